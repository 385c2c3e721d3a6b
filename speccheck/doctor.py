"""`speccheck doctor`: what this machine (and a model, and a server) can run, before a run
fails twenty minutes in. Each finding says what was seen and, when something is wrong, the fix;
what cannot be checked here is said plainly instead of guessed.

Nothing here imports vLLM, flash-attn or FlashInfer (importing them can take a minute and
initialise CUDA): packages are found with ``importlib.util.find_spec`` and their versions read
from their metadata.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

OK, WARN, FAIL, UNKNOWN = "ok", "warn", "FAIL", "can't check"


@dataclass
class Finding:
    status: str  # OK | WARN | FAIL | UNKNOWN
    topic: str
    seen: str
    fix: str = ""

    def line(self) -> str:
        return f"[{self.status:^11}] {self.topic}: {self.seen}" + (f"\n              fix: {self.fix}" if self.fix else "")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def platform_findings() -> list[Finding]:
    out = [Finding(OK, "python", f"{platform.python_version()} on {platform.system()} {platform.machine()}")]
    try:
        proc_version = Path("/proc/version").read_text()
    except OSError:
        proc_version = ""
    return out + [wsl_finding(proc_version, platform.uname().release,
                              os.environ.get("VLLM_WSL2_ENABLE_PIN_MEMORY"))]


#: the first WSL2 kernel with (limited) pinned-memory support for CUDA (vLLM 0.26,
#: platforms/cuda.py ``is_pin_memory_available``)
WSL_PIN_KERNEL = (4, 19, 121)


def wsl_finding(proc_version: str, release: str, pin: str | None) -> Finding:
    """Pinned memory under WSL2, as vLLM 0.26 decides it: off below kernel 4.19.121 whatever
    the setting, else only with VLLM_WSL2_ENABLE_PIN_MEMORY=1 (an int; anything but 0 is on).
    Without it host-device copies are slower, and what needs pinned memory or UVA (CPU
    offload, the V2 model runner that DFlash2 runs in) is not available."""
    text = proc_version.lower()
    if "microsoft" not in text and "wsl" not in text:
        return Finding(OK, "WSL2", "not WSL2 (VLLM_WSL2_ENABLE_PIN_MEMORY does not apply)")
    try:
        kernel = tuple(int(x) for x in release.split("-")[0].split(".")[:3])
    except ValueError:
        kernel = None
    if kernel is None or kernel < WSL_PIN_KERNEL:
        return Finding(WARN, "WSL2", f"running under WSL2, kernel {release or 'unknown'}: vLLM turns pinned "
                       "memory off below 4.19.121 whatever VLLM_WSL2_ENABLE_PIN_MEMORY says",
                       "run `wsl --update` (Windows side), then export VLLM_WSL2_ENABLE_PIN_MEMORY=1")
    try:
        on = pin is not None and int(pin) != 0
    except ValueError:
        return Finding(FAIL, "WSL2", f"VLLM_WSL2_ENABLE_PIN_MEMORY={pin!r}: vLLM reads it as an integer and "
                       "fails to start", "export VLLM_WSL2_ENABLE_PIN_MEMORY=1")
    return Finding(OK if on else WARN, "WSL2",
                   f"running under WSL2 (kernel {release}); VLLM_WSL2_ENABLE_PIN_MEMORY={pin or 'unset'}",
                   "" if on else "export VLLM_WSL2_ENABLE_PIN_MEMORY=1 (vLLM disables pinned memory on WSL2 "
                   "otherwise: slower host-device copies, and no V2 model runner, which DFlash2 needs)")


def gpu_findings() -> tuple[list[Finding], dict]:
    """torch, CUDA, the GPUs and their free memory; ``info`` carries numbers for later checks."""
    out: list[Finding] = []
    info: dict = {}
    tv = _version("torch")
    if tv is None:
        out.append(Finding(FAIL, "torch", "not installed", "pip install torch (the reference engine needs it)"))
        return out, info
    out.append(Finding(OK, "torch", tv))
    smi = shutil.which("nvidia-smi")
    driver = None
    if smi:
        try:
            q = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
            driver = q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip() else None
        except (OSError, subprocess.TimeoutExpired):
            driver = None
    import torch

    if not torch.cuda.is_available():
        out.append(Finding(UNKNOWN, "GPU", "no CUDA device visible to torch "
                           f"(torch CUDA build: {torch.version.cuda or 'none, a CPU build'}; nvidia-smi: "
                           f"{'found' if smi else 'not found'}): the GPU, driver, free memory and which "
                           "kernels vLLM picks cannot be checked on this machine",
                           "run `speccheck doctor` on the GPU host; here the reference engine runs on CPU"))
        return out, info
    info["cuda"] = torch.version.cuda
    out.append(Finding(OK, "driver", f"{driver or 'unknown (nvidia-smi not found)'}; torch built for CUDA {torch.version.cuda}"))
    for i in range(torch.cuda.device_count()):
        name = torch.cuda.get_device_name(i)
        cap = torch.cuda.get_device_capability(i)
        free, total = torch.cuda.mem_get_info(i)
        info.setdefault("gpus", []).append({"name": name, "capability": cap, "free": free, "total": total})
        out.append(Finding(OK, f"GPU {i}", f"{name}, compute capability {cap[0]}.{cap[1]}, "
                           f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free"))
    return out, info


def backend_findings(info: dict) -> list[Finding]:
    """Which GDN and attention backends vLLM would pick here, and which are importable."""
    out: list[Finding] = []
    vv = _version("vllm")
    if vv is None:
        out.append(Finding(WARN, "vLLM", "not installed (only the reference and openai engines can run)",
                           "pip install 'speccheck[vllm]' for --engine vllm (an offline host: install the wheels vLLM pins into a venv and pass --engine-arg python=VENV/bin/python)"))
    else:
        out.append(Finding(OK, "vLLM", vv))
    triton = _version("triton")
    fla_vendored = vv and any(_importable(m) for m in (  # 0.26 vendors it under third_party
        "vllm.third_party.flash_linear_attention", "vllm.model_executor.layers.fla"))
    fla = _version("flash-linear-attention") or _version("fla-core")
    gdn = ("vLLM's vendored FLA Triton kernels" if fla_vendored else
           f"fla {fla}" if fla else None)
    out.append(Finding(OK if triton and gdn else (WARN if vv else UNKNOWN), "GDN kernels",
                       f"Triton {triton or 'not installed'}; " + (f"{gdn} importable" if gdn else
                                                                     "no FLA kernels importable"),
                       "" if triton and gdn else "GDN layers run on Triton/FLA: install triton (comes with "
                       "torch CUDA builds) and vLLM; `speccheck kernels gdn` compares them"))
    fi = _version("flashinfer-python") or _version("flashinfer")
    fa = (_importable("vllm.vllm_flash_attn") if vv else False) or _importable("flash_attn_interface")
    out.append(Finding(OK, "attention backends importable",
                       f"FlashInfer {fi or 'no'}; FlashAttention (FA2/FA3) {'yes' if fa else 'no'}; Triton "
                       f"attention {'yes' if triton else 'no'}"))
    gpus = info.get("gpus") or []
    if not gpus:
        out.append(Finding(UNKNOWN, "attention backend vLLM picks",
                           "needs a GPU (it depends on the compute capability)",
                           "on the GPU host: FA3 on Hopper (9.0) when vLLM's flash-attn is built with it, "
                           "FlashAttention 2 on Ampere/Ada, else FlashInfer or TRITON_ATTN"))
    else:
        major = gpus[0]["capability"][0]
        pick = ("FLASH_ATTN (FA3)" if major == 9 and fa else "FLASH_ATTN (FA2)" if major >= 8 and fa
                else "FLASHINFER" if fi else "TRITON_ATTN")
        out.append(Finding(OK, "attention backend vLLM picks", f"{pick} for the target by default; the MTP "
                           "drafter picks its own. speccheck's vLLM runs that are known to work pass "
                           "attention_backend=TRITON_ATTN and gdn_prefill_backend=triton",
                           "" if pick != "TRITON_ATTN" else "install vLLM's flash-attn or FlashInfer for speed"))
    return out


def gdn_prefill_finding(capability: tuple[int, int] | None, head_k_dim: int | None,
                        flashinfer: str | None, cute_dsl: bool) -> Finding:
    """The GDN prefill kernel vLLM 0.26 will run (``_resolve_gdn_prefill_backend`` in
    model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py): FlashInfer's on SM90 whatever the
    head dim, on SM10x only at head dim 128, else Triton/FLA. FlashInfer 0.6.14's SM90 kernel
    (CuTe DSL) takes head dim 128 only and needs nvidia-cutlass-dsl importable, so a model or
    an install that does not fit fails at its first prefill, not at start-up."""
    fix = ("start vLLM with --gdn-prefill-backend triton (offline: additional_config="
           "{\"gdn_prefill_backend\": \"triton\"})")
    if capability is None:
        return Finding(UNKNOWN, "GDN prefill kernel vLLM picks", "needs a GPU (FlashInfer's on Hopper, "
                       "Triton/FLA on most others)", "")
    if capability[0] == 9:
        if not flashinfer:
            return Finding(FAIL, "GDN prefill kernel vLLM picks", "FlashInfer's (vLLM 0.26 on SM90), but "
                           "flashinfer-python is not installed", f"pip install flashinfer-python, or {fix}")
        if not cute_dsl:
            return Finding(FAIL, "GDN prefill kernel vLLM picks", f"FlashInfer {flashinfer}'s CuTe-DSL "
                           "kernel (SM90), but `cutlass` (nvidia-cutlass-dsl) does not import here",
                           "pip install nvidia-cutlass-dsl (a tree on PYTHONPATH also needs its "
                           f"nvidia_cutlass_dsl/dsl_packages on PYTHONPATH: .pth files are not read there), or {fix}")
        if head_k_dim is not None and head_k_dim != 128:
            return Finding(FAIL, "GDN prefill kernel vLLM picks", f"FlashInfer {flashinfer}'s (SM90), which "
                           f"takes head dim 128 only; this model's linear_key_head_dim is {head_k_dim}",
                           f"{fix}, or export the model padded to 128 (speccheck export-reference "
                           "--linear-head-dim 128 for the reference model)")
        return Finding(OK, "GDN prefill kernel vLLM picks", f"FlashInfer {flashinfer}'s CuTe-DSL kernel "
                       "(SM90; JIT-compiled at the first prefill)" + ("" if head_k_dim else
                       "; give --model to check its head dim"))
    if capability[0] == 10 and head_k_dim == 128:
        return Finding(OK if flashinfer else FAIL, "GDN prefill kernel vLLM picks",
                       "FlashInfer's (SM10x, head dim 128)" + ("" if flashinfer else ": not installed"),
                       "" if flashinfer else f"pip install flashinfer-python, or {fix}")
    return Finding(OK, "GDN prefill kernel vLLM picks", f"Triton/FLA (compute capability "
                   f"{capability[0]}.{capability[1]})")


def model_findings(model: str, info: dict, k: int, gpu_memory_utilization: float = 0.9,
                   tp: int = 1) -> list[Finding]:
    """Weights + the KV cache (attention layers) + the GDN state the model and K need, per GPU
    at tensor parallel size ``tp`` (weights and GDN heads split ``tp`` ways, KV heads split or
    replicated as vLLM does), against the free memory of each of the first ``tp`` GPUs."""
    from speccheck.engines.vllm import HEAD_KEYS, model_heads, tp_fits

    path = Path(model)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        return [Finding(FAIL, "model", f"{model}: no config.json there",
                        "give --model the directory of a Hugging Face checkpoint (speccheck export-reference "
                        "writes one for the reference model)")]
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return [Finding(FAIL, "model", f"{cfg_path}: unreadable ({e})", "fix or re-export the checkpoint")]
    text = cfg.get("text_config") or cfg
    layers = text.get("layer_types") or []
    attn = sum(1 for t in layers if t == "full_attention") or int(text.get("num_hidden_layers", 0)) // 4
    gdn = sum(1 for t in layers if t == "linear_attention")
    kv_heads = int(text.get("num_key_value_heads", text.get("num_attention_heads", 1)))
    head_dim = int(text.get("head_dim", text.get("hidden_size", 0) // max(int(text.get("num_attention_heads", 1)), 1)))
    positions = int(text.get("max_position_embeddings", 8192))
    dtype_bytes = 4 if str(text.get("torch_dtype") or cfg.get("torch_dtype")) in ("float32", "fp32") else 2
    kv_rank = max(1, kv_heads // tp)  # KV heads per rank: split, or one replica each when tp > kv
    kv_per_token = 2 * attn * kv_rank * head_dim * dtype_bytes
    kv_seq = kv_per_token * (positions + k + 1)
    v_heads = int(text.get("linear_num_value_heads", 0))
    gdn_state = gdn * v_heads * int(text.get("linear_key_head_dim", 0)) * int(text.get("linear_value_head_dim", 0)) * 4 // tp
    weights = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    need = weights / tp + kv_seq + gdn_state * (k + 2)  # spec decode keeps per-draft-step GDN states
    per = f" per GPU at TP={tp}" if tp > 1 else ""
    out = [Finding(OK, "model", f"{path.name}: {attn} attention + {gdn} GDN layers, {positions} positions, "
                   f"weights {weights / 2**30:.2f} GiB{f' ({weights / tp / 2**30:.2f} GiB per GPU)' if tp > 1 else ''}, "
                   f"KV cache {kv_seq / 2**20:.1f} MiB{per} for one full-length sequence at K={k}, "
                   f"GDN state {gdn_state / 2**20:.1f} MiB{per} per sequence")]
    if tp > 1:
        heads = model_heads(cfg)
        bad = tp_fits(heads, tp)
        shown = ", ".join(f"{n} {HEAD_KEYS[key]}" for key, n in heads.items())
        fits = [n for n in range(1, 65) if not tp_fits(heads, n)][:8]
        out.append(Finding(FAIL if bad else OK, f"model heads at TP={tp}",
                           f"{', '.join(bad)} do not split {tp} ways" if bad else f"{shown} shard {tp} ways",
                           f"use a TP size that fits: {', '.join(map(str, fits))}" if bad else ""))
    gpus = (info.get("gpus") or [])[:tp]
    if not gpus:
        out.append(Finding(UNKNOWN, "GPU memory for this model",
                           f"needs ~{need / 2**30:.2f} GiB{per}; no GPU here to compare with"))
    elif len(gpus) < tp:
        out.append(Finding(UNKNOWN, "GPU memory for this model",
                           f"needs ~{need / 2**30:.2f} GiB{per}; only {len(gpus)} GPU(s) visible for TP={tp} "
                           "(see the TP finding)"))
    else:
        low = min(range(len(gpus)), key=lambda i: gpus[i]["free"])
        budget = gpus[low]["free"] * gpu_memory_utilization
        ok = budget > need * 1.2
        where = f" on GPU {low}, the fullest of the {tp}" if tp > 1 else ""
        out.append(Finding(OK if ok else FAIL, "GPU memory for this model",
                           f"needs ~{need / 2**30:.2f} GiB{per} (+ activations), {budget / 2**30:.1f} GiB available"
                           f"{where} at gpu_memory_utilization={gpu_memory_utilization}",
                           "" if ok else "free the GPU(s), raise --engine-arg gpu_memory_utilization, lower "
                           "--engine-arg max_model_len, or raise tensor_parallel_size"))
    return out


def parallel_findings(tp: int, info: dict, topo, visible_indices: list[int] | None,
                      peer: dict[tuple[int, int], bool] | None) -> list[Finding]:
    """What a TP run over ``tp`` GPUs needs: that many visible GPUs, the links between the
    first ``tp`` of them (``nvidia-smi topo -m``, parsed: a Topology or None), and P2P access
    between them (``torch.cuda.can_device_access_peer``; None: not checked). vLLM 0.26 turns
    its custom all-reduce off on more than two GPUs not all joined by NVLink, and wherever P2P
    fails; all-reduce then runs through NCCL alone -- another kernel, so near-ties may flip
    differently than on a host where it runs."""
    from speccheck.topology import describe_link, is_nvlink, weakest_link

    if tp <= 1:
        return []
    gpus = info.get("gpus")
    if gpus is None:
        return [Finding(UNKNOWN, f"GPUs for TP={tp}", "no CUDA device visible: the GPU count, the links "
                        "between the GPUs (nvidia-smi topo -m) and P2P access cannot be checked here",
                        f"run `speccheck doctor --engine vllm --tp {tp}` on the GPU host")]
    out = []
    if len(gpus) < tp:
        cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
        out.append(Finding(FAIL, f"GPUs for TP={tp}", f"{len(gpus)} GPU(s) visible"
                           + (f" (CUDA_VISIBLE_DEVICES={cvd})" if cvd is not None else ""),
                           f"expose {tp} GPUs (e.g. CUDA_VISIBLE_DEVICES={','.join(map(str, range(tp)))}) or "
                           f"lower --engine-arg tensor_parallel_size to {len(gpus)} or less"))
        return out
    out.append(Finding(OK, f"GPUs for TP={tp}", f"{len(gpus)} visible; ranks 0..{tp - 1} on GPUs "
                       + ", ".join(g["name"] for g in gpus[:tp])))
    used = (visible_indices or [])[:tp]
    if topo is None or len(used) < tp:
        out.append(Finding(UNKNOWN, "GPU links", "nvidia-smi topo -m gave no GPU matrix" if topo is None else
                           "which nvidia-smi GPUs CUDA_VISIBLE_DEVICES names is unknown (UUIDs)",
                           "check `nvidia-smi topo -m` by hand: NV# between the GPUs is NVLink"))
    else:
        link = weakest_link(topo, used)
        nv = is_nvlink(link)
        custom_off = tp > 2 and not nv
        slow = link in ("PHB", "NODE", "SYS")
        seen = f"GPUs {', '.join(map(str, used))}: slowest link {describe_link(link)}"
        if custom_off:
            seen += "; vLLM turns custom all-reduce off on more than two GPUs not all joined by NVLink"
        out.append(Finding(WARN if slow or custom_off else OK, "GPU links", seen,
                           "pick GPUs joined by NVLink or one PCIe switch (CUDA_VISIBLE_DEVICES; see "
                           "`nvidia-smi topo -m`); every layer all-reduces across them" if slow or custom_off
                           else ""))
    if peer is None:
        out.append(Finding(UNKNOWN, "P2P access", "not checked"))
    else:
        missing = [f"{i}->{j}" for (i, j), ok in sorted(peer.items()) if not ok]
        out.append(Finding(WARN if missing else OK, "P2P access",
                           f"no P2P between GPUs {', '.join(missing)}: vLLM turns custom all-reduce off and "
                           "NCCL goes through host memory" if missing else
                           f"every pair of the {tp} GPUs can access each other's memory",
                           "on bare metal enable P2P (IOMMU/ACS settings of the PCIe switch); in a VM or "
                           "WSL2 P2P is often unavailable: expect slower all-reduce, and pass --engine-arg "
                           "disable_custom_all_reduce=true to say so" if missing else ""))
    return out


def peer_access(n: int) -> dict[tuple[int, int], bool] | None:
    """``torch.cuda.can_device_access_peer`` for every ordered pair of the first ``n`` GPUs."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        return None
    return {(i, j): bool(torch.cuda.can_device_access_peer(i, j))
            for i in range(n) for j in range(n) if i != j}


