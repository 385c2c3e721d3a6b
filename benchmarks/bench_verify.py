"""The store the verifier benchmark times `speccheck diff` and `speccheck gate` on: >= 1 M
generated tokens, built once and cached. The timing itself is pytest-benchmark's, in
benchmarks/test_bench_verify.py:

    pytest benchmarks/ --benchmark-only [--benchmark-cprofile=cumtime]

This script only builds (or finds) the store and prints where it is:

    python benchmarks/bench_verify.py [--prompts 500] [--min-len 64] [--max-len 256]
        [--configs baseline,mtp-k3,dflash-k7,dflash2-k7] [--cache /tmp/...] [--rebuild]

The store is synthetic but shaped like a real `speccheck run` of a vLLM server: every config
twice (the second a fresh process) plus the whole corpus all at once with 2 copies, the
baseline's teacher-forced rescoring of every run 0, spec counters per request, attribution
files. Numbers follow a latent top-5 per position: the baseline's decode path, each spec
path and the prefill (rescoring) path each add their own kernel noise, so teacher-forced
flips happen at near-ties only; a few prompts per spec config diverge at a near-tie, one
config also at two high-confidence positions (that config fails the gate, as it should), and
a copy of one prompt per spec config splits at a near-tie in the run all at once. It is
written through the real Store API, once, and cached.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from speccheck.store import Store
from speccheck.types import Completion, RunRecord, Scored, SpecConfig, SpecCounters
from speccheck.verify import canonical_rows

BUILDER_VERSION = 3  # 2: top-1 logprobs at least 8 noise sds below 0 (no path reports one above 0);
#                      3: each row one distribution's (its probabilities add up to less than 1)
VOCAB = 151_000  # ids drawn below the end-of-sequence id, so EOS never appears mid-stream
EOS = 151_645
TOP_K = 5
SIGMA = 0.004  # kernel noise of each path (nats, one sd): tau_tie = max(0.02, 4 x p99)
NEAR_TIE = 0.015  # latent margins below this are near-ties
WORDS = np.array([w for w in ("the of and to in is for on that with as by this be are from at or an "
                              "it not was have has but all can more one its def return self if else "
                              "import None True False print value data list dict key model token").split()])
CONFIG_NAMES = "baseline,mtp-k3,dflash-k7,dflash2-k7"


# --- the synthetic store ------------------------------------------------------------------------

class Latent:
    """The latent top-k of one stream's contexts: ``ids[i, 0]`` is the token chosen there
    (greedy), ``lp`` descending; every path reports these plus its own noise."""

    def __init__(self, ids: np.ndarray, lp: np.ndarray):
        self.ids, self.lp = ids, lp

    @property
    def tokens(self) -> np.ndarray:
        return self.ids[:, 0]

    def __len__(self) -> int:
        return len(self.ids)

    def cat(self, other: "Latent") -> "Latent":
        return Latent(np.concatenate([self.ids, other.ids]), np.concatenate([self.lp, other.lp]))

    def head(self, n: int) -> "Latent":
        return Latent(self.ids[:n], self.lp[:n])


def latent_rows(rng: np.random.Generator, n: int, stop: bool) -> Latent:
    """n positions: random argmax tokens, 4 distinct runners-up, margins a mixture of
    confident (most), unsure (~10 %) and near-ties (~1.5 %); the last token EOS if ``stop``."""
    tok = rng.integers(0, VOCAB, n)
    band = VOCAB // TOP_K
    offs = 1 + np.arange(TOP_K - 1) * band + rng.integers(0, band - 1, (n, TOP_K - 1))
    ids = (tok[:, None] + np.concatenate([np.zeros((n, 1), np.int64), offs], 1)) % VOCAB
    if stop:
        ids[-1, 0] = EOS
    u = rng.random(n)
    margin = np.where(u < 0.015, rng.uniform(0, NEAR_TIE, n),
                      np.where(u < 0.12, rng.exponential(0.4, n), 1 + rng.exponential(2.5, n)))
    steps = np.concatenate([np.zeros((n, 1)), margin[:, None], rng.exponential(0.7, (n, TOP_K - 2))], 1)
    top1 = -np.abs(rng.normal(0, 0.4, n)) - 8 * SIGMA  # no path's noise lifts a logprob above 0
    rows = top1[:, None] - np.cumsum(steps, 1)
    # one distribution's: the row's probabilities add up to less than 1, with room for noise
    mass = np.logaddexp.reduce(rows, axis=1)
    rows -= np.maximum(mass, 0.0)[:, None] + np.where(mass > -8 * SIGMA, 8 * SIGMA, 0.0)[:, None]
    return Latent(ids.astype(np.int32), rows.astype(np.float32))


def decode_view(rng, lat: Latent) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What a decode path reports: (topk ids, topk logprobs, chosen logprobs); its noise shifts
    a whole row, so its greedy choice is the latent argmax."""
    lp = lat.lp + rng.normal(0, SIGMA, (len(lat), 1)).astype(np.float32)
    return lat.ids, lp, lp[:, 0].copy()


