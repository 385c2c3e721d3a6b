"""Every workload-axis proof the vllm engine reports, read from vLLM's own statistics as each
recorded release (0.26.0, 0.27.1, 0.28.0, 0.33.0; tests/fixtures/vllm/versions/, recorded from
vLLM's source by scripts/record_vllm_facts.py) shapes them: ``LLM.get_metrics()``'s objects
(the Counter/Gauge/Vector/Histogram dataclasses of vllm/v1/metrics/reader.py, of the metrics the
Prometheus loggers register, with their labels), the engine core's step outputs
(EngineCoreOutputs, EngineCoreOutput, EngineCoreEvent, SchedulerStats, CUDAGraphStat), a
RequestOutput's RequestStateStats and per-request spec-decode counters, and the Prometheus
text a server's /metrics shows. The objects are test doubles built from the recorded names;
no vLLM is imported."""
from __future__ import annotations

import dataclasses
import enum
from types import SimpleNamespace

import pytest

from speccheck.engines.openai import parse_metrics
from speccheck.engines.vllm import (
    completion_from_dict,
    metric_names,
    spec_counters_delta,
    workload_proof,
)
from speccheck.engines.vllm_versions import release_entry
from speccheck.engines.vllm_worker import (
    _gauge,
    metrics_to_dicts,
    request_output_to_dict,
    serve_workload,
)
from speccheck.types import SpecCounters
from tests.engines.test_vllm_versions import VERSIONS, facts


def classes(fields: dict[str, list[str] | None]) -> dict[str, type]:
    """Dataclasses of the recorded names and fields (every field defaulting to None)."""
    return {name: dataclasses.make_dataclass(name, [(f, object, None) for f in fs or []])
            for name, fs in fields.items()}


# ---------------------------------------------------------------- LLM.get_metrics()

#: the counters of a served workload (after minus before) and the running gauge's peak
MOVED = {"vllm:prefix_cache_queries": 656, "vllm:prefix_cache_hits": 320, "vllm:num_preemptions": 2,
         "vllm:spec_decode_num_drafts": 10, "vllm:spec_decode_num_draft_tokens": 30,
         "vllm:spec_decode_num_accepted_tokens": 18, "vllm:request_success": 7,
         # distractors: never read as the cache's own hits or as preemptions
         "vllm:external_prefix_cache_hits": 999, "vllm:external_prefix_cache_queries": 999,
         "vllm:prompt_tokens_cached": 999}
PER_POS = [8, 6, 4]


def snapshot(version: str, after: bool, running: float = 0.0) -> list:
    """get_metrics() as this release gives it: one object per metric the Prometheus loggers
    register (its kind and labels as recorded), through the reader's own dataclasses."""
    f = facts(version)
    cls = classes(f["metrics_reader"])
    out = []
    for name, meta in f["prometheus_metrics"].items():
        labels = {lb: {"model_name": "m", "engine": "0"}.get(lb, "x")
                  for lb in meta["labels"] or ["model_name", "engine"] if lb != "position"}
        if name.endswith("_per_pos"):
            out.append(cls["Vector"](name=name, labels=labels, values=PER_POS if after else [0, 0, 0]))
        elif meta["kind"] == "counter":
            out.append(cls["Counter"](name=name, labels=labels, value=MOVED.get(name, 0) if after else 0))
        elif meta["kind"] == "gauge":
            value = running if name == "vllm:num_requests_running" else 0.0
            out.append(cls["Gauge"](name=name, labels=labels, value=value))
        else:
            out.append(cls["Histogram"](name=name, labels=labels, count=0, sum=0.0, buckets={"+Inf": 0}))
    return out


@pytest.mark.parametrize("version", VERSIONS)
def test_every_name_the_table_reads_is_a_metric_of_that_kind(version):
    """The version table's names are registered by that release's loggers, as the kind the
    adapter reads them as (a gauge sampled per step, counters differenced)."""
    reg = facts(version)["prometheus_metrics"]
    names = metric_names(version)
    assert reg[names["requests_running"]]["kind"] == "gauge"
    for key in ("prefix_cache_queries", "prefix_cache_hits", "preemptions", "drafts", "draft_tokens",
                "accepted_tokens", "accepted_per_pos"):
        assert reg[names[key]]["kind"] == "counter", key
    assert "position" in reg[names["accepted_per_pos"]]["labels"]
    assert set(facts(version)["metrics_reader"]) == {"Counter", "Gauge", "Vector", "Histogram"}


