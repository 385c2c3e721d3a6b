"""Output boundaries: where spec and baseline agree up to the baseline's end, the spec output
ends there too (same finish reason; nothing past max_tokens, nothing past end-of-sequence).

A spec decoder verifies K+1 tokens at once, so a stop that falls inside an accepted draft
must cut it there; engines have shipped emission past ``max_tokens`` and past an
end-of-sequence token inside accepted drafts. A flip at a near-tie may legitimately move the
stop (the two outputs continue from different contexts), so a length difference after a
tolerated divergence is explained; one where the streams agree token for token is not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from speccheck.verify.divergence import Divergence

KINDS = {
    "past_max_tokens": "ran past max_tokens",
    "past_end_of_sequence": "emitted tokens after an end-of-sequence token",
    "runs_longer": "ran on past the baseline's end",
    "stops_early": "stopped before the baseline's end",
    "finish_differs": "stopped with another finish reason",
}


@dataclass(frozen=True)
class Boundary:
    """One prompt whose spec output stops elsewhere than the baseline's (or not at all where
    it must), with the evidence. ``position`` is the first position where the two disagree
    on stopping (or on a token); ``explained_by`` is the earlier divergence that legitimately
    moved the stop (a near-tie or low-confidence flip), None when nothing explains it;
    ``spec_past`` the spec tokens past the stop it should have made (up to 8)."""

    prompt_id: str
    kind: str
    position: int
    base_tokens: int
    spec_tokens: int
    base_finish: str
    spec_finish: str
    explained_by: Divergence | None = None
    spec_past: tuple[int, ...] = ()

    @property
    def explained(self) -> bool:
        return self.explained_by is not None

    def describe(self) -> str:
        why = (f"explained by a {self.explained_by.cls} flip at position {self.explained_by.position}"
               if self.explained_by is not None else "nothing earlier explains it")
        past = f"; spec tokens past it: {' '.join(map(str, self.spec_past))}" if self.spec_past else ""
        return (f"prompt {self.prompt_id}: spec {KINDS[self.kind]} at position {self.position} "
                f"(baseline {self.base_tokens} tokens, finish {self.base_finish!r}; spec "
                f"{self.spec_tokens} tokens, finish {self.spec_finish!r}); {why}{past}")


def stop_tokens(streams: Iterable[tuple[Sequence[int], str]]) -> set[int]:
    """End-of-sequence token ids as a run shows them, without knowing the tokenizer: the last
    token of each stream that finished with ``"stop"``, less any token seen before the end of
    such a stream (a stop string can end a stream on an ordinary token; that token is then
    seen mid-stream elsewhere and does not count)."""
    last, inside = set(), []
    for tokens, finish in streams:
        t = np.asarray(tokens).ravel()
        if finish == "stop" and len(t):
            last.add(int(t[-1]))
            inside.append(t[:-1])
    if not inside:
        return last
    inside = np.concatenate(inside)
    candidates = np.fromiter(last, dtype=np.int64, count=len(last))
    return last - set(inside[np.isin(inside, candidates)].tolist())


def boundary_divergence(prompt_id: str, base_tokens, base_finish: str, spec_tokens,
                        spec_finish: str, first: Divergence | None,
                        stops: set[int] = frozenset()) -> Boundary | None:
    """Whether the spec stream stops where it must (None) or a :class:`Boundary`.

    ``first`` is the streams' first divergence (:func:`find_divergences`; None when they are
    identical). ``stops`` are end-of-sequence ids (:func:`stop_tokens`), honoured for this
    prompt unless the baseline itself went on past one (``ignore_eos``).

    Never explained: tokens after an end-of-sequence token where the baseline stopped at one
    (where it ran to max_tokens, EOS may be ignored, and a tolerated flip explains it); a
    stream longer than the other side's ``"length"`` finish (max_tokens is the same for
    both); a length or finish difference where one stream is a prefix of the other.
    Explained: a length or finish difference after a tolerated (near-tie / low-confidence)
    first divergence.
    """
    b, s = np.asarray(base_tokens).ravel(), np.asarray(spec_tokens).ravel()
    nb, ns = len(b), len(s)
    if nb == ns and base_finish == spec_finish and np.array_equal(b, s):
        return None  # the same stream, stopped the same way: nothing below can fire
    make = lambda kind, pos, why=None, past=(): Boundary(  # noqa: E731
        prompt_id, kind, int(pos), nb, ns, str(base_finish), str(spec_finish), why,
        tuple(int(x) for x in past[:8]))
    tolerated = first is not None and first.base_token >= 0 and first.spec_token >= 0 \
        and first.cls != "high_confidence"
    stop_ids = np.fromiter(stops, dtype=np.int64, count=len(stops))
    honoured = not np.isin(b[:-1], stop_ids).any()
    after_stop = np.flatnonzero(np.isin(s[:-1], stop_ids)) if honoured else ()
    past_eos = None
    if len(after_stop):
        i = int(after_stop[0]) + 1
        # a baseline that stopped at end-of-sequence shows it is honoured; one cut at
        # max_tokens does not (ignore_eos), so there a tolerated flip may lead to one
        unsure = base_finish != "stop" and tolerated
        past_eos = make("past_end_of_sequence", i, first if unsure else None, s[i:])
        if not past_eos.explained:
            return past_eos
    if base_finish == "length" and ns > nb:
        return make("past_max_tokens", nb, past=s[nb:])
    if spec_finish == "length" and nb > ns:  # a cap at ns that the baseline did not meet
        return make("stops_early", ns)
    if past_eos is not None:
        return past_eos
    if nb == ns and base_finish == spec_finish:
        return None
    kind = "finish_differs" if nb == ns else ("runs_longer" if ns > nb else "stops_early")
    pos = first.position if first is not None else min(nb, ns)
    return make(kind, pos, first if tolerated else None, s[nb:] if ns > nb else ())
