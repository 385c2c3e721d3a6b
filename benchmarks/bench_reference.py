"""Warm single-stream decode speed of the reference engine: baseline vs MTP vs DFlash.

    python benchmarks/bench_reference.py [--corpus code] [--repeats 3] [--mtp-k 1,2,3,5,7]
        [--dflash-k 3,5,7,10] [--dflash2-k 7] [--engine-arg key=value ...]
        [--variant LABEL:key=value,key=value ...] [--order prompt|config|both] [--loop-split]

Every config first runs once to warm up; then ``--repeats`` rounds each run every config once,
interleaved prompt by prompt (every config on a prompt before the next prompt), so that a
machine whose speed drifts (a shared CPU) slows all configs alike. The
table gives the median decode tok/s (generated tokens after the first / decode seconds, summed
over the corpus), tokens per iteration and the speedup over the baseline's median. Not a test:
numbers depend on the machine (CPU threads, contention). Each ``--variant`` (other code-path
engine args on the same loaded networks, e.g. the fused GDN kernel or cuda_graphs=off) runs in
the same rounds and gets a table of its own, its speedups against its own baseline.

``--clock cpu`` times decoding by the CPU time of the decoding thread instead of the wall clock
(CPU only, one torch thread: every op runs on that thread): on a shared machine the wall clock
also measures the other users' load, the CPU time much less so (caches and memory are still
shared). The default ``wall`` is what a user sees.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import types

import torch

from speccheck.corpus import load_corpus
from speccheck.reference import decode as decode_module
from speccheck.reference import graphs
from speccheck.reference.engine import ReferenceEngine
from speccheck.reference.graphs import Replay
from speccheck.types import SpecConfig


def run(engine, prompts, ids, config):
    """(decode tok/s, tokens per iteration, wall seconds, token ids per prompt) of the corpus."""
    t = time.perf_counter()
    comps = engine.generate(prompts, ids, config, 5)
    return summarize(comps, time.perf_counter() - t)


def summarize(comps, wall):
    tokens = sum(c.n_tokens - 1 for c in comps)
    decode = sum(c.decode_s for c in comps)
    spec = None
    for c in comps:
        if c.spec is not None:
            spec = c.spec if spec is None else spec + c.spec
    tpi = 1 + spec.accepted_tokens / spec.drafts if spec and spec.drafts else 1.0
    return tokens / decode, tpi, wall, [c.token_ids.tolist() for c in comps]


def interleaved_round(cells, engines, prompts, ids, turn: int, split: dict | None = None,
                      by_config: bool = False) -> dict:
    """One round: prompt by prompt, every cell on that prompt before the next one (starting
    at a cell that moves each prompt and round), so a drift in the machine's speed over the
    round hits every config alike instead of the ones that ran while it was slow. With
    ``by_config``, each cell over the whole corpus in turn instead (as a user's run of one
    config: what switching configs between requests costs shows as the difference).
    ``split`` (cell -> list): each generation's (decode seconds, Marks) appended."""
    comps = {cell: [] for cell in cells}
    walls = {cell: 0.0 for cell in cells}
    order = [(j, n) for n in range(len(cells)) for j in range(len(prompts))] if by_config \
        else [(j, n) for j in range(len(prompts)) for n in range(len(cells))]
    for j, n in order:
        label, cfg = cells[(n + (0 if by_config else j) + turn) % len(cells)]
        seen = len(MarkedAhead.generations)
        t = time.perf_counter()
        got = engines[label].generate([prompts[j]], [ids[j]], cfg, 5)
        walls[(label, cfg)] += time.perf_counter() - t
        comps[(label, cfg)] += got
        if split is not None and len(MarkedAhead.generations) == seen + 1:
            split[(label, cfg)].append((got[0].decode_s, MarkedAhead.generations[-1]))
    return {cell: summarize(comps[cell], walls[cell]) for cell in cells}


class Marks(types.SimpleNamespace):
    """One generation's marks: ``made`` (its queue made) and ``steps``, (start, end, queued
    behind) per step."""


class MarkedAhead(graphs._Ahead):
    """The step graphs' queue (graphs._Ahead), marking on the device when it was made and when
    each step starts and ends (CUDA timing events; on the CPU, where a step runs as it is
    queued, the clock), and whether a step was queued behind one not read yet (the device had
    work queued) or after the host had read every step (the device waited for the host). Only
    the marks outlive the generation: a queue kept would keep its pinned host buffers, and
    every later generation would pin new ones."""

    generations: list = []  # every queue's Marks, in order: one per generation

    def __init__(self, step, out):
        self.cuda = out.device.type == "cuda"
        made = self._mark()  # before its host buffers are allocated
        super().__init__(step, out)
        self.marks = Marks(made=made, steps=[])
        MarkedAhead.generations.append(self.marks)

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def _queue(self) -> None:
        behind, start = self.queued > 0, self._mark()
        super()._queue()
        self.marks.steps.append((start, self._mark(), behind))


