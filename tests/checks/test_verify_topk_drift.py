"""verify_topk_drift on constructed stores: a spec path whose top-k logprobs sit further from the
baseline's prefill rows than the baseline's own decode path fails, a slight excess within
chance passes, and one between alpha and look-closer is inconclusive (not a pass)."""
from __future__ import annotations

import numpy as np
import pytest

from speccheck.evaluate import evaluate_suite
from speccheck.gate import gate_text
from speccheck.policy import Policy
from speccheck.store import Store
from speccheck.types import Completion, RunRecord, Scored, SpecConfig, SpecCounters

N, K, PROMPTS = 60, 5, 4


def _comp(pid, tokens, lps, ids, spec=None):
    return Completion(pid, [1, 2, 3], np.array(tokens), lps[:, 0].copy(), ids, lps,
                      text=" ".join(map(str, tokens)), ttft_s=0.01, decode_s=0.1, spec=spec)


def _suite(tmp_path, spec_noise: float, seed: int = 0, rare: float = 0.0):
    """Per prompt N positions; the prefill rows are exact, the baseline's decode path is off by
    noise of scale 0.01 nats, the spec path by ``spec_noise`` (and by ten times that at a
    ``rare`` share of positions: a state wrong after rare steps)."""
    rng = np.random.default_rng(seed)
    s = Store(tmp_path).suite("t", {"corpus_hash": "h", "engine": "t", "corpus": "c"})
    base, spec, scored = [], [], {}
    for p in range(PROMPTS):
        pid = f"p{p}"
        ids = np.tile(np.arange(K), (N, 1)) + 10 * np.arange(N)[:, None]
        lps = np.sort(rng.uniform(-12, -0.5, (N, K)), axis=1)[:, ::-1].copy()
        lps[:, 0] = -0.01
        tokens = ids[:, 0].tolist()
        scored[pid] = Scored(ids, lps, lps[:, 0].copy())
        jitter = lambda sd: lps + rng.normal(0, sd, lps.shape) * np.array([0, 1, 1, 1, 1])  # noqa: E731
        base.append(_comp(pid, tokens, jitter(0.01), ids))
        hit = (rng.random(N) < rare)[:, None]
        spec.append(_comp(pid, tokens, np.where(hit, jitter(10 * spec_noise), jitter(spec_noise)), ids,
                          SpecCounters(N // 2, 3 * (N // 2), N // 2 - 1, [N // 2 - 1, 0, 0], iterations=N // 2)))
    for r in (0, 1):
        s.write_run(RunRecord(SpecConfig(), {"engine": "t", "model_hash": "m"}, "c", "h", r, r == 1,
                              completions=base))
        s.write_run(RunRecord(SpecConfig("mtp", 3), {"engine": "t", "model_hash": "m"}, "c", "h", r,
                              False, completions=spec))
    for name in ("baseline", "mtp-k3"):
        s.write_rescore(name, 0, list(scored), list(scored.values()))
    return s


@pytest.mark.parametrize("spec_noise, state", [(0.01, "pass"), (0.02, "fail")])
def test_drift_of_the_whole_top_k_fails(tmp_path, spec_noise, state):
    c = evaluate_suite(_suite(tmp_path, spec_noise), Policy()).get("mtp-k3").check("verify_topk_drift")
    assert c.state == state, c.message
    assert "power: a ratio >=" in c.message


def test_a_rare_excursion_fails_the_tail_test_not_the_typical_one(tmp_path):
    e = evaluate_suite(_suite(tmp_path, 0.01, rare=0.1), Policy()).get("mtp-k3")
    c, m = e.check("verify_topk_drift"), e.measured["verify_topk_drift"]
    assert m.typical.decision == "pass" and m.tail.decision == "fail", c.message
    assert c.state == "fail" and "(tail)" in c.message


def test_an_effect_between_alpha_and_look_closer_is_inconclusive(tmp_path):
    suite = _suite(tmp_path, 0.02)
    res = evaluate_suite(suite, Policy(topk_drift_alpha=1e-300, topk_drift_look_closer=1.0))
    r = res.get("mtp-k3")
    c = r.check("verify_topk_drift")
    assert c.state == "inconclusive" and not c.passed and c.message.startswith("inconclusive")
    assert r.verdict != "pass" and not res.passed
    assert "verify_topk_drift inconclusive (not a pass) for config mtp-k3" in gate_text(res)


def test_an_inconclusive_is_rendered_as_such_everywhere(tmp_path):
    """diff, Markdown, HTML and JUnit show the state, none of them as a pass."""
    import xml.etree.ElementTree as ET

    from speccheck.gate import write_junit
    from speccheck.golden import check_states
    from speccheck.report import html_report
    from speccheck.report.text import diff_text, markdown_report

    res = evaluate_suite(_suite(tmp_path, 0.02), Policy(topk_drift_alpha=1e-300, topk_drift_look_closer=1.0))
    assert "INCONCLUSIVE verify_topk_drift" in diff_text(res)
    assert "**INCONCLUSIVE**" in markdown_report(res)
    assert 'chip inconclusive' in html_report(res)
    write_junit(res, tmp_path / "j.xml")
    case = next(c for c in ET.parse(tmp_path / "j.xml").iter("testcase")
                if c.get("name") == "verify_topk_drift[mtp-k3]")
    assert case.find("failure").get("message").startswith("inconclusive")
    assert check_states(res)["mtp-k3"]["verify_topk_drift"] == "inconclusive"
