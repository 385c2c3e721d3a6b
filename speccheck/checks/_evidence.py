"""Evidence several checks need, each with the one message its absence fails with."""
from __future__ import annotations

from speccheck.checks import Evidence
from speccheck.evidence import RESUME

COMPARED = Evidence(
    "baseline comparison", lambda r: r.prompts > 0,
    lambda r: "no prompt was compared with a baseline output")

RESCORED = Evidence(
    "teacher-forced rescoring", lambda r: not r.missing_evidence,
    lambda r: "; ".join(r.missing_evidence))

LOGPROB_PAIRS = Evidence(
    "reported logprobs against the baseline's", lambda r: r.logprobs is not None,
    lambda r: "no teacher-forced rescoring of this config, so its reported logprobs cannot be "
              f"checked; {RESUME}", blocking=True)

PATH_NOISE = Evidence(
    "the engine's path noise", lambda r: r.noise_missing is None,
    lambda r: f"the engine's path noise is unmeasured ({r.noise_missing}): reported logprobs "
              "cannot be judged against it", blocking=True)
