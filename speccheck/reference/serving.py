"""The reference model served as a serving engine serves it: continuous batching, a hybrid
prefix cache, a KV block budget with preemption and recompute, state slots reused across
requests (:class:`Server`, behind :meth:`ReferenceEngine.run_workload`).

One engine *step* advances every running request by one decode (baseline) or one draft +
verify (speculative) in one batched target forward, and in the same step prefills the requests
admitted at it (a *mixed* step when others decode). Requests are submitted at their arrival
step, at most ``max_in_flight`` run at once, and each runs in a *state slot* (its row of the
target's GDN / conv / K/V pool and of the drafter's state pool); a finished request frees its
slot for the next one.

Exactness (CPU): each request is prefilled alone through the path generate() takes, and the
batched decode, verify and drafting are row-invariant (kernels/cpu.py: a row's bits do not
depend on the batch), so a request served here gives the bits it gives alone, whatever joins,
leaves or shares its steps. Two regimes compute the same tokens along another path, so their
comparison is classified (by margin), not exact:

* the prefix cache (``prefix_cache=on``) prefills in pieces ending at each block boundary, to
  keep the hybrid state there (vLLM's "align" mode); a piece is not the same sum as one
  prefill of the whole prompt unless ``block_size`` is a multiple of the GDN chunk (64). A hit
  restores the state a miss computed, so hit and miss are the same bits;
* a recompute after preemption prefills prompt + generated tokens, whose state decode and
  verify had computed step by step.

With async scheduling (``async_scheduling=on``) the scheduler plans step n + 1 before step n's
outputs are known, as vLLM V1's async scheduler does: each running request holds K + 1
placeholder tokens for the step in flight, fixed up by the drafts that step rejected when its
outputs arrive; finishes and freed slots are seen one step late; the worker places each row
where the scheduler put it, corrected by the rejected count. The bits are those of synchronous
scheduling.

The planted faults of this regime (decode.FAULTS; outside a Server they change nothing, but
``short-prompt-verify``, which generate() also plants on a prompt of 1 + K tokens):
``join-contaminates``, ``slot-residue``, ``prefix-wrong-block``, ``short-prompt-verify``,
``preempt-loses-draft-state``, ``padded-row-real``, ``async-stale-accepted``,
``thinking-no-rollback``.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from speccheck.engines.base import padded_size, vllm_capture_sizes
from speccheck.types import Request, SpecCounters

from .decode import Decoder
from .model import Cache
from .steps import Generation, _Out, _sync, emitted_rows

#: tokens per cache block (vLLM's block_size): prefix-cache granularity and KV budget unit
DEFAULT_BLOCK_SIZE = 16
#: requests in flight when the workload names no limit (vLLM's max_num_seqs, small)
DEFAULT_MAX_IN_FLIGHT = 8
#: cache blocks the prefix cache keeps (each with a hybrid state, ~0.4 MB), least recently
#: used dropped first
PREFIX_CACHE_BLOCKS = 512
#: the requests a step may hold when the engine sizes its CUDA graphs (vLLM's max_num_seqs; the
#: axes put at most 32 in flight): the captured sizes follow vLLM's default rule from it
#: (engines.base.vllm_capture_sizes: 1, 2, 4, 8, 16, ... 64 tokens for the baseline; with
#: speculation multiples of 1 + K up to min(64 x (1 + K), 512) tokens, so K = 7 pads a batch of
#: 33 requests to 34); a batched step of another size is padded up to the next captured one,
#: past the largest it runs without a graph (what the fault padded-row-real and the shapes
#: axis's batch level are about). On CPU nothing is captured: the model only decides the padding
CAPTURE_MAX_SEQS = 32
#: the token id of a padding row (vLLM pads input ids with 0)
PAD_TOKEN = 0

#: workload knobs this engine reads (Workload.knobs) -> one-line doc
KNOBS = {
    "prefix_cache": "on | off: a prompt reuses the longest cached block-aligned prefix (its "
                    "K/V and the GDN + conv state at that boundary); absent: prompts prefill "
                    "whole, as generate() does",
    "block_size": f"tokens per cache block (default {DEFAULT_BLOCK_SIZE})",
    "kv_blocks": "KV blocks for all running requests together (absent: no limit); the newest "
                 "request is preempted and later recomputed when a step needs more",
    "async_scheduling": "on | off: the scheduler plans step n + 1 before step n's outputs are "
                        "known (vLLM V1's async scheduling): each running request holds K + 1 "
                        "placeholder tokens for the step in flight, fixed up by its rejected "
                        "drafts when the step completes; finishes and freed slots are seen a "
                        "step late; the worker places the step from the scheduler's count",
    "cudagraph_metrics": "on | off: the proof counts each batched step's rows, the captured "
                         "size it was padded up to and the steps past every captured size "
                         "(vLLM's cudagraph_metrics)",
}


def capture_sizes(k: int) -> tuple[int, ...]:
    """The batch sizes, in tokens, of the graphs this engine models for K drafts (0: the
    baseline): vLLM's default rule at max_num_seqs CAPTURE_MAX_SEQS."""
    return vllm_capture_sizes(CAPTURE_MAX_SEQS, 1 + k)


