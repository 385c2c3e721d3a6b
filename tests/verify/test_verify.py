"""Example-based unit tests of verify/: hand-worked numbers for each function."""
from __future__ import annotations

import math

import numpy as np
import pytest

from speccheck.verify import (END, Boundary, acceptance_of, acceptance_summary,
                              boundary_divergence, calibrate_thresholds, classify_divergence,
                              counter_problems, determinism, find_divergences, first_divergence,
                              margins, path_noise, prefix_agreement, rank_of, stop_tokens,
                              teacher_forced_agreement, teacher_forced_divergences,
                              text_similarity, tokens_per_iteration_views, unique_completions)

A = np.array


def test_first_divergence_and_prefix_agreement_examples():
    assert first_divergence(A([1, 2, 3]), A([1, 2, 4])) == 2
    assert first_divergence(A([1, 2, 3]), A([1, 2, 3, 9])) == 3
    assert first_divergence(A([]), A([5])) == 0
    assert first_divergence(A([7, 7]), A([7, 7])) is None
    assert prefix_agreement(A([1, 2, 3, 4]), A([1, 2, 9, 4])) == (2, 4)
    assert prefix_agreement(A([1, 2, 3, 4]), A([1, 2, 3])).fraction == 0.75
    assert prefix_agreement(A([]), A([])).fraction == 1.0
    with pytest.raises(ValueError, match="1-D"):
        first_divergence(np.zeros((2, 2)), A([1]))


def test_margins_and_rank_of():
    lp = A([[-0.1, -0.3, -2.0], [-1.0, -1.0, -5.0]])
    np.testing.assert_allclose(margins(lp), [0.2, 0.0])
    assert margins(A([-3.0, -0.5])) == pytest.approx(2.5)  # unsorted row
    with pytest.raises(ValueError, match="k >= 2"):
        margins(A([[-0.1]]))
    assert rank_of(7, A([3, 7, 9])) == 1
    assert rank_of(4, A([3, 7, 9])) is None


# baseline chose 10 over 11 by 0.01 nat; spec chose 11 over 10 by 0.02 nat
B_IDS, B_LP = A([10, 11, 12, 13]), A([-0.69, -0.70, -3.0, -4.0])
S_IDS, S_LP = A([11, 10, 12, 13]), A([-0.68, -0.70, -3.0, -4.0])


def test_classify_near_tie_low_confidence_high_confidence():
    c = classify_divergence(10, 11, B_IDS, B_LP, S_IDS, S_LP, tau_tie=0.05, tau_low=0.5)
    assert c.cls == "near_tie"
    assert (c.spec_rank_in_base, c.base_rank_in_spec) == (1, 1)
    assert c.base_margin == pytest.approx(0.01) and c.spec_margin == pytest.approx(0.02)
    assert c.base_gap == pytest.approx(0.01)
    # margins above tau_tie but within tau_low
    assert classify_divergence(10, 11, B_IDS, B_LP, S_IDS, S_LP, 0.005, 0.5).cls == "low_confidence"
    # margins above both
    assert classify_divergence(10, 11, B_IDS, B_LP, S_IDS, S_LP, 0.001, 0.005).cls == "high_confidence"
    # decisive baseline, undecided spec: low_confidence on the spec side's margin
    c = classify_divergence(10, 11, A([10, 12, 11]), A([-0.1, -2.0, -2.5]),
                            A([11, 12, 10]), A([-1.0, -1.05, -1.2]), 0.01, 0.5)
    assert (c.cls, c.spec_margin) == ("low_confidence", pytest.approx(0.05))
    # the spec token is the baseline's rank 4 and vice versa: at most low_confidence
    c = classify_divergence(10, 13, B_IDS, B_LP, A([13, 11, 12, 10]), S_LP, 1.0, 1.0)
    assert (c.cls, c.spec_rank_in_base, c.base_rank_in_spec) == ("low_confidence", 3, 3)
    # "or vice versa": the spec side's near-tie with the baseline token as its runner-up
    c = classify_divergence(10, 13, B_IDS, B_LP, A([13, 10, 11, 12]), S_LP, 0.05, 0.05)
    assert (c.cls, c.base_rank_in_spec) == ("near_tie", 1)
    # ... unless max_gap refuses it: the baseline put 13 3.31 nats below 10
    assert c.base_gap == pytest.approx(3.31)
    c = classify_divergence(10, 13, B_IDS, B_LP, A([13, 10, 11, 12]), S_LP, 0.05, 0.05, max_gap=1.0)
    assert c.cls == "high_confidence"
    assert classify_divergence(10, 11, B_IDS, B_LP, S_IDS, S_LP, 0.05, 0.5, max_gap=0.1).cls == "near_tie"
    # a spec token the baseline did not even rank: high_confidence whatever the taus
    c = classify_divergence(10, 99, B_IDS, B_LP, A([99, 10, 11, 12]), S_LP, 10.0, 10.0)
    assert (c.cls, c.spec_rank_in_base) == ("high_confidence", None)
    with pytest.raises(ValueError, match="not a divergence"):
        classify_divergence(10, 10, B_IDS, B_LP, S_IDS, S_LP, 0.1, 0.1)


