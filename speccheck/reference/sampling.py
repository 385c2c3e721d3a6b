"""Sampling at temperature > 0 for the reference engine: plain sampling for the baseline and
speculative sampling (accept draft d with probability min(1, p(d)/q(d)), resample a rejection
from the normalised residual max(0, p - q)) for MTP, DFlash and DFlash2, one request at a time.

The drafters *sample* their drafts from q, the drafter's distribution under the same
temperature / top-p / top-k transform as the target's, and the acceptance ratio reads that
same q. DFlash2's selector walks its candidates: slot l's draft is drawn from the softmax of
the transformed edge scores row of the previous slot's choice, over the slot's top-K
candidates (zero elsewhere); that conditional distribution is slot l's q (given the accepted
prefix, the previous draft is fixed, so q depends on the prefix alone, as the proof needs).

Uniforms come from a counter-based stream keyed by (seed, request, output position, use), so
a request's tokens depend on its seed and prompt only: not on the batch, the process or the
run. Planted sampler bugs (:data:`FAULTS`) join the decoder's faults.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import numpy as np
import torch

#: planted sampler bugs (engine arg ``fault=NAME``, temperature > 0); ``speccheck selftest``
#: proves the distribution check catches each
FAULTS = {
    "residual-unnormalised": "a rejection resamples by inverse CDF over max(0, p - q) without "
                             "dividing by its sum: a draw past the residual's mass runs off the "
                             "end of the vocabulary and is clamped to its last token id",
    "residual-is-p": "a rejection resamples from the target's p instead of max(0, p - q) (the "
                     "output over-weights tokens the drafter already proposes)",
    "temperature-target-only": "the drafter draws its drafts at temperature 1 while the "
                               "acceptance ratio reads q at the requested temperature",
    "top-p-draft-only": "top-p (and top-k) filter the drafter's q but not the target's p in "
                        "the verify: tokens outside the nucleus are emitted",
    "seed-reused": "every step draws its uniforms from the same per-request stream position "
                   "(the step index is not mixed into the seed)",
    "dflash2-q-unary": "DFlash2's acceptance ratio reads the per-slot softmax of the unary "
                       "scores over the whole vocabulary, not the selector's distribution the "
                       "draft was drawn from",
}


@dataclass(frozen=True)
class SamplingParams:
    """What a sampled request asks for (temperature 0: greedy, never reaches this module)."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int = 0

    @classmethod
    def from_args(cls, args: dict) -> "SamplingParams | None":
        t = float(args.get("temperature") or 0)
        if t <= 0:
            return None
        return cls(t, float(args.get("top_p") or 1.0), int(args.get("sample_top_k") or 0),
                   int(args.get("seed") or 0))


def transform(logits: torch.Tensor, sp: SamplingParams, *, temperature: bool = True,
              truncate: bool = True) -> torch.Tensor:
    """Probabilities [..., V] (float64) of logits under temperature, then top-k, then top-p
    over the renormalised top-k survivors (the smallest set of most likely tokens whose mass
    reaches top_p; equal probabilities ordered by token id), renormalised: vLLM's order. The keyword switches exist for planted faults."""
    x = logits.double() / (sp.temperature if temperature else 1.0)
    p = torch.softmax(x, -1)
    if not truncate or (sp.top_k <= 0 and sp.top_p >= 1.0):
        return p
    order = _descending(p)
    sp_sorted = p.gather(-1, order)
    keep = torch.ones_like(sp_sorted, dtype=torch.bool)
    if sp.top_k > 0:
        keep[..., sp.top_k:] = False
    if sp.top_p < 1.0:  # over the top-k survivors, renormalised (vLLM's apply_top_k_top_p)
        alive = sp_sorted * keep
        before = alive.cumsum(-1) - alive  # mass of the more likely survivors
        keep &= before < sp.top_p * alive.sum(-1, keepdim=True)
    kept = torch.zeros_like(p).scatter(-1, order, keep.double())
    p = p * kept
    return p / p.sum(-1, keepdim=True)


def _descending(p: torch.Tensor) -> torch.Tensor:
    """Token order by probability, descending, equal ones by token id (stable sort)."""
    return torch.sort(-p, dim=-1, stable=True).indices


def icdf(p: torch.Tensor, u: float, normalise: bool = True) -> int:
    """The token of p [V] at uniform u by inverse CDF over tokens in descending probability
    (so a token's randomized PIT is u itself). ``normalise`` False: u is taken against the
    unnormalised mass, past which the last token id is returned (a planted fault)."""
    order = _descending(p)
    c = p[order].cumsum(0)
    total = float(c[-1])
    target = u * total if normalise else u
    if not normalise and target >= total:  # clamped to the vocabulary's end
        return len(p) - 1
    i = int(torch.searchsorted(c, torch.tensor([target], dtype=c.dtype)).item())
    if i >= len(order):  # numerics at the top end
        i = len(order) - 1
    while float(p[order[i]]) <= 0 and i > 0:  # never a zero-probability token
        i -= 1
    return int(order[i])


