"""axis_kv_pressure: preemption and recompute under a KV budget change no token."""
from __future__ import annotations

from speccheck.axes import get as get_axis
from speccheck.checks import CheckSpec, Context
from speccheck.checks._axes import judge_axis, measure_axis, prompt_of
from speccheck.types import axis_slot

AXIS = get_axis("kv_pressure")


def reference(ctx: Context, run, c):
    """Pressure level: the same request without pressure; free level: the prompt alone."""
    if run.level == "pressure":
        free = ctx.suite.load_axis(ctx.config, axis_slot("kv_pressure", "free"))
        return None if free is None else free.by_prompt().get(c.prompt_id)
    return ctx.runs[0].by_prompt().get(prompt_of(c.prompt_id)) if ctx.runs else None


def measure(ctx: Context):
    return measure_axis(ctx, "kv_pressure", reference)


def judge(r, p):
    return judge_axis("axis_kv_pressure", "kv_pressure", r, p, "differ from the run without pressure")


CHECK = CheckSpec(
    name="axis_kv_pressure", label="KV pressure", order=240, baseline=True, judge=judge, measure=measure,
    guards=AXIS.guards, description=AXIS.description)
