"""Temperature 0 means argmax: every chosen token is the top-1 of the engine's own reported
distribution at that position.

A speculative path that samples (a temperature that leaked through, a rejection sampler run at
temperature 0 with a non-zero epsilon, a drafter token accepted without checking it is the
target's argmax) still emits plausible text, and its choices differ from argmax only where
the top two are close -- so output comparisons excuse them as near-ties. The engine's own
logprobs give it away: the token it chose must be its own best, position by position
(:func:`argmax_violations`), and across a run the near-ties must all have gone to rank 1
(:func:`near_tie_rank2_test`); a sampler at temperature T takes rank 2 at margin m with
probability sigmoid(-m / T).

Top-k rows follow the store's conventions: best first, exact ties by lowest id (what greedy
argmax picks), padded slots hold id -1 and logprob -inf and are ignored here.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

#: nats below the reported top-1 a chosen token may sit and still count as the argmax:
#: reporting noise only (the logprob of a float32 log-softmax of the logits greedy argmax saw).
#: It is under bf16's resolution at any usual logit size (spacing 1/32 nats from |logit| 4), so
#: a real rank-2 pick in a bf16 model is never inside it.
ARGMAX_TOL = 1e-3
#: nats: the margin (top-1 minus top-2) up to which a position is a near-tie for the rank-2 test
NEAR_TIE_TAU = 0.1


@dataclass(frozen=True)
class ArgmaxViolation:
    """A position whose chosen token is not its own top-1: ``token`` and its logprob (NaN when
    outside the top-k and not otherwise reported), the top-1 ``top1`` and its logprob."""

    position: int
    token: int
    top1: int
    chosen_logprob: float
    top1_logprob: float
    in_topk: bool

    @property
    def gap(self) -> float:
        """How far below the top-1 the chosen token was (nats; NaN when unknown)."""
        return self.top1_logprob - self.chosen_logprob

    def __str__(self) -> str:
        if not self.in_topk:
            where = "outside the top-k" + ("" if math.isnan(self.chosen_logprob)
                                           else f" (logprob {self.chosen_logprob:.4f})")
            return (f"position {self.position}: chose {self.token}, {where}; top-1 was "
                    f"{self.top1} at {self.top1_logprob:.4f}")
        return (f"position {self.position}: chose {self.token} at {self.chosen_logprob:.4f}, "
                f"{self.gap:.4f} nats below the top-1 {self.top1} at {self.top1_logprob:.4f}")


@dataclass(frozen=True)
class ArgmaxCheck:
    """One completion judged: ``violations`` (chosen below its own top-1 by more than
    ``tol``, or outside the top-k), ``unjudged`` positions (no real top-k entry to judge
    by), and ``tie_breaks``: positions whose token tied the top-1 exactly but was not the
    lowest id of the tie (within tolerance, so not a violation; argmax would have taken the
    lowest id)."""

    n: int
    tol: float
    violations: tuple[ArgmaxViolation, ...]
    unjudged: tuple[int, ...]
    tie_breaks: tuple[int, ...]

    @property
    def positions(self) -> list[int]:
        return [v.position for v in self.violations]

    @property
    def ok(self) -> bool:
        return not self.violations


def _rows(token_ids, topk_ids, topk_logprobs) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Tokens [n], top-k ids and logprobs [n, k] in canonical order (best first, ties by
    lowest id, non-entries last with NaN logprob), and which entries are real."""
    tok = np.asarray(token_ids, dtype=np.int64).ravel()
    ids = np.asarray(topk_ids, dtype=np.int64)
    lps = np.asarray(topk_logprobs, dtype=np.float64)
    if ids.ndim != 2 or ids.shape != lps.shape:
        raise ValueError(f"top-k ids and logprobs must both be [n, k], got {ids.shape} and {lps.shape}")
    n = len(tok)
    if ids.shape[0] < n:  # missing rows: nothing to judge there
        pad = n - ids.shape[0]
        ids = np.concatenate([ids, np.full((pad, ids.shape[1]), -1, np.int64)])
        lps = np.concatenate([lps, np.full((pad, lps.shape[1]), -np.inf)])
    ids, lps = ids[:n], lps[:n]
    real = (ids >= 0) & ~np.isnan(lps) & (lps > -np.inf)
    key = np.where(real, -lps, np.inf)
    order = np.lexsort((np.where(real, ids, np.iinfo(np.int64).max), key), axis=-1)
    ids, lps, real = (np.take_along_axis(a, order, -1) for a in (ids, np.where(real, lps, np.nan), real))
    return tok, ids, lps, real


