"""Logprobs that cannot be: non-finite, positive, missing, or a top-k out of order.

Every other check reads these arrays as numbers. A NaN compares false with everything, so a
margin or a |Δ| built on one passes any threshold silently; a short array raises an
IndexError far from its cause. This module names such problems, with positions, so the gate
can fail with a message instead of a traceback or a pass.

The store's top-k convention (engines/vllm.py ``topk_arrays``): rows best first, exact ties
by lowest id; where an engine returned fewer than k entries the trailing slots hold id -1 and
logprob -inf. That padding is legitimate; anything else non-finite is not.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: nats above 0 a logprob may reach before it counts as positive (float32 rounding of a
#: log-softmax at a certain token lands a few ulps either side of 0)
POSITIVE_TOL = 1e-4
#: nats the log of a top-k's probability mass may exceed 0 (each entry rounded to bf16 moves
#: it by well under 0.01)
MASS_TOL = 0.02
#: positions named in one message before "(+N more)"
LISTED = 5
PAD_ID = -1


@dataclass(frozen=True)
class LogprobProblem:
    """One kind of problem and every position (0-based generated position) it occurs at."""

    kind: str
    what: str
    positions: tuple[int, ...]

    def __str__(self) -> str:
        if not self.positions:
            return self.what
        shown = ", ".join(str(p) for p in self.positions[:LISTED])
        more = f" (+{len(self.positions) - LISTED} more)" if len(self.positions) > LISTED else ""
        word = "position" if len(self.positions) == 1 else "positions"
        return f"{self.what} at {word} {shown}{more}"


def _at(mask: np.ndarray) -> tuple[int, ...]:
    m = np.asarray(mask)
    if m.ndim > 1:
        m = m.any(axis=tuple(range(1, m.ndim)))
    return tuple(int(i) for i in np.flatnonzero(m))


def _none_from(have: int, n: int) -> str:
    if have >= n:
        return ""
    return f" (position {have} has none)" if have == n - 1 else f" (positions {have}-{n - 1} have none)"


def find_logprob_problems(token_ids, logprobs, topk_ids, topk_logprobs,
                          tol: float = POSITIVE_TOL) -> list[LogprobProblem]:
    """Every problem of one completion's logprobs ([] when none):

    - fewer (or more) chosen-token logprobs, or top-k rows, than tokens;
    - a chosen-token logprob that is NaN, ±inf, or above 0 by more than ``tol``, or above
      its own top-1's by more than ``tol`` (the top-k would not be the top);
    - in the top-k: NaN; +inf; -inf on a real token; a padded slot (id -1) with a logprob
      other than -inf, or before a real entry; a negative id other than -1; the same id twice;
      a row with no real entry; a logprob above 0 by more than ``tol``; entries not in
      descending order, or exact ties not ordered by lowest id; probabilities adding up to
      more than 1 (beyond rounding).
    """
    tok = np.asarray(token_ids).ravel()
    lp = np.asarray(logprobs, dtype=np.float64).ravel()
    ids = np.asarray(topk_ids)
    tlp = np.asarray(topk_logprobs, dtype=np.float64)
    n = len(tok)
    out: list[LogprobProblem] = []

    def add(kind: str, what: str, mask=None) -> None:
        pos = () if mask is None else _at(mask)
        if mask is None or pos:
            out.append(LogprobProblem(kind, what, pos))

    if len(lp) != n:
        gap = _none_from(len(lp), n)
        add("logprob_count", f"{len(lp)} chosen-token logprobs for {n} tokens{gap}")
    m = min(len(lp), n)
    own = lp[:m]
    add("logprob_nan", "chosen-token logprob is NaN", np.isnan(own))
    add("logprob_posinf", "chosen-token logprob is +inf", own == np.inf)
    add("logprob_neginf", "chosen-token logprob is -inf (probability 0 for a token it chose)",
        own == -np.inf)
    with np.errstate(invalid="ignore"):
        add("logprob_positive", f"chosen-token logprob above 0 (by more than {tol:g})",
            np.isfinite(own) & (own > tol))

    if ids.ndim != 2 or ids.shape != tlp.shape:
        add("topk_shape", f"top-k ids {ids.shape} and logprobs {tlp.shape} are not two [n, k] "
                          "arrays of one shape")
        return out
    if ids.shape[0] != n:
        gap = _none_from(ids.shape[0], n)
        add("topk_count", f"{ids.shape[0]} top-k rows for {n} tokens{gap}")
    r = min(ids.shape[0], n)
    ids, tlp = ids[:r].astype(np.int64), tlp[:r]
    if r and ids.shape[1] == 0:
        add("topk_empty", f"top-k has width 0: no entries for any of the {r} positions")
        return out
    pad = ids == PAD_ID
    real = ids >= 0
    add("topk_nan", "top-k logprob is NaN", np.isnan(tlp))
    add("topk_posinf", "top-k logprob is +inf", tlp == np.inf)
    add("topk_neginf", "top-k logprob is -inf for a real token (only padding, id -1, may be -inf)",
        real & (tlp == -np.inf))
    add("topk_bad_pad", "padded top-k slot (id -1) has a logprob other than -inf",
        pad & (tlp != -np.inf))
    add("topk_bad_id", "top-k id is negative (only -1, padding, may be)", ids < PAD_ID)
    if ids.shape[1] > 1:
        add("topk_pad_order", "padded top-k slot (id -1) comes before a real entry",
            pad[:, :-1] & real[:, 1:])
        srt = np.sort(np.where(real, ids, -1 - np.arange(ids.shape[1])), axis=1)
        add("topk_duplicate", "top-k lists the same token id twice", srt[:, 1:] == srt[:, :-1])
    add("topk_no_entry", "top-k row has no real entry", ~real.any(axis=1) if r else np.zeros(0, bool))
    fin = real & np.isfinite(tlp)
    with np.errstate(invalid="ignore", divide="ignore"):  # log(0): a row without a finite entry
        add("topk_positive", f"top-k logprob above 0 (by more than {tol:g})", fin & (tlp > tol))
        if ids.shape[1] > 1:
            both = fin[:, :-1] & fin[:, 1:]
            add("topk_order", "top-k not in descending logprob order", both & (tlp[:, 1:] > tlp[:, :-1]))
            add("topk_tie_order", "exactly tied top-k entries not ordered by lowest id (as argmax "
                                  "breaks ties)", both & (tlp[:, 1:] == tlp[:, :-1]) & (ids[:, 1:] < ids[:, :-1]))
        # probabilities add up to at most 1: a top-k whose mass is above (beyond bf16's rounding
        # of each entry) was not computed from one distribution
        mass = np.log(np.where(fin, np.exp(np.where(fin, tlp, -np.inf)), 0.0).sum(axis=1)) if r else np.zeros(0)
        add("topk_mass", f"top-k probabilities add up to more than 1 (log mass above {MASS_TOL:g})",
            mass > MASS_TOL)
        k = min(m, r)
        if k:
            top1 = np.where(fin[:k], tlp[:k], -np.inf).max(axis=1)
            add("logprob_above_top1", f"chosen-token logprob above its own top-1's (by more than "
                                      f"{tol:g}): the top-k is not the top",
                fin[:k].any(axis=1) & np.isfinite(own[:k]) & (own[:k] > top1 + tol))
    return out


def logprob_problems(token_ids, logprobs, topk_ids, topk_logprobs,
                     tol: float = POSITIVE_TOL) -> list[str]:
    """:func:`find_logprob_problems` as short messages naming positions ([] when none)."""
    return [str(p) for p in find_logprob_problems(token_ids, logprobs, topk_ids, topk_logprobs, tol)]
