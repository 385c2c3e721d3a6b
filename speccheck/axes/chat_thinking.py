"""chat_thinking: corpus prompts rendered through the engine's chat template, thinking off and on."""
from __future__ import annotations

from speccheck.axes._registry import SERVING_MAX_TOKENS, AxisInput, AxisSpec
from speccheck.types import Prompt, Workload

#: the corpus prompts it sends (those of at most SERVING_PROMPT_TOKENS tokens, chat or text)
PROMPTS = 6


def messages_of(p: Prompt) -> tuple[dict, ...]:
    """A chat prompt's messages; a text prompt as one user message."""
    return tuple(p.messages) if p.messages else ({"role": "user", "content": p.text or ""},)


def build(inp: AxisInput) -> Workload:
    """The first corpus prompts as conversations, rendered by the engine through its own chat
    template with enable_thinking off or on (the level; the engine reads the proof back from
    the ids it rendered), all in flight together. Each spec request is judged against the
    baseline's run of the same rendered request."""
    reqs = []
    for p in inp.serving_prompts(PROMPTS):
        chat = Prompt(p.id, p.category, min(p.max_tokens, SERVING_MAX_TOKENS), None, messages_of(p),
                      p.ignore_eos)
        # the ids are the corpus's tokenisation; the engine renders the messages itself
        reqs.append(inp.request(f"chat/{inp.level}:{p.id}", chat, inp.inputs[p.id]))
    return Workload("chat_thinking", inp.level, reqs, max_in_flight=len(reqs),
                    knobs={"chat_template": "on", "thinking": inp.level})


AXIS = AxisSpec(
    name="chat_thinking", order=70, levels=("off", "on"), build=build, against_baseline=True,
    proofs={"off": ("chat_rendered",), "on": ("chat_rendered", "thinking_prompts")},
    guards="spec output that diverges with the chat template's thinking mode on where it did not "
           "with it off (DFlash2: vLLM #54928, SGLang #38009)",
    description="Corpus prompts rendered through the engine's chat template, thinking off and "
                "on: each spec request gives the baseline's tokens on the same rendering, and "
                "every request was rendered (in thinking mode where asked).")
