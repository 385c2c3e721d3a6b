"""Inconclusive is not pass: escalation to more prompts, and the verdict there.

A statistical check whose effect is beyond its limit at a p between its alpha and its looser
look-closer threshold returns an *inconclusive* verdict (``Check.inconclusive``). After it has
run the matrix, `speccheck run` judges the suite and, for the inconclusive configs only, runs
them and the baseline on a corpus derived from the suite's own: every prompt continued by its
own baseline output, generating ``escalation_budget`` times its max_tokens (deterministic, so a
resume finds it stored). That suite is linked from the first (``escalation.json``), and every
verdict on the first (gate, report, diff, JUnit, golden) takes each inconclusive check's
verdict from the linked suite: pass there passes, fail fails, and an inconclusive that remains
after the budget fails, naming the check, its p, alpha and the budget. The linked suite is an
independent sample, so the false-alarm rate stays at most the check's alpha.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

from speccheck.corpus import prompt_dict
from speccheck.engines import engine_class
from speccheck.evaluate import evaluate_suite
from speccheck.golden import golden_acceptance, golden_noise
from speccheck.plan import RunPlan
from speccheck.policy import Policy, load_policy
from speccheck.results import Check, SuiteResult
from speccheck.executors import run_suite
from speccheck.store import Store, Suite
from speccheck.types import Prompt, SpecConfig

#: a derived prompt's id: the original's plus this
SUFFIX = "~cont"
#: the user turn that asks a chat prompt to continue its own answer
CONTINUE = "Continue."


def derive_prompts(prompts: Sequence[Prompt], outputs: dict[str, str], multiple: int) -> list[Prompt]:
    """Every prompt continued by its own baseline output ``outputs[id]`` (text prompts: the
    text followed by it; chat prompts: it as the assistant's turn, then a user turn asking to
    continue), generating ``multiple`` times its max_tokens past end-of-sequence. Prompts
    without an output are left out."""
    out = []
    for p in prompts:
        text = outputs.get(p.id)
        if text is None:
            continue
        common = dict(id=p.id + SUFFIX, category=p.category, max_tokens=p.max_tokens * multiple,
                      ignore_eos=True)
        if p.text is not None:
            out.append(Prompt(text=p.text + text, **common))
        else:
            msgs = tuple(p.messages or ()) + ({"role": "assistant", "content": text},
                                              {"role": "user", "content": CONTINUE})
            out.append(Prompt(messages=msgs, **common))
    return out


def _inconclusive(result: SuiteResult) -> dict[str, list[str]]:
    return {r.config: [c.name for c in r.checks if c.inconclusive]
            for r in result.configs if any(c.inconclusive for c in r.checks)}


def judge(store: Store, suite: Suite, policy: Policy, golden_dir: str | Path | None = "golden",
          configs: Sequence[str] | None = None, detok=None) -> SuiteResult:
    """The suite judged, with what the golden says, then each inconclusive check resolved by
    the linked escalation suite (:func:`resolve`)."""
    return resolve(store, suite, _evaluate(suite, policy, golden_dir, configs, detok), policy)


def _evaluate(suite: Suite, policy: Policy, golden_dir, configs=None, detok=None) -> SuiteResult:
    have_base = suite.is_complete("baseline", 0) and golden_dir is not None
    gold = golden_acceptance(suite, Path(golden_dir)) if have_base else None
    noise = golden_noise(suite, Path(golden_dir)) if have_base else None
    return evaluate_suite(suite, policy, configs, gold, detok, noise)


def resolve(store: Store, suite: Suite, result: SuiteResult, policy: Policy) -> SuiteResult:
    """Each inconclusive check of ``result`` judged again on the linked escalation suite (in
    place; returned). Without a link the check stays inconclusive (not a pass)."""
    pending = _inconclusive(result)
    if not pending:
        return result
    link = suite.load_escalation()
    if link is None:
        for r in result.configs:
            for c in r.checks:
                if c.inconclusive:
                    c.message += (f" -- not escalated (escalation_budget {policy.escalation_budget}): "
                                  "`speccheck run` with the same options runs it on more prompts")
        return result
    try:
        child = store.suite(link["suite"])
        judged = evaluate_suite(child, policy, ["baseline", *[c for c in pending if c in link.get("configs", [])]])
    except Exception as e:  # noqa: BLE001 - a damaged escalation leaves the check failing, said why
        judged, why = None, f"its escalation suite {link['suite']} cannot be judged ({e})"
    where = (f"escalated to suite {link['suite']} ({link.get('prompts', '?')} prompts continued by "
             f"their baseline output, {link.get('budget', '?')}x max_tokens)")
    for r in result.configs:
        for i, c in enumerate(r.checks):
            if not c.inconclusive:
                continue
            first = c.message.splitlines()[0]
            there = None
            if judged is not None:
                try:
                    there = judged.get(r.config).check(c.name)
                except (KeyError, StopIteration):
                    there = None
                why = f"{where}, but {r.config} is not stored there"
            if there is None:
                r.checks[i] = Check(c.name, False, f"{first}; {why}: an inconclusive is not a pass")
            elif there.passed:
                r.checks[i] = Check(c.name, True, f"{where}: passed there: {there.message}"
                                    f" (here: {first})")
            elif there.inconclusive:
                r.checks[i] = Check(c.name, False,
                                    f"still inconclusive after the escalation budget -- {c.name} on "
                                    f"{r.config}, {where}: {there.message.splitlines()[0]} (here: {first})")
            else:
                r.checks[i] = Check(c.name, False, f"{where}: failed there: {there.message}"
                                    f" (here: {first})")
    return result


def escalate(plan: RunPlan, store: Store, suite: Suite, log: Callable[[str], None] = print,
             policy: Policy | None = None, golden_dir: str | Path | None = "golden") -> Suite | None:
    """After `speccheck run`: judge the suite; if a check is inconclusive, run the inconclusive
    configs and the baseline on the derived corpus (into the same store) and link that suite.
    Returns it, or None when nothing was inconclusive or the budget is 0."""
    policy = policy or load_policy()
    pending = _inconclusive(_evaluate(suite, policy, golden_dir))
    if not pending or policy.escalation_budget <= 0 or not suite.is_complete("baseline", 0):
        return None
    base = suite.load_run("baseline", 0).by_prompt()
    corpus = plan.load_corpus()
    prompts = derive_prompts(corpus.prompts, {p: c.text for p, c in base.items()},
                             policy.escalation_budget)
    path = store.root / "escalations" / f"{suite.id}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(prompt_dict(p), ensure_ascii=False) + "\n" for p in prompts)
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    names = [c.name for c in plan.configs if c.name in pending]
    if engine_class(plan.engine).serves_one_config:  # its server runs one config: nothing to pair
        log("inconclusive: " + ", ".join(pending) + f" -- the {plan.engine} engine serves one config, "
            "so `speccheck run` cannot escalate; run the continued corpus against each server "
            f"({path}) and judge it, or the inconclusive checks fail the gate")
        return None
    log("inconclusive: " + "; ".join(f"{c} ({', '.join(ch)})" for c, ch in pending.items())
        + f" -- escalating to {len(prompts)} prompts continued by their baseline output, "
          f"{policy.escalation_budget}x max_tokens")
    child_plan = replace(plan, corpus=str(path),
                         configs=[SpecConfig()] + [c for c in plan.configs if c.name in pending],
                         repeats=1, fresh_process_repeat=False, concurrent=0, attribute=False,
                         axes=(), max_tokens=None, ignore_eos=False,
                         moves_latest=False)  # a gate meanwhile judges the user's suite
    try:
        child = run_suite(child_plan, store, log=log)
    except Exception as e:  # noqa: BLE001 - the checks stay inconclusive: the gate fails them
        log(f"escalation failed ({type(e).__name__}: {e}); the inconclusive checks fail the gate")
        return None
    suite.write_escalation({"suite": child.id, "configs": names, "checks": pending,
                            "prompts": len(prompts), "budget": policy.escalation_budget})
    store.set_latest(suite.id)  # the gate judges the suite the user ran; it reads the link
    return child
