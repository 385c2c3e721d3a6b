"""The embedded reference engine: the shipped small Qwen3.5-family model, in process.

Weights directory (the package's ``weights/`` or ``model=DIR``)::

    config.json         ReferenceConfig (model shape, drafter shape, special token ids)
    model.safetensors   target (HF Qwen3_5TextModel names) + mtp.* (vLLM Qwen3.5 MTP names)
    drafter.safetensors DFlash drafter (vLLM DFlashQwen3Model names)
    dflash2.safetensors DFlash2 drafter (vLLM DFlash2Qwen3Model names; its conv/selector
                        fields in the file's metadata), optional
    tokenizer.json      byte-level BPE (``tokenizers``), <|endoftext|> and <|mask|>

Without trained weights the networks get a fixed-seed random init, so everything runs (and
is deterministic) before training has happened.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from speccheck.engines.base import (Engine, EngineError, EngineUsageError, OnTokens,
                                    ScoringUnavailable, chat_knobs, rendered_thinking)
from speccheck.types import (Completion, Prompt, Replay, Request, Scored, SpecConfig, Workload,
                             WorkloadResult)

from .chat import identity as chat_identity
from .decode import FAULTS, Decoder, Knobs
from speccheck.types import request_seed, sampling_problem

from .sampling import SamplingParams
from .dflash2 import DFLASH2_FILE, WALK_DTYPES, SelectorKnobs, load_dflash2
from .kernels.attn_fused import unavailable as attn_fused_unavailable
from .kernels.gdn_fused import unavailable as gdn_fused_unavailable
from .model import (ATTN_FORMS, DRAFT_ATTN_FORMS, GDN_FORMS, DFlashDrafter, MTPModule,
                    Qwen3_5TextModel, ReferenceConfig, init_weights)

WEIGHTS_DIR = Path(__file__).parent / "weights"

#: engine args (``--engine-arg key=value``) -> (allowed values or None, default, one-line doc)
ENGINE_ARGS = {
    "gdn_prefill": (GDN_FORMS, "chunked", "GDN form for the prompt (and for score())"),
    "gdn_decode": (GDN_FORMS, "recurrent", "GDN form for one-token decode steps"),
    "gdn_verify": (GDN_FORMS, "chunked", "GDN form for the K+1-token verify forward"),
    "attn_prefill": (ATTN_FORMS, "multi", "attention form for the prompt (and for score())"),
    "attn_decode": (ATTN_FORMS, "single", "attention form for one-token decode steps"),
    "attn_verify": (ATTN_FORMS, "multi", "attention form for the verify forward"),
    "attn_draft": (DRAFT_ATTN_FORMS, "multi", "attention form of the DFlash / DFlash2 drafter "
                                              "(multi = SDPA; fused = the Triton kernel)"),
    "dtype": (("bf16", "fp32"), "bf16", "weights/activations dtype (GDN state, norms, logits fp32)"),
    "device": (("auto", "cpu", "cuda"), "auto", "auto = cuda when available"),
    # one thread by default: the toy model's ops are too small to gain from more (measured 313 vs
    # 326 tok/s), and spin-waiting OpenMP threads collapse (~50x) when the CPU is shared
    "threads": (None, "1", "torch CPU threads (default 1; empty = torch default)"),
    "batch": (None, "1", "prompts decoded together in one batch (each prefilled alone, then "
                         "decoding at its own length and, speculating, its own acceptance)"),
    "no_draft_every": (None, "0", "every N-th verify step carries no draft and decodes one "
                                  "token, as engines do near the context end or when the drafter "
                                  "has nothing (0 = never)"),
    "fault": (("none",) + tuple(FAULTS), "none", "planted spec-decode bug for self-tests"),
    "dflash2_selector": (("on", "off"), "on", "DFlash2 candidate selector; off = per-slot argmax "
                                               "(DFlash's rule)"),
    "dflash2_top_k": (None, "", "DFlash2 candidates per slot (empty = the checkpoint's "
                                "selector_top_k)"),
    "dflash2_walk": (tuple(WALK_DTYPES), "fp32", "dtype of the DFlash2 edge scores and walk"),
    "prefix_cache": (("on", "off"), "on", "a prompt prefilled before in this process reuses "
                                          "that prefill (the same bits; eager decoding, not the "
                                          "CUDA graphs path); off = every request prefills"),
    "cuda_graphs": (("on", "off"), "on", "CUDA: each decode, verify and draft step of one prompt "
                                         "replays a CUDA graph (no planted fault); off = eager"),
    "thinking": (("off", "on"), "off", "chat prompts render the chat template's thinking mode "
                                       "(the assistant turn opens a <think> block)"),
    "temperature": (None, "0", "sampling temperature (0 = greedy; > 0: every request sampled "
                               "with its own seed, speculative configs by speculative sampling)"),
    "top_p": (None, "1", "sampling: nucleus mass kept (1 = all)"),
    "sample_top_k": (None, "0", "sampling: most likely tokens kept (0 = all)"),
    "seed": (None, "0", "sampling: the run's seed (each request's is derived from it and its "
                        "prompt)"),
    "samples": (None, "1", "sampling: requests per prompt (the plan repeats each prompt; each "
                           "sample has its own seed)"),
    "compile": (("on", "off"), "off", "CUDA graphs: each step is torch.compile'd (Inductor fuses "
                                      "its small ops into Triton kernels) before its capture; "
                                      "bf16 roundings move (fused ops skip bf16 rounds)"),
}
#: engine args that pick code paths, not weights: :meth:`ReferenceEngine.with_args` changes them
#: on the loaded networks
PATH_ARGS = ("gdn_prefill", "gdn_decode", "gdn_verify", "attn_prefill", "attn_decode",
             "attn_verify", "attn_draft", "batch", "no_draft_every", "fault", "dflash2_selector",
             "dflash2_top_k", "dflash2_walk", "cuda_graphs", "compile", "prefix_cache", "thinking",
             "temperature", "top_p", "sample_top_k", "seed", "samples")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
#: the engine args that pick a kernel form per phase (Knobs fields; the identity's "knobs")
KNOB_ARGS = ("gdn_prefill", "gdn_decode", "gdn_verify", "attn_prefill", "attn_decode",
             "attn_verify", "attn_draft")


def _sha256(path: Path) -> str | None:
    if not path.is_file():
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


#: the most threads the engine starts (libgomp segfaults when asked for 100,000)
MAX_THREADS = 1024
SAMPLING_KEYS = ("temperature", "top_p", "sample_top_k", "seed", "samples")


def parse_engine_args(args: dict[str, str]) -> dict[str, str]:
    """Validated engine args with defaults filled in; EngineUsageError names the bad one."""
    unknown = sorted(set(args) - set(ENGINE_ARGS))
    if unknown:
        valid = "; ".join(f"{k} ({'|'.join(v[0]) if v[0] else 'int'}, default {v[1] or 'auto'})"
                          for k, v in ENGINE_ARGS.items())
        raise EngineUsageError(f"unknown --engine-arg {', '.join(unknown)} for the reference "
                               f"engine; valid: {valid}")
    out = {k: str(args.get(k, v[1])) for k, v in ENGINE_ARGS.items()}
    for k, (allowed, _, _) in ENGINE_ARGS.items():
        if allowed and out[k] not in allowed:
            raise EngineUsageError(f"--engine-arg {k}={out[k]!r} is not valid for the reference "
                                   f"engine; choose one of {', '.join(allowed)}")
    for key in ("threads", "batch", "dflash2_top_k"):
        if out[key] and not (out[key].isdigit() and int(out[key]) > 0):
            raise EngineUsageError(f"--engine-arg {key}={out[key]!r}: give a positive integer")
    if out["threads"] and int(out["threads"]) > MAX_THREADS:  # OpenMP crashes far past it
        raise EngineUsageError(f"--engine-arg threads={out['threads']}: give at most {MAX_THREADS} "
                               f"(this machine has {os.cpu_count() or 1} CPU cores)")
    bad = sampling_problem({k: out[k] for k in SAMPLING_KEYS if out.get(k) not in (None, "")})
    if bad:
        raise EngineUsageError(f"--engine-arg {bad}")
    if not out["no_draft_every"].isdigit():
        raise EngineUsageError(f"--engine-arg no_draft_every={out['no_draft_every']!r}: give 0 "
                               f"(every step drafts) or N >= 1 (every N-th verify step has no draft)")
    return out


#: the name the reference network goes by, here and in every checkpoint exported from it
REFERENCE_MODEL_NAME = "speccheck-reference-qwen3_5-tiny"


def reference_model_name(trained: bool = True, linear_head_dim: int | None = None) -> str:
    """The reference network's name: ``-untrained`` for the fixed-seed init, ``-gdn<D>`` for an
    export whose GDN heads were padded to D (another checkpoint, another hash)."""
    return (REFERENCE_MODEL_NAME + ("" if trained else "-untrained")
            + (f"-gdn{linear_head_dim}" if linear_head_dim else ""))


def load_networks(model_dir: Path, cfg: ReferenceConfig | None = None, draft: Path | None = None):
    """(config, target, mtp, drafter, trained) from a weights directory, fp32 on CPU.
    Missing files mean a fixed-seed random init of that part."""
    cfg_path = model_dir / "config.json"
    if cfg is None:
        cfg = _unbroken(cfg_path, lambda: ReferenceConfig.from_dict(json.loads(cfg_path.read_text()))
                        if cfg_path.is_file() else ReferenceConfig())
    target, mtp, drafter = _unbroken(cfg_path, lambda: (Qwen3_5TextModel(cfg), MTPModule(cfg), DFlashDrafter(cfg)))
    init_weights(target, 0)
    init_weights(mtp, 1)
    init_weights(drafter, 2)
    trained = False
    mfile = model_dir / "model.safetensors"
    if mfile.is_file():
        sd = _unbroken(mfile, lambda: load_file(str(mfile)))
        _load(target, {k: v for k, v in sd.items() if not k.startswith("mtp.")}, mfile)
        msd = {k[4:]: v for k, v in sd.items() if k.startswith("mtp.")}
        if msd:
            _load(mtp, msd, mfile)
        else:
            mtp = None
        trained = True
    dfile = model_dir / "drafter.safetensors"
    if draft is not None:
        dfile = draft / "drafter.safetensors" if draft.is_dir() else draft
        if not dfile.is_file():
            raise EngineUsageError(f"--draft {draft}: no drafter.safetensors there")
    if dfile.is_file():
        _load(drafter, _unbroken(dfile, lambda: load_file(str(dfile))), dfile)
    elif trained:
        drafter = None
    return cfg, target, mtp, drafter, trained


def load_file(path: str) -> dict:
    from safetensors.torch import load_file as load

    return load(path)


def _unbroken(path: Path, read):
    """``read()`` of a weights directory's file; a file that cannot be read as what it should
    be (truncated, not JSON, a field of the wrong type) is the user's input, said with its
    name -- not a crash."""
    try:
        return read()
    except EngineUsageError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors, json, torch and the config raise their own kinds
        raise EngineUsageError(f"{path}: cannot be loaded as the reference model's "
                               f"{ {'config.json': 'config', 'tokenizer.json': 'tokenizer'}.get(path.name, 'weights')} "
                               f"({type(e).__name__}: "
                               f"{str(e)[:200]}); give --model a directory `speccheck export-reference` or the "
                               "reference training wrote, or leave --model out for the shipped weights.") from None


def _load(module: torch.nn.Module, sd: dict, path: Path) -> None:
    sd = {k: v.float() for k, v in sd.items()}
    missing, unexpected = module.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise EngineUsageError(f"{path}: weights do not match the config (missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}); re-run the training script or "
                               f"point model= at a complete weights directory")


def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode (the printable stand-ins of the 256 bytes)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


class ReferenceEngine(Engine):
    name = "reference"
    methods = ("mtp", "dflash", "dflash2")
    replays_acceptance = True
    #: the workload axes its serving loop runs (reference/serving.py)
    axes = frozenset({"concurrency", "prefix_cache", "kv_pressure", "long_lived", "async_scheduling",
                      "chat_thinking", "shapes"})

    @classmethod
    def preflight(cls, model: str | None, engine_args: dict[str, str], draft: str | None) -> None:
        """Its arguments and model directory, before anything is written: a bad one is one
        message, not one failed run (or test) per config."""
        parse_engine_args(engine_args)
        if model and not Path(model).is_dir():
            raise EngineUsageError(f"--model {model}: not a directory; give a directory with config.json, "
                                   "model.safetensors, tokenizer.json")

    def __init__(self, model: str | None = None, engine_args: dict[str, str] | None = None,
                 draft: str | None = None) -> None:
        super().__init__(model, engine_args, draft)
        self.args = parse_engine_args(self.engine_args)
        self.model_dir = Path(model) if model else WEIGHTS_DIR
        if not self.model_dir.is_dir():
            raise EngineUsageError(f"--model {self.model_dir}: not a directory; give a directory "
                                   f"with config.json, model.safetensors, tokenizer.json")
        tok_path = self.model_dir / "tokenizer.json"
        if not tok_path.is_file():
            tok_path = WEIGHTS_DIR / "tokenizer.json"
        if not tok_path.is_file():
            raise EngineUsageError(f"no tokenizer.json in {self.model_dir} or {WEIGHTS_DIR}")
        from tokenizers import Tokenizer

        self.tokenizer = _unbroken(tok_path, lambda: Tokenizer.from_file(str(tok_path)))
        self.tok_path = tok_path
        if self.args["threads"]:
            torch.set_num_threads(int(self.args["threads"]))
        # a second process at these threads fits beside this one (runner.FreshAlongside)
        self.fresh_process_alongside = 2 * torch.get_num_threads() <= _cpus()
        dev = self.args["device"]
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        if dev == "cuda" and not torch.cuda.is_available():
            raise EngineUsageError("--engine-arg device=cuda but CUDA is not available here")
        self.device = torch.device(dev)
        if dev == "cuda":
            self.fresh_process_alongside = False  # one device, and its memory, per process
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cudnn.deterministic = True
        cfg = None
        if not (self.model_dir / "config.json").is_file():
            cfg = ReferenceConfig(eos_token_id=self._special("<|endoftext|>"),
                                  mask_token_id=self._special("<|mask|>"),
                                  vocab_size=self.tokenizer.get_vocab_size())
        self.cfg, target, mtp, drafter, self.trained = load_networks(
            self.model_dir, cfg, Path(draft) if draft else None)
        dtype = DTYPES[self.args["dtype"]]
        self.target, self.mtp, self.drafter = (
            None if m is None else m.to(self.device, dtype).eval() for m in (target, mtp, drafter))
        d2_file = self.model_dir / DFLASH2_FILE
        self.dflash2 = None
        if d2_file.is_file():
            self.dflash2 = _unbroken(d2_file, lambda: load_dflash2(d2_file, self.cfg).to(self.device, dtype).eval())
        self._set_knobs()
        #: requests this engine has served since it started (generate() and workloads alike)
        self.requests_served = 0
        #: the acceptance replay's teacher-forced passes (replay.forced), shared with variants
        self._replay_memo: OrderedDict = OrderedDict()

    def _set_knobs(self) -> None:
        if self.args["attn_prefill"] == "fused":
            raise EngineUsageError("--engine-arg attn_prefill=fused: the fused attention kernel "
                                   "is for a few queries at a time (decode, verify, drafts); "
                                   "choose multi or single for the prompt")
        for keys, unavailable, instead in (
                (("gdn_prefill", "gdn_decode", "gdn_verify"), gdn_fused_unavailable,
                 "chunked or recurrent"),
                (("attn_decode", "attn_verify", "attn_draft"), attn_fused_unavailable, "multi")):
            fused = [k for k in keys if self.args[k] == "fused"]
            why = fused and unavailable(self.device)
            if why:
                raise EngineUsageError(f"--engine-arg {fused[0]}=fused: {why}; choose {instead} "
                                       f"here")
        fault = None if self.args["fault"] == "none" else self.args["fault"]
        self.knobs = Knobs(fault=fault, no_draft_every=int(self.args["no_draft_every"]),
                           cuda_graphs=self.args["cuda_graphs"] == "on",
                           compile=self.args["compile"] == "on",
                           prefix_cache=self.args["prefix_cache"] == "on",
                           **{k: self.args[k] for k in KNOB_ARGS})
        top_k = self.args["dflash2_top_k"]
        self.selector = SelectorKnobs(self.args["dflash2_selector"] == "on",
                                      int(top_k) if top_k else None, self.args["dflash2_walk"])
        self.decoder = Decoder(self.cfg, self.target, self.mtp, self.drafter, self.knobs,
                               self.dflash2, self.selector)
        self.decoder.sampling = self.sampling = SamplingParams.from_args(self.args)

    def with_args(self, **overrides: str) -> "ReferenceEngine":
        """This engine under other code-path args (PATH_ARGS: a planted fault, kernel forms,
        batch), sharing the loaded networks: the self-test runs every fault on one load."""
        other = sorted(set(overrides) - set(PATH_ARGS))
        if other:
            raise EngineUsageError(f"engine args {', '.join(other)} change what is loaded; make a "
                                   f"new engine for them (with_args takes {', '.join(PATH_ARGS)})")
        variant = copy.copy(self)
        variant.engine_args = {**self.engine_args, **overrides}
        variant.args = parse_engine_args(variant.engine_args)
        variant._set_knobs()
        return variant

    def _special(self, token: str) -> int:
        i = self.tokenizer.token_to_id(token)
        if i is None:
            raise EngineUsageError(f"{self.tok_path}: tokenizer has no {token} token")
        return i

    # ------------------------------------------------------------------ Engine API

    def identity(self) -> dict:
        from speccheck.version import __version__

        files = {n: _sha256(self.model_dir / n)
                 for n in ("config.json", "model.safetensors", "drafter.safetensors",
                           DFLASH2_FILE)}
        target = {n: files[n] for n in ("config.json", "model.safetensors")}
        model_id = reference_model_name(self.trained)
        # the identity keys every engine shares: model_id, model_hash (the target, MTP included),
        # draft_hash (the external drafter), tokenizer_hash; golden check compares these
        return {
            "engine": self.name,
            "speccheck_version": __version__,
            "model_id": model_id,
            "model_path": str(self.model_dir),
            "model_hash": hashlib.sha256(json.dumps(target, sort_keys=True).encode()).hexdigest(),
            "draft_hash": files["drafter.safetensors"],
            "weights_sha256": files,
            "draft": self.draft,
            "tokenizer_hash": _sha256(self.tok_path),
            "dtype": self.args["dtype"],
            "device": str(self.device),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # SIMD kernels torch picked
            # (attn_draft only when not the default: goldens recorded before it compare equal)
            "knobs": {k: self.args[k] for k in KNOB_ARGS
                      if k != "attn_draft" or self.args[k] != ENGINE_ARGS[k][1]},
            "fault": self.args["fault"],
            **({"cuda_graphs": self.args["cuda_graphs"]} if self.device.type == "cuda" else {}),
            **({"compile": "on"} if self.device.type == "cuda" and self.knobs.compile else {}),
            "batch": int(self.args["batch"]),
            "prefix_cache": self.args["prefix_cache"],
            "no_draft_every": int(self.args["no_draft_every"]),
            # the template chat prompts render through (whether or not this engine rendered one
            # yet: an identity that depends on what ran before would not compare)
            "chat_template": chat_identity(self.args["thinking"] == "on"),
            "block_size": self.cfg.drafter.block_size,
            "dflash2": (None if self.dflash2 is None else
                        {"selector": self.args["dflash2_selector"],
                         "top_k": self.selector.top_k or self.dflash2.d2.selector_top_k,
                         "walk": self.selector.walk, "config": vars(self.dflash2.d2).copy()}),
        }

    def tokenize(self, prompt: Prompt) -> list[int]:
        """A text prompt as it is; chat messages rendered through the chat template
        (reference/chat.py: with thinking off, the text Prompt.as_text gives)."""
        if prompt.text is not None or not prompt.messages:
            return self.tokenizer.encode(prompt.as_text()).ids
        from .chat import render

        return self.tokenizer.encode(render(prompt.messages, self.args["thinking"] == "on")).ids

    def max_positions(self) -> int | None:
        return int(self.cfg.max_position_embeddings)

    def token_bytes(self, token_id: int) -> bytes | None:
        """GPT-2 byte-level BPE: each character of the token string stands for one byte."""
        piece = self.tokenizer.id_to_token(int(token_id))
        if piece is None:
            return None
        table = _unicode_to_byte()
        return bytes(table[ch] for ch in piece) if all(ch in table for ch in piece) else None

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def generate(self, prompts: Sequence[Prompt], prompt_ids: Sequence[Sequence[int]],
                 config: SpecConfig, top_k: int) -> list[Completion]:
        batch = int(self.args["batch"])
        return [c for i in range(0, len(prompts), batch)
                for c in self._generate_batch(prompts[i:i + batch], prompt_ids[i:i + batch],
                                              config, top_k)]

    def generate_together(self, prompts: Sequence[Prompt], prompt_ids: Sequence[Sequence[int]],
                          config: SpecConfig, top_k: int) -> list[Completion]:
        return self._generate_batch(prompts, prompt_ids, config, top_k)

    def generate_streaming(self, prompt: Prompt, prompt_ids: Sequence[int], config: SpecConfig,
                           top_k: int, on_tokens: OnTokens) -> Completion:
        """One prompt; each decode or verify step's tokens go to ``on_tokens`` as decided."""
        return self._generate_batch([prompt], [prompt_ids], config, top_k, [on_tokens])[0]

    def _generate_batch(self, prompts, prompt_ids, config: SpecConfig, top_k: int,
                        emit: list | None = None) -> list[Completion]:
        if config.method not in ("baseline",) + self.methods:
            raise EngineUsageError(f"--method {config.method!r} is not offered by the reference "
                                   f"engine; choose baseline, {', '.join(self.methods)}")
        names = ", ".join(dict.fromkeys(p.id for p in prompts))
        try:
            gens = self.decoder.generate_batch([list(ids) for ids in prompt_ids],
                                               [p.max_tokens for p in prompts],
                                               config.method, config.k, top_k,
                                               [p.ignore_eos for p in prompts], emit,
                                               seeds=[p.seed if p.seed is not None else
                                                      request_seed(self.sampling.seed, config.name,
                                                                   ids, p.sample)
                                                      for p, ids in zip(prompts, prompt_ids)]
                                               if self.sampling else None)
        except ValueError as e:
            raise EngineUsageError(f"prompt {names}: {e}") from e
        except RuntimeError as e:
            raise EngineError(f"reference engine failed on prompt {names}: {e}") from e
        self.requests_served += len(prompts)
        return [Completion(p.id, list(ids), g.token_ids, g.logprobs, g.topk_ids, g.topk_logprobs,
                           self.detokenize(g.token_ids), g.finish_reason, g.ttft_s, g.decode_s,
                           replace(g.spec, iterations=g.iterations) if g.spec else None, g.decode_cpu_s)
                for p, ids, g in zip(prompts, prompt_ids, gens)]

    def run_workload(self, workload: Workload, config: SpecConfig, top_k: int) -> WorkloadResult:
        """A workload axis's requests through the serving loop (reference/serving.py: continuous
        batching, the block prefix cache, a KV block budget); the proof is its own accounting,
        and ``requests_served`` this engine's count since it started."""
        from .serving import Server

        if config.method not in ("baseline",) + self.methods:
            raise EngineUsageError(f"--method {config.method!r} is not offered by the reference "
                                   f"engine; choose baseline, {', '.join(self.methods)}")
        if workload.axis not in self.axes:
            raise EngineUsageError(f"the reference engine cannot run the {workload.axis} workload "
                                   f"axis (it runs {', '.join(sorted(self.axes))})")
        server = self.__dict__.get("_server")
        if server is None or server.dec is not self.decoder:  # a with_args variant: its own
            server = self._server = Server(self.decoder)
        thinking, knobs = chat_knobs(workload.knobs)
        reqs, chat_proof, thinking_ids = list(workload.requests), {}, frozenset()
        if thinking is not None:
            reqs, chat_proof, thinking_ids = self._render_chat(reqs, thinking)
        try:
            gens, proof = server.serve(reqs, config.method, config.k, top_k,
                                       workload.max_in_flight, knobs, thinking_ids)
        except ValueError as e:
            raise EngineUsageError(f"{workload.axis} workload {workload.level}: {e}") from e
        except RuntimeError as e:
            raise EngineError(f"reference engine failed on the {workload.axis} workload "
                              f"{workload.level}: {e}") from e
        self.requests_served += len(reqs)
        proof["requests_served"] = self.requests_served
        proof.update(chat_proof)
        return WorkloadResult(
            [Completion(r.id, list(r.prompt_ids), g.token_ids, g.logprobs, g.topk_ids,
                        g.topk_logprobs, self.detokenize(g.token_ids), g.finish_reason, g.ttft_s,
                        g.decode_s, replace(g.spec, iterations=g.iterations) if g.spec else None)
             for r, g in zip(reqs, gens)], proof)

    def _render_chat(self, reqs: list[Request], thinking: bool):
        """Each request's messages rendered through the chat template with enable_thinking as
        asked (the token ids it came with are not used); the proof counts the prompts rendered
        and, read back from the rendered ids, those rendered in thinking mode."""
        from .chat import render

        out, rendered, ids_thinking = [], 0, set()
        for r in reqs:
            if not r.prompt.messages:
                raise EngineUsageError(f"request {r.id}: chat_template=on needs chat messages")
            ids = self.tokenizer.encode(render(r.prompt.messages, thinking)).ids
            without = self.detokenize(self.tokenizer.encode(render(r.prompt.messages, False)).ids)
            rendered += 1
            if thinking and rendered_thinking(self.detokenize(ids), without):
                ids_thinking.add(r.id)
            out.append(replace(r, prompt_ids=tuple(ids)))
        return out, {"chat_rendered": rendered, "thinking_prompts": len(ids_thinking)}, frozenset(ids_thinking)

    def gpus(self) -> int:
        """One GPU where this engine runs on CUDA (device=cuda, or auto where CUDA is), else 0:
        an executor gives every cell of a suite the same device as the engine that plans it."""
        return 1 if self.device.type == "cuda" else 0

    def capture_sizes(self, config: SpecConfig) -> tuple[int, ...]:
        """The graph sizes its serving loop pads batched steps to (serving.capture_sizes)."""
        from .serving import capture_sizes

        return capture_sizes(0 if config.is_baseline else config.k)

    def cache_block_size(self) -> int:
        from .serving import DEFAULT_BLOCK_SIZE

        return DEFAULT_BLOCK_SIZE

    def score(self, prompt_ids: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
              top_k: int) -> list[Scored]:
        out = []
        for p, c in zip(prompt_ids, continuations):
            ids, lps, tok = self.decoder.score(list(p), list(c), top_k)
            out.append(Scored(ids, lps, tok))
        return out

    def sampled_score_top_k(self) -> int:
        """The whole vocabulary: the scored distribution is exact, no tail."""
        return int(self.cfg.vocab_size)

    def vocab_size(self) -> int | None:
        return int(self.cfg.vocab_size)

    def replay_acceptance(self, config: SpecConfig, prompt_ids: Sequence[Sequence[int]],
                          outputs: Sequence[Sequence[int]],
                          max_tokens: Sequence[int]) -> list[Replay]:
        """Each request's steps replayed by reference/replay.py: the target teacher forced
        once over prompt + output, the drafter from scratch per step, on these networks and
        kernel-form knobs and never the planted fault (the Decoder is not used)."""
        from .replay import replay_acceptance

        method = config.method
        if method not in self.methods:
            raise EngineUsageError(f"replay of {config.name}: the reference engine replays "
                                   f"{', '.join(self.methods)}, not {method!r}")
        drafter = {"mtp": self.mtp, "dflash": self.drafter, "dflash2": self.dflash2}[method]
        if drafter is None:
            raise EngineUsageError(f"replay of {config.name}: this weights directory has no "
                                   f"{method} drafter")
        if not (len(prompt_ids) == len(outputs) == len(max_tokens)):
            raise ValueError("replay_acceptance: prompt_ids, outputs and max_tokens differ in length")
        return replay_acceptance(self, method, config.k, prompt_ids, outputs, max_tokens)

    def attribution_variants(self, configs=(), ran=None) -> dict[str, dict[str, str]]:
        """Other kernel paths for the same network: GDN all-recurrent / all-chunked,
        attention all-single / all-multi, and fp32 (each only if it differs from now)."""
        a = self.args
        variants = {
            "gdn=recurrent": {"gdn_prefill": "recurrent", "gdn_decode": "recurrent",
                              "gdn_verify": "recurrent"},
            "gdn=chunked": {"gdn_prefill": "chunked", "gdn_decode": "chunked",
                            "gdn_verify": "chunked"},
            "attn=single": {"attn_prefill": "single", "attn_decode": "single",
                            "attn_verify": "single"},
            "attn=multi": {"attn_prefill": "multi", "attn_decode": "multi", "attn_verify": "multi"},
            "dtype=fp32": {"dtype": "fp32"},
        }
        return {label: v for label, v in variants.items()
                if any(a[key] != val for key, val in v.items())}

    def default_k(self, method: str) -> int | None:
        if method in ("dflash", "dflash2"):
            return self.cfg.drafter.block_size - 1
        if method == "mtp":
            return 3
        return None

    def close(self) -> None:
        self.decoder = None
        self.__dict__.pop("_replay_memo", None)  # replay.forced's teacher-forced passes
