"""The store: ``.speccheck/`` on disk, one directory per (config, repeat), written atomically.

Layout::

    <store>/LATEST                         suite id of the last `speccheck run`
    <store>/suites/<suite>/suite.json      what the suite is: engine, model, engine args, corpus + hash
    <store>/suites/<suite>/plan.json       what `speccheck run` was asked to store (Suite.missing)
    <store>/suites/<suite>/inputs.npz      the prompts' token ids, tokenised once for every config
    <store>/suites/<suite>/runs/<config>/r<i>/manifest.json + arrays.npz
    <store>/suites/<suite>/rescore/<config>-r<i>.npz   baseline's teacher-forced scores of that run
    <store>/suites/<suite>/replay/<config>-r<i>.npz    acceptance replayed over that run's own output
    <store>/suites/<suite>/attribution/<config>.json   kernel-path attribution of its divergences
    <store>/suites/<suite>/attribution/parts/*.json    each kernel path's tokens while attributing

A run directory is complete iff its manifest says ``"complete": true`` and the files it lists
(size and sha256) are there unchanged; it is written in a temporary sibling and renamed into
place, so a crash never leaves a half run that looks finished. Every file the store reads
(manifests, plans, LATEST included) has a ``<file>.sha256`` sidecar, checked on every read; a
missing sidecar is damage, never "unknown" (stores written before sums existed are redone).
Only regular files are opened: a symlink, FIFO or device where a stored file belongs is named
as damage before anything could block on it, and every entry under ``runs/`` must be one
speccheck writes (hidden names: temporary leftovers of a crash, skipped).
Arrays are plain ``.npz`` read with ``allow_pickle=False``; nothing is unpickled. Writers take
the store lock (``<store>/lock``: the holder's pid, released by the kernel when it dies).
A suite is keyed by what produced it (engine, model, draft, engine args, corpus, ignore_eos),
so runs with a planted fault or another kernel knob never mix with clean ones.

The plan is written before any engine starts and only ever extended, so a run that dies
(crash, OOM, a killed CI job) leaves a suite that says what is missing: every verdict fails
a planned config that is not complete. Suites stored before plans were recorded have none.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shlex
import shutil
import stat
import tempfile
import time
import zipfile
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from speccheck.files import share_mode
from speccheck.types import (TOGETHER, Completion, Replay, RunRecord, Scored, SpecConfig,
                             SpecCounters, slot_label)

FORMAT_VERSION = 1


class StoreError(ValueError):
    """The store on disk is unreadable or inconsistent (exit code 2)."""


def suite_id(engine: str, model: str | None, draft: str | None, engine_args: dict,
             corpus: str, corpus_hash: str, ignore_eos: bool = False) -> str:
    """A readable, stable directory name for everything that makes runs comparable
    (``ignore_eos`` enters the key only when set, so older suites keep their ids)."""
    key = json.dumps([engine, model, draft, sorted(engine_args.items()), corpus, corpus_hash]
                     + (["ignore_eos"] if ignore_eos else []))
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    model_slug = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model).name if model else "default")[:40]
    return f"{engine}-{model_slug}-{corpus}-{digest}"


_SUMS: dict[tuple, dict] = {}  # (path, mtime_ns, size, inode) -> sum: each file hashed once per process


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "file"), (stat.S_ISLNK, "symlink"), (stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO (named pipe)"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


def regular_file(path: Path, redo: str = "") -> os.stat_result:
    """``path``'s stat if it is a regular file (not followed through a symlink); anything else
    is damage, said before it is opened (a FIFO would block the read forever)."""
    redo = redo or _REDO_DEFAULT
    try:
        st = os.lstat(path)
    except OSError as e:
        raise StoreError(f"{path}: missing or unreadable ({e.strerror or e}); {redo}.") from None
    if not stat.S_ISREG(st.st_mode):
        raise StoreError(f"{path}: is a {_kind(st.st_mode)}, not a file speccheck wrote; the store is "
                         f"damaged: remove it, then {redo}.")
    return st


def file_sum(path: Path) -> dict:
    """Size and sha256 of a stored file, as manifests and sidecars list them."""
    st = regular_file(path)
    key = (str(path), st.st_mtime_ns, st.st_size, st.st_ino)
    if key not in _SUMS:
        _SUMS[key] = _hash_file(path)
    return dict(_SUMS[key])


def _hash_file(path: Path) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"size": path.stat().st_size, "sha256": h.hexdigest()}


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _atomic_write_bytes(path: Path, write: Callable, mode: str = "wb", sidecar: bool = True) -> None:
    """Temp file, its sum in the sidecar, then rename: a crash leaves the old file or the new,
    and never a temp file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:  # named by the file meant, not the temporary one
        raise OSError(e.errno, e.strerror, str(path)) from None
    tmp = Path(name)
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
        share_mode(tmp)
        if sidecar:
            _write_sidecar(path, file_sum(tmp))
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.filename is None:  # a failed write names no file: name the one being written
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_sidecar(path: Path, sums: dict) -> None:
    side = _sidecar(path)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{side.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(sums))
        share_mode(Path(name))
        os.replace(name, side)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise


def _atomic_write_text(path: Path, text: str, sidecar: bool = True) -> None:
    _atomic_write_bytes(path, lambda f: f.write(text.encode()), sidecar=sidecar)


def _atomic_write_npz(path: Path, **arrays: np.ndarray) -> None:
    _atomic_write_bytes(path, lambda f: np.savez(f, **arrays))


#: how to redo a damaged file; set per suite (see Suite.redo_hint) so messages name the command
_REDO_DEFAULT = "delete it and `speccheck run` again with the same options to redo just that part"


def verify_file(path: Path, want: dict | None, redo: str = _REDO_DEFAULT) -> None:
    """A stored file must still have the size and sha256 recorded when it was written
    (``want`` None: no sum recorded, which is damage)."""
    if want is None:
        raise StoreError(f"{path}: no checksum is recorded for it, so it cannot be verified; the store is "
                         f"damaged (or was written by a speccheck from before checksums): {redo}.")
    regular_file(path, redo)
    try:
        have = file_sum(path)
    except OSError as e:
        raise StoreError(f"{path}: missing or unreadable ({e.strerror or e}); {redo}.") from None
    if have != {"size": want.get("size"), "sha256": want.get("sha256")}:
        raise StoreError(f"{path}: changed since it was written (size {have['size']} vs {want.get('size')}, "
                         f"sha256 {have['sha256'][:12]} vs {str(want.get('sha256'))[:12]}): the store is "
                         f"damaged; {redo}.")


def _sidecar_sum(path: Path, redo: str) -> dict:
    side = _sidecar(path)
    if not os.path.lexists(side):
        regular_file(path, redo)  # a missing file is said as missing, before its sum
        raise StoreError(f"{side}: missing, so {path.name} cannot be verified; a missing checksum is "
                         f"damage: {redo}.")
    data = _load_json(side, redo)
    if not isinstance(data, dict) or not isinstance(data.get("size"), int) or not isinstance(data.get("sha256"), str):
        raise StoreError(f"{side}: not a size/sha256 record; {redo}.")
    return data


def _load_npz(path: Path, redo: str = _REDO_DEFAULT, keys: tuple[str, ...] = (),
              verified: bool = False) -> dict[str, np.ndarray]:
    """Stored arrays, their sidecar's sum checked first (``verified``: the caller checked the
    sum a manifest lists)."""
    if not verified:
        _settled(lambda: verify_file(path, _sidecar_sum(path, redo), redo))
    try:
        with np.load(path, allow_pickle=False) as z:
            out = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError, RuntimeError) as e:
        raise StoreError(f"{path}: cannot read stored arrays ({type(e).__name__}: {e}); the file is "
                         f"corrupted or not a speccheck store: {redo}.") from None
    missing = [k for k in keys if k not in out]
    if missing:
        raise StoreError(f"{path}: stored arrays lack {', '.join(missing)}; the file is damaged: {redo}.")
    return out


