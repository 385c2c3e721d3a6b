"""Warm single-stream decode speed of the reference engine: baseline vs MTP vs DFlash.

    python benchmarks/bench_reference.py [--corpus code] [--repeats 3] [--mtp-k 1,2,3,5,7]
        [--dflash-k 3,5,7,10] [--engine-arg key=value ...]

Every config first runs once to warm up; then ``--repeats`` rounds each run every config once,
in turn, so that a machine whose speed drifts (a shared CPU) slows all configs alike. The
table gives the median decode tok/s (generated tokens after the first / decode seconds, summed
over the corpus), tokens per iteration and the speedup over the baseline's median. Not a test:
numbers depend on the machine (CPU threads, contention).

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
from speccheck.engines.reference import decode as decode_module
from speccheck.engines.reference.engine import ReferenceEngine
from speccheck.types import SpecConfig


def run(engine, prompts, ids, config):
    t = time.perf_counter()
    comps = engine.generate(prompts, ids, config, 5)
    wall = time.perf_counter() - t
    tokens = sum(c.n_tokens - 1 for c in comps)
    decode = sum(c.decode_s for c in comps)
    spec = None
    for c in comps:
        if c.spec is not None:
            spec = c.spec if spec is None else spec + c.spec
    tpi = 1 + spec.accepted_tokens / spec.drafts if spec and spec.drafts else 1.0
    return tokens / decode, tpi, wall, [c.token_ids.tolist() for c in comps]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default="code")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mtp-k", default="1,2,3,5,7")
    ap.add_argument("--dflash-k", default="3,5,7,10")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time decoding by the wall clock or by the decoding thread's CPU time")
    a = ap.parse_args(argv)
    engine_args = dict(kv.split("=", 1) for kv in a.engine_arg)
    engine = ReferenceEngine(engine_args=engine_args)
    if a.clock == "cpu":
        if engine.device.type != "cpu" or torch.get_num_threads() != 1:
            ap.error("--clock cpu needs the CPU engine at one thread (threads=1, the default)")
        # the decoder's clock (its decode_s) becomes this thread's CPU time
        decode_module.time = types.SimpleNamespace(perf_counter=time.thread_time)
    prompts = list(load_corpus(a.corpus).prompts)
    ids = [engine.tokenize(p) for p in prompts]
    ident = engine.identity()
    print(f"reference engine on {ident['device']} ({ident['threads']} threads, {ident['dtype']}), "
          f"corpus {a.corpus}: {len(prompts)} prompts; {a.clock} clock; knobs {ident['knobs']}")
    configs = [SpecConfig()]
    configs += [SpecConfig("mtp", int(k)) for k in a.mtp_k.split(",") if k]
    configs += [SpecConfig("dflash", int(k)) for k in a.dflash_k.split(",") if k]
    for cfg in configs:
        run(engine, prompts, ids, cfg)  # warm-up
    by_cfg = {cfg.name: [] for cfg in configs}
    for i in range(a.repeats):
        for cfg in configs:
            by_cfg[cfg.name].append(run(engine, prompts, ids, cfg))
        print(f"  round {i + 1}/{a.repeats}: " + "  ".join(
            f"{name} {r[-1][0]:.0f}" for name, r in by_cfg.items()), file=sys.stderr, flush=True)
    rows = []
    base_tokens = None
    for cfg in configs:
        results = by_cfg[cfg.name]
        tps = statistics.median(r[0] for r in results)
        same = None
        if cfg.is_baseline:
            base_tokens = results[0][3]
        else:
            same = sum(x == y for x, y in zip(results[0][3], base_tokens))
        # speedup: the median over rounds of (this config / baseline in the same round)
        speedup = statistics.median(r[0] / b[0] for r, b in zip(results, by_cfg["baseline"]))
        rows.append((cfg.name, tps, speedup, results[0][1], [round(r[0], 1) for r in results],
                     same))
    width = max(len(str(r[4])) for r in rows) + 2
    print(f"{'config':<12}{'tok/s (median)':>15}{'speedup':>9}{'tok/iter':>10}  "
          f"{'runs (tok/s)':<{width}}identical to baseline")
    for name, tps, speedup, tpi, runs, same in rows:
        ident_txt = "" if same is None else f"{same}/{len(prompts)}"
        print(f"{name:<12}{tps:>15.1f}{speedup:>8.2f}x{tpi:>10.2f}  {str(runs):<{width}}{ident_txt}")
    for method in ("mtp", "dflash"):
        best = max((r for r in rows if r[0].startswith(method)), key=lambda r: r[2], default=None)
        if best:
            print(f"best {method}: {best[0]} {best[1]:.1f} tok/s = {best[2]:.2f}x baseline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
