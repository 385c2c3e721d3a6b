"""greedy_is_argmax: at temperature 0 every chosen token is the engine's own top-1."""
from __future__ import annotations

from dataclasses import dataclass

from speccheck.checks import CheckSpec, Context, PolicyKey
from speccheck.results import Check, ConfigResult
from speccheck.verify.argmax import (
    ARGMAX_TOL,
    NEAR_TIE_TAU,
    argmax_summary,
    argmax_violations,
    near_tie_rank2_test,
)

POLICY = (
    PolicyKey("argmax_tolerance", ARGMAX_TOL,
              "nats a chosen token's reported logprob may sit below the reported top-1 and still "
              "count as the argmax (reporting noise only; below bf16's resolution at usual logits)"),
    PolicyKey("argmax_alpha", 1e-3,
              "the near-tie test: how surprising the near-ties that went to rank 2 may be under "
              "argmax decoding before the check fails", hi=1.0),
)


@dataclass
class ArgmaxEvidence:
    positions: int
    violations: list[str]  # "r0 prompt p position 12: token 5 (-1.31) below top-1 7 (-1.20)"
    near_ties: int
    rank2: int
    p: float
    temperature: float


def measure(ctx: Context) -> ArgmaxEvidence:
    tol = ctx.policy.argmax_tolerance
    comps = [(rec, c) for rec in ctx.runs for c in rec.completions]
    where = []
    for rec, c in comps:
        for v in argmax_violations(c.token_ids, c.topk_ids, c.topk_logprobs, c.logprobs, tol).violations:
            where.append(f"r{rec.repeat} prompt {c.prompt_id} position {v.position}: token {v.token} "
                         f"({v.chosen_logprob:.4f}) "
                         + ("outside its own top-k" if not v.in_topk else "")
                         + f" below its own top-1 {v.top1} ({v.top1_logprob:.4f})")
    s = argmax_summary([c for _, c in comps], NEAR_TIE_TAU, tol)
    test = near_tie_rank2_test(s.margins, s.chose_rank2, alpha=min(max(ctx.policy.argmax_alpha, 1e-12), 0.5))
    return ArgmaxEvidence(s.positions, where, s.near_ties, s.near_tie_rank2, test.p, test.temperature)


def judge(r: ConfigResult, p) -> Check:
    e: ArgmaxEvidence = r.measured["greedy_is_argmax"]
    ties = (f"{e.rank2} of {e.near_ties} near-tie(s) (margin <= {NEAR_TIE_TAU} nats) went to rank 2"
            + (f" (p {e.p:.2g}; a sampler at temperature ~{e.temperature:.3g} explains them best)"
               if e.rank2 else ""))
    if not e.violations and e.p >= p.argmax_alpha:
        return Check("greedy_is_argmax", True,
                     f"every one of {e.positions} chosen tokens is its own top-1; {ties}")
    return Check("greedy_is_argmax", False,
                 f"{len(e.violations)} of {e.positions} chosen token(s) are not the engine's own top-1 "
                 f"at temperature 0: something samples or accepts a non-argmax token; {ties}"
                 + "".join("\n    " + w for w in e.violations[:5])
                 + (f"\n    ... and {len(e.violations) - 5} more" if len(e.violations) > 5 else ""))


CHECK = CheckSpec(
    sampled="greedy-only",
    name="greedy_is_argmax", label=None, order=17, baseline=True, judge=judge, measure=measure,
    policy=POLICY,
    guards="a sampler that draws at a small temperature on the verify path, or a draft accepted "
           "without being the target's argmax: choices that differ only at near-ties, which output "
           "comparisons excuse",
    description="At temperature 0 every chosen token is the top-1 of the engine's own reported "
                "logprobs at that position, and no near-tie goes to rank 2 more often than argmax "
                "allows.")