def test_calibrate_thresholds_scales_with_noise():
    assert calibrate_thresholds(0.0, 4, 50, 1e-3, 1e-2) == (1e-3, 1e-2)
    assert calibrate_thresholds(0.01, 4, 50, 1e-3, 1e-2) == pytest.approx((0.04, 0.5))
    assert calibrate_thresholds(0.01, 4, 1, 0, 0) == pytest.approx((0.04, 0.04))  # tau_low >= tau_tie
    with pytest.raises(ValueError, match="noise"):
        calibrate_thresholds(float("nan"), 4, 50, 1e-3, 1e-2)


def test_path_noise_quantile_and_nan_safety():
    a = np.zeros(100)
    b = np.arange(100) / 1000.0  # |diff| = 0.000 .. 0.099
    assert path_noise(a, b, q=1.0) == pytest.approx(0.099)
    assert path_noise(a, b, q=0.5) == pytest.approx(0.0495)
    assert path_noise(A([0.0, np.nan, -np.inf]), A([0.5, 1.0, -np.inf]), q=1.0) == 0.5
    assert path_noise(A([]), A([])) == 0.0
    with pytest.raises(ValueError, match="same shape"):
        path_noise(A([1.0]), A([1.0, 2.0]))


def test_teacher_forced_agreement_goes_on_past_the_first_divergence():
    spec = A([5, 6, 7, 8])
    scored = A([[5, 1], [9, 6], [7, 1], [8, 2]])
    np.testing.assert_array_equal(teacher_forced_agreement(spec, scored), [True, False, True, True])
    with pytest.raises(ValueError, match="n = 4"):
        teacher_forced_agreement(spec, scored[:3])


def test_find_divergences_classifies_the_first_one_with_evidence():
    base = A([1, 10, 3])
    spec = A([1, 11, 4])
    b_ids = np.stack([A([1, 2, 3, 4]), B_IDS, A([3, 4, 5, 6])])
    s_ids = np.stack([A([1, 2, 3, 4]), S_IDS, A([4, 3, 5, 6])])
    b_lp = np.stack([A([-0.1, -3, -4, -5]), B_LP, A([-0.1, -3, -4, -5])])
    s_lp = np.stack([A([-0.1, -3, -4, -5]), S_LP, A([-0.1, -3, -4, -5])])
    [d] = find_divergences("p1", base, b_ids, b_lp, spec, s_ids, s_lp, 0.05, 0.5, noise=0.002)
    assert (d.prompt_id, d.position, d.base_token, d.spec_token, d.cls) == ("p1", 1, 10, 11, "near_tie")
    assert d.margin_in_noise == pytest.approx(5.0)
    assert d.base_topk[:2] == [(10, pytest.approx(-0.69)), (11, pytest.approx(-0.70))]
    assert d.context == ""
    [d] = find_divergences("p1", base, b_ids, b_lp, spec, s_ids, s_lp, 0.05, 0.5, noise=0.0)
    assert d.margin_in_noise == math.inf
    assert find_divergences("p1", base, b_ids, b_lp, base, b_ids, b_lp, 0.05, 0.5, 0.0) == []


