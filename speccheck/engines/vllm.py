"""The ``vllm`` engine: vLLM's offline ``LLM`` API, in a fresh subprocess per call.

Each ``generate()``/``score()`` runs ``python -m speccheck.engines.vllm_worker`` with a JSON
request in a temp dir and reads a JSON result back, so GPU memory and engine state are
released between configs and a crash or OOM becomes an ``EngineError`` carrying the tail of
the worker's log (the runner records it and goes on). ``--engine-arg worker=per-config``
keeps one worker alive while consecutive calls use the same config (faster; the runner can
read ``last_call_fresh_process`` to record which it was).

Prompts are tokenised here, once, with the model's own tokenizer; the worker sees token ids
only (``skip_tokenizer_init``). Prompts run one at a time (single stream), so the before/after
differences of ``LLM.get_metrics()``'s spec-decode counters belong to exactly one request.

The serving workload axes (concurrency, prefix_cache, kv_pressure, async_scheduling,
chat_thinking and the shapes axis's batch level; run_workload) run in the worker through vLLM's
own engine step loop (``llm.llm_engine.add_request`` at each request's arrival step,
``llm.llm_engine.step()``), under the workload's knobs (``enable_prefix_caching``,
``num_gpu_blocks_override``, ``async_scheduling``, ``cudagraph_metrics``); their proof is read
from vLLM's own statistics: ``get_metrics()`` (names: METRIC_NAMES), the resolved configs, and
each step's output as the engine core hands it over (vllm_worker.StepTap).

Engine args (``--engine-arg key=value``):
  ``env.NAME=value``      environment of the worker (e.g. ``env.VLLM_USE_FLASHINFER_SAMPLER=0``)
  ``sampling.NAME=value`` extra ``SamplingParams`` fields (e.g. ``sampling.ignore_eos=true``)
  ``spec.NAME=value``     extra ``speculative_config`` keys (e.g. ``spec.attention_backend=FLASH_ATTN``)
  ``worker=per-call|per-config``, ``timeout_s=N``, ``warmup=true|false``, ``python=PATH``
  ``score_path=prefill|decode|verify``, ``score_spec=CONFIG`` (e.g. mtp-k3): which kernels
                          score() runs (attribution variants set them; see score())
  ``dflash2_draft=PATH``  the DFlash2 draft of dflash2 configs, where --draft names the DFlash
                          one (one suite runs dflash-k7 and dflash2-k7 on the checkpoint
                          export-reference wrote: --draft DIR/drafter, dflash2_draft=DIR/dflash2)
  ``score_top_k=N``       logprobs per position a sampled run's outputs are scored with
                          (default 20, vLLM's max_logprobs; more raises max_logprobs too):
                          tokens past them are one tail category of the distribution check
  ``attribution_jobs=N``  attribution variants run N at once, a worker each (mind
                          gpu_memory_utilization: each worker takes that share of the GPU)
  ``pad_batch=N``         each single-stream request decodes beside N copies of itself
                          (outputs dropped): kernels chosen by batch size then run their
                          large-batch form (TRITON_ATTN's 2D decode kernel; see PAD_FOR_2D)
  ``tensor_parallel_size=N``, ``pipeline_parallel_size=N``, ``distributed_executor_backend=
                          mp|ray|uni|external_launcher``: passed to ``LLM(...)`` like the rest,
                          checked first (parallel_problem: sizes, head counts, visible GPUs);
                          the identity records what vLLM resolved, the NCCL version and the
                          links between the GPUs used (``nvidia-smi topo -m``)
  anything else           passed to ``LLM(...)``; values parsed as JSON where they parse
                          (ints, floats, booleans, ``{"gdn_prefill_backend": "triton"}``).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from speccheck.engines.base import Engine, EngineError, EngineUsageError, chat_knobs, vllm_capture_sizes
from speccheck.topology import physical_gpu_count, visible_gpus
from speccheck.types import (Completion, Prompt, Scored, SpecConfig, SpecCounters, Workload,
                             WorkloadResult, request_seed, sampling_of)
from speccheck.engines.vllm_versions import (DFLASH2_ARCHITECTURE, DFLASH2_MIN_VLLM, VLLM_RELEASES,
                                             golden_series, release, release_entry, version_problem)
from speccheck.verify.ties import canonical_topk

#: vLLM's metric names per release, from the version table (vllm_versions.VLLM_RELEASES: the one
#: place to change when vLLM renames one); kept as a mapping {since: names} for callers
METRIC_NAMES: dict[tuple[int, ...], dict[str, str]] = {k: dict(r.metrics) for k, r in VLLM_RELEASES.items()}
SPEC_KEYS = ("drafts", "draft_tokens", "accepted_tokens", "accepted_per_pos")
#: workload knobs (Workload.knobs) -> the LLM(...) argument each sets, and how its value reads:
#: ``prefix_cache=on|off`` -> ``enable_prefix_caching``; ``kv_blocks=N`` (blocks of
#: cache_block_size() tokens) -> ``num_gpu_blocks_override``, the KV cache's block count;
#: ``async_scheduling=on|off`` -> ``async_scheduling`` (set both ways: newer releases turn it on
#: by default). With speculative decoding vLLM 0.10 refused it (ValueError at LLM(...): the
#: axis run fails); later releases keep it for the methods of ``EagleModelTypes`` (eagle,
#: eagle3, the MTP types and, from when it joined them, dflash) and ngram_gpu, and turn it off
#: with a warning for the others (the proof reads ``scheduler_config.async_scheduling`` back, so
#: a level turned off is not exercised); ``cudagraph_metrics=on`` -> ``cudagraph_metrics`` (each
#: step's CUDA-graph stat: tokens before and after padding). The chat-template knobs
#: (engines.base.CHAT_KNOBS) are no LLM(...) argument: the worker renders the requests' messages
#: with the model's tokenizer
WORKLOAD_KNOBS = {"prefix_cache": "enable_prefix_caching", "kv_blocks": "num_gpu_blocks_override",
                  "async_scheduling": "async_scheduling", "cudagraph_metrics": "cudagraph_metrics"}
OWN_OPTIONS = {"worker", "timeout_s", "warmup", "python", "score_path", "score_spec", "pad_batch",
               "attribution_jobs", "dflash2_draft", "score_top_k"}
#: identity keys that say what vLLM resolved (read back from the worker), not what was asked
RESOLVED_KEYS = ("gdn_prefill_backend", "attention_backend", "enforce_eager", "capability",
                 "flashinfer_available", "gdn_decode_kernel_setting")
#: pad_batch for a single stream to decode with TRITON_ATTN's 2D kernel, as every spec verify
#: step does: vLLM 0.26 takes its 3D split-softmax kernel for one-token steps of at most
#: 128 / KV-heads sequences (v1/attention/ops/triton_unified_attention.py, use_3d; the
#: threshold snaps to a CUDA-graph capture size, at most 128), and the 2D one above that
PAD_FOR_2D = 160
#: how score() computes the scored positions (attribution variants pick one; see
#: attribution_variants): prompt_logprobs of one prefill, or the last position generated by
#: one one-token decode step, or by the first position of one spec verify step
SCORE_PATHS = ("prefill", "decode", "verify")
#: LLM(...) arguments that --method/--k/--draft own
SPEC_ARGS = {"speculative_config", "spec_method", "spec_model", "spec_tokens"}
DEFAULT_LLM_KWARGS = {"skip_tokenizer_init": True, "disable_log_stats": False, "seed": 0}
DEFAULT_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
BACKEND_LOG_MARKERS = ("backend", "GDN prefill kernel")


def metric_names(version: str | None = None) -> dict[str, str]:
    """METRIC_NAMES for a vLLM version ("0.26.0", "0.28.1rc2.dev77+g..."; None: the newest;
    older than every entry: the oldest), read as the version table is."""
    keys = sorted(METRIC_NAMES)
    if version:
        older = [k for k in keys if k <= _release(version)]
        return dict(METRIC_NAMES[older[-1] if older else keys[0]])
    return dict(METRIC_NAMES[keys[-1]])


#: the spec-decode counters' names (of the newest entry: they have not changed since v1)
SPEC_NAMES = {k: metric_names()[k] for k in SPEC_KEYS}

#: identity keys naming the kernels that ran, read back inside the worker
#: (vllm_worker.kernel_paths); None until a worker has answered
RESOLVED_KERNEL_KEYS = ("attention_backend", "draft_attention_backend", "gdn_prefill_backend",
                        "gdn_decode_kernel", "gdn_verify_kernel", "cudagraph_mode",
                        "compilation_mode", "enforce_eager", "all_reduce")
#: identity keys of the parallel layout: asked for (static identity), then read back from
#: vLLM's parallel_config and the host inside the worker (vllm_worker.parallel_facts)
PARALLEL_KEYS = ("tensor_parallel_size", "pipeline_parallel_size", "world_size",
                 "distributed_executor_backend", "disable_custom_all_reduce", "nccl_version",
                 "nccl_version_vllm", "interconnect", "gpu_links", "topology_error",
                 "parallel_config_error")
PACKED_DECODE_ENV = release_entry().packed_decode_env
#: vLLM >= 0.28: cuda (default, where eligible) | triton, the GDN kernel of spec verify steps
GDN_DECODE_KERNEL_ENV = release_entry().gdn_decode_kernel_env
#: attention backends for a Qwen3.5 target's full-attention layers on CUDA (version table;
#: vllm/v1/attention/backends/registry.py); FLASHINFER only where flashinfer is installed
ATTENTION_BACKENDS = release_entry().attention_backends
#: when set, worker logs are copied there when each worker ends (debugging on the GPU box)
LOG_DIR_ENV = "SPECCHECK_VLLM_LOG_DIR"


# ---------------------------------------------------------------- pure: arguments

def parse_value(text: str) -> Any:
    """An engine-arg value: JSON where it parses (1, 0.5, true, {"a": 1}), else the string."""
    t = text.strip()
    if t.lower() in ("true", "yes", "on"):
        return True
    if t.lower() in ("false", "no", "off"):
        return False
    try:
        return json.loads(t)
    except ValueError:
        return text


#: the sampling engine args (types.SAMPLING_ARGS) -> their SamplingParams fields
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "sample_top_k": "top_k",
                   "seed": "seed"}


def split_engine_args(args: dict[str, str]) -> dict[str, dict]:
    """--engine-arg pairs -> {"llm": LLM kwargs, "env": worker env, "sampling": ...,
    "spec": extra speculative_config keys, "own": this engine's options}."""
    out: dict[str, dict] = {"llm": {}, "env": {}, "sampling": {}, "spec": {}, "own": {}}
    for key, raw in args.items():
        key = key.strip()
        if key.startswith("env."):
            name = key[4:]
            if not name:
                raise EngineUsageError("--engine-arg env.NAME=value: NAME is empty")
            out["env"][name] = str(raw)
        elif key.startswith("sampling."):
            out["sampling"][key[9:]] = parse_value(raw)
        elif key == "samples":  # the plan repeats each prompt (Prompt.sample): the seed mixes it
            out["own"]["samples"] = parse_value(raw)
        elif key in SAMPLING_FIELDS:  # speccheck run --temperature/--top-p/--sample-top-k/--seed
            if not (key == "sample_top_k" and parse_value(raw) == 0):  # 0: no top-k cut
                out["sampling"][SAMPLING_FIELDS[key]] = parse_value(raw)
        elif key.startswith("spec."):
            out["spec"][key[5:]] = parse_value(raw)
        elif key in OWN_OPTIONS:
            out["own"][key] = parse_value(raw)
        elif key in SPEC_ARGS:
            raise EngineUsageError(
                f"--engine-arg {key}=...: the speculative config comes from --method, --k and "
                "--draft (add extra keys with --engine-arg spec.NAME=value)")
        else:
            out["llm"][key] = parse_value(raw)
    worker = out["own"].get("worker", "per-call")
    if worker not in ("per-call", "per-config"):
        raise EngineUsageError(f"--engine-arg worker={worker}: use per-call or per-config")
    pad = out["own"].get("pad_batch", 0)
    if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
        raise EngineUsageError(f"--engine-arg pad_batch={pad}: give a whole number of copies >= 0 "
                               f"(e.g. pad_batch={PAD_FOR_2D})")
    jobs = out["own"].get("attribution_jobs", 1)
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise EngineUsageError(f"--engine-arg attribution_jobs={jobs}: give how many attribution "
                               f"variants may run at once, a whole number >= 1")
    path = out["own"].get("score_path", "prefill")
    if path not in SCORE_PATHS:
        raise EngineUsageError(f"--engine-arg score_path={path}: use one of {', '.join(SCORE_PATHS)}")
    if path == "verify":
        try:
            spec = SpecConfig.from_name(str(out["own"].get("score_spec", "")))
        except (ValueError, KeyError):
            spec = None
        if spec is None or spec.is_baseline:
            raise EngineUsageError("--engine-arg score_path=verify needs score_spec=CONFIG, a "
                                   "speculative config by name (e.g. score_spec=mtp-k3)")
    return out


def speculative_config(config: SpecConfig, draft: str | None, llm_kwargs: dict,
                       extra: dict | None = None) -> dict | None:
    """SpecConfig -> vLLM's ``speculative_config`` (None for the baseline)."""
    if config.is_baseline:
        return None
    # DFlash2 has no method name of its own in vLLM: method "dflash" with a draft whose
    # architecture is DFlash2DraftModel (see dflash2_problem / DFLASH2_ENV)
    method = "dflash" if config.method == "dflash2" else config.method
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": config.k}
    if method == "dflash":
        if not draft:
            raise EngineUsageError(f"method {config.method} needs the drafter: pass --draft PATH "
                                   f"(a {'DFlash2' if config.method == 'dflash2' else 'DFlash'} "
                                   f"draft checkpoint directory)")
        spec["model"] = draft
        # the drafter attends non-causally; use the kernel the target was told to use
        # (TRITON_ATTN supports that) unless spec.attention_backend says otherwise
        if llm_kwargs.get("attention_backend"):
            spec["attention_backend"] = llm_kwargs["attention_backend"]
    elif draft and config.method != "mtp":
        spec["model"] = draft
    spec.update(extra or {})
    return spec


# ---------------------------------------------------------------- pure: parallel layout

#: executors vLLM 0.26 knows by name (``config/parallel.py``, ``DistributedExecutorBackend``);
#: anything else must be the import path of an Executor subclass ("pkg.module.Class")
EXECUTOR_BACKENDS = ("mp", "ray", "uni", "external_launcher")
#: head groups vLLM shards across TP ranks, as the model's config.json names them
HEAD_KEYS = {"num_attention_heads": "attention heads", "num_key_value_heads": "KV heads",
             "linear_num_key_heads": "GDN key heads", "linear_num_value_heads": "GDN value heads"}


def model_heads(config: dict) -> dict[str, int]:
    """The head counts TP shards (``HEAD_KEYS``), from a config.json (its ``text_config``
    for the multimodal Qwen3.5 class)."""
    text = config.get("text_config") or config
    return {k: int(text[k]) for k in HEAD_KEYS
            if isinstance(text.get(k), int) and not isinstance(text.get(k), bool)}


def tp_fits(heads: dict[str, int], tp: int) -> list[str]:
    """The head groups ``tp`` cannot shard (as vLLM 0.26 does it): attention and GDN heads are
    split evenly (``num_heads % tp``, ``divide(num_v_heads, tp)`` in qwen_gdn_linear_attn.py);
    KV heads are split when tp divides them and replicated when tp is a multiple of them
    (``QKVParallelLinear``)."""
    bad = []
    for key, n in heads.items():
        ok = n % tp == 0 or (key == "num_key_value_heads" and tp % n == 0)
        if not ok:
            bad.append(f"{n} {HEAD_KEYS[key]} ({key})")
    return bad


def parallel_size(llm_kwargs: dict, key: str) -> int:
    """tensor/pipeline_parallel_size as asked (1 when not given); assumes it was validated."""
    return int(llm_kwargs.get(key, 1))


def parallel_problem(llm_kwargs: dict, model_config: dict, model: str,
                     draft_config: dict | None = None, draft: str | None = None,
                     visible: int | None = None, spec_extra: dict | None = None) -> str | None:
    """Why the parallel layout asked for (``tensor_parallel_size``, ``pipeline_parallel_size``,
    ``distributed_executor_backend``) cannot run this model here, or None: caught before a
    worker starts, where vLLM would fail minutes later. ``visible``: GPUs this process may use
    (None: unknown, not checked); ``spec_extra``: the ``spec.*`` engine args (a drafter runs
    at the target's TP unless ``spec.draft_tensor_parallel_size=1``)."""
    sizes = {}
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        value = llm_kwargs.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return (f"--engine-arg {key}={value}: give a positive whole number of GPUs "
                    f"(e.g. {key}=2); the default is 1.")
        sizes[key] = value
    tp, pp = sizes["tensor_parallel_size"], sizes["pipeline_parallel_size"]
    backend = llm_kwargs.get("distributed_executor_backend")
    if backend is not None and (not isinstance(backend, str) or (
            backend not in EXECUTOR_BACKENDS and "." not in backend)):
        return (f"--engine-arg distributed_executor_backend={backend}: vLLM knows "
                f"{', '.join(EXECUTOR_BACKENDS)} (or the import path of an Executor subclass); "
                "leave it out for vLLM's default (mp on one host when TP x PP > 1).")
    if backend == "uni" and tp * pp > 1:
        return (f"--engine-arg distributed_executor_backend=uni runs one process, which cannot hold "
                f"TP x PP = {tp} x {pp} = {tp * pp} ranks: use mp (vLLM's default on one host) or ray, "
                "or tensor_parallel_size=1.")
    for cfg, path, what in ((model_config, model, "--model"), (draft_config, draft, "--draft")):
        if cfg is None:
            continue
        size = tp
        draft_tp = (spec_extra or {}).get("draft_tensor_parallel_size")
        if what == "--draft" and isinstance(draft_tp, int) and not isinstance(draft_tp, bool) and draft_tp >= 1:
            size = draft_tp  # vLLM allows 1 or the target's TP
        heads = model_heads(cfg)
        bad = tp_fits(heads, size)
        if bad:
            fits = [n for n in range(1, 65) if not tp_fits(heads, n)]
            hint = (f"TP sizes that fit: {', '.join(map(str, fits[:8]))}" if fits else
                    "no TP size fits")
            draft_hint = (" (the drafter runs at the target's TP; spec.draft_tensor_parallel_size=1 "
                          "runs it unsharded)" if what == "--draft" else "")
            return (f"tensor_parallel_size={size} cannot shard {what} {path}: its config.json has "
                    f"{', '.join(bad)}, which do not split into {size} equal parts{draft_hint}. "
                    f"vLLM shards every attention, KV and GDN head group across the TP ranks; {hint}.")
    nnodes = llm_kwargs.get("nnodes", 1)
    multi_host = backend == "ray" or (isinstance(nnodes, int) and nnodes > 1)
    if visible is not None and tp * pp > visible and not multi_host:
        return (f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} needs {tp * pp} GPUs, "
                f"and this process sees {visible} (nvidia-smi -L, narrowed by CUDA_VISIBLE_DEVICES). "
                "Expose more GPUs, lower the sizes, or span hosts with --engine-arg "
                "distributed_executor_backend=ray.")
    return None


