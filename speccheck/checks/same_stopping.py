"""same_stopping: each spec output stops where the baseline's does."""
from __future__ import annotations

from speccheck.checks import CheckSpec, first_line
from speccheck.checks._evidence import COMPARED
from speccheck.checks._text import untrusted_tau
from speccheck.results import Check, ConfigResult


def judge(r: ConfigResult, p) -> Check:
    """Same length, same finish reason, nothing past max_tokens or an end-of-sequence token,
    unless a tolerated flip earlier in that prompt moved the stop."""
    bad = [b for b in r.boundaries if not b.explained]
    moved = [b for b in r.boundaries if b.explained]
    ctx = {(d.prompt_id, d.position): d.context for d in r.divergences if d.context}
    lines = [b.describe() + (f", context {ctx[(b.prompt_id, b.position)]!r}"
                             if (b.prompt_id, b.position) in ctx and not b.explained else "")
             for b in bad[:5]] + ([f"... and {len(bad) - 5} more"] if len(bad) > 5 else [])
    head = f"{r.prompts - len(r.boundaries)}/{r.prompts} prompts stop where the baseline does"
    if moved:
        head += (f"; {len(moved)} stop elsewhere after a tolerated flip ("
                 + ", ".join(f"{b.prompt_id}: {b.base_tokens} -> {b.spec_tokens} tokens" for b in moved[:5])
                 + ")")
    unsure = [untrusted_tau(len(moved), r.noise_missing)] if r.noise_missing and moved else []
    if bad:
        head = f"{len(bad)} prompt(s) stop elsewhere with nothing to explain it; " + head
    return Check("same_stopping", not bad and not unsure,
                 "; ".join(unsure + [head]) + "".join("\n    " + x for x in lines))


CHECK = CheckSpec(
    sampled="greedy-only",
    name="same_stopping", label="stopping", order=70, judge=judge, row=first_line, needs=(COMPARED,),
    guards="output boundaries: emission past max_tokens or past an end-of-sequence token inside "
           "accepted drafts; legitimate tokens stripped as mask tokens",
    description="Each spec output has the baseline's length and finish reason, unless a tolerated "
                "flip earlier in that prompt moved the stop.")
