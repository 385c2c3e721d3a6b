"""The runner: corpus × matrix × repeats -> engine -> store, resumable.

After the generation runs it does what verify/ needs from an engine: teacher-forced
rescoring of every config's output by the (non-speculative) engine, the acceptance each spec
config's output should have had, replayed by the engine's own independent drafter pass (where
it has one), and kernel-path attribution of each first divergence (re-scoring the divergent
prefix under the engine's alternative kernel knobs). All are stored next to the runs, so
diff/gate/report never need an engine.
"""
from __future__ import annotations

import fnmatch

import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from speccheck.version import __version__
from speccheck.corpus import Corpus
from speccheck.engines import Engine, EngineError, EngineUsageError, make_engine
from speccheck.engines.base import ScoringUnavailable
from speccheck.axes import AxisInput
from speccheck.axes import get as get_axis
from speccheck.plan import RunPlan, plan_suite_id
from speccheck.store import Store, StoreError, Suite
from speccheck.types import (TOGETHER, RunRecord, SpecConfig, Workload, WorkloadResult, sampling_of,
                             slot_label)
from speccheck.verify import first_divergence


Log = Callable[[str], None]


def _print(msg: str) -> None:
    print(msg, flush=True)


def open_suite(plan: RunPlan, store: Store, corpus: Corpus) -> Suite:
    return store.suite(plan_suite_id(plan, corpus), plan.suite_meta(corpus))


def weights_fingerprint(identity: dict) -> tuple:
    """What makes a stored run stale when it changes: the weights and tokenizer it ran with."""
    return tuple(identity.get(k) for k in ("model_hash", "draft_hash", "tokenizer_hash"))


def tokenized_inputs(suite: Suite, engine: Engine, corpus: Corpus) -> dict[str, np.ndarray]:
    """Prompts are tokenised once per suite and stored, so every config sees identical input."""
    try:
        inputs = suite.load_inputs()
    except StoreError:  # damaged: tokenise again
        inputs = None
    if inputs is None or set(inputs) != {p.id for p in corpus.prompts}:
        suite.write_inputs({p.id: engine.tokenize(p) for p in corpus.prompts})
        inputs = suite.load_inputs()
    assert inputs is not None
    return inputs


def check_context(engine: Engine, corpus: Corpus) -> None:
    """Every prompt plus its max_tokens must fit the model's positions, checked before any run
    (an 8192-position model given a 20k-token prompt would otherwise run for many minutes)."""
    limit = engine.max_positions()
    if not limit:
        return
    for p in corpus.prompts:
        n = len(engine.tokenize(p))
        if n + p.max_tokens > limit:
            raise EngineUsageError(
                f"{corpus.path}: prompt {p.id!r} is {n} tokens + max_tokens {p.max_tokens} = "
                f"{n + p.max_tokens} positions, more than the {limit} the model holds; "
                + (f"shorten the prompt or lower its max_tokens to at most {limit - n}." if n < limit else
                   f"the prompt alone does not fit: shorten it to under {limit} tokens."))


def run_one(engine: Engine, suite: Suite, corpus: Corpus, inputs: dict[str, np.ndarray],
            config: SpecConfig, repeat: int, top_k: int, fresh_process: bool,
            copies: int = 0) -> RunRecord:
    """Generate the whole corpus under one config and store it; an engine failure is stored
    as a failed run (the matrix goes on), bad usage is raised. With ``copies`` N the corpus
    goes to the engine all at once, N times over (slot TOGETHER)."""
    t0 = time.perf_counter()
    record = RunRecord(config=config, identity={}, corpus=corpus.name, corpus_hash=corpus.hash,
                       repeat=TOGETHER if copies else repeat, fresh_process=fresh_process, copies=copies)
    try:
        prompts = list(corpus.prompts) * max(copies, 1)
        ids = [inputs[p.id].tolist() for p in prompts]
        generate = engine.generate_together if copies else engine.generate
        record.completions = generate(prompts, ids, config, top_k)
    except EngineUsageError:
        raise
    except Exception as e:  # noqa: BLE001 - any engine crash is recorded, not fatal to the matrix
        _failed(record, e)
    _identify(record, engine)
    if engine.last_call_fresh_process is not None:
        record.fresh_process = engine.last_call_fresh_process
    record.wall_s = time.perf_counter() - t0
    suite.write_run(record)
    return record


def _failed(record: RunRecord, e: BaseException) -> None:
    """An engine crash, stored as the run's failure (with where it happened)."""
    record.status = "failed"
    record.error = f"{type(e).__name__}: {e}\n" + "".join(traceback.format_exc(limit=8))


def _identify(record: RunRecord, engine: Engine) -> None:
    """The engine's identity, read after the run: some facts (kernels chosen, GPU, K notes) are
    known only once it ran."""
    try:
        record.identity = {**engine.identity(), "speccheck_version": __version__}
    except Exception as e:  # noqa: BLE001
        record.identity = {"engine": engine.name, "identity_error": str(e)}


