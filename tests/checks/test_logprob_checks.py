"""logprobs_valid and greedy_is_argmax on suites of constructed runs: a baseline with NaN or
missing logprobs fails by name (never a pass, never a traceback), and a token that is not the
engine's own top-1 -- a sampler at a small temperature -- fails at temperature 0."""
from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from speccheck.cli import main
from speccheck.evaluate import evaluate_suite
from speccheck.gate import gate_text
from speccheck.policy import Policy
from speccheck.store import Store
from speccheck.types import Completion
from tests.test_evaluate import (
    BASE,
    MTP_COUNTERS,
    NEAR,
    comp,
    complete_as_run_would,
    scored_for,
    write,
)

LOOSE = Policy(min_token_agreement=0.5)


def _suite(tmp_path, base_comps, spec_comps=None):
    s = Store(tmp_path).suite("t", {"corpus_hash": "h", "engine": "t", "corpus": "c"})
    for r in (0, 1):
        write(s, "baseline", base_comps, r, fresh=r == 1)
        write(s, "mtp-k3", spec_comps or [comp(p, t, NEAR.get(p), spec=MTP_COUNTERS)
                                          for p, t in BASE.items()], r)
    for name in ("baseline", "mtp-k3"):
        toks = {c.prompt_id: c.token_ids.tolist() for c in s.load_run(name, 0).completions}
        s.write_rescore(name, 0, list(toks), list(scored_for(toks).values()))
    complete_as_run_would(s)
    return s


def _with(c: Completion, **arrays) -> Completion:
    return Completion(c.prompt_id, c.prompt_ids, c.token_ids, arrays.get("logprobs", c.logprobs),
                      arrays.get("topk_ids", c.topk_ids), arrays.get("topk_logprobs", c.topk_logprobs),
                      text=c.text, ttft_s=c.ttft_s, decode_s=c.decode_s, spec=c.spec)


def test_clean_runs_pass_both(tmp_path):
    res = evaluate_suite(_suite(tmp_path, [comp(p, t, NEAR.get(p)) for p, t in BASE.items()]), LOOSE)
    for cfg in ("baseline", "mtp-k3"):
        assert res.get(cfg).check("logprobs_valid").passed
        assert res.get(cfg).check("greedy_is_argmax").passed


@pytest.mark.parametrize("damage", ["nan", "short", "topk_nan"])
def test_a_baseline_with_impossible_logprobs_fails_by_name_without_a_traceback(tmp_path, damage):
    """A server that reports NaN logprobs, or fewer logprobs than tokens, for the baseline: the
    baseline fails logprobs_valid naming run, prompt and position (a missing row is stored as
    NaN, not by shifting the next prompt's rows), and `speccheck gate` exits 1 with that
    message."""
    base = [comp(p, t, NEAR.get(p)) for p, t in BASE.items()]
    a = base[0]
    if damage == "nan":
        lp = a.logprobs.copy()
        lp[2] = np.nan
        base[0] = _with(a, logprobs=lp)
    elif damage == "short":
        base[0] = _with(a, logprobs=a.logprobs[:4])
    else:
        t = a.topk_logprobs.copy()
        t[1, 1] = np.nan
        base[0] = _with(a, topk_logprobs=t)
    s = _suite(tmp_path, base)
    res = evaluate_suite(s, LOOSE)
    chk = res.get("baseline").check("logprobs_valid")
    assert not chk.passed and "r0 prompt a:" in chk.message and "NaN" in chk.message
    assert "prompt b" not in chk.message and "prompt c" not in chk.message  # nothing shifted
    assert "logprobs_valid failed for config baseline" in gate_text(res)
    out = CliRunner().invoke(main, ["gate", "--store", str(tmp_path), "--suite", "t"])
    assert out.exit_code == 1, out.output
    assert "logprobs_valid failed for config baseline" in out.output and "Traceback" not in out.output


def test_a_token_below_its_own_top1_fails_greedy_is_argmax(tmp_path):
    """A spec run that takes the runner-up at a near-tie the engine itself reports (what a
    sampler at temperature 0.01 does): agreement excuses it as a near-tie, this check does not."""
    spec = [comp(p, t, NEAR.get(p), spec=MTP_COUNTERS) for p, t in BASE.items()]
    a = spec[0]
    ids, lps = a.topk_ids.copy(), a.topk_logprobs.copy()
    tokens = a.token_ids.copy()
    tokens[3] = ids[3, 1]  # the reported rank 2 at the near-tie (margin 0.01)
    spec[0] = Completion(a.prompt_id, a.prompt_ids, tokens, np.where(np.arange(len(tokens)) == 3,
                         lps[:, 1], a.logprobs), ids, lps, text=a.text, ttft_s=a.ttft_s,
                         decode_s=a.decode_s, spec=a.spec)
    res = evaluate_suite(_suite(tmp_path, [comp(p, t, NEAR.get(p)) for p, t in BASE.items()], spec), LOOSE)
    chk = res.get("mtp-k3").check("greedy_is_argmax")
    assert not chk.passed and "prompt a position 3" in chk.message
    assert "1 of 1 near-tie(s)" in chk.message or "near-tie" in chk.message
    assert res.get("baseline").check("greedy_is_argmax").passed
