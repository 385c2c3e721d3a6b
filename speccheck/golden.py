"""Golden baselines: `golden/<engine>/<model>/<corpus>/` holds a recorded baseline run (the
store's own format) and per-config acceptance; `check` compares today's baseline with it using
the same divergence classification, and refuses when model, tokenizer or corpus differ."""
from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from speccheck.config import RUN_ONLY_ARGS
from speccheck.checks import get as get_check
from speccheck.compare import Comparison, compare_runs
from speccheck.evaluate import per_prompt_acceptance
from speccheck.evidence import kernel_noise_sample, spec_delta_sample
from speccheck.results import SuiteResult
from speccheck.store import (StoreError, Suite, load_checked_json, load_checked_npz, read_run,
                             write_checked_npz, write_checked_text)
from speccheck.types import RunRecord, sampling_of
from speccheck.verify import DriftTest, calibrate_thresholds, drift_test, summarize

#: the noise samples of a golden: the engine's kernel-path noise, and per spec config the
#: |spec-reported - baseline logprob| of its agreeing positions (keys "config:<name>")
NOISE_FILE = "noise.npz"
KERNEL_PATH = "kernel_path"


class GoldenMismatch(ValueError):
    """The golden was recorded for another model, tokenizer or corpus (exit code 2)."""


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("_") or "default"


#: engine args that reach a server, not the numerics: they are not part of a golden's key
_NOT_NUMERICS = ("base_url", "served_model", "api_key_env")
#: identity keys that change numerics (a golden recorded under other ones is another golden)
NUMERICS_KEYS = ("dtype", "knobs", "fault", "kernel_knobs", "batch", "cuda_graphs", "compile")
#: identity keys that explain near-tie flips between machines (kernels, SIMD, library builds)
PLATFORM_KEYS = ("device", "cpu_capability", "threads", "torch", "gpu", "cuda", "vllm_version",
                 "server_version", "driver")


#: an engine-settings label longer than this becomes a hash (the settings are in golden.json)
LABEL_MAX = 40


def engine_settings(identity: dict, meta: dict) -> dict[str, str]:
    """The engine args of a suite that change its numerics (dtype, kernel knobs, planted
    faults, ...): those a golden is recorded under; how speccheck reaches or sizes the engine
    is left out (``RUN_ONLY_ARGS``)."""
    engine = identity.get("engine") or meta["engine"]
    skip = set(_NOT_NUMERICS) | RUN_ONLY_ARGS.get(engine, frozenset())
    return {str(k): str(v) for k, v in sorted((meta.get("engine_args") or {}).items()) if k not in skip}


def settings_label(settings: dict[str, str]) -> str:
    """A short, stable label of engine settings for a folder name: ``key=value,...`` where that
    fits in LABEL_MAX characters, else ``settings-`` and 10 hex digits of their hash."""
    if not settings:
        return ""
    plain = _slug(",".join(f"{k}={v}" for k, v in sorted(settings.items())))
    if len(plain) <= LABEL_MAX:
        return plain
    digest = hashlib.sha256(json.dumps(sorted(settings.items())).encode()).hexdigest()[:10]
    return f"settings-{digest}"


def golden_dir(root: Path, identity: dict, meta: dict) -> Path:
    """``golden/<engine>[/<series>]/<model>/<corpus>[+<settings>]``: engine settings (dtype,
    kernel knobs, planted faults) change the numerics, so a golden made with them never lands
    where the default one lives (:func:`settings_label`; golden.json keeps the settings
    themselves); an engine whose numerics follow its release names the series in its identity
    (``golden_series``, e.g. vLLM's ``0.28.0``), one golden per release. The model is named as
    the engine names it (``model_id``: for vLLM, the name the checkpoint declares)."""
    model = identity.get("model_id") or meta.get("model") or "default"
    engine = identity.get("engine") or meta["engine"]
    label = settings_label(engine_settings(identity, meta))
    series = identity.get("golden_series")
    return Path(root) / _slug(engine) / (_slug(str(series)) if series else "") \
        / _slug(Path(str(model)).name) / _slug(meta["corpus"] + (f"+{label}" if label else ""))


def portable_identity(identity: dict) -> dict:
    """The identity a golden keeps: paths of the recording machine become their last part (a
    golden is committed and read elsewhere; model, drafter and tokenizer are known by hash)."""
    return {k: (Path(v).name if isinstance(v, str) and v.startswith("/") and "\n" not in v else v)
            for k, v in identity.items()}


def _fingerprint(identity: dict, corpus_hash: str) -> dict:
    return {"model_hash": identity.get("model_hash"), "tokenizer_hash": identity.get("tokenizer_hash"),
            "corpus_hash": corpus_hash}


def _numerics(identity: dict) -> dict:
    return {k: identity[k] for k in NUMERICS_KEYS if k in identity}


