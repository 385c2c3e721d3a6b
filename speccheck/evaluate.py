"""From a stored suite to verdicts: every figure diff/gate/report/pytest print comes from here.

Reads runs, rescoring and attribution from the store, calls the pure functions of verify/,
and applies the policy. No engine is touched.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from statistics import median
from typing import Sequence

import numpy as np

from speccheck.policy import Policy
from speccheck.store import Suite, config_sort_key
from speccheck.types import Completion, RunRecord, SpecConfig, SpecCounters
from speccheck.verify import (
    END,
    below_floor_p,
    RepeatTiming,
    SpeedupModel,
    speedup_model,
    Acceptance,
    DriftTest,
    FlipBudget,
    PairedDriftTest,
    Boundary,
    Divergence,
    acceptance_mismatches,
    acceptance_summary,
    SameOutputAcceptance,
    output_digest,
    same_output_acceptance,
    boundary_divergence,
    calibrate_thresholds,
    abs_deltas,
    counter_problems,
    determinism,
    drift_test,
    find_divergences,
    flip_budget,
    margins,
    paired_deltas,
    paired_drift_test,
    path_noise,
    stop_tokens,
    teacher_forced_agreement,
    teacher_forced_divergences,
    text_similarity,
    tokens_per_iteration_views,
    unique_completions,
)

CHECKS = ("ran", "deterministic", "batch_invariant", "concurrent_identical",
          "agrees_with_baseline", "divergences_are_low_confidence", "same_stopping",
          "counters_consistent", "acceptance_deterministic", "logprobs_consistent",
          "acceptance_not_regressed", "speedup")

#: how to get evidence that is missing from a store (runs are kept; only what is missing is redone)
RESUME = ("`speccheck run` again with the same options into the same --store resumes: stored runs "
          "are skipped and only the missing rescoring is redone")


@dataclass
class Check:
    name: str
    passed: bool
    message: str
    skipped: bool = False


@dataclass
class Speed:
    warm_tok_s: float | None  # median over warm requests (the first request of each run excluded)
    cold_tok_s: float | None  # the first request of the first run
    ttft_s: float | None  # median
    speedup: float | None  # warm tok/s over the baseline's, same suite
    #: per stored repeat, its warm requests' tokens, steps and seconds: the speedup model's
    #: input, in wall seconds and (where every request has them) in the engine's CPU seconds
    repeats: tuple[RepeatTiming, ...] = ()
    cpu_repeats: tuple[RepeatTiming, ...] = ()

    @property
    def cpu_timed(self) -> bool:
        return bool(self.cpu_repeats) and len(self.cpu_repeats) == len(self.repeats)


@dataclass
class Together:
    """The config's run of the whole corpus at once, each prompt ``copies`` times, against
    its first run (one prompt at a time)."""

    copies: int
    requests: int
    prompts: int
    exact: int  # prompts whose first copy equals the prompt alone, token for token
    prefix_agreement: float
    divergences: list[Divergence]  # first copy vs alone
    split: dict[str, int]  # prompt -> distinct completions among its copies, where > 1
    #: where a copy differs from the first copy of its prompt: the split, classified by margin
    split_divergences: list[Divergence] = field(default_factory=list)
    #: the baseline's own run all at once splits copies or changes prompts: the engine is not
    #: batch-invariant at ties with or without speculation (set by evaluate_config)
    baseline_not_invariant: bool = False
    of_baseline: bool = False

    @property
    def high(self) -> list[Divergence]:
        return [d for d in self.divergences if d.classification.cls == "high_confidence"]

    @property
    def not_invariant(self) -> bool:
        """This run itself shows the engine is not batch-invariant."""
        return bool(self.split or self.divergences)


@dataclass
class LogprobConsistency:
    """The spec engine's reported logprobs against the baseline's teacher-forced logprobs of
    the same tokens in the same context (positions where both chose the token): one by one
    against ``limit``, as a distribution against the engine's own kernel-path noise (and the
    golden's sample of this config, when recorded), position by position against the
    baseline's own decode path where both outputs still share context and token (``paired``),
    and the teacher-forced flips against what that noise predicts."""

    positions: int
    limit: float
    over: list[str]  # evidence of the worst positions over the limit
    n_over: int
    drift: DriftTest
    golden_drift: DriftTest | None
    flips: FlipBudget
    paired: PairedDriftTest | None = None


@dataclass
class ConfigResult:
    config: str
    repeats: int
    failed_runs: list[str]
    identical_runs: bool | None
    nondeterminism: list[str]  # "r1 prompt p3 position 17 (fresh process)"
    prompts: int
    prompts_exact: int
    prefix_agreement: float | None
    token_agreement: float | None  # teacher-forced
    text_similarity: float | None
    divergences: list[Divergence]  # first divergences, free-running
    tf_divergences: list[Divergence]  # teacher-forced disagreements, all positions
    class_counts: dict[str, int]
    attribution: list[dict]
    acceptance: Acceptance | None
    golden_tokens_per_iter: float | None
    speed: Speed
    together: Together | None = None
    logprobs: LogprobConsistency | None = None
    checks: list[Check] = field(default_factory=list)
    #: evidence the store lacks (rescoring absent or short): never read as agreement
    missing_evidence: list[str] = field(default_factory=list)
    #: why the engine's path noise (and so tau) could not be measured; None when it was
    noise_missing: str | None = None
    #: prompts whose spec output stops elsewhere than the baseline's (explained or not)
    boundaries: list[Boundary] = field(default_factory=list)
    #: acceptance against the golden's on the prompts whose output is the golden run's
    golden_same_output: SameOutputAcceptance | None = None
    #: impossible spec counters ("r0 prompt p: ..."), and the run's tokens/iteration three ways
    counter_problems: list[str] = field(default_factory=list)
    counter_views: dict[str, float | None] = field(default_factory=dict)
    #: spec counters identical run to run (None: fewer than 2 runs with counters)
    acceptance_identical: bool | None = None
    acceptance_nondeterminism: list[str] = field(default_factory=list)
    prompt_ids: list[str] = field(default_factory=list)  # the prompts compared with the baseline
    token_agreement_n: int = 0  # teacher-forced positions compared
    missing: list[str] = field(default_factory=list)  # planned or demanded, not stored

    @property
    def verdict(self) -> str:
        if self.failed_runs:
            return "error"
        return "pass" if all(c.passed or c.skipped for c in self.checks) else "fail"

    def check(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["verdict"] = self.verdict
        return d


@dataclass
class SuiteResult:
    suite: str
    meta: dict
    identity: dict
    noise: float
    tau_tie: float
    tau_low: float
    policy: dict
    configs: list[ConfigResult]
    #: why path noise was not measured (tau then comes from the policy floors); None when it was
    noise_missing: str | None = None
    plan: dict | None = None  # what `speccheck run` recorded it would store (None: older suite)
    #: per method swept over two or more Ks: the speedup model and the K it recommends
    speedup: dict[str, SpeedupModel] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(c.verdict == "pass" for c in self.configs)

    @property
    def engine_failed(self) -> bool:
        return any(c.verdict == "error" for c in self.configs)

    def get(self, name: str) -> ConfigResult:
        for c in self.configs:
            if c.config == name:
                return c
        raise KeyError(name)

    def to_dict(self) -> dict:
        return {"suite": self.suite, "meta": self.meta, "identity": self.identity,
                "noise": self.noise, "noise_missing": self.noise_missing,
                "tau_tie": self.tau_tie, "tau_low": self.tau_low, "policy": self.policy,
                "plan": self.plan, "passed": self.passed,
                "configs": [c.to_dict() for c in self.configs],
                "speedup": {m: asdict(model) for m, model in self.speedup.items()}}


# --- helpers -----------------------------------------------------------------------------------

def _warm_rates(record: RunRecord) -> list[float]:
    """Decode tok/s of each request that decoded, but the first such (warm-up) of a run."""
    rates = [(c.n_tokens - 1) / c.decode_s for c in record.completions if c.decode_s > 0 and c.n_tokens > 1]
    return rates[1:]


def speed_of(records: Sequence[RunRecord]) -> tuple[float | None, float | None, float | None]:
    warm = [r for rec in records for r in _warm_rates(rec)]
    first = next((c for c in (records[0].completions if records else []) if c.n_tokens > 1 and c.decode_s > 0),
                 None)
    cold = (first.n_tokens - 1) / first.decode_s if first else None
    ttfts = [c.ttft_s for rec in records for c in rec.completions[1:] if c.ttft_s > 0]
    return (median(warm) if warm else None, cold, median(ttfts) if ttfts else None)


def _warm(record: RunRecord) -> list[Completion]:
    """A run's requests that decoded, but the first (warm-up), as in :func:`_warm_rates`."""
    return [c for c in record.completions if c.decode_s > 0 and c.n_tokens > 1][1:]


