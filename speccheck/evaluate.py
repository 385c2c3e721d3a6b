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
from speccheck.store import Suite
from speccheck.types import Completion, RunRecord
from speccheck.verify import (
    Acceptance,
    DriftTest,
    FlipBudget,
    Divergence,
    acceptance_summary,
    calibrate_thresholds,
    abs_deltas,
    determinism,
    drift_test,
    find_divergences,
    flip_budget,
    margins,
    path_noise,
    teacher_forced_agreement,
    teacher_forced_divergences,
    text_similarity,
    unique_completions,
)

CHECKS = ("ran", "deterministic", "batch_invariant", "concurrent_identical",
          "agrees_with_baseline", "divergences_are_low_confidence", "logprobs_consistent",
          "acceptance_not_regressed", "speedup")


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
    golden's sample of this config, when recorded), and the teacher-forced flips against what
    that noise predicts."""

    positions: int
    limit: float
    over: list[str]  # evidence of the worst positions over the limit
    n_over: int
    drift: DriftTest
    golden_drift: DriftTest | None
    flips: FlipBudget


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
                "noise": self.noise, "tau_tie": self.tau_tie, "tau_low": self.tau_low,
                "policy": self.policy, "passed": self.passed,
                "configs": [c.to_dict() for c in self.configs]}


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


def suite_noise(suite: Suite) -> float:
    """The engine's own path noise: its decode-path logprobs of the baseline's tokens against
    the teacher-forced (prefill-path) logprobs of the same tokens."""
    if not suite.is_complete("baseline", 0):
        return 0.0
    scored = suite.load_rescore("baseline", 0)
    if not scored:
        return 0.0
    a, b = [], []
    for c in suite.load_run("baseline", 0).completions:
        s = scored.get(c.prompt_id)
        if s is not None and len(s.token_logprobs) == c.n_tokens:
            a.append(c.logprobs)
            b.append(s.token_logprobs)
    return float(path_noise(np.concatenate(a), np.concatenate(b))) if a else 0.0


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
    where, the spec-reported and the baseline's logprob; and the baseline's teacher-forced
    margin at every position (flip risk)."""

    where: list[tuple[str, int]]
    spec_lp: np.ndarray
    base_lp: np.ndarray
    margins: np.ndarray

    @property
    def deltas(self) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            return np.abs(self.spec_lp.astype(np.float64) - self.base_lp.astype(np.float64))


def logprob_evidence(run: RunRecord, scored: dict | None) -> LogprobEvidence:
    where, s_lp, b_lp, marg = [], [], [], []
    for c in run.completions:
        s = (scored or {}).get(c.prompt_id)
        if s is None or len(s.token_logprobs) != c.n_tokens or len(c.logprobs) != c.n_tokens:
            continue
        if c.n_tokens:
            marg.append(margins(s.topk_logprobs))
        for i in np.flatnonzero(s.topk_ids[:, 0] == c.token_ids) if c.n_tokens else ():
            where.append((c.prompt_id, int(i)))
            s_lp.append(c.logprobs[i])
            b_lp.append(s.token_logprobs[i])
    return LogprobEvidence(where, np.asarray(s_lp, np.float64), np.asarray(b_lp, np.float64),
                           np.concatenate(marg) if marg else np.zeros(0))


def spec_delta_sample(suite: Suite, name: str) -> np.ndarray:
    """|spec-reported - baseline teacher-forced logprob| at the agreeing positions of a
    config's run 0 (what ``golden record`` stores per config)."""
    if not suite.is_complete(name, 0):
        return np.zeros(0)
    d = logprob_evidence(suite.load_run(name, 0), suite.load_rescore(name, 0)).deltas
    return d[np.isfinite(d)]


