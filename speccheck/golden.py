"""Golden baselines: `golden/<engine>/<model>/<corpus>/` holds a recorded baseline run (the
store's own format) and per-config acceptance; `check` compares today's baseline with it using
the same divergence classification, and refuses when model, tokenizer or corpus differ."""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from speccheck.evaluate import (Comparison, SuiteResult, compare_runs, kernel_noise_sample,
                                spec_delta_sample)
from speccheck.store import Suite, read_run
from speccheck.types import RunRecord
from speccheck.verify import DriftTest, calibrate_thresholds, drift_test, summarize

#: the noise samples of a golden: the engine's kernel-path noise, and per spec config the
#: |spec-reported - baseline logprob| of its agreeing positions (keys "config:<name>")
NOISE_FILE = "noise.npz"
KERNEL_PATH = "kernel_path"


class GoldenMismatch(ValueError):
    """The golden was recorded for another model, tokenizer or corpus (exit code 2)."""


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("_") or "default"


def golden_dir(root: Path, identity: dict, meta: dict) -> Path:
    model = identity.get("model_id") or meta.get("model") or "default"
    return Path(root) / _slug(identity.get("engine") or meta["engine"]) / _slug(Path(str(model)).name) \
        / _slug(meta["corpus"])


def _fingerprint(identity: dict, corpus_hash: str) -> dict:
    return {"model_hash": identity.get("model_hash"), "tokenizer_hash": identity.get("tokenizer_hash"),
            "corpus_hash": corpus_hash}


def record(suite: Suite, result: SuiteResult, root: Path) -> Path:
    """Write the suite's baseline (first repeat) and every config's acceptance as the golden."""
    base = suite.load_run("baseline", 0)
    if base.status != "ok":
        raise GoldenMismatch("the baseline run failed; nothing to record as golden.")
    target = golden_dir(root, base.identity, suite.meta)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(suite.run_dir("baseline", 0), tmp / "baseline")
    acceptance = {r.config: {"tokens_per_iter": r.acceptance.tokens_per_iter,
                             "per_pos": list(r.acceptance.per_pos)}
                  for r in result.configs if r.acceptance is not None}
    samples = {KERNEL_PATH: kernel_noise_sample(suite)}
    samples.update({f"config:{r.config}": spec_delta_sample(suite, r.config)
                    for r in result.configs if r.config != "baseline"})
    np.savez(tmp / NOISE_FILE, **{k: v.astype(np.float32) for k, v in samples.items()})
    meta = {"suite": suite.id, "engine": suite.meta["engine"], "corpus": suite.meta["corpus"],
            "identity": base.identity, "fingerprint": _fingerprint(base.identity, base.corpus_hash),
            "noise": result.noise, "acceptance": acceptance,
            "logprob_noise": {k: summarize(v).to_dict() for k, v in samples.items()}}
    (tmp / "golden.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False))
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    return target


@dataclass
class GoldenCheck:
    path: Path
    comparison: Comparison
    acceptance: dict[str, float]
    #: today's kernel-path noise against the golden's (None: the golden has no noise sample)
    noise_drift: DriftTest | None = None

    @property
    def passed(self) -> bool:
        return self.comparison.passed and not (self.noise_drift and self.noise_drift.drifted)


def load_golden(suite: Suite, root: Path) -> tuple[Path, dict, RunRecord]:
    base = suite.load_run("baseline", 0)
    path = golden_dir(root, base.identity, suite.meta)
    if not (path / "golden.json").exists():
        raise GoldenMismatch(f"no golden at {path} (option --golden); record one with "
                             "`speccheck golden record` after a clean `speccheck run`.")
    meta = json.loads((path / "golden.json").read_text())
    return path, meta, read_run(path / "baseline")


def check(suite: Suite, root: Path, noise: float, policy, detok=None) -> GoldenCheck:
    path, meta, gold = load_golden(suite, root)
    today = suite.load_run("baseline", 0)
    want, have = meta["fingerprint"], _fingerprint(today.identity, today.corpus_hash)
    differ = [k for k in want if want[k] != have[k]]
    if differ:
        raise GoldenMismatch(
            f"golden {path} was recorded for another {', '.join(d.replace('_hash', '') for d in differ)} "
            f"({'; '.join(f'{k}: golden {want[k]} vs now {have[k]}' for k in differ)}). Comparing them "
            "would be meaningless: record a new golden with `speccheck golden record` if the change is intended.")
    tau_tie, tau_low = calibrate_thresholds(max(noise, meta.get("noise", 0.0)), policy.tie_noise_multiple,
                                            policy.low_noise_multiple, policy.tie_floor, policy.low_floor)
    acceptance = {k: v["tokens_per_iter"] for k, v in meta.get("acceptance", {}).items()}
    samples = _noise_samples(path)
    drift = (drift_test(kernel_noise_sample(suite), samples[KERNEL_PATH], policy.max_logprob_drift,
                        policy.logprob_drift_alpha) if KERNEL_PATH in samples else None)
    return GoldenCheck(path, compare_runs(gold, today, tau_tie, tau_low, noise, detok), acceptance, drift)


def _noise_samples(path: Path) -> dict[str, np.ndarray]:
    if not (path / NOISE_FILE).exists():
        return {}
    with np.load(path / NOISE_FILE, allow_pickle=False) as z:
        return {k: z[k].astype(np.float64) for k in z.files}


def golden_noise(suite: Suite, root: Path) -> dict[str, np.ndarray] | None:
    """Per spec config, the golden's |Δ logprob| sample (for evaluate_suite's golden_noise);
    None without a golden or without recorded samples."""
    try:
        path, _, _ = load_golden(suite, root)
    except (GoldenMismatch, FileNotFoundError, KeyError):
        return None
    samples = _noise_samples(path)
    return {k.removeprefix("config:"): v for k, v in samples.items() if k.startswith("config:")} or None


def golden_acceptance(suite: Suite, root: Path) -> dict[str, float] | None:
    try:
        _, meta, _ = load_golden(suite, root)
    except (GoldenMismatch, FileNotFoundError, KeyError):
        return None
    return {k: v["tokens_per_iter"] for k, v in meta.get("acceptance", {}).items()}