def repeat_timing(record: RunRecord, clock: str = "wall") -> RepeatTiming:
    """A run's warm requests summed: tokens, target steps, decode seconds on ``clock`` ("cpu":
    the engine's CPU seconds), the share of them spent drafting, counters."""
    warm = _warm(record)
    specs = [c.spec for c in warm if c.spec is not None]
    steps = [c.n_tokens - 1 if c.spec is None else
             (c.spec.iterations if c.spec.iterations is not None else c.spec.drafts) for c in warm]
    total = sum(specs[1:], specs[0] + SpecCounters(iterations=0, draft_s=0.0)) if specs else None
    wall = sum(c.decode_s for c in warm)
    return RepeatTiming(
        repeat=record.repeat, prompts=tuple(c.prompt_id for c in warm),
        tokens=tuple(c.n_tokens - 1 for c in warm), iterations=tuple(steps),
        seconds=tuple(c.decode_cpu_s if clock == "cpu" else c.decode_s for c in warm),
        drafts=total.drafts if total else 0,
        draft_share=total.draft_s / wall if total and total.draft_s is not None and len(specs) == len(warm)
        and wall > 0 else None,
        accepted_per_pos=tuple(total.accepted_per_pos) if total else ())


def speedup_models(results: Sequence["ConfigResult"]) -> dict[str, SpeedupModel]:
    """Per method run at two or more Ks (and a baseline), the speedup model; only Ks that
    pass every check may be recommended. Costs are in the engine's CPU seconds where every
    run has them (the wall clock of a shared machine measures the other load as much), else
    in wall seconds."""
    base = next((r for r in results if r.config == "baseline"), None)
    by_method: dict[str, dict[int, ConfigResult]] = {}
    for r in results:
        cfg = SpecConfig.from_name(r.config)
        if not cfg.is_baseline and r.speed.repeats:
            by_method.setdefault(cfg.method, {})[cfg.k] = r
    models = {}
    for method, per_k in by_method.items():
        if base is None:
            break
        runs = [base, *per_k.values()]
        clock = "cpu" if all(r.speed.repeats for r in runs) and all(
            r.speed.cpu_timed for r in runs) else "wall"
        pick = (lambda r: r.speed.cpu_repeats) if clock == "cpu" else (lambda r: r.speed.repeats)
        model = speedup_model(method, pick(base), {k: pick(r) for k, r in per_k.items()},
                              eligible=[k for k, r in per_k.items() if r.verdict == "pass"], clock=clock)
        if model is not None:
            models[method] = model
    return models


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
    a = [c.logprobs for c in comps if c.n_tokens]
    b = [scored[c.prompt_id].token_logprobs for c in comps if c.n_tokens]
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
             if c.prompt_id in scored and len(scored[c.prompt_id].token_logprobs) == c.n_tokens]
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
        if bc is None or bs is None or len(bs.token_logprobs) != bc.n_tokens:
            continue
        pa, pb = paired_deltas(c.token_ids, c.logprobs, bc.token_ids, bc.logprobs, bs.token_logprobs)
        a.append(pa)
        b.append(pb)
    return np.concatenate(a), np.concatenate(b)


def logprob_consistency(ev: LogprobEvidence, flips: int, noise: float, kernel_noise: np.ndarray,
                        policy: Policy, golden_sample: np.ndarray | None = None,
                        paired: tuple[np.ndarray, np.ndarray] | None = None) -> LogprobConsistency:
    """``paired``: :func:`paired_logprob_deltas` (the spec path's |Δ| and the baseline decode
    path's at the same positions); None leaves the paired test out."""
    limit = max(policy.logprob_floor, policy.logprob_noise_multiple * noise)
    d = ev.deltas
    bad = np.flatnonzero(~(d <= limit))  # NaN on one side is over the limit too
    worst = bad[np.argsort(-np.nan_to_num(d[bad], nan=np.inf))][:5]
    over = [f"prompt {ev.at(i)[0]} position {ev.at(i)[1]}: spec logprob {ev.spec_lp[i]:.4f} vs "
            f"baseline {ev.base_lp[i]:.4f} (|Δ| {d[i]:.4f} nats > {limit:.4f})" for i in worst]
    finite = d[np.isfinite(d)]
    drift = drift_test(finite, kernel_noise, policy.max_logprob_drift, policy.logprob_drift_alpha)
    gold = (drift_test(finite, golden_sample, policy.max_logprob_drift, policy.logprob_drift_alpha)
            if golden_sample is not None and len(golden_sample) else None)
    budget = flip_budget(ev.margins, flips, kernel_noise, policy.flip_noise_multiple, policy.flip_slack)
    pair = (paired_drift_test(paired[0], paired[1], policy.max_logprob_drift, policy.logprob_drift_alpha)
            if paired is not None else None)
    return LogprobConsistency(len(d), limit, over, len(bad), drift, gold, budget, pair)


