"""The ray executor on a real (local, CPU) Ray: it stores what the local executor stores, cell for
cell; a worker killed mid-run and a node lost mid-run cost a retry the log names, nothing else;
a second run finds nothing to do. Every cell here is the reference engine on CPU."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import speccheck
from speccheck.api import gate

ray = pytest.importorskip("ray")

ROOT = Path(__file__).parents[2]
#: one divergence (so attribution runs), the corpus all at once and one axis level: every kind
#: of cell, in seconds
PLAN = dict(corpus="near_tie", configs=["mtp-k3"], axes="concurrency=4")
#: what legitimately differs between two runs of one plan: timings, the machine/process identity,
#: and axis proofs' counters of the engine's whole life (the local executor runs every cell on
#: one engine, so its counters and prefix cache carry over from the runs before; a Ray cell
#: starts its own engine)
VOLATILE = {"wall_s", "ttft_s", "decode_s", "decode_cpu_s", "draft_s", "identity", "files"}
ENGINE_LIFETIME = {"requests_served", "engine_requests_served", "prefix_hits", "prefix_hit_tokens"}


def _content(x, key=None):
    if isinstance(x, dict):
        drop = VOLATILE | (ENGINE_LIFETIME if key == "proof" else set())
        return {k: _content(v, k) for k, v in x.items() if k not in drop}
    if isinstance(x, list):
        return [_content(v) for v in x]
    return x


def assert_same_store(a: Path, b: Path) -> int:
    """Every array of every file bit-identical, every JSON file equal but for VOLATILE; the
    number of arrays compared."""
    sa, sb = (next((p / "suites").iterdir()) for p in (a, b))
    files = sorted(p.relative_to(sa) for p in sa.rglob("*") if p.is_file() and p.suffix in (".npz", ".json"))
    assert files == sorted(p.relative_to(sb) for p in sb.rglob("*") if p.is_file() and p.suffix in (".npz", ".json"))
    arrays = 0
    for rel in files:
        if rel.suffix == ".npz":
            za, zb = np.load(sa / rel, allow_pickle=False), np.load(sb / rel, allow_pickle=False)
            assert sorted(za.files) == sorted(zb.files), rel
            for key in za.files:
                assert za[key].dtype == zb[key].dtype and za[key].shape == zb[key].shape, (rel, key)
                assert np.array_equal(za[key], zb[key], equal_nan=za[key].dtype.kind == "f"), (rel, key)
                arrays += 1
        else:
            ja, jb = (json.loads((s / rel).read_text()) for s in (sa, sb))
            assert _content(ja) == _content(jb), rel
    return arrays


@pytest.fixture
def local_ray():
    ray.init(address="local", num_cpus=2, log_to_driver=False, logging_level="ERROR")
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_ray_stores_what_the_local_executor_stores(tmp_path, local_ray):
    """The same plan run locally and as Ray tasks under ray.init(num_cpus=2): the same runs,
    tokens, logprobs, top-k, teacher-forced scores, replays and attribution, bit for bit, and
    the same gate verdict."""
    lines: list[str] = []
    speccheck.run(store=tmp_path / "local", log=lambda _: None, **PLAN)
    speccheck.run(store=tmp_path / "ray", executor="ray", log=lines.append, **PLAN)
    assert any("ray: using the Ray this process is connected to" in ln for ln in lines), lines
    assert any("kernel-path run(s)" in ln for ln in lines), lines  # attribution ran, as cells
    assert assert_same_store(tmp_path / "local", tmp_path / "ray") > 50  # 75 on this plan
    local, on_ray = (gate(tmp_path / s, golden=None) for s in ("local", "ray"))
    assert (local.exit_code, local.text) == (on_ray.exit_code, on_ray.text)
    suite = next((tmp_path / "ray" / "suites").iterdir())
    assert json.loads((suite / "attribution" / "mtp-k3.json").read_text())  # the divergence, attributed


def _run(store: Path, *extra: str) -> subprocess.Popen:
    """The CLI with a Ray of its own (--address local): left out, Ray joins whatever cluster
    was started last on this machine, such as another test's ray.cluster_utils.Cluster."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "speccheck.cli", "run", "--store", str(store), "--corpus", "smoke",
                             "--config", "mtp-k3", "--executor", "ray", "--address", "local", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


#: the cell killed: long enough (200 requests) that its worker is still in it when the log
#: says it started
LONG = ["--axes", "long_lived=200", "--no-attribution"]
STARTED = re.compile(r"baseline axis long_lived \(200\) started on (\S+) \(node (\w+)\), pid (\d+)")


