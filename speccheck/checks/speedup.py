"""speedup: warm decode speedup over the baseline measured in the same suite."""
from __future__ import annotations

from speccheck.checks import CheckSpec, PolicyKey
from speccheck.checks._text import times
from speccheck.results import Check, ConfigResult

POLICY = (
    PolicyKey("min_speedup", 0.0,
              "warm decode speedup over the baseline measured in the same suite (0 = report only)"),
)


def judge(r: ConfigResult, p) -> Check:
    sp = r.speed.speedup
    if p.min_speedup <= 0:
        return Check("speedup", True, f"speedup {times(sp)} (not gated)", skipped=True)
    return Check("speedup", sp is not None and sp >= p.min_speedup,
                 f"warm speedup {times(sp)} vs required {p.min_speedup:.2f}x")


CHECK = CheckSpec(
    name="speedup", label=None, order=120, judge=judge, policy=POLICY,
    guards="a config that costs more than it buys",
    description="The warm decode speedup over the baseline reaches min_speedup (report only by "
                "default).")