def decoded_context(detok, comp: Completion, pos: int, width: int = 8) -> str:
    """A decoded window of ``comp`` before ``pos`` and the token there (``⟦⟨end⟩⟧`` where the
    stream had already stopped: streams of different lengths are compared)."""
    if detok is None:
        return ""
    n = comp.n_tokens
    lo = max(0, min(pos, n) - width)
    here = detok([int(comp.token_ids[pos])]) if 0 <= pos < n else "⟨end⟩"
    return f"{detok(comp.token_ids[lo:min(pos, n)].tolist())}⟦{here}⟧"


# --- evaluation ----------------------------------------------------------------------------------

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
                 detok=None, stops: set[int] | None = None) -> Comparison:
    """``stops``: end-of-sequence ids (default: as the base run shows them, see
    :func:`verify.stop_tokens`), for the boundary check of each prompt."""
    base_by = base.by_prompt()
    if stops is None:
        stops = stop_tokens((c.token_ids, c.finish_reason) for c in base.completions)
    cmp = Comparison(0, 0, 0, 0, [])
    for c in other.completions:
        b = base_by.get(c.prompt_id)
        if b is None:
            continue
        divs = find_divergences(c.prompt_id, b.token_ids, b.topk_ids, b.topk_logprobs, c.token_ids,
                                c.topk_ids, c.topk_logprobs, tau_tie, tau_low, noise, max_gap=tau_low)
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
                    noise: float, detok=None) -> Together:
    first = replace(together, completions=together.corpus_copy(0), copies=0)
    cmp = compare_runs(alone, first, tau_tie, tau_low, noise, detok)
    copies = [together.corpus_copy(j) for j in range(together.copies)]
    split, split_divs = {}, []
    for i, c in enumerate(first.completions):
        n = unique_completions([cp[i].token_ids for cp in copies])
        if n > 1:
            split[c.prompt_id] = n
            split_divs += _split_divergences([cp[i] for cp in copies], tau_tie, tau_low, noise, detok)
    return Together(together.copies, len(together.completions), cmp.prompts, cmp.exact,
                    cmp.prefix_agreement, cmp.divergences, split, split_divs)


def baseline_not_invariant(suite: Suite, tau_tie: float, tau_low: float, noise: float) -> bool:
    """Whether the baseline's own run all at once splits identical copies or changes a prompt
    (then spec configs are judged against an engine that is not batch-invariant at ties)."""
    together = suite.load_together("baseline")
    ok = [r for r in suite.records("baseline") if r.status == "ok"]
    if together is None or together.status != "ok" or not ok:
        return False
    return together_result(ok[0], together, tau_tie, tau_low, noise).not_invariant


def _split_divergences(copies: list[Completion], tau_tie: float, tau_low: float, noise: float,
                       detok=None) -> list[Divergence]:
    """Each copy of one prompt that differs from the first copy, classified by margin like
    any divergence (the first copy on the baseline side)."""
    first = copies[0]
    out = []
    for cp in copies[1:]:
        divs = find_divergences(first.prompt_id, first.token_ids, first.topk_ids, first.topk_logprobs,
                                cp.token_ids, cp.topk_ids, cp.topk_logprobs, tau_tie, tau_low, noise,
                                max_gap=tau_low)
        out += [replace(d, context=decoded_context(detok, first, d.position)
                        if d.position < first.n_tokens else "") for d in divs]
    return out


