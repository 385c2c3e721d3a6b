"""DFlash2 for the reference engine: the DFlash block drafter plus a local dynamic convolution
around every sublayer and a candidate selector (see vLLM 0.28+'s
``qwen3_dflash2.py``, whose module and parameter names and shapes these follow, so the state
dict exports by renaming nothing).

- Body: :class:`~.model.DFlashDrafter`'s (``fc``, ``hidden_norm``, ``layers.N.*``, ``norm``),
  same shapes, so it starts from the shipped DFlash drafter.
- ``layers.N.attention_conv`` / ``layers.N.mlp_conv``: a two-tap grouped depthwise convolution
  along the block applied to the sublayer's input (side 0) and to its output (side 1); the
  per-position kernel is ``base_kernel[side] + δ`` with δ = ``kernel_projection`` of the
  sublayer's (normed) input, one value per tap and channel group. Block position i sees
  i - 1 only inside its own block. Identity at init (base tap 0 = 1, everything else 0).
- ``candidate_selector``: unary scores = the target's LM head on each slot's hidden state; the
  top-K per slot are candidates; the edge score from the previous slot's candidate p to this
  slot's candidate c is ``unary[c] + <A[p] * P h, B[c]>``; the walk starts at the anchor token
  and takes the argmax at each step (ties: lowest candidate index). Zero ``hidden_projection``
  (its init) makes the walk the per-slot argmax, i.e. DFlash.

The selector's knobs (:class:`SelectorKnobs`) change drafts only; at temperature 0 they can
change the output only through which positions the verify forward computes.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .kernels.cpu import compiled, dflash2_select, grouped_conv, linear
from .kernels.dflash2_fused import dflash2_select_fused
from .kernels.dflash2_fused import unavailable as fused_unavailable
from .model import DFlashDecoderLayer, DFlashDrafter, ReferenceConfig

#: the DFlash2 drafter's weights file in a weights directory (config in its metadata)
DFLASH2_FILE = "dflash2.safetensors"
WALK_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class DFlash2Config:
    """The fields DFlash2 adds to ``dflash_config`` (the body's shape is ``cfg.drafter``).
    ``selector_rank`` is 128 here, not the released 256, to keep the shipped weights small."""

    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 128
    selector_top_k: int = 16

    @classmethod
    def from_dict(cls, d: dict) -> "DFlash2Config":
        known = {f.name for f in fields(cls)}
        bad = set(d) - known
        if bad:
            raise ValueError(f"dflash2 config: unknown fields {sorted(bad)}; known: {sorted(known)}")
        return cls(**d)


@dataclass
class SelectorKnobs:
    """Attribution knobs (engine args ``dflash2_selector``, ``dflash2_top_k``, ``dflash2_walk``):
    selector off = per-slot argmax (DFlash's rule); ``top_k`` candidates per slot (None = the
    checkpoint's ``selector_top_k``); edge scores computed and walked in fp32 or bf16 (bf16
    rounds near-ties into exact ties, which the walk breaks by the lower candidate index)."""

    selector: bool = True
    top_k: int | None = None
    walk: str = "fp32"

    def __post_init__(self) -> None:
        if self.walk not in WALK_DTYPES:
            raise ValueError(f"dflash2 walk={self.walk!r}: choose one of {tuple(WALK_DTYPES)}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"dflash2 top_k={self.top_k}: give a positive integer")

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- local convolution


def block_slots(n: int, block_size: int, device) -> torch.Tensor:
    """Position of each of ``n`` consecutive tokens inside its block (blocks laid end to end)."""
    return torch.arange(n, device=device) % block_size


def block_reach(slot: torch.Tensor, taps: int) -> torch.Tensor:
    """0 / 1 (uint8) [taps, T]: may the token reach t back (slot >= t, inside its own block)?
    Made once per drafter forward for all its convolutions; a product with it is the product
    with 0.0 / 1.0 in the other operand's dtype."""
    return (slot[None] >= torch.arange(taps, device=slot.device)[:, None]).to(torch.uint8)


class DFlashGroupedConv(nn.Module):
    """vLLM ``DFlashGroupedConv``: ``base_kernel`` [2, taps, H] (side 0 = before the sublayer,
    side 1 = after it), ``kernel_projection`` H -> 2 * taps * groups (the per-position δ)."""

    def __init__(self, hidden: int, taps: int, group_size: int):
        super().__init__()
        if hidden % group_size:
            raise ValueError(f"conv_group_size={group_size} must divide hidden_size={hidden}")
        self.taps, self.group_size, self.groups = taps, group_size, hidden // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)
        self.reset_identity()

    def reset_identity(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def _convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int,
                  reach: torch.Tensor) -> torch.Tensor:
        """x [B,T,H], delta [B,T,2,taps,G] (both sides): out[i] = Σ_t (base[t] + δ[i,t]) x[i - t],
        taps that would reach before the block's first slot dropped (``reach``:
        :func:`block_reach`). On the CPU one C call with these ops' bits
        (kernels.cpu.grouped_conv: 8 of them are a tenth of a DFlash2 draft as ops)."""
        out = grouped_conv(x, self.base_kernel[side], delta, side, reach, self.groups)
        if out is not None:
            return out
        blocks = x.unflatten(-1, (self.groups, self.group_size))
        coef = self.base_kernel[side].view(1, 1, self.taps, self.groups, self.group_size) \
            + delta[:, :, side].unsqueeze(-1)
        out = coef[:, :, 0] * blocks
        for t in range(1, self.taps):
            shifted = F.pad(blocks[:, :-t], (0, 0, 0, 0, t, 0))
            out = out + coef[:, :, t] * shifted * reach[t].view(1, -1, 1, 1)
        return out.flatten(-2)

    def prepare(self, x: torch.Tensor, reach: torch.Tensor) -> tuple:
        """Side 0 applied to the sublayer input; returns it and δ (side 1's for :meth:`finish`)."""
        B, T, _ = x.shape
        delta = linear(x, self.kernel_projection.weight).view(B, T, 2, self.taps, self.groups)
        return self._convolve(x, delta, 0, reach), delta

    def finish(self, y: torch.Tensor, delta: torch.Tensor, reach: torch.Tensor) -> torch.Tensor:
        return self._convolve(y, delta, 1, reach)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    def __init__(self, cfg: ReferenceConfig, d2: DFlash2Config):
        super().__init__(cfg)
        args = (cfg.hidden_size, d2.conv_kernel_size, d2.conv_group_size)
        self.attention_conv = DFlashGroupedConv(*args)
        self.mlp_conv = DFlashGroupedConv(*args)

    def forward(self, x, positions, ctx_k, ctx_v, mask=None, ctx_len=None, reach=None, keys=None,
                attn_form="multi"):
        h, delta = self.attention_conv.prepare(self.input_layernorm(x), reach)
        h = self.self_attn(h, positions, ctx_k, ctx_v, mask, ctx_len, keys, attn_form)
        x = x + self.attention_conv.finish(h, delta, reach)
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x), reach)
        return x + self.mlp_conv.finish(self.mlp(h), delta, reach)


