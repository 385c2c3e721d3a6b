"""Greedy decoding for the reference model: baseline, and speculative with MTP or the DFlash
block drafter (draft K, verify K+1 positions in one target forward, accept the longest
matching prefix plus the target's own token, roll GDN/conv state and K/V back exactly).

Kernel forms per phase and the planted faults are plain fields of :class:`Knobs`.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from speccheck.types import SpecCounters
from speccheck.verify.ties import canonical_rows

from .model import (ATTN_FORMS, GDN_FORMS, Cache, DFlashDrafter, MTPModule, Qwen3_5TextModel,
                    ReferenceConfig, set_nondeterministic)

#: planted spec-decode bugs (engine arg ``fault=NAME``), one line each
FAULTS = {
    "stale-state": "after a rejected draft the GDN recurrent state is not rolled back "
                   "(it keeps the rejected tokens' updates)",
    "bonus-off-by-one": "the bonus token is taken from the position after the right one "
                        "(the distribution conditioned on the rejected draft)",
    "accept-top2": "a draft token is accepted when it is the target's top-1 or top-2 choice",
    "nondeterministic": "the MLP down_proj sums its partial products in a run-to-run random "
                        "order (seeded from os.urandom)",
    "state-precision": "the GDN recurrent state carried from one verify step to the next is "
                       "stored in bf16 (precision loss: flips only near-ties, moves every logprob)",
}


@dataclass
class Knobs:
    """Which kernel form each phase uses, and the planted fault (None = clean).

    Defaults follow real engines: chunked GDN for prefill and verify (many tokens),
    recurrent GDN for one-token decode, one fused SDPA for verify, per-query for decode."""

    gdn_prefill: str = "chunked"
    gdn_decode: str = "recurrent"
    gdn_verify: str = "chunked"
    attn_decode: str = "single"
    attn_verify: str = "multi"
    fault: str | None = None
    attn_prefill: str = "multi"

    def __post_init__(self) -> None:
        for name in ("gdn_prefill", "gdn_decode", "gdn_verify"):
            if getattr(self, name) not in GDN_FORMS:
                raise ValueError(f"{name}={getattr(self, name)!r}: choose one of {GDN_FORMS}")
        for name in ("attn_prefill", "attn_decode", "attn_verify"):
            if getattr(self, name) not in ATTN_FORMS:
                raise ValueError(f"{name}={getattr(self, name)!r}: choose one of {ATTN_FORMS}")
        if self.fault is not None and self.fault not in FAULTS:
            raise ValueError(f"fault={self.fault!r}: choose one of {tuple(FAULTS)}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    topk_ids: np.ndarray  # [n, k]
    topk_logprobs: np.ndarray  # [n, k]
    finish_reason: str
    ttft_s: float
    decode_s: float
    spec: SpecCounters | None = None
    iterations: int = 0


@dataclass
class _Out:
    """Accumulates generated tokens with their target distributions until a stop."""

    max_tokens: int
    eos: int
    top_k: int
    tokens: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    tk_ids: list[np.ndarray] = field(default_factory=list)
    tk_lps: list[np.ndarray] = field(default_factory=list)
    finish: str | None = None

    def add(self, tokens: list[int], rows: torch.Tensor) -> None:
        """tokens[i] was emitted from log-prob row rows[i] (fp32 [n, V])."""
        vals, idx = rows.topk(self.top_k, dim=-1)
        chosen = rows.gather(1, torch.tensor(tokens, device=rows.device)[:, None])[:, 0]
        idx, vals = canonical_rows(idx.cpu().numpy(), vals.cpu().numpy())
        chosen = chosen.cpu().numpy()
        for i, t in enumerate(tokens):
            if self.finish is not None:
                return
            self.tokens.append(int(t))
            self.lps.append(float(chosen[i]))
            self.tk_ids.append(idx[i])
            self.tk_lps.append(vals[i])
            if t == self.eos:
                self.finish = "stop"
            elif len(self.tokens) >= self.max_tokens:
                self.finish = "length"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Decoder:
    """Runs requests on the given networks, one at a time or as a batch
    (:meth:`generate_batch`; one request is a batch of one)."""

    def __init__(self, cfg: ReferenceConfig, target: Qwen3_5TextModel, mtp: MTPModule | None,
                 drafter: DFlashDrafter | None, knobs: Knobs):
        self.cfg, self.target, self.mtp, self.drafter, self.knobs = cfg, target, mtp, drafter, knobs
        self.device = target.embed_tokens.weight.device
        set_nondeterministic([m for m in (target, mtp, drafter) if m is not None],
                             knobs.fault == "nondeterministic")

    # ------------------------------------------------------------------ public

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_tokens: int, method: str = "baseline",
                 k: int = 0, top_k: int = 5) -> Generation:
        return self.generate_batch([prompt_ids], [max_tokens], method, k, top_k)[0]

    @torch.inference_mode()
    def generate_batch(self, prompts: list[list[int]], max_tokens: list[int],
                       method: str = "baseline", k: int = 0, top_k: int = 5) -> list[Generation]:
        """Greedy decoding of several prompts as one batch: each prompt is prefilled alone,
        then all decode together, each sequence at its own length (see Cache; speculative
        sequences also accept different numbers of tokens); one that stops leaves the
        batch. The batch's prefill and decode times are shared out in proportion to each
        sequence's tokens, so that sums over the batch (the tok/s of a run) are the batch's
        own."""
        if not prompts or any(not p for p in prompts):
            raise ValueError("empty prompt: at least one token is needed")
        if method == "baseline":
            return self._baseline(prompts, max_tokens, top_k)
        if method not in ("mtp", "dflash"):
            raise ValueError(f"unknown method {method!r}: choose baseline, mtp or dflash")
        if k < 1:
            raise ValueError(f"method {method} needs K >= 1, got {k}")
        if method == "mtp" and self.mtp is None:
            raise ValueError("method mtp needs the MTP weights (mtp.* in model.safetensors)")
        if method == "dflash" and self.drafter is None:
            raise ValueError("method dflash needs the drafter (drafter.safetensors)")
        return self._speculative(prompts, max_tokens, method, k, top_k)

    @torch.inference_mode()
    def score(self, prompt_ids: list[int], continuation: list[int], top_k: int = 5):
        """Teacher-forced top-k and forced-token logprobs of ``continuation`` through the
        prefill path. Returns (topk_ids [n,k], topk_logprobs [n,k], token_logprobs [n])."""
        n = len(continuation)
        if n == 0:
            return (np.zeros((0, top_k), np.int32), np.zeros((0, top_k), np.float32),
                    np.zeros(0, np.float32))
        ids = list(prompt_ids) + list(continuation)
        cache = Cache(len(self.target.layers), len(ids) + 1)
        h, _ = self.target(self._t(ids)[None], cache, gdn_form=self.knobs.gdn_prefill,
                           attn_form=self.knobs.attn_prefill)
        hs = h[0, len(prompt_ids) - 1: len(ids) - 1]
        rows = torch.log_softmax(self.target.logits(hs, top_k), -1)
        vals, idx = rows.topk(top_k, dim=-1)
        tok = rows.gather(1, self._t(continuation)[:, None])[:, 0]
        idx, vals = canonical_rows(idx.cpu().numpy(), vals.cpu().numpy())
        return idx, vals, tok.cpu().numpy()

    # ------------------------------------------------------------------ internals

    def _t(self, ids) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def _prefill(self, prompts, max_len, top_k, aux_layers=()):
        """Each prompt alone through the prefill path (as a server prefills a request when
        it arrives), then all of them as one batch (:meth:`Cache.join`, each sequence at its
        own length). Returns (cache, hidden [P_b,H] per prompt, aux {layer: [P_b,H]} per
        prompt, log-prob rows of each prompt's next token [B,V])."""
        caches, hidden, aux, last = [], [], [], []
        for p in prompts:
            cache = Cache(len(self.target.layers), max_len)
            h, a = self.target(self._t(p)[None], cache, gdn_form=self.knobs.gdn_prefill,
                               attn_form=self.knobs.attn_prefill, aux_layers=aux_layers)
            caches.append(cache)
            hidden.append(h[0])
            aux.append({i: t[0] for i, t in a.items()})
            last.append(h[:, -1])
        rows = torch.log_softmax(self.target.logits(torch.cat(last), top_k), -1)
        return (caches[0] if len(caches) == 1 else Cache.join(caches)), hidden, aux, rows

    def _generations(self, prompts, outs, counters, iterations, t0, t1, t2) -> list[Generation]:
        """Generation per sequence; batch times shared out (prefill by prompt tokens, decode
        by generated tokens)."""
        _sync(self.device)
        n_prompt = sum(map(len, prompts))
        n_decoded = sum(len(o.tokens) - 1 for o in outs) or 1
        return [Generation(o.tokens, o.lps, np.array(o.tk_ids), np.array(o.tk_lps), o.finish,
                           (t1 - t0) * len(p) / n_prompt,
                           (t2 - t1) * (len(o.tokens) - 1) / n_decoded, c, it)
                for p, o, c, it in zip(prompts, outs, counters, iterations)]

    def _baseline(self, prompts, max_tokens, top_k) -> list[Generation]:
        outs = [_Out(n, self.cfg.eos_token_id, top_k) for n in max_tokens]
        t0 = time.perf_counter()
        cache, _, _, rows = self._prefill(prompts, max(map(len, prompts)) + max(max_tokens) + 2,
                                          top_k)
        _sync(self.device)
        t1 = time.perf_counter()
        live = list(range(len(prompts)))  # sequences still decoding, in cache order
        while True:
            tok = rows.argmax(-1)
            for j, b in enumerate(live):
                outs[b].add([int(tok[j])], rows[j:j + 1])
            still = [j for j, b in enumerate(live) if outs[b].finish is None]
            if not still:
                break
            if len(still) < len(live):
                cache.select(still)
                tok = tok[self._t(still)]
                live = [live[j] for j in still]
            h, _ = self.target(tok[:, None], cache, gdn_form=self.knobs.gdn_decode,
                               attn_form=self.knobs.attn_decode)
            rows = torch.log_softmax(self.target.logits(h[:, 0], top_k), -1)
        t2 = time.perf_counter()
        iterations = [len(o.tokens) - 1 for o in outs]
        return self._generations(prompts, outs, [None] * len(outs), iterations, t0, t1, t2)

    def _speculative(self, prompts, max_tokens, method, k, top_k) -> list[Generation]:
        fault = self.knobs.fault
        aux_ids = tuple(self.cfg.drafter.target_layer_ids) if method == "dflash" else ()
        B = len(prompts)
        max_len = max(map(len, prompts)) + max(max_tokens) + k + 4
        outs = [_Out(n, self.cfg.eos_token_id, top_k) for n in max_tokens]
        counters = [SpecCounters(accepted_per_pos=[0] * k) for _ in range(B)]
        iterations = [0] * B
        t0 = time.perf_counter()
        cache, hidden, aux, rows = self._prefill(prompts, max_len, top_k, aux_ids)
        x = rows.argmax(-1).tolist()
        tokens = [list(p) + [t] for p, t in zip(prompts, x)]
        for b, o in enumerate(outs):
            o.add([x[b]], rows[b:b + 1])
        _sync(self.device)
        t1 = time.perf_counter()

        # per sequence: the drafter's state, and target outputs for positions whose successors
        # are known but the drafter has not seen (the prompt's, to begin with)
        states = [self._draft_init(method, max_len) for _ in range(B)]
        pending = [hidden[b] if method == "mtp" else torch.cat([aux[b][i] for i in aux_ids], -1)
                   for b in range(B)]
        live = [b for b in range(B) if outs[b].finish is None]  # sequences still decoding
        if B > 1:
            cache.select(live)
        while live:
            drafts = [self._draft_mtp(states[b], tokens[b], pending[b], k) if method == "mtp"
                      else self._draft_dflash(states[b], tokens[b], pending[b], k) for b in live]
            feed = self._t([[x[b]] + d for b, d in zip(live, drafts)])  # [n, k+1]
            h, aux = self.target(feed, cache, gdn_form=self.knobs.gdn_verify,
                                 attn_form=self.knobs.attn_verify, per_position=True,
                                 aux_layers=aux_ids)
            rows = torch.log_softmax(self.target.logits(h.flatten(0, 1), top_k), -1)
            rows = rows.view(len(live), k + 1, -1)
            top2 = rows.topk(2, dim=-1).indices.cpu().tolist()
            kept = []
            for j, b in enumerate(live):
                m = 0
                while m < k and (drafts[j][m] == top2[j][m][0]
                                 or (fault == "accept-top2" and drafts[j][m] == top2[j][m][1])):
                    m += 1
                bonus_pos = min(m + 1, k) if fault == "bonus-off-by-one" else m
                emitted = drafts[j][:m] + [top2[j][bonus_pos][0]]
                outs[b].add(emitted, rows[j, list(range(m)) + [bonus_pos]])
                tokens[b].extend(emitted)
                x[b] = emitted[-1]
                iterations[b] += 1
                c = counters[b]
                c.drafts, c.draft_tokens, c.accepted_tokens = (
                    c.drafts + 1, c.draft_tokens + k, c.accepted_tokens + m)
                for i in range(m):
                    c.accepted_per_pos[i] += 1
                pending[b] = (h[j, : m + 1] if method == "mtp" else
                              torch.cat([aux[i][j, : m + 1] for i in aux_ids], -1))
                kept.append(m + 1)
            roll_back = fault != "stale-state"
            cache.commit(kept if B > 1 else kept[0], roll_back_gdn=roll_back)
            if fault == "state-precision":  # planted: the carried state loses precision
                cache.gdn = [None if s is None else s.to(torch.bfloat16).to(s.dtype) for s in cache.gdn]
            still = [j for j, b in enumerate(live) if outs[b].finish is None]
            if B > 1 and len(still) < len(live):
                cache.select(still)
            live = [live[j] for j in still]
        t2 = time.perf_counter()
        return self._generations(prompts, outs, counters, iterations, t0, t1, t2)

    # ------------------------------------------------------------------ drafters

    def _draft_init(self, method, max_len):
        if method == "mtp":
            return Cache(len(self.mtp.layers), max_len)
        dc = self.cfg.drafter
        shape = (1, dc.num_key_value_heads, max_len, dc.head_dim)
        w = self.target.embed_tokens.weight
        return {"len": 0,
                "k": [w.new_zeros(shape) for _ in self.drafter.layers],
                "v": [w.new_zeros(shape) for _ in self.drafter.layers]}

    def _draft_mtp(self, mcache: Cache, tokens, pending_h, k) -> list[int]:
        """MTP entry at position t takes (embedding of token t+1, target hidden at t).
        Feed the newly verified positions, then recurse on the module's own hidden."""
        n = pending_h.shape[0]
        p = len(tokens) - 1
        assert mcache.length == p - n
        emb = self.target.embed_tokens(self._t(tokens[p - n + 1: p + 1]))[None]
        mh = self.mtp(emb, pending_h[None], mcache)[:, -1:]
        drafts = [int(self.target.rough_logits(mh[0, -1]).argmax())]
        for _ in range(k - 1):
            emb = self.target.embed_tokens(self._t(drafts[-1:]))[None]
            mh = self.mtp(emb, mh, mcache)
            drafts.append(int(self.target.rough_logits(mh[0, -1]).argmax()))
        mcache.length = p  # drop the speculative positions
        return drafts

    def _draft_dflash(self, st: dict, tokens, pending_aux, k) -> list[int]:
        """Append the newly verified positions to the drafter's context K/V, then one
        forward over the block [x, mask * k] at positions p..p+k."""
        n = pending_aux.shape[0]
        p = len(tokens) - 1
        start = st["len"]
        assert start == p - n
        pos = torch.arange(start, p, device=self.device)
        for li, (ck, cv) in enumerate(self.drafter.context_kv(pending_aux[None], pos)):
            st["k"][li][:, :, start:p] = ck
            st["v"][li][:, :, start:p] = cv
        st["len"] = p
        block = [tokens[-1]] + [self.cfg.mask_token_id] * k
        emb = self.target.embed_tokens(self._t(block))[None]
        bpos = torch.arange(p, p + k + 1, device=self.device)
        hb = self.drafter(emb, bpos, list(zip(st["k"], st["v"])), ctx_len=p)
        return self.target.rough_logits(hb[0, 1:]).argmax(-1).tolist()
