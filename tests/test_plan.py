"""The gate knows the matrix: `speccheck run` records what it was asked for before any engine
starts, and every command that judges the suite fails a planned (or demanded) config that is
missing, naming it and the run that resumes it. The kill is real (SIGKILL), the engine the
reference one on the smoke corpus."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from speccheck.cli import main
from speccheck.engines import EngineError
from speccheck.plan import RunPlan, plan_suite_id
from speccheck.executors import run_suite
from speccheck.store import Store
from speccheck.types import SpecConfig

RUN = ["run", "--method", "mtp", "--k", "3", "--corpus", "smoke"]


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def suite_dir(store: Path) -> Path:
    (suite,) = (store / "suites").iterdir()
    return suite


#: `speccheck run` with two holds put in, so that where it is killed does not depend on the
#: machine's speed: the fresh-process lane never starts a worker, and the process stops for
#: good right after storing the baseline's first run, saying so on stdout after its own lines.
HELD_RUN = """
import sys, threading
import speccheck.executors.local, speccheck.store
from speccheck.cli import main

def held(*args, **kwargs):
    threading.Event().wait()  # the fresh-process lane: held until the kill

write_run = speccheck.store.Suite.write_run

def write_then_stop(self, record):
    path = write_run(self, record)
    if record.config.is_baseline and record.repeat == 0:
        print("<baseline r0 stored>", flush=True)
        threading.Event().wait()  # held until the kill
    return path