def test_find_divergences_when_one_stream_stopped_early():
    ids = np.stack([A([1, 2]), A([2, 1])])
    lp = np.stack([A([-0.1, -3.0]), A([-0.2, -2.0])])
    [d] = find_divergences("p", A([1, 2]), ids, lp, A([1]), ids[:1], lp[:1], 1.0, 1.0, 0.01)
    assert (d.position, d.base_token, d.spec_token, d.cls) == (1, 2, END, "high_confidence")
    assert d.spec_topk == [] and d.base_topk == [(2, pytest.approx(-0.2)), (1, -2.0)]


def test_empty_streams_with_zero_width_top_k():
    """A completion with no tokens stores its top-k as [0, 0]; comparing it must still work."""
    ids = np.stack([A([1, 2]), A([2, 1])])
    lp = np.stack([A([-0.1, -3.0]), A([-0.2, -2.0])])
    empty_ids, empty_lp = np.zeros((0, 0), np.int32), np.zeros((0, 0), np.float32)
    [d] = find_divergences("p", A([], np.int32), empty_ids, empty_lp, A([1, 2]), ids, lp, 1.0, 1.0, 0.0)
    assert (d.position, d.base_token, d.spec_token, d.cls) == (0, END, 1, "high_confidence")
    assert teacher_forced_agreement(A([], np.int32), empty_ids).shape == (0,)
    assert teacher_forced_divergences("p", A([]), empty_ids, empty_lp, empty_ids, empty_lp, 1, 1, 0) == []


def test_teacher_forced_divergences_lists_every_disagreement():
    spec = A([10, 11, 12])
    s_ids = np.stack([A([10, 11]), A([11, 10]), A([12, 50])])
    s_lp = np.tile(A([-0.5, -0.6]), (3, 1))
    sc_ids = np.stack([A([11, 10]), A([10, 11]), A([12, 50])])
    sc_lp = np.tile(A([-0.5, -0.6]), (3, 1))
    divs = teacher_forced_divergences("p", spec, s_ids, s_lp, sc_ids, sc_lp, 0.2, 0.5, 0.01)
    assert [(d.position, d.base_token, d.spec_token, d.cls) for d in divs] == [
        (0, 11, 10, "near_tie"), (1, 10, 11, "near_tie")]


def test_determinism_and_unique_completions():
    r0 = [A([1, 2, 3]), A([4, 5])]
    r1 = [A([1, 2, 3]), A([4, 6])]
    res = determinism([r0, r0, r1])
    assert not res.identical and (res.n_runs, res.n_prompts) == (3, 2)
    assert res.mismatches == ((2, 1, 1),)
    assert determinism([r0, [a.copy() for a in r0]]).identical
    with pytest.raises(ValueError, match="run 1 has 1 prompts"):
        determinism([r0, r0[:1]])
    assert unique_completions([A([1, 2]), A([1, 2]), A([1, 3])]) == 2
    assert unique_completions([]) == 0


def test_text_similarity_examples():
    assert text_similarity("abc", "abc") == 1.0
    assert text_similarity("abcd", "abce") == pytest.approx(0.75)
    assert text_similarity("", "") == 1.0
    assert text_similarity("abc", "") == 0.0


def test_acceptance_summary_example_and_bad_counters():
    a = acceptance_summary(drafts=10, draft_tokens=30, accepted_tokens=15, accepted_per_pos=[8, 5, 2])
    assert a.tokens_per_iter == 2.5
    assert a.acceptance_rate == 0.5
    assert a.per_pos == (0.8, 0.5, 0.2)
    none = acceptance_summary(0, 0, 0, [])
    assert (none.tokens_per_iter, none.acceptance_rate, none.per_pos) == (1.0, 0.0, ())
    with pytest.raises(ValueError, match="accepted_tokens 31 > draft_tokens 30"):
        acceptance_summary(10, 30, 31, [10, 10, 10])
    with pytest.raises(ValueError, match="negative"):
        acceptance_summary(-1, 0, 0, [])

    class Counters:  # duck-typed like speccheck.types.SpecCounters
        drafts, draft_tokens, accepted_tokens, accepted_per_pos = 4, 8, 6, [4, 2]
    assert acceptance_of(Counters()).tokens_per_iter == 2.5


