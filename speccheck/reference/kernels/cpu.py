"""The reference engine's CPU kernels (see cpu_kernels.c): the bf16 linear and RMSNorm,
row-invariant and fast, and the verify's GDN chunk.

A decode step (1 row), a verify (K+1 rows) and a batch all get the same bits for a row, on any
CPU. The C kernels are compiled at install time (build.py, run by setup.py's build_ext), one
library per vector instruction set (AVX-512, AVX2, generic C: the same bits from each); at
first use the library for the widest the CPU has is loaded (:func:`isa`; ``SPECCHECK_CPU_ISA``
asks for a narrower one). Nothing is compiled at run time: where no built library fits (the
install found no C compiler, say), one line on stderr says why and :func:`rowinv_linear_torch`
and :func:`rms_norm_torch` compute the same sums with PyTorch ops (slower, same bits);
``SPECCHECK_CPU_LINEAR=torch`` asks for them. The GDN chunk (:func:`gdn_chunk`) has no such twin:
without the library a verify runs the chunked form as PyTorch ops (model.gdn_chunked), the same
form summed in PyTorch's order. ``python -m speccheck.reference.kernels.build`` builds the
libraries of a checkout by hand.
"""
from __future__ import annotations

import ctypes
import os
import platform
import sys
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from .build import ISA_NEEDS, ISAS, SOURCE, library_name, source_sha256

_LANES = 16
#: where the built libraries are looked for (next to this file, where the install puts them)
_LIB_DIR = Path(__file__).parent
_lib = None
_lib_isa: str | None = None
_lib_tried = False
_lock = threading.Lock()
_local = threading.local()


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _fitting() -> list[str]:
    """The instruction sets to load a library for, widest first: those this CPU has, or only
    the one that ``SPECCHECK_CPU_ISA`` asks for (to compare them, or to rule one out)."""
    have = _cpu_flags() if platform.machine() in ("x86_64", "AMD64") else set()
    fits = [name for name in ISAS if ISA_NEEDS[name] <= have]
    asked = os.environ.get("SPECCHECK_CPU_ISA")
    if asked:
        if asked not in ISAS:
            raise ValueError(f"SPECCHECK_CPU_ISA={asked!r}: choose one of {ISAS}")
        if asked not in fits:
            raise ValueError(f"SPECCHECK_CPU_ISA={asked!r}: this CPU lacks "
                             f"{sorted(ISA_NEEDS[asked] - have)}; it can run {fits}")
        return [asked]
    return fits


def isa() -> str:
    """The widest of :data:`ISAS` this CPU has (or the one ``SPECCHECK_CPU_ISA`` asks for)."""
    return _fitting()[0]


def _source_sha() -> str | None:
    """The sha256 of the cpu_kernels.c next to this file (None where it is not there)."""
    try:
        return source_sha256(SOURCE)
    except OSError:
        return None


def _open(path: Path) -> ctypes.CDLL:
    """Load one library and declare its functions; OSError where it cannot be used (not
    loadable, or built from another cpu_kernels.c than the one next to it)."""
    dll = ctypes.CDLL(str(path))
    built_from = ctypes.c_char_p.in_dll(dll, "cpu_kernels_sha256").value.decode()
    want = _source_sha()
    if want is not None and built_from != want:
        raise OSError("built from another cpu_kernels.c than this one: rebuild it")
    fn = dll.rowinv_linear
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int,
                                                                 ctypes.c_void_p, ctypes.c_void_p]
    fn = dll.rms_norm
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
    fn = dll.gdn_chunk
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 5 \
        + [ctypes.c_float, ctypes.c_void_p]
    fn = dll.gdn_chunk_state
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 5
    fn = dll.dflash2_select
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] + [ctypes.c_void_p] * 2 \
        + [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 2
    fn = dll.grouped_conv
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int] \
        + [ctypes.c_int64] * 5 + [ctypes.c_void_p]
    return dll


