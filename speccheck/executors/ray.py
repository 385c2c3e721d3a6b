"""The ray executor (``speccheck run --executor ray``): every cell of the plan a Ray task, sized
to its engine, on this machine or a cluster; only this process, the driver, writes the store.

A cell is one thing an engine computes: a (config, repeat) run, a workload-axis level of a
config, a config's teacher-forced rescoring, acceptance replay or sampled scoring, one
kernel-path attribution run. It computes exactly what the local executor computes (the same
runner.py functions, against a :class:`CellSuite`: the stored records it reads, sent with it,
and the writes it makes, returned), so both executors store the same outputs. A cell is sent
when what it reads is stored: a config's axes, rescoring and replay after its first repeat,
a spec config's rescoring after the baseline's, attribution once every config's first repeat
is in (on a thread of its own, beside the rest); so the wall time approaches the longest such
chain, not the sum.

Each task holds what its engine needs (Engine.gpus(): TP x PP GPUs; more than one in a
placement group, one STRICT_PACK bundle, so all of an engine's GPUs are on one node and seen
by the one process that starts it). The fresh-process repeat runs in a worker started for it
alone (a runtime_env of its own, max_calls=1), checked on arrival. A cell whose worker or node
dies is sent again (RETRIES times, said in the log with the node it died on); the others go
on; one that keeps dying is stored as a failed run (exit 3 names it). Ctrl-C cancels every
task in flight; what is stored stays, and the same command resumes."""
from __future__ import annotations

import importlib.util
import logging
import os
import queue
import socket
import threading
import time
import uuid
from concurrent.futures import CancelledError, Future, as_completed
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import ray
from ray.exceptions import (GetTimeoutError, NodeDiedError, ObjectLostError, OutOfMemoryError, RayActorError,
                            RayTaskError, WorkerCrashedError)
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from speccheck.corpus import Corpus
from speccheck.engines import Engine, EngineError, EngineUsageError, make_engine
from speccheck.plan import PlanError, RunPlan
from speccheck.runner import (Log, _print, _summary_line, attribute_suite, attribution_paths, axis_runs_to_do,
                              is_fresh_repeat, replay_configs, rescore_suite, run_axis, run_one, runs_to_do,
                              score_sampled_suite, start_engine, tokenized_inputs, unit_tokens)
from speccheck.store import Store, Suite
from speccheck.types import RunRecord, SpecConfig, sampling_of, slot_label

#: times a cell whose worker or node was lost is sent again before it counts as failed
RETRIES = 2
#: seconds for something to answer at --address, then for the Ray there to take us in
PROBE_S, CONNECT_S = 5.0, 30.0
#: how often the driver looks at its cells (and redraws the progress line)
TICK_S = 0.5
#: a lost worker, node or result: the cell is sent again
LOST = (WorkerCrashedError, NodeDiedError, ObjectLostError, OutOfMemoryError)
#: an engine failing inside a cell: the cell failed, as it would have locally (not retried)
ENGINE_FAILED = (EngineError, RuntimeError, OSError, MemoryError)


def run_suite(plan: RunPlan, store: Store, log: Log = _print,
              progress: Callable[[int, int, str], None] | None = None) -> Suite:
    """Plan the cells not yet stored (with the engine made here, as locally: its arguments
    checked, the plan recorded), then send them to Ray and store what comes back, under the
    store's lock. A cluster named by --address is joined first (one that is not there writes
    nothing); Ray on this machine is started only when there is something to do."""
    address = plan.address or os.environ.get("RAY_ADDRESS") or None
    named = "--address" if plan.address else "$RAY_ADDRESS"  # what the messages blame
    probe(address, named)
    joined = connect(address, log, named) if address not in (None, "local") else None
    try:
        with store.lock(notify=log):
            corpus = plan.load_corpus()
            engine, suite = start_engine(plan, store, corpus)
            try:
                inputs = tokenized_inputs(suite, engine, corpus)
                cells, attribute = plan_cells(plan, engine, suite, corpus, log)
                if not cells and not attribute:
                    log("ray: nothing to do: every cell of this plan is stored")
                    return suite
                if joined is None:
                    joined = connect(address, log, named)
                _Driver(plan, engine, suite, corpus, inputs, log, progress).run(cells, attribute)
            finally:
                engine.close()
    finally:
        if joined:
            ray.shutdown()
    return suite


# --- connecting ---------------------------------------------------------------------------------

