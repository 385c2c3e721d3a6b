"""DFlash2's selector (fp32 walk) in two Triton launches: every slot's projection and top-K
candidates at once, then the walk over the rows of edge scores it reads.

Why: on a GPU the selector's ops (an fp32 projection that cuBLAS runs at ~50 µs for 7 rows, an
int64 top-k over the vocabulary, a batched fp32 einsum for all K x K edge scores, one
gather-argmax launch per slot) cost more than the drafter's whole network (~140 of a ~240 µs
draft on the H200, compiled); its work is tiny. The same
rule as :func:`speccheck.reference.dflash2.select_drafts` and the CPU kernel (``kernels.cpu.dflash2_select``):
candidates by descending score with ties to the lower token id, the walk's ties to the
better-ranked candidate; the sum over the rank is the kernel's own tree, so at near-ties its
drafts can differ from the ops' (drafts only: the target's verify decides every token).
``TRITON_INTERPRET=1`` (set before the first call) runs it on CPU tensors, which is how the
tests check it without a GPU.
"""
from __future__ import annotations

import torch

from .triton_support import kernel, triton_missing


def unavailable(device: torch.device) -> str | None:
    """Why the kernel cannot run on ``device`` (None: it can)."""
    return triton_missing(device.type)


def _kernel():
    return kernel("dflash2_select", _define_kernel)


def _define_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def dflash2_slot_fwd(unary, hidden, proj, h, ids, vals, V: tl.constexpr, K: tl.constexpr,
                         SHIFT: tl.constexpr, H: tl.constexpr, R: tl.constexpr,
                         BV: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
        # one program per slot: P h of its hidden state, and its K best scores, highest first,
        # equal scores lowest id first
        row = tl.program_id(0)
        rr = tl.arange(0, BR)
        acc = tl.zeros([BR], dtype=tl.float32)
        for c0 in tl.static_range(0, H, BH):
            rh = c0 + tl.arange(0, BH)
            x = tl.load(hidden + row * H + rh, mask=rh < H, other=0.0).to(tl.float32)
            w = tl.load(proj + rr[:, None] * H + rh[None, :],
                        mask=(rr[:, None] < R) & (rh[None, :] < H), other=0.0).to(tl.float32)
            acc += tl.sum(w * x[None, :], axis=1)
        tl.store(h + row * R + rr, acc, mask=rr < R)
        # one int64 key per score (as dflash2.candidates): the score's bits made
        # order-preserving above the token id inverted, so one max finds the next candidate
        rv = tl.arange(0, BV)
        u = tl.load(unary + row * V + rv, mask=rv < V, other=0.0)
        u = tl.where(u == 0.0, 0.0, u)  # -0.0 ties with +0.0
        bits = u.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        key = (ordered.to(tl.int64) << SHIFT) | (V - 1 - rv).to(tl.int64)
        key = tl.where(rv < V, key, -9223372036854775807 - 1)
        for c in tl.static_range(K):
            best = tl.max(key, axis=0)
            key = tl.where(key == best, -9223372036854775807 - 1, key)
            idx = V - 1 - (best & ((1 << SHIFT) - 1))
            tl.store(ids + row * K + c, idx)
            tl.store(vals + row * K + c, tl.load(unary + row * V + idx))

    @triton.jit
    def dflash2_walk_fwd(ids, vals, h, pred_book, succ_book, anchor, out, L: tl.constexpr,
                         K: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
        # one program per sequence, the slots in order: slot l scores its candidates c by
        # vals[c] + sum_r pred[prev, r] h[l, r] succ[c, r] and keeps the best (ties: lower c)
        n = tl.program_id(0)
        rk = tl.arange(0, BK)
        rr = tl.arange(0, BR)
        prev = tl.load(anchor + n)
        for l in tl.static_range(L):
            row = n * L + l
            cand = tl.load(ids + row * K + rk, mask=rk < K, other=0)
            v = tl.load(vals + row * K + rk, mask=rk < K, other=0.0)
            a = tl.load(pred_book + prev * R + rr, mask=rr < R, other=0.0).to(tl.float32) \
                * tl.load(h + row * R + rr, mask=rr < R, other=0.0)  # (P h from the slot pass)
            succ = tl.load(succ_book + cand[:, None] * R + rr[None, :],
                           mask=(rk[:, None] < K) & (rr[None, :] < R), other=0.0).to(tl.float32)
            s = tl.where(rk < K, v + tl.sum(succ * a[None, :], axis=1), float("-inf"))
            best = tl.min(tl.where(s == tl.max(s, axis=0), rk, BK), axis=0)
            prev = tl.sum(tl.where(rk == best, cand, 0), axis=0)
            tl.store(out + row, prev)

    return dflash2_slot_fwd, dflash2_walk_fwd


def dflash2_select_fused(unary: torch.Tensor, hidden: torch.Tensor, proj: torch.Tensor,
                         pred_book: torch.Tensor, succ_book: torch.Tensor, anchor: torch.Tensor,
                         k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """As ``kernels.cpu.dflash2_select`` with the projection inside (unary [N, L, V] fp32
    LM-head scores, hidden [N, L, H] the slots' hidden states, proj [R, H] the
    ``hidden_projection`` weight, codebooks [V, R], anchor [N] -> drafts [N, L] int64, in
    ``out`` where given): a launch over the slots (:func:`slot_pass`), then one over the
    sequences (the walk)."""
    import triton

    N, L, _ = unary.shape
    R = proj.shape[0]
    h, ids, vals = slot_pass(unary, hidden, proj, k)
    if out is None:
        out = torch.empty(N, L, dtype=torch.int64, device=unary.device)
    elif out.shape != (N, L) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"dflash2_select_fused: out must be contiguous int64 {(N, L)}")
    _kernel()[1][(N,)](ids, vals, h, pred_book.contiguous(), succ_book.contiguous(),
                       anchor.to(torch.int64).contiguous(), out, L=L, K=k, R=R,
                       BK=triton.next_power_of_2(k), BR=triton.next_power_of_2(R))
    return out


def slot_pass(unary: torch.Tensor, hidden: torch.Tensor, proj: torch.Tensor, k: int) -> tuple:
    """Per slot, in one launch: P h [N, L, R] fp32 and the candidates (ids [N, L, k] int64,
    scores [N, L, k]) as :func:`speccheck.reference.dflash2.candidates` orders them."""
    import triton

    N, L, V = unary.shape
    H, R = hidden.shape[-1], proj.shape[0]
    dev = unary.device
    h = torch.empty(N, L, R, dtype=torch.float32, device=dev)
    ids = torch.empty(N, L, k, dtype=torch.int64, device=dev)
    vals = torch.empty(N, L, k, dtype=torch.float32, device=dev)
    br = triton.next_power_of_2(R)
    _kernel()[0][(N * L,)](unary.float().contiguous(), hidden.contiguous(), proj.contiguous(), h,
                           ids, vals, V=V, K=k, SHIFT=max(1, (V - 1).bit_length()), H=H, R=R,
                           BV=triton.next_power_of_2(V), BR=br,
                           BH=min(triton.next_power_of_2(H), max(16, 8192 // br)))
    return h, ids, vals
