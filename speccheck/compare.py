"""Two free-running runs of the same prompts compared stream by stream (spec vs baseline, the
run all at once vs each prompt alone, golden vs today, one suite vs another), each divergence
classified by margin and, across suites, attributed to what differs between them."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from speccheck.evidence import RESUME, suite_noise
from speccheck.identity import IdentityChange, changes_cause, identity_changes, side_names
from speccheck.results import Together
from speccheck.store import Suite
from speccheck.types import Completion, RunRecord
from speccheck.verify import (END, Boundary, Divergence, boundary_divergence, calibrate_thresholds,
                              find_divergences, stop_tokens, unique_completions)


def decoded_context(detok, comp: Completion, pos: int, width: int = 8) -> str:
    """A decoded window of ``comp`` before ``pos`` and the token there (``⟦⟨end⟩⟧`` where the
    stream had already stopped: streams of different lengths are compared)."""
    if detok is None:
        return ""
    n = comp.n_tokens
    lo = max(0, min(pos, n) - width)
    here = detok([int(comp.token_ids[pos])]) if 0 <= pos < n else "⟨end⟩"
    return f"{detok(comp.token_ids[lo:min(pos, n)].tolist())}⟦{here}⟧"



@dataclass
class Comparison:
    """Two free-running runs of the same prompts compared stream by stream (golden vs today,
    one engine vs another): where each first diverges and how confident that flip was."""

    prompts: int
    exact: int
    matched: int
    compared: int
    divergences: list[Divergence]
    boundaries: list[Boundary] = field(default_factory=list)  # outputs that stop elsewhere

    @property
    def high(self) -> list[Divergence]:
        return [d for d in self.divergences if d.classification.cls == "high_confidence"]

    @property
    def prefix_agreement(self) -> float:
        return self.matched / self.compared if self.compared else 1.0

    @property
    def passed(self) -> bool:
        return not self.high


def compare_runs(base: RunRecord, other: RunRecord, tau_tie: float, tau_low: float, noise: float,
                 detok=None, stops: set[int] | None = None, sampled: bool = False) -> Comparison:
    """``stops``: end-of-sequence ids (default: as the base run shows them, see
    :func:`verify.stop_tokens`), for the boundary check of each prompt. ``sampled``: two
    sampled runs of the same seeds (a divergence classified by how far the two runs'
    distributions there differ, not by margins)."""
    base_by = base.by_prompt()
    if stops is None:
        stops = stop_tokens((c.token_ids, c.finish_reason) for c in base.completions)
    cmp = Comparison(0, 0, 0, 0, [])
    for c in other.completions:
        b = base_by.get(c.prompt_id)
        if b is None:
            continue
        divs = find_divergences(c.prompt_id, b.token_ids, b.topk_ids, b.topk_logprobs, c.token_ids,
                                c.topk_ids, c.topk_logprobs, tau_tie, tau_low, noise, max_gap=tau_low,
                                sampled=sampled)
        cmp.prompts += 1
        cmp.exact += not divs and b.n_tokens == c.n_tokens
        cmp.matched += divs[0].position if divs else min(b.n_tokens, c.n_tokens)
        cmp.compared += max(b.n_tokens, c.n_tokens)
        divs = [replace(d, context=decoded_context(detok, b if d.base_token != END else c, d.position))
                for d in divs]
        cmp.divergences.extend(divs)
        bd = boundary_divergence(c.prompt_id, b.token_ids, b.finish_reason, c.token_ids,
                                 c.finish_reason, divs[0] if divs else None, stops)
        if bd is not None:
            cmp.boundaries.append(bd)
    return cmp


def together_result(alone: RunRecord, together: RunRecord, tau_tie: float, tau_low: float,
                    noise: float, detok=None, sampled: bool = False) -> Together:
    """Each prompt alone against inside the batch of all (and against its copies); at
    temperature > 0 (``sampled``: the same seeds) classified by distribution shift."""
    first = replace(together, completions=together.corpus_copy(0), copies=0)
    cmp = compare_runs(alone, first, tau_tie, tau_low, noise, detok, sampled=sampled)
    copies = [together.corpus_copy(j) for j in range(together.copies)]
    split, split_divs = {}, []
    for i, c in enumerate(first.completions):
        n = unique_completions([cp[i].token_ids for cp in copies])
        if n > 1:
            split[c.prompt_id] = n
            split_divs += _split_divergences([cp[i] for cp in copies], tau_tie, tau_low, noise, detok,
                                             sampled)
    return Together(together.copies, len(together.completions), cmp.prompts, cmp.exact,
                    cmp.prefix_agreement, cmp.divergences, split, split_divs)



def _split_divergences(copies: list[Completion], tau_tie: float, tau_low: float, noise: float,
                       detok=None, sampled: bool = False) -> list[Divergence]:
    """Each copy of one prompt that differs from the first copy, classified by margin like
    any divergence (the first copy on the baseline side)."""
    first = copies[0]
    out = []
    for cp in copies[1:]:
        divs = find_divergences(first.prompt_id, first.token_ids, first.topk_ids, first.topk_logprobs,
                                cp.token_ids, cp.topk_ids, cp.topk_logprobs, tau_tie, tau_low, noise,
                                max_gap=tau_low, sampled=sampled)
        out += [replace(d, context=decoded_context(detok, first, d.position)
                        if d.position < first.n_tokens else "") for d in divs]
    return out



def token_divergences(divs: Sequence[Divergence]) -> list[Divergence]:
    """Divergences where both sides chose a token (those where one stream had already
    stopped are judged by same_stopping)."""
    return [d for d in divs if d.base_token != END and d.spec_token != END]



def _scored_top1(scored: dict | None, prompt_id: str, pos: int) -> tuple[int, float] | None:
    """The teacher-forced argmax at ``pos`` of one stored rescoring, with its margin."""
    s = (scored or {}).get(prompt_id)
    if s is None or not 0 <= pos < len(s.topk_ids) or s.topk_ids[pos, 0] < 0:
        return None
    row = s.topk_logprobs[pos]
    margin = float(row[0] - row[1]) if len(row) > 1 and np.isfinite(row[1]) else float("inf")
    return int(s.topk_ids[pos, 0]), margin


def attribute_across(d: Divergence, a_scored: dict | None, b_scored: dict | None, cause: str,
                     a_name: str = "A", b_name: str = "B") -> dict:
    """Why suite A's run chose ``d.base_token`` and suite B's ``d.spec_token`` at the same
    prefix, from each side's stored teacher-forced rescoring (the baseline of that suite,
    prefill path, fed that run's own tokens -- identical up to the divergence): when each
    side's scoring gives its own side's token, the same computation gives the other token
    under the other identity, so the difference is ``cause`` (e.g. "TP size"); when both
    scorings agree, the identity change does not flip the prefill path there and the side
    that differs chose its token on its own decode/verify path ("kernel path in B")."""
    a_tok, b_tok, pos = d.base_token, d.spec_token, d.position
    ta, tb = _scored_top1(a_scored, d.prompt_id, pos), _scored_top1(b_scored, d.prompt_id, pos)
    out = {"cause": "unattributed", "a_scores": ta and ta[0], "b_scores": tb and tb[0],
           "a_margin": ta and ta[1], "b_margin": tb and tb[1]}
    if END in (a_tok, b_tok):
        out["why"] = "one stream had ended there: nothing to score"
    elif ta is None or tb is None:
        out["why"] = (f"no stored rescoring of this position in suite {a_name if ta is None else b_name} "
                      f"({RESUME})")
    elif ta[0] == a_tok and tb[0] == b_tok:
        out["cause"] = cause
        out["why"] = (f"each side's teacher-forced score gives its own token ({a_name} {a_tok}, margin "
                      f"{ta[1]:.3f}; {b_name} {b_tok}, margin {tb[1]:.3f})")
    elif ta[0] == tb[0] in (a_tok, b_tok):
        odd = b_name if ta[0] == a_tok else a_name
        out["cause"] = f"kernel path in {odd}"
        out["why"] = (f"both teacher-forced scores give {ta[0]}: {cause} does not flip the prefill path "
                      f"here; {odd}'s run chose its token on its own decode/verify path")
    else:
        out["why"] = f"the teacher-forced scores give {ta[0]} ({a_name}) and {tb[0]} ({b_name})"
    return out


@dataclass
class SuiteComparison:
    """Two suites of the same corpus (another TP size, GPU, engine version, engine...): per
    config, the first divergence of each prompt, classified, and attributed to what differs
    between the suites' identities."""

    a: str
    b: str
    noise: float
    tau_tie: float
    tau_low: float
    changes: list[IdentityChange]
    configs: dict[str, Comparison] = field(default_factory=dict)
    attribution: dict[str, list[dict]] = field(default_factory=dict)  # per divergence, in order
    #: config -> changes that only that config's identity shows (e.g. its drafter's backend)
    config_changes: dict[str, list[IdentityChange]] = field(default_factory=dict)

    @property
    def cause(self) -> str:
        return changes_cause(self.changes)

    @property
    def divergences(self) -> list[Divergence]:
        return [d for c in self.configs.values() for d in c.divergences]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.configs.values())

    def verdict(self) -> str:
        """One plain sentence: does the change alter outputs, and beyond near-ties?"""
        what = "; ".join(str(c) for c in self.changes if not c.follows) or "nothing in the identity"
        divs = self.divergences
        prompts = sum(c.prompts for c in self.configs.values())
        scope = f"{prompts} prompt run(s) over {len(self.configs)} config(s)"
        if not divs:
            return f"{what}: outputs identical token for token ({scope})."
        counts = {k: sum(d.cls == k for d in divs) for k in ("near_tie", "low_confidence", "high_confidence")}
        causes: dict[str, int] = {}
        for rows in self.attribution.values():
            for row in rows:
                causes[row["cause"]] = causes.get(row["cause"], 0) + 1
        blamed = ", ".join(f"{n} to {k}" for k, n in sorted(causes.items(), key=lambda kv: -kv[1]))
        head = (f"{what}: changes outputs only at near-ties" if counts["near_tie"] == len(divs) else
                f"{what}: changes outputs BEYOND near-ties ({counts['high_confidence']} high-confidence, "
                f"{counts['low_confidence']} low-confidence)")
        return (f"{head} — {len(divs)} divergence(s) in {scope} (near_tie {counts['near_tie']}, "
                f"low_confidence {counts['low_confidence']}, high_confidence {counts['high_confidence']}); "
                f"attributed: {blamed}.")


