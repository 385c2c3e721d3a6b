"""Greedy decoding for the reference model: baseline, and speculative with MTP or the DFlash
block drafter (draft K, verify K+1 positions in one target forward, accept the longest
matching prefix plus the target's own token, roll GDN/conv state and K/V back exactly).

Kernel forms per phase and the planted faults are plain fields of :class:`Knobs`.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, replace
from typing import Callable

import numpy as np
import torch

from speccheck.types import SpecCounters
from speccheck.verify.ties import canonical_rows

from . import dflash2 as _dflash2
from . import sampling as _sampling
from .graphs import GraphDecoding
from .model import (ATTN_FORMS, DRAFT_ATTN_FORMS, GDN_FORMS, Cache, DFlashDrafter, MTPModule,
                    Qwen3_5TextModel, ReferenceConfig, set_nondeterministic, set_verify_scale)
from .steps import Generation, _Out, _sync, emitted_rows

#: planted spec-decode bugs (engine arg ``fault=NAME``), one line each naming the real bug it
#: models; ``speccheck selftest`` proves that the gate catches each
FAULTS = {
    "stale-state": "after a rejected draft the GDN recurrent state is not rolled back "
                   "(it keeps the rejected tokens' updates)",
    "conv-not-rolled-back": "after a rejected draft the GDN short-conv window keeps the "
                            "rejected tokens' inputs (vLLM #50272, #39273)",
    "accepted-clamped-to-conv": "the state keeps at most conv kernel - 1 = 3 new positions: "
                                "with >= 4 accepted (bonus included) the recurrent state lags "
                                "the tokens (xLLM #2249)",
    "wrong-slot-after-no-draft": "after a step without a draft the next verify starts from the "
                                 "last drafting step's state (column num_accepted - 1), not the "
                                 "one plain decode wrote (column 0) (vLLM #52942; needs "
                                 "no_draft_every)",
    "batch-aliases-seq0": "every row of a batch reads and writes sequence 0's GDN/conv state "
                          "slot (SGLang #27202; shows with batch > 1 only)",
    "decode-kernel-verify": "verify runs the one-token decode kernel over the K+1 tokens, "
                            "which keeps no per-token states: after a rejection the state "
                            "cannot roll back (SGLang #19775)",
    "mtp-stale-hidden": "the MTP head drafts from target hidden states one position stale "
                        "(vLLM #36531; acceptance only, tokens stay exact)",
    "dflash-wrong-layer": "the DFlash drafter gets the target layers' inputs instead of their "
                          "outputs, aux hidden states one layer early (vLLM #42704; "
                          "acceptance only)",
    "bonus-off-by-one": "the bonus token is taken from the position after the right one "
                        "(the distribution conditioned on the rejected draft)",
    "accept-top2": "a draft token is accepted when it is the target's top-1 or top-2 choice",
    "verify-samples": "at temperature 0 the verify draws its tokens at temperature 0.01 instead of "
                      "taking the argmax (a sampler left on: choices differ from argmax only at "
                      "near-ties, which output comparisons excuse)",
    "accepted-counts-bonus": "the accepted-token counter includes the bonus token (a metrics "
                             "bug like vLLM #27077's impossible acceptance counts)",
    "past-max-tokens": "accepted drafts are not cut at max_tokens: the output runs past its "
                       "budget",
    "past-eos": "accepted drafts after an end-of-sequence token are emitted (the stop is "
                "checked on the step's last token only)",
    "nondeterministic": "the MLP down_proj sums its partial products in a run-to-run random "
                        "order (seeded from os.urandom)",
    "state-precision": "the GDN recurrent state carried from one verify step to the next keeps "
                       "4 mantissa bits, an fp8 (e4m3) state cache's precision, range kept "
                       "(precision loss: flips mostly near-ties, moves every logprob)",
    "conv-block-boundary": "a verify step whose kept positions cross a 16-position cache block "
                           "keeps the conv state from before the step (written token-indexed "
                           "into the wrong block: vLLM #53229; only steps across a block)",
    "prefix-cache-overreach": "a prompt's prefill kept for reuse takes the GDN and conv state its "
                              "speculative generation ended at: the next request for that prompt "
                              "reuses hybrid state past the prompt (vLLM #43559, #43650, #53912; "
                              "one request at a time, prefix_cache on)",
    "rollback-skipped-at-k-minus-1": "the GDN recurrent state is not rolled back after a step "
                                     "that accepted exactly K - 1 drafts (an off-by-one in the "
                                     "rollback index, taken only on that rare step: about 1-2 % "
                                     "of DFlash K=7's steps; a rare-step hybrid-state bug like "
                                     "vLLM #52942, #50272)",
    "verify-drift": "the GDN layers' output on the verify path only is off by a factor "
                    "(1 + 2^-7) (a verify kernel's output scaled slightly wrong: a verify-only "
                    "numeric drift that flips only near-ties, as a wrong scale in a GDN verify "
                    "kernel would)",
    "drafter-noise": "the drafter's logits carry a fixed pseudo-random perturbation per draft "
                     "position (a drafter-only numerics bug: a wrong scale, a lossy drafter "
                     "kernel); acceptance falls about a fifth, tokens stay exact",
    # the serving regime's (reference/serving.py, run_workload; generate() sees only
    # short-prompt-verify, on a prompt of 1 + K tokens)
    "join-contaminates": "a request that joins a running batch takes a neighbour's GDN/conv "
                         "state row for its first step (SGLang #36548, #35150: wrong only at "
                         "concurrency)",
    "slot-residue": "a reused state slot keeps the previous request's conv window: the next "
                    "request's prefill starts from it (state leaking across requests in a "
                    "long-lived server, vLLM #35800, #36872)",
    "prefix-wrong-block": "a prefix-cache hit restores the GDN state of the block allocated "
                          "after the boundary's (vLLM #43559, #53912; prefix_cache=on)",
    "short-prompt-verify": "a prefill of 1 + K tokens is taken down the verify path and keeps "
                           "only its first position's GDN state (vLLM #53051; prompts of 1 + K "
                           "tokens, or what a prefix hit leaves to prefill)",
    "preempt-loses-draft-state": "a request recomputed after preemption resumes with its "
                                 "drafter state lost, not rebuilt from the recompute (acceptance "
                                 "falls; tokens move at near-ties only; kv_blocks)",
    "padded-row-real": "a batched step not of a CUDA-graph capture size (vLLM's default "
                       "sizes in tokens, 1 + K a request) is padded up to the next; the padding "
                       "rows write their state into the last row's slot (vLLM #45100)",
    "thinking-no-rollback": "a request whose prompt the chat template rendered in thinking "
                            "mode is verified on a path that keeps the rejected drafts' GDN "
                            "state (a verify path keyed on the reasoning mode; the thinking-mode "
                            "divergences of #54928, #38009; chat template, thinking on)",
    "async-stale-accepted": "with async scheduling, the step planned ahead is placed by the "
                            "drafts rejected in the step before the one in flight (a stale "
                            "accepted count): its positions are off whenever two steps in a row "
                            "keep different counts (vLLM #52071, #38556; async_scheduling=on)",
}
FAULTS.update(_sampling.FAULTS)  # the sampler's (temperature > 0)


#: positions per cache block of the fault conv-block-boundary
CONV_BLOCK = 16

#: standard deviation (nats) of the fault drafter-noise's perturbation of a drafter logit, and
#: the draft positions after which its table repeats
DRAFTER_NOISE_SD = 1.5
DRAFTER_NOISE_ROWS = 64
_NOISE_TABLES: dict = {}


def drafter_noise(logits: torch.Tensor, positions) -> torch.Tensor:
    """(fault drafter-noise) ``logits`` [..., V] of drafts at ``positions`` (an int, a range or
    a tensor of ``logits.shape[:-1]``) plus a fixed pseudo-random perturbation per draft
    position and token: the same bits in every run, batch and drafting path."""
    V, device = logits.shape[-1], logits.device
    if isinstance(positions, range):
        positions = list(positions)
    key = (V, device)
    if key not in _NOISE_TABLES:
        gen = torch.Generator().manual_seed(0x5EED)
        _NOISE_TABLES[key] = (torch.randn(DRAFTER_NOISE_ROWS, V, generator=gen)
                              * DRAFTER_NOISE_SD).to(device)
    pos = torch.as_tensor(positions, device=device).expand(logits.shape[:-1])
    return logits + _NOISE_TABLES[key][pos % DRAFTER_NOISE_ROWS]


#: the factor the fault verify-drift puts on the GDN layers' output on the verify path
VERIFY_DRIFT = 1.0 + 2.0 ** -7

#: prompt tokens whose prefills a decoder keeps for reuse (Knobs.prefix_cache), the least
#: recently used dropped first: the default corpus has about 12,000
PREFIX_CACHE_TOKENS = 65_536


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` rounded to ``bits`` mantissa bits (to nearest, ties away from zero), exponent range
    kept: a lower-precision state cache without its range limits. (A bf16 state, 7 bits, moved
    logprobs by about one more bf16 rounding of a GEMM: detectable on one CPU's bf16 kernels
    and not on another's.)"""
    shift = 23 - bits
    i = x.float().contiguous().view(torch.int32)
    i = (i + (1 << (shift - 1))) & ~((1 << shift) - 1)
    return i.view(torch.float32).to(x.dtype)


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
    #: the drafter's attention (DFlash / DFlash2 block): SDPA (multi) or the Triton kernel
    attn_draft: str = "multi"
    #: every N-th verify step carries no draft and decodes one token (0 = never), as engines
    #: do near the end of the context or when the drafter has nothing to propose
    no_draft_every: int = 0
    #: on CUDA, one prompt at a time runs its steps as CUDA graphs (graphs.py); else eagerly
    cuda_graphs: bool = True
    #: the graph steps are torch.compile'd before their capture (graphs.Replay)
    compile: bool = False
    #: a prompt prefilled before by this decoder reuses that prefill (Decoder._prefill_one)
    prefix_cache: bool = True

    def __post_init__(self) -> None:
        for name in ("gdn_prefill", "gdn_decode", "gdn_verify"):
            if getattr(self, name) not in GDN_FORMS:
                raise ValueError(f"{name}={getattr(self, name)!r}: choose one of {GDN_FORMS}")
        for name in ("attn_prefill", "attn_decode", "attn_verify"):
            if getattr(self, name) not in ATTN_FORMS:
                raise ValueError(f"{name}={getattr(self, name)!r}: choose one of {ATTN_FORMS}")
        if self.attn_draft not in DRAFT_ATTN_FORMS:
            raise ValueError(f"attn_draft={self.attn_draft!r}: choose one of {DRAFT_ATTN_FORMS}")
        if self.fault is not None and self.fault not in FAULTS:
            raise ValueError(f"fault={self.fault!r}: choose one of {tuple(FAULTS)}")
        if self.no_draft_every < 0:
            raise ValueError(f"no_draft_every={self.no_draft_every}: give 0 (never) or N >= 1")

    def to_dict(self) -> dict:
        return asdict(self)