def evaluate_config(suite: Suite, name: str, policy: Policy, tau_tie: float, tau_low: float,
                    noise: float, base_records: list[RunRecord], golden_acceptance: dict | None = None,
                    detok=None, base_speed: float | None = None,
                    noise_missing: str | None = None,
                    kernel_noise: np.ndarray | None = None,
                    golden_noise: dict | None = None,
                    baseline_not_invariant: bool = False) -> ConfigResult:
    """One config's figures and checks. ``noise_missing`` (from :func:`measure_noise`): why
    the path noise behind ``tau_tie``/``tau_low`` is unmeasured; checks that excuse a
    divergence by tau then fail rather than trust floor thresholds. ``kernel_noise``: the
    engine's kernel-path noise sample (:func:`kernel_noise_sample`); ``golden_noise``: the
    golden's |Δ logprob| sample per config; ``baseline_not_invariant``: the baseline's own
    run all at once splits or changes prompts."""
    records = list(suite.records(name))
    failed = [f"{r.label}: {(r.error or '').splitlines()[0] if r.error else 'failed'}"
              for r in records if r.status != "ok"]
    ok = [r for r in records if r.status == "ok"]

    # determinism: every repeat against the first, token for token
    nondet: list[str] = []
    identical: bool | None = None
    if len(ok) >= 2:
        ids = [c.prompt_id for c in ok[0].completions]
        empty = Completion("", [], [], [], [], [])
        comps = [[by.get(p, empty) for p in ids] for by in (rec.by_prompt() for rec in ok)]
        det = determinism([[c.token_ids for c in run] for run in comps],
                          [[c.logprobs for c in run] for run in comps],
                          policy.determinism_logprob_tolerance)
        identical = det.identical and (det.logprobs_identical
                                       or not policy.require_deterministic_logprobs)
        for run_i, prompt_i, pos in det.mismatches:
            rec = ok[run_i]
            nondet.append(f"r{rec.repeat} vs r{ok[0].repeat}: prompt {ids[prompt_i]} position {pos}"
                          + (f" ({rec.fresh_note})" if rec.fresh_note else ""))
        for run_i, prompt_i, pos, delta in det.logprob_mismatches:
            rec = ok[run_i]
            nondet.append(f"r{rec.repeat} vs r{ok[0].repeat}: prompt {ids[prompt_i]} same tokens but "
                          f"logprobs differ from position {pos} (max |Δ| {delta:.2g} nats)"
                          + (f" ({rec.fresh_note})" if rec.fresh_note else ""))

    # the corpus all at once (batch composition, identical concurrent requests)
    together, all_at_once = suite.load_together(name), None
    if together is not None and together.status != "ok":
        failed.append(f"all at once: {(together.error or 'failed').splitlines()[0]}")
    elif together is not None and ok:
        all_at_once = together_result(ok[0], together, tau_tie, tau_low, noise, detok)
        all_at_once.of_baseline = name == "baseline"
        all_at_once.baseline_not_invariant = name != "baseline" and bool(baseline_not_invariant)

    result = ConfigResult(
        config=name, repeats=len(records), failed_runs=failed, identical_runs=identical,
        nondeterminism=nondet, prompts=0, prompts_exact=0, prefix_agreement=None,
        token_agreement=None, text_similarity=None, divergences=[], tf_divergences=[],
        class_counts={}, attribution=suite.load_attribution(name) or [], acceptance=None,
        golden_tokens_per_iter=None, speed=Speed(None, None, None, None), together=all_at_once,
        missing=suite.missing(name))

    warm, cold, ttft = speed_of(ok)
    runs = [r for r in ok if r.repeat >= 0]
    cpu = all(c.decode_cpu_s is not None for r in runs for c in _warm(r))
    result.speed = Speed(warm, cold, ttft, warm / base_speed if warm and base_speed else None,
                         tuple(repeat_timing(r) for r in runs),
                         tuple(repeat_timing(r, "cpu") for r in runs) if cpu and runs else ())
    result.noise_missing = noise_missing
    is_spec = name != "baseline"
    if is_spec:
        _judge_counters(result, ok, name, together)

    base_ok = [r for r in base_records if r.status == "ok"]
    if is_spec and ok and not base_ok:
        result.missing_evidence.append("no complete baseline run to compare with (speccheck run "
                                       "--method baseline into the same --store)")
    if ok and base_ok:
        base = base_ok[0].by_prompt()
        run0 = ok[0]
        scored = suite.load_rescore(name, run0.repeat)
        stops = stop_tokens((c.token_ids, c.finish_reason) for r in base_ok for c in r.completions)
        free = compare_runs(base_ok[0], run0, tau_tie, tau_low, noise, detok, stops)
        result.prompts, result.prompts_exact = free.prompts, free.exact
        result.prompt_ids = [c.prompt_id for c in run0.completions if c.prompt_id in base]
        result.divergences = free.divergences
        result.boundaries = free.boundaries
        result.prefix_agreement = free.prefix_agreement
        if is_spec:
            result.missing_evidence += rescore_gaps(suite, name, run0.repeat, run0.completions)
            run0_prompts = run0.by_prompt()
            lacking = [p for p in base if p not in run0_prompts]
            if lacking:
                result.missing_evidence.append(
                    f"{name} r{run0.repeat} has no output for baseline prompt(s) "
                    f"{', '.join(lacking[:8])}{' ...' if len(lacking) > 8 else ''}")
        tf_agree = tf_total = 0
        sims = []
        for c in run0.completions:
            b = base.get(c.prompt_id)
            if b is None:
                continue
            sims.append(text_similarity(b.text, c.text))
            s = scored.get(c.prompt_id) if scored else None
            if s is not None and len(s.topk_ids) == c.n_tokens:
                agree = teacher_forced_agreement(c.token_ids, s.topk_ids)
                tf_agree += int(agree.sum())
                tf_total += len(agree)
                tfd = teacher_forced_divergences(c.prompt_id, c.token_ids, c.topk_ids, c.topk_logprobs,
                                                 s.topk_ids, s.topk_logprobs, tau_tie, tau_low, noise,
                                                 max_gap=tau_low)
                result.tf_divergences.extend(
                    replace(d, context=decoded_context(detok, c, d.position)) for d in tfd)
        result.token_agreement = tf_agree / tf_total if tf_total else None
        result.token_agreement_n = tf_total
        result.text_similarity = float(np.mean(sims)) if sims else None
        counts: dict[str, int] = {"near_tie": 0, "low_confidence": 0, "high_confidence": 0}
        for d in _token_divergences(result.divergences + result.tf_divergences):
            counts[d.classification.cls] += 1
        result.class_counts = counts
        if scored and name != "baseline":
            result.logprobs = logprob_consistency(
                logprob_evidence(run0, scored), len(_token_divergences(result.tf_divergences)), noise,
                kernel_noise if kernel_noise is not None else kernel_noise_sample(suite), policy,
                (golden_noise or {}).get(name),
                paired_logprob_deltas(base_ok[0], suite.load_rescore("baseline", base_ok[0].repeat), run0))

    # what drafting bought needs no baseline: a spec config stored alone still shows it
    spec = ok[0].spec_total() if ok else None
    if spec is not None and is_spec:
        try:
            result.acceptance = acceptance_summary(spec.drafts, spec.draft_tokens,
                                                   spec.accepted_tokens, spec.accepted_per_pos)
        except ValueError:  # impossible counters: counters_consistent names them
            result.acceptance = None
    if golden_acceptance and name in golden_acceptance:
        gold = golden_acceptance[name]
        gold = gold if isinstance(gold, dict) else {"tokens_per_iter": gold}  # overall only
        result.golden_tokens_per_iter = gold["tokens_per_iter"]
        if ok and gold.get("per_prompt"):
            result.golden_same_output = same_output_acceptance(
                per_prompt_acceptance(ok[0].completions),
                {p: tuple(v) for p, v in gold["per_prompt"].items()})

    result.checks = _checks(result, policy, is_baseline=(name == "baseline"))
    return result


def per_prompt_acceptance(completions: Sequence[Completion]) -> dict[str, tuple[int, int, str]]:
    """{prompt id: (drafts, accepted tokens, output digest)} of the completions that carry spec
    counters: what ``golden record`` keeps per config, what :func:`same_output_acceptance`
    compares."""
    return {c.prompt_id: (int(c.spec.drafts), int(c.spec.accepted_tokens), output_digest(c.token_ids))
            for c in completions if c.spec is not None}


def _token_divergences(divs: Sequence[Divergence]) -> list[Divergence]:
    """Divergences where both sides chose a token (those where one stream had already
    stopped are judged by same_stopping)."""
    return [d for d in divs if d.base_token != END and d.spec_token != END]


