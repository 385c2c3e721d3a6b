"""The vllm engine without a GPU: conversion of vLLM's outputs and metrics, argument
parsing, the speculative_config mapping, the DFlash K hint, and worker failure handling.

Fixtures in tests/fixtures/vllm/ are plain JSON of what vLLM returned, captured on the H200
(vLLM 0.26.0, 2026-11-30) by the worker during `speccheck run --engine vllm` on the exported
reference checkpoint (scripts/capture_vllm_fixtures.py; ``"source": "captured"``): the smallest request of
the baseline, of MTP K=1/3/7 and DFlash K=7, and of a prompt_logprobs (score) call, each with
a ``get_metrics()`` dump. scripts/capture_vllm_fixtures.py --construct can rebuild stand-ins
of the same shape from vLLM's own Python classes where no GPU is at hand.
"""
from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from speccheck.engines.base import EngineError, EngineUsageError
from speccheck.engines.vllm import (
    VllmEngine,
    check_speculated,
    completion_from_dict,
    eos_token_ids,
    k_hint_note,
    parse_value,
    sample_groups,
    scored_from_dict,
    spec_counters_delta,
    speculative_config,
    split_engine_args,
)
from speccheck.engines.vllm_worker import metrics_to_dicts, request_output_to_dict
from speccheck.types import Completion, Prompt, SpecConfig, SpecCounters

FIX = Path(__file__).parents[1] / "fixtures" / "vllm"


def fixture(name: str) -> dict:
    return json.loads((FIX / name).read_text())


def spec_fixtures() -> list[str]:
    return sorted(p.name for p in FIX.glob("*_k*.json"))


# ---------------------------------------------------------------- outputs -> Completion

def test_baseline_output_becomes_completion_with_greedy_topk():
    fx = fixture("baseline.json")
    out = fx["row"]["output"]
    c = completion_from_dict("p0", fx["row"], fx["top_k"], spec=False)
    assert c.token_ids.tolist() == out["outputs"][0]["token_ids"]
    assert c.prompt_ids.tolist() == out["prompt_token_ids"]
    assert c.topk_ids.shape == (c.n_tokens, fx["top_k"])
    # temperature 0: every chosen token is the top-1 of its own position
    assert (c.topk_ids[:, 0] == c.token_ids).all()
    np.testing.assert_allclose(c.logprobs, c.topk_logprobs[:, 0], rtol=0, atol=1e-6)
    assert (np.diff(c.topk_logprobs, axis=1) <= 0).all(), "top-k must be sorted best first"
    assert c.spec is None
    m = out["metrics"]
    if m:
        assert c.ttft_s == pytest.approx(m["first_token_latency"])
        assert c.decode_s == pytest.approx(m["last_token_ts"] - m["first_token_ts"])


@pytest.mark.parametrize("name", spec_fixtures())
def test_spec_output_counters_are_consistent(name):
    fx = fixture(name)
    k = fx["speculative_config"]["num_speculative_tokens"]
    c = completion_from_dict("p0", fx["row"], fx["top_k"], spec=True)
    s = c.spec
    assert s is not None and s.drafts > 0
    assert s.draft_tokens == s.drafts * k
    assert len(s.accepted_per_pos) == k
    assert s.accepted_tokens == sum(s.accepted_per_pos)
    assert list(s.accepted_per_pos) == sorted(s.accepted_per_pos, reverse=True)
    # greedy: one token from prefill, then 1 + accepted per verify step (cut at max_tokens)
    assert c.n_tokens <= 1 + s.drafts + s.accepted_tokens
    assert (c.topk_ids[:, 0] == c.token_ids).all()


def test_samples_of_one_prompt_go_as_one_request_of_n():
    """Consecutive requests of one prompt with seeds s, s+1, ... are vLLM's n samples of one
    request seeded s; anything else (another prompt, budget or seed, a greedy run) stands alone."""
    ids = [[1, 2], [1, 2], [1, 2], [3], [3], [1, 2]]
    mt, ie = [8] * 6, [False] * 6
    assert sample_groups(ids, mt, ie, [10, 11, 12, 40, 41, 13]) == [(0, 3), (3, 2), (5, 1)]
    assert sample_groups(ids, mt, ie, [10, 11, 13, 40, 41, 13]) == [(0, 2), (2, 1), (3, 2), (5, 1)]
    assert sample_groups(ids, [8, 9, 8, 8, 8, 8], ie, [10, 11, 12, 40, 41, 13])[:2] == [(0, 1), (1, 1)]
    assert sample_groups(ids, mt, ie, None) == [(i, 1) for i in range(6)]


def test_first_sample_carries_the_shared_counters():
    """A row of n outputs: each becomes its own completion, only the first with counters."""
    fx = fixture(spec_fixtures()[0])
    row = copy.deepcopy(fx["row"])
    second = {**row["output"]["outputs"][0], "index": 1}
    row["output"]["outputs"].append(second)
    c0 = completion_from_dict("p", row, fx["top_k"], spec=True, index=0)
    c1 = completion_from_dict("p#s1", row, fx["top_k"], spec=False, index=1)
    assert c0.spec is not None and c1.spec is None
    assert c1.token_ids.tolist() == second["token_ids"]
    with pytest.raises(EngineError, match="index 2"):
        completion_from_dict("p#s2", row, fx["top_k"], spec=False, index=2)


def test_counter_delta_subtracts_before_and_sums_label_sets():
    after = fixture(spec_fixtures()[0])["row"]["metrics_after"]
    # a second engine (data parallel) reports the same names under other labels
    other = copy.deepcopy(after)
    for r in other:
        r["labels"] = {**r["labels"], "engine": "1"}
    two = spec_counters_delta([], after + other)
    one = spec_counters_delta([], after)
    assert two.drafts == 2 * one.drafts and two.accepted_tokens == 2 * one.accepted_tokens
    assert two.accepted_per_pos == [2 * x for x in one.accepted_per_pos]
    assert spec_counters_delta(after, after) == SpecCounters(0, 0, 0, [0] * len(one.accepted_per_pos))


def test_get_metrics_dump_has_the_spec_counters_vllm_names():
    names = {r["name"] for r in fixture(spec_fixtures()[0])["get_metrics"]}
    for n in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
              "vllm:spec_decode_num_accepted_tokens",
              "vllm:spec_decode_num_accepted_tokens_per_pos"):
        assert n in names


# ---------------------------------------------------------------- prompt logprobs -> Scored

