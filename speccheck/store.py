"""The store: ``.speccheck/`` on disk, one directory per (config, repeat), written atomically.

Layout::

    <store>/LATEST                         suite id of the last `speccheck run`
    <store>/suites/<suite>/suite.json      what the suite is: engine, model, engine args, corpus + hash
    <store>/suites/<suite>/inputs.npz      the prompts' token ids, tokenised once for every config
    <store>/suites/<suite>/runs/<config>/r<i>/manifest.json + arrays.npz
    <store>/suites/<suite>/rescore/<config>-r<i>.npz   baseline's teacher-forced scores of that run
    <store>/suites/<suite>/attribution/<config>.json   kernel-path attribution of its divergences

A run directory is complete iff its manifest says ``"complete": true``; it is written in a
temporary sibling and renamed into place, so a crash never leaves a half run that looks
finished. Arrays are plain ``.npz`` read with ``allow_pickle=False``; nothing is unpickled.
A suite is keyed by what produced it (engine, model, draft, engine args, corpus), so runs
with a planted fault or another kernel knob never mix with clean ones.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterator

import numpy as np

from speccheck.types import Completion, RunRecord, Scored, SpecConfig, SpecCounters

FORMAT_VERSION = 1


class StoreError(ValueError):
    """The store on disk is unreadable or inconsistent (exit code 2)."""


def suite_id(engine: str, model: str | None, draft: str | None, engine_args: dict,
             corpus: str, corpus_hash: str) -> str:
    """A readable, stable directory name for everything that makes runs comparable."""
    key = json.dumps([engine, model, draft, sorted(engine_args.items()), corpus, corpus_hash])
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    model_slug = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model).name if model else "default")[:40]
    return f"{engine}-{model_slug}-{corpus}-{digest}"


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _atomic_write_npz(path: Path, **arrays: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".npz")
    with os.fdopen(fd, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)


def _load_npz(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError) as e:
        raise StoreError(
            f"{path}: cannot read stored arrays ({e}). The file is corrupted or not a speccheck "
            "store; delete that run directory and `speccheck run` again to redo just that run."
        ) from None


def _load_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise StoreError(
            f"{path}: cannot read JSON ({e}). Delete that run directory and `speccheck run` again "
            "to redo just that run; nothing else in the store is affected."
        ) from None


def _ragged(arrays: list[np.ndarray], dtype) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate ragged arrays along axis 0; ``flat[offsets[i]:offsets[i+1]]`` is the i-th."""
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(a) for a in arrays])
    flat = np.concatenate([np.asarray(a, dtype=dtype) for a in arrays]) if arrays else np.zeros(0, dtype)
    return flat, offsets


def _width(a: np.ndarray, k: int) -> np.ndarray:
    """A [n, k'] top-k array as [n, k] (only empty arrays may differ in width)."""
    return a if a.shape[1] == k else a.reshape(0, k)


