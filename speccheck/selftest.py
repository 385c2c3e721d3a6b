"""`speccheck selftest`: proof that the gate catches the bugs it exists for.

Every planted fault of the reference engine (``--engine-arg fault=NAME``, modelled on a bug
class real engines shipped) runs on a small corpus, is stored and judged exactly as
`speccheck run` + `speccheck gate` would judge it, and must fail the one check named for it in
:data:`CASES`. The clean engine runs the same configs in the same session and must pass every
check: a self-test whose clean run fails proves nothing.

Cheap enough for CI: the weights load once (faults are code paths, ``with_args``), the clean
baseline runs once per corpus and is shared by every fault's suite on it (no fault changes a
baseline request on its own; the prefix-cache one only after a speculative request of the same
prompt), only the determinism and prefix-cache faults repeat, only the batch fault runs the
corpus all at once, and there is no kernel attribution.

The reference engine is the one engine with planted faults, so this module names it.
"""
from __future__ import annotations

import hashlib
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

from speccheck.corpus import load_corpus
from speccheck.engines import EngineUsageError, make_engine
from speccheck.checks import names as check_names
from speccheck.evaluate import evaluate_suite
from speccheck.policy import Policy
from speccheck.plan import RunPlan
from speccheck.runner import (check_context, open_suite, replay_configs, rescore_suite, run_one,
                              score_sampled_suite)
from speccheck.store import Store, Suite
from speccheck.types import SAMPLING_ARGS, SpecConfig, sampling_of

#: the corpus the self-test runs by default: `smoke` cannot show every fault (no smoke prompt
#: ends at an end-of-sequence token after drafting; its chat prompt emits one as its very first
#: token, and the toy drafters propose end-of-sequence only in memorised boilerplate such as a
#: codec module's registry function, which `selftest` adds)
CORPUS = "selftest"


@dataclass(frozen=True)
class Case:
    """A planted fault, the bug class it models and the check that must catch it."""

    fault: str
    models: str  # the bug class (and the public reports) it models
    check: str  # the check that must fail
    method: str | None = None  # None: the method under test (--method)
    engine_args: tuple[tuple[str, str], ...] = ()  # besides fault=NAME
    repeats: int = 1  # 2 where determinism is the point
    together: int = 0  # copies of each prompt in a run of the corpus all at once (0: none)
    corpus: str | None = None  # None: the corpus under test (--corpus)
    #: prompts of the corpus left out (none: all run): long ones its axis never sends cost
    #: runs that show nothing
    without: tuple[str, ...] = ()
    #: workload axis levels run after the repeats (slots "axis-<axis>-<level>", as `speccheck
    #: run --axes`), clean and faulty, and judged by the axis checks
    axes: tuple[str, ...] = ()


#: the sampled settings the sampler faults run under (as `speccheck run --temperature T
#: --top-p 0.9 [--samples N]` records them), each chosen by the fault's power over seeds
#: (benchmarks/RESULTS.md), not by one lucky draw. The default corpus at temperature 0.8 (~1,800
#: sampled tokens per config) shows the unnormalised residual, top-p, seed and DFlash2 faults
#: at any seed. A residual taken as p moves MTP's output little (the toy MTP's q is close to p
#: where it is drafted: martingale z about -1.2 per 1,800 tokens) but DFlash2's much (z 3.3 to
#: 5.0 over 5 seeds), so it runs on DFlash2. Drafts drawn at temperature 1 while q is read at T
#: show only below 0.8: at 0.6 z about -2.1 per 1,800 tokens (6 seeds, one near 0), so each
#: prompt is sampled 5 times (~8,500 tokens: z about -4.5 expected, -3.15 at seed 0)
SAMPLED = (("temperature", "0.8"), ("top_p", "0.9"), ("sample_top_k", "0"), ("seed", "0"))
SAMPLED_CORPUS = "default"
SAMPLED_COLD = (("temperature", "0.6"), ("top_p", "0.9"), ("sample_top_k", "0"), ("seed", "0"),
                ("samples", "5"))
SAMPLED_COLD_CORPUS = "default*5"

