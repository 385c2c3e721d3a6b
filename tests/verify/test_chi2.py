"""verify/chi2.py against scipy.stats (chi2, ncx2) as the oracle."""
from __future__ import annotations

import pytest
from scipy import stats

from speccheck.verify.chi2 import chi2_isf, chi2_sf, ncx2_sf, noncentrality_for_power


@pytest.mark.parametrize("df", [1, 2, 3, 7, 30, 400, 3000])
@pytest.mark.parametrize("scale", [0.05, 0.5, 1.0, 1.5, 3.0])
def test_chi2_sf(df, scale):
    x = df * scale + 0.1
    assert chi2_sf(x, df) == pytest.approx(stats.chi2.sf(x, df), rel=1e-9, abs=1e-300)


@pytest.mark.parametrize("df", [1, 4, 63, 999])
@pytest.mark.parametrize("q", [0.5, 0.01, 1e-4])
def test_chi2_isf(df, q):
    assert chi2_isf(q, df) == pytest.approx(stats.chi2.isf(q, df), rel=1e-8)


@pytest.mark.parametrize("df", [1, 5, 60, 700])
@pytest.mark.parametrize("nc", [0.3, 4.0, 40.0, 300.0])
def test_ncx2_sf(df, nc):
    x = stats.chi2.isf(0.01, df)
    assert ncx2_sf(x, df, nc) == pytest.approx(stats.ncx2.sf(x, df, nc), rel=1e-8, abs=1e-14)


@pytest.mark.parametrize("df", [1, 9, 120, 2000])
@pytest.mark.parametrize("alpha", [0.01, 0.0025])
def test_noncentrality_gives_the_power(df, alpha):
    nc = noncentrality_for_power(df, alpha, 0.8)
    assert stats.ncx2.sf(stats.chi2.isf(alpha, df), df, nc) == pytest.approx(0.8, abs=1e-6)
