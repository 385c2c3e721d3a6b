"""The subprocess side of the ``vllm`` engine: owns one ``vllm.LLM`` and answers requests.

Run as ``python -m speccheck.engines.vllm_worker``. It reads request-file paths from stdin,
one per line, until EOF; for each it writes ``<request>.result.json`` (atomically) next to
it. Everything crosses the process boundary as plain JSON (no pickles). vLLM's own logging
goes to this process's stdout/stderr, which the parent sends to a log file and shows the
tail of when something fails.

The converters at the top (``request_output_to_dict``, ``metrics_to_dicts``) read vLLM
objects by attribute only, so this module imports without vLLM; the parent turns the
dicts into speccheck types (``speccheck.engines.vllm``).
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
import traceback
from typing import Any

from speccheck.engines.base import rendered_thinking

SPEC_PREFIX = "vllm:spec_decode_"
#: VLLM_* as the worker was started with (vLLM later sets some of its own, e.g. random
#: shared-memory names, which are no setting of the user's)
START_ENV = {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_")}
#: where the worker writes raw dicts of the first request of each call, when set
CAPTURE_ENV = "SPECCHECK_VLLM_CAPTURE_DIR"


# ---------------------------------------------------------------- vLLM objects -> dicts

def _position_to_dict(pos: Any) -> dict[str, dict] | None:
    """One position of vLLM logprobs ({token_id: Logprob}) -> {"<id>": {logprob, rank, ...}}."""
    if pos is None:
        return None
    return {
        str(int(tid)): {
            "logprob": float(lp.logprob),
            "rank": None if lp.rank is None else int(lp.rank),
            "decoded_token": lp.decoded_token,
        }
        for tid, lp in pos.items()
    }


def logprobs_to_list(logprobs: Any) -> list[dict | None] | None:
    """vLLM's SampleLogprobs / PromptLogprobs (a list of dicts, or FlatLogprobs, which
    iterates as one) -> a JSON-able list; prompt logprobs keep their leading None."""
    if logprobs is None:
        return None
    return [_position_to_dict(pos) for pos in logprobs]


def request_output_to_dict(out: Any) -> dict:
    """A ``vllm.RequestOutput`` as plain data, keeping vLLM's field names."""
    m = getattr(out, "metrics", None)
    metrics = None
    if m is not None:
        metrics = {k: getattr(m, k) for k in (
            "arrival_time", "queued_ts", "scheduled_ts", "first_token_ts", "last_token_ts",
            "first_token_latency", "num_generation_tokens", "num_preemptions") if hasattr(m, k)}
    return {
        "request_id": str(out.request_id),
        "prompt_token_ids": [int(t) for t in (out.prompt_token_ids or [])],
        "prompt_logprobs": logprobs_to_list(out.prompt_logprobs),
        "outputs": [
            {
                "index": int(c.index),
                "text": c.text or "",
                "token_ids": [int(t) for t in c.token_ids],
                "cumulative_logprob": c.cumulative_logprob,
                "logprobs": logprobs_to_list(c.logprobs),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                **spec_metrics_to_dict(getattr(c, "spec_decode_metrics", None)),
            }
            for c in out.outputs
        ],
        "finished": bool(out.finished),
        "metrics": metrics,
    }


def spec_metrics_to_dict(m: Any) -> dict:
    """A request's own spec-decode counters (``CompletionOutput.spec_decode_metrics``, vLLM
    0.33's RequestSpecDecodeMetrics: per verify step, a histogram of the drafts it accepted),
    as {"spec_decode_metrics": {...}}; empty where vLLM gave none."""
    if m is None or getattr(m, "histogram", None) is None:
        return {}
    return {"spec_decode_metrics": {"num_spec_tokens": int(m.num_spec_tokens),
                                    "histogram": [int(x) for x in m.histogram],
                                    "num_draft_tokens": int(m.num_draft_tokens)}}


def metrics_to_dicts(metrics: Any, prefix: str = "vllm:") -> list[dict]:
    """``LLM.get_metrics()`` (vllm.v1.metrics.reader Counter/Vector/Gauge/Histogram) as
    plain dicts, keeping only names that start with ``prefix``."""
    rows = []
    for m in metrics:
        if not m.name.startswith(prefix):
            continue
        row = {"name": m.name, "type": type(m).__name__.lower(), "labels": dict(m.labels)}
        for attr in ("value", "values", "count", "sum", "buckets"):
            if hasattr(m, attr):
                v = getattr(m, attr)
                row[attr] = list(v) if attr == "values" else (dict(v) if attr == "buckets" else v)
        rows.append(row)
    return rows


# ---------------------------------------------------------------- facts about the host

