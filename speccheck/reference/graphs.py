"""Single-stream greedy decoding with every step recorded once as a CUDA graph and replayed.

On a GPU this model is bound by the host, not by the GPU: a decode step is ~400 kernels of a
few microseconds each, and PyTorch's eager dispatch of each costs more than the kernel. Here
each step — the one-token decode; the spec verify of K+1 positions with its acceptance and
exact rollback; the MTP, DFlash or DFlash2 draft — works on buffers at fixed addresses
(:meth:`.model.Cache.static_for`: lengths on the device, every position attended with the
ones past the sequence's end masked, states updated in place), is captured once as a graph
and then replayed (a speculative iteration, draft then verify, as one graph of the two), and
the host reads back only what the step emits (one copy per step). The next step is queued
before the host waits for this one's output (:class:`_Ahead`; a step needs nothing from the
host), so the GPU never waits for a launch and the host's work overlaps the GPU's, as vLLM's
async scheduling does. Nothing is queued past a step that may reach
``max_tokens``; a generation that ends at end-of-sequence leaves one step run past its end,
whose output is dropped.

The networks, the greedy rule (argmax, lowest id on exact ties), the acceptance (the longest
draft prefix equal to the target's own tokens, plus the target's next token) and the rollback
(the state after the last kept position) are Decoder's; only the bookkeeping moves to the
device. Graphs and buffers are kept per capacity (positions rounded up to
:data:`CAPACITY_STEP`), so prompts of similar length share them. Decoder uses this for one
prompt at a time on CUDA without planted faults (engine arg ``cuda_graphs``); on CPU the same
steps run eagerly (:class:`Replay` without a graph), which is how the tests check them.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from speccheck.types import SpecCounters
from speccheck.verify.ties import canonical_rows

from . import dflash2 as _dflash2
from .model import Cache
from .steps import Generation, _Out, _sync

#: capacities (positions) are rounded up to a multiple of this, so that graphs are shared
CAPACITY_STEP = 512


def capacity(positions: int) -> int:
    return -(-positions // CAPACITY_STEP) * CAPACITY_STEP


class Replay:
    """``fn`` (no arguments; it reads and writes fixed buffers) recorded as a CUDA graph after
    one warm-up run on a side stream (which builds lazily cached tensors and compiles Triton
    kernels outside the capture); calling it replays the graph. Without CUDA it calls ``fn``.
    The warm-up really runs ``fn``: capture before filling the buffers with a request.

    ``compile``: on CUDA, ``fn`` is first run eagerly (it builds the weight-only caches the
    trace then reads), then ``torch.compile``'d and warmed up again, which compiles it; the
    capture records the compiled kernels, so a replay never runs the compiler's host code."""

    #: why a capture failed, per step name (the step then runs eagerly; the bench prints it)
    failures: dict[str, str] = {}

    def __init__(self, fn, device: torch.device, name: str = "", compile: bool = False):
        self.fn, self.graph = fn, None
        if device.type == "cuda":
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                if compile:
                    fn()
                    # each step function is one code object traced once per (capacity, K)
                    torch._dynamo.config.recompile_limit = max(
                        torch._dynamo.config.recompile_limit, 256)
                    fn = torch.compile(fn, dynamic=False)
                fn()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    fn()
            except RuntimeError as e:  # an op that cannot be captured: stay eager, say why
                Replay.failures[name or fn.__name__] = " ".join(str(e).split())[:300]
            else:
                self.graph = graph
            self.fn = fn  # (compiled, where it was)

    def __call__(self) -> None:
        if self.graph is None:
            self.fn()
        else:
            self.graph.replay()

    def gpu_seconds(self, in_a_row: int = 1) -> float:
        """GPU seconds per replay of ``in_a_row`` replays one after the other (CUDA events)."""
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(in_a_row):
            self()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1000.0 / in_a_row


