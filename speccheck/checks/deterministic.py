"""deterministic: every repeat of a config gives the first repeat's tokens (and logprobs)."""
from __future__ import annotations

from speccheck.checks import CheckSpec, PolicyKey
from speccheck.results import Check, ConfigResult

POLICY = (
    PolicyKey("require_deterministic", True,
              "every config must repeat token for token (in-process and fresh-process repeats)"),
    PolicyKey("require_deterministic_logprobs", True,
              "... and, where the tokens agree, with the same logprobs (|Δ| <= the tolerance): a "
              "kernel whose reduction order varies run to run moves every logprob but flips tokens "
              "only at near-ties, so tokens alone catch it by luck. Turn off for an engine whose "
              "kernel choice legitimately varies between processes (e.g. autotuning)."),
    PolicyKey("determinism_logprob_tolerance", 1e-6, "nats"),
)


def judge(r: ConfigResult, p) -> Check:
    if r.identical_runs is None:
        return Check("deterministic", not p.require_deterministic, "fewer than 2 stored runs to compare",
                     skipped=not p.require_deterministic)
    msg = (f"{r.repeats} runs identical token for token"
           + (", logprob for logprob" if p.require_deterministic_logprobs else "")
           if r.identical_runs else f"runs differ: {'; '.join(r.nondeterminism[:5])}")
    return Check("deterministic", r.identical_runs or not p.require_deterministic, msg)


CHECK = CheckSpec(
    name="deterministic", label="determinism", order=20, baseline=True, judge=judge, policy=POLICY,
    guards="run-to-run nondeterminism: reduction order varying in a kernel, state left over from an "
           "earlier request, a prefix-cache hit restoring the wrong state (vLLM #43559, #53912)",
    description="Every repeat, in the same process and in a fresh one, gives the first repeat's "
                "tokens, and their logprobs within the tolerance.")
