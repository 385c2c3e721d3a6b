"""Corpus loading: built-ins load, bad files fail with file + line, the hash tracks content."""
from __future__ import annotations

import hashlib
import json
import re

import pytest

from speccheck.corpus import CorpusError, corpus_hash, list_corpora, load_corpus

from tests.training_code import train_reference

CATEGORIES = {"ocr_ja", "code", "chat", "math", "summarization", "translation", "near_tie"}
GOOD = {"id": "a", "category": "chat", "max_tokens": 8, "text": "hello"}


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records), encoding="utf-8")
    return path


@pytest.mark.parametrize("name", list_corpora())
def test_builtin_corpus_loads(name):
    c = load_corpus(name)
    assert c.name == name and c.prompts
    assert re.fullmatch(r"[0-9a-f]{64}", c.hash)
    assert len({p.id for p in c.prompts}) == len(c.prompts)
    assert all(p.as_text().strip() for p in c.prompts)


def test_required_builtins_exist():
    assert {"default", "smoke"} <= set(list_corpora())


def test_default_covers_all_categories_with_short_outputs():
    c = load_corpus("default")
    assert set(c.categories()) == CATEGORIES
    assert 20 <= len(c.prompts) <= 32
    assert sum(p.max_tokens for p in c.prompts) / len(c.prompts) <= 96
    assert c.categories()["code"] >= 6 and c.categories()["ocr_ja"] >= 2


def test_ocr_prompts_are_long_japanese_documents():
    """The seed workload: ~2k Qwen tokens, i.e. roughly 2500-3500 characters, mostly Japanese."""
    for p in load_corpus("default").prompts:
        if p.category == "ocr_ja":
            text = p.as_text()
            japanese = re.findall(r"[\u3040-\u30ff\u4e00-\u9fff]", text)
            assert 2500 <= len(text) <= 4000, (p.id, len(text))
            assert len(japanese) >= 900, (p.id, len(japanese))
            assert p.max_tokens <= 96


def test_smoke_is_small_and_fast():
    c = load_corpus("smoke")
    assert 3 <= len(c.prompts) <= 4
    assert all(16 <= p.max_tokens <= 24 for p in c.prompts)


def test_chat_prompt_becomes_template_text(tmp_path):
    rec = {"id": "c", "category": "chat", "max_tokens": 4,
           "messages": [{"role": "user", "content": "hi"}]}
    c = load_corpus(write_jsonl(tmp_path / "c.jsonl", [rec]))
    assert c.prompts[0].messages == ({"role": "user", "content": "hi"},)
    assert c.prompts[0].as_text() == "<|user|>\nhi\n<|assistant|>\n"


@pytest.mark.parametrize("bad_line, message", [
    ('{"id": "b", "category": "chat", "max_tokens": 8, "text": "x"', "malformed JSON"),
    ({"id": "b", "category": "chat", "text": "x"}, "missing field 'max_tokens'"),
    ({"category": "chat", "max_tokens": 8, "text": "x"}, "missing field 'id'"),
    ({"id": "b", "category": "chat", "max_tokens": 8, "text": "   "}, "is empty"),
    ({"id": "b", "category": "chat", "max_tokens": 8, "messages": []}, "is empty"),
    ({"id": "a", "category": "chat", "max_tokens": 8, "text": "x"}, "duplicate prompt id 'a'"),
    ({"id": "b", "category": "chat", "max_tokens": 0, "text": "x"}, "bad max_tokens"),
    ({"id": "b", "category": "chat", "max_tokens": 32769, "text": "x"}, "bad max_tokens"),
    ({"id": "b", "category": "chat", "max_tokens": "8", "text": "x"}, "bad max_tokens"),
    ({"id": "b", "category": "chat", "max_tokens": 8.5, "text": "x"}, "bad max_tokens"),
    ({"id": "b", "category": "chat", "max_tokens": True, "text": "x"}, "bad max_tokens"),
    ({"id": "b", "category": "chat", "max_tokens": 8, "text": "x", "temp": 0}, "unknown field"),
    ({"id": "b", "category": "chat", "max_tokens": 8}, "exactly one of 'text' or 'messages'"),
    ({"id": "b", "category": "chat", "max_tokens": 8, "text": "x",
      "messages": [{"role": "user", "content": "y"}]}, "exactly one of 'text' or 'messages'"),
    ({"id": "b", "category": "chat", "max_tokens": 8,
      "messages": [{"role": "robot", "content": "y"}]}, "message 0"),
    ('[1, 2]', "expected a JSON object"),
    ({"id": "b", "category": "chat", "max_tokens": 8, "text": "x", "ignore_eos": "yes"},
     "'ignore_eos' must be true or false"),
    ({"id": "b", "category": "chat", "max_tokens": 8, "text": "x", "ignore_eos": 1},
     "'ignore_eos' must be true or false"),
])
def test_bad_prompt_names_file_and_line(tmp_path, bad_line, message):
    # the bad record sits on line 3, after a good prompt and a blank line
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, "", bad_line])
    with pytest.raises(CorpusError) as e:
        load_corpus(str(path))
    assert f"{path}:3:" in str(e.value)
    assert message in str(e.value)