class _Ahead:
    """A step queued one ahead of the one the host reads: each step's output is copied into
    one of two host buffers (pinned, without blocking) and an event marks it; ``next()``
    queues the following step, then waits for this one's copy. The GPU never waits for the
    host to launch a graph, and the host's emitting overlaps the GPU's next step (the steps
    need nothing from the host). Where the step read now may end the generation by length,
    the caller says so (``more=False``) and nothing is queued past it; a generation that ends
    otherwise (end-of-sequence) leaves one step run past its end."""

    def __init__(self, step, out: torch.Tensor):
        self.step, self.out, self.cuda = step, out, out.device.type == "cuda"
        self.host = [torch.empty(out.shape, dtype=out.dtype, pin_memory=self.cuda)
                     for _ in range(2)]
        self.done = [torch.cuda.Event() if self.cuda else None for _ in range(2)]
        self.slot = 0  # the oldest queued step's buffer
        self.queued = 0  # steps queued and not read yet

    def _queue(self) -> None:
        slot = (self.slot + self.queued) % 2
        self.step()
        self.host[slot].copy_(self.out, non_blocking=self.cuda)
        if self.cuda:
            self.done[slot].record()
        self.queued += 1

    def next(self, more: bool = True) -> torch.Tensor:
        """The output of the oldest queued step (queued now if none is); with ``more``, the
        step after it is queued first."""
        if self.queued == 0:
            self._queue()
        if more and self.queued == 1:
            self._queue()
        slot, self.slot = self.slot, 1 - self.slot
        self.queued -= 1
        if self.cuda:
            self.done[slot].synchronize()
        return self.host[slot]


class Buffers:
    """Everything the graphs of one capacity read and write: the target's static cache, the
    drafters' (MTP cache, DFlash context K/V), the step inputs and the packed outputs."""

    def __init__(self, dec, cap: int):
        t = dec.target
        dev = dec.device
        self.cap = cap
        self.cache = Cache.static_for(t.layers, cap)
        self.mtp_cache = None if dec.mtp is None else Cache.static_for(dec.mtp.layers, cap)
        dc = dec.cfg.drafter
        w = t.embed_tokens.weight
        self.ctx = {}  # id of a drafter network -> its context ([K per layer], [V per layer])
        for net in (dec.drafter, dec.dflash2):
            if net is not None:
                shape = (1, dc.num_key_value_heads, cap, dc.head_dim)
                self.ctx[id(net)] = ([w.new_zeros(shape) for _ in net.layers],
                                     [w.new_zeros(shape) for _ in net.layers])
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=dev)  # the next token to feed
        self.p = torch.zeros(1, dtype=torch.long, device=dev)  # the anchor's position
        self.graphs: dict = {}
        self.dev = dev

    def reset(self, spec: dict | None = None) -> None:
        """Every buffer back to empty; with a speculative step's buffers ``spec``
        (:meth:`GraphDecoding._spec_steps`), at position 1 with one kept position pending,
        a valid state to run a draft or a verify from."""
        self.cache.reset()
        if self.mtp_cache is not None:
            self.mtp_cache.reset()
        for ks, vs in self.ctx.values():
            for x in ks + vs:
                x.zero_()
        self.tok.zero_()
        self.p.zero_()
        if spec is not None:
            spec["pend_n"].fill_(1)
            self.p.fill_(1)