def logprob_consistency(ev: LogprobEvidence, flips: int, noise: float, kernel_noise: np.ndarray,
                        policy: Policy, golden_sample: np.ndarray | None = None) -> LogprobConsistency:
    limit = max(policy.logprob_floor, policy.logprob_noise_multiple * noise)
    d = ev.deltas
    bad = np.flatnonzero(~(d <= limit))  # NaN on one side is over the limit too
    worst = bad[np.argsort(-np.nan_to_num(d[bad], nan=np.inf))][:5]
    over = [f"prompt {ev.where[i][0]} position {ev.where[i][1]}: spec logprob {ev.spec_lp[i]:.4f} vs "
            f"baseline {ev.base_lp[i]:.4f} (|Δ| {d[i]:.4f} nats > {limit:.4f})" for i in worst]
    finite = d[np.isfinite(d)]
    drift = drift_test(finite, kernel_noise, policy.max_logprob_drift, policy.logprob_drift_alpha)
    gold = (drift_test(finite, golden_sample, policy.max_logprob_drift, policy.logprob_drift_alpha)
            if golden_sample is not None and len(golden_sample) else None)
    budget = flip_budget(ev.margins, flips, kernel_noise, policy.flip_noise_multiple, policy.flip_slack)
    return LogprobConsistency(len(d), limit, over, len(bad), drift, gold, budget)


def decoded_context(detok, comp: Completion, pos: int, width: int = 8) -> str:
    if detok is None:
        return ""
    lo = max(0, pos - width)
    return f"{detok(comp.token_ids[lo:pos].tolist())}⟦{detok([int(comp.token_ids[pos])])}⟧"


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
                 detok=None) -> Comparison:
    base_by = base.by_prompt()
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
        cmp.divergences.extend(replace(d, context=decoded_context(detok, b, d.position)) for d in divs)
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
                    kernel_noise: np.ndarray | None = None,
                    golden_noise: dict | None = None,
                    baseline_not_invariant: bool = False) -> ConfigResult:
    records = list(suite.records(name))
    failed = [f"r{r.repeat}: {(r.error or '').splitlines()[0] if r.error else 'failed'}"
              for r in records if r.status != "ok"]
    ok = [r for r in records if r.status == "ok"]

    # determinism: every repeat against the first, token for token
    nondet: list[str] = []
    identical: bool | None = None
    if len(ok) >= 2:
        ids = [c.prompt_id for c in ok[0].completions]
        empty = Completion("", [], [], [], [], [])
        comps = [[rec.by_prompt().get(p, empty) for p in ids] for rec in ok]
        det = determinism([[c.token_ids for c in run] for run in comps],
                          [[c.logprobs for c in run] for run in comps],
                          policy.determinism_logprob_tolerance)
        identical = det.identical and (det.logprobs_identical
                                       or not policy.require_deterministic_logprobs)
        for run_i, prompt_i, pos in det.mismatches:
            rec = ok[run_i]
            nondet.append(f"r{rec.repeat} vs r{ok[0].repeat}: prompt {ids[prompt_i]} position {pos}"
                          + (" (fresh process)" if rec.fresh_process else ""))
        for run_i, prompt_i, pos, delta in det.logprob_mismatches:
            rec = ok[run_i]
            nondet.append(f"r{rec.repeat} vs r{ok[0].repeat}: prompt {ids[prompt_i]} same tokens but "
                          f"logprobs differ from position {pos} (max |Δ| {delta:.2g} nats)"
                          + (" (fresh process)" if rec.fresh_process else ""))

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
        golden_tokens_per_iter=None, speed=Speed(None, None, None, None), together=all_at_once)

    warm, cold, ttft = speed_of(ok)
    result.speed = Speed(warm, cold, ttft, warm / base_speed if warm and base_speed else None)

    base_ok = [r for r in base_records if r.status == "ok"]
    if ok and base_ok:
        base = base_ok[0].by_prompt()
        run0 = ok[0]
        scored = suite.load_rescore(name, run0.repeat)
        free = compare_runs(base_ok[0], run0, tau_tie, tau_low, noise, detok)
        result.prompts, result.prompts_exact = free.prompts, free.exact
        result.divergences = free.divergences
        result.prefix_agreement = free.prefix_agreement
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
        result.text_similarity = float(np.mean(sims)) if sims else None
        counts: dict[str, int] = {"near_tie": 0, "low_confidence": 0, "high_confidence": 0}
        for d in result.divergences + result.tf_divergences:
            counts[d.classification.cls] += 1
        result.class_counts = counts
        if scored and name != "baseline":
            result.logprobs = logprob_consistency(
                logprob_evidence(run0, scored), len(result.tf_divergences), noise,
                kernel_noise if kernel_noise is not None else kernel_noise_sample(suite), policy,
                (golden_noise or {}).get(name))

        spec = run0.spec_total()
        if spec is not None and name != "baseline":
            result.acceptance = acceptance_summary(spec.drafts, spec.draft_tokens, spec.accepted_tokens,
                                                   spec.accepted_per_pos)
        if golden_acceptance and name in golden_acceptance:
            result.golden_tokens_per_iter = golden_acceptance[name]

    result.checks = _checks(result, policy, is_baseline=(name == "baseline"))
    return result