def identity_changes(old: dict, new: dict, keys) -> list[str]:
    """``key: old -> new`` for each of ``keys`` that differs between two identities."""
    return [f"{k}: {old.get(k)} -> {new.get(k)}" for k in keys
            if (k in old or k in new) and old.get(k) != new.get(k)]


def record(suite: Suite, result: SuiteResult, root: Path, force: bool = False) -> Path:
    """Write the suite's baseline (first repeat) and every config's acceptance as the golden.
    Refuses a suite whose gate fails, and an existing golden unless ``force``."""
    missing = [m for r in result.configs for m in r.missing]
    if missing:
        raise GoldenMismatch(f"suite {suite.id} is incomplete, so it cannot be recorded as golden: "
                             + "; ".join(missing))
    base = suite.load_run("baseline", 0)
    if base.status != "ok":
        raise GoldenMismatch("the baseline run failed; nothing to record as golden.")
    if not result.passed:
        failing = [r.config for r in result.configs if r.verdict != "pass"]
        raise GoldenMismatch(f"suite {suite.id} fails the gate ({', '.join(failing)}); a golden must be a "
                             "run you trust: fix what `speccheck gate` reports, then record.")
    target = golden_dir(root, base.identity, suite.meta)
    if (target / "golden.json").exists() and not force:
        old, old_base = _read_golden(target)
        changed = [c.prompt_id for c in base.completions
                   if c.prompt_id not in old_base.by_prompt()
                   or c.token_ids.tolist() != old_base.by_prompt()[c.prompt_id].token_ids.tolist()]
        ident = identity_changes(old.get("identity", {}), base.identity,
                                 ("model_hash", "tokenizer_hash", *NUMERICS_KEYS, *PLATFORM_KEYS))
        raise GoldenMismatch(
            f"a golden exists at {target} (recorded from suite {old.get('suite')}); recording would change "
            f"{len(changed)} of {len(base.completions)} baseline outputs"
            + (f" ({', '.join(changed[:5])}{', ...' if len(changed) > 5 else ''})" if changed else "")
            + (f" and the identity ({'; '.join(ident)})" if ident else "")
            + ". Pass --force to overwrite it (then commit the change), or --golden DIR to record elsewhere.")
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(suite.run_dir("baseline", 0), tmp / "baseline")
    # per prompt too, with a digest of its output: on another machine only the prompts that
    # keep their trajectory are compared (verify.same_output_acceptance)
    acceptance = {r.config: {"tokens_per_iter": r.acceptance.tokens_per_iter,
                             "per_pos": list(r.acceptance.per_pos),
                             "per_prompt": {p: list(v) for p, v in per_prompt_acceptance(
                                 suite.load_run(r.config, 0).completions).items()},
                             "per_prompt_pos": {c.prompt_id: [int(x) for x in c.spec.accepted_per_pos]
                                                for c in suite.load_run(r.config, 0).completions
                                                if c.spec is not None}}
                  for r in result.configs if r.acceptance is not None}
    samples = {KERNEL_PATH: kernel_noise_sample(suite)}
    samples.update({f"config:{r.config}": spec_delta_sample(suite, r.config)
                    for r in result.configs if r.config != "baseline"})
    write_checked_npz(tmp / NOISE_FILE, **{k: v.astype(np.float32) for k, v in samples.items()})
    manifest = tmp / "baseline" / "manifest.json"
    m = json.loads(manifest.read_text())
    m["identity"] = portable_identity(m.get("identity") or {})
    write_checked_text(manifest, json.dumps(m, indent=1, ensure_ascii=False))
    meta = {"suite": suite.id, "engine": suite.meta["engine"], "corpus": suite.meta["corpus"],
            "engine_settings": engine_settings(base.identity, suite.meta),
            "identity": portable_identity(base.identity), "fingerprint": _fingerprint(base.identity, base.corpus_hash),
            "numerics": _numerics(base.identity),
            "noise": result.noise, "acceptance": acceptance,
            "checks": check_states(result),
            "logprob_noise": {k: summarize(v).to_dict() for k, v in samples.items()}}
    write_checked_text(tmp / "golden.json", json.dumps(meta, indent=1, ensure_ascii=False))
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    return target


def _state(c) -> str:
    return c.state


def check_states(result: SuiteResult) -> dict[str, dict[str, str]]:
    """Per config, every registered check's state (pass / fail / skip): what the golden keeps
    so that a later check shows what changed against the run it was recorded from."""
    return {r.config: {c.name: _state(c) for c in r.checks} for r in result.configs}