def _announce(line: str) -> None:
    print(f"speccheck: {line}", file=sys.stderr, flush=True)


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """The built library for the widest instruction set that fits, and its name; (None, None)
    where none is usable. Said on stderr, once: a narrower library than the CPU could run
    (slower, same bits), or none at all (the PyTorch ops: much slower, same bits)."""
    fits = _fitting()
    why = []
    for name in fits:
        path = _LIB_DIR / library_name(name)
        if not path.is_file():
            why.append(f"{name}: not built")
            continue
        try:
            dll = _open(path)
        except (OSError, ValueError) as e:
            why.append(f"{name}: {e}")
            continue
        if why:
            _announce(f"the CPU kernels for {fits[0]} are not usable ({'; '.join(why)}): "
                      f"running the {name} build (same bits, slower)")
        return dll, name
    _announce(f"no built CPU kernel library fits this CPU in {_LIB_DIR} ({'; '.join(why)}): the "
              "reference engine's CPU kernels run as PyTorch ops (same bits, slower); reinstall "
              "speccheck with a C compiler, or run python -m speccheck.reference.kernels.build")
    return None, None


def _kernel():
    global _lib, _lib_isa, _lib_tried
    if not _lib_tried:
        with _lock:
            if not _lib_tried:
                if os.environ.get("SPECCHECK_CPU_LINEAR") != "torch":
                    _lib, _lib_isa = _load()
                _lib_tried = True
    return _lib


def loaded() -> str | None:
    """The instruction set of the library in use (None: the PyTorch ops)."""
    _kernel()
    return _lib_isa


