"""Divergences with their evidence: the first divergence of two free-running streams, and
every divergence of a spec stream from the baseline's teacher-forced choices."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from speccheck.verify.margins import (Classification, classify_divergence,
                                      classify_sampled_divergence, margins)
from speccheck.verify.streams import first_divergence

END = -1  # token id recorded for a side whose stream had already ended at the position


@dataclass(frozen=True)
class Divergence:
    """One position where spec and baseline chose different tokens, and why we think so.

    ``noise`` is the path noise the thresholds were calibrated with; ``margin_in_noise`` is
    the baseline margin as a multiple of it (inf when noise is 0). A token of ``END`` (-1)
    means that side's stream had already stopped there (always high_confidence: streams
    should include their stop token). ``context`` is a decoded window, filled by the caller.
    """

    prompt_id: str
    position: int
    base_token: int
    spec_token: int
    classification: Classification
    noise: float
    margin_in_noise: float
    base_topk: list[tuple[int, float]]
    spec_topk: list[tuple[int, float]]
    context: str = ""

    @property
    def cls(self) -> str:
        return self.classification.cls


def _topk(ids, lp, name: str) -> tuple[np.ndarray, np.ndarray]:
    ids, lp = np.asarray(ids), np.asarray(lp)
    if ids.size == 0 and lp.size == 0:  # an empty stream: any width will do
        return ids.reshape(0, 0), lp.reshape(0, 0)
    if ids.ndim != 2 or ids.shape != lp.shape or ids.shape[1] < 2:
        raise ValueError(f"{name}: top-k ids and logprobs must both be [n, k] with k >= 2, "
                         f"got {ids.shape} and {lp.shape}")
    return ids, lp


def _pairs(ids_row, lp_row) -> list[tuple[int, float]]:
    return list(zip(np.asarray(ids_row).tolist(), np.asarray(lp_row, dtype=np.float64).tolist()))


def _in_noise(margin: float, noise: float) -> float:
    if noise == 0:
        return math.nan if math.isnan(margin) else math.inf
    return margin / noise


def _make(prompt_id, pos, bt, st, b_ids, b_lp, s_ids, s_lp, tau_tie, tau_low, noise,
          max_gap, sampled: bool = False) -> Divergence:
    if bt == END or st == END:  # one stream stopped: nothing to weigh the other token against
        bm = float(margins(b_lp)) if bt != END else math.nan
        sm = float(margins(s_lp)) if st != END else math.nan
        c = Classification("high_confidence", bm, sm, None, None)
    elif sampled:
        c = classify_sampled_divergence(b_ids, b_lp, s_ids, s_lp, tau_tie, tau_low)
    else:
        c = classify_divergence(bt, st, b_ids, b_lp, s_ids, s_lp, tau_tie, tau_low, max_gap)
    return Divergence(
        prompt_id=prompt_id, position=int(pos), base_token=int(bt), spec_token=int(st),
        classification=c, noise=float(noise), margin_in_noise=_in_noise(c.base_margin, float(noise)),
        base_topk=_pairs(b_ids, b_lp) if bt != END else [],
        spec_topk=_pairs(s_ids, s_lp) if st != END else [],
    )


def find_divergences(prompt_id: str, base_tokens, base_topk_ids, base_topk_lp,
                     spec_tokens, spec_topk_ids, spec_topk_lp,
                     tau_tie: float, tau_low: float, noise: float,
                     max_gap: float | None = None, sampled: bool = False) -> list[Divergence]:
    """The first divergence of two free-running greedy streams, classified; [] when the
    streams are identical. Only the first: past it the two continue from different
    contexts and stop being comparable (teacher forcing goes on — see
    :func:`teacher_forced_divergences`). ``sampled``: two sampled runs of one seed, classified
    by how far their distributions there differ (classify_sampled_divergence)."""
    base_tokens, spec_tokens = np.asarray(base_tokens), np.asarray(spec_tokens)
    b_ids, b_lp = _topk(base_topk_ids, base_topk_lp, "baseline")
    s_ids, s_lp = _topk(spec_topk_ids, spec_topk_lp, "spec")
    if len(b_ids) != len(base_tokens) or len(s_ids) != len(spec_tokens):
        raise ValueError("find_divergences: each stream needs one top-k row per token "
                         f"(baseline {len(base_tokens)} tokens / {len(b_ids)} rows, "
                         f"spec {len(spec_tokens)} tokens / {len(s_ids)} rows)")
    if base_tokens.ndim == spec_tokens.ndim == 1 and np.array_equal(base_tokens, spec_tokens):
        return []
    p = first_divergence(base_tokens, spec_tokens)
    if p is None:
        return []
    bt = int(base_tokens[p]) if p < len(base_tokens) else END
    st = int(spec_tokens[p]) if p < len(spec_tokens) else END
    row = lambda a, present: a[p] if present else a[:0]  # noqa: E731
    return [_make(prompt_id, p, bt, st, row(b_ids, bt != END), row(b_lp, bt != END),
                  row(s_ids, st != END), row(s_lp, st != END), tau_tie, tau_low, noise, max_gap,
                  sampled)]


def teacher_forced_agreement(spec_tokens: np.ndarray, scored_topk_ids: np.ndarray) -> np.ndarray:
    """Per position of the spec output, whether the baseline — scoring ``prompt + spec
    output`` teacher-forced — would have chosen the same token: ``scored_topk_ids[i, 0] ==
    spec_tokens[i]``. Unlike prefix agreement this goes on past the first divergence."""
    spec_tokens = np.asarray(spec_tokens).ravel()
    ids = np.asarray(scored_topk_ids)
    if ids.size == 0 and len(spec_tokens) == 0:
        return np.zeros(0, dtype=bool)
    if ids.ndim != 2 or len(ids) != len(spec_tokens) or ids.shape[1] < 1:
        raise ValueError(f"teacher_forced_agreement: scored top-k must be [n, k] with n = "
                         f"{len(spec_tokens)} spec tokens, got shape {ids.shape}")
    return ids[:, 0] == spec_tokens


def below_floor_p(agree: int, total: int, floor: float) -> float:
    """One-sided binomial p-value that a share of ``agree`` of ``total`` comes from an agreement
    rate of at least ``floor``: P(X <= agree) for X ~ Binomial(total, floor). A share below the
    floor over a few dozen tokens (two near-tie flips in 61) is not evidence of a rate below it;
    over thousands of tokens it is."""
    if total <= 0 or agree >= total * floor:
        return 1.0
    return binom_cdf(agree, total, floor)


def binom_cdf(k: int, n: int, q: float) -> float:
    """P(X <= k) for X ~ Binomial(n, q), summed in log space."""
    if k >= n:
        return 1.0
    if k < 0:
        return 0.0
    if q >= 1.0:
        return 0.0
    if q <= 0.0:
        return 1.0
    lq, lp = math.log(q), math.log1p(-q)
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
             + i * lq + (n - i) * lp for i in range(k + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def teacher_forced_divergences(prompt_id: str, spec_tokens, spec_topk_ids, spec_topk_lp,
                               scored_topk_ids, scored_topk_lp,
                               tau_tie: float, tau_low: float, noise: float,
                     max_gap: float | None = None) -> list[Divergence]:
    """Every position where the baseline's teacher-forced argmax differs from the spec token,
    classified like :func:`find_divergences` (baseline side = the scored top-k; both sides
    saw the same context, so every position is comparable)."""
    spec_tokens = np.asarray(spec_tokens).ravel()
    s_ids, s_lp = _topk(spec_topk_ids, spec_topk_lp, "spec")
    b_ids, b_lp = _topk(scored_topk_ids, scored_topk_lp, "scored baseline")
    if not len(s_ids) == len(b_ids) == len(spec_tokens):
        raise ValueError("teacher_forced_divergences: spec tokens, spec top-k and scored top-k "
                         f"must have the same length, got {len(spec_tokens)}, {len(s_ids)}, {len(b_ids)}")
    agree = teacher_forced_agreement(spec_tokens, b_ids)
    return [_make(prompt_id, i, int(b_ids[i, 0]), int(spec_tokens[i]), b_ids[i], b_lp[i],
                  s_ids[i], s_lp[i], tau_tie, tau_low, noise, max_gap)
            for i in np.flatnonzero(~agree)]


def detectable_agreement(n: int, floor: float, alpha: float, power: float = 0.8) -> float | None:
    """The highest agreement rate whose n-token sample the one-sided binomial test of
    :func:`below_floor_p` would put below ``floor`` at ``alpha`` with probability ``power``
    (the smallest shortfall it detects); None when no count of n is significant."""
    if n <= 0:
        return None
    lo, hi = -1, n  # the largest count k with below_floor_p(k) < alpha, by bisection
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if below_floor_p(mid, n, floor) < alpha:
            lo = mid
        else:
            hi = mid
    if lo < 0:
        return None
    a, b = 0.0, floor  # P(X <= lo | rate) falls as the rate rises
    for _ in range(60):
        mid = (a + b) / 2
        if binom_cdf(lo, n, mid) >= power:
            a = mid
        else:
            b = mid
    return a