#: every fault, the bug it models and the check expected to catch it: the one place to edit
CASES: tuple[Case, ...] = (
    Case("stale-state", "hybrid state after a rejection: GDN recurrent state not rolled back",
         "divergences_are_low_confidence"),
    Case("conv-not-rolled-back", "hybrid state after a rejection: conv state not rolled back "
         "(vLLM #50272, #39273)", "divergences_are_low_confidence"),
    Case("accepted-clamped-to-conv", "hybrid state: accepted count clamped to the conv "
         "history, state lags the tokens (xLLM #2249)", "divergences_are_low_confidence"),
    Case("wrong-slot-after-no-draft", "hybrid state read from the wrong slot after a step "
         "with no drafts (vLLM #52942)", "divergences_are_low_confidence",
         engine_args=(("no_draft_every", "2"),)),
    Case("batch-aliases-seq0", "hybrid state: a batch's rows alias request 0's state slot "
         "(SGLang #27202)", "batch_invariant", together=2),
    Case("decode-kernel-verify", "hybrid state: decode kernel reused for verify, no "
         "per-token states (SGLang #19775)", "divergences_are_low_confidence"),
    Case("mtp-stale-hidden", "acceptance only: MTP fed the wrong hidden states (vLLM #36531)",
         "acceptance_not_regressed", method="mtp"),
    Case("dflash-wrong-layer", "acceptance only: DFlash aux hidden states from the wrong "
         "target layer (vLLM #42704)", "acceptance_not_regressed", method="dflash"),
    Case("bonus-off-by-one", "verifier: bonus token taken from the wrong position",
         "divergences_are_low_confidence"),
    Case("accept-top2", "verifier: a draft accepted that is not the target's argmax",
         "divergences_are_low_confidence"),
    # it shows only where a near-tie meets a verify: the selftest corpus's short memorised
    # prompts have too few, so the case runs on ci (4 of 34 near-ties went to rank 2 there)
    Case("verify-samples", "temperature 0 not argmax: the verify draws at temperature 0.01",
         "greedy_is_argmax", corpus="ci"),
    Case("accepted-counts-bonus", "counters and metrics: impossible acceptance counts "
         "(vLLM #27077)", "counters_consistent"),
    Case("past-max-tokens", "output boundaries: emission past max_tokens", "same_stopping"),
    Case("past-eos", "output boundaries: emission past end-of-sequence inside accepted drafts",
         "same_stopping"),
    Case("nondeterministic", "nondeterminism: run-to-run reduction order in a kernel",
         "deterministic", repeats=2),
    # a small drift shows only on many positions that are not saturated: on the selftest
    # corpus's short, memorised prompts (~120 shared positions, a fifth unmoved) a bf16 state
    # gave paired ratios 1.04-1.18 at p 0.04-0.4 depending on the CPU's bf16 GEMMs (a miss on
    # each), so the case runs on `code` (~700) whatever --corpus says; there a bf16 state gave
    # 1.30 (native bf16) but 1.15 with oneDNN held to AVX512_CORE, 4 mantissa bits 1.47 and
    # 1.27 (clean 1.02 and 0.79). DFlash K=7 takes too few verify steps per prompt for it, so
    # the case runs MTP whatever --method says.
    Case("state-precision", "numeric drift: precision lost in the state carried between "
         "verify steps", "logprobs_consistent", method="mtp", corpus="code"),
    Case("conv-block-boundary", "hybrid state: conv state written token-indexed into the "
         "wrong cache block, stale across block boundaries (vLLM #53229)",
         "divergences_are_low_confidence"),
    # the first request of a prompt fills the prefix cache and is right; the repeat hits it
    Case("prefix-cache-overreach", "prefix caching x spec decode: a prefix hit reuses hybrid "
         "state past the prompt (vLLM #43559, #43650, #53912)", "deterministic", repeats=2),
    # the serving regime (reference/serving.py): each through the workload axis it lives in
    Case("join-contaminates", "concurrency: a request joining a running batch reads a neighbour's "
         "hybrid state row (SGLang #36548, #35150)", "axis_concurrency",
         axes=("axis-concurrency-4",)),
    Case("padded-row-real", "shapes: padding rows of a batch just past a CUDA-graph capture "
         "size write their state into a real row (vLLM #45100)", "axis_shapes",
         axes=("axis-shapes-batch",)),
    Case("slot-residue", "long life: a reused state slot leaks the previous request's conv "
         "window (vLLM #35800, #36872)", "axis_concurrency", axes=("axis-concurrency-4",)),
    Case("prefix-wrong-block", "prefix caching x hybrid state: a hit restores another block's "
         "GDN state (vLLM #43559, #53912)", "axis_prefix_cache",
         axes=("axis-prefix_cache-cold", "axis-prefix_cache-hit")),
    Case("short-prompt-verify", "shapes: a prefill of 1 + K tokens taken for a verify loses its "
         "GDN state (vLLM #53051)", "axis_shapes", axes=("axis-shapes-k",)),
    # acceptance only, and only after the recompute: judged per preempted request against the
    # same request unpressured; on the default corpus's code prompts the preempted request
    # still has most of its output ahead (on the selftest corpus it is preempted a few tokens
    # before its end). The axis never sends the corpus's 3k-token OCR prompts, which would
    # cost the case's repeats 2.5x its time; the other prompts stay (on the axis's four code
    # prompts alone the clean verify_topk_drift sat at its limit: ratio 1.10)
    Case("preempt-loses-draft-state", "preemption: a recomputed request resumes without its "
         "drafter state (acceptance only)", "axis_kv_pressure", method="dflash2",
         corpus="default", axes=("axis-kv_pressure-free", "axis-kv_pressure-pressure"),
         without=("ocr-invoice", "ocr-contract", "ocr-notice")),
    Case("async-stale-accepted", "async scheduling: the step planned ahead is placed by a stale "
         "accepted count (vLLM #52071, #38556)", "axis_async_scheduling",
         axes=("axis-async_scheduling-off", "axis-async_scheduling-on")),
    Case("thinking-no-rollback", "chat template: a request rendered in thinking mode is verified "
         "without GDN state rollback (divergence only with thinking on: #54928, #38009)",
         "axis_chat_thinking", method="dflash2",
         axes=("axis-chat_thinking-off", "axis-chat_thinking-on")),
    Case("drafter-noise", "acceptance only: the drafter's logits perturbed (a drafter-side "
         "numerics bug), tokens exact", "acceptance_not_regressed", method="mtp"),
    # a step that accepts exactly K - 1 of 7 drafts is rare (about 1-2 % of DFlash's steps), so
    # the case runs DFlash K=7 on ci, where enough of them fall before a divergence
    Case("rollback-skipped-at-k-minus-1", "rare-step hybrid state: GDN rollback skipped only "
         "on steps that accept K - 1 drafts", "verify_topk_drift", method="dflash", corpus="ci"),
    Case("verify-drift", "numeric drift: the GDN layers' verify-path output off by (1 + 2^-7)",
         "verify_topk_drift"),
    # the sampler's (temperature > 0), judged against the target's own distribution
    Case("residual-unnormalised", "speculative sampling: the rejection residual not "
         "renormalised", "sampled_matches_target", method="mtp", engine_args=SAMPLED,
         corpus=SAMPLED_CORPUS),
    Case("residual-is-p", "speculative sampling: a rejection resampled from p, not "
         "max(0, p - q)", "sampled_matches_target", method="dflash2", engine_args=SAMPLED,
         corpus=SAMPLED_CORPUS),
    Case("temperature-target-only", "speculative sampling: temperature applied to the target "
         "only (drafts drawn at temperature 1)", "sampled_matches_target", method="mtp",
         engine_args=SAMPLED_COLD, corpus=SAMPLED_COLD_CORPUS),
    Case("top-p-draft-only", "speculative sampling: top-p applied to the draft only",
         "sampled_matches_target", method="mtp", engine_args=SAMPLED, corpus=SAMPLED_CORPUS),
    Case("seed-reused", "sampling: one seed stream position reused at every step",
         "sampled_matches_target", method="mtp", engine_args=SAMPLED, corpus=SAMPLED_CORPUS),
    Case("dflash2-q-unary", "speculative sampling: DFlash2's acceptance reads another q than "
         "the selector drew from", "sampled_matches_target", method="dflash2",
         engine_args=SAMPLED, corpus=SAMPLED_CORPUS),
)


