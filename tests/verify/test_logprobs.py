"""Reported logprobs against the baseline (verify/logprobs.py and the logprobs_consistent
check): the two-sample drift statistic, the flip budget, and the check on constructed suites."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speccheck.evaluate import evaluate_suite
from speccheck.gate import gate_text
from speccheck.policy import Policy
from speccheck.report import markdown_report
from speccheck.store import Store
from speccheck.types import Completion, RunRecord, Scored, SpecConfig, SpecCounters
from speccheck.verify import (abs_deltas, drift_test, flip_budget, hodges_lehmann, ks_greater,
                              paired_deltas, typical_ratio,
                              paired_drift_test, rank_test_greater, signed_rank_test_greater,
                              summarize)

ALPHA, RATIO = Policy().logprob_drift_alpha, Policy().max_logprob_drift


# --- pure statistics ------------------------------------------------------------------------------

def test_ks_greater_identical_and_shifted():
    x = np.random.default_rng(0).exponential(0.002, 2000)
    assert ks_greater(x, x) == (0.0, 1.0)
    d, p = ks_greater(x * 2, x)
    assert d > 0.2 and p < 1e-20
    assert ks_greater(x / 2, x)[0] == 0.0  # one-sided: smaller is never "greater"
    assert ks_greater([], x) == (0.0, 1.0)


def test_rank_test_identical_shifted_and_tied():
    x = np.random.default_rng(0).exponential(0.002, 2000)
    z, p = rank_test_greater(x, x)
    assert z == 0.0 and p == 0.5
    assert rank_test_greater(x * 1.5, x)[1] < 1e-10 and rank_test_greater(x / 1.5, x)[1] > 0.99
    assert rank_test_greater(np.zeros(50), np.zeros(80)) == (0.0, 1.0)  # all tied: no evidence
    assert rank_test_greater([], x) == (0.0, 1.0)


def test_summary_and_abs_deltas_skip_non_finite():
    d = abs_deltas([0.0, -1.0, np.nan, -np.inf], [0.5, -1.5, 0.0, -1.0])
    assert d.tolist() == [0.5, 0.5]
    s = summarize(np.arange(101) / 100)
    assert s.n == 101 and s.median == 0.5 and s.max == 1.0 and s.p99 == pytest.approx(0.99)
    assert summarize([]).n == 0


def test_drift_needs_effect_and_significance():
    rng = np.random.default_rng(1)
    ref = rng.exponential(0.002, 20000)
    small = rng.exponential(0.0021, 20000)  # +5 %: significant with this many, but no effect
    t = drift_test(small, ref, RATIO, ALPHA)
    assert t.p < ALPHA and t.ratio < RATIO and not t.drifted
    assert drift_test(ref[:40] * 3, ref, RATIO, ALPHA).drifted is False  # too few positions
    assert drift_test(rng.exponential(0.004, 3000), ref, RATIO, ALPHA).drifted


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 10, allow_nan=False), min_size=0, max_size=400))
def test_identical_samples_never_drift(xs):
    assert not drift_test(xs, xs, RATIO, ALPHA).drifted
    assert ks_greater(xs, xs)[0] == 0.0


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), shape=st.floats(0.5, 3.0), scale=st.floats(1e-4, 1.0),
       n=st.integers(300, 3000))
def test_a_sample_scaled_up_2x_drifts(seed, shape, scale, n):
    """|Δ| samples shaped like path noise (gamma, any scale): the same sample scaled by 2 fails
    against the original beyond a few hundred positions; scaled by 1.1 it does not."""
    x = np.random.default_rng(seed).gamma(shape, scale, n)
    assert drift_test(2 * x, x, RATIO, ALPHA).drifted
    assert not drift_test(1.1 * x, x, RATIO, ALPHA).drifted


def test_signed_rank_matches_a_hand_computed_case():
    """d = a - b = [0, 1, -2, 3, 3]: Pratt ranks |d| 1..5 with the zero first and the tied 3s
    at 4.5 each: T+ = 2 + 4.5 + 4.5 = 11, mean (30 - 2)/4 = 7, variance (330 - 6)/24 - 6/48,
    continuity correction 0.5."""
    z, p = signed_rank_test_greater([0, 1, 0, 3, 3], [0, 0, 2, 0, 0])
    assert z == pytest.approx((11 - 7 - 0.5) / np.sqrt(324 / 24 - 6 / 48))
    assert p == pytest.approx(0.5 * __import__("math").erfc(z / np.sqrt(2)))
    assert signed_rank_test_greater([1, 2], [1, 2]) == (0.0, 1.0)  # nothing but zeros
    assert (signed_rank_test_greater([1, np.nan, 3, 4, 5], [0, 0, np.inf, 0, 0])
            == signed_rank_test_greater([1, 4, 5], [0, 0, 0]))  # non-finite pairs dropped
    with pytest.raises(ValueError):
        signed_rank_test_greater([1, 2], [1])


def test_signed_rank_against_the_exact_distribution():
    """From 20 distinct |d| (the fewest pairs the drift test judges) the normal approximation
    stays within 0.005 of the exact one-sided p-value (the null distribution of T+ counted
    over all 2^n sign patterns by dynamic programming), at every observed T+."""
    for n in (20, 35):
        counts = np.zeros(n * (n + 1) // 2 + 1)
        counts[0] = 1
        for r in range(1, n + 1):  # subsets of {1..n} by their sum
            counts[r:] = counts[r:] + counts[:-r].copy()
        survival = np.cumsum(counts[::-1])[::-1] / 2.0 ** n  # P(T+ >= t)
        rng = np.random.default_rng(n)
        b = rng.exponential(1.0, n)
        for shift in (-0.5, 0.0, 0.3, 0.8, 1.5):
            a = b + rng.normal(shift, 1.0, n)
            d = a - b
            t_obs = int((np.argsort(np.argsort(np.abs(d))) + 1)[d > 0].sum())
            assert signed_rank_test_greater(a, b)[1] == pytest.approx(survival[t_obs], abs=0.005)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=60))
def test_hodges_lehmann_is_the_median_of_walsh_averages(xs):
    d = np.asarray(xs)
    walsh = ((d[:, None] + d[None, :]) / 2)[np.triu_indices(len(d))]
    assert hodges_lehmann(d) == pytest.approx(float(np.median(walsh)), rel=1e-9, abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([-2.0, -0.1, 0.0, 0.1, 0.3, 1.0 / 3, 7.5]) | st.floats(-50, 50, allow_nan=False),
                min_size=60, max_size=400))
def test_hodges_lehmann_selection_rounds_are_exact(xs):
    """Large samples are not listed whole: rounds of sampled bounds narrow the Walsh averages
    in play (forced here on small samples, many values tied) and must still give exactly the
    median of all of them."""
    import speccheck.verify.logprobs as logprobs

    d = np.asarray(xs)
    walsh = ((d[:, None] + d[None, :]) / 2)[np.triu_indices(len(d))]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(logprobs, "_WALSH_LIST", 50)
        mp.setattr(logprobs, "_WALSH_SAMPLE", 64)
        assert hodges_lehmann(d) == float(np.median(walsh))


def test_typical_ratio_reads_as_times_the_reference():
    b = np.random.default_rng(2).gamma(0.5, 1.0, 501)  # heavy-tailed, like |Δ|
    assert typical_ratio(b, b) == 1.0
    assert typical_ratio(1.1 * b, b) == pytest.approx(1.1) and typical_ratio(b, 3 * b) == pytest.approx(1 / 3)
    assert typical_ratio([0.0, 2.0, 4.0, 6.0, 1.0], [1.0, 1.0, 2.0, 3.0, 0.0]) == pytest.approx(2.0)  # pairs with a 0 left out
    assert typical_ratio([0.0], [0.0]) == 1.0


def test_paired_deltas_stop_at_the_first_divergence():
    a, b = paired_deltas([5, 6, 7, 8], [-0.1, -0.2, -0.3, -0.4], [5, 6, 9, 8, 1],
                         [-0.15, -0.2, -0.3, -0.4, -0.5], [-0.1, -0.25, -0.3, -0.4, -0.5])
    assert a == pytest.approx([0.0, 0.05]) and b == pytest.approx([0.05, 0.05])
    assert [len(x) for x in paired_deltas([1], [0.0], [1, 2], [0.0, 0.0], [0.0, 0.0])] == [1, 1]


def _gamma_pairs(seed, shape, scale, n):
    """|Δ| pairs shaped like path noise: each position has its own sensitivity (a flat
    softmax moves more), which both paths share, times each path's own rounding."""
    rng = np.random.default_rng(seed)
    site = rng.gamma(shape, scale, n)
    return site * rng.gamma(4.0, 0.25, n), site * rng.gamma(4.0, 0.25, n)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 10, allow_nan=False), min_size=0, max_size=400))
