"""Is a sampled output a draw from the target's own distribution? Pure statistics over the
teacher-forced scores of each sampled position (verify/sampling_dist.py from the scorer's
raw top-k logprobs: per position the mass of the strictly more probable categories, the mass
of the sampled token's own -- the tokens tied with it, or the tail beyond the top-k -- its
probability, E[log p] and E[(log p)^2] under the sampling transform).

Under losslessness each sampled token is a draw from the target's distribution at its own
prefix, so

- the randomized probability-integral transform over tokens ordered by probability,
  ``u = above + V * tied`` (V uniform), is i.i.d. uniform on [0, 1): tested by KS, and for
  independence by the lag-1 products of its normal scores within each output;
- ``log p(token) - E[log p]`` has conditional mean 0: its sum over all positions is a
  martingale, tested by a z-test against the summed conditional variances.

The three p-values are combined by Holm at the family-wise ``alpha``.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

#: salt of the PIT's randomisation, whose seed is a digest of the scores themselves: the same
#: store gives the same verdict, and two stores draw independent uniforms (one fixed seed would
#: put the same uniforms on every store's positions, and a store's false-alarm rate would be
#: conditional on them instead of alpha)
PIT_SEED = 0x9E3779B9
#: share of positions that may sit at the nucleus boundary (kernel numerics) before the
#: support test fails
BOUNDARY_SHARE = 0.01
#: the power at which minimum detectable effects are stated
POWER = 0.8


def pit(scores: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Randomized PIT of each scored position ([n, 5+] -> [n] in [0, 1]); a token outside
    the target's support (probability 0) gets 1."""
    above, tied = scores[:, 0], scores[:, 1]
    v = rng.random(len(scores))
    return np.clip(above + v * tied, 0.0, 1.0)


def kolmogorov_sf(x: float) -> float:
    """P(K > x) of the Kolmogorov distribution (the limit of sqrt(n) D_n)."""
    if x <= 0:
        return 1.0
    if x < 1.0:  # the theta-function form converges fast here
        t = math.exp(-math.pi ** 2 / (8 * x * x))
        cdf = math.sqrt(2 * math.pi) / x * sum(t ** ((2 * k - 1) ** 2) for k in range(1, 8))
        return float(min(1.0, max(0.0, 1.0 - cdf)))
    s = sum((-1) ** (k - 1) * math.exp(-2 * k * k * x * x) for k in range(1, 101))
    return float(min(1.0, max(0.0, 2 * s)))


def ks_uniform(u: np.ndarray) -> tuple[float, float]:
    """(D, p) of the one-sample KS test of u against U(0, 1); p by Stephens' small-sample
    correction of the asymptotic distribution (within 0.02 of the exact one for n >= 20)."""
    n = len(u)
    if n == 0:
        return 0.0, 1.0
    x = np.sort(u)
    i = np.arange(1, n + 1)
    d = float(max((i / n - x).max(), (x - (i - 1) / n).max()))
    rn = math.sqrt(n)
    return d, kolmogorov_sf((rn + 0.12 + 0.11 / rn) * d)


def two_sided_normal_p(z: float) -> float:
    return math.erfc(abs(z) / math.sqrt(2))


