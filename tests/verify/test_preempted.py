"""The preempted requests' acceptance test: stratified per request, two-sided."""
import math

from speccheck.types import SpecCounters
from speccheck.verify.preempted import continuation_trials, preempted_acceptance


def _c(drafts, per):
    return SpecCounters(drafts=drafts, draft_tokens=drafts * len(per), accepted_tokens=sum(per),
                        accepted_per_pos=list(per))


def test_trials_count_positions_reached():
    assert continuation_trials(10, [6, 3, 1]) == (10, 10 + 6 + 3)
    assert continuation_trials(4, []) == (0, 4)


def test_the_same_counters_are_no_change():
    r = preempted_acceptance([("a", _c(17, [7, 5, 2, 2, 1, 0, 0]), _c(17, [7, 5, 2, 2, 1, 0, 0]))])
    assert r.change == 0 and abs(r.z) < 1e-9 and r.p > 0.99
    assert not r.significant(0.05, 0.05)


def test_a_cold_drafter_after_the_recompute_is_caught_and_a_shifted_step_is_not():
    free = _c(17, [7, 5, 2, 2, 1, 0, 0])
    cold = preempted_acceptance([("a", _c(24, [4, 2, 0, 0, 0, 0, 0]), free),
                                 ("b", _c(22, [5, 3, 0]), _c(16, [6, 6, 4]))])
    assert cold.change < -0.5 and cold.p < 0.01 and cold.significant(0.05, 0.05)
    shifted = preempted_acceptance([("a", _c(16, [7, 5, 2, 2, 1, 0, 0]), free)])
    assert shifted.change > 0 and shifted.p > 0.5 and not shifted.significant(0.05, 0.05)


def test_a_rise_is_a_finding_too():
    r = preempted_acceptance([("a", _c(10, [10, 10, 9]), _c(20, [8, 4, 1]))])
    assert r.change > 0.5 and r.z > 0 and r.significant(0.05, 0.05)


def test_no_trials_is_no_test():
    r = preempted_acceptance([("a", _c(0, [0, 0]), _c(5, [1, 0]))])
    assert math.isnan(r.p) and not r.significant(0.05, 0.05)
