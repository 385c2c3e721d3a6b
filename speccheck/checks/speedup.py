"""speedup: warm decode speedup over the baseline measured in the same suite."""
from __future__ import annotations

from speccheck.checks import CheckSpec, PolicyKey
from speccheck.checks._text import times
from speccheck.results import Check, ConfigResult

POLICY = (
    PolicyKey("min_speedup", False,
              "warm decode speedup over the baseline measured in the same suite (false = report "
              "only; 1.0 = no slower than the baseline)", above=True, optional=True),
)


def judge(r: ConfigResult, p) -> Check:
    sp = r.speed.speedup
    if p.min_speedup is False:
        return Check("speedup", True, f"speedup {times(sp)} (not gated)", skipped=True)
    if sp is None:  # a floor set but no speed measured: not judged, so not passed
        return Check("speedup", False, f"warm speedup not measured, though min_speedup is "
                     f"{p.min_speedup:.2f}x (no warm baseline or spec timings in this suite)")
    return Check("speedup", sp >= p.min_speedup, f"warm speedup {times(sp)} vs required {p.min_speedup:.2f}x")


CHECK = CheckSpec(
    name="speedup", label=None, order=120, judge=judge, policy=POLICY,
    guards="a config that costs more than it buys",
    description="The warm decode speedup over the baseline reaches min_speedup (report only by "
                "default).")
