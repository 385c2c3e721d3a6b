"""Where the reference engine spends its time: one decode step, one verify forward at several
K, one MTP draft step and one DFlash block draft, timed alone (medians); the top ops of decode,
verify and draft from torch.profiler (with kernel launches and GPU time on CUDA); then the
real decode loop on a corpus split into its phases.

    python benchmarks/profile_reference.py [--engine-arg device=cuda] [--context 200]

Speculative decoding pays when verify(K+1 tokens) + drafting costs less than the tokens per
iteration times a decode step; this prints the terms of that inequality. Not a test.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import types

import torch
from torch.profiler import ProfilerActivity, profile

from speccheck.corpus import load_corpus
from speccheck.reference import decode as decode_module
from speccheck.reference import steps as steps_module
from speccheck.reference.engine import ReferenceEngine
from speccheck.reference.model import Cache

#: the phases of Decoder's loops, timed in :func:`loop_phases` (object, attribute, label)
PHASES = (("target", "forward", "target forward"), ("target", "logits", "lm head"),
          ("decoder", "_draft_mtp", "MTP drafting"), ("decoder", "_draft_dflash", "DFlash draft"),
          ("cache", "commit", "commit/rollback"), ("decode", "emitted_rows", "emit (top-k to host)"),
          ("steps", "emitted_rows", "emit (top-k to host)"))  # (decode's batch, and _Out.add's)


def loop_phases(eng, corpus: str, max_prompts: int, runs) -> None:
    """Time each phase of the real decode loop (wrapped, with a device sync after each, which
    costs little where the host is the bottleneck) and print ms per iteration."""
    d = eng.decoder
    sync = torch.cuda.synchronize if d.device.type == "cuda" else (lambda: None)
    prompts = list(load_corpus(corpus).prompts)[:max_prompts]
    ids = [eng.tokenize(p) for p in prompts]
    owners = {"target": d.target, "decoder": d, "cache": Cache, "decode": decode_module,
              "steps": steps_module}
    spent: dict[str, float] = {}
    originals = []

    def timed(label, f):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            r = f(*args, **kwargs)
            sync()
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - t
            return r
        return wrapper

    for owner, attr, label in PHASES:
        obj = owners[owner]
        originals.append((obj, attr, obj.__dict__.get(attr)))
        setattr(obj, attr, timed(label, getattr(obj, attr)))
    try:
        print(f"decode loop on {len(prompts)} prompts of corpus {corpus} (ms per iteration):")
        for method, k in runs:
            for _ in range(2):  # the first is a warm-up
                spent.clear()
                t = time.perf_counter()
                gens = [d.generate(i, p.max_tokens, method, k, 5) for i, p in zip(ids, prompts)]
                sync()
                total = time.perf_counter() - t
            its = sum(g.iterations for g in gens)
            toks = sum(len(g.token_ids) - 1 for g in gens)
            rest = total - sum(spent.values())
            parts = ", ".join(f"{lab} {1e3 * v / its:.2f}" for lab, v in
                              sorted(spent.items(), key=lambda kv: -kv[1]))
            name = method if method == "baseline" else f"{method}-k{k}"
            print(f"  {name:<10} {1e3 * total / its:6.2f} ms/iter, {toks / its:.2f} tok/iter, "
                  f"{toks / total:6.1f} tok/s | {parts}, other {1e3 * rest / its:.2f}")
    finally:
        for obj, attr, orig in originals:
            if orig is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, orig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--context", type=int, default=200, help="prompt tokens before the step")
    ap.add_argument("--k", default="1,3,7", help="verify widths to time")
    ap.add_argument("--top", type=int, default=15, help="ops listed per profiled phase")
    ap.add_argument("--iters", type=int, default=100, help="timed repetitions per step")
    ap.add_argument("--corpus", default="code", help="corpus of the decode-loop split")
    ap.add_argument("--prompts", type=int, default=8, help="prompts of it to run")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time by the wall clock or by this thread's CPU time (CPU engine at one "
                         "thread; on a shared machine the wall clock also measures the others)")
    ap.add_argument("--no-profiler", action="store_true", help="skip the torch.profiler op lists")
    a = ap.parse_args(argv)
    eng = ReferenceEngine(engine_args=dict(kv.split("=", 1) for kv in a.engine_arg))
    if a.clock == "cpu":
        if eng.device.type != "cpu" or torch.get_num_threads() != 1:
            ap.error("--clock cpu needs the CPU engine at one thread (threads=1, the default)")
        global time  # this script's clock and the decoder's become this thread's CPU time
        time = decode_module.time = types.SimpleNamespace(perf_counter=time.thread_time,
                                                          process_time=time.process_time)
    d, target, knobs = eng.decoder, eng.decoder.target, eng.decoder.knobs
    cuda = d.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    aux_ids = tuple(eng.cfg.drafter.target_layer_ids)
    ids = [10 + i % 1000 for i in range(a.context)]

    def median_ms(f):
        f()
        sync()
        ts = []
        for _ in range(a.iters):
            t = time.perf_counter()
            f()
            sync()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e3

    with torch.inference_mode():
        cache, (h,), (aux,), _ = d._prefill([ids], a.context + 64, 5, aux_ids)
        snap = cache.snapshot()

        def decode():
            cache.restore(snap)
            hh, _ = target(d._t([5])[None], cache, gdn_form=knobs.gdn_decode,
                           attn_form=knobs.attn_decode)
            int(torch.log_softmax(target.logits(hh[0]), -1)[0].argmax())

        def verify(k):
            cache.restore(snap)
            hh, _ = target(d._t([5] * (k + 1))[None], cache, gdn_form=knobs.gdn_verify,
                           attn_form=knobs.attn_verify, per_position=True, aux_layers=aux_ids)
            torch.log_softmax(target.logits(hh[0]), -1).topk(2, dim=-1).indices.tolist()
            cache.commit(1)

        mcache = Cache(len(d.mtp.layers), a.context + 64) if d.mtp is not None else None

        def mtp_step():
            mcache.length = 0
            mh = d.mtp(target.embed_tokens(d._t([5]))[None], h[None, :1], mcache)
            int(target.rough_logits(mh[0, -1]).argmax())

        st = d._draft_init("dflash", a.context + 64) if d.drafter is not None else None
        tokens = ids + [5]
        pending = torch.cat([aux[i] for i in aux_ids], -1)

        def dflash_block(k=eng.cfg.drafter.block_size - 1):
            st["len"] = len(tokens) - 2
            d._draft_dflash(st, tokens, pending[-1:], k)

        ident = eng.identity()
        print(f"reference engine on {ident['device']} ({ident['threads']} threads, "
              f"{ident['dtype']}), context {a.context} tokens")
        base = median_ms(decode)
        print(f"  decode step (1 token, logits)      {base:8.3f} ms")
        for k in (int(x) for x in a.k.split(",")):
            t = median_ms(lambda: verify(k))
            print(f"  verify K={k:<2} ({k + 1} tokens, commit)    {t:8.3f} ms  = {t / base:.2f} decode")
        if mcache is not None:
            d._draft_init("mtp", 8)
            t = median_ms(mtp_step)
            print(f"  MTP draft step                     {t:8.3f} ms  = {t / base:.2f} decode")
        if st is not None:
            d._draft_dflash(st, tokens, pending, eng.cfg.drafter.block_size - 1)
            t = median_ms(dflash_block)
            print(f"  DFlash block draft (K={eng.cfg.drafter.block_size - 1})         "
                  f"{t:8.3f} ms  = {t / base:.2f} decode")
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        phases = [("decode step", decode), ("verify K=7 + commit", lambda: verify(7))]
        if st is not None:
            phases.append(("DFlash block draft", dflash_block))
        for name, f in [] if a.no_profiler else phases:
            with profile(activities=acts) as p:
                for _ in range(20):
                    f()
                sync()
            ka = p.key_averages()
            dev = sum(getattr(e, "self_device_time_total", 0) for e in ka) / 20
            launches = sum(e.count for e in ka if "LaunchKernel" in e.key) / 20
            print(f"{name}: {sum(e.count for e in ka) / 20:.0f} profiled ops per step"
                  + (f", {launches:.0f} kernel launches, {dev / 1e3:.3f} ms of GPU kernels"
                     if cuda else "")
                  + "; top by self CPU time (per step):")
            for e in sorted(ka, key=lambda e: -e.self_cpu_time_total)[:a.top]:
                print(f"  {e.key:<52} {e.self_cpu_time_total / 20:9.1f} us  x{e.count / 20:.0f}")
    k_mtp, k_dflash = eng.default_k("mtp"), eng.default_k("dflash")
    loop_phases(eng, a.corpus, a.prompts, [("baseline", 0), ("mtp", k_mtp), ("dflash", k_dflash)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