def test_unknown_gap_is_not_excused_in_either_order():
    """Found by the symmetry property: the baseline's chosen token (9) is outside its own
    top-k, so its gap is unknown (NaN); with max_gap set that must be high_confidence whichever
    side is called baseline (max(nan, x) and max(x, nan) differ)."""
    b_ids, b_lp = np.array([3, 5]), np.array([-0.5, -0.6])
    s_ids, s_lp = np.array([3, 9]), np.array([-0.5, -0.55])
    c = classify_divergence(9, 3, b_ids, b_lp, s_ids, s_lp, 0.1, 0.3, max_gap=1.0)
    r = classify_divergence(3, 9, s_ids, s_lp, b_ids, b_lp, 0.1, 0.3, max_gap=1.0)
    assert c.cls == r.cls == "high_confidence"
    assert math.isnan(c.base_gap) and c.spec_gap == pytest.approx(0.05)


def test_determinism_sees_logprob_drift_under_identical_tokens():
    toks = [np.array([1, 2, 3])]
    lp = [np.array([-0.1, -0.2, -0.3], np.float32)]
    same = determinism([toks, toks], [lp, lp])
    assert same.identical and same.logprobs_identical
    moved = determinism([toks, toks], [lp, [lp[0] + np.float32([0, 0.003, 0])]])
    assert moved.identical and not moved.logprobs_identical
    assert moved.logprob_mismatches[0][:3] == (1, 0, 1)
    assert moved.logprob_mismatches[0][3] == pytest.approx(0.003, rel=1e-3)
    # within the tolerance, and past the first token difference, nothing is counted
    assert determinism([toks, toks], [lp, [lp[0] + 1e-7]], logprob_tolerance=1e-6).logprobs_identical
    flipped = determinism([toks, [np.array([1, 9, 3])]], [lp, [lp[0] + np.float32([0, 1, 1])]])
    assert not flipped.identical and flipped.logprobs_identical


# --- counters and boundaries -------------------------------------------------------------------


def test_counter_problems_name_each_impossibility():
    ok = dict(drafts=4, draft_tokens=12, accepted_tokens=6, accepted_per_pos=[3, 2, 1], k=3)
    assert counter_problems(**ok, emitted=10, iterations=4) == []
    assert counter_problems(**ok, emitted=8, iterations=4) == []  # 2 accepted, cut at a stop
    assert counter_problems(**ok, emitted=10) == []  # steps unknown: every step drafted
    bonus = counter_problems(4, 12, 10, [3, 2, 1], 3, emitted=10, iterations=4)
    assert any("accepted tokens 10 != 6" in p for p in bonus)
    assert any("14 tokens after the first, but 10 were emitted" in p for p in bonus)
    assert any("increases" in p for p in counter_problems(4, 12, 6, [1, 2, 3], 3))
    assert any("x K 3 = 12 != draft tokens 10" in p for p in counter_problems(4, 10, 6, [3, 2, 1], 3))
    assert any("negative" in p for p in counter_problems(4, 12, -1, [], 3))
    assert any("> draft tokens" in p for p in counter_problems(1, 3, 4, [], 3))
    assert any("above drafts" in p for p in counter_problems(1, 3, 3, [2, 1, 0], 3))
    assert any("in only 3 verify steps" in p for p in counter_problems(**ok, iterations=3))
    # more tokens than the steps explain (no steps without a draft were counted)
    assert any("were emitted" in p for p in counter_problems(**ok, emitted=11))


def test_tokens_per_iteration_three_ways():
    v = tokens_per_iteration_views(100, 166, [42, 25, 15], 182, 100)
    assert v == pytest.approx({"counters": 2.66, "per-position rates": 1.82, "emitted tokens": 1.82})
    assert tokens_per_iteration_views(0, 0, [], 0, None)["counters"] is None


def test_stop_tokens_from_stopped_streams_only():
    assert stop_tokens([([1, 2, 9], "stop"), ([3, 9], "stop"), ([4, 5], "length")]) == {9}
    # a stop string ended a stream on an ordinary token (9) seen mid-stream elsewhere
    assert stop_tokens([([1, 2, 9], "stop"), ([2, 9, 3], "stop")]) == {3}