@dataclass
class Row:
    fault: str
    models: str
    config: str  # e.g. "mtp-k3 no_draft_every=2"
    expected: str
    failed: list[str]  # every check that failed
    error: str | None = None  # the evaluation crashed, or the fault has no case
    #: for a fault of a workload axis: the checks that fail without that axis (the default
    #: run's other checks on the same runs): none, or the axis would not be earning its place
    without_axis: list[str] | None = None

    @property
    def caught(self) -> bool:
        return self.error is None and self.expected in self.failed


@dataclass
class CleanRun:
    config: str
    failed: list[str]  # checks the clean engine failed (must be none)
    messages: list[str] = field(default_factory=list)
    tokens_per_iter: float | None = None
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and not self.failed


@dataclass
class SelftestResult:
    method: str
    corpus: str
    prompts: int
    clean: list[CleanRun]
    rows: list[Row]
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.clean) and all(r.caught for r in self.rows)

    def to_dict(self) -> dict:
        return {"method": self.method, "corpus": self.corpus, "prompts": self.prompts,
                "passed": self.passed, "seconds": round(self.seconds, 1),
                "clean": [{**asdict(c), "passed": c.passed} for c in self.clean],
                "faults": [{**asdict(r), "caught": r.caught} for r in self.rows]}


def _label(config: SpecConfig, args: dict[str, str], corpus: str | None = None) -> str:
    base, _, left_out = (corpus or "").partition("!")
    on = [f"on {base}" + (f" without {left_out.replace('+', ', ')}" if left_out else "")] if corpus else []
    return " ".join([config.name, *(f"{k}={v}" for k, v in sorted(args.items())), *on])


