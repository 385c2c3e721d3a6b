"""Hypothesis property tests of verify/'s invariants (docs/design.md, what "agree" means)."""
from __future__ import annotations

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from speccheck.verify import (acceptance_summary, calibrate_thresholds, classify_divergence,
                              determinism, find_divergences, first_divergence, margins,
                              path_noise, prefix_agreement, same_output_acceptance,
                              teacher_forced_agreement,
                              teacher_forced_divergences, text_similarity, unique_completions)

#: this module's example count, on top of the session's profile (conftest.py: ci or dev) -- a
#: profile loaded here would replace that one for every test collected after this module
EXAMPLES = settings(max_examples=150)

VOCAB = 12
tokens = st.lists(st.integers(0, 5), max_size=24).map(lambda xs: np.array(xs, dtype=np.int32))
taus = st.floats(0, 6, allow_nan=False)
gaps = st.one_of(st.none(), st.floats(0, 6))


@st.composite
def topk_rows(draw, k=None):
    """One top-k row: distinct ids, logprobs sorted descending (ties allowed)."""
    k = k or draw(st.integers(2, 5))
    ids = draw(st.lists(st.integers(0, VOCAB - 1), min_size=k, max_size=k, unique=True))
    top = draw(st.floats(-8, 0))
    gaps = draw(st.lists(st.floats(0, 4), min_size=k - 1, max_size=k - 1))
    lp = top - np.concatenate([[0.0], np.cumsum(gaps)])
    return np.array(ids, dtype=np.int32), lp.astype(np.float32)


@st.composite
def divergent_pair(draw):
    """Two sides' top-k rows and two different chosen tokens (usually each side's top-1,
    sometimes any token, possibly outside the top-k)."""
    b_ids, b_lp = draw(topk_rows())
    s_ids, s_lp = draw(topk_rows())
    if draw(st.booleans()):  # same candidates, reordered: both tokens in both top-ks
        s_ids, s_lp = np.array(draw(st.permutations(b_ids.tolist())), np.int32), draw(topk_rows(len(b_ids)))[1]
    bt = draw(st.sampled_from([int(b_ids[0]), draw(st.integers(0, VOCAB + 2))]))
    stok = draw(st.sampled_from([int(s_ids[0]), draw(st.integers(0, VOCAB + 2))]))
    assume(bt != stok)
    return bt, stok, b_ids, b_lp, s_ids, s_lp


def _stream_with_topk(draw, n):
    """A token stream whose top-1 is its token, with a top-k of width 3 per position."""
    rows = [draw(topk_rows(k=3)) for _ in range(n)]
    ids = np.stack([r[0] for r in rows]) if rows else np.zeros((0, 3), np.int32)
    lp = np.stack([r[1] for r in rows]) if rows else np.zeros((0, 3), np.float32)
    return ids[:, 0].copy(), ids, lp


@EXAMPLES
@given(tokens)
def test_a_stream_agrees_fully_with_itself(a):
    assert first_divergence(a, a.copy()) is None
    assert prefix_agreement(a, a.copy()) == (len(a), len(a))
    assert prefix_agreement(a, a.copy()).fraction == 1.0
    assert teacher_forced_agreement(a, a.reshape(-1, 1)).all()
    assert determinism([[a], [a.copy()], [a.copy()]]).identical


@EXAMPLES
@given(tokens, tokens, tokens, st.integers(0, 5), st.integers(0, 5))
def test_first_divergence_is_exact_on_constructed_streams(prefix, tail_a, tail_b, x, y):
    assume(x != y)
    a = np.concatenate([prefix, [x], tail_a])
    b = np.concatenate([prefix, [y], tail_b])
    assert first_divergence(a, b) == len(prefix)
    assert first_divergence(b, a) == len(prefix)
    assert prefix_agreement(a, b).matched == len(prefix)