def test_boundaries():
    d = find_divergences("p", [1, 2, 3], *_rows([1, 2, 3]), [1, 2, 3, 4], *_rows([1, 2, 3, 4]),
                         0.1, 0.2, 0.01)
    b = boundary_divergence("p", [1, 2, 3], "length", [1, 2, 3, 4], "length", d[0], {9})
    assert isinstance(b, Boundary) and b.kind == "past_max_tokens" and not b.explained
    assert b.spec_past == (4,) and "ran past max_tokens at position 3" in b.describe()
    b = boundary_divergence("p", [1, 9], "stop", [1, 9, 5], "length", None, {9})
    assert b.kind == "past_end_of_sequence" and b.position == 2
    # the baseline itself went on past end-of-sequence (ignore_eos): not a violation
    assert boundary_divergence("p", [9, 1, 2], "length", [9, 1, 2], "length", None, {9}) is None
    b = boundary_divergence("p", [1, 2, 9], "stop", [1, 2], "length", None, {9})
    assert b.kind == "stops_early" and not b.explained
    b = boundary_divergence("p", [1, 2, 3], "stop", [1, 2, 3], "length", None, {9})
    assert b.kind == "finish_differs" and not b.explained
    assert boundary_divergence("p", [1, 2], "length", [1, 2], "length", None, {9}) is None


def _rows(tokens):
    ids = np.array([[t, t + 1] for t in tokens], np.int32).reshape(len(tokens), 2)
    return ids, np.tile(np.array([-0.1, -3.0], np.float32), (len(tokens), 1))


def test_end_of_sequence_after_a_flip_where_the_baseline_ran_to_max_tokens():
    """The baseline never stopped at end-of-sequence here (it may ignore it): a spec that
    reached one after a near-tie flip and went on is explained; past max_tokens never is."""
    b_ids = np.array([[1, 2], [2, 5], [3, 4]], np.int32)
    lp = np.tile(np.array([-0.1, -0.11], np.float32), (3, 1))
    s_ids = np.array([[1, 2], [5, 2], [9, 3]], np.int32)
    d = find_divergences("p", [1, 2, 3], b_ids, lp, [1, 5, 9], s_ids, lp, 0.1, 0.2, 0.01)
    assert d[0].cls == "near_tie"
    b = boundary_divergence("p", [1, 2, 3], "length", [1, 5, 9], "length", d[0], {9})
    assert b is None  # same length: the EOS was the last token
    s4 = np.vstack([s_ids, [[4, 3]]])
    d = find_divergences("p", [1, 2, 3], b_ids, lp, [1, 5, 9, 4], s4, np.vstack([lp, lp[:1]]),
                         0.1, 0.2, 0.01)
    b = boundary_divergence("p", [1, 2, 3], "length", [1, 5, 9, 4], "length", d[0], {9})
    assert b.kind == "past_max_tokens" and not b.explained
    b = boundary_divergence("p", [1, 2, 3, 7], "length", [1, 5, 9, 4], "length", d[0], {9})
    assert b.kind == "past_end_of_sequence" and b.explained
    b = boundary_divergence("p", [1, 2, 3, 9], "stop", [1, 5, 9, 4], "length", d[0], {9})
    assert b.kind == "past_end_of_sequence" and not b.explained


def test_sampled_divergence_is_classified_by_distribution_shift():
    """Two sampled runs of one seed that part: their distributions at the shared prefix tell
    numerics (within the path noise: near_tie / low_confidence) from a real change."""
    from speccheck.verify.margins import classify_sampled_divergence

    ids = np.array([3, 7, 1, 9])
    lp = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    assert classify_sampled_divergence(ids, lp, ids, lp + 0.01, 0.05, 0.2).cls == "near_tie"
    assert classify_sampled_divergence(ids, lp, ids[[1, 0, 2, 3]], lp[[1, 0, 2, 3]] + np.array(
        [0.1, -0.1, 0, 0]), 0.05, 0.2).cls == "low_confidence"
    moved = classify_sampled_divergence(ids, lp, ids, lp + np.array([0.0, 0.0, 0.9, 0.0]), 0.05, 0.2)
    assert moved.cls == "high_confidence" and moved.base_gap == pytest.approx(0.9)
    assert classify_sampled_divergence(ids, lp, ids + 100, lp, 0.05, 0.2).cls == "high_confidence"
