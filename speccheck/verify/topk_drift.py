"""Verify-path drift in the whole top-k, paired by position, and the three-way decision every
escalating test shares (pass / inconclusive / fail) with the power it had.

The chosen token's logprob is a weak witness of a small drift: at a confident position it is
about 0 on every path, so its |Δ| is 0 whatever the kernel did. The other top-k entries
(logprobs of -3 to -15 nats) move with every logit and carry the drift at every position. So
per position the mean |Δ logprob| over the token ids both rows list, spec path against the
baseline's prefill path, is compared with the same figure of the baseline's own decode path,
at the positions where both saw the same context (up to and including the first divergence).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from speccheck.verify.logprobs import DeltaSummary, signed_rank_test_greater, summarize, typical_ratio

#: decisions of an escalating test
PASS, INCONCLUSIVE, FAIL = "pass", "inconclusive", "fail"


def decide(effect_over: bool, p: float, alpha: float, look_closer: float) -> str:
    """An effect beyond its limit at p < ``alpha`` fails; at ``alpha`` <= p < ``look_closer``
    it is inconclusive (too few data to say: more prompts decide); anything else passes."""
    if not effect_over or not p < look_closer:
        return PASS
    return FAIL if p < alpha else INCONCLUSIVE


def _z(q: float) -> float:
    """The standard normal quantile (Acklam's rational approximation, |error| < 1.2e-9)."""
    if not 0 < q < 1:
        raise ValueError(f"_z: q must be in (0, 1), got {q}")
    a = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02,
         1.383577518672690e02, -3.066479806614716e01, 2.506628277459239e00)
    b = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02,
         6.680131188771082e01, -1.328068155288572e01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00,
         -2.549732539343734e00, 4.374664141464968e00, 2.938163982698783e00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00)
    lo = 0.02425
    if q < lo:
        r = math.sqrt(-2 * math.log(q))
        return (((((c[0] * r + c[1]) * r + c[2]) * r + c[3]) * r + c[4]) * r + c[5]) / \
            ((((d[0] * r + d[1]) * r + d[2]) * r + d[3]) * r + 1)
    if q > 1 - lo:
        return -_z(1 - q)
    r = (q - 0.5) ** 2
    return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * (q - 0.5) / \
        (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)


def detectable_ratio(a, b, alpha: float, power: float = 0.8) -> float:
    """The smallest typical ratio a/b that a one-sided paired test at ``alpha`` would find
    with probability ``power`` on these pairs: exp((z_{1-alpha} + z_power) x sd / sqrt(n)) of
    the per-position log ratios (the t-test's figure; the signed-rank test's efficiency is
    about 0.95 of it). ``inf`` with fewer than 3 usable pairs."""
    x, y = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    with np.errstate(divide="ignore", invalid="ignore"):
        lr = np.log(x) - np.log(y)
    lr = lr[np.isfinite(lr)]
    if len(lr) < 3:
        return math.inf
    sd = float(np.std(lr, ddof=1))
    return float(math.exp((-_z(alpha) + _z(power)) * sd / math.sqrt(len(lr))))


def topk_abs_deltas(ids_a, lps_a, ids_b, lps_b) -> np.ndarray:
    """Per position (row), the mean |lp_a - lp_b| over the token ids both top-k rows list;
    NaN where they share none or a shared entry is not finite. Rows: [n, k] each."""
    ia, ib = np.asarray(ids_a), np.asarray(ids_b)
    la, lb = np.asarray(lps_a, dtype=np.float64), np.asarray(lps_b, dtype=np.float64)
    n = min(len(ia), len(ib), len(la), len(lb))
    if n == 0:
        return np.zeros(0)
    ia, ib, la, lb = ia[:n], ib[:n], la[:n], lb[:n]
    match = ia[:, :, None] == ib[:, None, :]
    with np.errstate(invalid="ignore"):
        d = np.abs(la[:, :, None] - lb[:, None, :])
    count = match.sum(axis=(1, 2))
    total = np.where(match, d, 0.0).sum(axis=(1, 2))
    with np.errstate(invalid="ignore", divide="ignore"):
        out = total / count
    return np.where(count > 0, out, np.nan)


def shared_context(spec_tokens, base_tokens) -> int:
    """Positions at which spec and baseline saw the same context: up to and including the
    first divergence (the whole shorter output where there is none)."""
    s, b = np.asarray(spec_tokens).ravel(), np.asarray(base_tokens).ravel()
    n = min(len(s), len(b))
    diff = np.flatnonzero(s[:n] != b[:n])
    return int(diff[0]) + 1 if len(diff) else n


@dataclass(frozen=True)
class TopkDrift:
    """The paired top-k test: ``spec`` and ``reference`` summarise the per-position mean
    |Δ| of the spec path and of the baseline's decode path against the same prefill rows;
    ``ratio`` the typical per-position ratio (Hodges-Lehmann of the log ratios), ``p`` the
    one-sided signed-rank p, ``detectable`` the smallest ratio it would find (80 % power),
    ``decision`` pass / inconclusive / fail (:func:`decide`)."""

    spec: DeltaSummary
    reference: DeltaSummary
    ratio: float
    p: float
    detectable: float
    max_ratio: float
    alpha: float
    look_closer: float
    decision: str

    @property
    def n(self) -> int:
        return self.spec.n


