"""acceptance_deterministic: the spec counters repeat run to run."""
from __future__ import annotations

from speccheck.checks import CheckSpec, PolicyKey
from speccheck.results import Check, ConfigResult

POLICY = (
    PolicyKey("require_deterministic_acceptance", False,
              "the spec counters (drafts, accepted, per position) repeat run to run; off by default: "
              "near-ties may flip accept/reject while the output repeats exactly (vLLM #53436), which "
              "is performance nondeterminism, reported apart from output determinism"),
)


def judge(r: ConfigResult, p) -> Check:
    """Gated only if asked; reported either way."""
    gated = p.require_deterministic_acceptance
    note = "" if gated else " (reported, not gated: policy require_deterministic_acceptance)"
    if r.acceptance_identical is None:
        return Check("acceptance_deterministic", not gated,
                     "fewer than 2 runs with spec counters to compare" + note, skipped=not gated)
    if r.acceptance_identical:
        return Check("acceptance_deterministic", True,
                     f"spec counters identical in every run, prompt by prompt{note}", skipped=not gated)
    return Check("acceptance_deterministic", not gated,
                 f"spec counters differ run to run for {len(r.acceptance_nondeterminism)} prompt(s): "
                 + "; ".join(r.acceptance_nondeterminism[:5]) + note, skipped=not gated)


CHECK = CheckSpec(
    name="acceptance_deterministic", label=None, order=90, judge=judge, policy=POLICY,
    guards="acceptance that changes run to run at temperature 0 with identical text (vLLM #53436)",
    description="The spec counters of every repeat equal the first's, prompt by prompt (gated only "
                "with require_deterministic_acceptance).")
