"""Margins, ranks, path noise and the divergence classes near_tie / low_confidence /
high_confidence.

A divergence is only "explained by numerics" when both sides were nearly undecided: the
top-1/top-2 gap is small compared with how much the two kernel paths disagree on the very
same logprobs. Hence thresholds are derived from measured path noise
(:func:`calibrate_thresholds`), not fixed in nats.
"""
from __future__ import annotations

from dataclasses import dataclass

import math

import numpy as np

CLASSES = ("near_tie", "low_confidence", "high_confidence")  # from benign to failure
SEVERITY = {c: i for i, c in enumerate(CLASSES)}


def margins(topk_logprobs: np.ndarray) -> np.ndarray:
    """Top-1 minus top-2 logprob (nats) of each row of a top-k: ``[..., k] -> [...]``.

    Rows need not be sorted. k must be ≥ 2 (a margin needs a runner-up).
    """
    lp = np.asarray(topk_logprobs, dtype=np.float64)
    if lp.ndim < 1 or lp.shape[-1] < 2:
        raise ValueError(f"margins need top-k logprobs with k >= 2 in the last axis, got shape {lp.shape}")
    top2 = -np.sort(-lp, axis=-1)[..., :2]
    with np.errstate(invalid="ignore"):
        return top2[..., 0] - top2[..., 1]


def rank_of(token: int, topk_ids_row: np.ndarray) -> int | None:
    """0-based rank of ``token`` in one row of top-k ids, or None if it is not in the top-k."""
    ids, token = np.asarray(topk_ids_row).ravel().tolist(), int(token)
    return ids.index(token) if token in ids else None


@dataclass(frozen=True)
class Classification:
    """The class of one divergence and the evidence it rests on.

    Margins are each side's own top-1 minus top-2 (nats). Ranks are 0-based: the spec token's
    rank in the baseline's top-k and the baseline token's rank in the spec's top-k (None when
    outside). ``base_gap`` / ``spec_gap`` are how far each side put the other side's token
    below its own (lp(own token) - lp(other token), NaN when the other token is outside the
    top-k): evidence for reports, not used by the rule.
    """

    cls: str
    base_margin: float
    spec_margin: float
    spec_rank_in_base: int | None
    base_rank_in_spec: int | None
    base_gap: float = float("nan")
    spec_gap: float = float("nan")

    @property
    def severity(self) -> int:
        """0 near_tie, 1 low_confidence, 2 high_confidence."""
        return SEVERITY[self.cls]


def _row(x, name: str) -> np.ndarray:
    a = np.asarray(x).ravel()
    if len(a) < 2:
        raise ValueError(f"{name}: a top-k row needs k >= 2 entries, got {len(a)}")
    return a


def _gap(own: int, other: int, ids: np.ndarray, lp: np.ndarray) -> float:
    ro, rt = rank_of(own, ids), rank_of(other, ids)
    if ro is None or rt is None:
        return float("nan")
    return float(lp[ro]) - float(lp[rt])


def _second(rank: int, lp: np.ndarray) -> bool:
    """The token at ``rank`` is that side's runner-up: rank 2, or tied exactly with the
    runner-up's logprob (an exact tie, margin 0, is the closest near-tie whatever order the
    tied entries were listed in)."""
    if rank == 1:
        return True
    lp = np.asarray(lp, dtype=np.float64)
    return rank >= 1 and bool(lp[rank] >= np.sort(lp)[-2])


def classify_divergence(base_token: int, spec_token: int,
                        base_topk_ids: np.ndarray, base_topk_lp: np.ndarray,
                        spec_topk_ids: np.ndarray, spec_topk_lp: np.ndarray,
                        tau_tie: float, tau_low: float,
                        max_gap: float | None = None) -> Classification:
    """Classify one position where baseline and spec chose different tokens.

    - ``near_tie``: each token is in the other's top-k, and (baseline margin ≤ tau_tie and
      the spec token is the baseline's second choice) or (spec margin ≤ tau_tie and the
      baseline token is the spec's second choice); a token tied exactly with the second
      choice's logprob counts as second choice (an exact tie is the closest near-tie);
    - ``low_confidence``: each token is in the other's top-k and
      min(baseline margin, spec margin) ≤ tau_low;
    - ``high_confidence``: anything else — a failure. A token outside the other side's
      top-k is always high_confidence.

    ``max_gap`` (optional, off by default): also call high_confidence any divergence where a
    side put the other side's token more than ``max_gap`` nats below its own (``base_gap`` /
    ``spec_gap``). The margin rule alone lets one side's near-tie excuse a token the other
    side ranked far down, which kernel noise cannot explain.

    Symmetric under swapping baseline and spec; raising either tau never makes a class worse.
    """
    base_token, spec_token = int(base_token), int(spec_token)
    if base_token == spec_token:
        raise ValueError(f"classify_divergence: both sides chose token {base_token}; "
                         "identical tokens are not a divergence")
    b_ids, b_lp = _row(base_topk_ids, "base_topk_ids"), _row(base_topk_lp, "base_topk_lp")
    s_ids, s_lp = _row(spec_topk_ids, "spec_topk_ids"), _row(spec_topk_lp, "spec_topk_lp")
    if b_ids.shape != b_lp.shape or s_ids.shape != s_lp.shape:
        raise ValueError("classify_divergence: top-k ids and logprobs must have the same shape "
                         f"(base {b_ids.shape} vs {b_lp.shape}, spec {s_ids.shape} vs {s_lp.shape})")
    bm, sm = float(margins(b_lp)), float(margins(s_lp))
    s_in_b, b_in_s = rank_of(spec_token, b_ids), rank_of(base_token, s_ids)
    b_gap = _gap(base_token, spec_token, b_ids, b_lp)
    s_gap = _gap(spec_token, base_token, s_ids, s_lp)
    both_in = s_in_b is not None and b_in_s is not None
    # (an unknown gap, NaN, is not excused; max() would depend on the order of a NaN)
    if both_in and max_gap is not None and not (b_gap <= max_gap and s_gap <= max_gap):
        both_in = False
    if both_in and ((bm <= tau_tie and _second(s_in_b, b_lp)) or (sm <= tau_tie and _second(b_in_s, s_lp))):
        cls = "near_tie"
    elif both_in and min(bm, sm) <= tau_low:  # NaN margins compare False: high_confidence
        cls = "low_confidence"
    else:
        cls = "high_confidence"
    return Classification(cls, bm, sm, s_in_b, b_in_s, b_gap, s_gap)


