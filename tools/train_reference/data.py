"""Training text for the reference model and its tokenizer: text every Python install has.

The reference weights must be reproducible on any machine with Python and no network, so the
training text is the running interpreter's own standard library sources (minus tests and
third-party site-packages) plus the prompts of speccheck's built-in corpora, so that every
corpus category, Japanese included, is seen. The stdlib differs between Python versions, so
re-training on another version gives similar, not bit-identical, weights.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

#: directories under the stdlib that are not "the standard library's own sources"
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                       "__pycache__"})
MAX_FILE_BYTES = 1_000_000  # skip generated giants
MAX_TOTAL_BYTES = 30_000_000


def stdlib_texts(max_total_bytes: int = MAX_TOTAL_BYTES) -> list[str]:
    """UTF-8 ``.py`` sources of the standard library, in sorted path order, capped in total size."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for f in filenames:
            if f.endswith(".py"):
                paths.append(Path(dirpath) / f)
    texts, total = [], 0
    for p in sorted(paths, key=lambda p: p.relative_to(root).as_posix()):
        size = p.stat().st_size
        if size == 0 or size > MAX_FILE_BYTES:
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few stdlib files are latin-1; not worth special-casing
        if total + len(text.encode()) > max_total_bytes:
            break
        texts.append(text)
        total += len(text.encode())
    return texts


def corpus_texts() -> list[str]:
    """Every prompt of every built-in corpus as the plain text the engine is fed, deduplicated."""
    from speccheck.corpus import list_corpora, load_corpus

    seen, out = set(), []
    for name in list_corpora():
        for p in load_corpus(name).prompts:
            t = p.as_text()
            if t not in seen:
                seen.add(t)
                out.append(t)
    return out


def training_texts(max_total_bytes: int = MAX_TOTAL_BYTES) -> list[str]:
    """The full training text: stdlib sources, then the built-in corpora's prompts."""
    return stdlib_texts(max_total_bytes) + corpus_texts()


def held_out_split(texts: list[str], frac: float = 0.02) -> tuple[list[str], list[str]]:
    """(train, held_out): a text is held out iff its sha256 falls in the lowest ``frac``.

    Decided per text by content, so the split does not depend on order or on which other texts
    are present, and is the same on every machine.
    """
    if not 0.0 <= frac < 1.0:
        raise ValueError(f"held-out fraction must be in [0, 1), got {frac}")
    train, held = [], []
    for t in texts:
        h = int.from_bytes(hashlib.sha256(t.encode("utf-8")).digest()[:8], "big") / 2.0**64
        (held if h < frac else train).append(t)
    return train, held
