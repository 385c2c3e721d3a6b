"""Sampling options in the plan: a sampled suite is its own suite, greedy ones keep theirs."""
from __future__ import annotations

import pytest

from speccheck.plan import PlanError, RunPlan, parse_engine_args, plan_suite_id, sampling_engine_args
from speccheck.types import sampling_of


def test_greedy_adds_nothing_and_sampling_settings_need_a_temperature():
    assert sampling_engine_args() == ()
    with pytest.raises(PlanError, match="--temperature"):
        sampling_engine_args(top_p=0.9)
    with pytest.raises(PlanError, match="--temperature"):
        sampling_engine_args(samples=3)


def test_sampled_suite_has_its_own_identity_and_samples_expand_the_corpus():
    args = parse_engine_args(sampling_engine_args(0.7, 0.9, 0, 5, samples=2))
    assert sampling_of(args) == {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "seed": 5, "samples": 2}
    greedy, sampled = RunPlan(corpus="smoke"), RunPlan(corpus="smoke", engine_args=args)
    assert plan_suite_id(greedy) != plan_suite_id(sampled)
    other_seed = RunPlan(corpus="smoke", engine_args={**args, "seed": "6"})
    assert plan_suite_id(other_seed) != plan_suite_id(sampled)
    base = greedy.load_corpus().prompts
    expanded = sampled.load_corpus().prompts
    assert len(expanded) == 2 * len(base)
    assert [p.id for p in expanded[:2]] == [base[0].id, base[0].id + "#s1"]
    assert [p.sample for p in expanded[:2]] == [0, 1]
    # a sampled plan neither replays greedy acceptance nor attributes divergences
    planned = RunPlan(corpus="smoke", engine_args=args, configs=greedy.configs).planned()
    assert all(not v["attribute"] and "replay" not in v for v in planned.values())