def classify_sampled_divergence(base_topk_ids: np.ndarray, base_topk_lp: np.ndarray,
                                spec_topk_ids: np.ndarray, spec_topk_lp: np.ndarray,
                                tau_tie: float, tau_low: float) -> Classification:
    """Classify where two sampled runs of one request (the same seed) chose different tokens.

    At temperature > 0 the tokens are draws, so their margins say nothing; with one seed the
    draws differ only where the two runs' distributions at the shared prefix differ. Kernel
    numerics move them by about the path noise, and then a draw flips only when its random
    number lies that close to a boundary; a bug (state leaking between batch rows) moves them
    more. So the class is the largest |logprob difference| over the tokens both top-k hold:
    ``near_tie`` at most tau_tie, ``low_confidence`` at most tau_low, ``high_confidence``
    above, or with fewer than two tokens in common. ``base_gap`` carries that difference."""
    b_ids, b_lp = _row(base_topk_ids, "base_topk_ids"), _row(base_topk_lp, "base_topk_lp")
    s_ids, s_lp = _row(spec_topk_ids, "spec_topk_ids"), _row(spec_topk_lp, "spec_topk_lp")
    bm, sm = float(margins(b_lp)), float(margins(s_lp))
    spec_of = {int(t): float(x) for t, x in zip(s_ids, s_lp) if np.isfinite(x)}
    deltas = [abs(float(x) - spec_of[int(t)]) for t, x in zip(b_ids, b_lp)
              if np.isfinite(x) and int(t) in spec_of]
    shift = max(deltas) if len(deltas) >= 2 else math.inf
    cls = ("near_tie" if shift <= tau_tie else "low_confidence" if shift <= tau_low
           else "high_confidence")
    return Classification(cls, bm, sm, None, None, shift, math.nan)


def calibrate_thresholds(noise: float, policy_tie_multiple: float, policy_low_multiple: float,
                         tie_floor: float, low_floor: float) -> tuple[float, float]:
    """``(tau_tie, tau_low)`` with tau = max(floor, multiple × noise).

    Thresholds scale with the measured path noise (margins and kernel noise both scale with
    the logits), the floors keep them sane when the noise measured is ~0. tau_low is never
    below tau_tie.
    """
    for name, v in (("noise", noise), ("policy_tie_multiple", policy_tie_multiple),
                    ("policy_low_multiple", policy_low_multiple), ("tie_floor", tie_floor),
                    ("low_floor", low_floor)):
        if not np.isfinite(v) or v < 0:
            raise ValueError(f"calibrate_thresholds: {name} must be a finite number >= 0, got {v!r}")
    tau_tie = max(float(tie_floor), float(policy_tie_multiple) * float(noise))
    tau_low = max(float(low_floor), float(policy_low_multiple) * float(noise), tau_tie)
    return tau_tie, tau_low


def path_noise(lp_a: np.ndarray, lp_b: np.ndarray, q: float = 0.99) -> float:
    """How much two kernel paths disagree on the same tokens' logprobs: the q-quantile of
    |lp_a - lp_b| (e.g. a run's decode-path logprobs vs the teacher-forced prefill-path
    logprobs of the same positions). Non-finite differences (NaN, -inf on either side) are
    left out; 0.0 when nothing is left."""
    a = np.asarray(lp_a, dtype=np.float64)
    b = np.asarray(lp_b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"path_noise: logprob arrays must have the same shape, got {a.shape} and {b.shape}")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"path_noise: q must be in [0, 1], got {q}")
    with np.errstate(invalid="ignore"):
        d = np.abs(a - b).ravel()
    d = d[np.isfinite(d)]
    return float(np.quantile(d, q)) if len(d) else 0.0