def _summary_line(record: RunRecord) -> str:
    if record.status != "ok":
        first = (record.error or "").splitlines()[0] if record.error else ""
        return f"{record.config.name:>12} {record.label}  FAILED  {first}"
    n = sum(c.n_tokens for c in record.completions)
    dec = sum(c.decode_s for c in record.completions)
    spec = record.spec_total()
    tpi = f"  {1 + spec.accepted_tokens / spec.drafts:.2f} tok/iter" if spec and spec.drafts else ""
    fresh = f"  [{record.fresh_note}]" if record.fresh_note else ""
    rate = f"{n / dec:7.1f} tok/s" if dec > 0 else "      - tok/s"
    if record.axis:
        proof = ", ".join(f"{k} {v}" for k, v in record.proof.items() if not isinstance(v, list))
        return (f"{record.config.name:>12} {record.label}: {len(record.completions)} requests  {n:6d} tok"
                + (f"  ({proof})" if proof else ""))
    if record.copies:
        return (f"{record.config.name:>12} all at once: {len(record.completions)} requests "
                f"({record.copies} of each prompt)  {n:6d} tok")
    return (f"{record.config.name:>12} r{record.repeat}  {len(record.completions)} prompts  "
            f"{n:6d} tok  {rate}{tpi}{fresh}")


def run_suite(plan: RunPlan, store: Store, log: Log = _print,
              progress: Callable[[int, int, str], None] | None = None) -> Suite:
    """Under the store's writer lock (a second `run` on the store waits, then finds the work
    done), run_suite_unlocked."""
    with store.lock(notify=log):
        return run_suite_unlocked(plan, store, log, progress)


def run_suite_unlocked(plan: RunPlan, store: Store, log: Log = _print,
                       progress: Callable[[int, int, str], None] | None = None) -> Suite:
    """Record the plan in the suite, then run every (config, repeat) not yet complete in the
    store, then rescore and attribute. ``progress(done, total, what)`` is called before each
    run and once at the end. The engine is made (its arguments checked) before anything is
    written, and the plan is recorded before it generates anything."""
    corpus = plan.load_corpus()

    def open_planned() -> Suite:
        suite = open_suite(plan, store, corpus)
        store.set_latest(suite.id)
        suite.extend_plan(plan.planned(), plan.run_args())
        return suite

    try:
        engine = make_engine(plan.engine, plan.model, plan.engine_args, plan.draft)
    except EngineUsageError:
        raise  # bad input: nothing written
    except BaseException:
        open_planned()  # a crash at engine start leaves the plan, so every verdict names what is missing
        raise
    try:
        check_context(engine, corpus)
        check_attribution_paths(plan, engine)
        suite = open_planned()  # before any generation
    except BaseException:
        engine.close()
        raise
    try:
        inputs = tokenized_inputs(suite, engine, corpus)
        current = weights_fingerprint(engine.identity())
        # TOGETHER: the corpus all at once (plan.concurrent copies of each prompt)
        wanted = [(c, r) for c in plan.configs
                  for r in list(range(plan.repeats)) + ([TOGETHER] if plan.concurrent else [])]
        if plan.round_robin:  # stable: configs keep their order within a round
            wanted.sort(key=lambda cr: cr[1] if cr[1] >= 0 else plan.repeats)
        def is_fresh(repeat: int) -> bool:
            return (plan.fresh_process_repeat and plan.repeats > 1 and repeat == plan.repeats - 1
                    and not engine.fresh_process_per_config)

        # a stored repeat that should have run in a fresh process but did not (a sweep's) is run again
        todo = [(c, r) for c, r in wanted
                if not (suite.is_complete(c.name, r)
                        and weights_fingerprint(suite.run_identity(c.name, r)) == current
                        and (r >= 0 or suite.load_together(c.name).copies == plan.concurrent)
                        and (not is_fresh(r) or suite.run_manifest(c.name, r).get("fresh_process")))]
        done = len(wanted) - len(todo)
        together = f" + all at once x{plan.concurrent}" if plan.concurrent else ""
        log(f"suite {suite.id}: {len(plan.configs)} configs x {plan.repeats} repeats{together} "
            f"on corpus {corpus.name} ({len(corpus.prompts)} prompts); {done} already stored, "
            f"{len(todo)} to run")

        def in_process(config: SpecConfig, repeat: int) -> RunRecord:
            return run_one(engine, suite, corpus, inputs, config, repeat, plan.top_k,
                           fresh_process=engine.fresh_process_per_config,
                           copies=plan.concurrent if repeat < 0 else 0)

        two_lanes = engine.fresh_process_alongside and any(is_fresh(r) for _, r in todo)
        eta = RunEta(todo, lanes=2 if two_lanes else 1)
        if two_lanes:
            run_two_lanes(todo, is_fresh, in_process,
                          lambda c, r: run_in_fresh_process(plan, store, suite, c, r),
                          eta, log, progress)
        else:
            for i, (config, repeat) in enumerate(todo):
                if progress:
                    progress(i, len(todo), _what(config, repeat) + eta.text(config))
                began = time.perf_counter()
                if is_fresh(repeat):
                    record = run_in_fresh_process(plan, store, suite, config, repeat)
                else:
                    record = in_process(config, repeat)
                eta.finish(config, repeat, time.perf_counter() - began)
                log(_summary_line(record))
        run_axes(plan, engine, suite, corpus, inputs, log, progress)
        if progress:
            progress(len(todo), len(todo), "rescoring teacher-forced")
        if plan.rescore:
            rescore_suite(engine, suite, [c.name for c in plan.configs], log)
        sampled = sampling_of(plan.engine_args) is not None
        if sampled:
            score_sampled_suite(engine, suite, [c.name for c in plan.configs], log)
        else:
            replay_suite(plan, engine, suite, corpus, log, progress)
        if plan.attribute and not sampled:
            if progress:
                progress(len(todo), len(todo), "attributing divergences to kernel paths")
            spec_configs = [c for c in plan.configs if not c.is_baseline]
            ran = suite.run_identity("baseline", 0) if suite.is_complete("baseline", 0) else None
            variants = (engine.rerun_variants(spec_configs, ran) if plan.attribution_mode == "rerun"
                        else engine.attribution_variants(spec_configs, ran))
            for label, url in plan.attribute_with.items():
                variants[label] = engine.attribution_server_args(label, url)
            variants = select_paths(variants, plan.attribution_paths, log)
            attribute_suite(plan, variants, suite, [c.name for c in spec_configs], log,
                            jobs=engine.attribution_jobs)
    finally:
        engine.close()
    return suite


