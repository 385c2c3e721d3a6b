"""Acceptance judged statistically, two-sided, with prompts as the unit of sampling.

A run's acceptance figures are sums over prompts, and prompts differ far more from each other
than drafts within one prompt do (code accepts more than prose; a prompt's drafts share its
context). So the draft is not the independent unit: treating 700 drafts as 700 coin flips
makes every machine-to-machine wobble "significant". Here each per-position rate is the ratio
estimator Σ_prompts accepted_j / Σ_prompts drafts, its variance the cluster (linearised,
delta-method) variance over prompts, and comparisons are two-sided: acceptance that *rose*
is as much a sign that the drafter or the verifier changed as acceptance that fell.

With the same prompts on both sides (a golden of the same corpus), the comparison is paired:
each prompt's own difficulty cancels and the variance is that of the per-prompt differences.
Positions and tokens/iteration form one family, held to ``alpha`` by Holm's step-down.

At temperature 0 there is also an exact version: replaying the drafter over the baseline's
own tokens predicts every step's acceptance, so counts either match or do not
(:func:`exact_acceptance_mismatch`).

Pure numpy and ``math``: the t distribution is computed here (tests check it against scipy).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from speccheck.verify.roots import last_true

#: below this many prompts with drafts a cluster variance means little: results say inconclusive
MIN_PROMPTS = 5
#: a standard error at or below this counts as zero (rates live in [0, 1]; float residue is ~1e-17)
_ZERO_SE = 1e-12


# ------------------------------------------------------------------ input

@dataclass(frozen=True)
class PromptCounts:
    """One run's spec counters, prompt by prompt: ``drafts`` [n] and ``accepted`` [n, K]
    (accepted count at draft position j, 0-based as in ``SpecCounters.accepted_per_pos``);
    ``prompts`` names the rows when known (paired comparisons align on them)."""

    drafts: np.ndarray
    accepted: np.ndarray
    prompts: tuple[str, ...] | None = None

    @property
    def n(self) -> int:
        return len(self.drafts)

    @property
    def k(self) -> int:
        return int(self.accepted.shape[1])


def _row(item: Any) -> tuple[int, list[int]]:
    if item is None:
        raise ValueError("a prompt has no spec counters (None): acceptance needs every prompt's")
    if hasattr(item, "drafts") and hasattr(item, "accepted_per_pos"):
        return int(item.drafts), [int(x) for x in item.accepted_per_pos]
    drafts, per = item
    return int(drafts), [int(x) for x in per]


def prompt_counts(per_prompt: Any) -> PromptCounts:
    """A :class:`PromptCounts` from what a caller has: one already; a mapping {prompt id:
    counters}; or a sequence of counters, each a ``SpecCounters``-like object (``drafts``,
    ``accepted_per_pos``) or a ``(drafts, accepted_per_pos)`` pair. Ragged per-position lists
    are padded with zeros (as ``SpecCounters.__add__`` does). Raises ValueError on counters
    that cannot be (negative, a position accepted more often than there were drafts)."""
    if isinstance(per_prompt, PromptCounts):
        return per_prompt
    names = None
    if isinstance(per_prompt, Mapping):
        names = tuple(str(p) for p in per_prompt)
        items = list(per_prompt.values())
    else:
        items = list(per_prompt)
    rows = [_row(x) for x in items]
    k = max((len(p) for _, p in rows), default=0)
    drafts = np.array([d for d, _ in rows], dtype=np.int64)
    acc = np.zeros((len(rows), k), dtype=np.int64)
    for i, (_, p) in enumerate(rows):
        acc[i, :len(p)] = p
    bad = [i for i in range(len(rows)) if drafts[i] < 0 or (acc[i] < 0).any() or (acc[i] > drafts[i]).any()]
    if bad:
        which = ", ".join(names[i] if names else str(i) for i in bad[:5])
        raise ValueError(f"impossible spec counters for prompt(s) {which}: a negative count or a "
                         "position accepted more often than there were drafts")
    return PromptCounts(drafts, acc, names)


def _widen(c: PromptCounts, k: int) -> np.ndarray:
    return np.pad(c.accepted, ((0, 0), (0, k - c.k))) if c.k < k else c.accepted


# ------------------------------------------------------------------ distributions (no scipy)

def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbt = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
           + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lbt) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbt) * _betacf(b, a, 1.0 - x) / b


def _t_two_sided(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom (normal for df = inf)."""
    if math.isinf(t):
        return 0.0
    if math.isinf(df) or df > 1e7:
        return math.erfc(abs(t) / math.sqrt(2.0))
    return _betainc(df / 2.0, 0.5, df / (df + t * t))