@EXAMPLES
@given(tokens, st.lists(st.integers(0, 5), min_size=1, max_size=8))
def test_first_divergence_when_one_stream_runs_on(prefix, more):
    longer = np.concatenate([prefix, more])
    assert first_divergence(prefix, longer) == len(prefix)
    assert prefix_agreement(longer, prefix) == (len(prefix), len(longer))


@EXAMPLES
@given(tokens, tokens)
def test_prefix_agreement_at_most_one_and_one_iff_equal(a, b):
    pa = prefix_agreement(a, b)
    assert 0 <= pa.matched <= pa.compared == max(len(a), len(b))
    assert 0.0 <= pa.fraction <= 1.0
    assert (pa.fraction == 1.0) == np.array_equal(a, b)
    assert pa == prefix_agreement(b, a)


@EXAMPLES
@given(divergent_pair(), taus, taus, gaps)
def test_classification_is_symmetric_under_swapping_sides(pair, tau_tie, tau_low, max_gap):
    bt, stok, b_ids, b_lp, s_ids, s_lp = pair
    c = classify_divergence(bt, stok, b_ids, b_lp, s_ids, s_lp, tau_tie, tau_low, max_gap)
    r = classify_divergence(stok, bt, s_ids, s_lp, b_ids, b_lp, tau_tie, tau_low, max_gap)
    assert c.cls == r.cls
    assert (c.base_margin, c.spec_margin) == (r.spec_margin, r.base_margin)
    assert (c.spec_rank_in_base, c.base_rank_in_spec) == (r.base_rank_in_spec, r.spec_rank_in_base)


@EXAMPLES
@given(divergent_pair(), taus, taus, gaps)
def test_a_token_outside_the_other_top_k_is_always_high_confidence(pair, tau_tie, tau_low, max_gap):
    bt, stok, b_ids, b_lp, s_ids, s_lp = pair
    c = classify_divergence(bt, stok, b_ids, b_lp, s_ids, s_lp, tau_tie, tau_low, max_gap)
    if stok not in b_ids or bt not in s_ids:
        assert c.cls == "high_confidence"
    else:
        assert c.spec_rank_in_base is not None and c.base_rank_in_spec is not None


@EXAMPLES
@given(divergent_pair(), taus, taus, st.floats(0, 6), st.floats(0, 6), gaps, st.floats(0, 6))
def test_raising_tau_never_makes_a_divergence_worse(pair, tau_tie, tau_low, d_tie, d_low,
                                                    max_gap, d_gap):
    bt, stok, b_ids, b_lp, s_ids, s_lp = pair
    before = classify_divergence(bt, stok, b_ids, b_lp, s_ids, s_lp, tau_tie, tau_low, max_gap)
    looser_gap = None if max_gap is None else max_gap + d_gap
    for t_tie, t_low, t_gap in ((tau_tie + d_tie, tau_low, max_gap), (tau_tie, tau_low + d_low, max_gap),
                                (tau_tie, tau_low, looser_gap), (tau_tie, tau_low, None),
                                (tau_tie + d_tie, tau_low + d_low, looser_gap)):
        after = classify_divergence(bt, stok, b_ids, b_lp, s_ids, s_lp, t_tie, t_low, t_gap)
        assert after.severity <= before.severity


@EXAMPLES
@given(topk_rows(), topk_rows(), st.integers(0, 4), taus, taus)
def test_small_base_margin_second_choice_flip_is_a_near_tie(base, spec, where, tau_tie, tau_low):
    """The spec token is the baseline's runner-up within tau_tie (and the baseline token is
    in the spec's top-k): the textbook kernel-noise flip."""
    (b_ids, b_lp), (s_ids, s_lp) = base, spec
    bt, stok = int(b_ids[0]), int(b_ids[1])
    if bt not in s_ids:  # put the baseline token somewhere in the spec's top-k
        s_ids = s_ids.copy()
        s_ids[where % len(s_ids)] = bt
    tau = float(margins(b_lp)) + tau_tie
    c = classify_divergence(bt, stok, b_ids, b_lp, s_ids, s_lp, tau, tau_low)
    assert c.cls == "near_tie"
    assert c.spec_rank_in_base == 1