def probe(address: str | None, named: str = "--address") -> None:
    """An address that nothing answers at, said within PROBE_S (Ray itself retries for
    minutes); a dashboard URL or a ray:// address without Ray Client installed, said before
    anything runs. ``named``: where the address came from, for the message."""
    if address in (None, "auto", "local"):
        return
    what = f"{named} {address}"
    if address.startswith(("http://", "https://")):
        raise PlanError(f"{what}: that is a dashboard's address (what `ray job submit` takes); the "
                        "driver joins a cluster at its head node's GCS address, HOST:6379, or auto on a "
                        "node of the cluster.")
    if address.startswith("ray://") and importlib.util.find_spec("grpc") is None:
        raise PlanError(f"{what}: a ray:// address goes through Ray Client, which needs "
                        "`pip install 'ray[client]'`; or run `speccheck run` on a node of the cluster "
                        "with --address auto.")
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise PlanError(f"{what}: write auto, HOST:PORT (the head node's GCS port, 6379 unless "
                        "changed) or ray://HOST:PORT (Ray Client, port 10001).")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_S).close()
    except OSError as e:
        raise PlanError(f"{what}: nothing answers there within {PROBE_S:.0f} s "
                        f"({e.strerror or type(e).__name__}); start the cluster (`ray start --head` on its "
                        "head node), give its head node's address, or leave the address out to start Ray "
                        "on this machine.") from None


def connect(address: str | None, log: Log, named: str = "--address") -> bool:
    """Join the Ray at ``address`` within CONNECT_S (None: start one on this machine), unless
    this process already has (a test's ray.init, a notebook's). True when this call started
    or joined it, so the run ends it. A Ray started here starts on the main thread (its
    processes would die with a thread that started them); joining one is given a deadline."""
    if ray.is_initialized():
        log("ray: using the Ray this process is connected to")
        return False
    options = dict(log_to_driver=False, logging_level=logging.ERROR)
    if address in (None, "local"):
        log("ray: starting Ray on this machine" if address else
            "ray: Ray on this machine (the cluster `ray start` runs here, else a new one)")
        ray.init(address=address, **options)
        return True
    what = f"{named} {address}"
    log(f"ray: connecting to {address} ({named})")
    done, failed = threading.Event(), []

    def join() -> None:
        try:
            ray.init(address=address, **options)
        except BaseException as e:  # noqa: BLE001 - said on the main thread below
            failed.append(e)
        finally:
            done.set()

    threading.Thread(target=join, name="speccheck-ray-connect", daemon=True).start()
    if not done.wait(CONNECT_S):
        raise PlanError(f"{what}: something answers there, but no Ray cluster took this driver in "
                        f"within {CONNECT_S:.0f} s; check that it is a Ray head node (GCS port, 6379 "
                        "unless changed) running this Ray version, or leave the address out to start "
                        "Ray on this machine.")
    if failed:
        e = failed[0]
        if isinstance(e, (ConnectionError, ValueError, RuntimeError)):
            raise PlanError(f"{what}: Ray could not connect there ({e}); give the head node's address "
                            "(auto, HOST:PORT or ray://HOST:PORT), or leave the address out to start Ray "
                            "on this machine.") from None
        raise e
    return True


# --- what a cell is, and what it runs -----------------------------------------------------------

@dataclass
class CellSpec:
    """What a task is sent: the cell's name in the log (``key``), what it computes (``kind``:
    run, axis, rescore, sampled, replay or attribution), what it computes it on (``payload``),
    whether it must be the first thing its process runs, the GPUs it holds, and which attempt
    it is."""

    key: str
    kind: str
    payload: dict = field(default_factory=dict)
    fresh: bool = False
    gpus: int = 0
    attempt: int = 1


