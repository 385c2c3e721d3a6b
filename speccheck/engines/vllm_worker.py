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

import json
import os
import subprocess
import sys
import time
import traceback
from typing import Any

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
            "first_token_latency", "num_generation_tokens") if hasattr(m, k)}
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
            }
            for c in out.outputs
        ],
        "finished": bool(out.finished),
        "metrics": metrics,
    }


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
    return facts


def nvidia_smi_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None
    except (OSError, subprocess.SubprocessError):
        return None


def _engine_choices(llm: Any) -> dict:
    """Attention and GDN prefill backends as vLLM resolved them (best effort: internal API)."""
    out: dict[str, Any] = {}
    try:
        cfg = llm.llm_engine.vllm_config
    except Exception:  # noqa: BLE001
        return out
    try:
        backend = cfg.attention_config.backend
        out["attention_backend"] = getattr(backend, "name", None) if backend else "auto"
    except Exception:  # noqa: BLE001
        pass
    try:
        from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
            _resolve_gdn_prefill_backend,
        )
        requested, active = _resolve_gdn_prefill_backend(cfg)
        out["gdn_prefill_backend"] = active
        out["gdn_prefill_backend_requested"] = requested
    except Exception as e:  # noqa: BLE001
        out["gdn_prefill_backend_error"] = repr(e)[:200]
    try:
        spec = cfg.speculative_config
        if spec is not None:
            ab = getattr(spec, "attention_backend", None)
            out["draft_attention_backend"] = getattr(ab, "name", None) if ab else "auto"
            out["speculative_method"] = spec.method
            out["num_speculative_tokens"] = spec.num_speculative_tokens
    except Exception:  # noqa: BLE001
        pass
    try:
        out["dtype"] = str(cfg.model_config.dtype).replace("torch.", "")
        out["enforce_eager"] = bool(cfg.model_config.enforce_eager)
        out["prefix_caching"] = bool(cfg.cache_config.enable_prefix_caching)
    except Exception:  # noqa: BLE001
        pass
    return out


# ---------------------------------------------------------------- serving requests

class UsageProblem(Exception):
    """The request itself is wrong (e.g. an unknown LLM(...) argument): exit code 2."""


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
        prompts = req["prompts"]
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
            params = [SamplingParams(temperature=0.0, max_tokens=int(max_tokens),
                                     logprobs=int(req["top_k"]), detokenize=False,
                                     stop_token_ids=[] if ign else
                                     list(req.get("stop_token_ids") or []),
                                     ignore_eos=ign, **extra)
                      for max_tokens, ign in zip(req["max_tokens"], ignore)]
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
                for ids, sp in zip(prompts, params):
                    before = self.spec_metrics()
                    t0 = time.perf_counter()
                    out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
                    wall = time.perf_counter() - t0
                    after = self.spec_metrics()
                    row = {"output": request_output_to_dict(out), "wall_s": wall,
                           "metrics_before": before, "metrics_after": after}
                    result["requests"].append(row)
                    self.capture(op, row, llm)
        elif op == "score":
            sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=int(req["top_k"]),
                                detokenize=False, **extra)
            for ids in prompts:
                out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
                row = {"output": request_output_to_dict(out)}
                result["requests"].append(row)
                self.capture(op, row, llm)
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
