#!/usr/bin/env python3
"""Write the small JSON fixtures that tests/engines/test_vllm.py checks the vllm engine's
conversion code against, as plain dicts of what vLLM returned (no pickles).

On the GPU box (real vLLM; the worker writes each fixture from the live objects):

    python scripts/capture_vllm_fixtures.py --model DIR/target [--draft DIR/drafter] \
        --out tests/fixtures/vllm --engine-arg attention_backend=TRITON_ATTN ...

It runs two short prompts as the baseline (plus one score call: prompt_logprobs) and as
MTP K=3 (and DFlash K=3 with --draft), through speccheck's own vllm engine with
SPECCHECK_VLLM_CAPTURE_DIR set. Files: baseline.json, mtp_k3.json, prompt_logprobs.json
(each with a get_metrics() dump), dflash_k3.json.

Without a GPU (``--construct --vllm-src PATH``) it builds files of the same shape from
vLLM's own pure-Python classes (vllm/logprobs.py: Logprob, FlatLogprobs;
vllm/v1/metrics/reader.py over prometheus_client counters named as vLLM names them) and a
small made-up distribution; they are marked ``"source": "constructed"`` and stand in until
real captures replace them.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def capture(args: argparse.Namespace) -> int:
    from speccheck.engines.vllm import VllmEngine
    from speccheck.engines.vllm_worker import CAPTURE_ENV
    from speccheck.types import Prompt, SpecConfig

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    eargs = dict(a.split("=", 1) for a in args.engine_arg)
    eargs[f"env.{CAPTURE_ENV}"] = str(out)
    eargs.setdefault("worker", "per-config")
    eng = VllmEngine(model=args.model, engine_args=eargs, draft=args.draft)
    prompts = [Prompt("cap-code", "code", 24, text="def fibonacci(n):\n    "),
               Prompt("cap-chat", "chat", 24, text="The capital of France is")]
    ids = [eng.tokenize(p) for p in prompts]
    try:
        base = eng.generate(prompts, ids, SpecConfig(), args.top_k)
        eng.score(ids, [c.token_ids.tolist() for c in base], args.top_k)
        configs = [SpecConfig("mtp", 3)] + ([SpecConfig("dflash", 3)] if args.draft else [])
        for cfg in configs:
            try:
                comps = eng.generate(prompts, ids, cfg, args.top_k)
                total = sum((c.spec for c in comps if c.spec), start=type(comps[0].spec)())
                print(f"{cfg.name}: drafts={total.drafts} accepted={total.accepted_tokens} "
                      f"per_pos={total.accepted_per_pos}")
            except Exception as e:  # noqa: BLE001 - keep the fixtures captured so far
                print(f"{cfg.name}: {type(e).__name__}: {str(e)[:800]}")
    finally:
        eng.close()
    print(json.dumps(eng.identity(), indent=1, default=str)[:3000])
    for f in sorted(out.glob("*.json")):
        print(f"wrote {f} ({f.stat().st_size} bytes)")
    return 0


# ---------------------------------------------------------------- constructed fixtures

def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def construct(args: argparse.Namespace) -> int:
    src = Path(args.vllm_src)
    lp_mod = _load(src / "vllm" / "logprobs.py", "vllm_logprobs")
    reader = _load(src / "vllm" / "v1" / "metrics" / "reader.py", "vllm_reader")
    from prometheus_client import REGISTRY, Counter

    from speccheck.engines.vllm_worker import logprobs_to_list, metrics_to_dicts

    rng = random.Random(0)
    vocab, top_k = 64, args.top_k

    def distribution(forced: int | None = None):
        """A made-up next-token distribution: (sorted [(id, logprob)], greedy id)."""
        logits = [rng.gauss(0, 2.0) for _ in range(vocab)]
        z = math.log(sum(math.exp(x) for x in logits))
        lps = sorted(((i, x - z) for i, x in enumerate(logits)), key=lambda t: -t[1])
        return lps, lps[0][0]

    def position(lps, token):
        """vLLM's dict for one position: the top-k plus the given token when outside it."""
        rank = {t: r + 1 for r, (t, _) in enumerate(lps)}
        d = {t: lp_mod.Logprob(logprob=lp, rank=rank[t], decoded_token=None)
             for t, lp in lps[:top_k]}
        if token not in d:
            d[token] = lp_mod.Logprob(logprob=dict(lps)[token], rank=rank[token],
                                      decoded_token=None)
        return d

    labels = ["model_name", "engine"]
    c_drafts = Counter("vllm:spec_decode_num_drafts", "", labels)
    c_tokens = Counter("vllm:spec_decode_num_draft_tokens", "", labels)
    c_acc = Counter("vllm:spec_decode_num_accepted_tokens", "", labels)
    c_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "", labels + ["position"])
    lv = ("/models/target", "0")
    k = 3
    for c in (c_drafts, c_tokens, c_acc):
        c.labels(*lv)
    for p in range(k):
        c_pos.labels(*lv, str(p))

    def snapshot():
        return metrics_to_dicts(reader.get_metrics_snapshot(), "vllm:spec_decode_")

    def request(prompt_len: int, n: int, spec: bool, flat: bool):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        before = snapshot()
        toks, sample = [], (lp_mod.FlatLogprobs() if flat else [])
        for _ in range(n):
            lps, greedy = distribution()
            toks.append(greedy)
            sample.append(position(lps, greedy))
        if spec:  # made-up acceptance: 1 prefill token, then 1 + a tokens per verify step
            steps, left = [], n - 1
            while left > 0:
                a = min(rng.randrange(k + 1), left - 1)
                steps.append(a)
                left -= 1 + a
            c_drafts.labels(*lv).inc(len(steps))
            c_tokens.labels(*lv).inc(len(steps) * k)
            c_acc.labels(*lv).inc(sum(steps))
            for p in range(k):
                c_pos.labels(*lv, str(p)).inc(sum(1 for a in steps if a > p))
        after = snapshot()
        output = {
            "request_id": str(rng.randrange(10**6)), "prompt_token_ids": prompt,
            "prompt_logprobs": None,
            "outputs": [{"index": 0, "text": "", "token_ids": toks,
                         "cumulative_logprob": None, "logprobs": logprobs_to_list(sample),
                         "finish_reason": "length", "stop_reason": None}],
            "finished": True,
            "metrics": {"arrival_time": 1.7e9, "queued_ts": 100.0, "scheduled_ts": 100.001,
                        "first_token_ts": 100.02, "last_token_ts": 100.02 + 0.004 * (n - 1),
                        "first_token_latency": 0.021, "num_generation_tokens": n},
        }
        return {"output": output, "wall_s": 0.03 + 0.004 * n, "metrics_before": before,
                "metrics_after": after}

    def score_request(prompt_len: int):
        full = [rng.randrange(vocab) for _ in range(prompt_len)]
        plp = lp_mod.create_prompt_logprobs(flat_logprobs=False)  # [None]
        for t in full[1:]:
            lps, _ = distribution()
            plp.append(position(lps, t))
        lps, greedy = distribution()
        output = {
            "request_id": "score-0", "prompt_token_ids": full,
            "prompt_logprobs": logprobs_to_list(plp),
            "outputs": [{"index": 0, "text": "", "token_ids": [greedy],
                         "cumulative_logprob": None, "logprobs": None,
                         "finish_reason": "length", "stop_reason": None}],
            "finished": True, "metrics": None,
        }
        return {"output": output}

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = {"speccheck_fixture": 1, "source": "constructed", "top_k": top_k,
              "runtime": {"note": "constructed from vLLM 0.26.0's Python classes, no GPU"}}
    files = {
        "baseline.json": {**common, "op": "generate", "speculative_config": None,
                          "row": request(12, 10, False, flat=False)},
        "mtp_k3.json": {**common, "op": "generate",
                        "speculative_config": {"method": "mtp", "num_speculative_tokens": k},
                        "row": request(9, 11, True, flat=True)},
        "prompt_logprobs.json": {**common, "op": "score", "speculative_config": None,
                                 "row": score_request(14)},
    }
    dump = metrics_to_dicts(reader.get_metrics_snapshot())
    for name, data in files.items():
        data["get_metrics"] = dump
        (out / name).write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {out / name}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="target checkpoint dir (HF layout, with mtp.* weights)")
    ap.add_argument("--draft", help="DFlash draft checkpoint dir (optional)")
    ap.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "vllm"))
    ap.add_argument("--top-k", type=int, default=5)
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--construct", action="store_true",
                    help="no GPU: build fixtures from vLLM's pure-Python classes")
    ap.add_argument("--vllm-src", help="with --construct: a directory holding vllm/ sources")
    args = ap.parse_args()
    if args.construct:
        if not args.vllm_src:
            ap.error("--construct needs --vllm-src DIR (a directory with vllm/logprobs.py)")
        return construct(args)
    if not args.model:
        ap.error("--model DIR is required (or --construct)")
    return capture(args)


if __name__ == "__main__":
    sys.exit(main())
