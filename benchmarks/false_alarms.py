"""The gate's false-alarm rate on the clean reference engine, check by check.

    python benchmarks/false_alarms.py [--seeds 20] [--prompts 10] [--max-tokens 48]
        [--configs mtp-k3,dflash2-k7] [--out false_alarms.json] [--store DIR] [--pool all|unseen]

For each seed s in 1..N: draw ``--prompts`` prompts with ``numpy.random.default_rng(s)`` from a
pool of prompts the gate's defaults were not set on -- the built-in corpora other than
``default`` and ``ci`` (code, near_tie, ocr_ja, selftest, smoke), each distinct prompt once --
cap their max_tokens, write them as a JSONL corpus, run the baseline and ``--configs`` into a
store of their own (repeats 2 with the fresh-process repeat, the corpus all at once with 2
copies, no workload axes), judge it with no golden, and record per (seed, config, check):
passed / failed / skipped and the first line of the check's message.

The engine is the clean embedded reference engine, so every failure is a false alarm. The
table gives per check (and, for the checks that run several tests, per test) the failures over
the (seed, config) pairs judged, the 95 % Clopper-Pearson upper bound of the rate, the alpha
the policy states for it, and the one-sided binomial p of seeing that many failures at a rate
of alpha (a small p: the check fails more often than its alpha says). Deterministic checks
state no alpha: on a clean engine their rate must be 0.

Caveats the numbers carry: the reference engine is deterministic, so the seeds differ only in
which prompts they draw, and seeds that share prompts are not independent trials; the two
configs of a seed share its baseline. ``--pool all`` (the default) also holds prompts that
``default`` holds too (the built-in corpora share prompts: 12 of 22 when written); ``--pool unseen``
keeps only those that neither ``default`` nor ``ci`` holds. Without a golden, acceptance_not_regressed's
paired test (acceptance_alpha) has nothing to compare with and is not exercised: only its
deterministic floor (drafted, min_tokens_per_iter) is.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from scipy.stats import beta, binomtest

from speccheck import api
from speccheck.corpus import list_corpora, load_corpus
from speccheck.verify import below_floor_p

TUNED = ("default", "ci")


def _key(p) -> str:
    return json.dumps([p.text, [dict(m) for m in p.messages or ()]], ensure_ascii=False)


def prompt_pool(which: str = "all") -> tuple[list, list[str]]:
    """(prompts, names of the corpora drawn from): every distinct prompt of the built-in
    corpora other than default/ci, in corpus-name then file order; ``unseen``: only those
    that default and ci do not hold."""
    tuned = {_key(p) for name in TUNED for p in load_corpus(name).prompts}
    names = [n for n in list_corpora() if n not in TUNED]
    pool, seen, ids = [], set(), set()
    for name in names:
        for p in load_corpus(name).prompts:
            k = _key(p)
            if k in seen or (which == "unseen" and k in tuned):
                continue
            seen.add(k)
            pid = p.id if p.id not in ids else f"{name}-{p.id}"
            ids.add(pid)
            pool.append((pid, p, k in tuned))
    return pool, names


def write_corpus(prompts, path: Path, max_tokens: int) -> None:
    with path.open("w", encoding="utf-8") as f:
        for pid, p, _ in prompts:
            rec = {"id": pid, "category": p.category, "max_tokens": min(p.max_tokens, max_tokens)}
            if p.text is not None:
                rec["text"] = p.text
            else:
                rec["messages"] = [dict(m) for m in p.messages]
            if p.ignore_eos:
                rec["ignore_eos"] = True
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")


def first_line(msg: str) -> str:
    return (msg or "").splitlines()[0] if msg else ""


def subtests(cr, pol: dict) -> dict:
    """The statistical tests inside a check, each with its own verdict: logprobs_consistent's
    drift tests and flip budget, greedy_is_argmax's near-tie test and its deterministic part,
    agrees_with_baseline's binomial floor. ``judged`` False: too little evidence to test."""
    out = {}
    checked = {c.name for c in cr.checks if not c.skipped}
    lc = cr.logprobs if "logprobs_consistent" in checked else None
    if lc is not None:
        for name, t in (("drift", lc.drift), ("golden_drift", lc.golden_drift), ("paired", lc.paired)):
            if t is not None:
                judged = not math.isnan(t.ratio)  # NaN: fewer positions than the test's minimum
                out[f"logprobs_consistent.{name}"] = {
                    "judged": judged, "failed": bool(t.drifted), "p": _num(t.p), "ratio": _num(t.ratio),
                    "n": t.spec.n, "n_reference": t.reference.n}
        f = lc.flips
        out["logprobs_consistent.flip_budget"] = {
            "judged": True, "failed": bool(f.excess), "flips": f.flips, "expected": f.expected,
            "allowed": f.allowed, "positions": f.positions}
        out["logprobs_consistent.per_position"] = {
            "judged": lc.positions > 0, "failed": lc.n_over > 0, "n_over": lc.n_over,
            "positions": lc.positions}
    e = cr.measured.get("greedy_is_argmax") if "greedy_is_argmax" in checked else None
    if e is not None:
        out["greedy_is_argmax.near_tie"] = {"judged": e.near_ties > 0, "failed": e.p < pol["argmax_alpha"],
                                            "p": _num(e.p), "near_ties": e.near_ties, "rank2": e.rank2}
        out["greedy_is_argmax.top1"] = {"judged": e.positions > 0, "failed": bool(e.violations),
                                        "violations": len(e.violations), "positions": e.positions}
    e = cr.measured.get("verify_topk_drift") if "verify_topk_drift" in checked else None
    if e is not None:
        t, tail = e.typical, e.tail
        out["verify_topk_drift.typical"] = {
            "judged": not math.isnan(t.ratio), "failed": t.decision == "fail",
            "inconclusive": t.decision == "inconclusive", "p": _num(t.p), "ratio": _num(t.ratio),
            "n": t.n, "detectable": _num(t.detectable)}
        out["verify_topk_drift.tail"] = {
            "judged": tail.above + tail.below > 0, "failed": tail.decision == "fail",
            "inconclusive": tail.decision == "inconclusive", "p": _num(tail.p), "odds": _num(tail.odds),
            "above": tail.above, "below": tail.below, "detectable": _num(tail.detectable)}
    if "agrees_with_baseline" in checked and cr.token_agreement is not None and cr.token_agreement_n:
        n, floor = cr.token_agreement_n, pol["min_token_agreement"]
        p = below_floor_p(round(cr.token_agreement * n), n, floor) if cr.token_agreement < floor else 1.0
        out["agrees_with_baseline.binomial"] = {
            "judged": True, "failed": p < pol["agreement_alpha"], "p": p, "agreement": cr.token_agreement,
            "n": n}
    return out