@pytest.mark.parametrize("version", VERSIONS)
def test_get_metrics_objects_become_each_axis_proof(version):
    """A workload's get_metrics() before and after, as this release's reader gives them (every
    registered metric, histograms and distractors included): prefix-cache hits and queries,
    preemptions, the running gauge's peak (sampled per step) and the spec counters."""
    before = metrics_to_dicts(snapshot(version, False))
    steps = [metrics_to_dicts(snapshot(version, True, running=r)) for r in (3.0, 5.0, 2.0)]
    running = metric_names(version)["requests_running"]
    stats = {"requests_served": 7, "steps": 3, "mixed_steps": 1, "metrics_before": before,
             "metrics_after": steps[-1], "step_max": {running: max(_gauge(s, running) for s in steps)}}
    proof = workload_proof(stats, version)
    assert proof == {"requests_served": 7, "steps": 3, "mixed_steps": 1, "max_batch": 5,
                     "max_batch_from": running, "prefix_hits": 320, "prefix_queries": 656,
                     "preemptions": 2}
    assert spec_counters_delta(before, steps[-1]) == SpecCounters(10, 30, 18, PER_POS)
    assert {r["type"] for r in before} <= {"counter", "gauge", "vector", "histogram"}


# ---------------------------------------------------------------- the engine core's step outputs

def core_classes(version: str) -> SimpleNamespace:
    f = facts(version)
    c = classes({"EngineCoreOutputs": f["engine_core_outputs_fields"],
                 "EngineCoreOutput": f["engine_core_output_fields"],
                 "EngineCoreEvent": f["engine_core_event_fields"],
                 "SchedulerStats": f["scheduler_stats_fields"],
                 "CUDAGraphStat": f["cudagraph_stat_fields"]})
    c["EngineCoreEventType"] = enum.IntEnum("EngineCoreEventType", f["engine_core_event_types"])
    return SimpleNamespace(**c)


class ScriptedEngine:
    """LLMEngine as serve_workload drives it, over an engine core whose get_output() hands out
    this release's EngineCoreOutputs: every request in flight makes one token a step (its
    prefill too), ``q`` tokens a request in a uniform step, padded up to the next of
    ``capture`` (mode NONE past the last); the request named ``preempt`` gets a PREEMPTED
    event on step 2 (its next output carries it)."""

    def __init__(self, version: str, capture: list[int], q: int, preempt: str | None = None):
        self.c, self.capture, self.q, self.preempt = core_classes(version), capture, q, preempt
        self.reqs: dict[str, list] = {}
        self.steps = 0
        self.engine_core = SimpleNamespace(get_output=self._core_step)
        self.last: list = []

    def add_request(self, rid, prompt, params):
        self.reqs[rid] = [params, 0]

    def get_num_unfinished_requests(self):
        return len(self.reqs)

    def _core_step(self):
        c, self.steps = self.c, self.steps + 1
        outs, ros = [], []
        for rid, st in list(self.reqs.items()):
            st[1] += 1
            events = None
            if rid == self.preempt and self.steps == 2:
                events = [c.EngineCoreEvent(type=c.EngineCoreEventType.PREEMPTED, timestamp=1.0)]
            outs.append(c.EngineCoreOutput(request_id=rid, new_token_ids=[5], events=events))
            done = st[1] >= st[0]
            ros.append(SimpleNamespace(request_id=rid, finished=done,
                                       outputs=[SimpleNamespace(token_ids=[5] * st[1])]))
            if done:
                del self.reqs[rid]
        n = len(outs)
        tokens = n * self.q
        padded = min((s for s in self.capture if s >= tokens), default=None)
        graph = c.CUDAGraphStat(num_unpadded_tokens=tokens, num_padded_tokens=padded or tokens,
                                num_paddings=(padded or tokens) - tokens,
                                runtime_mode="NONE" if padded is None else "FULL")
        stats = c.SchedulerStats(num_running_reqs=n, cudagraph_stats=graph)
        self.last = ros
        return c.EngineCoreOutputs(outputs=outs, scheduler_stats=stats)

    def step(self):
        self.engine_core.get_output()
        return self.last