@st.composite
def base_spec_scored(draw):
    """Baseline and spec streams (with top-k), and a teacher-forced scoring of the spec stream
    whose top-1 equals the baseline on their common prefix and is arbitrary after it."""
    nb, ns = draw(st.integers(0, 12)), draw(st.integers(1, 12))
    base, b_ids, b_lp = _stream_with_topk(draw, nb)
    spec, s_ids, s_lp = _stream_with_topk(draw, ns)
    common = draw(st.integers(0, min(nb, ns)))  # force a shared prefix of this length
    spec[:common] = base[:common]
    s_ids[:common] = b_ids[:common]
    _, sc_ids, sc_lp = _stream_with_topk(draw, ns)
    p = first_divergence(base, spec)
    p = min(nb, ns) if p is None else p
    sc_ids[:p] = b_ids[:p]
    sc_lp[:p] = b_lp[:p]
    return base, b_ids, b_lp, spec, s_ids, s_lp, sc_ids, sc_lp


@EXAMPLES
@given(base_spec_scored())
def test_teacher_forced_agreement_at_least_prefix_agreement(data):
    base, b_ids, b_lp, spec, s_ids, s_lp, sc_ids, sc_lp = data
    tf = teacher_forced_agreement(spec, sc_ids)
    assert tf.mean() >= prefix_agreement(base, spec).fraction
    # and the divergence list is exactly the disagreeing positions
    divs = teacher_forced_divergences("p", spec, s_ids, s_lp, sc_ids, sc_lp, 0.1, 0.5, 0.01)
    assert [d.position for d in divs] == list(np.flatnonzero(~tf))
    assert all(d.base_token == sc_ids[d.position, 0] != d.spec_token for d in divs)


@EXAMPLES
@given(base_spec_scored())
def test_find_divergences_reports_the_first_divergence_only(data):
    base, b_ids, b_lp, spec, s_ids, s_lp, _, _ = data
    divs = find_divergences("p", base, b_ids, b_lp, spec, s_ids, s_lp, 0.1, 0.5, 0.01)
    p = first_divergence(base, spec)
    assert [d.position for d in divs] == ([] if p is None else [p])
    assert find_divergences("p", base, b_ids, b_lp, base, b_ids, b_lp, 0.1, 0.5, 0.01) == []


@EXAMPLES
@given(st.lists(tokens, min_size=1, max_size=6))
def test_unique_completions_is_one_iff_all_equal(streams):
    all_equal = all(np.array_equal(streams[0], s) for s in streams)
    assert (unique_completions(streams) == 1) == all_equal
    assert 1 <= unique_completions(streams) <= len(streams)
    assert determinism([[s] for s in streams]).identical == all_equal


@st.composite
def valid_counters(draw):
    k = draw(st.integers(1, 12))
    drafts = draw(st.integers(0, 200))
    per_pos = [draw(st.integers(0, drafts)) for _ in range(k)]
    per_pos = sorted(per_pos, reverse=True)  # a position is reached only if the earlier were accepted
    accepted = sum(per_pos)
    draft_tokens = k * drafts
    return k, drafts, draft_tokens, accepted, per_pos


@EXAMPLES
@given(valid_counters())
def test_tokens_per_iteration_within_one_and_one_plus_k(counters):
    k, drafts, draft_tokens, accepted, per_pos = counters
    a = acceptance_summary(drafts, draft_tokens, accepted, per_pos)
    assert 1.0 <= a.tokens_per_iter <= 1.0 + k
    assert 0.0 <= a.acceptance_rate <= 1.0
    assert all(0.0 <= x <= 1.0 for x in a.per_pos)
    if drafts:
        assert np.isclose(a.tokens_per_iter, 1.0 + sum(a.per_pos))


per_prompt = st.dictionaries(st.sampled_from("abcdefgh"), st.tuples(
    st.integers(0, 50), st.integers(0, 7), st.sampled_from(["x", "y"])), max_size=8).map(
    lambda d: {p: (n, min(a, 7 * n), o) for p, (n, a, o) in d.items()})  # accepted <= K x drafts


