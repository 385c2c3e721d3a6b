"""False-alarm rate of sampled_matches_target on the clean reference engine, over seeds.

    python benchmarks/sampling_false_alarms.py [--seeds 20] [--configs mtp-k3,dflash2-k7]
        [--temperature 0.8] [--top-p 0.9] [--max-tokens 96] [--out sampling_false_alarms.json]

Each seed s samples every prompt of the pool (benchmarks/false_alarms.py's prompt_pool: the
built-in corpora other than default and ci, each distinct prompt once) with per-request seeds
derived from s, under each config, scores the sampled positions teacher-forced with the target
and runs the distribution check's tests (verify/sampled.fit) at the policy's alpha. The engine
is clean, so every rejection is a false alarm; at T > 0 different seeds give different samples,
so the seeds are independent trials. Prints per config the alarms, the 95 % Clopper-Pearson
upper bound of the rate, the samples per trial, the minimum detectable effects and the seconds
a trial took (generation + scoring: the check's cost per config on this machine).
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--configs", default="mtp-k3,dflash2-k7")
    ap.add_argument("--temperature", default="0.8")
    ap.add_argument("--top-p", default="0.9")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    pool, names = prompt_pool("all")
    prompts = [replace(p, id=pid, max_tokens=min(p.max_tokens, a.max_tokens)) for pid, p, _ in pool]
    alpha = Policy().sampled_alpha
    rows = []
    base = ReferenceEngine(engine_args={"temperature": a.temperature, "top_p": a.top_p})
    ids = [base.tokenize(p) for p in prompts]
    for seed in range(1, a.seeds + 1):
        eng = base.with_args(seed=str(seed))
        for name in a.configs.split(","):
            t0 = time.perf_counter()
            out = eng.generate(prompts, ids, SpecConfig.from_name(name), 5)
            scores = eng.score_sampled(ids, [c.token_ids for c in out])
            f = fit(scores, alpha)
            rows.append({"seed": seed, "config": name, "passed": f.passed, "rejected": f.rejected,
                         "positions": f.positions, "ks_p": f.ks_p, "loglik_p": f.loglik_p,
                         "serial_p": f.serial_p, "mde_tv": f.mde_tv, "mde_nats": f.mde_nats,
                         "seconds": time.perf_counter() - t0})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\npool: {len(prompts)} prompts of {', '.join(names)}, max_tokens <= {a.max_tokens}, "
          f"T {a.temperature}, top-p {a.top_p}, alpha {alpha}")
    print("| config | trials | false alarms | 95 % upper bound | sampled tokens / trial | "
          "MDE TV / token | MDE nats / token | s / trial |")
    print("|---|---|---|---|---|---|---|---|")
    for name in a.configs.split(","):
        r = [x for x in rows if x["config"] == name]
        k = sum(not x["passed"] for x in r)
        print(f"| {name} | {len(r)} | {k} | {cp_upper(k, len(r)):.3f} | "
              f"{np.median([x['positions'] for x in r]):.0f} | {np.median([x['mde_tv'] for x in r]):.3f} | "
              f"{np.median([x['mde_nats'] for x in r]):.3f} | {np.median([x['seconds'] for x in r]):.0f} |")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