def argmax_violations(token_ids, topk_ids, topk_logprobs, logprobs=None,
                      tol: float = ARGMAX_TOL) -> ArgmaxCheck:
    """Positions where the chosen token is not the engine's own top-1: its logprob is below
    the top-1's by more than ``tol``, or it is absent from the top-k (the engine listed k
    tokens it found likelier or as likely). ``logprobs`` (the chosen tokens' own reported
    logprobs) only adds the figure to a violation whose token is outside the top-k."""
    if not tol >= 0:
        raise ValueError(f"tol must be >= 0, got {tol}")
    tok, ids, lps, real = _rows(token_ids, topk_ids, topk_logprobs)
    if ids.shape[1] == 0:
        return ArgmaxCheck(len(tok), tol, (), tuple(range(len(tok))), ())
    own = None if logprobs is None else np.asarray(logprobs, dtype=np.float64).ravel()
    judged = real[:, 0]
    hit = real & (ids == tok[:, None])
    in_topk = hit.any(axis=1)
    first = hit.argmax(axis=1)
    rows = np.arange(len(tok))
    chosen = np.where(in_topk, lps[rows, first], np.nan)
    top1 = lps[:, 0]
    with np.errstate(invalid="ignore"):
        bad = judged & (~in_topk | (chosen < top1 - tol))
        ties = judged & in_topk & (chosen == top1) & (first > 0)
    out = []
    for i in np.flatnonzero(bad):
        lp = chosen[i]
        if not in_topk[i] and own is not None and i < len(own):
            lp = own[i]
        out.append(ArgmaxViolation(int(i), int(tok[i]), int(ids[i, 0]), float(lp), float(top1[i]),
                                   bool(in_topk[i])))
    return ArgmaxCheck(len(tok), tol, tuple(out), tuple(int(i) for i in np.flatnonzero(~judged)),
                       tuple(int(i) for i in np.flatnonzero(ties)))


@dataclass(frozen=True)
class ArgmaxSummary:
    """A run's argmax evidence: judged ``positions``, ``violations`` (count), and the
    near-ties (margin ≤ ``tau`` between the two best real entries): their ``margins`` and,
    for each, whether the chosen token was the rank-2 one (``chose_rank2``)."""

    positions: int
    violations: int
    tau: float
    margins: np.ndarray
    chose_rank2: np.ndarray

    @property
    def near_ties(self) -> int:
        return len(self.margins)

    @property
    def near_tie_rank2(self) -> int:
        return int(self.chose_rank2.sum())


def _parts(c: Any) -> tuple:
    if hasattr(c, "token_ids"):
        return c.token_ids, c.topk_ids, c.topk_logprobs, getattr(c, "logprobs", None)
    return (*c, None)[:4]


def argmax_summary(completions: Iterable[Any], tau: float = NEAR_TIE_TAU,
                   tol: float = ARGMAX_TOL) -> ArgmaxSummary:
    """:func:`argmax_violations` over a run, and its near-ties. Each completion is anything
    with ``token_ids``, ``topk_ids``, ``topk_logprobs`` (``logprobs`` optional), or a tuple
    ``(token_ids, topk_ids, topk_logprobs)``."""
    positions = violations = 0
    ms, r2 = [], []
    for c in completions:
        tokens, tids, tlps, own = _parts(c)
        check = argmax_violations(tokens, tids, tlps, own, tol)
        positions += check.n - len(check.unjudged)
        violations += len(check.violations)
        tok, ids, lps, real = _rows(tokens, tids, tlps)
        if ids.shape[1] < 2:
            continue
        two = real[:, 0] & real[:, 1]
        margin = lps[:, 0] - lps[:, 1]
        near = two & (margin <= tau)
        ms.append(margin[near])
        r2.append(tok[near] == ids[near, 1])
    margins = np.concatenate(ms) if ms else np.zeros(0)
    rank2 = np.concatenate(r2) if r2 else np.zeros(0, bool)
    return ArgmaxSummary(positions, violations, tau, margins.astype(np.float64), rank2.astype(bool))


