"""Reported logprobs against the baseline's: one by one, as a distribution, and as flip counts.

Where spec and baseline saw the same context and chose the same token, the only thing that may
separate their logprobs is kernel-path noise. A spec path that loses precision (e.g. a state
carried between verify steps in a narrower dtype) flips tokens only at near-ties -- each flip
looks excusable -- but it moves *every* logprob a little. So the |Δ| of all agreeing positions
is compared, as a sample, with a sample of the engine's own path noise: the effect size (ratio
of quantiles) says whether the shift matters, a one-sided Mann-Whitney rank test says whether
it is more than chance (the Kolmogorov-Smirnov distance D+ is reported beside it). With
thousands of positions any difference is "significant", so both must hold before a config
fails. Where spec and baseline still share context and token (before a prompt's first
divergence) the two |Δ| are also compared position by position, against the same prefill
logprob: a paired signed-rank test, far more powerful on a small corpus because each
position's own sensitivity cancels.

Pure numpy; no scipy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: the quantiles a distribution of |Δ| is summarised by (and whose ratios are the effect size)
SUMMARY_QUANTILES = (0.5, 0.9, 0.99)
#: the quantiles the drift effect size is taken over: the bulk and the upper body, not the
#: extreme tail (a few positions near a softmax saturation say little about a path)
EFFECT_QUANTILES = (0.5, 0.9)


def abs_deltas(lp_a, lp_b) -> np.ndarray:
    """|lp_a - lp_b| (float64, flat) where both are finite."""
    a = np.asarray(lp_a, dtype=np.float64).ravel()
    b = np.asarray(lp_b, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise ValueError(f"abs_deltas: logprob arrays must have the same length, got {a.shape} and {b.shape}")
    with np.errstate(invalid="ignore"):
        d = np.abs(a - b)
    return d[np.isfinite(d)]


@dataclass(frozen=True)
class DeltaSummary:
    """A |Δ| sample in a few numbers (nats): size, median, p90, p99, max."""

    n: int
    median: float
    p90: float
    p99: float
    max: float

    def to_dict(self) -> dict:
        return {"n": self.n, "median": self.median, "p90": self.p90, "p99": self.p99, "max": self.max}


def summarize(sample) -> DeltaSummary:
    x = np.asarray(sample, dtype=np.float64).ravel()
    x = x[np.isfinite(x)]
    if not len(x):
        return DeltaSummary(0, math.nan, math.nan, math.nan, math.nan)
    q = np.quantile(x, SUMMARY_QUANTILES)
    return DeltaSummary(len(x), float(q[0]), float(q[1]), float(q[2]), float(x.max()))


def ks_greater(sample, reference) -> tuple[float, float]:
    """One-sided two-sample Kolmogorov-Smirnov test that ``sample`` is stochastically larger
    than ``reference``: ``D+ = sup_x (F_ref(x) - F_sample(x))`` and its asymptotic p-value
    ``exp(-2 n_e D+^2)`` with ``n_e = n m / (n + m)`` (Smirnov). ``(0.0, 1.0)`` when either
    sample is empty."""
    a = np.sort(np.asarray(sample, dtype=np.float64).ravel())
    b = np.sort(np.asarray(reference, dtype=np.float64).ravel())
    a, b = a[np.isfinite(a)], b[np.isfinite(b)]
    if not len(a) or not len(b):
        return 0.0, 1.0
    grid = np.concatenate([a, b])
    f_a = np.searchsorted(a, grid, side="right") / len(a)
    f_b = np.searchsorted(b, grid, side="right") / len(b)
    d = max(0.0, float(np.max(f_b - f_a)))
    n_e = len(a) * len(b) / (len(a) + len(b))
    return d, float(min(1.0, math.exp(-2.0 * n_e * d * d)))


def rank_test_greater(sample, reference) -> tuple[float, float]:
    """One-sided Mann-Whitney U test that ``sample`` is stochastically larger than
    ``reference``: ``(z, p)`` from the normal approximation with tie correction (mid-ranks).
    More powerful than KS for the shift a precision loss makes (every |Δ| a little larger).
    ``(0.0, 1.0)`` when either sample is empty or all values are tied."""
    a = np.asarray(sample, dtype=np.float64).ravel()
    b = np.asarray(reference, dtype=np.float64).ravel()
    a, b = a[np.isfinite(a)], b[np.isfinite(b)]
    n1, n2 = len(a), len(b)
    if not n1 or not n2:
        return 0.0, 1.0
    _, inv, counts = np.unique(np.concatenate([a, b]), return_inverse=True, return_counts=True)
    mid = np.cumsum(counts) - (counts - 1) / 2.0  # the mid-rank of each distinct value
    u = float(mid[inv[:n1]].sum()) - n1 * (n1 + 1) / 2.0
    n = n1 + n2
    var = n1 * n2 / 12.0 * ((n + 1) - float((counts ** 3 - counts).sum()) / (n * (n - 1)))
    if var <= 0:
        return 0.0, 1.0
    z = (u - n1 * n2 / 2.0) / math.sqrt(var)
    return z, 0.5 * math.erfc(z / math.sqrt(2.0))


@dataclass(frozen=True)
class DriftTest:
    """|Δ| of a spec path against a reference noise sample.

    ``ratio`` is the effect size: the largest of the quantile ratios spec/reference over
    :data:`EFFECT_QUANTILES`; ``ks`` the one-sided KS distance D+; ``p`` the one-sided
    Mann-Whitney p-value. ``drifted``: ratio > ``max_ratio`` and p < ``alpha`` (and enough
    positions on both sides)."""

    spec: DeltaSummary
    reference: DeltaSummary
    ratio: float
    ks: float
    p: float
    max_ratio: float
    alpha: float
    drifted: bool


def drift_test(sample, reference, max_ratio: float, alpha: float, min_n: int = 50) -> DriftTest:
    """Is ``sample`` (|Δ| of the spec path) shifted up against ``reference`` (|Δ| of the
    engine's own path noise) by more than ``max_ratio`` at the median or p90, with a one-sided
    rank-test p-value below ``alpha``? Fewer than ``min_n`` finite values on either side: never
    drifted (too little evidence either way; the caller says so)."""
    if not max_ratio > 0 or not 0 < alpha <= 1:
        raise ValueError(f"drift_test: max_ratio must be > 0 and alpha in (0, 1], got {max_ratio}, {alpha}")
    s = np.asarray(sample, dtype=np.float64).ravel()
    r = np.asarray(reference, dtype=np.float64).ravel()
    s, r = s[np.isfinite(s)], r[np.isfinite(r)]
    ss, rs = summarize(s), summarize(r)
    if len(s) < min_n or len(r) < min_n:
        return DriftTest(ss, rs, math.nan, 0.0, 1.0, max_ratio, alpha, False)
    qs, qr = np.quantile(s, EFFECT_QUANTILES), np.quantile(r, EFFECT_QUANTILES)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(qr > 0, qs / np.where(qr > 0, qr, 1.0), np.where(qs > 0, np.inf, 1.0))
    ratio = float(np.max(ratios))
    d = ks_greater(s, r)[0]
    p = rank_test_greater(s, r)[1]
    return DriftTest(ss, rs, ratio, d, p, max_ratio, alpha, bool(ratio > max_ratio and p < alpha))


@dataclass(frozen=True)
class FlipBudget:
    """Teacher-forced flips against what the path noise predicts.

    ``at_risk``: positions whose baseline margin is at most the noise level (the p99 of the
    noise sample); ``expected``: Σ over positions of P(noise ≥ margin), the noise sample's
    survival function at each margin; ``allowed``: the most flips the policy tolerates."""

    flips: int
    positions: int
    at_risk: int
    expected: float
    allowed: int

    @property
    def excess(self) -> bool:
        return self.flips > self.allowed


def flip_budget(margins, flips: int, noise_sample, multiple: float, slack: int) -> FlipBudget:
    """How many flips the noise explains: ``allowed = ceil(multiple × expected + slack ×
    sqrt(expected) + slack)`` -- a multiple of the expectation plus a Poisson-like allowance
    so that few expected flips still leave room for a handful. Positions with a non-finite
    margin are left out."""
    m = np.asarray(margins, dtype=np.float64).ravel()
    m = m[np.isfinite(m)]
    noise = np.sort(np.asarray(noise_sample, dtype=np.float64).ravel())
    noise = noise[np.isfinite(noise)]
    if len(noise):
        survival = 1.0 - np.searchsorted(noise, m, side="left") / len(noise)
        level = float(np.quantile(noise, 0.99))
    else:
        survival, level = np.zeros(len(m)), 0.0
    expected = float(survival.sum())
    at_risk = int(np.count_nonzero(m <= level))
    allowed = int(math.ceil(multiple * expected + slack * math.sqrt(expected) + slack))
    return FlipBudget(int(flips), len(m), at_risk, expected, allowed)


def signed_rank_test_greater(a, b) -> tuple[float, float]:
    """One-sided Wilcoxon signed-rank test that ``a`` is larger than its paired ``b``:
    ``(z, p)`` of ``T+`` (the rank sum of the positive ``a - b``) from the normal
    approximation with a continuity correction (half a rank: conservative), zeros handled as Pratt does (ranked with the rest, then left out of T+, the
    mean and the variance), tied |a - b| by mid-ranks with the tie correction. Exact enough
    for 20 or more pairs. Pairs with a non-finite side are dropped; ``(0.0, 1.0)`` when
    nothing but zeros is left."""
    x = np.asarray(a, dtype=np.float64).ravel()
    y = np.asarray(b, dtype=np.float64).ravel()
    if x.shape != y.shape:
        raise ValueError(f"signed_rank_test_greater: paired arrays must have the same length, "
                         f"got {x.shape} and {y.shape}")
    with np.errstate(invalid="ignore"):
        d = x - y
    d = d[np.isfinite(d)]
    n = len(d)
    zeros = int(np.count_nonzero(d == 0))
    if n == zeros:
        return 0.0, 1.0
    _, inv, counts = np.unique(np.abs(d), return_inverse=True, return_counts=True)
    rank = (np.cumsum(counts) - (counts - 1) / 2.0)[inv]  # mid-ranks of |d|, zeros ranked first
    t_plus = float(rank[d > 0].sum())
    mean = (n * (n + 1) - zeros * (zeros + 1)) / 4.0
    nonzero_ties = counts[1:] if zeros else counts  # the zeros form the first group of |d|
    var = ((n * (n + 1) * (2 * n + 1) - zeros * (zeros + 1) * (2 * zeros + 1)) / 24.0
           - float((nonzero_ties ** 3 - nonzero_ties).sum()) / 48.0)
    if var <= 0:
        return 0.0, 1.0
    z = (t_plus - mean - 0.5) / math.sqrt(var)
    return z, 0.5 * math.erfc(z / math.sqrt(2.0))


def hodges_lehmann(d) -> float:
    """The Hodges-Lehmann estimate of the shift of paired differences ``d``: the median of
    the Walsh averages ``(d_i + d_j) / 2`` over ``i <= j`` (the estimator that goes with the
    signed-rank test), selected without listing all n(n+1)/2 of them (:func:`_walsh_kth`).
    NaN for an empty sample."""
    x = np.sort(np.asarray(d, dtype=np.float64).ravel())
    x = x[np.isfinite(x)]
    n = len(x)
    if not n:
        return math.nan
    total = n * (n + 1) // 2
    k = total // 2 + 1
    if total % 2:
        return _walsh_kth(x, k)
    below = _walsh_kth(x, k - 1)
    return 0.5 * (below + _walsh_next(x, below, k))


#: at most this many Walsh averages are listed at once (then selected by np.partition)
_WALSH_LIST = 1 << 21
_WALSH_SAMPLE = 1 << 16


def _walsh_upto(x: np.ndarray, v: float, rows: np.ndarray | None = None) -> np.ndarray:
    """Per row i (all, or ``rows``) of the Walsh averages of sorted ``x`` (columns j >= i),
    the first column whose average ``0.5 * (x[i] + x[j])`` exceeds v (i where none is at or
    below v). The search for ``2 v - x[i]`` can be off by a rounding; the averages as
    computed are monotone in j, so the edge is moved until they say so."""
    n = len(x)
    rows = np.arange(n) if rows is None else rows
    xi = x[rows]
    edge = np.searchsorted(x, 2.0 * v - xi, side="right")
    while True:
        up = np.flatnonzero(edge < n)
        up = up[0.5 * (xi[up] + x[edge[up]]) <= v]
        edge[up] = np.searchsorted(x, x[edge[up]], side="right")
        down = np.flatnonzero(edge > 0)
        down = down[0.5 * (xi[down] + x[edge[down] - 1]) > v]
        edge[down] = np.searchsorted(x, x[edge[down] - 1], side="left")
        if not len(up) and not len(down):
            return np.maximum(edge, rows)


def _walsh_next(x: np.ndarray, v: float, k: int) -> float:
    """The k-th smallest Walsh average, given that the (k-1)-th is ``v``: v again when at least
    k averages are at or below it, else the smallest average above it."""
    edge = _walsh_upto(x, v)
    if int((edge - np.arange(len(x))).sum()) >= k:
        return v
    rows = np.flatnonzero(edge < len(x))
    return float(np.min(0.5 * (x[rows] + x[edge[rows]])))


def _walsh_kth(x: np.ndarray, k: int) -> float:
    """The k-th smallest (1-based) Walsh average of sorted, finite ``x``.

    The averages form a matrix sorted along rows and columns (row i holds j >= i), so how
    many lie at or below a value is one sorted search per row. Each round samples the
    averages still in play, takes two sample quantiles just either side of the wanted rank
    as new bounds and counts exactly below them: the averages in play shrink ~100-fold a
    round until few enough are left to list and partition. Exact whatever the sample (it only
    chooses the bounds); a value many averages share is caught when the sample repeats it.
    """
    n = len(x)
    rows = np.arange(n)  # rows with averages in play: columns [start, stop)
    start, stop = rows.copy(), np.full(n, n)
    below = 0  # averages below those in play
    rng = np.random.default_rng(0)
    last = None
    while True:
        keep = start < stop
        rows, start, stop = rows[keep], start[keep], stop[keep]
        width = stop - start
        cum = np.cumsum(width)
        m = int(cum[-1])
        if m <= _WALSH_LIST:
            at = np.repeat(np.arange(len(rows)), width)
            w = 0.5 * (x[rows[at]] + x[start[at] + np.arange(m) - (cum[at] - width[at])])
            return float(np.partition(w, k - below - 1)[k - below - 1])
        stalled, last = m == last, m
        pick = rng.integers(0, m, _WALSH_SAMPLE)
        at = np.searchsorted(cum, pick, side="right")
        sample = np.sort(0.5 * (x[rows[at]] + x[start[at] + pick - (cum[at] - width[at])]))
        q = (k - below) / m
        spread = 4.0 * math.sqrt(q * (1 - q) / _WALSH_SAMPLE) + 2.0 / _WALSH_SAMPLE
        s = len(sample)
        for v in (sample[max(int((q - spread) * s), 0)], sample[min(int(math.ceil((q + spread) * s)), s - 1)]):
            edge = np.clip(_walsh_upto(x, v, rows), start, stop)
            count = below + int((edge - start).sum())
            if count < k:  # the wanted average lies above v
                below, start = count, edge
                continue
            stop = edge
            if stalled or np.count_nonzero(sample == v) > 1:  # is v, a value shared, the answer?
                under = np.clip(_walsh_upto(x, np.nextafter(v, -np.inf), rows), start, stop)
                if below + int((under - start).sum()) < k:
                    return float(v)
                stop = under


def typical_ratio(a, b) -> float:
    """The paired effect size: how many times ``b[i]`` ``a[i]`` typically is -- exp of the
    Hodges-Lehmann estimate of log(a/b) over the pairs where both are positive (a pair with a
    0 has no ratio; the signed-rank test still counts it). Scale-true: ``a = c b`` gives
    exactly c, whatever the shape of b. 1.0 when no pair has both sides positive."""
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    both = (a > 0) & (b > 0) & np.isfinite(a) & np.isfinite(b)
    if not both.any():
        return 1.0
    return float(math.exp(hodges_lehmann(np.log(a[both]) - np.log(b[both]))))


@dataclass(frozen=True)
class PairedDriftTest:
    """|Δ| of the spec path against the baseline's own decode path at the same positions
    (same context, same token, same prefill reference): ``spec`` and ``reference`` summarise
    the two sides, ``ratio`` (the effect size) is :func:`typical_ratio` (a ratio of the two
    medians would say little: |Δ| is heavy-tailed and coarsely rounded, clean pairs on the
    reference engine's selftest corpus gave a median ratio of 1.76 at a typical per-position
    ratio of 1.00), ``p`` the one-sided Wilcoxon signed-rank p-value. ``drifted``: ratio > ``max_ratio`` and p <
    ``alpha`` (and at least ``min_n`` pairs)."""

    spec: DeltaSummary
    reference: DeltaSummary
    ratio: float
    p: float
    max_ratio: float
    alpha: float
    drifted: bool

    @property
    def n(self) -> int:
        return self.spec.n


def paired_drift_test(spec, reference, max_ratio: float, alpha: float,
                      min_n: int = 20) -> PairedDriftTest:
    """Is the spec path's |Δ| (``spec[i]``) larger than the baseline decode path's
    (``reference[i]``) position by position? Pairing removes what the two share -- the
    position's own sensitivity (a flat softmax moves more under any perturbation) -- which
    the unpaired :func:`drift_test` must carry as variance, so a drift shows on a few hundred
    positions rather than thousands. Pairs with a non-finite side are dropped; fewer than
    ``min_n`` pairs: never drifted."""
    if not max_ratio > 0 or not 0 < alpha <= 1:
        raise ValueError(f"paired_drift_test: max_ratio must be > 0 and alpha in (0, 1], "
                         f"got {max_ratio}, {alpha}")
    s = np.asarray(spec, dtype=np.float64).ravel()
    r = np.asarray(reference, dtype=np.float64).ravel()
    if s.shape != r.shape:
        raise ValueError(f"paired_drift_test: paired arrays must have the same length, "
                         f"got {s.shape} and {r.shape}")
    keep = np.isfinite(s) & np.isfinite(r)
    s, r = s[keep], r[keep]
    ss, rs = summarize(s), summarize(r)
    if len(s) < min_n:
        return PairedDriftTest(ss, rs, math.nan, 1.0, max_ratio, alpha, False)
    ratio = typical_ratio(s, r)
    p = signed_rank_test_greater(s, r)[1]
    return PairedDriftTest(ss, rs, ratio, p, max_ratio, alpha, bool(ratio > max_ratio and p < alpha))


def paired_deltas(spec_tokens, spec_lp, base_tokens, base_lp, prefill_lp) -> tuple[np.ndarray, np.ndarray]:
    """``(a, b)`` over the positions before the first divergence of the spec and baseline
    outputs of one prompt, where both saw the same context and emitted the same token:
    ``a = |spec-reported - prefill|``, ``b = |baseline decode-path - prefill|``, both against
    the baseline's teacher-forced (prefill-path) logprob ``prefill_lp`` of its own tokens."""
    st, bt = np.asarray(spec_tokens).ravel(), np.asarray(base_tokens).ravel()
    sl = np.asarray(spec_lp, dtype=np.float64).ravel()
    bl = np.asarray(base_lp, dtype=np.float64).ravel()
    pl = np.asarray(prefill_lp, dtype=np.float64).ravel()
    n = min(len(st), len(bt), len(sl), len(bl), len(pl))
    diff = np.flatnonzero(st[:n] != bt[:n])
    shared = int(diff[0]) if len(diff) else n
    with np.errstate(invalid="ignore"):
        return np.abs(sl[:shared] - pl[:shared]), np.abs(bl[:shared] - pl[:shared])
