"""The vllm engine's workload axes without a GPU: the proof read from vLLM's metrics (the names
of vLLM 0.26.0, recorded and constructed fixtures in tests/fixtures/vllm/), the worker's step
loop (arrivals, turns in order, requests in flight, a stall) against the fake vLLM's engine in
this process, and every serving axis through VllmEngine.run_workload and `speccheck run` with
the fake vLLM in the worker (test doubles: tests/engines/test_vllm.py, FAKE_VLLM)."""
from __future__ import annotations

import copy
import json
import types
from pathlib import Path

import numpy as np
import pytest

from speccheck.axes import AxisInput
from speccheck.axes import get as get_axis
from speccheck.corpus import load_corpus
from speccheck.engines import vllm_worker
from speccheck.engines.base import EngineError, EngineUsageError
from speccheck.engines.vllm import (
    METRIC_NAMES,
    SPEC_NAMES,
    VllmEngine,
    metric_delta,
    metric_names,
    workload_llm_kwargs,
    workload_proof,
)
from speccheck.engines.vllm_worker import UsageProblem, metrics_to_dicts, serve_workload
from speccheck.evaluate import evaluate_suite
from speccheck.policy import Policy
from speccheck.types import Prompt, Request, SpecConfig, Workload
from tests.engines.test_vllm import FAKE_VLLM, dirs, fake_vllm  # noqa: F401 - fixtures (test doubles)

FIX = Path(__file__).parents[1] / "fixtures" / "vllm"
RUNNING = "vllm:num_requests_running"


def workload_fixtures() -> list[Path]:
    return sorted((FIX / "workload").glob("*.json"))


# ---------------------------------------------------------------- metric names and the proof

def test_metric_names_are_the_ones_vllm_0_26_reported():
    """Every name of the table is in the get_metrics() dumps captured from vLLM 0.26.0."""
    recorded = {r["name"] for name in ("mtp_k3.json", "baseline.json")
                for r in json.loads((FIX / name).read_text())["get_metrics"]}
    assert set(METRIC_NAMES[(0, 26)].values()) - recorded == set()
    assert SPEC_NAMES == {k: metric_names()[k] for k in SPEC_NAMES}


def test_metric_names_follow_the_version(monkeypatch):
    """A version reads the newest entry not after it (an older one the oldest, None the
    newest): a later vLLM that renamed a counter changes the table, and the proof of a
    workload it served is read under the new name."""
    old = dict(METRIC_NAMES[(0, 26)])
    renamed = {**old, "preemptions": "vllm:num_preempted_requests"}
    monkeypatch.setitem(METRIC_NAMES, (0, 40), renamed)
    for version, want in (("0.26.0", old), ("0.39.9rc1.dev3+gabc", old), ("0.9.2", old),
                          ("0.40.0", renamed), ("1.2.3", renamed), (None, renamed)):
        assert metric_names(version) == want, version
    stats = json.loads((FIX / "workload" / "kv_pressure-pressure.json").read_text())["stats"]
    assert workload_proof(stats, "0.26.0")["preemptions"] == 1
    assert "preemptions" not in workload_proof(stats, "0.40.1")  # not reported under the new name
    for key in ("metrics_before", "metrics_after"):
        for r in stats[key]:
            if r["name"] == "vllm:num_preemptions":
                r["name"] = "vllm:num_preempted_requests"
    assert workload_proof(stats, "0.40.1")["preemptions"] == 1


@pytest.mark.parametrize("path", workload_fixtures(), ids=lambda p: p.stem)
def test_proof_from_workload_fixtures(path):
    fx = json.loads(path.read_text())
    assert fx["metric_names"] == "vLLM 0.26.0" or fx["source"] == "captured"
    proof = workload_proof(fx["stats"], "0.26.0")
    if "proof" in fx:
        assert proof == fx["proof"]
    for key, value in proof.items():  # well formed, whatever the source
        assert isinstance(value, int) or key == "max_batch_from", key
        assert key == "max_batch_from" or value >= 0


def test_proof_keys_vllm_does_not_report_are_absent_not_zero():
    """A counter missing from the snapshot (an older vLLM, or one that keeps no such count)
    leaves its proof key out, so the gate fails the level as not exercised instead of
    reading 0; without the running gauge max_batch comes from the unfinished requests."""
    fx = json.loads((FIX / "workload" / "kv_pressure-pressure.json").read_text())
    stats = copy.deepcopy(fx["stats"])
    gone = {"vllm:num_preemptions", "vllm:prefix_cache_hits"}
    for key in ("metrics_before", "metrics_after"):
        stats[key] = [r for r in stats[key] if r["name"] not in gone]
    stats["step_max"] = {}
    proof = workload_proof(stats, "0.26.0")
    assert "preemptions" not in proof and "prefix_hits" not in proof
    assert proof["prefix_queries"] == 0  # still reported
    assert (proof["max_batch"], proof["max_batch_from"]) == (4, "unfinished requests")
    assert metric_delta([], [], "vllm:num_preemptions") is None


