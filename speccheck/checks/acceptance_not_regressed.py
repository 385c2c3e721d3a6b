"""acceptance_not_regressed: the config really speculates, and its acceptance holds up."""
from __future__ import annotations

from speccheck.checks import CheckSpec, PolicyKey
from speccheck.results import Check, ConfigResult

POLICY = (
    PolicyKey("min_tokens_per_iter", 1.0,
              "a spec config must have drafted (drafts > 0) and reach this many tokens per iteration"),
    PolicyKey("max_acceptance_drop", 0.05,
              "tokens per iteration may fall this much (relative) below the golden's before failing "
              "(on the prompts whose output is the golden run's, where the golden records them)",
              hi=1.0),
)


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
    shared = f"; {same.today:.2f} vs {same.golden:.2f}{where}" if same else ""
    gold = f" (golden {r.golden_tokens_per_iter:.2f}{shared})" if r.golden_tokens_per_iter else ""
    return Check("acceptance_not_regressed", not problems,
                 "; ".join(problems) if problems else f"{acc.tokens_per_iter:.2f} tokens/iteration{gold}")


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
    policy=POLICY,
    guards="acceptance-only bugs with exact tokens: MTP fed the wrong hidden states (vLLM #36531), "
           "DFlash features from the wrong layer (#42704), a fall after an upgrade (syv-ai #73)",
    description="The config drafted, reaches min_tokens_per_iter, and its tokens per iteration did "
                "not fall more than max_acceptance_drop below the golden's.")
