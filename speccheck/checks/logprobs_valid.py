"""logprobs_valid: every logprob an engine reported is a logprob, one per generated token."""
from __future__ import annotations

from speccheck.checks import CheckSpec, Context
from speccheck.results import Check, ConfigResult
from speccheck.verify.finite import find_logprob_problems

SHOWN = 8


def measure(ctx: Context) -> list[str]:
    """Each problem of each stored run of the config (the run all at once too), named by run,
    prompt and position."""
    together = ctx.suite.load_together(ctx.config)
    runs = [*ctx.runs, *([together] if together is not None and together.status == "ok" else [])]
    out = []
    for rec in runs:
        label = "all at once" if rec.copies else f"r{rec.repeat}"
        for c in rec.completions:
            out += [f"{label} prompt {c.prompt_id}: {p}"
                    for p in find_logprob_problems(c.token_ids, c.logprobs, c.topk_ids, c.topk_logprobs)]
    return out


def judge(r: ConfigResult, p) -> Check:
    problems = r.measured.get("logprobs_valid") or []
    if not problems:
        return Check("logprobs_valid", True, "every reported logprob finite, at most 0, one per token, "
                                             "each top-k in order")
    more = f"\n    ... and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
    return Check("logprobs_valid", False,
                 f"{len(problems)} impossible logprob reading(s): every figure built on them (margins, "
                 "|Δ logprob|, path noise) would be meaningless"
                 + "".join("\n    " + x for x in problems[:SHOWN]) + more)


CHECK = CheckSpec(
    name="logprobs_valid", label=None, order=15, baseline=True, judge=judge, measure=measure,
    guards="an engine or server reporting NaN or infinite logprobs, fewer logprobs than tokens, or "
           "a top-k out of order (vLLM #27077: NaN logits after a sentinel change), which every "
           "comparison would otherwise read as numbers",
    description="Every reported logprob (the chosen token's and the top-k's) is finite, at most 0, "
                "present for every generated token, and each top-k is ordered best first.")
