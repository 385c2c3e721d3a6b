"""Flips binned by margin: the evidence that two numerically different paths disagree only
where the answer was nearly undecided. Each position goes to one bin of the reference's
top-1/top-2 margin (decades: ``< 1e-5``, ``1e-5..1e-4``, ..., ``>= 1``), and per bin the
number of positions where two paths' argmaxes differ is counted. Flips that sit in the
small-margin bins are rounding; a flip at a large margin is a bug."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: bin edges of the margin curve: one decade per bin, from "a tie" to "clearly decided"
MARGIN_EDGES = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)


@dataclass(frozen=True)
class MarginBin:
    """Positions whose margin is in ``[lo, hi)`` and how many of them flipped."""

    lo: float  # 0.0 for the first bin
    hi: float  # inf for the last bin
    count: int
    flips: int

    @property
    def label(self) -> str:
        if self.lo == 0.0:
            return f"<{_short(self.hi)}"
        if self.hi == float("inf"):
            return f">={_short(self.lo)}"
        return f"{_short(self.lo)}..{_short(self.hi)}"

    @property
    def flip_rate(self) -> float:
        return self.flips / self.count if self.count else 0.0

    def to_dict(self) -> dict:
        return {"lo": self.lo, "hi": None if self.hi == float("inf") else self.hi,
                "count": self.count, "flips": self.flips}


def _short(x: float) -> str:
    """1e-05 -> 1e-5, 1.0 -> 1e0 (powers of ten; other edges as %g): labels that fit a column."""
    mantissa, exponent = f"{x:.0e}".split("e")
    return f"1e{int(exponent)}" if float(f"1e{exponent}") == x else f"{x:g}"


def margin_bin_index(margin, edges=MARGIN_EDGES) -> np.ndarray:
    """The bin of each margin: 0 below ``edges[0]``, ``len(edges)`` at or above the last."""
    m = np.asarray(margin, dtype=np.float64)
    e = np.asarray(edges, dtype=np.float64)
    if e.ndim != 1 or len(e) == 0 or np.any(np.diff(e) <= 0) or e[0] <= 0:
        raise ValueError(f"margin bin edges must be positive and strictly increasing, got {edges}")
    if np.isnan(m).any():
        raise ValueError("margins contain NaN: a margin needs finite top-1 and top-2 scores")
    return np.searchsorted(e, m, side="right")


def flips_by_margin(margin, top_a, top_b, edges=MARGIN_EDGES) -> list[MarginBin]:
    """Per margin bin: positions, and positions where ``top_a`` and ``top_b`` (argmaxes of two
    paths, same shape as ``margin``) differ. The bins partition the positions."""
    a, b = np.asarray(top_a), np.asarray(top_b)
    m = np.asarray(margin, dtype=np.float64)
    if not (a.shape == b.shape == m.shape):
        raise ValueError(f"flips_by_margin: margin {m.shape}, top_a {a.shape} and top_b "
                         f"{b.shape} must have one shape (one entry per position)")
    idx = margin_bin_index(m, edges).ravel()
    n = len(edges) + 1
    counts = np.bincount(idx, minlength=n)
    flips = np.bincount(idx, weights=(a != b).ravel().astype(np.float64), minlength=n)
    bounds = (0.0, *map(float, edges), float("inf"))
    return [MarginBin(bounds[i], bounds[i + 1], int(counts[i]), int(flips[i])) for i in range(n)]
