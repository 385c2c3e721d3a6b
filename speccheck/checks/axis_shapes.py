"""axis_shapes: prompts and budgets around K and the cache block give the baseline's tokens."""
from __future__ import annotations

from speccheck.axes import get as get_axis
from speccheck.checks import CheckSpec, Context
from speccheck.checks._axes import judge_axis, measure_axis

AXIS = get_axis("shapes")


def reference(ctx: Context, run, c):
    """The baseline's output of the very same request (same cut prompt, same budget)."""
    if ctx.config == "baseline":
        return None
    base = ctx.suite.load_axis("baseline", run.slot)
    return None if base is None else base.by_prompt().get(c.prompt_id)


def measure(ctx: Context):
    return measure_axis(ctx, "shapes", reference)


def judge(r, p):
    check = judge_axis("axis_shapes", "shapes", r, p, "differ from the baseline's")
    if r.config == "baseline" or not check.passed or check.skipped:
        return check
    # the shapes the axis is for must have been sent to this config's K
    from speccheck.types import SpecConfig
    k = SpecConfig.from_name(r.config).k
    sent = set()
    for lv in r.measured.get("axis_shapes") or []:
        sent |= set(lv.proof.get("prompt_lengths", []))
    lacking = sorted({1, k, k + 1} - sent)
    if lacking:
        return type(check)("axis_shapes", False, f"prompt length(s) {lacking} around K={k} were never sent "
                           f"(sent: {sorted(sent)}): the axis did not reach the shapes it is for")
    return check


CHECK = CheckSpec(
    sampled="greedy-only",  # it compares tokens with the baseline's: at T > 0 they are draws
    name="axis_shapes", label="shapes", order=200, baseline=True, judge=judge, measure=measure,
    guards=AXIS.guards, description=AXIS.description)