class Uniforms:
    """Counter-based uniforms of one request: u(position, use) depends on (seed, prompt,
    position, use) alone. ``reuse`` (fault seed-reused) drops the position."""

    USES = {"draw": 0, "draft": 1, "accept": 2, "resid": 3}

    def __init__(self, seed: int, prompt: list[int], reuse: bool = False):
        self.key = hashlib.sha256(np.asarray([int(seed)] + list(prompt), np.int64).tobytes()).digest()
        self.reuse = reuse

    def __call__(self, position: int, use: str) -> float:
        pos = 0 if self.reuse else position
        h = hashlib.sha256(self.key + np.asarray([pos, self.USES[use]], np.int64).tobytes())
        return (int.from_bytes(h.digest()[:8], "little") >> 11) / float(1 << 53)


# --------------------------------------------------------------------------- generation


def generate(dec, prompt: list[int], max_tokens: int, method: str, k: int, top_k: int,
             ignore_eos: bool, sp: SamplingParams, emit=None):
    """One request, sampled: the baseline, or speculative sampling with ``method`` at K.
    ``dec`` is the reference Decoder (its networks, knobs, prefill and cache)."""
    from .steps import Generation, _Out
    from speccheck.types import SpecCounters

    fault = dec.knobs.fault
    rng = Uniforms(sp.seed, prompt, reuse=fault == "seed-reused")
    spec = method != "baseline"
    aux_ids = tuple(dec.cfg.drafter.target_layer_ids) if spec and method != "mtp" else ()
    max_len = len(prompt) + max_tokens + k + 4
    out = _Out(max_tokens, dec.cfg.eos_token_id, top_k, ignore_eos=ignore_eos, emit=emit)
    t0 = time.perf_counter()
    cache, hidden, aux, rows = dec._prefill([prompt], max_len, top_k, aux_ids)
    t1, c1 = time.perf_counter(), time.process_time()
    x = icdf(_target_p(rows[0], sp, fault), rng(0, "draw"))
    out.add([x], rows[:1])
    tokens = list(prompt) + [x]
    counters = SpecCounters(accepted_per_pos=[0] * k) if spec else None
    iterations = 0
    if not spec:
        while out.finish is None:
            h, _ = dec.target(dec._t([[x]]), cache, gdn_form=dec.knobs.gdn_decode,
                              attn_form=dec.knobs.attn_decode)
            rows = torch.log_softmax(dec.target.logits(h[:, 0]), -1)
            x = icdf(_target_p(rows[0], sp, fault), rng(len(out.tokens), "draw"))
            out.add([x], rows)
            tokens.append(x)
            iterations += 1
    else:
        state = dec._draft_init(method, max_len)
        pending = (hidden[0] if method == "mtp"
                   else torch.cat([aux[0][i] for i in aux_ids], -1))
        while out.finish is None:
            t_draft = time.perf_counter()
            drafts, q = _draft(dec, method, state, tokens, pending, k, sp, rng, len(out.tokens))
            counters.draft_s = (counters.draft_s or 0.0) + time.perf_counter() - t_draft
            h, auxo = dec.target(dec._t([[x] + drafts]), cache, gdn_form=dec.knobs.gdn_verify,
                                 attn_form=dec.knobs.attn_verify, per_position=True,
                                 aux_layers=aux_ids)
            rows = torch.log_softmax(dec.target.logits(h[0]), -1)  # [k+1, V]
            p = _target_p(rows, sp, fault)
            emitted = accept(p, q, drafts, rng, len(out.tokens), fault)
            m = len(emitted) - 1
            out.add(emitted, rows[: m + 1])
            tokens.extend(emitted)
            x = emitted[-1]
            iterations += 1
            counters.drafts, counters.draft_tokens = counters.drafts + 1, counters.draft_tokens + k
            counters.accepted_tokens += m
            for i in range(m):
                counters.accepted_per_pos[i] += 1
            # the decoder's state faults apply here too (stale-state, conv-not-rolled-back)
            cache.commit(m + 1, roll_back_gdn=fault != "stale-state",
                         roll_back_conv=fault != "conv-not-rolled-back")
            pending = (h[0, : m + 1] if method == "mtp"
                       else torch.cat([auxo[i][0, : m + 1] for i in aux_ids], -1))
    t2, c2 = time.perf_counter(), time.process_time()
    cpu_s = c2 - c1 if dec.device.type == "cpu" and torch.get_num_threads() == 1 else None
    return Generation(out.tokens, out.lps, np.array(out.tk_ids), np.array(out.tk_lps),
                      out.finish, t1 - t0, t2 - t1, counters, iterations, cpu_s)


def _target_p(rows: torch.Tensor, sp: SamplingParams, fault) -> torch.Tensor:
    """The target's sampling distribution from log-prob rows (fault top-p-draft-only: not
    truncated)."""
    return transform(rows, sp, truncate=fault != "top-p-draft-only")


