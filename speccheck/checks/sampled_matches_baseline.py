"""sampled_matches_baseline: at temperature > 0 a spec config's samples and the baseline's
samples of the same prompts are draws from one distribution (a two-sample permutation test on
the tokens alone, so it needs no scoring and runs through any engine)."""
from __future__ import annotations

import math

from speccheck.checks import CheckSpec, Context, PolicyKey
from speccheck.checks._evidence import judge_sampled
from speccheck.results import Check, ConfigResult
from speccheck.verify.two_sample import PREFIX_LEN, POWER, TwoSample, base_prompt_id, two_sample

POLICY = (
    PolicyKey("two_sample_alpha", 0.01,
              "family-wise false-alarm rate of the two-sample check per config (Holm over its "
              "first-token, prefix, token and bigram statistics)", hi=0.5),
)

#: what each statistic compares, for the messages
WHAT = {"first_token": "first tokens per prompt",
        "prefix": f"first {PREFIX_LEN} tokens per prompt",
        "tokens": "token counts per prompt",
        "tokens_pooled": "token counts over all prompts",
        "bigrams_pooled": "bigram counts over all prompts"}


def _samples(run) -> dict:
    out: dict[str, list] = {}
    for c in run.completions:
        out.setdefault(base_prompt_id(c.prompt_id), []).append(c.token_ids)
    return out


def measure(ctx: Context) -> TwoSample | str | None:
    """The family over the first repeat of the config and of the baseline (later repeats of a
    seeded run are copies, not new samples). None: a greedy suite; a string: what is missing."""
    from speccheck.types import sampling_of

    if ctx.runs is None or sampling_of(ctx.suite.meta.get("engine_args")) is None:
        return None
    if ctx.config == "baseline":
        return None
    if not ctx.runs:
        return None
    base = [r for r in ctx.baseline_runs if r.status == "ok" and r.repeat == 0]
    if not base:
        return ("no baseline samples to compare with: run the baseline into this store "
                f"({ctx.suite.resume_command('baseline')})")
    return two_sample(_samples(ctx.runs[0]), _samples(base[0]),
                      min(max(ctx.policy.two_sample_alpha, 1e-12), 0.5))


def _tv(x: float) -> str:
    return f"{x:.3f}" if math.isfinite(x) and x <= 1 else "> 1 (no power)"


def describe(t: TwoSample) -> str:
    stats = "; ".join(f"{WHAT[s.name]} G {s.g:.1f} on {s.df} df (p {s.p:.2g}, detects TV {_tv(s.mde_tv)})"
                      for s in t.statistics)
    lo, hi = t.samples
    per = f"{lo}" if lo == hi else f"{lo}-{hi}"
    skipped = ""
    if t.skipped:
        skipped = (f"; not computed: {', '.join(WHAT[n] for n in t.skipped)} (a prompt needs 2+ "
                   f"outputs per arm whose categories repeat: more samples, --samples N)")
    return (f"{t.spec_outputs} outputs vs the baseline's {t.base_outputs} on {t.prompts} prompts "
            f"({per} per prompt and arm): {stats or 'no statistic computable'}{skipped}"
            f"; alpha {t.alpha:g} (Holm over {len(t.statistics)}, {t.permutations} shuffles of "
            f"the arm labels within prompts); detectable effects at {POWER:.0%} power")


def judge(r: ConfigResult, p) -> Check:
    return judge_sampled(r, "sampled_matches_baseline", lambda t: t.statistics, "no statistic could be computed",
                         describe, "the config's samples differ from the baseline's")


CHECK = CheckSpec(
    name="sampled_matches_baseline", label="two-sample", order=19, judge=judge, measure=measure,
    policy=POLICY,
    guards="speculative-sampling bugs at temperature > 0 seen through the tokens alone, on any "
           "engine (an OpenAI-compatible server without prompt logprobs included): an output "
           "distribution that moved from the baseline's",
    description="At temperature > 0 the config's samples and the baseline's samples of the same "
                "prompts (independent seeds) are draws from one distribution: first tokens, "
                "first-token prefixes, token and bigram counts compared by permutation tests "
                "within prompts (family-wise alpha, Holm).")
