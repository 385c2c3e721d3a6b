"""agrees_with_baseline: the spec config's tokens are the baseline's, as a sample."""
from __future__ import annotations

from speccheck.checks import CheckSpec, PolicyKey
from speccheck.checks._evidence import COMPARED, RESCORED
from speccheck.checks._text import pct
from speccheck.results import Check, ConfigResult
from speccheck.verify import below_floor_p, detectable_agreement

POLICY = (
    PolicyKey("min_token_agreement", 0.98,
              "share of spec tokens equal to the baseline's teacher-forced argmax (the '99.6 %' "
              "figure)", hi=1.0, above=True),
    PolicyKey("agreement_alpha", 0.05,
              "... judged as a sample: a share below the floor fails when a rate at the floor would "
              "give so few agreements with one-sided binomial p < this (1 = a plain floor). Two "
              "near-tie flips in the 61 tokens of `smoke` (96.7 %) are within chance of a 98 % rate "
              "(p 0.35); 96.7 % over 1000 tokens is not (p 4e-3)."),
    PolicyKey("agreement_look_closer", 0.25,
              "a share below min_token_agreement at agreement_alpha <= p < this is inconclusive: "
              "`speccheck run` escalates it to more prompts, and it fails if it stays so", hi=1.0),
    PolicyKey("min_prefix_agreement", False,
              "share of tokens matched before the first divergence, summed over prompts "
              "(false = report only)", hi=1.0, above=True, optional=True),
    PolicyKey("min_text_similarity", False,
              "mean text similarity of spec vs baseline outputs (false = report only)", hi=1.0,
              above=True, optional=True),
)


def judge(r: ConfigResult, p) -> Check:
    fail, within_chance, unsure = [], "", False
    if r.token_agreement is not None and r.token_agreement < p.min_token_agreement:
        n = r.token_agreement_n
        pval = below_floor_p(round(r.token_agreement * n), n, p.min_token_agreement) if n else 0.0
        unsure = p.agreement_alpha <= pval < p.agreement_look_closer
        if pval < p.agreement_alpha:
            fail.append(f"teacher-forced token agreement {r.token_agreement:.2%} < "
                        f"{p.min_token_agreement:.2%} over {n} tokens (binomial p {pval:.2g})")
        else:
            within_chance = (f"; {r.token_agreement:.2%} is below {p.min_token_agreement:.2%} but "
                             f"within chance of it over {n} tokens (binomial p {pval:.2g} >= "
                             f"{p.agreement_alpha:g})")
    # a floor the policy sets is judged on a figure that exists: one that cannot be measured
    # (no text to compare) fails rather than passing unjudged
    for what, have, floor in (("prefix agreement", r.prefix_agreement, p.min_prefix_agreement),
                              ("text similarity", r.text_similarity, p.min_text_similarity)):
        if floor is False:
            continue
        if have is None:
            fail.append(f"{what} not measured, though the policy sets a floor of {floor:.2%}")
        elif have < floor:
            fail.append(f"{what} {have:.2%} < {floor:.2%}")
    figures = (f"{r.prompts_exact}/{r.prompts} prompts exact, prefix "
               f"{pct(r.prefix_agreement)}, teacher-forced {pct(r.token_agreement)}, "
               f"text {pct(r.text_similarity)}")
    if r.token_agreement_n:
        floor = detectable_agreement(r.token_agreement_n, p.min_token_agreement, p.agreement_alpha)
        figures += ("; power: no agreement rate is detectable below the floor over so few tokens"
                    if floor is None else
                    f"; power: an agreement rate of {floor:.2%} would be found 80 % of the time "
                    f"at alpha {p.agreement_alpha:g}")
    if unsure and not fail:
        return Check("agrees_with_baseline", False, "inconclusive: " + within_chance.lstrip("; ")
                     + f", and p < look-closer {p.agreement_look_closer:g} ({figures})",
                     inconclusive=True)
    return Check("agrees_with_baseline", not fail,
                 figures + within_chance if not fail else "; ".join(fail) + f" ({figures})")


def row(r: ConfigResult, c: Check) -> str:
    text = (f"{r.prompts_exact}/{r.prompts} prompts exact · prefix {_pct2(r.prefix_agreement)} · "
            f"teacher-forced {_pct2(r.token_agreement)} · text {_pct2(r.text_similarity)}")
    if c.passed and "within chance" in c.message:
        text += "\n" + c.message.split("; ", 1)[1]
    return text


def _pct2(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f} %"


CHECK = CheckSpec(
    sampled="greedy-only",
    name="agrees_with_baseline", label="agreement", order=50, judge=judge, row=row, policy=POLICY,
    needs=(COMPARED, RESCORED),
    guards="any bug that changes outputs often: a wrong verify, a wrong state after rejection",
    description="Teacher-forced, the spec tokens are the baseline's argmax on at least "
                "min_token_agreement of positions (judged as a binomial sample), and the prefix "
                "and text floors the policy sets hold.")
