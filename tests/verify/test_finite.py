"""Logprobs that cannot be (verify/finite.py): each problem named with its positions, so a
gate check fails with a message rather than a traceback or a silent pass; the store's
padding (id -1, logprob -inf) is never a problem."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from speccheck.engines.vllm import topk_arrays
from speccheck.verify.finite import (
    POSITIVE_TOL,
    find_logprob_problems,
    logprob_problems,
)

TOK = np.array([5, 2, 4], np.int32)
LP = np.array([-0.1, -0.6, -0.01], np.float32)
IDS = np.array([[5, 3, 9], [2, 7, 1], [4, 8, -1]], np.int32)
LPS = np.array([[-0.1, -3.0, -4.0], [-0.6, -0.9, -4.0], [-0.01, -5.0, -np.inf]], np.float32)


def kinds(*args, **kw) -> list[str]:
    return [p.kind for p in find_logprob_problems(*args, **kw)]


def test_clean_completion_with_padding_has_no_problem():
    assert logprob_problems(TOK, LP, IDS, LPS) == []
    assert logprob_problems([], [], np.zeros((0, 3)), np.zeros((0, 3))) == []


def test_the_vllm_engines_own_padding_is_clean():
    """Rows built the way the vLLM engine stores them (fewer entries than k: -1 / -inf)."""
    positions = [{"5": {"logprob": -0.1}, "3": {"logprob": -2.5}}, {"2": {"logprob": -0.2}}]
    ids, lps, own = topk_arrays(positions, [5, 2], 4)
    assert ids[1].tolist() == [2, -1, -1, -1]
    assert logprob_problems([5, 2], own, ids, lps) == []


def test_non_finite_chosen_logprobs_are_named_by_position():
    lp = LP.copy()
    lp[0], lp[2] = np.nan, -np.inf
    got = logprob_problems(TOK, lp, IDS, LPS)
    assert got == ["chosen-token logprob is NaN at position 0",
                   "chosen-token logprob is -inf (probability 0 for a token it chose) at position 2"]
    lp = LP.copy()
    lp[1] = np.inf
    assert kinds(TOK, lp, IDS, LPS) == ["logprob_posinf"]


def test_short_arrays_say_which_positions_have_nothing():
    assert logprob_problems(TOK, LP[:1], IDS, LPS) == [
        "1 chosen-token logprobs for 3 tokens (positions 1-2 have none)"]
    assert logprob_problems(TOK, LP, IDS[:2], LPS[:2]) == ["2 top-k rows for 3 tokens (position 2 has none)"]
    assert kinds(TOK[:2], LP, IDS, LPS) == ["logprob_count", "topk_count"]  # more rows than tokens
    assert kinds(TOK, LP, IDS, LPS[:, :2]) == ["topk_shape"]
    assert kinds(TOK, LP, np.zeros((3, 0)), np.zeros((3, 0))) == ["topk_empty"]


def test_positive_logprobs_beyond_tolerance():
    lp, lps = LP.copy(), LPS.copy()
    lp[0] = lps[0, 0] = POSITIVE_TOL / 2  # float32 rounding at a certain token: fine
    lps[0, 1:] = [-9.0, -10.0]  # (and the rest of a certain token's row all but 0)
    assert logprob_problems(TOK, lp, IDS, lps) == []
    lp[1] = lps[1, 0] = 0.3  # a probability above 1: its row's mass is above 1 too
    assert kinds(TOK, lp, IDS, lps) == ["logprob_positive", "topk_positive", "topk_mass"]


def test_a_topk_whose_probabilities_add_up_past_one_is_named():
    """Five entries of -0.1 each (a mass of 4.5) are not one distribution's; bf16-rounded
    entries of a real one (mass 1.005) are."""
    ids = np.array([[1, 2, 3, 5, 9]])  # exact ties in lowest-id order
    assert kinds([1], [-0.1], ids, np.full((1, 5), -0.1)) == ["topk_mass"]
    real = np.log(np.array([[0.6, 0.3, 0.05, 0.03, 0.02]])) + 0.005
    assert logprob_problems([1], real[:, 0], ids, real) == []


def test_topk_problems_each_named():
    cases = {
        "topk_nan": (1, 2, np.nan, None),
        "topk_posinf": (0, 2, np.inf, None),
        "topk_neginf": (0, 2, -np.inf, None),
        "topk_bad_pad": (2, 2, -7.0, None),
        "topk_bad_id": (1, 2, None, -3),
        "topk_duplicate": (0, 2, None, 3),
        "topk_order": (0, 2, -1.0, None),
        "topk_tie_order": (0, 2, -3.0, 1),
    }
    for kind, (r, c, lp, tid) in cases.items():
        ids, lps = IDS.copy(), LPS.copy()
        if lp is not None:
            lps[r, c] = lp
        if tid is not None:
            ids[r, c] = tid
        got = kinds(TOK, LP, ids, lps)
        assert kind in got, (kind, got)
        msg = next(str(p) for p in find_logprob_problems(TOK, LP, ids, lps) if p.kind == kind)
        assert msg.endswith(f"at position {r}")


def test_padding_before_a_real_entry_and_rows_without_one():
    ids, lps = IDS.copy(), LPS.copy()
    ids[2] = [-1, 4, 8]
    lps[2] = [-np.inf, -0.01, -5.0]
    assert "topk_pad_order" in kinds(TOK, LP, ids, lps)
    ids[1], lps[1] = -1, -np.inf
    assert "topk_no_entry" in kinds(TOK, LP, ids, lps)


def test_chosen_above_its_own_top1_means_the_topk_is_not_the_top():
    lp = LP.copy()
    lp[1] = -0.3
    assert logprob_problems(TOK, lp, IDS, LPS) == [
        (f"chosen-token logprob above its own top-1's (by more than {POSITIVE_TOL:g}): the top-k "
         "is not the top at position 1")]


def test_many_positions_are_listed_briefly():
    n = 12
    lp = np.full(n, np.nan)
    ids = np.tile([[1, 2]], (n, 1))
    lps = np.tile([[-0.1, -3.0]], (n, 1))
    assert logprob_problems(np.ones(n), lp, ids, lps) == [
        "chosen-token logprob is NaN at positions 0, 1, 2, 3, 4 (+7 more)"]


@st.composite
def clean(draw):
    """A completion as engines store it: canonical rows (best first, ties by lowest id),
    some rows padded at the end, the chosen token in its row."""
    n = draw(st.integers(0, 8))
    k = draw(st.integers(2, 5))
    ids = np.full((n, k), -1, np.int64)
    lps = np.full((n, k), -np.inf, np.float32)
    tok, own = [], []
    for r in range(n):
        m = draw(st.integers(1, k))
        row_ids = draw(st.lists(st.integers(0, 50), min_size=m, max_size=m, unique=True))
        # one distribution's probabilities (weights over a total that leaves room for the
        # tokens not listed; equal weights make exact ties)
        weights = draw(st.lists(st.integers(1, 4), min_size=m, max_size=m))
        total = sum(weights) + draw(st.integers(0, 4))
        row_lp = sorted((float(np.log(w / total)) for w in weights), reverse=True)
        pairs = sorted(zip(row_ids, row_lp), key=lambda x: (-x[1], x[0]))
        ids[r, :m] = [t for t, _ in pairs]
        lps[r, :m] = [lp for _, lp in pairs]
        j = draw(st.integers(0, m - 1))
        tok.append(pairs[j][0])
        own.append(pairs[j][1])
    return np.array(tok, np.int64), np.array(own, np.float32), ids, lps


@settings(max_examples=200, deadline=None)
@given(clean(), st.data())
def test_clean_data_has_no_problem_and_one_planted_fault_is_found_where_planted(c, data):
    tok, own, ids, lps = c
    assert logprob_problems(tok, own, ids, lps) == []
    if not len(tok):
        return
    r = data.draw(st.integers(0, len(tok) - 1))
    fault = data.draw(st.sampled_from(["nan_own", "nan_topk", "pos_own", "drop_row"]))
    own, lps = own.copy(), lps.copy()
    if fault == "nan_own":
        own[r] = np.nan
    elif fault == "nan_topk":
        lps[r, data.draw(st.integers(0, lps.shape[1] - 1))] = np.nan
    elif fault == "pos_own":
        own[r] = 0.5
    else:
        ids, lps, r = ids[:-1], lps[:-1], len(tok) - 1
    problems = find_logprob_problems(tok, own, ids, lps)
    assert problems
    assert any(r in p.positions or f"position {r} has none" in str(p) for p in problems)

