"""axis_concurrency: requests that join a running batch give their tokens alone."""
from __future__ import annotations

from speccheck.axes import get as get_axis
from speccheck.checks import CheckSpec, Context
from speccheck.checks._axes import judge_axis, measure_axis, prompt_of

AXIS = get_axis("concurrency")


def reference(ctx: Context, run, c):
    """The same prompt alone: the config's first repeat."""
    alone = ctx.runs[0].by_prompt() if ctx.runs else {}
    return alone.get(prompt_of(c.prompt_id))


def measure(ctx: Context):
    return measure_axis(ctx, "concurrency", reference)


def judge(r, p):
    return judge_axis("axis_concurrency", "concurrency", r, p, "differ from the prompt alone")


CHECK = CheckSpec(
    name="axis_concurrency", label="concurrency", order=210, baseline=True, judge=judge, measure=measure,
    guards=AXIS.guards, description=AXIS.description)