@dataclass(frozen=True)
class Rank2Test:
    """Near-ties that went to rank 2, against what argmax with reporting noise allows:
    ``expected`` such choices under that null, ``p`` the probability of at least ``rank2``
    of them, ``rejected`` when p < alpha. ``temperature``: the temperature of a sampler
    that best explains the choices (maximum likelihood; 0 when there were none, NaN when
    the margins cannot tell)."""

    near_ties: int
    rank2: int
    expected: float
    noise: float
    p: float
    alpha: float
    rejected: bool
    temperature: float


def _poisson_binomial_sf(q: np.ndarray, r: int) -> float:
    """P(X ≥ r) for X a sum of independent Bernoulli(q_i): the tail kept as its own cell, so
    a tiny p-value is not lost to 1 − (1 − p)."""
    if r <= 0:
        return 1.0
    if r > len(q):
        return 0.0
    dp = np.zeros(r + 1)
    dp[0] = 1.0
    for qi in q:
        tail = dp[r] + dp[r - 1] * qi
        dp[1:r] = dp[1:r] * (1.0 - qi) + dp[:r - 1] * qi
        dp[0] *= 1.0 - qi
        dp[r] = tail
    return float(min(1.0, dp[r]))


def _temperature(m: np.ndarray, c: np.ndarray) -> float:
    """Maximum-likelihood T of P(rank 2) = sigmoid(−m / T) (golden section on log T)."""
    if not c.any():
        return 0.0
    if not (m > 0).any():
        return math.nan

    def nll(log_t: float) -> float:
        z = m / math.exp(log_t)
        # -log sigmoid(-z) for rank 2, -log sigmoid(z) for rank 1
        return float(np.sum(np.where(c, np.logaddexp(0.0, z), np.logaddexp(0.0, -z))))

    lo, hi = math.log(1e-6), math.log(1e3)
    g = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = nll(a), nll(b)
    for _ in range(120):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = nll(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = nll(b)
    return math.exp(0.5 * (lo + hi))


def near_tie_rank2_test(margins_of_near_ties, chose_rank2, alpha: float = 0.01,
                        noise: float = 0.0) -> Rank2Test:
    """How surprising are this many rank-2 choices at near-ties if decoding was argmax?

    The null: every token was the argmax of the logits the engine decided on, and the reported
    logprobs differ from those by reporting noise, the reported margin off by a normal error
    of sd ``noise`` nats. A rank-2 choice then happens only where the noise swapped the
    reported order, which at reported margin m has probability Φ(−m / noise) (a flat prior on
    the true margin near 0). With ``noise`` 0 (the engine reports the very logprobs it took
    the argmax of, and ties go to the lowest id as the top-k orders them) that probability
    is 0, and any rank-2 choice at all is conclusive (p = 0). The count is Poisson-binomial
    under the null; ``p`` is its exact upper tail."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if not noise >= 0:
        raise ValueError(f"noise must be >= 0, got {noise}")
    m = np.asarray(margins_of_near_ties, dtype=np.float64).ravel()
    c = np.asarray(chose_rank2, dtype=bool).ravel()
    if m.shape != c.shape:
        raise ValueError(f"margins and chose_rank2 must have the same length, got {m.shape} and {c.shape}")
    if (~np.isfinite(m)).any() or (m < 0).any():
        raise ValueError("near-tie margins must be finite and >= 0 (top-1 minus top-2)")
    if noise == 0:
        q = np.zeros_like(m)
    else:
        q = np.array([0.5 * math.erfc(x / noise / math.sqrt(2.0)) for x in m])
    r = int(c.sum())
    p = _poisson_binomial_sf(q, r)
    return Rank2Test(len(m), r, float(q.sum()), noise, p, alpha, bool(p < alpha), _temperature(m, c))