def blocks(n_tokens: int, block_size: int) -> int:
    return -(-n_tokens // block_size)


def parse_knobs(knobs: dict[str, str]) -> tuple[str | None, int, int | None]:
    """(prefix_cache, block_size, kv_blocks) from a workload's knobs; ValueError names a bad one
    (async_scheduling: :func:`async_knob`)."""
    unknown = sorted(set(knobs) - set(KNOBS))
    if unknown:
        raise ValueError(f"workload knob(s) {', '.join(unknown)} unknown to the reference engine; "
                         f"it reads " + "; ".join(f"{k} ({v})" for k, v in KNOBS.items()))
    prefix = knobs.get("prefix_cache")
    if prefix not in (None, "on", "off"):
        raise ValueError(f"workload knob prefix_cache={prefix!r}: give on or off")
    async_knob(knobs)
    if knobs.get("cudagraph_metrics", "off") not in ("on", "off"):
        raise ValueError(f"workload knob cudagraph_metrics={knobs['cudagraph_metrics']!r}: give on or off")
    out = []
    for key in ("block_size", "kv_blocks"):
        v = knobs.get(key)
        if v is not None and not (str(v).isdigit() and int(v) > 0):
            raise ValueError(f"workload knob {key}={v!r}: give a positive integer")
        out.append(None if v is None else int(v))
    return prefix, out[0] or DEFAULT_BLOCK_SIZE, out[1]


def async_knob(knobs: dict[str, str]) -> bool:
    v = knobs.get("async_scheduling", "off")
    if v not in ("on", "off"):
        raise ValueError(f"workload knob async_scheduling={v!r}: give on or off")
    return v == "on"


# --------------------------------------------------------------------------- state pools


def _gather(pool: Cache, slots: list[int]) -> Cache:
    """A batch cache of these slots' rows (copies), each at its own length."""
    idx = torch.tensor(slots, dtype=torch.long, device=pool.lengths.device)
    c = Cache(len(pool.gdn), pool.max_len)
    for name in ("gdn", "conv", "k", "v"):
        setattr(c, name, [None if t is None else t[idx] for t in getattr(pool, name)])
    c.lengths = pool.lengths[idx]
    return c


def _scatter(pool: Cache, slots: list[int], c: Cache) -> None:
    """Write a batch cache's rows back into these slots."""
    idx = torch.tensor(slots, dtype=torch.long, device=pool.lengths.device)
    for name in ("gdn", "conv", "k", "v"):
        for t, new in zip(getattr(pool, name), getattr(c, name)):
            if t is not None:
                t[idx] = new
    pool.lengths[idx] = c.lengths


def _put(pool: Cache, slot: int, c: Cache) -> None:
    """A single sequence's cache (a prefill) into one slot."""
    for name in ("gdn", "conv", "k", "v"):
        for t, new in zip(getattr(pool, name), getattr(c, name)):
            if t is not None and new is not None:
                t[slot] = new[0]
    pool.lengths[slot] = c.length


def _pool(layers, max_len: int, slots: int) -> Cache:
    """An empty pool of ``slots`` rows for these decoder layers (target or MTP)."""
    pool = Cache.static_for(layers, max_len, slots)
    pool.static = False
    return pool


# --------------------------------------------------------------------------- prefix cache


@dataclass
class _Block:
    """One full cache block of a prompt: its positions' K/V and the target outputs the
    drafters read, and the hybrid (GDN + conv) state at its end."""

    id: int  # allocation order (a physical block number)
    k: list  # per layer: [1, Hkv, block, D] or None (a linear-attention layer)
    v: list
    gdn: list  # per layer: the GDN state after the block's last position, or None
    conv: list
    hidden: torch.Tensor  # [block, H]
    aux: dict  # layer -> [block, H]


class BlockCache:
    """vLLM's prefix cache for a hybrid model, per block of ``block_size`` tokens keyed by the
    whole prefix up to its end: a request reuses the longest cached block-aligned prefix of its
    prompt (never all of it: the last token is computed, for the next token's logits)."""

    def __init__(self, max_blocks: int = PREFIX_CACHE_BLOCKS):
        self.max_blocks = max_blocks
        self.blocks: OrderedDict[tuple, _Block] = OrderedDict()
        self.by_id: dict[int, tuple] = {}
        self.next_id = 0

    def lookup(self, ids: list[int], block_size: int, layers) -> list[_Block]:
        """The chain of cached blocks of the longest hit (empty: a miss)."""
        chain = []
        for end in range(block_size, len(ids), block_size):  # end <= len(ids) - 1
            b = self.blocks.get(tuple(ids[:end]))
            if b is None or not set(layers) <= b.aux.keys():
                break
            chain.append(b)
        for end in range(block_size, (len(chain) + 1) * block_size, block_size):
            self.blocks.move_to_end(tuple(ids[:end]))
        return chain

    def store(self, key: tuple, block: _Block) -> None:
        if key in self.blocks:
            return
        self.blocks[key] = block
        self.by_id[block.id] = key
        while len(self.blocks) > self.max_blocks:
            _, old = self.blocks.popitem(last=False)
            self.by_id.pop(old.id, None)

    def allocate(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def after(self, block: _Block) -> _Block | None:
        """The block allocated right after this one (fault prefix-wrong-block)."""
        key = self.by_id.get(block.id + 1)
        return None if key is None else self.blocks.get(key)


# --------------------------------------------------------------------------- requests


@dataclass
class _Seq:
    """One request in the server: where it is, what it has emitted, its state slot."""

    i: int
    req: Request
    after: int | None  # index of the request that must finish first
    out: _Out
    state: str = "waiting"  # waiting | running | done
    slot: int | None = None
    order: int = -1  # admission counter: the newest running request is preempted first
    preempted: bool = False  # its next admission is a recompute
    joined: bool = False  # admitted while others decoded, its first step not taken yet
    fresh_draft: bool = True  # the drafter state of its slot is to be built from its context
    t_arrive: float = 0.0
    t_first: float | None = None
    t_done: float = 0.0


@dataclass
class Proof:
    """The server's own accounting of what a workload exercised."""

    steps: int = 0
    max_batch: int = 0
    mixed_steps: int = 0
    slot_reuses: int = 0
    prefix_hits: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    preempted: list = field(default_factory=list)  # request ids, once per preemption
    #: async scheduling: steps planned while the step before was in flight, and the requests'
    #: placeholder counts fixed up by rejected drafts when a step completed
    scheduled_ahead: int = 0
    placeholder_fixups: int = 0
    #: batched steps (decode or verify forwards): their sizes in requests, how many replayed a
    #: captured size (of those, padded up to it) and how many ran past every one (no graph)
    batch_sizes: set = field(default_factory=set)
    padded_steps: int = 0
    graph_steps: int = 0
    eager_steps: int = 0


class Server:
    """Serves workloads on one decoder's networks and knobs (its planted fault included). The
    prefix cache lives as long as the server: a long-lived process keeps it across workloads."""

    def __init__(self, decoder: Decoder):
        self.dec = decoder
        self.prefix = BlockCache()
        #: requests served since this server started (the engine keeps its own count too)
        self.served = 0

    # ------------------------------------------------------------------ the loop

    @torch.inference_mode()
    def serve(self, requests: list[Request], method: str, k: int, top_k: int,
              max_in_flight: int | None = None, knobs: dict[str, str] | None = None,
              thinking: frozenset[str] = frozenset()) -> tuple[list[Generation], dict]:
        """Every request to completion; (a Generation per request, in order; the proof).
        ``thinking``: the requests whose prompt the chat template rendered in thinking mode."""
        dec = self.dec
        prefix, bs, kv_blocks = parse_knobs(dict(knobs or {}))
        if method != "baseline":
            if method not in ("mtp", "dflash", "dflash2"):
                raise ValueError(f"unknown method {method!r}: choose baseline, mtp, dflash or dflash2")
            if k < 1:
                raise ValueError(f"method {method} needs K >= 1, got {k}")
            if {"mtp": dec.mtp, "dflash": dec.drafter, "dflash2": dec.dflash2}[method] is None:
                raise ValueError(f"method {method} needs its drafter weights")
        else:
            k = 0
        index = {r.id: i for i, r in enumerate(requests)}
        if len(index) != len(requests):
            raise ValueError("workload request ids must be unique")
        for r in requests:
            if not r.prompt_ids:
                raise ValueError(f"request {r.id}: empty prompt")
            if r.after is not None and r.after not in index:
                raise ValueError(f"request {r.id} comes after {r.after!r}, which is not in the workload")
        dec._arm()
        self.method, self.k, self.top_k = method, k, top_k
        self.block_size, self.kv_blocks = bs, kv_blocks
        self.prefix_on = prefix == "on"
        self.prefix_mode = prefix
        self.graph_metrics = (knobs or {}).get("cudagraph_metrics") == "on"
        self.capture = capture_sizes(k)
        fault = dec.knobs.fault
        self.aux_ids = tuple(dec.cfg.drafter.target_layer_ids) if method not in ("baseline", "mtp") else ()
        if fault == "dflash-wrong-layer":
            self.aux_ids = tuple(max(i - 1, 0) for i in self.aux_ids)
        n_slots = max_in_flight or DEFAULT_MAX_IN_FLIGHT
        self.max_len = max(len(r.prompt_ids) + r.prompt.max_tokens for r in requests) + k + 4
        self.pool = _pool(dec.target.layers, self.max_len, n_slots)
        self.dpool = None
        if method == "mtp":
            self.dpool = _pool(dec.mtp.layers, self.max_len, n_slots)
        elif method != "baseline":
            self.dpool = dec._draft_init_batch(method, n_slots, self.max_len)
        self.slot_used = [False] * n_slots
        self.free = list(range(n_slots))
        self.proof = Proof()

        seqs = [_Seq(i, r, None if r.after is None else index[r.after],
                     _Out(r.prompt.max_tokens, dec.cfg.eos_token_id, top_k,
                          cut_at_max=fault != "past-max-tokens", cut_at_eos=fault != "past-eos",
                          ignore_eos=r.prompt.ignore_eos))
                for i, r in enumerate(requests)]
        N = len(seqs)
        # per request, as Decoder._verify_step reads them (index = request)
        self.x = [0] * N
        self.tokens: list[list[int]] = [[] for _ in range(N)]
        self.outs = [s.out for s in seqs]
        self.iterations = [0] * N
        self.counters = [SpecCounters(accepted_per_pos=[0] * k) if k else None for _ in range(N)]
        self.pending: list = [None] * N
        self.last_hidden: list = [None] * N
        self.seqs = seqs
        self.thinking = [r.id in thinking for r in requests]
        # the scheduler's view of each request: its token count with the placeholders of the
        # steps scheduled and not completed (async scheduling: one step ahead), each such
        # step's placeholders, the tokens its completed steps left, where it placed the
        # request's latest step, whether that was while a step of it was in flight, and the
        # placeholders its last two completed steps rejected
        self.async_on = async_knob(dict(knobs or {}))
        self.sched_len = [0] * N
        self.flight: list[deque] = [deque() for _ in range(N)]
        self.done_len = [0] * N
        self.sched_pos = [0] * N
        self.ahead = [False] * N
        self.rejected = [0] * N
        self.rejected_before = [0] * N

        arrivals = deque(sorted(seqs, key=lambda s: (s.req.arrive_after, s.i)))
        waiting: deque[_Seq] = deque()
        running: list[_Seq] = []
        done, step, order = 0, 0, 0
        in_flight: list[_Seq] = []  # async: the requests of the step whose outputs are not seen yet
        while done < N:
            now = time.perf_counter()
            while arrivals and arrivals[0].req.arrive_after <= step:
                s = arrivals.popleft()
                s.t_arrive = now
                waiting.append(s)
            preempted = False
            if kv_blocks is not None:
                while self._blocks_needed(running) > kv_blocks:
                    if len(running) == 1:
                        raise RuntimeError(f"kv_blocks={kv_blocks}: request {running[0].req.id} alone "
                                         f"needs {self._blocks_needed(running)} blocks of {bs} tokens")
                    victim = max(running, key=lambda s: s.order)
                    running.remove(victim)
                    self._preempt(victim)
                    waiting.appendleft(victim)
                    preempted = True
            decoding = list(running)
            admitted = []
            # blocks this step uses: the running requests' next positions (with K lookahead
            # slots), and each admitted prompt's own (none ahead before a request has computed
            # tokens, as vLLM)
            held = self._blocks_needed(running)
            if not preempted:  # as vLLM: no admission in a step that preempted
                for s in list(waiting):
                    if len(running) >= n_slots:
                        break
                    if s.after is not None and seqs[s.after].state != "done":
                        continue
                    need = blocks(len(self._context(s)), bs)
                    if kv_blocks is not None and need > kv_blocks:
                        raise RuntimeError(f"kv_blocks={kv_blocks}: request {s.req.id} alone needs "
                                           f"{need} blocks of {bs} tokens")
                    if kv_blocks is not None and held + need > kv_blocks:
                        break
                    held += need
                    waiting.remove(s)
                    s.order, order = order, order + 1
                    self._admit(s, joined=bool(decoding))
                    running.append(s)
                    admitted.append(s)
            self._schedule(decoding)
            finished = []
            if self.async_on:  # planned; now the outputs of the step in flight arrive
                self.proof.scheduled_ahead += bool(in_flight and decoding)
                finished = self._complete(in_flight, running, waiting)
            # (async) a request that the step in flight finished was scheduled all the same; its
            # row is dropped, as vLLM discards its output
            live = [s for s in decoding if s.out.finish is None and s.state == "running"]
            if live:
                self._step(live)
            if live or admitted:
                self.proof.steps += 1
                self.proof.max_batch = max(self.proof.max_batch, len(live) + len(admitted))
                self.proof.mixed_steps += bool(live and admitted)
            if self.async_on:
                in_flight = live
            else:
                finished = self._complete(live, running, waiting)
            done += len(finished)
            if not (running or admitted or finished or arrivals or preempted) and waiting:
                raise RuntimeError("workload cannot finish: nothing runs and nothing can be admitted ("
                                 + ", ".join(s.req.id for s in waiting) + " wait: on a request "
                                 "that never runs, or for more KV blocks than the budget)")
            step += 1
        _sync(dec.device)
        self.served += N
        gens = [Generation(s.out.tokens, s.out.lps, np.array(s.out.tk_ids), np.array(s.out.tk_lps),
                           s.out.finish, (s.t_first or s.t_done) - s.t_arrive,
                           s.t_done - (s.t_first or s.t_done), self.counters[s.i],
                           self.iterations[s.i], None)
                for s in seqs]
        return gens, self._proof()

    def _proof(self) -> dict:
        p = self.proof
        out = {"requests": len(self.seqs), "steps": p.steps, "max_batch": p.max_batch,
               "mixed_steps": p.mixed_steps, "slot_reuses": p.slot_reuses,
               "block_size": self.block_size}
        if self.prefix_on:
            out.update(prefix_hits=p.prefix_hits, prefix_hit_tokens=p.prefix_hit_tokens)
        if self.kv_blocks is not None:
            out.update(kv_blocks=self.kv_blocks, preemptions=p.preemptions,
                       recomputed_tokens=p.recomputed_tokens,
                       preempted_requests=sorted(set(p.preempted)))
        if self.async_on:
            out.update(async_scheduling=1, steps_scheduled_ahead=p.scheduled_ahead,
                       placeholder_fixups=p.placeholder_fixups)
        if self.graph_metrics:
            out.update(capture_sizes=list(self.capture), tokens_per_request=1 + self.k,
                       batch_sizes=sorted(p.batch_sizes), padded_steps=p.padded_steps,
                       graph_steps=p.graph_steps, eager_steps=p.eager_steps)
        return out

    # ------------------------------------------------------------------ scheduling

    def _context(self, s: _Seq) -> list[int]:
        """What an admission prefills: the prompt, or after a preemption prompt + every
        token emitted so far (the recompute)."""
        return list(s.req.prompt_ids) + (list(s.out.tokens) if s.preempted else [])

    def _blocks_needed(self, running: list[_Seq]) -> int:
        """Blocks the running requests hold once this step has written its positions: a
        decode writes the last token, a verify K + 1 positions from it (vLLM's lookahead slots);
        counted on the scheduler's view (async: with the placeholders of the step in flight)."""
        return sum(blocks(self.sched_len[s.i] + self.k, self.block_size) for s in running)

    def _schedule(self, decoding: list[_Seq]) -> None:
        """Place each running request's next step where the scheduler's count says it starts
        (with async scheduling, before the step in flight has said how many drafts it kept),
        and hold its placeholders: K + 1 tokens (a verify keeps at most that), 1 decoding."""
        for s in decoding:
            i = s.i
            self.ahead[i] = bool(self.flight[i])
            self.sched_pos[i] = self.sched_len[i] - 1
            self.flight[i].append(1 + self.k)
            self.sched_len[i] += 1 + self.k

    def _complete(self, stepped: list[_Seq], running: list[_Seq], waiting) -> list[_Seq]:
        """A step's outputs reach the scheduler: each request's placeholders are fixed up by
        what the step rejected, and the requests it finished leave (their slots freed)."""
        for s in stepped:
            i = s.i
            if self.flight[i]:
                held = self.flight[i].popleft()
                rejected = held - (len(self.tokens[i]) - self.done_len[i])
                self.sched_len[i] -= rejected
                self.rejected_before[i], self.rejected[i] = self.rejected[i], rejected
                self.proof.placeholder_fixups += rejected > 0
            self.done_len[i] = len(self.tokens[i])
        finished = [s for s in running if s.out.finish is not None]
        finished += [s for s in stepped if s.out.finish is not None and s.state == "waiting"]
        for s in finished:
            if s in running:
                running.remove(s)
            else:  # (async) preempted while the step that finished it was in flight
                waiting.remove(s)
            self._release(s)
            s.state, s.t_done = "done", time.perf_counter()
        return finished

    def _placed(self, live: list[_Seq], c: Cache) -> None:
        """(async scheduling) The worker places each row where the scheduler put its step,
        corrected by the drafts the step in flight then rejected: its state's own length when
        right; the fault async-stale-accepted corrects by the step before's count."""
        stale = self.dec.knobs.fault == "async-stale-accepted"
        for j, s in enumerate(live):
            i = s.i
            fix = (self.rejected_before[i] if stale else self.rejected[i]) if self.ahead[i] else 0
            pos = min(max(self.sched_pos[i] - fix, 0), self.max_len - 1 - self.k)
            if not stale and pos != int(c.lengths[j]):
                raise RuntimeError(f"async scheduling: request {s.req.id} placed at {pos}, its state "
                                   f"is at {int(c.lengths[j])} (placeholder fix-up wrong)")
            c.lengths[j] = pos

    def _preempt(self, s: _Seq) -> None:
        """Drop a running request's state (its slot freed); it waits to be recomputed."""
        self._release(s)
        s.state, s.preempted = "waiting", True
        self.proof.preemptions += 1
        self.proof.preempted.append(s.req.id)

    def _release(self, s: _Seq) -> None:
        if s.slot is not None:
            self.free.append(s.slot)
            self.free.sort()
            s.slot = None
        self.pending[s.i] = None

    def _admit(self, s: _Seq, joined: bool) -> None:
        """Prefill a request into a free slot and emit its next token (its first, or after a
        recompute the one after the tokens it had)."""
        dec = self.dec
        slot = self.free.pop(0)
        reused = self.slot_used[slot]
        self.proof.slot_reuses += reused
        self.slot_used[slot] = True
        ids = self._context(s)
        recompute = s.preempted
        if recompute:
            self.proof.recomputed_tokens += len(ids)
        cache, hidden, aux = self._prefill(ids, slot, reused)
        rows = torch.log_softmax(dec.target.logits(hidden[-1:]), -1)
        tok = int(rows.argmax(-1))
        if s.t_first is None:
            s.t_first = time.perf_counter()
        s.out.add([tok], rows)
        if recompute:
            self.iterations[s.i] += 1  # a target forward that emitted one token, no draft
        self.tokens[s.i] = ids + [tok]
        self.x[s.i] = tok
        # the scheduler knows a prefill's one token: no placeholder in flight
        self.sched_len[s.i] = self.done_len[s.i] = len(self.tokens[s.i])
        self.flight[s.i].clear()
        self.rejected[s.i] = self.rejected_before[s.i] = 0
        _put(self.pool, slot, cache)
        s.slot, s.state, s.joined = slot, "running", joined
        s.fresh_draft = True
        if self.method == "baseline":
            s.preempted = False
            return
        self.pending[s.i] = (hidden if self.method == "mtp"
                             else torch.cat([aux[i] for i in self.aux_ids], -1))
        self.last_hidden[s.i] = hidden[-1:]
        if recompute and dec.knobs.fault == "preempt-loses-draft-state":
            # planted: the drafter state went with the preemption and is not rebuilt: the
            # request resumes on an empty drafter context, fed only its newest position
            self._clear_draft_slot(slot)
            self.pending[s.i] = self.pending[s.i][-1:]
            s.fresh_draft = False
        s.preempted = False

    def _clear_draft_slot(self, slot: int) -> None:
        pool = self.dpool
        for t in (pool.k + pool.v if self.method == "mtp" else pool["k"] + pool["v"]):
            if t is not None:
                t[slot].zero_()

    # ------------------------------------------------------------------ prefill

    def _prefill(self, ids: list[int], slot: int, reused: bool):
        """(single-sequence cache, hidden [P, H], aux {layer: [P, H]}) of ``ids``, through the
        prefix cache where it is on."""
        dec, fault = self.dec, self.dec.knobs.fault
        target, knobs = dec.target, dec.knobs
        layers = tuple(sorted(set(self.aux_ids) | set(dec._drafter_layers)))
        cache, h0, hid, aux = None, 0, [], {i: [] for i in layers}
        if self.prefix_on:
            chain = self.prefix.lookup(ids, self.block_size, layers)
            if chain:
                cache = self._restore(chain)
                h0 = len(chain) * self.block_size
                hid = [b.hidden for b in chain]
                aux = {i: [b.aux[i] for b in chain] for i in layers}
                self.proof.prefix_hits += 1
                self.proof.prefix_hit_tokens += h0
        rest = ids[h0:]
        short_verify = (fault == "short-prompt-verify" and self.k and len(rest) == self.k + 1)
        residue = fault == "slot-residue" and reused and h0 == 0
        if cache is None and not (short_verify or residue) and self.prefix_mode is None:
            c, h, a = dec._prefill_one(ids, self.max_len, layers)  # generate()'s own prefill
            return c, h, a
        if cache is None:
            cache = Cache(len(target.layers), self.max_len)
        if residue:  # planted: the reused slot's conv window is the prefill's initial state
            cache.conv = [None if t is None else t[slot:slot + 1].clone() for t in self.pool.conv]
        if short_verify:
            h, a = dec._prefill_as_verify(rest, cache, layers)
            hid.append(h)
            for i in layers:
                aux[i].append(a[i])
        else:
            at = h0
            while at < len(ids):
                end = (min((at // self.block_size + 1) * self.block_size, len(ids))
                       if self.prefix_on else len(ids))
                h, a = target(dec._t(ids[at:end])[None], cache, gdn_form=knobs.gdn_prefill,
                              attn_form=knobs.attn_prefill, aux_layers=layers)
                hid.append(h[0])
                for i in layers:
                    aux[i].append(a[i][0])
                if self.prefix_on and end % self.block_size == 0:
                    self._keep_block(ids[:end], cache, h[0], {i: a[i][0] for i in layers})
                at = end
        return cache, torch.cat(hid), {i: torch.cat(aux[i]) for i in layers}

    def _keep_block(self, prefix: list[int], cache: Cache, hidden: torch.Tensor, aux: dict) -> None:
        """The block that ends at len(prefix): its K/V, the hybrid state now, the drafters' inputs."""
        end, bs = len(prefix), self.block_size
        key = tuple(prefix)
        if key in self.prefix.blocks:
            return
        sl = slice(end - bs, end)
        self.prefix.store(key, _Block(
            self.prefix.allocate(),
            [None if t is None else t[:, :, sl].clone() for t in cache.k],
            [None if t is None else t[:, :, sl].clone() for t in cache.v],
            [None if t is None else t.clone() for t in cache.gdn],
            [None if t is None else t.clone() for t in cache.conv],
            hidden[-bs:].clone(), {i: t[-bs:].clone() for i, t in aux.items()}))

    def _restore(self, chain: list[_Block]) -> Cache:
        """A single-sequence cache at the end of a chain of cached blocks."""
        bs = self.block_size
        cache = Cache(len(self.dec.target.layers), self.max_len)
        last = chain[-1]
        gdn = last.gdn
        if self.dec.knobs.fault == "prefix-wrong-block":
            # planted: the GDN state of the block allocated after the boundary's (one not
            # written yet holds nothing: zeros)
            nxt = self.prefix.after(last)
            gdn = nxt.gdn if nxt is not None else [None if t is None else torch.zeros_like(t)
                                                   for t in last.gdn]
        for i in range(len(cache.gdn)):
            if last.k[i] is not None:
                kv = [last.k[i].new_zeros(*last.k[i].shape[:2], self.max_len, last.k[i].shape[3])
                      for _ in range(2)]
                for j, b in enumerate(chain):
                    kv[0][:, :, j * bs:(j + 1) * bs] = b.k[i]
                    kv[1][:, :, j * bs:(j + 1) * bs] = b.v[i]
                cache.k[i], cache.v[i] = kv
            if last.gdn[i] is not None:
                cache.gdn[i] = gdn[i].clone()
                cache.conv[i] = last.conv[i].clone()
        cache.length = len(chain) * bs
        return cache

    # ------------------------------------------------------------------ steps

    def _step(self, live: list[_Seq]) -> None:
        """One engine step of the running requests: a decode each (baseline), or a draft +
        verify each; under no_draft_every, a request's every N-th verify carries no draft."""
        if self.method == "baseline":
            self._decode(live)
            return
        every = self.dec.knobs.no_draft_every
        plain = [s for s in live if every and (self.iterations[s.i] + 1) % every == 0]
        verify = [s for s in live if s not in plain]
        if self.dec.knobs.fault == "thinking-no-rollback":
            # planted: requests in thinking mode verified on a path that keeps the rejected
            # drafts' GDN state (the fault stale-state, for them only)
            think = [s for s in verify if self.thinking[s.i]]
            verify = [s for s in verify if not self.thinking[s.i]]
            if think:
                knobs = self.dec.knobs
                self.dec.knobs = replace(knobs, fault="stale-state")
                try:
                    self._spec(think, True)
                finally:
                    self.dec.knobs = knobs
        for group, draft in ((verify, True), (plain, False)):
            if group:
                self._spec(group, draft)

    def _batch(self, live: list[_Seq]) -> Cache:
        """The running requests' target state as one batch, with the planted faults of
        joining a running batch."""
        c = _gather(self.pool, [s.slot for s in live])
        if self.async_on:
            self._placed(live, c)
        if self.dec.knobs.fault == "join-contaminates" and len(live) > 1:
            for j, s in enumerate(live):
                if s.joined:  # planted: a neighbour's GDN / conv row for its first step
                    n = j - 1 if j else j + 1
                    for name in ("gdn", "conv"):
                        for t in getattr(c, name):
                            if t is not None:
                                t[j] = t[n]
        for s in live:
            s.joined = False
        return c

    def _padding(self, live: list[_Seq], c: Cache, n_tokens: int) -> None:
        """A batched step of ``len(live)`` rows of ``n_tokens`` tokens each replays the
        captured graph of the next size up (vLLM pads a batch to it), or runs without one past
        the largest; counted for the proof. Fault padded-row-real: the padding rows, mapped to
        the last row's state slot, write their state over it."""
        n = len(live)
        size = padded_size(n * n_tokens, self.capture)
        p = self.proof
        p.batch_sizes.add(n)
        p.eager_steps += size is None
        p.graph_steps += size is not None
        p.padded_steps += size is not None and size > n * n_tokens
        if self.dec.knobs.fault != "padded-row-real" or size is None or size == n * n_tokens:
            return
        dec = self.dec
        pad = _gather(self.pool, [live[-1].slot])  # the last row's state before this step
        dec.target(dec._t([[PAD_TOKEN] * n_tokens]), pad, gdn_form=dec.knobs.gdn_decode
                   if n_tokens == 1 else dec.knobs.gdn_verify,
                   attn_form=dec.knobs.attn_decode if n_tokens == 1 else dec.knobs.attn_verify)
        for name in ("gdn", "conv"):
            for t, p in zip(getattr(c, name), getattr(pad, name)):
                if t is not None:
                    t[-1] = p[0]

    def _decode(self, live: list[_Seq]) -> None:
        dec = self.dec
        c = self._batch(live)
        b = [s.i for s in live]
        h, _ = dec.target(dec._t([[self.x[i]] for i in b]), c, gdn_form=dec.knobs.gdn_decode,
                          attn_form=dec.knobs.attn_decode)
        rows = torch.log_softmax(dec.target.logits(h[:, 0]), -1)
        toks = rows.argmax(-1).tolist()
        idx, vals, chosen = emitted_rows(rows, toks, self.top_k)
        for j, i in enumerate(b):
            self.outs[i].extend(toks[j:j + 1], idx[j:j + 1], vals[j:j + 1], chosen[j:j + 1])
            self.tokens[i].append(toks[j])
            self.x[i] = toks[j]
            self.iterations[i] += 1
        self._padding(live, c, 1)
        _scatter(self.pool, [s.slot for s in live], c)

    def _spec(self, live: list[_Seq], draft: bool) -> None:
        dec, method, k = self.dec, self.method, self.k
        c = self._batch(live)
        b = [s.i for s in live]
        slots = [s.slot for s in live]
        fault = dec.knobs.fault

        def verified(i, hs, auxs):
            if method != "mtp":
                new = torch.cat(auxs, -1)
            elif fault == "mtp-stale-hidden":
                new, self.last_hidden[i] = torch.cat([self.last_hidden[i], hs[:-1]]), hs[-1:]
            else:
                new = hs
            self.pending[i] = new if self.pending[i] is None else torch.cat([self.pending[i], new])

        if draft:
            dstate = self._draft_rows(slots)

            def draft_all(rows):
                return self._draft(dstate, rows)

            dec._verify_step(c, b, self.x, self.tokens, self.outs, self.iterations, self.counters,
                             draft_all, self.pending, verified, k, self.aux_ids,
                             dec.cfg.linear_conv_kernel_dim - 1, self.top_k)
            self._draft_scatter(slots, dstate)
        else:
            dec._step_without_draft(c, b, self.x, self.tokens, self.outs, self.iterations,
                                    verified, self.aux_ids, self.top_k)
        self._padding(live, c, k + 1 if draft else 1)
        _scatter(self.pool, slots, c)

    # ------------------------------------------------------------------ drafting

    def _draft_rows(self, slots: list[int]):
        if self.method == "mtp":
            return _gather(self.dpool, slots)
        idx = torch.tensor(slots, dtype=torch.long, device=self.dec.device)
        return {"k": [t[idx] for t in self.dpool["k"]], "v": [t[idx] for t in self.dpool["v"]]}

    def _draft_scatter(self, slots: list[int], st) -> None:
        if self.method == "mtp":
            _scatter(self.dpool, slots, st)
            return
        idx = torch.tensor(slots, dtype=torch.long, device=self.dec.device)
        for pool, new in ((self.dpool["k"], st["k"]), (self.dpool["v"], st["v"])):
            for t, n in zip(pool, new):
                t[idx] = n

    def _draft(self, st, live: list[int]) -> list[list[int]]:
        """K drafts for each running request in one drafter call per step (Decoder's batched
        drafting; the MTP state of a request that has none yet is built from its context
        alone first, as generate() builds it)."""
        if self.method != "mtp":
            return self.dec._draft_batch(self.method, st, live, self.tokens, self.pending, self.k)
        return self._draft_mtp(st, live)

    def _draft_mtp(self, mc: Cache, live: list[int]) -> list[list[int]]:
        dec, k, tokens, pending = self.dec, self.k, self.tokens, self.pending
        n = [pending[b].shape[0] for b in live]
        p = [len(tokens[b]) - 1 for b in live]
        p_t = dec._t(p)
        mh: list = [None] * len(live)
        old = []
        for j, b in enumerate(live):
            s = self.seqs[b]
            if not s.fresh_draft:
                old.append(j)
                continue
            one = Cache(len(dec.mtp.layers), mc.max_len)  # its context alone, as generate()
            emb = dec.target.embed_tokens(dec._t(tokens[b][1: p[j] + 1]))[None]
            mh[j] = dec.mtp(emb, pending[b][None], one)[0, -1]
            for t, new in ((mc.k, one.k), (mc.v, one.v)):
                for li, x in enumerate(new):
                    t[li][j] = x[0]
            mc.lengths[j] = one.length
            s.fresh_draft = False
        if old:
            sub = _gather(mc, old)
            T = max(n[j] for j in old)
            ids = [tokens[live[j]][p[j] - n[j] + 1: p[j] + 1] + [tokens[live[j]][p[j]]] * (T - n[j])
                   for j in old]
            hid = torch.nn.utils.rnn.pad_sequence([pending[live[j]] for j in old], batch_first=True)
            sub.lengths = dec._t([p[j] - n[j] for j in old])
            nt = dec._t([n[j] for j in old])
            res = dec.mtp(dec.target.embed_tokens(dec._t(ids)), hid, sub)[
                torch.arange(len(old), device=dec.device), nt - 1]
            for jj, j in enumerate(old):
                mh[j] = res[jj]
            _scatter(mc, old, sub)
        h = torch.stack(mh)
        out = [dec._draft_logits(h, p_t + 1).argmax(-1)]
        mc.lengths = p_t
        for j in range(k - 1):
            h = dec.mtp(dec.target.embed_tokens(out[-1])[:, None], h[:, None], mc)[:, 0]
            out.append(dec._draft_logits(h, p_t + 2 + j).argmax(-1))
        mc.lengths = p_t  # drop the speculative positions
        return torch.stack(out, 1).tolist()
