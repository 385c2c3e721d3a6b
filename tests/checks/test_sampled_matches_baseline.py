"""sampled_matches_baseline: its verdicts and messages, and the seeds that make it valid."""
from __future__ import annotations

import numpy as np

from speccheck.checks import get
from speccheck.policy import Policy
from speccheck.results import ConfigResult, Speed
from speccheck.types import request_seed
from speccheck.verify.two_sample import two_sample

SAMPLING = {"temperature": 0.8, "top_p": 0.9, "top_k": 0, "seed": 0, "samples": 4}


def _result(sampling=None, measured=None) -> ConfigResult:
    r = ConfigResult("mtp-k3", 1, [], None, [], 0, 0, None, None, None, [], [], {}, [], None, None,
                     Speed(None, None, None, None))
    r.sampling = sampling
    r.measured = {"sampled_matches_baseline": measured}
    return r


def _arm(rng, shift=0.0):
    out = {}
    for p in range(12):
        q = np.random.default_rng(p).dirichlet(np.full(5, 0.6))
        q[0] += shift
        q /= q.sum()
        out[f"p{p}"] = [rng.choice(5, size=10, p=q) for _ in range(4)]
    return out


def test_greedy_suite_says_not_exercised():
    c = get("sampled_matches_baseline").run(_result(), Policy())
    assert c.skipped and c.passed and "not exercised" in c.message


def test_clean_samples_pass_stating_alpha_and_detectable_effects():
    rng = np.random.default_rng(0)
    c = get("sampled_matches_baseline").run(_result(SAMPLING, two_sample(_arm(rng), _arm(rng))),
                                            Policy())
    assert c.passed and not c.skipped, c.message
    assert "alpha 0.01 (Holm over 5" in c.message and "detects TV 0." in c.message
    assert "80% power" in c.message and "48 outputs vs the baseline's 48 on 12 prompts" in c.message


def test_a_moved_distribution_fails_naming_the_statistics():
    rng = np.random.default_rng(1)
    c = get("sampled_matches_baseline").run(
        _result(SAMPLING, two_sample(_arm(rng, shift=2.0), _arm(rng))), Policy())
    assert not c.passed and "rejected" in c.message and "tokens" in c.message


def test_no_baseline_is_missing_evidence():
    c = get("sampled_matches_baseline").run(_result(SAMPLING, "no baseline samples"), Policy())
    assert not c.passed and c.message.startswith("evidence missing")


def test_seeds_differ_between_configs_and_repeat_within_one():
    """Independent arms need different seeds per config; seeded determinism needs the same
    seed every repeat; sample j of a prompt is seed + j (vLLM's n samples of one request)."""
    ids = [5, 6, 7]
    assert request_seed(1, "baseline", ids) != request_seed(1, "mtp-k3", ids)
    assert request_seed(1, "mtp-k3", ids) == request_seed(1, "mtp-k3", ids)
    assert request_seed(1, "mtp-k3", ids) != request_seed(1, "mtp-k3", [5, 6, 8])
    assert request_seed(1, "mtp-k3", ids, 3) == request_seed(1, "mtp-k3", ids) + 3
    assert 0 <= request_seed(9, "dflash2-k7", ids) < 2 ** 31