def _seconds(a, b) -> float:
    return b - a if isinstance(a, float) else a.elapsed_time(b) / 1000.0


def loop_split(decode_s: float, marked: Marks) -> dict:
    """One generation's decode seconds in parts that sum to it: ``steps`` (the device running
    the queued steps, each with its output's copy to the host), ``gap behind`` (idle between a
    step and one queued behind it: the host was late to queue), ``gap serial`` (idle before a
    step queued after the host read every earlier one: near max_tokens, the host's reading,
    emitting and launching), ``to first`` (from the queue's making to the first step: its
    buffers' allocation and the first launch) and ``after`` (the rest: mainly from the last
    step's end to the clock's stop, the host's reading and emitting it). ``first``: the first
    step's own seconds (a step graph slower right after another config's shows there, not in
    a back-to-back replay)."""
    marks = marked.steps
    steps = sum(_seconds(a, b) for a, b, _ in marks)
    gaps = {True: 0.0, False: 0.0}
    for (_, prev_end, _), (start, _, behind) in zip(marks, marks[1:]):
        gaps[behind] += _seconds(prev_end, start)
    to_first = _seconds(marked.made, marks[0][0]) if marks else 0.0
    span = _seconds(marked.made, marks[-1][1]) if marks else 0.0
    return {"steps": steps, "gap behind": gaps[True], "gap serial": gaps[False],
            "to first": to_first, "after": decode_s - span, "n": len(marks),
            "first": _seconds(*marks[0][:2]) if marks else 0.0,
            "serial": sum(not behind for _, _, behind in marks[1:])}


