"""The reference model's chat template (Jinja, as a tokenizer_config.json's ``chat_template``)
and its optional thinking mode.

With thinking off the template renders exactly :meth:`Prompt.as_text` (``<|role|>\\n`` content
``\\n`` per message, then ``<|assistant|>\\n``), so the token ids of every chat prompt recorded
before it existed are unchanged. With ``enable_thinking`` the assistant turn opens a
``<think>`` block the model reasons in before it answers (Qwen3's template); the reasoning of
earlier assistant turns (up to their ``</think>``) is dropped from the history, as Qwen3's does.
"""
from __future__ import annotations

import hashlib
from functools import lru_cache

CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- set content = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{ '<|' + m['role'] + '|>\\n' + content + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|assistant|>\\n' }}"
    "{%- if enable_thinking -%}{{ '<think>\\n' }}{%- endif -%}"
    "{%- endif -%}"
)

TEMPLATE_SHA256 = hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()


@lru_cache(maxsize=1)
def _compiled():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(keep_trailing_newline=True).from_string(CHAT_TEMPLATE)


def render(messages, enable_thinking: bool = False, add_generation_prompt: bool = True) -> str:
    """The conversation as the text the tokenizer encodes."""
    return _compiled().render(messages=[dict(m) for m in messages],
                              enable_thinking=enable_thinking,
                              add_generation_prompt=add_generation_prompt)


def identity(enable_thinking: bool) -> dict:
    """What a run's identity records of the template it rendered chat prompts with."""
    return {"sha256": TEMPLATE_SHA256, "enable_thinking": enable_thinking}
