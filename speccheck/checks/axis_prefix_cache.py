"""axis_prefix_cache: a prefix-cache hit gives the tokens of a cold prefill."""
from __future__ import annotations

from speccheck.axes import get as get_axis
from speccheck.checks import CheckSpec, Context
from speccheck.checks._axes import judge_axis, measure_axis, prompt_of
from speccheck.types import axis_slot

AXIS = get_axis("prefix_cache")


def reference(ctx: Context, run, c):
    """Hit level: the same request with the cache off; cold level: a first turn is the prompt
    alone (the config's first repeat)."""
    if run.level == "hit":
        cold = ctx.suite.load_axis(ctx.config, axis_slot("prefix_cache", "cold"))
        return None if cold is None else cold.by_prompt().get(c.prompt_id)
    if "/turn1:" in c.prompt_id and ctx.runs:
        return ctx.runs[0].by_prompt().get(prompt_of(c.prompt_id))
    return None


def measure(ctx: Context):
    return measure_axis(ctx, "prefix_cache", reference)


def judge(r, p):
    return judge_axis("axis_prefix_cache", "prefix_cache", r, p, "differ from a cold prefill")


CHECK = CheckSpec(
    name="axis_prefix_cache", label="prefix cache", order=220, baseline=True, judge=judge, measure=measure,
    guards=AXIS.guards, description=AXIS.description)
