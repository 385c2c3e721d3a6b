"""axis_shapes: prompts and budgets around K and the cache block give the baseline's tokens;
batches at the engine's CUDA-graph capture sizes ± 1 give each request's tokens alone."""
from __future__ import annotations

from speccheck.axes import get as get_axis
from speccheck.axes.shapes import batch_targets
from speccheck.checks import CheckSpec, Context
from speccheck.checks._axes import judge_axis, measure_axis, prompt_of
from speccheck.results import Check
from speccheck.types import SpecConfig

AXIS = get_axis("shapes")


def reference(ctx: Context, run, c):
    """Lengths level: the baseline's output of the very same request (same cut prompt, same
    budget). Batch level: the same prompt alone (the config's first repeat)."""
    if run.level == "batch":
        alone = ctx.runs[0].by_prompt() if ctx.runs else {}
        return alone.get(prompt_of(c.prompt_id))
    if ctx.config == "baseline":
        return None
    base = ctx.suite.load_axis("baseline", run.slot)
    return None if base is None else base.by_prompt().get(c.prompt_id)


def measure(ctx: Context):
    levels = measure_axis(ctx, "shapes", reference)
    for lv in levels:  # the batch sizes the capture sizes call for, against those scheduled
        if not lv.slot.endswith("-batch") or lv.failed:
            continue
        sizes, q = lv.proof.get("capture_sizes"), lv.proof.get("tokens_per_request")
        if not sizes:
            lv.unproven.append(f"capture_sizes = {sizes if sizes is not None else 'not read back'} "
                               "(the engine replayed no CUDA graph: there was no size to pad to)")
            continue
        want = batch_targets(sizes, q or 1)
        lacking = sorted(set(want) - set(lv.proof.get("batch_sizes") or ()))
        lv.proof["batches_of"] = "+".join(map(str, want))  # shown with the level's proof
        if lacking:
            lv.unproven.append(f"batch sizes {lacking} of {want} were never scheduled (scheduled: "
                               f"{sorted(lv.proof.get('batch_sizes') or ())}; capture sizes {sizes} "
                               f"tokens at {q} per request)")
    return levels


def judge(r, p):
    check = judge_axis("axis_shapes", "shapes", r, p, "differ from their reference (the baseline's for lengths, the prompt alone for batches)")
    if r.config == "baseline" or not check.passed or check.skipped:
        return check
    # the shapes the lengths level is for must have been sent to this config's K
    k = SpecConfig.from_name(r.config).k
    levels = [lv for lv in r.measured.get("axis_shapes") or [] if not lv.slot.endswith("-batch")]
    if not levels:
        return check
    sent = set()
    for lv in levels:
        sent |= set(lv.proof.get("prompt_lengths", []))
    lacking = sorted({1, k, k + 1} - sent)
    if lacking:
        return Check("axis_shapes", False, f"prompt length(s) {lacking} around K={k} were never sent "
                     f"(sent: {sorted(sent)}): the axis did not reach the shapes it is for")
    return check


CHECK = CheckSpec(
    sampled="greedy-only",  # it compares tokens with the baseline's: at T > 0 they are draws
    name="axis_shapes", label="shapes", order=200, baseline=True, judge=judge, measure=measure,
    guards=AXIS.guards, description=AXIS.description)