def _policy(repeats: int) -> Policy:
    """The default policy; a config that ran once cannot be judged for determinism."""
    return Policy() if repeats >= 2 else Policy(require_deterministic=False)


def _failed_checks(suite: Suite, name: str, repeats: int, golden: dict | None):
    result = evaluate_suite(suite, _policy(repeats), [name], golden, detok=None).get(name)
    failed = [c for c in result.checks if not c.passed and not c.skipped]
    # an inconclusive check is not a catch: `speccheck run` would escalate it, and it may pass
    return result, [c.name + (" (inconclusive)" if c.inconclusive else "") for c in failed], \
        [f"{c.name}: {c.message}" for c in failed]


def run_selftest(method: str = "mtp", corpus: str = CORPUS, store_dir: str | None = None,
                 faults: list[str] | None = None,
                 log: Callable[[str], None] = lambda m: None) -> SelftestResult:
    """Run the clean engine and every planted fault (or those named) and judge each."""
    from speccheck.reference.decode import FAULTS

    t0 = time.perf_counter()
    engine = make_engine("reference")
    offered = tuple(engine.methods or ())
    if method not in offered:
        raise EngineUsageError(f"--method {method!r}: the reference engine offers "
                               f"{', '.join(offered)}")
    unknown = sorted(set(faults or ()) - set(FAULTS))
    if unknown:
        raise EngineUsageError(f"--fault {', '.join(unknown)}: not a planted fault; the "
                               f"reference engine has {', '.join(FAULTS)}")
    names = [f for f in FAULTS if not faults or f in faults]
    cases = {c.fault: c for c in CASES}
    corpora: dict[str, tuple] = {}  # name -> (corpus, its prompts tokenised), loaded once

    def corpus_of(name: str) -> tuple:
        if name not in corpora:
            name_, _, left_out = name.partition("!")  # "default!a+b": without prompts a, b
            base, _, n = name_.partition("*")  # "default*3": each prompt 3 times (run --samples 3)
            c = load_corpus(base)
            if n:
                c = RunPlan(corpus=base, engine_args={"temperature": "1", "samples": n}).load_corpus()
                c = replace(c, name=f"{base}-x{n}")
            if left_out:
                ids = left_out.split("+")
                missing = sorted(set(ids) - {p.id for p in c.prompts})
                if missing:
                    raise EngineUsageError(f"selftest case: corpus {base} has no prompt {', '.join(missing)}")
                c = replace(c, name=f"{c.name}-without-{len(ids)}",
                            hash=hashlib.sha256(f"{c.hash}!{left_out}".encode()).hexdigest(),
                            prompts=[p for p in c.prompts if p.id not in ids])
            corpora[name] = (c, {p.id: engine.tokenize(p) for p in c.prompts})
        return corpora[name]

    corp, _ = corpus_of(corpus)
    check_context(engine, corp)  # a prompt past the model's positions: refused before any run
    with tempfile.TemporaryDirectory(prefix="speccheck-selftest-") as tmp:
        store = Store(store_dir or tmp)
        bases: dict[str, tuple] = {}

        def suite_for(args: dict[str, str], name: str) -> Suite:
            c, inputs = corpus_of(name)
            suite = open_suite(RunPlan(engine="reference", engine_args=args, corpus=name), store, c)
            suite.write_inputs(inputs)
            return suite

        def baseline(name: str, args: dict[str, str]) -> tuple:
            """The baseline once per corpus and sampling setting (greedy, or sampled as the
            suite's configs are: the two-sample check compares them), clean; every suite on
            it gets a copy of it and of its rescoring (and sampled-position scores)."""
            clean = {k: v for k, v in args.items() if k in SAMPLING_ARGS}
            key = (name, tuple(sorted(clean.items())))
            if key not in bases:
                c, _ = corpus_of(name)
                suite = suite_for(clean, name)
                stored = suite.load_inputs()
                variant = engine.with_args(**clean) if clean else engine
                base = run_one(variant, suite, c, stored, SpecConfig(), 0, 5, fresh_process=False)
                rescore_suite(variant, suite, ["baseline"], log=lambda m: None)
                if clean:
                    score_sampled_suite(variant, suite, ["baseline"], log=lambda m: None)
                bases[key] = (c, stored, suite, base, suite.load_rescore("baseline", 0),
                              suite.load_sampled_scores("baseline", 0))
            return bases[key]

        def run(args: dict[str, str], config: SpecConfig, repeats: int, together: int,
                name: str, axes: tuple[str, ...] = ()) -> Suite:
            c, stored, base_suite, base, base_scores, base_sampled = baseline(name, args)
            variant = engine.with_args(**args)
            suite = suite_for(args, name)
            # recorded as `speccheck run` records it, so that the verdict demands every run
            plan = RunPlan(engine="reference", engine_args=args, corpus=name, repeats=1,
                           configs=[SpecConfig()], fresh_process_repeat=False, attribute=False)
            spec = replace(plan, configs=[config], repeats=repeats, concurrent=together,
                           axes=tuple(axes))
            suite.extend_plan({**plan.planned(), **spec.planned()}, spec.run_args())
            if suite is not base_suite and suite.root != base_suite.root:
                suite.write_run(base)
                suite.write_rescore("baseline", 0, list(base_scores), list(base_scores.values()))
                if base_sampled is not None:
                    suite.write_sampled_scores("baseline", 0, list(base_sampled),
                                               list(base_sampled.values()))
            for r in range(repeats):
                run_one(variant, suite, c, stored, config, r, 5, fresh_process=False)
            if together:
                run_one(variant, suite, c, stored, config, -1, 5, fresh_process=False,
                        copies=together)
            rescore_suite(variant, suite, [config.name], log=lambda m: None)
            if sampling_of(args):  # the distribution check's evidence, as `speccheck run` scores it
                score_sampled_suite(variant, suite, [config.name], log=lambda m: None)
                run_axes(suite, spec, variant, c, stored, config, axes)
                return suite
            # the acceptance expected of the run, replayed as `speccheck run` does: without the fault
            clean = engine.with_args(**{k: v for k, v in args.items() if k != "fault"})
            replay_configs(clean, suite, [config], {p.id: p.max_tokens for p in c.prompts},
                           log=lambda m: None)
            run_axes(suite, spec, variant, c, stored, config, axes)
            return suite

        def run_axes(suite, spec, variant, c, stored, config, axes) -> None:
            """The axis levels, as `speccheck run` runs them; an axis judged against the
            baseline's run of the same requests (shapes) gets the clean baseline's run too."""
            from speccheck.axes import get as get_axis
            from speccheck.runner import run_axis

            for slot in axes:
                if get_axis(slot.split("-")[1]).against_baseline and not suite.is_complete("baseline", slot):
                    run_axis(spec, engine, suite, c, stored, SpecConfig(), slot)
                run_axis(spec, variant, suite, c, stored, config, slot)

        def setting(case: Case) -> tuple[SpecConfig, dict[str, str], str]:
            m = case.method or method
            if m not in offered:
                m = method
            on = case.corpus or corpus
            return (SpecConfig(m, engine.default_k(m) or 3), dict(case.engine_args),
                    on + "!" + "+".join(case.without) if case.without else on)

        # the clean engine under every setting a fault uses, with every variant of the runs
        wanted = [cases[f] for f in names if f in cases]
        settings: dict[str, tuple] = {}
        for case in wanted:
            config, args, name = setting(case)
            key = _label(config, args, name if name != corpus else None)
            _, _, _, reps, tog, axes = settings.get(key, (config, args, name, 1, 0, ()))
            settings[key] = (config, args, name, max(reps, case.repeats),
                             max(tog, case.together), tuple(dict.fromkeys(axes + case.axes)))
        # configs that share a suite (same engine args and corpus) are held to one standard of
        # evidence (Suite.demand): each gets the most repeats and copies at once any of them has
        group = {}
        for config, args, name, reps, tog, _ in settings.values():
            k = (tuple(sorted(args.items())), name)
            group[k] = tuple(map(max, zip(group.get(k, (reps, tog)), (reps, tog))))
        settings = {key: (c, a, n, *group[(tuple(sorted(a.items())), n)], ax)
                    for key, (c, a, n, _, _, ax) in settings.items()}
        clean, golden = [], {}
        for key, (config, args, name, reps, tog, axes) in settings.items():
            log(f"clean {key}")
            suite = run(args, config, reps, tog, name, axes)
            try:
                result, failed, messages = _failed_checks(suite, config.name, reps, None)
                tpi = result.acceptance.tokens_per_iter if result.acceptance else None
                clean.append(CleanRun(key, failed, messages, tpi))
                golden[key] = tpi
            except Exception as e:  # noqa: BLE001 - a crash is a finding, reported as such
                clean.append(CleanRun(key, [], [], None, f"{type(e).__name__}: {e}"))

        rows = []
        for name in names:
            case = cases.get(name)
            if case is None:
                rows.append(Row(name, FAULTS[name], "-", "-", [],
                                "no case in speccheck.selftest.CASES names the check for it"))
                continue
            if case.check not in check_names():
                rows.append(Row(name, case.models, "-", case.check, [],
                                f"its case names {case.check!r}, which is not a registered check "
                                f"(speccheck/checks/: {', '.join(check_names())})"))
                continue
            config, args, on = setting(case)
            key = _label(config, args, on if on != corpus else None)
            log(f"fault {name} ({key})")
            suite = run({**args, "fault": name}, config, case.repeats, case.together, on,
                        case.axes)
            # judged like a user with a golden: tokens/iteration of the clean engine here
            gold = {config.name: golden[key]} if golden.get(key) else None
            try:
                _, failed, _ = _failed_checks(suite, config.name, case.repeats, gold)
                without = [c for c in failed if not c.startswith("axis_")] if case.axes else None
                rows.append(Row(name, case.models, key, case.check, failed, without_axis=without))
            except Exception as e:  # noqa: BLE001 - the gate crashing on a fault misses it
                rows.append(Row(name, case.models, key, case.check, [],
                                f"evaluation crashed: {type(e).__name__}: {e}"))
    return SelftestResult(method, corp.name, len(corp.prompts), clean, rows,
                          time.perf_counter() - t0)


