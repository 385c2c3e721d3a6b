"""acceptance_not_regressed: the config really speculates, and its acceptance holds up."""
from __future__ import annotations

from speccheck.checks import CheckSpec, Context, PolicyKey
from speccheck.results import Check, ConfigResult
from speccheck.verify import output_digest
from speccheck.verify.acceptance_stats import (
    AcceptanceComparison,
    DetectableDrop,
    compare_acceptance,
    minimum_detectable_drop,
)

POLICY = (
    PolicyKey("min_tokens_per_iter", 1.0,
              "a spec config must have drafted (drafts > 0) and reach this many tokens per iteration"),
    PolicyKey("max_acceptance_drop", 0.05,
              "tokens per iteration may fall this much (relative) below the golden's before failing "
              "(on the prompts whose output is the golden run's, where the golden records them)",
              hi=1.0),
    PolicyKey("acceptance_alpha", 0.01,
              "against the golden, prompt by prompt on the prompts whose output is the golden run's "
              "(prompts, not tokens, the unit of sampling): a change of tokens/iteration beyond "
              "max_acceptance_drop, either way, fails when its two-sided p (Holm) is below this -- "
              "a rise is as much a finding as a fall (drafts accepted without a real verify)",
              hi=1.0),
)


def measure(ctx: Context) -> tuple[AcceptanceComparison, DetectableDrop | None] | None:
    """Today's per-prompt acceptance against the golden's, paired on the prompts whose output is
    the golden run's token for token (elsewhere the trajectories differ and so may the steps)."""
    gold = (ctx.golden_acceptance or {}).get("per_prompt")
    per_pos = (ctx.golden_acceptance or {}).get("per_prompt_pos")  # goldens recorded before: none
    if not gold or not per_pos or not ctx.runs:
        return None
    today = {c.prompt_id: (int(c.spec.drafts), list(c.spec.accepted_per_pos))
             for c in ctx.runs[0].completions
             if c.spec is not None and c.prompt_id in gold and c.prompt_id in per_pos
             and output_digest(c.token_ids) == gold[c.prompt_id][2]}
    then = {p: (int(gold[p][0]), list(per_pos[p])) for p in today}
    if not today:
        return None
    alpha = ctx.policy.acceptance_alpha
    try:
        cmp = compare_acceptance(then, today, alpha=alpha, paired=True)
    except ValueError:  # impossible counters on a side: counters_consistent names today's
        return None
    try:
        power = minimum_detectable_drop(then, today, alpha=alpha, paired=True)
    except ValueError:
        power = None
    return cmp, power


def judge(r: ConfigResult, p) -> Check:
    acc = r.acceptance
    if acc is None and r.counter_problems:
        return Check("acceptance_not_regressed", False,
                     "the spec counters are impossible, so acceptance cannot be measured "
                     "(see counters_consistent)")
    if acc is None or acc.drafts == 0:
        return Check("acceptance_not_regressed", False,
                     "the engine reported no drafts: this config did not actually speculate "
                     "(spec counters missing or zero)")
    problems = []
    if acc.tokens_per_iter < p.min_tokens_per_iter:
        problems.append(f"{acc.tokens_per_iter:.2f} tokens/iteration < {p.min_tokens_per_iter:.2f}")
    same = r.golden_same_output
    where = (f" on the {same.shared} of {same.prompts} prompts whose output is the golden run's "
             "token for token") if same else ""
    if same is not None and same.today < same.golden * (1 - p.max_acceptance_drop):
        problems.append(f"{same.today:.2f} tokens/iteration{where} fell more than "
                        f"{p.max_acceptance_drop:.0%} below the golden's {same.golden:.2f} there")
    elif same is None and r.golden_tokens_per_iter is not None and \
            acc.tokens_per_iter < r.golden_tokens_per_iter * (1 - p.max_acceptance_drop):
        problems.append(f"{acc.tokens_per_iter:.2f} tokens/iteration fell more than "
                        f"{p.max_acceptance_drop:.0%} below golden {r.golden_tokens_per_iter:.2f}")
    stats = r.measured.get("acceptance_not_regressed")
    if same is not None and same.today > same.golden * (1 + p.max_acceptance_drop):
        problems.append(f"{same.today:.2f} tokens/iteration{where} rose {same.today / same.golden - 1:.0%} "
                        f"above the golden's {same.golden:.2f}, more than {p.max_acceptance_drop:.0%}: the "
                        "same tokens accepted more often than the drafter proposes them"
                        + _significance(stats, p))
    elif problems and same is not None:
        problems[-1] += _significance(stats, p)
    shared = f"; {same.today:.2f} vs {same.golden:.2f}{where}" if same else ""
    gold = f" (golden {r.golden_tokens_per_iter:.2f}{shared})" if r.golden_tokens_per_iter else ""
    if stats is not None and stats[1] is not None:
        d = stats[1]
        gold += ("; prompt by prompt as recorded, so any change would show" if d.se == 0 else
                 f"; a change of {d.relative:.1%} either way would be detected with power {d.power:.0%} "
                 f"at alpha {p.acceptance_alpha:g} over {stats[0].prompts[0]} prompts")
    return Check("acceptance_not_regressed", not problems,
                 "; ".join(problems) if problems else f"{acc.tokens_per_iter:.2f} tokens/iteration{gold}")


def _significance(stats, p) -> str:
    """The paired test's verdict on the change (prompts as the unit): how sure it is."""
    if stats is None:
        return ""
    cmp, _ = stats
    o = cmp.overall
    if cmp.inconclusive:
        return f" ({cmp.reason})"
    return (f" (paired over {cmp.prompts[0]} prompts: Holm p {o.p_holm:.2g}"
            + (", beyond chance)" if o.p_holm <= p.acceptance_alpha else
               f", not beyond chance at {p.acceptance_alpha:g}: inconclusive, so it fails; more prompts "
               "would decide it)"))


def row(r: ConfigResult, c: Check) -> str:
    acc = r.acceptance
    if acc is None:
        return c.message.splitlines()[0]
    per = "/".join(f".{round(100 * q):02d}" if q < 1 else "1.0" for q in acc.per_pos[:16])
    return (f"{acc.tokens_per_iter:.2f} tokens/iter · rate {100 * acc.acceptance_rate:.1f} % · per position "
            f"{per or '-'}{'/...' if len(acc.per_pos) > 16 else ''}"
            + (f" · golden {r.golden_tokens_per_iter:.2f}" if r.golden_tokens_per_iter else ""))


CHECK = CheckSpec(
    name="acceptance_not_regressed", label="acceptance", order=110, judge=judge, row=row,
    policy=POLICY, measure=measure,
    guards="acceptance-only bugs with exact tokens: MTP fed the wrong hidden states (vLLM #36531), "
           "DFlash features from the wrong layer (#42704), a fall after an upgrade (syv-ai #73)",
    description="The config drafted, reaches min_tokens_per_iter, and its tokens per iteration "
                "neither fell more than max_acceptance_drop below the golden's nor rose beyond it "
                "by more than chance over the prompts.")