def _load_json(path: Path, redo: str = _REDO_DEFAULT):
    regular_file(path, redo)
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise StoreError(f"{path}: cannot read JSON ({e}); {redo}; nothing else in the store is "
                         "affected.") from None


#: a reader that finds a file and its sum disagreeing looks again this many times, 50 ms apart:
#: a writer in another process renames the sum in first, then the file (a run in progress)
_SETTLE_TRIES = 6


def _settled(read):
    """``read()``, looked at again while a file and its checksum disagree for a moment (a
    `speccheck run` writing the store while a `gate` reads it); damage stays damage."""
    for attempt in range(_SETTLE_TRIES):
        try:
            return read()
        except StoreError as e:
            if "changed since it was written" not in str(e) or attempt == _SETTLE_TRIES - 1:
                raise
            time.sleep(0.05)


def _load_checked_json(path: Path, redo: str = _REDO_DEFAULT):
    def read():
        verify_file(path, _sidecar_sum(path, redo), redo)
        return _load_json(path, redo)
    return _settled(read)


# the checked readers and writers, for other folders in the store's format (the golden)
load_checked_json = _load_checked_json
load_checked_npz = _load_npz
write_checked_text = _atomic_write_text
write_checked_npz = _atomic_write_npz


#: what a run manifest must hold (key -> accepted types); anything else is a damaged store
_MANIFEST_SCHEMA = {"format": (int,), "complete": (bool,), "config": (dict,), "identity": (dict,),
                    "corpus": (str,), "corpus_hash": (str,), "repeat": (int,), "fresh_process": (bool,),
                    "status": (str,), "error": (str, type(None)), "completions": (list,)}
_COMPLETION_SCHEMA = {"prompt_id": (str,), "text": (str,), "finish_reason": (str,),
                      "ttft_s": (int, float), "decode_s": (int, float), "spec": (dict, type(None))}
_RUN_ARRAYS = ("prompt_ids", "prompt_offsets", "token_ids", "offsets", "logprobs", "topk_ids", "topk_logprobs")


def _schema_problem(m, schema: dict, what: str) -> str | None:
    if not isinstance(m, dict):
        return f"{what} is not a JSON object"
    for key, types in schema.items():
        if key not in m:
            return f"{what} lacks {key!r}"
        if not isinstance(m[key], types) or (bool not in types and isinstance(m[key], bool)):
            return f"{what}: {key!r} is {type(m[key]).__name__}, not {'/'.join(t.__name__ for t in types)}"
    return None


#: what a plan.json holds, and per config (key -> accepted types; run_args may be absent)
_PLAN_SCHEMA = {"configs": (dict,)}
_PLAN_CONFIG_SCHEMA = {"repeats": (int,), "fresh_process_repeat": (bool,), "concurrent": (int,),
                       "rescore": (bool,), "attribute": (bool,)}
#: keys a config's plan may hold (plans recorded before them lack them): key -> accepted types
_PLAN_CONFIG_OPTIONAL = {"replay": (bool,)}


def _larger_demand(key: str, old, new):
    """Of two plans' demands for one config, the larger: most repeats, the newest all-at-once
    copies, a run asked for by either, every axis either asked for."""
    if old is None:
        return new
    if key == "repeats":
        return max(old, new)
    if key == "concurrent":
        return new or old
    if isinstance(new, bool):
        return old or new
    if isinstance(new, list):
        return list(dict.fromkeys([*old, *new]))
    return new


def _plan_problem(plan) -> str | None:
    """What is wrong with a loaded plan.json (None: nothing)."""
    problem = _schema_problem(plan, _PLAN_SCHEMA, "the plan")
    if problem:
        return problem
    if not isinstance(plan.get("run_args", []), list):
        return "the plan's 'run_args' is not a list"
    for name, want in plan["configs"].items():
        try:
            SpecConfig.from_name(name)
        except ValueError:
            return f"{name!r} is not a config name"
        problem = _schema_problem(want, _PLAN_CONFIG_SCHEMA, f"config {name!r}")
        if problem:
            return problem
        if not 1 <= want["repeats"] <= 100 or not 0 <= want["concurrent"] <= 64:
            return f"config {name!r} plans {want['repeats']} repeats and {want['concurrent']} copies at once"
        if not isinstance(want.get("axes", []), list) or not all(isinstance(a, str) for a in want.get("axes", [])):
            return f"config {name!r}: 'axes' is not a list of axis slots"
        present = {key: types for key, types in _PLAN_CONFIG_OPTIONAL.items() if key in want}
        problem = _schema_problem(want, present, f"config {name!r}")
        if problem:
            return problem
    return None


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 53