def test_proof_sums_engines_and_reads_prometheus_total_names():
    """Two engines (data parallel: label engine=1) add up; a counter exposed with Prometheus'
    _total suffix is the same counter."""
    fx = json.loads((FIX / "workload" / "prefix_cache-hit.json").read_text())
    stats = copy.deepcopy(fx["stats"])
    for key in ("metrics_before", "metrics_after"):
        other = copy.deepcopy(stats[key])
        for r in other:
            r["labels"] = {**r["labels"], "engine": "1"}
            if r["type"] == "counter":
                r["name"] += "_total"
        stats[key] += other
    proof = workload_proof(stats, "0.26.0")
    assert (proof["prefix_hits"], proof["prefix_queries"]) == (2 * 320, 2 * 656)


# ---------------------------------------------------------------- knobs

def test_workload_knobs_map_to_llm_arguments():
    assert workload_llm_kwargs({}) == {}
    assert workload_llm_kwargs({"prefix_cache": "on"}) == {"enable_prefix_caching": True}
    assert workload_llm_kwargs({"prefix_cache": "off", "kv_blocks": "9"}) == {
        "enable_prefix_caching": False, "num_gpu_blocks_override": 9}
    assert workload_llm_kwargs({"async_scheduling": "on"}) == {"async_scheduling": True}
    assert workload_llm_kwargs({"async_scheduling": "off"}) == {"async_scheduling": False}
    for bad in ({"prefix_cache": "maybe"}, {"kv_blocks": "0"}, {"kv_blocks": "-3"},
                {"kv_blocks": "many"}, {"swap_space": "4"}, {"async_scheduling": "auto"},
                {"chat_template": "on"}):
        with pytest.raises(EngineUsageError):
            workload_llm_kwargs(bad)


# ---------------------------------------------------------------- the step loop, in process

@pytest.fixture
def fake():
    """The fake vLLM (test double) as a module of this process."""
    mod = types.ModuleType("fake_vllm")
    exec(FAKE_VLLM, mod.__dict__)  # noqa: S102 - the test double's source (tests/engines/test_vllm.py)
    return mod


def greedy(mod, ids, n):
    out: list[int] = []
    for _ in range(n):
        out.append(mod.dist(list(ids) + out)[0][0])
    return out


class Recording:
    """Wraps the fake engine: which requests were unfinished at each step, and when each was
    added (in steps)."""

    def __init__(self, engine):
        self.engine, self.steps, self.added, self.unfinished = engine, 0, {}, []

    def add_request(self, request_id, prompt, params):
        self.added[request_id] = self.steps
        return self.engine.add_request(request_id, prompt, params)

    def get_num_unfinished_requests(self):
        return self.engine.get_num_unfinished_requests()

    def step(self):
        self.unfinished.append(self.engine.get_num_unfinished_requests())
        self.steps += 1
        return self.engine.step()


def items_of(mod, prompts, max_tokens=6, **kw):
    return [{"id": f"r{i}", "prompt": p, "arrive_after": kw.get("arrive", [0] * len(prompts))[i],
             "after": kw.get("after", [None] * len(prompts))[i],
             "params": mod.SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=3)}
            for i, p in enumerate(prompts)]


def serve(mod, items, max_in_flight, spec=None, **llm_kwargs):
    llm = mod.LLM("m", speculative_config=spec, **llm_kwargs)
    eng = Recording(llm.llm_engine)
    done, stats = serve_workload(eng, items, max_in_flight, lambda: metrics_to_dicts(llm.get_metrics()),
                                 [RUNNING])
    return eng, done, stats


