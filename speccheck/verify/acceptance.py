"""Acceptance summaries from spec-decode counters (drafts, draft tokens, accepted tokens,
accepted per draft position), as vLLM's ``spec_decode_*`` metrics report them."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np


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


def counter_problems(drafts: int, draft_tokens: int, accepted_tokens: int,
                     accepted_per_pos: Sequence[int], k: int | None,
                     emitted: int | None = None, iterations: int | None = None,
                     requests: int = 1) -> list[str]:
    """What is impossible about one set of spec counters ([] when nothing is): counters are
    evidence, not truth, so they must agree with each other and with what was observed.

    - every counter ≥ 0; accepted ≤ draft tokens; no draft tokens without drafts;
    - accepted = Σ accepted per position; per-position counts non-increasing (a token at
      position i+1 is accepted only after the one at i) and none above drafts;
    - with ``k`` (a config's fixed K): drafts × K = draft tokens, nothing accepted past K;
    - with ``emitted`` (Σ over ``requests`` of generated tokens − 1: the first token comes
      from prefill): every verify step emits its accepted tokens + 1, so
      ``expected = iterations + accepted`` (``drafts + accepted`` when ``iterations`` is
      None: every step drafted), and ``0 ≤ expected − emitted ≤ K × requests`` — an output
      cut at max_tokens or end-of-sequence loses at most K accepted tokens of its last step.
    """
    drafts, draft_tokens, accepted_tokens = int(drafts), int(draft_tokens), int(accepted_tokens)
    per = [int(x) for x in accepted_per_pos]
    problems = []
    if min([drafts, draft_tokens, accepted_tokens, *per]) < 0 or (iterations is not None and iterations < 0):
        problems.append("a counter is negative")
    if accepted_tokens > draft_tokens:
        problems.append(f"accepted tokens {accepted_tokens} > draft tokens {draft_tokens}")
    if drafts == 0 and draft_tokens > 0:
        problems.append(f"{draft_tokens} draft tokens with 0 drafts")
    if per and sum(per) != accepted_tokens:
        problems.append(f"accepted tokens {accepted_tokens} != {sum(per)}, the sum accepted per "
                        f"position {per}")
    if any(b > a for a, b in zip(per, per[1:])):
        problems.append(f"accepted per position {per} increases (position i+1 accepted more "
                        "often than position i)")
    if any(x > drafts for x in per):
        problems.append(f"accepted per position {per} has an entry above drafts {drafts}")
    if k is not None:
        if drafts * k != draft_tokens:
            problems.append(f"drafts {drafts} x K {k} = {drafts * k} != draft tokens {draft_tokens}")
        if any(per[k:]):
            problems.append(f"accepted per position {per} accepts past position K = {k}")
    if iterations is not None and iterations < drafts:
        problems.append(f"{drafts} drafts in only {iterations} verify steps")
    if emitted is not None:
        steps = iterations if iterations is not None else drafts
        expected = steps + accepted_tokens
        slack = (k if k is not None else max(len(per), 1)) * max(int(requests), 1)
        if not 0 <= expected - int(emitted) <= slack:
            what = f"{iterations} steps" if iterations is not None else f"{drafts} drafting steps"
            problems.append(
                f"{what} + {accepted_tokens} accepted = {expected} tokens after the first, but "
                f"{int(emitted)} were emitted (allowed: up to {slack} fewer, cut at a stop)")
    return problems


def tokens_per_iteration_views(drafts: int, accepted_tokens: int, accepted_per_pos: Sequence[int],
                               emitted: int, iterations: int | None) -> dict[str, float | None]:
    """The same figure three ways, for failure messages: from the accepted counter, from
    the per-position counters, and from the tokens actually emitted (after the first) per
    verify step (per drafting step when the engine does not count steps)."""
    steps = iterations if iterations is not None else drafts
    return {"counters": 1 + accepted_tokens / drafts if drafts else None,
            "per-position rates": 1 + sum(int(x) for x in accepted_per_pos) / drafts if drafts else None,
            "emitted tokens": emitted / steps if steps else None}


def acceptance_mismatches(runs: Sequence[Sequence[tuple | None]]) -> list[tuple[int, int]]:
    """Acceptance determinism: runs × prompts of counter tuples (None: none reported);
    ``(run index, prompt index)`` of every prompt whose counters differ from run 0's.
    Greedy output can repeat token for token while near-ties flip accept/reject run to run:
    performance nondeterminism, reported apart from output determinism."""
    runs = [list(r) for r in runs]
    return [(ri, pi) for ri, run in enumerate(runs[1:], start=1)
            for pi, (ref, got) in enumerate(zip(runs[0], run)) if ref != got]


def output_digest(token_ids: Sequence[int]) -> str:
    """A short fingerprint of one output's token ids: equal digests, same trajectory."""
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()[:16]


@dataclass(frozen=True)
class SameOutputAcceptance:
    """Tokens per iteration today and in the golden's run, summed over the prompts whose
    output is the same token for token in both (``shared`` of the golden's ``prompts``)."""

    today: float
    golden: float
    shared: int
    prompts: int


def same_output_acceptance(today: dict, golden: dict) -> SameOutputAcceptance | None:
    """Acceptance against a golden on the prompts that followed the same trajectory.

    Both sides are {prompt id: (drafts, accepted tokens, output digest)}. Where another
    machine flips a near-tie, that prompt's continuation, and with it what the drafter is
    asked to guess, changes from there on: its acceptance is a different experiment, and a
    handful of such prompts moves a suite's tokens/iteration by more than any tolerance that
    still catches a real regression. Output is lossless, so a broken drafter leaves
    trajectories alone and shows here. None when no prompt with drafts is shared."""
    shared = [p for p, g in golden.items()
              if p in today and today[p][2] == g[2] and today[p][0] > 0 and g[0] > 0]
    if not shared:
        return None

    def tpi(side):
        return 1.0 + sum(side[p][1] for p in shared) / sum(side[p][0] for p in shared)

    return SameOutputAcceptance(tpi(today), tpi(golden), len(shared), len(golden))

