#!/usr/bin/env python3
"""Record what speccheck's vLLM engine relies on from one vLLM source tree, without importing it.

    python scripts/record_vllm_facts.py SRC [--version V] [-o tests/fixtures/vllm/versions/V.json]

SRC is the root holding the ``vllm`` package: an unpacked release wheel (``unzip
vllm-0.28.0-*.whl 'vllm/*.py' -d SRC``; no GPU, no torch) or a git checkout. The facts (names of
metrics, ``SpeculativeConfig`` fields and methods, environment switches, model architectures,
model-runner and speculator attributes, ``Logprob``/``RequestOutput``/``CompletionOutput``/
``RequestStateStats`` fields, GDN prefill and attention backends, the metrics reader's
dataclasses and the Prometheus metrics' kinds and labels, the engine core's step outputs and
scheduler / CUDA-graph stats) are read from the source's
syntax tree; tests hold the engine's version table (speccheck/engines/vllm_versions.py)
against them and build vLLM-shaped objects from them.
"""
from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path


def _tree(root: Path, rel: str) -> ast.Module | None:
    p = root / rel
    return ast.parse(p.read_text()) if p.is_file() else None


def _class(tree: ast.Module | None, name: str) -> ast.ClassDef | None:
    if tree is None:
        return None
    return next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name), None)