def selftest_text(result: SelftestResult) -> str:
    """The table: fault, the bug class it models, the check expected to catch it and the
    checks that failed, caught or missed; then the clean engine's verdict per setting."""
    head = ("fault", "config", "expected check", "", "checks that failed", "without its axis",
            "models (bug class)")
    body = [(r.fault, r.config, r.expected, "caught" if r.caught else "MISSED",
             r.error or (", ".join(r.failed) or "none"),
             "-" if r.without_axis is None else ("missed" if not r.without_axis else ", ".join(r.without_axis)),
             r.models) for r in result.rows]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]

    def line(row) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()

    lines = [f"speccheck selftest: {len(result.rows)} planted faults, method {result.method}, "
             f"corpus {result.corpus} ({result.prompts} prompts)", line(head),
             line(["-" * w for w in widths]), *map(line, body), ""]
    for c in result.clean:
        tpi = f", {c.tokens_per_iter:.2f} tokens/iteration" if c.tokens_per_iter else ""
        verdict = "passes every check" if c.passed else (
            c.error or "FAILS " + "; ".join(c.messages or c.failed))
        lines.append(f"clean engine, {c.config}: {verdict}{tpi}")
    caught = sum(r.caught for r in result.rows)
    clean_ok = all(c.passed for c in result.clean)
    lines.append(f"selftest: {'PASS' if result.passed else 'FAIL'} — {caught} of "
                 f"{len(result.rows)} faults caught by their check, clean engine "
                 f"{'passes' if clean_ok else 'FAILS'} ({result.seconds:.0f} s)")
    return "\n".join(lines)
