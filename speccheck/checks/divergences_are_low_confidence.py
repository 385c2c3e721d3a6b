"""divergences_are_low_confidence: every disagreement with the baseline is a numeric near-tie."""
from __future__ import annotations

from speccheck.checks import CheckSpec, PolicyKey
from speccheck.checks._evidence import COMPARED, RESCORED
from speccheck.checks._text import fmt_div, untrusted_tau
from speccheck.compare import token_divergences
from speccheck.results import Check, ConfigResult

POLICY = (
    PolicyKey("max_high_confidence", 0,
              "divergences that are not explained by a near-tie (see verify.classify_divergence); "
              "also the high-confidence changes a batch may make to a prompt (batch_invariant)"),
)


def judge(r: ConfigResult, p) -> Check:
    token_divs = token_divergences(r.divergences + r.tf_divergences)
    high = [d for d in token_divs if d.classification.cls == "high_confidence"]
    seen, unique_high = set(), []
    for d in high:
        if (d.prompt_id, d.position) not in seen:
            seen.add((d.prompt_id, d.position))
            unique_high.append(d)
    excused = {(d.prompt_id, d.position) for d in token_divs} - seen
    unsure = [untrusted_tau(len(excused), r.noise_missing)] if r.noise_missing and excused else []
    return Check(
        "divergences_are_low_confidence", len(unique_high) <= p.max_high_confidence and not unsure,
        "; ".join(unsure + [f"{len(unique_high)} high-confidence divergence(s) (max {p.max_high_confidence})"])
        + ("".join("\n    " + fmt_div(d) for d in unique_high[:5])
           + (f"\n    ... and {len(unique_high) - 5} more" if len(unique_high) > 5 else "")))


def row(r: ConfigResult, c: Check) -> str:
    cc = r.class_counts
    return (f"{len(r.divergences)} first, {len(r.tf_divergences)} teacher-forced "
            f"(near_tie {cc.get('near_tie', 0)}, low_confidence {cc.get('low_confidence', 0)}, "
            f"high_confidence {cc.get('high_confidence', 0)})")


CHECK = CheckSpec(
    sampled="greedy-only",
    name="divergences_are_low_confidence", label="divergences", order=60, judge=judge, row=row,
    policy=POLICY, needs=(COMPARED, RESCORED),
    guards="silent corruption: hybrid state not rolled back after a rejection (vLLM #50272, "
           "#39273), read from the wrong slot (#52942), a draft accepted that is not the argmax",
    description="Every token where spec and baseline differ, first divergence or teacher-forced, "
                "is a near-tie or low-confidence flip by the calibrated margins, never a "
                "high-confidence one.")
