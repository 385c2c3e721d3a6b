"""evaluate + gate + report on suites built from constructed runs (no engine involved): each
planted defect must fail exactly the check that names it."""
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from speccheck.checks import names as check_names
from speccheck.evaluate import evaluate_suite, per_prompt_acceptance
from speccheck.gate import exit_code, gate_text, write_junit
from speccheck.policy import Policy
from speccheck.report import diff_text, markdown_report
from speccheck.store import Store
from speccheck.types import Completion, RunRecord, Scored, SpecConfig, SpecCounters
from speccheck.verify import output_digest

V = 50


def dist(tokens, margin=3.0, near=None):
    """Top-5 rows whose argmax is each token; at positions in `near`, runner-up within 0.01."""
    n = len(tokens)
    ids = np.zeros((n, 5), np.int32)
    lp = np.zeros((n, 5), np.float32)
    for i, t in enumerate(tokens):
        ids[i] = [t, (t + 1) % V, (t + 2) % V, (t + 3) % V, (t + 4) % V]
        m = 0.01 if near and i in near else margin
        top = -0.7 if m < 0.5 else -0.5  # one distribution's: a near-tie's two halves add up to < 1
        lp[i] = [top, top - m, -6, -7, -8]
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


#: per prompt of 6 tokens: 2 verify steps, each with a 3-token draft, 3 accepted (2 + 3 = 5)
MTP_COUNTERS = SpecCounters(2, 6, 3, [2, 1, 0], iterations=2)
#: one 7-token draft, 4 accepted (1 + 4 = 5); steps not counted, as a server's /metrics
DFLASH_COUNTERS = SpecCounters(1, 7, 4, [1, 1, 1, 1, 0, 0, 0])


@pytest.fixture
def suite(tmp_path):
    s = Store(tmp_path).suite("t", {"corpus_hash": "h", "engine": "t", "corpus": "c"})
    # each prompt: 6 tokens = the first (prefill) + 5 from verify steps
    for r in (0, 1):
        write(s, "baseline", [comp(p, t, NEAR.get(p)) for p, t in BASE.items()], r, fresh=r == 1)
        write(s, "mtp-k3", [comp(p, t, NEAR.get(p), spec=MTP_COUNTERS) for p, t in BASE.items()], r)
    # near-tie flip at a[3] then a different continuation
    flipped = BASE["a"][:3] + [BASE["a"][3] + 1, 40, 41]
    for r in (0, 1):
        write(s, "dflash-k7", [comp("a", flipped, NEAR["a"], DFLASH_COUNTERS, flip_at=3,
                                    base_token=BASE["a"][3])]
              + [comp(p, BASE[p], spec=DFLASH_COUNTERS) for p in ("b", "c")], r)
    for name in ("baseline", "mtp-k3", "dflash-k7"):
        toks = {c.prompt_id: c.token_ids.tolist() for c in s.load_run(name, 0).completions}
        s.write_rescore(name, 0, list(toks), list(scored_for(toks).values()))
    return s


def test_clean_suite_passes_with_figures(suite):
    res = evaluate_suite(suite, Policy(min_token_agreement=0.5))
    assert res.passed and exit_code(res) == 0
    mtp = res.get("mtp-k3")
    assert mtp.prompts_exact == 3 and mtp.prefix_agreement == 1.0 and mtp.token_agreement == 1.0
    assert mtp.acceptance.tokens_per_iter == pytest.approx(2.5)
    assert all(c.passed and not c.skipped for c in mtp.checks
               if c.name in ("same_stopping", "counters_consistent"))
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
    bad = [comp("a", [5, 6, 30, 31, 32, 33], spec=SpecCounters(2, 10, 3, [1, 1, 1, 0, 0]))]
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


