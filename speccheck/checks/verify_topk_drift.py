"""verify_topk_drift: the spec path's whole top-k, not only the chosen token, stays as close to
the baseline's prefill path as the baseline's own decode path does, position by position."""
from __future__ import annotations

import math

from speccheck.checks import CheckSpec, Context, PolicyKey
from speccheck.checks._evidence import LOGPROB_PAIRS
from speccheck.evidence import paired_topk_deltas
from speccheck.results import Check, ConfigResult
from speccheck.verify import FAIL, INCONCLUSIVE, TopkDrift, topk_drift_test

POLICY = (
    PolicyKey("topk_drift_max_ratio", 1.10,
              "per position, the mean |Δ logprob| over the top-k ids both rows list, spec path "
              "against the baseline's prefill path, may exceed the baseline decode path's by this "
              "typical ratio (Hodges-Lehmann of the log ratios) only within chance (one-sided "
              "signed-rank p >= topk_drift_alpha), at the positions where both saw the same "
              "context. Clean MTP K=3, DFlash K=7 and DFlash2 K=7 gave 1.03-1.04 on the default "
              "corpus; a GDN rollback skipped on the rare steps that accept K-1 drafts gave 1.12-1.14 "
              "(p <= 1e-13), a verify-path GDN output off by 2^-7 gave 2.4"),
    PolicyKey("topk_drift_alpha", 1e-3, "see topk_drift_max_ratio", hi=1.0),
    PolicyKey("topk_drift_look_closer", 0.05,
              "a ratio above topk_drift_max_ratio at topk_drift_alpha <= p < this is inconclusive: "
              "`speccheck run` escalates it to more prompts, and it fails if it stays so", hi=1.0),
)


def measure(ctx: Context) -> TopkDrift | None:
    base = next((r for r in ctx.baseline_runs if r.status == "ok"), None)
    if base is None or not ctx.runs:
        return None
    a, b, _ = paired_topk_deltas(base, ctx.suite.load_rescore("baseline", base.repeat), ctx.runs[0])
    p = ctx.policy
    return topk_drift_test(a, b, p.topk_drift_max_ratio, p.topk_drift_alpha,
                           max(p.topk_drift_look_closer, p.topk_drift_alpha))


def power_str(t: TopkDrift) -> str:
    at = max(t.detectable, t.max_ratio)
    return ("no power: too few shared positions" if math.isinf(t.detectable)
            else f"power: a ratio >= {at:.3f} would be found 80 % of the time at alpha {t.alpha:g}")


def judge(r: ConfigResult, p) -> Check:
    t: TopkDrift | None = r.measured.get("verify_topk_drift")
    if t is None:
        return Check("verify_topk_drift", False, "evidence missing: no complete baseline run")
    figures = (f"top-k |Δ| median {t.spec.median:.4f} nats vs the baseline decode path's "
               f"{t.reference.median:.4f} over {t.n} shared positions: typical ratio {t.ratio:.3f} "
               f"(max {t.max_ratio:.2f}), signed-rank p {t.p:.2g}; {power_str(t)}")
    if t.decision == FAIL:
        return Check("verify_topk_drift", False,
                     f"the spec path's top-k logprobs drifted from the baseline's beyond its own "
                     f"decode path (p {t.p:.2g} < alpha {t.alpha:g}): {figures}")
    if t.decision == INCONCLUSIVE:
        return Check("verify_topk_drift", False,
                     f"inconclusive: ratio {t.ratio:.3f} > {t.max_ratio:.2f} at p {t.p:.2g}, between "
                     f"alpha {t.alpha:g} and look-closer {t.look_closer:g}: {figures}", inconclusive=True)
    return Check("verify_topk_drift", True, figures)


CHECK = CheckSpec(
    name="verify_topk_drift", label="top-k drift", order=101, judge=judge, measure=measure,
    policy=POLICY, needs=(LOGPROB_PAIRS,),
    guards="slight verify-only numeric drift (a verify kernel's output off by a small factor) and "
           "hybrid state wrong after rare steps only (a rollback skipped on one acceptance count): "
           "both move every later logit a little and flip only near-ties",
    description="Where spec and baseline saw the same context, the spec path's top-k logprobs are "
                "no further from the baseline's prefill path than its own decode path is (paired "
                "by position, over every id both list; alpha and power stated; inconclusive "
                "escalates).")
