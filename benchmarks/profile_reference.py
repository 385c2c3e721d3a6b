"""Where a step of the reference engine spends its time: one decode step, one verify forward
at several K, one MTP draft step and one DFlash block draft, timed alone (medians), then the
top ops of a decode step from torch.profiler.

    python benchmarks/profile_reference.py [--engine-arg device=cuda] [--context 200]

Speculative decoding pays when verify(K+1 tokens) + drafting costs less than the tokens per
iteration times a decode step; this prints the terms of that inequality. Not a test.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from speccheck.engines.reference.engine import ReferenceEngine
from speccheck.engines.reference.model import Cache


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--context", type=int, default=200, help="prompt tokens before the step")
    ap.add_argument("--k", default="1,3,7", help="verify widths to time")
    a = ap.parse_args(argv)
    eng = ReferenceEngine(engine_args=dict(kv.split("=", 1) for kv in a.engine_arg))
    d, target, knobs = eng.decoder, eng.decoder.target, eng.decoder.knobs
    cuda = d.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    aux_ids = tuple(eng.cfg.drafter.target_layer_ids)
    ids = [10 + i % 1000 for i in range(a.context)]

    def median_ms(f, n=100):
        f()
        sync()
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            f()
            sync()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e3

    with torch.inference_mode():
        cache, h, aux, _ = d._prefill(ids, a.context + 64, 5, aux_ids)
        snap = cache.snapshot()

        def decode():
            cache.restore(snap)
            hh, _ = target(d._t([5])[None], cache, gdn_form=knobs.gdn_decode,
                           attn_form=knobs.attn_decode)
            int(torch.log_softmax(target.logits(hh[0], 5), -1)[0].argmax())

        def verify(k):
            cache.restore(snap)
            hh, _ = target(d._t([5] * (k + 1))[None], cache, gdn_form=knobs.gdn_verify,
                           attn_form=knobs.attn_verify, per_position=True, aux_layers=aux_ids)
            torch.log_softmax(target.logits(hh[0], 5), -1).topk(2, dim=-1).indices.tolist()
            cache.commit(1)

        mcache = Cache(len(d.mtp.layers), a.context + 64) if d.mtp is not None else None

        def mtp_step():
            mcache.length = 0
            mh = d.mtp(target.embed_tokens(d._t([5]))[None], h[None, :1], mcache)
            int(target.rough_logits(mh[0, -1]).argmax())

        st = d._draft_init("dflash", a.context + 64) if d.drafter is not None else None
        tokens = ids + [5]
        pending = torch.cat([aux[i][0] for i in aux_ids], -1)

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
        with profile(activities=acts) as p:
            for _ in range(20):
                decode()
            sync()
        ka = p.key_averages()
        print(f"decode step: {sum(e.count for e in ka) / 20:.0f} profiled ops per step; "
              f"top by self CPU time (per step):")
        for e in sorted(ka, key=lambda e: -e.self_cpu_time_total)[:15]:
            print(f"  {e.key:<52} {e.self_cpu_time_total / 20:9.1f} us  x{e.count / 20:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
