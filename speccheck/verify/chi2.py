"""The chi-squared distribution, central and noncentral, in plain Python: p-values of
contingency tests and the noncentrality a test needs for a stated power (the minimum
detectable effects of verify/two_sample.py). scipy is a test-only dependency; the tests hold
these to scipy.stats.chi2 / ncx2."""
from __future__ import annotations

import math

from speccheck.verify.roots import last_true


def gammaincc(s: float, x: float) -> float:
    """Regularised upper incomplete gamma Q(s, x) = Gamma(s, x) / Gamma(s): the series below
    s + 1, the continued fraction (modified Lentz) above (Numerical Recipes 6.2)."""
    if x <= 0:
        return 1.0
    if s <= 0:
        raise ValueError("s must be positive")
    log_front = s * math.log(x) - x - math.lgamma(s)
    if x < s + 1:
        term = total = 1.0 / s
        a = s
        for _ in range(100_000):
            a += 1
            term *= x / a
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = x + 1 - s
    c = 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, 100_000):
        an = -i * (i - s)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-16:
            break
    return min(1.0, math.exp(log_front) * h)


def chi2_sf(x: float, df: float) -> float:
    """P(X > x) for X ~ chi-squared with ``df`` degrees of freedom."""
    if df <= 0:
        return 0.0 if x > 0 else 1.0
    return gammaincc(df / 2, x / 2) if x > 0 else 1.0


def chi2_isf(q: float, df: float) -> float:
    """The x with P(X > x) = q (bisection to 1e-10 relative)."""
    return last_true(lambda x: chi2_sf(x, df) > q, max(1.0, df), 1e-10, 200)


def ncx2_sf(x: float, df: float, nc: float) -> float:
    """P(X > x) for the noncentral chi-squared (``nc`` the noncentrality): the Poisson
    mixture sum_j Pois(j; nc/2) Q(df/2 + j, x/2), the Q terms by their upward recurrence."""
    if nc <= 0:
        return chi2_sf(x, df)
    if x <= 0:
        return 1.0
    y, lam = x / 2, nc / 2
    a = df / 2
    q = gammaincc(a, y)
    mode = int(lam)
    top = mode + 20 + int(12 * math.sqrt(lam + 1))
    total = 0.0
    for j in range(top + 1):
        w = math.exp(-lam + j * math.log(lam) - math.lgamma(j + 1))
        total += w * q
        # Q(a + j + 1, y) = Q(a + j, y) + y^(a+j) e^-y / Gamma(a + j + 1)
        q = min(1.0, q + math.exp((a + j) * math.log(y) - y - math.lgamma(a + j + 1)))
    return min(1.0, total)


def noncentrality_for_power(df: float, alpha: float, power: float) -> float:
    """The least noncentrality at which a level-``alpha`` chi-squared test on ``df``
    degrees of freedom rejects with probability ``power``."""
    crit = chi2_isf(alpha, df)
    return last_true(lambda nc: ncx2_sf(crit, df, nc) < power, 1.0, 1e-8, 100)