def _seconds(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1e9  # a NaN fails too


def _completion_problem(c: dict, i: int) -> str | None:
    """What a completion's numbers cannot be: negative, NaN or infinite times, counters that
    are not counts (each would be judged as a measurement)."""
    for key in ("ttft_s", "decode_s"):
        if not _seconds(c[key]):
            return f"completion {i}: {key!r} is {c[key]!r}, not a number of seconds"
    if c.get("decode_cpu_s") is not None and not _seconds(c["decode_cpu_s"]):
        return f"completion {i}: 'decode_cpu_s' is {c['decode_cpu_s']!r}, not a number of seconds"
    spec = c["spec"]
    if spec:
        bad = [k for k in ("drafts", "draft_tokens", "accepted_tokens") if not _count(spec.get(k, 0))]
        if spec.get("iterations") is not None and not _count(spec["iterations"]):
            bad.append("iterations")
        if spec.get("draft_s") is not None and not _seconds(spec["draft_s"]):
            bad.append("draft_s")
        per_pos = spec.get("accepted_per_pos", [])
        if not isinstance(per_pos, list) or not all(_count(n) for n in per_pos):
            bad.append("accepted_per_pos")
        if bad:
            return f"completion {i}: spec counters {', '.join(bad)} are not counts"
    return None


def manifest_problem(m) -> str | None:
    """Why a run manifest cannot be used (None: it can)."""
    problem = _schema_problem(m, _MANIFEST_SCHEMA, "the manifest")
    if problem:
        return problem
    cfg = m["config"]
    if not isinstance(cfg.get("method"), str) or not isinstance(cfg.get("k"), int):
        return "the manifest's config lacks method/k"
    seen: set[str] = set()
    for i, c in enumerate(m["completions"]):
        problem = _schema_problem(c, _COMPLETION_SCHEMA, f"completion {i}") or _completion_problem(c, i)
        if problem:
            return problem
        if c["prompt_id"] in seen and not m.get("copies"):  # a run all at once holds each prompt N times
            return f"completion {i} repeats prompt {c['prompt_id']!r}"
        seen.add(c["prompt_id"])
    if not _seconds(m.get("wall_s", 0.0)) or not _count(m.get("copies", 0)):
        return f"the manifest's wall_s {m.get('wall_s')!r} or copies {m.get('copies')!r} is not a measurement"
    files = m.get("files")
    if files is None:
        return "the manifest lists no file checksums"
    if not (isinstance(files, dict) and all(
            isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
            for v in files.values())):
        return "the manifest's file list is malformed"
    return None


def _ragged(arrays: list[np.ndarray], dtype) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate ragged arrays along axis 0; ``flat[offsets[i]:offsets[i+1]]`` is the i-th."""
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(a) for a in arrays])
    flat = np.concatenate([np.asarray(a, dtype=dtype) for a in arrays]) if arrays else np.zeros(0, dtype)
    return flat, offsets


def _rows(a: np.ndarray, n: int, fill) -> np.ndarray:
    """``a`` with exactly ``n`` rows: cut, or filled with ``fill`` where the engine gave fewer."""
    a = np.asarray(a)
    if len(a) == n:
        return a
    if len(a) > n:
        return a[:n]
    pad = np.full((n - len(a), *a.shape[1:]), fill, dtype=np.result_type(a.dtype, type(fill)))
    return np.concatenate([a.astype(pad.dtype), pad])


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
    return SpecCounters(**{k: v for k, v in d.items() if k in _COUNTER_FIELDS})


_COUNTER_FIELDS = frozenset(f.name for f in fields(SpecCounters))


def read_manifest(d: Path, redo: str = _REDO_DEFAULT) -> dict:
    """A run's manifest, verified against its sidecar and schema-checked, and its listed files
    verified (size and sha256)."""
    m = _load_checked_json(d / "manifest.json", redo)
    if isinstance(m, dict) and m.get("format") != FORMAT_VERSION:
        raise StoreError(f"{d}: store format {m.get('format')} is not {FORMAT_VERSION}; "
                         "re-run with this speccheck version into a fresh --store.")
    problem = manifest_problem(m)
    if problem:
        raise StoreError(f"{d / 'manifest.json'}: {problem}; the store is damaged: {redo}.")
    if m["completions"] and "arrays.npz" not in m["files"]:
        raise StoreError(f"{d / 'manifest.json'}: lists no checksum for arrays.npz; the store is damaged: {redo}.")
    for name, want in m["files"].items():
        if "/" in name or name.startswith(".") or name in ("manifest.json", "manifest.json.sha256"):
            raise StoreError(f"{d / 'manifest.json'}: lists {name!r}, not a file of a run; the store is "
                             f"damaged: {redo}.")
        verify_file(d / name, want, redo)
    return m


def read_run(d: Path, redo: str = _REDO_DEFAULT, manifest: dict | None = None) -> RunRecord:
    """One stored run directory (manifest.json + arrays.npz) as a RunRecord (``manifest``:
    its :func:`read_manifest`, when already read)."""
    m = manifest if manifest is not None else read_manifest(d, redo)
    comps: list[Completion] = []
    try:
        if m["completions"]:
            a = _load_npz(d / "arrays.npz", redo, _RUN_ARRAYS, verified=True)
            pids = _unragged(a["prompt_ids"], a["prompt_offsets"])
            off = a["offsets"]
            n = len(m["completions"])
            if len(off) != n + 1 or len(pids) != n or off[-1] != len(a["token_ids"]) or np.any(np.diff(off) < 0):
                raise ValueError("array offsets do not match the manifest's completions")
            for i, meta in enumerate(m["completions"]):
                sl = slice(off[i], off[i + 1])
                comps.append(Completion(
                    prompt_id=meta["prompt_id"], prompt_ids=pids[i], token_ids=a["token_ids"][sl],
                    logprobs=a["logprobs"][sl], topk_ids=a["topk_ids"][sl],
                    topk_logprobs=a["topk_logprobs"][sl], text=meta["text"],
                    finish_reason=meta["finish_reason"], ttft_s=meta["ttft_s"],
                    decode_s=meta["decode_s"], decode_cpu_s=meta.get("decode_cpu_s"),
                    spec=_counters(meta["spec"])))
        cfg = m["config"]
        return RunRecord(
            config=SpecConfig(cfg["method"], cfg["k"], cfg.get("draft")), identity=m["identity"],
            corpus=m["corpus"], corpus_hash=m["corpus_hash"], repeat=m["repeat"],
            fresh_process=m["fresh_process"], status=m["status"], error=m["error"],
            completions=comps, wall_s=m.get("wall_s", 0.0), copies=m.get("copies", 0),
            axis=str(m.get("axis") or ""), level=str(m.get("level") or ""), proof=dict(m.get("proof") or {}))
    except (KeyError, IndexError, ValueError, TypeError) as e:
        raise StoreError(f"{d}: the stored run is inconsistent ({type(e).__name__}: {e}); the store is "
                         f"damaged: {redo}.") from None


def _signature(paths: tuple[Path, ...]) -> tuple | None:
    """What identifies these files' contents without reading them (path, mtime, size, inode:
    every stored file is replaced by a rename, never rewritten in place); None if one is absent."""
    try:
        return tuple((str(p), st.st_mtime_ns, st.st_size, st.st_ino) for p in paths for st in (p.stat(),))
    except OSError:
        return None


@dataclass
class Suite:
    """One suite directory: the runs of one engine/model/args/corpus combination.

    Each stored file is read (and its sum checked) once per Suite object while it stays
    unchanged on disk: an evaluation asks for the baseline's runs and rescoring many times.
    What the loaders return is shared between callers, so it is never modified."""

    root: Path
    _reads: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _read_once(self, kind: str, paths: tuple[Path, ...], load: Callable):
        """``load()``, or what it returned last for these files while they are unchanged
        (failures are not kept: a damaged file fails every time it is asked for)."""
        sig = _signature(paths)
        if sig is None:
            return load()
        key = (kind, paths)
        kept = self._reads.get(key)
        if kept is None or kept[0] != sig:  # one version per file: a replaced file's old one goes
            self._reads[key] = (sig, load())
        return self._reads[key][1]

    @property
    def id(self) -> str:
        return self.root.name

    @property
    def meta(self) -> dict:
        path = self.root / "suite.json"
        m = self._read_once("json", (path, _sidecar(path)), lambda: _load_checked_json(
            path, "run `speccheck run` again into a fresh --store"))
        if (not isinstance(m, dict) or not all(isinstance(m.get(k), str) for k in ("engine", "corpus", "corpus_hash"))
                or not isinstance(m.get("engine_args") or {}, dict)
                or not all(isinstance(m.get(k), (str, type(None))) for k in ("model", "draft"))):
            raise StoreError(f"{self.root / 'suite.json'}: lacks engine/corpus/corpus_hash (strings), or its "
                             "engine_args/model/draft are of the wrong type; the suite is damaged: run "
                             "`speccheck run` again into a fresh --store.")
        return m

    def redo_hint(self, config_name: str | None = None, what: str = "that part") -> str:
        """The command that redoes just one damaged part of this suite (a damaged part counts as
        not stored, so `run` redoes it and nothing else)."""
        try:
            m = self.meta
        except StoreError:
            return _REDO_DEFAULT
        store = self.root.parent.parent
        cmd = ["speccheck", "run", "--store", str(store), "--engine", m["engine"]]
        for opt in ("model", "draft"):
            if m.get(opt):
                cmd += [f"--{opt}", str(m[opt])]
        from speccheck.corpus import list_corpora

        corpus = m["corpus"] if m["corpus"] in list_corpora() else f"<your {m['corpus']} corpus file>"
        cmd += ["--corpus", corpus, "--config", config_name or "baseline"]
        cmd += [a for k, v in sorted((m.get("engine_args") or {}).items())
                for a in ("--engine-arg", f"{k}={v}")
                if k not in ("base_url", "served_model", "api_key_env")]
        for k in ("base_url", "served_model", "api_key_env"):
            if (m.get("engine_args") or {}).get(k):
                cmd += [f"--{k.replace('_', '-')}", str(m["engine_args"][k])]
        return f"`{shlex.join(cmd)}` redoes just {what}"

    # --- runs -----------------------------------------------------------------------------
    def run_dir(self, config_name: str, repeat: int | str) -> Path:
        """Where a run of the config lives, by its slot (types.TOGETHER: the corpus all at once;
        a string: a workload axis at one level, types.axis_slot)."""
        if isinstance(repeat, str):
            return self.root / "runs" / config_name / repeat
        return self.root / "runs" / config_name / ("together" if repeat == TOGETHER else f"r{repeat}")

    def is_complete(self, config_name: str, repeat: int) -> bool:
        """Stored, finished, and intact: a damaged run counts as not stored, so `run` redoes it."""
        d = self.run_dir(config_name, repeat)
        if not (d / "manifest.json").exists():
            return False
        try:
            return bool(self._manifest(config_name, repeat, _REDO_DEFAULT)["complete"])
        except StoreError:
            return False

    def _run_files(self, config_name: str, repeat: int) -> tuple[Path, Path, Path]:
        d = self.run_dir(config_name, repeat)
        return d / "manifest.json", _sidecar(d / "manifest.json"), d / "arrays.npz"

    def _manifest(self, config_name: str, repeat: int, redo: str | None = None) -> dict:
        """read_manifest of that run, once while its files are unchanged."""
        return self._read_once("manifest", self._run_files(config_name, repeat), lambda: read_manifest(
            self.run_dir(config_name, repeat), redo or self._redo_run(config_name, repeat)))

    def run_manifest(self, config_name: str, repeat: int) -> dict:
        """A stored run's manifest (verified; StoreError when damaged)."""
        return self._manifest(config_name, repeat)

    def check_run(self, config_name: str, repeat: int) -> bool:
        """Whether a run is stored and complete; a damaged one is a StoreError, not False
        (for the commands that must not skip what they cannot read)."""
        if not os.path.lexists(self.run_dir(config_name, repeat) / "manifest.json"):
            return False
        return bool(self._manifest(config_name, repeat)["complete"])

    def run_identity(self, config_name: str, repeat: int) -> dict:
        return self._manifest(config_name, repeat)["identity"]

    def _redo_run(self, config_name: str, repeat: int) -> str:
        return self.redo_hint(config_name, f"that run ({config_name} {slot_label(repeat)})")

    def write_run(self, record: RunRecord) -> Path:
        """Write one run atomically: temp directory, then rename over any old (failed) one.
        A new first repeat makes that config's rescoring and attribution stale: they go."""
        final = self.run_dir(record.config.name, record.slot)
        if record.slot == 0:
            self.rescore_path(record.config.name, 0).unlink(missing_ok=True)
            self.replay_path(record.config.name, 0).unlink(missing_ok=True)
            (self.root / "attribution" / f"{record.config.name}.json").unlink(missing_ok=True)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
        try:
            self._fill_run_dir(tmp, record)
            share_mode(tmp, directory=True)
            _replace_dir(tmp, final)
        except OSError as e:
            if e.filename is None:  # a failed write (a full disk, a size limit) names no file
                raise OSError(e.errno, e.strerror, str(final)) from None
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    @staticmethod
    def _fill_run_dir(tmp: Path, record: RunRecord) -> None:
        comps = record.completions
        arrays: dict[str, np.ndarray] = {}
        if comps:
            arrays["prompt_ids"], arrays["prompt_offsets"] = _ragged([c.prompt_ids for c in comps], np.int32)
            arrays["token_ids"], arrays["offsets"] = _ragged([c.token_ids for c in comps], np.int32)
            # one logprob row per token, whatever the engine reported: a missing row is NaN (and
            # logprobs_valid names it), never a shift of every later prompt's rows
            arrays["logprobs"], _ = _ragged([_rows(c.logprobs, c.n_tokens, np.nan) for c in comps], np.float32)
            k = max(c.topk_ids.shape[1] for c in comps)
            arrays["topk_ids"], _ = _ragged([_rows(_width(c.topk_ids, k), c.n_tokens, -1) for c in comps],
                                            np.int32)
            arrays["topk_logprobs"], _ = _ragged([_rows(_width(c.topk_logprobs, k), c.n_tokens, np.nan)
                                                  for c in comps], np.float32)
        np.savez(tmp / "arrays.npz", **arrays)
        share_mode(tmp / "arrays.npz")
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
            **({"axis": record.axis, "level": record.level, "proof": record.proof} if record.axis else {}),
            "completions": [
                {"prompt_id": c.prompt_id, "text": c.text, "finish_reason": c.finish_reason,
                 "ttft_s": c.ttft_s, "decode_s": c.decode_s, "n_tokens": c.n_tokens,
                 "spec": c.spec.to_dict() if c.spec else None,
                 **({"decode_cpu_s": c.decode_cpu_s} if c.decode_cpu_s is not None else {})}
                for c in comps
            ],
            "files": {"arrays.npz": file_sum(tmp / "arrays.npz")},
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False))
        share_mode(tmp / "manifest.json")
        _write_sidecar(tmp / "manifest.json", file_sum(tmp / "manifest.json"))

    def load_run(self, config_name: str, repeat: int) -> RunRecord:
        return self._read_once("run", self._run_files(config_name, repeat), lambda: self._of_this_suite(
            read_run(self.run_dir(config_name, repeat), self._redo_run(config_name, repeat),
                     self._manifest(config_name, repeat)), config_name, repeat))

    def _of_this_suite(self, rec: RunRecord, config_name: str, repeat: int) -> RunRecord:
        """A run is of the suite that holds it: its config, corpus and engine are the suite's
        (a suite.json or manifest rewritten with a matching checksum is caught here)."""
        path = self.root / "suite.json"
        raw = self._read_once("json", (path, _sidecar(path)), lambda: _load_checked_json(
            path, "run `speccheck run` again into a fresh --store")) if path.exists() else {}
        meta = raw if isinstance(raw, dict) else {}  # its shape is `meta`'s to judge
        for what, have, want in (("config", rec.config.name, config_name),
                                 ("corpus hash", rec.corpus_hash, meta.get("corpus_hash")),
                                 ("engine", (rec.identity or {}).get("engine"), meta.get("engine"))):
            if have is not None and want is not None and have != want:
                raise StoreError(
                    f"{self.run_dir(config_name, repeat) / 'manifest.json'}: its {what} is {have!r}, but the "
                    f"suite's (suite.json, runs/{config_name}/) is {want!r}: a run of another suite, or a file "
                    f"changed after it was written; the suite is damaged: {self._redo_run(config_name, repeat)}.")
        return rec

    def load_together(self, config_name: str) -> RunRecord | None:
        """The config's run of the whole corpus at once, if one is stored."""
        d = self.run_dir(config_name, TOGETHER)
        return self.load_run(config_name, TOGETHER) if (d / "manifest.json").exists() else None

    def _entries(self, d: Path, what: str, ok: Callable[[str], bool]) -> list[Path]:
        """The directories in ``d`` (a folder of the store speccheck fills), each checked: a real
        directory whose name ``ok`` accepts. Anything else there (a stray file or directory, a
        symlink, a FIFO) is damage, named; hidden names are a crash's temporary leftovers."""
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StoreError(f"{d}: unreadable ({e.strerror or e}); check its permissions.") from None
        out = []
        for e in entries:
            if e.name.startswith("."):
                continue
            kind = "symlink" if e.is_symlink() else ("directory" if e.is_dir(follow_symlinks=False) else None)
            if kind != "directory" or not ok(e.name):
                shown = _kind(e.stat(follow_symlinks=False).st_mode) if kind is None else kind
                raise StoreError(f"{Path(e.path)}: a {shown} speccheck did not write ({what} hold only "
                                 f"speccheck's own directories); move it out of the store (or delete it) "
                                 f"and run the command again; nothing else there is affected.")
            out.append(Path(e.path))
        return out

    def _slots(self, config_name: str) -> list[Path]:
        return self._entries(self.root / "runs" / config_name, f"runs/{config_name}/",
                             lambda n: bool(re.fullmatch(r"r\d+|together|axis-.+", n)))

    def axis_slots(self, config_name: str) -> list[str]:
        """The workload-axis runs stored for a config (their slots, sorted)."""
        return sorted(p.name for p in self._slots(config_name)
                      if p.name.startswith("axis-") and (p / "manifest.json").exists())

    def load_axis(self, config_name: str, slot: str) -> RunRecord | None:
        """A config's run of one workload axis at one level, if one is stored."""
        return self.load_run(config_name, slot) if (self.run_dir(config_name, slot) / "manifest.json").exists() else None

    def configs(self) -> list[str]:
        """Config names with at least one stored run, baseline first, then by method and K."""
        names = [p.name for p in self._entries(self.root / "runs", "runs/", _is_config_name)]
        return sorted(names, key=config_sort_key)

    def repeats(self, config_name: str) -> list[int]:
        return sorted(int(p.name[1:]) for p in self._slots(config_name) if re.fullmatch(r"r\d+", p.name))

    def records(self, config_name: str) -> Iterator[RunRecord]:
        for r in self.repeats(config_name):
            yield self.load_run(config_name, r)

    # --- inputs, rescoring, attribution ----------------------------------------------------
    def write_inputs(self, prompt_ids: dict[str, list[int]]) -> None:
        ids = list(prompt_ids)
        flat, off = _ragged([np.asarray(prompt_ids[i], np.int32) for i in ids], np.int32)
        _atomic_write_npz(self.root / "inputs.npz", ids=np.array(ids, dtype=str), flat=flat, offsets=off)

    def check_inputs(self) -> None:
        """The tokenised prompts every stored run was made from, and the plan of what was asked:
        read and verified. Either missing beside stored runs is damage, said before anything is
        judged (without the plan a gate cannot tell a config that was cut short from one never
        asked for, so deleting it must not make a suite pass)."""
        if not self.configs():
            return
        if self.load_inputs() is None:
            raise StoreError(f"{self.root / 'inputs.npz'}: missing, though runs are stored; the suite is "
                             f"damaged: {self.redo_hint('baseline', 'the tokenised prompts')}.")
        if self.load_plan() is None:
            raise StoreError(f"{self.root / 'plan.json'}: missing, though runs are stored, so what was asked "
                             "of this suite is lost; the suite is damaged: `speccheck run` again into it with "
                             "the options you want writes it anew (stored runs are kept and skipped).")
        unplanned = self.unplanned()
        if unplanned:
            raise StoreError(
                f"{self.root / 'plan.json'}: does not plan {unplanned}, which is stored. A plan only grows as "
                "runs are added, so it was changed after the runs were made (a plan asking for less would "
                "let the gate judge on less evidence); the suite is damaged: `speccheck run` again into it "
                "with the options it was run with writes the plan anew (stored runs are kept and skipped).")

    def unplanned(self) -> str | None:
        """The first stored piece the plan does not ask for (a config, a repeat, the run all at
        once, a workload axis, a rescoring or replay), or None."""
        planned = (self.load_plan() or {}).get("configs", {})
        for name in self.configs():
            want = planned.get(name)
            if want is None:
                return f"config {name} (runs/{name}/)"
            reps = self.repeats(name)
            if reps and reps[-1] >= want["repeats"]:
                return f"repeat r{reps[-1]} of {name} (it plans {want['repeats']})"
            if not want.get("concurrent") and (self.run_dir(name, TOGETHER) / "manifest.json").exists():
                return f"the run of {name} all at once (runs/{name}/together)"
            extra = sorted(set(self.axis_slots(name)) - set(want.get("axes") or []))
            if extra:
                return f"the workload axis run {name}/{extra[0]}"
            for key, path, what in (("rescore", self.rescore_path(name, 0), "rescoring"),
                                    ("replay", self.replay_path(name, 0), "acceptance replay")):
                if not want.get(key) and path.exists():
                    return f"the {what} of {name} ({path.parent.name}/{path.name})"
        return None

    def load_inputs(self) -> dict[str, np.ndarray] | None:
        path = self.root / "inputs.npz"
        if not os.path.lexists(path):
            return None
        redo = self.redo_hint("baseline", "the tokenised prompts")
        a = _load_npz(path, redo, ("ids", "flat", "offsets"))
        off = a["offsets"]
        if len(off) != len(a["ids"]) + 1 or (len(off) and off[-1] != len(a["flat"])):
            raise StoreError(f"{path}: the tokenised prompts are inconsistent; {redo}.")
        return dict(zip(a["ids"].tolist(), _unragged(a["flat"], off)))

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
        return self._read_once("rescore", (path, _sidecar(path)), lambda: self._read_rescore(path, config_name))

    def _read_rescore(self, path: Path, config_name: str) -> dict[str, Scored]:
        redo = self.redo_hint(config_name, "its rescoring")
        a = _load_npz(path, redo, ("ids", "topk_ids", "topk_logprobs", "token_logprobs", "offsets"))
        off = a["offsets"]
        try:
            if len(off) != len(a["ids"]) + 1 or off[-1] != len(a["token_logprobs"]):
                raise ValueError("offsets do not match")
            return {pid: Scored(a["topk_ids"][off[i]:off[i + 1]], a["topk_logprobs"][off[i]:off[i + 1]],
                                a["token_logprobs"][off[i]:off[i + 1]])
                    for i, pid in enumerate(a["ids"].tolist())}
        except (ValueError, IndexError) as e:
            raise StoreError(f"{path}: the stored scores are inconsistent ({e}); {redo}.") from None

    def has_rescore(self, config_name: str, repeat: int) -> bool:
        """Stored and intact (a damaged rescoring counts as missing, so `run` redoes it)."""
        try:
            return self.load_rescore(config_name, repeat) is not None
        except StoreError:
            return False

    def replay_path(self, config_name: str, repeat: int) -> Path:
        return self.root / "replay" / f"{config_name}-r{repeat}.npz"

    def write_replay(self, config_name: str, repeat: int, prompt_ids: list[str],
                     replays: list[Replay]) -> None:
        """The acceptance replayed over that run's own outputs (Engine.replay_acceptance),
        prompt by prompt: each verify step's accepted count and the drafter's margins."""
        acc, off = _ragged([r.accepted for r in replays], np.int32)
        margins, _ = _ragged([r.margins for r in replays], np.float32)
        weakest, _ = _ragged([r.min_margins for r in replays], np.float32)
        _atomic_write_npz(self.replay_path(config_name, repeat), ids=np.array(prompt_ids, dtype=str),
                          k=np.array([r.k for r in replays], dtype=np.int32), accepted=acc,
                          margins=margins, min_margins=weakest, offsets=off)

    def load_replay(self, config_name: str, repeat: int) -> dict[str, Replay] | None:
        """prompt id -> its replay, or None where none is stored (StoreError: damaged)."""
        path = self.replay_path(config_name, repeat)
        if not path.exists():
            return None
        return self._read_once("replay", (path, _sidecar(path)), lambda: self._read_replay(path, config_name))

    def _read_replay(self, path: Path, config_name: str) -> dict[str, Replay]:
        redo = self.redo_hint(config_name, "its acceptance replay")
        a = _load_npz(path, redo, ("ids", "k", "accepted", "margins", "min_margins", "offsets"))
        off, k, acc = a["offsets"], a["k"], a["accepted"]
        try:
            n = len(a["ids"])
            if (len(off) != n + 1 or len(k) != n or off[-1] != len(acc) or np.any(np.diff(off) < 0)
                    or len(a["margins"]) != len(acc) or len(a["min_margins"]) != len(acc)):
                raise ValueError("offsets do not match")
            if np.any(k < 1) or any(np.any((acc[off[i]:off[i + 1]] < -1) | (acc[off[i]:off[i + 1]] > k[i]))
                                    for i in range(n)):
                raise ValueError("an accepted count outside -1..K")
            drafted = np.asarray(acc) != -1  # a step without a draft (-1) has no margin: NaN there only
            for name in ("margins", "min_margins"):  # top-1 minus top-2: >= 0, +inf with one candidate
                m = np.asarray(a[name], dtype=np.float64)
                if np.any(np.isnan(m[drafted])) or np.any(m[~np.isnan(m)] < 0):
                    raise ValueError(f"a drafter {name.replace('_', ' ')[:-1]} that is NaN or negative "
                                     "at a step that drafted")
            return {pid: Replay(int(k[i]), acc[off[i]:off[i + 1]], a["margins"][off[i]:off[i + 1]],
                                a["min_margins"][off[i]:off[i + 1]])
                    for i, pid in enumerate(a["ids"].tolist())}
        except (ValueError, IndexError) as e:
            raise StoreError(f"{path}: the stored replay is inconsistent ({e}); {redo}.") from None

    def has_replay(self, config_name: str, repeat: int) -> bool:
        """Stored and intact (a damaged replay counts as missing, so `run` redoes it)."""
        try:
            return self.load_replay(config_name, repeat) is not None
        except StoreError:
            return False

    def sampled_scores_path(self, config_name: str, repeat: int) -> Path:
        return self.root / "sampled" / f"{config_name}-r{repeat}.npz"

    def write_sampled_scores(self, config_name: str, repeat: int, prompt_ids: list[str],
                             scores: list[np.ndarray]) -> None:
        """A sampled run's teacher-forced target distribution at each sampled position
        (Engine.score_sampled: float64 [n, 6] per prompt; older stores [n, 5])."""
        width = max([np.asarray(s).shape[-1] for s in scores if np.asarray(s).ndim == 2] or [6])
        flat, off = _ragged([np.asarray(s, np.float64).reshape(-1, width) for s in scores], np.float64)
        _atomic_write_npz(self.sampled_scores_path(config_name, repeat),
                          ids=np.array(prompt_ids, dtype=str), scores=flat.reshape(-1, width),
                          offsets=off)

    def load_sampled_scores(self, config_name: str, repeat: int) -> dict[str, np.ndarray] | None:
        """prompt id -> [n, 6] (or older [n, 5]) scores, or None where none are stored (StoreError: damaged)."""
        path = self.sampled_scores_path(config_name, repeat)
        if not path.exists():
            return None

        def read():
            redo = self.redo_hint(config_name, "its sampled-position scores")
            a = _load_npz(path, redo, ("ids", "scores", "offsets"))
            off, sc = a["offsets"], a["scores"]
            if (sc.ndim != 2 or sc.shape[1] not in (5, 6) or len(off) != len(a["ids"]) + 1
                    or (len(off) and off[-1] != len(sc)) or np.any(np.diff(off) < 0)):
                raise StoreError(f"{path}: the stored scores are inconsistent; {redo}.")
            return {pid: sc[off[i]:off[i + 1]] for i, pid in enumerate(a["ids"].tolist())}
        return self._read_once("sampled", (path, _sidecar(path)), read)

    # --- the plan: what `speccheck run` was asked to store here -----------------------------
    def load_plan(self) -> dict | None:
        """The recorded plan, or None for a suite stored before plans were recorded."""
        path = self.root / "plan.json"
        if not path.exists():
            return None
        redo = ("delete it and `speccheck run` again with the options you want (stored runs are "
                "kept and skipped)")
        plan = _load_checked_json(path, redo)
        problem = _plan_problem(plan)
        if problem:
            raise StoreError(f"{path}: {problem}, so the plan is damaged; {redo}; nothing else in "
                             "the store is affected.")
        return plan

    def extend_plan(self, configs: dict[str, dict], run_args: list[str]) -> dict:
        """Add configs to the plan (written atomically, before any engine starts). A config
        planned again keeps the larger demand: most repeats, the newest all-at-once copies,
        rescoring and attribution if either run asked for them. ``run_args`` are the
        `speccheck run` options that name this suite (engine, model, corpus, ...)."""
        plan = self.load_plan() or {"format": 1, "configs": {}}
        for name, want in configs.items():
            old = plan["configs"].get(name)
            if old is not None:
                want = {**old, **{key: _larger_demand(key, old.get(key), value) for key, value in want.items()}}
            plan["configs"][name] = want
        plan["configs"] = dict(sorted(plan["configs"].items(), key=lambda kv: config_sort_key(kv[0])))
        plan["run_args"] = run_args
        if plan != self.load_plan():  # a resume with nothing new writes nothing
            _atomic_write_text(self.root / "plan.json", json.dumps(plan, indent=1))
        return plan

    # --- escalation: the linked suite that judged this one's inconclusive checks again -------
    def write_escalation(self, link: dict) -> None:
        _atomic_write_text(self.root / "escalation.json", json.dumps(link, indent=1))

    def load_escalation(self) -> dict | None:
        """The link `speccheck run` wrote when it escalated (None: never escalated)."""
        path = self.root / "escalation.json"
        if not path.exists():
            return None
        link = _load_checked_json(path, "`speccheck run` again with the same options escalates again")
        return link if isinstance(link, dict) and isinstance(link.get("suite"), str) else None

    def _json(self, path: Path):
        """A stored JSON file (its sum checked, no schema), once while it is unchanged."""
        return self._read_once("json", (path, _sidecar(path)), lambda: _load_checked_json(path))

    def planned_configs(self) -> list[str]:
        plan = self.load_plan()
        return list(plan["configs"]) if plan else []

    def run_command(self, *options: str) -> str:
        """`speccheck run` into this suite with these options (as the plan recorded it)."""
        run_args = (self.load_plan() or {}).get("run_args", [])
        return shlex.join(["speccheck", "run", *run_args, *options, "--store", str(self.root.parent.parent)])

    def demand(self, config_name: str) -> dict | None:
        """What the plan asks of a config, with the evidence every config of the suite is judged
        on -- a fresh-process repeat, the corpus all at once -- raised to what any config of it
        was planned with: one gate, one standard (a sweep into a `run`'s suite, which plans
        neither, must not pass its configs on less evidence than the run's). None: not planned."""
        configs = (self.load_plan() or {}).get("configs", {})
        want = configs.get(config_name)
        if want is None:
            return None
        want = dict(want)
        fresh = any(w["fresh_process_repeat"] and w["repeats"] > 1 for w in configs.values())
        if fresh and not want["fresh_process_repeat"]:
            want["fresh_process_repeat"], want["repeats"] = True, max(want["repeats"], 2)
        want["concurrent"] = want["concurrent"] or max((w["concurrent"] for w in configs.values()), default=0)
        return want

    def resume_command(self, config_name: str) -> str:
        """The `speccheck run` that stores what the plan asks of this config (it resumes:
        complete runs are skipped)."""
        want = self.demand(config_name)
        options = ["--config", config_name]
        if want is not None:
            options += ["--repeats", str(want["repeats"]), "--concurrent", str(want["concurrent"])]
            options += [] if want["attribute"] else ["--no-attribution"]
        return self.run_command(*options)

    def missing(self, config_name: str) -> list[str]:
        """What is not stored of this config: every run, rescoring, acceptance replay and
        attribution the plan asked for; a config with no stored run at all is missing whether planned or not (it
        was demanded, or its one run was cut short). Empty when complete. Failed runs are not missing (they say why)."""
        want = self.demand(config_name)
        resume = f"re-run `{self.resume_command(config_name)}` to resume"
        if not self.repeats(config_name) and not (self.run_dir(config_name, TOGETHER) / "manifest.json").exists():
            if want is None:
                return [f"{config_name} is not stored in suite {self.id}; run "
                        f"`{self.resume_command(config_name)}`"]
            return [f"{config_name} was planned but is not stored: the run died or was stopped "
                    f"before it; {resume}"]
        if want is None:
            return []
        gaps = [f"{config_name} r{r}" for r in range(want["repeats"])
                if not (self.run_dir(config_name, r) / "manifest.json").exists()]
        if want["concurrent"]:
            together = self.run_dir(config_name, TOGETHER) / "manifest.json"
            if not together.exists() or self._json(together).get("copies") != want["concurrent"]:
                gaps.append(f"{config_name} all at once (x{want['concurrent']})")
        gaps += [f"{config_name} {slot_label(slot)}" for slot in want.get("axes", ())
                 if not self.is_complete(config_name, slot)]
        ok = [r for r in range(want["repeats"]) if self.is_complete(config_name, r)]
        if (want["fresh_process_repeat"] and want["repeats"] > 1 and len(ok) == want["repeats"]
                and not any(self._json(self.run_dir(config_name, r) / "manifest.json").get("fresh_process")
                            for r in ok)):
            gaps.append(f"the fresh-process repeat of {config_name} (every stored repeat ran in "
                        "one process)")
        if want["rescore"] and self.is_complete(config_name, 0) and self.load_rescore(config_name, 0) is None:
            gaps.append(f"teacher-forced rescoring of {config_name} r0 (never finished)")
        if want.get("replay") and self.is_complete(config_name, 0) and not self.has_replay(config_name, 0):
            gaps.append(f"acceptance replay of {config_name} r0 (never finished)")
        if (want["attribute"] and config_name != "baseline" and self.is_complete(config_name, 0)
                and self.load_attribution(config_name) is None):
            gaps.append(f"kernel-path attribution of {config_name} (never finished)")
        return [f"planned but not stored: {', '.join(gaps)}; {resume}"] if gaps else []

    def write_attribution(self, config_name: str, data: list[dict]) -> None:
        _atomic_write_text(self.root / "attribution" / f"{config_name}.json",
                           json.dumps(data, indent=1, ensure_ascii=False))

    def load_attribution(self, config_name: str) -> list[dict] | None:
        path = self.root / "attribution" / f"{config_name}.json"
        if not path.exists():
            return None
        redo = self.redo_hint(config_name, "its attribution")
        data = _load_checked_json(path, redo)
        if not isinstance(data, list) or not all(
                isinstance(d, dict) and isinstance(d.get("prompt_id"), str) and isinstance(d.get("position"), int)
                and isinstance(d.get("paths", {}), dict) for d in data):
            raise StoreError(f"{path}: not a list of attributed divergences (prompt_id, position, paths); {redo}.")
        return data

    def has_attribution(self, config_name: str) -> bool:
        try:
            return self.load_attribution(config_name) is not None
        except StoreError:
            return False

    # one kernel path's result, kept while an attribution is under way: on a real engine each
    # path is an engine start (minutes), so a run stopped half-way resumes where it stopped
    def _part_path(self, key: str) -> Path:
        return self.root / "attribution" / "parts" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"

    def write_attribution_part(self, key: str, tokens: list[int]) -> None:
        _atomic_write_text(self._part_path(key), json.dumps({"key": key, "tokens": tokens}))

    def load_attribution_part(self, key: str) -> list[int] | None:
        """The tokens stored under ``key``, or None (not stored, or damaged: computed again)."""
        path = self._part_path(key)
        if not path.exists():
            return None
        try:
            data = _load_checked_json(path, _REDO_DEFAULT)
        except StoreError:
            return None
        ok = (isinstance(data, dict) and data.get("key") == key and isinstance(data.get("tokens"), list)
              and all(isinstance(t, int) for t in data["tokens"]))
        return data["tokens"] if ok else None

    def clear_attribution_parts(self) -> None:
        shutil.rmtree(self.root / "attribution" / "parts", ignore_errors=True)