def _t_cdf(t: float, df: float) -> float:
    p = 0.5 * _t_two_sided(t, df)
    return p if t < 0 else 1.0 - p


def _t_ppf(q: float, df: float) -> float:
    """The q-quantile of Student's t (bisection on the tail; ~1e-12 relative)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile level must be in (0, 1), got {q}")
    if q == 0.5:
        return 0.0
    if q < 0.5:
        return -_t_ppf(1.0 - q, df)
    tail = 2.0 * (1.0 - q)  # two-sided tail at the wanted point
    return last_true(lambda t: _t_two_sided(t, df) > tail, 1.0, 1e-13, 200)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error ≤ alpha when the adjusted p ≤
    alpha), in the input order. NaN stays NaN and does not count in the family."""
    p = [float(x) for x in p_values]
    live = sorted((x, i) for i, x in enumerate(p) if not math.isnan(x))
    m = len(live)
    out = [math.nan] * len(p)
    running = 0.0
    for rank, (x, i) in enumerate(live):
        running = max(running, min(1.0, (m - rank) * x))
        out[i] = running
    return out


# ------------------------------------------------------------------ estimates

@dataclass(frozen=True)
class Estimate:
    """A ratio estimate with its prompt-clustered standard error and two-sided interval
    (NaN throughout when there is nothing to estimate: no drafts)."""

    value: float
    se: float
    low: float
    high: float


@dataclass(frozen=True)
class AcceptanceInterval:
    """One run's acceptance with uncertainty: per draft position the rate Σ accepted_j /
    Σ drafts, and tokens/iteration 1 + Σ accepted / Σ drafts, each with a (1 − alpha)
    t interval (df = prompts − 1) from the cluster variance over prompts. ``inconclusive``
    (with ``reason``) when there are no drafts or fewer than ``min_prompts`` prompts drafted:
    the estimates are then still given (NaN without drafts) but no interval is claimed."""

    prompts: int
    drafts: int
    alpha: float
    per_pos: tuple[Estimate, ...]
    tokens_per_iter: Estimate
    inconclusive: bool
    reason: str


