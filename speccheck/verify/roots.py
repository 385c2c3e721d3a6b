"""Inverting a monotone function by bisection: the quantiles and power figures of the
statistics in verify/ that have no closed form."""
from __future__ import annotations

from collections.abc import Callable


def last_true(pred: Callable[[float], bool], hi: float = 1.0, rtol: float = 1e-10, steps: int = 200) -> float:
    """The x >= 0 where ``pred`` (True from 0 up to x, False beyond) turns False: ``hi``
    doubled until pred(hi) is False, then bisected to ``rtol`` relative."""
    lo = 0.0
    while pred(hi):
        lo, hi = hi, hi * 2
    for _ in range(steps):
        mid = (lo + hi) / 2
        if pred(mid):
            lo = mid
        else:
            hi = mid
        if hi - lo <= rtol * hi:
            break
    return (lo + hi) / 2