def print_loop_split(split: dict) -> None:
    """Per config, over all its generations: the steps per generation, the device's time per
    step and the idle gaps per step (:func:`loop_split`), then per generation its first step,
    the time to it and the time after the last, and the serial steps."""
    print("\nloop split, all rounds: per step (us): the device running it, idle gaps (the host "
          "late behind a queued step; serial, near max_tokens) and the decode time; per "
          "generation (us): its first step alone, from the queue's making to it, after the "
          "last step; serial steps")
    print(f"{'config':<22}{'steps':>7}{'step':>8}{'behind':>8}{'serial':>8}{'decode':>8}"
          f"{'| first':>9}{'to first':>9}{'after':>8}{'serial':>7}")
    for (label, cfg), gens in split.items():
        if not gens:
            continue
        parts = [loop_split(d, a) for d, a in gens]
        n, g = sum(p["n"] for p in parts) or 1, len(gens)
        step = {k: 1e6 * sum(p[k] for p in parts) / n for k in ("steps", "gap behind", "gap serial")}
        gen = {k: 1e6 * sum(p[k] for p in parts) / g for k in ("first", "to first", "after")}
        print(f"{(label + ' ' if label else '') + cfg.name:<22}{n / g:>7.1f}{step['steps']:>8.1f}"
              f"{step['gap behind']:>8.1f}{step['gap serial']:>8.1f}"
              f"{1e6 * sum(d for d, _ in gens) / n:>8.1f}  {gen['first']:>7.1f}"
              f"{gen['to first']:>9.1f}{gen['after']:>8.1f}{sum(p['serial'] for p in parts) / g:>7.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default="code")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mtp-k", default="1,2,3,5,7")
    ap.add_argument("--dflash-k", default="3,5,7,10")
    ap.add_argument("--dflash2-k", default="7")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:KEY=VALUE,...",
                    help="also bench the engine under these code-path args (repeatable), in the "
                         "same rounds, e.g. 'fused:gdn_decode=fused,gdn_verify=fused'")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time decoding by the wall clock or by the decoding thread's CPU time")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="CUDA: also list each step graph's N costliest kernels")
    ap.add_argument("--timeline", default="", metavar="STEP,...",
                    help="CUDA: print every kernel of one replay of these step graphs (e.g. "
                         "'decode,dflash2-k7 verify') in launch order, with its duration and "
                         "the idle gap before it")
    ap.add_argument("--order", choices=("prompt", "config", "both"), default="prompt",
                    help="each round prompt by prompt (every config on a prompt before the next), "
                         "config by config (each over the whole corpus), or both in turn, a "
                         "table each")
    ap.add_argument("--loop-split", action="store_true",
                    help="step graphs: split each config's decode time into the device running "
                         "steps, idle gaps (host late, or waiting near max_tokens) and the rest")
    a = ap.parse_args(argv)
    engine_args = dict(kv.split("=", 1) for kv in a.engine_arg)
    engine = ReferenceEngine(engine_args=engine_args)
    if a.clock == "cpu":
        if engine.device.type != "cpu" or torch.get_num_threads() != 1:
            ap.error("--clock cpu needs the CPU engine at one thread (threads=1, the default)")
        # the decoder's clock (its decode_s) becomes this thread's CPU time
        decode_module.time = types.SimpleNamespace(perf_counter=time.thread_time,
                                                   process_time=time.process_time)
    overrides = {"": {}}
    for v in a.variant:
        label, _, kvs = v.partition(":")
        overrides[label] = dict(kv.split("=", 1) for kv in kvs.split(",") if kv)
    engines = {label: engine.with_args(**o) if o else engine for label, o in overrides.items()}
    prompts = list(load_corpus(a.corpus).prompts)
    ids = [engine.tokenize(p) for p in prompts]
    ident = engine.identity()
    print(f"reference engine on {ident['device']} ({ident['threads']} threads, {ident['dtype']}), "
          f"corpus {a.corpus}: {len(prompts)} prompts; {a.clock} clock; knobs {ident['knobs']}"
          + (f"; cuda_graphs {ident['cuda_graphs']}" if "cuda_graphs" in ident else "")
          + "".join(f"; variant {v}" for v in a.variant))
    configs = [SpecConfig()]
    configs += [SpecConfig("mtp", int(k)) for k in a.mtp_k.split(",") if k]
    configs += [SpecConfig("dflash", int(k)) for k in a.dflash_k.split(",") if k]
    if engine.dflash2 is not None:
        configs += [SpecConfig("dflash2", int(k)) for k in a.dflash2_k.split(",") if k]
    cells = [(label, cfg) for label in engines for cfg in configs]
    for label, cfg in cells:
        run(engines[label], prompts, ids, cfg)  # warm-up (on CUDA: captures the step graphs)
    orders = ("prompt", "config") if a.order == "both" else (a.order,)
    by_cell = {o: {cell: [] for cell in cells} for o in orders}
    split = {o: {cell: [] for cell in cells} for o in orders} if a.loop_split else None
    queue = graphs._Ahead
    graphs._Ahead = MarkedAhead if a.loop_split else queue
    try:
        for i in range(a.repeats):
            for o in orders:
                for cell, result in interleaved_round(cells, engines, prompts, ids, i,
                                                      split and split[o], o == "config").items():
                    by_cell[o][cell].append(result)
                print(f"  round {i + 1}/{a.repeats}{'' if len(orders) == 1 else ' by ' + o}: "
                      + "  ".join(f"{label + ' ' if label else ''}{cfg.name} {r[-1][0]:.0f}"
                                  for (label, cfg), r in by_cell[o].items()),
                      file=sys.stderr, flush=True)
    finally:
        graphs._Ahead = queue
    for o in orders:
        if len(orders) > 1:
            print(f"\n=== rounds {'prompt by prompt' if o == 'prompt' else 'config by config'}")
        for label, kv in overrides.items():
            if label:
                print(f"\nvariant {label}: {kv}")
            table({cfg: by_cell[o][(label, cfg)] for cfg in configs}, len(prompts))
        if split is not None:
            if any(split[o].values()):
                print_loop_split(split[o])
            else:
                print("\nloop split: no step graphs ran (CUDA with cuda_graphs on)")
    for label, eng in engines.items():
        times = graph_step_times(eng, a.kernels, [t for t in a.timeline.split(",") if t])
        if times:
            print(f"\n{label or 'default'}: GPU time of one replay of each step graph (median of "
                  f"{STEP_REPLAYS}, microseconds): " + "; ".join(f"{k} {v:.0f}" for k, v in times.items()))
    for step, why in Replay.failures.items():
        print(f"step {step} ran eagerly: its CUDA graph capture failed: {why}")
    return 0


STEP_REPLAYS = 50
BACK_TO_BACK = 40