# --- workload axes -----------------------------------------------------------------------------

def run_axes(plan: RunPlan, engine: Engine, suite: Suite, corpus: Corpus, inputs: dict[str, np.ndarray],
             log: Log = _print, progress: Callable[[int, int, str], None] | None = None) -> None:
    """Every planned axis level of every axis config not yet stored, after the repeats (a
    conversation's next turn carries the config's stored answer)."""
    todo = [(c, slot) for c in plan.axis_configs() for slot in plan.axes if not suite.is_complete(c.name, slot)]
    if todo:
        log(f"workload axes: {len(todo)} run(s) ({', '.join(sorted({slot_label(s) for _, s in todo}))})")
    for i, (config, slot) in enumerate(todo):
        if progress:
            progress(i, len(todo), f"{config.name} {slot_label(slot)}")
        log(_summary_line(run_axis(plan, engine, suite, corpus, inputs, config, slot)))


def run_axis(plan: RunPlan, engine: Engine, suite: Suite, corpus: Corpus, inputs: dict[str, np.ndarray],
             config: SpecConfig, slot: str) -> RunRecord:
    """Build one axis level's workload from the corpus, run it, store it with its proof; an
    engine failure is stored as a failed run (the matrix goes on)."""
    _, name, level = slot.split("-", 2)
    axis = get_axis(name)
    t0 = time.perf_counter()
    record = RunRecord(config=config, identity={}, corpus=corpus.name, corpus_hash=corpus.hash, repeat=0,
                       fresh_process=False, axis=name, level=level)
    try:
        outputs = ({c.prompt_id: c.token_ids for c in suite.load_run(config.name, 0).completions}
                   if suite.is_complete(config.name, 0) else {})
        ks = tuple(sorted({c.k for c in plan.configs if not c.is_baseline}))
        workload = axis.build(AxisInput(corpus, inputs, config, level, ks, outputs,
                                        block_size=engine.cache_block_size()))
        # an engine that serves the axis itself (its scheduler, slots, caches) runs it; any other
        # engine runs a runner-side axis through generate()
        result = (engine.run_workload(workload, config, plan.top_k) if name in engine.axes
                  else serve_in_order(engine, workload, config, plan.top_k))
        record.completions, record.proof = result.completions, dict(result.proof)
    except EngineUsageError:
        raise
    except Exception as e:  # noqa: BLE001 - recorded, not fatal to the matrix
        _failed(record, e)
    _identify(record, engine)
    record.wall_s = time.perf_counter() - t0
    suite.write_run(record)
    return record


def serve_in_order(engine: Engine, workload: Workload, config: SpecConfig, top_k: int) -> WorkloadResult:
    """An axis any engine runs: its requests in order through one generate() call (one engine,
    one process), each completion named by its request. The proof is what was sent: requests,
    prompt lengths and budgets as the engine tokenised them (and the engine's own count of
    requests served, where it keeps one)."""
    reqs = workload.requests
    comps = engine.generate([r.prompt for r in reqs], [list(r.prompt_ids) for r in reqs], config, top_k)
    if len(comps) != len(reqs):
        raise EngineError(f"{len(comps)} completions for the {len(reqs)} requests of the {workload.axis} axis")
    comps = [replace(c, prompt_id=r.id) for c, r in zip(comps, reqs)]
    proof = {"requests": len(reqs), "prompt_lengths": sorted({len(r.prompt_ids) for r in reqs}),
             "max_tokens": sorted({r.prompt.max_tokens for r in reqs})}
    served = getattr(engine, "requests_served", None)
    if isinstance(served, int):
        proof["engine_requests_served"] = served
    return WorkloadResult(comps, proof)


