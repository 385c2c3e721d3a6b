"""Acceptance summaries from spec-decode counters (drafts, draft tokens, accepted tokens,
accepted per draft position), as vLLM's ``spec_decode_*`` metrics report them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Acceptance:
    """What drafting bought: mean tokens per verify iteration (1 + accepted / drafts; 1.0
    with no drafts), the share of draft tokens accepted (0.0 with none), and per draft
    position the fraction of drafts whose token there was accepted."""

    drafts: int
    draft_tokens: int
    accepted_tokens: int
    tokens_per_iter: float
    acceptance_rate: float
    per_pos: tuple[float, ...]


def acceptance_summary(drafts: int, draft_tokens: int, accepted_tokens: int,
                       accepted_per_pos: Sequence[int]) -> Acceptance:
    """Summarise counters (summed over requests or differenced before/after); rejects
    counters that cannot be (negative, more accepted than drafted, a position accepted
    more often than there were drafts)."""
    drafts, draft_tokens, accepted_tokens = int(drafts), int(draft_tokens), int(accepted_tokens)
    per = [int(x) for x in accepted_per_pos]
    problems = []
    if min([drafts, draft_tokens, accepted_tokens, *per]) < 0:
        problems.append("a counter is negative")
    if accepted_tokens > draft_tokens:
        problems.append(f"accepted_tokens {accepted_tokens} > draft_tokens {draft_tokens}")
    if drafts == 0 and draft_tokens > 0:
        problems.append(f"draft_tokens {draft_tokens} with 0 drafts")
    if any(x > drafts for x in per):
        problems.append(f"accepted_per_pos {per} has an entry above drafts {drafts}")
    if problems:
        raise ValueError("inconsistent spec-decode counters (" + "; ".join(problems) + "): "
                         "they must be non-negative differences of the same engine's counters")
    return Acceptance(
        drafts=drafts, draft_tokens=draft_tokens, accepted_tokens=accepted_tokens,
        tokens_per_iter=1.0 + accepted_tokens / drafts if drafts else 1.0,
        acceptance_rate=accepted_tokens / draft_tokens if draft_tokens else 0.0,
        per_pos=tuple(x / drafts if drafts else 0.0 for x in per),
    )


def acceptance_of(counters) -> Acceptance:
    """:func:`acceptance_summary` of anything with ``drafts``, ``draft_tokens``,
    ``accepted_tokens`` and ``accepted_per_pos`` attributes (e.g. ``types.SpecCounters``)."""
    return acceptance_summary(counters.drafts, counters.draft_tokens, counters.accepted_tokens,
                              counters.accepted_per_pos)