def test_duplicate_id_names_both_lines(tmp_path):
    path = write_jsonl(tmp_path / "dup.jsonl", [GOOD, {**GOOD, "text": "other"}])
    with pytest.raises(CorpusError, match=r"dup\.jsonl:2: duplicate prompt id 'a' .*line 1"):
        load_corpus(path)


def test_empty_file_is_an_error(tmp_path):
    with pytest.raises(CorpusError, match="no prompts"):
        load_corpus(write_jsonl(tmp_path / "empty.jsonl", [""]))


def test_unknown_name_lists_available():
    with pytest.raises(CorpusError) as e:
        load_corpus("no-such-corpus")
    for name in list_corpora():
        assert name in str(e.value)


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        load_corpus(str(tmp_path / "missing.jsonl"))


def test_corpus_error_is_a_value_error():
    assert issubclass(CorpusError, ValueError)


def test_hash_is_stable_and_ignores_formatting(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [GOOD, {**GOOD, "id": "b"}])
    # same prompts, other key order, spacing and blank lines, other file name
    b = tmp_path / "b.jsonl"
    b.write_text('\n{"text":"hello", "max_tokens":8,"id":"a","category":"chat"}\n\n'
                 '{ "category" : "chat", "id" : "b", "text" : "hello", "max_tokens" : 8 }\n')
    assert load_corpus(a).hash == load_corpus(a).hash == load_corpus(b).hash


@pytest.mark.parametrize("change", [
    {"text": "hello!"}, {"max_tokens": 9}, {"category": "code"}, {"id": "z"}, {"ignore_eos": True},
])
def test_hash_changes_when_a_prompt_changes(tmp_path, change):
    before = load_corpus(write_jsonl(tmp_path / "x.jsonl", [GOOD, {**GOOD, "id": "b"}]))
    after = load_corpus(write_jsonl(tmp_path / "y.jsonl", [GOOD, {**GOOD, "id": "b", **change}]))
    assert before.hash != after.hash


def test_hash_changes_when_prompts_are_reordered(tmp_path):
    one, two = GOOD, {**GOOD, "id": "b", "text": "bye"}
    assert (load_corpus(write_jsonl(tmp_path / "x.jsonl", [one, two])).hash
            != load_corpus(write_jsonl(tmp_path / "y.jsonl", [two, one])).hash)


def test_toml_corpus_matches_jsonl(tmp_path):
    toml = tmp_path / "t.toml"
    toml.write_text('''# a comment
[[prompt]]
id = "a"
category = "chat"
max_tokens = 8
text = "hello"

[[prompt]]
id = "c"
category = "chat"
max_tokens = 4
messages = [{ role = "user", content = "hi" }]
''')
    jsonl = write_jsonl(tmp_path / "t.jsonl", [
        GOOD, {"id": "c", "category": "chat", "max_tokens": 4,
               "messages": [{"role": "user", "content": "hi"}]}])
    t, j = load_corpus(toml), load_corpus(jsonl)
    assert t.prompts == j.prompts and t.hash == j.hash


def test_toml_error_names_the_prompt_table_line(tmp_path):
    toml = tmp_path / "t.toml"
    toml.write_text('[[prompt]]\nid = "a"\ncategory = "chat"\nmax_tokens = 8\ntext = "x"\n\n'
                    '[[prompt]]\nid = "b"\ncategory = "chat"\nmax_tokens = -1\ntext = "y"\n')
    with pytest.raises(CorpusError, match=r"t\.toml:7: .*bad max_tokens"):
        load_corpus(toml)


