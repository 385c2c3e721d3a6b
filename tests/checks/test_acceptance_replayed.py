"""acceptance_replayed on constructed runs and replays: counters as the replay predicts pass;
a fall (a drafter-side bug) and a rise (counted past a real verify) beyond max_acceptance_drop
fail, with no golden; a store whose plan asked for a replay that is missing fails; an engine
that cannot replay is skipped, saying so."""
from __future__ import annotations

import numpy as np

from speccheck.evaluate import evaluate_suite
from speccheck.policy import Policy
from speccheck.store import Store
from speccheck.types import Replay, RunRecord, SpecConfig, SpecCounters
from tests.test_evaluate import BASE, comp

LOOSE = Policy(min_token_agreement=0.5, require_deterministic=False)
#: each prompt: 2 verify steps of K=3, accepting 2 then 1
REPLAY = Replay(3, np.array([2, 1]), np.array([np.inf, 0.5]), np.array([0.9, 0.5]))


def _suite(tmp_path, counters: SpecCounters, replay: bool = True, planned: bool = True):
    s = Store(tmp_path).suite("t", {"corpus_hash": "h", "engine": "t", "corpus": "c"})
    want = {"repeats": 1, "fresh_process_repeat": False, "concurrent": 0, "rescore": False, "attribute": False}
    s.extend_plan({"baseline": want, "mtp-k3": {**want, **({"replay": True} if planned else {})}}, ["--corpus", "c"])
    s.write_run(RunRecord(SpecConfig(), {"engine": "t"}, "c", "h", 0, False,
                          completions=[comp(p, t) for p, t in BASE.items()]))
    s.write_run(RunRecord(SpecConfig("mtp", 3), {"engine": "t"}, "c", "h", 0, False,
                          completions=[comp(p, t, spec=counters) for p, t in BASE.items()]))
    if replay:
        s.write_replay("mtp-k3", 0, list(BASE), [REPLAY] * len(BASE))
    return evaluate_suite(s, LOOSE, ["baseline", "mtp-k3"]).get("mtp-k3").check("acceptance_replayed")


def test_counters_as_replayed_pass(tmp_path):
    c = _suite(tmp_path, SpecCounters(2, 6, 3, [2, 1, 0], iterations=2))
    assert c.passed and "3/3 prompts exact" in c.message


def test_a_fall_fails_without_a_golden(tmp_path):
    c = _suite(tmp_path, SpecCounters(2, 6, 1, [1, 0, 0], iterations=2))
    assert not c.passed and "below what the drafter makes" in c.message


def test_a_rise_fails(tmp_path):
    c = _suite(tmp_path, SpecCounters(2, 6, 5, [2, 1, 0], iterations=2))
    assert not c.passed and "above what the drafter makes" in c.message


def test_a_planned_replay_that_is_missing_fails(tmp_path):
    c = _suite(tmp_path, SpecCounters(2, 6, 3, [2, 1, 0], iterations=2), replay=False)
    assert not c.passed and c.message.startswith("evidence missing")


def test_an_engine_that_cannot_replay_is_skipped_saying_so(tmp_path):
    c = _suite(tmp_path, SpecCounters(2, 6, 3, [2, 1, 0], iterations=2), replay=False, planned=False)
    assert c.skipped and "cannot replay" in c.message
