"""A small but real Qwen3.5-family model: hybrid Gated-DeltaNet / gated attention target,
one MTP module, and a DFlash-style block drafter.

Module and parameter names mirror Hugging Face transformers' ``Qwen3_5TextModel``
(``embed_tokens``, ``layers.N.linear_attn.*`` / ``layers.N.self_attn.*``, ``mlp.*``,
``input_layernorm``, ``post_attention_layernorm``, ``norm``; tied lm head), vLLM's
``Qwen3_5MultiTokenPredictor`` (``fc``, ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``,
``layers.0.*``, ``norm``; saved under ``mtp.``) and vLLM's ``DFlashQwen3Model``
(``fc``, ``hidden_norm``, ``layers.N.*``, ``norm``), so a state dict exports by renaming
prefixes only.

Numerics follow the family: Qwen3.5 RMSNorm scales by ``(1 + weight)`` in fp32, the GDN
output norm is a plain-weight gated RMSNorm, GDN runs in fp32 with an fp32 recurrent state,
logits are fp32. In bf16 the matmuls run in bf16 while the residual stream stays fp32. GDN has two forms (recurrent step, chunked parallel) and attention two
forms (``multi``: one SDPA over all new queries, ``single``: one query at a time); which
form runs is chosen per call, so decode and verify can differ exactly as real kernels do.
"""
from __future__ import annotations

import functools
import math
import os
import random
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from .kernels.attn_fused import attn_fused
from .kernels.cpu import compiled, gdn_chunk, gdn_chunk_state, linear, rms_norm, rowinv_linear
from .kernels.gdn_fused import gdn_fused
from .state import PerPositionStates

#: "fused" is one Triton kernel (CUDA; see gdn_fused.py) computing the recurrent form
GDN_FORMS = ("chunked", "recurrent", "fused")
ATTN_FORMS = ("single", "multi", "fused")
DRAFT_ATTN_FORMS = ("multi", "fused")  # a DFlash block attends non-causally: no per-query form


# --------------------------------------------------------------------------- config


@dataclass
class DrafterConfig:
    """DFlash block drafter (vLLM ``DFlashQwen3ForCausalLM`` shape)."""

    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    block_size: int = 8
    target_layer_ids: list[int] = field(default_factory=lambda: [1, 4, 6])
    rope_theta: float = 10000.0


@dataclass
class ReferenceConfig:
    """Everything needed to rebuild the networks; saved as ``config.json`` next to the weights."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 8
    layer_types: list[str] = field(
        default_factory=lambda: ["linear_attention"] * 3 + ["full_attention"]
        + ["linear_attention"] * 3 + ["full_attention"]
    )
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10000.0
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 8192
    mtp_num_hidden_layers: int = 1
    chunk_size: int = 64
    eos_token_id: int = 0
    mask_token_id: int = 1
    drafter: DrafterConfig = field(default_factory=DrafterConfig)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ReferenceConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"config.json: unknown fields {sorted(unknown)}; known: {sorted(known)}")
        d = dict(d)
        if isinstance(d.get("drafter"), dict):
            dk = {f.name for f in fields(DrafterConfig)}
            bad = set(d["drafter"]) - dk
            if bad:
                raise ValueError(f"config.json: unknown drafter fields {sorted(bad)}; known: {sorted(dk)}")
            d["drafter"] = DrafterConfig(**d["drafter"])
        return cls(**d)


# --------------------------------------------------------------------------- small pieces


def inference_cached(owner: nn.Module, name: str, sources: list[torch.Tensor], build):
    """``build()`` of parameters, cached on ``owner`` at inference and rebuilt when any source
    changes; recomputed (differentiable) when autograd is on. A CPU decode step is bound by
    per-op overhead, so weight-only work (fused projections, norm scales) is done once."""
    if torch.is_grad_enabled():
        return build()
    if torch.compiler.is_compiling():  # a traced step: the eager warm-up built it (fixed weights)
        cached = owner.__dict__.get("_cached_" + name)
        return build() if cached is None else cached[1]
    key = tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in sources)
    cached = owner.__dict__.get("_cached_" + name)
    if cached is None or cached[0] != key:
        with torch.inference_mode(False), torch.no_grad():
            cached = (key, build())
        owner.__dict__["_cached_" + name] = cached
    return cached[1]


class RMSNorm(nn.Module):
    """Plain RMSNorm (``x̂ * w``), as in Qwen3 / vLLM's RMSNorm, used by the drafter;
    computed in fp32, returned in the weights' dtype."""

    init = 1.0  # the weight's initial value

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.full((dim,), self.init))

    def scale(self) -> torch.Tensor:
        return self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = inference_cached(self, "scale", [self.weight], self.scale)
        return rms_norm(x, scale, self.eps, self.weight.dtype)


class Qwen3_5RMSNorm(RMSNorm):
    """Zero-centred RMSNorm of the family: ``x̂ * (1 + w)`` (the residual stream itself
    stays fp32, see Qwen3_5TextModel)."""

    init = 0.0

    def scale(self) -> torch.Tensor:
        return 1.0 + self.weight.float()


class Qwen3_5RMSNormGated(nn.Module):
    """GDN output norm: plain-weight RMSNorm per head, then ``* silu(z)`` (as HF)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = self.weight * rms_norm(x, None, self.eps, dtype)
        h = h * F.silu(gate.float())
        return h.to(dtype)


class Fault:
    """Which planted bug is active (``None`` = clean); see decode.FAULTS."""

    name: str | None = None


class Linear(nn.Linear):
    """nn.Linear (no bias) whose bf16 inference on the CPU runs the row-invariant kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class NondetLinear(Linear):
    """nn.Linear whose reduction order can be randomised run to run (fault
    ``nondeterministic``): the input dim is split at random points and the partial
    products are summed in random order in the working dtype."""

    nondet_rng: random.Random | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rng = self.nondet_rng
        if rng is None:
            return super().forward(x)
        n = self.in_features
        cuts = sorted(rng.sample(range(1, n), 3))
        bounds = list(zip([0] + cuts, cuts + [n]))
        rng.shuffle(bounds)
        out = None
        for a, b in bounds:
            part = F.linear(x[..., a:b], self.weight[:, a:b])
            out = part if out is None else out + part
        return out


