"""Evidence read from a stored suite, below any verdict: the engine's own path noise, the
stored teacher-forced rescoring and what it lacks, and the logprobs at the positions where a spec
run and the baseline chose the same token."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from speccheck.store import Suite
from speccheck.types import Completion, RunRecord
from speccheck.verify import (abs_deltas, margins, paired_deltas, path_noise, shared_context,
                              topk_abs_deltas)

#: how to get evidence that is missing from a store (runs are kept; only what is missing is redone)
RESUME = ("`speccheck run` again with the same options into the same --store resumes: stored runs "
          "are skipped and only the missing rescoring is redone")



def rescore_gaps(suite: Suite, name: str, repeat: int, comps: Sequence[Completion]) -> list[str]:
    """What the stored teacher-forced rescoring of one run lacks ([] when it covers every
    prompt with one score row per generated token), each with the command that redoes it."""
    scored = suite.load_rescore(name, repeat)
    path = suite.rescore_path(name, repeat)
    if scored is None:
        return [f"no teacher-forced rescoring of {name} r{repeat} is stored ({path}); {RESUME}"]
    absent = [c.prompt_id for c in comps if c.prompt_id not in scored]
    short = [f"{c.prompt_id} ({len(scored[c.prompt_id].topk_ids)} score rows for {c.n_tokens} tokens)"
             for c in comps if c.prompt_id in scored and len(scored[c.prompt_id].topk_ids) != c.n_tokens]
    gaps = ([f"prompt(s) {', '.join(absent[:8])}{' ...' if len(absent) > 8 else ''} not scored"]
            if absent else []) + ([f"wrong length at {', '.join(short[:8])}"] if short else [])
    if not gaps:
        return []
    return [f"the teacher-forced rescoring of {name} r{repeat} ({path}) is incomplete: "
            f"{'; '.join(gaps)}. Delete that file, then {RESUME}"]


def measure_noise(suite: Suite) -> tuple[float, str | None]:
    """``(noise, why_missing)``: the engine's own path noise -- its decode-path logprobs of the
    baseline's tokens against the teacher-forced (prefill-path) logprobs of the same tokens --
    or ``(0.0, reason)`` when the store cannot say (no complete baseline, no or incomplete
    baseline rescoring, no tokens). Unmeasured noise is not zero noise: tau would come from
    the policy floors, so every check that excuses a divergence by tau must say so."""
    if not suite.is_complete("baseline", 0):
        return 0.0, "no complete baseline run r0 to measure the engine's path noise on"
    comps = suite.load_run("baseline", 0).completions
    gaps = rescore_gaps(suite, "baseline", 0, comps)
    if gaps:
        return 0.0, gaps[0]
    scored = suite.load_rescore("baseline", 0) or {}
    # a completion whose logprobs are not one per token is left out (logprobs_valid names it)
    whole = [c for c in comps if c.n_tokens and len(c.logprobs) == c.n_tokens]
    a = [c.logprobs for c in whole]
    b = [scored[c.prompt_id].token_logprobs for c in whole]
    if not a:
        return 0.0, "the baseline generated no tokens to measure the engine's path noise on"
    return float(path_noise(np.concatenate(a), np.concatenate(b))), None


def suite_noise(suite: Suite) -> float:
    """:func:`measure_noise`'s figure alone (0.0 when it could not be measured)."""
    return measure_noise(suite)[0]


def kernel_noise_sample(suite: Suite) -> np.ndarray:
    """The engine's own kernel-path noise as a whole sample: |decode-path - prefill-path
    logprob| of the baseline's own tokens (run 0 against its rescoring); empty without them.
    (:func:`suite_noise` is its 99th percentile.)"""
    if not suite.is_complete("baseline", 0):
        return np.zeros(0)
    scored = suite.load_rescore("baseline", 0) or {}
    parts = [abs_deltas(c.logprobs, scored[c.prompt_id].token_logprobs)
             for c in suite.load_run("baseline", 0).completions
             if c.prompt_id in scored and len(scored[c.prompt_id].token_logprobs) == c.n_tokens
             and len(c.logprobs) == c.n_tokens]
    return np.concatenate(parts) if parts else np.zeros(0)


@dataclass
class LogprobEvidence:
    """Per agreeing position of a spec run (its token = the baseline's teacher-forced argmax):
    where (``prompts[prompt_index[i]]``, ``positions[i]``), the spec-reported and the
    baseline's logprob; and the baseline's teacher-forced margin at every position (flip risk)."""

    prompts: list[str]
    prompt_index: np.ndarray
    positions: np.ndarray
    spec_lp: np.ndarray
    base_lp: np.ndarray
    margins: np.ndarray

    def at(self, i: int) -> tuple[str, int]:
        """(prompt id, position) of the i-th agreeing position."""
        return self.prompts[int(self.prompt_index[i])], int(self.positions[i])

    @property
    def where(self) -> list[tuple[str, int]]:
        return [self.at(i) for i in range(len(self.positions))]

    @property
    def deltas(self) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            return np.abs(self.spec_lp.astype(np.float64) - self.base_lp.astype(np.float64))