# --- progress ----------------------------------------------------------------------------------

def _what(config: SpecConfig, repeat: int) -> str:
    return f"{config.name} {slot_label(repeat)}"


class RunEta:
    """Progress of the generation phase: per config how many of its runs are left and the time
    they will take (from that config's own runs so far, else from the mean run: a spec config
    and the baseline differ in speed, runs of one config cost alike), and the time left for
    the whole matrix (divided over the lanes that run at once)."""

    def __init__(self, todo: Sequence[tuple[SpecConfig, int]], lanes: int = 1):
        self.left: dict[str, int] = {}
        for config, _ in todo:
            self.left[config.name] = self.left.get(config.name, 0) + 1
        self.total, self.done, self.lanes = len(todo), 0, lanes
        self.seconds: dict[str, list[float]] = {}

    def finish(self, config: SpecConfig, repeat: int, seconds: float) -> None:
        self.done += 1
        self.left[config.name] -= 1
        self.seconds.setdefault(config.name, []).append(seconds)

    def per_run(self, name: str) -> float | None:
        """Seconds one more run of config ``name`` should take; None before any run ended."""
        own = self.seconds.get(name)
        if own:
            return sum(own) / len(own)
        every = [t for ts in self.seconds.values() for t in ts]
        return sum(every) / len(every) if every else None

    def text(self, config: SpecConfig | None = None) -> str:
        configs = len(self.left)
        finished = sum(1 for n in self.left.values() if n == 0)
        if not self.done:
            return f" (configs done 0/{configs})"
        total = sum(n * self.per_run(name) for name, n in self.left.items()) / self.lanes
        this = ""
        if config is not None and self.left.get(config.name):
            n = self.left[config.name]
            this = (f"{config.name}: {n} run{'s' if n > 1 else ''} left, about "
                    f"{_duration(n * self.per_run(config.name))}; ")
        return (f" ({this}configs done {finished}/{configs}, runs {self.done}/{self.total}, "
                f"about {_duration(total)} left)")


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


# --- fresh-process repeats ---------------------------------------------------------------------

def run_two_lanes(todo, is_fresh, in_process, in_fresh_process, eta: RunEta, log: Log,
                  progress) -> None:
    """The runs on two lanes at once, for an engine that leaves a core free (the CPU
    reference engine at one thread): this process runs the in-process repeats, a background
    thread starts the fresh-process repeats one after another, and runs of the corpus all at
    once go to whichever lane is free first (in a fresh process on the second lane). Each run
    still computes exactly what it would alone; the matrix takes about half the wall time."""
    import threading

    own = {True: [t for t in todo if t[1] >= 0 and is_fresh(t[1])],
           False: [t for t in todo if t[1] >= 0 and not is_fresh(t[1])]}
    either = [t for t in todo if t[1] < 0]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def take(fresh: bool):
        with lock:
            if errors:
                return None
            queue = own[fresh] or either
            return queue.pop(0) if queue else None

    def run(task, how) -> None:
        began = time.perf_counter()
        record = how(*task)
        with lock:
            eta.finish(*task, time.perf_counter() - began)
        log(_summary_line(record))

    def second_lane() -> None:
        try:
            while (task := take(True)) is not None:
                run(task, in_fresh_process)
        except BaseException as e:  # noqa: BLE001 - raised in this thread below
            errors.append(e)

    lane = threading.Thread(target=second_lane, name="speccheck-fresh-lane", daemon=True)
    lane.start()
    try:
        while (task := take(False)) is not None:
            if progress:
                progress(eta.done, eta.total, _what(*task) + eta.text(task[0]))
            run(task, in_process)
    except BaseException as e:
        errors.append(e)
    lane.join()
    if errors:
        raise errors[0]


def run_in_fresh_process(plan: RunPlan, store: Store, suite: Suite, config: SpecConfig,
                         repeat: int) -> RunRecord:
    """One (config, repeat) in a new Python process: catches state that leaks across runs
    in-process (caches, allocator, JIT) and differences in process start-up. (Repeat -1, the
    corpus all at once, runs there too when :func:`run_two_lanes` sends it.)"""
    request = {"plan": {**plan.__dict__, "configs": [config.to_dict()]}, "store": str(store.root),
               "suite": suite.id, "repeat": repeat, "parent": os.getpid()}
    proc = subprocess.run([sys.executable, "-m", "speccheck.runner", json.dumps(request)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"})
    if proc.returncode == 2:
        raise EngineUsageError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else
                               "fresh-process worker rejected its input")
    if not suite.is_complete(config.name, repeat) and not suite.run_dir(config.name, repeat).exists():
        record = RunRecord(config=config, identity={}, corpus=plan.corpus, corpus_hash=suite.meta["corpus_hash"],
                           repeat=repeat, fresh_process=True, status="failed",
                           error=f"fresh-process worker exited {proc.returncode}:\n{proc.stderr[-4000:]}")
        suite.write_run(record)
        return record
    return suite.load_run(config.name, repeat)


def _exit_with_parent(parent: int | None) -> None:
    """A worker whose parent died (kill -9, a closed terminal) stops instead of writing into a
    store nobody watches: a daemon thread polls the parent pid."""
    if not parent:
        return
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="speccheck-parent-watch").start()