def test_step_loop_arrivals_and_slots(fake):
    """Requests join at their arrival step while others decode, never more than max_in_flight
    unfinished; each gives its tokens alone; the gauge and the step loop see the batch."""
    prompts = [[3, 4, 5], [9, 1], [7, 7, 7, 7], [2, 8], [6, 5, 4, 3, 2], [1, 1]]
    items = items_of(fake, prompts, max_tokens=8, arrive=[0, 2, 4, 6, 8, 10])
    eng, done, stats = serve(fake, items, 3)
    assert [d["output"].outputs[0].token_ids for d in done] == [greedy(fake, p, 8) for p in prompts]
    assert max(eng.unfinished) == 3 == stats["max_unfinished"]
    assert [eng.added[f"speccheck-{i}"] for i in range(3)] == [0, 2, 4]  # on time while slots are free
    assert all(eng.added[f"speccheck-{i}"] >= 2 * i for i in range(6))
    assert stats["mixed_steps"] > 0 and stats["step_max"][RUNNING] == 3
    assert stats["requests_served"] == 6 and stats["steps"] == len(eng.unfinished)
    assert all("metrics_after" not in d for d in done)  # none was alone: no per-request counters


def test_step_loop_runs_turns_after_their_predecessor(fake):
    """A turn is added only once the request it follows has finished; with nothing in flight
    the arrival clock jumps ahead instead of stepping an idle engine."""
    prompts = [[3, 4, 5], [3, 4, 5, 9], [8, 8], [3, 4, 5, 9, 9]]
    items = items_of(fake, prompts, after=[None, "r0", None, "r1"], arrive=[0, 0, 50, 0])
    eng, done, stats = serve(fake, items, 1)
    order = sorted(eng.added, key=lambda k: (eng.added[k], k))
    assert order == ["speccheck-0", "speccheck-1", "speccheck-3", "speccheck-2"]
    assert max(eng.unfinished) == 1 and stats["mixed_steps"] == 0
    assert stats["steps"] == 4 * 6  # one step per token, none idle
    assert all(d["metrics_after"] is not None for d in done)  # each alone in flight


def test_step_loop_maps_ids_vllm_suffixed(fake, monkeypatch):
    """Newer vLLM appends a suffix to the request ids it reports; outputs still reach their
    request."""
    monkeypatch.setenv("FAKE_VLLM_ID_SUFFIX", "a1b2c3d4")
    prompts = [[3, 4, 5], [9, 1]]
    _, done, _ = serve(fake, items_of(fake, prompts), None)
    assert [d["output"].request_id for d in done] == ["speccheck-0-a1b2c3d4", "speccheck-1-a1b2c3d4"]
    assert [d["output"].outputs[0].token_ids for d in done] == [greedy(fake, p, 6) for p in prompts]


def test_step_loop_refuses_turns_waiting_on_each_other(fake):
    with pytest.raises(UsageProblem, match="wait on each other"):
        serve(fake, items_of(fake, [[1, 2], [3, 4]], after=["r1", "r0"]), None)


def test_step_loop_gives_up_on_a_request_that_never_fits(fake, monkeypatch):
    """A KV budget smaller than one request needs: vLLM would keep it waiting forever."""
    monkeypatch.setattr(vllm_worker, "STALL_STEPS", 50)
    with pytest.raises(RuntimeError, match="no output in 50 steps.*KV block budget"):
        serve(fake, items_of(fake, [list(range(1, 41))]), None, num_gpu_blocks_override=1)


# ---------------------------------------------------------------- VllmEngine.run_workload

def corpus_inputs(eng: VllmEngine, config: SpecConfig, corpus: str = "smoke"):
    """A corpus as the engine tokenises it, and the config's outputs of it one at a time."""
    c = load_corpus(corpus)
    inputs = {p.id: np.array(eng.tokenize(p)) for p in c.prompts}
    alone = eng.generate(list(c.prompts), [inputs[p.id].tolist() for p in c.prompts], config, 5)
    return c, inputs, {a.prompt_id: a.token_ids for a in alone}, {a.prompt_id: a for a in alone}


def check_outputs(result, workload, alone):
    """One completion per request, named by it, each the prompt's tokens alone (the fake's
    model is the same in every batch) up to its budget."""
    assert [c.prompt_id for c in result.completions] == [r.id for r in workload.requests]
    for c, r in zip(result.completions, workload.requests):
        want = alone.get(r.id.rsplit(":", 1)[-1])
        if want is not None and list(r.prompt_ids) == want.prompt_ids.tolist():
            n = min(want.n_tokens, c.n_tokens)
            assert c.token_ids[:n].tolist() == want.token_ids[:n].tolist(), r.id
        assert (c.topk_ids[:, 0] == c.token_ids).all()