def holm(pvalues: list[float], alpha: float) -> list[bool]:
    """Holm's step-down: which hypotheses are rejected at family-wise ``alpha``."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    rejected = [False] * len(pvalues)
    m = len(pvalues)
    for rank, i in enumerate(order):
        if pvalues[i] > alpha / (m - rank):
            break
        rejected[i] = True
    return rejected


@dataclass
class SampledFit:
    """The three tests of one config's sampled outputs against the target's distribution."""

    outputs: int
    positions: int
    outside_support: int  # sampled tokens the target gives probability 0
    boundary: int  # ... or that miss its nucleus by less than the scorer's boundary mass
    ks_d: float
    ks_p: float
    z_loglik: float  # martingale z: (sum log p - E log p) / sqrt(sum Var log p)
    loglik_p: float
    z_serial: float  # lag-1 products of the PIT's normal scores
    serial_p: float
    alpha: float
    rejected: list[str] = field(default_factory=list)  # the tests Holm rejects
    #: minimum detectable effects at POWER: the PIT CDF's sup-distance from uniform (a bound
    #: on the per-token total variation moved along the probability order) and the mean
    #: log-likelihood shift per token (nats)
    mde_tv: float = math.nan
    mde_nats: float = math.nan
    #: per output position: mean of log p - E log p and its count (the drift plot)
    drift_mean: list[float] = field(default_factory=list)
    drift_n: list[int] = field(default_factory=list)
    #: PIT histogram, 20 equal bins
    pit_hist: list[int] = field(default_factory=list)
    #: positions left out because the scorer's top-k logprobs do not identify the sampling
    #: distribution there (verify/sampling_dist.py)
    unidentified: int = 0
    #: positions tested within the top-k tokens every possible nucleus keeps (the rest of the
    #: nucleus unknown)
    within_topk: int = 0

    @property
    def passed(self) -> bool:
        return not self.rejected


def pit_seed(per_output: list[np.ndarray]) -> list[int]:
    """The PIT's seed: PIT_SEED and a digest of every output's scores."""
    h = hashlib.sha256()
    for s in per_output:
        h.update(np.ascontiguousarray(s, dtype=np.float64).tobytes())
        h.update(b"|")
    return [PIT_SEED, int.from_bytes(h.digest()[:8], "little")]


def fit(per_output: list[np.ndarray], alpha: float = 0.01) -> SampledFit:
    """The tests over every scored output ([n_i, 5] or [n_i, 6] each) of one config."""
    rng = np.random.default_rng(pit_seed(per_output))
    us, zs, devs, var, serial, npairs = [], [], [], 0.0, 0.0, 0
    nd = NormalDist()
    outside = boundary = 0
    longest = max((len(s) for s in per_output), default=0)
    drift_sum, drift_n = np.zeros(longest), np.zeros(longest, dtype=int)
    unidentified = within = used = 0
    for s in per_output:
        if len(s) == 0:
            continue
        known = ~np.isnan(s[:, 2])  # NaN: the scorer's top-k does not identify the distribution
        edge = known & (s[:, 2] < 0)  # at the nucleus boundary (the scorer's mark)
        use = known & ~edge  # both left out: the choice rests on the prefix (or is the scorer's)
        unidentified += int((~known).sum())
        if s.shape[1] > 5:
            within += int(np.nansum(s[use, 5]))
        boundary += int(edge.sum())
        where = np.nonzero(use)[0]
        s = s[use]
        if len(s) == 0:
            continue
        used += len(s)
        ok = s[:, 2] > 0
        # a nucleus of one token: its PIT is the uniform alone and says nothing of the sampler
        told = ~((s[:, 0] <= 0) & (s[:, 1] >= 1 - 1e-9))
        u = pit(s[told], rng)
        us.append(u)
        outside += int((s[:, 2] == 0).sum())
        d = np.where(ok, np.log(np.where(ok, s[:, 2], 1.0)) - s[:, 3], 0.0)
        devs.append(d)
        var += float(np.clip(s[:, 4] - s[:, 3] ** 2, 0, None)[ok].sum())
        drift_sum[where] += d
        drift_n[where] += ok
        z = np.array([nd.inv_cdf(min(max(x, 1e-12), 1 - 1e-12)) for x in u])
        zs.append(z)
        serial += float((z[1:] * z[:-1]).sum())
        npairs += max(len(z) - 1, 0)
    u_all = np.concatenate(us) if us else np.zeros(0)
    n = len(u_all)
    ks_d, ks_p = ks_uniform(u_all)
    dev = float(np.concatenate(devs).sum()) if devs else 0.0
    z_ll = dev / math.sqrt(var) if var > 0 else (0.0 if dev == 0 else math.copysign(math.inf, dev))
    z_ser = serial / math.sqrt(npairs) if npairs else 0.0
    names = ["pit_uniform", "loglik_martingale", "pit_independent"]
    ps = [ks_p, two_sided_normal_p(z_ll), two_sided_normal_p(z_ser)]
    if outside or boundary > max(2, BOUNDARY_SHARE * used):  # tokens the target never draws
        names.append("support")
        ps.append(0.0)
    rejected = [nm for nm, r in zip(names, holm(ps, alpha)) if r]
    # the least effect each test finds with probability POWER (Holm's first step: alpha / m)
    a = alpha / len(names)
    z_pow = nd.inv_cdf(POWER)
    c_ks = math.sqrt(-math.log(a / 2) / 2)
    mde_tv = (c_ks + z_pow * 0.5) / math.sqrt(n) if n else math.nan
    mde_nats = ((nd.inv_cdf(1 - a / 2) + z_pow) * math.sqrt(var) / used) if used and var > 0 else math.nan
    with np.errstate(invalid="ignore"):
        drift = np.where(drift_n > 0, drift_sum / np.maximum(drift_n, 1), np.nan)
    hist = np.histogram(u_all, bins=20, range=(0.0, 1.0))[0] if n else np.zeros(20, int)
    return SampledFit(len(us), used, outside, boundary, ks_d, ks_p, z_ll, ps[1], z_ser, ps[2], alpha, rejected,
                      mde_tv, mde_nats, [float(x) for x in drift], [int(x) for x in drift_n],
                      [int(x) for x in hist], unidentified, within)