def _unragged(flat: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    return [flat[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def _counters(d: dict | None) -> SpecCounters | None:
    """Stored counters; keys this version does not know are left out (a newer speccheck may
    store more), keys it knows but the store lacks take their defaults (``iterations``)."""
    if not d:
        return None
    known = {f.name for f in fields(SpecCounters)}
    return SpecCounters(**{k: v for k, v in d.items() if k in known})


def read_run(d: Path) -> RunRecord:
    """One stored run directory (manifest.json + arrays.npz) as a RunRecord."""
    m = _load_json(d / "manifest.json")
    if m.get("format") != FORMAT_VERSION:
        raise StoreError(f"{d}: store format {m.get('format')} is not {FORMAT_VERSION}; "
                         "re-run with this speccheck version into a fresh --store.")
    comps: list[Completion] = []
    if m["completions"]:
        a = _load_npz(d / "arrays.npz")
        pids = _unragged(a["prompt_ids"], a["prompt_offsets"])
        off = a["offsets"]
        for i, meta in enumerate(m["completions"]):
            sl = slice(off[i], off[i + 1])
            comps.append(Completion(
                prompt_id=meta["prompt_id"], prompt_ids=pids[i], token_ids=a["token_ids"][sl],
                logprobs=a["logprobs"][sl], topk_ids=a["topk_ids"][sl],
                topk_logprobs=a["topk_logprobs"][sl], text=meta["text"],
                finish_reason=meta["finish_reason"], ttft_s=meta["ttft_s"],
                decode_s=meta["decode_s"],
                spec=_counters(meta["spec"])))
    cfg = m["config"]
    return RunRecord(
        config=SpecConfig(cfg["method"], cfg["k"], cfg.get("draft")), identity=m["identity"],
        corpus=m["corpus"], corpus_hash=m["corpus_hash"], repeat=m["repeat"],
        fresh_process=m["fresh_process"], status=m["status"], error=m["error"],
        completions=comps, wall_s=m.get("wall_s", 0.0), copies=m.get("copies", 0))


@dataclass
class Suite:
    """One suite directory: the runs of one engine/model/args/corpus combination."""

    root: Path

    @property
    def id(self) -> str:
        return self.root.name

    @property
    def meta(self) -> dict:
        return _load_json(self.root / "suite.json")

    # --- runs -----------------------------------------------------------------------------
    def run_dir(self, config_name: str, repeat: int) -> Path:
        """``repeat`` -1 is the config's run of the whole corpus at once (``copies``)."""
        return self.root / "runs" / config_name / ("together" if repeat < 0 else f"r{repeat}")

    def is_complete(self, config_name: str, repeat: int) -> bool:
        manifest = self.run_dir(config_name, repeat) / "manifest.json"
        if not manifest.exists():
            return False
        return bool(_load_json(manifest).get("complete"))

    def run_identity(self, config_name: str, repeat: int) -> dict:
        return _load_json(self.run_dir(config_name, repeat) / "manifest.json").get("identity") or {}

    def write_run(self, record: RunRecord) -> Path:
        """Write one run atomically: temp directory, then rename over any old (failed) one.
        A new first repeat makes that config's rescoring and attribution stale: they go."""
        final = self.run_dir(record.config.name, record.repeat)
        if record.repeat == 0:
            self.rescore_path(record.config.name, 0).unlink(missing_ok=True)
            (self.root / "attribution" / f"{record.config.name}.json").unlink(missing_ok=True)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
        comps = record.completions
        arrays: dict[str, np.ndarray] = {}
        if comps:
            arrays["prompt_ids"], arrays["prompt_offsets"] = _ragged([c.prompt_ids for c in comps], np.int32)
            arrays["token_ids"], arrays["offsets"] = _ragged([c.token_ids for c in comps], np.int32)
            arrays["logprobs"], _ = _ragged([c.logprobs for c in comps], np.float32)
            k = max(c.topk_ids.shape[1] for c in comps)
            arrays["topk_ids"], _ = _ragged([_width(c.topk_ids, k) for c in comps], np.int32)
            arrays["topk_logprobs"], _ = _ragged([_width(c.topk_logprobs, k) for c in comps], np.float32)
        np.savez(tmp / "arrays.npz", **arrays)
        manifest = {
            "format": FORMAT_VERSION,
            "complete": record.status == "ok",
            "config": record.config.to_dict(),
            "identity": record.identity,
            "corpus": record.corpus,
            "corpus_hash": record.corpus_hash,
            "repeat": record.repeat,
            "fresh_process": record.fresh_process,
            "status": record.status,
            "error": record.error,
            "wall_s": record.wall_s,
            "copies": record.copies,
            "completions": [
                {"prompt_id": c.prompt_id, "text": c.text, "finish_reason": c.finish_reason,
                 "ttft_s": c.ttft_s, "decode_s": c.decode_s, "n_tokens": c.n_tokens,
                 "spec": c.spec.to_dict() if c.spec else None}
                for c in comps
            ],
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False))
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        return final

    def load_run(self, config_name: str, repeat: int) -> RunRecord:
        return read_run(self.run_dir(config_name, repeat))

    def load_together(self, config_name: str) -> RunRecord | None:
        """The config's run of the whole corpus at once, if one is stored."""
        d = self.run_dir(config_name, -1)
        return read_run(d) if (d / "manifest.json").exists() else None

    def configs(self) -> list[str]:
        """Config names with at least one stored run, baseline first, then by method and K."""
        runs = self.root / "runs"
        names = [p.name for p in runs.iterdir() if p.is_dir()] if runs.exists() else []
        return sorted(names, key=config_sort_key)

    def repeats(self, config_name: str) -> list[int]:
        d = self.root / "runs" / config_name
        if not d.exists():
            return []
        return sorted(int(p.name[1:]) for p in d.iterdir() if re.fullmatch(r"r\d+", p.name))

    def records(self, config_name: str) -> Iterator[RunRecord]:
        for r in self.repeats(config_name):
            yield self.load_run(config_name, r)

    # --- inputs, rescoring, attribution ----------------------------------------------------
    def write_inputs(self, prompt_ids: dict[str, list[int]]) -> None:
        ids = list(prompt_ids)
        flat, off = _ragged([np.asarray(prompt_ids[i], np.int32) for i in ids], np.int32)
        _atomic_write_npz(self.root / "inputs.npz", ids=np.array(ids, dtype=str), flat=flat, offsets=off)

    def load_inputs(self) -> dict[str, np.ndarray] | None:
        path = self.root / "inputs.npz"
        if not path.exists():
            return None
        a = _load_npz(path)
        return dict(zip(a["ids"].tolist(), _unragged(a["flat"], a["offsets"])))

    def rescore_path(self, config_name: str, repeat: int) -> Path:
        return self.root / "rescore" / f"{config_name}-r{repeat}.npz"

    def write_rescore(self, config_name: str, repeat: int, prompt_ids: list[str],
                      scored: list[Scored]) -> None:
        ti, off = _ragged([s.topk_ids for s in scored], np.int32)
        tl, _ = _ragged([s.topk_logprobs for s in scored], np.float32)
        lp, _ = _ragged([s.token_logprobs for s in scored], np.float32)
        _atomic_write_npz(self.rescore_path(config_name, repeat), ids=np.array(prompt_ids, dtype=str),
                          topk_ids=ti, topk_logprobs=tl, token_logprobs=lp, offsets=off)

    def load_rescore(self, config_name: str, repeat: int) -> dict[str, Scored] | None:
        path = self.rescore_path(config_name, repeat)
        if not path.exists():
            return None
        a = _load_npz(path)
        off = a["offsets"]
        return {pid: Scored(a["topk_ids"][off[i]:off[i + 1]], a["topk_logprobs"][off[i]:off[i + 1]],
                            a["token_logprobs"][off[i]:off[i + 1]])
                for i, pid in enumerate(a["ids"].tolist())}

    def write_attribution(self, config_name: str, data: list[dict]) -> None:
        _atomic_write_text(self.root / "attribution" / f"{config_name}.json",
                           json.dumps(data, indent=1, ensure_ascii=False))

    def load_attribution(self, config_name: str) -> list[dict] | None:
        path = self.root / "attribution" / f"{config_name}.json"
        return _load_json(path) if path.exists() else None


def config_sort_key(name: str) -> tuple:
    if name == "baseline":
        return (0, "", 0)
    cfg = SpecConfig.from_name(name)
    return (1, cfg.method, cfg.k)


class Store:
    """A ``.speccheck/`` directory holding suites."""

    def __init__(self, root: str | os.PathLike = ".speccheck") -> None:
        self.root = Path(root)

    def suite(self, sid: str, meta: dict | None = None) -> Suite:
        """The suite with this id; ``meta`` creates it (or checks it is the same suite)."""
        s = Suite(self.root / "suites" / sid)
        if meta is not None:
            if (s.root / "suite.json").exists():
                if s.meta.get("corpus_hash") != meta.get("corpus_hash"):
                    raise StoreError(f"{s.root}: suite exists with another corpus hash")
            else:
                _atomic_write_text(s.root / "suite.json", json.dumps(meta, indent=1))
        elif not (s.root / "suite.json").exists():
            raise StoreError(
                f"no suite {sid!r} in store {self.root} (option --store / --suite). "
                f"Suites there: {', '.join(self.suite_ids()) or 'none'}; run `speccheck run` first.")
        return s

    def suite_ids(self) -> list[str]:
        d = self.root / "suites"
        return sorted(p.name for p in d.iterdir() if (p / "suite.json").exists()) if d.exists() else []

    def set_latest(self, sid: str) -> None:
        _atomic_write_text(self.root / "LATEST", sid + "\n")

    def latest(self) -> Suite:
        """The suite of the last `speccheck run` into this store."""
        path = self.root / "LATEST"
        if not path.exists():
            raise StoreError(
                f"store {self.root} holds no runs (option --store). Run `speccheck run` first, or "
                "point --store at the directory a run wrote.")
        return self.suite(path.read_text().strip())
