"""async_scheduling: an engine switch users flip, the scheduler planning one step ahead."""
from __future__ import annotations

from speccheck.axes._registry import SERVING_MAX_TOKENS, AxisInput, AxisSpec
from speccheck.types import Workload

#: requests in flight; twice as many arrive, one every GAP steps
IN_FLIGHT = 4
GAP = 2


def build(inp: AxisInput) -> Workload:
    """Distinct corpus prompts arriving while others decode, at most IN_FLIGHT at once, with
    async scheduling off or on (the level): with it on the scheduler plans step n + 1 before
    step n's accepted counts are known. Each ``on`` request must give its ``off`` tokens."""
    prompts = inp.serving_prompts()
    reqs = [inp.request(f"async/{i:02d}:{p.id}", p, inp.inputs[p.id],
                        max_tokens=min(p.max_tokens, SERVING_MAX_TOKENS), arrive_after=GAP * i)
            for i, p in enumerate(prompts[i % len(prompts)] for i in range(2 * IN_FLIGHT))]
    return Workload("async_scheduling", inp.level, reqs, max_in_flight=IN_FLIGHT,
                    knobs={"async_scheduling": inp.level})


AXIS = AxisSpec(
    name="async_scheduling", order=60, levels=("off", "on"), build=build,
    proofs={"on": ("async_scheduling", "steps_scheduled_ahead")},
    guards="async scheduling on: the scheduler plans step n + 1 before step n's accepted counts "
           "are known, placeholders fixed up later (vLLM #52071, #38556)",
    description="With the engine's async scheduling switched on, every request gives the tokens "
                "it gives with it off, and the engine did schedule steps ahead.")
