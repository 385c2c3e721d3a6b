"""GDN differential harness: every gated-delta-rule implementation on this machine, run on
the same bf16 inputs, against an fp64 recurrence.

Speculative decoding verifies with other kernels than decode (for GDN: the chunked form
instead of the recurrent step), so its divergences are only as small as the difference
between those kernels. This measures that difference where it starts, per kernel: relative
error of the outputs and the final state against fp64, and how often the argmax of a fixed
random readout of the outputs flips (a stand-in for "the next token changes"). It covers the
reference engine's two forms on any device, and on CUDA the FLA Triton kernels that vLLM
ships (``vllm.model_executor.layers.fla.ops``) or the ``fla`` package, when importable.

    speccheck kernels gdn [--device cuda] [--positions 8192] [--json]
"""
from __future__ import annotations

import importlib
import inspect
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

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
    from speccheck.engines.reference.model import gdn_chunked, gdn_recurrent

    fn = gdn_chunked if form == "chunked" else gdn_recurrent

    def call(q, k, v, g, beta, state):
        o, s, _ = fn(q, k, v, g, beta, state)
        return o.to(q.dtype), s

    return call


#: where FLA's gated-delta-rule kernels live: vLLM's vendored copy (0.26 and older), the package
FLA_MODULES = (("vllm fla", "vllm.third_party.flash_linear_attention.ops"),
               ("vllm fla", "vllm.model_executor.layers.fla.ops"),
               ("fla", "fla.ops.gated_delta_rule"))


def _fla(module: str, name: str) -> Kernel | str:
    """An FLA kernel, called with the keywords its signature has; or why it cannot be had."""
    try:
        fn = getattr(importlib.import_module(module), name)
    except Exception as e:  # noqa: BLE001 - not installed, or no GPU to build it for
        return f"{module}.{name}: {type(e).__name__}: {e}"[:200]
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


def kernels(device: str, missing: list[str] | None = None) -> dict[str, Kernel]:
    """Every implementation that runs on ``device``; why others do not goes to ``missing``."""
    found: dict[str, Kernel] = {"reference recurrent": _reference("recurrent"),
                                "reference chunked": _reference("chunked")}
    if not device.startswith("cuda"):
        return found
    for label, module in FLA_MODULES:
        for form, name in (("chunked", "chunk_gated_delta_rule"),
                           ("recurrent", "fused_recurrent_gated_delta_rule")):
            fn = _fla(module, name)
            if isinstance(fn, str):
                if missing is not None:
                    missing.append(fn)
            else:
                found.setdefault(f"{label} {form}", fn)
    return found


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-300))


def compare(inputs: dict[str, torch.Tensor], impls: dict[str, Kernel], classes: int = 256,
            seed: int = 1, repeats: int = 3) -> list[KernelResult]:
    """Run each implementation on ``inputs`` and measure it against the fp64 recurrence. The
    readout is a fixed random [Dv, classes] projection of each position's output per head."""
    device = str(inputs["q"].device)
    o64, s64 = fp64_recurrence(**inputs)
    gen = torch.Generator().manual_seed(seed)
    readout = torch.randn(o64.shape[-1], classes, generator=gen, dtype=torch.float64).to(o64.device)
    top64 = (o64 @ readout).argmax(-1)
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
    return results


def form_flips(results: list[KernelResult]) -> list[tuple[str, str, int, int]]:
    """Chunked against recurrent within each family (what a spec-decode verify changes):
    (chunked, recurrent, positions x heads whose readout argmax differs, compared)."""
    by_name = {r.name: r for r in results if r.error is None}
    return [(r.name, rec, int((r.top != by_name[rec].top).sum()), r.top.numel())
            for r in by_name.values() if r.name.endswith(" chunked")
            for rec in [r.name[:-len("chunked")] + "recurrent"] if rec in by_name]


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