def rescore_view(noise: np.ndarray, lat: Latent, forced: np.ndarray) -> Scored:
    """The baseline's teacher-forced scores of ``forced`` tokens in ``lat``'s contexts: the
    prefill path's per-entry noise may reorder near-ties (teacher-forced flips)."""
    lp = lat.lp + noise
    hit = lat.ids == forced[:, None]
    token_lp = np.where(hit.any(1), (lp * hit).sum(1), np.float32(-15.0)).astype(np.float32)
    ids, lp = canonical_rows(lat.ids, lp)
    return Scored(ids, lp, token_lp)


def counters(rng, n: int, k: int, accept: float) -> SpecCounters:
    """Spec counters of one request of n tokens: each verify step accepts a geometric number
    of draft tokens (at most K) and emits it + 1, until n - 1 tokens after the first."""
    a = np.minimum(rng.geometric(1 - accept, n) - 1, k)
    emitted = np.cumsum(a + 1)
    steps = int(np.searchsorted(emitted, n - 1)) + 1 if n > 1 else 0
    a = a[:steps]
    return SpecCounters(steps, steps * k, int(a.sum()), [int((a > i).sum()) for i in range(k)], steps)


def diverge(rng, lat: Latent, stop: bool, max_tokens: int, near_tie: bool) -> tuple[Latent, int] | None:
    """A stream that follows ``lat`` up to a position p and then chooses another token there
    (the runner-up at a near-tie, or a token outside the top-k at a confident position) and
    goes on in its own contexts; None when ``lat`` has no such position."""
    m = lat.lp[:, 0] - lat.lp[:, 1]
    where = np.flatnonzero(m < NEAR_TIE if near_tie else m > 2.0)
    where = where[where < len(lat) - 1]
    if not len(where):
        return None
    p = int(rng.choice(where))
    row_ids, row_lp = lat.ids[p].copy(), lat.lp[p].copy()
    if near_tie:
        row_ids[[0, 1]] = row_ids[[1, 0]]
        row_lp[1] = row_lp[0] - rng.uniform(0, NEAR_TIE)
    else:
        row_ids[0] = (row_ids[0] + VOCAB // (2 * TOP_K)) % VOCAB
    n = max_tokens if not stop else int(rng.integers(p + 2, max_tokens + 1))
    rest = latent_rows(rng, n - p - 1, stop and n < max_tokens)
    return lat.head(p).cat(Latent(row_ids[None], row_lp[None])).cat(rest), p


def text_of(tokens: np.ndarray) -> str:
    return " ".join(WORDS[tokens % len(WORDS)].tolist())


def build_store(root: Path, prompts: int = 500, min_len: int = 64, max_len: int = 256,
                configs: str = CONFIG_NAMES, seed: int = 0, log=print) -> dict:
    """Write the synthetic suite into a fresh store at ``root`` through the Store API; returns
    what it holds (runs, completions, generated tokens)."""
    rng = np.random.default_rng(seed)
    names = configs.split(",")
    if names[0] != "baseline":
        raise ValueError("--configs: the first config must be baseline")
    spec = [SpecConfig.from_name(n) for n in names[1:]]
    faulty = spec[-1].name if spec else None  # the config with high-confidence divergences
    ids = [f"p{i:05d}" for i in range(prompts)]
    caps = rng.choice(np.arange(min_len, max_len + 1, 32), prompts)  # max_tokens per prompt
    stops = rng.random(prompts) < 0.4
    lens = np.where(stops, [int(rng.integers(min_len, c + 1)) for c in caps], caps)
    stops &= lens < caps
    base = [latent_rows(rng, int(n), bool(s)) for n, s in zip(lens, stops)]
    prefill_noise = [rng.normal(0, SIGMA, (len(b), TOP_K)).astype(np.float32) for b in base]
    prompt_ids = {pid: rng.integers(0, VOCAB, int(rng.integers(20, 400))).astype(np.int32) for pid in ids}

    corpus_hash = hashlib.sha256(json.dumps([prompts, min_len, max_len, configs, seed]).encode()).hexdigest()
    meta = {"engine": "vllm", "model": "Qwen/Qwen3-8B", "draft": None, "engine_args": {},
            "corpus": "bench-verify", "corpus_hash": corpus_hash, "ignore_eos": False, "top_k": TOP_K,
            "speccheck_version": "0.1.0"}
    identity = {"engine": "vllm", "model_id": "Qwen/Qwen3-8B", "dtype": "bf16", "device": "synthetic"}
    store = Store(root)
    sid = "vllm-Qwen3-8B-bench-verify-" + corpus_hash[:10]
    stats = {"runs": 0, "completions": 0, "generated_tokens": 0, "prompts": prompts}

    def completion(i: int, lat: Latent, rate: float, cfg: SpecConfig, stop: bool) -> Completion:
        tid, tlp, lp = decode_view(rng, lat)
        n = len(lat)
        finish = "stop" if stop else "length"
        c = counters(rng, n, cfg.k, 0.55 + 0.1 * (i % 3)) if cfg.k else None
        return Completion(ids[i], prompt_ids[ids[i]], lat.tokens, lp, tid, tlp, text_of(lat.tokens), finish,
                          float(rng.uniform(0.03, 0.2)), (n - 1) / (rate * rng.uniform(0.9, 1.1)), c)

    def write(cfg: SpecConfig, repeat: int, comps: list[Completion], copies: int = 0) -> None:
        suite.write_run(RunRecord(cfg, identity, "bench-verify", corpus_hash, repeat, repeat == 1, "ok", None,
                                  comps, wall_s=float(sum(c.decode_s + c.ttft_s for c in comps)), copies=copies))
        stats["runs"] += 1
        stats["completions"] += len(comps)
        stats["generated_tokens"] += sum(c.n_tokens for c in comps)

    with store.lock():
        suite = store.suite(sid, meta)
        plan = {n: {"repeats": 2, "fresh_process_repeat": True, "concurrent": 2, "rescore": True,
                    "attribute": n != "baseline"} for n in names}
        suite.extend_plan(plan, ["--engine", "vllm", "--corpus", "bench-verify"])
        suite.write_inputs({pid: a.tolist() for pid, a in prompt_ids.items()})
        for cfg in [SpecConfig()] + spec:
            t = time.perf_counter()
            lats, ends, divs = [], [], []
            for i, (lat, stop) in enumerate(zip(base, stops)):
                kind = None
                if cfg.k and rng.random() < 0.08:
                    kind = "near_tie"
                if cfg.name == faulty and i in (prompts // 3, 2 * prompts // 3):
                    kind = "high"
                d = diverge(rng, lat, bool(stop), int(caps[i]), kind == "near_tie") if kind else None
                if d is not None:
                    lat = d[0]
                    divs.append((i, d[1], lat))
                lats.append(lat)
                ends.append(int(lat.ids[-1, 0]) == EOS)
            rate = 60.0 * (1.6 if cfg.k else 1.0)
            # r0 and the fresh-process r1 give the same tokens; their logprobs carry the same
            # run-to-run noise (a deterministic engine repeats itself bit for bit)
            state = rng.bit_generator.state
            r0 = [completion(i, lat, rate, cfg, e) for i, (lat, e) in enumerate(zip(lats, ends))]
            rng.bit_generator.state = state
            r1 = [completion(i, lat, rate, cfg, e) for i, (lat, e) in enumerate(zip(lats, ends))]
            write(cfg, 0, r0)
            write(cfg, 1, r1)
            # all at once, 2 copies: the first as alone, the second splits one prompt at a near-tie
            second = list(r0)
            if cfg.k:
                for i in rng.permutation(prompts):
                    if all(j != i for j, _, _ in divs):
                        d = diverge(rng, lats[i], ends[i], int(caps[i]), True)
                        if d is not None:
                            second[i] = completion(int(i), d[0], rate, cfg, int(d[0].ids[-1, 0]) == EOS)
                            break
            write(cfg, -1, r0 + second, copies=2)
            # the baseline's teacher-forced rescoring of run 0: the prefill path's noise in the
            # shared prefix is the baseline's own (same contexts, same kernel path)
            scored = []
            for i, lat in enumerate(lats):
                p = next((p for j, p, _ in divs if j == i), None)
                own = len(lat) if p is None else p + 1
                noise = np.concatenate([prefill_noise[i][:own],
                                        rng.normal(0, SIGMA, (len(lat) - own, TOP_K)).astype(np.float32)])
                context = lat if p is None else base[i].head(p + 1).cat(Latent(lat.ids[p + 1:], lat.lp[p + 1:]))
                scored.append(rescore_view(noise, context, lat.tokens))
            suite.write_rescore(cfg.name, 0, ids, scored)
            if cfg.k:
                suite.write_attribution(cfg.name, [
                    {"prompt_id": ids[i], "position": p, "base_token": int(base[i].ids[p, 0]),
                     "spec_token": int(lat.ids[p, 0]), "paths": {"attn=multi": int(lat.ids[p, 0])},
                     "reproduces_spec": ["attn=multi"], "reproduces_base": [], "attributed_to": ["attn=multi"]}
                    for i, p, lat in divs])
            log(f"  {cfg.name}: {len(divs)} divergent prompt(s), {time.perf_counter() - t:.1f} s")
        store.set_latest(sid)
    return stats


def cached_store(cache: Path, prompts: int, min_len: int, max_len: int, configs: str, seed: int,
                 rebuild: bool = False, log=print) -> tuple[Path, dict]:
    """The store for these parameters, built once under ``cache`` (BUILT marks it finished)."""
    key = f"v{BUILDER_VERSION}-p{prompts}-{min_len}-{max_len}-s{seed}-" + \
        hashlib.sha256(configs.encode()).hexdigest()[:8]
    root = cache / key
    done = root / "BUILT"
    if done.exists() and not rebuild:
        return root, json.loads(done.read_text())
    shutil.rmtree(root, ignore_errors=True)
    log(f"building the store in {root} (once; --rebuild redoes it)")
    t = time.perf_counter()
    stats = build_store(root, prompts, min_len, max_len, configs, seed, log)
    stats["build_s"] = round(time.perf_counter() - t, 1)
    done.write_text(json.dumps(stats))
    return root, stats


# --- running the commands ---------------------------------------------------------------------

def in_process(args: list[str], cwd: Path) -> tuple[str, int]:
    """One speccheck command through click in this process, as a fresh process would run it
    (the per-process checksum cache cleared first: load + verify + format, no interpreter
    start-up or imports): (stdout, exit code)."""
    import os

    from speccheck import store as store_mod
    from speccheck.cli import main

    store_mod._SUMS.clear()
    out = io.StringIO()
    old = Path.cwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out):
            try:
                main.main(args=args, prog_name="speccheck", standalone_mode=False)
                code = 0
            except SystemExit as e:
                code = int(e.code or 0)
        return out.getvalue(), code
    finally:
        os.chdir(old)


def cli(args: list[str], cwd: Path) -> tuple[str, int]:
    """The `speccheck` console script in a subprocess: (stdout, exit code)."""
    exe = shutil.which("speccheck") or str(Path(sys.executable).with_name("speccheck"))
    p = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, check=False)
    return p.stdout, p.returncode


def store_size(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=500)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--configs", default=CONFIG_NAMES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/speccheck-bench-verify"))
    ap.add_argument("--rebuild", action="store_true")
    a = ap.parse_args(argv)
    root, stats = cached_store(a.cache, a.prompts, a.min_len, a.max_len, a.configs, a.seed, a.rebuild)
    print(f"store {root}: {stats['prompts']} prompts, {stats['runs']} runs, {stats['completions']} "
          f"completions, {stats['generated_tokens']:,} generated tokens, {store_size(root) / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