def _golden_per_prompt(suite, name, accepted=None, other_output=()):
    """The golden entry of ``name`` as `golden record` writes it, from today's run 0, with
    each prompt's accepted count replaced from ``accepted`` and the prompts in
    ``other_output`` given another output (a trajectory the golden's machine took)."""
    per = {p: list(v) for p, v in per_prompt_acceptance(suite.load_run(name, 0).completions).items()}
    for p, n in (accepted or {}).items():
        per[p][1] = n
    for p in other_output:
        per[p][2] = output_digest([9, 9, 9])
    tpi = 1 + sum(v[1] for v in per.values()) / sum(v[0] for v in per.values())
    return {name: {"tokens_per_iter": tpi, "per_pos": [], "per_prompt": per}}


def test_golden_acceptance_compared_on_the_prompts_that_kept_their_output(suite):
    """Another machine flipped a near-tie in prompt a, whose new continuation the drafter
    guesses far worse than the golden's did: the suite's tokens/iteration is 17 % under the
    golden's, yet on b and c (same output as the golden's run) acceptance is unchanged."""
    gold = _golden_per_prompt(suite, "mtp-k3", accepted={"a": 6}, other_output=["a"])
    check = evaluate_suite(suite, Policy(min_token_agreement=0.5),
                           golden_acceptance=gold).get("mtp-k3").check("acceptance_not_regressed")
    assert 2.5 < gold["mtp-k3"]["tokens_per_iter"] * 0.95  # the overall figure alone would fail
    assert check.passed and "on the 2 of 3 prompts whose output is the golden run's" in check.message


def test_golden_acceptance_drop_on_unchanged_outputs_fails(suite):
    """Same outputs (lossless), fewer tokens accepted: a drafter regression."""
    gold = _golden_per_prompt(suite, "mtp-k3", accepted={"b": 4, "c": 4})
    check = evaluate_suite(suite, Policy(min_token_agreement=0.5),
                           golden_acceptance=gold).get("mtp-k3").check("acceptance_not_regressed")
    assert not check.passed and "on the 3 of 3 prompts" in check.message and "2.83" in check.message


def test_golden_acceptance_without_shared_outputs_uses_the_total(suite):
    gold = _golden_per_prompt(suite, "mtp-k3", accepted={"a": 4, "b": 4, "c": 4},
                              other_output=["a", "b", "c"])
    check = evaluate_suite(suite, Policy(min_token_agreement=0.5),
                           golden_acceptance=gold).get("mtp-k3").check("acceptance_not_regressed")
    assert not check.passed and "below golden 3.00" in check.message


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


# --- missing evidence ----------------------------------------------------------------------------

def test_missing_spec_rescoring_fails_agreement_naming_the_redo(suite):
    suite.rescore_path("mtp-k3", 0).unlink()
    res = evaluate_suite(suite, Policy(min_token_agreement=0.5))
    mtp = res.get("mtp-k3")
    agree = mtp.check("agrees_with_baseline")
    assert mtp.token_agreement is None and not agree.passed
    assert "no teacher-forced rescoring of mtp-k3 r0" in agree.message and "speccheck run" in agree.message
    assert not mtp.check("divergences_are_low_confidence").passed  # past the first: unknown
    assert exit_code(res) == 1 and res.get("dflash-k7").verdict == "pass"


@pytest.mark.parametrize("damage", ["prompt missing", "wrong length"])
def test_incomplete_spec_rescoring_fails_agreement(suite, damage):
    toks = {c.prompt_id: c.token_ids.tolist() for c in suite.load_run("mtp-k3", 0).completions}
    scored = scored_for(toks)
    if damage == "prompt missing":
        del scored["b"]
    else:
        s = scored["b"]
        scored["b"] = Scored(s.topk_ids[:-2], s.topk_logprobs[:-2], s.token_logprobs[:-2])
    suite.write_rescore("mtp-k3", 0, list(scored), list(scored.values()))
    agree = evaluate_suite(suite, Policy(min_token_agreement=0.5)).get("mtp-k3").check("agrees_with_baseline")
    assert not agree.passed and "incomplete" in agree.message and "Delete that file" in agree.message
    assert ("b not scored" if damage == "prompt missing" else "b (4 score rows for 6 tokens)") in agree.message


