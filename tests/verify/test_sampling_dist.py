"""verify/sampling_dist.py: the sampling distribution from raw top-k logprobs, against the
exact distribution over the whole vocabulary (an oracle written as plainly as possible) and
its invariants (hypothesis)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from speccheck.verify.sampled import fit
from speccheck.verify.sampling_dist import TAIL_EPS, sampled_rows, transform_full


def _oracle(lp: np.ndarray, t: float, top_p: float, top_k: int) -> np.ndarray:
    """One row's sampling distribution, the slow obvious way (vLLM's order of operations)."""
    order = sorted(range(len(lp)), key=lambda i: (-lp[i], i))
    w = {i: np.exp(lp[i] / t) for i in order}
    kept = order[:top_k] if top_k else list(order)
    z = sum(w[i] for i in kept)
    nucleus, before = [], 0.0
    for i in kept:
        if top_p < 1 and before >= top_p * z:
            break
        nucleus.append(i)
        before += w[i]
    out = np.zeros(len(lp))
    for i in nucleus:
        out[i] = w[i]
    return out / out.sum()


def _logprobs(draw, v):
    logits = np.array(draw(st.lists(st.floats(-6, 6), min_size=v, max_size=v)))
    return logits - np.log(np.exp(logits).sum())


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_full_vocabulary_rows_are_exact(data):
    v = data.draw(st.integers(2, 24))
    lp = _logprobs(data.draw, v)
    t = data.draw(st.floats(0.2, 2.5))
    top_p = data.draw(st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.2]))
    top_k = data.draw(st.integers(0, v))
    tok = data.draw(st.integers(0, v - 1))
    pi = _oracle(lp, t, top_p, top_k)
    np.testing.assert_allclose(transform_full(lp, t, top_p, top_k), pi, atol=1e-12)
    row = sampled_rows(np.arange(v)[None], lp[None], np.array([tok]), t, top_p, top_k, v)[0]
    assert not np.isnan(row).any()
    if pi[tok] > 0:
        assert row[2] == pytest.approx(pi[tok], abs=1e-12)
        assert row[0] == pytest.approx(pi[pi > pi[tok]].sum(), abs=1e-12)
        assert row[1] == pytest.approx(pi[pi == pi[tok]].sum(), abs=1e-12)
    else:
        assert row[2] <= 0  # outside the support, or just outside the nucleus (negative)
    logs = np.log(pi[pi > 0])
    assert row[3] == pytest.approx((pi[pi > 0] * logs).sum(), abs=1e-10)
    assert row[4] == pytest.approx((pi[pi > 0] * logs ** 2).sum(), abs=1e-10)


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_top_k_rows_are_exact_and_the_kind_of_row_ignores_the_token(data):
    """From the top k only: an identified row gives each top-k token its exact probability and
    the tail its exact mass; where the nucleus is not identified, a token every possible
    nucleus keeps gets its exact probability *within* those tokens (column 5 = 1), a token no
    nucleus keeps is a miss, and the rest are left out. Whether a position is identified
    depends on its distribution, never on the token drawn."""
    v = data.draw(st.integers(6, 40))
    lp = _logprobs(data.draw, v)
    k = data.draw(st.integers(1, v - 1))
    t = data.draw(st.sampled_from([0.5, 0.7, 1.0, 1.3]))
    top_p = data.draw(st.sampled_from([1.0, 0.9, 0.6]))
    top_k = data.draw(st.sampled_from([0, 3, 10]))
    order = np.argsort(-lp, kind="stable")[:k]
    pi = _oracle(lp, t, top_p, top_k)
    rows = sampled_rows(np.tile(order, (v, 1)), np.tile(lp[order], (v, 1)), np.arange(v), t,
                        top_p, top_k, v)
    whole = ~np.isnan(rows[:, 2]) & (rows[:, 5] == 0) & (rows[:, 2] > 0)
    within = rows[:, 5] == 1
    assert not (whole.any() and within.any()), "identified or not: one answer per position"
    if t == 1.0 and top_p == 1.0 and top_k == 0:
        assert not within.any() and not np.isnan(rows[:, 2]).any()  # the tail's mass is exact
    tail = pi[np.setdiff1d(np.arange(v), order)].sum()
    for x in np.nonzero(whole)[0]:
        assert rows[x, 2] == pytest.approx(pi[x] if x in order else tail, abs=TAIL_EPS)
    if within.any():
        sure = within  # these tokens' exact share among themselves
        share = pi[sure] / pi[sure].sum()
        np.testing.assert_allclose(rows[sure, 2], share, atol=1e-9)
    for x in range(v):
        if pi[x] == 0 and not np.isnan(rows[x, 2]):
            assert rows[x, 2] <= 0  # never drawn: a miss (or a boundary case), never a pass


def test_t1_tail_is_lumped_last_with_its_raw_mass():
    lp = np.log(np.array([0.5, 0.2, 0.1, 0.1, 0.05, 0.05]))
    rows = sampled_rows(np.array([[0, 1]]), lp[None, :2], np.array([5]), 1.0)
    assert rows[0] == pytest.approx([0.7, 0.3, 0.3, 0.5 * np.log(0.5) + 0.2 * np.log(0.2)
                                     + 0.3 * np.log(0.3),
                                     0.5 * np.log(0.5) ** 2 + 0.2 * np.log(0.2) ** 2
                                     + 0.3 * np.log(0.3) ** 2, 0.0])


def test_a_near_tie_just_outside_the_nucleus_is_a_boundary_case_not_a_miss():
    """Tokens 1 and 2 nearly tie: the path that sampled may have put 2 first."""
    lp = np.log(np.array([0.80, 0.0951, 0.0949, 0.01]))
    lp -= np.log(np.exp(lp).sum())
    row = sampled_rows(np.arange(4)[None], lp[None], np.array([2]), 1.0, 0.85, 0, 4)[0]
    assert row[2] < 0  # excluded here, yet not outside the support
    far = sampled_rows(np.arange(4)[None], lp[None], np.array([3]), 1.0, 0.85, 0, 4)[0]
    assert far[2] == 0


@pytest.mark.parametrize("k", [4, 8, 64])
@pytest.mark.parametrize("t,top_p", [(0.7, 0.9), (1.0, 1.0), (1.0, 0.8)])
def test_lumped_pit_of_true_draws_is_uniform(k, t, top_p):
    """Draws from the exact distribution, scored from their top-k only: the PIT over the
    categories (tail lumped; within the sure top-k where the nucleus reaches past it) is
    uniform and the martingale centred (scipy's KS as oracle)."""
    rng = np.random.default_rng(k)
    v, n = 64, 3000
    logits = rng.normal(size=(n, v)) * 2.5
    lp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    pi = transform_full(lp, t, top_p)
    tok = np.array([rng.choice(v, p=r) for r in pi])
    order = np.argsort(-lp, 1, kind="stable")[:, :k]
    rows = sampled_rows(order, np.take_along_axis(lp, order, 1), tok, t, top_p, 0, v)
    f = fit([rows], 0.001)  # fixed seeds: a verdict at 1e-3 is a check of the maths, not luck
    assert f.positions > 300
    u = np.random.default_rng(1).random(len(rows))
    keep = ~np.isnan(rows[:, 2])
    pit = rows[keep, 0] + u[keep] * rows[keep, 1]
    assert stats.kstest(pit, "uniform").pvalue > 1e-3
    assert f.passed, f