@pytest.mark.slow
@pytest.mark.parametrize("config", [SpecConfig(), SpecConfig("mtp", 3)], ids=lambda c: c.name)
def test_serving_axes_through_run_workload(fake_vllm, config):  # noqa: F811
    """concurrency, prefix_cache and kv_pressure built by their axes from the smoke corpus and
    served by the worker's step loop with the fake vLLM (test double): each level proves
    itself from vLLM's counters and gauge, and every request gives its tokens alone."""
    target, draft = fake_vllm
    if not (target / "tokenizer.json").is_file():
        pytest.skip("reference tokenizer not shipped yet")
    eng = VllmEngine(model=str(target), draft=str(draft), engine_args={"worker": "per-config"})
    try:
        corpus, inputs, outputs, alone = corpus_inputs(eng, config)
        proofs = {}
        for axis, level in (("concurrency", "4"), ("prefix_cache", "cold"), ("prefix_cache", "hit"),
                            ("kv_pressure", "free")):
            wl = get_axis(axis).build(AxisInput(corpus, inputs, config, level, (3,), outputs,
                                                block_size=eng.cache_block_size()))
            result = eng.run_workload(wl, config, 5)
            check_outputs(result, wl, alone)
            proofs[axis, level] = result.proof
            if axis == "prefix_cache":  # one at a time: every request alone, counters its own
                assert all((c.spec is not None) == (not config.is_baseline) for c in result.completions)
            if axis == "concurrency":
                assert any(c.spec is None for c in result.completions)  # shared in flight
    finally:
        eng.close()
    conc = proofs["concurrency", "4"]
    assert conc["max_batch"] == 4 and conc["max_batch_from"] == RUNNING
    assert conc["mixed_steps"] > 0 and conc["requests_served"] == 8
    assert proofs["prefix_cache", "hit"]["prefix_hits"] > 0
    assert proofs["prefix_cache", "cold"]["prefix_hits"] == 0  # the counter is there, and did not move
    assert proofs["kv_pressure", "free"]["preemptions"] == 0
    for proof in proofs.values():
        assert ("drafts" in proof) == (not config.is_baseline)
        if not config.is_baseline:
            assert proof["drafts"] > 0 and proof["accepted_tokens"] > 0


def pressure_workload(n_tokens: int = 24, blocks: int = 8) -> Workload:
    """Four requests in flight whose KV needs outgrow ``blocks`` blocks of 16 tokens."""
    reqs = [Request(f"kv:p{i}", Prompt(f"p{i}", "x", n_tokens, text="a", ignore_eos=True),
                    tuple(range(10 + i, 30 + i))) for i in range(4)]
    return Workload("kv_pressure", "pressure", reqs, max_in_flight=4, knobs={"kv_blocks": str(blocks)})


def test_kv_pressure_preempts_and_reads_back_the_block_size(fake_vllm, monkeypatch):  # noqa: F811
    """kv_blocks becomes num_gpu_blocks_override: the fake (test double) preempts, and the
    proof counts it; the block size the axes size their budgets in is the one vLLM resolved
    (the fake resolves 32, as a hybrid model's attention blocks grow)."""
    target, _ = fake_vllm
    monkeypatch.setenv("FAKE_VLLM_BLOCK_SIZE", "16")
    eng = VllmEngine(model=str(target))
    try:
        assert eng.cache_block_size() == 16
        wl = pressure_workload()
        result = eng.run_workload(wl, SpecConfig(), 5)
        assert result.proof["preemptions"] > 0 and result.proof["requests_served"] == 4
        free = eng.run_workload(Workload("kv_pressure", "free", wl.requests, max_in_flight=4), SpecConfig(), 5)
        assert free.proof["preemptions"] == 0
        for a, b in zip(result.completions, free.completions):
            assert a.token_ids.tolist() == b.token_ids.tolist() and a.n_tokens == 24
        monkeypatch.setenv("FAKE_VLLM_BLOCK_SIZE", "32")
        eng.run_workload(Workload("kv_pressure", "free", wl.requests[:1]), SpecConfig(), 5)
        assert eng.cache_block_size() == 32
    finally:
        eng.close()
    assert VllmEngine(model=str(target), engine_args={"block_size": "8"}).cache_block_size() == 8


def test_proof_keys_absent_where_the_fake_vllm_has_no_counter(fake_vllm, monkeypatch):  # noqa: F811
    """The fake vLLM (test double) told to report no preemption, prefix-hit or running-gauge
    metric: those proof keys are absent (not 0), and max_batch falls back to the unfinished
    requests vLLM counts."""
    target, _ = fake_vllm
    monkeypatch.setenv("FAKE_VLLM_HIDE_METRICS", f"vllm:num_preemptions,vllm:prefix_cache_hits,{RUNNING}")
    eng = VllmEngine(model=str(target))
    try:
        proof = eng.run_workload(pressure_workload(), SpecConfig(), 5).proof
    finally:
        eng.close()
    assert "preemptions" not in proof and "prefix_hits" not in proof
    assert proof["max_batch_from"] == "unfinished requests" and proof["max_batch"] == 4