def test_identical_pairs_never_drift(xs):
    t = paired_drift_test(xs, xs, RATIO, ALPHA)
    assert not t.drifted and t.p == 1.0


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), shape=st.floats(0.5, 3.0), scale=st.floats(1e-4, 1.0),
       n=st.integers(20, 2000))
def test_pairs_with_a_scaled_2x_drift_and_swapped_never(seed, shape, scale, n):
    """The spec side 2x the decode path's |Δ| (on pairs that differ position by position)
    fails from 20 pairs (the least the test judges); the same pairs swapped never fail (one-sided), nor does a 1.1x
    scaling (no effect)."""
    _, b = _gamma_pairs(seed, shape, scale, n)
    assert paired_drift_test(2 * b, b, RATIO, ALPHA).drifted
    assert not paired_drift_test(b, 2 * b, RATIO, ALPHA).drifted
    assert not paired_drift_test(1.1 * b, b, RATIO, ALPHA).drifted


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10, allow_nan=False), st.floats(0, 10, allow_nan=False)),
                min_size=0, max_size=400))
def test_swapping_the_sides_never_drifts_both_ways(pairs):
    """Whatever the pairs, a drift one way and a drift the other way exclude each other: the
    signed-rank statistic changes sign when the sides swap (less the continuity correction,
    which is conservative both ways)."""
    a = [x for x, _ in pairs]
    b = [y for _, y in pairs]
    pa, pb = signed_rank_test_greater(a, b)[1], signed_rank_test_greater(b, a)[1]
    assert pa + pb >= 1.0 - 1e-9
    assert not (paired_drift_test(a, b, RATIO, ALPHA).drifted and paired_drift_test(b, a, RATIO, ALPHA).drifted)