def _counter_tuple(c: Completion) -> tuple | None:
    s = c.spec
    return None if s is None else (s.drafts, s.draft_tokens, s.accepted_tokens,
                                   tuple(s.accepted_per_pos), s.iterations)


def _judge_counters(result: ConfigResult, ok: Sequence[RunRecord], name: str,
                    together: RunRecord | None = None) -> None:
    """counters_consistent's evidence (each request's counters against each other and
    against its emitted tokens, then each run's totals; the run all at once too) and
    acceptance determinism (the counters of every repeat against the first's)."""
    k = SpecConfig.from_name(name).k
    for rec in list(ok) + ([together] if together is not None and together.status == "ok" else []):
        label = "all at once" if rec.copies else f"r{rec.repeat}"
        with_spec = [c for c in rec.completions if c.spec is not None]
        for c in with_spec:
            s = c.spec
            for p in counter_problems(s.drafts, s.draft_tokens, s.accepted_tokens, s.accepted_per_pos,
                                      k, emitted=max(c.n_tokens - 1, 0), iterations=s.iterations):
                result.counter_problems.append(f"{label} prompt {c.prompt_id}: {p}")
        total = rec.spec_total()
        if total is None:
            continue
        emitted = sum(max(c.n_tokens - 1, 0) for c in with_spec)
        for p in counter_problems(total.drafts, total.draft_tokens, total.accepted_tokens,
                                  total.accepted_per_pos, k, emitted=emitted,
                                  iterations=total.iterations, requests=len(with_spec)):
            result.counter_problems.append(f"{label} all prompts: {p}")
        if rec is ok[0]:
            result.counter_views = tokens_per_iteration_views(
                total.drafts, total.accepted_tokens, total.accepted_per_pos, emitted, total.iterations)
    runs = [rec for rec in ok if any(c.spec is not None for c in rec.completions)]
    if len(runs) >= 2:
        ids = [c.prompt_id for c in runs[0].completions]
        tuples = [[_counter_tuple(by[p]) if p in by else None for p in ids]
                  for by in (rec.by_prompt() for rec in runs)]
        bad = acceptance_mismatches(tuples)
        result.acceptance_identical = not bad
        for ri, pi in bad:
            result.acceptance_nondeterminism.append(
                f"r{runs[ri].repeat} vs r{runs[0].repeat}: prompt {ids[pi]} counters "
                f"{_fmt_counters(tuples[ri][pi])} vs {_fmt_counters(tuples[0][pi])}"
                + (f" ({runs[ri].fresh_note})" if runs[ri].fresh_note else ""))


def _fmt_counters(t: tuple | None) -> str:
    if t is None:
        return "none"
    d, dt, a, per, it = t
    return (f"{d} drafts/{dt} draft tokens/{a} accepted, per position {list(per)}"
            + (f", {it} steps" if it is not None else ""))


def _fmt_div(d: Divergence) -> str:
    c = d.classification
    ctx = f" context {d.context!r}" if d.context else ""
    return (f"prompt {d.prompt_id} position {d.position}: baseline token {d.base_token} vs {d.spec_token}, "
            f"baseline margin {c.base_margin:.3f} nats ({d.margin_in_noise:.1f}x path noise), "
            f"spec margin {c.spec_margin:.3f}, rank of spec token in baseline top-k "
            f"{'absent' if c.spec_rank_in_base is None else c.spec_rank_in_base + 1} -> {c.cls}{ctx}")


