"""Exact ties in a top-k, ordered the one way every engine must order them: as greedy argmax
breaks them (the lowest token id first). Servers list tied entries in an arbitrary order
(vLLM 0.26's top-k on a three-way bf16 tie: 3895, 3023, 312 -- greedy chose 312), so without
one order the same numbers would give different ranks, agreement and classes depending on
which engine stored them."""
from __future__ import annotations

import math
from typing import Iterable

import numpy as np


def canonical_topk(pairs: Iterable[tuple[int, float]], k: int | None = None) -> list[tuple[int, float]]:
    """``(token id, logprob)`` pairs best first, exact ties by lowest id, NaN logprobs last;
    the first ``k`` (all when None)."""
    items = [(int(t), float(lp)) for t, lp in pairs]
    items.sort(key=lambda x: (math.isnan(x[1]), -x[1] if not math.isnan(x[1]) else 0.0, x[0]))
    return items if k is None else items[:k]


def canonical_rows(topk_ids, topk_logprobs) -> tuple[np.ndarray, np.ndarray]:
    """Each row of a top-k (``[n, k]`` ids and logprobs) in the canonical order of
    :func:`canonical_topk`; dtypes kept."""
    ids, lps = np.asarray(topk_ids), np.asarray(topk_logprobs)
    if ids.shape != lps.shape or ids.ndim != 2:
        raise ValueError(f"canonical_rows: ids and logprobs must both be [n, k], got {ids.shape} and {lps.shape}")
    if ids.size == 0:
        return ids, lps
    key = np.where(np.isnan(lps), np.inf, -lps.astype(np.float64))
    order = np.lexsort((ids, key), axis=-1)  # by -logprob, then by id (NaN last)
    return np.take_along_axis(ids, order, -1), np.take_along_axis(lps, order, -1)
