"""False-alarm rates of the two distribution checks on the clean reference engine, over seeds.

    python benchmarks/sampling_false_alarms.py [--seeds 20] [--configs mtp-k3,dflash2-k7]
        [--temperature 0.8] [--top-p 0.9] [--max-tokens 96] [--samples 1] [--out FILE.json]
        [--null-redraws N] [--null-score-top-k K]

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

``--null-redraws N`` (default 0: off) measures sampled_matches_target's statistic under the
exact null, at the real distributions' shapes, where engine trials (~30 s each) cannot give a
rate precise enough to compare with alpha. Per trial (seed, config) the stored outputs are
scored teacher-forced over the whole vocabulary; at every sampled position the target's exact
sampling distribution is that row under the run's temperature / top-k / top-p
(``sampling_dist.transform_full``, the transform ``sampled_rows`` applies), and each position's
token is redrawn from it N times (a seeded numpy generator, inverse CDF), independently across
positions and redraws, keeping the stored prefixes. Each redraw's rows are what
``sampled_rows`` gives the redrawn tokens from the scorer's top ``--null-score-top-k``
(default the engine's ``sampled_score_top_k``: the whole vocabulary for the reference engine;
20 emulates vLLM's scorer, with the tail category and the nucleus bounds), and ``fit`` runs on
them at the policy's ``sampled_alpha``. Keeping the prefix at t + 1 while redrawing t is a null
for these statistics: every redrawn token is an independent draw from the exact conditional
distribution at its prefix, so the randomized PIT values are i.i.d. uniform and the
log-likelihood terms independent with mean zero. The redraw uses every config's outputs, not
only the baseline's: the prefixes only fix which distributions the positions have (the tokens
tested are the redraws, not the engine's), so each config's outputs are one more set of real
distribution shapes, and the null holds whichever sampler produced them. Two PIT
randomisations are reported: ``shipped`` is the check as it ships (its PIT seeded by a digest
of the scores, so each redraw draws its own uniforms, and the same store always the same),
``redrawn`` gives each redraw a fresh salt as well (``verify.sampled.PIT_SEED``: the rate
averaged over the randomisation, which is what the tests' level refers to); the two agree
when the digest seeding does what it is for. The table gives per config and pooled: redraws, alarms, rate, the
two-sided 95 % Clopper-Pearson interval, the count of each test Holm rejected, and the
standard deviations of the martingale and lag-1 z (1 under the null).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from scipy.stats import beta

sys.path.insert(0, str(Path(__file__).parent))
from false_alarms import cp_upper, prompt_pool  # noqa: E402

from speccheck.policy import Policy  # noqa: E402
from speccheck.reference.engine import ReferenceEngine  # noqa: E402
from speccheck.types import SpecConfig, sampling_of  # noqa: E402
from speccheck.verify.sampled import fit  # noqa: E402
from speccheck.verify.two_sample import base_prompt_id, two_sample  # noqa: E402


def _by_prompt(outs) -> dict:
    got: dict[str, list] = {}
    for c in outs:
        got.setdefault(base_prompt_id(c.prompt_id), []).append(c.token_ids)
    return got


# --- the statistic under the exact null -------------------------------------------------------

class ExactNull:
    """One trial's stored prefixes with the target's exact sampling distribution at each sampled
    position, for redrawing every token afresh from it.

    ``scored``: the target's teacher-forced raw logprobs over the whole vocabulary at each
    position of each stored output (``engine.score(..., top_k=V)``). The sampling distribution
    is ``transform_full`` of that row (temperature, top-k, top-p, ties by lowest id: what
    ``sampled_rows`` applies). The scorer the check reads is emulated by the top
    ``score_top_k`` of the same row (the reference engine's own ``sampled_score_top_k`` is the
    whole vocabulary; 20 is vLLM's, with the tail category and the nucleus bounds). For every
    token the sampler can draw at a position, its row is computed once by ``sampled_rows`` --
    the real path, row by row (each row of ``sampled_rows`` depends on its own position and
    token only, so looking a row up is the same as computing it for the redrawn token)."""

    def __init__(self, scored, sp: dict, vocab_size: int, score_top_k: int, chunk: int = 1 << 21):
        from speccheck.verify.sampling_dist import sampled_rows, transform_full

        self.lengths = [len(s.token_logprobs) for s in scored]
        cdfs, tokens, tables = [], [], []
        for s in scored:
            n = len(s.token_logprobs)
            if n == 0:
                continue
            full = np.full((n, vocab_size), -np.inf)
            np.put_along_axis(full, np.asarray(s.topk_ids, np.int64),
                              np.asarray(s.topk_logprobs, np.float64), 1)
            probs = transform_full(full, sp["temperature"], sp["top_p"], sp["top_k"])
            # the scorer's top-k: the row's most probable tokens, ties by lowest id
            k = min(score_top_k, vocab_size)
            order = np.lexsort((np.broadcast_to(np.arange(vocab_size), full.shape), -full), axis=-1)[:, :k]
            ids_k, lp_k = order, np.take_along_axis(full, order, 1)
            pos, tok = np.nonzero(probs > 0)  # every token the sampler can draw, by position
            cut = np.cumsum(np.bincount(pos, minlength=n))[:-1]
            cdfs += [np.cumsum(p) for p in np.split(probs[pos, tok], cut)]
            tokens += np.split(tok, cut)
            step = max(1, chunk // k)
            rows = [sampled_rows(ids_k[pos[i:i + step]], lp_k[pos[i:i + step]], tok[i:i + step],
                                 sp["temperature"], sp["top_p"], sp["top_k"], vocab_size,
                                 full[pos[i:i + step], tok[i:i + step]])
                    for i in range(0, len(pos), step)]
            tables.append(np.concatenate(rows))
        self.cdfs, self.tokens = cdfs, tokens  # per position: its support's CDF and token ids
        self.support = np.array([len(c) for c in cdfs])
        self.offset = np.concatenate([[0], np.cumsum(self.support)[:-1]]).astype(np.int64)
        self.table = np.concatenate(tables) if tables else np.zeros((0, 6))

    @property
    def positions(self) -> int:
        return len(self.cdfs)

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """[n, positions] indices into the support of each position: n independent draws at
        every position from its exact distribution (inverse CDF of one uniform each)."""
        u = rng.random((n, self.positions))
        out = np.empty((n, self.positions), np.int64)
        for t, c in enumerate(self.cdfs):
            out[:, t] = np.minimum(np.searchsorted(c, u[:, t] * c[-1], side="right"), len(c) - 1)
        return out

    def rows(self, drawn: np.ndarray) -> list[np.ndarray]:
        """One redraw's per-output rows, as ``sampled_rows`` gives them for the drawn tokens."""
        r = self.table[self.offset + drawn]
        return np.split(r, np.cumsum(self.lengths)[:-1])


def cp_interval(k: int, n: int, conf: float = 0.95) -> tuple[float, float]:
    """Two-sided Clopper-Pearson interval of a binomial rate at ``conf``."""
    lo = 0.0 if k == 0 else float(beta.ppf((1 - conf) / 2, k, n - k + 1))
    hi = 1.0 if k >= n else float(beta.ppf(1 - (1 - conf) / 2, k + 1, n - k))
    return lo, hi


NULL_TESTS = ("pit_uniform", "pit_independent", "loglik_martingale", "support")


def null_redraws(null: ExactNull, redraws: int, alpha: float, rng: np.random.Generator) -> dict:
    """``fit`` over ``redraws`` redraws of every token of one trial, per PIT randomisation:
    ``shipped`` (the check as it ships: the PIT seeded by a digest of the scores) and
    ``redrawn`` (a fresh PIT_SEED salt per redraw as well: the statistic's rate averaged over
    its randomisation, as the design states it)."""
    from speccheck.verify import sampled

    drawn = null.draw(redraws, rng)
    pit_seeds = rng.integers(0, 2 ** 63, redraws)
    out = {}
    for mode in ("shipped", "redrawn"):
        got = {"alarms": 0, **{t: 0 for t in NULL_TESTS}, "ks_p": [], "loglik_p": [],
               "serial_p": [], "z_loglik": [], "z_serial": []}
        keep = sampled.PIT_SEED
        try:
            for r in range(redraws):
                if mode == "redrawn":
                    sampled.PIT_SEED = int(pit_seeds[r])
                f = sampled.fit(null.rows(drawn[r]), alpha)
                got["alarms"] += not f.passed
                for t in f.rejected:
                    got[t] += 1
                for key in ("ks_p", "loglik_p", "serial_p", "z_loglik", "z_serial"):
                    got[key].append(float(getattr(f, key)))
        finally:
            sampled.PIT_SEED = keep
        out[mode] = got
    return out


def print_null_table(rows: list[dict], configs: list[str], a, alpha: float) -> None:
    k = a.null_score_top_k or "the engine's"
    print(f"\nexact null: every sampled token redrawn {a.null_redraws} times per trial from the "
          f"target's exact distribution at its stored prefix, rows by sampled_rows (scorer top-k "
          f"{k}), verify.sampled.fit at alpha {alpha}; 95 % two-sided Clopper-Pearson")
    print("| PIT seed | config | trials | positions / trial | redraws | alarms | rate | 95 % interval "
          "| pit_uniform | pit_independent | loglik_martingale | support | sd z loglik / lag-1 | "
          "s / trial (CPU s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mode in ("shipped", "redrawn"):
        for name in configs + ["all"]:
            r = [x["null"] for x in rows if "null" in x and name in ("all", x["config"])]
            n = sum(x["redraws"] for x in r)
            k1 = sum(x[mode]["alarms"] for x in r)
            lo, hi = cp_interval(k1, n)
            tests = " | ".join(str(sum(x[mode][t] for x in r)) for t in NULL_TESTS)
            zl = np.concatenate([x[mode]["z_loglik"] for x in r])
            zs = np.concatenate([x[mode]["z_serial"] for x in r])
            print(f"| {mode} | {name} | {len(r)} | {np.median([x['positions'] for x in r]):.0f} | "
                  f"{n} | {k1} | {k1 / n:.4f} | [{lo:.4f}, {hi:.4f}] | {tests} | "
                  f"{np.std(zl):.3f} / {np.std(zs):.3f} | "
                  f"{np.median([x['seconds'] for x in r]):.0f} "
                  f"({np.median([x['cpu_seconds'] for x in r]):.0f}) |")


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
    ap.add_argument("--null-redraws", type=int, default=0,
                    help="per trial, redraw every sampled token N times from the target's exact "
                         "distribution at its stored prefix and run the check's fit (0: off)")
    ap.add_argument("--null-score-top-k", type=int, default=0,
                    help="the scorer's top-k the redraws' rows are built from (0: the engine's "
                         "sampled_score_top_k, the whole vocabulary for the reference engine; "
                         "20: vLLM's, with the tail category)")
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
            if a.null_redraws > 0:
                t1, c1 = time.perf_counter(), time.process_time()
                vocab = eng.vocab_size()
                null = ExactNull(eng.score(ids, [c.token_ids for c in out], top_k=vocab),
                                 sampling_of(eng.engine_args), vocab,
                                 a.null_score_top_k or eng.sampled_score_top_k())
                got = null_redraws(null, a.null_redraws, policy.sampled_alpha,
                                   np.random.default_rng([seed, configs.index(name), 0x4E55]))
                row["null"] = {"positions": null.positions, "redraws": a.null_redraws,
                               "support_median": float(np.median(null.support)),
                               "support_one": float(np.mean(null.support == 1)),
                               "seconds": time.perf_counter() - t1,
                               "cpu_seconds": time.process_time() - c1, **got}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "null"}), flush=True)
            if "null" in row:
                print(json.dumps({"null": {m: {k: v for k, v in row["null"][m].items()
                                               if not isinstance(v, list)}
                                           for m in ("shipped", "redrawn")}}), flush=True)
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
    if a.null_redraws > 0:
        print_null_table(rows, configs, a, policy.sampled_alpha)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
