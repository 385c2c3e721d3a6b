"""verify/two_sample.py: its G statistic and permutation p-values against scipy, its
false-alarm rate under exchangeable arms, and its power against the effects it states."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from speccheck.verify.two_sample import _bag, base_prompt_id, g_statistic, two_sample


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), min_size=2, max_size=8))
def test_g_matches_scipy_log_likelihood_contingency(cols):
    table = np.array(cols, float).T
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2 or (table.sum(1) == 0).any():
        return
    ref = stats.chi2_contingency(table, lambda_="log-likelihood", correction=False)[0]
    assert g_statistic(table[0], table[1]) == pytest.approx(ref, rel=1e-10, abs=1e-10)


def test_rare_categories_are_pooled_into_one_chosen_on_the_pooled_counts():
    outs = [np.array([7] * 5 + [1, 3]), np.array([7] * 4 + [2, 9, 9, 9])]
    x = _bag(outs, lambda o: [int(t) for t in o], min_count=3)
    assert x.tolist() == [[5, 0, 2], [4, 3, 1]]  # 7, 9, then 1/2/3 pooled
    assert _bag(outs, lambda o: [int(t) for t in o], min_count=3, most=1).tolist() == [[5, 2], [4, 4]]


def test_base_prompt_id():
    assert base_prompt_id("code-x#s3") == "code-x" and base_prompt_id("a#b") == "a#b"


def _arms(rng, prompts, n, vocab=6, length=12, shift=0.0, sticky=0.5, base_seed=0):
    """Per prompt a fixed categorical distribution (its own seed); each output a sticky chain
    over it (tokens of one output are dependent); ``shift`` moves mass to each prompt's top
    token."""
    out = {}
    for p in range(prompts):
        q = np.random.default_rng(base_seed + p).dirichlet(np.full(vocab, 0.7))
        q[np.argmax(q)] += shift
        q /= q.sum()
        outs = []
        for _ in range(n):
            seq = [rng.choice(vocab, p=q)]
            while len(seq) < length:
                seq.append(seq[-1] if rng.random() < sticky else rng.choice(vocab, p=q))
            outs.append(np.array(seq))
        out[f"p{p}"] = outs
    return out


def test_first_token_p_value_matches_scipy_permutation_test():
    """One prompt, first tokens only: the stratified shuffle is scipy's independent-samples
    permutation test of the G statistic."""
    rng = np.random.default_rng(3)
    a = {"p": [np.array([t]) for t in rng.choice(4, 40, p=[0.4, 0.3, 0.2, 0.1])]}
    b = {"p": [np.array([t]) for t in rng.choice(4, 40, p=[0.25, 0.25, 0.25, 0.25])]}
    ours = two_sample(a, b, permutations=4999).get("first_token").p

    def g(x, y):
        cx, cy = np.bincount(x, minlength=4), np.bincount(y, minlength=4)
        return g_statistic(cx, cy)

    ref = stats.permutation_test((np.concatenate([o for o in a["p"]]),
                                  np.concatenate([o for o in b["p"]])), g, vectorized=False,
                                 permutation_type="independent", alternative="greater",
                                 n_resamples=4999, random_state=0).pvalue
    assert ours == pytest.approx(ref, abs=0.02)


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 3])
def test_false_alarm_rate_is_at_most_alpha(n):
    """Both arms from one distribution (dependent tokens within an output): rejections at
    alpha 0.05 over 200 data sets stay within the binomial's 99.9 % bound of 5 %."""
    alarms = 0
    for seed in range(200):
        rng = np.random.default_rng(seed)
        t = two_sample(_arms(rng, 12, n), _arms(rng, 12, n), alpha=0.05, permutations=199)
        alarms += not t.passed
    assert alarms <= stats.binom.ppf(0.999, 200, 0.05)


def test_identical_arms_never_reject():
    rng = np.random.default_rng(0)
    a = _arms(rng, 10, 3)
    t = two_sample(a, {k: list(v) for k, v in a.items()})
    assert t.passed and all(s.p > 0.5 for s in t.statistics)


def test_a_shift_well_above_the_stated_effect_is_found():
    rng = np.random.default_rng(1)
    t = two_sample(_arms(rng, 20, 6, shift=3.0), _arms(rng, 20, 6))
    assert not t.passed
    assert {"first_token", "tokens"} & set(t.rejected)
    mde = t.get("first_token").mde_tv
    assert 0 < mde < 1


def test_the_stated_effect_is_detected_at_about_the_stated_power():
    """First tokens only (independent draws): a per-prompt TV equal to the stated first-token
    MDE is detected in most of 20 trials (asymptotics at small counts: 60 % at least)."""
    prompts, n, vocab = 16, 24, 3

    def draws(rng, q):
        return {f"p{i}": [np.array([rng.choice(vocab, p=q)]) for _ in range(n)]
                for i in range(prompts)}

    p0 = np.full(vocab, 1 / vocab)
    probe = two_sample(draws(np.random.default_rng(0), p0), draws(np.random.default_rng(1), p0))
    d = probe.get("first_token").mde_tv
    p1 = p0 + np.array([d, -d / 2, -d / 2])  # total variation d
    hits = sum(not two_sample(draws(np.random.default_rng(10 + s), p1),
                              draws(np.random.default_rng(100 + s), p0), permutations=499).passed
               for s in range(20))
    assert hits >= 12


def test_one_output_per_prompt_still_has_the_pooled_statistics():
    rng = np.random.default_rng(2)
    t = two_sample(_arms(rng, 10, 1), _arms(rng, 10, 1))
    assert [s.name for s in t.statistics] == ["tokens_pooled", "bigrams_pooled"]
    assert t.skipped == ["first_token", "prefix", "tokens"]