def _copy_dir(src: Path, final: Path) -> None:
    """A stored run directory copied whole: into a temporary sibling, then renamed in place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    try:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
        _replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _copy_files(src_dir: Path, dst_dir: Path, names: list[str]) -> None:
    """Files copied each through a temporary name (their sidecars with them)."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        if (src_dir / name).exists():
            tmp = dst_dir / f".{name}.tmp-{os.getpid()}"
            shutil.copyfile(src_dir / name, tmp)
            os.replace(tmp, dst_dir / name)


def _outputs_differ(a: RunRecord, b: RunRecord) -> str | None:
    """Which outputs two runs of one config differ in ("3 prompts' tokens"), or None."""
    pa, pb = a.by_prompt(), b.by_prompt()
    if set(pa) != set(pb):
        return "their prompts"
    n = sum(not (np.array_equal(pa[i].token_ids, pb[i].token_ids)
                 and np.array_equal(pa[i].logprobs, pb[i].logprobs)) for i in pa)
    return f"{n} prompt(s)' tokens or logprobs" if n else None


def _replace_dir(tmp: Path, final: Path) -> None:
    """Rename a finished temp directory over ``final``; another writer's directory there
    (a race the store lock normally prevents) is moved aside and removed, never merged."""
    for _ in range(20):
        old = None
        if final.exists():
            old = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.old-"))
            try:
                os.replace(final, old / "run")
            except FileNotFoundError:
                pass
        try:
            tmp.rename(final)
            return
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        finally:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
    raise StoreError(f"{final}: another writer keeps replacing this run; run one `speccheck run` per store.")


