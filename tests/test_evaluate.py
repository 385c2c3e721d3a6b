"""evaluate + gate + report on suites built from constructed runs (no engine involved): each
planted defect must fail exactly the check that names it."""
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from speccheck.evaluate import evaluate_suite
from speccheck.gate import exit_code, gate_text, write_junit
from speccheck.policy import Policy
from speccheck.report import markdown_report
from speccheck.store import Store
from speccheck.types import Completion, RunRecord, Scored, SpecConfig, SpecCounters

V = 50


def dist(tokens, margin=3.0, near=None):
    """Top-5 rows whose argmax is each token; at positions in `near`, runner-up within 0.01."""
    n = len(tokens)
    ids = np.zeros((n, 5), np.int32)
    lp = np.zeros((n, 5), np.float32)
    for i, t in enumerate(tokens):
        ids[i] = [t, (t + 1) % V, (t + 2) % V, (t + 3) % V, (t + 4) % V]
        m = 0.01 if near and i in near else margin
        lp[i] = [-0.5, -0.5 - m, -6, -7, -8]
    return ids, lp


def comp(pid, tokens, near=None, spec=None, flip_at=None, base_token=None):
    ids, lp = dist(tokens, near=near)
    if flip_at is not None:  # the spec side chose the baseline's runner-up at a near-tie
        ids[flip_at, 1] = base_token
    return Completion(pid, [1, 2, 3], tokens, lp[:, 0], ids, lp, text=" ".join(map(str, tokens)),
                      ttft_s=0.01, decode_s=0.1, spec=spec)


BASE = {"a": [5, 6, 7, 8, 9, 10], "b": [11, 12, 13, 14, 15, 16], "c": [1, 2, 3, 4, 5, 6]}
NEAR = {"a": {3}}


def write(suite, name, comps, repeat=0, fresh=False):
    suite.write_run(RunRecord(SpecConfig.from_name(name), {"engine": "t", "model_hash": "m"}, "c", "h",
                              repeat, fresh, completions=comps))


def scored_for(tokens_by_prompt):
    """Teacher-forced baseline scores of each output: the baseline follows the given prefix, and
    at the near-tie position it prefers its own token by 0.01 nats."""
    out = {}
    for pid, toks in tokens_by_prompt.items():
        ids, lp = dist(toks, near=NEAR.get(pid))
        for i in NEAR.get(pid, ()):
            if toks[i] != BASE[pid][i]:
                ids[i, :2] = [BASE[pid][i], toks[i]]
        out[pid] = Scored(ids, lp, np.where(ids[:, 0] == toks, lp[:, 0], lp[:, 1]))
    return out


@pytest.fixture
def suite(tmp_path):
    s = Store(tmp_path).suite("t", {"corpus_hash": "h", "engine": "t", "corpus": "c"})
    counters = SpecCounters(4, 12, 8, [4, 3, 1])
    for r in (0, 1):
        write(s, "baseline", [comp(p, t, NEAR.get(p)) for p, t in BASE.items()], r, fresh=r == 1)
        write(s, "mtp-k3", [comp(p, t, NEAR.get(p), spec=counters) for p, t in BASE.items()], r)
    # near-tie flip at a[3] then a different continuation
    flipped = BASE["a"][:3] + [BASE["a"][3] + 1, 40, 41]
    for r in (0, 1):
        write(s, "dflash-k7", [comp("a", flipped, NEAR["a"], counters, flip_at=3, base_token=BASE["a"][3])]
              + [comp(p, BASE[p], spec=counters) for p in ("b", "c")], r)
    for name in ("baseline", "mtp-k3", "dflash-k7"):
        toks = {c.prompt_id: c.token_ids.tolist() for c in s.load_run(name, 0).completions}
        s.write_rescore(name, 0, list(toks), list(scored_for(toks).values()))
    return s


def test_clean_suite_passes_with_figures(suite):
    res = evaluate_suite(suite, Policy(min_token_agreement=0.5))
    assert res.passed and exit_code(res) == 0
    mtp = res.get("mtp-k3")
    assert mtp.prompts_exact == 3 and mtp.prefix_agreement == 1.0 and mtp.token_agreement == 1.0
    assert mtp.acceptance.tokens_per_iter == pytest.approx(3.0)
    d = res.get("dflash-k7")
    assert [x.position for x in d.divergences] == [3] and d.divergences[0].classification.cls == "near_tie"
    assert d.prefix_agreement == pytest.approx(15 / 18)


def test_nondeterminism_fails_only_determinism(suite):
    write(suite, "mtp-k3", [comp("a", [5, 6, 7, 8, 9, 11]), comp("b", BASE["b"]), comp("c", BASE["c"])],
          repeat=1, fresh=True)
    res = evaluate_suite(suite, Policy(min_token_agreement=0.5))
    mtp = res.get("mtp-k3")
    assert not mtp.check("deterministic").passed
    assert "prompt a position 5 (fresh process)" in mtp.check("deterministic").message
    assert mtp.check("agrees_with_baseline").passed and exit_code(res) == 1


def test_high_confidence_divergence_fails_with_evidence(suite):
    bad = [comp("a", [5, 6, 30, 31, 32, 33], spec=SpecCounters(2, 6, 1, [1, 0, 0]))]
    write(suite, "mtp-k5", bad)
    write(suite, "mtp-k5", bad, repeat=1)
    res = evaluate_suite(suite, Policy(min_token_agreement=0.5), ["baseline", "mtp-k5"])
    chk = res.get("mtp-k5").check("divergences_are_low_confidence")
    assert not chk.passed and "prompt a position 2" in chk.message and "high_confidence" in chk.message
    assert "FAIL  mtp-k5" in gate_text(res)