class CellSuite:
    """A cell's view of the suite: the stored records the driver sent with it, read the way
    runner.py reads a Suite, and the writes it makes, kept for the driver to make with the
    store's own write path (a cell never writes the store, so its node needs none)."""

    #: the Suite methods a cell's writes become on the driver
    WRITES = ("write_run", "write_rescore", "write_replay", "write_sampled_scores")

    def __init__(self, runs: dict | None = None, rescores: dict | None = None) -> None:
        self.runs: dict[tuple[str, int | str], RunRecord] = dict(runs or {})
        self.rescores: dict[str, dict] = dict(rescores or {})
        self.writes: list[tuple[str, tuple]] = []

    def is_complete(self, config_name: str, repeat: int | str) -> bool:
        record = self.runs.get((config_name, repeat))
        return record is not None and record.status == "ok"

    def load_run(self, config_name: str, repeat: int | str) -> RunRecord:
        return self.runs[(config_name, repeat)]

    def configs(self) -> list[str]:
        return list(dict.fromkeys(name for name, _ in self.runs))

    def has_rescore(self, config_name: str, repeat: int) -> bool:
        return repeat == 0 and config_name in self.rescores

    def load_rescore(self, config_name: str, repeat: int):
        return self.rescores.get(config_name) if repeat == 0 else None

    def load_sampled_scores(self, config_name: str, repeat: int):
        return None  # a sampled-scoring cell is sent only where none is stored

    def write_run(self, record: RunRecord) -> None:
        self.writes.append(("write_run", (record,)))

    def write_rescore(self, *args) -> None:
        self.writes.append(("write_rescore", args))

    def write_replay(self, *args) -> None:
        self.writes.append(("write_replay", args))

    def write_sampled_scores(self, *args) -> None:
        self.writes.append(("write_sampled_scores", args))


#: cells this worker process has run: a fresh-process cell must find 0
_cells_here = 0


def where_am_i() -> dict:
    return {"node": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid()}


def _cell(spec: CellSpec, plan: RunPlan, corpus: Corpus, inputs: dict, board) -> dict:
    """The task: say where it runs, check a fresh cell is its process's first, compute."""
    global _cells_here
    first, _cells_here = _cells_here == 0, _cells_here + 1
    where = where_am_i()
    if board is not None:
        board.started.remote(spec.key, spec.attempt, where)
    if spec.fresh and not first:
        raise RuntimeError(f"{spec.key} is planned in a fresh process, and its Ray worker "
                           f"(pid {where['pid']}) ran another cell before it")
    if not spec.gpus:  # a cell that holds no GPU uses none: the engine that planned it ran on the CPU
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    lines: list[str] = []
    return {"where": where, "log": lines, **compute_cell(spec, plan, corpus, inputs, lines.append)}


#: the driver sends a lost cell again itself (max_retries=0), so the log can say so; a fresh
#: cell's worker exits after it (max_calls=1: a task option only, hence two remote functions)
_cell_task = ray.remote(max_retries=0)(_cell)
_fresh_cell_task = ray.remote(max_retries=0, max_calls=1)(_cell)


def compute_cell(spec: CellSpec, plan: RunPlan, corpus: Corpus, inputs: dict, log: Log) -> dict:
    """What one cell computes, wherever it runs: {"writes": [...]} for the driver to make, or
    for an attribution run {"tokens": [...]} (or {"failed": why}, as the local executor says)."""
    p = spec.payload
    if spec.kind == "attribution":
        try:
            return {"tokens": unit_tokens(plan, p["args"], p["unit"])}
        except (EngineError, EngineUsageError, RuntimeError) as e:
            return {"failed": f"attribution variant {p['unit'].label} failed: {e}"}
    args = dict(plan.engine_args)
    if spec.kind == "replay":  # the replay is the independent expectation: never a planted fault
        args.pop("fault", None)
    view = CellSuite(p.get("runs"), p.get("rescores"))
    engine = make_engine(plan.engine, plan.model, args, plan.draft)
    try:
        config: SpecConfig = p["config"]
        if spec.kind == "run":
            run_one(engine, view, corpus, inputs, config, p["repeat"], plan.top_k,
                    fresh_process=spec.fresh or engine.fresh_process_per_config,
                    copies=plan.concurrent if p["repeat"] < 0 else 0)
        elif spec.kind == "axis":
            run_axis(plan, engine, view, corpus, inputs, config, p["slot"])
        elif spec.kind == "rescore":
            rescore_suite(engine, view, [config.name], log)
        elif spec.kind == "sampled":
            score_sampled_suite(engine, view, [config.name], log)
        elif spec.kind == "replay":
            replay_configs(engine, view, [config], {q.id: q.max_tokens for q in corpus.prompts}, log)
        else:
            raise ValueError(f"no cell kind {spec.kind!r}")
    finally:
        engine.close()
    return {"writes": view.writes}