def _worker_main(argv: Sequence[str]) -> int:
    request = json.loads(argv[0])
    _exit_with_parent(request.get("parent"))
    p = request["plan"]
    plan = RunPlan(**{**p, "configs": [SpecConfig(**c) for c in p["configs"]]})
    store = Store(request["store"])
    suite = store.suite(request["suite"])
    corpus = plan.load_corpus()
    try:
        engine = make_engine(plan.engine, plan.model, plan.engine_args, plan.draft)
    except EngineUsageError as e:
        print(str(e), file=sys.stderr)
        return 2
    try:
        inputs = suite.load_inputs() or tokenized_inputs(suite, engine, corpus)
        repeat = request["repeat"]
        run_one(engine, suite, corpus, inputs, plan.configs[0], repeat, plan.top_k,
                fresh_process=True, copies=plan.concurrent if repeat < 0 else 0)
    finally:
        engine.close()
    return 0


# --- rescoring ---------------------------------------------------------------------------------

def rescore_suite(engine: Engine, suite: Suite, config_names: Sequence[str], log: Log = _print) -> None:
    """Teacher-forced baseline scores of each config's first repeat (the baseline included:
    its decode-path vs prefill-path logprobs measure the engine's own path noise).

    Only outputs that differ from the baseline's are scored again; identical ones share the
    baseline's scores, which are exactly what the engine would give. Says what it will score
    before it starts, then each config's share with the time left at the pace so far."""
    if not suite.is_complete("baseline", 0):
        return
    # also what an earlier run stored but could not rescore (a server that speculates)
    config_names = list(dict.fromkeys([*config_names, *suite.configs()]))
    base = suite.load_run("baseline", 0).by_prompt()
    base_scores = suite.load_rescore("baseline", 0) if suite.has_rescore("baseline", 0) else None
    work: list[tuple[str, list, list]] = []  # (config, its completions, those to score)
    if base_scores is None:
        work.append(("baseline", list(base.values()), list(base.values())))
    # outputs several configs share (they often diverge from the baseline alike) are scored once
    known: dict[tuple, object] = {}
    for name in config_names:
        if name == "baseline" or not suite.is_complete(name, 0) or suite.has_rescore(name, 0):
            continue
        comps = suite.load_run(name, 0).completions
        work.append((name, comps, [c for c in comps if c.prompt_id not in base
                                   or first_divergence(c.token_ids, base[c.prompt_id].token_ids) is not None]))
    tokens = [sum(c.n_tokens for c in differ) for _, _, differ in work]
    if any(tokens):
        log(f"rescoring teacher-forced: {sum(len(d) for _, _, d in work)} output(s) of "
            f"{sum(1 for t in tokens if t)} config(s), {sum(tokens)} tokens")
    started, done = time.perf_counter(), 0
    for (name, comps, differ), n in zip(work, tokens):
        if done and differ:
            left = (time.perf_counter() - started) / done * (sum(tokens) - done)
            log(f"rescoring {name} ({len(differ)} output(s); about {left:.0f} s left)")
        key = {c.prompt_id: (c.prompt_id, c.prompt_ids.tobytes(), c.token_ids.tobytes()) for c in differ}
        new = [c for c in differ if key[c.prompt_id] not in known]
        try:
            known.update({key[pid]: s for pid, s in _score_record(engine, new).items()})
        except ScoringUnavailable as e:
            log(f"rescoring {name} left for later: {e}")
            return
        scores = {pid: known[k] for pid, k in key.items()}
        done += n
        if name == "baseline":
            base_scores = scores
            suite.write_rescore("baseline", 0, list(scores), list(scores.values()))
            continue
        merged = {c.prompt_id: scores.get(c.prompt_id) or base_scores[c.prompt_id] for c in comps}
        suite.write_rescore(name, 0, list(merged), list(merged.values()))
        log(f"{name:>12} rescored teacher-forced ({len(differ)} of {len(comps)} outputs differ from baseline)")


