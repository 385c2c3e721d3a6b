"""kv_pressure: a KV block budget small enough that the scheduler preempts and recomputes."""
from __future__ import annotations

from dataclasses import replace

from speccheck.axes._registry import SERVING_MAX_TOKENS, AxisInput, AxisSpec
from speccheck.types import Workload

IN_FLIGHT = 4


def build(inp: AxisInput) -> Workload:
    """The first prompts in flight together, under no budget (``free``) or a budget that admits
    every prompt but not every output (``pressure``: at least the prompts' own blocks, about half
    of what they need at their longest, below that): as they grow the newest is preempted and
    recomputed. Each pressured request must give its free tokens."""
    prompts = [replace(p, max_tokens=min(p.max_tokens, SERVING_MAX_TOKENS))
               for p in inp.serving_prompts(IN_FLIGHT)]
    reqs = [inp.request(f"kv:{p.id}", p, inp.inputs[p.id]) for p in prompts]
    knobs = {}
    if inp.level == "pressure":
        b = inp.block_size
        admit = sum(-(-len(inp.inputs[p.id]) // b) for p in prompts)  # every prompt admitted at once
        need = sum(-(-(len(inp.inputs[p.id]) + p.max_tokens + max(inp.ks, default=0) + 1) // b) for p in prompts)
        # room for all prompts to start, not for all of them to finish: the newest is preempted
        knobs = {"kv_blocks": str(max(min(max(admit, need // 2), need - 1), 1))}
    return Workload("kv_pressure", inp.level, reqs, max_in_flight=IN_FLIGHT, knobs=knobs)


AXIS = AxisSpec(
    name="kv_pressure", order=50, levels=("free", "pressure"), build=build,
    proofs={"pressure": ("preemptions",)},
    guards="preemption and recompute under KV-cache pressure losing or corrupting draft or "
           "hybrid state (vLLM's first spec-decode tests forced it with small KV budgets)",
    description="Under a KV block budget that forces preemption and recompute, every request "
                "gives the tokens it gives without pressure.")