def _checks(r: ConfigResult, p: Policy, is_baseline: bool) -> list[Check]:
    ran = (["engine failure: " + "; ".join(r.failed_runs)] if r.failed_runs else []) + r.missing
    checks = [Check("ran", not ran, "\n".join(ran) or "all planned runs completed")]
    if r.identical_runs is None:
        checks.append(Check("deterministic", not p.require_deterministic, "fewer than 2 stored runs to compare",
                            skipped=not p.require_deterministic))
    else:
        msg = (f"{r.repeats} runs identical token for token"
               + (", logprob for logprob" if p.require_deterministic_logprobs else "")
               if r.identical_runs else f"runs differ: {'; '.join(r.nondeterminism[:5])}")
        checks.append(Check("deterministic", r.identical_runs or not p.require_deterministic, msg))
    checks += _together_checks(r.together, p, r.noise_missing)
    if is_baseline:
        return checks

    agree_fail = [f"evidence missing: {m}" for m in r.missing_evidence]
    within_chance = ""
    if r.token_agreement is not None and r.token_agreement < p.min_token_agreement:
        n = r.token_agreement_n
        pval = below_floor_p(round(r.token_agreement * n), n, p.min_token_agreement) if n else 0.0
        if pval < p.agreement_alpha:
            agree_fail.append(f"teacher-forced token agreement {r.token_agreement:.2%} < "
                              f"{p.min_token_agreement:.2%} over {n} tokens (binomial p {pval:.2g})")
        else:
            within_chance = (f"; {r.token_agreement:.2%} is below {p.min_token_agreement:.2%} but "
                             f"within chance of it over {n} tokens (binomial p {pval:.2g} >= "
                             f"{p.agreement_alpha:g})")
    if r.prefix_agreement is not None and r.prefix_agreement < p.min_prefix_agreement:
        agree_fail.append(f"prefix agreement {r.prefix_agreement:.2%} < {p.min_prefix_agreement:.2%}")
    if r.text_similarity is not None and r.text_similarity < p.min_text_similarity:
        agree_fail.append(f"text similarity {r.text_similarity:.2%} < {p.min_text_similarity:.2%}")
    figures = (f"{r.prompts_exact}/{r.prompts} prompts exact, prefix "
               f"{_pct(r.prefix_agreement)}, teacher-forced {_pct(r.token_agreement)}, "
               f"text {_pct(r.text_similarity)}")
    checks.append(Check("agrees_with_baseline", not agree_fail,
                        figures + within_chance if not agree_fail else "; ".join(agree_fail) + f" ({figures})"))

    token_divs = _token_divergences(r.divergences + r.tf_divergences)
    high = [d for d in token_divs if d.classification.cls == "high_confidence"]
    seen, unique_high = set(), []
    for d in high:
        if (d.prompt_id, d.position) not in seen:
            seen.add((d.prompt_id, d.position))
            unique_high.append(d)
    excused = {(d.prompt_id, d.position) for d in token_divs} - seen
    unsure = [NOTHING_COMPARED] if not r.prompts else []
    if r.missing_evidence:
        unsure.append("evidence missing: divergences past the first cannot be classified without "
                      "the teacher-forced rescoring (see agrees_with_baseline)")
    if r.noise_missing and excused:
        unsure.append(_untrusted_tau(len(excused), r.noise_missing))
    checks.append(Check(
        "divergences_are_low_confidence", len(unique_high) <= p.max_high_confidence and not unsure,
        "; ".join(unsure + [f"{len(unique_high)} high-confidence divergence(s) (max {p.max_high_confidence})"])
        + ("".join("\n    " + _fmt_div(d) for d in unique_high[:5])
           + (f"\n    ... and {len(unique_high) - 5} more" if len(unique_high) > 5 else ""))))
    checks.append(_stopping_check(r))
    checks.append(_counters_check(r))
    checks.append(_acceptance_determinism_check(r, p))

    checks.append(_logprobs_check(r.logprobs, r.noise_missing))

    acc = r.acceptance
    if acc is None and r.counter_problems:
        checks.append(Check("acceptance_not_regressed", False,
                            "the spec counters are impossible, so acceptance cannot be measured "
                            "(see counters_consistent)"))
    elif acc is None or acc.drafts == 0:
        checks.append(Check("acceptance_not_regressed", False,
                            "the engine reported no drafts: this config did not actually speculate "
                            "(spec counters missing or zero)"))
    else:
        problems = []
        if acc.tokens_per_iter < p.min_tokens_per_iter:
            problems.append(f"{acc.tokens_per_iter:.2f} tokens/iteration < {p.min_tokens_per_iter:.2f}")
        same = r.golden_same_output
        where = (f" on the {same.shared} of {same.prompts} prompts whose output is the golden run's "
                 "token for token") if same else ""
        if same is not None and same.today < same.golden * (1 - p.max_acceptance_drop):
            problems.append(f"{same.today:.2f} tokens/iteration{where} fell more than "
                            f"{p.max_acceptance_drop:.0%} below the golden's {same.golden:.2f} there")
        elif same is None and r.golden_tokens_per_iter is not None and \
                acc.tokens_per_iter < r.golden_tokens_per_iter * (1 - p.max_acceptance_drop):
            problems.append(f"{acc.tokens_per_iter:.2f} tokens/iteration fell more than "
                            f"{p.max_acceptance_drop:.0%} below golden {r.golden_tokens_per_iter:.2f}")
        shared = f"; {same.today:.2f} vs {same.golden:.2f}{where}" if same else ""
        gold = f" (golden {r.golden_tokens_per_iter:.2f}{shared})" if r.golden_tokens_per_iter else ""
        checks.append(Check("acceptance_not_regressed", not problems,
                            "; ".join(problems) if problems else f"{acc.tokens_per_iter:.2f} tokens/iteration{gold}"))

    sp = r.speed.speedup
    if p.min_speedup <= 0:
        checks.append(Check("speedup", True, f"speedup {_x(sp)} (not gated)", skipped=True))
    else:
        checks.append(Check("speedup", sp is not None and sp >= p.min_speedup,
                            f"warm speedup {_x(sp)} vs required {p.min_speedup:.2f}x"))
    return checks


def _drift_str(t: DriftTest, against: str) -> str:
    s, ref = t.spec, t.reference
    return (f"|Δ| median {s.median:.4f} / p90 {s.p90:.4f} / max {s.max:.4f} nats over {s.n} positions vs "
            f"{against} {ref.median:.4f} / {ref.p90:.4f} / {ref.max:.4f} ({ref.n}): ratio {t.ratio:.2f} "
            f"(max {t.max_ratio:.2f}), KS D+ {t.ks:.3f}, rank-test p {t.p:.2g}")


def _paired_str(t: PairedDriftTest) -> str:
    return (f"|Δ| median {t.spec.median:.4f} nats vs the baseline decode path's {t.reference.median:.4f} "
            f"over {t.n} shared positions: ratio {t.ratio:.2f} (max {t.max_ratio:.2f}), "
            f"signed-rank p {t.p:.2g}")


def _logprobs_check(lc: LogprobConsistency | None, noise_missing: str | None = None) -> Check:
    """logprobs_consistent: where spec and baseline chose the same token in the same context,
    the spec engine's reported logprob is the baseline's up to path noise -- one by one, as a
    distribution (drift too small to flip more than near-ties), and in the flips it causes."""
    if lc is None:
        return Check("logprobs_consistent", False, "evidence missing: no teacher-forced rescoring of "
                     f"this config, so its reported logprobs cannot be checked; {RESUME}")
    if noise_missing:
        return Check("logprobs_consistent", False, f"the engine's path noise is unmeasured "
                     f"({noise_missing}): reported logprobs cannot be judged against it")
    problems = []
    if lc.n_over:
        problems.append(f"{lc.n_over} of {lc.positions} position(s) with |Δ logprob| above "
                        f"{lc.limit:.4f} nats" + "".join("\n    " + o for o in lc.over))
    for t, against in ((lc.drift, "kernel-path noise"), (lc.golden_drift, "golden")):
        if t is not None and t.drifted:
            problems.append(f"logprobs drifted from the {against}: {_drift_str(t, against)}")
    if lc.paired is not None and lc.paired.drifted:
        problems.append("logprobs drifted from the baseline's decode path at the same positions: "
                        + _paired_str(lc.paired))
    f = lc.flips
    flips = (f"{f.flips} teacher-forced flip(s) where the noise predicts {f.expected:.1f} "
             f"({f.at_risk} of {f.positions} positions within the noise level; at most {f.allowed})")
    if f.excess:
        problems.append("more flips than the path noise explains: " + flips)
    # the figures, each once: those a problem already quotes are not repeated after it
    figures = [] if lc.drift is not None and lc.drift.drifted else [_drift_str(lc.drift, "kernel-path noise")]
    figures += [] if f.excess else [flips]
    if lc.paired is not None and not lc.paired.drifted:
        figures.append("paired: " + _paired_str(lc.paired))
    if lc.golden_drift is not None and not lc.golden_drift.drifted:
        figures.append(f"golden ratio {lc.golden_drift.ratio:.2f}, p {lc.golden_drift.p:.2g}")
    summary = "; ".join(figures)
    if not problems:
        return Check("logprobs_consistent", True, summary)
    return Check("logprobs_consistent", False,
                 "; ".join(problems) + (f" ({summary})" if summary else ""))


NOTHING_COMPARED = "evidence missing: no prompt was compared with a baseline output"


