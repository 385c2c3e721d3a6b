"""sampled_matches_target: at temperature > 0 the sampled tokens are draws from the target's own
distribution at their prefixes (randomized PIT uniform and independent, log-likelihood
martingale centred)."""
from __future__ import annotations

from speccheck.checks import CheckSpec, Context, PolicyKey
from speccheck.checks._evidence import judge_sampled
from speccheck.results import Check, ConfigResult
from speccheck.store import StoreError
from speccheck.verify.sampled import POWER, SampledFit, fit

POLICY = (
    PolicyKey("sampled_alpha", 0.01,
              "family-wise false-alarm rate of the distribution check per config (Holm over its "
              "PIT-uniformity, PIT-independence and log-likelihood martingale tests)", hi=0.5),
)


def measure(ctx: Context) -> SampledFit | str | None:
    """The tests over the first repeat's scored positions (None: a greedy suite; a string:
    why the evidence is missing)."""
    if ctx.runs is None or not _sampled(ctx):
        return None
    try:
        scores = ctx.suite.load_sampled_scores(ctx.config, 0)
    except StoreError as e:
        return str(e)
    if scores is None:
        return ("no teacher-forced scores of the sampled positions (the engine cannot give the "
                "target's logprobs there, or the run stopped before scoring): "
                f"{ctx.suite.resume_command(ctx.config)}")
    return fit(list(scores.values()), min(max(ctx.policy.sampled_alpha, 1e-12), 0.5))


def _sampled(ctx: Context) -> bool:
    from speccheck.types import sampling_of

    return sampling_of(ctx.suite.meta.get("engine_args")) is not None


def describe(f: SampledFit) -> str:
    return (f"{f.positions} sampled tokens of {f.outputs} outputs: PIT KS D {f.ks_d:.3f} "
            f"(p {f.ks_p:.2g}), log-likelihood martingale z {f.z_loglik:+.2f} (p {f.loglik_p:.2g}), "
            f"PIT lag-1 z {f.z_serial:+.2f} (p {f.serial_p:.2g})"
            + (f", {f.outside_support} outside the target's support" if f.outside_support else "")
            + (f", {f.boundary} at its nucleus boundary" if f.boundary else "")
            + (f", {f.within_topk} tested within the scored top-k (the nucleus reaches past it)"
               if getattr(f, "within_topk", 0) else "")
            + (f", {f.unidentified} left out (the scorer's top-k logprobs do not identify the "
               f"sampling distribution there)" if getattr(f, "unidentified", 0) else "")
            + f"; alpha {f.alpha:g} (Holm); detects at {POWER:.0%} power a total variation of "
            f"{f.mde_tv:.3f} per token along the probability order, or a mean log-likelihood "
            f"shift of {f.mde_nats:.3f} nats per token")


def judge(r: ConfigResult, p) -> Check:
    return judge_sampled(r, "sampled_matches_target", lambda f: f.positions, "no sampled position could be tested",
                         describe, "the sampled tokens are not draws from the target's distribution")


CHECK = CheckSpec(
    name="sampled_matches_target", label="distribution", order=18, baseline=True, judge=judge,
    measure=measure, policy=POLICY,
    guards="speculative-sampling bugs at temperature > 0: a residual not renormalised or taken as "
           "p, temperature / top-p applied to the target or the drafter only, a seed reused "
           "across steps, a DFlash2 selector whose acceptance reads another q than it drew from",
    description="At temperature > 0 each sampled token is a draw from the target's own "
                "distribution at its prefix: the randomized PIT over tokens ordered by probability "
                "is uniform and independent, and the log-likelihood minus the negative entropy is "
                "a zero-mean martingale (family-wise alpha, Holm).")
