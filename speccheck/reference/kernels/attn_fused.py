"""Attention of a few queries over a cache as one Triton kernel (attention form ``fused``): the
one-token decode, the K+1-token verify and the DFlash block draft.

Why: on the H200 PyTorch's SDPA sends 8 queries with a mask to cuDNN's SM90 flash kernel,
which costs a memset, ~6 µs of launch and ~10 µs of kernel inside a CUDA graph for 8 queries
over a few hundred keys — four of them per speculative iteration (two target layers in the
verify, two drafter layers), 70 µs of an iteration of ~500. Here one program per (sequence,
KV head) holds that head's group of query heads x T queries as one tile, walks the keys up to
the last visible one in blocks (online softmax in fp32, products on the tensor cores in the
cache's dtype, as flash attention does) and writes the output: one launch, no workspace.

Visibility: query t of sequence b sees keys ``0 .. base[b] + t`` (``causal``: the target,
its new tokens at base..base+T-1) or ``0 .. base[b] + T - 1`` (a DFlash block, non-causal
inside the block). CUDA only (Triton); ``TRITON_INTERPRET=1`` runs it on CPU tensors, which
is how the tests check it against SDPA.
"""
from __future__ import annotations

import torch

from .triton_support import kernel
from .triton_support import unavailable as form_unavailable

#: keys per block of the walk, and warps per program
BLOCK_N, NUM_WARPS = 64, 4


def unavailable(device: torch.device) -> str | None:
    """Why the fused attention cannot run on ``device`` (None: it can)."""
    return form_unavailable(device.type, "attention form fused")


def _kernel():
    return kernel("attn_fused", _define_kernel)


def _define_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def attn_fused_fwd(q, k, v, o, base, sq_b, sq_h, sq_t, sk_b, sk_h, sk_n, so_b, so_t,
                       T: tl.constexpr, G: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                       M: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr,
                       PRECISION: tl.constexpr):
        scale = 1.0 / tl.sqrt(D * 1.0)  # (fp32; SDPA's default 1/sqrt(D))
        pid = tl.program_id(0)
        b = pid // HKV
        hk = pid % HKV
        rm = tl.arange(0, M)  # row = (query head in the group) * T + query
        live = rm < G * T
        t = rm % T
        head = hk * G + rm // T
        rd = tl.arange(0, D)
        qs = tl.load(q + b * sq_b + head[:, None] * sq_h + t[:, None] * sq_t + rd[None, :],
                     mask=live[:, None], other=0.0)
        start = tl.load(base + b)
        last = start + (t if CAUSAL else T - 1)  # the last key each row sees
        n = start + T
        m_i = tl.full([M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([M], dtype=tl.float32)
        acc = tl.zeros([M, D], dtype=tl.float32)
        kv = b * sk_b + hk * sk_h
        for s0 in range(0, n, BN):
            rn = s0 + tl.arange(0, BN)
            inside = rn < n
            ks = tl.load(k + kv + rn[:, None] * sk_n + rd[None, :], mask=inside[:, None], other=0.0)
            s = tl.dot(qs, tl.trans(ks), input_precision=PRECISION) * scale
            s = tl.where(rn[None, :] <= last[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vs = tl.load(v + kv + rn[:, None] * sk_n + rd[None, :], mask=inside[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vs.dtype), vs, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(o + b * so_b + head[:, None] * D + t[:, None] * so_t + rd[None, :],
                 out.to(o.dtype.element_ty), mask=live[:, None])

    return attn_fused_fwd


def attn_fused(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, base, causal: bool = True):
    """q [B,H,T,D]; K, V [B,Hkv,L,D] (H a multiple of Hkv: grouped queries), holding at least
    base + T keys per sequence; ``base`` an int or a [B] device tensor (the position of the
    first query). Returns [B,H,T,D] in q's dtype, as ``F.scaled_dot_product_attention`` with
    the visibility above."""
    why = unavailable(q.device)
    if why:
        raise RuntimeError(why)
    B, H, T, D = q.shape
    HKV = K.shape[1]
    if not isinstance(base, torch.Tensor):
        base = torch.full((B,), int(base), dtype=torch.long, device=q.device)
    if K.stride(-1) != 1 or V.stride() != K.stride():
        K, V = K.contiguous(), V.contiguous()
    q = q if q.stride(-1) == 1 else q.contiguous()
    G = H // HKV
    out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)  # [B,T,H,D]: o_proj's layout
    M = max(16, 1 << (G * T - 1).bit_length())
    _kernel()[(B * HKV,)](
        q, K, V, out, base, q.stride(0), q.stride(1), q.stride(2),
        K.stride(0), K.stride(1), K.stride(2), out.stride(0), out.stride(1),
        T=T, G=G, HKV=HKV, D=D, M=M, BN=BLOCK_N, CAUSAL=causal,
        # fp32 products in fp32 (not TF32: an fp32 engine is exact up to fp32 rounding)
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=NUM_WARPS)
    return out.transpose(1, 2)