def check_changes(recorded: dict[str, dict[str, str]], result: SuiteResult) -> list[str]:
    """One line per (config, check) whose state differs from the golden's, with what the check
    means; a check the golden predates is named only where it fails."""
    out = []
    for r in result.configs:
        then = recorded.get(r.config)
        if then is None:
            continue
        for c in r.checks:
            now, was = _state(c), then.get(c.name)
            if now == was or (was is None and now in ("pass", "skip")):  # a newer check that passes: news to no one
                continue
            then_text = "not in the golden (a newer check)" if was is None else f"{was} in the golden"
            out.append(f"{r.config} {c.name}: {then_text}, {now} today ({get_check(c.name).description})")
    return out


@dataclass
class GoldenCheck:
    path: Path
    comparison: Comparison
    acceptance: dict[str, float]
    #: platform identity keys that differ from the golden's (why near-ties may flip)
    platform_changes: tuple[str, ...] = ()
    #: today's kernel-path noise against the golden's (None: the golden has no noise sample)
    noise_drift: DriftTest | None = None
    #: per config, each check's state when the golden was recorded (empty: recorded before)
    checks: dict[str, dict[str, str]] | None = None

    @property
    def passed(self) -> bool:
        return self.comparison.passed and not (self.noise_drift and self.noise_drift.drifted)

    def why(self) -> str | None:
        """One line on why near-tie-only differences are expected (or None: nothing differs)."""
        cmp = self.comparison
        if not cmp.divergences or cmp.high:
            return None
        if self.platform_changes:
            return (f"expected: only near-ties differ, and this machine is not the golden's "
                    f"({'; '.join(self.platform_changes)}): other SIMD kernels or library builds round "
                    "differently, which flips only near-tied argmaxes.")
        return ("only near-ties differ, on the golden's own platform as recorded; kernel choice "
                "(e.g. autotuning or thread count) can still flip near-tied argmaxes.")


def _redo(path: Path) -> str:
    return (f"restore {path} from version control, or record it again with `speccheck golden record "
            "--force` (option --golden)")


def _read_golden(path: Path) -> tuple[dict, RunRecord]:
    """golden.json and the baseline run of a golden, each verified against its checksum (a
    damaged or unsummed golden is an error, never a golden that is silently not there)."""
    redo = _redo(path)
    if path.is_symlink():
        raise StoreError(f"{path}: a symlink, not a golden speccheck recorded (a golden is read from "
                         f"where it was recorded); {redo}.")
    meta = load_checked_json(path / "golden.json", redo)
    problem = _golden_problem(meta)
    if problem:
        raise StoreError(f"{path / 'golden.json'}: not a golden record ({problem}); {redo}.")
    return meta, read_run(path / "baseline", redo)


def _number(x, lo: float = 0.0, hi: float = math.inf) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and lo <= x <= hi


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _golden_problem(meta) -> str | None:
    """What in a golden.json is not what `golden record` writes (None: nothing): a field of
    the wrong type or a number that cannot be would otherwise crash a check or pass it (a NaN
    acceptance compares false with every limit)."""
    if not isinstance(meta, dict):
        return "not a JSON object"
    fp = meta.get("fingerprint")
    if not isinstance(fp, dict) or not all(isinstance(fp.get(k), (str, type(None)))
                                           for k in ("model_hash", "tokenizer_hash", "corpus_hash")):
        return "its fingerprint lacks model_hash/tokenizer_hash/corpus_hash"
    if not _number(meta.get("noise", 0.0)):
        return f"its noise is {meta.get('noise')!r}, not a finite number >= 0"
    for key in ("numerics", "identity", "engine_settings"):
        if not isinstance(meta.get(key) or {}, dict):
            return f"its {key} is not an object"
    checks = meta.get("checks") or {}
    if not isinstance(checks, dict) or not all(
            isinstance(v, dict) and all(isinstance(c, str) and isinstance(st, str) for c, st in v.items())
            for v in checks.values()):
        return "its checks are not {config: {check: state}}"
    acceptance = meta.get("acceptance", {})
    if not isinstance(acceptance, dict):
        return "its acceptance is not an object"
    for config, a in acceptance.items():
        where = f"acceptance of {config}"
        if not isinstance(a, dict) or not _number(a.get("tokens_per_iter")):
            return f"the {where} has no finite tokens_per_iter"
        if not isinstance(a.get("per_pos", []), list) or not all(_number(x, 0.0, 1.0) for x in a.get("per_pos", [])):
            return f"the {where} has per_pos rates outside 0..1"
        per_prompt = a.get("per_prompt", {})
        if not isinstance(per_prompt, dict) or not all(
                isinstance(v, list) and len(v) == 3 and _count(v[0]) and _count(v[1]) and isinstance(v[2], str)
                for v in per_prompt.values()):
            return f"the {where} has per_prompt entries that are not [drafts, accepted, output digest]"
        per_pos = a.get("per_prompt_pos", {})
        if not isinstance(per_pos, dict) or not all(isinstance(v, list) and all(map(_count, v))
                                                    for v in per_pos.values()):
            return f"the {where} has per_prompt_pos entries that are not lists of counts"
    return None


