"""Temperature 0 means argmax (verify/argmax.py): every chosen token is its own reported top-1,
and near-ties do not go to rank 2 more often than reporting noise allows.

Measured for near_tie_rank2_test (alpha 0.05):
- false alarms, argmax decisions with the reported margin off by N(0, σ) noise and the test
  told σ (true margins uniform on [0, 1] nats, 2000 positions, ~200 near-ties ≤ 0.1 per
  dataset, the tests' 300 seeded datasets): 0.027 at σ = 1e-3, 0.043 at σ = 0.01, 0.070 at
  σ = 0.03 (2000 other seeded datasets: 0.033 at σ = 0.01, 0.044 at σ = 0.03);
- power against a sampler at temperature T (rank 2 with probability sigmoid(−m / T)) on 50
  near-ties with margins uniform on [0, 0.1], σ = 1e-3, 200 seeded datasets: 0.06 at
  T = 1e-3, 0.44 at T = 3e-3, 0.94 at T = 0.01, 1.00 at T = 0.05 (below T ≈ σ a sampler is
  indistinguishable from reporting noise, by construction).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from speccheck.types import Completion
from speccheck.verify.argmax import (
    ARGMAX_TOL,
    argmax_summary,
    argmax_violations,
    near_tie_rank2_test,
)
from speccheck.verify.ties import canonical_topk

IDS = np.array([[5, 3, 9], [2, 7, 1], [4, 8, -1]], np.int32)
LPS = np.array([[-0.1, -2.0, -3.0], [-0.6, -0.8, -4.0], [-0.01, -5.0, -np.inf]], np.float32)


def test_argmax_stream_has_no_violation():
    check = argmax_violations([5, 2, 4], IDS, LPS)
    assert check.ok and check.positions == [] and check.unjudged == () and check.n == 3


def test_rank2_pick_and_a_token_outside_the_topk_are_violations():
    check = argmax_violations([5, 7, 11], IDS, LPS, logprobs=[-0.1, -0.8, -7.5])
    assert check.positions == [1, 2]
    v1, v2 = check.violations
    assert (v1.token, v1.top1, v1.in_topk) == (7, 2, True)
    assert v1.gap == pytest.approx(0.2, abs=1e-6)
    assert (v2.token, v2.in_topk, v2.chosen_logprob) == (11, False, -7.5)
    assert "outside the top-k" in str(v2) and "position 2" in str(v2)
    assert "nats below the top-1 2" in str(v1)
    assert math.isnan(argmax_violations([5, 2, 11], IDS, LPS).violations[0].chosen_logprob)


def test_tolerance_excuses_reporting_noise_only():
    lps = np.array([[-0.5, -0.5 - ARGMAX_TOL / 2, -3.0]], np.float32)
    ids = np.array([[1, 2, 3]], np.int32)
    assert argmax_violations([2], ids, lps).ok
    assert not argmax_violations([2], ids, lps, tol=0.0).ok
    assert not argmax_violations([2], ids, np.array([[-0.5, -0.5 - 3 * ARGMAX_TOL, -3.0]], np.float32)).ok


def test_exact_ties_go_to_the_lowest_id_else_reported_as_a_tie_break():
    ids = np.array([[3895, 3023, 312]], np.int32)  # a bf16 three-way tie, listed as vLLM did
    lps = np.full((1, 3), -3.12999, np.float32)
    assert argmax_violations([312], ids, lps).tie_breaks == ()
    check = argmax_violations([3023], ids, lps)
    assert check.ok and check.tie_breaks == (0,)


def test_padding_unsorted_rows_and_missing_rows():
    ids = np.array([[-1, 4, 6], [-1, -1, -1]], np.int32)
    lps = np.array([[-np.inf, -2.0, -0.3], [-np.inf] * 3], np.float32)
    check = argmax_violations([6, 1, 2], ids, lps)  # row 0 out of order; row 1 padding; row 2 missing
    assert check.ok and check.unjudged == (1, 2)
    assert argmax_violations([4, 1, 2], ids, lps).positions == [0]
    assert argmax_violations([1, 2], np.zeros((2, 0)), np.zeros((2, 0))).unjudged == (0, 1)
    with pytest.raises(ValueError, match=r"\[n, k\]"):
        argmax_violations([1], [[1, 2]], [[-1.0]])


@st.composite
def rows(draw):
    k = draw(st.integers(2, 6))
    ids = draw(st.lists(st.integers(0, 40), min_size=k, max_size=k, unique=True))
    lps = draw(st.lists(st.sampled_from([-0.1, -0.5, -0.5004, -1.0, -2.0, -6.0]), min_size=k, max_size=k))
    return ids, lps


@settings(max_examples=200, deadline=None)
@given(st.lists(rows(), min_size=1, max_size=6), st.data())
def test_violation_iff_below_own_best_beyond_tolerance(table, data):
    """Whatever order the row lists its entries in: the canonical top-1 is never a
    violation; any other listed token is one exactly when its logprob is more than tol
    below the best; a token not listed always is."""
    width = max(len(i) for i, _ in table)
    ids = np.full((len(table), width), -1, np.int64)
    lps = np.full((len(table), width), -np.inf)
    tokens, expect = [], []
    for r, (i, lp) in enumerate(table):
        order = data.draw(st.permutations(range(len(i))))
        ids[r, :len(i)] = [i[j] for j in order]
        lps[r, :len(i)] = [lp[j] for j in order]
        kind = data.draw(st.sampled_from(["top", "any", "absent"]))
        best = canonical_topk(zip(i, lp))[0]
        if kind == "top":
            tokens.append(best[0])
            expect.append(False)
        elif kind == "any":
            j = data.draw(st.integers(0, len(i) - 1))
            tokens.append(i[j])
            expect.append(lp[j] < best[1] - ARGMAX_TOL)
        else:
            tokens.append(99)
            expect.append(True)
    got = argmax_violations(tokens, ids, lps).positions
    assert got == [r for r, e in enumerate(expect) if e]


def test_summary_over_completions_and_tuples():
    c = Completion("p", [1], [5, 7, 4], [-0.1, -0.8, -0.01], IDS, LPS)
    s = argmax_summary([c, ([2], IDS[1:2], LPS[1:2])], tau=0.25)
    assert (s.positions, s.violations) == (4, 1)
    assert s.near_ties == 2 and s.near_tie_rank2 == 1  # margin 0.2 twice; rank 2 once
    assert s.margins == pytest.approx([0.2, 0.2], abs=1e-6)
    assert argmax_summary([]).near_ties == 0


# ----------------------------------------------------------------- the near-tie test

def test_exact_argmax_null_makes_any_rank2_conclusive():
    t = near_tie_rank2_test([0.0, 0.01, 0.05], [False, False, False], 0.05)
    assert (t.p, t.rejected, t.expected, t.temperature) == (1.0, False, 0.0, 0.0)
    t = near_tie_rank2_test([0.0, 0.01, 0.05], [False, True, False], 0.05)
    assert t.p == 0.0 and t.rejected and t.rank2 == 1


@pytest.mark.parametrize("margin,noise,n,r", [(0.002, 0.001, 40, 3), (0.0, 0.01, 25, 18), (0.01, 0.004, 300, 5)])
def test_equal_margins_give_the_binomial_tail(margin, noise, n, r):
    q = stats.norm.sf(margin / noise)
    t = near_tie_rank2_test([margin] * n, [True] * r + [False] * (n - r), 0.05, noise=noise)
    assert t.p == pytest.approx(stats.binom.sf(r - 1, n, q), rel=1e-9)
    assert t.expected == pytest.approx(n * q)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0, 0.01), min_size=1, max_size=25), st.data())
def test_unequal_margins_give_the_poisson_binomial_tail(margins, data):
    """Against the distribution built by convolving the Bernoulli pmfs one by one."""
    noise = 0.003
    r = data.draw(st.integers(0, len(margins)))
    q = stats.norm.sf(np.array(margins) / noise)
    pmf = np.array([1.0])
    for qi in q:
        pmf = np.convolve(pmf, [1 - qi, qi])
    t = near_tie_rank2_test(margins, [True] * r + [False] * (len(margins) - r), noise=noise)
    assert t.p == pytest.approx(min(1.0, pmf[r:].sum()), rel=1e-9, abs=1e-15)


def _noisy_argmax(rng, n, sigma, tau=0.1):
    g = rng.uniform(0, 1.0, n)  # true top-1 minus top-2
    reported = g + rng.normal(0, sigma, n)  # argmax was right; the report swaps where < 0
    m, near = np.abs(reported), np.abs(reported) <= tau
    return m[near], (reported < 0)[near]


@pytest.mark.parametrize("sigma", [1e-3, 0.01, 0.03])
def test_false_alarm_rate_under_argmax_with_reporting_noise(sigma):
    """300 seeded datasets of 2000 argmax decisions (~200 near-ties each), the reported
    margin off by N(0, σ): rejected at alpha 0.05 in 0.027 / 0.043 / 0.070 of them (σ = 1e-3
    / 0.01 / 0.03; 0.044 at σ = 0.03 over 2000 other datasets); allowed alpha + 0.03."""
    rng = np.random.default_rng(int(sigma * 1e4))
    hits = sum(near_tie_rank2_test(*_noisy_argmax(rng, 2000, sigma), 0.05, noise=sigma).rejected
               for _ in range(300))
    assert hits / 300 <= 0.08


@pytest.mark.parametrize("temperature,least", [(0.01, 0.85), (0.05, 0.99)])
def test_power_against_a_small_temperature_sampler(temperature, least):
    """50 near-ties, margins uniform on [0, 0.1], rank 2 taken with probability
    sigmoid(−m / T), noise 1e-3: measured power 0.94 at T = 0.01, 1.00 at T = 0.05 on these
    200 seeded datasets."""
    rng = np.random.default_rng(1)
    hits = 0
    for _ in range(200):
        m = rng.uniform(0, 0.1, 50)
        c = rng.random(50) < 1 / (1 + np.exp(m / temperature))
        hits += near_tie_rank2_test(m, c, 0.05, noise=1e-3).rejected
    assert hits / 200 >= least


def test_temperature_is_recovered_from_many_near_ties():
    rng = np.random.default_rng(4)
    m = rng.uniform(0, 0.2, 20000)
    c = rng.random(len(m)) < 1 / (1 + np.exp(m / 0.03))
    assert near_tie_rank2_test(m, c).temperature == pytest.approx(0.03, rel=0.1)
    assert math.isnan(near_tie_rank2_test([0.0, 0.0], [True, False]).temperature)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="same length"):
        near_tie_rank2_test([0.1], [True, False])
    with pytest.raises(ValueError, match="finite"):
        near_tie_rank2_test([math.nan], [True])
    with pytest.raises(ValueError, match="noise"):
        near_tie_rank2_test([0.1], [True], noise=-1)