def score_sampled_suite(engine: Engine, suite: Suite, config_names: Sequence[str],
                        log: Log = _print) -> None:
    """A sampled suite: each config's first repeat scored teacher-forced by the target's
    full next-token distribution at every sampled position (the distribution check's
    evidence), unless stored already or the engine cannot (left missing, said once)."""
    for name in config_names:
        if not suite.is_complete(name, 0) or suite.load_sampled_scores(name, 0) is not None:
            continue
        comps = suite.load_run(name, 0).completions
        began = time.perf_counter()
        try:
            scores = engine.score_sampled([c.prompt_ids.tolist() for c in comps],
                                          [c.token_ids.tolist() for c in comps])
        except ScoringUnavailable as e:
            log(f"sampled outputs not scored: {e}")
            return
        suite.write_sampled_scores(name, 0, [c.prompt_id for c in comps], scores)
        log(f"{name:>12} sampled positions scored by the target "
            f"({sum(c.n_tokens for c in comps)} tokens, {time.perf_counter() - began:.1f} s)")


def _score_record(engine: Engine, comps) -> dict:
    if not comps:
        return {}
    scored = engine.score([c.prompt_ids.tolist() for c in comps], [c.token_ids.tolist() for c in comps],
                          top_k=comps[0].topk_ids.shape[1] or 5)
    return {c.prompt_id: s for c, s in zip(comps, scored)}


# --- acceptance replay -------------------------------------------------------------------------

def replay_suite(plan: RunPlan, engine: Engine, suite: Suite, corpus: Corpus, log: Log = _print,
                 progress: Callable[[int, int, str], None] | None = None) -> None:
    """The acceptance replay of each spec config the plan asks one of (its first repeat's own
    outputs; one already stored is kept). The replay runs without the engine's planted fault
    (engine arg ``fault``): a fault models a bug in the engine under test, the replay is the
    independent expectation it is judged by, so with a fault a fresh engine of the same weights
    and other args replays."""
    planned = plan.planned()
    todo = [c for c in plan.configs if planned.get(c.name, {}).get("replay")
            and suite.is_complete(c.name, 0) and not suite.has_replay(c.name, 0)]
    if not todo:
        return
    replayer, own = engine, False
    if "fault" in plan.engine_args:
        args = {k: v for k, v in plan.engine_args.items() if k != "fault"}
        try:
            replayer, own = make_engine(plan.engine, plan.model, args, plan.draft), True
        except (EngineError, EngineUsageError, RuntimeError) as e:
            log(f"acceptance replay left for later: no engine without the fault ({e})")
            return
    try:
        replay_configs(replayer, suite, todo, {p.id: p.max_tokens for p in corpus.prompts}, log,
                       progress)
    finally:
        if own:
            replayer.close()


def replay_configs(engine: Engine, suite: Suite, configs: Sequence[SpecConfig],
                   max_tokens: dict[str, int], log: Log = _print,
                   progress: Callable[[int, int, str], None] | None = None) -> None:
    """Replay each config's first repeat with ``engine`` (which must carry no planted fault)
    and store it; a replay that fails is said and left missing (the verdict names it)."""
    for i, config in enumerate(configs):
        if progress:
            progress(i, len(configs), f"replaying the acceptance of {config.name}")
        t0 = time.perf_counter()
        comps = suite.load_run(config.name, 0).completions
        try:
            replays = engine.replay_acceptance(
                config, [c.prompt_ids.tolist() for c in comps], [c.token_ids.tolist() for c in comps],
                [max_tokens.get(c.prompt_id, c.n_tokens) for c in comps])
        except Exception as e:  # noqa: BLE001 - recorded as missing, not fatal to the run
            log(f"acceptance replay of {config.name} failed: {type(e).__name__}: {e}")
            continue
        if replays is None:
            return  # this engine cannot replay
        suite.write_replay(config.name, 0, [c.prompt_id for c in comps], replays)
        log(f"{config.name:>12} acceptance replayed: {_tpi([r.counters for r in replays])} tok/iter "
            f"expected, {_tpi([c.spec for c in comps if c.spec])} reported "
            f"({time.perf_counter() - t0:.1f} s)")


def _tpi(counters) -> str:
    """Tokens per iteration of summed counters (emitted tokens over verify steps)."""
    drafts = sum(c.drafts for c in counters)
    steps = sum(c.iterations if c.iterations is not None else c.drafts for c in counters)
    return f"{(sum(c.accepted_tokens for c in counters) + steps) / steps:.2f}" if steps and drafts else "-"


# --- kernel-path attribution -------------------------------------------------------------------

def check_attribution_paths(plan: RunPlan, engine: Engine) -> None:
    """Every ``--attribution-paths`` glob must match a kernel path the engine offers, said before
    anything runs (a typo would otherwise attribute with nothing, minutes later)."""
    spec = [c for c in plan.configs if not c.is_baseline]
    if not (plan.attribute and plan.attribution_paths and spec):
        return
    labels = list((engine.rerun_variants(spec, None) if plan.attribution_mode == "rerun"
                   else engine.attribution_variants(spec, None))) + list(plan.attribute_with)
    unmatched = [g for g in plan.attribution_paths if not any(fnmatch.fnmatchcase(x, g) for x in labels)]
    if unmatched:
        raise EngineUsageError(f"--attribution-paths: {', '.join(map(repr, unmatched))} matches no kernel path "
                               f"of the {plan.engine} engine; it offers: {'; '.join(labels) or 'none'}. "
                               "Give globs of those labels (e.g. 'gdn=*'), or drop the option.")


