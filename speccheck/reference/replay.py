"""Acceptance replay: the acceptance a request should have had, from its own emitted tokens.

At temperature 0 a verify step that starts after emitted position p drafts K tokens from the
drafter's inputs (the target's hidden states or aux-layer features at the verified positions,
and the emitted tokens) and accepts the longest prefix of drafts equal to the next emitted
tokens; the next step starts after p + accepted + 1. So given the tokens, the drafter alone
fixes every step, and a replay that recomputes the drafter on its own predicts the engine's
spec counters (up to the drafter's numerics at near-ties).

This is deliberately not the Decoder's code: no decoder state, no drafter caches carried from
step to step, no batching, no CUDA graphs, no planted fault. The target runs once, teacher
forced over prompt + output through the prefill path (in two chunks, the prompt's shared by
every config's output of it); then every step's drafts are computed from that alone:

- MTP: the module over every position once (teacher forced: entry t takes the embedding of
  token t+1 and the target's hidden state at t; causal, so entry t is what a from-scratch pass
  over any longer prefix gives), then per step its own K-1 recursions on a private copy of the
  attention cache cut at the step's position (kept per position: a config of smaller K reads
  the first slots of the chain a larger K made there, which are the same computation);
- DFlash / DFlash2: the context K/V of every position once (a per-position projection), then
  per step one block forward [x, mask * K] over the context before it, by concatenation (the
  plain SDPA path), DFlash2's candidate selector walked here in torch.

Steps follow the Decoder's rules: the first token comes from the prefill; every step drafts K
(near max_tokens too: it counts all K drafts and every accepted one, even past the cut, judged
against the target's own continuation past the output's end); with ``no_draft_every`` N every
N-th step (drafting or not) carries no draft and emits one token; every step is an iteration.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import torch

from speccheck.types import Replay

from . import dflash2 as _dflash2
from .model import Cache, set_nondeterministic


def _margins(scores: torch.Tensor) -> list[float]:
    """Top-1 minus top-2 of each row of [L, V] scores (+inf for rows of one score)."""
    if scores.shape[-1] < 2:
        return [math.inf] * scores.shape[0]
    top = scores.float().topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


#: tokens of teacher-forced passes an engine keeps for the next config's replay (one pass per
#: prompt, continued once per distinct output; the least recently used go first)
MEMO_TOKENS = 32_768

#: positions past a sequence's end its caches hold room for (the continuation, MTP's
#: recursion): K at most (types.K_MAX), plus two
K_ROOM = 34


class _Forced:
    """The target teacher forced over one token sequence through the prefill path, the
    target's greedy continuation past its end (made on demand), and the drafters' per-position
    inputs computed from that once: what every step of a replay reads.

    ``base``: the pass over a prefix of ``ids`` (the prompt's), continued here over the rest:
    the prefill path in two chunks, so that every config's output of one prompt shares the
    prompt's pass. A base is never continued past its own end."""

    def __init__(self, engine, ids: list[int], base: _Forced | None = None):
        self.e, self.ids, self.base = engine, ids, base
        self.target, self.knobs = engine.target, engine.knobs
        self.device = self.target.embed_tokens.weight.device
        L, n0 = len(ids), len(base.ids) if base is not None else 0
        has_block = engine.drafter is not None or engine.dflash2 is not None
        self.layers = tuple(engine.cfg.drafter.target_layer_ids) if has_block else ()
        self.cache = (base.cache.copy(L + K_ROOM) if base is not None
                      else Cache(len(self.target.layers), L + K_ROOM))
        h, aux = self.target(self._t(ids[n0:])[None], self.cache, gdn_form=self.knobs.gdn_prefill,
                             attn_form=self.knobs.attn_prefill, aux_layers=self.layers)
        self.last_h = h[:, -1]
        # hidden [L, H]: what MTP reads (the final-normed hidden states); aux [L, n*H]: the block
        # drafters' features, target_layer_ids in order, in the weights' dtype (the drafter's
        # fc casts them so: the same values, a quarter of the memory)
        w = self.target.embed_tokens.weight
        self.hidden = h[0]
        self.aux = torch.cat([aux[i][0] for i in self.layers], -1).to(w.dtype) if self.layers else None
        if base is not None:
            self.hidden = torch.cat([base.hidden, self.hidden])
            self.aux = None if self.aux is None else torch.cat([base.aux, self.aux])
        self.extension: list[int] = []  # the target's greedy tokens past the end
        self.mtp = None  # (outputs [L-1, H], attention cache) of the MTP module, teacher forced
        self.ctx: dict[int, list] = {}  # id(drafter) -> per-layer context (K, V) of every position
        #: step position -> MTP's draft chain there: [drafts, margins, its attention cache, its
        #: last hidden state]; slot j depends on slots < j only, so a step at p drafting K
        #: reads the first K of the chain, made as long as the largest K asked for there
        self.chains: dict[int, list] = {}

    def _t(self, ids) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def token(self, pos: int) -> int:
        """The token at ``pos``: ``ids``, then the target's own greedy continuation."""
        L = len(self.ids)
        if pos < L:
            return self.ids[pos]
        while len(self.extension) <= pos - L:
            if self.extension:
                h, _ = self.target(self._t([[self.extension[-1]]]), self.cache,
                                   gdn_form=self.knobs.gdn_decode, attn_form=self.knobs.attn_decode)
                self.last_h = h[:, -1]
            self.extension.append(int(self.target.logits(self.last_h)[0].argmax()))
        return self.extension[pos - L]

    def mtp_pass(self) -> tuple:
        """The MTP module over every position once: entry t takes the embedding of token t+1
        and the target's hidden state at t (t = 0 .. L-2). Causal, so entry t and the
        attention K/V up to it are what a from-scratch pass over any prefix past t gives."""
        if self.mtp is None:
            mtp, L = self.e.mtp, len(self.ids)
            out, a = None, 0  # a: entries already made (the base's)
            if self.base is not None:
                out, cache = self.base.mtp_pass()
                a, cache = len(self.base.ids) - 1, cache.copy(L + K_ROOM)
            else:
                cache = Cache(len(mtp.layers), L + K_ROOM)
            if L - 1 > a:
                emb = self.target.embed_tokens(self._t(self.ids[a + 1:]))[None]
                new = mtp(emb, self.hidden[None, a: L - 1], cache)[0]
                out = new if out is None else torch.cat([out, new])
            self.mtp = (out, cache)
        return self.mtp

    def mtp_chain(self, p: int, k: int) -> tuple[list[int], list[float]]:
        """MTP's K drafts of a step after position ``p`` and its margin at each slot: entry p-1
        (token p, hidden state at p-1) drafts token p+1, then the module recurses on its own
        hidden state and draft, on a private copy of the attention cache cut at p."""
        mtp, target = self.e.mtp, self.target
        chain = self.chains.get(p)
        if chain is None:
            out, cache = self.mtp_pass()
            own = Cache(len(mtp.layers), cache.max_len)  # private: positions >= p are rewritten
            own.k = [None if t is None else t.clone() for t in cache.k]
            own.v = [None if t is None else t.clone() for t in cache.v]
            own.length = p
            mh = out[p - 1: p]
            logits = target.rough_logits(mh)
            chain = self.chains[p] = [[int(logits[0].argmax())], _margins(logits), own, mh]
        drafts, margins, own, mh = chain
        while len(drafts) < k:
            mh = mtp(target.embed_tokens(self._t([drafts[-1]]))[None], mh[None], own)[0]
            logits = target.rough_logits(mh)
            drafts.append(int(logits[0].argmax()))
            margins += _margins(logits)
            chain[3] = mh
        return drafts[:k], margins[:k]

    def context(self, net) -> list:
        """A block drafter's context K/V at every position (each position's alone)."""
        if id(net) not in self.ctx:
            n0 = len(self.base.ids) if self.base is not None else 0
            positions = torch.arange(n0, len(self.ids), device=self.device)
            kv = net.context_kv(self.aux[None, n0:], positions)
            if self.base is not None:
                kv = [(torch.cat([bk, k], 2), torch.cat([bv, v], 2))
                      for (bk, bv), (k, v) in zip(self.base.context(net), kv)]
            self.ctx[id(net)] = kv
        return self.ctx[id(net)]


def forced(engine, prompt: list[int], output: list[int]) -> _Forced:
    """The engine's teacher-forced pass over prompt + output, continuing its pass over the
    prompt; each from the engine's memo or made now (keyed by the tokens and the target's
    kernel forms: variants of one engine share the memo)."""
    memo = engine.__dict__.setdefault("_replay_memo", OrderedDict())
    k = engine.knobs
    forms = (k.gdn_prefill, k.attn_prefill, k.gdn_decode, k.attn_decode)

    def get(ids: tuple, make) -> _Forced:
        key = (ids, forms)
        if key in memo:
            memo.move_to_end(key)
            return memo[key]
        memo[key] = made = make()
        while sum(len(kk[0]) for kk in memo) > MEMO_TOKENS and len(memo) > 1:
            memo.popitem(last=False)
        return made

    # (a prompt's pass is keyed apart from a full sequence equal to it: it is never continued)
    base = get(("prompt",) + tuple(prompt), lambda: _Forced(engine, list(prompt)))
    return get(tuple(prompt) + tuple(output), lambda: _Forced(engine, list(prompt) + list(output), base))


class _Replayer:
    """One request's replay (see the module docstring)."""

    def __init__(self, engine, method: str, k: int, prompt: list[int], output: list[int]):
        self.e, self.method, self.k = engine, method, k
        self.cfg, self.target, self.knobs = engine.cfg, engine.target, engine.knobs
        self.P = len(prompt)
        self.f = forced(engine, list(prompt), list(output))
        self.ids = self.f.ids
        if method != "mtp":
            self.net = self.e.drafter if method == "dflash" else self.e.dflash2

    def _t(self, ids) -> torch.Tensor:
        return self.f._t(ids)

    # ------------------------------------------------------------------ drafters

    def draft(self, p: int) -> tuple[list[int], list[float]]:
        """The K drafts of a step after position ``p`` and the drafter's margin at each slot."""
        if self.method == "mtp":
            return self.f.mtp_chain(p, self.k)
        return self._draft_block(p)

    def _draft_block(self, p: int) -> tuple[list[int], list[float]]:
        k, net, target = self.k, self.net, self.target
        block = self._t([self.ids[p]] + [self.cfg.mask_token_id] * k)
        ctx = [(ck[:, :, :p], cv[:, :, :p]) for ck, cv in self.f.context(net)]
        hb = net(target.embed_tokens(block)[None], range(p, p + k + 1), ctx)[0, 1:]  # [K, H]
        unary = target.rough_logits(hb)  # [K, V]
        if self.method == "dflash" or not self.e.selector.selector:
            return unary.argmax(-1).tolist(), _margins(unary)
        return self._walk(hb, unary, block[:1])

    def _walk(self, hb, unary, anchor) -> tuple[list[int], list[float]]:
        """DFlash2's selector: top-k candidates per slot, edge scores from the previous slot's
        choice (the anchor's for slot 0), the greedy walk (ties: the lower candidate index)."""
        sel = self.net.candidate_selector
        top_k = self.e.selector.top_k or sel.top_k
        ids, vals = _dflash2.candidates(unary[None], top_k)
        scores = sel.edge_scores(ids, vals, hb[None], anchor,
                                 _dflash2.WALK_DTYPES[self.e.selector.walk])[0]  # [K, Kc, Kc]
        drafts, margins, prev = [], [], 0
        for slot in range(self.k):
            row = scores[slot, prev]
            prev = int(row.argmax())
            drafts.append(int(ids[0, slot, prev]))
            margins += _margins(row[None])
        return drafts, margins

    # ------------------------------------------------------------------ the steps

    def run(self, n: int) -> Replay:
        """Every step of a request whose output is the first ``n`` emitted tokens."""
        k, every = self.k, self.knobs.no_draft_every
        accepted, margins, weakest = [], [], []
        emitted, step = 1, 0  # the first token came from the prefill
        while emitted < n:
            step += 1
            if every and step % every == 0:
                accepted.append(-1)
                margins.append(math.nan)
                weakest.append(math.nan)
                emitted += 1
                continue
            p = self.P + emitted - 1  # the step's last emitted token, fed with the drafts
            drafts, slot = self.draft(p)
            m = 0
            while m < k and drafts[m] == self.f.token(p + 1 + m):
                m += 1
            accepted.append(m)
            margins.append(slot[m] if m < k else math.inf)
            weakest.append(min(slot[: m + 1]))
            emitted += m + 1
        return Replay(k, accepted, margins, weakest)


@torch.inference_mode()
def replay_acceptance(engine, method: str, k: int, prompt_ids, outputs, max_tokens) -> list[Replay]:
    """Per request, the replayed steps of ``method`` at ``k`` over its own output (cut at its
    max_tokens); ``engine``: a ReferenceEngine (its networks and kernel-form knobs; never its
    planted fault)."""
    nets = [m for m in (engine.target, engine.mtp, engine.drafter, engine.dflash2) if m is not None]
    set_nondeterministic(nets, False)  # the nondeterministic fault lives in the networks
    out = []
    for prompt, output, budget in zip(prompt_ids, outputs, max_tokens):
        prompt = [int(t) for t in prompt]
        output = [int(t) for t in output][: max(int(budget), 0)]
        if not prompt or len(output) < 2:  # no step after the prefill's token
            out.append(Replay(k, [], [], []))
            continue
        out.append(_Replayer(engine, method, k, prompt, output).run(len(output)))
    return out
