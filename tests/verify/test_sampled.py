"""verify/sampled.py against independent oracles (scipy) and its invariants (hypothesis)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from speccheck.verify.sampled import fit, holm, kolmogorov_sf, ks_uniform, two_sided_normal_p


@pytest.mark.parametrize("n", [20, 50, 200, 2000])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ks_matches_scipy(n, seed):
    rng = np.random.default_rng(seed)
    u = rng.random(n) ** 1.3  # some departure, so p spans a range
    d, p = ks_uniform(u)
    ref = stats.kstest(u, "uniform")
    assert d == pytest.approx(ref.statistic, abs=1e-12)
    assert p == pytest.approx(ref.pvalue, abs=0.02)


@pytest.mark.parametrize("x", [0.3, 0.6, 0.9, 1.0, 1.2, 1.8, 2.5])
def test_kolmogorov_sf_matches_scipy(x):
    assert kolmogorov_sf(x) == pytest.approx(stats.kstwobign.sf(x), abs=1e-9)


@pytest.mark.parametrize("z", [0.0, 0.5, 1.96, -2.5, 4.0])
def test_normal_p_matches_scipy(z):
    assert two_sided_normal_p(z) == pytest.approx(2 * stats.norm.sf(abs(z)), rel=1e-9)


@given(st.lists(st.floats(0, 1), min_size=1, max_size=12), st.floats(1e-4, 0.5))
def test_holm_is_step_down_and_controls(ps, alpha):
    rej = holm(ps, alpha)
    # every rejected p is below every kept one, and a rejection needs p <= alpha
    if any(rej) and not all(rej):
        assert max(p for p, r in zip(ps, rej) if r) <= min(p for p, r in zip(ps, rej) if not r)
    assert all(p <= alpha for p, r in zip(ps, rej) if r)
    # Bonferroni's rejections are a subset of Holm's
    assert all(r for p, r in zip(ps, rej) if p <= alpha / len(ps))


def _draws(rng, n_out, n_pos, vocab=12, tilt=0.0, reuse=False):
    """Scores of outputs sampled from random categorical distributions (tilt > 0: drawn from
    p ** (1 + tilt) renormalised instead of p; reuse: one uniform per output)."""
    outs = []
    for _ in range(n_out):
        rows, u0 = [], rng.random()
        for _ in range(n_pos):
            p = rng.dirichlet(np.full(vocab, 0.5))
            q = p ** (1 + tilt)
            q /= q.sum()
            order = np.argsort(-p, kind="stable")
            c = np.cumsum(q[order])
            u = u0 if reuse else rng.random()
            tok = order[min(np.searchsorted(c, u * c[-1]), vocab - 1)]
            pt = p[tok]
            logp = np.log(p)
            rows.append([p[p > pt].sum(), p[p == pt].sum(), pt, (p * logp).sum(), (p * logp ** 2).sum()])
        outs.append(np.array(rows))
    return outs


def test_clean_draws_pass_and_pit_is_uniform():
    rng = np.random.default_rng(7)
    f = fit(_draws(rng, 20, 50), alpha=0.01)
    assert f.passed, f
    assert f.positions == 1000 and f.outputs == 20
    assert abs(f.z_loglik) < 4 and abs(f.z_serial) < 4
    assert 0 < f.mde_tv < 0.1 and f.mde_nats > 0


def test_false_alarm_rate_at_most_alpha_over_seeds():
    """The family-wise test's false alarms on exact draws, over 40 seeds, stay within what a
    binomial(40, alpha = 0.05) allows at 1e-3."""
    alarms = sum(not fit(_draws(np.random.default_rng(s), 10, 30), alpha=0.05).passed for s in range(40))
    assert alarms <= stats.binom.ppf(0.999, 40, 0.05)


def test_sharpened_sampler_is_caught():
    f = fit(_draws(np.random.default_rng(3), 20, 50, tilt=0.5), alpha=0.01)
    assert not f.passed and "loglik_martingale" in f.rejected


def test_reused_uniform_is_caught():
    f = fit(_draws(np.random.default_rng(4), 20, 50, reuse=True), alpha=0.01)
    assert not f.passed and "pit_independent" in f.rejected


def test_outside_support_fails_and_boundary_is_tolerated():
    rng = np.random.default_rng(5)
    outs = _draws(rng, 10, 40)
    edge = [o.copy() for o in outs]
    edge[0][3, 2] = -0.002  # one token at the nucleus boundary (the scorer's mark)
    assert fit(edge).passed and fit(edge).boundary == 1
    bad = [o.copy() for o in outs]
    bad[0][3, :3] = [1.0, 0.0, 0.0]  # probability 0 under the target
    f = fit(bad)
    assert not f.passed and "support" in f.rejected and f.outside_support == 1


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000))
def test_pit_in_unit_interval_and_deterministic(seed):
    outs = _draws(np.random.default_rng(seed), 2, 5)
    a, b = fit(outs), fit(outs)
    assert a.ks_d == b.ks_d and 0 <= a.ks_d <= 1 and sum(a.pit_hist) == a.positions
    assert math.isfinite(a.z_loglik)


def test_the_pit_is_seeded_by_the_scores_themselves():
    """The same scores give the same verdict; other scores draw other uniforms (a fixed seed
    would lay the same uniforms on every store, so each store's false-alarm rate would be
    conditional on them, not alpha)."""
    a = _draws(np.random.default_rng(11), 5, 40)
    b = [s.copy() for s in a]
    b[0][0, 2] = np.nextafter(b[0][0, 2], 1.0)  # one probability, one ulp apart
    assert fit(a).ks_d == fit([s.copy() for s in a]).ks_d
    assert fit(a).ks_d != fit(b).ks_d


def test_a_one_token_nucleus_is_not_a_pit_sample():
    """A position whose nucleus is one token (nothing above it, all the mass tied with it)
    has a PIT that is the uniform alone: it is counted as a position but enters neither the
    KS nor the lag-1 test, and a store of only such positions tests nothing there."""
    one = np.array([[0.0, 1.0, 1.0, 0.0, 0.0]] * 30)
    f = fit([one])
    assert f.positions == 30 and sum(f.pit_hist) == 0 and f.ks_p == 1.0 and f.z_serial == 0.0
    clean = _draws(np.random.default_rng(5), 4, 30)
    mixed = fit([np.vstack([c, one[:10]]) for c in clean])
    assert mixed.positions == 160 and sum(mixed.pit_hist) == 120