def _is_config_name(name: str) -> bool:
    try:
        return SpecConfig.from_name(name).name == name
    except ValueError:
        return False


def config_sort_key(name: str) -> tuple:
    if name == "baseline":
        return (0, "", 0)
    try:
        cfg = SpecConfig.from_name(name)
    except ValueError:
        return (2, name, 0)
    return (1, cfg.method, cfg.k)


class Store:
    """A ``.speccheck/`` directory holding suites."""

    def __init__(self, root: str | os.PathLike = ".speccheck") -> None:
        self.root = Path(root)

    def suite(self, sid: str, meta: dict | None = None) -> Suite:
        """The suite with this id; ``meta`` creates it (or checks it is the same suite)."""
        s = Suite(self.root / "suites" / sid)
        if s.root.is_symlink():  # another store's files read as this one's: never judged as ours
            raise StoreError(f"{s.root}: a symlink speccheck did not write (suites/ holds only "
                             "speccheck's own directories); to judge another store's suite, pass that "
                             "store with --store (or copy it in with `speccheck merge`).")
        if meta is not None:
            if (s.root / "suite.json").exists():
                if s.meta.get("corpus_hash") != meta.get("corpus_hash"):
                    raise StoreError(f"{s.root}: suite exists with another corpus hash")
            else:
                _atomic_write_text(s.root / "suite.json", json.dumps(meta, indent=1))
                share_mode(s.root, directory=True)
        elif not (s.root / "suite.json").exists():
            raise StoreError(
                f"no suite {sid!r} in store {self.root} (option --store / --suite). "
                f"Suites there: {', '.join(self.suite_ids()) or 'none'}; run `speccheck run` first.")
        return s

    def suite_ids(self) -> list[str]:
        d = self.root / "suites"
        return sorted(p.name for p in d.iterdir() if (p / "suite.json").exists()) if d.exists() else []

    def set_latest(self, sid: str) -> None:
        path = self.root / "LATEST"
        try:
            if self.latest_id() == sid:
                return  # nothing to write: a resume with nothing to do works on a read-only store
        except StoreError:
            pass  # absent or damaged: written anew
        _atomic_write_text(path, sid + "\n")

    def latest_id(self) -> str | None:
        """The suite id LATEST names (its sum checked), or None when no run wrote one."""
        path = self.root / "LATEST"
        if not os.path.lexists(path):
            return None
        redo = "name the suite with --suite, or `speccheck run` again to write it anew"
        verify_file(path, _sidecar_sum(path, redo), redo)
        try:
            return path.read_bytes().decode("utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise StoreError(f"{path}: unreadable ({e}); {redo}.") from None

    @contextlib.contextmanager
    def lock(self, wait: bool = True, notify: Callable[[str], None] | None = None):
        """Exclusive writer lock on the store: ``<store>/lock`` (a :class:`filelock.FileLock`,
        flock()ed, so the kernel releases it when the holder dies and a stale lock is recovered
        by the next writer) holds the holder's pid. A second writer waits (``wait``) or refuses
        at once. On a store this process cannot write, nothing is locked: nothing can be
        written there either."""
        from filelock import FileLock, Timeout

        path = self.root / "lock"
        try:
            st = os.lstat(path)
        except OSError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):  # a FIFO would block, a directory refuse
            raise StoreError(f"{path}: a {_kind(st.st_mode)} where speccheck keeps its lock file (a regular "
                             "file holding the writer's pid); remove it, then run the command again "
                             "(nothing else in the store is affected).")
        held = FileLock(path, poll_interval=0.2)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            try:
                held.acquire(blocking=False)
            except Timeout:
                try:
                    holder = path.read_bytes()[:64].decode(errors="replace").strip() or "?"
                except OSError:
                    holder = "?"
                if not wait:
                    raise StoreError(f"store {self.root} is in use by another speccheck (pid {holder}); "
                                     "wait for it to finish or use another --store.") from None
                if notify:
                    notify(f"store {self.root} is in use by another speccheck (pid {holder}); waiting "
                           "for it to finish (Ctrl-C to stop)")
                held.acquire()
        except OSError as e:  # (a Timeout is an OSError too, but only a non-blocking try raises one)
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM) and self.root.is_dir():
                yield
                return
            raise StoreError(f"--store {self.root}: cannot create the store there ({e.strerror or e}); "
                             "give a writable directory with --store.") from None
        try:
            fd = os.open(path, os.O_WRONLY)  # the file held: the lock keeps it in place while held
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            finally:
                os.close(fd)
            yield
        finally:
            held.release()

    def merge(self, source: "Store") -> list[str]:
        """Copy into this store what ``source`` holds and it lacks: whole suites, and of a suite
        both hold every complete run, rescoring and attribution (configs run side by side into
        stores of their own, e.g. one GPU each, then judged together). Nothing here is
        overwritten: of a run both hold, this store's is kept (a difference in outputs is
        said: a determinism finding), and a rescoring or attribution is copied only with the
        first repeat it was made from. The plans are joined. One line per thing done."""
        if source.root.resolve() == self.root.resolve():
            raise StoreError(f"merge: {source.root} is the store itself (option --store)")
        if not source.suite_ids():  # a mistyped path must not read as "already merged"
            raise StoreError(f"merge: {source.root} holds no suites, so it is not a store `speccheck run` "
                             "wrote (a store holds suites/<id>/suite.json); give the --store a run wrote to.")
        said: list[str] = []
        for sid in source.suite_ids():
            src = source.suite(sid)
            dst = self.suite(sid, src.meta)
            if not (dst.root / "inputs.npz").exists() and (src.root / "inputs.npz").exists():
                _copy_files(src.root, dst.root, ["inputs.npz", "inputs.npz.sha256"])
            for name in src.configs():
                together = [TOGETHER] if (src.run_dir(name, TOGETHER) / "manifest.json").exists() else []
                for r in src.repeats(name) + together + src.axis_slots(name):
                    what = f"{sid}: {name} {slot_label(r)}"
                    if not src.check_run(name, r):  # a damaged source run is said, not skipped
                        continue
                    if not dst.is_complete(name, r):
                        _copy_dir(src.run_dir(name, r), dst.run_dir(name, r))
                        said.append(f"{what} copied")
                    elif (differ := _outputs_differ(dst.load_run(name, r), src.load_run(name, r))):
                        said.append(f"{what}: both stores hold it and {differ} differ; this "
                                    f"store's is kept (a run-to-run difference: see `speccheck diff`)")
                same_r0 = (dst.is_complete(name, 0) and src.is_complete(name, 0)
                           and dst._manifest(name, 0) == src._manifest(name, 0))
                pieces = [(src.rescore_path(name, 0), dst.rescore_path(name, 0), "rescoring"),
                          (src.replay_path(name, 0), dst.replay_path(name, 0), "acceptance replay"),
                          (src.root / "attribution" / f"{name}.json",
                           dst.root / "attribution" / f"{name}.json", "attribution")]
                for a, b, kind in pieces:
                    if same_r0 and a.exists() and not b.exists():
                        _copy_files(a.parent, b.parent, [a.name, _sidecar(a).name])
                        said.append(f"{sid}: {name} {kind} copied")
            plan = src.load_plan()
            if plan:
                dst.extend_plan(plan["configs"], (dst.load_plan() or plan).get("run_args", []))
        latest = self.latest_id()
        if (latest is None or latest not in self.suite_ids()) and source.suite_ids():
            # the source's last run is what a `gate` after the merge judges, not the first suite by name
            theirs = source.latest_id()
            self.set_latest(theirs if theirs in source.suite_ids() else source.suite_ids()[-1])
            latest = self.latest_id()
        others = [sid for sid in source.suite_ids() if sid != latest]
        if not said:
            said.append(f"nothing to copy: {self.root} already holds everything {source.root} holds")
        if others:
            said.append(f"`speccheck gate` judges suite {latest} (the store's LATEST); the other suites "
                        f"merged are judged with --suite: " + "; ".join(f"`speccheck gate --suite {sid}`"
                                                                      for sid in others))
        return said

    def latest(self) -> Suite:
        """The suite of the last `speccheck run` into this store."""
        path = self.root / "LATEST"
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"--store {self.root}: is not a directory; point --store at the directory a "
                             "run wrote.")
        sid = self.latest_id()
        if sid is None:
            raise StoreError(
                f"store {self.root} holds no runs (option --store). Run `speccheck run` first, or "
                "point --store at the directory a run wrote.")
        if not sid or "/" in sid or sid.startswith("."):
            raise StoreError(f"{path}: does not name a suite; name one with --suite "
                             f"(suites there: {', '.join(self.suite_ids()) or 'none'}).")
        return self.suite(sid)