def select_paths(variants: dict[str, dict[str, str]], globs: Sequence[str],
                 log: Log = _print) -> dict[str, dict[str, str]]:
    """The kernel paths whose label matches one of ``globs`` (all of them without globs)."""
    if not globs:
        return variants
    chosen = {label: args for label, args in variants.items()
              if any(fnmatch.fnmatchcase(label, g) for g in globs)}
    if not chosen:
        log(f"attribution: no kernel path matches --attribution-paths {','.join(globs)}; "
            f"this engine offers: {'; '.join(variants) or 'none'}")
    else:
        log(f"attribution: {len(chosen)} of {len(variants)} kernel paths chosen by "
            f"--attribution-paths ({'; '.join(chosen)})")
    return chosen


def attribute_suite(plan: RunPlan, variants: dict[str, dict[str, str]], suite: Suite,
                    config_names: Sequence[str], log: Log = _print, jobs: int = 1) -> None:
    """For each first divergence of a spec config from the baseline, compute the divergent
    position under every alternative kernel-path setting the engine offers and record which
    setting gives which token there: the shared prefix re-scored (rescore), or the baseline
    regenerated with the switch flipped (rerun). In rerun mode, where no switch gives the
    baseline the spec token, the spec config is regenerated with each switch too: a switch
    under which the spec run gives the baseline's token is as much the cause. Up to ``jobs``
    engine starts run at once (where the engine says its variants can); each one's tokens are
    stored as it ends, so a run stopped half-way resumes with the starts still to do."""
    if not suite.is_complete("baseline", 0):
        return
    todo = _first_divergences(suite, config_names)
    if not todo:
        return
    rerun = plan.attribution_mode == "rerun"
    weights = weights_fingerprint(suite.run_identity("baseline", 0))
    # configs that diverge at the same place share one computation per kernel path
    unique: dict[tuple, list[dict]] = {}
    for items in todo.values():
        for it in items:
            unique.setdefault((it["prompt_id"], tuple(it["prompt_ids"]), tuple(it["prefix"])), []).append(it)
    firsts = [group[0] for group in unique.values()]
    if firsts:
        tokens_at = _rerun_tokens(plan, SpecConfig()) if rerun else _rescored_tokens
        units = [_Unit(label, "baseline", firsts, tokens_at) for label in variants]
        found = _over_units(plan, variants, units, jobs, log, suite, weights,
                            f"on {len(firsts)} divergent prefix(es)" + (" by rerun" if rerun else ""))
        for unit, tokens in zip(units, found):
            for group, token in zip(unique.values(), tokens or []):
                if token >= 0:  # -1: that path could not compute this position (engine says why)
                    for it in group:
                        it.setdefault("paths", {})[unit.label] = token
    left = {name: [it for it in items if it["spec_token"] not in it.get("paths", {}).values()]
            for name, items in todo.items()} if rerun else {}
    left = {name: items for name, items in left.items() if items}
    if left:
        # one engine start per (switch, spec config): on vLLM each config is a worker of its own
        units = [_Unit(label, name, items, _rerun_tokens(plan, SpecConfig.from_name(name)))
                 for label in variants for name, items in left.items()]
        n = sum(map(len, left.values()))
        found = _over_units(plan, variants, units, jobs, log, suite, weights,
                            f"regenerating {len(left)} spec config(s) on the {n} divergence(s) "
                            f"no baseline rerun reproduced")
        for unit, tokens in zip(units, found):
            for it, token in zip(unit.items, tokens or []):
                if token >= 0:
                    it.setdefault("spec_paths", {})[unit.label] = token
    for name, items in todo.items():
        for it in items:
            it.pop("prompt_ids"), it.pop("prefix")
            paths, spec_paths = it.setdefault("paths", {}), it.pop("spec_paths", {})
            it["reproduces_spec"] = sorted(k for k, t in paths.items() if t == it["spec_token"])
            it["reproduces_base"] = sorted(k for k, t in paths.items() if t == it["base_token"])
            if rerun:
                it["spec_paths"] = spec_paths
                it["spec_reproduces_base"] = sorted(k for k, t in spec_paths.items()
                                                    if t == it["base_token"])
            it["attributed_to"] = (it["reproduces_spec"] or it.get("spec_reproduces_base")
                                   or "unattributed")
            it["by"] = plan.attribution_mode
        suite.write_attribution(name, items)
        if items:
            log(f"{name:>12} attributed {len(items)} divergence(s) over {len(variants)} kernel paths")
    suite.clear_attribution_parts()


