"""The acceptance replay (ReferenceEngine.replay_acceptance, speccheck/reference/replay.py): an
independent drafter pass over a run's own tokens predicts the spec counters the run reported,
exactly or where not, only at a step the drafter decided by a near-tie; drafter-side faults
(acceptance lower than the drafter gives) and inflated counters show as a difference either
way; the runner stores it (Suite.write_replay / load_replay) and the plan asks for it."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from speccheck.cli import main
from speccheck.corpus import load_corpus
from speccheck.plan import RunPlan
from speccheck.reference.decode import FAULTS
from speccheck.reference.engine import ReferenceEngine
from speccheck.store import Store, StoreError
from speccheck.types import Completion, Replay, RunRecord, SpecConfig, SpecCounters

#: a drafter margin (nats) this small is a near-tie: the drafter's bf16 logits (the LM head's
#: rough_logits) step by 1/16 to 1/8 at their magnitudes, so one rounding of the hidden state
#: it reads (a verify forward's vs the replay's prefill forward) can flip it
TINY = 0.25

CONFIGS = ("mtp-k1", "mtp-k3", "mtp-k7", "dflash-k7", "dflash2-k7")


@pytest.fixture(scope="module")
def engine():
    return ReferenceEngine(engine_args={"device": "cpu"})  # bf16, the default


@pytest.fixture(scope="module")
def corpora(engine):
    out = {}

    def get(name):
        if name not in out:
            prompts = list(load_corpus(name).prompts)
            out[name] = (prompts, [engine.tokenize(p) for p in prompts])
        return out[name]
    return get


def streamed(engine, prompts, ids, config):
    """Each prompt's completion and the tokens each of its steps emitted (the streaming
    callback is called once per step; its first call is the prefill's token)."""
    out = []
    for p, i in zip(prompts, ids):
        steps = []
        c = engine.generate_streaming(p, i, config, 5, lambda t, *_, seen=steps: seen.append(len(t)))
        out.append((c, steps[1:]))
    return out


def same_counters(a: SpecCounters, b: SpecCounters) -> bool:
    return ((a.drafts, a.draft_tokens, a.accepted_tokens, list(a.accepted_per_pos), a.iterations)
            == (b.drafts, b.draft_tokens, b.accepted_tokens, list(b.accepted_per_pos), b.iterations))


def first_difference(replay: Replay, steps: list[int], n_tokens: int) -> int | None:
    """The first step whose emitted count the replay does not predict (the last step's count
    is cut at the output's end), or None."""
    emitted = 1
    for i, got in enumerate(steps):
        if i >= replay.n_steps:
            return i
        a = int(replay.accepted[i])
        want = min(1 if a < 0 else a + 1, n_tokens - emitted)
        if got != want:
            return i
        emitted += got
    return None if replay.n_steps == len(steps) else len(steps)


def tpi(counters) -> float:
    steps = sum(c.iterations for c in counters)
    return (sum(c.accepted_tokens for c in counters) + steps) / steps