class GraphDecoding:
    """Decoder's baseline and speculative loops for one prompt, on :class:`Buffers` and
    :class:`Replay` steps."""

    def __init__(self, decoder):
        self.d = decoder
        self.buffers: dict[int, Buffers] = {}

    def handles(self, method: str, batch: int) -> bool:
        k = self.d.knobs
        return batch == 1 and k.fault is None and not k.no_draft_every and \
            method in ("baseline", "mtp", "dflash", "dflash2")

    def _buffers(self, cap: int) -> Buffers:
        if cap not in self.buffers:
            self.buffers[cap] = Buffers(self.d, cap)
        return self.buffers[cap]

    # ------------------------------------------------------------------ baseline

    def baseline(self, prompt: list[int], max_tokens: int, top_k: int, ignore_eos: bool, emit):

        d = self.d
        B = self._buffers(capacity(len(prompt) + max_tokens + 3))  # (+1: the step past the end)
        key = ("decode", top_k)
        if key not in B.graphs:
            B.graphs[key] = self._decode_step(B, top_k)
        step, out_buf = B.graphs[key]
        out = _Out(max_tokens, d.cfg.eos_token_id, top_k, ignore_eos=ignore_eos, emit=emit)
        t0 = time.perf_counter()
        B.reset()
        h, _ = d.target(d._t(prompt)[None], B.cache, gdn_form=d.knobs.gdn_prefill,
                        attn_form=d.knobs.attn_prefill)
        rows = torch.log_softmax(d.target.logits(h[:, -1]), -1)
        B.tok.copy_(rows.argmax(-1, keepdim=True))
        self._emit(out, _pack(rows, B.tok[0], top_k).cpu(), 1, top_k)
        _sync(d.device)
        t1 = time.perf_counter()
        steps = 0
        ahead = _Ahead(step, out_buf)
        while out.finish is None:
            packed = ahead.next(more=out.max_tokens - len(out.tokens) > 1)
            steps += 1
            self._emit(out, packed, 1, top_k)
        _sync(d.device)  # a step launched past the end (at end-of-sequence) counts too
        t2 = time.perf_counter()
        return Generation(out.tokens, out.lps, np.array(out.tk_ids), np.array(out.tk_lps),
                          out.finish, t1 - t0, t2 - t1, None, steps)

    def _decode_step(self, B: Buffers, top_k: int):
        d = self.d
        out = torch.zeros(2 * top_k + 1, dtype=torch.float64, device=B.dev)

        def decode():
            h, _ = d.target(B.tok, B.cache, gdn_form=d.knobs.gdn_decode,
                            attn_form=d.knobs.attn_decode)
            rows = torch.log_softmax(d.target.logits(h[:, 0]), -1)
            B.tok.copy_(rows.argmax(-1, keepdim=True))
            out.copy_(_pack(rows, B.tok[0], top_k))

        step = Replay(decode, B.dev, "decode", d.knobs.compile)
        B.reset()  # the warm-up ran on the buffers
        return step, out

    # ------------------------------------------------------------------ speculative

    def speculative(self, prompt: list[int], max_tokens: int, method: str, k: int, top_k: int,
                    ignore_eos: bool, emit):

        d = self.d
        aux_ids = tuple(d.cfg.drafter.target_layer_ids) if method != "mtp" else ()
        # room for the iteration past the end too
        B = self._buffers(capacity(len(prompt) + max_tokens + 2 * (k + 1) + 4))
        key = (method, k, top_k)
        if key not in B.graphs:
            B.graphs[key] = self._spec_steps(B, method, k, top_k, aux_ids)
        draft, verify, both, st = B.graphs[key]
        out = _Out(max_tokens, d.cfg.eos_token_id, top_k, ignore_eos=ignore_eos, emit=emit)
        counters = SpecCounters(accepted_per_pos=[0] * k)
        t0 = time.perf_counter()
        B.reset()
        h, aux = d.target(d._t(prompt)[None], B.cache, gdn_form=d.knobs.gdn_prefill,
                          attn_form=d.knobs.attn_prefill, aux_layers=aux_ids)
        rows = torch.log_softmax(d.target.logits(h[:, -1]), -1)
        x = rows.argmax(-1, keepdim=True)  # [1, 1]
        self._emit(out, _pack(rows, x[0], top_k).cpu(), 1, top_k)
        # the drafter sees the prompt's positions but the last; the last is left pending, as
        # the positions a verify step keeps are (so every draft step has one at least)
        n = len(prompt)
        feats = h[0] if method == "mtp" else torch.cat([aux[i][0] for i in aux_ids], -1)
        if method == "mtp":
            if n > 1:
                emb = d.target.embed_tokens(d._t(prompt[1:]))[None]
                d.mtp(emb, feats[None, : n - 1], B.mtp_cache)
            st["pend_tok"][0, 0] = x[0, 0]
        else:
            net = d.drafter if method == "dflash" else d.dflash2
            ks, vs = B.ctx[id(net)]
            if n > 1:
                pos = torch.arange(n - 1, device=d.device)
                for li, (ck, cv) in enumerate(net.context_kv(feats[None, : n - 1], pos)):
                    ks[li][:, :, : n - 1] = ck
                    vs[li][:, :, : n - 1] = cv
        st["pend"][0, 0] = feats[n - 1]
        st["pend_n"].fill_(1)
        B.p.fill_(n)
        B.tok.copy_(x)
        _sync(d.device)
        t1 = time.perf_counter()
        draft_times: list[float] = []  # seconds of each iteration's draft (eager steps)
        iterations = 0

        def iteration():
            if both is not None:  # a CUDA graph of the draft and the verify: one launch
                both()
                return
            t = time.perf_counter()
            draft()
            draft_times.append(time.perf_counter() - t)
            verify()

        ahead = _Ahead(iteration, st["out"])
        while out.finish is None:
            # an iteration emits 1 to k + 1 tokens: the next is queued while this one cannot
            # reach max_tokens (near the end the host waits for each iteration instead)
            res = ahead.next(more=out.max_tokens - len(out.tokens) > k + 1)
            m = int(res[-1])
            self._emit(out, res, m + 1, top_k, k + 1)
            iterations += 1
            counters.drafts += 1
            counters.draft_tokens += k
            counters.accepted_tokens += m
            for i in range(m):
                counters.accepted_per_pos[i] += 1
        _sync(d.device)  # an iteration launched past the end (end-of-sequence) counts too
        t2 = time.perf_counter()
        if not iterations:
            counters.draft_s = None
        elif both is not None:
            # inside one graph the draft cannot be timed apart: its graph replayed alone here,
            # at the generation's final length (it writes only the drafter's own buffers)
            alone = np.median([draft.gpu_seconds() for _ in range(3)])
            counters.draft_s = iterations * float(alone)
        else:
            counters.draft_s = sum(draft_times[:iterations])  # (not the one past the end)
        return Generation(out.tokens, out.lps, np.array(out.tk_ids), np.array(out.tk_lps),
                          out.finish, t1 - t0, t2 - t1, counters, iterations)

    def _spec_steps(self, B: Buffers, method: str, k: int, top_k: int, aux_ids: tuple):
        """The draft and verify steps of one (method, K) and the buffers between them:
        ``pend`` / ``pend_n`` the target features of the positions the last verify kept (for
        the drafter), ``pend_tok`` their successors (MTP's inputs), ``drafts``, ``out``."""
        d = self.d
        dev, H = B.dev, d.cfg.hidden_size
        width = H * (len(aux_ids) or 1)
        w = d.target.embed_tokens.weight
        # pend in the dtype the drafter rounds it to (MTP: the target's; DFlash: its fc's), so
        # the verify's copy rounds it and the draft reads it as it is
        net = {"mtp": None, "dflash": d.drafter, "dflash2": d.dflash2}[method]
        pend_dtype = w.dtype if net is None else net.fc.weight.dtype
        st = {"pend": torch.zeros(1, k + 1, width, dtype=pend_dtype, device=dev),
              "pend_n": torch.zeros(1, dtype=torch.long, device=dev),
              "pend_tok": torch.zeros(1, k + 1, dtype=torch.long, device=dev),
              "drafts": torch.zeros(1, k, dtype=torch.long, device=dev),
              "out": torch.zeros((k + 1) * (2 * top_k + 1) + 1, dtype=torch.float64, device=dev)}
        ar = torch.arange(k + 1, device=dev)

        if method == "mtp":
            mc = B.mtp_cache

            def draft():
                # the kept positions p-n..p-1 (rows past n are padding, never read: their keys
                # lie past every query that counts and are overwritten by the recursion)
                mc.lengths.copy_(B.p - st["pend_n"])
                emb = d.target.embed_tokens(st["pend_tok"])
                mh = d.mtp(emb, st["pend"].float(), mc)
                last = (st["pend_n"] - 1).view(1, 1, 1).expand(1, 1, H)
                mh = mh.gather(1, last)[:, 0]  # [1, H]
                mc.lengths.copy_(B.p)
                toks = [d.target.rough_logits(mh).argmax(-1)]
                for _ in range(k - 1):
                    mh = d.mtp(d.target.embed_tokens(toks[-1])[:, None], mh[:, None], mc)[:, 0]
                    toks.append(d.target.rough_logits(mh).argmax(-1))
                st["drafts"].copy_(torch.stack(toks, 1))
        else:
            ks, vs = B.ctx[id(net)]
            block_tail = torch.full((1, k), d.cfg.mask_token_id, dtype=torch.long, device=dev)

            def draft():
                # the kept positions' context K/V at p-n..p-1; rows past n land on the block's
                # own positions p.., which the block overwrites before it attends
                pos = B.p - st["pend_n"] + ar
                for li, (ck, cv) in enumerate(net.context_kv(st["pend"], pos)):
                    ks[li][:, :, pos] = ck
                    vs[li][:, :, pos] = cv
                block = torch.cat([B.tok, block_tail], 1)
                hb = net(d.target.embed_tokens(block), B.p[:, None] + ar, list(zip(ks, vs)),
                         ctx_len=B.p, keys=B.cap, attn_form=d.knobs.attn_draft)
                if method == "dflash2":  # (the anchor is B.tok: block[:, 0] would be a copy)
                    toks = _dflash2.select_drafts(net, d.target, hb[:, 1:], B.tok[:, 0],
                                                  d.selector, out=st["drafts"])
                else:
                    toks = d.target.rough_logits(hb[:, 1:]).argmax(-1)
                if toks is not st["drafts"]:
                    st["drafts"].copy_(toks)

        def verify():
            feed = torch.cat([B.tok, st["drafts"]], 1)  # the anchor at p, the drafts after it
            h, aux = d.target(feed, B.cache, gdn_form=d.knobs.gdn_verify,
                              attn_form=d.knobs.attn_verify, per_position=True, aux_layers=aux_ids)
            rows = torch.log_softmax(d.target.logits(h[0]), -1)  # [k+1, V]
            top1 = rows.argmax(-1)
            m = (st["drafts"][0] == top1[:k]).long().cumprod(0).sum(0, keepdim=True)  # [1]
            B.cache.commit_kept(m + 1)
            st["pend"].copy_(h if method == "mtp" else torch.cat([aux[i] for i in aux_ids], -1))
            st["pend_tok"].copy_(top1[None])
            st["pend_n"].copy_(m + 1)
            B.p.copy_(B.cache.lengths)
            B.tok.copy_(top1.gather(0, m)[None])  # the target's own token after the kept drafts
            st["out"].copy_(torch.cat([_pack(rows, top1, top_k), m.double()]))

        # warm-up and capture on the empty buffers (one kept position pending), then reset
        B.reset(st)
        drafting = Replay(draft, dev, f"{method} draft", d.knobs.compile)
        verifying = Replay(verify, dev, f"{method} verify", d.knobs.compile)
        both = None
        if drafting.graph is not None and verifying.graph is not None:
            # one iteration as one graph of the two (compiled) steps: one launch instead of two,
            # no gap between them (the draft's time is then measured apart: speculative())
            B.reset(st)
            both = Replay(lambda: (drafting.fn(), verifying.fn()), dev, f"{method} iteration")
        B.reset()
        return drafting, verifying, both, st

    # ------------------------------------------------------------------ host side

    @staticmethod
    def _emit(out, packed, n: int, top_k: int, rows: int | None = None) -> None:
        """Emit the first ``n`` of ``rows`` packed rows (see :func:`_pack`)."""
        rows = rows or n
        packed = packed.numpy()
        k2 = 2 * top_k + 1
        table = packed[: rows * k2].reshape(rows, k2)[:n]
        ids = table[:, :top_k].astype(np.int64)
        vals = table[:, top_k: 2 * top_k].astype(np.float32)
        tokens = table[:, 2 * top_k].astype(np.int64)
        ids, vals = canonical_rows(ids, vals)
        out.extend([int(t) for t in tokens], ids, vals, vals[:, 0].copy())


def _pack(rows: torch.Tensor, tokens: torch.Tensor, top_k: int) -> torch.Tensor:
    """Per row of log-probs [n, V] and its chosen token [n]: top-k ids, top-k logprobs, token,
    flattened in float64 (exact for all three), so one copy brings a step's output to the
    host. The chosen token is the row's argmax, so its logprob is the row's top-1 value."""
    vals, ids = rows.topk(top_k, dim=-1)
    return torch.cat([ids.double(), vals.double(), tokens.view(-1, 1).double()], 1).flatten()
