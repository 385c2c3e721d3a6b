"""Spec samples against baseline samples of the same prompts: a two-sample test that needs
nothing but tokens, so it runs on any engine (any OpenAI-compatible server included).

Under losslessness, a spec config's samples of a prompt and the baseline's are draws from one
distribution. With independent seeds (types.request_seed mixes the config in) the arm labels
of one prompt's outputs are then exchangeable, so a permutation test that shuffles the labels
within each prompt is exact at any sample size, whatever the dependence between the tokens of
one output. Four statistics, each a G (log-likelihood ratio) statistic of arm x category
counts, rare categories pooled (fewer than :data:`MIN_COUNT` observations over both arms go
to one "other" category: a choice made on the pooled counts, the same under every shuffle):

- ``first_token``: per prompt, the first generated token; summed over the prompts with at
  least two outputs in each arm (with one each, every shuffle gives the same table);
- ``prefix``: per prompt, the first :data:`PREFIX_LEN` tokens as one category;
- ``tokens`` and ``bigrams``: every generated token (and pair of neighbours) of all outputs,
  pooled over prompts: the statistic with power when each prompt has one sample per arm.

The family (the statistics that could be computed) is judged at family-wise ``alpha`` by
Holm. Each states its minimum detectable effect at :data:`POWER` as a total variation:
``first_token`` / ``prefix`` -- a per-prompt first-token (first-``PREFIX_LEN``-token)
distribution that moves by that TV on every prompt is detected; ``tokens`` / ``bigrams`` --
the token (bigram) frequencies moving by that TV. These use the chi-squared approximation of
the permutation test's power (TV >= d implies a chi-squared divergence >= 4 d^2), with the
pooled statistics' null inflated by the permutation distribution's own mean over its
degrees of freedom (tokens of one output are not independent).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from speccheck.verify.chi2 import noncentrality_for_power
from speccheck.verify.sampled import holm

#: label shuffles per test (p-values step 1 / (PERMUTATIONS + 1): 5e-4, below Holm's
#: smallest threshold at the default alpha 0.01 over four statistics)
PERMUTATIONS = 1999
#: seed of the shuffles (fixed: the same store gives the same verdict)
PERM_SEED = 0x5A3C
#: categories with fewer observations over both arms are pooled
MIN_COUNT = 3
#: categories a statistic keeps at most (the most frequent; the rest pooled)
MAX_CATEGORIES = 2000
#: tokens per category of the ``prefix`` statistic
PREFIX_LEN = 4
#: the power at which minimum detectable effects are stated
POWER = 0.8

_SAMPLE = re.compile(r"#s\d+$")


def base_prompt_id(prompt_id: str) -> str:
    """The corpus prompt a sampled request came from (``<id>#s<j>`` -> ``<id>``)."""
    return _SAMPLE.sub("", prompt_id)


@dataclass
class Statistic:
    """One statistic of the family: G, its permutation p-value, its degrees of freedom (after
    pooling), the observations it rests on and its minimum detectable TV at POWER."""

    name: str
    g: float
    p: float
    df: int
    observations: int  # outputs (first_token, prefix) or tokens (tokens, bigrams) compared
    prompts: int  # prompts that contribute
    mde_tv: float
    null_inflation: float = 1.0  # the permutation null's mean over df (1 for the per-prompt ones)


@dataclass
class TwoSample:
    """The two-sample family of one config against the baseline."""

    prompts: int
    spec_outputs: int
    base_outputs: int
    samples: tuple[int, int]  # fewest and most outputs per prompt and arm
    alpha: float
    statistics: list[Statistic] = field(default_factory=list)
    #: statistics that could not be computed: a per-prompt one where no prompt has 2+ outputs
    #: in each arm with 2+ categories seen MIN_COUNT+ times, a pooled one with < 2 categories
    skipped: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    permutations: int = PERMUTATIONS

    @property
    def passed(self) -> bool:
        return not self.rejected

    def get(self, name: str) -> Statistic | None:
        return next((s for s in self.statistics if s.name == name), None)


def g_statistic(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """G = 2 sum O ln(O / E) of 2 x C tables, rows of ``a`` and ``b`` ([..., C] counts of
    each arm); scipy.stats.chi2_contingency(lambda_="log-likelihood") on one table."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    t = a + b
    na, nb = a.sum(-1, keepdims=True), b.sum(-1, keepdims=True)
    n = na + nb
    with np.errstate(divide="ignore", invalid="ignore"):
        ea, eb = na * t / n, nb * t / n
        ga = np.where(a > 0, a * np.log(a / np.where(ea > 0, ea, 1.0)), 0.0)
        gb = np.where(b > 0, b * np.log(b / np.where(eb > 0, eb, 1.0)), 0.0)
    return 2 * (ga + gb).sum(-1)


def _bag(outputs: Sequence[np.ndarray], keys: Callable[[np.ndarray], list],
         min_count: int = MIN_COUNT, most: int = MAX_CATEGORIES) -> np.ndarray:
    """[outputs, C] counts of each output's keys over the categories seen ``min_count``+
    times in all (at most the ``most`` most frequent), the rest pooled in one last column:
    chosen on the pooled counts, the same under every shuffle. Built from the kept keys alone,
    so a long run's bigrams (100 000s of distinct ones) never make a dense table."""
    from collections import Counter

    per = [Counter(keys(o)) for o in outputs]
    total: Counter = Counter()
    for c in per:
        total.update(c)
    kept = [k for k, n in total.most_common(most) if n >= min_count]
    index = {k: i for i, k in enumerate(kept)}
    out = np.zeros((len(outputs), len(kept) + 1))
    for i, c in enumerate(per):
        for k, n in c.items():
            out[i, index.get(k, len(kept))] += n
    return out if out[:, -1].any() else out[:, :-1]


def _labels(groups: list[tuple[int, int]], rng: np.random.Generator, b: int) -> np.ndarray:
    """[b + 1, outputs] booleans, True = the spec arm: row 0 as observed, then ``b`` shuffles
    of the labels within each prompt (group: its spec count, its output count)."""
    cols = []
    for n_s, n in groups:
        obs = np.zeros(n, bool)
        obs[:n_s] = True
        shuffled = rng.permuted(np.tile(obs, (b, 1)), axis=1)
        cols.append(np.vstack([obs, shuffled]))
    return np.hstack(cols) if cols else np.zeros((b + 1, 0), bool)


def _p_value(stats: np.ndarray) -> float:
    """(1 + shuffles at least as extreme) / (1 + shuffles), ties within rounding counted."""
    obs = stats[0]
    return float((1 + np.sum(stats[1:] >= obs - 1e-9 * max(1.0, abs(obs)))) / len(stats))


def two_sample(spec: dict[str, list[np.ndarray]], base: dict[str, list[np.ndarray]],
               alpha: float = 0.01, permutations: int = PERMUTATIONS,
               seed: int = PERM_SEED) -> TwoSample:
    """The family over the prompts both arms sampled (``{prompt: [token arrays]}`` each)."""
    prompts = sorted(set(spec) & set(base))
    outputs: list[np.ndarray] = []
    groups: list[tuple[int, int]] = []
    per_prompt: list[tuple[int, int, int]] = []  # (start, n_spec, n_base)
    for pid in prompts:
        s, b = [np.asarray(x) for x in spec[pid]], [np.asarray(x) for x in base[pid]]
        per_prompt.append((len(outputs), len(s), len(b)))
        outputs += s + b
        groups.append((len(s), len(s) + len(b)))
    counts = [n for _, s, b in per_prompt for n in (s, b)]
    res = TwoSample(len(prompts), sum(s for _, s, _ in per_prompt), sum(b for _, _, b in per_prompt),
                    (min(counts, default=0), max(counts, default=0)), alpha, permutations=permutations)
    if not prompts:
        return res
    labels = _labels(groups, np.random.default_rng(seed), permutations)

    def stratified(name: str, keys: Callable[[np.ndarray], list]) -> None:
        """Sum over prompts of each prompt's own G (its categories, its shuffles)."""
        total = np.zeros(permutations + 1)
        df = used = observations = 0
        n_eff = 0.0
        for (start, n_s, n_b) in per_prompt:
            if n_s < 2 or n_b < 2:
                continue
            x = _bag(outputs[start:start + n_s + n_b], keys)
            if x.shape[1] < 2:
                continue
            lab = labels[:, start:start + n_s + n_b].astype(np.float64)
            a = lab @ x
            total += g_statistic(a, x.sum(0) - a)
            df += x.shape[1] - 1
            used += 1
            observations += int(x.sum())
            na = a[0].sum()
            nb = x.sum() - na
            n_eff += na * nb / (na + nb)
        if not used:
            res.skipped.append(name)
            return
        inflation = max(1.0, float(total[1:].mean()) / df)
        res.statistics.append(Statistic(name, float(total[0]), _p_value(total), df, observations,
                                        used, n_eff, inflation))

    def pooled(name: str, keys: Callable[[np.ndarray], list]) -> None:
        """One G over the counts of all prompts together (shuffles still within prompts):
        the statistic with power when every prompt has one output per arm."""
        x = _bag(outputs, keys)
        if x.shape[1] < 2:
            res.skipped.append(name)
            return
        a = labels.astype(np.float64) @ x
        stats = g_statistic(a, x.sum(0) - a)
        na, nb = a[0].sum(), x.sum() - a[0].sum()
        df = x.shape[1] - 1
        inflation = max(1.0, float(stats[1:].mean()) / df)
        res.statistics.append(Statistic(name, float(stats[0]), _p_value(stats), df, int(x.sum()),
                                        len(prompts), na * nb / (na + nb) if na and nb else 0.0,
                                        inflation))

    stratified("first_token", lambda o: [int(o[0]) if len(o) else -1])
    stratified("prefix", lambda o: [tuple(int(t) for t in o[:PREFIX_LEN])])
    stratified("tokens", lambda o: [int(t) for t in o])
    pooled("tokens_pooled", lambda o: [int(t) for t in o])
    pooled("bigrams_pooled", lambda o: [(int(x), int(y)) for x, y in zip(o[:-1], o[1:])])
    m = len(res.statistics)
    if m:
        for st, rej in zip(res.statistics, holm([s.p for s in res.statistics], alpha)):
            if rej:
                res.rejected.append(st.name)
        # the least TV each detects at POWER at Holm's first step (alpha / m); mde_tv held the
        # effective sample size until here
        for st in res.statistics:
            n_eff = st.mde_tv
            lam = noncentrality_for_power(st.df, alpha / m, POWER)
            st.mde_tv = 0.5 * math.sqrt(st.null_inflation * lam / n_eff) if n_eff > 0 else math.inf
    return res
