"""False-alarm rates of the two distribution checks on the clean reference engine, over seeds.

    python benchmarks/sampling_false_alarms.py [--seeds 20] [--configs mtp-k3,dflash2-k7]
        [--temperature 0.8] [--top-p 0.9] [--max-tokens 96] [--samples 1] [--out FILE.json]

Each seed s samples every prompt of the pool (benchmarks/false_alarms.py's prompt_pool: the
built-in corpora other than default and ci, each distinct prompt once, ``--samples`` times)
under the baseline and each config, every request with its own seed derived from s, the config
and the prompt (types.request_seed: the configs' samples and the baseline's are independent),
scores the sampled positions teacher-forced with the target and runs both checks at their
policy alphas: sampled_matches_target (verify/sampled.fit, the baseline included) and
sampled_matches_baseline (verify/two_sample, each config against the baseline of the same
seed). The engine is clean, so every rejection is a false alarm; different seeds give
different samples, so the seeds are independent trials. Prints per config the alarms of each
check, their 95 % Clopper-Pearson upper bounds, the samples per trial, the minimum detectable
effects, the smallest p-values seen, and the wall and CPU seconds of a trial (generation +
scoring of one config: the distribution check's cost per config on this machine).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from false_alarms import cp_upper, prompt_pool  # noqa: E402

from speccheck.policy import Policy  # noqa: E402
from speccheck.reference.engine import ReferenceEngine  # noqa: E402
from speccheck.types import SpecConfig  # noqa: E402
from speccheck.verify.sampled import fit  # noqa: E402
from speccheck.verify.two_sample import base_prompt_id, two_sample  # noqa: E402


def _by_prompt(outs) -> dict:
    got: dict[str, list] = {}
    for c in outs:
        got.setdefault(base_prompt_id(c.prompt_id), []).append(c.token_ids)
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--configs", default="mtp-k3,dflash2-k7")
    ap.add_argument("--temperature", default="0.8")
    ap.add_argument("--top-p", default="0.9")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    pool, names = prompt_pool("all")
    prompts = [replace(p, id=pid if j == 0 else f"{pid}#s{j}", sample=j,
                       max_tokens=min(p.max_tokens, a.max_tokens))
               for pid, p, _ in pool for j in range(a.samples)]
    policy = Policy()
    rows = []
    base = ReferenceEngine(engine_args={"temperature": a.temperature, "top_p": a.top_p})
    ids = [base.tokenize(p) for p in prompts]
    configs = ["baseline"] + a.configs.split(",")
    for seed in range(a.first_seed, a.first_seed + a.seeds):
        eng = base.with_args(seed=str(seed))
        samples = {}
        for name in configs:
            t0, c0 = time.perf_counter(), time.process_time()
            out = eng.generate(prompts, ids, SpecConfig.from_name(name), 5)
            scores = eng.score_sampled(ids, [c.token_ids for c in out])
            f = fit(scores, policy.sampled_alpha)
            row = {"seed": seed, "config": name, "target_passed": f.passed,
                   "target_rejected": f.rejected, "positions": f.positions, "ks_p": f.ks_p,
                   "loglik_p": f.loglik_p, "serial_p": f.serial_p, "boundary": f.boundary,
                   "mde_tv": f.mde_tv, "mde_nats": f.mde_nats,
                   "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}
            samples[name] = _by_prompt(out)
            if name != "baseline":
                t = two_sample(samples[name], samples["baseline"], policy.two_sample_alpha)
                row.update({"two_sample_passed": t.passed, "two_sample_rejected": t.rejected,
                            "two_sample_p": {s.name: s.p for s in t.statistics},
                            "two_sample_mde_tv": {s.name: s.mde_tv for s in t.statistics}})
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\npool: {len(pool)} prompts of {', '.join(names)} x {a.samples} sample(s), max_tokens "
          f"<= {a.max_tokens}, T {a.temperature}, top-p {a.top_p}; alphas: distribution "
          f"{policy.sampled_alpha}, two-sample {policy.two_sample_alpha}")
    print("| config | trials (seeds) | distribution alarms (95 % upper) | two-sample alarms "
          "(95 % upper) | sampled tokens / trial | MDE TV / token (distribution) | MDE nats / "
          "token | MDE TV tokens / bigrams (two-sample) | smallest p (distribution / "
          "two-sample) | s / trial (CPU s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in configs:
        r = [x for x in rows if x["config"] == name]
        k1 = sum(not x["target_passed"] for x in r)
        test1_p = min(min(x["ks_p"], x["loglik_p"], x["serial_p"]) for x in r)
        if name == "baseline":
            two, mde2, p2 = "-", "-", "-"
        else:
            k2 = sum(not x["two_sample_passed"] for x in r)
            two = f"{k2} ({cp_upper(k2, len(r)):.3f})"
            mde2 = (f"{np.median([x['two_sample_mde_tv'].get('tokens_pooled', np.nan) for x in r]):.3f} / "
                    f"{np.median([x['two_sample_mde_tv'].get('bigrams_pooled', np.nan) for x in r]):.3f}")
            p2 = f"{min(min(x['two_sample_p'].values()) for x in r):.3g}"
        print(f"| {name} | {len(r)} | {k1} ({cp_upper(k1, len(r)):.3f}) | {two} | "
              f"{np.median([x['positions'] for x in r]):.0f} | {np.median([x['mde_tv'] for x in r]):.3f} | "
              f"{np.median([x['mde_nats'] for x in r]):.3f} | {mde2} | {test1_p:.3g} / {p2} | "
              f"{np.median([x['seconds'] for x in r]):.0f} ({np.median([x['cpu_seconds'] for x in r]):.0f}) |")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