class Decoder:
    """Runs requests on the given networks, one at a time or as a batch
    (:meth:`generate_batch`; one request is a batch of one)."""

    def __init__(self, cfg: ReferenceConfig, target: Qwen3_5TextModel, mtp: MTPModule | None,
                 drafter: DFlashDrafter | None, knobs: Knobs,
                 dflash2: "_dflash2.DFlash2Drafter | None" = None,
                 selector: "_dflash2.SelectorKnobs | None" = None):
        self.cfg, self.target, self.mtp, self.drafter, self.knobs = cfg, target, mtp, drafter, knobs
        self.dflash2, self.selector = dflash2, selector or _dflash2.SelectorKnobs()
        self.device = target.embed_tokens.weight.device
        self.graphs = (GraphDecoding(self) if knobs.cuda_graphs and self.device.type == "cuda"
                       else None)
        self._prefilled: OrderedDict = OrderedDict()  # prompt ids -> (cache, hidden, aux)
        #: temperature > 0: requests are sampled (sampling.py), one at a time
        self.sampling: _sampling.SamplingParams | None = None
        self._drafter_layers = (tuple(cfg.drafter.target_layer_ids)
                                if drafter is not None or dflash2 is not None else ())
        self._arm()

    def _arm(self) -> None:
        """Switch the ``nondeterministic`` fault on or off in the networks. Done at every call:
        decoders with other knobs may share the networks (ReferenceEngine.with_args)."""
        nets = (self.target, self.mtp, self.drafter, self.dflash2)
        set_nondeterministic([m for m in nets if m is not None],
                             self.knobs.fault == "nondeterministic")
        set_verify_scale(self.target, VERIFY_DRIFT if self.knobs.fault == "verify-drift" else 1.0)

    # ------------------------------------------------------------------ public

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_tokens: int, method: str = "baseline",
                 k: int = 0, top_k: int = 5) -> Generation:
        return self.generate_batch([prompt_ids], [max_tokens], method, k, top_k)[0]

    @torch.inference_mode()
    def generate_batch(self, prompts: list[list[int]], max_tokens: list[int],
                       method: str = "baseline", k: int = 0, top_k: int = 5,
                       ignore_eos: list[bool] | None = None,
                       emit: list[Callable | None] | None = None,
                       seeds: list[int] | None = None) -> list[Generation]:
        """Greedy decoding of several prompts as one batch: each prompt is prefilled alone,
        then all decode together, each sequence at its own length (see Cache; speculative
        sequences also accept different numbers of tokens); one that stops leaves the
        batch. The batch's prefill and decode times are shared out in proportion to each
        sequence's tokens, so that sums over the batch (the tok/s of a run) are the batch's
        own. ``ignore_eos[i]``: sequence i does not stop at end-of-sequence; ``emit[i]``:
        called with each step's tokens of sequence i as it is decided (_Out.emit)."""
        if not prompts or any(not p for p in prompts):
            raise ValueError("empty prompt: at least one token is needed")
        self._arm()
        ignore_eos = list(ignore_eos or [False] * len(prompts))
        emit = list(emit or [None] * len(prompts))
        if self.sampling is not None:
            seeds = seeds or [self.sampling.seed] * len(prompts)  # ``seeds[i]``: request i's
            return [_sampling.generate(self, p, n, method, k, top_k, i,
                                       replace(self.sampling, seed=s), e)
                    for p, n, i, e, s in zip(prompts, max_tokens, ignore_eos, emit, seeds)]
        graphed = self.graphs is not None and self.graphs.handles(method, len(prompts))
        if method == "baseline":
            if graphed:
                return [self.graphs.baseline(prompts[0], max_tokens[0], top_k, ignore_eos[0], emit[0])]
            return self._baseline(prompts, max_tokens, top_k, ignore_eos, emit)
        if method not in ("mtp", "dflash", "dflash2"):
            raise ValueError(f"unknown method {method!r}: choose baseline, mtp, dflash or dflash2")
        if k < 1:
            raise ValueError(f"method {method} needs K >= 1, got {k}")
        if method == "mtp" and self.mtp is None:
            raise ValueError("method mtp needs the MTP weights (mtp.* in model.safetensors)")
        if method == "dflash" and self.drafter is None:
            raise ValueError("method dflash needs the drafter (drafter.safetensors)")
        if method == "dflash2" and self.dflash2 is None:
            raise ValueError(f"method dflash2 needs the DFlash2 drafter ({_dflash2.DFLASH2_FILE})")
        if graphed:
            return [self.graphs.speculative(prompts[0], max_tokens[0], method, k, top_k,
                                            ignore_eos[0], emit[0])]
        return self._speculative(prompts, max_tokens, method, k, top_k, ignore_eos, emit)

    @torch.inference_mode()
    def score(self, prompt_ids: list[int], continuation: list[int], top_k: int = 5):
        """Teacher-forced top-k and forced-token logprobs of ``continuation`` through the
        prefill path. Returns (topk_ids [n,k], topk_logprobs [n,k], token_logprobs [n])."""
        n = len(continuation)
        if n == 0:
            return (np.zeros((0, top_k), np.int32), np.zeros((0, top_k), np.float32),
                    np.zeros(0, np.float32))
        self._arm()
        ids = list(prompt_ids) + list(continuation)
        cache = Cache(len(self.target.layers), len(ids) + 1)
        h, _ = self.target(self._t(ids)[None], cache, gdn_form=self.knobs.gdn_prefill,
                           attn_form=self.knobs.attn_prefill)
        hs = h[0, len(prompt_ids) - 1: len(ids) - 1]
        rows = torch.log_softmax(self.target.logits(hs), -1)
        vals, idx = rows.topk(top_k, dim=-1)
        tok = rows.gather(1, self._t(continuation)[:, None])[:, 0]
        idx, vals = canonical_rows(idx.cpu().numpy(), vals.cpu().numpy())
        return idx, vals, tok.cpu().numpy()

    # ------------------------------------------------------------------ internals

    def _t(self, ids) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def _prefill(self, prompts, max_len, top_k, aux_layers=(), verify_k=0):
        """Each prompt alone through the prefill path (as a server prefills a request when
        it arrives), then all of them as one batch (:meth:`Cache.join`, each sequence at its
        own length). Returns (cache, hidden [P_b,H] per prompt, aux {layer: [P_b,H]} per
        prompt, log-prob rows of each prompt's next token [B,V])."""
        caches, hidden, aux = [], [], []
        for p in prompts:
            cache, h, a = self._prefill_one(p, max_len, tuple(aux_layers), verify_k)
            caches.append(cache)
            hidden.append(h)
            aux.append(a)
        rows = torch.log_softmax(self.target.logits(torch.cat([h[-1:] for h in hidden])), -1)
        return (caches[0] if len(caches) == 1 else Cache.join(caches)), hidden, aux, rows

    def _prefill_one(self, prompt, max_len, aux_layers, verify_k=0):
        """(cache of ``max_len`` positions, hidden [P,H], aux {layer: [P,H]}) of one prompt.

        With ``prefix_cache`` a prompt this decoder prefilled before reuses what that prefill
        computed, as vLLM's prefix caching does: the same bits, since a prefill depends on
        the prompt alone. The matrix runs each prompt under every config (and twice in a run
        of the corpus all at once), so a long prompt is prefilled once per process, not once
        per run; a fresh-process repeat still prefills everything itself. The drafters'
        layers are always kept, so that the baseline's prefill serves them too."""
        if self.knobs.fault == "short-prompt-verify" and verify_k and len(prompt) == verify_k + 1:
            cache = Cache(len(self.target.layers), max_len)
            h, a = self._prefill_as_verify(prompt, cache, aux_layers)
            return cache, h, a
        memo, key = self._prefilled, tuple(prompt)
        on = self.knobs.prefix_cache
        if on and key in memo and set(aux_layers) <= memo[key][2].keys():
            memo.move_to_end(key)
            cache, h, a = memo[key]
            return cache.copy(max_len), h, {i: a[i] for i in aux_layers}
        layers = tuple(sorted(set(aux_layers) | set(self._drafter_layers))) if on else aux_layers
        cache = Cache(len(self.target.layers), max_len)
        h, a = self.target(self._t(prompt)[None], cache, gdn_form=self.knobs.gdn_prefill,
                           attn_form=self.knobs.attn_prefill, aux_layers=layers)
        h, a = h[0], {i: t[0] for i, t in a.items()}
        if on:
            memo[key] = (cache.copy(len(prompt)), h, a)
            while sum(map(len, memo)) > PREFIX_CACHE_TOKENS and len(memo) > 1:
                memo.popitem(last=False)
        return cache, h, {i: a[i] for i in aux_layers}

    def _prefill_as_verify(self, ids, cache: Cache, layers):
        """(fault short-prompt-verify) A prefill of 1 + K tokens taken for a verify: the verify's
        GDN form and per-position states, of which the spec path keeps the state after the
        accepted count a new request starts at (1): the GDN updates of the other K positions are
        lost (vLLM #53051). K/V and the conv window keep every position. (hidden [T, H], aux)"""
        h, a = self.target(self._t(ids)[None], cache, gdn_form=self.knobs.gdn_verify,
                           attn_form=self.knobs.attn_verify, per_position=True, aux_layers=layers)
        T = len(ids)
        for i, p in cache.pending.items():
            per_state, window = p[1], p[2]
            k1 = window.shape[1] - len(per_state)
            cache.conv[i] = window[:, T:T + k1]
            cache.gdn[i] = per_state.at(0)
        cache.pending = {}
        cache.length += T
        return h[0], {i: a[i][0] for i in layers}

    def _generations(self, prompts, outs, counters, iterations, t0, t1, t2, cpu_s=None) -> list[Generation]:
        """Generation per sequence; batch times shared out (prefill by prompt tokens, decode
        by generated tokens). CPU seconds only where they are the decode's own work (CPU, one
        thread): on a shared machine they are what an idle one's wall clock would show."""
        _sync(self.device)
        cpu_s = cpu_s if self.device.type == "cpu" and torch.get_num_threads() == 1 else None
        n_prompt = sum(map(len, prompts))
        n_decoded = sum(len(o.tokens) - 1 for o in outs) or 1
        return [Generation(o.tokens, o.lps, np.array(o.tk_ids), np.array(o.tk_lps), o.finish,
                           (t1 - t0) * len(p) / n_prompt,
                           (t2 - t1) * (len(o.tokens) - 1) / n_decoded, c, it,
                           cpu_s and cpu_s * (len(o.tokens) - 1) / n_decoded)
                for p, o, c, it in zip(prompts, outs, counters, iterations)]

    def _baseline(self, prompts, max_tokens, top_k, ignore_eos, emit) -> list[Generation]:
        outs = [_Out(n, self.cfg.eos_token_id, top_k, ignore_eos=i, emit=e)
                for n, i, e in zip(max_tokens, ignore_eos, emit)]
        t0 = time.perf_counter()
        cache, _, _, rows = self._prefill(prompts, max(map(len, prompts)) + max(max_tokens) + 2,
                                          top_k)
        _sync(self.device)
        t1, c1 = time.perf_counter(), time.process_time()
        live = list(range(len(prompts)))  # sequences still decoding, in cache order
        while True:
            tok = rows.argmax(-1)
            toks = tok.tolist()
            idx, vals, chosen = emitted_rows(rows, toks, top_k)
            for j, b in enumerate(live):
                outs[b].extend(toks[j:j + 1], idx[j:j + 1], vals[j:j + 1], chosen[j:j + 1])
            still = [j for j, b in enumerate(live) if outs[b].finish is None]
            if not still:
                break
            if len(still) < len(live):
                cache.select(still)
                tok = tok[self._t(still)]
                live = [live[j] for j in still]
            h, _ = self.target(tok[:, None], cache, gdn_form=self.knobs.gdn_decode,
                               attn_form=self.knobs.attn_decode)
            rows = torch.log_softmax(self.target.logits(h[:, 0]), -1)
        t2, c2 = time.perf_counter(), time.process_time()
        iterations = [len(o.tokens) - 1 for o in outs]
        return self._generations(prompts, outs, [None] * len(outs), iterations, t0, t1, t2, c2 - c1)

    def _speculative(self, prompts, max_tokens, method, k, top_k, ignore_eos, emit) -> list[Generation]:
        fault = self.knobs.fault
        aux_ids = tuple(self.cfg.drafter.target_layer_ids) if method != "mtp" else ()
        if fault == "dflash-wrong-layer":  # each layer's input (the previous layer's output)
            aux_ids = tuple(max(i - 1, 0) for i in aux_ids)
        conv_history = self.cfg.linear_conv_kernel_dim - 1
        B = len(prompts)
        max_len = max(map(len, prompts)) + max(max_tokens) + k + 4
        outs = [_Out(n, self.cfg.eos_token_id, top_k, cut_at_max=fault != "past-max-tokens",
                     cut_at_eos=fault != "past-eos", ignore_eos=i, emit=e)
                for n, i, e in zip(max_tokens, ignore_eos, emit)]
        counters = [SpecCounters(accepted_per_pos=[0] * k) for _ in range(B)]
        iterations = [0] * B
        t0 = time.perf_counter()
        cache, hidden, aux, rows = self._prefill(prompts, max_len, top_k, aux_ids, verify_k=k)
        x = rows.argmax(-1).tolist()
        tokens = [list(p) + [t] for p, t in zip(prompts, x)]
        for b, o in enumerate(outs):
            o.add([x[b]], rows[b:b + 1])
        _sync(self.device)
        t1, c1 = time.perf_counter(), time.process_time()

        # the drafter's state (per sequence alone; one for the whole batch, drafting all live
        # sequences in one call), and per sequence the target outputs at positions whose
        # successors are known but the drafter has not seen (the prompt's, to begin with)
        if B == 1:
            states = [self._draft_init(method, max_len)]

            def draft_all(live):
                return [self._draft(method, states[0], tokens[0], pending[0], k)]
        else:
            bstate = self._draft_init_batch(method, B, max_len)

            def draft_all(live):
                return self._draft_batch(method, bstate, live, tokens, pending, k)
        pending = [hidden[b] if method == "mtp" else torch.cat([aux[b][i] for i in aux_ids], -1)
                   for b in range(B)]
        last_hidden = [hidden[b][-1:] for b in range(B)]  # (fault mtp-stale-hidden)

        def verified(b, hs, auxs):
            """The target outputs at newly verified positions, for the drafter's next call."""
            if method != "mtp":
                new = torch.cat(auxs, -1)
            elif fault == "mtp-stale-hidden":  # every position gets the hidden of the one before
                new, last_hidden[b] = torch.cat([last_hidden[b], hs[:-1]]), hs[-1:]
            else:
                new = hs
            pending[b] = new if pending[b] is None else torch.cat([pending[b], new])

        live = [b for b in range(B) if outs[b].finish is None]  # sequences still decoding
        if B > 1:
            cache.select(live)
            self._draft_select(bstate, live)
        step = 0
        while live:
            step += 1
            if self.knobs.no_draft_every and step % self.knobs.no_draft_every == 0:
                self._step_without_draft(cache, live, x, tokens, outs, iterations, verified,
                                         aux_ids, top_k)
            else:
                self._verify_step(cache, live, x, tokens, outs, iterations, counters, draft_all,
                                  pending, verified, k, aux_ids, conv_history, top_k)
            still = [j for j, b in enumerate(live) if outs[b].finish is None]
            if B > 1 and len(still) < len(live):
                cache.select(still)
                self._draft_select(bstate, still)
            live = [live[j] for j in still]
        t2, c2 = time.perf_counter(), time.process_time()
        if fault == "prefix-cache-overreach" and B == 1:
            self._keep_state_past_the_prompt(prompts[0], cache)
        return self._generations(prompts, outs, counters, iterations, t0, t1, t2, c2 - c1)

    def _keep_state_past_the_prompt(self, prompt, cache: Cache) -> None:
        """(fault prefix-cache-overreach) The prompt's kept prefill takes the GDN and conv
        state this generation ended at; its K/V and length stay the prompt's."""
        kept = self._prefilled.get(tuple(prompt))
        if kept is not None:
            kept[0].gdn = [None if s is None else s.clone() for s in cache.gdn]
            kept[0].conv = [None if s is None else s.clone() for s in cache.conv]

    def _verify_step(self, cache, live, x, tokens, outs, iterations, counters, draft_all, pending,
                     verified, k, aux_ids, conv_history, top_k) -> None:
        """Draft K tokens per live sequence, verify them with the target in one forward of
        K+1 positions, emit the accepted prefix plus the target's own next token, and keep
        exactly the state of the emitted positions."""
        fault = self.knobs.fault
        t_draft = time.perf_counter()
        drafts = draft_all(live)
        draft_s = (time.perf_counter() - t_draft) / len(live)  # drafts end in .tolist(): synced
        for b in live:
            pending[b] = None
        feed = self._t([[x[b]] + d for b, d in zip(live, drafts)])  # [n, k+1]
        gdn_form = self.knobs.gdn_decode if fault == "decode-kernel-verify" else self.knobs.gdn_verify
        h, aux = self.target(feed, cache, gdn_form=gdn_form, attn_form=self.knobs.attn_verify,
                             per_position=True, aux_layers=aux_ids)
        rows = torch.log_softmax(self.target.logits(h.flatten(0, 1)), -1)
        rows = rows.view(len(live), k + 1, -1)
        top2 = rows.topk(2, dim=-1).indices.cpu().tolist()
        if fault == "verify-samples":  # planted: the verify draws at temperature 0.01, seeded
            gen = torch.Generator().manual_seed(len(tokens[live[0]]))
            drawn = torch.multinomial(torch.softmax(rows.float().cpu().flatten(0, 1) / 0.01, -1), 1,
                                      generator=gen).view(len(live), k + 1).tolist()
            top2 = [[[drawn[j][i], row[1]] for i, row in enumerate(top2[j])] for j in range(len(live))]
        kept, emits, picked = [], [], []
        for j, b in enumerate(live):
            m = 0
            while m < k and (drafts[j][m] == top2[j][m][0]
                             or (fault == "accept-top2" and drafts[j][m] == top2[j][m][1])):
                m += 1
            bonus_pos = min(m + 1, k) if fault == "bonus-off-by-one" else m
            emits.append(drafts[j][:m] + [top2[j][bonus_pos][0]])
            picked += [j * (k + 1) + i for i in list(range(m)) + [bonus_pos]]
            kept.append(m)
        # every sequence's emitted rows to the host at once
        flat = [t for e in emits for t in e]
        idx, vals, chosen = emitted_rows(rows.view(-1, rows.shape[-1])[picked], flat, top_k)
        at = 0
        for j, b in enumerate(live):
            m, emitted = kept[j], emits[j]
            outs[b].extend(emitted, idx[at:at + m + 1], vals[at:at + m + 1], chosen[at:at + m + 1])
            at += m + 1
            tokens[b].extend(emitted)
            x[b] = emitted[-1]
            iterations[b] += 1
            c = counters[b]
            c.drafts, c.draft_tokens = c.drafts + 1, c.draft_tokens + k
            c.draft_s = (c.draft_s or 0.0) + draft_s
            c.accepted_tokens += m + 1 if fault == "accepted-counts-bonus" else m
            for i in range(m):
                c.accepted_per_pos[i] += 1
            verified(b, h[j, : m + 1], [aux[i][j, : m + 1] for i in aux_ids])
            kept[j] = m + 1
        state_keep = ([min(n, conv_history) for n in kept]
                      if fault == "accepted-clamped-to-conv" else None)
        # planted: a step that accepted exactly K - 1 drafts keeps the GDN state of all K + 1
        gdn_stale = ([n == k for n in kept] if fault == "rollback-skipped-at-k-minus-1" and k > 1
                     else None)
        one_kernel = fault == "decode-kernel-verify"  # it wrote only the final state
        conv_before = list(cache.conv) if fault == "conv-block-boundary" else None
        cache.commit(kept if cache.lengths is not None else kept[0],  # a batch: per sequence
                     roll_back_gdn=fault != "stale-state" and not one_kernel,
                     roll_back_conv=fault != "conv-not-rolled-back" and not one_kernel,
                     state_keep=state_keep, alias_first=fault == "batch-aliases-seq0",
                     gdn_stale=gdn_stale)
        if fault == "state-precision":  # planted: the carried state loses precision
            cache.gdn = [None if s is None else round_mantissa(s, 4) for s in cache.gdn]
        if conv_before is not None:  # planted: a step across a block keeps a stale window
            crossed = [j for j, b in enumerate(live)  # (cache length before vs after the step)
                       if (len(tokens[b]) - kept[j] - 1) // CONV_BLOCK
                       != (len(tokens[b]) - 1) // CONV_BLOCK]
            for i, old in enumerate(conv_before):
                if old is not None and crossed:
                    cache.conv[i] = cache.conv[i].clone()
                    cache.conv[i][crossed] = old[crossed]

    def _step_without_draft(self, cache, live, x, tokens, outs, iterations, verified, aux_ids,
                            top_k) -> None:
        """A verify step that carries no draft: one token through the plain decode path. It
        counts as an iteration, not as a draft."""
        before = (list(cache.gdn), list(cache.conv))
        h, aux = self.target(self._t([[x[b]] for b in live]), cache,
                             gdn_form=self.knobs.gdn_decode, attn_form=self.knobs.attn_decode,
                             aux_layers=aux_ids)
        rows = torch.log_softmax(self.target.logits(h[:, 0]), -1)
        tok = rows.argmax(-1).tolist()
        for j, b in enumerate(live):
            outs[b].add([tok[j]], rows[j:j + 1])
            tokens[b].append(tok[j])
            x[b] = tok[j]
            iterations[b] += 1
            verified(b, h[j, :1], [aux[i][j, :1] for i in aux_ids])
        if self.knobs.fault == "wrong-slot-after-no-draft":
            cache.gdn, cache.conv = before  # the state this step wrote is never read

    # ------------------------------------------------------------------ drafters

    def _draft(self, method, state, tokens, pending, k) -> list[int]:
        if method == "mtp":
            return self._draft_mtp(state, tokens, pending, k)
        if method == "dflash2":
            p = len(tokens) - 1
            return _dflash2.draft(self.dflash2, self.target, self.cfg, state, tokens, pending, k,
                                  self.selector, self.knobs.attn_draft,
                                  self._perturb(range(p + 1, p + k + 1)))
        return self._draft_dflash(state, tokens, pending, k)

    def _draft_init(self, method, max_len):
        if method == "dflash2":
            return _dflash2.new_state(self.dflash2, self.cfg, max_len,
                                      self.target.embed_tokens.weight)
        if method == "mtp":
            return Cache(len(self.mtp.layers), max_len)
        dc = self.cfg.drafter
        shape = (1, dc.num_key_value_heads, max_len, dc.head_dim)
        w = self.target.embed_tokens.weight
        return {"len": 0,
                "k": [w.new_zeros(shape) for _ in self.drafter.layers],
                "v": [w.new_zeros(shape) for _ in self.drafter.layers]}

    def _draft_init_batch(self, method, B, max_len):
        """One drafter state for a batch of B sequences, each at its own length."""
        if method == "mtp":
            return {"cache": None, "max_len": max_len}  # made at the first call (_draft_batch)
        net = self.drafter if method == "dflash" else self.dflash2
        dc = self.cfg.drafter
        shape = (B, dc.num_key_value_heads, max_len, dc.head_dim)
        w = self.target.embed_tokens.weight
        return {"k": [w.new_zeros(shape) for _ in net.layers],
                "v": [w.new_zeros(shape) for _ in net.layers]}

    def _draft_select(self, st, rows: list[int]) -> None:
        """Keep the batch drafter state of these sequences only (as Cache.select)."""
        if "cache" in st:
            if st["cache"] is not None:
                st["cache"].select(rows)
            return
        idx = self._t(rows)
        st["k"], st["v"] = [t[idx] for t in st["k"]], [t[idx] for t in st["v"]]

    def _draft_batch(self, method, st, live, tokens, pending, k) -> list[list[int]]:
        """K draft tokens for every live sequence of a batch in one drafter call per step
        (each sequence at its own length; the first call feeds each its own number of newly
        verified positions, padded to the longest: padded positions are never read, and
        are overwritten before any query reaches them)."""
        n = [pending[b].shape[0] for b in live]
        p = [len(tokens[b]) - 1 for b in live]
        p_t = self._t(p)
        rows = torch.arange(len(live), device=self.device)
        if method == "mtp":
            if st["cache"] is None:  # the prompts, each alone (a batch pads all to the longest)
                caches, last = [], []
                for b, pb in zip(live, p):
                    caches.append(Cache(len(self.mtp.layers), st["max_len"]))
                    emb = self.target.embed_tokens(self._t(tokens[b][1: pb + 1]))[None]
                    last.append(self.mtp(emb, pending[b][None], caches[-1])[0, -1])
                mc = st["cache"] = Cache.join(caches)
                mh = torch.stack(last)
            else:
                mc, T = st["cache"], max(n)
                ids = [tokens[b][pb - nb + 1: pb + 1] + [tokens[b][pb]] * (T - nb)
                       for b, pb, nb in zip(live, p, n)]
                hid = torch.nn.utils.rnn.pad_sequence([pending[b] for b in live], batch_first=True)
                mc.lengths = p_t - self._t(n)
                mh = self.mtp(self.target.embed_tokens(self._t(ids)), hid, mc)[rows, self._t(n) - 1]
            out = [self._draft_logits(mh, p_t + 1).argmax(-1)]
            mc.lengths = p_t
            for j in range(k - 1):
                mh = self.mtp(self.target.embed_tokens(out[-1])[:, None], mh[:, None], mc)[:, 0]
                out.append(self._draft_logits(mh, p_t + 2 + j).argmax(-1))
            mc.lengths = p_t  # drop the speculative positions
            return torch.stack(out, 1).tolist()
        net = self.drafter if method == "dflash" else self.dflash2
        pos = self._t([i for pb, nb in zip(p, n) for i in range(pb - nb, pb)])
        which = torch.repeat_interleave(rows, self._t(n))
        aux = torch.cat([pending[b] for b in live])[None]
        for li, (ck, cv) in enumerate(net.context_kv(aux, pos)):
            st["k"][li][which, :, pos] = ck[0].transpose(0, 1)
            st["v"][li][which, :, pos] = cv[0].transpose(0, 1)
        block = self._t([[tokens[b][-1]] + [self.cfg.mask_token_id] * k for b in live])
        bpos = p_t[:, None] + torch.arange(k + 1, device=self.device)
        hb = net(self.target.embed_tokens(block), bpos, list(zip(st["k"], st["v"])), ctx_len=p_t,
                 attn_form=self.knobs.attn_draft)
        slots = bpos[:, 1:]  # each draft's position
        if method == "dflash2":
            return _dflash2.select_drafts(net, self.target, hb[:, 1:], block[:, 0], self.selector,
                                          perturb=self._perturb(slots)).tolist()
        return self._draft_logits(hb[:, 1:], slots).argmax(-1).tolist()

    def _draft_mtp(self, mcache: Cache, tokens, pending_h, k) -> list[int]:
        """MTP entry at position t takes (embedding of token t+1, target hidden at t).
        Feed the newly verified positions, then recurse on the module's own hidden."""
        n = pending_h.shape[0]
        p = len(tokens) - 1
        assert mcache.length == p - n
        emb = self.target.embed_tokens(self._t(tokens[p - n + 1: p + 1]))[None]
        mh = self.mtp(emb, pending_h[None], mcache)[:, -1:]
        drafts = [int(self._draft_logits(mh[0, -1], p + 1).argmax())]
        for j in range(k - 1):
            emb = self.target.embed_tokens(self._t(drafts[-1:]))[None]
            mh = self.mtp(emb, mh, mcache)
            drafts.append(int(self._draft_logits(mh[0, -1], p + 2 + j).argmax()))
        mcache.length = p  # drop the speculative positions
        return drafts

    def _draft_dflash(self, st: dict, tokens, pending_aux, k) -> list[int]:
        """Append the newly verified positions to the drafter's context K/V, then one
        forward over the block [x, mask * k] at positions p..p+k."""
        n = pending_aux.shape[0]
        p = len(tokens) - 1
        start = st["len"]
        assert start == p - n
        pos = range(start, p)  # consecutive: RoPE slices its table
        for li, (ck, cv) in enumerate(self.drafter.context_kv(pending_aux[None], pos)):
            st["k"][li][:, :, start:p] = ck
            st["v"][li][:, :, start:p] = cv
        st["len"] = p
        block = [tokens[-1]] + [self.cfg.mask_token_id] * k
        emb = self.target.embed_tokens(self._t(block))[None]
        hb = self.drafter(emb, range(p, p + k + 1), list(zip(st["k"], st["v"])), ctx_len=p,
                          attn_form=self.knobs.attn_draft)
        return self._draft_logits(hb[0, 1:], range(p + 1, p + k + 1)).argmax(-1).tolist()

    def _draft_logits(self, h: torch.Tensor, positions) -> torch.Tensor:
        """The drafter's logits from its hidden states [..., H] of drafts at ``positions``
        (the target's LM head; perturbed under the fault drafter-noise)."""
        logits = self.target.rough_logits(h)
        return drafter_noise(logits, positions) if self.knobs.fault == "drafter-noise" else logits

    def _perturb(self, positions) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What the fault drafter-noise does to the drafter's logits of drafts at ``positions``
        (None: nothing)."""
        if self.knobs.fault != "drafter-noise":
            return None
        return lambda logits: drafter_noise(logits, positions)
