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
from speccheck.types import Completion, RunRecord
from speccheck.verify import (
    Acceptance,
    Divergence,
    acceptance_summary,
    calibrate_thresholds,
    determinism,
    find_divergences,
    path_noise,
    teacher_forced_agreement,
    teacher_forced_divergences,
    text_similarity,
    unique_completions,
)

CHECKS = ("ran", "deterministic", "batch_invariant", "concurrent_identical",
          "agrees_with_baseline", "divergences_are_low_confidence", "acceptance_not_regressed",
          "speedup")


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

    @property
    def high(self) -> list[Divergence]:
        return [d for d in self.divergences if d.classification.cls == "high_confidence"]


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
    checks: list[Check] = field(default_factory=list)
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
    plan: dict | None = None  # what `speccheck run` recorded it would store (None: older suite)

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
                "policy": self.policy, "plan": self.plan, "passed": self.passed,
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
    split = {}
    for i, c in enumerate(first.completions):
        n = unique_completions([cp[i].token_ids for cp in copies])
        if n > 1:
            split[c.prompt_id] = n
    return Together(together.copies, len(together.completions), cmp.prompts, cmp.exact,
                    cmp.prefix_agreement, cmp.divergences, split)


def evaluate_config(suite: Suite, name: str, policy: Policy, tau_tie: float, tau_low: float,
                    noise: float, base_records: list[RunRecord], golden_acceptance: dict | None = None,
                    detok=None, base_speed: float | None = None) -> ConfigResult:
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

    result = ConfigResult(
        config=name, repeats=len(records), failed_runs=failed, identical_runs=identical,
        nondeterminism=nondet, prompts=0, prompts_exact=0, prefix_agreement=None,
        token_agreement=None, text_similarity=None, divergences=[], tf_divergences=[],
        class_counts={}, attribution=suite.load_attribution(name) or [], acceptance=None,
        golden_tokens_per_iter=None, speed=Speed(None, None, None, None), together=all_at_once,
        missing=suite.missing(name))

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
    batch = Check("batch_invariant", len(problems) <= (0 if p.require_batch_invariant
                                                         else p.max_high_confidence),
                  figures + "".join("\n    " + _fmt_div(d) for d in problems[:5]))
    split = ", ".join(f"{pid}: {n} distinct" for pid, n in t.split.items())
    concurrent = Check("concurrent_identical", not t.split or not p.require_concurrent_identical,
                       f"{t.copies} identical concurrent requests per prompt -> "
                       + (f"more than one completion for {len(t.split)} prompt(s) ({split})"
                          if t.split else "1 completion each"))
    return [batch, concurrent]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.2%}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def judged_configs(suite: Suite, demanded: Sequence[str] = ()) -> list[str]:
    """Every config a verdict covers: stored, planned, or demanded on the command line."""
    return sorted({*suite.configs(), *suite.planned_configs(), *demanded}, key=config_sort_key)


def evaluate_suite(suite: Suite, policy: Policy, configs: Sequence[str] | None = None,
                   golden_acceptance: dict | None = None, detok=None) -> SuiteResult:
    names = list(configs) if configs is not None else judged_configs(suite)
    base_records = list(suite.records("baseline"))
    noise = suite_noise(suite)
    tau_tie, tau_low = calibrate_thresholds(noise, policy.tie_noise_multiple, policy.low_noise_multiple,
                                            policy.tie_floor, policy.low_floor)
    base_speed = speed_of([r for r in base_records if r.status == "ok"])[0] if base_records else None
    identity = next((r.identity for r in base_records if r.identity), {})
    results = [evaluate_config(suite, n, policy, tau_tie, tau_low, noise, base_records,
                               golden_acceptance, detok, base_speed) for n in names]
    return SuiteResult(suite.id, suite.meta, identity, noise, tau_tie, tau_low, policy.to_dict(), results,
                       suite.load_plan())
