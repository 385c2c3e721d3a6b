"""Escalation: an inconclusive check is judged again on the linked suite of more prompts -- a
pass there passes, a fail fails, and one that stays inconclusive fails naming the check, its
p, alpha and the budget; without a link it stays inconclusive (never a pass)."""
from __future__ import annotations

import pytest

import speccheck.escalate as esc
from speccheck.policy import Policy
from speccheck.results import Check, ConfigResult, Speed, SuiteResult
from speccheck.store import Store
from speccheck.types import Prompt

INCONCLUSIVE = Check("verify_topk_drift", False, "inconclusive: ratio 1.15 > 1.10 at p 0.004, "
                     "between alpha 0.001 and look-closer 0.05", inconclusive=True)


def _result(checks) -> SuiteResult:
    cr = ConfigResult("mtp-k3", 2, [], True, [], 0, 0, None, None, None, [], [], {}, [], None, None,
                      Speed(None, None, None, None), checks=list(checks))
    return SuiteResult("s", {}, {}, 0.0, 0.0, 0.0, {}, [cr])


def test_derived_prompts_continue_each_prompt_by_its_baseline_output():
    text = Prompt("a", "code", 32, text="def f(")
    chat = Prompt("b", "chat", 16, messages=({"role": "user", "content": "hi"},))
    out = esc.derive_prompts([text, chat, Prompt("c", "x", 8, text="no output")],
                             {"a": "x): pass", "b": "hello"}, 3)
    assert [p.id for p in out] == ["a~cont", "b~cont"]
    assert out[0].text == "def f(x): pass" and out[0].max_tokens == 96 and out[0].ignore_eos
    assert out[1].messages[-2:] == ({"role": "assistant", "content": "hello"},
                                    {"role": "user", "content": esc.CONTINUE})


@pytest.fixture
def linked(tmp_path, monkeypatch):
    store = Store(tmp_path)
    suite = store.suite("s", {"corpus_hash": "h", "engine": "t", "corpus": "c"})
    store.suite("child", {"corpus_hash": "h2", "engine": "t", "corpus": "c2"})
    suite.write_escalation({"suite": "child", "configs": ["mtp-k3"],
                            "checks": {"mtp-k3": ["verify_topk_drift"]}, "prompts": 8, "budget": 3})

    def with_child(check):
        monkeypatch.setattr(esc, "evaluate_suite", lambda *a, **k: _result([check]))
        return esc.resolve(store, suite, _result([INCONCLUSIVE]), Policy()).get("mtp-k3").check(
            "verify_topk_drift")
    return with_child


def test_a_pass_on_the_escalation_passes(linked):
    c = linked(Check("verify_topk_drift", True, "ratio 1.01, p 0.4"))
    assert c.passed and "escalated to suite child" in c.message


def test_a_fail_on_the_escalation_fails(linked):
    c = linked(Check("verify_topk_drift", False, "drifted: ratio 1.2, p 1e-9"))
    assert c.state == "fail" and "failed there" in c.message


def test_an_inconclusive_left_after_the_budget_fails(linked):
    c = linked(Check("verify_topk_drift", False, "inconclusive: ratio 1.12 > 1.10 at p 0.01, "
                     "between alpha 0.001 and look-closer 0.05", inconclusive=True))
    assert c.state == "fail" and not c.inconclusive
    assert "still inconclusive after the escalation budget" in c.message
    for said in ("verify_topk_drift", "p 0.01", "alpha 0.001", "3x max_tokens"):
        assert said in c.message


def test_without_a_link_an_inconclusive_stays_so_and_is_not_a_pass(tmp_path):
    store = Store(tmp_path)
    suite = store.suite("s", {"corpus_hash": "h", "engine": "t", "corpus": "c"})
    res = esc.resolve(store, suite, _result([INCONCLUSIVE]), Policy())
    c = res.get("mtp-k3").check("verify_topk_drift")
    assert c.inconclusive and not c.passed and not res.passed and "not escalated" in c.message


@pytest.mark.slow
def test_run_escalates_an_inconclusive_and_the_gate_judges_it_there(tmp_path):
    """On ci, a policy that makes the clean engine's top-k test inconclusive (limit 1.0, alpha
    1e-12, look-closer 1): escalate() runs the baseline and mtp-k3 on the continued corpus into
    a linked suite, and the verdict there -- still inconclusive -- fails the gate."""
    from speccheck.plan import make_plan
    from speccheck.executors import run_suite

    pol = Policy(require_deterministic=False).with_overrides(
        {"topk_drift_max_ratio": 1.0, "topk_drift_alpha": 1e-12, "topk_drift_look_closer": 1.0,
         "escalation_budget": 2}, "test")
    plan = make_plan("reference", configs=["mtp-k3"], corpus="ci", repeats=1, concurrent=0,
                     no_attribution=True, axes="none")
    store = Store(tmp_path)
    suite = run_suite(plan, store, log=lambda m: None)
    child = esc.escalate(plan, store, suite, lambda m: None, pol, golden_dir=None)
    assert child is not None and suite.load_escalation()["suite"] == child.id
    assert child.is_complete("baseline", 0) and child.is_complete("mtp-k3", 0)
    assert store.latest().id == suite.id
    c = esc.judge(store, suite, pol, golden_dir=None).get("mtp-k3").check("verify_topk_drift")
    assert c.state == "fail" and "still inconclusive after the escalation budget" in c.message