def test_paired_needs_enough_pairs_and_an_effect():
    a, b = _gamma_pairs(0, 1.0, 0.002, 5000)
    assert not paired_drift_test(3 * b[:19], b[:19], RATIO, ALPHA).drifted  # too few pairs
    small = paired_drift_test(1.05 * b, b, RATIO, ALPHA)  # significant, but no effect
    assert small.p < ALPHA and small.ratio < RATIO and not small.drifted
    same = paired_drift_test(a, b, RATIO, ALPHA)  # two independent draws of the same noise
    assert not same.drifted and same.ratio == pytest.approx(1.0, abs=0.1)


def test_flip_budget_counts_what_noise_predicts():
    noise = np.linspace(0, 0.01, 1001)  # uniform on [0, 0.01]
    b = flip_budget([0.0025, 0.005, 1.0, 2.0, np.nan], 1, noise, multiple=2.0, slack=1)
    assert b.positions == 4 and b.at_risk == 2
    assert b.expected == pytest.approx(0.75 + 0.5, abs=0.01)
    assert b.allowed == int(np.ceil(2 * b.expected + np.sqrt(b.expected) + 1)) and not b.excess
    assert flip_budget([1.0] * 10, 5, noise, 2.0, 1).excess  # no position at risk, 5 flips


# --- the check on constructed suites ---------------------------------------------------------------

