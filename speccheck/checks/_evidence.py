"""Evidence several checks need, each with the one message its absence fails with."""
from __future__ import annotations

from typing import Callable

from speccheck.checks import Evidence
from speccheck.evidence import RESUME
from speccheck.results import Check, ConfigResult

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


def judge_sampled(r: ConfigResult, name: str, tested: Callable[[object], bool], untested: str,
                  describe: Callable[[object], str], differs: str) -> Check:
    """A distribution check's verdict from what its measure stored: skipped on a greedy suite
    (nothing sampled to judge); failed where its evidence is missing or nothing could be
    tested (``untested`` says why), or where its tests rejected (``differs`` says what)."""
    got = r.measured.get(name)
    if got is None:
        return Check(name, True, "not exercised: a greedy suite (run with --temperature > 0)", skipped=True)
    if isinstance(got, str):
        return Check(name, False, "evidence missing: " + got)
    if not tested(got):
        return Check(name, False, f"evidence missing: {untested}: " + describe(got))
    if got.passed:
        return Check(name, True, describe(got))
    return Check(name, False, f"{differs} ({', '.join(got.rejected)} rejected): " + describe(got))