def _fmt_div(d: Divergence) -> str:
    c = d.classification
    ctx = f" context {d.context!r}" if d.context else ""
    return (f"prompt {d.prompt_id} position {d.position}: baseline token {d.base_token} vs {d.spec_token}, "
            f"baseline margin {c.base_margin:.3f} nats ({d.margin_in_noise:.1f}x path noise), "
            f"spec margin {c.spec_margin:.3f}, rank of spec token in baseline top-k "
            f"{'absent' if c.spec_rank_in_base is None else c.spec_rank_in_base + 1} -> {c.cls}{ctx}")


def _checks(r: ConfigResult, p: Policy, is_baseline: bool) -> list[Check]:
    checks = [Check("ran", not r.failed_runs,
                    "all runs completed" if not r.failed_runs else "engine failure: " + "; ".join(r.failed_runs))]
    if r.identical_runs is None:
        checks.append(Check("deterministic", not p.require_deterministic, "fewer than 2 stored runs to compare",
                            skipped=not p.require_deterministic))
    else:
        msg = (f"{r.repeats} runs identical token for token"
               + (", logprob for logprob" if p.require_deterministic_logprobs else "")
               if r.identical_runs else f"runs differ: {'; '.join(r.nondeterminism[:5])}")
        checks.append(Check("deterministic", r.identical_runs or not p.require_deterministic, msg))
    checks += _together_checks(r.together, p)
    if is_baseline:
        return checks

    agree_fail = []
    if r.token_agreement is not None and r.token_agreement < p.min_token_agreement:
        agree_fail.append(f"teacher-forced token agreement {r.token_agreement:.2%} < {p.min_token_agreement:.2%}")
    if r.prefix_agreement is not None and r.prefix_agreement < p.min_prefix_agreement:
        agree_fail.append(f"prefix agreement {r.prefix_agreement:.2%} < {p.min_prefix_agreement:.2%}")
    if r.text_similarity is not None and r.text_similarity < p.min_text_similarity:
        agree_fail.append(f"text similarity {r.text_similarity:.2%} < {p.min_text_similarity:.2%}")
    figures = (f"{r.prompts_exact}/{r.prompts} prompts exact, prefix "
               f"{_pct(r.prefix_agreement)}, teacher-forced {_pct(r.token_agreement)}, "
               f"text {_pct(r.text_similarity)}")
    checks.append(Check("agrees_with_baseline", not agree_fail,
                        figures if not agree_fail else "; ".join(agree_fail) + f" ({figures})"))

    high = [d for d in r.divergences + r.tf_divergences if d.classification.cls == "high_confidence"]
    seen, unique_high = set(), []
    for d in high:
        if (d.prompt_id, d.position) not in seen:
            seen.add((d.prompt_id, d.position))
            unique_high.append(d)
    checks.append(Check(
        "divergences_are_low_confidence", len(unique_high) <= p.max_high_confidence,
        f"{len(unique_high)} high-confidence divergence(s) (max {p.max_high_confidence})"
        + ("".join("\n    " + _fmt_div(d) for d in unique_high[:5])
           + (f"\n    ... and {len(unique_high) - 5} more" if len(unique_high) > 5 else ""))))

    checks.append(_logprobs_check(r.logprobs))

    acc = r.acceptance
    if acc is None or acc.drafts == 0:
        checks.append(Check("acceptance_not_regressed", False,
                            "the engine reported no drafts: this config did not actually speculate "
                            "(spec counters missing or zero)"))
    else:
        problems = []
        if acc.tokens_per_iter < p.min_tokens_per_iter:
            problems.append(f"{acc.tokens_per_iter:.2f} tokens/iteration < {p.min_tokens_per_iter:.2f}")
        if r.golden_tokens_per_iter is not None and \
                acc.tokens_per_iter < r.golden_tokens_per_iter * (1 - p.max_acceptance_drop):
            problems.append(f"{acc.tokens_per_iter:.2f} tokens/iteration fell more than "
                            f"{p.max_acceptance_drop:.0%} below golden {r.golden_tokens_per_iter:.2f}")
        gold = f" (golden {r.golden_tokens_per_iter:.2f})" if r.golden_tokens_per_iter else ""
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