def _num(x):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


def run_seed(seed: int, pool, args, root: Path) -> dict:
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(pool), size=min(args.prompts, len(pool)), replace=False)
    prompts = [pool[i] for i in pick]
    corpus = root / f"seed{seed}.jsonl"
    write_corpus(prompts, corpus, args.max_tokens)
    store = root / f"store-seed{seed}"
    t0 = time.perf_counter()
    api.run(store=store, configs=args.configs, corpus=str(corpus), repeats=2, concurrent=2,
                  axes="none", log=lambda s: None)
    t_run = time.perf_counter() - t0
    suite, result, _ = api.evaluate(store, golden_dir=None)
    link = suite.load_escalation()
    escalated = None
    if link is not None:  # the first stage's inconclusive checks, judged before the escalation
        escalated = {"suite": link["suite"], "checks": link["checks"]}
    pol = result.policy
    configs = {}
    for cr in result.configs:
        configs[cr.config] = {
            "verdict": cr.verdict,
            "checks": {c.name: {"status": {"skip": "skipped", "pass": "passed"}.get(c.state, "failed"),
                                "message": first_line(c.message)} for c in cr.checks},
            "tests": subtests(cr, pol),
        }
    return {"seed": seed, "prompts": [pid for pid, _, _ in prompts],
            "prompts_in_default": [pid for pid, _, tuned in prompts if tuned],
            "run_s": round(t_run, 1), "escalated": escalated, "noise": result.noise, "noise_missing": result.noise_missing,
            "policy": pol, "configs": configs}


def cp_upper(k: int, n: int, conf: float = 0.95) -> float:
    """One-sided Clopper-Pearson upper bound at ``conf``."""
    return 1.0 if k >= n else float(beta.ppf(conf, k + 1, n - k))