def test_zero_drafts_is_flagged(suite):
    silent = [comp(p, t, spec=SpecCounters()) for p, t in BASE.items()]
    write(suite, "mtp-k2", silent)
    write(suite, "mtp-k2", silent, repeat=1)
    res = evaluate_suite(suite, Policy(), ["baseline", "mtp-k2"])
    assert "did not actually speculate" in res.get("mtp-k2").check("acceptance_not_regressed").message


def test_golden_acceptance_regression(suite):
    res = evaluate_suite(suite, Policy(min_token_agreement=0.5), golden_acceptance={"mtp-k3": 3.5})
    assert not res.get("mtp-k3").check("acceptance_not_regressed").passed


def test_failed_run_is_engine_failure(suite):
    suite.write_run(RunRecord(SpecConfig("mtp", 4), {}, "c", "h", 0, False, status="failed",
                              error="EngineError: CUDA out of memory"))
    res = evaluate_suite(suite, Policy(), ["baseline", "mtp-k4"])
    assert res.get("mtp-k4").verdict == "error" and exit_code(res) == 3


def test_junit_and_markdown(suite, tmp_path):
    res = evaluate_suite(suite, Policy(min_token_agreement=0.5))
    write_junit(res, tmp_path / "j.xml")
    root = ET.parse(tmp_path / "j.xml").getroot()
    assert {c.get("name") for c in root.iter("testcase")} >= {"deterministic[mtp-k3]", "agrees_with_baseline[dflash-k7]"}
    md = markdown_report(res)
    assert "| mtp-k3 | 3 |" in md and "near_tie" in md and "**Verdict: PASS**" in md


def write_together(suite, name, copies_of_each: list[list[Completion]]):
    """A run of the corpus all at once: copies_of_each[j] is the j-th copy of the corpus."""
    suite.write_run(RunRecord(SpecConfig.from_name(name), {"engine": "t", "model_hash": "m"}, "c",
                              "h", -1, False, completions=[c for cp in copies_of_each for c in cp],
                              copies=len(copies_of_each)))


def test_all_at_once_checks_skip_without_such_a_run(suite):
    res = evaluate_suite(suite, Policy(min_token_agreement=0.5))
    for name in ("batch_invariant", "concurrent_identical"):
        c = res.get("mtp-k3").check(name)
        assert c.skipped and "--concurrent" in c.message


def test_all_at_once_identical_passes_and_is_reported(suite):
    corpus = [comp(p, t, NEAR.get(p)) for p, t in BASE.items()]
    write_together(suite, "mtp-k3", [corpus, corpus])
    res = evaluate_suite(suite, Policy(min_token_agreement=0.5))
    r = res.get("mtp-k3")
    assert r.together.exact == 3 and r.together.requests == 6 and not r.together.split
    assert r.check("batch_invariant").passed and r.check("concurrent_identical").passed
    assert "3/3 prompts exact inside a batch of 6" in r.check("batch_invariant").message
    assert "in a batch 3/3 exact" in markdown_report(res)
    assert suite.repeats("mtp-k3") == [0, 1]  # the run all at once is not a repeat


def test_split_concurrent_copies_fail_naming_the_prompt(suite):
    corpus = [comp(p, t, NEAR.get(p)) for p, t in BASE.items()]
    other_b = [comp("a", BASE["a"], NEAR["a"]), comp("b", BASE["b"][:3] + [30, 31, 32]),
               comp("c", BASE["c"])]
    write_together(suite, "baseline", [corpus, other_b, corpus])
    res = evaluate_suite(suite, Policy(min_token_agreement=0.5))
    c = res.get("baseline").check("concurrent_identical")
    assert not c.passed and "b: 2 distinct" in c.message and exit_code(res) == 1
    assert res.get("baseline").check("batch_invariant").passed  # copy 0 equals the prompt alone
    assert "concurrent_identical failed for config baseline" in gate_text(res)


def test_batch_changes_near_tie_passes_high_confidence_fails(suite):
    flipped = BASE["a"][:3] + [BASE["a"][3] + 1, 40, 41]  # the runner-up at a near-tie
    near = [comp("a", flipped, NEAR["a"], flip_at=3, base_token=BASE["a"][3])] + \
        [comp(p, BASE[p]) for p in ("b", "c")]
    write_together(suite, "mtp-k3", [near])
    res = evaluate_suite(suite, Policy(min_token_agreement=0.5))
    c = res.get("mtp-k3").check("batch_invariant")
    assert c.passed and "2/3 prompts exact" in c.message and "1 divergence(s), 0 high" in c.message
    strict = evaluate_suite(suite, Policy(min_token_agreement=0.5, require_batch_invariant=True))
    assert not strict.get("mtp-k3").check("batch_invariant").passed

    wild = [comp("a", BASE["a"][:2] + [44, 45, 46, 47])] + [comp(p, BASE[p]) for p in ("b", "c")]
    write_together(suite, "mtp-k3", [wild])
    c = evaluate_suite(suite, Policy(min_token_agreement=0.5)).get("mtp-k3").check("batch_invariant")
    assert not c.passed and "prompt a position 2" in c.message and "high_confidence" in c.message
