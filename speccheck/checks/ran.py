"""ran: every planned run of the config is stored and completed."""
from __future__ import annotations

from speccheck.checks import CheckSpec
from speccheck.results import Check, ConfigResult


def judge(r: ConfigResult, p) -> Check:
    ran = (["engine failure: " + "; ".join(r.failed_runs)] if r.failed_runs else []) + r.missing
    return Check("ran", not ran, "\n".join(ran) or "all planned runs completed")


CHECK = CheckSpec(
    name="ran", label=None, order=10, baseline=True, judge=judge,
    guards="a crash, an out-of-memory kill or a stopped run that would leave a config unjudged",
    description="Every run the plan asked for (repeats, fresh process, the corpus all at once, "
                "rescoring, attribution) is stored and complete.")