def fused_weight(owner: nn.Module, name: str, linears: list[nn.Linear]) -> torch.Tensor:
    """The row-concatenation of several projections' weights, so one GEMM replaces several."""
    weights = [lin.weight for lin in linears]
    return inference_cached(owner, name, weights, lambda: torch.cat(weights))


class Qwen3_5MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.inter = inter
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = NondetLinear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, fused_weight(self, "gate_up", [self.gate_proj, self.up_proj])
                            ).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


ROPE_TABLE_SIZE = 1 << 15  # positions (the config allows 8192)


#: (rot_dim, theta, dtype, device) -> (cos, sin): a plain dict, not an lru_cache, so that a
#: traced step (engine arg ``compile``) reads the table instead of recomputing it in its graph
_ROPE_TABLES: dict = {}


def _rope_table(rot_dim: int, theta: float, dtype, device) -> tuple:
    key = (rot_dim, theta, dtype, device)
    if key not in _ROPE_TABLES:
        _ROPE_TABLES[key] = _build_rope_table(rot_dim, theta, dtype, device)
    return _ROPE_TABLES[key]


def _build_rope_table(rot_dim: int, theta: float, dtype, device) -> tuple:
    with torch.inference_mode(False), torch.no_grad():
        inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32,
                                                 device=device) / rot_dim))
        freqs = torch.arange(ROPE_TABLE_SIZE, dtype=torch.float32, device=device)[:, None] \
            * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        sin = emb.sin()
        sin[:, : rot_dim // 2] *= -1  # the sign of rotate_half's first half, see apply_rope
        return emb.cos().to(dtype), sin.to(dtype)


def rope_cos_sin(positions: torch.Tensor | range, rot_dim: int, theta: float, dtype,
                 device=None) -> tuple:
    """Neox-style RoPE cos and (signed, see :func:`apply_rope`) sin for ``rot_dim`` leading
    dims at ``positions`` (a tensor, or a ``range`` for consecutive positions), looked up in a
    table computed once in fp32."""
    if isinstance(positions, range):
        if positions.stop > ROPE_TABLE_SIZE:
            raise ValueError(f"position {positions.stop - 1} is past the {ROPE_TABLE_SIZE} "
                             f"positions this model supports; shorten the prompt or max_tokens")
        cos, sin = _rope_table(rot_dim, theta, dtype, torch.device(device))
        return cos[positions.start:positions.stop], sin[positions.start:positions.stop]
    cos, sin = _rope_table(rot_dim, theta, dtype, positions.device)
    return cos[positions], sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., T, D]; rotates the first ``cos.shape[-1]`` dims (partial rotary):
    ``x * cos + rotate_half(x) * sin`` with rotate_half(x) = [-x2, x1], computed as
    [x2, x1] (one roll) times the signed sin of :func:`rope_cos_sin`: the same products
    (a sign flip is exact), fewer ops."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + x.roll(r // 2, -1) * sin
    xr = x[..., :r]
    return torch.cat([xr * cos + xr.roll(r // 2, -1) * sin, x[..., r:]], dim=-1)


# --------------------------------------------------------------------------- gated delta rule


@functools.lru_cache(maxsize=64)
def _upper_mask(n: int, device: torch.device) -> torch.Tensor:
    """True strictly above the diagonal (j > i: a later token cannot affect an earlier one)."""
    with torch.inference_mode(False):
        return torch.ones(n, n, dtype=torch.bool, device=device).triu(1)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _gdn_prep(q, k, v, g, beta):
    """[B,T,H,D] inputs -> fp32 [B,H,T,D], q/k L2-normalised, q scaled by 1/sqrt(D)."""
    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
    g, beta = g.transpose(1, 2).float(), beta.transpose(1, 2).float()
    q = l2norm(q) * (q.shape[-1] ** -0.5)
    k = l2norm(k)
    return q, k, v, g, beta


def gdn_recurrent(q, k, v, g, beta, state, per_position: bool = False):
    """Gated delta rule, one token at a time (the decode kernel):
    S <- exp(g) S;  S <- S + k (beta (v - k.S));  o = q.S

    q,k: [B,T,H,Dk]; v: [B,T,H,Dv]; g (log decay, <=0), beta: [B,T,H]; state: fp32
    [B,H,Dk,Dv]. Returns output [B,T,H,Dv] (fp32), the final state, and with
    ``per_position`` instead of the final state (None) the state after every position
    (for exact rollback after a rejected draft; the final one is ``per.at(T - 1)``).
    """
    q, k, v, g, beta = _gdn_prep(q, k, v, g, beta)
    T = q.shape[2]
    decay = g.exp()[..., None, None]
    q, k, v, beta = q[..., None, :], k[..., None, :], v[..., None, :], beta[..., None, None]
    outs, states = [], []
    s = state
    for t in range(T):
        s = s * decay[:, :, t]
        kt = k[:, :, t]  # [B,H,1,Dk]
        delta = (v[:, :, t] - kt @ s) * beta[:, :, t]  # [B,H,1,Dv]
        s = s + kt.transpose(-1, -2) @ delta
        outs.append(q[:, :, t] @ s)
        if per_position:
            states.append(s)
    out = (outs[0] if T == 1 else torch.cat(outs, dim=2)).transpose(1, 2)
    if per_position:
        return out, None, PerPositionStates(torch.stack(states, dim=1))
    return out, s, None


def gdn_chunked(q, k, v, g, beta, state, chunk_size: int = 64, per_position: bool = False):
    """Gated delta rule in the chunked parallel (WY / UT-transform) form (the prefill
    kernel). Same contract as :func:`gdn_recurrent`; ``state`` may be None (zeros).

    Per chunk: [u | w] = (I + tril(diag(beta) K K^T * D, -1))^-1 [beta V | beta exp(cum) K],
    v_new = u - w S, o = exp(cum) Q S + (Q K^T * D) v_new, with D_ij = exp(cum_i - cum_j)
    for j <= i. With ``per_position`` and one chunk (a verify) the state is left as parts
    and only the kept position's state is ever formed (:class:`PerPositionStates`)."""
    q, k, v, g, beta = _gdn_prep(q, k, v, g, beta)
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    if state is None:
        state = q.new_zeros(B, H, Dk, Dv)
    C = min(chunk_size, T)  # short inputs (verify) are one chunk, unpadded
    pad = (C - T % C) % C
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // C
    if n > 1:
        q, k, v = (x.reshape(B, H, n, C, -1) for x in (q, k, v))
        g, beta = g.reshape(B, H, n, C), beta.reshape(B, H, n, C)
    cum = g.cumsum(-1)
    exp_cum = cum.exp()[..., None]
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(_upper_mask(C, q.device),
                                                                 float("-inf")).exp()
    kt = k.transpose(-1, -2)
    k_beta = k * beta[..., None]
    # the unit-triangular solve reads only the strictly lower triangle: no mask, no eye
    uw = torch.linalg.solve_triangular((k_beta @ kt) * decay,
                                       torch.cat([v * beta[..., None], k_beta * exp_cum], -1),
                                       upper=False, unitriangular=True)
    u, w = uw[..., :Dv], uw[..., Dv:]
    intra = (q @ kt) * decay
    q_dec = q * exp_cum
    if n == 1:
        v_new = u - w @ state
        out = q_dec @ state + intra @ v_new
        out = out.transpose(1, 2)  # (one chunk is never padded)
        if per_position:
            return out, None, PerPositionStates(parts=(state, cum, decay, k, v_new))
        k_dec = kt * (cum[..., -1:] - cum).exp()[..., None, :]
        return out, state * exp_cum[..., -1, :, None] + k_dec @ v_new, None
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    outs, states = [], []
    s = state
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ s
        outs.append(q_dec[:, :, i] @ s + intra[:, :, i] @ v_new)
        if per_position:
            states.append(PerPositionStates(parts=(s, cum[:, :, i], decay[:, :, i], k[:, :, i],
                                                   v_new)).stack())
        s = s * chunk_decay[:, :, i] + k_dec[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(outs, dim=2).reshape(B, H, n * C, Dv)[:, :, :T].transpose(1, 2)
    # (a padded tail has g=0, beta=0: no decay and no update, so s is exact)
    if per_position:
        return out, None, PerPositionStates(torch.cat(states, dim=1)[:, :T])
    return out, s, None


# --------------------------------------------------------------------------- cache


class Cache:
    """Inference state: GDN recurrent state (fp32) and conv state per linear layer, K/V per
    attention layer, and the number of positions seen.

    Verify forwards leave per-position candidates in ``pending`` so that
    :meth:`commit` can keep exactly the first ``n`` new positions (exact rollback).

    A batch (:meth:`join`: prompts prefilled one by one, as a server prefills each request
    when it arrives, then decoded together) keeps a length per sequence, ``lengths`` [B]: a
    forward writes sequence b's tokens at lengths[b].., attention masks every key past a
    sequence's own position, and :meth:`commit` keeps a count per sequence. Attention depends
    only on relative positions, so each sequence computes what it would alone.

    A ``static`` cache (:meth:`static_for`, for CUDA graphs: every tensor at a fixed address)
    keeps ``lengths`` on the device, attends over all ``max_len`` positions with the keys past
    each sequence's end masked, updates its states in place and commits a device tensor of
    counts (:meth:`commit_kept`): no step reads a value back to the host."""

    def __init__(self, n_layers: int, max_len: int):
        self.length = 0
        self.lengths: torch.Tensor | None = None
        self.max_len = max_len
        self.static = False
        self.gdn: list = [None] * n_layers
        self.conv: list = [None] * n_layers
        self.k: list = [None] * n_layers
        self.v: list = [None] * n_layers
        self.pending: dict = {}

    @classmethod
    def join(cls, caches: list["Cache"]) -> "Cache":
        """One batch of single-sequence caches (same max_len), each at its own length."""
        out = cls(len(caches[0].gdn), caches[0].max_len)
        for name in ("gdn", "conv", "k", "v"):
            setattr(out, name, [None if parts[0] is None else torch.cat(parts)
                                for parts in zip(*(getattr(c, name) for c in caches))])
        device = next(t for t in out.gdn + out.k if t is not None).device
        out.lengths = torch.tensor([c.length for c in caches], dtype=torch.long, device=device)
        return out

    @classmethod
    def static_for(cls, layers, max_len: int, batch: int = 1) -> "Cache":
        """A static cache for these decoder layers (target or MTP), all zeros, at length 0."""
        p = next(layers.parameters())
        out = cls(len(layers), max_len)
        out.static = True
        out.lengths = torch.zeros(batch, dtype=torch.long, device=p.device)
        for i, layer in enumerate(layers):
            if layer.layer_type == "linear_attention":
                a = layer.linear_attn
                out.gdn[i] = torch.zeros(batch, a.nv, a.dk, a.dv, device=p.device)
                out.conv[i] = p.new_zeros(batch, a.kernel - 1, a.conv_dim)
            else:
                a = layer.self_attn
                out.k[i] = p.new_zeros(batch, a.nkv, max_len, a.d)
                out.v[i] = p.new_zeros(batch, a.nkv, max_len, a.d)
        return out

    def reset(self) -> None:
        """A static cache back to empty, in place."""
        for t in self.gdn + self.conv + self.k + self.v + [self.lengths]:
            if t is not None:
                t.zero_()
        self.pending = {}

    def advance(self, n: int) -> None:
        """``n`` more positions seen by every sequence (in place where static)."""
        if self.lengths is None:
            self.length += n
        elif self.static:
            self.lengths += n
        else:
            self.lengths = self.lengths + n

    def commit_kept(self, kept: torch.Tensor) -> None:
        """:meth:`commit` of a static cache: keep ``kept`` [B] (a device tensor) of the last
        forward's new positions per sequence, states copied in place."""
        rows = torch.arange(kept.shape[0], device=kept.device)
        for i, p in self.pending.items():
            per_state, window = p[1], p[2]
            k1 = window.shape[1] - len(per_state)
            self.conv[i].copy_(window[rows[:, None], kept[:, None] + torch.arange(k1, device=kept.device)])
            self.gdn[i].copy_(per_state.at_rows(kept - 1))
        self.pending = {}
        self.lengths += kept

    def commit(self, n_new: int | list[int], roll_back_gdn: bool = True, *,
               roll_back_conv: bool = True, state_keep: list[int] | None = None,
               alias_first: bool = False, gdn_stale: list[bool] | None = None) -> None:
        """Keep the first ``n_new`` positions of the last forward and drop the rest (a list:
        a count per sequence of a ragged batch).

        The other arguments exist only to plant spec-decode bugs (decode.FAULTS); their
        defaults are exact rollback: ``roll_back_gdn`` / ``roll_back_conv`` False keep that
        state at the end of the forward (rejected positions included), ``state_keep`` keeps
        the GDN and conv state at other counts than the tokens (per sequence), and
        ``alias_first`` gives every row of a batch sequence 0's state, ``gdn_stale`` (per
        sequence) keeps the GDN state at the end of the forward where True."""
        counts = [n_new] if isinstance(n_new, int) else list(n_new)
        state_counts = counts if state_keep is None else list(state_keep)
        for i, p in self.pending.items():
            per_state, window = p[1], p[2]
            # conv state = the last K-1 inputs: window holds K-1 old + T new [B, K-1+T, C]
            k1 = window.shape[1] - len(per_state)
            keep = [n if roll_back_gdn and not (gdn_stale and gdn_stale[j]) else len(per_state)
                    for j, n in enumerate(state_counts)]
            conv_keep = [n if roll_back_conv else len(per_state) for n in state_counts]
            if isinstance(n_new, int):
                self.conv[i] = window[:, conv_keep[0]: conv_keep[0] + k1]
                self.gdn[i] = per_state.at(keep[0] - 1)
            else:  # one gather per layer, whatever the batch size
                dev = window.device
                at = torch.tensor(conv_keep, device=dev)[:, None] + torch.arange(k1, device=dev)
                self.conv[i] = window[torch.arange(len(conv_keep), device=dev)[:, None], at]
                self.gdn[i] = per_state.at_rows(torch.tensor(keep, device=dev) - 1)
                if alias_first:
                    self.conv[i] = self.conv[i][:1].expand_as(self.conv[i]).clone()
                    self.gdn[i] = self.gdn[i][:1].expand_as(self.gdn[i]).clone()
        self.pending = {}
        if isinstance(n_new, int):
            self.length += n_new
        else:
            self.lengths = self.lengths + torch.tensor(counts, device=self.lengths.device)

    def select(self, rows: list[int]) -> None:
        """Keep only these sequences of a ragged batch (the others have finished)."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.lengths.device)
        for name in ("gdn", "conv", "k", "v"):
            setattr(self, name, [None if t is None else t[idx] for t in getattr(self, name)])
        self.lengths = self.lengths[idx]

    def copy(self, max_len: int) -> "Cache":
        """A single sequence's cache copied into a new one of ``max_len`` positions (the K/V
        of the positions seen; nothing shared): a prefilled prompt kept for reuse."""
        assert self.lengths is None and not self.pending and self.length <= max_len
        out = Cache(len(self.gdn), max_len)
        out.length = self.length
        out.gdn = [None if s is None else s.clone() for s in self.gdn]
        out.conv = [None if s is None else s.clone() for s in self.conv]
        for mine, theirs in ((self.k, out.k), (self.v, out.v)):
            for i, t in enumerate(mine):
                if t is not None:
                    theirs[i] = t.new_zeros(*t.shape[:2], max_len, t.shape[3])
                    theirs[i][:, :, :self.length] = t[:, :, :self.length]
        return out

    def snapshot(self) -> tuple:
        """A copy of the state at the current position (cheap: a few small tensors)."""
        return (self.length, [None if s is None else s.clone() for s in self.gdn],
                [None if s is None else s.clone() for s in self.conv])

    def restore(self, snap: tuple) -> None:
        """Back to a snapshot; attention K/V beyond its length is simply ignored."""
        self.length, gdn, conv = snap
        self.gdn = [None if s is None else s.clone() for s in gdn]
        self.conv = [None if s is None else s.clone() for s in conv]
        self.pending = {}


# --------------------------------------------------------------------------- target layers


class Qwen3_5GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.chunk_size = cfg.chunk_size
        h = cfg.hidden_size
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, bias=False,
                                groups=self.conv_dim, padding=self.kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.nv).uniform_(1, 16)))
        self.norm = Qwen3_5RMSNormGated(self.dv, eps=cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, h, bias=False)
        self.in_proj_qkv = Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = Linear(h, self.value_dim, bias=False)
        self.in_proj_b = Linear(h, self.nv, bias=False)
        self.in_proj_a = Linear(h, self.nv, bias=False)
        self.verify_scale = 1.0  # 1 but under the planted fault verify-drift (decode.py)

    def forward(self, x: torch.Tensor, cache: Cache | None = None, idx: int = 0,
                form: str = "chunked", per_position: bool = False) -> torch.Tensor:
        B, T, _ = x.shape
        proj = linear(x, fused_weight(self, "in_proj", [self.in_proj_qkv, self.in_proj_z,
                                                          self.in_proj_b, self.in_proj_a]))
        mixed, z, b, a = proj.split([self.conv_dim, self.value_dim, self.nv, self.nv], dim=-1)
        z = z.reshape(B, T, self.nv, self.dv)
        # the causal depthwise conv accumulates in fp32 (as causal-conv1d kernels do)
        w = inference_cached(self, "conv_w", [self.conv1d.weight],
                             lambda: self.conv1d.weight.float())  # [C, 1, K]
        if cache is None:
            conv_out = F.conv1d(mixed.transpose(1, 2).float(), w, padding=self.kernel - 1,
                                groups=self.conv_dim)[..., :T].transpose(1, 2)
            state = None
        else:
            prev = cache.conv[idx]  # the last K-1 inputs [B, K-1, C]
            if prev is None:
                prev = mixed.new_zeros(B, self.kernel - 1, self.conv_dim)
            full = torch.cat([prev, mixed], dim=1)  # [B, K-1+T, C]
            if T <= 16:  # few positions: one windowed product is cheaper than a conv call
                w_kc = inference_cached(self, "conv_w_kc", [self.conv1d.weight],
                                        lambda: self.conv1d.weight[:, 0].t().float().contiguous())
                windows = full.float().unfold(1, self.kernel, 1).transpose(-1, -2)  # [B,T,K,C]
                conv_out = (windows * w_kc).sum(-2)
            else:
                conv_out = F.conv1d(full.transpose(1, 2).float(), w,
                                    groups=self.conv_dim).transpose(1, 2)
            state = cache.gdn[idx]
            if state is None:
                state = x.new_zeros(B, self.nv, self.dk, self.dv, dtype=torch.float32)
        conv_out = F.silu(conv_out)  # [B, T, C]
        beta = b.sigmoid()
        neg_a = inference_cached(self, "neg_a", [self.A_log], lambda: -self.A_log.float().exp())
        g = neg_a * F.softplus(a.float() + self.dt_bias)
        if (form == "chunked" and per_position and cache is not None and T <= self.chunk_size
                and conv_out.is_cpu and self.nv == self.nk and not torch.is_grad_enabled()
                and compiled()):
            # a verify on the CPU: the chunk (L2 norms, WY solve, outputs) in one C call
            # instead of ~30 PyTorch ops (same form; fp32 sums in the kernel's own order)
            out, parts = gdn_chunk(conv_out, g, beta, state, self.nv, self.dk, self.dv)
            s, per = None, PerPositionStates(kernel=parts, kernel_state=gdn_chunk_state)
        else:
            out, s, per = self._core(conv_out, g, beta, state, form, per_position)
        if cache is not None:
            if per_position:
                cache.pending[idx] = ("gdn", per, full)
            elif cache.static:
                cache.gdn[idx].copy_(s)
                cache.conv[idx].copy_(full[:, -(self.kernel - 1):])
            else:
                cache.gdn[idx] = s
                cache.conv[idx] = full[:, -(self.kernel - 1):]
        out = self.norm(out.to(x.dtype), z)
        y = self.out_proj(out.reshape(B, T, self.value_dim))
        return y * self.verify_scale if per_position and self.verify_scale != 1.0 else y

    def _core(self, conv_out, g, beta, state, form: str, per_position: bool):
        """The gated delta rule in ``form`` over the convolution's q, k, v."""
        B, T, _ = conv_out.shape
        q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, T, self.nk, self.dk)
        k = k.reshape(B, T, self.nk, self.dk)
        v = v.reshape(B, T, self.nv, self.dv)
        if self.nv != self.nk:
            q = q.repeat_interleave(self.nv // self.nk, dim=2)
            k = k.repeat_interleave(self.nv // self.nk, dim=2)
        if state is None and form != "chunked":
            state = q.new_zeros(B, self.nv, self.dk, self.dv, dtype=torch.float32)
        if form == "recurrent":
            return gdn_recurrent(q, k, v, g, beta, state, per_position)
        if form == "chunked":
            return gdn_chunked(q, k, v, g, beta, state, self.chunk_size, per_position)
        if form == "fused":
            return gdn_fused(q, k, v, g, beta, state, per_position)
        raise ValueError(f"unknown GDN form {form!r}; choose one of {GDN_FORMS}")


def _attend(q, K, V, start: int | torch.Tensor, form: str):
    """q: [B,H,T,D] at positions start..start+T-1; K,V: [B,Hkv,start+T,D] (all visible
    keys). ``multi`` = one SDPA with a causal mask, ``single`` = one SDPA per query,
    ``fused`` = one Triton kernel (:mod:`.kernels.attn_fused`; few queries, CUDA). A tensor
    ``start`` [B] is a batch of sequences at their own lengths: K,V hold max(start)+T
    positions and sequence b sees keys <= start[b]+i."""
    if form == "fused":  # one Triton kernel (CUDA): the visibility follows from start alone
        return attn_fused(q, K, V, start, causal=True)
    T, L = q.shape[2], K.shape[2]
    allowed = None  # [B, 1, T, L]: key visibility in a batch of sequences of their own lengths
    if isinstance(start, torch.Tensor):
        last = start[:, None] + torch.arange(T, device=q.device)  # [B, T]
        allowed = torch.arange(L, device=q.device) <= last[:, None, :, None]
        start = L - T  # causality is in `allowed`; the forms below see the longest sequence
    if form == "multi":
        if T == 1 and allowed is None:
            return F.scaled_dot_product_attention(q, K, V, enable_gqa=True)
        if T == L and allowed is None and q.device.type == "cpu":
            # a prefill: on the CPU the same bits as the mask below, its upper half skipped
            return F.scaled_dot_product_attention(q, K, V, is_causal=True, enable_gqa=True)
        mask = torch.ones(T, L, dtype=torch.bool, device=q.device).tril(L - T)
        if allowed is not None:
            mask = mask & allowed
        return F.scaled_dot_product_attention(q, K, V, attn_mask=mask, enable_gqa=True)
    if form == "single":
        outs = [F.scaled_dot_product_attention(
                    q[:, :, i:i + 1], K[:, :, : start + i + 1], V[:, :, : start + i + 1],
                    attn_mask=None if allowed is None else allowed[:, :, i:i + 1, : start + i + 1],
                    enable_gqa=True)
                for i in range(T)]
        return torch.cat(outs, dim=2)
    raise ValueError(f"unknown attention form {form!r}; choose one of {ATTN_FORMS}")


class Qwen3_5Attention(nn.Module):
    """Gated full attention: q_proj yields query and output gate, per-head q/k norms,
    partial RoPE, GQA."""

    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        self.nh, self.nkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.rot = int(self.d * cfg.partial_rotary_factor)
        self.theta = cfg.rope_theta
        self.q_proj = Linear(h, self.nh * self.d * 2, bias=False)
        self.k_proj = Linear(h, self.nkv * self.d, bias=False)
        self.v_proj = Linear(h, self.nkv * self.d, bias=False)
        self.o_proj = Linear(self.nh * self.d, h, bias=False)
        self.q_norm = Qwen3_5RMSNorm(self.d, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3_5RMSNorm(self.d, eps=cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cache: Cache | None = None, idx: int = 0,
                form: str = "multi", start: int = 0, positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """With a cache: new tokens at positions start.. . Without: a training forward,
        causal from 0, or with explicit ``positions`` and boolean ``mask`` (True = attend)."""
        B, T, _ = x.shape
        qkv = linear(x, fused_weight(self, "qkv", [self.q_proj, self.k_proj, self.v_proj]))
        nq, nk = self.nh * self.d * 2, self.nkv * self.d
        qg = qkv[..., :nq].view(B, T, self.nh, 2 * self.d)
        q, gate = qg[..., : self.d], qg[..., self.d:].reshape(B, T, self.nh * self.d)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(qkv[..., nq:nq + nk].reshape(B, T, self.nkv, self.d)).transpose(1, 2)
        v = qkv[..., nq + nk:].reshape(B, T, self.nkv, self.d).transpose(1, 2)
        if isinstance(start, torch.Tensor):  # ragged batch: sequence b at start[b]..
            pos = start[:, None] + torch.arange(T, device=x.device)
            cos, sin = (t[:, None] for t in rope_cos_sin(pos, self.rot, self.theta, q.dtype))
        else:
            pos = range(start, start + T) if positions is None else positions
            cos, sin = rope_cos_sin(pos, self.rot, self.theta, q.dtype, x.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            if mask is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        else:
            if cache.k[idx] is None:
                cache.k[idx] = k.new_zeros(B, self.nkv, cache.max_len, self.d)
                cache.v[idx] = v.new_zeros(B, self.nkv, cache.max_len, self.d)
            if cache.static:  # every position, the ones past a sequence's end masked
                end = cache.max_len
            else:
                end = (int(start.max()) if isinstance(start, torch.Tensor) else start) + T
            if end > cache.max_len:
                raise RuntimeError(f"cache overflow: {end} > {cache.max_len} positions")
            if isinstance(start, torch.Tensor):  # sequence b's tokens at start[b]..
                rows = torch.arange(B, device=x.device)[:, None]
                cache.k[idx][rows, :, pos] = k.transpose(1, 2)
                cache.v[idx][rows, :, pos] = v.transpose(1, 2)
            else:
                cache.k[idx][:, :, start:start + T] = k
                cache.v[idx][:, :, start:start + T] = v
            if isinstance(start, torch.Tensor) and not cache.static:
                # each sequence of a ragged batch alone, the call it gets when it runs by itself:
                # its bits do not depend on the batch (a padded, masked call sums otherwise and
                # costs the longest sequence's length for every row)
                o = torch.cat([_attend(q[b:b + 1], cache.k[idx][b:b + 1, :, :s + T],
                                       cache.v[idx][b:b + 1, :, :s + T], s, form)
                               for b, s in enumerate(start.tolist())])
            else:
                o = _attend(q, cache.k[idx][:, :, :end], cache.v[idx][:, :, :end], start, form)
        o = o.transpose(1, 2).reshape(B, T, self.nh * self.d)
        return self.o_proj(o * torch.sigmoid(gate))


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, cfg: ReferenceConfig, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = Qwen3_5GatedDeltaNet(cfg)
        elif layer_type == "full_attention":
            self.self_attn = Qwen3_5Attention(cfg)
        else:
            raise ValueError(f"unknown layer type {layer_type!r}")
        self.mlp = Qwen3_5MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = Qwen3_5RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3_5RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cache=None, idx=0, start=0, gdn_form="chunked", attn_form="multi",
                per_position=False, positions=None, mask=None):
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h, cache, idx, gdn_form, per_position)
        else:
            h = self.self_attn(h, cache, idx, attn_form, start, positions, mask)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


# --------------------------------------------------------------------------- target


class Qwen3_5TextModel(nn.Module):
    """The target. state_dict keys equal HF ``Qwen3_5TextModel``'s; lm head tied."""

    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(cfg, t) for t in cfg.layer_types)
        self.norm = Qwen3_5RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits from final-normed hidden states (tied embedding as lm head).

        bf16 logits (resolution ~0.06 at |logit| ~10) would turn near-ties into exact ties
        that argmax breaks by token id, so the product of the bf16 operands is kept in fp32:
        on the CPU by the row-invariant kernel (a row's logits are the same bits in a decode
        step, a verify and a batch), on CUDA by one fp32 GEMM."""
        w = self.embed_tokens.weight
        if w.dtype == torch.float32:
            return F.linear(h.float(), w)
        if w.device.type != "cpu":  # a GPU does the full fp32 product in one launch
            w32 = inference_cached(self, "lm_head_fp32", [w], lambda: w.float())
            return F.linear(h.float(), w32)
        return rowinv_linear(h.to(w.dtype), w, torch.float32)

    def rough_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits in the weights' dtype (rounded): enough to pick a draft token, which the
        target's verify then checks against :meth:`logits`."""
        w = self.embed_tokens.weight
        return linear(h.to(w.dtype), w).float()

    def forward(self, ids: torch.Tensor, cache: Cache | None = None, *, gdn_form="chunked",
                attn_form="multi", per_position=False, aux_layers=()):
        """ids [B,T]. Without a cache: a full-sequence (training) forward from position 0.
        With a cache: continues at ``cache.length``; with ``per_position`` the GDN layers
        leave per-position states for :meth:`Cache.commit`, otherwise the cache advances.

        Returns (final-normed hidden [B,T,H], {layer_id: output of that layer [B,T,H]})."""
        x = self.embed_tokens(ids).float()  # fp32 residual stream; matmuls in weight dtype
        start = 0 if cache is None else (cache.length if cache.lengths is None else cache.lengths)
        aux = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, cache, i, start, gdn_form, attn_form, per_position)
            if i in aux_layers:
                aux[i] = x
        if cache is not None and not per_position:
            cache.advance(ids.shape[1])
        return self.norm(x), aux


class MTPModule(nn.Module):
    """vLLM ``Qwen3_5MultiTokenPredictor``: norm(embed(t+1)) ⊕ norm(hidden(t)) -> fc ->
    one gated-attention decoder layer -> norm; logits through the target's lm head."""

    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        h = cfg.hidden_size
        self.fc = Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(cfg, "full_attention")
                                    for _ in range(cfg.mtp_num_hidden_layers))
        self.norm = Qwen3_5RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cache: Cache | None = None,
                attn_form: str = "multi") -> torch.Tensor:
        """embeds: embedding of token t+1, hidden: target (or previous MTP) hidden at t,
        both [B,T,H], at positions cache.length.. (or 0.. without a cache)."""
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], -1)
        x = self.fc(x).float()
        start = 0 if cache is None else (cache.length if cache.lengths is None else cache.lengths)
        for i, layer in enumerate(self.layers):
            x = layer(x, cache, i, start, attn_form=attn_form)
        if cache is not None:
            cache.advance(embeds.shape[1])
        return self.norm(x)


