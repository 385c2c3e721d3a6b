"""counters_consistent: the spec counters agree with each other and with the tokens emitted."""
from __future__ import annotations

from speccheck.checks import CheckSpec
from speccheck.results import Check, ConfigResult


def judge(r: ConfigResult, p) -> Check:
    v = r.counter_views
    if not v and not r.counter_problems:
        return Check("counters_consistent", True, "the engine reported no spec counters", skipped=True)
    views = ", ".join(f"{name} say {x:.2f}" if x is not None else f"{name} say -"
                      for name, x in v.items())
    views = f"tokens/iteration: {views}" if views else "no counters in the first run"
    if not r.counter_problems:
        return Check("counters_consistent", True,
                     f"{views}; counters agree with each other and with the tokens emitted "
                     "(an output cut at max_tokens or end-of-sequence drops up to K accepted tokens)")
    more = f"\n    ... and {len(r.counter_problems) - 8} more" if len(r.counter_problems) > 8 else ""
    return Check("counters_consistent", False,
                 f"{len(r.counter_problems)} impossible counter reading(s) for config {r.config} "
                 f"({views})" + "".join("\n    " + x for x in r.counter_problems[:8]) + more)


def row(r: ConfigResult, c: Check) -> str:
    """With acceptance determinism on the same line."""
    text = c.message.splitlines()[0]
    if r.acceptance_identical is not None:
        text += (" · acceptance identical run to run" if r.acceptance_identical else
                 f" · acceptance DIFFERS run to run ({len(r.acceptance_nondeterminism)} prompt(s))")
    return text


CHECK = CheckSpec(
    name="counters_consistent", label="counters", order=80, judge=judge, row=row,
    guards="impossible acceptance counts and metrics (vLLM #27077: negative counts, a sentinel "
           "checked against the old value)",
    description="Accepted = the sum per position, per-position counts never increase, and the "
                "counters match the tokens emitted per iteration.")