def _untrusted_tau(n: int, why: str) -> str:
    return (f"{n} divergence(s) would be excused as near-tie/low-confidence, but the thresholds "
            f"were not calibrated -- path noise unmeasured ({why}); they came from the policy "
            "floors, so nothing is excused")


def _stopping_check(r: ConfigResult) -> Check:
    """same_stopping: each spec output stops where the baseline's does (same length, same
    finish reason, nothing past max_tokens or an end-of-sequence token), unless a tolerated
    flip earlier in that prompt moved the stop."""
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
    unsure = [_untrusted_tau(len(moved), r.noise_missing)] if r.noise_missing and moved else []
    if not r.prompts:
        unsure.append(NOTHING_COMPARED)
    if bad:
        head = f"{len(bad)} prompt(s) stop elsewhere with nothing to explain it; " + head
    return Check("same_stopping", not bad and not unsure,
                 "; ".join(unsure + [head]) + "".join("\n    " + x for x in lines))


def _counters_check(r: ConfigResult) -> Check:
    """counters_consistent: spec counters agree with each other and with the tokens emitted."""
    v = r.counter_views
    if not v and not r.counter_problems:
        return Check("counters_consistent", True, "the engine reported no spec counters", skipped=True)
    views = ", ".join(f"{name} say {x:.2f}" if x is not None else f"{name} say -"
                      for name, x in v.items())
    views = f"tokens/iteration: {views}" if views else "no counters in the first run"
    if not r.counter_problems:
        return Check("counters_consistent", True,
                     f"{views}; counters agree with each other and with the tokens emitted "
                     "(an output cut at max_tokens or end-of-sequence drops up to K accepted tokens)")
    more = f"\n    ... and {len(r.counter_problems) - 8} more" if len(r.counter_problems) > 8 else ""
    return Check("counters_consistent", False,
                 f"{len(r.counter_problems)} impossible counter reading(s) for config {r.config} "
                 f"({views})" + "".join("\n    " + x for x in r.counter_problems[:8]) + more)


def _acceptance_determinism_check(r: ConfigResult, p: Policy) -> Check:
    """acceptance_deterministic: the spec counters repeat run to run (gated only if asked:
    near-ties may flip accept/reject with identical output -- performance, not correctness)."""
    gated = p.require_deterministic_acceptance
    note = "" if gated else " (reported, not gated: policy require_deterministic_acceptance)"
    if r.acceptance_identical is None:
        return Check("acceptance_deterministic", not gated,
                     "fewer than 2 runs with spec counters to compare" + note, skipped=not gated)
    if r.acceptance_identical:
        return Check("acceptance_deterministic", True,
                     f"spec counters identical in every run, prompt by prompt{note}", skipped=not gated)
    return Check("acceptance_deterministic", not gated,
                 f"spec counters differ run to run for {len(r.acceptance_nondeterminism)} prompt(s): "
                 + "; ".join(r.acceptance_nondeterminism[:5]) + note, skipped=not gated)


def _together_checks(t: Together | None, p: Policy, noise_missing: str | None = None) -> list[Check]:
    """batch_invariant: each prompt inside a batch of all the others (and of copies of
    itself) gives its tokens alone, or -- unless the policy asks for exact invariance -- at
    least flips no high-confidence token. concurrent_identical: identical requests in flight
    together give one completion."""
    if t is None:
        why = "no run of the corpus all at once (speccheck run --concurrent N)"
        return [Check("batch_invariant", True, why, skipped=True),
                Check("concurrent_identical", True, why, skipped=True)]
    figures = (f"{t.exact}/{t.prompts} prompts exact inside a batch of {t.requests}, prefix "
               f"{_pct(t.prefix_agreement)}, {len(t.divergences)} divergence(s), "
               f"{len(t.high)} high-confidence")
    problems = t.high if not p.require_batch_invariant else t.divergences
    if p.require_batch_invariant and t.baseline_not_invariant:  # judged against its engine
        problems = [d for d in t.divergences if d.cls != "near_tie"]
        figures += f"; the baseline is not batch-invariant either: {NOT_INVARIANT}"
    excused = len(t.divergences) - len(t.high) if not p.require_batch_invariant else 0
    unsure = [_untrusted_tau(excused, noise_missing)] if noise_missing and excused else []
    batch = Check("batch_invariant", len(problems) <= (0 if p.require_batch_invariant
                                                         else p.max_high_confidence) and not unsure,
                  "; ".join(unsure + [figures]) + "".join("\n    " + _fmt_div(d) for d in problems[:5]))
    concurrent = _concurrent_check(t, p, noise_missing)
    return [batch, concurrent]


NOT_INVARIANT = "this engine is not batch-invariant at ties, with or without speculation"


def _concurrent_check(t: Together, p: Policy, noise_missing: str | None = None) -> Check:
    """concurrent_identical: identical requests in flight together give one completion -- or,
    unless the policy is strict, differ only at near-ties (exact ties included: real servers
    batch identical requests out of step, and bf16 ties then go either way). Where the
    baseline splits too, a config is judged against that engine: near-tie splits are never
    counted against it, and (unless strict) low-confidence ones neither; high-confidence
    splits always fail."""
    tolerated = set() if p.require_concurrent_identical else {"near_tie"}
    if t.baseline_not_invariant:
        tolerated |= {"near_tie"} | (set() if p.require_concurrent_identical else {"low_confidence"})
    bad = [d for d in t.split_divergences if d.cls not in tolerated]
    if t.split and not t.split_divergences:  # split copies but nothing to classify: never excused
        bad = [None]
    excused = len(t.split_divergences) - len([d for d in bad if d is not None])
    unsure = [_untrusted_tau(excused, noise_missing)] if noise_missing and excused else []
    split = ", ".join(f"{pid}: {n} distinct" for pid, n in t.split.items())
    msg = (f"{t.copies} identical concurrent requests per prompt -> "
           + (f"more than one completion for {len(t.split)} prompt(s) ({split})" if t.split
              else "1 completion each"))
    if t.baseline_not_invariant:
        msg += f"; the baseline is not batch-invariant either: {NOT_INVARIANT}"
    elif t.of_baseline and t.not_invariant:
        msg += f"; {NOT_INVARIANT}"
    if t.split:
        strict = " (strict: require_concurrent_identical)" if p.require_concurrent_identical else ""
        msg += (f"; {len([d for d in bad if d is not None])} split(s) not explained by a near-tie{strict}"
                + "".join("\n    " + _fmt_div(d) for d in t.split_divergences[:5]))
    return Check("concurrent_identical", not bad and not unsure, "; ".join(unsure + [msg]))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.2%}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def judged_configs(suite: Suite, demanded: Sequence[str] = ()) -> list[str]:
    """Every config a verdict covers: stored, planned, or demanded on the command line."""
    return sorted({*suite.configs(), *suite.planned_configs(), *demanded}, key=config_sort_key)