N, V = 400, 97


def _rows(tokens, rng, noise_scale, margin=2.0):
    """Top-5 rows whose argmax is each token (margin nats to the runner-up), every logprob
    perturbed by path noise of the given scale."""
    n = len(tokens)
    ids = np.stack([(tokens + j) % V for j in range(5)], 1).astype(np.int32)
    lp = np.array([-0.2, -0.2 - margin, -5, -6, -7], np.float64)[None].repeat(n, 0)
    lp += rng.exponential(noise_scale, (n, 1)) * rng.choice([-1, 1], (n, 1))
    return ids, lp.astype(np.float32)


FLIPS = [10 + 7 * i for i in range(40)]


def _suite(tmp_path, spec_noise=0.002, base_noise=0.002, wrong_rows=(), spec_flips=0):
    """A suite of 4 prompts x N tokens: the baseline and mtp-k3 agree on every token; their
    reported logprobs differ from the teacher-forced ones by noise of the given scales. With
    ``spec_flips``, prompt a's teacher-forced baseline prefers its runner-up by 0.02 nats (10x
    the noise: a near-tie, yet one the noise flips almost never) at that many positions."""
    rng = np.random.default_rng(7)
    s = Store(tmp_path).suite("t", {"corpus_hash": "h", "engine": "t", "corpus": "c"})
    toks = {p: rng.integers(0, V, N) for p in "abcd"}
    for name, scale in (("baseline", base_noise), ("mtp-k3", spec_noise)):
        comps, scored = [], []
        flips = FLIPS[:spec_flips] if name != "baseline" else []
        for p, t in toks.items():
            ids, lp = _rows(t, rng, scale)
            lp_chosen = lp[:, 0].copy()
            if name != "baseline":
                lp_chosen[list(wrong_rows)] -= 1.5  # a wrong logprob row: another distribution's value
            if p == "a":
                lp[flips, 1] = lp[flips, 0] - 0.02  # the spec side was nearly undecided too
            spec = SpecCounters(133, 399, 266, [133, 100, 33]) if name != "baseline" else None  # 1 + 133 + 266 = N
            comps.append(Completion(p, [1, 2], t, lp_chosen, ids, lp, ttft_s=0.01, decode_s=0.1, spec=spec))
            ids, lp = _rows(t, np.random.default_rng(0), 0.0)
            if p == "a":
                for pos in flips:  # the baseline prefers the spec's runner-up by 0.02 nats
                    ids[pos, :2] = [(t[pos] + 1) % V, t[pos]]
                    lp[pos, 1] = lp[pos, 0] - 0.02
            scored.append(Scored(ids, lp, lp[np.arange(N), np.argmax(ids == t[:, None], 1)]))
        for r in (0, 1):
            s.write_run(RunRecord(SpecConfig.from_name(name), {"engine": "t"}, "c", "h", r, False,
                                  completions=comps))
        s.write_rescore(name, 0, list(toks), scored)
    return s


def test_clean_logprobs_pass_with_distribution_figures(tmp_path):
    res = evaluate_suite(_suite(tmp_path), Policy())
    r = res.get("mtp-k3")
    c = r.check("logprobs_consistent")
    assert c.passed, c.message
    assert r.logprobs.positions == 4 * N and r.logprobs.drift.spec.n == 4 * N
    assert "ratio" in c.message and "KS D+" in c.message and "flip(s)" in c.message
    assert "| mtp-k3 | 1600 |" in markdown_report(res)