def _first_divergences(suite: Suite, config_names: Sequence[str]) -> dict[str, list[dict]]:
    """Per config not yet attributed, its first divergence from the baseline on each prompt
    (with the prompt's ids and the shared prefix, for the kernel paths to compute)."""
    base = suite.load_run("baseline", 0).by_prompt()
    todo: dict[str, list[dict]] = {}
    for name in config_names:
        if not suite.is_complete(name, 0) or suite.has_attribution(name):
            continue
        items = []
        for c in suite.load_run(name, 0).completions:
            b = base.get(c.prompt_id)
            if b is None:
                continue
            pos = first_divergence(b.token_ids, c.token_ids)
            if pos is None or pos >= min(b.n_tokens, c.n_tokens):
                continue
            items.append({"prompt_id": c.prompt_id, "position": int(pos),
                          "base_token": int(b.token_ids[pos]), "spec_token": int(c.token_ids[pos]),
                          "prompt_ids": b.prompt_ids.tolist(), "prefix": b.token_ids[:pos + 1].tolist()})
        todo[name] = items
    return todo


@dataclass
class _Unit:
    """One engine start of attribution: the kernel path (its label among the variants), the
    config it generates or scores (``baseline`` for the baseline side), the divergences, and
    ``tokens_at(engine, items)``: the token at each divergent position, -1 where none."""
    label: str
    config: str
    items: list[dict]
    tokens_at: Callable

    def key(self, plan: RunPlan, weights: tuple) -> str:
        """What its stored tokens stay valid for: the same computation on the same positions
        of the same stored runs' weights."""
        where = [(it["prompt_id"], it["position"], it["prefix"]) for it in self.items]
        return json.dumps([plan.attribution_mode, self.label, self.config, list(weights), where])


def _over_units(plan: RunPlan, variants: dict[str, dict[str, str]], units: list[_Unit], jobs: int,
                log: Log, suite: Suite, weights: tuple, what: str) -> list[list[int] | None]:
    """Each unit's tokens, computed with an engine under its kernel path (``jobs`` at once) or
    read back where a stopped run stored them; None for a path that failed (logged)."""
    results = [suite.load_attribution_part(u.key(plan, weights)) for u in units]
    todo = [i for i, r in enumerate(results) if r is None]
    if len(todo) < len(units):
        log(f"attribution: {len(units) - len(todo)} of {len(units)} kernel-path run(s) {what} "
            f"already stored by an earlier run, kept")
    started = time.perf_counter()
    several = len({u.config for u in units}) > 1

    def one(n: int) -> list[int] | None:
        u = units[todo[n]]
        done = n - min(n, max(jobs, 1) - 1)  # runs finished before this one started, about
        eta = (f", about {(time.perf_counter() - started) / done * (len(todo) - n):.0f} s left"
               if done > 0 else "")
        name = f"{u.label}, {u.config}" if several else u.label
        log(f"attribution: kernel path {n + 1}/{len(todo)} ({name}) {what}{eta}")
        try:
            engine = make_engine(plan.engine, plan.model, {**plan.engine_args, **variants[u.label]},
                                 plan.draft)
            try:
                tokens = [int(t) for t in u.tokens_at(engine, u.items)]
            finally:
                engine.close()
        except (EngineError, EngineUsageError, RuntimeError) as e:
            log(f"attribution variant {u.label} failed: {e}")
            return None
        suite.write_attribution_part(u.key(plan, weights), tokens)
        return tokens

    if jobs > 1 and len(todo) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="speccheck-attribution") as pool:
            computed = list(pool.map(one, range(len(todo))))
    else:
        computed = [one(n) for n in range(len(todo))]
    for i, tokens in zip(todo, computed):
        results[i] = tokens
    return results


def _rescored_tokens(engine: Engine, firsts: list[dict]) -> list[int]:
    """The top-1 token at each divergent position, the shared prefix re-scored."""
    scored = engine.score([it["prompt_ids"] for it in firsts], [it["prefix"] for it in firsts],
                          top_k=2)
    return [int(s.topk_ids[it["position"], 0]) for it, s in zip(firsts, scored)]


def _rerun_tokens(plan: RunPlan, config: SpecConfig):
    """A ``tokens_at`` that regenerates each divergent prompt under ``config`` (the baseline,
    or a spec config), the same request the stored run made: the token at the divergent
    position, or -1 where the rerun left the shared prefix earlier (a switch that changes an
    earlier token says nothing of this one)."""
    prompts = {p.id: p for p in plan.load_corpus().prompts}

    def tokens_at(engine: Engine, items: list[dict]) -> list[int]:
        asked = [prompts[it["prompt_id"]] for it in items]
        comps = engine.generate(asked, [it["prompt_ids"] for it in items], config, 2)
        out = []
        for it, c in zip(items, comps):
            pos, ids = it["position"], np.asarray(c.token_ids)
            same = len(ids) > pos and np.array_equal(ids[:pos], np.asarray(it["prefix"][:pos]))
            out.append(int(ids[pos]) if same else -1)
        return out
    return tokens_at


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
