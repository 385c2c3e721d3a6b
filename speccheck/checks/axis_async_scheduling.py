"""axis_async_scheduling: scheduling one step ahead changes no token."""
from __future__ import annotations

from speccheck.axes import get as get_axis
from speccheck.checks import CheckSpec, Context
from speccheck.checks._axes import judge_axis, measure_axis, prompt_of
from speccheck.types import axis_slot

AXIS = get_axis("async_scheduling")


def reference(ctx: Context, run, c):
    """On: the same request with async scheduling off; off: the prompt alone (first repeat)."""
    if run.level == "on":
        off = ctx.suite.load_axis(ctx.config, axis_slot("async_scheduling", "off"))
        return None if off is None else off.by_prompt().get(c.prompt_id)
    return ctx.runs[0].by_prompt().get(prompt_of(c.prompt_id)) if ctx.runs else None


def measure(ctx: Context):
    return measure_axis(ctx, "async_scheduling", reference)


def judge(r, p):
    return judge_axis("axis_async_scheduling", "async_scheduling", r, p,
                      "differ from async scheduling off")


CHECK = CheckSpec(
    name="axis_async_scheduling", label="async scheduling", order=250, baseline=True, judge=judge,
    measure=measure, guards=AXIS.guards, description=AXIS.description)