def test_a_wrong_logprob_row_fails_one_by_one(tmp_path):
    r = evaluate_suite(_suite(tmp_path, wrong_rows=(5,)), Policy()).get("mtp-k3")
    c = r.check("logprobs_consistent")
    assert not c.passed and r.logprobs.n_over == 4  # position 5 of each prompt
    assert "prompt a position 5" in c.message and "|Δ| 1.5" in c.message


def test_drift_below_every_near_tie_fails_as_a_distribution(tmp_path):
    """2x the path noise: no single position is off by much, and no token flips."""
    res = evaluate_suite(_suite(tmp_path, spec_noise=0.004), Policy())
    r = res.get("mtp-k3")
    assert r.check("agrees_with_baseline").passed and r.logprobs.n_over == 0
    c = r.check("logprobs_consistent")
    assert not c.passed and "drifted from the kernel-path noise" in c.message
    assert "logprobs_consistent failed for config mtp-k3" in gate_text(res)


def _paired_suite(tmp_path, spec_factor, n=60, diverge_at=None):
    """Two prompts of ``n`` tokens whose |Δ| is heavy-tailed (each position its own
    sensitivity, as a flat softmax moves more): the baseline's decode path is off the prefill
    path by ``site`` at each position, the spec path by ``spec_factor x site``. With
    ``diverge_at``, the spec output of prompt a takes another token there (and keeps it)."""
    rng = np.random.default_rng(11)
    s = Store(tmp_path).suite("p", {"corpus_hash": "h", "engine": "t", "corpus": "c"})
    toks = {p: rng.integers(0, V, n) for p in "ab"}
    site = {p: rng.gamma(0.3, 0.01, n) for p in "ab"}
    for name, factor in (("baseline", 1.0), ("mtp-k3", spec_factor)):
        comps, scored = [], []
        for p, t in toks.items():
            t = t.copy()
            if name != "baseline" and p == "a" and diverge_at is not None:
                t[diverge_at:] = (t[diverge_at:] + 1) % V
            ids, lp = _rows(t, np.random.default_rng(0), 0.0)  # the prefill path: exact rows
            prefill = lp[:, 0].astype(np.float64)
            spec = SpecCounters(20, 60, 39, [20, 12, 7]) if name != "baseline" else None
            comps.append(Completion(p, [1, 2], t, (prefill - factor * site[p]).astype(np.float32), ids, lp,
                                    ttft_s=0.01, decode_s=0.1, spec=spec))
            scored.append(Scored(ids, lp, lp[:, 0]))
        s.write_run(RunRecord(SpecConfig.from_name(name), {"engine": "t"}, "c", "h", 0, False, completions=comps))
        s.write_rescore(name, 0, list(toks), scored)
    return s


def test_paired_test_catches_drift_the_unpaired_test_misses(tmp_path):
    """1.5x the decode path's |Δ| at every position, 120 positions of heavy-tailed noise: the
    two samples overlap too much for the unpaired rank test; position by position the spec
    side is larger every time."""
    r = evaluate_suite(_paired_suite(tmp_path / "drift", 1.5), Policy()).get("mtp-k3")
    lc = r.logprobs
    assert not lc.drift.drifted and lc.drift.p > ALPHA
    assert lc.paired.n == 120 and lc.paired.ratio == pytest.approx(1.5) and lc.paired.p < ALPHA
    c = r.check("logprobs_consistent")
    assert not c.passed and "drifted from the baseline's decode path at the same positions" in c.message
    clean = evaluate_suite(_paired_suite(tmp_path / "clean", 1.0), Policy()).get("mtp-k3")
    assert clean.logprobs.paired.ratio == 1.0 and not clean.logprobs.paired.drifted
    assert clean.check("logprobs_consistent").passed, clean.check("logprobs_consistent").message
    assert "paired:" in clean.check("logprobs_consistent").message


