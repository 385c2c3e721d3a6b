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

Engine args (``--engine-arg key=value``):
  ``env.NAME=value``      environment of the worker (e.g. ``env.VLLM_USE_FLASHINFER_SAMPLER=0``)
  ``sampling.NAME=value`` extra ``SamplingParams`` fields (e.g. ``sampling.ignore_eos=true``)
  ``spec.NAME=value``     extra ``speculative_config`` keys (e.g. ``spec.attention_backend=FLASH_ATTN``)
  ``worker=per-call|per-config``, ``timeout_s=N``, ``warmup=true|false``, ``python=PATH``
  anything else           passed to ``LLM(...)``; values parsed as JSON where they parse
                          (ints, floats, booleans, ``{"gdn_prefill_backend": "triton"}``).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from speccheck.engines.base import Engine, EngineError, EngineUsageError
from speccheck.types import Completion, Prompt, Scored, SpecConfig, SpecCounters
from speccheck.verify.ties import canonical_topk

SPEC_NAMES = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "accepted_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
}
OWN_OPTIONS = {"worker", "timeout_s", "warmup", "python"}
#: LLM(...) arguments that --method/--k/--draft own
SPEC_ARGS = {"speculative_config", "spec_method", "spec_model", "spec_tokens"}
DEFAULT_LLM_KWARGS = {"skip_tokenizer_init": True, "disable_log_stats": False, "seed": 0}
DEFAULT_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
BACKEND_LOG_MARKERS = ("backend", "GDN prefill kernel")
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
    return out