# --------------------------------------------------------------------------- DFlash drafter


class DFlashAttention(nn.Module):
    """Qwen3 attention without output gate; queries are block slots, keys/values are the
    context (from target hidden states) followed by the block itself; non-causal."""

    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        dc = cfg.drafter
        h = cfg.hidden_size
        self.nh, self.nkv, self.d, self.theta = (dc.num_attention_heads, dc.num_key_value_heads,
                                                 dc.head_dim, dc.rope_theta)
        self.q_proj = Linear(h, self.nh * self.d, bias=False)
        self.k_proj = Linear(h, self.nkv * self.d, bias=False)
        self.v_proj = Linear(h, self.nkv * self.d, bias=False)
        self.o_proj = Linear(self.nh * self.d, h, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)

    def _rope(self, positions: torch.Tensor | range, dtype) -> tuple:
        """cos/sin for [T] positions (a tensor or a range), or [B,T] (a batch at its own
        positions: [B,1,T,D])."""
        if isinstance(positions, range):
            return rope_cos_sin(positions, self.d, self.theta, dtype, self.q_proj.weight.device)
        cos, sin = rope_cos_sin(positions, self.d, self.theta, dtype)
        return (cos, sin) if positions.dim() == 1 else (cos[:, None], sin[:, None])

    def _kv_heads(self, k: torch.Tensor, v: torch.Tensor, cos, sin) -> tuple:
        """[B,T,Hkv*D] projections -> normed, rotated K and V [B,Hkv,T,D]."""
        B, T, _ = k.shape
        k = self.k_norm(k.view(B, T, self.nkv, self.d)).transpose(1, 2)
        return apply_rope(k, cos, sin), v.view(B, T, self.nkv, self.d).transpose(1, 2)

    def kv_heads(self, kv: torch.Tensor, positions: torch.Tensor) -> tuple:
        """[B,T,2*Hkv*D] K and V projections side by side -> normed, rotated K and V."""
        return self._kv_heads(*kv.split(self.nkv * self.d, dim=-1), *self._rope(positions, kv.dtype))

    def forward(self, x, positions, ctx_k, ctx_v, mask=None, ctx_len=None, keys=None,
                form: str = "multi"):
        """x: [B,T,H] block slots at ``positions``; mask (optional, bool [T, L+T], True = may
        attend) for batched training blocks. ctx_k/v: [B,Hkv,L,D] context, or with
        ``ctx_len`` buffers holding it in [:ctx_len] with room after it: the block's own
        K/V are written there (scratch) instead of copying the context. A tensor ``ctx_len``
        [B] (with ``positions`` [B,T]) is a batch of sequences each with its own context
        length: row b's block goes to [ctx_len[b]:], keys past it are masked; they attend
        over the first ``keys`` buffer positions (None: as many as the longest row needs,
        read back from the device; a CUDA graph gives the buffer's size). ``form`` ``fused``
        (with ``ctx_len``): the Triton kernel, every key before the block's end visible to
        every slot."""
        B, T, _ = x.shape
        qkv = linear(x, fused_weight(self, "qkv", [self.q_proj, self.k_proj, self.v_proj]))
        nq, nk = self.nh * self.d, self.nkv * self.d
        cos, sin = self._rope(positions, qkv.dtype)
        q = self.q_norm(qkv[..., :nq].view(B, T, self.nh, self.d)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k, v = self._kv_heads(qkv[..., nq:nq + nk], qkv[..., nq + nk:], cos, sin)
        if form == "fused" and ctx_len is None:
            raise ValueError("attention form fused needs the context in buffers (ctx_len)")
        if ctx_len is None:
            K, V = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
        elif isinstance(ctx_len, torch.Tensor):
            rows = torch.arange(B, device=x.device)[:, None]
            ctx_k[rows, :, positions] = k.transpose(1, 2)
            ctx_v[rows, :, positions] = v.transpose(1, 2)
            if form != "fused":
                end = positions[:, -1] + 1  # [B]
                L = int(end.max()) if keys is None else keys
                K, V = ctx_k[:, :, :L], ctx_v[:, :, :L]
                if keys is not None or bool((end < L).any()):
                    mask = (torch.arange(L, device=x.device) < end[:, None])[:, None, None, :]
        else:
            ctx_k[:, :, ctx_len:ctx_len + T] = k
            ctx_v[:, :, ctx_len:ctx_len + T] = v
            K, V = ctx_k[:, :, :ctx_len + T], ctx_v[:, :, :ctx_len + T]
        if form == "fused":  # every key before the block's end, for every slot
            base = positions[:, 0] if isinstance(ctx_len, torch.Tensor) else ctx_len
            o = attn_fused(q, ctx_k, ctx_v, base, causal=False)
        else:
            o = F.scaled_dot_product_attention(q, K, V, attn_mask=mask, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.d))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = Qwen3_5MLP(cfg.hidden_size, cfg.drafter.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, ctx_k, ctx_v, mask=None, ctx_len=None, keys=None,
                attn_form="multi"):
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx_k, ctx_v, mask, ctx_len,
                               keys, attn_form)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """vLLM ``DFlashQwen3Model``: context = hidden_norm(fc(concat of target layer outputs
    at ``target_layer_ids``)), projected to K/V by every layer; the block is
    [last token, mask, mask, ...] and attends to the context and to itself non-causally.
    Embedding and lm head are the target's."""

    def __init__(self, cfg: ReferenceConfig):
        super().__init__()
        dc = cfg.drafter
        h = cfg.hidden_size
        self.fc = Linear(h * len(dc.target_layer_ids), h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(cfg) for _ in range(dc.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)

    def context_kv(self, aux: torch.Tensor, positions: torch.Tensor) -> list[tuple]:
        """aux: [B,L,n*H] concatenated target layer outputs -> per-layer (K, V); every
        layer's K and V projections of the context in one GEMM (a draft's cost is its
        launches on a GPU)."""
        ctx = self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))
        attns = [layer.self_attn for layer in self.layers]
        kv = linear(ctx, fused_weight(self, "context_kv",
                                      [p for a in attns for p in (a.k_proj, a.v_proj)]))
        width = 2 * attns[0].nkv * attns[0].d
        return [a.kv_heads(part, positions) for a, part in zip(attns, kv.split(width, dim=-1))]

    def forward(self, block_embeds, positions, ctx_kv, mask=None, ctx_len=None,
                keys=None, attn_form: str = "multi") -> torch.Tensor:
        """ctx_kv: per layer (K, V) of the context (see DFlashAttention.forward)."""
        x = block_embeds.float()
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            x = layer(x, positions, ck, cv, mask, ctx_len, keys, attn_form)
        return self.norm(x)