# --------------------------------------------------------------------------- candidate selector


class CandidateSelector(nn.Module):
    """vLLM ``CandidateSelector``: predecessor / successor codebooks [V, rank] and
    ``hidden_projection`` H -> rank."""

    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def project(self, hidden: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """P h: the slots' hidden states [N, L, H] through ``hidden_projection``, in ``dtype``."""
        return linear(hidden.to(dtype), self.hidden_projection.weight.to(dtype))

    def edge_scores(self, cand: torch.Tensor, unary: torch.Tensor, hidden: torch.Tensor,
                    anchor: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """cand / unary [N, L, K] (candidate ids and their LM-head scores), hidden [N, L, H]
        (the slots' draft hidden states), anchor [N] (the verified token before slot 0)
        -> scores [N, L, K_prev, K]: slot l's candidate c after slot l-1's candidate p (the
        anchor for l = 0), ``unary[c] + Σ_r A[p, r] (P h_l)_r B[c, r]``, in ``dtype``."""
        N, L, K = cand.shape
        h = self.project(hidden, dtype)  # [N, L, r]
        prev = torch.cat([anchor[:, None, None].expand(N, 1, K), cand[:, :-1]], 1)
        pred = self.predecessor_codebook[prev].to(dtype)  # [N, L, K, r] (gathered, then cast:
        succ = self.successor_codebook[cand].to(dtype)  # the same values, not the whole book)
        edge = torch.einsum("nlpr,nlcr->nlpc", pred * h[:, :, None], succ)
        return unary.to(dtype)[:, :, None] + edge


def walk(scores: torch.Tensor) -> torch.Tensor:
    """Greedy path through [N, L, K, K] edge scores from the anchor: at slot l take the argmax
    of scores[l, previous choice] (slot 0 reads row 0: every row there is the anchor's);
    ties go to the lowest candidate index (torch.argmax returns the first maximum).
    Returns candidate indices [N, L]."""
    N, L, K, _ = scores.shape
    rows = torch.arange(N, device=scores.device)
    prev = torch.zeros(N, dtype=torch.long, device=scores.device)
    path = []
    for l in range(L):
        prev = scores[rows, l, prev].argmax(-1)
        path.append(prev)
    return torch.stack(path, 1)


def candidates(unary_full: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of [..., V] scores as (ids, values), equal scores ordered by token id: the first
    k of a stable descending sort. torch.topk leaves ties in an unspecified order, so it runs
    on one int64 key per score, the score's bits made order-preserving above the token id
    inverted; that key has no ties, and is 20x cheaper than sorting the vocabulary (the
    sort was half of a DFlash2 draft on the CPU). Scores must not be NaN."""
    V = unary_full.shape[-1]
    shift = max(1, (V - 1).bit_length())
    bits = (unary_full.float() + 0.0).view(torch.int32)  # + 0.0: -0.0 becomes +0.0
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negatives' magnitude bits flipped: int order
    key = (ordered.long() << shift) | torch.arange(V - 1, -1, -1, device=unary_full.device)
    ids = key.topk(k, dim=-1).indices
    return ids, unary_full.gather(-1, ids)


# --------------------------------------------------------------------------- drafter


class DFlash2Drafter(DFlashDrafter):
    """vLLM ``DFlash2Qwen3Model`` (without the target's embedding / LM head): DFlash's body with
    :class:`DFlash2DecoderLayer` layers, plus ``candidate_selector``."""

    def __init__(self, cfg: ReferenceConfig, d2: DFlash2Config | None = None):
        super().__init__(cfg)
        self.d2 = d2 = d2 or DFlash2Config()
        self.layers = nn.ModuleList(DFlash2DecoderLayer(cfg, d2)
                                    for _ in range(cfg.drafter.num_hidden_layers))
        self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size,
                                                    d2.selector_rank, d2.selector_top_k)

    def forward(self, block_embeds, positions, ctx_kv, mask=None, ctx_len=None,
                keys=None, block_size: int | None = None, attn_form: str = "multi") -> torch.Tensor:
        """As DFlashDrafter.forward; the T block tokens are blocks of ``block_size`` laid end
        to end (None: one block), which bounds the convolution's reach."""
        x = block_embeds.float()
        reach = block_reach(block_slots(x.shape[1], block_size or x.shape[1], x.device),
                            self.d2.conv_kernel_size)
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            x = layer(x, positions, ck, cv, mask, ctx_len, reach, keys, attn_form)
        return self.norm(x)


def init_from_dflash(d2: DFlash2Drafter, dflash: DFlashDrafter, seed: int = 0,
                     codebook_std: float = 0.3) -> None:
    """Body copied from a DFlash drafter, convolutions at identity, selector codebooks random
    with a zero ``hidden_projection``: the result drafts exactly as ``dflash`` does."""
    missing, unexpected = d2.load_state_dict(dflash.state_dict(), strict=False)
    assert not unexpected, unexpected
    assert all(".attention_conv." in m or ".mlp_conv." in m or m.startswith("candidate_selector.")
               for m in missing), missing
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in d2.layers:
            layer.attention_conv.reset_identity()
            layer.mlp_conv.reset_identity()
        sel = d2.candidate_selector
        for p in (sel.predecessor_codebook, sel.successor_codebook):
            p.copy_(torch.randn(p.shape, generator=gen) * codebook_std)
        sel.hidden_projection.weight.zero_()


def save_dflash2(d2: DFlash2Drafter, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().to(torch.bfloat16).cpu().contiguous()
               for k, v in d2.state_dict().items()}, str(path),
              metadata={"dflash2_config": json.dumps(asdict(d2.d2))})


def load_dflash2(path: Path, cfg: ReferenceConfig) -> DFlash2Drafter:
    """A DFlash2 drafter (fp32, CPU) from ``path``; its DFlash2 fields from the file's metadata."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    d2 = DFlash2Drafter(cfg, DFlash2Config.from_dict(json.loads(meta.get("dflash2_config", "{}"))))
    sd = {k: v.float() for k, v in load_file(str(path)).items()}
    missing, unexpected = d2.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match the DFlash2 drafter (missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]}); re-run the training "
                         f"script with --drafter dflash2")
    return d2


# --------------------------------------------------------------------------- drafting


def select_drafts(d2: DFlash2Drafter, target, hs: torch.Tensor, anchor: torch.Tensor,
                  knobs: SelectorKnobs, out: torch.Tensor | None = None,
                  perturb=None) -> torch.Tensor:
    """Draft tokens [N, L] from the slots' hidden states hs [N, L, H] after ``anchor`` [N]:
    the selector's walk, or (selector off) the per-slot argmax of the same LM-head scores.
    ``out`` (int64 [N, L]): where the GPU's fused selector may write them (a CUDA graph's
    buffer; one copy fewer), which it then returns. ``perturb``: applied to the LM-head
    scores first (the planted fault drafter-noise)."""
    unary_full = target.rough_logits(hs)  # [N, L, V] fp32 from the target's (bf16) LM head
    if perturb is not None:
        unary_full = perturb(unary_full)
    if not knobs.selector:
        return unary_full.argmax(-1)
    sel, k = d2.candidate_selector, knobs.top_k or d2.candidate_selector.top_k
    if knobs.walk == "fp32" and hs.is_cpu and not torch.is_grad_enabled() and compiled():
        # one C call for candidates, the row of edge scores the walk reads and the walk
        drafts = dflash2_select(unary_full, sel.project(hs), sel.predecessor_codebook,
                                sel.successor_codebook, anchor, k)
        if drafts is not None:
            return drafts
    if knobs.walk == "fp32" and not torch.is_grad_enabled() and fused_unavailable(hs.device) is None:
        # on a GPU: the same rule in two Triton launches instead of ~20 ops
        return dflash2_select_fused(unary_full, hs, sel.hidden_projection.weight,
                                    sel.predecessor_codebook, sel.successor_codebook, anchor, k,
                                    out=out)
    ids, vals = candidates(unary_full, k)
    scores = sel.edge_scores(ids, vals, hs, anchor, WALK_DTYPES[knobs.walk])
    return ids.gather(-1, walk(scores)[..., None])[..., 0]


def new_state(d2: DFlash2Drafter, cfg: ReferenceConfig, max_len: int, like: torch.Tensor) -> dict:
    """Per-sequence drafter state: context K/V buffers per layer and how much is filled."""
    shape = (1, cfg.drafter.num_key_value_heads, max_len, cfg.drafter.head_dim)
    return {"len": 0, "k": [like.new_zeros(shape) for _ in d2.layers],
            "v": [like.new_zeros(shape) for _ in d2.layers]}


def draft(d2: DFlash2Drafter, target, cfg: ReferenceConfig, st: dict, tokens: list[int],
          pending_aux: torch.Tensor, k: int, knobs: SelectorKnobs,
          attn_form: str = "multi", perturb=None) -> list[int]:
    """As decode's DFlash drafting (append the newly verified positions' context K/V, one
    forward over [x, mask * k] at p..p+k, the block being one conv block of k+1), then the
    selector picks the K tokens."""
    device = pending_aux.device
    n = pending_aux.shape[0]
    p = len(tokens) - 1
    start = st["len"]
    assert start == p - n
    pos = torch.arange(start, p, device=device)
    for li, (ck, cv) in enumerate(d2.context_kv(pending_aux[None], pos)):
        st["k"][li][:, :, start:p] = ck
        st["v"][li][:, :, start:p] = cv
    st["len"] = p
    block = torch.tensor([tokens[-1]] + [cfg.mask_token_id] * k, device=device)
    emb = target.embed_tokens(block)[None]
    hb = d2(emb, torch.arange(p, p + k + 1, device=device), list(zip(st["k"], st["v"])),
            ctx_len=p, attn_form=attn_form)
    return select_drafts(d2, target, hb[:, 1:], block[:1], knobs, perturb=perturb)[0].tolist()
