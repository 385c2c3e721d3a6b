"""From a stored suite to verdicts: every figure diff/gate/report/pytest print comes from here.

Measures each config's figures from the store (calling the pure functions of verify/), then lets
every check of the registry (speccheck/checks/) judge them under the policy. No engine is touched.
"""
from __future__ import annotations

from dataclasses import replace
from statistics import median
from typing import Sequence

import numpy as np

from speccheck.checks import Context, judge_all, measure_all
from speccheck.compare import compare_runs, decoded_context, together_result, token_divergences
from speccheck.evidence import (LogprobEvidence, kernel_noise_sample, logprob_evidence, measure_noise,
                                paired_logprob_deltas, rescore_gaps)
from speccheck.policy import Policy
from speccheck.results import ConfigResult, LogprobConsistency, Speed, SuiteResult
from speccheck.store import Suite, config_sort_key
from speccheck.types import Completion, RunRecord, SpecConfig, SpecCounters, sampling_of
from speccheck.verify import (
    RepeatTiming,
    SpeedupModel,
    acceptance_mismatches,
    acceptance_summary,
    calibrate_thresholds,
    counter_problems,
    detectable_ratio,
    determinism,
    drift_test,
    flip_budget,
    output_digest,
    paired_drift_test,
    same_output_acceptance,
    speedup_model,
    stop_tokens,
    teacher_forced_agreement,
    teacher_forced_divergences,
    text_similarity,
    tokens_per_iteration_views,
)

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
    total = sum(specs[1:], specs[0] + SpecCounters(iterations=0, draft_s=0.0, requests=0)) if specs else None
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
    power = (detectable_ratio(paired[0], paired[1], policy.logprob_drift_alpha)
             if paired is not None else None)
    return LogprobConsistency(len(d), limit, over, len(bad), drift, gold, budget, pair, power)



def baseline_not_invariant(suite: Suite, tau_tie: float, tau_low: float, noise: float) -> bool:
    """Whether the baseline's own run all at once splits identical copies or changes a prompt
    (then spec configs are judged against an engine that is not batch-invariant at ties)."""
    together = suite.load_together("baseline")
    ok = [r for r in suite.records("baseline") if r.status == "ok"]
    if together is None or together.status != "ok" or not ok:
        return False
    return together_result(ok[0], together, tau_tie, tau_low, noise,
                           sampled=sampling_of(suite.meta.get("engine_args")) is not None).not_invariant



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
        all_at_once = together_result(ok[0], together, tau_tie, tau_low, noise, detok,
                                      sampled=sampling_of(suite.meta.get("engine_args")) is not None)
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
        for d in token_divergences(result.divergences + result.tf_divergences):
            counts[d.classification.cls] += 1
        result.class_counts = counts
        if scored and name != "baseline":
            result.logprobs = logprob_consistency(
                logprob_evidence(run0, scored), len(token_divergences(result.tf_divergences)), noise,
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

    gold = (golden_acceptance or {}).get(name)
    result.sampling = sampling_of(suite.meta.get("engine_args"))
    result.measured = measure_all(Context(suite, name, policy, ok, base_records, tau_tie, tau_low, noise, detok,
                                          gold if isinstance(gold, dict) else None))
    result.checks = judge_all(result, policy)
    return result



def per_prompt_acceptance(completions: Sequence[Completion]) -> dict[str, tuple[int, int, str]]:
    """{prompt id: (drafts, accepted tokens, output digest)} of the completions that carry spec
    counters: what ``golden record`` keeps per config, what :func:`same_output_acceptance`
    compares."""
    return {c.prompt_id: (int(c.spec.drafts), int(c.spec.accepted_tokens), output_digest(c.token_ids))
            for c in completions if c.spec is not None}



def _counter_tuple(c: Completion) -> tuple | None:
    s = c.spec
    return None if s is None else (s.drafts, s.draft_tokens, s.accepted_tokens,
                                   tuple(s.accepted_per_pos), s.iterations)


def _emitted_by_counters(completions: Sequence[Completion]) -> list[int]:
    """Tokens after the first that each completion's counters cover: its own, or, for the
    first sample of a vLLM request of n samples (counters shared, ``requests`` n), those of
    that sample and the n - 1 samples after it."""
    comps = list(completions)
    return [sum(max(x.n_tokens - 1, 0)
                for x in comps[i:i + max(c.spec.requests if c.spec is not None else 1, 1)])
            for i, c in enumerate(comps)]


def _judge_counters(result: ConfigResult, ok: Sequence[RunRecord], name: str,
                    together: RunRecord | None = None) -> None:
    """counters_consistent's evidence (each request's counters against each other and
    against its emitted tokens, then each run's totals; the run all at once too) and
    acceptance determinism (the counters of every repeat against the first's)."""
    k = SpecConfig.from_name(name).k
    for rec in list(ok) + ([together] if together is not None and together.status == "ok" else []):
        label = "all at once" if rec.copies else f"r{rec.repeat}"
        covered = _emitted_by_counters(rec.completions)
        with_spec = [(c, e) for c, e in zip(rec.completions, covered) if c.spec is not None]
        for c, e in with_spec:
            s = c.spec
            for p in counter_problems(s.drafts, s.draft_tokens, s.accepted_tokens, s.accepted_per_pos,
                                      k, emitted=e, iterations=s.iterations, requests=s.requests):
                result.counter_problems.append(f"{label} prompt {c.prompt_id}: {p}")
        total = rec.spec_total()
        if total is None:
            continue
        emitted = sum(e for _, e in with_spec)
        for p in counter_problems(total.drafts, total.draft_tokens, total.accepted_tokens,
                                  total.accepted_per_pos, k, emitted=emitted,
                                  iterations=total.iterations, requests=total.requests):
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

