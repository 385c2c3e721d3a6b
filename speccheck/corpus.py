"""Prompt corpora: load, validate and identify them by content.

A corpus is a plain-text file of prompts: JSONL (one JSON object per line) or TOML
(``[[prompt]]`` tables). Built-in corpora live in the repo's ``corpora/`` directory, which is
installed as the package ``speccheck.corpora``, so they resolve wherever speccheck is installed.

Each prompt has ``id``, ``category``, ``max_tokens`` and exactly one of ``text`` (a string) or
``messages`` (a list of ``{"role", "content"}``), and optionally ``ignore_eos`` (true: decode
the full ``max_tokens`` past end-of-sequence). Anything else is an error, reported with the
file and line so that the user can fix it.

The corpus hash is the sha256 of a canonical JSON rendering of the validated prompts in file
order (sorted keys, no insignificant whitespace, UTF-8). It therefore changes when any prompt's
id, category, max_tokens, text, messages or ignore_eos change, or when prompts are reordered
(``ignore_eos`` enters only where it is true, so corpora without it keep their hash), and does
*not* change with the file's formatting (key order, spacing, blank lines, comments, JSONL vs
TOML) or its name or location: a stored run is tied to what was asked, not to how the file
was written.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from speccheck.types import Prompt

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

MAX_TOKENS_LIMIT = 32768
#: max_tokens of prompts from a format that carries none (Spec-Bench's question.jsonl)
DEFAULT_MAX_TOKENS = 128
#: Spec-Bench's data/spec_bench/question.jsonl (and MT-bench's): these fields, first turn used
SPEC_BENCH_FIELDS = {"question_id", "category", "turns"}
SUFFIXES = (".jsonl", ".toml")
_FIELDS = {"id", "category", "max_tokens", "text", "messages", "ignore_eos"}
_ROLES = {"system", "user", "assistant"}
_PACKAGE = "speccheck.corpora"


class CorpusError(ValueError):
    """A corpus file could not be used; the message names file, line and the fix."""


@dataclass(frozen=True)
class Corpus:
    name: str
    path: str
    hash: str  # sha256 hex of the canonical content (see module docstring)
    prompts: list[Prompt]

    def categories(self) -> dict[str, int]:
        """Prompt count per category, in first-seen order."""
        counts: dict[str, int] = {}
        for p in self.prompts:
            counts[p.category] = counts.get(p.category, 0) + 1
        return counts

    def get(self, prompt_id: str) -> Prompt:
        for p in self.prompts:
            if p.id == prompt_id:
                return p
        raise KeyError(prompt_id)


def _builtin_dir():
    """The installed ``speccheck.corpora`` package, or the repo's ``corpora/`` when running
    from a source checkout that is not installed."""
    try:
        return resources.files(_PACKAGE)
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / "corpora"


def list_corpora() -> list[str]:
    """Names of the built-in corpora, sorted."""
    names = set()
    for entry in _builtin_dir().iterdir():
        stem, dot, suffix = entry.name.rpartition(".")
        if dot and "." + suffix in SUFFIXES and entry.is_file():
            names.add(stem)
    return sorted(names)


def load_corpus(name_or_path: str | os.PathLike, max_tokens: int | None = None) -> Corpus:
    """A built-in corpus by name (``default``, ``smoke``, ...) or a user's corpus file by path.

    Anything containing a path separator, ending in ``.jsonl``/``.toml``, or naming an existing
    file is treated as a path; otherwise it must be a built-in name. A JSONL file whose first
    record has Spec-Bench's fields (question_id, category, turns) is read as Spec-Bench's
    question.jsonl: read where it lies at run time (third-party prompts are never copied into
    the repo), each question's first turn as one user message, ``max_tokens`` (default
    DEFAULT_MAX_TOKENS) for every prompt, since the format carries none.
    """
    spec = os.fspath(name_or_path)
    looks_like_path = (os.sep in spec or "/" in spec or spec.endswith(SUFFIXES)
                       or os.path.isfile(spec))
    if looks_like_path:
        path = Path(spec)
        if path.is_dir():
            raise CorpusError(f"corpus path {spec} is a directory; give the path of a .jsonl or "
                              f".toml file inside it, or one of the built-in corpora: "
                              f"{', '.join(list_corpora())}.")
        if path.exists() and not path.is_file():  # a FIFO or device: reading it could block
            raise CorpusError(f"corpus path {spec} is not a regular file; give the path of a .jsonl "
                              "or .toml file.")
        if not path.is_file():
            raise CorpusError(f"corpus file {spec} does not exist; give the path of a .jsonl or "
                              f".toml file, or one of the built-in corpora: "
                              f"{', '.join(list_corpora())}.")
        try:
            data = path.read_bytes()
        except OSError as e:
            raise CorpusError(f"corpus file {spec}: cannot read it ({e.strerror or e}); check its "
                              "permissions.") from None
        return _load_file(path.stem, str(path), data, max_tokens)
    for suffix in SUFFIXES:
        entry = _builtin_dir().joinpath(spec + suffix)
        if entry.is_file():
            return _load_file(spec, str(entry), entry.read_bytes())
    raise CorpusError(f"unknown corpus {spec!r}; the built-in corpora are: "
                      f"{', '.join(list_corpora())}. To use your own, pass the path of a .jsonl "
                      f"or .toml file.")


def corpus_hash(prompts: list[Prompt]) -> str:
    """sha256 of the canonical JSON of the prompts (formatting-independent, order-dependent)."""
    canon = [_prompt_dict(p) for p in prompts]
    blob = json.dumps(canon, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _prompt_dict(p: Prompt) -> dict:
    d: dict = {"id": p.id, "category": p.category, "max_tokens": p.max_tokens}
    if p.text is not None:
        d["text"] = p.text
    else:
        d["messages"] = [dict(m) for m in p.messages or ()]
    if p.ignore_eos:  # only when set: corpora without it keep their hash
        d["ignore_eos"] = True
    return d


def prompt_dict(p: Prompt) -> dict:
    """A prompt as one record of a JSONL corpus file (what :func:`load_corpus` reads back)."""
    return _prompt_dict(p)


def _load_file(name: str, path: str, data: bytes, max_tokens: int | None = None) -> Corpus:
    try:
        content = data.decode("utf-8-sig")  # a byte-order mark (Windows editors) is not content
    except UnicodeDecodeError as e:
        raise CorpusError(f"{path}: not UTF-8 text ({e}); save the corpus as UTF-8.") from None
    if path.endswith(".toml"):
        records = _read_toml(path, content)
    else:
        records = _read_jsonl(path, content)
    spec_bench = bool(records) and SPEC_BENCH_FIELDS <= set(records[0][1])
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    for line, rec in records:
        p = (_spec_bench_prompt(path, line, rec, max_tokens or DEFAULT_MAX_TOKENS) if spec_bench
             else _to_prompt(path, line, rec))
        if p.id in seen:
            raise CorpusError(f"{path}:{line}: duplicate prompt id {p.id!r} (first used on line "
                              f"{seen[p.id]}); give every prompt a unique id.")
        seen[p.id] = line
        prompts.append(p)
    if not prompts:
        raise CorpusError(f"{path}: the corpus has no prompts; add at least one prompt "
                          f"(one JSON object per line, or a [[prompt]] table in TOML).")
    return Corpus(name=name, path=path, hash=corpus_hash(prompts), prompts=prompts)


def _read_jsonl(path: str, content: str) -> list[tuple[int, dict]]:
    out = []
    for lineno, raw in enumerate(content.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError as e:
            raise CorpusError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno}); "
                              f"each line must be one complete JSON object.") from None
        except RecursionError:
            raise CorpusError(f"{path}:{lineno}: JSON nested too deeply to read; a prompt is one flat "
                              "object (id, category, max_tokens, text or messages).") from None
        _check_unicode(f"{path}:{lineno}", rec)
        if not isinstance(rec, dict):
            raise CorpusError(f"{path}:{lineno}: expected a JSON object with id, category, "
                              f"max_tokens and text or messages, got {type(rec).__name__}.")
        out.append((lineno, rec))
    return out


def _check_unicode(where: str, rec: object) -> None:
    """Text that can be written back out: JSON's ``\\ud800`` escapes decode to lone surrogates,
    which no UTF-8 file, tokenizer or store can hold."""
    try:
        json.dumps(rec, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        bad = e.object[e.start:e.end] if isinstance(e.object, str) else "?"
        raise CorpusError(f"{where}: holds {bad!r}, a lone UTF-16 surrogate (a \\ud800-style escape "
                          "without its pair), which is not text; fix the escape or the character.") from None


#: the longest prompt id (ids name prompts in reports, JUnit and request ids)
MAX_ID_LEN = 200


def _read_toml(path: str, content: str) -> list[tuple[int, dict]]:
    try:
        doc = tomllib.loads(content)
    except tomllib.TOMLDecodeError as e:
        raise CorpusError(f"{path}: malformed TOML ({e}); fix the syntax.") from None
    except RecursionError:
        raise CorpusError(f"{path}: TOML nested too deeply to read; a corpus holds flat [[prompt]] "
                          "tables.") from None
    extra = set(doc) - {"prompt"}
    if extra:
        raise CorpusError(f"{path}: unknown top-level key(s) {sorted(extra)}; a TOML corpus holds "
                          f"only [[prompt]] tables.")
    tables = doc.get("prompt", [])
    if not isinstance(tables, list):
        raise CorpusError(f"{path}: 'prompt' must be an array of tables; write each prompt as a "
                          f"[[prompt]] table.")
    # tomllib gives no line numbers: find where each [[prompt]] header starts.
    starts = [i for i, raw in enumerate(content.splitlines(), 1)
              if raw.strip().replace(" ", "").startswith("[[prompt]]")]
    return [(starts[i] if i < len(starts) else 0, t) for i, t in enumerate(tables)]


def _check_id(where: str, pid: str) -> None:
    """A prompt id is a name: printable, one line, at most MAX_ID_LEN characters."""
    if len(pid) > MAX_ID_LEN or any(ch.isspace() and ch != " " or not ch.isprintable() for ch in pid):
        shown = pid[:40] + ("..." if len(pid) > 40 else "")
        raise CorpusError(f"{where}: prompt id {shown!r} must be printable text on one line of at most "
                          f"{MAX_ID_LEN} characters (no newlines, tabs or control characters): ids name "
                          "prompts in reports, JUnit and requests.")


def _to_prompt(path: str, line: int, rec: dict) -> Prompt:
    where = f"{path}:{line}"
    unknown = set(rec) - _FIELDS
    if unknown:
        raise CorpusError(f"{where}: unknown field(s) {sorted(unknown)}; a prompt has only "
                          f"id, category, max_tokens, text or messages, and optionally ignore_eos.")
    for key in ("id", "category", "max_tokens"):
        if key not in rec:
            raise CorpusError(f"{where}: missing field {key!r}; every prompt needs id, category, "
                              f"max_tokens and text or messages.")
    pid, category, max_tokens = rec["id"], rec["category"], rec["max_tokens"]
    if not isinstance(pid, str) or not pid.strip():
        raise CorpusError(f"{where}: 'id' must be a non-empty string, got {pid!r}.")
    _check_id(where, pid)
    if not isinstance(category, str) or not category.strip():
        raise CorpusError(f"{where}: prompt {pid!r}: 'category' must be a non-empty string, "
                          f"got {category!r}.")
    if (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
            or not 1 <= max_tokens <= MAX_TOKENS_LIMIT):
        raise CorpusError(f"{where}: prompt {pid!r}: bad max_tokens {max_tokens!r}; use a whole "
                          f"number from 1 to {MAX_TOKENS_LIMIT}.")
    ignore_eos = rec.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise CorpusError(f"{where}: prompt {pid!r}: 'ignore_eos' must be true or false, got "
                          f"{ignore_eos!r}.")
    has_text, has_messages = "text" in rec, "messages" in rec
    if has_text == has_messages:
        raise CorpusError(f"{where}: prompt {pid!r}: give exactly one of 'text' or 'messages' "
                          f"({'both' if has_text else 'neither'} given).")
    if has_text:
        text = rec["text"]
        if not isinstance(text, str) or not text.strip():
            raise CorpusError(f"{where}: prompt {pid!r} is empty; give it a non-empty 'text'.")
        return Prompt(pid, category, max_tokens, text=text, ignore_eos=ignore_eos)
    messages = rec["messages"]
    if not isinstance(messages, list) or not messages:
        raise CorpusError(f"{where}: prompt {pid!r} is empty; 'messages' must be a non-empty "
                          f"list of {{\"role\", \"content\"}} objects.")
    out = []
    for i, m in enumerate(messages):
        if (not isinstance(m, dict) or set(m) != {"role", "content"}
                or m["role"] not in _ROLES or not isinstance(m["content"], str)):
            raise CorpusError(f"{where}: prompt {pid!r}, message {i}: each message must be "
                              f"{{\"role\": one of {sorted(_ROLES)}, \"content\": a string}}; "
                              f"got {m!r}.")
        if not m["content"].strip():
            raise CorpusError(f"{where}: prompt {pid!r}, message {i} is empty; give it content.")
        out.append({"role": m["role"], "content": m["content"]})
    return Prompt(pid, category, max_tokens, messages=tuple(out), ignore_eos=ignore_eos)


def _spec_bench_prompt(path: str, line: int, rec: dict, max_tokens: int) -> Prompt:
    """One line of Spec-Bench's question.jsonl -> a chat prompt of its first turn."""
    where = f"{path}:{line}"
    missing = SPEC_BENCH_FIELDS - set(rec)
    if missing:
        raise CorpusError(f"{where}: missing field(s) {sorted(missing)}; the file's first line "
                          f"is in Spec-Bench's format, so every line needs question_id, "
                          f"category and turns.")
    qid, category, turns = rec["question_id"], rec["category"], rec["turns"]
    if isinstance(qid, bool) or not isinstance(qid, (int, str)) or not str(qid).strip():
        raise CorpusError(f"{where}: 'question_id' must be a number or a non-empty string, "
                          f"got {qid!r}.")
    _check_id(where, str(qid))
    if not isinstance(category, str) or not category.strip():
        raise CorpusError(f"{where}: question {qid!r}: 'category' must be a non-empty string, "
                          f"got {category!r}.")
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) \
            or not turns[0].strip():
        raise CorpusError(f"{where}: question {qid!r}: 'turns' must be a list whose first "
                          f"entry is the (non-empty) question text.")
    if not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
        raise CorpusError(f"max_tokens {max_tokens} for {path}: use a whole number from 1 to "
                          f"{MAX_TOKENS_LIMIT} (option --max-tokens).")
    return Prompt(str(qid), category, max_tokens,
                  messages=({"role": "user", "content": turns[0]},))
