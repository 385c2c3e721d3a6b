"""GDN differential harness: every gated-delta-rule implementation on this machine, run on
the same bf16 inputs, against an fp64 recurrence.

Speculative decoding verifies with other kernels than decode (for GDN: the chunked form
instead of the recurrent step), so its divergences are only as small as the difference
between those kernels. This measures that difference where it starts, per kernel: relative
error of the outputs and the final state against fp64, how often the argmax of a fixed
random readout of the outputs flips (a stand-in for "the next token changes"), and for every
pair of kernels where those flips sit on the curve of the fp64 readout's top-1/top-2 margin.

It covers the reference engine's two forms on any device (and on CUDA its fused Triton
kernel, the form its CUDA-graph decode and verify steps can run), and on CUDA what vLLM runs: FLA's
Triton chunk and recurrent kernels (``vllm.third_party.flash_linear_attention.ops`` in 0.26,
``vllm.model_executor.layers.fla.ops`` before, or the ``fla`` package), FlashInfer's GDN
prefill kernel (vLLM's default prefill on Hopper; head dim 128 only), and vLLM's fused Triton
kernels, called as the engine calls them: the packed one-token decode kernel over the
positions one at a time, and the fused sigmoid-gating kernel over blocks of K+1 tokens as a
spec-decode verify does (with the gating inputs solved so that they compute the same g and
beta as every other kernel gets).

    speccheck kernels gdn [--device cuda] [--positions 8192] [--head-dim 128] [--json]
"""
from __future__ import annotations

import importlib
import inspect
import site
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from speccheck.verify.margin_bins import MARGIN_EDGES, MarginBin, flips_by_margin
from speccheck.verify.margins import margins

#: an implementation: (q, k, v [B,T,H,D] bf16; g, beta [B,T,H] fp32; state [B,H,Dk,Dv] fp32)
#: -> (output [B,T,H,Dv], final state [B,H,Dk,Dv]); q and k un-normalised (it L2-normalises
#: them and scales q by Dk^-0.5, as the model's layer does)
Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass
class KernelResult:
    name: str
    out_rel_err: float  # ||o - o_fp64|| / ||o_fp64|| over all positions
    state_rel_err: float  # the same for the final state
    flips: int  # positions x heads where the readout's argmax differs from fp64's
    positions: int  # positions x heads compared
    ms: float  # one call, median of a few (after a warm-up)
    top: torch.Tensor | None = field(default=None, repr=False)  # the readout's argmax
    error: str | None = None  # the kernel raised (wrong signature, no GPU build, ...)

    @property
    def flip_rate(self) -> float:
        return self.flips / self.positions if self.positions else 0.0

    def to_dict(self) -> dict:
        return {"name": self.name, "out_rel_err": self.out_rel_err,
                "state_rel_err": self.state_rel_err, "flips": self.flips,
                "positions": self.positions, "flip_rate": self.flip_rate, "ms": self.ms,
                "error": self.error}