#: DFlash2's speculator exists only in the V2 model runner (vLLM forces it for DFlash2 drafts
#: since 0.28 unless the switch says 0; upstream's own test sets it, and so do we, so the
#: identity records it)
DFLASH2_ENV = {release_entry().v2_runner_env: "1"}
_release = release


def dflash2_problem(config: SpecConfig, draft: str | None, vllm_version: str | None) -> str | None:
    """Why ``config`` (method dflash2) cannot run on this vLLM / draft, or None. An unknown
    vLLM version (not installed in this interpreter) is left to the worker."""
    if config.method != "dflash2":
        return None
    if vllm_version and _release(vllm_version) < DFLASH2_MIN_VLLM:
        return (f"DFlash2 needs vLLM ≥ {'.'.join(map(str, DFLASH2_MIN_VLLM))}; this is "
                f"{vllm_version}. Install vLLM 0.28 or later (it needs torch ≥ 2.13), or run "
                f"--method dflash with a DFlash (v1) draft.")
    if draft:
        try:
            arch = json.loads((Path(draft) / "config.json").read_text()).get("architectures")
        except (OSError, ValueError):
            arch = None
        if arch != [DFLASH2_ARCHITECTURE]:
            return (f"--method dflash2 needs a DFlash2 draft (config.json architectures "
                    f"[\"{DFLASH2_ARCHITECTURE}\"]); {draft} says {arch}: vLLM would run it as "
                    f"plain DFlash. Export one with `speccheck export-reference DIR` (DIR/dflash2).")
    return None


_OFF = ("0", "false", "no", "off", "")


def combination_problem(config: SpecConfig, draft: str | None, vllm_version: str | None,
                        env_args: dict[str, str], llm_kwargs: dict) -> str | None:
    """Why this vLLM cannot run ``config`` with these settings (version table), or None: a vLLM
    older than the table; DFlash2 before its release, with a DFlash (v1) draft, or with the V2
    model runner switched off (vLLM would draft it as DFlash, silently); a kernel switch this
    vLLM does not have (it would be ignored, and attribution would name a path that never
    ran). An unknown version (vLLM not in this interpreter) is checked for what needs none."""
    problem = version_problem(vllm_version) or dflash2_problem(config, draft, vllm_version)
    if problem:
        return problem
    rel = release_entry(vllm_version)
    if config.method == "dflash2":
        v2 = env_args.get(rel.v2_runner_env)
        if v2 is not None and str(v2).strip().lower() in _OFF:
            return (f"--engine-arg env.{rel.v2_runner_env}={v2}: DFlash2 runs only in vLLM's V2 model "
                    f"runner; the V1 runner would load the DFlash2 draft and draft as DFlash (its "
                    f"candidate selector never called). Drop that switch.")
    if vllm_version is None:
        return None
    name = ".".join(map(str, release(vllm_version)))
    newest_gdn_env = release_entry().gdn_decode_kernel_env
    if newest_gdn_env and newest_gdn_env in env_args and rel.gdn_decode_kernel_env is None:
        return (f"--engine-arg env.{newest_gdn_env}=...: vLLM {name} has no such switch (it came with "
                f"{'.'.join(map(str, DFLASH2_MIN_VLLM))}); it would be ignored.")
    gdn = requested_gdn_prefill(llm_kwargs)
    if gdn != "auto" and gdn not in rel.gdn_prefill_backends:
        return (f"GDN prefill backend {gdn!r}: vLLM {name} offers {', '.join(rel.gdn_prefill_backends)}")
    return None


