"""verify/roots.py: bisection finds where a monotone predicate turns False, from any start."""
from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

from speccheck.verify.roots import last_true


@given(st.floats(1e-6, 1e6), st.floats(1e-3, 1e3))
def test_last_true_finds_the_threshold(c, hi):
    assert last_true(lambda x: x < c, hi, 1e-12) == pytest.approx(c, rel=1e-9)


@given(st.floats(1e-6, 0.5), st.floats(0.5, 200))
def test_inverting_a_tail_matches_scipy(q, df):
    """The chi-squared quantile by bisection on scipy's own tail: scipy's isf (oracle)."""
    x = last_true(lambda t: stats.chi2.sf(t, df) > q, max(1.0, df), 1e-12)
    assert x == pytest.approx(stats.chi2.isf(q, df), rel=1e-8)
    assert math.isfinite(x)
