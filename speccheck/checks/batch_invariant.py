"""batch_invariant: each prompt inside a batch of all the others gives its tokens alone."""
from __future__ import annotations

from speccheck.checks import CheckSpec, PolicyKey
from speccheck.checks._text import NOT_INVARIANT, fmt_div, pct, untrusted_tau
from speccheck.results import Check, ConfigResult

POLICY = (
    PolicyKey("require_batch_invariant", False,
              "with a run of the corpus all at once: each prompt inside that batch must give "
              "exactly its tokens alone (batch invariance, which few engines offer); when false "
              "only high-confidence changes fail"),
)

NO_RUN = "no run of the corpus all at once (speccheck run --concurrent N)"


def judge(r: ConfigResult, p) -> Check:
    """Unless the policy asks for exact invariance, only high-confidence changes fail (at most
    ``max_high_confidence``); where the baseline is not invariant either, a spec config is
    judged against that engine."""
    t = r.together
    if t is None:
        return Check("batch_invariant", True, NO_RUN, skipped=True)
    figures = (f"{t.exact}/{t.prompts} prompts exact inside a batch of {t.requests}, prefix "
               f"{pct(t.prefix_agreement)}, {len(t.divergences)} divergence(s), "
               f"{len(t.high)} high-confidence")
    problems = t.high if not p.require_batch_invariant else t.divergences
    if p.require_batch_invariant and t.baseline_not_invariant:  # judged against its engine
        problems = [d for d in t.divergences if d.cls != "near_tie"]
        figures += f"; the baseline is not batch-invariant either: {NOT_INVARIANT}"
    excused = len(t.divergences) - len(t.high) if not p.require_batch_invariant else 0
    unsure = [untrusted_tau(excused, r.noise_missing)] if r.noise_missing and excused else []
    return Check("batch_invariant", len(problems) <= (0 if p.require_batch_invariant
                                                        else p.max_high_confidence) and not unsure,
                 "; ".join(unsure + [figures]) + "".join("\n    " + fmt_div(d) for d in problems[:5]))


CHECK = CheckSpec(
    sampled="reported",
    name="batch_invariant", label="all at once", order=30, baseline=True, judge=judge, policy=POLICY,
    guards="state shared between the rows of a batch: padded rows aliasing request 0's state slot "
           "(SGLang #27202), wrong outputs only when requests run together (vLLM #42728)",
    description="Each prompt inside a batch of all the others (and of copies of itself) gives its "
                "tokens alone, up to classified near-ties unless exact invariance is required.")
