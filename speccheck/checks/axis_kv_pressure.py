"""axis_kv_pressure: preemption and recompute under a KV budget change no token, and leave the
preempted requests' acceptance where the same requests have it without pressure."""
from __future__ import annotations

from speccheck.axes import get as get_axis
from speccheck.checks import CheckSpec, Context, PolicyKey
from speccheck.checks._axes import judge_axis, measure_axis, prompt_of
from speccheck.results import Check
from speccheck.types import axis_slot
from speccheck.verify.preempted import preempted_acceptance

AXIS = get_axis("kv_pressure")

POLICY = (
    PolicyKey("preempted_acceptance_alpha", 0.05,
              "the preempted requests' acceptance against the same requests without pressure "
              "(paired per request, draft positions reached as trials, a Mantel-Haenszel test "
              "stratified by request, two-sided): a change beyond max_acceptance_drop fails when "
              "its p is below this (a clean recompute moves only its step boundaries; a drafter "
              "that restarts cold after the recompute moves every step after it)", hi=1.0),
)


def reference(ctx: Context, run, c):
    """Pressure level: the same request without pressure; free level: the prompt alone."""
    if run.level == "pressure":
        free = ctx.suite.load_axis(ctx.config, axis_slot("kv_pressure", "free"))
        return None if free is None else free.by_prompt().get(c.prompt_id)
    return ctx.runs[0].by_prompt().get(prompt_of(c.prompt_id)) if ctx.runs else None


def measure(ctx: Context):
    levels = measure_axis(ctx, "kv_pressure", reference)
    for lv in levels:  # each preempted request's acceptance against itself without pressure
        if not lv.slot.endswith("-pressure") or lv.failed:
            continue
        run = ctx.suite.load_axis(ctx.config, lv.slot)
        pre = set((run.proof or {}).get("preempted_requests") or ())
        pairs, counted = [], 0
        for c in run.completions:
            ref = reference(ctx, run, c) if c.prompt_id in pre else None
            if ref is not None and c.spec is not None and ref.spec is not None and c.spec.drafts and ref.spec.drafts:
                counted += 1
                if c.token_ids.tolist() == ref.token_ids.tolist():
                    pairs.append((c.prompt_id, c.spec, ref.spec))
        lv.proof["preempted_counted"] = counted  # with spec counters of their own, both runs
        lv.proof["preempted_compared"] = len(pairs)
        lv.preempted = preempted_acceptance(pairs) if pairs else None
        lv.proof["preempted_named"] = len(pre)
    return levels


def judge(r, p) -> Check:
    check = judge_axis("axis_kv_pressure", "kv_pressure", r, p, "differ from the run without pressure")
    for lv in r.measured.get("axis_kv_pressure") or []:
        res = lv.preempted
        if check.skipped or lv.failed or not lv.slot.endswith("-pressure") or r.config == "baseline":
            continue
        if res is None:  # said, so that a pass is not read as this test's
            named = lv.proof.get("preempted_named")
            why = ("the engine names no preempted request" if not named else
                   f"the engine counts drafts only for its whole batch, not for each of the {named} "
                   "preempted request(s)" if not lv.proof.get("preempted_counted") else
                   f"none of the {named} preempted request(s) gave the free run's tokens, so their "
                   "acceptance compares different drafts")
            check = Check(check.name, check.passed, f"{check.message}; {lv.label}: the preempted "
                          f"requests' acceptance not judged ({why}); the tokens are")
            continue
        rows = ", ".join(f"{q.request} {q.change:+.0%}" for q in res.requests)
        what = (f"{lv.label}: the preempted requests' acceptance (accepted per draft) {res.change:+.1%} "
                f"against the same requests without pressure (p {res.p:.3g}, alpha "
                f"{p.preempted_acceptance_alpha:g}; {rows})")
        if res.significant(p.preempted_acceptance_alpha, p.max_acceptance_drop):
            return Check("axis_kv_pressure", False,
                         what + f": beyond chance and more than {p.max_acceptance_drop:.0%}, so the "
                         "recompute did not restore the drafter's state; " + check.message)
        check = Check(check.name, check.passed, f"{check.message}; {what}", skipped=check.skipped)
    return check


CHECK = CheckSpec(
    name="axis_kv_pressure", label="KV pressure", order=240, baseline=True, judge=judge, measure=measure,
    policy=POLICY, guards=AXIS.guards, description=AXIS.description)
