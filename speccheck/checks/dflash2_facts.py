"""dflash2_facts: a DFlash2 config ran as DFlash2, by what the engine read back."""
from __future__ import annotations

from speccheck.checks import CheckSpec, Context
from speccheck.results import Check, ConfigResult
from speccheck.types import SpecConfig


def measure(ctx: Context) -> dict | None:
    """The first run's identity facts about the drafter (None: no run to read)."""
    if not ctx.runs:
        return None
    ident = ctx.runs[0].identity
    d2 = ident.get("dflash2")
    # the trained block: where the engine read it back with the drafter (its own key, as
    # vLLM's identity's block_size is the KV cache's), else the identity's block_size
    trained = d2["trained_block"] if isinstance(d2, dict) and "trained_block" in d2 else ident.get("block_size")
    return {"dflash2": d2, "block_size": trained,
            "draft_block": ident.get("draft_block"), "draft_class": ident.get("draft_class")}


def judge(r: ConfigResult, p) -> Check:
    k = SpecConfig.from_name(r.config).k
    facts = r.measured.get("dflash2_facts")
    if facts is None:
        return Check("dflash2_facts", False, "evidence missing: no stored run to read the drafter's facts from")
    d2 = facts["dflash2"]
    if not d2:
        return Check("dflash2_facts", False,
                     "the engine read back no DFlash2 drafter for this run (identity has no dflash2 "
                     "facts): nothing shows that it ran DFlash2 rather than DFlash or no drafter")
    problems = []
    if str(d2.get("selector", "on")) != "on":
        problems.append(f"the candidate selector was {d2.get('selector')!r}, not on: without it DFlash2 "
                        "drafts as DFlash does")
    if d2.get("model_runner_v2") is False:
        problems.append(f"it ran in {d2.get('model_runner') or 'a model runner'}, not the V2 model runner: "
                        "there the DFlash2 draft drafts as DFlash (its candidate selector is never called)")
    want, cls = d2.get("expected_draft_class"), facts.get("draft_class")
    if want and str(cls or "").rsplit(".", 1)[-1] != want:
        problems.append(f"the draft model was {cls or 'not read back'}, not {want}")
    block, trained = facts["draft_block"], facts["block_size"]
    if block is not None and block != k + 1:
        problems.append(f"the drafter's block was {block} tokens, not K + 1 = {k + 1}")
    if trained is not None and k > trained - 1:
        problems.append(f"K = {k} drafts past the block the drafter was trained on ({trained} tokens: "
                        f"at most K = {trained - 1})")
    ran = (f"{str(cls).rsplit('.', 1)[-1]} in {str(d2.get('model_runner')).rsplit('.', 2)[-2]}."
           f"{str(d2.get('model_runner')).rsplit('.', 1)[-1]}, " if d2.get("model_runner") and cls else "")
    said = (ran + f"selector {d2.get('selector', 'on')}, top-{d2.get('top_k', '?')} candidates, block "
            f"{block if block is not None else k + 1} tokens for K = {k}"
            + (f" (trained block {trained})" if trained is not None else ""))
    return Check("dflash2_facts", not problems, "; ".join(problems) + (f" ({said})" if problems else said))


CHECK = CheckSpec(
    name="dflash2_facts", label="DFlash2", order=130, judge=judge, measure=measure, methods=("dflash2",),
    guards="a DFlash2 config that silently ran as DFlash (selector off, wrong drafter class) or with "
           "a block that is not K + 1, so its figures say nothing about DFlash2",
    description="For a DFlash2 config, the engine read back a DFlash2 drafter with its candidate "
                "selector on and a draft block of K + 1 tokens within the block it was trained on "
                "(where the engine reports them: the drafter's model class and a V2 model runner).")