def runtime_facts(llm: Any = None) -> dict:
    """Versions, GPU, driver and the kernel choices vLLM made (what the parent cannot see)."""
    facts: dict[str, Any] = {}
    try:
        import vllm
        facts["vllm_version"] = getattr(vllm, "__version__", None)
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        facts["vllm_version_error"] = repr(e)
    try:
        if "torch" not in sys.modules:  # vLLM imports it; do not pay for it otherwise
            raise ImportError("torch not loaded")
        import torch
        facts["torch"] = torch.__version__
        facts["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            facts["gpu"] = torch.cuda.get_device_name(0)
            facts["gpu_count"] = torch.cuda.device_count()
            facts["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    except Exception as e:  # noqa: BLE001
        facts["torch_error"] = repr(e)
    facts["driver"] = nvidia_smi_driver()
    facts["env"] = dict(START_ENV)
    if llm is not None:
        facts.update(_engine_choices(llm))
        facts.update(parallel_facts(llm))
    return facts


def nccl_version() -> str | None:
    """The NCCL torch links (``torch.cuda.nccl.version()``: a tuple in torch 2.x, an int such
    as 2708 or 21903 before) as "2.21.5"; None without CUDA torch."""
    try:
        import torch
        return format_nccl_version(torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - a CPU build, or no NCCL
        return None


def format_nccl_version(v: Any) -> str:
    """(2, 21, 5) -> "2.21.5"; the int forms NCCL reports: 21903 -> "2.19.3" (2.9 and
    later: major*10000 + minor*100 + patch), 2708 -> "2.7.8" (before: major*1000 + ...)."""
    if isinstance(v, (tuple, list)):
        return ".".join(str(x) for x in v[:3])
    v = int(v)
    if v >= 10000:
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}"
    return f"{v // 1000}.{v // 100 % 10}.{v % 100}"


def gpu_links(world_size: int, topo: Any, cuda_visible_devices: str | None) -> dict:
    """How the GPUs of one run are linked (``topo``: the parsed ``nvidia-smi topo -m``):
    vLLM's mp executor puts rank i on visible GPU i, so the first ``world_size`` visible GPUs.
    ``interconnect`` is the slowest link among them (what an all-reduce over all of them waits
    on); None with one GPU, or when the topology or the GPUs' indices cannot be read."""
    from speccheck.topology import visible_gpus, weakest_link

    if world_size <= 1:
        return {"interconnect": None}
    if topo is None:
        return {"interconnect": None, "topology_error": "nvidia-smi topo -m gave no GPU matrix"}
    _, indices = visible_gpus(cuda_visible_devices, topo.gpus)
    if indices is None or len(indices) < world_size:
        return {"interconnect": None,
                "topology_error": "the GPUs' nvidia-smi indices are unknown (CUDA_VISIBLE_DEVICES)"}
    used = indices[:world_size]
    return {"interconnect": weakest_link(topo, used),
            "gpu_links": {f"GPU{a}-GPU{b}": topo.link(a, b)
                          for n, a in enumerate(used) for b in used[n + 1:]}}


def parallel_facts(llm: Any) -> dict:
    """The parallel layout vLLM resolved (``vllm_config.parallel_config``: TP and PP sizes,
    world size, the executor it picked -- ``uni`` for one GPU, ``mp`` on one host -- and
    whether custom all-reduce was turned off), the NCCL version, and the links between the
    GPUs used."""
    out: dict[str, Any] = {}
    try:
        pc = llm.llm_engine.vllm_config.parallel_config
        backend = pc.distributed_executor_backend
        out.update({
            "tensor_parallel_size": int(pc.tensor_parallel_size),
            "pipeline_parallel_size": int(pc.pipeline_parallel_size),
            "world_size": int(pc.world_size),
            "distributed_executor_backend": (backend if isinstance(backend, str) or backend is None
                                             else f"{backend.__module__}.{backend.__qualname__}"),
            "disable_custom_all_reduce": bool(pc.disable_custom_all_reduce),
        })
    except Exception as e:  # noqa: BLE001 - recorded: the identity then says it is unknown
        out["parallel_config_error"] = repr(e)[:300]
    out["nccl_version"] = nccl_version()
    out.update(_host_links(int(out.get("world_size") or 1), os.environ.get("CUDA_VISIBLE_DEVICES")))
    return out


@functools.lru_cache(maxsize=None)
def _host_links(world_size: int, cuda_visible_devices: str | None) -> dict:
    """gpu_links of this host, read once per worker (nvidia-smi is not asked after every call)."""
    from speccheck.topology import host_topology
    return gpu_links(world_size, host_topology() if world_size > 1 else None, cuda_visible_devices)


def nvidia_smi_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None
    except (OSError, subprocess.SubprocessError):
        return None


def probe_model_runner(worker: Any) -> dict:
    """Runs inside vLLM's worker (``LLM.collective_rpc``): the kernels each layer was built
    with, read from the live model, not from the arguments. vLLM 0.26: every attention and
    GDN layer registers in ``compilation_config.static_forward_context``; an attention layer
    holds its resolved backend class (``attn_backend``, ``get_name()``: FLASH_ATTN,
    TRITON_ATTN, FLASHINFER, ...); a Qwen GDN layer holds ``gdn_prefill_backend`` (the
    active one: flashinfer | triton | cutedsl) and ``enable_packed_recurrent_decode``. The
    drafter's attention layers are named in ``model_runner.drafter._draft_attn_layer_names``.
    ``cudagraph_mode`` is read after the runner resolved it (it may lower the mode to what
    the backends support)."""
    runner = worker.model_runner
    cfg = runner.vllm_config
    cc = cfg.compilation_config
    drafter = getattr(runner, "drafter", None)
    draft_names = set(getattr(drafter, "_draft_attn_layer_names", None) or ())
    layers: dict[str, dict] = {}
    for name, layer in cc.static_forward_context.items():
        if hasattr(layer, "gdn_prefill_backend"):
            layers[name] = {"kind": "gdn", "prefill": str(layer.gdn_prefill_backend),
                            "packed_decode": bool(getattr(layer, "enable_packed_recurrent_decode",
                                                          False)),
                            # vLLM >= 0.28 only (VLLM_GDN_DECODE_KERNEL, after its fallback)
                            "decode_kernel": getattr(layer, "gdn_decode_kernel", None)}
        elif hasattr(getattr(layer, "attn_backend", None), "get_name"):
            layers[name] = {"kind": "attention", "backend": str(layer.attn_backend.get_name()),
                            "draft": name in draft_names}
    mode = getattr(cc, "mode", None)
    out = {"layers": layers, **all_reduce_paths(), "cudagraph_mode": str(cc.cudagraph_mode),
           "compilation_mode": str(getattr(mode, "name", mode)),
           "cudagraph_capture_sizes": [int(x) for x in (cc.cudagraph_capture_sizes or [])],
           "enforce_eager": bool(cfg.model_config.enforce_eager),
           "model_runner": f"{type(runner).__module__}.{type(runner).__name__}",
           "drafter": drafter_facts(runner)}
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        out["flash_attn_version"] = get_flash_attn_version()
    except Exception:  # noqa: BLE001 - not every build has FA
        pass
    return out


def _class_name(obj: Any) -> str | None:
    return None if obj is None else f"{type(obj).__module__}.{type(obj).__name__}"


def drafter_facts(runner: Any, version: str | None = None) -> dict | None:
    """Runs inside vLLM's worker: the drafter the model runner built, read from the live
    objects (attribute names from the version table, vllm_versions): the runner's class (V2:
    ``vllm.v1.worker.gpu.model_runner.GPUModelRunner``), its drafter (V2 ``speculator``, V1
    ``drafter``) and that drafter's class, the draft model's class and architectures, its
    block (``num_query_per_req`` = anchor + K) and K (``num_speculative_steps``), the trained
    block (``dflash_config.block_size``), and DFlash2's candidate selector: its top-k (0.28
    ``selector_top_k``, 0.33 ``top_k``) and whether the draft model has one. None without a
    drafter."""
    from speccheck.engines.vllm_versions import release_entry

    if version is None:
        try:
            import vllm
            version = getattr(vllm, "__version__", None)
        except Exception:  # noqa: BLE001 - the newest entry then
            version = None
    rel = release_entry(version)
    spec = None
    for attr in rel.drafter_attrs:
        spec = getattr(runner, attr, None)
        if spec is not None:
            break
    if spec is None:
        return None
    model = getattr(spec, "model", None)
    draft_cfg = getattr(spec, "draft_model_config", None)
    hf = getattr(draft_cfg, "hf_config", None)
    dcfg = getattr(hf, "dflash_config", None) or {}
    top_k = None
    for attr in filter(None, (rel.selector_top_k_attr, "top_k", "selector_top_k")):
        if getattr(spec, attr, None) is not None:
            top_k = int(getattr(spec, attr))
            break

    def num(obj: Any, attr: str) -> int | None:
        v = getattr(obj, attr, None)
        return None if v is None else int(v)

    return {
        "model_runner": _class_name(runner),
        "model_runner_v2": _class_name(runner) == rel.runner_v2,
        "drafter_class": _class_name(spec),
        "draft_class": _class_name(model),
        "architectures": list(getattr(draft_cfg, "architectures", None) or []) or None,
        "draft_block": num(spec, rel.block_attr),
        "num_speculative_steps": num(spec, rel.steps_attr),
        "trained_block": int(dcfg["block_size"]) if isinstance(dcfg, dict) and dcfg.get("block_size") else None,
        "selector_top_k": top_k,
        "candidate_selector": getattr(getattr(model, "model", None), "candidate_selector", None) is not None,
    }


#: the all-reduce implementations of vLLM 0.26's CudaCommunicator, in the order it tries them
#: (``distributed/device_communicators/cuda_communicator.py``, ``all_reduce``)
ALL_REDUCE_COMMS = (("qr_comm", "quick_reduce"), ("fi_ar_comm", "flashinfer"),
                    ("aiter_ar_comm", "aiter"), ("ca_comm", "custom"),
                    ("symm_mem_comm", "symm_mem"), ("pynccl_comm", "pynccl"))


def all_reduce_paths() -> dict:
    """Runs inside vLLM's worker: the TP group's all-reduce paths that are set up and enabled
    (custom all-reduce for small tensors where P2P allows it, then NCCL through pynccl) and
    the NCCL library vLLM loaded; {} at TP=1 (no device communicator)."""
    try:
        from vllm.distributed.parallel_state import get_tp_group
        comm = get_tp_group().device_communicator
    except Exception:  # noqa: BLE001 - not initialised, or another vLLM
        return {}
    if comm is None:
        return {}
    paths = [label for attr, label in ALL_REDUCE_COMMS
             if getattr(comm, attr, None) is not None and not getattr(getattr(comm, attr), "disabled", False)]
    out: dict[str, Any] = {"all_reduce": "+".join(paths) or None}
    try:
        out["nccl_version_vllm"] = comm.pynccl_comm.nccl.ncclGetVersion()
    except Exception:  # noqa: BLE001
        pass
    return out


def kernel_paths(probe: dict, speculative: bool) -> dict:
    """The probe of ``probe_model_runner`` -> identity keys naming the kernels that compute a
    position: target and drafter attention backends, the GDN prefill kernel, the GDN kernel
    of one-token decode and of the spec verify step (vLLM 0.26 ``qwen_gdn_linear_attn.py``:
    decode uses ``fused_recurrent_gated_delta_rule_packed_decode`` when packed decode is on
    and the batch is decode-only without spec tokens, else ``fused_sigmoid_gating_delta_rule_
    update``, which is also the verify kernel), CUDA graph and torch.compile modes."""
    layers = list((probe.get("layers") or {}).values())

    def joined(values) -> str | None:
        v = sorted(set(values))
        return "+".join(v) if v else None

    gdn = [x for x in layers if x["kind"] == "gdn"]
    packed = {x["packed_decode"] for x in gdn}
    # vLLM >= 0.28: VLLM_GDN_DECODE_KERNEL=cuda runs verify batches (K+1 <= 8, num_v_heads =
    # 8 num_k_heads) through the CUDA kernel fused_gdn_decode_post_conv_mtp
    cuda_verify = any(x.get("decode_kernel") == "cuda" for x in gdn)
    out = {
        "attention_backend": joined(x["backend"] for x in layers
                                    if x["kind"] == "attention" and not x.get("draft")),
        "draft_attention_backend": joined(x["backend"] for x in layers
                                          if x["kind"] == "attention" and x.get("draft")),
        "gdn_prefill_backend": joined(x["prefill"] for x in gdn),
        "gdn_decode_kernel": None if not gdn else (
            "fla_packed_recurrent_decode" if packed == {True} else
            "fused_sigmoid_gating_delta_rule_update" if packed == {False} else "mixed"),
        "gdn_verify_kernel": None if not (gdn and speculative) else (
            "fused_gdn_decode_post_conv_mtp (cuda) where eligible, else "
            "fused_sigmoid_gating_delta_rule_update" if cuda_verify
            else "fused_sigmoid_gating_delta_rule_update"),
        "gdn_decode_kernel_setting": joined(x["decode_kernel"] for x in gdn
                                            if x.get("decode_kernel")),
        "cudagraph_mode": probe.get("cudagraph_mode"),
        "compilation_mode": probe.get("compilation_mode"),
        "enforce_eager": probe.get("enforce_eager"),
        "gdn_layers": len(gdn),
        "attention_layers": sum(1 for x in layers if x["kind"] == "attention"),
    }
    for key in ("flash_attn_version", "all_reduce", "nccl_version_vllm"):
        if probe.get(key) is not None:
            out[key] = probe[key]
    return out


def _engine_choices(llm: Any) -> dict:
    """The kernels vLLM chose, read back from the running model (``probe_model_runner``);
    the requested settings are kept next to them (``*_requested``)."""
    out: dict[str, Any] = {}
    try:
        cfg = llm.llm_engine.vllm_config
    except Exception:  # noqa: BLE001
        return out
    spec = getattr(cfg, "speculative_config", None)
    try:
        backend = cfg.attention_config.backend
        out["attention_backend_requested"] = getattr(backend, "name", None) if backend else "auto"
    except Exception:  # noqa: BLE001
        pass
    add = getattr(cfg, "additional_config", None)
    out["gdn_prefill_backend_requested"] = (
        str(add.get("gdn_prefill_backend", "auto")) if isinstance(add, dict) else "auto")
    try:
        probe = llm.collective_rpc(probe_model_runner)[0]
        out.update(kernel_paths(probe, spec is not None))
        if probe.get("drafter"):
            out["drafter"] = probe["drafter"]
        out["kernels_read_back"] = True
    except Exception as e:  # noqa: BLE001 - recorded: the identity then says it is unknown
        out["kernels_read_back"] = False
        out["kernel_probe_error"] = repr(e)[:300]
    try:
        if spec is not None:
            out["speculative_method"] = spec.method
            out["num_speculative_tokens"] = spec.num_speculative_tokens
    except Exception:  # noqa: BLE001
        pass
    try:
        out["dtype"] = str(cfg.model_config.dtype).replace("torch.", "")
        out.setdefault("enforce_eager", bool(cfg.model_config.enforce_eager))
        out["prefix_caching"] = bool(cfg.cache_config.enable_prefix_caching)
    except Exception:  # noqa: BLE001
        pass
    try:  # as resolved: a hybrid model's attention block grows to its mamba state's page size
        out["block_size"] = int(cfg.cache_config.block_size)
    except Exception:  # noqa: BLE001
        pass
    graphs = graph_facts(llm)  # the shapes axis sends batches at these sizes
    if "capture_sizes" in graphs:
        out["cudagraph_capture_sizes"] = graphs["capture_sizes"]
    try:
        import importlib.util
        out["flashinfer_available"] = importlib.util.find_spec("flashinfer") is not None
    except Exception:  # noqa: BLE001
        pass
    return out


# ---------------------------------------------------------------- serving requests

def scheduler_budget(llm: Any) -> int | None:
    """Tokens the scheduler puts in one step (``max_num_batched_tokens``), None if unknown."""
    try:
        return int(llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens)
    except Exception:  # noqa: BLE001
        return None


def token_budget_groups(lengths: list[int], budget: int | None) -> list[list[int]]:
    """Consecutive indices grouped so that each group's total length fits the budget (a
    sequence longer than the budget alone); one group when the budget is unknown."""
    if not lengths:
        return []
    if not budget:
        return [list(range(len(lengths)))]
    groups: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        if groups[-1] and used + n > budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups


class UsageProblem(Exception):
    """The request itself is wrong (e.g. an unknown LLM(...) argument): exit code 2."""


# ---------------------------------------------------------------- serving a workload

#: engine steps in a row that give no output while requests are unfinished before the step
#: loop gives up: a request that can never be scheduled (one that needs more KV blocks than
#: the whole cache holds) would keep it stepping forever
STALL_STEPS = 2000
#: the ids this worker gives vLLM's requests (vLLM may append a suffix of its own)
ID_PREFIX = "speccheck-"


def _own_id(vllm_id: str, ids: dict[str, str]) -> str | None:
    """The workload request a vLLM request id names: one of ours as given, or with a suffix
    vLLM appended (``<id>-<random>``, as newer releases do to keep internal ids unique)."""
    if vllm_id in ids:
        return ids[vllm_id]
    best = max((k for k in ids if vllm_id.startswith(k + "-")), key=len, default=None)
    return ids[best] if best is not None else None


def _gauge(rows: list[dict], name: str) -> float | None:
    """A gauge's value summed over its label sets (engines), None where not reported."""
    vals = [float(r["value"]) for r in rows if r["name"] == name
            and isinstance(r.get("value"), (int, float)) and not isinstance(r.get("value"), bool)]
    return sum(vals) if vals else None


def _produced(out: Any) -> int:
    """Tokens a (cumulative) RequestOutput holds so far."""
    return sum(len(c.token_ids) for c in (out.outputs or []))


def batches_in_flight(engine: Any) -> int | None:
    """Batches vLLM's engine core holds scheduled and not yet processed (its ``batch_queue``,
    kept with async scheduling: a step n + 1 planned before step n's output), or None where
    there is no such queue (synchronous scheduling, or a vLLM without it)."""
    core = getattr(engine, "engine_core", None)
    core = getattr(core, "engine_core", core)
    queue = getattr(core, "batch_queue", None)
    try:
        return None if queue is None else len(queue)
    except TypeError:
        return None


def chat_tokenizer(llm: Any, model: str) -> Any:
    """The model's tokenizer (the one ``LLM.chat`` renders with): the LLM's own, else -- an LLM
    started with skip_tokenizer_init -- vLLM's get_tokenizer for the model."""
    try:
        tok = llm.get_tokenizer()
        if tok is not None:
            return tok
    except Exception:  # noqa: BLE001 - skip_tokenizer_init: load it as vLLM would
        pass
    try:
        from vllm.tokenizers import get_tokenizer
    except ImportError:
        from vllm.transformers_utils.tokenizer import get_tokenizer
    return get_tokenizer(model)


def render_chat(tok: Any, messages: list[dict], thinking: bool) -> tuple[list[int], str, str]:
    """A conversation through the tokenizer's chat template as ``LLM.chat`` renders it
    (``chat_template_kwargs={"enable_thinking": ...}``, the generation prompt added, no
    special tokens added on encoding): (ids, the text, the text with the switch flipped)."""
    def text(flag: bool) -> str:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                       enable_thinking=flag)
    rendered = text(thinking)
    return list(tok.encode(rendered, add_special_tokens=False)), rendered, text(not thinking)


class StepTap:
    """What each engine step's ``EngineCoreOutputs`` says, read as ``LLMEngine.step`` takes
    them from ``engine_core.get_output()`` (the method is wrapped on the instance for the
    workload and put back after): the scheduler stats' running requests, the step's
    CUDA-graph stat (only with ``LLM(cudagraph_metrics=True)``: tokens before and after
    padding, the graph mode), and each request's PREEMPTED events (recorded by the scheduler
    with stats on and handed out with the request's next output). ``installed`` is False
    where the engine has no such method (nothing is read then)."""

    def __init__(self, engine: Any, preempted_event: str = "PREEMPTED"):
        self.core = getattr(engine, "engine_core", None)
        self.original = getattr(self.core, "get_output", None)
        self.installed = callable(self.original)
        self.own = self.installed and "get_output" in vars(self.core)
        self.event = preempted_event
        self.running: list[int] = []
        self.graphs: list[list] = []  # [unpadded tokens, padded tokens, mode] per step that had one
        self.preempted: dict[str, int] = {}  # vLLM request id -> PREEMPTED events
        self.error: str | None = None
        if self.installed:
            self.core.get_output = self._get_output

    def _get_output(self, *args: Any, **kwargs: Any) -> Any:
        out = self.original(*args, **kwargs)
        try:
            self.read(out)
        except Exception as e:  # noqa: BLE001 - said in the stats; the step itself goes on
            self.error = repr(e)[:300]
        return out

    def read(self, out: Any) -> None:
        stats = getattr(out, "scheduler_stats", None)
        if stats is not None:
            self.running.append(int(stats.num_running_reqs))
            g = getattr(stats, "cudagraph_stats", None)
            if g is not None:
                self.graphs.append([int(g.num_unpadded_tokens), int(g.num_padded_tokens),
                                    str(g.runtime_mode)])
        for o in getattr(out, "outputs", None) or ():
            for e in getattr(o, "events", None) or ():
                if getattr(e.type, "name", str(e.type)) == self.event:
                    rid = str(o.request_id)
                    self.preempted[rid] = self.preempted.get(rid, 0) + 1

    def close(self) -> None:
        if self.installed:
            if self.own:
                self.core.get_output = self.original
            else:
                del self.core.get_output


def serve_workload(engine: Any, items: list[dict], max_in_flight: int | None,
                   read_metrics: Any, step_gauges: Any = (),
                   preempted_event: str = "PREEMPTED") -> tuple[list[dict], dict]:
    """Serve a workload through vLLM's engine step loop, as ``LLM.generate`` does it but with
    arrivals: ``engine`` is ``llm.llm_engine`` (``add_request(request_id, prompt, params)``,
    ``step()`` -> RequestOutputs, ``get_num_unfinished_requests()``); ``items`` are dicts
    {"id", "prompt" (token ids), "params" (SamplingParams), "arrive_after", "after"}.

    Before each step, every waiting item in order is added once its arrival step has come
    (steps counted from the start; with nothing in flight the clock jumps to the next
    arrival), its ``after`` request has finished, and fewer than ``max_in_flight`` (None: no
    limit) are unfinished. ``read_metrics()`` (``get_metrics()`` as dicts) is read before
    the first step and after every step: ``step_gauges`` are sampled there (their peaks
    returned), and a request alone in flight for its whole life gets the spec counters
    around it. Returns, per item in order, {"output": its final RequestOutput, "wall_s",
    and "metrics_before"/"metrics_after" (spec rows) where it was alone}, and the stats:
    steps, mixed_steps (a request's first token in the same step as another's further
    tokens), max_unfinished, step_max, requests_served, metrics_before/after, and
    steps_scheduled_ahead (steps after which a batch was still in flight: batches_in_flight;
    None where the engine keeps no batch queue); from the engine core's step outputs
    (StepTap): step_running (the scheduler's running requests after each step), step_graphs
    ([unpadded, padded tokens, graph mode] of each step that reported one), preempted
    ({request: PREEMPTED events}); step_tap says whether they were read at all."""
    ids = {f"{ID_PREFIX}{i}": it["id"] for i, it in enumerate(items)}
    vid = {own: v for v, own in ids.items()}
    pending = list(items)
    inflight: dict[str, dict] = {}  # own id -> {"tokens", "alone", "before", "t0"}
    done: dict[str, dict] = {}
    first_snap = read_metrics()
    step_max: dict[str, float] = {}
    tap = StepTap(engine, preempted_event)
    try:
        steps, mixed, max_unfinished, ahead, snap = _serve_steps(
            engine, pending, inflight, done, ids, vid, first_snap, read_metrics, step_gauges,
            max_in_flight, step_max)
    finally:
        tap.close()
    preempted: dict[str, int] = {}
    for rid, n in tap.preempted.items():
        own = _own_id(rid, ids)
        if own is not None:
            preempted[own] = preempted.get(own, 0) + n
    stats = {"steps": steps, "mixed_steps": mixed, "max_unfinished": max_unfinished,
             "step_max": step_max, "requests_served": len(done), "steps_scheduled_ahead": ahead,
             "metrics_before": first_snap, "metrics_after": snap, "step_tap": tap.installed,
             "step_running": tap.running, "step_graphs": tap.graphs, "preempted": preempted,
             **({"step_tap_error": tap.error} if tap.error else {})}
    return [done[it["id"]] for it in items], stats


def _serve_steps(engine: Any, pending: list[dict], inflight: dict, done: dict, ids: dict,
                 vid: dict, snap: list, read_metrics: Any, step_gauges: Any,
                 max_in_flight: int | None, step_max: dict) -> tuple:
    """serve_workload's loop: (steps, mixed steps, most unfinished, steps scheduled ahead,
    the last metrics snapshot)."""
    clock = steps = mixed = idle = 0
    ahead: int | None = None
    max_unfinished = 0
    while pending or inflight:
        for it in list(pending):
            if max_in_flight is not None and len(inflight) >= max_in_flight:
                break
            if int(it.get("arrive_after") or 0) > clock or (it.get("after") and it["after"] not in done):
                continue
            got = engine.add_request(vid[it["id"]], {"prompt_token_ids": list(it["prompt"])}, it["params"])
            if isinstance(got, str) and got not in ids:  # the id vLLM gave it, where it says
                ids[got] = it["id"]
            pending.remove(it)
            inflight[it["id"]] = {"tokens": 0, "alone": True, "t0": time.perf_counter(),
                                  "before": [r for r in snap if r["name"].startswith(SPEC_PREFIX)]}
        if not inflight:
            ready = [int(it.get("arrive_after") or 0) for it in pending
                     if not it.get("after") or it["after"] in done]
            if not ready:
                raise UsageProblem("the workload's requests wait on each other (after): "
                                   + ", ".join(it["id"] for it in pending[:5]))
            clock = max(clock, min(ready))
            continue
        count = getattr(engine, "get_num_unfinished_requests", None)
        max_unfinished = max(max_unfinished, int(count()) if callable(count) else len(inflight))
        if len(inflight) > 1:
            for st in inflight.values():
                st["alone"] = False
        outs = engine.step() or []
        clock += 1
        steps += 1
        held = batches_in_flight(engine)
        if held is not None:
            ahead = (ahead or 0) + (held > 0)
        snap = read_metrics()
        for name in step_gauges:
            v = _gauge(snap, name)
            if v is not None:
                step_max[name] = max(step_max.get(name, v), v)
        started, continued = set(), set()
        for out in outs:
            own = _own_id(str(out.request_id), ids)
            st = inflight.get(own) if own is not None else None
            if st is None:
                continue
            n = _produced(out)
            if n > st["tokens"]:
                (started if st["tokens"] == 0 else continued).add(own)
                st["tokens"] = n
            if out.finished:
                row = {"output": out, "wall_s": time.perf_counter() - st["t0"]}
                if st["alone"]:
                    row["metrics_before"] = st["before"]
                    row["metrics_after"] = [r for r in snap if r["name"].startswith(SPEC_PREFIX)]
                done[own] = row
                del inflight[own]
        mixed += bool(started and continued)
        idle = 0 if outs else idle + 1
        if idle >= STALL_STEPS:
            raise RuntimeError(
                f"the engine gave no output in {STALL_STEPS} steps with {len(inflight)} request(s) "
                f"unfinished ({', '.join(list(inflight)[:3])}): one can never be scheduled (a KV "
                "block budget smaller than one request needs?)")
    return steps, mixed, max_unfinished, ahead, snap


def _release_of(llm: Any) -> Any:
    """The version table's entry for the vLLM this worker runs."""
    from speccheck.engines.vllm_versions import release_entry
    try:
        import vllm
        return release_entry(getattr(vllm, "__version__", None))
    except ImportError:
        return release_entry(None)


def graph_facts(llm: Any) -> dict:
    """The CUDA-graph sizes vLLM resolved for this LLM (``compilation_config.
    cudagraph_capture_sizes``, in tokens), its graph mode, and the tokens a request feeds a
    uniform step (1 + K with speculation); absent where not readable."""
    out: dict[str, Any] = {}
    try:
        cfg = llm.llm_engine.vllm_config
        cc = cfg.compilation_config
        out["capture_sizes"] = [int(x) for x in (cc.cudagraph_capture_sizes or [])]
        out["cudagraph_mode"] = str(getattr(cc.cudagraph_mode, "name", cc.cudagraph_mode))
        spec = getattr(cfg, "speculative_config", None)
        out["tokens_per_request"] = 1 + int(getattr(spec, "num_speculative_tokens", 0) or 0)
    except Exception:  # noqa: BLE001 - absent: the proof then says not read back
        pass
    return out


def greedy_params(max_tokens: int, top_k: int, stop_token_ids: list[int], ignore_eos: bool,
                  extra: dict) -> Any:
    """Greedy SamplingParams with top-k logprobs, token ids only. With ignore_eos the
    end-of-sequence ids are not stop ids either (vLLM stops at stop_token_ids regardless)."""
    from vllm import SamplingParams
    # a sampled run (speccheck run --temperature) passes temperature/top_p/top_k/seed in extra
    return SamplingParams(**{"temperature": 0.0, "max_tokens": int(max_tokens),
                             "logprobs": int(top_k), "detokenize": False,
                             "stop_token_ids": [] if ignore_eos else list(stop_token_ids),
                             "ignore_eos": ignore_eos, **extra})


def with_request_seed(extra: dict, seed: int | None, n: int = 1) -> dict:
    """``extra`` (the run's sampling fields) for one request: its own seed (the parent's
    types.request_seed) and its n samples, which vLLM seeds seed, seed + 1, ... in turn.
    Greedy (no seed): as it is."""
    if seed is None:
        return extra
    return {**extra, "seed": int(seed), **({"n": int(n)} if n > 1 else {})}


class Worker:
    def __init__(self) -> None:
        self.llm = None
        self.llm_key: str | None = None
        self.capture_dir = os.environ.get(CAPTURE_ENV) or None
        self.captured: set[str] = set()

    def get_llm(self, req: dict) -> Any:
        key = json.dumps([req["model"], req["llm_kwargs"]], sort_keys=True)
        if self.llm is not None:
            if key != self.llm_key:
                raise UsageProblem("one worker serves one config; got a request for another")
            return self.llm
        from vllm import LLM
        t0 = time.perf_counter()
        try:
            self.llm = LLM(model=req["model"], **req["llm_kwargs"])
        except TypeError as e:
            if "argument" in str(e):
                raise UsageProblem(f"vLLM rejected an engine argument: {e}") from e
            raise
        self.llm_key = key
        self.init_s = time.perf_counter() - t0
        return self.llm

    def spec_metrics(self) -> list[dict]:
        return metrics_to_dicts(self.llm.get_metrics(), SPEC_PREFIX)

    def handle(self, req: dict) -> dict:
        from vllm import SamplingParams
        llm = self.get_llm(req)
        op = req["op"]
        prompts = req.get("prompts") or []
        self.top_k = int(req["top_k"])
        result: dict[str, Any] = {"op": op, "requests": []}
        extra = dict(req.get("sampling") or {})
        if op == "generate":
            if req.get("warmup", True) and prompts:
                warm = SamplingParams(temperature=0.0, max_tokens=8, detokenize=False)
                llm.generate([{"prompt_token_ids": prompts[0][:32]}], warm, use_tqdm=False)
            # ignore_eos (per prompt, or sampling.ignore_eos for all): vLLM still stops at
            # stop_token_ids, so the end-of-sequence ids are not passed as such either
            ignore = [bool(i or extra.get("ignore_eos"))
                      for i in req.get("ignore_eos") or [False] * len(prompts)]
            extra.pop("ignore_eos", None)
            seeds = req.get("seeds") or [None] * len(prompts)
            params = [greedy_params(max_tokens, req["top_k"], req.get("stop_token_ids") or [],
                                    ign, with_request_seed(extra, seed, n))
                      for max_tokens, ign, seed, n in zip(req["max_tokens"], ignore, seeds,
                                                          req.get("n") or [1] * len(prompts))]
            if req.get("together"):  # one call: the scheduler batches every request
                before = self.spec_metrics()
                t0 = time.perf_counter()
                outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params,
                                    use_tqdm=False)  # (outputs come back in input order)
                wall = time.perf_counter() - t0
                after = self.spec_metrics()
                result["requests"] = [{"output": request_output_to_dict(out), "wall_s": wall,
                                       "metrics_before": before, "metrics_after": after}
                                      for out in outs]
            else:
                pad = int(req.get("pad_batch") or 0)  # copies beside it, outputs dropped
                for ids, sp in zip(prompts, params):
                    before = self.spec_metrics()
                    t0 = time.perf_counter()
                    out = llm.generate([{"prompt_token_ids": ids}] * (1 + pad), [sp] * (1 + pad),
                                       use_tqdm=False)[0]
                    wall = time.perf_counter() - t0
                    after = self.spec_metrics()
                    row = {"output": request_output_to_dict(out), "wall_s": wall,
                           "metrics_before": before, "metrics_after": after}
                    result["requests"].append(row)
                    self.capture(op, row, llm)
        elif op == "score":
            # all sequences in as few LLM.generate calls as the scheduler's token budget
            # allows, so none is split into chunked-prefill pieces by the batch around it
            if req.get("path", "prefill") == "prefill":
                sp = SamplingParams(temperature=0.0, max_tokens=1,
                                    prompt_logprobs=int(req["top_k"]), detokenize=False, **extra)
            else:  # "steps": the last two positions generated (prefill, then decode/verify)
                sp = SamplingParams(temperature=0.0, max_tokens=2, logprobs=int(req["top_k"]),
                                    detokenize=False, **extra)
            for group in token_budget_groups([len(p) for p in prompts], scheduler_budget(llm)):
                outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in group], sp,
                                    use_tqdm=False)
                for out in outs:
                    row = {"output": request_output_to_dict(out)}
                    result["requests"].append(row)
                    self.capture(op, row, llm)
        elif op == "workload":
            every = bool(extra.pop("ignore_eos", False))
            try:  # every step's output holds all tokens so far (LLM.generate asks FINAL_ONLY)
                from vllm.sampling_params import RequestOutputKind
                extra.setdefault("output_kind", RequestOutputKind.CUMULATIVE)
            except ImportError:
                pass
            items = [{**r, "params": greedy_params(r["max_tokens"], req["top_k"],
                                                   req.get("stop_token_ids") or [],
                                                   bool(r.get("ignore_eos") or every),
                                                   with_request_seed(extra, r.get("seed")))}
                     for r in req["requests"]]
            chat = req.get("chat")
            thinking_ids = set()
            if chat is not None:  # each request's messages through the model's chat template
                tok, flag = chat_tokenizer(llm, req["model"]), bool(chat["enable_thinking"])
                for it in items:
                    it["prompt"], text, flipped = render_chat(tok, it["messages"], flag)
                    if flag and rendered_thinking(text, flipped):
                        thinking_ids.add(it["id"])
            done, stats = serve_workload(llm.llm_engine, items, req.get("max_in_flight"),
                                         lambda: metrics_to_dicts(llm.get_metrics()),
                                         req.get("step_gauges") or (),
                                         _release_of(llm).preempted_event)
            if req.get("cudagraph_metrics"):  # the sizes the steps were padded to, as resolved
                stats.update(graph_facts(llm))
            result["requests"] = [{**row, "output": request_output_to_dict(row["output"])}
                                  for row in done]
            if chat is not None:
                stats["chat_rendered"], stats["thinking_prompts"] = len(items), len(thinking_ids)
            try:  # as resolved: vLLM may turn it off (or on, by default) whatever was asked
                stats["async_scheduling"] = bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling)
            except AttributeError:
                stats["async_scheduling"] = None
            result["workload"] = stats
            self.capture_workload(req, stats)
        else:
            raise UsageProblem(f"unknown op {op!r}")
        result["runtime"] = runtime_facts(llm)
        result["runtime"]["engine_init_s"] = round(getattr(self, "init_s", 0.0), 3)
        return result

    def capture(self, op: str, row: dict, llm: Any) -> None:
        """Keep the smallest request of each kind (baseline, each spec config, score) as a
        fixture for the conversion tests, with a get_metrics() dump."""
        if not self.capture_dir:
            return
        spec = json.loads(self.llm_key)[1].get("speculative_config") if self.llm_key else None
        if op == "score":
            name = "prompt_logprobs"
        elif spec:
            name = f"{spec.get('method')}_k{spec.get('num_speculative_tokens')}"
        else:
            name = "baseline"
        out = row["output"]
        generated = sum(len(c["token_ids"]) for c in out["outputs"])
        if op == "generate" and generated < 8:  # too short to show drafting
            return
        size = len(out["prompt_token_ids"]) + generated
        path = os.path.join(self.capture_dir, f"{name}.json")
        try:
            with open(path) as f:
                if json.load(f).get("size", 1 << 30) <= size:
                    return
        except (OSError, ValueError):
            pass
        os.makedirs(self.capture_dir, exist_ok=True)
        data = {"speccheck_fixture": 1, "source": "captured", "op": op, "size": size,
                "speculative_config": spec, "top_k": self.top_k, "row": row,
                "get_metrics": metrics_to_dicts(llm.get_metrics()),
                "runtime": runtime_facts(llm)}
        _write_json(path, data)


    def capture_workload(self, req: dict, stats: dict) -> None:
        """Keep a workload's get_metrics() before and after, and its step loop's stats, as a
        fixture of the proof parsing (``workload_<axis>-<level>.json``; the last one of each)."""
        if not self.capture_dir or not req.get("axis"):
            return
        os.makedirs(self.capture_dir, exist_ok=True)
        name = f"workload_{req['axis']}-{req.get('level', '')}.json"
        _write_json(os.path.join(self.capture_dir, name),
                    {"speccheck_fixture": 1, "source": "captured", "op": "workload",
                     "axis": req["axis"], "level": req.get("level"),
                     "llm_kwargs": json.loads(self.llm_key)[1] if self.llm_key else None,
                     "stats": stats, "runtime": runtime_facts(self.llm)})


def _write_json(path: str, data: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def main() -> int:
    worker = Worker()
    for line in sys.stdin:
        path = line.strip()
        if not path:
            continue
        try:
            with open(path) as f:
                req = json.load(f)
            result = worker.handle(req)
        except UsageProblem as e:
            result = {"error": str(e), "error_kind": "usage"}
        except BaseException as e:  # noqa: BLE001 - everything is reported to the parent
            result = {"error": f"{type(e).__name__}: {e}"[:4000], "error_kind": "engine",
                      "traceback": traceback.format_exc()[-6000:]}
        _write_json(path + ".result.json", result)
        sys.stdout.flush()
        sys.stderr.flush()
        if "error" in result:
            break
    # vLLM's background threads can keep a clean exit waiting: leave at once
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