@EXAMPLES
@given(per_prompt, per_prompt)
def test_same_output_acceptance_reads_only_prompts_whose_output_matches(today, golden):
    """Changing any prompt whose output differs (or is missing on one side) changes nothing;
    the same counters on both sides give equal figures; shared never exceeds the golden's."""
    r = same_output_acceptance(today, golden)
    other = {p: (v[0] + 3, v[1], v[2]) for p, v in today.items()
             if p not in golden or golden[p][2] != v[2]}
    assert same_output_acceptance({**today, **other}, golden) == r
    if r is not None:
        assert 1 <= r.shared <= r.prompts == len(golden)
        assert 1.0 <= min(r.today, r.golden) and max(r.today, r.golden) <= 8.0
    mine = same_output_acceptance(golden, golden)
    assert (mine is None) == (not any(v[0] for v in golden.values()))
    assert mine is None or mine.today == mine.golden


finite_lp = st.floats(-30, 0, allow_nan=False)


@EXAMPLES
@given(st.lists(st.one_of(finite_lp, st.just(float("nan")), st.just(float("-inf"))), max_size=40),
       st.floats(0, 1))
def test_path_noise_of_identical_arrays_is_zero(xs, q):
    x = np.array(xs, dtype=np.float32)
    assert path_noise(x, x.copy(), q) == 0.0


@EXAMPLES
@given(st.lists(st.tuples(finite_lp, finite_lp), min_size=1, max_size=40), st.floats(0, 1))
def test_path_noise_is_symmetric_and_bounded_by_max_difference(pairs, q):
    a, b = (np.array(x) for x in zip(*pairs))
    n = path_noise(a, b, q)
    assert n == path_noise(b, a, q)
    assert 0.0 <= n <= np.abs(a - b).max() + 1e-12


@EXAMPLES
@given(st.floats(0, 1), st.floats(0, 1), st.floats(0, 50), st.floats(0, 50), st.floats(0, 1), st.floats(0, 1))
def test_thresholds_grow_with_noise_and_respect_floors(n1, n2, m_tie, m_low, f_tie, f_low):
    lo, hi = sorted((n1, n2))
    t_lo = calibrate_thresholds(lo, m_tie, m_low, f_tie, f_low)
    t_hi = calibrate_thresholds(hi, m_tie, m_low, f_tie, f_low)
    assert t_lo[0] <= t_hi[0] and t_lo[1] <= t_hi[1]
    assert t_lo[0] >= f_tie and t_lo[1] >= f_low and t_lo[1] >= t_lo[0]


@EXAMPLES
@given(st.text(max_size=30), st.text(max_size=30))
def test_text_similarity_symmetric_bounded_and_one_for_equal(a, b):
    s = text_similarity(a, b)
    assert s == text_similarity(b, a)
    assert 0.0 <= s <= 1.0
    assert text_similarity(a, a) == 1.0
    if a != b:
        assert s < 1.0


@EXAMPLES
@given(total=st.integers(1, 400), floor=st.floats(0.5, 0.999), data=st.data())
def test_below_floor_p_is_the_binomial_tail_and_falls_with_fewer_agreements(total, floor, data):
    """The agreement floor's p-value: 1 at or above the floor, else P(X <= agree) for
    X ~ Binomial(total, floor) (checked against the sum of exact terms), and never larger for
    fewer agreements."""
    from math import comb

    from speccheck.verify import below_floor_p
    agree = data.draw(st.integers(0, total))
    p = below_floor_p(agree, total, floor)
    if agree >= total * floor:
        assert p == 1.0
    else:
        exact = sum(comb(total, i) * floor**i * (1 - floor) ** (total - i) for i in range(agree + 1))
        assert abs(p - exact) <= 1e-9 + 1e-6 * exact
    if agree > 0:
        assert below_floor_p(agree - 1, total, floor) <= p