@pytest.mark.parametrize("version", VERSIONS)
def test_step_outputs_become_the_batch_and_preemption_proof(version):
    """Batches of 3 and 5 requests of 4 tokens each (1 + K, K = 3) against captured sizes 4, 8,
    16 tokens: 3 requests (12 tokens) replay 16, padded; 5 (20) run past every graph; the
    running requests per step are the batch sizes; the preempted request is named from its
    event. The engine core's method is put back afterwards."""
    eng = ScriptedEngine(version, [4, 8, 16], 4, preempt="speccheck-1")
    items = [{"id": f"b3/{i}:p", "prompt": [1, 2], "params": 3, "arrive_after": 0} for i in range(3)]
    items += [{"id": f"b5/{i}:p", "prompt": [1, 2], "params": 3, "arrive_after": 10} for i in range(5)]
    original = eng.engine_core.get_output
    done, stats = serve_workload(eng, items, None, lambda: [],
                                 preempted_event=release_entry(version).preempted_event)
    assert eng.engine_core.get_output is original and len(done) == 8
    assert stats["step_tap"] and stats["preempted"] == {"b3/1:p": 1}
    proof = workload_proof({**stats, "capture_sizes": [4, 8, 16], "tokens_per_request": 4,
                            "cudagraph_mode": "FULL_AND_PIECEWISE"}, version)
    assert proof["batch_sizes"] == [3, 5] and proof["capture_sizes"] == [4, 8, 16]
    assert (proof["graph_steps"], proof["padded_steps"], proof["eager_steps"]) == (3, 3, 3)
    assert proof["preempted_requests"] == ["b3/1:p"]
    assert release_entry(version).preempted_event in facts(version)["engine_core_event_types"]
    rel = release_entry(version)
    assert rel.step_running_field in facts(version)["scheduler_stats_fields"]
    assert set(rel.cudagraph_stat_fields) <= set(facts(version)["cudagraph_stat_fields"])
    assert rel.cudagraph_metrics_arg in facts(version)["engine_args_observability"]


def test_no_step_output_read_leaves_the_batch_proof_unread():
    """An engine without engine_core.get_output: nothing tapped, no batch sizes or graph steps
    (the shapes axis's batch level then fails as not exercised)."""
    eng = ScriptedEngine("0.26.0", [4], 4)
    eng.engine_core = SimpleNamespace()
    eng.step = lambda: (eng._core_step(), eng.last)[1]
    _, stats = serve_workload(eng, [{"id": "a:p", "prompt": [1], "params": 2}], None, lambda: [])
    assert stats["step_tap"] is False and stats["step_running"] == [] and stats["step_graphs"] == []
    proof = workload_proof({**stats, "capture_sizes": [4], "tokens_per_request": 4}, "0.26.0")
    assert "graph_steps" not in proof and "batch_sizes" not in proof and "preempted_requests" not in proof


# ---------------------------------------------------------------- a RequestOutput's own statistics

@pytest.mark.parametrize("version", VERSIONS)
def test_request_output_gives_its_own_counters_and_preemptions_where_vllm_has_them(version):
    """vLLM 0.33's RequestStateStats counts the request's preemptions and its CompletionOutput
    carries the request's own spec-decode histogram (accepted drafts per verify step); before
    0.33 neither exists and a request that shared its steps has no counters of its own."""
    f, rel = facts(version), release_entry(version)
    lp = SimpleNamespace(logprob=-0.1, rank=1, decoded_token="x")
    own = None
    if f["request_spec_decode_metrics_fields"]:
        (metrics_cls,) = classes({"RequestSpecDecodeMetrics": f["request_spec_decode_metrics_fields"]}).values()
        own = metrics_cls(num_spec_tokens=3, histogram=[1, 0, 2, 3], num_draft_tokens=18)
    comp = SimpleNamespace(**{k: None for k in f["completion_output_fields"]})
    comp.__dict__.update(index=0, text="", token_ids=[5] * 21, logprobs=[{5: lp}] * 21, finish_reason="length",
                         **({"spec_decode_metrics": own} if "spec_decode_metrics" in f["completion_output_fields"] else {}))
    stats = SimpleNamespace(**{k: 0 for k in f["request_state_stats_fields"]})
    if rel.request_preemptions_field:
        setattr(stats, rel.request_preemptions_field, 2)
    out = SimpleNamespace(**{k: None for k in f["request_output_fields"]})
    out.__dict__.update(request_id="r", prompt_token_ids=[1], outputs=[comp], finished=True, metrics=stats)
    row = request_output_to_dict(out)
    c = completion_from_dict("p", {"output": row}, 1, spec=True)
    if version == "0.33.0":
        assert rel.request_preemptions_field == "num_preemptions" and row["metrics"]["num_preemptions"] == 2
        assert rel.per_request_spec_metrics_arg in f["engine_args_observability"]
        # 6 verify steps: 1 kept none, 2 kept two, 3 kept three
        assert c.spec == SpecCounters(6, 18, 13, [5, 5, 3])
    else:
        assert rel.request_preemptions_field is None and rel.per_request_spec_metrics_arg is None
        assert "num_preemptions" not in row["metrics"] and c.spec is None
        assert "per_request_spec_decode_metrics" not in f["engine_args_observability"]


