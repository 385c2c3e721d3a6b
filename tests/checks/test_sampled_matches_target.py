"""sampled_matches_target and how a sampled suite treats the greedy checks."""
from __future__ import annotations

import numpy as np

from speccheck.checks import get
from speccheck.policy import Policy
from speccheck.results import ConfigResult, Speed
from speccheck.verify.sampled import fit


def _result(sampling=None, fit_=None) -> ConfigResult:
    r = ConfigResult("mtp-k3", 1, [], None, [], 0, 0, None, None, None, [], [], {}, [], None, None,
                     Speed(None, None, None, None))
    r.sampling = sampling
    r.measured = {"sampled_matches_target": fit_}
    return r


def _scores(rng, n_out=8, n_pos=40, sharpen=0.0):
    outs = []
    for _ in range(n_out):
        rows = []
        for _ in range(n_pos):
            p = rng.dirichlet(np.full(8, 0.5))
            q = p ** (1 + sharpen)
            q /= q.sum()
            t = rng.choice(8, p=q)
            lp = np.log(p)
            rows.append([p[p > p[t]].sum(), p[p == p[t]].sum(), p[t], (p * lp).sum(), (p * lp ** 2).sum()])
        outs.append(np.array(rows))
    return outs


SAMPLING = {"temperature": 0.8, "top_p": 0.9, "top_k": 0, "seed": 0, "samples": 1}


def test_greedy_suite_says_not_exercised():
    c = get("sampled_matches_target").run(_result(), Policy())
    assert c.skipped and c.passed and "not exercised" in c.message


def test_clean_samples_pass_with_their_power_stated():
    f = fit(_scores(np.random.default_rng(0)))
    c = get("sampled_matches_target").run(_result(SAMPLING, f), Policy())
    assert c.passed and not c.skipped
    assert "320 sampled tokens" in c.message and "80% power" in c.message


def test_a_sharpened_sampler_fails_naming_the_test():
    f = fit(_scores(np.random.default_rng(1), n_out=20, sharpen=0.6))
    c = get("sampled_matches_target").run(_result(SAMPLING, f), Policy())
    assert not c.passed and "loglik_martingale" in c.message


def test_missing_scores_fail_as_missing_evidence():
    c = get("sampled_matches_target").run(_result(SAMPLING, "no teacher-forced scores"), Policy())
    assert not c.passed and c.message.startswith("evidence missing")


def test_greedy_only_checks_are_not_exercised_on_a_sampled_suite():
    for name in ("greedy_is_argmax", "agrees_with_baseline", "divergences_are_low_confidence",
                 "same_stopping", "acceptance_replayed", "logprobs_consistent"):
        c = get(name).run(_result(SAMPLING), Policy())
        assert c.skipped and c.message.startswith("not exercised: a sampled suite"), name