def test_paired_positions_end_at_the_first_divergence(tmp_path):
    r = evaluate_suite(_paired_suite(tmp_path, 1.0, diverge_at=25), Policy()).get("mtp-k3")
    assert r.logprobs.paired.n == 60 + 25


def test_golden_sample_is_a_second_reference(tmp_path):
    s = _suite(tmp_path, spec_noise=0.002, base_noise=0.004)  # the kernel path is noisier
    assert evaluate_suite(s, Policy()).get("mtp-k3").check("logprobs_consistent").passed
    gold = {"mtp-k3": np.random.default_rng(3).exponential(0.001, 2000)}
    r = evaluate_suite(s, Policy(), golden_noise=gold).get("mtp-k3")
    assert r.logprobs.golden_drift.drifted
    assert "drifted from the golden" in r.check("logprobs_consistent").message


def test_excess_flips_fail(tmp_path):
    """Near-tie flips (each one excusable) far more often than the noise predicts."""
    r = evaluate_suite(_suite(tmp_path, spec_flips=12), Policy()).get("mtp-k3")
    assert r.check("divergences_are_low_confidence").passed
    assert r.class_counts["near_tie"] == 12
    c = r.check("logprobs_consistent")
    assert not c.passed and "more flips than the path noise explains: 12" in c.message
    few = evaluate_suite(_suite(tmp_path / "few", spec_flips=1), Policy()).get("mtp-k3")
    assert few.check("logprobs_consistent").passed, few.check("logprobs_consistent").message


def test_missing_rescoring_is_not_a_pass(tmp_path):
    s = _suite(tmp_path)
    s.rescore_path("mtp-k3", 0).unlink()
    c = evaluate_suite(s, Policy()).get("mtp-k3").check("logprobs_consistent")
    assert not c.passed and "no teacher-forced rescoring" in c.message


def test_golden_records_the_noise_samples_and_check_compares_them(tmp_path):
    from speccheck import golden

    s = _suite(tmp_path / "st")
    res = evaluate_suite(s, Policy())
    path = golden.record(s, res, tmp_path / "golden")
    meta = __import__("json").loads((path / "golden.json").read_text())
    assert meta["logprob_noise"]["kernel_path"]["n"] == 4 * N
    assert meta["logprob_noise"]["config:mtp-k3"]["median"] == pytest.approx(res.get("mtp-k3").logprobs.drift.spec.median, rel=1e-4)
    samples = golden.golden_noise(s, tmp_path / "golden")
    assert set(samples) == {"mtp-k3"} and len(samples["mtp-k3"]) == 4 * N
    r = evaluate_suite(s, Policy(), golden_noise=samples).get("mtp-k3")
    assert r.logprobs.golden_drift.ratio == pytest.approx(1.0, abs=1e-3) and r.check("logprobs_consistent").passed
    chk = golden.check(s, tmp_path / "golden", res.noise, Policy())
    assert chk.noise_drift is not None and not chk.noise_drift.drifted and chk.passed


def test_golden_noise_from_another_platform_is_not_compared(tmp_path):
    """A golden recorded on another CPU (SIMD level) or GPU: its |Δ logprob| sample is not
    evidence about this machine's kernels, so only today's kernel-path noise judges drift."""
    from speccheck import golden

    s = _suite(tmp_path / "st")
    path = golden.record(s, evaluate_suite(s, Policy()), tmp_path / "golden")
    assert golden.golden_noise(s, tmp_path / "golden") is not None
    manifest = path / "baseline" / "manifest.json"
    m = json.loads(manifest.read_text())
    m["identity"]["cpu_capability"] = "AVX2" if m["identity"].get("cpu_capability") != "AVX2" else "AVX512"
    manifest.write_text(json.dumps(m))
    from speccheck.store import file_sum  # another golden, not a damaged one: its sum matches

    manifest.with_name("manifest.json.sha256").write_text(json.dumps(file_sum(manifest)))
    assert golden.golden_noise(s, tmp_path / "golden") is None