def _ratio_parts(drafts: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """Ratio Σy/Σx and each prompt's linearised contribution (y_i − R x_i) / Σx (the
    influence of prompt i on R, whose sum of squares is the delta-method variance)."""
    x = drafts.astype(np.float64)
    total = float(x.sum())
    r = float(y.sum()) / total
    return r, (y - r * x) / total


def _se(contrib: np.ndarray) -> float:
    """Cluster standard error from per-prompt contributions (n/(n−1) small-sample factor)."""
    n = len(contrib)
    if n < 2:
        return math.nan
    se = math.sqrt(n / (n - 1) * float(np.sum(contrib * contrib)))
    return 0.0 if se <= _ZERO_SE else se


def _check_alpha(alpha: float) -> None:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")


def _check_min(min_prompts: int) -> None:
    if min_prompts < 2:
        raise ValueError(f"min_prompts must be at least 2 (a variance needs two prompts), got {min_prompts}")


def acceptance_interval(per_prompt: Any, alpha: float = 0.05,
                        min_prompts: int = MIN_PROMPTS) -> AcceptanceInterval:
    """Acceptance of one run with prompt-clustered two-sided intervals at level 1 − alpha.

    Prompts without drafts carry no information about acceptance and do not count as
    clusters. Intervals are clipped to what the figure can be ([0, 1]; [1, K + 1])."""
    _check_alpha(alpha)
    _check_min(min_prompts)
    c = prompt_counts(per_prompt)
    has = c.drafts > 0
    x, acc = c.drafts[has], c.accepted[has]
    n, total = int(has.sum()), int(x.sum())
    k = c.k
    if total == 0:
        nan = Estimate(math.nan, math.nan, math.nan, math.nan)
        return AcceptanceInterval(n, 0, alpha, (nan,) * k, nan, True, "no drafts: acceptance is undefined")
    reason = "" if n >= min_prompts else f"only {n} prompt(s) with drafts (fewer than {min_prompts})"
    tq = _t_ppf(1.0 - alpha / 2.0, n - 1) if n >= 2 else math.nan

    def est(y: np.ndarray, lo_cap: float, hi_cap: float, shift: float = 0.0) -> Estimate:
        r, contrib = _ratio_parts(x, y)
        se = _se(contrib)
        if reason or math.isnan(se):
            return Estimate(r + shift, se, math.nan, math.nan)
        return Estimate(r + shift, se, max(lo_cap, r + shift - tq * se), min(hi_cap, r + shift + tq * se))

    per = tuple(est(acc[:, j].astype(np.float64), 0.0, 1.0) for j in range(k))
    tpi = est(acc.sum(axis=1).astype(np.float64), 1.0, 1.0 + k, shift=1.0)
    return AcceptanceInterval(n, total, alpha, per, tpi, bool(reason), reason)


# ------------------------------------------------------------------ comparison

@dataclass(frozen=True)
class Difference:
    """Observed minus expected for one figure (a position's rate or tokens/iteration):
    ``diff`` and ``relative`` (diff / expected; NaN where expected is 0), ``se`` and ``df``
    of the t test, ``low``/``high`` a simultaneous (Bonferroni over the family) interval
    of the difference, ``p`` the raw two-sided p-value, ``p_holm`` Holm's adjusted one.
    ``direction``: "fell" / "rose" when ``p_holm`` ≤ alpha, "same" when not,
    "inconclusive" when the data cannot say (then p is NaN)."""

    name: str
    expected: float
    observed: float
    diff: float
    relative: float
    se: float
    df: float
    low: float
    high: float
    p: float
    p_holm: float
    direction: str


@dataclass(frozen=True)
class AcceptanceComparison:
    """Run B (observed) against run A (expected): tokens/iteration (``overall``) and every
    draft position, one Holm family of K + 1 tests at ``alpha``. ``prompts``: the clusters
    on each side (paired: the shared prompts, both entries equal); ``unmatched``: prompts of
    either side left out of a paired comparison because the other side lacks them."""

    paired: bool
    alpha: float
    prompts: tuple[int, int]
    unmatched: int
    overall: Difference
    per_pos: tuple[Difference, ...]
    inconclusive: bool
    reason: str

    @property
    def differs(self) -> bool:
        """Any figure of the family moved (either way) beyond chance."""
        return any(d.direction in ("fell", "rose") for d in (self.overall, *self.per_pos))

    @property
    def fell(self) -> bool:
        return any(d.direction == "fell" for d in (self.overall, *self.per_pos))

    @property
    def rose(self) -> bool:
        return any(d.direction == "rose" for d in (self.overall, *self.per_pos))


def _align(a: PromptCounts, b: PromptCounts) -> tuple[PromptCounts, PromptCounts, int]:
    """The same prompts, in the same order, on both sides (by name when both sides have
    names; else by position, which then must have equal lengths)."""
    if a.prompts is not None and b.prompts is not None:
        bi = {p: i for i, p in enumerate(b.prompts)}
        shared = [(i, bi[p]) for i, p in enumerate(a.prompts) if p in bi]
        ia = np.array([i for i, _ in shared], dtype=np.int64)
        ib = np.array([j for _, j in shared], dtype=np.int64)
        names = tuple(a.prompts[i] for i in ia)
        unmatched = a.n + b.n - 2 * len(shared)
        return (PromptCounts(a.drafts[ia], a.accepted[ia], names),
                PromptCounts(b.drafts[ib], b.accepted[ib], names), unmatched)
    if a.n != b.n:
        raise ValueError(f"a paired comparison needs the same prompts on both sides: {a.n} and "
                         f"{b.n} prompts, without prompt names to match them by")
    return a, b, 0


def _test(name: str, ea: float, eb: float, se: float, df: float, reason: str) -> tuple:
    """(name, expected, observed, diff, relative, se, df, p) of one figure."""
    diff = eb - ea
    rel = diff / ea if ea else math.nan
    if reason:
        p = math.nan
    elif se == 0.0:  # no variation between prompts: any difference is certain
        p = 0.0 if abs(diff) > _ZERO_SE else 1.0
    else:
        p = _t_two_sided(diff / se, df)
    return name, ea, eb, diff, rel, se, df, p


def _finish(rows: list[tuple], alpha: float, reason: str) -> list[Difference]:
    adj = holm([r[-1] for r in rows])
    m = len(rows)
    out = []
    for r, pa in zip(rows, adj):
        name, ea, eb, diff, rel, se, df, p = r
        if reason or math.isnan(p):
            out.append(Difference(name, ea, eb, diff, rel, se, df, math.nan, math.nan,
                                  math.nan, math.nan, "inconclusive"))
            continue
        half = 0.0 if se == 0.0 else _t_ppf(1.0 - alpha / (2.0 * m), df) * se
        direction = ("fell" if diff < 0 else "rose") if pa <= alpha else "same"
        out.append(Difference(name, ea, eb, diff, rel, se, df, diff - half, diff + half, p, pa, direction))
    return out


def compare_acceptance(a: Any, b: Any, alpha: float = 0.05, paired: bool = False,
                       min_prompts: int = MIN_PROMPTS) -> AcceptanceComparison:
    """Did acceptance move between run A (expected) and run B (observed), either way?

    Unpaired (different prompts, or the same prompts but no wish to pair): the difference of
    the two ratio estimates, variance the sum of the two cluster variances, Welch-
    Satterthwaite degrees of freedom. Paired (the same prompts on both sides, matched by
    name when both sides have names): prompt i's contribution is its influence on B's rate
    minus its influence on A's, so what a prompt does to both cancels; df = prompts − 1.
    A figure whose prompts show no variation at all is certain: equal rates are "same",
    different ones moved (p = 0). Inconclusive (never a silent pass) without drafts on a
    side or with fewer than ``min_prompts`` drafted prompts."""
    _check_alpha(alpha)
    _check_min(min_prompts)
    ca, cb = prompt_counts(a), prompt_counts(b)
    k = max(ca.k, cb.k)
    unmatched = 0
    if paired:
        ca, cb, unmatched = _align(ca, cb)
        keep = (ca.drafts > 0) | (cb.drafts > 0)
        ca = PromptCounts(ca.drafts[keep], ca.accepted[keep])
        cb = PromptCounts(cb.drafts[keep], cb.accepted[keep])
        na = nb = int(keep.sum())
    else:
        ca = PromptCounts(ca.drafts[ca.drafts > 0], ca.accepted[ca.drafts > 0])
        cb = PromptCounts(cb.drafts[cb.drafts > 0], cb.accepted[cb.drafts > 0])
        na, nb = ca.n, cb.n
    acc_a, acc_b = _widen(ca, k), _widen(cb, k)
    xa, xb = int(ca.drafts.sum()), int(cb.drafts.sum())
    reason = ""
    if xa == 0 or xb == 0:
        reason = "no drafts in " + " and ".join(s for s, x in (("A", xa), ("B", xb)) if x == 0)
    elif min(na, nb) < min_prompts:
        reason = f"only {min(na, nb)} prompt(s) with drafts (fewer than {min_prompts})"

    figures = [("tokens/iteration", acc_a.sum(axis=1), acc_b.sum(axis=1), 1.0)]
    figures += [(f"position {j + 1}", acc_a[:, j], acc_b[:, j], 0.0) for j in range(k)]
    rows = []
    for name, ya, yb, shift in figures:
        if xa == 0 or xb == 0:
            ea = float(ya.sum()) / xa + shift if xa else math.nan
            eb = float(yb.sum()) / xb + shift if xb else math.nan
            rows.append(_test(name, ea, eb, math.nan, math.nan, reason))
            continue
        ra, ia = _ratio_parts(ca.drafts, ya.astype(np.float64))
        rb, ib = _ratio_parts(cb.drafts, yb.astype(np.float64))
        if paired:
            se, df = _se(ib - ia), na - 1.0
        else:
            va, vb = _se(ia) ** 2, _se(ib) ** 2
            se = math.sqrt(va + vb)
            se = 0.0 if se <= _ZERO_SE else se
            den = (va * va / (na - 1) if na > 1 and va else 0.0) + (vb * vb / (nb - 1) if nb > 1 and vb else 0.0)
            df = (va + vb) ** 2 / den if den > 0 else float(max(min(na, nb) - 1, 1))
        rows.append(_test(name, ra + shift, rb + shift, se, df, reason))
    diffs = _finish(rows, alpha, reason)
    return AcceptanceComparison(paired, alpha, (na, nb), unmatched, diffs[0], tuple(diffs[1:]),
                                bool(reason), reason)


# ------------------------------------------------------------------ power

@dataclass(frozen=True)
class DetectableDrop:
    """The check's stated power: the smallest change of tokens/iteration that the overall
    test finds with probability ``power`` (``absolute`` in tokens/iteration, ``relative`` to
    the expected run's ``tokens_per_iter``), the test held to ``level`` = alpha / tests (the
    strictest step of Holm's procedure over ``tests`` figures). Normal-theory, with the
    observed cluster variance standing in for the variance under the change."""

    relative: float
    absolute: float
    tokens_per_iter: float
    se: float
    level: float
    power: float
    prompts: int
    paired: bool
    inconclusive: bool
    reason: str


def minimum_detectable_drop(a: Any, b: Any = None, alpha: float = 0.05, power: float = 0.8,
                            paired: bool = False, tests: int | None = None,
                            min_prompts: int = MIN_PROMPTS) -> DetectableDrop:
    """How big a fall of tokens/iteration :func:`compare_acceptance` would catch.

    With ``b``: the standard error of that very comparison (paired or not). Without: a
    future unpaired run of as many prompts with A's own per-prompt variance (SE × √2); a
    paired design needs both runs (its variance is that of the differences). ``tests``:
    the size of the Holm family (default K + 1, as :func:`compare_acceptance` uses).
    δ = (t_{1 − level/2} + t_{power}) × SE, t with the comparison's degrees of freedom."""
    _check_alpha(alpha)
    if not 0.0 < power < 1.0:
        raise ValueError(f"power must be in (0, 1), got {power}")
    ca = prompt_counts(a)
    if b is not None:
        cmp = compare_acceptance(ca, b, alpha, paired, min_prompts)
        k = len(cmp.per_pos)
        se, df, tpi, n = cmp.overall.se, cmp.overall.df, cmp.overall.expected, min(cmp.prompts)
        reason = cmp.reason
    else:
        if paired:
            raise ValueError("minimum_detectable_drop: a paired design's power needs both runs "
                             "(its variance is that of the per-prompt differences)")
        iv = acceptance_interval(ca, alpha, min_prompts)
        k, n, tpi = ca.k, iv.prompts, iv.tokens_per_iter.value
        se, df = iv.tokens_per_iter.se * math.sqrt(2.0), max(n - 1, 1)
        reason = iv.reason
    m = tests if tests is not None else k + 1
    level = alpha / max(m, 1)
    if reason or math.isnan(se):
        return DetectableDrop(math.nan, math.nan, tpi, se, level, power, n, paired, True,
                              reason or "no variance estimate")
    delta = (_t_ppf(1.0 - level / 2.0, df) + _t_ppf(power, df)) * se
    return DetectableDrop(delta / tpi, delta, tpi, se, level, power, n, paired, False, "")


# ------------------------------------------------------------------ exact (temperature 0)

@dataclass(frozen=True)
class CountMismatch:
    """One prompt whose counters differ from the replay's prediction: ``field`` is "drafts",
    "prompt" (present on one side only; counts are then None there) or the 0-based draft
    position whose accepted count differs."""

    prompt: str
    field: str | int
    expected: int | None
    observed: int | None

    def __str__(self) -> str:
        what = (self.field if isinstance(self.field, str)
                else f"accepted at draft position {self.field + 1}")
        return f"prompt {self.prompt}: {what} expected {self.expected}, observed {self.observed}"


def exact_acceptance_mismatch(expected_per_prompt: Any, observed_per_prompt: Any) -> list[CountMismatch]:
    """Where counts differ from what was predicted exactly ([] when none do).

    At temperature 0 an independent replay of the drafter over the baseline's own tokens
    predicts each verify step's acceptance exactly, so there is no sampling error to allow
    for: any differing count, drafts or accepted at a position, is a finding. Prompts are
    matched by name when both sides have names (one missing on a side is itself a
    mismatch), else by order (unequal lengths: the extra prompts are mismatches)."""
    ea, ob = prompt_counts(expected_per_prompt), prompt_counts(observed_per_prompt)
    k = max(ea.k, ob.k)
    acc_e, acc_o = _widen(ea, k), _widen(ob, k)
    if ea.prompts is not None and ob.prompts is not None:
        ie = {p: i for i, p in enumerate(ea.prompts)}
        io = {p: i for i, p in enumerate(ob.prompts)}
        names = list(ea.prompts) + [p for p in ob.prompts if p not in ie]
        pairs = [(p, ie.get(p), io.get(p)) for p in names]
    else:
        n = max(ea.n, ob.n)
        pairs = [(str(i), i if i < ea.n else None, i if i < ob.n else None) for i in range(n)]
    out: list[CountMismatch] = []
    for name, i, j in pairs:
        if i is None or j is None:
            out.append(CountMismatch(name, "prompt", None if i is None else int(ea.drafts[i]),
                                     None if j is None else int(ob.drafts[j])))
            continue
        if ea.drafts[i] != ob.drafts[j]:
            out.append(CountMismatch(name, "drafts", int(ea.drafts[i]), int(ob.drafts[j])))
        for pos in np.flatnonzero(acc_e[i] != acc_o[j]):
            out.append(CountMismatch(name, int(pos), int(acc_e[i, pos]), int(acc_o[j, pos])))
    return out