def accept(p: torch.Tensor, q: torch.Tensor, drafts: list[int], rng: Uniforms, at: int,
           fault=None) -> list[int]:
    """Speculative sampling of one verify step: p [k+1, V] the target's distributions at the
    draft positions and after them, q [k, V] the drafter's; ``at`` is the output position of
    the first draft. Returns the accepted drafts plus one token drawn by the target (from the
    residual after a rejection, from p after all K were accepted)."""
    k = len(drafts)
    for i, d in enumerate(drafts):
        qd, pd = float(q[i, d]), float(p[i, d])
        if qd <= 0 or rng(at + i, "accept") >= min(1.0, pd / qd):
            if fault == "residual-is-p":
                r = p[i]
            else:
                r = (p[i] - q[i]).clamp_min(0)
                if float(r.sum()) <= 0:  # p == q where it matters: any draw from p is exact
                    r = p[i]
            return drafts[:i] + [icdf(r, rng(at + i, "resid"),
                                      normalise=fault != "residual-unnormalised")]
    return drafts + [icdf(p[k], rng(at + k, "resid"))]


def _draft(dec, method, state, tokens, pending, k, sp, rng, at):
    """K drafts sampled from the drafter, and q [K, V] they were drawn from."""
    fault = dec.knobs.fault
    draw_sp = (SamplingParams(1.0, sp.top_p, sp.top_k, sp.seed)
               if fault == "temperature-target-only" else sp)
    p = len(tokens) - 1
    if method == "mtp":
        n = pending.shape[0]
        emb = dec.target.embed_tokens(dec._t(tokens[p - n + 1: p + 1]))[None]
        mh = dec.mtp(emb, pending[None], state)[:, -1:]
        drafts, qs = [], []
        for j in range(k):
            if j:
                mh = dec.mtp(dec.target.embed_tokens(dec._t(drafts[-1:]))[None], mh, state)
            logits = dec._draft_logits(mh[0, -1], p + 1 + j)
            d, q = _sample_draft(logits, sp, draw_sp, rng(at + j, "draft"))
            drafts.append(d)
            qs.append(q)
        state.length = p
        return drafts, torch.stack(qs)
    net = dec.drafter if method == "dflash" else dec.dflash2
    n = pending.shape[0]
    start = state["len"]
    pos = range(start, p) if method == "dflash" else torch.arange(start, p, device=dec.device)
    for li, (ck, cv) in enumerate(net.context_kv(pending[None], pos)):
        state["k"][li][:, :, start:p] = ck
        state["v"][li][:, :, start:p] = cv
    state["len"] = p
    block = [tokens[-1]] + [dec.cfg.mask_token_id] * k
    emb = dec.target.embed_tokens(dec._t(block))[None]
    bpos = range(p, p + k + 1) if method == "dflash" else torch.arange(p, p + k + 1, device=dec.device)
    hb = net(emb, bpos, list(zip(state["k"], state["v"])), ctx_len=p,
             attn_form=dec.knobs.attn_draft)[0, 1:]
    logits = dec._draft_logits(hb, range(p + 1, p + k + 1))  # [k, V]
    if method == "dflash2" and dec.selector.selector:
        return _dflash2_walk(dec, hb, logits, tokens[-1], sp, draw_sp, rng, at)
    drafts, qs = [], []
    for j in range(k):
        d, q = _sample_draft(logits[j], sp, draw_sp, rng(at + j, "draft"))
        drafts.append(d)
        qs.append(q)
    return drafts, torch.stack(qs)


def _sample_draft(logits, sp, draw_sp, u):
    """(draft, q): q is what the acceptance ratio reads (the requested transform); the draft
    is drawn from ``draw_sp``'s (the same, but for fault temperature-target-only)."""
    q = transform(logits, sp)
    drawn = q if draw_sp is sp else transform(logits, draw_sp)
    return icdf(drawn, u), q


def _dflash2_walk(dec, hb, unary, anchor, sp, draw_sp, rng, at):
    """DFlash2's selector, sampled: at slot l, the edge scores from the previous choice to the
    slot's top-K candidates, transformed as the target's logits are, give q_l over the
    vocabulary (zero outside the candidates); the draft is drawn from q_l."""
    from .dflash2 import WALK_DTYPES, candidates

    sel = dec.dflash2.candidate_selector
    K = dec.selector.top_k or sel.top_k
    ids, vals = candidates(unary[None], K)  # [1, L, K]
    scores = sel.edge_scores(ids, vals, hb[None], dec._t([anchor]),
                             WALK_DTYPES[dec.selector.walk])[0]  # [L, Kp, K]
    V = unary.shape[-1]
    prev, drafts, qs = 0, [], []
    for l in range(unary.shape[0]):
        row = torch.full((V,), float("-inf"), dtype=torch.float64, device=unary.device)
        row[ids[0, l]] = scores[l, prev].double()
        q = transform(row, sp)
        drawn = q if draw_sp is sp else transform(row, draw_sp)
        d = icdf(drawn, rng(at + l, "draft"))
        if dec.knobs.fault == "dflash2-q-unary":
            q = transform(unary[l], sp)
        prev = int((ids[0, l] == d).nonzero()[0, 0])
        drafts.append(d)
        qs.append(q)
    return drafts, torch.stack(qs)
