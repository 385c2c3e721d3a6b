"""acceptance_not_regressed against a golden, two-sided and prompt by prompt: a rise in
tokens/iteration on the prompts whose output is the golden run's is a finding as much as a
fall (rMLX #436: acceptance too high hid drafts accepted without a real verify)."""
from __future__ import annotations

from speccheck.evaluate import evaluate_suite
from speccheck.policy import Policy
from speccheck.verify import output_digest
from tests.test_evaluate import BASE, MTP_COUNTERS, suite  # noqa: F401

LOOSE = Policy(min_token_agreement=0.5)


def golden_like(shift: int) -> dict:
    """The golden's acceptance of mtp-k3 on every prompt, ``shift`` accepted tokens off today's
    (taken from the first draft position, added at the last)."""
    acc = MTP_COUNTERS.accepted_tokens - shift
    per_pos = list(MTP_COUNTERS.accepted_per_pos)
    per_pos[0 if shift > 0 else -1] -= shift
    return {"mtp-k3": {"tokens_per_iter": 1 + acc / MTP_COUNTERS.drafts, "per_pos": [],
                       "per_prompt": {p: [MTP_COUNTERS.drafts, acc, output_digest(t)] for p, t in BASE.items()},
                       "per_prompt_pos": {p: per_pos for p in BASE}}}


def test_as_recorded_passes_and_says_so(suite):  # noqa: F811
    res = evaluate_suite(suite, LOOSE, ["baseline", "mtp-k3"], golden_acceptance=golden_like(0))
    c = res.get("mtp-k3").check("acceptance_not_regressed")
    assert c.passed and "any change would show" in c.message


def test_a_rise_beyond_the_allowed_change_fails(suite):  # noqa: F811
    """Today's 2.5 tokens/iteration where the golden recorded 2.0 on the same outputs."""
    res = evaluate_suite(suite, LOOSE, ["baseline", "mtp-k3"], golden_acceptance=golden_like(1))
    c = res.get("mtp-k3").check("acceptance_not_regressed")
    assert not c.passed and "rose 25% above the golden's 2.00" in c.message, c.message


def test_a_fall_still_fails(suite):  # noqa: F811
    res = evaluate_suite(suite, LOOSE, ["baseline", "mtp-k3"], golden_acceptance=golden_like(-1))
    c = res.get("mtp-k3").check("acceptance_not_regressed")
    assert not c.passed and "fell more than 5%" in c.message


def test_goldens_recorded_before_per_position_counts_judge_a_rise_without_the_paired_test(suite):  # noqa: F811
    gold = golden_like(1)
    del gold["mtp-k3"]["per_prompt_pos"]
    res = evaluate_suite(suite, LOOSE, ["baseline", "mtp-k3"], golden_acceptance=gold)
    c = res.get("mtp-k3").check("acceptance_not_regressed")
    assert not c.passed and "rose 25%" in c.message and "paired" not in c.message
