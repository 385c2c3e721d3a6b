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
        release = Path("/proc/version").read_text().lower()
    except OSError:
        release = ""
    if "microsoft" in release or "wsl" in release:
        pin = os.environ.get("VLLM_WSL2_ENABLE_PIN_MEMORY")
        out.append(Finding(OK if pin == "1" else WARN, "WSL2",
                           f"running under WSL2; VLLM_WSL2_ENABLE_PIN_MEMORY={pin or 'unset'}",
                           "" if pin == "1" else "export VLLM_WSL2_ENABLE_PIN_MEMORY=1 (vLLM disables pinned "
                           "memory on WSL2 otherwise, which slows host-device copies)"))
    else:
        out.append(Finding(OK, "WSL2", "not WSL2 (VLLM_WSL2_ENABLE_PIN_MEMORY does not apply)"))
    return out


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
                           "pip install 'speccheck[vllm]' (or stage it: tools/stage-vllm.sh) for --engine vllm"))
    else:
        out.append(Finding(OK, "vLLM", vv))
    triton = _version("triton")
    fla_vendored = _importable("vllm.model_executor.layers.fla") if vv else False
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


def model_findings(model: str, info: dict, k: int, gpu_memory_utilization: float = 0.9) -> list[Finding]:
    """Weights + the KV cache (attention layers) + the GDN state the model and K need, against
    free GPU memory."""
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
    kv_per_token = 2 * attn * kv_heads * head_dim * dtype_bytes
    kv_seq = kv_per_token * (positions + k + 1)
    v_heads = int(text.get("linear_num_value_heads", 0))
    gdn_state = gdn * v_heads * int(text.get("linear_key_head_dim", 0)) * int(text.get("linear_value_head_dim", 0)) * 4
    weights = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    need = weights + kv_seq + gdn_state * (k + 2)  # spec decode keeps per-draft-step GDN states
    out = [Finding(OK, "model", f"{path.name}: {attn} attention + {gdn} GDN layers, {positions} positions, "
                   f"weights {weights / 2**30:.2f} GiB, KV cache {kv_seq / 2**20:.1f} MiB for one full-length "
                   f"sequence at K={k}, GDN state {gdn_state / 2**20:.1f} MiB per sequence")]
    gpus = info.get("gpus") or []
    if not gpus:
        out.append(Finding(UNKNOWN, "GPU memory for this model", f"needs ~{need / 2**30:.2f} GiB; no GPU here to compare with"))
    else:
        budget = gpus[0]["free"] * gpu_memory_utilization
        ok = budget > need * 1.2
        out.append(Finding(OK if ok else FAIL, "GPU memory for this model",
                           f"needs ~{need / 2**30:.2f} GiB (+ activations), {budget / 2**30:.1f} GiB available at "
                           f"gpu_memory_utilization={gpu_memory_utilization}",
                           "" if ok else "free the GPU, raise --engine-arg gpu_memory_utilization, or lower "
                           "--engine-arg max_model_len"))
    return out


def server_findings(base_url: str, api_key_env: str | None = None) -> list[Finding]:
    import httpx

    from speccheck.engines.openai import server_root

    root = server_root(base_url)
    key = os.environ.get(api_key_env or "OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    out: list[Finding] = []
    try:
        with httpx.Client(headers=headers, timeout=10.0) as client:
            r = client.get(root + "/v1/models")
            if r.status_code in (401, 403):
                return [Finding(FAIL, "server", f"{root}/v1/models: {r.status_code} (the API key is refused)",
                                f"export {api_key_env or 'OPENAI_API_KEY'}=<the server's key>")]
            r.raise_for_status()
            models = [m.get("id") for m in r.json().get("data", [])]
            out.append(Finding(OK, "server", f"{root} serves {', '.join(map(str, models)) or 'no model'}"))
            v = client.get(root + "/version")
            out.append(Finding(OK if v.status_code == 200 else WARN, "server version",
                               v.json().get("version", "?") if v.status_code == 200 else f"/version: {v.status_code}"))
            m = client.get(root + "/metrics")
            spec = m.status_code == 200 and "spec_decode_num_drafts" in m.text
            out.append(Finding(OK if m.status_code == 200 else WARN, "server metrics",
                               "/metrics has the spec-decode counters" if spec else
                               "/metrics reachable, no spec-decode counters (a baseline server, or spec decode off)"
                               if m.status_code == 200 else f"/metrics: {m.status_code}",
                               "" if m.status_code == 200 else "acceptance needs /metrics; run vLLM with metrics on"))
    except httpx.HTTPError as e:
        out.append(Finding(FAIL, "server", f"{root}: {type(e).__name__}: {e}",
                           "start the server (e.g. `speccheck serve`, or vLLM's `vllm serve`), or fix --base-url"))
    except ValueError as e:
        out.append(Finding(FAIL, "server", f"{root}: not an OpenAI-compatible answer ({e})", "check --base-url"))
    return out


def diagnose(engine: str = "reference", model: str | None = None, base_url: str | None = None,
             api_key_env: str | None = None, k: int = 7) -> list[Finding]:
    findings = platform_findings()
    gpu, info = gpu_findings()
    findings += gpu + backend_findings(info)
    if model:
        findings += model_findings(model, info, k)
    elif engine == "vllm":
        findings.append(Finding(UNKNOWN, "model", "no --model given: the KV cache it needs cannot be estimated",
                                "speccheck doctor --engine vllm --model PATH"))
    if base_url or engine == "openai":
        findings += server_findings(base_url or os.environ.get("OPENAI_BASE_URL") or "http://127.0.0.1:8000",
                                    api_key_env)
    return findings