def test_prompt_logprobs_become_scored_continuation():
    fx = fixture("prompt_logprobs.json")
    out = fx["row"]["output"]
    full, plp = out["prompt_token_ids"], out["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(full)
    p = len(full) // 2
    s = scored_from_dict(fx["row"], p, fx["top_k"])
    n = len(full) - p
    assert s.topk_ids.shape == (n, fx["top_k"]) and s.token_logprobs.shape == (n,)
    for i in range(n):
        entry = plp[p + i][str(full[p + i])]
        assert s.token_logprobs[i] == pytest.approx(entry["logprob"], abs=1e-6)
        # the forced token is in the top-k exactly when its rank is <= k
        assert (full[p + i] in s.topk_ids[i]) == (entry["rank"] <= fx["top_k"])
        assert s.token_logprobs[i] <= s.topk_logprobs[i, 0] + 1e-6


def test_short_prompt_logprobs_are_an_engine_error():
    row = copy.deepcopy(fixture("prompt_logprobs.json")["row"])
    row["output"]["prompt_logprobs"] = row["output"]["prompt_logprobs"][:-1]
    with pytest.raises(EngineError, match="prompt logprobs"):
        scored_from_dict(row, 2, 5)


# ---------------------------------------------------------------- worker-side converters

def test_request_output_to_dict_reads_vllm_shaped_objects():
    """Test double: SimpleNamespace objects with RequestOutput/CompletionOutput/Logprob's
    attribute names (vllm/outputs.py, vllm/logprobs.py), since vLLM is not installed here."""
    lp = lambda v, r: SimpleNamespace(logprob=v, rank=r, decoded_token=None)  # noqa: E731
    comp = SimpleNamespace(index=0, text="", token_ids=[7, 3], cumulative_logprob=None,
                           logprobs=[{7: lp(-0.1, 1), 3: lp(-2.5, 2)},
                                     {3: lp(-0.3, 1), 9: lp(-1.5, 2)}],
                           finish_reason="length", stop_reason=None)
    out = SimpleNamespace(request_id="0", prompt_token_ids=[1, 2], prompt_logprobs=None,
                          outputs=[comp], finished=True, metrics=None)
    d = request_output_to_dict(out)
    json.dumps(d)  # plain data only
    c = completion_from_dict("p", {"output": d, "wall_s": 0.5}, 2, spec=False)
    assert c.token_ids.tolist() == [7, 3]
    assert c.topk_ids.tolist() == [[7, 3], [3, 9]]
    assert c.decode_s == pytest.approx(0.5)


def test_metrics_to_dicts_keeps_kinds_and_filters_by_prefix():
    """Test double: stand-ins with the dataclass names of vllm/v1/metrics/reader.py."""
    Counter = type("Counter", (), {})
    Vector = type("Vector", (), {})
    c, v = Counter(), Vector()
    c.name, c.labels, c.value = "vllm:spec_decode_num_drafts", {"engine": "0"}, 4
    v.name, v.labels, v.values = "vllm:spec_decode_num_accepted_tokens_per_pos", {}, [3, 1]
    other = Counter()
    other.name, other.labels, other.value = "vllm:num_requests", {}, 1
    rows = metrics_to_dicts([c, v, other], "vllm:spec_decode_")
    assert [r["type"] for r in rows] == ["counter", "vector"]
    assert spec_counters_delta([], rows) == SpecCounters(4, 0, 0, [3, 1])


# ---------------------------------------------------------------- engine args

def test_parse_value_types():
    assert parse_value("4") == 4 and parse_value("0.5") == 0.5
    assert parse_value("true") is True and parse_value("False") is False
    assert parse_value('{"gdn_prefill_backend": "triton"}') == {"gdn_prefill_backend": "triton"}
    assert parse_value("TRITON_ATTN") == "TRITON_ATTN"


def test_split_engine_args_routes_each_kind():
    a = split_engine_args({
        "attention_backend": "TRITON_ATTN", "max_model_len": "4096",
        "additional_config": '{"gdn_prefill_backend": "triton"}',
        "env.VLLM_USE_FLASHINFER_SAMPLER": "0", "sampling.ignore_eos": "true",
        "spec.attention_backend": "FLASH_ATTN", "worker": "per-config", "enforce_eager": "1"})
    assert a["llm"] == {"attention_backend": "TRITON_ATTN", "max_model_len": 4096,
                        "additional_config": {"gdn_prefill_backend": "triton"},
                        "enforce_eager": 1}
    assert a["env"] == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    assert a["sampling"] == {"ignore_eos": True}
    assert a["spec"] == {"attention_backend": "FLASH_ATTN"}
    assert a["own"] == {"worker": "per-config"}


@pytest.mark.parametrize("bad", [{"speculative_config": "{}"}, {"worker": "sometimes"},
                                 {"env.": "1"}])
def test_bad_engine_args_are_usage_errors(bad):
    with pytest.raises(EngineUsageError):
        split_engine_args(bad)


# ---------------------------------------------------------------- speculative_config

def test_speculative_config_mapping():
    assert speculative_config(SpecConfig(), None, {}) is None
    assert speculative_config(SpecConfig("mtp", 3), "/d", {}) == {
        "method": "mtp", "num_speculative_tokens": 3}
    assert speculative_config(SpecConfig("dflash", 7), "/d", {"attention_backend": "TRITON_ATTN"}) == {
        "method": "dflash", "model": "/d", "num_speculative_tokens": 7,
        "attention_backend": "TRITON_ATTN"}
    assert speculative_config(SpecConfig("dflash", 7), "/d", {},
                              {"attention_backend": "FLASH_ATTN"})["attention_backend"] == "FLASH_ATTN"
    assert speculative_config(SpecConfig("eagle3", 4), "/e", {}) == {
        "method": "eagle3", "num_speculative_tokens": 4, "model": "/e"}
    assert speculative_config(SpecConfig("ngram", 2), None, {}, {"prompt_lookup_max": 4}) == {
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}
    with pytest.raises(EngineUsageError, match="--draft"):
        speculative_config(SpecConfig("dflash", 7), None, {})


# ---------------------------------------------------------------- K hint and engine setup

def write_json(path: Path, data: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(data))


@pytest.fixture
def dirs(tmp_path):
    target, draft = tmp_path / "target", tmp_path / "drafter"
    write_json(target, {"architectures": ["Qwen3_5ForConditionalGeneration"],
                        "text_config": {"eos_token_id": 2}})
    write_json(draft, {"architectures": ["DFlashDraftModel"],
                       "dflash_config": {"block_size": 8, "mask_token_id": 5,
                                         "target_layer_ids": [1, 3]}})
    return target, draft


def test_k_hint_reads_block_size(dirs):
    target, draft = dirs
    eng = VllmEngine(model=str(target), draft=str(draft))
    assert eng.default_k("dflash") == 7
    assert eng.default_k("mtp") is None
    assert k_hint_note(SpecConfig("dflash", 7), str(draft)) is None
    assert "block_size is 8" in k_hint_note(SpecConfig("dflash", 3), str(draft))
    assert VllmEngine(model=str(target)).default_k("dflash") is None


def test_engine_usage_errors(tmp_path, dirs):
    with pytest.raises(EngineUsageError, match="--model"):
        VllmEngine(model=None)
    with pytest.raises(EngineUsageError, match="config.json"):
        VllmEngine(model=str(tmp_path))
    with pytest.raises(EngineUsageError, match="--draft"):
        VllmEngine(model=str(dirs[0]), draft=str(tmp_path / "nowhere"))


def test_eos_ids_from_text_config(dirs):
    assert eos_token_ids(str(dirs[0])) == [2]


def test_identity_records_requested_knobs_and_env(dirs):
    eng = VllmEngine(model=str(dirs[0]), engine_args={
        "attention_backend": "TRITON_ATTN", "additional_config": '{"gdn_prefill_backend": "triton"}',
        "env.VLLM_USE_FLASHINFER_SAMPLER": "0"})
    ident = eng.identity()
    assert ident["engine"] == "vllm"
    # asked for, not yet read back: what ran stays unknown until a worker answers
    assert ident["attention_backend_requested"] == "TRITON_ATTN"
    assert ident["gdn_prefill_backend_requested"] == "triton"
    assert ident["attention_backend"] is None and ident["gdn_prefill_backend"] is None
    assert ident["kernels_read_back"] is False
    assert ident["env"]["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert ident["kernel_knobs"]["VLLM_USE_FLASHINFER_SAMPLER"] == "0"


def test_zero_drafts_is_flagged():
    def comp(drafts):
        return Completion("p", [1], [5, 6, 7], [0, 0, 0], [[5], [6], [7]], [[0], [0], [0]],
                          spec=SpecCounters(drafts, 3 * drafts, drafts, [drafts, 0, 0]))
    check_speculated(SpecConfig("mtp", 3), [comp(2), comp(0)])
    with pytest.raises(EngineError, match="did not speculate"):
        check_speculated(SpecConfig("mtp", 3), [comp(0), comp(0)])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                    reason="checks the failure path of a worker that cannot import vLLM")
def test_worker_crash_is_an_engine_error_with_log_tail(dirs):
    eng = VllmEngine(model=str(dirs[0]), engine_args={"warmup": "false"})
    try:
        with pytest.raises(EngineError, match="vllm"):
            eng.generate([Prompt("a", "x", 4, text="hi")], [[1, 2]], SpecConfig(), 5)
        assert eng.last_call_fresh_process
    finally:
        eng.close()


# ---------------------------------------------------------------- real vLLM (GPU box)

@pytest.mark.gpu
def test_vllm_end_to_end_on_gpu():
    """Needs vLLM, CUDA and SPECCHECK_VLLM_MODEL (an exported target with mtp.* weights)."""
    import os
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = os.environ.get("SPECCHECK_VLLM_MODEL")
    if not model:
        pytest.skip("set SPECCHECK_VLLM_MODEL to an exported target checkpoint")
    args = {"attention_backend": "TRITON_ATTN", "enforce_eager": "true",
            "additional_config": '{"gdn_prefill_backend": "triton"}',
            "env.VLLM_USE_FLASHINFER_SAMPLER": "0", "gpu_memory_utilization": "0.3"}
    eng = VllmEngine(model=model, engine_args=args)
    try:
        prompts = [Prompt("a", "code", 16, text="def add(a, b):\n")]
        ids = [eng.tokenize(p) for p in prompts]
        base = eng.generate(prompts, ids, SpecConfig(), 5)
        mtp = eng.generate(prompts, ids, SpecConfig("mtp", 3), 5)
        assert base[0].n_tokens > 0 and mtp[0].spec.drafts > 0
        scored = eng.score(ids, [base[0].token_ids.tolist()], 5)
        assert (scored[0].topk_ids[:, 0] == base[0].token_ids).mean() > 0.9
    finally:
        eng.close()


# ---------------------------------------------------------------- the worker protocol, fake vLLM

FAKE_VLLM = '''
"""Test double: a fake ``vllm`` package with the attribute shapes of LLM, SamplingParams,
RequestOutput, CompletionOutput, Logprob and the metrics reader's Counter/Gauge/Vector, and
an ``llm_engine`` with the step loop of vLLM's LLMEngine (FakeEngine). Its "model" is
arithmetic: logit(t | ids) = -((t - 7 * len(ids) - sum(ids)) % V) / 3."""
import math
import os
from types import SimpleNamespace

# FAKE_VLLM_VERSION=0.33.0: per-request preemption counts and spec-decode counters, as 0.33 has
__version__ = os.environ.get("FAKE_VLLM_VERSION", "0.28.0+fake")
V = 50
NEW = tuple(int(x) for x in __version__.split("+")[0].split(".")[:2]) >= (0, 33)


def capture_sizes(max_num_seqs, q, eager):
    """vLLM 0.26's default CUDA-graph sizes in tokens (1 + K a request), none when eager."""
    if eager:
        return []
    top = min(max_num_seqs * q * 2, 512)
    base = [s for s in [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, top + 1, 16)) if s <= top]
    return sorted({-(-s // q) * q for s in base if -(-s // q) * q <= top})


class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=16, logprobs=None, prompt_logprobs=None,
                 detokenize=True, stop_token_ids=None, ignore_eos=False, output_kind=None,
                 top_p=1.0, top_k=0, seed=None, n=1):
        self.__dict__.update(locals())


def draw(ids, sp, rng, temperature):
    """A sampled token as vLLM's sampler draws it: temperature, top-k, then top-p over the
    renormalised survivors."""
    w = [(t, math.exp(lp / temperature)) for t, lp in dist(ids)]
    if sp.top_k and sp.top_k > 0:
        w = w[:sp.top_k]
    z, keep, before = sum(x for _, x in w), [], 0.0
    for t, x in w:
        if sp.top_p < 1 and before >= sp.top_p * z:
            break
        keep.append((t, x))
        before += x
    u = rng.random() * sum(x for _, x in keep)
    for t, x in keep:
        u -= x
        if u < 0:
            return t
    return keep[-1][0]


class Counter:
    def __init__(self, name, labels, value):
        self.name, self.labels, self.value = name, labels, value


class Vector:
    def __init__(self, name, labels, values):
        self.name, self.labels, self.values = name, labels, values


class Gauge:
    def __init__(self, name, labels, value):
        self.name, self.labels, self.value = name, labels, value


def dist(ids):
    logits = [-((t - 7 * len(ids) - sum(ids)) % V) / 3 for t in range(V)]
    z = math.log(sum(math.exp(x) for x in logits))
    return sorted(((t, x - z) for t, x in enumerate(logits)), key=lambda p: -p[1])


def position(ids, k, token):
    d = dist(ids)
    rank = {t: r + 1 for r, (t, _) in enumerate(d)}
    rank.setdefault(token, V + 1)  # ids past the fake vocabulary: last, at -30
    keep = dict(d[:k])
    keep.setdefault(token, dict(d).get(token, -30.0))
    return {t: SimpleNamespace(logprob=lp, rank=rank[t], decoded_token=None) for t, lp in keep.items()}


class Backend:
    def __init__(self, name):
        self.name = name

    def get_name(self):
        return self.name


def fake_worker(kwargs, spec):
    """vLLM 0.26's worker as the kernel probe reads it: model_runner.vllm_config
    .compilation_config.static_forward_context with attention layers (attn_backend) and GDN
    layers (gdn_prefill_backend, enable_packed_recurrent_decode), resolved like vLLM on an
    SM90 GPU: attention auto -> FLASH_ATTN, GDN prefill auto -> flashinfer."""
    import os
    add = kwargs.get("additional_config") or {}
    gdn = (kwargs.get("gdn_prefill_backend") or add.get("gdn_prefill_backend") or "auto")
    gdn = "flashinfer" if gdn == "auto" else gdn
    attn = kwargs.get("attention_backend") or "FLASH_ATTN"
    packed = os.environ.get("VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE", "1") != "0"
    ctx = {f"model.layers.{i}.linear_attn": SimpleNamespace(
               gdn_prefill_backend=gdn, enable_packed_recurrent_decode=packed) for i in (0, 1, 2)}
    ctx["model.layers.3.self_attn.attn"] = SimpleNamespace(attn_backend=Backend(attn))
    drafter = None
    if spec:
        ctx["mtp.layers.0.self_attn.attn"] = SimpleNamespace(attn_backend=Backend("FLASH_ATTN"))
        drafter = SimpleNamespace(_draft_attn_layer_names={"mtp.layers.0.self_attn.attn"})
    runner_attrs = {"drafter": drafter}
    runner_cls = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner")
    if spec and spec.get("method") == "dflash" and spec.get("model"):
        import json
        cfg = json.loads(open(os.path.join(spec["model"], "config.json")).read())
        if cfg.get("architectures") == ["DFlash2DraftModel"] and \
                os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1":
            # vLLM 0.28's V2 runner: model_runner.speculator, a DFlash2Speculator
            k = int(spec["num_speculative_tokens"])
            model = type("DFlash2Qwen3ForCausalLM", (), {
                "__module__": "vllm.model_executor.models.qwen3_dflash2",
                "model": SimpleNamespace(candidate_selector=object())})()
            sp = type("DFlash2Speculator", (), {
                "__module__": "vllm.v1.worker.gpu.spec_decode.dflash2.speculator"})()
            sp.__dict__.update(model=model, num_query_per_req=k + 1, num_speculative_steps=k,
                               selector_top_k=cfg["dflash_config"]["selector_top_k"],
                               draft_model_config=SimpleNamespace(
                                   architectures=cfg["architectures"],
                                   hf_config=SimpleNamespace(dflash_config=cfg["dflash_config"])))
            runner_attrs = {"speculator": sp}
            runner_cls = ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner")
    eager = bool(kwargs.get("enforce_eager"))
    cc = SimpleNamespace(static_forward_context=ctx,
                         cudagraph_mode="NONE" if eager else "FULL_AND_PIECEWISE",
                         mode=SimpleNamespace(name="NONE" if eager else "VLLM_COMPILE"),
                         cudagraph_capture_sizes=[] if eager else [1, 2, 4, 8])
    cfg = SimpleNamespace(compilation_config=cc, model_config=SimpleNamespace(enforce_eager=eager))
    runner = type(runner_cls[1], (), {"__module__": runner_cls[0]})()
    runner.__dict__.update(vllm_config=cfg, **runner_attrs)
    return SimpleNamespace(model_runner=runner)


class Req:
    """A request in FakeEngine: its prompt, its tokens so far, whether its KV is computed."""

    def __init__(self, rid, ids, sp):
        self.rid, self.ids, self.sp = rid, list(ids), sp
        self.toks, self.lps, self.computed, self.queried = [], [], False, False
        self.events, self.preemptions, self.histogram, self.drafted = [], 0, None, 0


class EventType:
    """vllm.v1.engine.EngineCoreEventType's members as the fake's events carry them."""

    def __init__(self, name):
        self.name = name


class FakeCore:
    """The engine core client as LLMEngine.step reads it: get_output() runs one scheduler
    step and returns EngineCoreOutputs (outputs with each request's events, scheduler_stats
    with the running requests and, with cudagraph_metrics, the step's CUDA-graph stat); the
    in-process core's batch queue under engine_core."""

    def __init__(self, engine, batch_queue):
        self.engine = engine
        self.engine_core = SimpleNamespace(batch_queue=batch_queue)

    def get_output(self):
        return self.engine.schedule_step()


class FakeEngine:
    """vLLM's LLMEngine as the step loop uses it (add_request, step, get_num_unfinished_requests)
    over a scheduler of its own, driven by the engine args: first come first served, at most
    max_num_seqs running, KV blocks of block_size tokens (num_gpu_blocks_override of them,
    unlimited without); while the running requests outgrow the blocks the newest is preempted
    (and recomputed when it is scheduled again). A prefill gives one token; a decode step one,
    or with speculation 1 + K (every draft accepted; ngram drafts none). With
    enable_prefix_caching a prompt's full blocks prefilled before are hits (vLLM looks prompts up,
    and counts the lookups, only with caching on). It keeps vLLM 0.26's
    counters (prefix-cache queries and hits in tokens, preemptions) and the running gauge.
    FAKE_VLLM_ID_SUFFIX=x: outputs name their request "<id>-x", as vLLM's internal ids do."""

    def __init__(self, llm, vllm_config):
        import os
        kw = llm.kwargs
        self.llm, self.vllm_config = llm, vllm_config
        self.block = vllm_config.cache_config.block_size
        self.budget = kw.get("num_gpu_blocks_override")
        self.prefix = bool(kw.get("enable_prefix_caching", False))
        self.max_seqs = int(kw.get("max_num_seqs") or 256)
        self.suffix = os.environ.get("FAKE_VLLM_ID_SUFFIX")
        self.waiting, self.running, self.cached = [], [], set()
        self.stats = {"vllm:prefix_cache_queries": 0, "vllm:prefix_cache_hits": 0,
                      "vllm:num_preemptions": 0}
        self.num_running = 0
        # async scheduling as vLLM's in-process engine core keeps it: a batch queue holding the
        # step planned ahead while requests run (none at all when scheduling synchronously)
        import collections
        asynchronous = vllm_config.scheduler_config.async_scheduling
        self.engine_core = FakeCore(self, collections.deque() if asynchronous else None)
        self.graph_stats = bool(kw.get("cudagraph_metrics"))
        self.per_request = kw.get("per_request_spec_decode_metrics", "none") != "none"

    def add_request(self, request_id, prompt, params, arrival_time=None, **kwargs):
        kind = getattr(params.output_kind, "name", "CUMULATIVE")
        if kind != "CUMULATIVE":  # it streams every step's tokens so far, nothing else
            raise ValueError(f"the fake engine streams CUMULATIVE outputs, not {kind}")
        self.waiting.append(Req(request_id, prompt["prompt_token_ids"], params))

    def get_num_unfinished_requests(self):
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self):
        return bool(self.waiting or self.running)

    def blocks(self, r, new):
        return -(-(len(r.ids) + len(r.toks) + new) // self.block)

    def step(self):
        return self.engine_core.get_output().request_outputs

    def schedule_step(self):
        spec = self.llm.spec
        k = len(self.llm.per_pos) if spec and spec["method"] != "ngram" else 0
        budget = float("inf") if self.budget is None else self.budget
        while self.running and sum(self.blocks(r, 1 + k) for r in self.running) > budget:
            r = self.running.pop()  # the newest gives its blocks back, and starts over later
            r.computed = False
            r.preemptions += 1
            r.events.append(SimpleNamespace(type=EventType("PREEMPTED"), timestamp=0.0))
            self.waiting.insert(0, r)
            self.stats["vllm:num_preemptions"] += 1
        used = sum(self.blocks(r, 1 + k) for r in self.running)
        while self.waiting and len(self.running) < self.max_seqs:
            r = self.waiting[0]
            if used + self.blocks(r, 1) > budget:
                break
            self.running.append(self.waiting.pop(0))
            used += self.blocks(r, 1)
            if self.prefix and not r.queried:  # looked up once, as vLLM counts it
                r.queried, hit = True, 0
                while (hit + 1) * self.block < len(r.ids) and \
                        tuple(r.ids[:(hit + 1) * self.block]) in self.cached:
                    hit += 1
                self.stats["vllm:prefix_cache_queries"] += len(r.ids)
                self.stats["vllm:prefix_cache_hits"] += hit * self.block
        self.num_running = len(self.running)
        outs, core_outs = [], []
        fed = [1 + k if r.computed else len(r.ids) + len(r.toks) for r in self.running]
        uniform = all(r.computed for r in self.running)
        for r in list(self.running):
            n = 1 + k if r.computed else 1
            if not r.computed and self.prefix:
                for j in range(1, len(r.ids) // self.block + 1):
                    self.cached.add(tuple(r.ids[:j * self.block]))
            decode, r.computed = r.computed, True
            made, finished, stopped = 0, False, False
            while made < n and not finished:
                t = dist(r.ids + r.toks)[0][0]
                if r.sp.logprobs:
                    r.lps.append(position(r.ids + r.toks, r.sp.logprobs, t))
                r.toks.append(t)
                made += 1
                stopped = t in (r.sp.stop_token_ids or [])
                finished = stopped or len(r.toks) >= r.sp.max_tokens
            if decode and k:
                self.llm.counts[0] += 1
                self.llm.counts[1] += k
                self.llm.counts[2] += made - 1
                for i in range(made - 1):
                    self.llm.per_pos[i] += 1
                if self.per_request:  # RequestSpecDecodeMetrics.observe
                    r.histogram = r.histogram or [0] * (k + 1)
                    r.histogram[made - 1] += 1
                    r.drafted += k
            own = None
            if self.per_request and finished and r.histogram is not None:
                own = SimpleNamespace(num_spec_tokens=k, histogram=list(r.histogram),
                                      num_draft_tokens=r.drafted)
            comp = SimpleNamespace(index=0, text="", token_ids=list(r.toks), cumulative_logprob=None,
                                   logprobs=list(r.lps) if r.sp.logprobs else None,
                                   finish_reason=("stop" if stopped else "length") if finished else None,
                                   stop_reason=None, spec_decode_metrics=own)
            rid = f"{r.rid}-{self.suffix}" if self.suffix else r.rid
            outs.append(SimpleNamespace(request_id=rid, prompt_token_ids=r.ids, prompt_logprobs=None,
                                        outputs=[comp], finished=finished,
                                        metrics=SimpleNamespace(num_preemptions=r.preemptions) if NEW else None))
            core_outs.append(SimpleNamespace(request_id=rid, new_token_ids=r.toks[-made:],
                                             events=r.events or None))
            r.events = []
            if finished:
                self.running.remove(r)
        queue = self.engine_core.engine_core.batch_queue
        if queue is not None:  # the next step is planned before this one's output is read
            queue.clear()
            if self.running or self.waiting:
                queue.append("step planned ahead")
        graph = None
        if self.graph_stats and fed:
            tokens = sum(fed)
            padded = min((c for c in self.vllm_config.compilation_config.cudagraph_capture_sizes
                          if c >= tokens), default=None)
            graph = SimpleNamespace(num_unpadded_tokens=tokens, num_padded_tokens=padded or tokens,
                                    num_paddings=(padded or tokens) - tokens,
                                    runtime_mode="NONE" if padded is None else
                                    "FULL" if uniform else "PIECEWISE")
        stats = SimpleNamespace(num_running_reqs=self.num_running, cudagraph_stats=graph)
        return SimpleNamespace(outputs=core_outs, scheduler_stats=stats, request_outputs=outs)


class FakeTokenizer:
    """A Qwen3-style chat template (enable_thinking=False closes an empty think block; on, the
    model opens its own) over a character-level encoding; FAKE_VLLM_CHAT_IGNORES_THINKING=1:
    a template without the switch."""

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False,
                            enable_thinking=True, **kwargs):
        import os
        text = "".join(f"<|im_start|>{m['role']}\\n{m['content']}<|im_end|>\\n" for m in messages)
        if add_generation_prompt:
            text += "<|im_start|>assistant\\n"
            if enable_thinking is False and not os.environ.get("FAKE_VLLM_CHAT_IGNORES_THINKING"):
                text += "<think>\\n\\n</think>\\n\\n"
        return self.encode(text) if tokenize else text

    def encode(self, text, add_special_tokens=True):
        return [1 + ord(c) % (V - 1) for c in text]


class LLM:
    def __init__(self, model, speculative_config=None, **kwargs):
        for arg in ("bogus_arg",) + (() if NEW else ("per_request_spec_decode_metrics",)):
            if arg in kwargs:
                raise TypeError(f"EngineArgs.__init__() got an unexpected keyword argument '{arg}'")
        import os
        # async scheduling with speculation: FAKE_VLLM_ASYNC_SPEC=refuse raises as vLLM 0.10
        # did, =disable turns it off as later releases do for a method they do not support
        asynchronous = bool(kwargs.get("async_scheduling"))
        if asynchronous and speculative_config and os.environ.get("FAKE_VLLM_ASYNC_SPEC") == "refuse":
            raise ValueError("Currently, speculative decoding is not supported with async scheduling.")
        if asynchronous and speculative_config and os.environ.get("FAKE_VLLM_ASYNC_SPEC") == "disable":
            asynchronous = False
        self.spec = speculative_config
        self.kwargs = kwargs
        self.counts = [0, 0, 0]
        self.per_pos = [0] * (speculative_config or {}).get("num_speculative_tokens", 0)
        self.calls = 0
        tp, pp = kwargs.get("tensor_parallel_size", 1), kwargs.get("pipeline_parallel_size", 1)
        import os
        # resolved as a hybrid model's is where FAKE_VLLM_BLOCK_SIZE says (attention blocks
        # grown to the mamba state's page size), else as asked
        block = int(os.environ.get("FAKE_VLLM_BLOCK_SIZE") or kwargs.get("block_size") or 16)
        self.llm_engine = FakeEngine(self, SimpleNamespace(
            # resolved as vLLM 0.26's ParallelConfig does: one GPU -> uni, more -> mp
            parallel_config=SimpleNamespace(
                tensor_parallel_size=tp, pipeline_parallel_size=pp, world_size=tp * pp,
                distributed_executor_backend=kwargs.get("distributed_executor_backend")
                or ("mp" if tp * pp > 1 else "uni"),
                disable_custom_all_reduce=bool(kwargs.get("disable_custom_all_reduce"))),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=12, async_scheduling=asynchronous),
            speculative_config=SimpleNamespace(method=self.spec["method"],
                                               num_speculative_tokens=len(self.per_pos))
            if self.spec else None,
            additional_config=kwargs.get("additional_config") or {},
            compilation_config=SimpleNamespace(
                cudagraph_mode="NONE" if kwargs.get("enforce_eager") else "FULL_AND_PIECEWISE",
                cudagraph_capture_sizes=capture_sizes(int(kwargs.get("max_num_seqs") or 256),
                                                      1 + len(self.per_pos), kwargs.get("enforce_eager"))),
            cache_config=SimpleNamespace(
                block_size=block, enable_prefix_caching=bool(kwargs.get("enable_prefix_caching")))))

    def get_tokenizer(self):
        return FakeTokenizer()

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [method(fake_worker(self.kwargs, self.spec), *args, **(kwargs or {}))]

    def generate(self, prompts, sp, use_tqdm=True):
        self.calls += 1
        import os
        log = os.environ.get("FAKE_VLLM_CALL_LOG")
        if log:  # the test reads how many generate() calls and prompts each call had
            with open(log, "a") as f:
                f.write(f"{len(prompts)}\\n")
        outs = []
        import random
        # FAKE_VLLM_SAMPLER_FAULT=spec-temperature-1: a speculative config samples at
        # temperature 1 whatever was asked (a sampler bug of the kind the checks must catch)
        hot = self.spec and os.environ.get("FAKE_VLLM_SAMPLER_FAULT") == "spec-temperature-1"
        for p, sp in zip(prompts, sp if isinstance(sp, list) else [sp] * len(prompts)):
            ids = list(p["prompt_token_ids"])
            if log and sp.temperature:
                with open(log, "a") as f:
                    f.write(f"n={sp.n} seed={sp.seed}\\n")
            plp = None
            if sp.prompt_logprobs:
                plp = [None] + [position(ids[:i], sp.prompt_logprobs, ids[i]) for i in range(1, len(ids))]
            comps = []
            for j in range(sp.n):  # vLLM seeds the j-th of n samples with seed + j
                rng = random.Random(None if sp.seed is None else sp.seed + j)
                toks, lps = [], []
                for _ in range(sp.max_tokens):
                    t = (draw(ids + toks, sp, rng, 1.0 if hot else sp.temperature)
                         if sp.temperature else dist(ids + toks)[0][0])
                    if sp.logprobs:
                        lps.append(position(ids + toks, sp.logprobs, t))
                    toks.append(t)
                    if t in (sp.stop_token_ids or []):
                        break
                if self.spec and self.spec["method"] != "ngram":  # all drafts accepted; ngram: none
                    k, left, acc = len(self.per_pos), len(toks) - 1, []
                    while left > 0:  # one verify step yields 1 + accepted tokens
                        acc.append(min(k, left - 1))
                        left -= 1 + acc[-1]
                    self.counts[0] += len(acc)
                    self.counts[1] += len(acc) * k
                    self.counts[2] += sum(acc)
                    for i in range(k):
                        self.per_pos[i] += sum(1 for a in acc if a > i)
                comps.append(SimpleNamespace(index=j, text="", token_ids=toks, cumulative_logprob=None,
                                             logprobs=lps if sp.logprobs else None,
                                             finish_reason="length", stop_reason=None))
            outs.append(SimpleNamespace(request_id="0", prompt_token_ids=ids, prompt_logprobs=plp,
                                        outputs=comps, finished=True, metrics=None))
        return outs

    def get_metrics(self):
        """vLLM 0.26's names; FAKE_VLLM_HIDE_METRICS=a,b leaves those out (an older vLLM)."""
        import os
        hide = set(filter(None, os.environ.get("FAKE_VLLM_HIDE_METRICS", "").split(",")))
        lab = {"model_name": "fake", "engine": "0"}
        rows = [Gauge("vllm:num_requests_running", lab, float(self.llm_engine.num_running))]
        rows += [Counter(n, lab, v) for n, v in self.llm_engine.stats.items()]
        if self.spec:
            names = ["vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                     "vllm:spec_decode_num_accepted_tokens"]
            rows += [Counter(n, lab, v) for n, v in zip(names, self.counts)] + [
                Vector("vllm:spec_decode_num_accepted_tokens_per_pos", lab, list(self.per_pos))]
        return [m for m in rows if m.name not in hide]
'''


FAKE_SAMPLING_PARAMS = '''
"""Test double: vllm.sampling_params's RequestOutputKind (what each step's RequestOutput holds)."""
import enum


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch, dirs):
    """Puts the fake vLLM (a test double, above) on the worker's PYTHONPATH; gives a target
    dir with the reference tokenizer."""
    site = tmp_path / "site" / "vllm"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text(FAKE_VLLM)
    (site / "sampling_params.py").write_text(FAKE_SAMPLING_PARAMS)
    monkeypatch.setenv("PYTHONPATH", str(site.parent))
    tok = Path(__file__).parents[2] / "speccheck" / "reference" / "weights" / "tokenizer.json"
    if tok.is_file():
        (dirs[0] / "tokenizer.json").write_bytes(tok.read_bytes())
    return dirs


@pytest.mark.slow
@pytest.mark.parametrize("worker", ["per-call", "per-config"])
def test_worker_protocol_with_fake_vllm(fake_vllm, worker, tmp_path, monkeypatch):
    """End to end through the subprocess worker, with the fake vLLM (test double)."""
    monkeypatch.setenv("SPECCHECK_VLLM_CAPTURE_DIR", str(tmp_path / "cap"))
    target, draft = fake_vllm
    eng = VllmEngine(model=str(target), draft=str(draft), engine_args={"worker": worker})
    try:
        prompts = [Prompt("a", "x", 9, text="a"), Prompt("b", "x", 12, text="b")]
        ids = [[3, 4, 5], [9, 1]]
        base = eng.generate(prompts, ids, SpecConfig(), 5)
        again = eng.generate(prompts, ids, SpecConfig(), 5)
        assert eng.last_call_fresh_process == (worker == "per-call")
        mtp = eng.generate(prompts, ids, SpecConfig("mtp", 3), 5)
        assert eng.last_call_fresh_process
        together = eng.generate_together(prompts * 2, ids * 2, SpecConfig("mtp", 3), 5)
        assert [c.prompt_id for c in together] == ["a", "b", "a", "b"]
        assert all(c.spec is None for c in together)  # one call's counters are not per request
        for b, a, m, t in zip(base * 2, again * 2, mtp * 2, together):
            assert b.token_ids.tolist() == a.token_ids.tolist() == m.token_ids.tolist() \
                == t.token_ids.tolist()
            assert b.spec is None and m.spec.drafts > 0 and len(m.spec.accepted_per_pos) == 3
        assert base[0].n_tokens == 9 and (base[0].topk_ids[:, 0] == base[0].token_ids).all()
        scored = eng.score(ids, [c.token_ids.tolist() for c in base], 5)
        # per-config parks the baseline worker while mtp runs, and scores with it
        assert eng.last_call_fresh_process == (worker == "per-call")
        for s, b in zip(scored, base):
            np.testing.assert_allclose(s.token_logprobs, b.logprobs, atol=1e-6)
            assert (s.topk_ids == b.topk_ids).all()
        ident = eng.identity()
        assert ident["version"] == "0.28.0+fake"
        with pytest.raises(EngineUsageError, match="bogus_arg"):
            VllmEngine(model=str(target), engine_args={"bogus_arg": "1"}).generate(
                prompts, ids, SpecConfig(), 5)
    finally:
        eng.close()
    caps = sorted(p.name for p in (tmp_path / "cap").glob("*.json"))
    assert caps == ["baseline.json", "mtp_k3.json", "prompt_logprobs.json"]
    # a capture converts like the checked-in fixtures
    cap = json.loads((tmp_path / "cap" / "mtp_k3.json").read_text())
    assert completion_from_dict("a", cap["row"], cap["top_k"], spec=True).spec.drafts > 0


def test_engine_leaves_no_temporary_folder(fake_vllm, monkeypatch):
    """An engine that only checks its arguments makes no folder; one that ran a call (the fake
    vLLM, a test double) has its requests' folder removed by close(), or when it is dropped
    without close()."""
    import gc
    import tempfile

    target, _ = fake_vllm
    mine = Path(tempfile.mkdtemp())
    monkeypatch.setattr(tempfile, "tempdir", str(mine))
    VllmEngine(model=str(target)).identity()
    assert list(mine.iterdir()) == []
    prompts, ids = [Prompt("a", "x", 4, text="a")], [[3, 4]]
    closed, dropped = VllmEngine(model=str(target)), VllmEngine(model=str(target))
    for eng in (closed, dropped):
        eng.generate(prompts, ids, SpecConfig(), 5)
    assert len(list(mine.iterdir())) == 2
    closed.close()
    del dropped, eng
    gc.collect()
    assert list(mine.iterdir()) == []
    mine.rmdir()


def test_zero_drafts_from_fake_vllm_fail_the_config(fake_vllm, monkeypatch):
    """The fake vLLM (test double) reports no drafts for ngram: the engine must refuse it."""
    target, _ = fake_vllm
    eng = VllmEngine(model=str(target))
    try:
        with pytest.raises(EngineError, match="did not speculate|no spec-decode counters"):
            eng.generate([Prompt("a", "x", 6, text="a")], [[1, 2]],
                         SpecConfig("ngram", 2), 5)
    finally:
        eng.close()


def test_cli_run_diff_gate_with_fake_vllm(fake_vllm, tmp_path):
    """`speccheck run --engine vllm` then `gate`, through the runner and store, with the fake
    vLLM (test double): the engine plugs into the suite like the reference engine."""
    from click.testing import CliRunner

    from speccheck.cli import main

    target, draft = fake_vllm
    if not (target / "tokenizer.json").is_file():
        pytest.skip("reference tokenizer not shipped yet")
    store = str(tmp_path / "store")
    runner = CliRunner()
    res = runner.invoke(main, ["run", "--engine", "vllm", "--model", str(target), "--draft",
                               str(draft), "--config", "mtp-k3", "--corpus", "smoke",
                               "--repeats", "2", "--store", store, "--axes", "none",
                               "--engine-arg", "worker=per-config"])  # axes: test_vllm_workload.py
    assert res.exit_code == 0, res.output
    assert "mtp-k3 r1" in res.output
    assert "mtp-k3 all at once: 8 requests (2 of each prompt)" in res.output  # the worker's one call
    res = runner.invoke(main, ["gate", "--store", store])
    assert res.exit_code == 0, res.output


@pytest.mark.slow
@pytest.mark.parametrize("fault", [None, "spec-temperature-1"])
def test_sampled_run_with_fake_vllm(fake_vllm, tmp_path, monkeypatch, fault):
    """A sampled run through the worker with the fake vLLM (test double; lossless unless the
    planted fault makes the spec config sample at temperature 1): each prompt's samples go as
    ONE request of n with its own seed, the outputs are scored through prompt_logprobs top-10
    (the tail lumped), and both distribution checks judge: the clean engine passes, the
    fault fails the distribution check (the two-sample check, weaker at 4 samples per prompt,
    states its figures)."""
    from click.testing import CliRunner

    from speccheck.cli import main

    target, _ = fake_vllm
    if not (target / "tokenizer.json").is_file():
        pytest.skip("reference tokenizer not shipped yet")
    cfg = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**cfg, "vocab_size": 50}))
    log = tmp_path / "calls.log"
    monkeypatch.setenv("FAKE_VLLM_CALL_LOG", str(log))
    if fault:
        monkeypatch.setenv("FAKE_VLLM_SAMPLER_FAULT", fault)
    store = str(tmp_path / "store")
    runner = CliRunner()
    res = runner.invoke(main, ["run", "--engine", "vllm", "--model", str(target), "--config",
                               "mtp-k3", "--corpus", "ci", "--temperature", "0.7", "--top-p", "0.9",
                               "--samples", "4", "--store", store, "--axes", "none",
                               "--concurrent", "off", "--no-attribution", "--engine-arg",
                               "worker=per-config", "--engine-arg", "score_top_k=10"])
    assert res.exit_code == 0, res.output
    sent = [line for line in log.read_text().splitlines() if line.startswith("n=")]
    assert sent and all(line.startswith("n=4 seed=") for line in sent)
    # a seed of its own per prompt and config, the same in the second repeat (seeded determinism)
    assert len(sent) == 2 * 2 * 8 and len(set(sent)) == 2 * 8
    diff = runner.invoke(main, ["diff", "--store", store, "--config", "mtp-k3"]).output
    assert "left out (the scorer's top-k logprobs" in diff or "sampled tokens of 32 outputs" in diff
    # the plumbing is under test, not the false-alarm rate (benchmarks/sampling_false_alarms.py
    # measures that): the distribution check at alpha 0.001, as this fixed draw of the clean
    # baseline sits at p 0.0026
    gate = runner.invoke(main, ["gate", "--store", store, "--set", "sampled_alpha=0.001"])
    if fault is None:
        assert gate.exit_code == 0, gate.output + diff
    else:
        assert gate.exit_code == 1
        assert "sampled_matches_target failed for config mtp-k3" in gate.output, gate.output
    assert "two-sample    32 outputs vs the baseline's 32 on 8 prompts (4 per prompt" in diff


def test_identity_after_dflash_call_carries_k_note(fake_vllm):
    """With the fake vLLM (test double): identity() after a dflash K=3 call says K is not
    block_size - 1, and the next call's identity drops the note."""
    target, draft = fake_vllm
    eng = VllmEngine(model=str(target), draft=str(draft))
    try:
        p, ids = [Prompt("a", "x", 6, text="a")], [[1, 2]]
        eng.generate(p, ids, SpecConfig("dflash", 3), 5)
        assert any("block_size is 8" in n for n in eng.identity()["notes"])
        eng.generate(p, ids, SpecConfig("dflash", 7), 5)
        assert eng.identity()["notes"] == []
    finally:
        eng.close()


# ---------------------------------------------------------------- kernel paths, fake vLLM

def test_identity_names_the_kernels_read_back_from_the_engine(fake_vllm):
    """With the fake vLLM (test double shaped like vLLM 0.26's worker): after a call, the
    identity names the backends the (fake) engine resolved, not the arguments: nothing was
    asked for, yet FLASH_ATTN, flashinfer GDN prefill and CUDA graphs are recorded."""
    target, _ = fake_vllm
    eng = VllmEngine(model=str(target), engine_args={"warmup": "false"})
    try:
        p, ids = [Prompt("a", "x", 5, text="a")], [[1, 2]]
        eng.generate(p, ids, SpecConfig("mtp", 3), 5)
        ident = eng.identity()
        assert ident["attention_backend_requested"] == "auto"
        assert ident["attention_backend"] == "FLASH_ATTN"
        assert ident["draft_attention_backend"] == "FLASH_ATTN"
        assert ident["gdn_prefill_backend"] == "flashinfer"
        assert ident["gdn_decode_kernel"] == "fla_packed_recurrent_decode"
        assert ident["gdn_verify_kernel"] == "fused_sigmoid_gating_delta_rule_update"
        assert ident["cudagraph_mode"] == "FULL_AND_PIECEWISE"
        assert ident["enforce_eager"] is False and ident["kernels_read_back"] is True
        assert ident["kernel_knobs"]["gdn_prefill_backend"] == "flashinfer"
    finally:
        eng.close()
    eng = VllmEngine(model=str(target), engine_args={
        "warmup": "false", "enforce_eager": "true", "attention_backend": "TRITON_ATTN",
        "additional_config": '{"gdn_prefill_backend": "triton"}',
        "env.VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE": "0"})
    try:
        eng.generate([Prompt("a", "x", 5, text="a")], [[1, 2]], SpecConfig(), 5)
        ident = eng.identity()
        assert (ident["attention_backend"], ident["gdn_prefill_backend"]) == ("TRITON_ATTN", "triton")
        assert ident["gdn_decode_kernel"] == "fused_sigmoid_gating_delta_rule_update"
        assert ident["gdn_verify_kernel"] is None  # the baseline has no verify step
        assert ident["cudagraph_mode"] == "NONE" and ident["enforce_eager"] is True
    finally:
        eng.close()


def test_attribution_variants_follow_what_ran(fake_vllm):
    """With the fake vLLM (test double): variants are relative to the resolved settings;
    each flips one switch that differs from them."""
    target, draft = fake_vllm
    eng = VllmEngine(model=str(target), draft=str(draft), engine_args={"warmup": "false"})
    try:
        eng.generate([Prompt("a", "x", 4, text="a")], [[1, 2]], SpecConfig(), 5)
        v = eng.attribution_variants([SpecConfig("mtp", 3), SpecConfig("dflash", 7)])
        ran = eng.identity()
    finally:
        eng.close()
    # a resumed run (no worker in this process) takes what ran from the stored identity
    fresh = VllmEngine(model=str(target), draft=str(draft), engine_args={"warmup": "false"})
    try:
        assert fresh.attribution_variants([SpecConfig("mtp", 3), SpecConfig("dflash", 7)], ran) == v
        assert "prefill gdn=triton" not in fresh.attribution_variants()  # 'auto': unknown
    finally:
        fresh.close()
    assert v["decode"] == {"score_path": "decode"}
    assert v["decode gdn=fused_sigmoid_gating"]["env.VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE"] == "0"
    assert v["decode eager"]["enforce_eager"] == "true"
    assert v["verify mtp-k3"] == {"score_path": "verify", "score_spec": "mtp-k3"}
    assert v["verify dflash-k7"]["score_spec"] == "dflash-k7"
    assert json.loads(v["prefill gdn=triton"]["additional_config"]) == {"gdn_prefill_backend": "triton"}
    assert "prefill attention=FLASH_ATTN" not in v and "prefill attention=TRITON_ATTN" in v
    assert "prefill attention=FLASHINFER" not in v  # flashinfer is not installed there
    assert v["prefill eager"] == {"enforce_eager": "true"}
    # every variant is a valid set of engine args for this engine
    for args in v.values():
        split_engine_args({"warmup": "false", **args})


def test_score_paths_through_the_worker(fake_vllm, tmp_path, monkeypatch):
    """With the fake vLLM (test double): prefill scoring sends all sequences in as few
    generate() calls as the scheduler's token budget (12 in the fake) allows; decode/verify
    paths give the last two positions, which match the teacher-forced ones where the fake's
    arithmetic model is the same on every path."""
    target, draft = fake_vllm
    log = tmp_path / "calls.log"
    monkeypatch.setenv("FAKE_VLLM_CALL_LOG", str(log))
    def greedy(ids, n):  # the fake's arithmetic model: argmax = (7 len + sum) mod 50
        out = []
        for _ in range(n):
            out.append((7 * len(ids + out) + sum(ids + out)) % 50)
        return out

    # greedy (the step reproduces the prefix), forced off-greedy (it does not), one token
    prompts, conts = [[3, 4, 5], [9, 1], [2, 2, 2, 2]], [greedy([3, 4, 5], 4), [4, 4], [1]]
    eng = VllmEngine(model=str(target))
    try:
        ref = eng.score(prompts, conts, 3)
    finally:
        eng.close()
    assert [int(n) for n in log.read_text().split()] == [2, 1]  # 7 + 4 tokens, then 5
    for path in ("decode", "verify"):
        log.write_text("")
        args = {"score_path": path, "score_spec": "mtp-k2"}
        eng = VllmEngine(model=str(target), draft=str(draft), engine_args=args)
        try:
            got = eng.score(prompts, conts, 3)
        finally:
            eng.close()
        assert [int(n) for n in log.read_text().split()] == [2]  # the 1-token one is not run
        for r, g, c in zip(ref, got, conts):
            n = len(c)
            if n < 2:
                assert (g.topk_ids == -1).all()
                continue
            # the last position is known only where the first step reproduced the prefix
            assert (g.topk_ids[: n - 2] == -1).all()
            assert (g.topk_ids[n - 2] == r.topk_ids[n - 2]).all()
            if c == conts[0]:
                assert (g.topk_ids[n - 1] == r.topk_ids[n - 1]).all()
                np.testing.assert_allclose(g.token_logprobs[n - 1], r.token_logprobs[n - 1],
                                           atol=1e-6)
            else:
                assert (g.topk_ids[n - 1] == -1).all()


def test_verify_path_needs_a_spec_config(dirs):
    with pytest.raises(EngineUsageError, match="score_spec"):
        VllmEngine(model=str(dirs[0]), engine_args={"score_path": "verify"})
    with pytest.raises(EngineUsageError, match="score_path"):
        VllmEngine(model=str(dirs[0]), engine_args={"score_path": "sideways"})


# ---------------------------------------------------------------- DFlash2

from speccheck.engines.vllm import DFLASH2_ENV, dflash2_problem  # noqa: E402


@pytest.fixture
def dflash2_draft(tmp_path):
    d = tmp_path / "dflash2"
    write_json(d, {"architectures": ["DFlash2DraftModel"],
                   "dflash_config": {"block_size": 8, "mask_token_id": 5, "target_layer_ids": [1, 3],
                                     "conv_kernel_size": 2, "conv_group_size": 16,
                                     "selector_rank": 128, "selector_top_k": 16}})
    return d


def test_dflash2_maps_to_vllm_dflash_with_a_dflash2_draft(dflash2_draft):
    """vLLM ≥ 0.28 has no method name 'dflash2': method dflash + a DFlash2DraftModel draft,
    in the V2 model runner."""
    assert speculative_config(SpecConfig("dflash2", 7), str(dflash2_draft),
                              {"attention_backend": "TRITON_ATTN"}) == {
        "method": "dflash", "model": str(dflash2_draft), "num_speculative_tokens": 7,
        "attention_backend": "TRITON_ATTN"}
    assert DFLASH2_ENV == {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    for version in ("0.28.0", "0.28.1rc2.dev77+gac7509e2b", "0.29.0", "1.0.0"):
        assert dflash2_problem(SpecConfig("dflash2", 7), str(dflash2_draft), version) is None
    assert dflash2_problem(SpecConfig("dflash", 7), None, "0.26.0") is None
    with pytest.raises(EngineUsageError, match="--draft"):
        speculative_config(SpecConfig("dflash2", 7), None, {})


@pytest.mark.parametrize("version", ["0.26.0", "0.27.2rc1.dev77+gac7509e2b", "0.9.2"])
def test_dflash2_refused_before_vllm_0_28(dflash2_draft, version):
    msg = dflash2_problem(SpecConfig("dflash2", 7), str(dflash2_draft), version)
    assert msg.startswith(f"DFlash2 needs vLLM ≥ 0.28; this is {version}")


def test_dflash2_refuses_a_dflash_v1_draft(dirs):
    msg = dflash2_problem(SpecConfig("dflash2", 7), str(dirs[1]), "0.28.0")
    assert "DFlash2DraftModel" in msg and "DFlashDraftModel" in msg


def test_dflash2_engine_refuses_on_old_vllm_before_starting_a_worker(dirs, dflash2_draft,
                                                                     monkeypatch):
    """The version check runs in generate() before any worker process starts (it would
    otherwise load the draft as plain DFlash or fail deep inside vLLM)."""
    import speccheck.engines.vllm as vmod

    monkeypatch.setattr(vmod.metadata, "version",
                        lambda dist: "0.26.0" if dist == "vllm" else "0")
    eng = VllmEngine(model=str(dirs[0]), draft=str(dflash2_draft))
    assert eng.default_k("dflash2") == 7
    with pytest.raises(EngineUsageError, match="DFlash2 needs vLLM ≥ 0.28; this is 0.26.0"):
        eng.generate([Prompt("a", "x", 4, text="a")], [[1, 2]], SpecConfig("dflash2", 7), 5)
    assert eng._worker is None
    eng.close()


def test_dflash2_worker_env_has_the_v2_runner(dirs, dflash2_draft):
    eng = VllmEngine(model=str(dirs[0]), engine_args={"env.VLLM_NO_USAGE_STATS": "1"})
    assert eng._worker_env(DFLASH2_ENV)["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in eng._worker_env() or \
        eng._worker_env()["VLLM_USE_V2_MODEL_RUNNER"] == __import__("os").environ.get(
            "VLLM_USE_V2_MODEL_RUNNER")
    override = VllmEngine(model=str(dirs[0]), draft=str(dflash2_draft),
                          engine_args={"env.VLLM_USE_V2_MODEL_RUNNER": "0"})
    # the V1 runner would draft a DFlash2 draft as DFlash: refused before a worker starts
    with pytest.raises(EngineUsageError, match="only in vLLM's V2 model runner"):
        override.generate([Prompt("a", "x", 4, text="a")], [[1, 2]], SpecConfig("dflash2", 7), 5)
    assert override._worker is None
    override.close()


def test_dflash2_call_with_fake_vllm_runs_in_the_v2_runner(fake_vllm, dflash2_draft):
    """With the fake vLLM (test double; vLLM not installed here, so its version is the
    worker's business): a dflash2 call reaches LLM(...) as method dflash with the DFlash2
    draft, its worker started with VLLM_USE_V2_MODEL_RUNNER=1 (recorded in the identity),
    and a following dflash call does not reuse that worker."""
    target, _ = fake_vllm
    eng = VllmEngine(model=str(target), draft=str(dflash2_draft),
                     engine_args={"worker": "per-config"})
    try:
        p, ids = [Prompt("a", "x", 6, text="a")], [[1, 2]]
        eng.generate(p, ids, SpecConfig("dflash2", 7), 5)
        ident = eng.identity()
        assert ident["env"].get("VLLM_USE_V2_MODEL_RUNNER") == "1"
        assert ident["notes"] == []
        # the proof read back from the (fake) V2 runner: DFlash2 drafter, block K + 1
        d2 = ident["dflash2"]
        assert d2["selector"] == "on" and d2["top_k"] == 16 and d2["model_runner_v2"]
        assert ident["draft_class"].endswith("DFlash2Qwen3ForCausalLM") and ident["draft_block"] == 8
        assert d2["trained_block"] == 8 and ident["golden_series"] == "0.28.0"
        eng.generate(p, ids, SpecConfig("dflash", 7), 5)
        assert eng.last_call_fresh_process
    finally:
        eng.close()


def test_ignore_eos_decodes_the_full_budget_with_fake_vllm(fake_vllm):
    """With the fake vLLM (test double), which like vLLM stops at any of stop_token_ids: a
    prompt whose first token is end-of-sequence (id 2 in the fixture's config) stops at once,
    and with ignore_eos decodes its full budget, one at a time and all at once."""
    target, _ = fake_vllm
    eng = VllmEngine(model=str(target))
    try:
        stops = Prompt("a", "x", 6, text="a")
        goes_on = Prompt("b", "x", 6, text="a", ignore_eos=True)
        for generate in (eng.generate, eng.generate_together):
            out = generate([stops, goes_on], [[45], [45]], SpecConfig(), 5)
            assert out[0].token_ids.tolist() == [2]
            assert out[1].n_tokens == 6 and out[1].token_ids[0] == 2
    finally:
        eng.close()


def test_dflash2_draft_beside_a_dflash_draft(dirs, dflash2_draft):
    """One suite runs dflash (--draft: the DFlash draft) and dflash2 (engine arg dflash2_draft):
    each config gets its own draft, K defaults to each draft's block - 1, and the identity
    holds the DFlash2 draft's hash."""
    eng = VllmEngine(model=str(dirs[0]), draft=str(dirs[1]),
                     engine_args={"dflash2_draft": str(dflash2_draft)})
    assert eng._draft_for(SpecConfig("dflash2", 7, str(dirs[1]))) == str(dflash2_draft)
    assert eng._draft_for(SpecConfig("dflash", 7, str(dirs[1]))) == str(dirs[1])
    assert eng.default_k("dflash2") == 7
    assert dflash2_problem(SpecConfig("dflash2", 7), eng._draft_for(SpecConfig("dflash2", 7)), "0.28.0") is None
    assert "dflash2_draft_hash" in eng.identity()
    eng.close()