def _logprobs_check(lc: LogprobConsistency | None) -> Check:
    """logprobs_consistent: where spec and baseline chose the same token in the same context,
    the spec engine's reported logprob is the baseline's up to path noise -- one by one, as a
    distribution (drift too small to flip more than near-ties), and in the flips it causes."""
    if lc is None:
        return Check("logprobs_consistent", False, "no teacher-forced rescoring of this config: its "
                     "reported logprobs cannot be checked (re-run `speccheck run` to finish rescoring)")
    problems = []
    if lc.n_over:
        problems.append(f"{lc.n_over} of {lc.positions} position(s) with |Δ logprob| above "
                        f"{lc.limit:.4f} nats" + "".join("\n    " + o for o in lc.over))
    for t, against in ((lc.drift, "kernel-path noise"), (lc.golden_drift, "golden")):
        if t is not None and t.drifted:
            problems.append(f"logprobs drifted from the {against}: {_drift_str(t, against)}")
    f = lc.flips
    flips = (f"{f.flips} teacher-forced flip(s) where the noise predicts {f.expected:.1f} "
             f"({f.at_risk} of {f.positions} positions within the noise level; at most {f.allowed})")
    if f.excess:
        problems.append("more flips than the path noise explains: " + flips)
    summary = _drift_str(lc.drift, "kernel-path noise") + "; " + flips
    if lc.golden_drift is not None:
        summary += "; golden ratio " + f"{lc.golden_drift.ratio:.2f}, p {lc.golden_drift.p:.2g}"
    return Check("logprobs_consistent", not problems,
                 summary if not problems else "; ".join(problems) + f" ({summary})")


def _together_checks(t: Together | None, p: Policy) -> list[Check]:
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
    batch = Check("batch_invariant", len(problems) <= (0 if p.require_batch_invariant
                                                         else p.max_high_confidence),
                  figures + "".join("\n    " + _fmt_div(d) for d in problems[:5]))
    concurrent = _concurrent_check(t, p)
    return [batch, concurrent]


NOT_INVARIANT = "this engine is not batch-invariant at ties, with or without speculation"


def _concurrent_check(t: Together, p: Policy) -> Check:
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
    split = ", ".join(f"{pid}: {n} distinct" for pid, n in t.split.items())
    msg = (f"{t.copies} identical concurrent requests per prompt -> "
           + (f"more than one completion for {len(t.split)} prompt(s) ({split})" if t.split
              else "1 completion each"))
    if t.baseline_not_invariant:
        msg += f"; the baseline splits too: {NOT_INVARIANT}"
    elif t.of_baseline and t.not_invariant:
        msg += f"; {NOT_INVARIANT}"
    if t.split:
        strict = " (strict: require_concurrent_identical)" if p.require_concurrent_identical else ""
        msg += (f"; {len([d for d in bad if d is not None])} split(s) not explained by a near-tie{strict}"
                + "".join("\n    " + _fmt_div(d) for d in t.split_divergences[:5]))
    return Check("concurrent_identical", not bad, msg)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.2%}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def evaluate_suite(suite: Suite, policy: Policy, configs: Sequence[str] | None = None,
                   golden_acceptance: dict | None = None, detok=None,
                   golden_noise: dict | None = None) -> SuiteResult:
    """``golden_noise``: {config: |Δ| sample} recorded with the golden (golden.golden_noise)."""
    names = list(configs) if configs is not None else suite.configs()
    base_records = list(suite.records("baseline"))
    noise = suite_noise(suite)
    kernel = kernel_noise_sample(suite)
    tau_tie, tau_low = calibrate_thresholds(noise, policy.tie_noise_multiple, policy.low_noise_multiple,
                                            policy.tie_floor, policy.low_floor)
    base_speed = speed_of([r for r in base_records if r.status == "ok"])[0] if base_records else None
    base_variant = baseline_not_invariant(suite, tau_tie, tau_low, noise)
    identity = next((r.identity for r in base_records if r.identity), {})
    results = [evaluate_config(suite, n, policy, tau_tie, tau_low, noise, base_records,
                               golden_acceptance, detok, base_speed, kernel, golden_noise,
                               base_variant) for n in names]
    return SuiteResult(suite.id, suite.meta, identity, noise, tau_tie, tau_low, policy.to_dict(), results)