ALPHA_OF = {  # the policy key stating each check's (or test's) false-alarm rate
    "agrees_with_baseline": "agreement_alpha",
    "agrees_with_baseline.binomial": "agreement_alpha",
    "logprobs_consistent": "logprob_drift_alpha",
    "logprobs_consistent.drift": "logprob_drift_alpha",
    "logprobs_consistent.golden_drift": "logprob_drift_alpha",
    "logprobs_consistent.paired": "logprob_drift_alpha",
    "greedy_is_argmax": "argmax_alpha",
    "greedy_is_argmax.near_tie": "argmax_alpha",
    "verify_topk_drift": "topk_drift_alpha",
    "verify_topk_drift.typical": "topk_drift_alpha",
    "verify_topk_drift.tail": "topk_drift_alpha",
    "acceptance_not_regressed": "acceptance_alpha",
    "acceptance_replayed": "replay_alpha",
}
NOTE_OF = {
    "greedy_is_argmax": "top-1 check + near-tie test",
    "greedy_is_argmax.near_tie": "reference engine reports the logprobs it took the argmax of: p is 0 or 1",
    "greedy_is_argmax.top1": "no α: must never fail",
    "agrees_with_baseline": "binomial floor (min_token_agreement) + prefix/text floors (0: report only)",
    "logprobs_consistent": "drift + paired test at α each, flip budget, per-position limit",
    "logprobs_consistent.drift": "fails only with effect > max_logprob_drift AND p < α",
    "verify_topk_drift": "after escalation: a first-stage inconclusive judged again on the continued corpus",
    "verify_topk_drift.typical": "first stage; effect > topk_drift_max_ratio AND p < α",
    "verify_topk_drift.tail": "first stage; odds > topk_tail_max_odds AND p < α",
    "logprobs_consistent.paired": "fails only with effect > max_logprob_drift AND p < α",
    "logprobs_consistent.flip_budget": "multiple x expected + slack; no α stated",
    "logprobs_consistent.per_position": "max(floor, multiple x noise); no α stated",
    "acceptance_not_regressed": "without a golden only its floor is judged; acceptance_alpha not exercised",
    "speedup": "report only (min_speedup 0)",
    "acceptance_deterministic": "report only (require_deterministic_acceptance off)",
}