def test_unmeasured_path_noise_excuses_nothing(suite):
    """Without the baseline's rescoring, tau comes from the floors: the near-tie of dflash-k7
    is not excused, and the report says the noise was not measured (not 0.0000)."""
    suite.rescore_path("baseline", 0).unlink()
    res = evaluate_suite(suite, Policy(min_token_agreement=0.5))
    assert res.noise_missing and "baseline r0" in res.noise_missing
    d = res.get("dflash-k7")
    chk = d.check("divergences_are_low_confidence")
    assert not chk.passed and "not calibrated" in chk.message
    assert res.get("mtp-k3").check("divergences_are_low_confidence").passed  # nothing to excuse
    text = diff_text(res)
    assert "path noise NOT MEASURED" in text and "0.0000" not in text


def test_no_baseline_is_missing_evidence(tmp_path):
    s = Store(tmp_path).suite("t", {"corpus_hash": "h", "engine": "t", "corpus": "c"})
    for r in (0, 1):
        write(s, "mtp-k3", [comp(p, t, spec=MTP_COUNTERS) for p, t in BASE.items()], r)
    res = evaluate_suite(s, Policy())
    r = res.get("mtp-k3")
    agree = r.check("agrees_with_baseline")
    assert not agree.passed and "no complete baseline" in agree.message and exit_code(res) == 1
    for name in ("divergences_are_low_confidence", "same_stopping"):
        assert not r.check(name).passed and "no prompt was compared" in r.check(name).message


# --- output boundaries ----------------------------------------------------------------------------

EOS = 49


def _stop(pid, tokens, **kw):
    c = comp(pid, tokens, **kw)
    c.finish_reason = "stop" if tokens and tokens[-1] == EOS else "length"
    return c


def detok(ids):
    return " ".join(f"t{i}" for i in ids)


@pytest.mark.parametrize("case", ["past max_tokens", "stops early", "past end-of-sequence"])
def test_output_boundaries_fail_same_stopping_without_a_crash(tmp_path, case):
    s = Store(tmp_path).suite("t", {"corpus_hash": "h", "engine": "t", "corpus": "c"})
    base = {"a": [5, 6, 7, 8, 9, 10], "e": [1, 2, 3, EOS]}
    spec = dict(base)
    if case == "past max_tokens":
        spec["a"] = base["a"] + [11, 12]  # accepted drafts past max_tokens = 6
    elif case == "stops early":
        spec["a"] = base["a"][:4]
    else:
        spec["e"] = base["e"] + [4, 5]  # an accepted draft ran past end-of-sequence
    for r in (0, 1):
        write(s, "baseline", [_stop(p, t) for p, t in base.items()], r)
        write(s, "mtp-k3", [_stop(p, t) for p, t in spec.items()], r)
    for name in ("baseline", "mtp-k3"):
        toks = {c.prompt_id: c.token_ids.tolist() for c in s.load_run(name, 0).completions}
        sc = {p: Scored(*dist(t)[:2], dist(t)[1][:, 0]) for p, t in toks.items()}
        s.write_rescore(name, 0, list(sc), list(sc.values()))
    res = evaluate_suite(s, Policy(), detok=detok)
    r = res.get("mtp-k3")
    chk = r.check("same_stopping")
    assert not chk.passed and "nothing earlier explains it" in chk.message
    want = {"past max_tokens": "ran past max_tokens", "stops early": "stopped before",
            "past end-of-sequence": "after an end-of-sequence token"}[case]
    assert want in chk.message
    assert r.check("divergences_are_low_confidence").passed  # judged by same_stopping alone
    assert "same_stopping failed for config mtp-k3" in gate_text(res) and exit_code(res) == 1
    assert "stopping" in diff_text(res, detok) and "⟨end⟩" in diff_text(res, detok)
    markdown_report(res, detok)