def test_ignore_eos_is_read_and_false_keeps_the_hash(tmp_path):
    """ignore_eos enters the hash only where it is true: corpora that do not use it (or say
    false) keep the hash they had before the field existed (pinned here by its value)."""
    plain = load_corpus(write_jsonl(tmp_path / "x.jsonl", [GOOD]))
    false = load_corpus(write_jsonl(tmp_path / "y.jsonl", [{**GOOD, "ignore_eos": False}]))
    true = load_corpus(write_jsonl(tmp_path / "z.jsonl", [{**GOOD, "ignore_eos": True}]))
    assert plain.hash == false.hash == hashlib.sha256(json.dumps(
        [GOOD], sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()
    assert true.hash != plain.hash
    assert [p.ignore_eos for p in (plain.prompts[0], false.prompts[0], true.prompts[0])] == [
        False, False, True]
    toml = tmp_path / "t.toml"
    toml.write_text('[[prompt]]\nid = "a"\ncategory = "chat"\nmax_tokens = 8\ntext = "hello"\n'
                    'ignore_eos = true\n')
    assert load_corpus(toml).hash == true.hash


def test_hash_matches_helper():
    c = load_corpus("smoke")
    assert corpus_hash(c.prompts) == c.hash


# --- the reference engine's training text and tokenizer, which are built from the corpora ---

def test_held_out_split_is_deterministic_and_order_free():
    held_out_split = train_reference("data").held_out_split

    texts = [f"text number {i}" for i in range(400)]
    train, held = held_out_split(texts, 0.1)
    assert sorted(train + held) == sorted(texts) and not set(train) & set(held)
    assert 10 <= len(held) <= 80  # ~40 expected
    train2, held2 = held_out_split(list(reversed(texts)), 0.1)
    assert set(held2) == set(held) and set(train2) == set(train)
    with pytest.raises(ValueError):
        held_out_split(texts, 1.0)


def test_training_text_contains_every_corpus_prompt():
    data = train_reference("data")
    corpus_texts, stdlib_texts = data.corpus_texts, data.stdlib_texts

    prompts = corpus_texts()
    for name in list_corpora():
        for p in load_corpus(name).prompts:
            assert p.as_text() in prompts
    small = stdlib_texts(max_total_bytes=200_000)
    assert small and sum(len(t.encode()) for t in small) <= 200_000


def test_tokenizer_special_ids_and_round_trip():
    from pathlib import Path

    from tokenizers import Tokenizer

    import speccheck.reference as ref

    tok = Tokenizer.from_file(str(Path(ref.__file__).parent / "weights" / "tokenizer.json"))
    assert tok.get_vocab_size() == 4096
    assert tok.token_to_id("<|endoftext|>") == 0 and tok.token_to_id("<|mask|>") == 1
    for p in load_corpus("default").prompts:
        text = p.as_text()
        ids = tok.encode(text).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
        if p.category == "ocr_ja":  # Japanese got merges, not 3 bytes per character
            assert len(ids) < 0.6 * len(text.encode("utf-8"))


# --- Spec-Bench's question.jsonl, read directly ---------------------------------------------

def _spec_bench_file(tmp_path, lines):
    """A tiny synthetic file in Spec-Bench's question.jsonl format (written here: the real
    third-party prompts are read at run time, never committed)."""
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_spec_bench_questions_become_chat_prompts(tmp_path):
    path = _spec_bench_file(tmp_path, [
        {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Shorter."]},
        {"question_id": "qa_7", "category": "qa", "turns": ["Who wrote Emma?"],
         "reference": ["Austen"]},
    ])
    c = load_corpus(str(path))
    assert [p.id for p in c.prompts] == ["81", "qa_7"]
    assert c.categories() == {"writing": 1, "qa": 1}
    assert c.prompts[0].messages == ({"role": "user", "content": "Write a haiku."},)
    assert all(p.max_tokens == 128 for p in c.prompts)
    longer = load_corpus(str(path), max_tokens=256)
    assert all(p.max_tokens == 256 for p in longer.prompts) and longer.hash != c.hash


@pytest.mark.parametrize("bad, msg", [
    ({"question_id": 2, "category": "qa"}, "missing field"),
    ({"question_id": 2, "category": "qa", "turns": []}, "turns"),
    ({"question_id": 2, "category": "", "turns": ["x"]}, "category"),
    ({"question_id": 1, "category": "qa", "turns": ["again"]}, "duplicate"),
])
def test_spec_bench_bad_lines_name_file_and_line(tmp_path, bad, msg):
    path = _spec_bench_file(tmp_path, [{"question_id": 1, "category": "qa", "turns": ["x"]}, bad])
    with pytest.raises(CorpusError, match=msg) as e:
        load_corpus(str(path))
    assert f"{path}:2" in str(e.value)


def test_default_corpus_decodes_its_full_budget_in_the_reference_golden():
    """Every default prompt yields max_tokens compared tokens on the reference engine: the
    committed golden baseline (recorded from this very corpus: same hash) shows no prompt
    stopping early, the long OCR prompts included."""
    from pathlib import Path

    from speccheck.store import read_run

    corpus = load_corpus("default")
    gold = Path(__file__).parents[1] / "golden" / "reference" / "speccheck-reference-qwen3_5-tiny" / "default"
    assert json.loads((gold / "golden.json").read_text())["fingerprint"]["corpus_hash"] == corpus.hash
    base = read_run(gold / "baseline").by_prompt()
    assert set(base) == {p.id for p in corpus.prompts}
    short = {p.id: base[p.id].n_tokens for p in corpus.prompts if base[p.id].n_tokens != p.max_tokens}
    assert not short, f"prompts stopping before max_tokens: {short}"