def tabulate(seeds: list[dict]) -> tuple[list[dict], str]:
    pol = seeds[0]["policy"]
    counts: dict[str, list[int]] = {}  # name -> [failed, judged, skipped]
    for s in seeds:
        for cfg in s["configs"].values():
            for name, c in cfg["checks"].items():
                row = counts.setdefault(name, [0, 0, 0])
                if c["status"] == "skipped":
                    row[2] += 1
                else:
                    row[1] += 1
                    row[0] += c["status"] == "failed"
            for name, t in cfg["tests"].items():
                row = counts.setdefault("  " + name, [0, 0, 0])
                if not t["judged"]:
                    row[2] += 1
                else:
                    row[1] += 1
                    row[0] += bool(t["failed"])
    order = [n for n in counts if not n.startswith("  ")]
    tests = [n for n in counts if n.startswith("  ")]
    ordered = []
    for n in order:
        ordered += [n] + [t for t in tests if t.strip().split(".")[0] == n]
    rows = []
    for name in ordered:
        k, n, skipped = counts[name]
        bare = name.strip()
        key = ALPHA_OF.get(bare)
        alpha = pol.get(key) if key else None
        if key == "acceptance_alpha":
            alpha = None  # not exercised without a golden (see NOTE_OF)
        p = binomtest(k, n, alpha, alternative="greater").pvalue if (alpha and n) else None
        consistent = (p is None and k == 0) or (p is not None and p >= 0.05)
        rows.append({"check": name, "failed": k, "judged": n, "skipped": skipped,
                     "cp95_upper": cp_upper(k, n) if n else None, "alpha_key": key, "alpha": alpha,
                     "binom_p": p, "consistent": consistent if n else None,
                     "note": NOTE_OF.get(bare) or ("" if key else
                                                    "axes none: not run" if bare.startswith("axis_")
                                                    else "no α: must never fail")})
    lines = ["| check | failed / judged | 95 % CP upper | α (policy) | binomial p (rate > α) | consistent | note |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        a = f"{r['alpha']:g} ({r['alpha_key']})" if r["alpha"] is not None else "—"
        cp = f"≤ {100 * r['cp95_upper']:.1f} %" if r["cp95_upper"] is not None else "—"
        pv = f"{r['binom_p']:.2g}" if r["binom_p"] is not None else "—"
        ok = {True: "yes", False: "**no**", None: "—"}[r["consistent"]]
        skip = f" ({r['skipped']} skipped)" if r["skipped"] else ""
        name = r["check"].replace("  ", "↳ ") if r["check"].startswith("  ") else r["check"]
        lines.append(f"| {name} | {r['failed']} / {r['judged']}{skip} | {cp} | {a} | {pv} | {ok} | {r['note']} |")
    return rows, "\n".join(lines)


def calibration(seeds: list[dict]) -> str:
    """Under the null a test's p is (about) uniform: its share of p <= 0.05 and <= 0.01 over
    all runs checks the calibration at alphas large enough for N seeds to see."""
    ps: dict[str, list[float]] = {}
    for s in seeds:
        for cfg in s["configs"].values():
            for name, t in cfg["tests"].items():
                if t["judged"] and t.get("p") is not None:
                    ps.setdefault(name, []).append(t["p"])
    out = []
    for name, v in ps.items():
        v = np.asarray(v)
        out.append(f"{name}: n {len(v)}, min p {v.min():.2g}, median p {np.median(v):.2g}, "
                   f"p <= 0.05: {int((v <= 0.05).sum())}, p <= 0.01: {int((v <= 0.01).sum())}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--configs", default="mtp-k3,dflash2-k7")
    ap.add_argument("--pool", choices=("all", "unseen"), default="all")
    ap.add_argument("--out", default="false_alarms.json")
    ap.add_argument("--store", default=None, help="directory for the per-seed corpora and stores "
                    "(default: a temporary directory, removed at the end)")
    args = ap.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    pool, names = prompt_pool(args.pool)
    print(f"pool: {len(pool)} distinct prompts of {', '.join(names)} "
          f"({sum(t for _, _, t in pool)} of them also in default/ci); {args.prompts} per seed, "
          f"max_tokens <= {args.max_tokens}; configs baseline, {', '.join(args.configs)}", flush=True)
    tmp = None if args.store else tempfile.TemporaryDirectory(prefix="false-alarms-")
    root = Path(args.store or tmp.name)
    root.mkdir(parents=True, exist_ok=True)
    seeds, t0 = [], time.perf_counter()
    try:
        for s in range(1, args.seeds + 1):
            r = run_seed(s, pool, args, root)
            seeds.append(r)
            failed = [f"{cfg}:{n}" for cfg, c in r["configs"].items()
                      for n, v in c["checks"].items() if v["status"] == "failed"]
            esc = f"  escalated {r['escalated']['checks']}" if r["escalated"] else ""
            print(f"seed {s:>2}: {r['run_s']:6.1f} s  prompts {','.join(r['prompts'])}  "
                  f"failed: {', '.join(failed) or 'none'}{esc}", flush=True)
            Path(args.out).write_text(json.dumps({"args": vars(args), "seeds": seeds}, indent=1, default=str))
    finally:
        if tmp is not None:
            tmp.cleanup()
    wall = time.perf_counter() - t0
    rows, table = tabulate(seeds)
    cal = calibration(seeds)
    Path(args.out).write_text(json.dumps({"args": vars(args), "wall_s": round(wall, 1), "table": rows,
                                          "seeds": seeds}, indent=1, default=str))
    n_esc = sum(1 for s in seeds if s["escalated"])
    unsure: dict[str, int] = {}
    for s in seeds:
        for cfg in s["configs"].values():
            for name, t in cfg["tests"].items():
                unsure[name] = unsure.get(name, 0) + bool(t.get("inconclusive"))
    print("first-stage inconclusive per test: "
          + (", ".join(f"{k} {v}" for k, v in unsure.items() if v) or "none"))
    print(f"\n{len(seeds)} seeds in {wall:.0f} s; {n_esc} escalated\n\n{table}\n\np-values of the statistical tests:\n{cal}")
    fails = {}
    for s in seeds:
        for cfg, c in s["configs"].items():
            for n, v in c["checks"].items():
                if v["status"] == "failed":
                    fails.setdefault(n, []).append(f"seed {s['seed']} {cfg}: {v['message']}")
    for n, msgs in fails.items():
        print(f"\n{n} failed {len(msgs)} time(s):\n  " + "\n  ".join(msgs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