@pytest.mark.parametrize("axis", ["long_lived", "swap"])
def test_an_axis_the_engine_lacks_is_refused_before_any_worker(dirs, axis):  # noqa: F811
    eng = VllmEngine(model=str(dirs[0]))
    wl = Workload(axis, "k", [Request("a:p", Prompt("p", "x", 4, text="a"), (1, 2))])
    with pytest.raises(EngineUsageError, match=f"cannot run the {axis} workload axis"):
        eng.run_workload(wl, SpecConfig(), 5)
    assert eng._worker is None and eng._tmp_dir is None
    assert eng.axes == frozenset({"concurrency", "prefix_cache", "kv_pressure", "async_scheduling",
                                  "chat_thinking", "shapes"})


@pytest.mark.parametrize("workload,match", [
    (Workload("kv_pressure", "pressure", [Request("a:p", Prompt("p", "x", 4, text="a"), (1, 2))],
              knobs={"kv_blocks": "none"}), "kv_blocks=none"),
    (Workload("prefix_cache", "hit", [Request("a:p", Prompt("p", "x", 4, text="a"), (1, 2))],
              knobs={"prefix_cache": "on", "cpu_offload": "1"}), "cpu_offload"),
    (Workload("prefix_cache", "hit", [Request("a:p", Prompt("p", "x", 4, text="a"), (1, 2), after="b:p")]),
     "after ones it lacks: b:p"),
    (Workload("concurrency", "2", [Request("a:p", Prompt("p", "x", 4, text="a"), (1, 2))] * 2),
     "names requests twice: a:p"),
    (Workload("chat_thinking", "on", [Request("a:p", Prompt("p", "x", 4, text="a"), (1, 2))],
              knobs={"chat_template": "on", "thinking": "on"}), "has none"),
    (Workload("chat_thinking", "on", [Request("a:p", Prompt("p", "x", 4, text="a"), (1, 2))],
              knobs={"thinking": "on"}), "without chat_template=on"),
])
def test_bad_workloads_are_refused_before_any_worker(dirs, workload, match):  # noqa: F811
    eng = VllmEngine(model=str(dirs[0]))
    with pytest.raises(EngineUsageError, match=match):
        eng.run_workload(workload, SpecConfig(), 5)
    assert eng._worker is None


def test_a_workload_that_does_not_speculate_fails(fake_vllm):  # noqa: F811
    """The fake vLLM (test double) drafts nothing for ngram: a spec config's workload that
    only repeats the baseline is an engine error, not a pass."""
    target, _ = fake_vllm
    eng = VllmEngine(model=str(target))
    try:
        with pytest.raises(EngineError, match="did not speculate over the workload"):
            eng.run_workload(pressure_workload(blocks=100), SpecConfig("ngram", 2), 5)
    finally:
        eng.close()


# ---------------------------------------------------------------- speccheck run and gate

CORPUS = [  # four prompts of 27 to 36 tokens (reference tokenizer), 32 tokens each
    "Write a Python function that returns the sum of the squares of a list of integers, with a docstring.",
    "Explain in two short paragraphs why the sky looks blue during the day and red at sunset.",
    "List five common uses of a hash map in everyday programming, one per line, with an example each.",
    "Translate the following sentence into French and German: the train leaves at nine tomorrow morning.",
]


