"""axis_long_lived: after many requests, the probe gives a fresh process's tokens and acceptance."""
from __future__ import annotations

from speccheck.axes import get as get_axis
from speccheck.checks import CheckSpec, Context
from speccheck.checks._axes import judge_axis, measure_axis, prompt_of
from speccheck.results import Check

AXIS = get_axis("long_lived")


def _fresh(ctx: Context):
    """The config's fresh-process repeat (else its first): what a new process gives."""
    fresh = [r for r in ctx.runs if r.fresh_process]
    return (fresh or list(ctx.runs) or [None])[-1]


def reference(ctx: Context, run, c):
    if not c.prompt_id.startswith("probe:"):
        return None
    fresh = _fresh(ctx)
    return None if fresh is None else fresh.by_prompt().get(prompt_of(c.prompt_id))


def measure(ctx: Context):
    levels = measure_axis(ctx, "long_lived", reference)
    fresh = _fresh(ctx)
    for lv in levels:  # acceptance of the probe against the fresh process, and what was served
        run = ctx.suite.load_axis(ctx.config, lv.slot)
        if run is None or run.status != "ok":
            continue
        probes = [c for c in run.completions if c.prompt_id.startswith("probe:")]
        lv.proof["requests_before_probe"] = len(run.completions) - len(probes)
        want = int(run.level) if run.level.isdigit() else 1
        if lv.proof["requests_before_probe"] < want:
            lv.unproven.append(f"requests_before_probe = {lv.proof['requests_before_probe']} (< {want})")
        by = fresh.by_prompt() if fresh is not None else {}
        pairs = [(c.spec, by[prompt_of(c.prompt_id)].spec) for c in probes
                 if c.spec is not None and prompt_of(c.prompt_id) in by and by[prompt_of(c.prompt_id)].spec]
        if pairs:
            late = 1 + sum(a.accepted_tokens for a, _ in pairs) / max(sum(a.drafts for a, _ in pairs), 1)
            new = 1 + sum(b.accepted_tokens for _, b in pairs) / max(sum(b.drafts for _, b in pairs), 1)
            lv.proof["tokens_per_iter_probe"] = round(late, 4)
            lv.proof["tokens_per_iter_fresh"] = round(new, 4)
    return levels


def judge(r, p) -> Check:
    check = judge_axis("axis_long_lived", "long_lived", r, p, "differ from a fresh process")
    for lv in r.measured.get("axis_long_lived") or []:
        late, new = lv.proof.get("tokens_per_iter_probe"), lv.proof.get("tokens_per_iter_fresh")
        if late and new and abs(late / new - 1) > p.max_acceptance_drop:
            return Check("axis_long_lived", False,
                         f"{lv.label}: the probe's acceptance {late:.2f} tokens/iteration is "
                         f"{late / new - 1:+.0%} from a fresh process's {new:.2f} (more than "
                         f"{p.max_acceptance_drop:.0%}): state left by earlier requests moves the drafts; "
                         + check.message)
    return check


CHECK = CheckSpec(
    name="axis_long_lived", label="long-lived", order=230, baseline=True, judge=judge, measure=measure,
    guards=AXIS.guards, description=AXIS.description)
