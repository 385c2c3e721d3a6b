"""Comparing token streams: first divergence, prefix agreement, determinism, unique
completions, text similarity.

A token stream is a 1-D array of token ids (one prompt, one run). Everything here is a
pure function of such arrays; nothing knows which engine produced them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np


def _stream(x, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be a 1-D token stream, got shape {a.shape}")
    return a


def first_divergence(a: np.ndarray, b: np.ndarray) -> int | None:
    """First position where the two streams differ.

    Over the common length this is the first unequal token; if the streams agree there but
    one is longer, it is ``min(len(a), len(b))`` (one stream stopped, the other went on).
    ``None`` iff the streams are identical (same length, same tokens).
    """
    a, b = _stream(a, "a"), _stream(b, "b")
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    if len(diff):
        return int(diff[0])
    return None if len(a) == len(b) else n


class PrefixAgreement(NamedTuple):
    """``matched`` positions before the first divergence out of ``compared`` =
    ``max(len(a), len(b))`` positions (so a stream that stops early, or runs on, counts
    every position it lacks as a disagreement)."""

    matched: int
    compared: int

    @property
    def fraction(self) -> float:
        """matched / compared; 1.0 for two empty streams. Equals 1.0 iff the streams are
        identical."""
        return 1.0 if self.compared == 0 else self.matched / self.compared


def prefix_agreement(a: np.ndarray, b: np.ndarray) -> PrefixAgreement:
    """Prefix agreement = matched positions before the first divergence / positions compared,
    with positions compared = ``max(len(a), len(b))``. Returns ``(matched, compared)`` (a
    NamedTuple; ``.fraction`` gives the ratio)."""
    a, b = _stream(a, "a"), _stream(b, "b")
    p = first_divergence(a, b)
    compared = max(len(a), len(b))
    return PrefixAgreement(compared if p is None else p, compared)


def unique_completions(streams: Sequence[np.ndarray]) -> int:
    """Number of distinct token streams (N identical concurrent requests must give 1)."""
    return len({tuple(np.asarray(s).ravel().tolist()) for s in streams})


def text_similarity(a: str, b: str) -> float:
    """rapidfuzz normalized Indel similarity of two decoded texts, in [0, 1] (1 = equal)."""
    from rapidfuzz.distance import Indel  # here, so that importing verify/ needs no rapidfuzz

    return float(Indel.normalized_similarity(a, b))


@dataclass(frozen=True)
class DeterminismResult:
    """Whether every run of one config produced the same tokens as run 0 on every prompt,
    and the same logprobs where the tokens are the same.

    ``mismatches`` holds ``(run index, prompt index, first differing position)`` for each
    run ≥ 1 and prompt whose stream differs from run 0's. ``logprob_mismatches`` holds
    ``(run index, prompt index, first position, max |Δ logprob|)`` where the tokens agree but
    their logprobs differ by more than the tolerance: a kernel whose reduction order varies
    run to run moves every logprob while it flips tokens only at near-ties, so the logprobs
    show it for certain where the tokens show it by luck. With fewer than two runs nothing
    was compared and ``identical`` is vacuously True; check ``n_runs``.
    """

    identical: bool
    n_runs: int
    n_prompts: int
    mismatches: tuple[tuple[int, int, int], ...]
    logprob_mismatches: tuple[tuple[int, int, int, float], ...] = ()

    @property
    def logprobs_identical(self) -> bool:
        return not self.logprob_mismatches


def determinism(runs: Sequence[Sequence[np.ndarray]],
                logprobs: Sequence[Sequence[np.ndarray]] | None = None,
                logprob_tolerance: float = 0.0) -> DeterminismResult:
    """Compare runs × prompts token streams of one config against the first run; with
    ``logprobs`` (runs × prompts chosen-token logprobs) also the logprobs of the positions
    before the first token difference (|Δ| > ``logprob_tolerance`` is a mismatch)."""
    runs = [list(r) for r in runs]
    if not runs:
        return DeterminismResult(True, 0, 0, ())
    n_prompts = len(runs[0])
    for i, r in enumerate(runs):
        if len(r) != n_prompts:
            raise ValueError(
                f"determinism: run {i} has {len(r)} prompts but run 0 has {n_prompts}; "
                "compare runs over the same prompt list, in the same order")
    lps = [list(r) for r in logprobs] if logprobs is not None else None
    if lps is not None and [len(r) for r in lps] != [len(r) for r in runs]:
        raise ValueError("determinism: logprobs must have the same runs × prompts as the tokens")
    mismatches, lp_mismatches = [], []
    for ri, run in enumerate(runs[1:], start=1):
        for pi, (ref, got) in enumerate(zip(runs[0], run)):
            if (logprob_tolerance >= 0 and np.array_equal(ref, got) and np.ndim(ref) == 1
                    and (lps is None or np.array_equal(lps[0][pi], lps[ri][pi]))):
                continue  # the same tokens and logprobs, bit for bit: nothing to report
            p = first_divergence(ref, got)
            if p is not None:
                mismatches.append((ri, pi, p))
            if lps is None:
                continue
            a, b = np.asarray(lps[0][pi], np.float64), np.asarray(lps[ri][pi], np.float64)
            n = min(len(ref), len(got), len(a), len(b)) if p is None else min(p, len(a), len(b))
            d = np.abs(a[:n] - b[:n])
            d = np.where(np.isnan(d), np.inf, d)  # a NaN on one side only is a difference
            d[np.isnan(a[:n]) & np.isnan(b[:n])] = 0.0
            bad = np.flatnonzero(d > logprob_tolerance)
            if len(bad):
                lp_mismatches.append((ri, pi, int(bad[0]), float(d.max())))
    return DeterminismResult(not mismatches, len(runs), n_prompts, tuple(mismatches),
                             tuple(lp_mismatches))
