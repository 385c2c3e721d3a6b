"""axis_chat_thinking: prompts rendered by the chat template, thinking off and on, give the
baseline's tokens; a request whose rendering did not happen is not exercised."""
from __future__ import annotations

from speccheck.axes import get as get_axis
from speccheck.checks import CheckSpec, Context
from speccheck.checks._axes import judge_axis, measure_axis

AXIS = get_axis("chat_thinking")


def reference(ctx: Context, run, c):
    """The baseline's output of the very same rendered request."""
    if ctx.config == "baseline":
        return None
    base = ctx.suite.load_axis("baseline", run.slot)
    return None if base is None else base.by_prompt().get(c.prompt_id)


def measure(ctx: Context):
    levels = measure_axis(ctx, "chat_thinking", reference)
    for lv in levels:  # every request rendered, and in thinking mode where asked: not some
        if lv.failed:
            continue
        keys = ("chat_rendered", "thinking_prompts") if lv.slot.endswith("-on") else ("chat_rendered",)
        for key in keys:
            got = lv.proof.get(key)
            if isinstance(got, (int, float)) and 0 < got < lv.requests:
                lv.unproven.append(f"{key} = {got} of {lv.requests} requests")
    return levels


def judge(r, p):
    return judge_axis("axis_chat_thinking", "chat_thinking", r, p,
                      "differ from the baseline's on the same rendering")


CHECK = CheckSpec(
    sampled="greedy-only",  # it compares tokens with the baseline's: at T > 0 they are draws
    name="axis_chat_thinking", label="chat template / thinking", order=260, baseline=True,
    judge=judge, measure=measure, guards=AXIS.guards, description=AXIS.description)