def task_options(gpus: int, fresh: bool) -> tuple[dict[str, Any], Any]:
    """A cell's Ray options, and the placement group it runs in (None: none): one CPU and its
    engine's GPUs; more than one GPU as one STRICT_PACK bundle (a task takes its resources from
    one bundle, so the engine's GPUs are on one node and all visible to the process that starts
    it); a fresh cell in a worker of its own (a runtime_env no other task shares)."""
    options: dict[str, Any] = {"num_cpus": 1, "num_gpus": gpus}
    if fresh:
        options["runtime_env"] = {"env_vars": {"SPECCHECK_FRESH_CELL": uuid.uuid4().hex}}
    if gpus <= 1:
        return options, None
    group = placement_group([{"GPU": gpus, "CPU": 1}], strategy="STRICT_PACK")
    options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
    return options, group


@ray.remote(num_cpus=0)
class _Board:
    """Where cells say that they started, and where: the driver reads it for the progress
    display and the log (which worker a cell runs in is known only once it runs)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, dict]] = []

    def started(self, key: str, attempt: int, where: dict) -> None:
        self.events.append((key, attempt, where))

    def take(self) -> list[tuple[str, int, dict]]:
        out, self.events = self.events, []
        return out


# --- which cells, after which -------------------------------------------------------------------

@dataclass
class _Cell:
    spec: CellSpec
    needs: set[str] = field(default_factory=set)  # keys of cells it reads the output of
    future: Future | None = None  # an attribution run's: the thread that asked waits on it


def plan_cells(plan: RunPlan, engine: Engine, suite: Suite, corpus: Corpus,
               log: Log = _print) -> tuple[list[_Cell], bool]:
    """The cells this run has left (what the local executor would do, cell by cell, each with
    the cells whose output it reads), and whether attribution is left to do."""
    gpus = engine.gpus()
    runs = runs_to_do(plan, engine, suite, corpus, log)
    first = {c.name for c, r in runs if r == 0}  # first repeats run now: what reads them waits

    def after(*names: str) -> set[str]:
        return {f"{n} r0" for n in names if n in first}

    def cell(key: str, kind: str, config: SpecConfig, needs: set[str] = frozenset(), fresh: bool = False,
             **payload) -> _Cell:
        return _Cell(CellSpec(key, kind, {"config": config, **payload}, fresh, gpus), set(needs))

    def left(name: str, stored: Callable[[str], bool]) -> bool:
        return name in first or (suite.is_complete(name, 0) and not stored(name))

    cells = [cell(f"{c.name} {slot_label(r)}", "run", c, fresh=is_fresh_repeat(plan, engine, r), repeat=r)
             for c, r in runs]
    cells += [cell(f"{c.name} {slot_label(slot)}", "axis", c, after(c.name), slot=slot)
              for c, slot in axis_runs_to_do(plan, suite)]
    by_name = {c.name: c for c in plan.configs}
    if plan.rescore:
        names = [n for n in dict.fromkeys([*by_name, *suite.configs()])
                 if left(n, lambda n: suite.has_rescore(n, 0))]
        base = "baseline" in names
        cells += [cell(f"rescore {n}", "rescore", by_name.get(n) or SpecConfig.from_name(n),
                       after("baseline", n) | ({"rescore baseline"} if base and n != "baseline" else set()))
                  for n in names]
    sampled = sampling_of(plan.engine_args) is not None
    planned = plan.planned()
    if sampled:
        cells += [cell(f"sampled scores {c.name}", "sampled", c, after(c.name)) for c in plan.configs
                  if left(c.name, lambda n: suite.load_sampled_scores(n, 0) is not None)]
    else:
        cells += [cell(f"replay {c.name}", "replay", c, after(c.name)) for c in plan.configs
                  if planned[c.name].get("replay") and left(c.name, lambda n: suite.has_replay(n, 0))]
    attribute = plan.attribute and not sampled and any(
        left(c.name, suite.has_attribution) for c in plan.configs if not c.is_baseline)
    return cells, attribute


# --- the driver ---------------------------------------------------------------------------------

class _Driver:
    """Sends cells whose inputs are stored, stores what comes back, sends lost cells again,
    and shows where each one runs. Only this thread calls Ray; the attribution thread hands
    its cells over through a queue and waits on futures."""

    def __init__(self, plan: RunPlan, engine: Engine, suite: Suite, corpus: Corpus, inputs: dict,
                 log: Log, progress: Callable[[int, int, str], None] | None) -> None:
        self.plan, self.engine, self.suite, self.corpus = plan, engine, suite, corpus
        self.log, self.progress = log, progress
        self.refs = (ray.put(plan), ray.put(corpus), ray.put(inputs))
        self.waiting: list[_Cell] = []
        self.in_flight: dict[Any, _Cell] = {}
        self.groups: dict[str, Any] = {}  # placement groups of cells in flight
        self.incoming: queue.Queue[_Cell] = queue.Queue()
        self.done: set[str] = set()
        self.total = 0
        self.running: dict[str, dict] = {}  # key -> where, from the board
        self.nodes: set[str] = set()
        self.retried: dict[str, int] = {}
        self.failures: list[str] = []
        self.shown: tuple = ()
        self.last = ""
        self.thread: threading.Thread | None = None
        self.thread_error: BaseException | None = None
        self.board = self._board()

    def _board(self):
        """The board, on the driver's own node (a node that dies takes its actors along; a soft
        affinity lets Ray put it elsewhere even where this node has room)."""
        try:
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            return _Board.options(scheduling_strategy=here).remote()
        except Exception:  # noqa: BLE001 - Ray Client: no node of our own
            return _Board.remote()

    # -- the loop

    def run(self, cells: list[_Cell], attribute: bool) -> None:
        began = time.monotonic()
        self._describe(cells, attribute)
        for c in cells:
            self._add(c)
        r0 = {c.spec.key for c in cells if c.spec.kind == "run" and c.spec.payload["repeat"] == 0}
        attribution_needs = set(r0) if attribute else None
        try:
            while True:
                while not self.incoming.empty():
                    self._add(self.incoming.get())
                if attribution_needs is not None and not (attribution_needs - self.done):
                    attribution_needs = None
                    self.thread = threading.Thread(target=self._attribute, name="speccheck-attribution",
                                                   daemon=True)
                    self.thread.start()
                self._release()
                if self.thread_error is not None:
                    raise self.thread_error
                busy = self.thread is not None and self.thread.is_alive()
                if not self.in_flight and self.incoming.empty() and not busy:
                    if self.waiting or attribution_needs is not None:
                        raise RuntimeError("cells wait on cells that will never run: "
                                           + ", ".join(c.spec.key for c in self.waiting))
                    break
                ready = []
                if self.in_flight:
                    ready, _ = ray.wait(list(self.in_flight), num_returns=1, timeout=TICK_S)
                    if ready:
                        ready, _ = ray.wait(list(self.in_flight), num_returns=len(self.in_flight), timeout=0)
                else:
                    time.sleep(TICK_S)
                self._read_board()
                for ref in ready:
                    self._finish(ref)
                self._show()
        except BaseException:
            self._cancel()
            raise
        finally:
            for group in self.groups.values():
                remove_placement_group(group)
            self.groups.clear()
        retried = ", ".join(f"{k} ({n}x)" for k, n in self.retried.items())
        self.log(f"ray: {len(self.done)} cell(s) on {len(self.nodes)} node(s) in {time.monotonic() - began:.0f} s"
                 + (f"; retried after a lost worker or node: {retried}" if retried else ""))
        if self.failures:
            raise EngineError("cells that failed on Ray: " + "; ".join(self.failures) + ". What the "
                              "other cells stored is kept; the same command runs the failed ones again.")

    def _describe(self, cells: list[_Cell], attribute: bool) -> None:
        resources = ray.cluster_resources()
        alive = [n for n in ray.nodes() if n.get("Alive")]
        self.log(f"ray: {len(alive)} node(s), {resources.get('CPU', 0):g} CPUs, {resources.get('GPU', 0):g} GPUs; "
                 f"{len(cells)} cell(s) to run" + (" + kernel-path attribution" if attribute else "")
                 + f", {self.engine.gpus()} GPU(s) each")
        gpus = self.engine.gpus()
        most = max((n.get("Resources", {}).get("GPU", 0) for n in alive), default=0)
        if gpus and most < gpus:
            self.log(f"ray: every cell holds {gpus} GPU(s) on one node, and no node has that many now "
                     f"(most: {most:g}); the cells wait for one (an autoscaler may add it)")

    def _add(self, cell: _Cell) -> None:
        self.total += 1
        cell.needs -= self.done
        self.waiting.append(cell)

    def _release(self) -> None:
        ready = [c for c in self.waiting if not (c.needs - self.done)]
        self.waiting = [c for c in self.waiting if c.needs - self.done]
        for cell in ready:
            self._send(cell)

    # -- sending

    def _payload(self, spec: CellSpec) -> dict | None:
        """The stored records the cell reads, read now (None: nothing left for it to do, e.g.
        the run it scores failed, or an earlier attempt stored it)."""
        s, p = self.suite, dict(spec.payload)
        name = p["config"].name if "config" in p else None
        if spec.kind in ("run", "attribution"):
            return p
        if spec.kind == "axis":
            p["runs"] = {(name, 0): s.load_run(name, 0)} if s.is_complete(name, 0) else {}
            return p
        if not s.is_complete(name, 0):
            return None
        p["runs"] = {(name, 0): s.load_run(name, 0)}
        if spec.kind == "rescore":
            if s.has_rescore(name, 0) or not s.is_complete("baseline", 0):
                return None
            p["runs"][("baseline", 0)] = s.load_run("baseline", 0)
            base = s.load_rescore("baseline", 0) if name != "baseline" and s.has_rescore("baseline", 0) else None
            p["rescores"] = {"baseline": base} if base is not None else {}
        elif spec.kind == "replay" and s.has_replay(name, 0):
            return None
        elif spec.kind == "sampled" and s.load_sampled_scores(name, 0) is not None:
            return None
        return p

    def _send(self, cell: _Cell) -> None:
        spec = cell.spec
        payload = self._payload(spec)
        if payload is None:
            self._close(cell)
            return
        sent = CellSpec(spec.key, spec.kind, payload, spec.fresh, spec.gpus, spec.attempt)
        options, group = task_options(spec.gpus, spec.fresh)
        if group is not None:
            self.groups[spec.key] = group
        task = _fresh_cell_task if spec.fresh else _cell_task
        ref = task.options(**options).remote(sent, *self.refs, self.board)
        self.in_flight[ref] = cell

    # -- coming back

    def _finish(self, ref) -> None:
        cell = self.in_flight.pop(ref)
        spec = cell.spec
        where = self.running.pop(spec.key, None)
        group = self.groups.pop(spec.key, None)
        if group is not None:
            remove_placement_group(group)
        try:
            result = ray.get(ref)
        except LOST as e:
            self._lost(cell, e, where)
            return
        except RayTaskError as e:
            cause = e.cause
            if isinstance(cause, EngineUsageError):
                raise cause from None  # bad input: exit 2
            if not isinstance(cause, ENGINE_FAILED):
                raise  # a bug in speccheck: exit 4, with its traceback
            self._failed(cell, f"{type(cause).__name__}: {cause}")
            return
        at = _at(result["where"])
        self.nodes.add(result["where"]["node_id"])
        for line in result.get("log", []):
            self.log(f"{line}  [{at}]")
        for name, args in result.get("writes", []):
            if name not in CellSuite.WRITES:
                raise RuntimeError(f"{spec.key}: a cell asked for {name}, which is not a store write")
            getattr(self.suite, name)(*args)
            if name == "write_run":
                self.log(f"{_summary_line(args[0])}  [{at}]")
        if spec.kind == "attribution":
            if "failed" in result:
                self.log(f"{result['failed']}  [{at}]")
            cell.future.set_result(result.get("tokens"))
        self.last = f"{spec.key} done on {result['where']['node']}"
        self._close(cell)

    def _lost(self, cell: _Cell, e: BaseException, where: dict | None) -> None:
        spec = cell.spec
        what = "node" if isinstance(e, NodeDiedError) else "worker"
        why = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
        at = f" on {_at(where)}" if where else ""
        if spec.attempt <= RETRIES:
            self.retried[spec.key] = self.retried.get(spec.key, 0) + 1
            self.log(f"{spec.key}: its Ray {what} was lost{at} ({why}); sending it again (attempt "
                     f"{spec.attempt + 1} of {RETRIES + 1})")
            spec.attempt += 1
            self._send(cell)
        else:
            self._failed(cell, f"its Ray {what} was lost {spec.attempt} times, the last{at}: {why}")

    def _failed(self, cell: _Cell, why: str) -> None:
        """A cell that failed for good: a run is stored as a failed run (the verdicts and the
        exit code name it, as locally); an attribution run counts as that kernel path failing;
        any other cell is named when the run ends (exit 3)."""
        spec, p = cell.spec, cell.spec.payload
        if spec.kind in ("run", "axis"):
            config, slot = p["config"], p.get("slot", p.get("repeat"))
            axis, level = slot.split("-", 2)[1:] if spec.kind == "axis" else ("", "")
            repeat = p["repeat"] if spec.kind == "run" else 0
            record = RunRecord(config=config, identity={}, corpus=self.corpus.name, corpus_hash=self.corpus.hash,
                               repeat=repeat, fresh_process=spec.fresh, status="failed", error=why,
                               copies=self.plan.concurrent if repeat < 0 else 0, axis=axis, level=level)
            self.suite.write_run(record)
            self.log(_summary_line(record))
        elif spec.kind == "attribution":
            self.log(f"attribution variant {p['unit'].label} failed: {why}")
            cell.future.set_result(None)
        else:
            self.failures.append(f"{spec.key} ({why})")
            self.log(f"{spec.key} FAILED: {why}")
        self.last = f"{spec.key} failed"
        self._close(cell)

    def _close(self, cell: _Cell) -> None:
        self.done.add(cell.spec.key)

    # -- where cells run

    def _read_board(self) -> None:
        if self.board is None:
            return
        try:
            events = ray.get(self.board.take.remote(), timeout=10)
        except (RayActorError, GetTimeoutError) as e:
            self.log(f"ray: the progress board is gone ({type(e).__name__}); cells go on, shown as they end")
            self.board = None
            return
        keys = {c.spec.key: c for c in self.in_flight.values()}
        for key, attempt, where in events:
            cell = keys.get(key)
            if cell is None or cell.spec.attempt != attempt:
                continue  # ended already, or an earlier attempt's
            self.running[key] = where
            self.nodes.add(where["node_id"])
            fresh = ", a fresh process" if cell.spec.fresh else ""
            self.log(f"{key:>24} started on {_at(where)}, pid {where['pid']} ({self.plan.engine} engine{fresh})")
            self.last = f"{key} on {where['node']}"

    def _show(self) -> None:
        if not self.progress:
            return
        running = len(self.running)
        queued = len(self.in_flight) - running + len(self.waiting)
        now = (len(self.done), self.total, running, queued, self.last)
        if now == self.shown:
            return
        self.shown = now
        self.progress(len(self.done), self.total, f"cells: {running} running, {queued} queued"
                      + (f" · {self.last}" if self.last else ""))

    # -- attribution, beside the rest

    def _attribute(self) -> None:
        try:
            variants = attribution_paths(self.plan, self.engine, self.suite, self.log)
            attribute_suite(self.plan, variants, self.suite,
                            [c.name for c in self.plan.configs if not c.is_baseline], self.log,
                            map_units=self._map_units)
        except CancelledError:
            pass
        except BaseException as e:  # noqa: BLE001 - raised on the driver's thread
            self.thread_error = e

    def _map_units(self, calls) -> Iterator[tuple[int, list[int] | None]]:
        """Attribution runs as cells (runner.MapUnits): each sent at once, each given back as
        it ends."""
        futures = []
        for name, args, unit in calls:
            future: Future = Future()
            spec = CellSpec(f"attribution {unit.label} ({unit.config})", "attribution",
                            {"args": args, "unit": unit}, gpus=self.engine.gpus())
            self.incoming.put(_Cell(spec, future=future))
            futures.append(future)
        index = {id(f): n for n, f in enumerate(futures)}
        for f in as_completed(futures):
            yield index[id(f)], f.result()

    # -- Ctrl-C

    def _cancel(self) -> None:
        """Every task in flight cancelled (a KeyboardInterrupt in each, so engines close; then
        forced after a few seconds), and the attribution thread let go."""
        refs = list(self.in_flight)
        for ref in refs:
            ray.cancel(ref)
        if refs:
            try:
                _, stuck = ray.wait(refs, num_returns=len(refs), timeout=5)
            except BaseException:  # noqa: BLE001 - a second Ctrl-C: force them at once
                stuck = refs
            for ref in stuck:
                ray.cancel(ref, force=True)
            self.log(f"ray: cancelled {len(refs)} task(s) in flight")
        for cell in [*self.in_flight.values(), *self.waiting]:
            if cell.future is not None:
                cell.future.cancel()
        while not self.incoming.empty():
            cell = self.incoming.get()
            if cell.future is not None:
                cell.future.cancel()
        self.in_flight.clear()


def _at(where: dict) -> str:
    return f"{where['node']} (node {where['node_id'][:8]})"


__all__ = ["CellSpec", "CellSuite", "compute_cell", "connect", "plan_cells", "probe", "run_suite",
           "task_options"]