def class_fields(tree: ast.Module | None, name: str) -> list[str] | None:
    """Annotated class attributes plus ``__init__`` parameters (dataclasses and plain classes)."""
    c = _class(tree, name)
    if c is None:
        return None
    out = [s.target.id for s in c.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    for f in c.body:
        if isinstance(f, ast.FunctionDef) and f.name == "__init__":
            out += [a.arg for a in f.args.args[1:] + f.args.kwonlyargs if a.arg not in out]
    return out


def self_attrs(tree: ast.Module | None, name: str) -> list[str] | None:
    """Attributes a class assigns on ``self`` anywhere in its body (``self.x = ...``)."""
    c = _class(tree, name)
    if c is None:
        return None
    out: set[str] = set()
    for n in ast.walk(c):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out.add(t.attr)
    return sorted(out)


def _strings(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def speculative_methods(tree: ast.Module | None) -> list[str]:
    """Every string in the module-level ``...Types``/``SpeculativeMethod`` Literal aliases."""
    out: set[str] = set()
    for n in (tree.body if tree else []):
        if isinstance(n, (ast.Assign, ast.AnnAssign)):
            t = n.targets[0] if isinstance(n, ast.Assign) else n.target
            if isinstance(t, ast.Name) and (t.id.endswith("Types") or t.id == "SpeculativeMethod") \
                    and n.value is not None and "Literal" in ast.unparse(n.value):
                out.update(_strings(n.value))
    return sorted(out)


def env_names(tree: ast.Module | None) -> list[str]:
    """Keys of envs.py's ``environment_variables`` dict."""
    for n in ast.walk(tree) if tree else []:
        if isinstance(n, (ast.Assign, ast.AnnAssign)):
            t = n.targets[0] if isinstance(n, ast.Assign) else n.target
            if isinstance(t, ast.Name) and t.id == "environment_variables" and isinstance(n.value, ast.Dict):
                return sorted(k.value for k in n.value.keys if isinstance(k, ast.Constant))
    return []


def registry_architectures(tree: ast.Module | None, needle: str) -> dict[str, list[str]]:
    """Model registry entries whose architecture name contains ``needle``: arch -> (module, class)."""
    out = {}
    for n in ast.walk(tree) if tree else []:
        if isinstance(n, ast.Dict):
            for k, v in zip(n.keys, n.values):
                if isinstance(k, ast.Constant) and isinstance(k.value, str) and needle in k.value \
                        and isinstance(v, ast.Tuple):
                    out[k.value] = _strings(v)
    return dict(sorted(out.items()))


def literal_of(tree: ast.Module | None, cls: str, attr: str) -> list[str] | None:
    c = _class(tree, cls)
    for s in (c.body if c else []):
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.target.id == attr:
            return sorted(set(_strings(s.annotation)))
    return None


def enum_members(tree: ast.Module | None, cls: str) -> list[str] | None:
    c = _class(tree, cls)
    if c is None:
        return None
    return [t.id for s in c.body if isinstance(s, ast.Assign) for t in s.targets if isinstance(t, ast.Name)]


def dataclass_fields(tree: ast.Module | None, name: str) -> list[str] | None:
    """A class's annotated fields, its bases' (in the same module) first, as a dataclass or
    msgspec Struct orders them."""
    c = _class(tree, name)
    if c is None:
        return None
    out: list[str] = []
    for b in c.bases:
        if isinstance(b, ast.Name) and _class(tree, b.id) is not None:
            out += [f for f in dataclass_fields(tree, b.id) or [] if f not in out]
    return out + [f for f in class_fields(tree, name) or [] if f not in out]


_KINDS = {"_gauge_cls": "gauge", "_counter_cls": "counter", "_histogram_cls": "histogram",
          "Gauge": "gauge", "Counter": "counter", "Histogram": "histogram"}


def prometheus_metrics(*trees: ast.Module | None) -> dict[str, dict]:
    """Every ``vllm:`` metric the Prometheus stat loggers register: its kind (the
    ``_gauge_cls``/``_counter_cls``/``_histogram_cls`` or prometheus_client class that makes
    it) and its label names (``labelnames``, resolved through the function's own assignments:
    ``labelnames = [...]``, ``labelnames + ["reason"]``). Names given through a loop over
    ``(name, documentation)`` pairs are read from those pairs."""
    out: dict[str, dict] = {}

    def assigned(node: ast.AST) -> dict[str, list[ast.AST]]:
        found: dict[str, list[ast.AST]] = {}
        for n in ast.walk(node):
            if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
                found.setdefault(n.targets[0].id, []).append(n.value)
        return found

    # a logger class that takes ``labelnames`` as a parameter gets the stat logger's own
    everywhere: dict[str, list[ast.AST]] = {}
    for tree in trees:
        for name, values in (assigned(tree) if tree else {}).items():
            everywhere.setdefault(name, []).extend(values)
    for tree in trees:
        for fn in ast.walk(tree) if tree else []:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            local = assigned(fn)

            def labels(node: ast.AST | None, depth: int = 0) -> list[str] | None:
                if node is None or depth > 5:
                    return None
                if isinstance(node, ast.List):
                    return [e.value for e in node.elts if isinstance(e, ast.Constant)]
                if isinstance(node, ast.Name):
                    for value in local.get(node.id) or everywhere.get(node.id) or []:
                        got = labels(value, depth + 1)
                        if got is not None:
                            return got
                    return None
                if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
                    a, b = labels(node.left, depth + 1), labels(node.right, depth + 1)
                    return None if a is None or b is None else a + b
                return None

            def pair_names() -> list[str]:  # the first strings of (name, documentation) pairs
                return [t.elts[0].value for vs in local.values() for v in vs if isinstance(v, ast.List)
                        for t in v.elts if isinstance(t, ast.Tuple) and t.elts
                        and isinstance(t.elts[0], ast.Constant) and str(t.elts[0].value).startswith("vllm:")]

            for call in ast.walk(fn):
                if not isinstance(call, ast.Call):
                    continue
                f = call.func
                attr = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                kind = _KINDS.get(attr)
                kw = {k.arg: k.value for k in call.keywords}
                if kind is None or "name" not in kw:
                    continue
                v = kw["name"]
                names = ([v.value] if isinstance(v, ast.Constant) and isinstance(v.value, str)
                         else pair_names() if isinstance(v, ast.Name) else [])
                for name in names:
                    if name.startswith("vllm:"):
                        out[name] = {"kind": kind, "labels": labels(kw.get("labelnames"))}
    return dict(sorted(out.items()))


def facts(src: Path, version: str | None = None) -> dict:
    v = src / "vllm"
    if not v.is_dir():
        raise SystemExit(f"{src} holds no vllm package")
    if version is None:
        vf = v / "_version.py"
        m = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)""", vf.read_text()) if vf.is_file() else None
        version = m.group(1) if m else None
    metrics: set[str] = set()
    for p in sorted((v / "v1").rglob("*.py")):
        metrics.update(re.findall(r'"(vllm:[a-z_0-9]+)"', p.read_text()))
    spec = _tree(src, "vllm/config/speculative.py")
    gpu = "vllm/v1/worker/gpu"
    runner_v2 = _tree(src, f"{gpu}/model_runner.py")
    runner_v1 = _tree(src, "vllm/v1/worker/gpu_model_runner.py")
    d2 = _tree(src, f"{gpu}/spec_decode/dflash2/speculator.py")
    d2_model = _tree(src, "vllm/model_executor/models/qwen3_dflash2.py")
    gdn = _tree(src, "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py")
    cfg_vllm = (v / "config" / "vllm.py").read_text() if (v / "config" / "vllm.py").is_file() else ""
    stats_reader = _tree(src, "vllm/v1/metrics/reader.py")
    stats = _tree(src, "vllm/v1/metrics/stats.py")
    core = _tree(src, "vllm/v1/engine/__init__.py")
    return {
        "vllm_version": version,
        "source": "recorded by scripts/record_vllm_facts.py from vLLM's own source (syntax tree, no import)",
        "metric_names": sorted(metrics),
        "speculative_config_fields": class_fields(spec, "SpeculativeConfig"),
        "speculative_methods": speculative_methods(spec),
        "envs": [e for e in env_names(_tree(src, "vllm/envs.py"))
                 if e.startswith(("VLLM_USE_V2", "VLLM_GDN", "VLLM_ENABLE_FLA", "VLLM_USE_FLASHINFER",
                                  "VLLM_ENABLE_V1_MULTI", "VLLM_ATTENTION"))],
        "dflash_architectures": registry_architectures(_tree(src, "vllm/model_executor/models/registry.py"), "DFlash"),
        "model_runner_v2": {"exists": runner_v2 is not None,
                            "class": "GPUModelRunner" if _class(runner_v2, "GPUModelRunner") else None,
                            "attrs": [a for a in (self_attrs(runner_v2, "GPUModelRunner") or [])
                                      if a in ("speculator", "drafter", "vllm_config")]},
        "model_runner_v1": {"class": "GPUModelRunner" if _class(runner_v1, "GPUModelRunner") else None,
                            "attrs": [a for a in (self_attrs(runner_v1, "GPUModelRunner") or [])
                                      if a in ("speculator", "drafter", "vllm_config")]},
        "draft_model_speculator_attrs": self_attrs(_tree(src, f"{gpu}/spec_decode/speculator.py"),
                                                   "DraftModelSpeculator"),
        "dflash_speculator_attrs": self_attrs(_tree(src, f"{gpu}/spec_decode/dflash/speculator.py"),
                                              "DFlashSpeculator"),
        "dflash2_speculator_attrs": self_attrs(d2, "DFlash2Speculator"),
        "dflash2_model": None if d2_model is None else {
            "classes": sorted(n.name for n in ast.walk(d2_model) if isinstance(n, ast.ClassDef)),
            "model_attrs": self_attrs(d2_model, "DFlash2Qwen3Model"),
        },
        # config/vllm.py's test for a draft that only the V2 runner drafts right (0.28:
        # _is_dflash2_draft forces V2; 0.33: V2 is the default, _is_dflash_candidate_draft)
        "dflash2_v2_test": next((f for f in ("_is_dflash2_draft", "_is_dflash_candidate_draft")
                                 if f"def {f}(" in cfg_vllm), None),
        "gdn_layer_attrs": [a for a in (self_attrs(gdn, "QwenGatedDeltaNetAttention") or
                                        self_attrs(gdn, "Qwen3NextGatedDeltaNet") or
                                        sorted({a for c in ast.walk(gdn) if isinstance(c, ast.ClassDef)
                                                for a in self_attrs(gdn, c.name) or []}) if gdn else [])
                            if a in ("gdn_prefill_backend", "enable_packed_recurrent_decode", "gdn_decode_kernel")],
        "gdn_prefill_backends": literal_of(_tree(src, "vllm/engine/arg_utils.py"), "EngineArgs", "gdn_prefill_backend"),
        "attention_backends": [m for m in (enum_members(_tree(src, "vllm/v1/attention/backends/registry.py"),
                                                        "AttentionBackendEnum") or [])
                               if m in ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "FLEX_ATTENTION")],
        "logprob_fields": class_fields(_tree(src, "vllm/logprobs.py"), "Logprob"),
        "completion_output_fields": class_fields(_tree(src, "vllm/outputs.py"), "CompletionOutput"),
        "request_output_fields": class_fields(_tree(src, "vllm/outputs.py"), "RequestOutput"),
        "request_state_stats_fields": class_fields(_tree(src, "vllm/v1/metrics/stats.py"), "RequestStateStats"),
        "scheduler_config_fields": [f for f in (class_fields(_tree(src, "vllm/config/scheduler.py"),
                                                             "SchedulerConfig") or [])
                                    if f in ("async_scheduling", "max_num_batched_tokens")],
        # what the workload axes read: LLM.get_metrics()'s objects, the metrics the Prometheus
        # loggers register (what a server's /metrics shows), and each engine step's output as
        # the engine core hands it to LLMEngine.step (scheduler stats, CUDA-graph stats, a
        # request's events), and the switches that turn the last two on
        "metrics_reader": {c: dataclass_fields(stats_reader, c)
                           for c in ("Counter", "Gauge", "Vector", "Histogram")},
        "prometheus_metrics": prometheus_metrics(_tree(src, "vllm/v1/metrics/loggers.py"),
                                                 _tree(src, "vllm/v1/spec_decode/metrics.py")),
        "engine_core_outputs_fields": dataclass_fields(core, "EngineCoreOutputs"),
        "engine_core_output_fields": dataclass_fields(core, "EngineCoreOutput"),
        "engine_core_event_fields": dataclass_fields(core, "EngineCoreEvent"),
        "engine_core_event_types": enum_members(core, "EngineCoreEventType"),
        "scheduler_stats_fields": dataclass_fields(stats, "SchedulerStats"),
        "cudagraph_stat_fields": dataclass_fields(_tree(src, "vllm/compilation/cuda_graph.py"), "CUDAGraphStat"),
        "request_spec_decode_metrics_fields": dataclass_fields(stats, "RequestSpecDecodeMetrics"),
        # the in-process client's engine core and its batch queue (async scheduling's proof),
        # the client's get_output (each step's outputs), the resolved graph sizes
        "inproc_client": {"attrs": [a for a in (self_attrs(_tree(src, "vllm/v1/engine/core_client.py"),
                                                           "InprocClient") or []) if a == "engine_core"],
                          "methods": [f.name for f in (_class(_tree(src, "vllm/v1/engine/core_client.py"),
                                                              "InprocClient") or ast.Module([], [])).body
                                      if isinstance(f, ast.FunctionDef) and f.name == "get_output"]},
        "engine_core_attrs": [a for a in (self_attrs(_tree(src, "vllm/v1/engine/core.py"), "EngineCore") or [])
                              if a == "batch_queue"],
        "compilation_config_fields": [f for f in (class_fields(_tree(src, "vllm/config/compilation.py"),
                                                               "CompilationConfig") or [])
                                      if f in ("cudagraph_capture_sizes", "cudagraph_mode",
                                               "max_cudagraph_capture_size")],
        "engine_args_observability": [f for f in (class_fields(_tree(src, "vllm/engine/arg_utils.py"),
                                                               "EngineArgs") or [])
                                      if f in ("cudagraph_metrics", "per_request_spec_decode_metrics",
                                               "disable_log_stats")],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("--version")
    ap.add_argument("-o", "--out", type=Path)
    a = ap.parse_args(argv)
    text = json.dumps(facts(a.src, a.version), indent=1, sort_keys=True) + "\n"
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