@pytest.mark.slow
def test_a_killed_worker_costs_a_retry_and_a_rerun_finds_nothing_to_do(tmp_path):
    """`speccheck run --executor ray` as a user runs it; the worker process of one cell is
    killed (SIGKILL) while it runs: the run completes (exit 0), the log says which cell lost
    its worker where and that it ran again, the gate passes, and the same command then finds
    nothing to do (and starts no Ray)."""
    proc = _run(tmp_path / "st", *LONG)
    out: list[str] = []
    killed = None
    for line in proc.stdout:
        out.append(line)
        m = STARTED.search(line)
        if m and killed is None:
            killed = int(m.group(3))
            os.kill(killed, signal.SIGKILL)
    assert proc.wait(timeout=300) == 0, "".join(out)
    log = "".join(out)
    assert killed is not None, log
    assert "baseline axis long_lived (200): its Ray worker was lost on" in log, log
    assert "sending it again (attempt 2 of 3)" in log, log
    assert "retried after a lost worker or node: baseline axis long_lived (200) (1x)" in log, log
    gate = subprocess.run([sys.executable, "-m", "speccheck.cli", "gate", "--store", str(tmp_path / "st")],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert gate.returncode == 0, gate.stdout + gate.stderr
    again = _run(tmp_path / "st", *LONG)
    text = again.communicate(timeout=300)[0]
    assert again.returncode == 0, text
    assert "0 to run" in text and "ray: nothing to do" in text and "Ray on this machine" not in text, text


@pytest.mark.slow
def test_a_node_lost_mid_run_is_retried_on_another_and_nothing_is_lost(tmp_path):
    """A two-node ray.cluster_utils.Cluster; the node a cell started on is removed while the
    cell runs: the run completes on the node left, every planned run is stored, the gate
    passes, and the log names the cell that ran again."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    worker = cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    lines: list[str] = []
    removed = threading.Event()
    errors: list[BaseException] = []

    def log(line: str) -> None:
        lines.append(line)
        if not removed.is_set() and f"(node {worker.node_id[:8]})" in line and " started on " in line:
            removed.set()
            threading.Thread(target=cluster.remove_node, args=(worker,)).start()

    def run() -> None:
        try:
            speccheck.run(store=tmp_path / "st", corpus="smoke", configs=["mtp-k3"],
                          axes="long_lived=200", no_attribution=True, executor="ray", log=log)
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    try:
        t = threading.Thread(target=run)
        t.start()
        t.join(timeout=300)
        assert not t.is_alive(), "\n".join(lines)
    finally:
        ray.shutdown()
        cluster.shutdown()
    text = "\n".join(lines)
    assert not errors, (errors, text)
    assert removed.is_set(), text
    assert "progress board is gone" not in text, text  # it lives on the driver's node
    lost = re.findall(r"^(.+): its Ray (?:worker|node) was lost", text, re.M)
    assert lost and f"retried after a lost worker or node: {lost[0]} (1x)" in text, text
    verdict = gate(tmp_path / "st", golden=None)
    assert verdict.exit_code == 0, verdict.text
    suite = next((tmp_path / "st" / "suites").iterdir())
    stored = sorted(p.parent.relative_to(suite / "runs").as_posix() for p in (suite / "runs").rglob("manifest.json"))
    assert stored == sorted(f"{c}/{r}" for c in ("baseline", "mtp-k3")
                            for r in ("r0", "r1", "together", "axis-long_lived-200")), stored


@pytest.mark.slow
def test_a_tensor_parallel_cell_holds_its_gpus_on_one_node():
    """Placement without GPUs: a cluster whose nodes declare logical GPUs (1 on one node, 2 on
    another); a cell of a TP = 2 engine, given task_options(2, ...), lands on the node with two
    and is given both (the process that starts vLLM's multiprocessing executor sees its whole
    TP group), a TP = 1 cell one; a TP = 3 cell waits (no node has three)."""
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import remove_placement_group

    from speccheck.executors.ray import task_options

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    cluster.add_node(num_cpus=1, num_gpus=1)
    two = cluster.add_node(num_cpus=1, num_gpus=2)
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    try:
        @ray.remote
        def where() -> tuple[str, list]:
            return ray.get_runtime_context().get_node_id(), ray.get_gpu_ids()

        options, group = task_options(2, fresh=True)
        assert group is not None and group.bundle_specs == [{"GPU": 2, "CPU": 1}]
        node, gpus = ray.get(where.options(**options).remote(), timeout=60)
        assert node == two.node_id and len(gpus) == 2
        remove_placement_group(group)
        options, group = task_options(1, fresh=False)
        assert group is None and len(ray.get(where.options(**options).remote(), timeout=60)[1]) == 1
        options, group = task_options(3, fresh=False)
        ready, _ = ray.wait([group.ready()], timeout=3)
        assert not ready  # infeasible here: it waits (for an autoscaler), it is not split
        remove_placement_group(group)
    finally:
        ray.shutdown()
        cluster.shutdown()