@pytest.mark.parametrize("corpus", ["smoke", "selftest", pytest.param("ci", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", CONFIGS)
def test_replay_predicts_the_reported_counters(engine, corpora, corpus, name):
    """Prompt by prompt the replay's counters are the engine's; where a prompt's are not, its
    first step the replay does not predict was decided by a near-tie of the drafter (the
    engine's steps: the tokens each emitted, so a difference on the last step past the
    output's end shows in the counters only)."""
    config = SpecConfig.from_name(name)
    prompts, ids = corpora(corpus)
    runs = streamed(engine, prompts, ids, config)
    replays = engine.replay_acceptance(config, ids, [c.token_ids for c, _ in runs],
                                       [p.max_tokens for p in prompts])
    exact, near_ties = 0, []
    for p, (c, steps), r in zip(prompts, runs, replays):
        assert r.k == config.k and len(r.margins) == len(r.min_margins) == r.n_steps
        if same_counters(r.counters, c.spec):
            exact += 1
            assert first_difference(r, steps, c.n_tokens) is None, p.id
            continue
        i = first_difference(r, steps, c.n_tokens)
        if i is None:  # every step emitted as replayed: the last one accepted otherwise past the cut
            i = r.n_steps - 1
        assert i < r.n_steps, (p.id, r.accepted.tolist(), steps)
        near_ties.append((p.id, i, float(r.margins[i]), float(r.min_margins[i])))
        assert r.min_margins[i] <= TINY, (
            f"{p.id} step {i}: replay accepted {r.accepted[i]}, the engine emitted {steps[i]} "
            f"tokens, and the drafter's margin there is {r.min_margins[i]:.3f} nats, no near-tie")
    print(f"\n{corpus} {name}: {exact}/{len(prompts)} prompts exact; tok/iter replayed "
          f"{tpi([r.counters for r in replays]):.3f} reported {tpi([c.spec for c, _ in runs]):.3f}; "
          f"near-tie steps (prompt, step, margin, smallest margin): {near_ties}")
    assert exact >= len(prompts) - 1


def test_replay_follows_steps_without_a_draft(engine, corpora):
    """no_draft_every=2: every second step decodes one token without a draft; the replay
    counts it as an iteration and not a draft, exactly as the engine does."""
    variant = engine.with_args(no_draft_every="2")
    config = SpecConfig("mtp", 3)
    for corpus in ("smoke", "selftest"):
        prompts, ids = corpora(corpus)
        comps = variant.generate(prompts, ids, config, 5)
        replays = variant.replay_acceptance(config, ids, [c.token_ids for c in comps],
                                            [p.max_tokens for p in prompts])
        for c, r in zip(comps, replays):
            assert same_counters(r.counters, c.spec), (c.prompt_id, r.accepted.tolist())
            if r.n_steps >= 2:
                assert r.accepted[1] == -1 and math.isnan(r.margins[1])
                assert c.spec.iterations > c.spec.drafts


def test_replay_edges(engine, corpora):
    """No step after a one-token output; an output longer than its max_tokens is cut there;
    the planted fault of the engine it is asked on never enters the replay; a baseline
    cannot be replayed."""
    prompts, ids = corpora("selftest")
    config = SpecConfig("mtp", 3)
    comps = engine.generate(prompts, ids, config, 5)
    outs = [c.token_ids.tolist() for c in comps]
    one = engine.replay_acceptance(config, ids[:1], [outs[0][:1]], [prompts[0].max_tokens])[0]
    assert one.n_steps == 0 and one.counters == SpecCounters(accepted_per_pos=[0] * 3, iterations=0)
    cut = engine.replay_acceptance(config, ids[:1], [outs[0]], [8])[0]
    assert cut.counters == engine.replay_acceptance(config, ids[:1], [outs[0][:8]], [8])[0].counters
    clean = engine.replay_acceptance(config, ids, outs, [p.max_tokens for p in prompts])
    for fault in ("drafter-noise", "mtp-stale-hidden", "nondeterministic"):
        faulty = engine.with_args(fault=fault).replay_acceptance(config, ids, outs,
                                                                 [p.max_tokens for p in prompts])
        for a, b in zip(clean, faulty):
            np.testing.assert_array_equal(a.accepted, b.accepted)
            np.testing.assert_array_equal(a.margins, b.margins)
    with pytest.raises(ValueError, match="baseline"):
        engine.replay_acceptance(SpecConfig(), ids, outs, [p.max_tokens for p in prompts])


def test_drafter_noise_is_documented():
    assert "drafter-noise" in FAULTS and "drafter" in FAULTS["drafter-noise"]


#: drafter-side faults: acceptance below what the drafter gives, tokens exact. Each where it
#: shows on most prompts (the MTP faults on ci: on smoke and selftest the outputs are short
#: after long prompts, and hidden states of generated positions only are stale; the wrong
#: DFlash layer on selftest: on ci's prose DFlash2 drafts nearly as well from it)
DRAFTER_FAULTS = [
    pytest.param("mtp-stale-hidden", "mtp-k1", "ci", marks=pytest.mark.slow),
    pytest.param("mtp-stale-hidden", "mtp-k3", "ci", marks=pytest.mark.slow),
    pytest.param("mtp-stale-hidden", "mtp-k7", "ci", marks=pytest.mark.slow),
    ("dflash-wrong-layer", "dflash-k7", "selftest"),
    ("dflash-wrong-layer", "dflash2-k7", "selftest"),
    ("drafter-noise", "mtp-k3", "selftest"),
    pytest.param("drafter-noise", "mtp-k3", "ci", marks=pytest.mark.slow),
    pytest.param("drafter-noise", "mtp-k7", "ci", marks=pytest.mark.slow),
    pytest.param("drafter-noise", "dflash-k7", "ci", marks=pytest.mark.slow),
    pytest.param("drafter-noise", "dflash2-k7", "ci", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("fault,name,corpus", DRAFTER_FAULTS)
def test_drafter_side_fault_replays_more_acceptance_than_reported(engine, corpora, fault, name,
                                                                   corpus):
    config = SpecConfig.from_name(name)
    prompts, ids = corpora(corpus)
    clean = engine.generate(prompts, ids, config, 5)
    bad = engine.with_args(fault=fault).generate(prompts, ids, config, 5)
    replays = engine.replay_acceptance(config, ids, [c.token_ids for c in bad],
                                       [p.max_tokens for p in prompts])
    exact_tokens = sum(np.array_equal(a.token_ids, b.token_ids) for a, b in zip(clean, bad))
    more = sum(r.counters.accepted_tokens > c.spec.accepted_tokens for r, c in zip(replays, bad))
    less = sum(r.counters.accepted_tokens < c.spec.accepted_tokens for r, c in zip(replays, bad))
    replayed, reported = tpi([r.counters for r in replays]), tpi([c.spec for c in bad])
    print(f"\n{fault} {name} on {corpus}: tok/iter replayed {replayed:.3f} reported {reported:.3f} "
          f"(clean run {tpi([c.spec for c in clean]):.3f}); replay above reported on {more} of "
          f"{len(prompts)} prompts, below on {less}; tokens as the clean run's on {exact_tokens}")
    # acceptance only: the tokens are the clean run's but where the verify forwards' other shapes
    # move a near-tie of the target (a bf16 clean run at another K differs as often)
    assert exact_tokens >= len(prompts) * 3 / 4
    assert more > len(prompts) / 2 and more >= 2 * less
    assert replayed > reported * 1.05


@pytest.mark.parametrize("corpus", ["smoke", "selftest"])
@pytest.mark.parametrize("name", ["mtp-k3", "dflash-k7", "dflash2-k7"])
def test_inflated_counters_replay_less_acceptance_than_reported(engine, corpora, corpus, name):
    """accepted-counts-bonus counts the bonus token as accepted: every prompt that drafted
    reports more than its replay, which predicts the clean engine's counters."""
    config = SpecConfig.from_name(name)
    prompts, ids = corpora(corpus)
    bad = engine.with_args(fault="accepted-counts-bonus").generate(prompts, ids, config, 5)
    replays = engine.replay_acceptance(config, ids, [c.token_ids for c in bad],
                                       [p.max_tokens for p in prompts])
    for c, r in zip(bad, replays):
        if c.spec.drafts:
            assert r.counters.accepted_tokens < c.spec.accepted_tokens, c.prompt_id
            assert r.counters.accepted_tokens <= c.spec.accepted_tokens - c.spec.drafts + 1


@pytest.mark.slow
def test_drafter_noise_lowers_acceptance_about_a_fifth_with_exact_tokens(engine, corpora):
    prompts, ids = corpora("ci")
    config = SpecConfig("mtp", 3)
    clean = engine.generate(prompts, ids, config, 5)
    bad = engine.with_args(fault="drafter-noise").generate(prompts, ids, config, 5)
    assert all(np.array_equal(a.token_ids, b.token_ids) for a, b in zip(clean, bad))
    drop = 1 - tpi([c.spec for c in bad]) / tpi([c.spec for c in clean])
    assert 0.1 < drop < 0.35, drop


# --- the store and the plan --------------------------------------------------------------------

def _replays():
    return [Replay(3, [3, 0, -1, 2], [math.inf, 0.5, math.nan, 1.25], [0.125, 0.5, math.nan, 1.0]),
            Replay(3, [], [], [])]


def test_store_round_trip_and_damage(tmp_path):
    suite = Store(tmp_path / "S").suite("s", {"engine": "reference", "corpus": "smoke",
                                             "corpus_hash": "h"})
    assert suite.load_replay("mtp-k3", 0) is None and not suite.has_replay("mtp-k3", 0)
    suite.write_replay("mtp-k3", 0, ["a", "b"], _replays())
    path = suite.replay_path("mtp-k3", 0)
    assert path.name == "mtp-k3-r0.npz" and path.parent.name == "replay"
    assert json.loads(path.with_name(path.name + ".sha256").read_text())["size"] == path.stat().st_size
    got = suite.load_replay("mtp-k3", 0)
    assert list(got) == ["a", "b"]
    a = got["a"]
    assert a.k == 3 and a.accepted.tolist() == [3, 0, -1, 2]
    assert a.margins[0] == math.inf and math.isnan(a.margins[2]) and a.min_margins[0] == 0.125
    assert a.counters == SpecCounters(3, 9, 5, [2, 2, 1], 4)
    assert got["b"].n_steps == 0
    data = bytearray(path.read_bytes())  # a damaged file: its sum no longer matches
    data[-30] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="changed since it was written"):
        suite.load_replay("mtp-k3", 0)
    assert not suite.has_replay("mtp-k3", 0)


def test_plan_asks_for_a_replay_and_missing_names_it(tmp_path):
    """Spec configs of an engine that replays plan one; a plan without the key (recorded
    before) asks for none; a planned replay not stored is missing, with the command that
    resumes it; a new first repeat makes the stored replay stale."""
    planned = RunPlan(configs=[SpecConfig(), SpecConfig("mtp", 3)]).planned()
    assert planned["mtp-k3"]["replay"] is True and "replay" not in planned["baseline"]
    assert "replay" not in RunPlan(engine="openai", configs=[SpecConfig("mtp", 3)]).planned()["mtp-k3"]

    suite = Store(tmp_path / "S").suite("s", {"engine": "reference", "corpus": "smoke",
                                             "corpus_hash": "h"})
    want = {"repeats": 1, "fresh_process_repeat": False, "concurrent": 0, "rescore": False,
            "attribute": False}
    suite.extend_plan({"mtp-k3": want}, ["--engine", "reference", "--corpus", "smoke"])
    comp = Completion("a", [1, 2], [3, 4], [-0.1, -0.2], [[3, 5], [4, 5]], [[-0.1, -2.0], [-0.2, -2.0]],
                      spec=SpecCounters(1, 3, 0, [0, 0, 0], 1))
    suite.write_run(RunRecord(SpecConfig("mtp", 3), {}, "smoke", "h", 0, False, completions=[comp]))
    assert suite.missing("mtp-k3") == []  # an old plan: no replay asked for
    suite.extend_plan({"mtp-k3": {**want, "replay": True}}, ["--engine", "reference", "--corpus", "smoke"])
    gaps = suite.missing("mtp-k3")
    assert len(gaps) == 1 and "acceptance replay of mtp-k3 r0" in gaps[0]
    assert "speccheck run --engine reference --corpus smoke --config mtp-k3" in gaps[0]
    suite.write_replay("mtp-k3", 0, ["a"], [Replay(3, [0], [0.5], [0.5])])
    assert suite.missing("mtp-k3") == []
    suite.write_run(RunRecord(SpecConfig("mtp", 3), {}, "smoke", "h", 0, False, completions=[comp]))
    assert not suite.has_replay("mtp-k3", 0)  # stale with a new first repeat: gone
    plan = json.loads((suite.root / "plan.json").read_text())
    plan["configs"]["mtp-k3"]["replay"] = "yes"
    (suite.root / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(StoreError, match="replay"):
        suite.load_plan()


@pytest.mark.slow
def test_run_stores_the_replay_resumes_it_and_replays_without_the_fault(tmp_path, engine, corpora):
    """`speccheck run` stores each spec config's replay (run 0's outputs); the gate passes; a
    replay deleted is named missing with the command that resumes it, which redoes just that;
    under a planted fault the replay is the clean drafter's (more acceptance than reported)."""
    store = tmp_path / "S"
    runner = CliRunner()
    args = ["run", "--store", str(store), "--corpus", "smoke", "--config", "mtp-k3",
            "--repeats", "1", "--concurrent", "off", "--no-attribution", "--axes", "none"]
    gate = ["gate", "--store", str(store), "--set", "require_deterministic=false"]  # one repeat
    r = runner.invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "mtp-k3 acceptance replayed" in r.output
    suite = Store(store).latest()
    assert suite.load_plan()["configs"]["mtp-k3"]["replay"] is True
    got = suite.load_replay("mtp-k3", 0)
    run0 = suite.load_run("mtp-k3", 0)
    assert set(got) == {c.prompt_id for c in run0.completions}
    # near-ties aside (see test_replay_predicts_the_reported_counters) the counters are the run's
    assert sum(same_counters(got[c.prompt_id].counters, c.spec) for c in run0.completions) \
        >= len(run0.completions) - 1
    g = runner.invoke(main, gate)
    assert g.exit_code == 0, g.output

    path = suite.replay_path("mtp-k3", 0)
    path.unlink()
    g = runner.invoke(main, gate)
    assert g.exit_code == 1 and "acceptance replay of mtp-k3 r0" in g.output, g.output
    assert "--config mtp-k3" in g.output
    again = runner.invoke(main, args)
    assert again.exit_code == 0 and "0 to run" in again.output, again.output
    assert path.exists()
    third = runner.invoke(main, args)
    assert "acceptance replayed" not in third.output  # stored: skipped

    faulty = runner.invoke(main, [*args, "--engine-arg", "fault=drafter-noise"])
    assert faulty.exit_code == 0, faulty.output
    fsuite = Store(store).latest()
    assert fsuite.id != suite.id
    replays, comps = fsuite.load_replay("mtp-k3", 0), fsuite.load_run("mtp-k3", 0).completions
    assert sum(replays[c.prompt_id].counters.accepted_tokens for c in comps) \
        > sum(c.spec.accepted_tokens for c in comps)
