"""Acceptance of preempted requests, each paired with itself unpressured.

A request that loses its drafter state in a preemption (the recompute rebuilds the target's
state but the drafter restarts cold or stale) keeps its tokens and loses only acceptance, and
only after its recompute: aggregated over every request of a run the fall is diluted below any
sensible threshold, while one clean recompute moves one request's count by several percent
(the recompute's step boundaries differ). So the comparison is per preempted request, against
the same request's counters without pressure, and the unit of evidence is the draft position a
verify reached (a *continuation trial*: position j is tried when positions < j were accepted,
and succeeds when it is accepted too), stratified by request: a Cochran-Mantel-Haenszel test
over the requests' 2 x 2 tables (pressure / free x accepted / rejected), two-sided.

Pure arithmetic over spec counters (``drafts``, ``accepted_per_pos``); no engine imports.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def continuation_trials(drafts: int, accepted_per_pos: Sequence[int]) -> tuple[int, int]:
    """(accepted draft tokens, draft positions reached) of one request's counters: position 0
    is reached by every draft, position j by the drafts whose position j - 1 was accepted."""
    per = [int(x) for x in accepted_per_pos]
    return sum(per), int(drafts) + sum(per[:-1])


@dataclass(frozen=True)
class RequestAcceptance:
    request: str
    #: (accepted, reached, drafts) under pressure, then without
    pressure: tuple[int, int, int]
    free: tuple[int, int, int]

    @property
    def change(self) -> float:
        """Relative change of accepted tokens per draft (pressure vs free); NaN without drafts."""
        (a, _, d), (fa, _, fd) = self.pressure, self.free
        if not d or not fd or not fa:
            return math.nan
        return (a / d) / (fa / fd) - 1


@dataclass(frozen=True)
class PreemptedAcceptance:
    """The stratified comparison: ``change`` pooled (accepted per draft, pressure vs free),
    ``z`` and its two-sided ``p``; ``requests`` one row each."""

    requests: tuple[RequestAcceptance, ...]
    change: float
    z: float
    p: float

    def significant(self, alpha: float, min_change: float) -> bool:
        """A change beyond chance at ``alpha`` and larger than ``min_change`` either way."""
        return (not math.isnan(self.p) and self.p <= alpha and not math.isnan(self.change)
                and abs(self.change) > min_change)


def _counts(c: Any) -> tuple[int, int, int]:
    a, n = continuation_trials(c.drafts, c.accepted_per_pos)
    return a, n, int(c.drafts)


def preempted_acceptance(pairs: Sequence[tuple[str, Any, Any]]) -> PreemptedAcceptance:
    """``pairs``: (request id, counters under pressure, counters of the same request free),
    counters ``SpecCounters``-like. Strata without variance (no trials on a side, or every
    trial alike on both) add nothing to the test."""
    rows = tuple(RequestAcceptance(r, _counts(p), _counts(f)) for r, p, f in pairs)
    obs = exp = var = 0.0
    for row in rows:
        a, n1, _ = row.pressure
        c, n2, _ = row.free
        n = n1 + n2
        m1 = a + c  # accepted on both sides
        if n1 == 0 or n2 == 0 or n < 2:
            continue
        obs += a
        exp += n1 * m1 / n
        var += n1 * n2 * m1 * (n - m1) / (n * n * (n - 1))
    if var <= 0:
        z, p = math.nan, math.nan
    else:
        z = (obs - exp) / math.sqrt(var)
        p = math.erfc(abs(z) / math.sqrt(2.0))
    acc = sum(r.pressure[0] for r in rows)
    d = sum(r.pressure[2] for r in rows)
    facc = sum(r.free[0] for r in rows)
    fd = sum(r.free[2] for r in rows)
    change = (acc / d) / (facc / fd) - 1 if d and fd and facc else math.nan
    return PreemptedAcceptance(rows, change, z, p)