def test_a_near_tie_flip_may_move_the_stop(tmp_path):
    s = Store(tmp_path).suite("t", {"corpus_hash": "h", "engine": "t", "corpus": "c"})
    base = [5, 6, 7, 8, 9, 10, 11, EOS]
    spec = [5, 6, 7, 9, 20, EOS]  # near-tie flip at 3, then a shorter answer
    for r in (0, 1):
        write(s, "baseline", [_stop("a", base, near={3})], r)
        write(s, "mtp-k3", [_stop("a", spec, near={3}, flip_at=3, base_token=8)], r)
    b_ids, b_lp = dist(base, near={3})
    s.write_rescore("baseline", 0, ["a"], [Scored(b_ids, b_lp, b_lp[:, 0])])
    t_ids, t_lp = dist(spec, near={3})
    t_ids[3, :2] = [8, 9]  # teacher-forced, the baseline prefers its own token by 0.01 nats
    s.write_rescore("mtp-k3", 0, ["a"], [Scored(t_ids, t_lp, np.where(t_ids[:, 0] == spec, t_lp[:, 0],
                                                                          t_lp[:, 1]))])
    res = evaluate_suite(s, Policy(min_token_agreement=0.0), detok=detok)
    assert res.noise_missing is None
    chk = res.get("mtp-k3").check("same_stopping")
    assert chk.passed and "1 stop elsewhere after a tolerated flip" in chk.message
    assert res.get("mtp-k3").boundaries[0].explained_by.position == 3


# --- counters -------------------------------------------------------------------------------------

def test_counters_that_count_the_bonus_token_fail(suite):
    """The issue's engine: accepted counts the bonus token too (1 + accepted / drafts reads
    high) while the per-position rates and the emitted tokens agree with each other."""
    lying = SpecCounters(2, 6, 5, [2, 1, 0], iterations=2)  # 3 accepted + 2 bonus tokens
    for r in (0, 1):
        write(suite, "mtp-k3", [comp(p, t, NEAR.get(p), spec=lying) for p, t in BASE.items()], r)
    r = evaluate_suite(suite, Policy(min_token_agreement=0.5)).get("mtp-k3")
    chk = r.check("counters_consistent")
    assert not chk.passed
    assert "counters say 3.50, per-position rates say 2.50, emitted tokens say 2.50" in chk.message
    assert "r0 prompt a: accepted tokens 5 != 3" in chk.message and "mtp-k3" in chk.message


def test_impossible_counters_are_a_failed_check_not_a_traceback(suite):
    impossible = SpecCounters(2, 6, 9, [2, 4, 3])  # more accepted than drafted
    for r in (0, 1):
        write(suite, "mtp-k3", [comp(p, t, NEAR.get(p), spec=impossible) for p, t in BASE.items()], r)
    res = evaluate_suite(suite, Policy(min_token_agreement=0.5))
    r = res.get("mtp-k3")
    assert not r.check("counters_consistent").passed
    assert "accepted tokens 9 > draft tokens 6" in r.check("counters_consistent").message
    assert "impossible" in r.check("acceptance_not_regressed").message
    assert exit_code(res) == 1 and "counters_consistent failed" in gate_text(res)


def test_counters_within_truncation_slack_pass(suite):
    """A last step whose accepted tokens were cut at max_tokens: counters say 2 more tokens
    than were emitted, within K."""
    cut = SpecCounters(2, 6, 5, [2, 2, 1], iterations=2)  # 2 + 5 = 7 tokens, 5 kept
    for r in (0, 1):
        write(suite, "mtp-k3", [comp(p, t, NEAR.get(p), spec=cut) for p, t in BASE.items()], r)
    assert evaluate_suite(suite, Policy(min_token_agreement=0.5)).get("mtp-k3").check("counters_consistent").passed