def speculative_config(config: SpecConfig, draft: str | None, llm_kwargs: dict,
                       extra: dict | None = None) -> dict | None:
    """SpecConfig -> vLLM's ``speculative_config`` (None for the baseline)."""
    if config.is_baseline:
        return None
    spec: dict[str, Any] = {"method": config.method, "num_speculative_tokens": config.k}
    if config.method == "dflash":
        if not draft:
            raise EngineUsageError("method dflash needs the drafter: pass --draft PATH "
                                   "(a DFlash draft checkpoint directory)")
        spec["model"] = draft
        # the drafter attends non-causally; use the kernel the target was told to use
        # (TRITON_ATTN supports that) unless spec.attention_backend says otherwise
        if llm_kwargs.get("attention_backend"):
            spec["attention_backend"] = llm_kwargs["attention_backend"]
    elif draft and config.method != "mtp":
        spec["model"] = draft
    spec.update(extra or {})
    return spec


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
    if config.method != "dflash":
        return None
    block = dflash_block_size(draft)
    if block and config.k != block - 1:
        return (f"dflash K={config.k} but the drafter's dflash_config.block_size is {block}: "
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


def has_spec_metrics(rows: list[dict]) -> bool:
    return any(r["name"] in (SPEC_NAMES["drafts"], SPEC_NAMES["drafts"] + "_total") for r in rows)


def completion_from_dict(prompt_id: str, row: dict, top_k: int, spec: bool) -> Completion:
    """One worker row (``request_output_to_dict`` + timings + metric snapshots) -> Completion."""
    out = row["output"]
    c = out["outputs"][0]
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
    if spec and has_spec_metrics(row.get("metrics_after") or []):
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


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


# ---------------------------------------------------------------- the engine

class VllmEngine(Engine):
    name = "vllm"
    fresh_process_per_config = True
    methods = None  # mtp, dflash, and whatever else vLLM's speculative_config takes

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
        self.llm_kwargs = {**DEFAULT_LLM_KWARGS, **self.args["llm"]}
        self._tokenizer = None
        self._runtime: dict = {}
        self._backend_log: list[str] = []
        self._notes: list[str] = []
        self._worker: subprocess.Popen | None = None
        self._worker_key: str | None = None
        self._parked: tuple | None = None  # (process, key, log) of an idle baseline worker
        self._tmp = Path(tempfile.mkdtemp(prefix="speccheck-vllm-"))
        self._calls = 0
        self.last_call_fresh_process = True
        self._static_identity: dict | None = None

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
                    "attention_backend", "gdn_prefill_backend", "draft_attention_backend",
                    "enforce_eager", "prefix_caching"):
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
        ident["kernel_knobs"] = {
            "attention_backend": ident.get("attention_backend"),
            "gdn_prefill_backend": ident.get("gdn_prefill_backend"),
            "draft_attention_backend": ident.get("draft_attention_backend"),
            **{k: v for k, v in ident["env"].items()},
        }
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
        add = self.llm_kwargs.get("additional_config") or {}
        from speccheck.engines.vllm_worker import nvidia_smi_driver
        gpu = nvidia_smi_driver()  # "NAME, DRIVER" of GPU 0, or None
        return {
            "engine": "vllm",
            "version": version("vllm"),
            "vllm_version": version("vllm"),
            "torch": version("torch"),
            "model": self.model,
            "model_id": Path(self.model).name,
            "model_hash": weights_sha256(self.model),
            "architectures": cfg.get("architectures"),
            "tokenizer_hash": file_sha256(tok_path) if tok_path.is_file() else None,
            "dtype": str(self.llm_kwargs.get("dtype") or cfg.get("dtype") or text_cfg.get("dtype")
                         or cfg.get("torch_dtype") or text_cfg.get("torch_dtype") or "auto"),
            "draft": self.draft,
            "draft_hash": weights_sha256(self.draft) if self.draft else None,
            "device": gpu.split(",")[0].strip() if gpu else None,
            "gpu_driver": gpu,
            "attention_backend": self.llm_kwargs.get("attention_backend") or "auto",
            "gdn_prefill_backend": (add.get("gdn_prefill_backend") if isinstance(add, dict)
                                    else None) or "auto",
            "llm_kwargs": self.llm_kwargs,
            "sampling": self.args["sampling"],
            "env": env,
            "worker": self.args["own"].get("worker", "per-call"),
        }

    def default_k(self, method: str) -> int | None:
        if method == "dflash":
            block = dflash_block_size(self.draft)
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
        draft = config.draft or self.draft
        note = k_hint_note(config, draft)
        self._notes = [note] if note else []
        spec = speculative_config(config, draft, self.llm_kwargs, self.args["spec"])
        req = {"op": "generate", "prompts": [list(map(int, p)) for p in prompt_ids],
               "max_tokens": [int(p.max_tokens) for p in prompts], "top_k": int(top_k),
               "stop_token_ids": eos_token_ids(self.model), "sampling": self.args["sampling"],
               "warmup": bool(self.args["own"].get("warmup", True)), "together": together}
        result = self._call(req, spec)
        rows = result["requests"]
        comps = [completion_from_dict(p.id, row, top_k, spec is not None and not together)
                 for p, row in zip(prompts, rows)]
        for c in comps:
            if not c.text:
                c.text = self.detokenize(c.token_ids)
        if spec is not None and not together:
            check_speculated(config, comps)
        return comps

    def score(self, prompt_ids: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
              top_k: int) -> list[Scored]:
        seqs = [list(map(int, p)) + list(map(int, c)) for p, c in zip(prompt_ids, continuations)]
        req = {"op": "score", "prompts": seqs, "top_k": int(top_k), "sampling": {}}
        result = self._call(req, None)
        return [scored_from_dict(row, len(p), top_k)
                for row, p in zip(result["requests"], prompt_ids)]

    # -- the worker process

    def worker_env_overrides(self) -> dict[str, str]:
        return {**DEFAULT_ENV, **self.args["env"]}

    def _worker_env(self) -> dict[str, str]:
        env = dict(os.environ)
        for k, v in DEFAULT_ENV.items():
            env.setdefault(k, v)
        env.update(self.args["env"])
        root = str(Path(__file__).resolve().parents[2])  # so the worker imports speccheck
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _call(self, req: dict, spec: dict | None) -> dict:
        kwargs = dict(self.llm_kwargs)
        if spec is not None:
            kwargs["speculative_config"] = spec
        req = {**req, "model": self.model, "llm_kwargs": kwargs}
        key = json.dumps(kwargs, sort_keys=True)
        reuse = self.args["own"].get("worker", "per-call") == "per-config"
        if self._worker is not None and (not reuse or key != self._worker_key
                                         or self._worker.poll() is not None):
            if reuse and self._worker.poll() is None and "speculative_config" not in \
                    json.loads(self._worker_key or "{}"):
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
            self._start_worker(key)
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

    def _start_worker(self, key: str) -> None:
        python = str(self.args["own"].get("python") or sys.executable)
        self._log_path = self._tmp / f"worker{self._calls + 1}.log"
        log = open(self._log_path, "w")
        try:
            self._worker = subprocess.Popen(
                [python, "-m", "speccheck.engines.vllm_worker"], stdin=subprocess.PIPE,
                stdout=log, stderr=subprocess.STDOUT, env=self._worker_env(), text=True)
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
        shutil.rmtree(self._tmp, ignore_errors=True)


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