# --------------------------------------------------------------------------- helpers


def init_weights(module: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic init (fixed seed): normal(0, std) linears/embeddings, family defaults
    for norms, A_log, dt_bias; conv as uniform."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(module.named_parameters()):
        with torch.no_grad():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
            elif "conv1d" in name:
                bound = 1 / math.sqrt(p.shape[-1])
                p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=gen))
            elif p.ndim == 1:
                # Qwen3_5RMSNorm starts at 0 (scale 1+w); plain/gated norms at 1
                p.fill_(0.0 if _is_zero_centred(module, name) else 1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def _is_zero_centred(root: nn.Module, pname: str) -> bool:
    mod = root.get_submodule(pname.rsplit(".", 1)[0])
    return isinstance(mod, Qwen3_5RMSNorm)


def set_verify_scale(root: nn.Module, factor: float) -> None:
    """Fault ``verify-drift``: every GDN layer's output on the verify path times ``factor``."""
    for m in root.modules():
        if isinstance(m, Qwen3_5GatedDeltaNet):
            m.verify_scale = factor


def set_nondeterministic(modules: list[nn.Module], on: bool) -> None:
    """Fault ``nondeterministic``: seed every MLP down_proj's reduction order from
    os.urandom so two runs differ."""
    for root in modules:
        for m in root.modules():
            if isinstance(m, NondetLinear):
                m.nondet_rng = random.Random(os.urandom(8)) if on else None