def test_acceptance_determinism_reported_and_gated_on_request(suite):
    other = SpecCounters(3, 9, 2, [1, 1, 0], iterations=3)  # same tokens, other accept/reject
    write(suite, "mtp-k3", [comp(p, t, NEAR.get(p), spec=other) for p, t in BASE.items()], repeat=1)
    res = evaluate_suite(suite, Policy(min_token_agreement=0.5))
    r = res.get("mtp-k3")
    chk = r.check("acceptance_deterministic")
    assert r.acceptance_identical is False and chk.skipped and "differ run to run" in chk.message
    assert r.check("deterministic").passed and res.passed
    assert "acceptance DIFFERS run to run (3 prompt(s))" in diff_text(res)
    gated = evaluate_suite(suite, Policy(min_token_agreement=0.5, require_deterministic_acceptance=True))
    c = gated.get("mtp-k3").check("acceptance_deterministic")
    assert not c.passed and not c.skipped and "prompt a counters 3 drafts" in c.message
    assert evaluate_suite(suite, Policy(min_token_agreement=0.5)).get("dflash-k7").acceptance_identical


def test_every_check_reaches_junit_and_diff(suite, tmp_path):
    res = evaluate_suite(suite, Policy(min_token_agreement=0.5))
    assert [c.name for c in res.get("mtp-k3").checks] == check_names("mtp-k3")
    write_junit(res, tmp_path / "j.xml")
    names = {c.get("name") for c in ET.parse(tmp_path / "j.xml").getroot().iter("testcase")}
    assert {f"{n}[mtp-k3]" for n in check_names("mtp-k3")} <= names
    text = diff_text(res)
    assert "stopping      3/3 prompts stop where the baseline does" in text
    assert "counters      tokens/iteration: counters say 2.50" in text


def test_agreement_floor_is_judged_as_a_sample(suite):
    """dflash-k7 agrees on 17 of its 18 teacher-forced tokens (94 % < 98 %): one near-tie flip
    in 18 tokens is within chance of a 98 % rate, so the check passes and says so; held to a
    plain floor (agreement_alpha=1) the same figures fail."""
    d = evaluate_suite(suite, Policy()).get("dflash-k7")
    assert d.token_agreement == pytest.approx(17 / 18) and d.token_agreement_n == 18
    agree = d.check("agrees_with_baseline")
    assert agree.passed and "within chance of it over 18 tokens" in agree.message
    assert "within chance" in diff_text(evaluate_suite(suite, Policy()))
    plain = evaluate_suite(suite, Policy(agreement_alpha=1.0)).get("dflash-k7").check("agrees_with_baseline")
    assert not plain.passed and "94.44% < 98.00% over 18 tokens" in plain.message


def complete_as_run_would(suite) -> None:
    """What `speccheck run` writes beside the runs of a suite built here by hand: the tokenised
    prompts and a plan asking for exactly the runs stored (a suite without them is damage)."""
    runs = {name: [suite.load_run(name, r) for r in suite.repeats(name)] for name in suite.configs()}
    first = next(iter(runs.values()))[0]
    suite.write_inputs({c.prompt_id: [int(x) for x in c.prompt_ids] for c in first.completions})
    def want(name, rs):
        together = suite.load_together(name)
        return {"repeats": max(suite.repeats(name)) + 1, "fresh_process_repeat": any(r.fresh_process for r in rs),
                "concurrent": together.copies if together is not None else 0,
                "rescore": suite.rescore_path(name, 0).exists(), "attribute": False,
                **({"replay": True} if suite.replay_path(name, 0).exists() else {}),
                **({"axes": suite.axis_slots(name)} if suite.axis_slots(name) else {})}
    suite.extend_plan({name: want(name, rs) for name, rs in runs.items()}, [])


def test_counters_shared_by_n_samples_cover_their_tokens():
    """vLLM's n samples of one request share its counters (on the first sample, requests n):
    they are checked against the tokens of all n, not of the first alone."""
    from speccheck.evaluate import _emitted_by_counters
    from speccheck.types import Completion, SpecCounters

    def comp(pid, n, spec=None):
        return Completion(pid, [1], list(range(n)), [0.0] * n, [[0]] * n, [[0.0]] * n, spec=spec)

    shared = SpecCounters(4, 12, 10, [4, 3, 3], requests=3)
    comps = [comp("a", 6, shared), comp("a#s1", 5), comp("a#s2", 4), comp("b", 3, SpecCounters())]
    assert _emitted_by_counters(comps) == [5 + 4 + 3, 4, 3, 2]