# ---------------------------------------------------------------- a server's /metrics

@pytest.mark.parametrize("version", VERSIONS)
def test_prometheus_text_of_each_version_gives_the_server_counts(version):
    """/metrics as prometheus_client renders this release's registered metrics (counters with
    _total, the per-position counter one series per position): the spec counters and the
    server's finished requests the openai engine reads (its requests_served, the long_lived
    axis's proof on a server), whatever the extra labels."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    reg = CollectorRegistry()
    for name, meta in facts(version)["prometheus_metrics"].items():
        labels = meta["labels"] or ["model_name", "engine"]
        kind = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}[meta["kind"]]
        metric = kind(name, name, labels, registry=reg)
        values = {lb: {"model_name": "m", "engine": "0"}.get(lb, "stop") for lb in labels}
        if "position" in labels:
            for pos, n in enumerate(PER_POS):
                metric.labels(**{**values, "position": str(pos)}).inc(n)
        elif meta["kind"] == "counter":
            metric.labels(**values).inc(MOVED.get(name, 0))
        elif meta["kind"] == "gauge":
            metric.labels(**values).set(1)
        else:
            metric.labels(**values).observe(1)
    got = parse_metrics(generate_latest(reg).decode())
    assert got["spec"] == SpecCounters(10, 30, 18, PER_POS)
    assert got["requests"] == 7


# ---------------------------------------------------------------- what the worker reads off the LLM

@pytest.mark.parametrize("version", VERSIONS)
def test_the_engine_objects_each_proof_is_read_from_exist_in_that_version(version):
    """Where the worker reads async scheduling's proof (the in-process client's engine core's
    batch queue: a step planned before the last one's output was read), the step outputs (the
    client's get_output) and the capture sizes (compilation_config), built with this release's
    names: what it reads is what the engine holds."""
    from collections import deque

    from speccheck.engines.vllm_worker import batches_in_flight, graph_facts

    f = facts(version)
    assert f["inproc_client"] == {"attrs": ["engine_core"], "methods": ["get_output"]}
    assert f["engine_core_attrs"] == ["batch_queue"]
    core = SimpleNamespace(**{a: deque(["planned"]) for a in f["engine_core_attrs"]})
    client = SimpleNamespace(**{a: core for a in f["inproc_client"]["attrs"]})
    assert batches_in_flight(SimpleNamespace(engine_core=client)) == 1
    core.batch_queue = None  # synchronous scheduling keeps no queue
    assert batches_in_flight(SimpleNamespace(engine_core=client)) is None
    cc = SimpleNamespace(**{k: None for k in f["compilation_config_fields"]})
    cc.cudagraph_capture_sizes, cc.cudagraph_mode = [4, 8, 16], SimpleNamespace(name="FULL_AND_PIECEWISE")
    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(
        compilation_config=cc, speculative_config=SimpleNamespace(num_speculative_tokens=3))))
    assert graph_facts(llm) == {"capture_sizes": [4, 8, 16], "cudagraph_mode": "FULL_AND_PIECEWISE",
                                "tokens_per_request": 4}