def dflash2_identity(drafter: dict | None, vllm_version: str | None) -> dict | None:
    """The proof that a DFlash2 config ran as DFlash2, from the drafter the worker read back
    (vllm_worker.drafter_facts), for the identity's ``dflash2`` (judged by the dflash2_facts
    check): the selector counts as on only where the V2 model runner built this release's
    DFlash2 speculator (the one whose drafting calls the candidate selector) over a draft
    model that has a selector with a top-k. None where nothing was read back."""
    if not drafter:
        return None
    rel = release_entry(vllm_version)
    cls = str(drafter.get("drafter_class") or "")
    on = bool(drafter.get("model_runner_v2") and rel.dflash2_speculator
              and cls.rsplit(".", 1)[-1] == rel.dflash2_speculator
              and drafter.get("candidate_selector") and drafter.get("selector_top_k"))
    return {"selector": "on" if on else "off", "top_k": drafter.get("selector_top_k"),
            "model_runner": drafter.get("model_runner"),
            "model_runner_v2": bool(drafter.get("model_runner_v2")),
            "drafter_class": drafter.get("drafter_class"), "draft_class": drafter.get("draft_class"),
            "expected_draft_class": rel.dflash2_draft_class,
            "architectures": drafter.get("architectures"),
            "draft_block": drafter.get("draft_block"), "trained_block": drafter.get("trained_block"),
            "read_back": "vLLM model runner"}


def dflash_block_size(draft: str | None) -> int | None:
    """``dflash_config.block_size`` of a DFlash draft checkpoint (None when absent)."""
    if not draft:
        return None
    path = Path(draft) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    block = (cfg.get("dflash_config") or {}).get("block_size", cfg.get("block_size"))
    return int(block) if block else None


def k_hint_note(config: SpecConfig, draft: str | None) -> str | None:
    """A warning when a dflash K is not block_size - 1 (what the drafter was trained for)."""
    if config.method not in ("dflash", "dflash2"):
        return None
    block = dflash_block_size(draft)
    if block and config.k != block - 1:
        return (f"{config.method} K={config.k} but the drafter's dflash_config.block_size is {block}: "
                f"it was trained for K={block - 1}")
    return None


# ---------------------------------------------------------------- pure: dicts -> types

def _ranked(pos: dict[str, dict]) -> list[tuple[int, float]]:
    """(token id, logprob) of one position, best first; exact ties by lowest token id.

    Not by vLLM's ``rank``: on exact (bf16) ties its top-k order is arbitrary, while its
    greedy sampler takes the first maximum (``argmax``: the lowest id). Seen on the H200:
    three tokens tied at -3.12999, top-k listed 3895, 3023, 312 and greedy chose 312."""
    return canonical_topk((int(t), float(v["logprob"])) for t, v in pos.items())


