"""verify/topk_drift.py against independent oracles: the per-position top-k |Δ| against a
loop over the rows, the paired test against scipy's Wilcoxon (Pratt, continuity-corrected)
and a brute-force Hodges-Lehmann, the power figure against scipy's normal quantiles, and the
three-way decision's invariants."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from speccheck.verify import (FAIL, INCONCLUSIVE, PASS, decide, detectable_ratio, shared_context,
                              topk_abs_deltas, topk_drift_test)
from speccheck.verify.topk_drift import _z


def _rows(draw, n, k, vocab):
    ids = np.array([draw(st.lists(st.integers(0, vocab), min_size=k, max_size=k, unique=True))
                    for _ in range(n)], dtype=np.int64).reshape(n, k)
    lps = np.array(draw(st.lists(st.floats(-20, 0), min_size=n * k, max_size=n * k))).reshape(n, k)
    return ids, lps


@settings(max_examples=80, deadline=None)
@given(st.data(), st.integers(0, 12), st.integers(1, 5), st.integers(4, 9))
def test_topk_abs_deltas_is_the_mean_over_shared_ids(data, n, k, vocab):
    ia, la = _rows(data.draw, n, k, vocab)
    ib, lb = _rows(data.draw, n, k, vocab)
    got = topk_abs_deltas(ia, la, ib, lb)
    assert got.shape == (n,)
    for i in range(n):
        b = dict(zip(ib[i].tolist(), lb[i].tolist()))
        d = [abs(lp - b[t]) for t, lp in zip(ia[i].tolist(), la[i].tolist()) if t in b]
        if d:
            assert got[i] == pytest.approx(np.mean(d), rel=1e-12, abs=1e-15)
        else:
            assert math.isnan(got[i])
    # symmetric, and zero against itself
    np.testing.assert_allclose(topk_abs_deltas(ib, lb, ia, la), got, rtol=1e-12, equal_nan=True)
    assert np.all(topk_abs_deltas(ia, la, ia, la) == 0)


def test_shared_context_includes_the_first_divergence():
    assert shared_context([1, 2, 3, 4], [1, 2, 9, 4]) == 3
    assert shared_context([1, 2, 3], [1, 2, 3, 4]) == 3
    assert shared_context([], [1]) == 0


@settings(max_examples=60, deadline=None)
@given(st.data(), st.floats(1.0, 2.0), st.sampled_from([1e-3, 0.01]), st.sampled_from([0.05, 0.2]))
def test_topk_drift_test_is_its_scipy_parts(data, max_ratio, alpha, look):
    n = data.draw(st.integers(20, 80))
    pos = st.floats(1e-4, 1.0)
    a = np.array(data.draw(st.lists(pos, min_size=n, max_size=n)))
    b = np.array(data.draw(st.lists(pos, min_size=n, max_size=n)))
    got = topk_drift_test(a, b, max_ratio, alpha, look)
    lr = np.log(a) - np.log(b)
    walsh = [(lr[i] + lr[j]) / 2 for i in range(n) for j in range(i, n)]
    assert got.ratio == pytest.approx(math.exp(np.median(walsh)), rel=1e-9)
    p = stats.wilcoxon(a, b, zero_method="pratt", correction=True, alternative="greater",
                       method="approx").pvalue if (a != b).any() else 1.0
    assert got.p == pytest.approx(p, rel=1e-6, abs=1e-300)
    assert got.decision == decide(got.ratio > max_ratio, got.p, alpha, look)
    want = math.exp((stats.norm.ppf(1 - alpha) + stats.norm.ppf(0.8)) * np.std(lr, ddof=1) / math.sqrt(n))
    assert got.detectable == pytest.approx(want, rel=1e-7)


@given(st.floats(1e-12, 1 - 1e-12))
def test_normal_quantile_is_scipys(q):
    assert _z(q) == pytest.approx(stats.norm.ppf(q), abs=1e-8, rel=1e-8)


@given(st.booleans(), st.floats(0, 1), st.floats(1e-6, 0.5), st.floats(0, 0.5))
def test_decide_three_ways(over, p, alpha, extra):
    look = min(1.0, alpha + extra)
    d = decide(over, p, alpha, look)
    if not over or p >= look:
        assert d == PASS
    elif p < alpha:
        assert d == FAIL
    else:
        assert d == INCONCLUSIVE
    # a smaller p never makes the verdict milder
    order = {PASS: 0, INCONCLUSIVE: 1, FAIL: 2}
    assert order[decide(over, p / 2, alpha, look)] >= order[d]


def test_topk_drift_test_finds_a_shift_it_claims_power_for():
    """A true typical ratio at the stated detectable ratio is found in about 80 % of samples
    (log-normal per-position ratios; 200 draws)."""
    rng = np.random.default_rng(7)
    n, sd = 300, 0.4
    b = rng.lognormal(-5, 1, n)
    probe = topk_drift_test(b * np.exp(rng.normal(0, sd, n)), b, 1.0, 1e-3, 0.05)
    shift = math.log(probe.detectable)
    found = sum(topk_drift_test(b * np.exp(rng.normal(shift, sd, n)), b, 1.0, 1e-3, 0.05).decision
                == FAIL for _ in range(200))
    assert 0.65 <= found / 200 <= 0.95


def test_too_few_pairs_pass_with_no_power():
    t = topk_drift_test(np.ones(5), np.ones(5) / 2, 1.1, 1e-3, 0.05)
    assert t.decision == PASS and math.isinf(t.detectable)
    with pytest.raises(ValueError):
        topk_drift_test(np.ones(30), np.ones(30), 1.1, 0.1, 0.05)
    assert math.isinf(detectable_ratio([1.0], [1.0], 0.01))


@settings(max_examples=40, deadline=None)
@given(st.integers(20, 600), st.sampled_from([0.9, 0.98, 0.995]), st.sampled_from([0.01, 0.05]))
def test_detectable_agreement_is_the_rate_the_binomial_test_finds_80_percent_of_the_time(n, floor, alpha):
    """Oracle: scipy's binomial distribution -- at the returned rate the count that the test
    calls significant (its largest) is reached with probability 0.8."""
    from speccheck.verify import detectable_agreement

    r = detectable_agreement(n, floor, alpha)
    crit = [k for k in range(n + 1) if stats.binom.cdf(k, n, floor) < alpha]
    if not crit:
        assert r is None
        return
    assert r is not None and 0 <= r < floor
    assert stats.binom.cdf(max(crit), n, r) == pytest.approx(0.8, abs=1e-6)


@settings(max_examples=60, deadline=None)
@given(st.data(), st.sampled_from([0.9, 0.95]), st.floats(1.0, 4.0), st.sampled_from([1e-3, 0.01]))
def test_tail_exceedance_test_is_scipys_sign_test(data, q, max_odds, alpha):
    """Oracle: numpy's pooled quantile, the discordant counts by a loop, and
    ``scipy.stats.binomtest(above, above + below, 0.5, alternative="greater")``."""
    from speccheck.verify import tail_exceedance_test

    n = data.draw(st.integers(1, 120))
    pos = st.floats(1e-5, 1.0)
    a = np.array(data.draw(st.lists(pos, min_size=n, max_size=n)))
    b = np.array(data.draw(st.lists(pos, min_size=n, max_size=n)))
    got = tail_exceedance_test(a, b, q, max_odds, alpha, 0.05)
    t = np.quantile(np.concatenate([a, b]), q)
    above = sum(1 for x, y in zip(a, b) if x > t >= y)
    below = sum(1 for x, y in zip(a, b) if y > t >= x)
    assert (got.above, got.below) == (above, below)
    p = stats.binomtest(above, above + below, 0.5, alternative="greater").pvalue if above + below else 1.0
    assert got.p == pytest.approx(p, rel=1e-9, abs=1e-300)
    assert got.decision == decide(got.odds > max_odds, got.p, alpha, 0.05)


@pytest.mark.parametrize("m", [10, 40, 135, 400])
def test_detectable_odds_is_found_80_percent_of_the_time(m):
    """Oracle: scipy's binomial -- at the returned odds the sign test's critical count is
    reached with probability 0.8."""
    from speccheck.verify import detectable_odds

    d = detectable_odds(m, 1e-3)
    crit = next(k for k in range(m + 1) if stats.binom.sf(k - 1, m, 0.5) < 1e-3)
    assert stats.binom.sf(crit - 1, m, d / (1 + d)) == pytest.approx(0.8, abs=1e-6)
    assert math.isinf(detectable_odds(5, 1e-3))