speccheck.executors.local.run_in_fresh_process = held
speccheck.store.Suite.write_run = write_then_stop
sys.argv = ["speccheck", *sys.argv[1:]]
main()
"""


#: the reference engine's default axis levels, in the registry's order (runner axes and the
#: serving axes its run_workload runs)
REFERENCE_AXES = ["axis-shapes-k", "axis-shapes-batch", "axis-concurrency-8", "axis-concurrency-32", "axis-prefix_cache-cold",
                  "axis-prefix_cache-hit", "axis-long_lived-200", "axis-kv_pressure-free",
                  "axis-kv_pressure-pressure", "axis-async_scheduling-off", "axis-async_scheduling-on",
                  "axis-chat_thinking-off", "axis-chat_thinking-on"]


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Path:
    """`speccheck run --method mtp --k 3 --corpus smoke` killed with SIGKILL right after the
    baseline's first run is stored (:data:`HELD_RUN`): what a killed CI job leaves behind."""
    store = tmp_path_factory.mktemp("killed") / "S"
    proc = subprocess.Popen([sys.executable, "-c", HELD_RUN, *RUN, "--store", str(store)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    try:
        said = ""
        for said in iter(proc.stdout.readline, ""):  # the run's own output comes first
            if said == "<baseline r0 stored>\n":
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the run's own process group, nothing else
        proc.wait()
        proc.stdout.close()
    assert said == "<baseline r0 stored>\n", f"the run ended before the baseline was stored: {said!r}"
    assert list(store.glob("suites/*/runs/baseline/r0/manifest.json"))
    assert not (suite_dir(store) / "runs" / "mtp-k3").exists()
    return store


@pytest.fixture(scope="module")
def resumed(killed, tmp_path_factory) -> Path:
    """The killed store after running the command the gate names to resume mtp-k3."""
    store = tmp_path_factory.mktemp("resumed") / "S"
    shutil.copytree(killed, store)
    gate = cli("gate", "--store", killed)
    command = re.search(r"mtp-k3 was planned.*?re-run `([^`]*)`", gate.output).group(1)
    args = shlex.split(command)
    assert args[:2] == ["speccheck", "run"]
    args[args.index("--store") + 1] = str(store)
    r = cli(*args[1:])
    assert r.exit_code == 0, r.output
    return store


def test_plan_is_recorded_before_the_engine_runs(killed):
    plan = json.loads((suite_dir(killed) / "plan.json").read_text())
    assert list(plan["configs"]) == ["baseline", "mtp-k3"]
    assert plan["configs"]["mtp-k3"] == {"repeats": 2, "fresh_process_repeat": True, "concurrent": 2,
                                         "rescore": True, "attribute": True, "replay": True,
                                         "axes": REFERENCE_AXES}
    assert plan["run_args"] == ["--engine", "reference", "--corpus", "smoke"]


def test_killed_run_fails_every_judging_command_naming_the_config(killed, tmp_path):
    gate = cli("gate", "--store", killed)
    assert gate.exit_code == 1, gate.output
    assert "FAIL  mtp-k3" in gate.output and "gate: FAIL" in gate.output
    assert re.search(r"mtp-k3 was planned but is not stored: .*`speccheck run --engine reference "
                     r"--corpus smoke --config mtp-k3 .*--store", gate.output)
    # the baseline's own missing runs (r1, all at once, rescoring) are named too
    assert re.search(r"planned but not stored: baseline r1, baseline all at once \(x2\)", gate.output)
    assert "Traceback" not in gate.output

    diff = cli("diff", "--store", killed)
    assert "mtp-k3  —  FAIL" in diff.output and "mtp-k3 was planned" in diff.output
    report = cli("report", "--store", killed, "--out", tmp_path / "rep")
    assert "mtp-k3 was planned" in report.output
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "**Verdict: FAIL**" in md and "`mtp-k3` ran: **FAIL** — mtp-k3 was planned" in md
    check = cli("golden", "check", "--store", killed, "--golden", tmp_path / "golden")
    assert check.exit_code != 0 and "mtp-k3 was planned" in check.output
    record = cli("golden", "record", "--store", killed, "--golden", tmp_path / "golden")
    assert record.exit_code == 2 and "incomplete" in record.output and "mtp-k3" in record.output
    assert not (tmp_path / "golden").exists()


@pytest.mark.slow
def test_the_named_command_resumes_and_the_gate_passes(resumed):
    gate = cli("gate", "--store", resumed)
    assert gate.exit_code == 0, gate.output
    assert "no recorded plan" not in gate.output


@pytest.mark.slow
def test_rescoring_and_attribution_never_finished_fail(resumed, tmp_path):
    store = tmp_path / "S"
    shutil.copytree(resumed, store)
    suite = suite_dir(store)
    (suite / "rescore" / "mtp-k3-r0.npz").unlink()
    (suite / "attribution" / "mtp-k3.json").unlink()
    gate = cli("gate", "--store", store)
    assert gate.exit_code == 1
    assert ("planned but not stored: teacher-forced rescoring of mtp-k3 r0 (never finished), "
            "kernel-path attribution of mtp-k3 (never finished)") in gate.output


@pytest.mark.slow
def test_demanded_configs_must_be_stored(resumed):
    assert cli("gate", "--store", resumed, "--method", "mtp", "--k", "3").exit_code == 0
    absent = cli("gate", "--store", resumed, "--config", "mtp-k5")
    assert absent.exit_code == 1
    assert "FAIL  mtp-k5" in absent.output and "mtp-k5 is not stored in suite" in absent.output
    no_method = cli("gate", "--store", resumed, "--method", "dflash")
    assert no_method.exit_code == 1 and "--method dflash: demanded" in no_method.output
    assert "gate: FAIL" in no_method.output


@pytest.mark.slow
def test_a_suite_whose_plan_is_gone_is_damage_and_the_run_writes_it_anew(resumed, tmp_path):
    """Without its plan a suite cannot say what was asked of it (deleting the plan must not
    leave a gate that judges only what is left): exit 2 naming plan.json, nothing changed."""
    store = tmp_path / "S"
    shutil.copytree(resumed, store)
    (suite_dir(store) / "plan.json").unlink()
    (suite_dir(store) / "plan.json.sha256").unlink(missing_ok=True)
    before = sorted(p.name for p in (suite_dir(store) / "runs").iterdir())
    gate = cli("gate", "--store", store)
    assert gate.exit_code == 2 and "plan.json: missing, though runs are stored" in gate.output, gate.output
    assert sorted(p.name for p in (suite_dir(store) / "runs").iterdir()) == before


def test_a_second_run_extends_the_plan(tmp_path, monkeypatch):
    """The plan is written before the engine starts (here it fails to start, an engine
    failure), and a second run into the same suite adds its configs; a config planned again
    keeps the larger demand."""
    def no_engine(*args, **kwargs):
        raise EngineError("no device")

    monkeypatch.setattr("speccheck.runner.make_engine", no_engine)
    store = tmp_path / "S"
    first = cli("run", "--store", store, "--corpus", "smoke", "--config", "mtp-k3", "--repeats", "3")
    assert first.exit_code == 3 and "no device" in first.output
    second = cli("run", "--store", store, "--corpus", "smoke", "--config", "dflash-k7",
                 "--repeats", "1", "--concurrent", "off", "--no-attribution")
    assert second.exit_code == 3
    plan = json.loads((suite_dir(store) / "plan.json").read_text())["configs"]
    assert list(plan) == ["baseline", "dflash-k7", "mtp-k3"]
    assert plan["baseline"]["repeats"] == 3 and plan["baseline"]["concurrent"] == 2
    assert plan["dflash-k7"] == {"repeats": 1, "fresh_process_repeat": False, "concurrent": 0,
                                 "rescore": True, "attribute": False, "replay": True,
                                 "axes": REFERENCE_AXES}
    gate = cli("gate", "--store", store)
    assert gate.exit_code == 1
    for name in plan:
        assert f"{name} was planned but is not stored" in gate.output


@pytest.mark.slow
def test_pytest_plugin_fails_a_planned_config_it_was_not_asked_for(resumed, tmp_path):
    """`pytest -m spec` generates tests for every config the suite's plan holds: one an
    earlier run planned and never stored fails every one of its tests there, by name."""
    store = tmp_path / "S"
    shutil.copytree(resumed, store)
    plan = RunPlan(corpus="smoke", configs=[SpecConfig(), SpecConfig("mtp", 3)])
    suite = Store(store).suite(plan_suite_id(plan))
    suite.extend_plan({"mtp-k5": json.loads((suite.root / "plan.json").read_text())["configs"]["mtp-k3"]},
                      plan.run_args())
    test_file = tmp_path / "test_gate.py"
    test_file.write_text("from speccheck.pytest_plugin import *  # noqa\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "spec", "-p", "no:randomly", "-n", "0",
                        str(test_file), "--spec-store", str(store), "--spec-corpus", "smoke",
                        "--spec-method", "mtp", "--spec-k", "3", "-k", "deterministic"],
                       capture_output=True, text=True, cwd=tmp_path)
    # every test of the missing config fails, with why; the stored configs' tests pass or skip
    assert "2 failed, 2 passed, 1 skipped" in r.stdout, r.stdout
    assert re.search(r"FAILED .*test_deterministic\[mtp-k5\]", r.stdout), r.stdout
    assert re.search(r"FAILED .*test_acceptance_deterministic\[mtp-k5\]", r.stdout), r.stdout
    assert "mtp-k5 was planned but is not stored" in r.stdout


@pytest.mark.slow
def test_run_ignore_eos_decodes_every_budget_in_a_suite_of_its_own(tmp_path):
    """`speccheck run --ignore-eos` (here on smoke, whose chat prompt the reference model ends
    at once): every prompt decodes its full max_tokens, in a suite apart from the plain one."""
    store = tmp_path / "S"
    r = cli("run", "--store", store, "--corpus", "smoke", "--method", "baseline", "--repeats", "1",
            "--concurrent", "off", "--ignore-eos")
    assert r.exit_code == 0, r.output
    plan = RunPlan(corpus="smoke", configs=[SpecConfig()], ignore_eos=True)
    suite = Store(store).suite(plan_suite_id(plan))
    assert suite.meta["ignore_eos"] is True
    assert plan_suite_id(plan) != plan_suite_id(RunPlan(corpus="smoke"))
    budget = {p.id: p.max_tokens for p in plan.load_corpus().prompts}
    assert {c.prompt_id: c.n_tokens for c in suite.load_run("baseline", 0).completions} == budget
    assert "--ignore-eos" in suite.resume_command("baseline")


def test_missing_names_each_planned_piece(tmp_path):
    """Store level, on hand-made records: each thing a plan asks of a config is checked."""
    from speccheck.types import Completion, RunRecord

    suite = Store(tmp_path / "S").suite("s", {"corpus_hash": "h"})
    want = {"repeats": 2, "fresh_process_repeat": True, "concurrent": 2, "rescore": False,
            "attribute": False}
    suite.extend_plan({"baseline": want}, ["--engine", "reference", "--corpus", "smoke"])

    def record(repeat, fresh=False, copies=0):
        comp = Completion("p", [1, 2], [3], [-0.1], [[3, 4]], [[-0.1, -2.0]])
        return RunRecord(SpecConfig(), {}, "smoke", "h", repeat, fresh,
                         completions=[comp] * max(copies, 1), copies=copies)

    suite.write_run(record(0))
    assert "baseline r1, baseline all at once (x2)" in suite.missing("baseline")[0]
    suite.write_run(record(1))
    suite.write_run(record(-1, copies=1))
    (gap,) = suite.missing("baseline")
    assert "baseline all at once (x2)" in gap and "fresh-process repeat of baseline" in gap
    assert "--repeats 2 --concurrent 2 --no-attribution" in gap
    suite.write_run(record(1, fresh=True))
    suite.write_run(record(-1, copies=2))
    assert suite.missing("baseline") == []


def test_attribution_paths_choose_kernel_paths_by_glob(tmp_path):
    """--attribution-paths keeps the matching labels only, says which, and says what exists
    when nothing matches (a typo must not silently attribute nothing)."""
    from speccheck.runner import select_paths

    variants = {"decode": {"a": "1"}, "decode eager": {"b": "1"}, "verify mtp-k3": {"c": "1"},
                "prefill gdn=triton": {"d": "1"}}
    said = []
    assert select_paths(variants, (), said.append) == variants and not said
    chosen = select_paths(variants, ("decode", "verify*"), said.append)
    assert list(chosen) == ["decode", "verify mtp-k3"]
    assert "2 of 4" in said[-1]
    assert select_paths(variants, ("prefil gdn*",), said.append) == {}
    assert "prefill gdn=triton" in said[-1] and "no kernel path matches" in said[-1]


@pytest.mark.slow
def test_attribution_paths_reach_the_attribution_step(tmp_path):
    """On the reference engine, a glob picks its gdn paths only: the stored attribution names no other."""
    from click.testing import CliRunner

    from speccheck.cli import main
    from speccheck.store import Store

    store = tmp_path / "s"
    r = CliRunner().invoke(main, ["run", "--corpus", "smoke", "--config", "mtp-k3", "--repeats", "1",
                                  "--concurrent", "off", "--attribution-paths", "gdn=*",
                                  "--store", str(store)])
    assert r.exit_code == 0, r.output
    assert "kernel paths chosen by --attribution-paths" in r.output
    suite = Store(store).latest()
    items = suite.load_attribution("mtp-k3")
    for it in items:
        assert set(it["paths"]) <= {"gdn=chunked", "gdn=recurrent"}, it["paths"]


class RefusingScorer:
    """Test double: the reference engine behind a scorer that refuses, as the openai engine
    does on a server that speculates (ScoringUnavailable)."""

    def __init__(self, engine):
        self.engine = engine

    def score(self, *args, **kwargs):
        from speccheck.engines.base import ScoringUnavailable
        raise ScoringUnavailable("the server at http://x runs speculative decoding")


def test_rescoring_refused_is_left_for_a_later_run_that_can(tmp_path):
    """A run whose engine cannot rescore (ScoringUnavailable) stores its outputs without the
    rescoring and says so; the next rescoring pass, even one planned for the baseline only,
    rescores what was left (the openai flow: spec server, then the baseline server again)."""
    from speccheck.engines import make_engine
    from speccheck.plan import RunPlan
    from speccheck.executors import run_suite
    from speccheck.runner import rescore_suite
    from speccheck.store import Store
    from speccheck.types import SpecConfig

    store, args = Store(tmp_path / "s"), {"fault": "stale-state"}
    run_suite(RunPlan(engine_args=args, corpus="smoke", repeats=1, attribute=False,
                      configs=[SpecConfig()]), store, log=lambda m: None)  # scored as it ran
    suite = run_suite(RunPlan(engine_args=args, corpus="smoke", repeats=1, attribute=False, rescore=False,
                              configs=[SpecConfig.from_name("mtp-k3")]), store, log=lambda m: None)
    engine = make_engine("reference", None, args)
    try:
        said = []
        assert suite.has_rescore("baseline", 0) and not suite.has_rescore("mtp-k3", 0)
        rescore_suite(RefusingScorer(engine), suite, ["mtp-k3"], said.append)
        assert not suite.has_rescore("mtp-k3", 0)
        assert any("rescoring mtp-k3 left for later" in m and "speculative" in m for m in said), said
        rescore_suite(engine, suite, ["baseline"], said.append)
        assert suite.has_rescore("mtp-k3", 0)
    finally:
        engine.close()


def test_where_the_openai_engine_rescores_is_not_part_of_the_suite():
    """score_base_url, timeouts and the key's variable change how speccheck talks to a server,
    not what it computes: a spec run rescored on a baseline server beside it is in the baseline's
    suite. The server under test (base_url) and the tokenizer still are."""
    from speccheck.plan import RunPlan, plan_suite_id

    def sid(**args):
        return plan_suite_id(RunPlan(engine="openai", corpus="smoke", engine_args=args))

    base = sid(base_url="http://127.0.0.1:8000")
    assert sid(base_url="http://127.0.0.1:8000", score_base_url="http://127.0.0.1:8001",
               timeout="30", retries="1", backoff="2", api_key_env="K") == base
    assert sid(base_url="http://127.0.0.1:8001") != base
    assert sid(base_url="http://127.0.0.1:8000", tokenizer="/t/tokenizer.json") != base


@pytest.mark.slow
def test_rerun_attribution_reads_the_regenerated_baseline(tmp_path):
    """--attribution-mode rerun: each kernel path's token at a divergent position is what a
    baseline generated from scratch with that switch gives there (or nothing, where that
    rerun already left the shared prefix); the vLLM switches lose their score-only paths."""
    from speccheck.engines import make_engine
    import numpy as np

    from speccheck.engines.vllm import rerun_switches
    from speccheck.plan import RunPlan
    from speccheck.executors import run_suite
    from speccheck.store import Store
    from speccheck.types import SpecConfig

    lines = []
    plan = RunPlan(corpus="smoke", configs=[SpecConfig(), SpecConfig.from_name("mtp-k3")],
                   engine_args={"fault": "stale-state"}, repeats=1, concurrent=0, rescore=False,
                   attribution_paths=("gdn=*",), attribution_mode="rerun")
    suite = run_suite(plan, Store(tmp_path / "s"), log=lines.append)
    items = suite.load_attribution("mtp-k3")
    assert items, "stale-state diverges on smoke"  # the planted fault makes it certain
    assert any("by rerun" in line for line in lines)
    base = suite.load_run("baseline", 0).by_prompt()
    prompts = {p.id: p for p in plan.load_corpus().prompts}
    for label, args in (("gdn=chunked", {"gdn_prefill": "chunked", "gdn_decode": "chunked",
                                         "gdn_verify": "chunked"}),):
        engine = make_engine("reference", None, {"fault": "stale-state", **args})
        try:
            for it in items:
                b = base[it["prompt_id"]]
                [c] = engine.generate([prompts[it["prompt_id"]]], [b.prompt_ids], SpecConfig(), 2)
                pos = it["position"]
                same = np.array_equal(c.token_ids[:pos], b.token_ids[:pos])
                assert it["paths"].get(label) == (int(c.token_ids[pos]) if same else None), it
                assert it["by"] == "rerun"
        finally:
            engine.close()
    v = {"decode": {"score_path": "decode"},
         "decode gdn=fused_sigmoid_gating": {"score_path": "decode", "env.X": "0"},
         "decode eager": {"score_path": "decode", "enforce_eager": "true"},
         "verify mtp-k3": {"score_path": "verify", "score_spec": "mtp-k3"},
         "prefill eager": {"enforce_eager": "true"}}
    assert rerun_switches(v) == {"decode gdn=fused_sigmoid_gating": {"env.X": "0"},
                                 "decode eager": {"enforce_eager": "true"}}


@pytest.mark.slow
def test_attribution_jobs_run_kernel_paths_at_once_with_the_same_result(tmp_path):
    """attribution_jobs > 1 (vLLM: a worker per kernel path) runs the paths on a thread pool;
    what it stores is what one path after another stores."""
    import shutil
    import threading

    from speccheck.engines import make_engine
    from speccheck.plan import RunPlan
    from speccheck.executors import run_suite
    from speccheck.runner import attribute_suite
    from speccheck.store import Store
    from speccheck.types import SpecConfig

    plan = RunPlan(corpus="smoke", configs=[SpecConfig(), SpecConfig.from_name("mtp-k3")],
                   engine_args={"fault": "stale-state"}, repeats=1, concurrent=0, rescore=False,
                   attribute=False)
    suite = run_suite(plan, Store(tmp_path / "a"), log=lambda _: None)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    engine = make_engine("reference", None, plan.engine_args)
    variants = engine.attribution_variants([SpecConfig.from_name("mtp-k3")])
    engine.close()
    threads = {1: set(), 2: set()}
    stored = {}
    for jobs, name in ((1, "a"), (2, "b")):
        s = Store(tmp_path / name).suite(suite.id)
        attribute_suite(plan, variants, s, ["mtp-k3"],
                        log=lambda _, j=jobs: threads[j].add(threading.current_thread().name),
                        jobs=jobs)
        stored[jobs] = s.load_attribution("mtp-k3")
    assert stored[1] and stored[1] == stored[2]
    assert threads[1] == {threading.current_thread().name}
    assert any(t.startswith("speccheck-attribution") for t in threads[2])


def test_rerun_attribution_also_regenerates_the_spec_side(tmp_path):
    """In rerun mode, where no switch gives the baseline the spec token, the spec config is
    regenerated under each switch: a switch under which the spec run gives the baseline's
    token is the cause. Planted here: the spec runs carry the stale-state fault, which no
    baseline run has, so only the spec run with the fault switched off removes the divergence."""
    from speccheck.report import attribution_str
    from speccheck.plan import RunPlan
    from speccheck.executors import run_suite
    from speccheck.runner import attribute_suite
    from speccheck.store import Store
    from speccheck.types import SpecConfig

    plan = RunPlan(corpus="smoke", configs=[SpecConfig(), SpecConfig.from_name("mtp-k3")],
                   engine_args={"fault": "stale-state"}, repeats=1, concurrent=0, rescore=False,
                   attribute=False, attribution_mode="rerun")
    suite = run_suite(plan, Store(tmp_path / "s"), log=lambda _: None)
    lines = []
    attribute_suite(plan, {"fault off": {"fault": "none"}}, suite, ["mtp-k3"], log=lines.append)
    items = suite.load_attribution("mtp-k3")
    assert items and any("regenerating 1 spec config(s)" in line for line in lines), lines
    for it in items:
        assert it["reproduces_spec"] == []  # the baseline never had the fault
        assert it["paths"]["fault off"] == it["base_token"]
    caught = [it for it in items if it["spec_reproduces_base"] == ["fault off"]]
    assert caught, items  # the clean spec run gives the baseline token there
    for it in caught:
        assert it["attributed_to"] == ["fault off"] and it["spec_paths"]["fault off"] == it["base_token"]
        assert "the spec run with it gives the baseline token" in attribution_str(it)


@pytest.mark.slow
def test_attribution_stopped_half_way_resumes_with_the_paths_still_to_do(tmp_path, monkeypatch):
    """Each kernel path's tokens are stored as its engine run ends: a run killed after the
    first path (here: the second engine start raises KeyboardInterrupt, as Ctrl-C or a
    deadline would) keeps that path, and the next run starts engines only for the rest and
    stores the same attribution as one uninterrupted run."""
    import speccheck.runner as runner
    from speccheck.plan import RunPlan
    from speccheck.executors import run_suite
    from speccheck.runner import attribute_suite
    from speccheck.store import Store
    from speccheck.types import SpecConfig

    plan = RunPlan(corpus="smoke", configs=[SpecConfig(), SpecConfig.from_name("mtp-k3")],
                   engine_args={"fault": "stale-state"}, repeats=1, concurrent=0, rescore=False,
                   attribute=False, attribution_mode="rerun")
    suite = run_suite(plan, Store(tmp_path / "a"), log=lambda _: None)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    variants = {"gdn chunked": {"gdn_decode": "chunked"}, "fault off": {"fault": "none"}}
    real, started = runner.make_engine, []

    def counted(engine, model, args, draft=None):
        started.append(args)
        return real(engine, model, args, draft)

    monkeypatch.setattr(runner, "make_engine", counted)
    attribute_suite(plan, variants, suite, ["mtp-k3"], log=lambda _: None)
    whole, whole_starts = suite.load_attribution("mtp-k3"), list(started)
    assert whole and not (suite.root / "attribution" / "parts").exists()
    assert len(whole_starts) > 2  # the baseline side's two paths, then the spec side's

    def stopped_at_the_second(engine, model, args, draft=None):
        started.append(args)
        if len(started) == 2:
            raise KeyboardInterrupt
        return real(engine, model, args, draft)

    b = Store(tmp_path / "b").suite(suite.id)
    started.clear()
    monkeypatch.setattr(runner, "make_engine", stopped_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        attribute_suite(plan, variants, b, ["mtp-k3"], log=lambda _: None)
    assert b.load_attribution("mtp-k3") is None
    assert len(list((b.root / "attribution" / "parts").glob("*.json"))) == 1

    started.clear()
    monkeypatch.setattr(runner, "make_engine", counted)
    lines = []
    attribute_suite(plan, variants, b, ["mtp-k3"], log=lines.append)
    assert any("1 of 2 kernel-path run(s)" in line and "kept" in line for line in lines), lines
    assert started == whole_starts[1:]  # the first path was not run again
    assert b.load_attribution("mtp-k3") == whole
