"""The gated delta rule as one Triton kernel per call: the recurrent step of every new token
inside one launch, the state in registers, optionally every token's state written out for
exact rollback — the shape of vLLM's fused recurrent / sigmoid-gating kernels, which serve its
one-token decode and its K+1-token spec verify alike.

Why: on a GPU this toy model is bound by kernel launches, not arithmetic. The PyTorch
recurrence is ~20 small kernels per layer and token, the chunked form ~40 per layer; one fused
launch per layer makes a verify of K+1 tokens cost about what a one-token decode step costs,
which is where speculative decoding's speedup comes from. CUDA only (Triton); the engine
offers it as GDN form ``fused``. ``TRITON_INTERPRET=1`` (set before the first call) runs it on
CPU tensors through Triton's interpreter, which is how the tests check it without a GPU.
"""
from __future__ import annotations

import torch

from ..state import PerPositionStates
from .triton_support import kernel
from .triton_support import unavailable as form_unavailable

#: eps of the q/k L2 normalisation (model.l2norm)
L2_EPS = 1e-6
#: value columns per program and warps per program (the launch shape; the sums per column
#: are the same whatever they are)
BLOCK_V, NUM_WARPS = 8, 1  # (fastest on the H200: T=8 6.4 µs, T=1 2.0 µs; 32, 4 took 10.7, 2.3)


def unavailable(device: torch.device) -> str | None:
    """Why the fused kernel cannot run on ``device`` (None: it can)."""
    return form_unavailable(device.type, "GDN form fused")


def _kernel():
    return kernel("gdn_fused", _define_kernel)


def _define_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gdn_fused_fwd(q, k, v, g, beta, s0, out, s_last, states,
                      T: tl.constexpr, TP: tl.constexpr, sq_b, sq_t, sq_h, sv_b, sv_t, sv_h,
                      sg_b, sg_t, sg_h, sb_b, sb_t, sb_h,
                      H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                      PER_POSITION: tl.constexpr, EPS: tl.constexpr):
        # one program per (sequence, head, block of BV value columns): S[:, cols] in registers
        bh = tl.program_id(0)
        b = bh // H
        h = bh % H
        rk = tl.arange(0, DK)
        rv = tl.program_id(1) * BV + tl.arange(0, BV)
        rt = tl.arange(0, TP)
        live = rt < T
        tile = (bh * DK + rk[:, None]) * DV + rv[None, :]  # [B,H,DK,DV] offsets of the tile
        # every position's inputs loaded before the first store (a store may alias a later
        # load as far as the compiler knows, so loads inside the loop would each wait for
        # the memory round trip), q and k L2-normalised for all positions at once
        qs = tl.load(q + b * sq_b + rt[:, None] * sq_t + h * sq_h + rk[None, :],
                     mask=live[:, None], other=0.0).to(tl.float32)
        ks = tl.load(k + b * sq_b + rt[:, None] * sq_t + h * sq_h + rk[None, :],
                     mask=live[:, None], other=0.0).to(tl.float32)
        vs = tl.load(v + b * sv_b + rt[:, None] * sv_t + h * sv_h + rv[None, :],
                     mask=live[:, None], other=0.0).to(tl.float32)
        gs = tl.load(g + b * sg_b + rt * sg_t + h * sg_h, mask=live, other=0.0).to(tl.float32)
        bs = tl.load(beta + b * sb_b + rt * sb_t + h * sb_h, mask=live, other=0.0).to(tl.float32)
        s = tl.load(s0 + tile)
        scale = 1.0 / tl.sqrt(DK * 1.0)
        qs = qs * (1.0 / tl.sqrt(tl.sum(qs * qs, axis=1) + EPS))[:, None] * scale
        ks = ks * (1.0 / tl.sqrt(tl.sum(ks * ks, axis=1) + EPS))[:, None]
        decay = tl.exp(gs)
        outs = tl.zeros([TP, BV], dtype=tl.float32)
        for t in tl.static_range(T):  # unrolled
            row = rt == t
            qt = tl.sum(tl.where(row[:, None], qs, 0.0), axis=0)
            kt = tl.sum(tl.where(row[:, None], ks, 0.0), axis=0)
            vt = tl.sum(tl.where(row[:, None], vs, 0.0), axis=0)
            dt = tl.sum(tl.where(row, decay, 0.0), axis=0)
            bt = tl.sum(tl.where(row, bs, 0.0), axis=0)
            s = s * dt
            delta = (vt - tl.sum(kt[:, None] * s, axis=0)) * bt
            s = s + kt[:, None] * delta[None, :]
            outs = tl.where(row[:, None], tl.sum(qt[:, None] * s, axis=0)[None, :], outs)
            if PER_POSITION:
                tl.store(states + (((b * T + t) * H + h) * DK + rk[:, None]) * DV + rv[None, :], s)
        tl.store(out + ((b * T + rt[:, None]) * H + h) * DV + rv[None, :], outs, mask=live[:, None])
        tl.store(s_last + tile, s)

    return gdn_fused_fwd


def _positions_tile(n: int) -> int:
    """The power of two >= n (and >= 2) that holds a call's positions as one tile."""
    return max(2, 1 << max(0, n - 1).bit_length())


def gdn_fused(q, k, v, g, beta, state, per_position: bool = False):
    """Same contract as :func:`speccheck.reference.model.gdn_recurrent` (q, k [B,T,H,Dk] un-normalised; v
    [B,T,H,Dv]; g, beta [B,T,H]; state fp32 [B,H,Dk,Dv]; returns fp32 output [B,T,H,Dv], the
    final state, and with ``per_position`` the stacked states after each position instead),
    computed by one kernel launch. The arithmetic is the recurrence's, in fp32, with the
    kernel's own reduction order (so it agrees with the PyTorch forms to fp32 rounding)."""
    why = unavailable(q.device)
    if why:
        raise RuntimeError(why)
    B, T, H, DK = q.shape
    DV = v.shape[-1]
    state = state.float().contiguous()
    out = torch.empty(B, T, H, DV, dtype=torch.float32, device=q.device)
    s_last = torch.empty_like(state)
    states = (torch.empty(B, T, H, DK, DV, dtype=torch.float32, device=q.device)
              if per_position else s_last)  # (unused without per_position)
    bv = min(DV, BLOCK_V)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1:
            raise ValueError(f"gdn_fused: {name} must be contiguous in its last dim")
    if k.stride() != q.stride():  # (one split of the conv output: they share strides)
        q, k = q.contiguous(), k.contiguous()
    _kernel()[(B * H, DV // bv)](
        q, k, v, g, beta, state, out, s_last, states, T, _positions_tile(T),
        q.stride(0), q.stride(1), q.stride(2), v.stride(0), v.stride(1), v.stride(2),
        g.stride(0), g.stride(1), g.stride(2), beta.stride(0), beta.stride(1), beta.stride(2),
        H=H, DK=DK, DV=DV, BV=bv, PER_POSITION=per_position, EPS=L2_EPS, num_warps=NUM_WARPS)
    if per_position:
        return out, None, PerPositionStates(states)
    return out, s_last, None
