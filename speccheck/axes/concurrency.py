"""concurrency: a ladder of requests in flight, arriving while others decode."""
from __future__ import annotations

from speccheck.axes._registry import SERVING_MAX_TOKENS, AxisInput, AxisSpec
from speccheck.types import Workload

#: every this many requests, a canary: the same first prompt again, as users interleave them
CANARY_EVERY = 4
#: engine steps between two arrivals
GAP = 2


def build(inp: AxisInput) -> Workload:
    """Twice ``level`` requests of distinct corpus prompts (cycled), one arriving every GAP
    steps, at most ``level`` in flight: requests join a running batch, steps mix a prefill
    with verifies, finished requests' slots are reused. Each request is judged against the same
    prompt alone (the config's first repeat)."""
    level = int(inp.level)
    prompts = inp.serving_prompts()
    reqs = []
    for i in range(2 * level):
        p = prompts[0] if i % CANARY_EVERY == CANARY_EVERY - 1 else prompts[i % len(prompts)]
        reqs.append(inp.request(f"c{level}/{i:03d}:{p.id}", p, inp.inputs[p.id],
                                max_tokens=min(p.max_tokens, SERVING_MAX_TOKENS), arrive_after=GAP * i))
    return Workload("concurrency", inp.level, reqs, max_in_flight=level)


AXIS = AxisSpec(
    name="concurrency", order=20, levels=("4", "8"), build=build,
    proofs={"4": ("max_batch", "mixed_steps"), "8": ("max_batch", "mixed_steps")},
    guards="wrong outputs only at high concurrency (SGLang #36548; #35150: 111 of 304 requests "
           "wrong at concurrency 8; vLLM #42728: more than one in-flight DFlash request)",
    description="Requests arrive while others decode, up to the level in flight (steps mix a "
                "prefill with verifies, freed slots are reused); each gives its tokens alone.")