def evaluate_suite(suite: Suite, policy: Policy, configs: Sequence[str] | None = None,
                   golden_acceptance: dict | None = None, detok=None,
                   golden_noise: dict | None = None) -> SuiteResult:
    """``golden_noise``: {config: |Δ| sample} recorded with the golden (golden.golden_noise)."""
    names = list(configs) if configs is not None else judged_configs(suite)
    base_records = list(suite.records("baseline"))
    noise, noise_missing = measure_noise(suite)
    kernel = kernel_noise_sample(suite)
    tau_tie, tau_low = calibrate_thresholds(noise, policy.tie_noise_multiple, policy.low_noise_multiple,
                                            policy.tie_floor, policy.low_floor)
    base_speed = speed_of([r for r in base_records if r.status == "ok"])[0] if base_records else None
    base_variant = baseline_not_invariant(suite, tau_tie, tau_low, noise)
    identity = next((r.identity for r in base_records if r.identity), {})
    results = [evaluate_config(suite, n, policy, tau_tie, tau_low, noise, base_records,
                               golden_acceptance, detok, base_speed, noise_missing, kernel,
                               golden_noise, base_variant) for n in names]
    return SuiteResult(suite.id, suite.meta, identity, noise, tau_tie, tau_low, policy.to_dict(), results,
                       noise_missing, suite.load_plan(), speedup_models(results))


# --- two suites: what changed between them and what it changed ---------------------------------

#: identity keys a comparison of two suites names when they differ (key, label, value when a
#: suite's identity lacks the key: a run without TP ran on one GPU)
IDENTITY_FIELDS = (
    ("engine", "engine", None), ("version", "engine version", None),
    ("model_hash", "model weights", None), ("draft_hash", "draft weights", None),
    ("tokenizer_hash", "tokenizer", None), ("dtype", "dtype", None),
    ("device", "GPU model", None), ("gpu_driver", "GPU driver", None),
    ("torch", "torch version", None), ("cuda", "CUDA version", None),
    ("tensor_parallel_size", "TP size", 1), ("pipeline_parallel_size", "PP size", 1),
    ("gpus_used", "GPUs used", 1), ("interconnect", "interconnect", None),
    ("distributed_executor_backend", "executor", None), ("all_reduce", "all-reduce", None),
    ("nccl_version", "NCCL version", None),
    ("attention_backend", "attention backend", None),
    ("draft_attention_backend", "drafter attention backend", None),
    ("gdn_prefill_backend", "GDN prefill backend", None),
    ("gdn_decode_kernel", "GDN decode kernel", None), ("gdn_verify_kernel", "GDN verify kernel", None),
    ("cudagraph_mode", "CUDA graphs", None), ("knobs", "kernel knobs", None),
)
#: fields that follow from the TP and PP sizes (vLLM runs one GPU without an executor process
#: or all-reduce, and TP x PP GPUs over their links otherwise): named, not blamed, when the
#: sizes themselves differ
FOLLOW_PARALLEL = {"gpus_used", "interconnect", "distributed_executor_backend", "all_reduce"}
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


@dataclass
class IdentityChange:
    key: str
    label: str
    a: object
    b: object
    follows: bool = False  # a consequence of another change (GPUs and links follow TP/PP)

    def __str__(self) -> str:
        return f"{self.label} {_show(self.a)} → {_show(self.b)}"


def _show(v) -> str:
    """An identity value, short: a sha256 by its first 12 digits, nothing as a dash."""
    return "—" if v is None else (v[:12] if isinstance(v, str) and len(v) == 64 else str(v))


def identity_changes(a: dict, b: dict) -> list[IdentityChange]:
    """The IDENTITY_FIELDS in which two runs' identities differ, those that follow from a TP/PP
    change marked ``follows``."""
    out = []
    for key, label, default in IDENTITY_FIELDS:
        va, vb = a.get(key, default), b.get(key, default)
        if key == "dtype":
            va, vb = (_DTYPES.get(str(v).lower(), str(v).lower()) if v is not None else None for v in (va, vb))
        if isinstance(va, dict) and isinstance(vb, dict):  # name the entries that differ
            out += [IdentityChange(f"{key}.{k}", f"{label[:-1]} {k}", va.get(k), vb.get(k))
                    for k in sorted(set(va) | set(vb)) if va.get(k) != vb.get(k)]
        elif va != vb:
            out.append(IdentityChange(key, label, va, vb))
    sizes = any(c.key in ("tensor_parallel_size", "pipeline_parallel_size") for c in out)
    for c in out:
        c.follows = sizes and c.key in FOLLOW_PARALLEL
    return out


def changes_cause(changes: Sequence[IdentityChange]) -> str:
    """What a difference between the suites is blamed on: the changed fields' labels."""
    primary = [c.label for c in changes if not c.follows]
    if not primary:
        return "nothing recorded in the identity"
    return ", ".join(primary[:4]) + (f" and {len(primary) - 4} more" if len(primary) > 4 else "")


def changes_str(changes: Sequence[IdentityChange]) -> str:
    if not changes:
        return "identical identities (the same engine, model, GPUs and layout)"
    primary = [str(c) for c in changes if not c.follows]
    follows = [str(c) for c in changes if c.follows]
    return "; ".join(primary) + (f" (with it: {'; '.join(follows)})" if follows else "")


_SHORT = {"tensor_parallel_size": "TP", "pipeline_parallel_size": "PP"}


def side_names(changes: Sequence[IdentityChange]) -> tuple[str, str]:
    """Names for the two sides from their first changed field ("TP=1", "TP=2"), else A and B."""
    for c in changes:
        if not c.follows and not (isinstance(c.a, (dict, list)) or isinstance(c.b, (dict, list))):
            short = _SHORT.get(c.key, c.label)
            return f"{short}={_show(c.a)}", f"{short}={_show(c.b)}"
    return ("A", "B")


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


def compare_suites(a: Suite, b: Suite, configs: Sequence[str], policy: Policy, detok=None) -> SuiteComparison:
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
