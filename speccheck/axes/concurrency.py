"""concurrency: a ladder of requests in flight, arriving while others decode."""
from __future__ import annotations

from speccheck.axes._registry import SERVING_MAX_TOKENS, AxisInput, AxisSpec
from speccheck.types import Workload

#: every this many requests, a canary: the same first prompt again, as users interleave them
CANARY_EVERY = 4
#: arrivals per engine step at level 8; higher levels arrive proportionally faster, so that the
#: level is reached while the first requests still decode
RATE_AT_8 = 1


def build(inp: AxisInput) -> Workload:
    """Twice ``level`` requests of distinct corpus prompts (cycled), arriving level / 8 a step,
    at most ``level`` in flight: requests join a running batch, steps mix a prefill
    with verifies, finished requests' slots are reused. Each request is judged against the same
    prompt alone (the config's first repeat)."""
    level = int(inp.level)
    prompts = inp.serving_prompts()
    reqs = []
    for i in range(2 * level):
        p = prompts[0] if i % CANARY_EVERY == CANARY_EVERY - 1 else prompts[i % len(prompts)]
        reqs.append(inp.request(f"c{level}/{i:03d}:{p.id}", p, inp.inputs[p.id],
                                max_tokens=min(p.max_tokens, SERVING_MAX_TOKENS), arrive_after=(i * 8) // (level * RATE_AT_8)))
    return Workload("concurrency", inp.level, reqs, max_in_flight=level)


AXIS = AxisSpec(
    name="concurrency", order=20, levels=("8", "32"), build=build,
    proofs={"8": ("max_batch", "mixed_steps"), "32": ("max_batch", "mixed_steps")},
    floors=lambda level: {"max_batch": int(level)},  # a batch that never reached the level
    guards="wrong outputs only at high concurrency (SGLang #36548; #35150: 111 of 304 requests "
           "wrong at concurrency 8; vLLM #42728: more than one in-flight DFlash request)",
    description="Requests arrive while others decode, up to the level in flight (steps mix a "
                "prefill with verifies, freed slots are reused); each gives its tokens alone.")