def compare_suites(a: Suite, b: Suite, configs: Sequence[str], policy, detok=None) -> SuiteComparison:
    """Each config's first repeat in suite ``a`` against the same in ``b`` (both must hold it),
    classified with tau calibrated on the larger of the two suites' path noise."""
    noise = max(suite_noise(a), suite_noise(b))
    tau_tie, tau_low = calibrate_thresholds(noise, policy.tie_noise_multiple, policy.low_noise_multiple,
                                            policy.tie_floor, policy.low_floor)
    first = configs[0] if configs else "baseline"
    changes = identity_changes(a.run_identity(first, 0), b.run_identity(first, 0)) if configs else []
    out = SuiteComparison(a.id, b.id, noise, tau_tie, tau_low, changes)
    shown = {(c.key, str(c.a), str(c.b)) for c in changes}
    for name in configs:
        cmp = compare_runs(a.load_run(name, 0), b.load_run(name, 0), tau_tie, tau_low, noise, detok)
        own = identity_changes(a.run_identity(name, 0), b.run_identity(name, 0))
        out.config_changes[name] = [c for c in own if (c.key, str(c.a), str(c.b)) not in shown]
        cause = changes_cause(own)
        sa, sb = a.load_rescore(name, 0), b.load_rescore(name, 0)
        out.configs[name] = cmp
        out.attribution[name] = [attribute_across(d, sa, sb, cause, *side_names(own))
                                 for d in cmp.divergences]
    return out