def _scratch(rows: int, kp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-thread buffers: the rows of x in fp32, 16 weight rows in fp32 (or 4 in bf16),
    zero-padded to kp."""
    bufs = getattr(_local, "bufs", None)
    need_x, need_w = rows * kp, 16 * kp
    if bufs is None or bufs[0].numel() < need_x or bufs[1].numel() < need_w:
        bufs = (torch.empty(max(need_x, bufs[0].numel() if bufs else 0), dtype=torch.float32),
                torch.empty(max(need_w, bufs[1].numel() if bufs else 0), dtype=torch.float32))
        _local.bufs = bufs
    return bufs


def rowinv_linear_torch(x: torch.Tensor, w: torch.Tensor, out_dtype=torch.bfloat16) -> torch.Tensor:
    """The kernel's sums as PyTorch ops (its specification; the fallback without a library)."""
    K = x.shape[-1]
    pad = -K % _LANES
    xs = F.pad(x.reshape(-1, K).float(), (0, pad)).view(-1, 1, (K + pad) // _LANES, _LANES)
    ws = F.pad(w.float(), (0, pad)).view(1, w.shape[0], (K + pad) // _LANES, _LANES)
    return _lanes_sum(lambda c: xs[:, :, c] * ws[:, :, c], xs.shape[2]).to(out_dtype).reshape(
        *x.shape[:-1], w.shape[0])


def _lanes_sum(term, chunks: int) -> torch.Tensor:
    """Lane l sums ``term(c)[..., l]`` over c in order (term(c): [..., 16], each rounded to
    fp32), then the lanes are summed by the kernels' fixed tree. From +0, as the kernels
    (a sum of -0 terms is +0)."""
    acc = 0.0
    for c in range(chunks):
        acc = acc + term(c)
    s = acc[..., :8] + acc[..., 8:]
    s = s[..., :4] + s[..., 4:]
    s = s[..., :2] + s[..., 2:]
    return s[..., 0] + s[..., 1]


def rowinv_linear(x: torch.Tensor, w: torch.Tensor, out_dtype=torch.bfloat16) -> torch.Tensor:
    """x [..., K] and w [N, K] in bf16 on the CPU -> [..., N] in ``out_dtype`` (bf16 or fp32)."""
    lib = _kernel()
    if lib is None:
        return rowinv_linear_torch(x, w, out_dtype)
    K, N = x.shape[-1], w.shape[0]
    x2 = x.reshape(-1, K).contiguous()
    w = w.contiguous()
    out = torch.empty(x2.shape[0], N, dtype=out_dtype)
    xbuf, wbuf = _scratch(x2.shape[0], -(-K // _LANES) * _LANES)
    lib.rowinv_linear(x2.data_ptr(), w.data_ptr(), out.data_ptr(), x2.shape[0], N, K,
                      int(out_dtype == torch.float32), xbuf.data_ptr(), wbuf.data_ptr())
    return out.reshape(*x.shape[:-1], N)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear without bias; bf16 inference on the CPU goes through the row-invariant kernel."""
    if (w.dtype == torch.bfloat16 and x.dtype == torch.bfloat16 and w.is_cpu
            and not (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))):
        return rowinv_linear(x, w)
    return F.linear(x, w)


def rms_norm_torch(x: torch.Tensor, scale: torch.Tensor | None, eps: float,
                   out_dtype) -> torch.Tensor:
    """The RMSNorm kernel's sums as PyTorch ops (its specification; the fallback)."""
    D = x.shape[-1]
    pad = -D % _LANES
    xf = x.reshape(-1, D).float()
    xs = F.pad(xf, (0, pad)).view(-1, (D + pad) // _LANES, _LANES)
    # rsqrt is 1 / sqrt with IEEE ops; torch.sqrt is not correctly rounded everywhere
    r = torch.rsqrt(_lanes_sum(lambda c: xs[:, c] * xs[:, c], xs.shape[1]) / D + eps)
    y = xf * r[:, None]
    if scale is not None:
        y = y * scale
    return y.to(out_dtype).reshape(x.shape)


def rms_norm(x: torch.Tensor, scale: torch.Tensor | None, eps: float, out_dtype) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 (``scale``: fp32 [D] or None), returned in
    ``out_dtype``. Inference on the CPU runs the row-invariant kernel; elsewhere PyTorch's."""
    if (not x.is_cpu or x.dtype not in (torch.float32, torch.bfloat16)
            or (torch.is_grad_enabled() and (x.requires_grad
                                              or (scale is not None and scale.requires_grad)))):
        return F.rms_norm(x.float(), (x.shape[-1],), scale, eps).to(out_dtype)
    lib = _kernel()
    if lib is None:
        return rms_norm_torch(x, scale, eps, out_dtype)
    x = x.contiguous()
    out = torch.empty_like(x, dtype=out_dtype)  # (a few us cheaper than torch.empty)
    lib.rms_norm(x.data_ptr(), int(x.dtype == torch.bfloat16),
                 None if scale is None else scale.data_ptr(), out.data_ptr(),
                 int(out_dtype == torch.float32), x.numel() // x.shape[-1], x.shape[-1], eps)
    return out


def compiled() -> bool:
    """Whether the C kernels are there (a built library is loaded)."""
    return _kernel() is not None


def gdn_chunk(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, s0: torch.Tensor,
              heads: int, dk: int, dv: int, eps: float = 1e-6) -> tuple[torch.Tensor, tuple]:
    """The gated delta rule over one chunk of T new positions in one C call (cpu_kernels.c,
    ``gdn_chunk``; needs :func:`compiled`): qkv [B, T, C] fp32 (q, k, v side by
    side, as the GDN layer's convolution leaves them, before the L2 norm), g / beta [B, T, H]
    fp32, s0 [B, H, Dk, Dv]. Returns out [B, T, H, Dv] and the parts
    :func:`gdn_chunk_state` forms the state after any of the T positions from."""
    B, T, C = qkv.shape
    qkv, g, beta, s0 = (t.float().contiguous() for t in (qkv, g, beta, s0))
    out = torch.empty(B, T, heads, dv)
    kn, vnew, cum = torch.empty(B, heads, T, dk), torch.empty(B, heads, T, dv), torch.empty(B, heads, T)
    scratch = torch.empty(T * (2 * dk + dv) + dv)
    _kernel().gdn_chunk(qkv.data_ptr(), C, g.data_ptr(), beta.data_ptr(), s0.data_ptr(), out.data_ptr(),
                        kn.data_ptr(), vnew.data_ptr(), cum.data_ptr(), B, T, heads, dk, dv, eps,
                        scratch.data_ptr())
    return out, (s0, kn, vnew, cum)


def gdn_chunk_state(parts: tuple, idx: torch.Tensor) -> torch.Tensor:
    """The state [B, H, Dk, Dv] after position idx[b] of a :func:`gdn_chunk` chunk."""
    s0, kn, vnew, cum = parts
    B, H, T, dk = kn.shape
    idx = idx.to(torch.int64).contiguous()
    state = torch.empty(B, H, dk, vnew.shape[-1])
    _kernel().gdn_chunk_state(s0.data_ptr(), kn.data_ptr(), vnew.data_ptr(), cum.data_ptr(),
                              idx.data_ptr(), state.data_ptr(), B, T, H, dk, vnew.shape[-1])
    return state


def grouped_conv(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, side: int,
                 reach: torch.Tensor, groups: int) -> torch.Tensor | None:
    """DFlash2's grouped convolution (dflash2.DFlashGroupedConv._convolve) in one C call with
    the bits of its PyTorch ops, or None where it does not apply (not the CPU, not inference,
    mixed dtypes, no library): the caller then runs the ops. x [B, T, H]; base [taps, H]; delta
    [B, T, 2, taps, G] (both sides, as kernel_projection leaves it); reach [taps, T] 0 / 1."""
    B, T, H = x.shape
    if (x.dtype not in (torch.float32, torch.bfloat16) or base.dtype != x.dtype
            or delta.dtype != x.dtype or (H // groups) % 8 or not x.is_cpu
            or torch.is_grad_enabled() or _kernel() is None):
        return None
    x, base, delta = x.contiguous(), base.contiguous(), delta.contiguous()
    reach = reach.to(torch.uint8).contiguous()  # (a no-op for dflash2.block_reach's masks)
    out, acc = torch.empty_like(x), _scratch(1, H)[0]
    _kernel().grouped_conv(x.data_ptr(), base.data_ptr(), delta.data_ptr(), side, reach.data_ptr(),
                           out.data_ptr(), int(x.dtype == torch.bfloat16), B, T, base.shape[0],
                           groups, H // groups, acc.data_ptr())
    return out


def dflash2_select(unary: torch.Tensor, h: torch.Tensor, pred_book: torch.Tensor,
                   succ_book: torch.Tensor, anchor: torch.Tensor, k: int) -> torch.Tensor | None:
    """DFlash2's selector with the fp32 walk in one C call (cpu_kernels.c, ``dflash2_select``):
    unary [N, L, V] fp32 LM-head scores, h [N, L, R] fp32 (hidden_projection of the slots), the
    predecessor / successor codebooks [V, R], anchor [N] -> draft tokens [N, L]; None where it
    does not apply (not the CPU, no library): the caller then runs the ops."""
    if not unary.is_cpu or _kernel() is None or pred_book.dtype not in (torch.float32, torch.bfloat16) \
            or succ_book.dtype != pred_book.dtype or k > unary.shape[-1]:
        return None
    N, L, V = unary.shape
    unary, h = unary.float().contiguous(), h.float().contiguous()
    pred_book, succ_book = pred_book.contiguous(), succ_book.contiguous()
    anchor = anchor.to(torch.int64).contiguous()
    out = torch.empty(N, L, dtype=torch.int64)
    ids, vals = torch.empty(k, dtype=torch.int64), torch.empty(k)
    _kernel().dflash2_select(unary.data_ptr(), h.data_ptr(), pred_book.data_ptr(), succ_book.data_ptr(),
                             int(pred_book.dtype == torch.bfloat16), anchor.data_ptr(), out.data_ptr(),
                             N, L, V, k, h.shape[-1], ids.data_ptr(), vals.data_ptr())
    return out