def topk_arrays(positions: Sequence[dict[str, dict]], chosen: Sequence[int],
                top_k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per position: the top-k ids/logprobs (padded with -1 / -inf when vLLM returned
    fewer) and the chosen token's own logprob (vLLM always includes it)."""
    n = len(chosen)
    ids = np.full((n, top_k), -1, dtype=np.int32)
    lps = np.full((n, top_k), -np.inf, dtype=np.float32)
    own = np.full(n, np.nan, dtype=np.float32)
    if len(positions) < n:
        raise EngineError(f"vLLM returned logprobs for {len(positions)} of {n} positions")
    for i, (pos, tok) in enumerate(zip(positions, chosen)):
        ranked = _ranked(pos or {})
        for j, (t, lp) in enumerate(ranked[:top_k]):
            ids[i, j], lps[i, j] = t, lp
        entry = (pos or {}).get(str(int(tok)))
        if entry is None:
            raise EngineError(f"vLLM's logprobs at position {i} lack the chosen token {tok}")
        own[i] = entry["logprob"]
    return ids, lps, own


def _metric_sum(rows: list[dict], name: str) -> int | list[int]:
    """Sum of one counter (or vector) over its label sets (engines, models)."""
    total: Any = None
    for r in rows:
        if r["name"] not in (name, name + "_total"):
            continue
        if "values" in r:
            v = [int(x) for x in r["values"]]
            total = v if total is None else [a + b for a, b in
                                              zip(total + [0] * (len(v) - len(total)),
                                                  v + [0] * (len(total) - len(v)))]
        else:
            total = (total or 0) + int(r["value"])
    if total is None:
        return [] if name.endswith("per_pos") else 0
    return total


def spec_counters_delta(before: list[dict], after: list[dict]) -> SpecCounters:
    """Spec counters of what ran between two ``get_metrics()`` snapshots."""
    vals = {}
    for field, name in SPEC_NAMES.items():
        a, b = _metric_sum(after, name), _metric_sum(before, name)
        if isinstance(a, list):
            b = list(b) + [0] * (len(a) - len(b))
            vals[field] = [x - y for x, y in zip(a, b)]
        else:
            vals[field] = a - b
    return SpecCounters(vals["drafts"], vals["draft_tokens"], vals["accepted_tokens"],
                        vals["accepted_per_pos"])


def sample_groups(prompt_ids: Sequence[Sequence[int]], max_tokens: Sequence[int],
                  ignore_eos: Sequence[bool], seeds: Sequence[int] | None) -> list[tuple[int, int]]:
    """(first, n) of each run of consecutive requests that goes to vLLM as ONE request of n
    samples: the same prompt ids, budget and ignore_eos, and seeds s, s + 1, ... (vLLM seeds
    the j-th of n samples of a request seeded s with s + j, parallel_sampling.ParentRequest;
    types.request_seed gives the samples of one prompt exactly those). Greedy: each alone."""
    groups: list[tuple[int, int]] = []
    for i in range(len(prompt_ids)):
        if groups and seeds is not None:
            first, n = groups[-1]
            if (list(prompt_ids[i]) == list(prompt_ids[first]) and max_tokens[i] == max_tokens[first]
                    and bool(ignore_eos[i]) == bool(ignore_eos[first])
                    and seeds[i] == seeds[first] + n):
                groups[-1] = (first, n + 1)
                continue
        groups.append((i, 1))
    return groups


def has_spec_metrics(rows: list[dict]) -> bool:
    return any(r["name"] in (SPEC_NAMES["drafts"], SPEC_NAMES["drafts"] + "_total") for r in rows)


def request_spec_counters(m: dict) -> SpecCounters:
    """A request's own counters from vLLM's per-request histogram (``histogram[j]``: its verify
    steps that accepted j drafts; ``num_draft_tokens``: drafts proposed): drafts = steps,
    accepted = sum of j x steps, and position i accepted on every step that kept more than i."""
    h = [int(x) for x in m["histogram"]]
    k = int(m.get("num_spec_tokens") or len(h) - 1)
    return SpecCounters(sum(h), int(m["num_draft_tokens"]), sum(j * n for j, n in enumerate(h)),
                        [sum(h[j] for j in range(i + 1, len(h))) for i in range(k)])


def completion_from_dict(prompt_id: str, row: dict, top_k: int, spec: bool,
                         index: int = 0) -> Completion:
    """One worker row (``request_output_to_dict`` + timings + metric snapshots) -> Completion
    of its output ``index`` (the j-th of a request's n samples)."""
    out = row["output"]
    c = next((o for o in out["outputs"] if int(o.get("index", 0)) == index), None)
    if c is None:
        raise EngineError(f"vLLM returned {len(out['outputs'])} outputs, none with index {index}")
    tokens = c["token_ids"]
    if c.get("logprobs") is None:
        raise EngineError("vLLM returned no logprobs although logprobs were requested")
    ids, lps, own = topk_arrays(c["logprobs"], tokens, top_k)
    m = out.get("metrics") or {}
    ttft = float(m.get("first_token_latency") or 0.0)
    if m.get("last_token_ts") and m.get("first_token_ts"):
        decode_s = float(m["last_token_ts"] - m["first_token_ts"])
    else:  # no per-request stats: the whole call minus time to first token
        decode_s = max(0.0, float(row.get("wall_s", 0.0)) - ttft)
    counters = None
    if spec and c.get("spec_decode_metrics"):  # its own, whatever shared its steps (vLLM >= 0.33)
        counters = request_spec_counters(c["spec_decode_metrics"])
    elif spec and has_spec_metrics(row.get("metrics_after") or []):
        counters = spec_counters_delta(row.get("metrics_before") or [], row["metrics_after"])
    return Completion(
        prompt_id=prompt_id, prompt_ids=out["prompt_token_ids"], token_ids=tokens,
        logprobs=own, topk_ids=ids, topk_logprobs=lps, text=c.get("text") or "",
        finish_reason=c.get("finish_reason") or "length", ttft_s=ttft, decode_s=decode_s,
        spec=counters)


def scored_from_dict(row: dict, prompt_len: int, top_k: int) -> Scored:
    """Prompt logprobs of ``prompt + continuation`` -> the continuation's Scored.

    vLLM's ``prompt_logprobs[i]`` is the distribution of token i given tokens < i, with
    None at i = 0; the continuation's positions are ``prompt_len ..``."""
    out = row["output"]
    full = out["prompt_token_ids"]
    plp = out.get("prompt_logprobs")
    if plp is None or len(plp) != len(full):
        raise EngineError(f"vLLM returned {0 if plp is None else len(plp)} prompt logprobs "
                          f"for {len(full)} prompt tokens")
    cont = full[prompt_len:]
    ids, lps, own = topk_arrays(plp[prompt_len:], cont, top_k)
    return Scored(topk_ids=ids, topk_logprobs=lps, token_logprobs=own)


# ---------------------------------------------------------------- pure: workload axes

def workload_llm_kwargs(knobs: dict[str, str]) -> dict[str, Any]:
    """A workload's knobs -> the LLM(...) arguments they set (WORKLOAD_KNOBS); an unknown knob
    or a bad value is refused, never dropped (the axis would run without its regime)."""
    out: dict[str, Any] = {}
    for key, raw in knobs.items():
        value = str(raw).strip().lower()
        if key in ("prefix_cache", "async_scheduling", "cudagraph_metrics"):
            if value not in ("on", "off"):
                raise EngineUsageError(f"workload knob {key}={raw}: use on or off")
            out[WORKLOAD_KNOBS[key]] = value == "on"
        elif key == "kv_blocks":
            n = int(value) if value.isdigit() else 0
            if n < 1:
                raise EngineUsageError(f"workload knob kv_blocks={raw}: give a whole number of KV "
                                       "cache blocks >= 1")
            out[WORKLOAD_KNOBS[key]] = n
        else:
            raise EngineUsageError(f"workload knob {key}={raw}: the vllm engine knows "
                                   f"{', '.join(sorted(WORKLOAD_KNOBS))}")
    return out


def workload_problem(workload: Workload) -> str | None:
    """Why the worker could not serve ``workload`` as asked, or None: request ids must be
    unique (each names its completion) and a turn's ``after`` must name a request of it."""
    ids = [r.id for r in workload.requests]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        return f"the {workload.axis} workload names requests twice: {', '.join(dup[:5])}"
    missing = sorted({r.after for r in workload.requests if r.after and r.after not in ids})
    if missing:
        return f"the {workload.axis} workload orders requests after ones it lacks: {', '.join(missing[:5])}"
    if workload.max_in_flight is not None and workload.max_in_flight < 1:
        return f"the {workload.axis} workload allows {workload.max_in_flight} requests in flight"
    return None


def has_metric(rows: list[dict], name: str) -> bool:
    """Whether a ``get_metrics()`` snapshot reports ``name`` at all."""
    return any(r["name"] in (name, name + "_total") for r in rows)


def metric_delta(before: list[dict], after: list[dict], name: str) -> int | None:
    """``after - before`` of a counter, summed over its label sets; None where ``after`` does
    not report it (this vLLM keeps no such count: the proof key is then absent, never 0)."""
    if not has_metric(after, name):
        return None
    return int(_metric_sum(after, name)) - int(_metric_sum(before, name))


def workload_proof(stats: dict, version: str | None = None) -> dict[str, Any]:
    """The proof of a served workload, from the worker's ``stats`` (serve_workload): its
    ``get_metrics()`` before and after (names by ``version``, METRIC_NAMES), the largest
    value of each gauge sampled after every engine step, and what the step loop saw.

    - ``max_batch``: the most requests running in one step -- the ``requests_running`` gauge
      (vLLM sets it at every step from the scheduler's running queue) at its peak over the
      steps; where vLLM reports no such gauge, the most unfinished requests
      (``LLMEngine.get_num_unfinished_requests()``) before a step, which also counts queued
      ones. ``max_batch_from`` names which.
    - ``mixed_steps``: steps whose outputs gave one request its first token (its prefill
      ended there) and another, which had tokens before, more (it decoded in the same step).
    - ``prefix_hits`` / ``prefix_queries``: prompt tokens found in / looked up in the prefix
      cache (counter differences); ``preemptions``: requests preempted (counter difference).
      Each absent where vLLM does not report the counter.
    - ``requests_served``, ``steps``: finished requests and engine steps of the loop.
    - ``async_scheduling``: 1 where vLLM resolved ``scheduler_config.async_scheduling`` on, 0
      where off (asked or not); ``steps_scheduled_ahead``: steps after which the engine core
      still held a batch in flight (its ``batch_queue``: the next step was scheduled before
      this one's output was processed). Absent where not read back.
    - ``chat_rendered`` / ``thinking_prompts``: prompts the worker rendered through the chat
      template, and of those the ones rendered in thinking mode (base.rendered_thinking).
    - ``preempted_requests``: the requests the engine core's step outputs carried a PREEMPTED
      event for (vllm_worker.StepTap; vLLM records one per preemption with stats on), where
      vLLM counts preemptions or named one; run_workload adds those whose
      ``RequestOutput.metrics.num_preemptions`` (vLLM >= 0.33) is above 0.
    - with ``cudagraph_metrics``: graph_proof."""
    names = metric_names(version)
    before, after = stats.get("metrics_before") or [], stats.get("metrics_after") or []
    proof: dict[str, Any] = {"requests_served": int(stats["requests_served"]),
                             "steps": int(stats["steps"]), "mixed_steps": int(stats["mixed_steps"])}
    running = names["requests_running"]
    peak = (stats.get("step_max") or {}).get(running)
    if peak is not None:
        proof["max_batch"], proof["max_batch_from"] = int(peak), running
    elif stats.get("max_unfinished") is not None:
        proof["max_batch"] = int(stats["max_unfinished"])
        proof["max_batch_from"] = "unfinished requests"
    for key, metric in (("prefix_hits", "prefix_cache_hits"), ("prefix_queries", "prefix_cache_queries"),
                        ("preemptions", "preemptions")):
        delta = metric_delta(before, after, names[metric])
        if delta is not None:
            proof[key] = delta
    if stats.get("async_scheduling") is not None:
        proof["async_scheduling"] = int(bool(stats["async_scheduling"]))
    for key in ("steps_scheduled_ahead", "chat_rendered", "thinking_prompts"):
        if stats.get(key) is not None:
            proof[key] = int(stats[key])
    if stats.get("step_tap") and ("preemptions" in proof or stats.get("preempted")):
        proof["preempted_requests"] = sorted(stats.get("preempted") or ())
        proof["preempted_from"] = "engine core events (PREEMPTED)"
    if "capture_sizes" in stats:
        proof.update(graph_proof(stats))
    return proof


def graph_proof(stats: dict) -> dict[str, Any]:
    """The shapes axis's batch proof from a workload served with ``cudagraph_metrics``: the
    capture sizes vLLM resolved (tokens) and the tokens a request feeds a uniform step; the
    batch sizes scheduled (the scheduler's running requests after each step); per step that reported a CUDA-graph stat, whether it replayed a
    graph (``graph_steps``), was padded up to one (``padded_steps``) or ran without one
    (``eager_steps``: mode NONE). The step keys are absent where no step reported a stat
    (cudagraph_metrics not taken, or the steps not read): the level is then not exercised."""
    out: dict[str, Any] = {"capture_sizes": [int(x) for x in stats["capture_sizes"]],
                           "tokens_per_request": int(stats.get("tokens_per_request") or 1)}
    if stats.get("cudagraph_mode") is not None:
        out["cudagraph_mode"] = str(stats["cudagraph_mode"])
    running = [int(n) for n in stats.get("step_running") or () if int(n) > 0]
    if running:
        out["batch_sizes"] = sorted(set(running))
    graphs = stats.get("step_graphs") or []
    if graphs:
        eager = [g for g in graphs if "NONE" in str(g[2]).upper()]
        out["graph_steps"] = len(graphs) - len(eager)
        out["eager_steps"] = len(eager)
        out["padded_steps"] = sum(1 for g in graphs if g not in eager and int(g[1]) > int(g[0]))
    return out


def workload_speculated(config: SpecConfig, stats: dict, comps: list[Completion]) -> SpecCounters:
    """The spec counters of a whole workload (requests in flight together share vLLM's
    counters); an EngineError where they show no drafting (see check_speculated)."""
    before, after = stats.get("metrics_before") or [], stats.get("metrics_after") or []
    if not has_spec_metrics(after):
        raise EngineError(f"{config.name}: vLLM reported no spec-decode counters "
                          "(vllm:spec_decode_*) over the workload, so speculation cannot be confirmed")
    total = spec_counters_delta(before, after)
    generated = sum(c.n_tokens for c in comps)
    if total.drafts == 0 and generated > len(comps):
        raise EngineError(f"{config.name} did not speculate over the workload: vLLM's counters show 0 "
                          f"drafts over {generated} generated tokens ({SPEC_NAMES['drafts']})")
    return total


# ---------------------------------------------------------------- pure: kernel paths

def requested_gdn_prefill(llm_kwargs: dict) -> str:
    """The GDN prefill backend asked for: the ``gdn_prefill_backend`` engine arg (vLLM 0.26
    copies it into additional_config), else ``additional_config["gdn_prefill_backend"]``,
    else "auto" (vLLM's own choice: FlashInfer on SM90)."""
    if llm_kwargs.get("gdn_prefill_backend"):
        return str(llm_kwargs["gdn_prefill_backend"]).lower()
    add = llm_kwargs.get("additional_config")
    if isinstance(add, dict) and add.get("gdn_prefill_backend"):
        return str(add["gdn_prefill_backend"]).lower()
    return "auto"


def gdn_prefill_args(llm_kwargs: dict, backend: str) -> dict[str, str]:
    """Engine args that select GDN prefill ``backend``, through ``additional_config`` (read
    by every version that has the switch), keeping the user's other additional_config keys."""
    add = llm_kwargs.get("additional_config")
    add = dict(add) if isinstance(add, dict) else {}
    add["gdn_prefill_backend"] = backend
    out = {"additional_config": json.dumps(add, sort_keys=True)}
    if llm_kwargs.get("gdn_prefill_backend"):  # the engine arg would win over additional_config
        out["gdn_prefill_backend"] = backend
    return out


def attribution_variants(current: dict, configs: Sequence[SpecConfig] = ()) -> dict[str, dict[str, str]]:
    """Label -> engine args of every vLLM 0.26 switch that changes which kernel computes a
    position, each only where it differs from ``current`` (resolved settings: keys
    attention_backend, gdn_prefill_backend, enforce_eager, packed_decode, capability,
    flashinfer_available; None where unknown).

    ``decode ...`` and ``verify CONFIG`` score the divergent position with one generated
    step (score_path, see VllmEngine.score); ``prefill ...`` with prompt_logprobs."""
    v: dict[str, dict[str, str]] = {}
    eager = bool(current.get("enforce_eager"))
    v["decode"] = {"score_path": "decode"}
    if current.get("packed_decode", True):
        v["decode gdn=fused_sigmoid_gating"] = {"score_path": "decode",
                                                f"env.{PACKED_DECODE_ENV}": "0"}
    else:
        v["decode gdn=packed_recurrent"] = {"score_path": "decode", f"env.{PACKED_DECODE_ENV}": "1"}
    v["decode eager" if not eager else "decode cudagraphs"] = {
        "score_path": "decode", "enforce_eager": "false" if eager else "true"}
    for c in configs:
        if not c.is_baseline:
            v[f"verify {c.name}"] = {"score_path": "verify", "score_spec": c.name}
            if current.get("gdn_decode_kernel_setting") == "cuda":  # vLLM >= 0.28
                v[f"verify {c.name} gdn=triton"] = {"score_path": "verify", "score_spec": c.name,
                                                    f"env.{GDN_DECODE_KERNEL_ENV}": "triton"}
    llm = current.get("llm_kwargs") or {}
    gdn = current.get("gdn_prefill_backend")
    if gdn and gdn != "triton":
        v["prefill gdn=triton"] = gdn_prefill_args(llm, "triton")
    elif gdn == "triton" and current.get("flashinfer_available") and \
            str(current.get("capability")) == "9.0":  # vLLM 0.26 uses FlashInfer's GDN on SM90 only
        v["prefill gdn=flashinfer"] = gdn_prefill_args(llm, "flashinfer")
    attn = current.get("attention_backend")
    for name in ATTENTION_BACKENDS:
        if attn and name not in attn.split("+") and (
                name != "FLASHINFER" or current.get("flashinfer_available")):
            v[f"prefill attention={name}"] = {"attention_backend": name}
    v["prefill eager" if not eager else "prefill cudagraphs"] = {
        "enforce_eager": "false" if eager else "true"}
    return v


def rerun_switches(variants: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """``attribution_variants`` without their score paths: label -> whole-run engine args."""
    out: dict[str, dict[str, str]] = {}
    seen: set[tuple] = set()
    for label, args in variants.items():
        if args.get("score_path") == "verify":
            continue
        run_args = {k: v for k, v in args.items() if k not in ("score_path", "score_spec")}
        key = tuple(sorted(run_args.items()))
        if run_args and key not in seen:
            seen.add(key)
            out[label] = run_args
    return out


def padded_decode_switches(current: dict) -> dict[str, dict[str, str]]:
    """Whole-run switches that make a baseline's one-token steps compute as a spec verify step
    does, part by part, each alone and with the GDN kernel a verify runs (fused sigmoid
    gating, where packed decode is on):

    - ``decode batch=2``: one copy beside each request (pad_batch=1), so every GEMM and the
      LM head run with 2 rows, as an MTP K=1 verify's; cuBLAS picks its kernel (split-K or
      not) by the row count, and a bf16 logit one ulp off flips an exact tie;
    - ``decode attention=2d`` (TRITON_ATTN only): the batch padded past the 3D split-softmax
      threshold, so decode attention runs the 2D kernel every verify step runs (its GEMMs
      then have 1 + PAD_FOR_2D rows)."""
    pads = {"decode batch=2": 1}
    if "TRITON_ATTN" in str(current.get("attention_backend") or ""):
        pads["decode attention=2d"] = PAD_FOR_2D
    out: dict[str, dict[str, str]] = {}
    for label, pad in pads.items():
        out[label] = {"pad_batch": str(pad)}
        if current.get("packed_decode", True):
            gdn = label.replace("decode", "decode gdn=fused_sigmoid_gating", 1)
            out[gdn] = {"pad_batch": str(pad), f"env.{PACKED_DECODE_ENV}": "0"}
    return out


def step_inputs(prompt_ids: Sequence[Sequence[int]],
                continuations: Sequence[Sequence[int]]) -> list[list[int] | None]:
    """For score paths decode/verify: the input that makes the continuation's last position
    the second generated token (prompt + all but the last two continuation tokens); None for
    a continuation of one token (its only position comes from prefill on every path)."""
    return [list(map(int, p)) + list(map(int, c[:-2])) if len(c) >= 2 else None
            for p, c in zip(prompt_ids, continuations)]


def scored_from_steps(row: dict | None, continuation: Sequence[int], top_k: int) -> Scored:
    """Two generated steps -> Scored of the continuation with only its last two positions
    known (-1 / -inf / NaN elsewhere): the second-to-last from prefill, the last from the
    decode or verify step -- known only if the first step reproduced the continuation's
    token there (otherwise the step did not see the prefix it was asked about)."""
    n = len(continuation)
    ids = np.full((n, top_k), -1, dtype=np.int32)
    lps = np.full((n, top_k), -np.inf, dtype=np.float32)
    own = np.full(n, np.nan, dtype=np.float32)
    if row is None or n < 2:
        return Scored(topk_ids=ids, topk_logprobs=lps, token_logprobs=own)
    c = row["output"]["outputs"][0]
    toks, positions = c["token_ids"], c.get("logprobs") or []
    known = [n - 2] + ([n - 1] if len(toks) >= 2 and len(positions) >= 2
                       and int(toks[0]) == int(continuation[n - 2]) else [])
    for j, pos in enumerate(known):
        if j >= len(positions):
            break
        for r, (t, lp) in enumerate(_ranked(positions[j] or {})[:top_k]):
            ids[pos, r], lps[pos, r] = t, lp
        entry = (positions[j] or {}).get(str(int(continuation[pos])))
        if entry is not None:
            own[pos] = entry["logprob"]
    return Scored(topk_ids=ids, topk_logprobs=lps, token_logprobs=own)


# ---------------------------------------------------------------- files and hashes

def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def weights_sha256(model_dir: str) -> str | None:
    """One sha256 over the checkpoint's safetensors files (names and contents, sorted)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + file_sha256(f).encode() + b"\n")
    return h.hexdigest()


def model_name(model_dir: str, config: dict, llm_kwargs: dict) -> str:
    """What the model is called: ``served_model_name`` where given (as vLLM's server names it),
    else the name its checkpoint declares (``speccheck.model_name`` of config.json, written by
    ``speccheck export-reference``; a plain relative ``_name_or_path`` such as a hub id), else
    its directory's name. A golden's folder carries it, so a checkpoint exported to a
    temporary directory still finds its golden."""
    served = llm_kwargs.get("served_model_name")
    if isinstance(served, (list, tuple)) and served:
        served = served[0]
    declared = (config.get("speccheck") or {}).get("model_name") if isinstance(config.get("speccheck"), dict) else None
    hub = config.get("_name_or_path")
    for name in (served, declared, hub if isinstance(hub, str) and not hub.startswith(("/", ".", "~")) else None):
        if isinstance(name, str) and name.strip():
            return name.strip()
    return Path(model_dir).name


def eos_token_ids(model_dir: str) -> list[int]:
    """EOS ids from generation_config.json, else config.json (or its text_config)."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        try:
            cfg = json.loads((Path(model_dir) / name).read_text())
        except (OSError, ValueError):
            continue
        for c in (cfg, cfg.get("text_config") or {}):
            v = c.get("eos_token_id")
            if v is not None:
                ids += [v] if isinstance(v, int) else list(v)
        if ids:
            break
    return sorted(set(int(i) for i in ids))


def _read_config(model_dir: str) -> dict:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise EngineUsageError(f"{model_dir}/config.json: unreadable ({e}); give a local Hugging "
                               "Face checkpoint directory") from e


def visible_gpu_count() -> int | None:
    """GPUs a worker started from here may use: nvidia-smi's list narrowed by
    CUDA_VISIBLE_DEVICES (None: no nvidia-smi and no CUDA_VISIBLE_DEVICES to tell)."""
    return visible_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), physical_gpu_count())[0]


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


# ---------------------------------------------------------------- preflight: is vLLM there?

#: seconds ``PYTHON -c "import vllm"`` may take before a run; a slower import is let through
#: (it is slow, not absent; the worker has its own timeout_s)
IMPORT_CHECK_S = 60
_import_problems: dict[tuple, str | None] = {}


def worker_env(env_args: dict[str, str], method_env: dict | None = None) -> dict[str, str]:
    """The worker's environment: ours, DEFAULT_ENV, what the method needs, then --engine-arg
    env.* (which wins), and speccheck on PYTHONPATH."""
    env = dict(os.environ)
    for k, v in DEFAULT_ENV.items():
        env.setdefault(k, v)
    env.update(method_env or {})
    env.update(env_args)
    root = str(Path(__file__).resolve().parents[2])  # so the worker imports speccheck
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def vllm_import_problem(python: str | None, env_args: dict[str, str]) -> str | None:
    """Why the worker's interpreter (``python``, else this one) cannot import vllm, or None.
    This interpreter finding vllm is enough (no import: torch stays unloaded); otherwise, and
    for another interpreter, ``PYTHON -c "import vllm"`` runs in the worker's environment
    (its PYTHONPATH may hold vLLM), once per interpreter and environment."""
    env = worker_env(env_args)
    key = (python, tuple(sorted(env.items())))
    if key in _import_problems:
        return _import_problems[key]
    problem: str | None = None
    if python or importlib.util.find_spec("vllm") is None:
        exe = python or sys.executable
        try:
            r = subprocess.run([exe, "-c", "import vllm"], env=env,
                               capture_output=True, text=True, timeout=IMPORT_CHECK_S)
        except subprocess.TimeoutExpired:
            pass
        except OSError as e:
            problem = f"cannot run {exe}: {e.strerror or e}"
        else:
            if r.returncode != 0:
                lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
                problem = lines[-1].strip() if lines else f"exit code {r.returncode}"
    _import_problems[key] = problem
    return problem


# ---------------------------------------------------------------- the engine

class VllmEngine(Engine):
    name = "vllm"
    fresh_process_per_config = True
    methods = None  # mtp, dflash, and whatever else vLLM's speculative_config takes

    @classmethod
    def preflight(cls, model: str | None, engine_args: dict[str, str],
                  draft: str | None) -> None:
        """The arguments (checkpoint, draft, layout: the engine made and closed, no worker
        started), then vLLM importable by the interpreter the worker will run under, else
        nothing can run: said once, before any run (not once per config, as each worker
        would)."""
        cls(model, engine_args, draft).close()
        args = split_engine_args(engine_args)
        python = args["own"].get("python")
        exe = shutil.which(str(python)) if python else None
        if python and not (exe and os.path.isfile(exe)):
            raise EngineUsageError(
                f"--engine-arg python={python}: no executable there; give the path of the Python "
                "interpreter the vLLM worker should run under (one that can import vllm), or "
                "drop it to use this one.")
        problem = vllm_import_problem(str(python) if python else None, args["env"])
        if problem is None:
            return
        if python:
            raise EngineUsageError(
                f"the vllm engine runs its worker under {python} (--engine-arg python=), and "
                f"that interpreter cannot import vLLM ({problem}). Install it there "
                f"(`{python} -m pip install vllm==0.26.0`, the version golden/vllm/ was "
                "recorded with), or point --engine-arg python= at an interpreter that has "
                "vLLM, or drop it to use this one.")
        raise EngineUsageError(
            f"the vllm engine needs vLLM, and this Python ({sys.executable}) cannot import it "
            f"({problem}). Install it into this environment with `pip install vllm==0.26.0` "
            "(the version golden/vllm/ was recorded with; it needs a CUDA GPU), or, if vLLM "
            "is installed in another environment, run the engine's worker there with "
            "--engine-arg python=/path/to/that/python.")

    def __init__(self, model: str | None = None, engine_args: dict[str, str] | None = None,
                 draft: str | None = None) -> None:
        super().__init__(model, engine_args, draft)
        if not model:
            raise EngineUsageError("the vllm engine needs --model PATH (a local Hugging Face "
                                   "checkpoint directory, e.g. one written by "
                                   "`speccheck export-reference DIR`)")
        if not (Path(model) / "config.json").is_file():
            raise EngineUsageError(f"--model {model}: no config.json there; give a local "
                                   "Hugging Face checkpoint directory")
        if draft and not (Path(draft) / "config.json").is_file():
            raise EngineUsageError(f"--draft {draft}: no config.json there; give a local "
                                   "draft checkpoint directory")
        self.model = str(Path(model).resolve())
        self.draft = str(Path(draft).resolve()) if draft else None
        self.args = split_engine_args(self.engine_args)
        self.attribution_jobs = self.args["own"].get("attribution_jobs", 1)
        self.llm_kwargs = {**DEFAULT_LLM_KWARGS, **self.args["llm"]}
        score_k = self.args["own"].get("score_top_k", 20)
        if isinstance(score_k, bool) or not isinstance(score_k, int) or score_k < 1:
            raise EngineUsageError(f"--engine-arg score_top_k={score_k}: give a whole number >= 1")
        if score_k > 20 and "max_logprobs" not in self.llm_kwargs:
            self.llm_kwargs["max_logprobs"] = score_k
        problem = parallel_problem(self.llm_kwargs, _read_config(self.model), self.model,
                                   _read_config(self.draft) if self.draft else None, self.draft,
                                   None if self._world_size() == 1 else visible_gpu_count(),
                                   self.args["spec"])
        if problem:
            raise EngineUsageError(problem)
        self._tokenizer = None
        self._runtime: dict = {}
        self._ran: dict = {}  # the last generate()/run_workload(): its method, drafter read back
        self._backend_log: list[str] = []
        self._notes: list[str] = []
        self._worker: subprocess.Popen | None = None
        self._worker_key: str | None = None
        self._parked: tuple | None = None  # (process, key, log) of an idle baseline worker
        self._tmp_dir: Path | None = None  # made at the first call (_tmp)
        self._calls = 0
        self.last_call_fresh_process = True
        self._static_identity: dict | None = None

    @property
    def _tmp(self) -> Path:
        """The folder of the requests and worker logs, made at the first call (an engine that
        only checks its arguments or names itself leaves nothing) and removed by close(), or,
        for one never closed, when it is collected or the process exits."""
        if self._tmp_dir is None:
            self._tmp_dir = Path(tempfile.mkdtemp(prefix="speccheck-vllm-"))
            self._tmp_removal = weakref.finalize(self, shutil.rmtree, self._tmp_dir, True)
        return self._tmp_dir

    def gpus(self) -> int:
        """TP x PP: every rank a GPU of its own, on one node (the mp executor in one worker)."""
        return max(self._world_size(), 1)

    def _world_size(self) -> int:
        """TP x PP as asked (parallel_problem has checked they are positive ints, or will)."""
        try:
            return (parallel_size(self.llm_kwargs, "tensor_parallel_size")
                    * parallel_size(self.llm_kwargs, "pipeline_parallel_size"))
        except (TypeError, ValueError):
            return 0

    # -- tokenizer

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            path = Path(self.model) / "tokenizer.json"
            if path.is_file():
                from tokenizers import Tokenizer
                self._tokenizer = ("tokenizers", Tokenizer.from_file(str(path)))
            else:
                try:
                    from transformers import AutoTokenizer
                    tok = AutoTokenizer.from_pretrained(self.model, local_files_only=True)
                except Exception as e:  # noqa: BLE001
                    raise EngineUsageError(f"--model {self.model}: no tokenizer.json and "
                                           f"transformers could not load one ({e})") from e
                self._tokenizer = ("transformers", tok)
        return self._tokenizer

    def tokenize(self, prompt: Prompt) -> list[int]:
        kind, tok = self.tokenizer
        text = prompt.as_text()
        return list(tok.encode(text).ids) if kind == "tokenizers" else list(tok.encode(text))

    def detokenize(self, ids: Sequence[int]) -> str:
        kind, tok = self.tokenizer
        ids = [int(i) for i in ids]
        return tok.decode(ids, skip_special_tokens=False) if kind == "tokenizers" else tok.decode(ids)

    # -- identity

    def identity(self) -> dict:
        """What ran, as of the last generate()/score() call: the kernels vLLM chose, the GPU
        and the K note are only known once a worker has run, so call it after generate()."""
        if self._static_identity is None:
            self._static_identity = self._make_static_identity()
        ident = dict(self._static_identity)
        rt = self._runtime
        for key in ("vllm_version", "torch", "cuda", "gpu", "gpu_count", "capability", "driver",
                    *RESOLVED_KERNEL_KEYS, "kernels_read_back", "kernel_probe_error",
                    "attention_backend_requested", "gdn_prefill_backend_requested",
                    "prefix_caching", "flashinfer_available", "gdn_decode_kernel_setting",
                    *PARALLEL_KEYS):
            if rt.get(key) is not None:
                ident[key] = rt[key]
        if rt.get("dtype"):
            ident["dtype"] = rt["dtype"]
        if rt.get("env"):
            ident["env"] = {**rt["env"], **ident["env"]}
        if rt.get("vllm_version"):
            ident["version"] = rt["vllm_version"]
        if rt.get("gpu"):
            ident["device"] = rt["gpu"]
        if rt.get("world_size"):
            ident["gpus_used"] = rt["world_size"]
        ident["kernel_knobs"] = {
            **{key: ident.get(key) for key in RESOLVED_KERNEL_KEYS},
            **{k: v for k, v in ident["env"].items()},
        }
        drafter = self._ran.get("drafter")
        if drafter:
            ident["drafter"] = drafter
            ident["draft_class"] = drafter.get("draft_class")
            ident["draft_block"] = drafter.get("draft_block")
        if self._ran.get("method") == "dflash2":
            ident["dflash2"] = dflash2_identity(drafter, self._ran.get("vllm_version"))
        series = golden_series(rt.get("vllm_version") or ident.get("vllm_version"))
        if series:
            ident["golden_series"] = series
        ident["backend_log"] = list(self._backend_log)
        ident["notes"] = list(self._notes)
        return ident

    def _make_static_identity(self) -> dict:
        def version(dist: str) -> str | None:
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                return None
        tok_path = Path(self.model) / "tokenizer.json"
        cfg = json.loads((Path(self.model) / "config.json").read_text())
        text_cfg = cfg.get("text_config") or {}
        env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_")}
        env.update({k: v for k, v in self.worker_env_overrides().items() if k.startswith("VLLM_")})
        from speccheck.engines.vllm_worker import nvidia_smi_driver
        gpu = nvidia_smi_driver()  # "NAME, DRIVER" of GPU 0, or None
        return {
            "engine": "vllm",
            "version": version("vllm"),
            "vllm_version": version("vllm"),
            "torch": version("torch"),
            "model": self.model,
            "model_id": model_name(self.model, cfg, self.llm_kwargs),
            "model_hash": weights_sha256(self.model),
            "architectures": cfg.get("architectures"),
            "tokenizer_hash": file_sha256(tok_path) if tok_path.is_file() else None,
            "dtype": str(self.llm_kwargs.get("dtype") or cfg.get("dtype") or text_cfg.get("dtype")
                         or cfg.get("torch_dtype") or text_cfg.get("torch_dtype") or "auto"),
            "draft": self.draft,
            "draft_hash": weights_sha256(self.draft) if self.draft else None,
            **({"dflash2_draft_hash": weights_sha256(str(self.args["own"]["dflash2_draft"]))}
               if self.args["own"].get("dflash2_draft") else {}),
            "device": gpu.split(",")[0].strip() if gpu else None,
            "gpu_driver": gpu,
            # what was asked for; what ran (read back from the engine) replaces the None
            # entries of RESOLVED_KERNEL_KEYS once a worker has answered
            "attention_backend_requested": self.llm_kwargs.get("attention_backend") or "auto",
            "gdn_prefill_backend_requested": requested_gdn_prefill(self.llm_kwargs),
            **{key: None for key in RESOLVED_KERNEL_KEYS},
            "kernels_read_back": False,
            # the parallel layout asked for; what vLLM resolved replaces it once a worker ran
            "tensor_parallel_size": parallel_size(self.llm_kwargs, "tensor_parallel_size"),
            "pipeline_parallel_size": parallel_size(self.llm_kwargs, "pipeline_parallel_size"),
            "distributed_executor_backend": self.llm_kwargs.get("distributed_executor_backend"),
            "gpus_used": self._world_size(),
            "interconnect": None,
            "nccl_version": None,
            "llm_kwargs": self.llm_kwargs,
            "sampling": self.args["sampling"],
            "env": env,
            "worker": self.args["own"].get("worker", "per-call"),
        }

    def _speculative_config(self, config: SpecConfig) -> dict | None:
        """The speculative_config a config runs with, after refusing a combination this vLLM
        cannot run; a note where K is not what its drafter was trained for."""
        draft = self._draft_for(config)
        problem = combination_problem(config, draft, self._vllm_version(), self.args["env"],
                                      self.llm_kwargs)
        if problem:
            raise EngineUsageError(problem)
        note = k_hint_note(config, draft)
        self._notes = [note] if note else []
        return speculative_config(config, draft, self.llm_kwargs, self.args["spec"])

    def _draft_for(self, config: SpecConfig) -> str | None:
        """The draft a config runs with: dflash2_draft for DFlash2 where given, else its own."""
        d2 = self.args["own"].get("dflash2_draft")
        if config.method == "dflash2" and d2:
            return str(d2)
        return config.draft or self.draft

    def default_k(self, method: str) -> int | None:
        if method in ("dflash", "dflash2"):
            block = dflash_block_size(self._draft_for(SpecConfig(method, 1)))
            return block - 1 if block and block > 1 else None
        return None

    # -- generation

    def generate(self, prompts: Sequence[Prompt], prompt_ids: Sequence[Sequence[int]],
                 config: SpecConfig, top_k: int) -> list[Completion]:
        return self._generate(prompts, prompt_ids, config, top_k, together=False)

    def generate_together(self, prompts: Sequence[Prompt], prompt_ids: Sequence[Sequence[int]],
                          config: SpecConfig, top_k: int) -> list[Completion]:
        """All prompts in one ``LLM.generate`` call, so the scheduler batches them. Spec
        counters then cover the whole call and are not split per request (None)."""
        return self._generate(prompts, prompt_ids, config, top_k, together=True)

    def _generate(self, prompts, prompt_ids, config: SpecConfig, top_k: int,
                  together: bool) -> list[Completion]:
        spec = self._speculative_config(config)
        sp = sampling_of(self.engine_args)
        seeds = None if sp is None else [
            p.seed if p.seed is not None else request_seed(sp["seed"], config.name, ids, p.sample)
            for p, ids in zip(prompts, prompt_ids)]
        groups = sample_groups(prompt_ids, [p.max_tokens for p in prompts],
                               [p.ignore_eos for p in prompts], seeds)
        req = {"op": "generate", "prompts": [list(map(int, prompt_ids[i])) for i, _ in groups],
               "max_tokens": [int(prompts[i].max_tokens) for i, _ in groups], "top_k": int(top_k),
               "stop_token_ids": eos_token_ids(self.model), "sampling": self.args["sampling"],
               "ignore_eos": [bool(prompts[i].ignore_eos) for i, _ in groups],
               "seeds": None if seeds is None else [seeds[i] for i, _ in groups],
               "n": [n for _, n in groups],
               "warmup": bool(self.args["own"].get("warmup", True)), "together": together,
               "pad_batch": int(self.args["own"].get("pad_batch", 0))}
        result = self._call(req, spec, DFLASH2_ENV if config.method == "dflash2" else {})
        self._ran = {"method": config.method, "drafter": self._runtime.get("drafter"),
                     "vllm_version": self._runtime.get("vllm_version")}
        rows = result["requests"]
        if len(rows) != len(groups):
            raise EngineError(f"the vLLM worker answered {len(rows)} of {len(groups)} requests")
        comps, firsts = [], []
        counted = spec is not None and not together
        for (first, n), row in zip(groups, rows):
            for j in range(n):
                c = completion_from_dict(prompts[first + j].id, row, top_k, counted and j == 0, j)
                if c.spec is not None:  # the n samples share the request's counters
                    c.spec.requests = n
                comps.append(c)
            firsts.append(comps[-n])
        for c in comps:
            if not c.text:
                c.text = self.detokenize(c.token_ids)
        if counted:
            check_speculated(config, firsts)
        return comps

    # -- workload axes

    #: served through vLLM's own step loop (run_workload); long_lived and the shapes axis's
    #: lengths are the runner's (its batch level is served here)
    axes = frozenset({"concurrency", "prefix_cache", "kv_pressure", "async_scheduling", "chat_thinking",
                      "shapes"})

    def capture_sizes(self, config: SpecConfig) -> tuple[int, ...]:
        """The CUDA-graph sizes (tokens) vLLM resolved for ``config``: as the last worker of the
        same K read them back, else predicted by vLLM's default rule (engines.base.
        vllm_capture_sizes, from max_num_seqs / max_num_batched_tokens where given; sizes the
        user gave in compilation_config, rounded to multiples of 1 + K); none when eager. A
        wrong prediction only picks other batch sizes: the proof reads back what vLLM resolved
        and the level fails where those were not reached."""
        k = 0 if config.is_baseline else config.k
        rt = self._runtime
        if rt.get("cudagraph_capture_sizes") is not None and int(rt.get("num_speculative_tokens") or 0) == k:
            return tuple(int(x) for x in rt["cudagraph_capture_sizes"])
        kw = self.llm_kwargs
        cc = kw.get("compilation_config") if isinstance(kw.get("compilation_config"), dict) else {}
        if kw.get("enforce_eager") is True or str(cc.get("cudagraph_mode", "")).upper() == "NONE":
            return ()
        if cc.get("cudagraph_capture_sizes"):
            q = 1 + k
            return tuple(sorted({-(-int(x) // q) * q for x in cc["cudagraph_capture_sizes"]}))
        seqs = kw.get("max_num_seqs") if isinstance(kw.get("max_num_seqs"), int) else 256
        tokens = kw.get("max_num_batched_tokens") if isinstance(kw.get("max_num_batched_tokens"), int) else None
        return vllm_capture_sizes(seqs, 1 + k, tokens)

    def cache_block_size(self) -> int:
        """Tokens per KV-cache block: as the last worker's vLLM resolved it (``cache_config.
        block_size``: a hybrid model's attention block grows to the page size of its mamba
        state), else the ``block_size`` engine arg, else vLLM's default of 16."""
        for v in (self._runtime.get("block_size"), self.llm_kwargs.get("block_size")):
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
        return 16

    def run_workload(self, workload: Workload, config: SpecConfig, top_k: int) -> WorkloadResult:
        """A serving axis through vLLM's engine step loop, in the worker (one ``LLM`` under the
        workload's knobs: ``prefix_cache`` -> ``enable_prefix_caching``, ``kv_blocks`` ->
        ``num_gpu_blocks_override``; a worker of its own wherever knobs are set). Each request
        is handed to ``llm.llm_engine.add_request`` (token ids, greedy ``SamplingParams`` with
        top-k logprobs) at its arrival step -- once its ``after`` request has finished and
        fewer than ``max_in_flight`` are unfinished -- and ``llm.llm_engine.step()`` runs the
        scheduler one step at a time until every request has finished
        (vllm_worker.serve_workload). The proof is read back from vLLM (workload_proof).

        Spec counters are per request only for a request that was alone in flight for its
        whole life (else None: requests decoding together share vLLM's counters); a spec
        config must show drafting over the workload (EngineError otherwise), and its
        ``drafts`` and ``accepted_tokens`` join the proof."""
        if workload.axis not in self.axes:
            raise EngineUsageError(f"the vllm engine cannot run the {workload.axis} workload axis (it "
                                   f"serves {', '.join(sorted(self.axes))}; the runner runs the "
                                   "others through generate())")
        problem = workload_problem(workload)
        if problem:
            raise EngineUsageError(problem)
        thinking, llm_knobs = chat_knobs(workload.knobs)
        knobs = workload_llm_kwargs(llm_knobs)
        rel = release_entry(self._vllm_version()) if self._vllm_version() else None
        if rel is not None and rel.per_request_spec_metrics_arg and not config.is_baseline:
            # each request's own counters, whatever shares its steps (vLLM >= 0.33)
            knobs[rel.per_request_spec_metrics_arg] = "summary"
        if thinking is not None and any(not r.prompt.messages for r in workload.requests):
            raise EngineUsageError(f"the {workload.axis} workload renders chat messages; a request "
                                   "has none")
        spec = self._speculative_config(config)
        reqs = workload.requests
        sp = sampling_of(self.engine_args)
        seeds = [None if sp is None else r.prompt.seed if r.prompt.seed is not None
                 else request_seed(sp["seed"], config.name, r.prompt_ids, r.prompt.sample)
                 for r in reqs]  # each request the seed it has alone: the axis compares them
        req = {"op": "workload", "axis": workload.axis, "level": workload.level,
               "top_k": int(top_k), "sampling": self.args["sampling"],
               "stop_token_ids": eos_token_ids(self.model),
               "max_in_flight": workload.max_in_flight,
               "cudagraph_metrics": bool(knobs.get("cudagraph_metrics")),
               "step_gauges": sorted({names["requests_running"] for names in METRIC_NAMES.values()}),
               "requests": [{"id": r.id, "prompt": [int(t) for t in r.prompt_ids],
                             "max_tokens": int(r.prompt.max_tokens), "ignore_eos": bool(r.prompt.ignore_eos),
                             "arrive_after": int(r.arrive_after), "after": r.after, "seed": seed,
                             **({"messages": [dict(m) for m in r.prompt.messages]}
                                if thinking is not None else {})} for r, seed in zip(reqs, seeds)]}
        if thinking is not None:  # rendered in the worker by the model's own chat template
            req["chat"] = {"enable_thinking": thinking}
        result = self._call(req, spec, DFLASH2_ENV if config.method == "dflash2" else {}, knobs)
        self._ran = {"method": config.method, "drafter": self._runtime.get("drafter"),
                     "vllm_version": self._runtime.get("vllm_version")}
        rows = result["requests"]
        if len(rows) != len(reqs):
            raise EngineError(f"the vLLM worker answered {len(rows)} of the {len(reqs)} requests of "
                              f"the {workload.axis} workload")
        comps = [completion_from_dict(r.id, row, top_k, spec is not None) for r, row in zip(reqs, rows)]
        for c in comps:
            if not c.text:
                c.text = self.detokenize(c.token_ids)
        stats = result["workload"]
        proof = workload_proof(stats, (result.get("runtime") or {}).get("vllm_version"))
        counted = [r.id for r, row in zip(reqs, rows)  # vLLM >= 0.33 counts them per request
                   if int(((row["output"].get("metrics") or {}).get("num_preemptions")) or 0) > 0]
        if counted:
            proof["preempted_requests"] = sorted(set(proof.get("preempted_requests") or ()) | set(counted))
            proof["preempted_from"] = ("engine core events (PREEMPTED) and RequestOutput.metrics"
                                       if stats.get("step_tap") else "RequestOutput.metrics")
        if spec is not None:
            total = workload_speculated(config, stats, comps)
            proof["drafts"], proof["accepted_tokens"] = total.drafts, total.accepted_tokens
        return WorkloadResult(comps, proof)

    def score(self, prompt_ids: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
              top_k: int) -> list[Scored]:
        """Teacher-forced scores, all sequences in one worker (one engine start) and as few
        ``LLM.generate`` calls as the token budget allows. ``score_path`` picks the kernels:
        ``prefill`` (default) -- prompt_logprobs of one prefill of prompt + continuation;
        ``decode`` / ``verify`` (attribution) -- only the last two positions: the input stops
        two tokens short and two tokens are generated, the first by prefill, the second by
        one one-token decode step (``decode``) or by position 0 of one spec verify step of
        ``score_spec`` (``verify``: the target's output there does not depend on the drafts)."""
        path = self.args["own"].get("score_path", "prefill")
        if path == "prefill":
            seqs = [list(map(int, p)) + list(map(int, c))
                    for p, c in zip(prompt_ids, continuations)]
            req = {"op": "score", "path": "prefill", "prompts": seqs, "top_k": int(top_k),
                   "sampling": {}}
            result = self._call(req, None)
            return [scored_from_dict(row, len(p), top_k)
                    for row, p in zip(result["requests"], prompt_ids)]
        spec = None
        if path == "verify":
            config = SpecConfig.from_name(str(self.args["own"]["score_spec"]))
            spec = speculative_config(config, self._draft_for(config), self.llm_kwargs,
                                      self.args["spec"])
        inputs = step_inputs(prompt_ids, continuations)
        todo = [i for i, x in enumerate(inputs) if x is not None]
        rows: dict[int, dict] = {}
        if todo:
            req = {"op": "score", "path": "steps", "prompts": [inputs[i] for i in todo],
                   "top_k": int(top_k), "sampling": {}}
            rows = dict(zip(todo, self._call(req, spec)["requests"]))
        return [scored_from_steps(rows.get(i), c, top_k) for i, c in enumerate(continuations)]

    def sampled_score_top_k(self) -> int:
        """``score_top_k`` (default 20: vLLM's default max_logprobs)."""
        return int(self.args["own"].get("score_top_k", 20))

    def vocab_size(self) -> int | None:
        """The model's logits per position, from its config.json (text_config for the
        multimodal wrappers)."""
        cfg = _read_config(self.model)
        v = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
        return int(v) if isinstance(v, int) and v > 0 else None

    def kernel_settings(self, ran: dict | None = None) -> dict:
        """What the kernel switches are set to: read back from the engine when a worker has
        answered in this process, else from ``ran`` (a stored run's identity: what was read
        back then), else as requested (None where that says 'auto')."""
        ident = self.identity()
        for key in RESOLVED_KEYS:
            if ident.get(key) is None and (ran or {}).get(key) is not None:
                ident[key] = ran[key]
        env = {**os.environ, **self.worker_env_overrides()}
        eager = ident.get("enforce_eager")
        if eager is None:
            eager = bool(self.llm_kwargs.get("enforce_eager", False))
        gdn = ident.get("gdn_prefill_backend") or (
            None if ident["gdn_prefill_backend_requested"] == "auto"
            else ident["gdn_prefill_backend_requested"])
        attn = ident.get("attention_backend") or (
            None if ident["attention_backend_requested"] == "auto"
            else str(ident["attention_backend_requested"]))
        return {"attention_backend": attn, "gdn_prefill_backend": gdn, "enforce_eager": eager,
                "packed_decode": env.get(PACKED_DECODE_ENV, "1") != "0",
                "capability": ident.get("capability"),
                "flashinfer_available": ident.get("flashinfer_available"),
                "gdn_decode_kernel_setting": ident.get("gdn_decode_kernel_setting"),
                "llm_kwargs": self.llm_kwargs}

    def rerun_variants(self, configs: Sequence[SpecConfig] = (),
                       ran: dict | None = None) -> dict[str, dict[str, str]]:
        """The switches as whole-run engine args: a regenerated baseline follows the path
        the run took (each prompt decoded token by token, alone, as the baseline's repeats
        are), where a re-score prefills the prefix. ``decode`` (the baseline itself) and the
        ``verify`` paths (the spec run itself) have no rerun; a switch offered for both
        decode and prefill (eager) is run once."""
        current = self.kernel_settings(ran)
        return {**rerun_switches(attribution_variants(current, configs)),
                **padded_decode_switches(current)}

    def attribution_variants(self, configs: Sequence[SpecConfig] = (),
                             ran: dict | None = None) -> dict[str, dict[str, str]]:
        """vLLM's kernel switches (``attribution_variants`` above), relative to the settings
        that ran: read back by generate() in this process, or stored in ``ran``.

        What each switch does in vLLM 0.26.0 (paths in vLLM's tree), and what changed later:

        - ``score_path=decode`` / ``verify CONFIG``: the one-token decode step vs the spec
          verify step. GDN (``model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py``,
          ``_forward_core``): prefill -> ``ChunkGatedDeltaRule``; a decode-only batch without
          spec tokens -> ``fused_recurrent_gated_delta_rule_packed_decode`` when packed decode
          is on, else ``fused_sigmoid_gating_delta_rule_update``; spec verify (K+1 tokens) ->
          ``fused_sigmoid_gating_delta_rule_update`` with ``num_accepted_tokens``. Attention
          sees a query of 1 vs K+1 tokens (uniform-decode batches, FULL CUDA graphs).
        - ``env.VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE=0`` (``envs.py``, default 1; read
          once per layer in ``QwenGatedDeltaNetAttention.__init__``): one-token decode then
          runs the verify kernel. Affects decode steps only (not prefill, not verify).
        - GDN prefill backend: ``additional_config={"gdn_prefill_backend": ...}`` or the
          engine arg / CLI ``--gdn-prefill-backend`` (``engine/arg_utils.py`` copies it into
          additional_config), values flashinfer | triton | cutedsl, default auto;
          ``_resolve_gdn_prefill_backend`` picks FlashInfer (``flashinfer.gdn_prefill``,
          JIT-compiled) on SM90 for auto/flashinfer, Triton/FLA
          (``model_executor/layers/fla/ops/chunk.py``) otherwise; CuteDSL only on SM10x
          with head_k_dim 128 when asked. Read again by ``v1/attention/backends/gdn_attn.py``.
        - Attention backend: ``attention_backend=`` (``AttentionConfig.backend``;
          ``config/attention.py``); the ``VLLM_ATTENTION_BACKEND`` environment variable is
          gone in 0.26 (not in ``envs.py``). The drafter's: ``speculative_config
          .attention_backend``.
        - CUDA graphs and torch.compile: ``enforce_eager=True`` sets
          ``compilation_config.mode=NONE`` and ``cudagraph_mode=NONE`` (``config/vllm.py``);
          hybrid (Mamba/GDN) models default to FULL_AND_PIECEWISE
          (``model_executor/models/config.py``, ``MambaModelConfig``): FULL graphs for
          uniform decode / verify batches, piecewise around attention for prefill, with
          batches padded to capture sizes (other GEMM shapes). ``compilation_config=
          {"cudagraph_mode": "NONE"}`` turns graphs off but keeps torch.compile.

        vLLM 0.28.0 (its wheel's source): the same GDN prefill switch, packed-decode env,
        ``attention_backend`` and ``enforce_eager`` semantics, plus a new GDN decode switch,
        ``VLLM_GDN_DECODE_KERNEL=cuda|triton`` (``envs.py``, default cuda): with cuda, a bf16
        model with K=V=128 head dims, SiLU gate and no interleaved GQA runs spec verify
        batches (no prefill in the batch, K+1 <= 8, num_v_heads = 8 num_k_heads) through the
        CUDA kernel ``torch.ops._C.fused_gdn_decode_post_conv_mtp`` and the gated RMSNorm
        through a fused CUDA norm (``_forward_core_fused_norm``); otherwise it falls back to
        triton (logged "GDN decode kernel: ..."). The probe reads it (``gdn_decode_kernel``
        of each layer) and a ``verify CONFIG gdn=triton`` variant is offered where it is
        cuda. Later main (stored source index): on SM10x FlashInfer's GDN prefill also
        needs an intact ``nvidia-cutlass-dsl-libs-cu13`` install, else Triton/FLA."""
        return attribution_variants(self.kernel_settings(ran), configs)

    # -- the worker process

    def worker_env_overrides(self) -> dict[str, str]:
        return {**DEFAULT_ENV, **self.args["env"]}

    def _vllm_version(self) -> str | None:
        """vLLM's version in the worker's interpreter: as a worker reported it, else this
        interpreter's when the worker runs under it (else unknown)."""
        if self._runtime.get("vllm_version"):
            return str(self._runtime["vllm_version"])
        if self.args["own"].get("python"):
            return None
        try:
            return metadata.version("vllm")
        except metadata.PackageNotFoundError:
            return None

    def _worker_env(self, method_env: dict | None = None) -> dict[str, str]:
        return worker_env(self.args["env"], method_env)

    def _call(self, req: dict, spec: dict | None, method_env: dict | None = None,
              llm_extra: dict | None = None) -> dict:
        """One request to the worker of these LLM(...) arguments (``llm_extra``: a workload's
        knobs, over the engine args), starting one where none of them is alive."""
        kwargs = dict(self.llm_kwargs)
        kwargs.update(llm_extra or {})
        if spec is not None:
            kwargs["speculative_config"] = spec
        req = {**req, "model": self.model, "llm_kwargs": kwargs}
        # a worker started with another environment is not reused; one that a workload's
        # knobs set up serves only such workloads (it is never parked)
        key = json.dumps({**kwargs, **({"worker_env": method_env} if method_env else {}),
                          **({"workload_knobs": sorted(llm_extra)} if llm_extra else {})},
                         sort_keys=True)
        reuse = self.args["own"].get("worker", "per-call") == "per-config"
        if self._worker is not None and (not reuse or key != self._worker_key
                                         or self._worker.poll() is not None):
            current = json.loads(self._worker_key or "{}")
            if reuse and self._worker.poll() is None and "speculative_config" not in current \
                    and "workload_knobs" not in current:
                # per-config: park the baseline worker (idle, off the GPU's critical path);
                # score() and a later baseline call take it back instead of a new start
                self._stop_parked()
                self._parked = (self._worker, self._worker_key, self._log_path)
                self._worker = None
            else:
                self._stop_worker()
        if self._worker is None and self._parked and self._parked[1] == key \
                and self._parked[0].poll() is None:
            self._worker, self._worker_key, self._log_path = self._parked
            self._parked = None
            self.last_call_fresh_process = False
        elif self._worker is not None:
            self.last_call_fresh_process = False
        fresh = self._worker is None
        if fresh:
            self._start_worker(key, method_env)
        if fresh:
            self.last_call_fresh_process = True
        self._calls += 1
        path = self._tmp / f"req{self._calls}.json"
        path.write_text(json.dumps(req))
        result_path = Path(str(path) + ".result.json")
        assert self._worker is not None and self._worker.stdin is not None
        try:
            self._worker.stdin.write(str(path) + "\n")
            self._worker.stdin.flush()
            if not reuse:
                self._worker.stdin.close()
        except OSError:
            pass  # it died already; reported below
        timeout = float(self.args["own"].get("timeout_s", 1800))
        t0 = time.monotonic()
        while not result_path.exists():
            if self._worker.poll() is not None:
                time.sleep(0.2)  # a result written just before exit
                if result_path.exists():
                    break
                rc = self._worker.returncode
                self._stop_worker()
                raise EngineError(f"vLLM worker died (exit {rc}) before answering; "
                                  f"log tail:\n{_tail(self._log_path)}")
            if time.monotonic() - t0 > timeout:
                self._stop_worker()
                raise EngineError(f"vLLM worker gave no answer within {timeout:.0f} s "
                                  f"(--engine-arg timeout_s=N); log tail:\n{_tail(self._log_path)}")
            time.sleep(0.05)
        result = json.loads(result_path.read_text())
        self._collect_log()
        if not reuse or "error" in result:
            self._stop_worker()
        if "error" in result:
            msg = f"vLLM worker: {result['error']}"
            if result.get("error_kind") == "usage":
                raise EngineUsageError(msg)
            raise EngineError(f"{msg}\n{result.get('traceback', '')}\nlog tail:\n"
                              f"{_tail(self._log_path, 2500)}")
        self._runtime = result.get("runtime") or {}
        return result

    def _start_worker(self, key: str, method_env: dict | None = None) -> None:
        python = str(self.args["own"].get("python") or sys.executable)
        self._log_path = self._tmp / f"worker{self._calls + 1}.log"
        log = open(self._log_path, "w")
        try:
            self._worker = subprocess.Popen(
                [python, "-m", "speccheck.engines.vllm_worker"], stdin=subprocess.PIPE,
                stdout=log, stderr=subprocess.STDOUT, env=self._worker_env(method_env),
                text=True)
        except OSError as e:
            raise EngineUsageError(f"cannot start the vLLM worker with {python}: {e}") from e
        finally:
            log.close()
        self._worker_key = key

    def _stop_worker(self) -> None:
        proc, self._worker = self._worker, None
        if proc is None:
            return
        try:
            if proc.stdin and not proc.stdin.closed:
                proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()  # the worker this engine started
            proc.wait(timeout=30)
        keep = os.environ.get(LOG_DIR_ENV)
        if keep and self._log_path.exists():
            Path(keep).mkdir(parents=True, exist_ok=True)
            shutil.copy(self._log_path, Path(keep) / f"{self._tmp.name}-{self._log_path.name}")

    def _stop_parked(self) -> None:
        if self._parked:
            current = (self._worker, self._worker_key, self._log_path)
            self._worker, self._worker_key, self._log_path = self._parked
            self._parked = None
            self._stop_worker()
            self._worker, self._worker_key, self._log_path = current

    def _collect_log(self) -> None:
        for line in _tail(self._log_path, 200_000).splitlines():
            if any(m in line for m in BACKEND_LOG_MARKERS) and "Using" in line:
                short = line.split("] ", 1)[-1].strip()[:300]
                if short not in self._backend_log:
                    self._backend_log.append(short)

    def close(self) -> None:
        self._stop_worker()
        self._stop_parked()
        if self._tmp_dir is not None:
            self._tmp_removal()
            self._tmp_dir = None


def check_speculated(config: SpecConfig, comps: list[Completion]) -> None:
    """A spec config must actually have drafted; vLLM has silently skipped drafting (e.g.
    for requests with logprobs in older versions), which would make every check pass
    vacuously."""
    if any(c.spec is None for c in comps):
        raise EngineError(f"{config.name}: vLLM reported no spec-decode counters "
                          "(vllm:spec_decode_*), so speculation cannot be confirmed")
    total = sum(c.spec.drafts for c in comps if c.spec)
    generated = sum(c.n_tokens for c in comps)
    if total == 0 and generated > len(comps):
        raise EngineError(
            f"{config.name} did not speculate: vLLM's counters show 0 drafts over "
            f"{generated} generated tokens (vllm:spec_decode_num_drafts). The run would only "
            "repeat the baseline; check the vLLM version and the speculative config.")
