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
    return {"dflash2": ident.get("dflash2"), "block_size": ident.get("block_size"),
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
    block, trained = facts["draft_block"], facts["block_size"]
    if block is not None and block != k + 1:
        problems.append(f"the drafter's block was {block} tokens, not K + 1 = {k + 1}")
    if trained is not None and k > trained - 1:
        problems.append(f"K = {k} drafts past the block the drafter was trained on ({trained} tokens: "
                        f"at most K = {trained - 1})")
    said = (f"selector {d2.get('selector', 'on')}, top-{d2.get('top_k', '?')} candidates, block "
            f"{block if block is not None else k + 1} tokens for K = {k}"
            + (f" (trained block {trained})" if trained is not None else ""))
    return Check("dflash2_facts", not problems, "; ".join(problems) + (f" ({said})" if problems else said))


CHECK = CheckSpec(
    name="dflash2_facts", label="DFlash2", order=130, judge=judge, measure=measure, methods=("dflash2",),
    guards="a DFlash2 config that silently ran as DFlash (selector off, wrong drafter class) or with "
           "a block that is not K + 1, so its figures say nothing about DFlash2",
    description="For a DFlash2 config, the engine read back a DFlash2 drafter with its candidate "
                "selector on and a draft block of K + 1 tokens within the block it was trained on.")
