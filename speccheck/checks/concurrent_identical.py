"""concurrent_identical: identical requests in flight together get one completion."""
from __future__ import annotations

from speccheck.checks import CheckSpec, PolicyKey
from speccheck.checks._text import NOT_INVARIANT, fmt_div, untrusted_tau
from speccheck.checks.batch_invariant import NO_RUN
from speccheck.results import Check, ConfigResult

POLICY = (
    PolicyKey("require_concurrent_identical", False,
              "identical requests in flight together must get one completion, or differ only at "
              "near-ties (exact ties included: vLLM 0.26's own server split two identical requests "
              "at a three-way bf16 tie in 3 of 5 runs); true = strict, any split fails (but a spec "
              "config's near-tie splits are never counted against it where the baseline splits too)"),
)


def judge(r: ConfigResult, p) -> Check:
    """Unless strict, splits at near-ties are tolerated; where the baseline splits too, a config
    is judged against that engine (near-tie splits never count, and unless strict neither do
    low-confidence ones); high-confidence splits always fail."""
    t = r.together
    if t is None:
        return Check("concurrent_identical", True, NO_RUN, skipped=True)
    tolerated = set() if p.require_concurrent_identical else {"near_tie"}
    if t.baseline_not_invariant:
        tolerated |= {"near_tie"} | (set() if p.require_concurrent_identical else {"low_confidence"})
    bad = [d for d in t.split_divergences if d.cls not in tolerated]
    if t.split and not t.split_divergences:  # split copies but nothing to classify: never excused
        bad = [None]
    excused = len(t.split_divergences) - len([d for d in bad if d is not None])
    unsure = [untrusted_tau(excused, r.noise_missing)] if r.noise_missing and excused else []
    split = ", ".join(f"{pid}: {n} distinct" for pid, n in t.split.items())
    msg = (f"{t.copies} identical concurrent requests per prompt -> "
           + (f"more than one completion for {len(t.split)} prompt(s) ({split})" if t.split
              else "1 completion each"))
    if t.baseline_not_invariant:
        msg += f"; the baseline is not batch-invariant either: {NOT_INVARIANT}"
    elif t.of_baseline and t.not_invariant:
        msg += f"; {NOT_INVARIANT}"
    if t.split:
        strict = " (strict: require_concurrent_identical)" if p.require_concurrent_identical else ""
        msg += (f"; {len([d for d in bad if d is not None])} split(s) not explained by a near-tie{strict}"
                + "".join("\n    " + fmt_div(d) for d in t.split_divergences[:5]))
    return Check("concurrent_identical", not bad and not unsure, "; ".join(unsure + [msg]))


CHECK = CheckSpec(
    sampled="reported",
    name="concurrent_identical", label="", order=40, baseline=True, judge=judge, policy=POLICY,
    guards="identical concurrent requests that get different completions (SGLang #35150: 111 of 304 "
           "requests wrong at concurrency 8)",
    description="N identical requests in flight together get one completion, or split only at "
                "classified near-ties.")
