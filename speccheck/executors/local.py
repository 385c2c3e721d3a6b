"""The local executor (the default): the plan's runs one after another in this process, with
one engine; the fresh-process repeat in a new Python process (alongside, where the engine
leaves a core free); then the workload axes, rescoring, the acceptance replay and kernel-path
attribution, each as runner.py computes it.

``python -m speccheck.executors.local REQUEST`` is that fresh-process worker."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Callable, Sequence

from speccheck.engines import EngineUsageError, make_engine
from speccheck.plan import RunPlan
from speccheck.runner import (Log, _print, _summary_line, attribute_suite, attribution_paths,
                              axis_runs_to_do, is_fresh_repeat, replay_suite, rescore_suite,
                              run_axis, run_one, runs_to_do, score_sampled_suite, start_engine,
                              tokenized_inputs)
from speccheck.store import Store, Suite
from speccheck.types import RunRecord, SpecConfig, sampling_of, slot_label


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
    engine, suite = start_engine(plan, store, corpus)
    try:
        inputs = tokenized_inputs(suite, engine, corpus)
        todo = runs_to_do(plan, engine, suite, corpus, log)

        def is_fresh(repeat: int) -> bool:
            return is_fresh_repeat(plan, engine, repeat)

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
            attribute_suite(plan, attribution_paths(plan, engine, suite, log), suite,
                            [c.name for c in plan.configs if not c.is_baseline], log,
                            jobs=engine.attribution_jobs)
    finally:
        engine.close()
    return suite


def run_axes(plan: RunPlan, engine, suite: Suite, corpus, inputs, log: Log = _print,
             progress: Callable[[int, int, str], None] | None = None) -> None:
    """Every planned axis level of every axis config not yet stored, after the repeats (a
    conversation's next turn carries the config's stored answer)."""
    todo = axis_runs_to_do(plan, suite)
    if todo:
        log(f"workload axes: {len(todo)} run(s) ({', '.join(sorted({slot_label(s) for _, s in todo}))})")
    for i, (config, slot) in enumerate(todo):
        if progress:
            progress(i, len(todo), f"{config.name} {slot_label(slot)}")
        log(_summary_line(run_axis(plan, engine, suite, corpus, inputs, config, slot)))


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
    proc = subprocess.run([sys.executable, "-m", "speccheck.executors.local", json.dumps(request)],
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

if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