def logprob_evidence(run: RunRecord, scored: dict | None) -> LogprobEvidence:
    prompts, index, pos, s_lp, b_lp, marg = [], [], [], [], [], []
    for c in run.completions:
        s = (scored or {}).get(c.prompt_id)
        if s is None or len(s.token_logprobs) != c.n_tokens or len(c.logprobs) != c.n_tokens or not c.n_tokens:
            continue
        marg.append(margins(s.topk_logprobs))
        agree = np.flatnonzero(s.topk_ids[:, 0] == c.token_ids)
        index.append(np.full(len(agree), len(prompts)))
        prompts.append(c.prompt_id)
        pos.append(agree)
        s_lp.append(c.logprobs[agree])
        b_lp.append(s.token_logprobs[agree])
    cat = lambda parts, dtype: np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)  # noqa: E731
    return LogprobEvidence(prompts, cat(index, np.int64), cat(pos, np.int64), cat(s_lp, np.float64),
                           cat(b_lp, np.float64), cat(marg, np.float64))


def spec_delta_sample(suite: Suite, name: str) -> np.ndarray:
    """|spec-reported - baseline teacher-forced logprob| at the agreeing positions of a
    config's run 0 (what ``golden record`` stores per config)."""
    if not suite.is_complete(name, 0):
        return np.zeros(0)
    d = logprob_evidence(suite.load_run(name, 0), suite.load_rescore(name, 0)).deltas
    return d[np.isfinite(d)]


def paired_logprob_deltas(base: RunRecord, base_scored: dict | None,
                          run: RunRecord) -> tuple[np.ndarray, np.ndarray]:
    """``(a, b)`` over every prompt's shared prefix with the baseline (same context, same
    token): a = |spec-reported - baseline prefill logprob|, b = |baseline decode-path - the
    same prefill logprob| (:func:`verify.paired_deltas`); empty without the baseline's
    rescoring."""
    by_prompt = base.by_prompt()
    a, b = [np.zeros(0)], [np.zeros(0)]
    for c in run.completions:
        bc, bs = by_prompt.get(c.prompt_id), (base_scored or {}).get(c.prompt_id)
        if bc is None or bs is None or len(bs.token_logprobs) != bc.n_tokens \
                or len(bc.logprobs) != bc.n_tokens or len(c.logprobs) != c.n_tokens:
            continue  # logprobs not one per token: logprobs_valid names them
        pa, pb = paired_deltas(c.token_ids, c.logprobs, bc.token_ids, bc.logprobs, bs.token_logprobs)
        a.append(pa)
        b.append(pb)
    return np.concatenate(a), np.concatenate(b)




def paired_topk_deltas(base: RunRecord, base_scored: dict | None,
                       run: RunRecord) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(a, b, prompt)`` over every prompt's positions of shared context with the baseline
    (up to and including the first divergence): a = the spec run's top-k against the
    baseline's prefill top-k, b = the baseline decode path's top-k against the same rows
    (per position, the mean |Δ logprob| over the ids both list; :func:`verify.topk_abs_deltas`),
    prompt = the index of each position's prompt in ``run``; empty without the baseline's
    rescoring."""
    by_prompt = base.by_prompt()
    a, b, where = [np.zeros(0)], [np.zeros(0)], [np.zeros(0, np.int64)]
    for i, c in enumerate(run.completions):
        bc, bs = by_prompt.get(c.prompt_id), (base_scored or {}).get(c.prompt_id)
        if bc is None or bs is None or len(bs.topk_ids) != bc.n_tokens \
                or len(bc.topk_ids) != bc.n_tokens or len(c.topk_ids) != c.n_tokens:
            continue  # top-k rows not one per token: logprobs_valid names them
        n = shared_context(c.token_ids, bc.token_ids)
        a.append(topk_abs_deltas(c.topk_ids[:n], c.topk_logprobs[:n], bs.topk_ids[:n], bs.topk_logprobs[:n]))
        b.append(topk_abs_deltas(bc.topk_ids[:n], bc.topk_logprobs[:n], bs.topk_ids[:n], bs.topk_logprobs[:n]))
        where.append(np.full(n, i, np.int64))
    return np.concatenate(a), np.concatenate(b), np.concatenate(where)