@pytest.mark.slow
def test_cli_runs_and_gates_the_serving_axes_with_fake_vllm(fake_vllm, tmp_path):  # noqa: F811
    """`speccheck run --engine vllm --axes concurrency=4,prefix_cache,kv_pressure` with the fake
    vLLM (test double) stores every axis level of the baseline and mtp-k3 with its proof, and
    `speccheck gate` judges them: each level exercised, every request as alone. (A corpus of
    prompts alike in length: the kv_pressure budget, half of what they need at their longest,
    then lets all four in and preempts as they grow.)"""
    from click.testing import CliRunner

    from speccheck.cli import main
    from speccheck.store import Store

    target, draft = fake_vllm
    if not (target / "tokenizer.json").is_file():
        pytest.skip("reference tokenizer not shipped yet")
    corpus = tmp_path / "alike.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"p{i}", "category": "x", "max_tokens": 32, "text": t,
                                          "ignore_eos": True}) + "\n" for i, t in enumerate(CORPUS)))
    store = str(tmp_path / "store")
    runner = CliRunner()
    res = runner.invoke(main, ["run", "--engine", "vllm", "--model", str(target), "--draft", str(draft),
                               "--config", "mtp-k3", "--corpus", str(corpus), "--repeats", "2",
                               "--concurrent", "off", "--no-attribution", "--store", store,
                               "--engine-arg", "worker=per-config",
                               "--axes", "concurrency=4,prefix_cache,kv_pressure"])
    assert res.exit_code == 0, res.output
    suite = Store(store).latest()
    for config in ("baseline", "mtp-k3"):
        assert suite.axis_slots(config) == sorted(
            ["axis-concurrency-4", "axis-kv_pressure-free", "axis-kv_pressure-pressure",
             "axis-prefix_cache-cold", "axis-prefix_cache-hit"])
        runs = {s: suite.load_axis(config, s) for s in suite.axis_slots(config)}
        assert all(r.status == "ok" for r in runs.values()), {s: r.error for s, r in runs.items()}
        assert runs["axis-concurrency-4"].proof["max_batch"] == 4
        assert runs["axis-concurrency-4"].proof["mixed_steps"] > 0
        assert runs["axis-prefix_cache-hit"].proof["prefix_hits"] > 0
        assert runs["axis-kv_pressure-pressure"].proof["preemptions"] > 0
        for run in runs.values():  # one per request, named by it (ids end in :<prompt id>)
            assert run.completions and all(c.prompt_id.rsplit(":", 1)[-1] in {"p0", "p1", "p2", "p3"}
                                           for c in run.completions)
    res = runner.invoke(main, ["gate", "--store", store])
    assert res.exit_code == 0, res.output
    judged = evaluate_suite(Store(store).latest(), Policy(), ["baseline", "mtp-k3"])
    for config in ("baseline", "mtp-k3"):
        for name, levels in (("axis_concurrency", ["concurrency (4)"]),
                             ("axis_prefix_cache", ["prefix_cache (cold)", "prefix_cache (hit)"]),
                             ("axis_kv_pressure", ["kv_pressure (free)", "kv_pressure (pressure)"])):
            c = judged.get(config).check(name)
            assert c.passed and not c.skipped, c.message
            assert all(f"axis {lv}: " in c.message for lv in levels), c.message