#: every probe of a server together may take this long (a server that accepts connections and
#: never answers, or drips its answer, is given up on; the wait is said every HEARTBEAT_S)
SERVER_DEADLINE_S = 30.0
#: one probe's wait for the server's next bytes
SERVER_TIMEOUT_S = 10.0


class _Unanswered(Exception):
    """The probes' total deadline passed while the server's answer was still awaited."""


def server_findings(base_url: str, api_key_env: str | None = None,
                    deadline: float | None = None) -> list[Finding]:
    """The server's models, version and metrics, each probe read within what is left of one
    total ``deadline`` and said on stderr while it waits (the openai engine's own waiting)."""
    import httpx

    from speccheck.engines.openai import _Deadline, _Waiting, server_root

    try:
        root = server_root(base_url)
        httpx.URL(root + "/v1/models")
    except (httpx.InvalidURL, ValueError, TypeError) as e:
        return [Finding(FAIL, "server", f"{base_url}: not a URL ({e})", "fix --base-url, e.g. http://127.0.0.1:8000")]
    key = os.environ.get(api_key_env or "OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    out: list[Finding] = []
    deadline = SERVER_DEADLINE_S if deadline is None else deadline
    wait = _Waiting(f"the server at {root} to answer doctor's probes", min(SERVER_TIMEOUT_S, deadline), deadline,
                    hint="")

    def get(client: httpx.Client, path: str) -> httpx.Response:
        try:
            with client.stream("GET", root + path, timeout=wait.attempt_timeout()) as r:
                body = b""
                for chunk in r.iter_raw():  # a drip is still a wait: only a whole answer counts
                    wait.check()
                    body += chunk
                    if len(body) > 16 * 2 ** 20:
                        raise ValueError(f"{path} answered more than 16 MiB")
                whole = httpx.Response(r.status_code, headers=r.headers, content=body, request=r.request)
                whole.read()
                wait.touch()
                return whole
        except _Deadline:
            raise _Unanswered(f"{path}: the answer was still arriving after {deadline:.0f} s") from None
        except httpx.TimeoutException as e:
            raise _Unanswered(f"{path}: nothing arrived for {wait.attempt_timeout().read:.0f} s "
                              f"({type(e).__name__})") from None

    try:
        with wait, httpx.Client(headers=headers) as client:
            r = get(client, "/v1/models")
            if r.status_code in (401, 403):
                return [Finding(FAIL, "server", f"{root}/v1/models: {r.status_code} (the API key is refused)",
                                f"export {api_key_env or 'OPENAI_API_KEY'}=<the server's key>")]
            r.raise_for_status()
            data = r.json().get("data", [])
            if not isinstance(data, list):
                raise ValueError("'data' is not a list of models")
            models = [m.get("id") for m in data]
            out.append(Finding(OK, "server", f"{root} serves {', '.join(map(str, models)) or 'no model'}"))
            v = get(client, "/version")
            out.append(Finding(OK if v.status_code == 200 else WARN, "server version",
                               str(v.json().get("version", "?")) if v.status_code == 200 else f"/version: {v.status_code}"))
            m = get(client, "/metrics")
            spec = m.status_code == 200 and "spec_decode_num_drafts" in m.text
            out.append(Finding(OK if m.status_code == 200 else WARN, "server metrics",
                               "/metrics has the spec-decode counters" if spec else
                               "/metrics reachable, no spec-decode counters (a baseline server, or spec decode off)"
                               if m.status_code == 200 else f"/metrics: {m.status_code}",
                               "" if m.status_code == 200 else "acceptance needs /metrics; run vLLM with metrics on"))
    except _Unanswered as e:
        out.append(Finding(FAIL, "server", f"{root} did not answer in time ({e}; {deadline:.0f} s for every "
                           "probe in all)", "is the server up and not overloaded? check --base-url"))
    except httpx.InvalidURL as e:
        out.append(Finding(FAIL, "server", f"{root}: not a URL ({e})", "fix --base-url, e.g. http://127.0.0.1:8000"))
    except httpx.HTTPError as e:
        out.append(Finding(FAIL, "server", f"{root}: {type(e).__name__}: {e}",
                           "start the server (e.g. `speccheck serve`, or vLLM's `vllm serve`), or fix --base-url"))
    except (ValueError, AttributeError, TypeError) as e:  # JSON of another shape than vLLM's
        out.append(Finding(FAIL, "server", f"{root}: not an OpenAI-compatible answer ({e})", "check --base-url"))
    return out


def cute_dsl_warmup_finding(capability: tuple[int, int] | None, cute_dsl: bool, quack: bool) -> Finding | None:
    """vLLM 0.26 warms up its CuTe-DSL router GEMM on SM90+ whenever ``cutlass`` imports
    (model_executor/warmup/kernel_warmup.py, ``_warmup_ll_bf16_router_gemm``), and that
    imports ``quack`` (quack-kernels, one of vLLM's requirements): with FlashInfer's CuTe-DSL
    installed but not quack, every engine start fails there (seen on the H200)."""
    if capability is None or capability[0] < 9 or not cute_dsl:
        return None
    if quack:
        return Finding(OK, "CuTe-DSL warm-up", "cutlass and quack import (vLLM's router GEMM warm-up)")
    return Finding(FAIL, "CuTe-DSL warm-up", "cutlass (CuTe DSL) imports but quack does not: vLLM 0.26's "
                   "kernel warm-up imports quack whenever cutlass imports, so the engine fails to start",
                   "pip install quack-kernels (vLLM 0.26 requires it), or take nvidia-cutlass-dsl off the "
                   "path (then use --gdn-prefill-backend triton: FlashInfer's SM90 GDN kernel needs it)")


def _linear_key_head_dim(model: str | None) -> int | None:
    try:
        cfg = json.loads((Path(model) / "config.json").read_text()) if model else {}
    except (OSError, json.JSONDecodeError):
        return None
    value = (cfg.get("text_config") or cfg).get("linear_key_head_dim")
    return int(value) if value else None


def _cute_dsl_importable() -> bool:
    """``cutlass`` as FlashInfer imports it: installed, or staged with its dsl_packages dir."""
    if _importable("cutlass"):
        return True
    spec = importlib.util.find_spec("nvidia_cutlass_dsl") if _importable("nvidia_cutlass_dsl") else None
    return bool(spec and spec.submodule_search_locations and any(
        (Path(p) / "dsl_packages" / "cutlass").is_dir() for p in spec.submodule_search_locations))


def diagnose(engine: str = "reference", model: str | None = None, base_url: str | None = None,
             api_key_env: str | None = None, k: int = 7, tp: int = 1) -> list[Finding]:
    from speccheck.topology import host_topology, visible_gpus

    findings = platform_findings()
    gpu, info = gpu_findings()
    findings += gpu + backend_findings(info)
    if tp > 1:
        topo = host_topology() if info.get("gpus") else None
        indices = visible_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), topo.gpus)[1] if topo else None
        findings += parallel_findings(tp, info, topo, indices,
                                      peer_access(tp) if len(info.get("gpus") or []) >= tp else None)
    if engine == "vllm" or _version("vllm"):
        gpus = info.get("gpus") or []
        cap, cute_dsl = (tuple(gpus[0]["capability"]) if gpus else None), _cute_dsl_importable()
        findings.append(gdn_prefill_finding(cap, _linear_key_head_dim(model),
                                            _version("flashinfer-python") or _version("flashinfer"),
                                            cute_dsl))
        warmup = cute_dsl_warmup_finding(cap, cute_dsl, _importable("quack"))
        if warmup:
            findings.append(warmup)
    if model:
        findings += model_findings(model, info, k, tp=tp)
    elif engine == "vllm":
        findings.append(Finding(UNKNOWN, "model", "no --model given: the KV cache it needs cannot be estimated",
                                "speccheck doctor --engine vllm --model PATH"))
    if base_url or engine == "openai":
        findings += server_findings(base_url or os.environ.get("OPENAI_BASE_URL") or "http://127.0.0.1:8000",
                                    api_key_env)
    return findings