def make_inputs(positions: int, heads: int = 4, dk: int = 64, dv: int = 64, seed: int = 0,
                device: str = "cpu") -> dict[str, torch.Tensor]:
    """Inputs with the statistics of a trained layer: q, k, v in bf16 (as the projections
    leave them), log-decay g <= 0 and write strength beta in (0, 1) in fp32 (as the gating
    computes them), and a non-trivial initial state."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = randn(1, positions, heads, dk), randn(1, positions, heads, dk)
    v = randn(1, positions, heads, dv)
    g = -torch.nn.functional.softplus(randn(1, positions, heads) - 3.0)  # decay ~0.95
    beta = torch.sigmoid(randn(1, positions, heads))
    state = 0.1 * randn(1, heads, dk, dv)
    out = {"q": q.bfloat16(), "k": k.bfloat16(), "v": v.bfloat16(), "g": g, "beta": beta,
           "state": state}
    return {name: t.to(device) for name, t in out.items()}


#: bytes the harness holds per position x head beyond the state-sized tensors (measured on the
#: CPU: 8192 x 4 heads at head dim 64 peaked at 1.3 GB, 4096 x 4 at head dim 256 at 4.1 GB)
PER_POSITION_HEAD_BYTES = 16 * 1024
#: the interpreter, torch and the readout
BASE_BYTES = 512 * 2 ** 20
#: the most memory a run may plan for, whatever the machine has (a harness, not a soak test)
MAX_BYTES = 8 * 2 ** 30


def memory_needed(positions: int, heads: int, dk: int, dv: int) -> int:
    """Peak bytes of a run, over-estimated: the kernels keep a state-sized fp32 tensor per
    position and head (the chunked form's per-position states, fp64 outputs and readout)."""
    return BASE_BYTES + positions * heads * (dk * dv * 4 + PER_POSITION_HEAD_BYTES)


def memory_budget(device: str) -> int:
    """What a run may take here: half of what the device has free, at most MAX_BYTES (a run
    that would swap or be OOM-killed is refused up front instead)."""
    free = None
    if device.startswith("cuda"):
        try:
            free = torch.cuda.mem_get_info(torch.device(device))[0]
        except (RuntimeError, AssertionError):
            free = None
    else:
        try:
            with open("/proc/meminfo") as f:
                info = dict(line.split(":", 1) for line in f if ":" in line)
            free = int(info["MemAvailable"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            free = None
    return MAX_BYTES if free is None else max(min(MAX_BYTES, free // 2), BASE_BYTES)


def max_positions(heads: int, dk: int, dv: int, budget: int) -> int:
    """The most positions that fit ``budget`` at these heads and head dims (0: none)."""
    return max((budget - BASE_BYTES) // (heads * (dk * dv * 4 + PER_POSITION_HEAD_BYTES)), 0)


def fp64_recurrence(q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, one position at a time, in fp64: the ground truth."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12) * q.shape[-1] ** -0.5
    k = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    s = state.double()
    outs = []
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[..., None, None]
        kt = k[:, t]  # [B,H,Dk]
        u = (v[:, t] - torch.einsum("bhk,bhkv->bhv", kt, s)) * beta[:, t, :, None]
        s = s + kt[..., :, None] * u[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], s))
    return torch.stack(outs, dim=1), s


def _reference(form: str) -> Kernel:
    """The reference engine's form; its fp32 output rounded to the inputs' dtype, as the
    layer rounds it before the gated norm (FLA's kernels return that dtype themselves)."""
    from speccheck.reference.model import gdn_chunked, gdn_fused, gdn_recurrent

    fn = {"chunked": gdn_chunked, "recurrent": gdn_recurrent, "fused": gdn_fused}[form]

    def call(q, k, v, g, beta, state):
        o, s, _ = fn(q, k, v, g, beta, state)
        return o.to(q.dtype), s

    return call


#: where FLA's gated-delta-rule kernels live: vLLM's vendored copy (0.26, then older), the package
FLA_MODULES = (("vllm fla", "vllm.third_party.flash_linear_attention.ops"),
               ("vllm fla", "vllm.model_executor.layers.fla.ops"),
               ("fla", "fla.ops.gated_delta_rule"))
#: FlashInfer's GDN prefill kernels (CuTe DSL) take this head dim only (SM90: "DSL kernel only
#: supports D=128"; SM100: "requires head_size=128")
FLASHINFER_HEAD_DIM = 128
#: the spec-decode verify block of the fused sigmoid-gating kernel: K+1 tokens for K = 7
VERIFY_BLOCK = 8


def _why(what: str, e: BaseException) -> str:
    return " ".join(f"{what}: {type(e).__name__}: {e}".split())[:300]


def _fla(module: str, name: str) -> Kernel | str:
    """An FLA kernel, called with the keywords its signature has; or why it cannot be had."""
    try:
        fn = getattr(importlib.import_module(module), name)
    except Exception as e:  # noqa: BLE001 - not installed, or no GPU to build it for
        return _why(f"{module}.{name}", e)
    params = inspect.signature(fn).parameters
    # vLLM 0.26's copy keeps the state as [N, H, V, K] (its docstrings say so); fla's [.., K, V]
    v_first = "V, K]" in (fn.__doc__ or "")
    # vLLM's recurrent kernel, not in place, returns the state after every token [T, H, V, K]
    per_token = "inplace_final_state" in params

    def call(q, k, v, g, beta, state):
        s0 = (state.transpose(-1, -2) if v_first else state).contiguous().clone()
        kwargs = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "scale": q.shape[-1] ** -0.5,
                  "initial_state": s0, "output_final_state": True,
                  "use_qk_l2norm_in_kernel": True, "inplace_final_state": False}
        o, s = fn(**{key: val for key, val in kwargs.items() if key in params})
        s = s[-1:] if per_token else s  # (one sequence: the last token's state)
        return o, (s.transpose(-1, -2) if v_first else s)

    return call


def gating_inputs(g: torch.Tensor, beta: torch.Tensor) -> dict[str, torch.Tensor]:
    """Inputs of vLLM's fused gating, ``g = -exp(A_log) softplus(a + dt_bias)`` and ``beta =
    sigmoid(b)``, that give back ``g`` and ``beta`` ([..., H]): A_log = dt_bias = 0, a the
    inverse softplus of -g and b the logit of beta, solved in fp64 and kept in fp32 (the
    kernels compute the gating in fp32), so the fused kernels do the same math as the others."""
    g64, b64 = g.double(), beta.double()
    heads = g.shape[-1]
    zeros = torch.zeros(heads, dtype=torch.float32, device=g.device)
    return {"A_log": zeros, "dt_bias": zeros.clone(),
            "a": torch.log(torch.expm1(-g64)).float().contiguous(),
            "b": (torch.log(b64) - torch.log1p(-b64)).float().contiguous()}


def _vllm_fused(name: str) -> Callable | str:
    """One of vLLM's fused GDN kernels, from the first vLLM module that has it."""
    why = []
    for _, module in FLA_MODULES[:2]:
        try:
            return getattr(importlib.import_module(module), name)
        except Exception as e:  # noqa: BLE001
            why.append(_why(f"{module}.{name}", e))
    return why[0]


def _vllm_fused_decode() -> Kernel | str:
    """vLLM's packed one-token decode kernel (``fused_recurrent_gated_delta_rule_packed_decode``,
    what a non-spec decode step runs), once per position as decode does: packed [q|k|v] of one
    token, the gating inside, the state in a pool slot ([slots, H, V, K]; slot 0 is the null
    block, which the kernel skips), updated in place. The engine hands it ``b`` in bf16 and the
    kernel rounds sigmoid(b) to b's dtype; here b is fp32 so beta is the one all kernels get."""
    fn = _vllm_fused("fused_recurrent_gated_delta_rule_packed_decode")
    if isinstance(fn, str):
        return fn

    def call(q, k, v, g, beta, state):
        _, t_len, heads, dk = q.shape
        dv = v.shape[-1]
        gate = gating_inputs(g[0], beta[0])
        mixed = torch.cat([q[0].reshape(t_len, -1), k[0].reshape(t_len, -1),
                           v[0].reshape(t_len, -1)], dim=-1).contiguous()
        pool = torch.zeros(2, heads, dv, dk, dtype=torch.float32, device=q.device)
        pool[1] = state[0].transpose(-1, -2)
        slot = torch.ones(1, dtype=torch.int32, device=q.device)
        out = torch.empty(t_len, 1, heads, dv, dtype=q.dtype, device=q.device)
        for t in range(t_len):
            fn(mixed_qkv=mixed[t:t + 1], a=gate["a"][t:t + 1], b=gate["b"][t:t + 1],
               A_log=gate["A_log"], dt_bias=gate["dt_bias"], scale=dk ** -0.5,
               initial_state=pool, out=out[t:t + 1], ssm_state_indices=slot,
               use_qk_l2norm_in_kernel=True)
        return out[:, 0].unsqueeze(0), pool[1:2].transpose(-1, -2)

    return call


def _vllm_fused_verify(block: int) -> Kernel | str:
    """vLLM's fused sigmoid-gating kernel (``fused_sigmoid_gating_delta_rule_update``, what a
    spec-decode verify runs on the K+1 tokens of each request) over consecutive blocks of
    ``block`` tokens, called as the engine calls it: the state after every token written to
    its own slot, the next block starting from the slot of the last accepted token (here all
    are accepted, so the sequence is the same one the other kernels see)."""
    fn = _vllm_fused("fused_sigmoid_gating_delta_rule_update")
    if isinstance(fn, str):
        return fn

    def call(q, k, v, g, beta, state):
        _, t_len, heads, dk = q.shape
        dv = v.shape[-1]
        dev = q.device
        gate = gating_inputs(g[0], beta[0])
        pool = torch.zeros(block + 1, heads, dv, dk, dtype=torch.float32, device=dev)
        pool[block] = state[0].transpose(-1, -2)
        slots = torch.arange(1, block + 1, dtype=torch.int32, device=dev).view(1, block)
        accepted = torch.full((1,), block, dtype=torch.int32, device=dev)
        outs = []
        for start in range(0, t_len, block):
            n = min(block, t_len - start)
            cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
            o, _ = fn(A_log=gate["A_log"], a=gate["a"][start:start + n],
                      b=gate["b"][start:start + n], dt_bias=gate["dt_bias"],
                      q=q[:, start:start + n], k=k[:, start:start + n], v=v[:, start:start + n],
                      initial_state=pool, inplace_final_state=True, cu_seqlens=cu,
                      ssm_state_indices=slots, num_accepted_tokens=accepted,
                      use_qk_l2norm_in_kernel=True)
            outs.append(o)
            accepted = torch.full((1,), n, dtype=torch.int32, device=dev)
        return torch.cat(outs, dim=1), pool[n:n + 1].transpose(-1, -2)

    return call


def _l2norm() -> Callable[[torch.Tensor], torch.Tensor]:
    """vLLM's ``l2norm_fwd`` (what it applies to q and k before FlashInfer's kernel: fp32 inside,
    the result rounded to the input dtype), or the same in torch where vLLM is absent."""
    for _, module in FLA_MODULES[:2]:
        try:
            return importlib.import_module(module + ".l2norm").l2norm_fwd
        except Exception:  # noqa: BLE001
            continue

    def l2norm(x):
        xf = x.float()
        return (xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)

    return l2norm


def _flashinfer_dsl_missing(major: int) -> str | None:
    """Why FlashInfer's GDN prefill DSL kernel for this architecture cannot be had (its package
    swallows the import error and leaves None), or None when it can."""
    gdn_kernels = importlib.import_module("flashinfer.gdn_kernels")
    attr, module = {9: ("chunk_gated_delta_rule_sm90", "delta_rule_dsl.delta_rule_sm90"),
                    10: ("chunk_gated_delta_rule_sm100", "blackwell")}[major]
    if getattr(gdn_kernels, attr, None) is not None:
        return None
    try:
        importlib.import_module(f"flashinfer.gdn_kernels.{module}")
    except Exception as e:  # noqa: BLE001
        return _why(f"flashinfer.gdn_kernels.{module}", e) + " (a CuTe-DSL kernel: it needs " \
            "nvidia-cutlass-dsl and its libs)"
    return f"flashinfer.gdn_kernels.{attr} is unavailable"


def read_cutlass_dsl_pth() -> list[str]:
    """nvidia-cutlass-dsl puts its ``cutlass`` package on sys.path through a .pth file
    (4.5: ``nvidia_cutlass_dsl/python_packages``, 4.8: ``.../dsl_packages``), which Python reads
    in site-packages but not in a PYTHONPATH folder, where the GPU host's staged wheels are:
    read those files in every sys.path folder. Returns the .pth files read."""
    read = []
    for entry in list(sys.path):
        folder = Path(entry or ".")
        if not folder.is_dir():
            continue
        for pth in sorted(folder.glob("nvidia_cutlass_dsl*.pth")):
            if str(pth) not in _PTH_READ:
                site.addpackage(str(folder), pth.name, None)
                _PTH_READ.add(str(pth))
                read.append(str(pth))
    return read


_PTH_READ: set[str] = set()


def flashinfer_arch(device: str) -> int | str:
    """The compute capability major (9 or 10) if FlashInfer's GDN prefill can run on
    ``device``, or why not."""
    if not device.startswith("cuda"):
        return "flashinfer: CUDA only"
    read_cutlass_dsl_pth()
    try:
        importlib.import_module("flashinfer.gdn_prefill")
    except Exception as e:  # noqa: BLE001 - not installed, or a dependency missing
        return _why("flashinfer.gdn_prefill", e)
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return f"flashinfer GDN prefill: needs SM90 (Hopper) or SM100 (Blackwell); this GPU is SM{major}{minor}"
    return major


def _flashinfer(use_cp: bool) -> Kernel:
    """FlashInfer's GDN prefill (``flashinfer.gdn_prefill.chunk_gated_delta_rule``) as vLLM
    0.26 calls it (``fi_chunk_gated_delta_rule``): q, k L2-normalised by ``l2norm_fwd`` first,
    [T, H, D] without the batch axis, the decay passed as ``exp(g)``, fp32 state in the
    [N, H, V, K] layout (the same ssm_state buffer vLLM hands to FLA's kernels). ``use_cp``
    picks the SM90 context-parallel kernel or the plain one; vLLM leaves it "auto", which
    takes CP when sequences x heads < SMs / 2."""
    from flashinfer.gdn_prefill import chunk_gated_delta_rule

    has_cp = "use_cp" in inspect.signature(chunk_gated_delta_rule).parameters
    l2norm = _l2norm()

    def call(q, k, v, g, beta, state):
        cu = torch.tensor([0, q.shape[1]], dtype=torch.int64, device=q.device)
        extra = {"use_cp": use_cp} if has_cp else {}
        o, s = chunk_gated_delta_rule(
            q=l2norm(q)[0].contiguous(), k=l2norm(k)[0].contiguous(), v=v[0].contiguous(),
            g=torch.exp(g[0].float()).contiguous(), beta=beta[0].float().contiguous(),
            scale=q.shape[-1] ** -0.5, initial_state=state.transpose(-1, -2).float().contiguous(),
            output_final_state=True, cu_seqlens=cu, **extra)
        return o.unsqueeze(0), s.transpose(-1, -2)

    return call


def flashinfer_auto_path(device: str, heads: int, sequences: int = 1) -> str:
    """Which of FlashInfer's two rows vLLM runs at this shape: it leaves ``use_cp="auto"``,
    which FlashInfer 0.6.14 turns into the CP kernel on SM90 when sequences x heads < SMs / 2."""
    props = torch.cuda.get_device_properties(device)
    half = max(1, props.multi_processor_count // 2)
    if props.major == 9 and sequences * heads < half:
        return (f"vLLM calls FlashInfer's GDN prefill with use_cp='auto': at {sequences} "
                f"sequence(s) x {heads} heads < {half} (SMs / 2) that is 'flashinfer chunked cp'")
    return (f"vLLM calls FlashInfer's GDN prefill with use_cp='auto': at {sequences} sequence(s) "
            f"x {heads} heads that is 'flashinfer chunked' (CP only on SM90 below {half} = SMs / 2)")


def default_head_dim(device: str) -> int:
    """128 where FlashInfer's GDN prefill runs (its only head dim), else 64."""
    return FLASHINFER_HEAD_DIM if isinstance(flashinfer_arch(device), int) else 64


def kernels(device: str, missing: list[str] | None = None, head_dim: int = 64,
            verify_block: int = VERIFY_BLOCK) -> dict[str, Kernel]:
    """Every implementation that runs on ``device`` at ``head_dim``; why others do not goes to
    ``missing``."""
    missing = [] if missing is None else missing
    found: dict[str, Kernel] = {"reference recurrent": _reference("recurrent"),
                                "reference chunked": _reference("chunked")}
    if not device.startswith("cuda"):
        return found
    from speccheck.reference.kernels.gdn_fused import unavailable

    why = unavailable(torch.device(device))
    if why:
        missing.append(f"reference fused: {why}")
    else:
        found["reference fused"] = _reference("fused")
    for label, module in FLA_MODULES:
        for form, name in (("chunked", "chunk_gated_delta_rule"),
                           ("recurrent", "fused_recurrent_gated_delta_rule")):
            fn = _fla(module, name)
            if isinstance(fn, str):
                missing.append(fn)
            else:
                found.setdefault(f"{label} {form}", fn)
    arch = flashinfer_arch(device)
    why = arch if isinstance(arch, str) else _flashinfer_dsl_missing(arch)
    if why is None and head_dim != FLASHINFER_HEAD_DIM:
        why = (f"flashinfer chunked: FlashInfer's GDN prefill kernel takes head dim "
               f"{FLASHINFER_HEAD_DIM} only (this run: {head_dim}); run with --head-dim "
               f"{FLASHINFER_HEAD_DIM} to compare it")
    if why is not None:
        missing.append(why)
    else:
        found["flashinfer chunked"] = _flashinfer(use_cp=False)
        if arch == 9:
            found["flashinfer chunked cp"] = _flashinfer(use_cp=True)
    for label, fn in (("vllm fused decode", _vllm_fused_decode()),
                      ("vllm fused verify", _vllm_fused_verify(verify_block))):
        if isinstance(fn, str):
            missing.append(fn)
        else:
            found[label] = fn
    return found


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-300))


@dataclass
class Comparison:
    """Every kernel's result and the fp64 readout they are measured against."""

    results: list[KernelResult]
    fp64_top: torch.Tensor  # the fp64 readout's argmax per position x head
    fp64_margin: np.ndarray  # its top-1 minus top-2 score (readout units), same shape


def compare(inputs: dict[str, torch.Tensor], impls: dict[str, Kernel], classes: int = 256,
            seed: int = 1, repeats: int = 3) -> Comparison:
    """Run each implementation on ``inputs`` and measure it against the fp64 recurrence. The
    readout is a fixed random [Dv, classes] projection of each position's output per head."""
    device = str(inputs["q"].device)
    o64, s64 = fp64_recurrence(**inputs)
    gen = torch.Generator().manual_seed(seed)
    readout = torch.randn(o64.shape[-1], classes, generator=gen, dtype=torch.float64).to(o64.device)
    scores64 = o64 @ readout
    top64 = scores64.argmax(-1)
    margin64 = margins(scores64.topk(2, dim=-1).values.cpu().numpy())
    results = []
    for name, fn in impls.items():
        times = []
        try:
            with torch.inference_mode():
                for _ in range(repeats + 1):  # the first is a warm-up (JIT, caches)
                    _sync(device)
                    t = time.perf_counter()
                    o, s = fn(**inputs)
                    _sync(device)
                    times.append(time.perf_counter() - t)
        except Exception as e:  # noqa: BLE001 - one kernel failing is a finding, not the end
            nan = float("nan")
            results.append(KernelResult(name, nan, nan, 0, 0, nan, None,
                                        " ".join(f"{type(e).__name__}: {e}".split())[:300]))
            continue
        top = (o.double() @ readout).argmax(-1)
        results.append(KernelResult(name, _rel(o, o64), _rel(s, s64), int((top != top64).sum()),
                                    top64.numel(), 1e3 * sorted(times[1:])[len(times[1:]) // 2],
                                    top))
    return Comparison(results, top64, margin64)


def form_flips(results: list[KernelResult]) -> list[tuple[str, str, int, int]]:
    """Chunked against recurrent within each family (what a spec-decode verify changes):
    (chunked, recurrent, positions x heads whose readout argmax differs, compared)."""
    by_name = {r.name: r for r in results if r.error is None}
    return [(r.name, rec, int((r.top != by_name[rec].top).sum()), r.top.numel())
            for r in by_name.values() if r.name.endswith(" chunked")
            for rec in [r.name[:-len("chunked")] + "recurrent"] if rec in by_name]


def margin_curves(comparison: Comparison, edges=MARGIN_EDGES) -> list[tuple[str, str, list[MarginBin]]]:
    """The flip-rate-vs-margin curve of every kernel against fp64, then of every pair of
    kernels: (a, b, bins of the fp64 top-1/top-2 margin with positions and flips in each)."""
    ok = [(r.name, r.top.cpu().numpy()) for r in comparison.results if r.error is None]
    fp64 = comparison.fp64_top.cpu().numpy()
    pairs = [(name, "fp64", top, fp64) for name, top in ok]
    pairs += [(a, b, ta, tb) for i, (a, ta) in enumerate(ok) for b, tb in ok[i + 1:]]
    return [(a, b, flips_by_margin(comparison.fp64_margin, ta, tb, edges)) for a, b, ta, tb in pairs]


def table(results: list[KernelResult]) -> str:
    lines = [f"{'kernel':<26}{'output rel err':>16}{'state rel err':>15}"
             f"{'flips vs fp64':>22}{'ms':>10}"]
    for r in results:
        if r.error:
            lines.append(f"{r.name:<26}  failed: {r.error}")
            continue
        lines.append(f"{r.name:<26}{r.out_rel_err:>16.2e}{r.state_rel_err:>15.2e}"
                     f"{r.flips:>10} ({100 * r.flip_rate:6.3f} %){r.ms:>10.2f}")
    for chunked, recurrent, n, total in form_flips(results):
        lines.append(f"{chunked} vs {recurrent}: readout argmax differs at {n} of {total} "
                     f"({100 * n / total:.3f} %)")
    return "\n".join(lines)


def margin_table(curves: list[tuple[str, str, list[MarginBin]]]) -> str:
    """Flips per margin bin, one row per pair; the first row is how many positions x heads
    fall in each bin (the same for every pair: the bins are of the fp64 margin)."""
    if not curves:
        return ""
    bins = curves[0][2]
    width = max(len(f"{a} vs {b}") for a, b, _ in curves) + 2
    head = "readout argmax flips by fp64 top-1/top-2 margin (readout units)"
    lines = [head, f"{'margin':<{width}}" + "".join(f"{b.label:>12}" for b in bins),
             f"{'positions x heads':<{width}}" + "".join(f"{b.count:>12}" for b in bins)]
    for a, b, row in curves:
        lines.append(f"{a + ' vs ' + b:<{width}}" + "".join(f"{x.flips:>12}" for x in row))
    return "\n".join(lines)