@pytest.mark.slow
def test_cli_gate_fails_a_level_whose_proof_vllm_does_not_report(fake_vllm, tmp_path, monkeypatch):  # noqa: F811
    """The same with the fake vLLM (test double) reporting no preemption counter: the
    pressure level's proof is absent, and the gate fails the axis naming it."""
    from click.testing import CliRunner

    from speccheck.cli import main

    target, _ = fake_vllm
    if not (target / "tokenizer.json").is_file():
        pytest.skip("reference tokenizer not shipped yet")
    monkeypatch.setenv("FAKE_VLLM_HIDE_METRICS", "vllm:num_preemptions")
    corpus = tmp_path / "alike.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"p{i}", "category": "x", "max_tokens": 32, "text": t,
                                          "ignore_eos": True}) + "\n" for i, t in enumerate(CORPUS)))
    store = str(tmp_path / "store")
    runner = CliRunner()
    res = runner.invoke(main, ["run", "--engine", "vllm", "--model", str(target), "--config", "baseline",
                               "--corpus", str(corpus), "--repeats", "2", "--concurrent", "off",
                               "--no-attribution", "--store", store, "--engine-arg", "worker=per-config",
                               "--axes", "kv_pressure"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(main, ["gate", "--store", store])
    assert res.exit_code == 1, res.output
    assert "kv_pressure (pressure) was not exercised: preemptions = not read back" in res.output


def test_proof_reads_async_scheduling_and_chat_rendering_back():
    stats = {"requests_served": 6, "steps": 9, "mixed_steps": 0, "async_scheduling": True,
             "steps_scheduled_ahead": 8, "chat_rendered": 6, "thinking_prompts": 6}
    proof = workload_proof(stats, "0.26.0")
    assert (proof["async_scheduling"], proof["steps_scheduled_ahead"]) == (1, 8)
    assert (proof["chat_rendered"], proof["thinking_prompts"]) == (6, 6)
    off = workload_proof({**stats, "async_scheduling": False, "steps_scheduled_ahead": None}, "0.26.0")
    assert off["async_scheduling"] == 0 and "steps_scheduled_ahead" not in off
    bare = workload_proof({"requests_served": 1, "steps": 1, "mixed_steps": 0}, "0.26.0")
    assert not {"async_scheduling", "steps_scheduled_ahead", "chat_rendered"} & set(bare)


def test_chat_rendering_as_llm_chat_does(fake):
    """enable_thinking goes to the template; a Qwen3-style template closes an empty think block
    with it off, so the two renderings differ: thinking mode rendered."""
    from speccheck.engines.base import rendered_thinking
    from speccheck.engines.vllm_worker import render_chat

    tok = fake.LLM("m").get_tokenizer()
    msgs = [{"role": "user", "content": "hi"}]
    ids_on, on, off = render_chat(tok, msgs, True)
    assert on.endswith("assistant\n") and off.endswith("</think>\n\n")
    assert ids_on == tok.encode(on, add_special_tokens=False) and rendered_thinking(on, off)
    _, off_text, flipped = render_chat(tok, msgs, False)
    assert off_text == off and flipped == on


@pytest.mark.slow
@pytest.mark.parametrize("config", [SpecConfig(), SpecConfig("mtp", 3)], ids=lambda c: c.name)
def test_async_and_chat_axes_through_run_workload(fake_vllm, config, monkeypatch):  # noqa: F811
    """async_scheduling and chat_thinking built by their axes and served by the worker with the
    fake vLLM (test double): async on is read back (scheduler_config and the engine core's
    batch queue), the chat prompts are rendered by the model's tokenizer with enable_thinking;
    a vLLM that turns async scheduling off for speculation, or a template without the
    switch, leaves the level unproven (proof 0: not exercised)."""
    target, draft = fake_vllm
    if not (target / "tokenizer.json").is_file():
        pytest.skip("reference tokenizer not shipped yet")
    eng = VllmEngine(model=str(target), draft=str(draft), engine_args={"worker": "per-config"})
    try:
        corpus, inputs, outputs, alone = corpus_inputs(eng, config)

        def run(axis, level):
            wl = get_axis(axis).build(AxisInput(corpus, inputs, config, level, (3,), outputs,
                                                block_size=eng.cache_block_size()))
            return wl, eng.run_workload(wl, config, 5)

        wl, on = run("async_scheduling", "on")
        check_outputs(on, wl, alone)
        assert on.proof["async_scheduling"] == 1 and on.proof["steps_scheduled_ahead"] > 0
        _, off = run("async_scheduling", "off")
        assert off.proof["async_scheduling"] == 0 and "steps_scheduled_ahead" not in off.proof
        for level in ("off", "on"):
            wl, res = run("chat_thinking", level)
            assert res.proof["chat_rendered"] == len(wl.requests)
            assert res.proof["thinking_prompts"] == (len(wl.requests) if level == "on" else 0)
            for r, c in zip(wl.requests, res.completions):
                assert c.prompt_ids.tolist() != list(r.prompt_ids)  # rendered, not the corpus ids
        monkeypatch.setenv("FAKE_VLLM_CHAT_IGNORES_THINKING", "1")
        eng.close()
        _, res = run("chat_thinking", "on")
        assert res.proof["thinking_prompts"] == 0
        if not config.is_baseline:
            monkeypatch.setenv("FAKE_VLLM_ASYNC_SPEC", "disable")
            eng.close()
            _, res = run("async_scheduling", "on")
            assert res.proof["async_scheduling"] == 0 and "steps_scheduled_ahead" not in res.proof
            monkeypatch.setenv("FAKE_VLLM_ASYNC_SPEC", "refuse")
            eng.close()
            with pytest.raises(EngineError, match="not supported with async scheduling"):
                run("async_scheduling", "on")
    finally:
        eng.close()


# ---------------------------------------------------------------- CUDA-graph sizes and preemptions

def test_capture_sizes_predicted_from_the_engine_args(dirs):  # noqa: F811
    """Before a worker has read them back: vLLM's default rule (1 + K tokens a request), the
    user's own sizes rounded to multiples of 1 + K, none when eager."""
    eng = VllmEngine(model=str(dirs[0]))
    assert eng.capture_sizes(SpecConfig())[:6] == (1, 2, 4, 8, 16, 24)
    assert eng.capture_sizes(SpecConfig("mtp", 3))[:5] == (4, 8, 16, 24, 32)
    own = VllmEngine(model=str(dirs[0]), engine_args={"compilation_config": '{"cudagraph_capture_sizes": [1, 2, 5, 8]}'})
    assert own.capture_sizes(SpecConfig("mtp", 3)) == (4, 8)
    assert VllmEngine(model=str(dirs[0]), engine_args={"enforce_eager": "true"}).capture_sizes(SpecConfig()) == ()
    eng._runtime = {"cudagraph_capture_sizes": [2, 4], "num_speculative_tokens": 1}
    assert eng.capture_sizes(SpecConfig("mtp", 1)) == (2, 4)  # read back for this K
    assert eng.capture_sizes(SpecConfig("mtp", 3))[:2] == (4, 8)  # another K: predicted


@pytest.mark.slow
@pytest.mark.parametrize("config", [SpecConfig(), SpecConfig("mtp", 3)], ids=lambda c: c.name)
def test_batch_level_through_run_workload(fake_vllm, config):  # noqa: F811
    """The shapes axis's batch level with the fake vLLM (test double, vLLM 0.26's default
    capture sizes): each batch of capture size ± 1 requests was scheduled, read from the
    engine core's step outputs, the steps past a size padded up to the next (cudagraph_metrics),
    and every request gives its tokens alone; an eager engine reports no size and the check
    fails the level as not exercised."""
    from speccheck.axes.shapes import batch_targets

    target, draft = fake_vllm
    if not (target / "tokenizer.json").is_file():
        pytest.skip("reference tokenizer not shipped yet")
    for eager in (False, True):
        eng = VllmEngine(model=str(target), draft=str(draft),
                         engine_args={"worker": "per-config", **({"enforce_eager": "true"} if eager else {})})
        try:
            corpus, inputs, outputs, alone = corpus_inputs(eng, config)
            sizes = eng.capture_sizes(config)
            wl = get_axis("shapes").build(AxisInput(corpus, inputs, config, "batch", (3,), outputs,
                                                    capture_sizes=sizes))
            result = eng.run_workload(wl, config, 5)
        finally:
            eng.close()
        p = result.proof
        if eager:  # no size to pad to, no step on a graph: axis_shapes fails it (tests/axes)
            assert sizes == () and p["capture_sizes"] == [] and p["graph_steps"] == 0
            assert p["eager_steps"] == p["steps"]
            continue
        check_outputs(result, wl, alone)
        q = 1 if config.is_baseline else 4
        assert p["tokens_per_request"] == q and tuple(p["capture_sizes"]) == sizes
        assert set(batch_targets(sizes, q)) <= set(p["batch_sizes"])
        assert p["padded_steps"] > 0 and p["graph_steps"] > p["padded_steps"]


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.28.0", "0.33.0"])
def test_preempted_requests_named_by_vllm(fake_vllm, monkeypatch, version):  # noqa: F811
    """Under a KV budget the fake vLLM (test double) preempts: the proof names the preempted
    requests from the engine core's PREEMPTED events (every version) and, as of vLLM 0.33,
    their RequestOutput.metrics; 0.33 also gives each request its own spec counters (a
    histogram of accepted drafts per step), so requests that shared their steps are judged one
    by one; before 0.33 only requests alone in flight have counters."""
    monkeypatch.setenv("FAKE_VLLM_VERSION", version)
    target, draft = fake_vllm
    eng = VllmEngine(model=str(target), draft=str(draft))
    try:  # a repeat first, as `speccheck run` runs them: the worker then says which vLLM it is
        eng.generate([Prompt("a", "x", 4, text="a")], [[1, 2, 3]], SpecConfig("mtp", 3), 5)
        result = eng.run_workload(pressure_workload(), SpecConfig("mtp", 3), 5)
    finally:
        eng.close()
    p = result.proof
    assert p["preemptions"] > 0 and p["preempted_requests"]
    assert set(p["preempted_requests"]) <= {r.id for r in pressure_workload().requests}
    if version == "0.33.0":
        assert "RequestOutput.metrics" in p["preempted_from"]
        assert all(c.spec is not None and c.spec.drafts > 0 for c in result.completions)
        for c in result.completions:  # the fake accepts every draft the budget leaves room for
            s = c.spec
            assert s.draft_tokens == 3 * s.drafts and s.accepted_tokens == sum(s.accepted_per_pos)
            assert s.accepted_per_pos[0] == s.drafts >= s.accepted_per_pos[-1] >= s.drafts - 1
    else:
        assert p["preempted_from"] == "engine core events (PREEMPTED)"
        assert all(c.spec is None for c in result.completions)  # in flight together: shared counters