def load_golden(suite: Suite, root: Path) -> tuple[Path, dict, RunRecord]:
    base = suite.load_run("baseline", 0)
    path = golden_dir(root, base.identity, suite.meta)
    if not (path / "golden.json").exists() and not (path / "golden.json").is_symlink():
        settings = engine_settings(base.identity, suite.meta)
        others = sorted(p.name for p in path.parent.glob("*") if (p / "golden.json").is_file()) \
            if path.parent.is_dir() else []
        raise GoldenMismatch(
            f"no golden at {path} (option --golden)"
            + (f" for the engine settings {', '.join(f'{k}={v}' for k, v in settings.items())}" if settings else "")
            + (f"; this model has goldens recorded under other corpora or settings: {', '.join(others[:5])} "
               "(their golden.json lists the settings)" if others else "")
            + "; record one with `speccheck golden record` after a clean `speccheck run`.")
    meta, gold = _read_golden(path)
    return path, meta, gold


def check(suite: Suite, root: Path, noise: float, policy, detok=None) -> GoldenCheck:
    path, meta, gold = load_golden(suite, root)
    today = suite.load_run("baseline", 0)
    want, have = meta["fingerprint"], _fingerprint(today.identity, today.corpus_hash)
    differ = [k for k in want if want[k] != have[k]]
    numerics = identity_changes(meta.get("numerics") or {}, _numerics(today.identity),
                                (meta.get("numerics") or {}).keys())
    if numerics and not differ:
        raise GoldenMismatch(
            f"golden {path} was recorded with other numerics ({'; '.join(numerics)}); a golden of one "
            "dtype / kernel path / fault is not evidence about another: record one for these settings "
            "with `speccheck golden record`.")
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
    sampled = sampling_of(suite.meta.get("engine_args")) is not None  # the same seeds: draws repeat
    return GoldenCheck(path, compare_runs(gold, today, tau_tie, tau_low, noise, detok,
                                          sampled=sampled), acceptance,
                       tuple(identity_changes(gold.identity, today.identity, PLATFORM_KEYS)), drift,
                       meta.get("checks"))


def _noise_samples(path: Path) -> dict[str, np.ndarray]:
    """The golden's noise samples (verified); every golden has them, so a missing file is damage."""
    samples = load_checked_npz(path / NOISE_FILE, _redo(path))
    if any(v.ndim != 1 or not np.issubdtype(v.dtype, np.floating) for v in samples.values()):
        raise StoreError(f"{path / NOISE_FILE}: not noise samples (1-d float arrays); {_redo(path)}.")
    if KERNEL_PATH not in samples:  # every golden records it: without it no drift is judged
        raise StoreError(f"{path / NOISE_FILE}: lacks the kernel-path noise sample ({KERNEL_PATH!r}) every "
                         f"golden records; {_redo(path)}.")
    bad = next((k for k, v in samples.items() if not np.all(np.isfinite(v)) or np.any(v < 0)), None)
    if bad is not None:  # |Δ logprob| values: a NaN compares false with every limit
        raise StoreError(f"{path / NOISE_FILE}: sample {bad!r} holds values that are not finite |Δ logprob| "
                         f">= 0 (NaN, infinite or negative); {_redo(path)}.")
    return {k: v.astype(np.float64) for k, v in samples.items()}


def golden_noise(suite: Suite, root: Path) -> dict[str, np.ndarray] | None:
    """Per spec config, the golden's |Δ logprob| sample (for evaluate_suite's golden_noise);
    None without a golden, without recorded samples, or when the golden was recorded on another
    platform (``PLATFORM_KEYS``: CPU SIMD level, GPU, torch, ...): how far a spec path's
    logprobs sit from the baseline's is a property of the kernels' roundings on that machine
    (an AVX2 golden's median |Δ| is 0.0017 nats where AVX-512 gives 0.0021 for the same code),
    so there only today's own kernel-path noise judges the drift."""
    try:
        path, _, gold = load_golden(suite, root)
    except GoldenMismatch:  # no golden here (a damaged one is an error: StoreError)
        return None
    if identity_changes(gold.identity, suite.load_run("baseline", 0).identity, PLATFORM_KEYS):
        return None
    samples = _noise_samples(path)
    return {k.removeprefix("config:"): v for k, v in samples.items() if k.startswith("config:")} or None


def golden_acceptance(suite: Suite, root: Path) -> dict[str, dict] | None:
    """Per config the golden's acceptance: ``tokens_per_iter``, ``per_pos`` and (goldens
    recorded since it existed) ``per_prompt`` {prompt id: [drafts, accepted, output digest]}."""
    try:
        _, meta, _ = load_golden(suite, root)
    except GoldenMismatch:  # no golden here (a damaged one is an error: StoreError)
        return None
    return dict(meta.get("acceptance", {}))