def _timeline(name: str, step) -> None:
    """Every kernel of the last of 5 back-to-back replays, in order: start offset, duration
    and the gap before it (microseconds) — where a step graph's time goes between kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                     key=lambda e: e.time_range.start)
    per = len(kernels) // 5
    last = kernels[-per:]
    t0, prev_end, gaps = last[0].time_range.start, None, 0.0
    print(f"  timeline of {name}: {per} kernels, {last[-1].time_range.end - t0:.1f} us")
    for e in last:
        gap = 0.0 if prev_end is None else e.time_range.start - prev_end
        gaps += gap
        print(f"    {e.time_range.start - t0:8.1f} {e.time_range.end - e.time_range.start:6.1f} "
              f"gap {gap:5.1f}  {e.name[:100]}")
        prev_end = e.time_range.end
    print(f"  gaps in all: {gaps:.1f} us")


def graph_step_times(engine, kernels: int = 0, timeline=()) -> dict[str, float]:
    """On CUDA, each captured step graph replayed alone (CUDA events; the buffers put back at
    a valid position before each replay): the GPU cost per decode step, per draft and per
    verify, the terms of the speedup; {} where no graph was captured (CPU, eager). With
    ``kernels``, also print each step's costliest kernels (torch.profiler over its replays):
    where a step's microseconds go."""
    graphs = getattr(engine.decoder, "graphs", None)
    if graphs is None or engine.device.type != "cuda":
        return {}
    with torch.inference_mode():  # the buffers are inference tensors
        return _step_times(graphs, kernels, timeline)


def _replays_ms(B, key, step, n: int) -> float:
    """Milliseconds per replay of ``n`` replays in a row (CUDA events), the buffers put back
    at a valid position first (for a speculative step: one kept position pending)."""
    B.reset(None if key[0] == "decode" else B.graphs[key][-1])
    torch.cuda.synchronize()
    return 1000 * step.gpu_seconds(n)


def _step_times(graphs, kernels: int = 0, timeline=()) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for cap, B in graphs.buffers.items():
        for key, steps in B.graphs.items():
            named = [("decode", steps[0])] if key[0] == "decode" else \
                [(f"{key[0]}-k{key[1]} draft", steps[0]), (f"{key[0]}-k{key[1]} verify", steps[1]),
                 (f"{key[0]}-k{key[1]} iteration", steps[2])]
            for name, step in named:
                if step is None or step.graph is None:
                    continue
                ms = [_replays_ms(B, key, step, 1) for _ in range(STEP_REPLAYS)]
                out[f"{name} (cap {cap})"] = 1000 * statistics.median(ms)
                # back to back (the GPU never idles between them, as in the decode loop)
                out[f"{name} (cap {cap}) back to back"] = 1000 * _replays_ms(B, key, step, BACK_TO_BACK)
                if name in timeline:
                    _timeline(f"{name} (cap {cap})", step)
                if kernels:
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        for _ in range(10):
                            step()
                        torch.cuda.synchronize()
                    rows = sorted((e for e in prof.key_averages() if e.device_time_total > 0),
                                  key=lambda e: -e.device_time_total)
                    launches = sum(e.count for e in rows) / 10
                    print(f"  {name} (cap {cap}): {launches:.0f} kernels per replay; costliest:")
                    for e in rows[:kernels]:
                        print(f"    {e.device_time_total / 10:7.1f} us  x{e.count / 10:<4.0f} {e.key[:90]}")
    return out


def table(by_cfg: dict, n_prompts: int) -> None:
    """The bench table of one engine variant: median tok/s, the median over rounds of the
    per-round speedup, tokens per iteration, each round, outputs identical to the baseline's."""
    rows = []
    base = next(cfg for cfg in by_cfg if cfg.is_baseline)
    base_tokens = by_cfg[base][0][3]
    for cfg, results in by_cfg.items():
        tps = statistics.median(r[0] for r in results)
        same = None if cfg.is_baseline else sum(x == y for x, y in zip(results[0][3], base_tokens))
        # speedup: the median over rounds of (this config / baseline in the same round)
        speedup = statistics.median(r[0] / b[0] for r, b in zip(results, by_cfg[base]))
        rows.append((cfg.name, tps, speedup, results[0][1], [round(r[0], 1) for r in results],
                     same))
    width = max(len(str(r[4])) for r in rows) + 2
    print(f"{'config':<12}{'tok/s (median)':>15}{'speedup':>9}{'tok/iter':>10}  "
          f"{'runs (tok/s)':<{width}}identical to baseline")
    for name, tps, speedup, tpi, runs, same in rows:
        ident_txt = "" if same is None else f"{same}/{n_prompts}"
        print(f"{name:<12}{tps:>15.1f}{speedup:>8.2f}x{tpi:>10.2f}  {str(runs):<{width}}{ident_txt}")
    for method in ("mtp", "dflash", "dflash2"):
        best = max((r for r in rows if r[0].startswith(method + "-")), key=lambda r: r[2],
                   default=None)
        if best:
            print(f"best {method}: {best[0]} {best[1]:.1f} tok/s = {best[2]:.2f}x baseline")


if __name__ == "__main__":
    sys.exit(main())
