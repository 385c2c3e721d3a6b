"""The reference engine's chat template (reference/chat.py): chat prompts render through it,
with the ids they had before it existed, and its thinking mode opens a <think> block."""
from __future__ import annotations

from speccheck.corpus import load_corpus
from speccheck.reference.chat import render
from speccheck.reference.engine import ReferenceEngine


def test_chat_template_keeps_the_ids_and_adds_thinking():
    """Chat prompts render through the template; with thinking off it is Prompt.as_text
    (ids of every recorded prompt unchanged), with thinking on the assistant turn opens a
    <think> block. The identity always names the template and its mode."""
    eng = ReferenceEngine(engine_args={"threads": "1"})
    corpus = load_corpus("smoke")
    text = next(p for p in corpus.prompts if p.text)
    chat = next(p for p in corpus.prompts if p.messages)
    eng.tokenize(text)
    assert eng.identity()["chat_template"]["enable_thinking"] is False  # before any chat prompt too
    ids = eng.tokenize(chat)
    assert ids == eng.tokenizer.encode(chat.as_text()).ids
    assert eng.identity()["chat_template"]["enable_thinking"] is False
    think = eng.with_args(thinking="on")
    tids = think.tokenize(chat)
    assert eng.detokenize(tids).endswith("<|assistant|>\n<think>\n") and tids[:len(ids)] == ids
    assert think.identity()["chat_template"]["enable_thinking"] is True
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>x</think>\nb"}]
    assert render(history, True, add_generation_prompt=False) == "<|user|>\na\n<|assistant|>\nb\n"


def test_every_recorded_chat_prompt_renders_as_before():
    """With thinking off the template is Prompt.as_text for every chat prompt of the corpora."""
    for name in ("smoke", "ci", "default"):
        for p in load_corpus(name).prompts:
            if p.messages:
                assert render(p.messages) == p.as_text(), (name, p.id)