def _finite_pairs(a, b, who: str) -> tuple[np.ndarray, np.ndarray]:
    """The paired per-position values as float64, pairs with a non-finite side dropped."""
    x, y = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    if x.shape != y.shape:
        raise ValueError(f"{who}: paired arrays must have the same length, got {x.shape} "
                         f"and {y.shape}")
    keep = np.isfinite(x) & np.isfinite(y)
    return x[keep], y[keep]


def topk_drift_test(a, b, max_ratio: float, alpha: float, look_closer: float,
                    min_n: int = 20) -> TopkDrift:
    """Is the spec path's per-position top-k |Δ| (``a``) larger than the baseline decode
    path's (``b``) by more than ``max_ratio``, beyond chance? Pairs with a non-finite side are
    dropped; fewer than ``min_n`` pairs: pass with an infinite detectable ratio (the caller
    says so)."""
    if not max_ratio > 0 or not 0 < alpha <= look_closer <= 1:
        raise ValueError(f"topk_drift_test: need max_ratio > 0 and 0 < alpha <= look_closer <= 1, "
                         f"got {max_ratio}, {alpha}, {look_closer}")
    x, y = _finite_pairs(a, b, "topk_drift_test")
    if len(x) < min_n:
        return TopkDrift(summarize(x), summarize(y), math.nan, 1.0, math.inf, max_ratio, alpha,
                         look_closer, PASS)
    ratio = typical_ratio(x, y)
    p = signed_rank_test_greater(x, y)[1]
    return TopkDrift(summarize(x), summarize(y), ratio, p, detectable_ratio(x, y, alpha),
                     max_ratio, alpha, look_closer, decide(ratio > max_ratio, p, alpha, look_closer))


@dataclass(frozen=True)
class TailTest:
    """The rare-excursion test: over the positions where exactly one side's per-position |Δ|
    is above ``threshold`` (the pooled ``quantile`` of both sides), ``above`` times the spec
    path's and ``below`` times the baseline decode path's; ``odds`` = (above + 0.5) /
    (below + 0.5), ``p`` the one-sided exact sign (McNemar) test, ``detectable`` the smallest
    odds it finds 80 % of the time on as many discordant positions, ``decision`` as
    :func:`decide`."""

    quantile: float
    threshold: float
    above: int
    below: int
    odds: float
    p: float
    detectable: float
    max_odds: float
    alpha: float
    look_closer: float
    decision: str


def _upper_tail(k: int, n: int, q: float) -> float:
    """P(X >= k) for X ~ Binomial(n, q)."""
    from speccheck.verify.divergence import binom_cdf

    return 1.0 - binom_cdf(k - 1, n, q) if k > 0 else 1.0


def _sign_p(k: int, n: int) -> float:
    """One-sided exact sign test: P(X >= k), X ~ Binomial(n, 1/2), summed from the top."""
    if n == 0 or k <= 0:
        return 1.0
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) - n * math.log(2)
             for i in range(k, n + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def detectable_odds(discordant: int, alpha: float, power: float = 0.8) -> float:
    """The smallest odds above:below that the one-sided sign test at ``alpha`` finds with
    probability ``power`` over ``discordant`` positions (``inf`` when no count is significant)."""
    crit = next((k for k in range(discordant + 1) if _sign_p(k, discordant) < alpha), None)
    if crit is None:
        return math.inf
    lo, hi = 0.5, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if _upper_tail(crit, discordant, mid) >= power:
            hi = mid
        else:
            lo = mid
    return hi / (1 - hi) if hi < 1 else math.inf


def tail_exceedance_test(a, b, quantile: float, max_odds: float, alpha: float,
                         look_closer: float) -> TailTest:
    """Do the spec path's per-position |Δ| (``a``) exceed the pooled ``quantile`` more often
    than the baseline decode path's (``b``) at the same positions? Under a clean spec path the
    two sides of a pair are exchangeable, so of the positions where exactly one exceeds, each
    side's share is 1/2; a state wrong after rare steps, or a verify kernel off by a little,
    puts many more of the spec side's positions in the tail than the typical ratio shows."""
    if not 0 < quantile < 1 or not max_odds > 0 or not 0 < alpha <= look_closer <= 1:
        raise ValueError(f"tail_exceedance_test: need 0 < quantile < 1, max_odds > 0 and "
                         f"0 < alpha <= look_closer <= 1, got {quantile}, {max_odds}, {alpha}, {look_closer}")
    x, y = _finite_pairs(a, b, "tail_exceedance_test")
    if not len(x):
        return TailTest(quantile, math.nan, 0, 0, 1.0, 1.0, math.inf, max_odds, alpha, look_closer, PASS)
    t = float(np.quantile(np.concatenate([x, y]), quantile))
    above = int(np.count_nonzero((x > t) & (y <= t)))
    below = int(np.count_nonzero((y > t) & (x <= t)))
    odds = (above + 0.5) / (below + 0.5)
    p = _sign_p(above, above + below)
    return TailTest(quantile, t, above, below, odds, p, detectable_odds(above + below, alpha),
                    max_odds, alpha, look_closer, decide(odds > max_odds, p, alpha, look_closer))
