"""concurrency: a ladder of requests in flight, arriving while others decode."""
from __future__ import annotations

from speccheck.axes._registry import SERVING_MAX_TOKENS, AxisInput, AxisSpec
from speccheck.types import Workload

#: every this many requests, a canary: the same first prompt again, as users interleave them
CANARY_EVERY = 4
#: engine steps over which the first ``level`` requests arrive, at most (fewer where a request
#: could finish sooner, so that the level is reached while the first requests still decode)
ARRIVAL_STEPS = 8


def build(inp: AxisInput) -> Workload:
    """Twice ``level`` requests of distinct corpus prompts (cycled), at most ``level`` in
    flight, the first ``level`` arriving over a few steps: requests join a running batch, steps
    mix a prefill with verifies, finished requests' slots are reused. Each request is judged
    against the same prompt alone (the config's first repeat)."""
    level = int(inp.level)
    prompts = inp.serving_prompts()
    reqs = []
    window = arrival_steps(inp, prompts)
    for i in range(2 * level):
        p = prompts[0] if i % CANARY_EVERY == CANARY_EVERY - 1 else prompts[i % len(prompts)]
        reqs.append(inp.request(f"c{level}/{i:03d}:{p.id}", p, inp.inputs[p.id],
                                max_tokens=min(p.max_tokens, SERVING_MAX_TOKENS), arrive_after=(i * window) // level))
    return Workload("concurrency", inp.level, reqs, max_in_flight=level)


def arrival_steps(inp: AxisInput, prompts) -> int:
    """Steps the first ``level`` requests arrive over: ARRIVAL_STEPS, or fewer than the
    shortest request can live (its prefill step, then its tokens at up to K + 1 a step, from
    its length in the config's first repeat where stored); a slower ladder would see the first
    requests leave before the last arrive, and the level would never be in flight."""
    tokens = min(min(len(inp.outputs.get(p.id, ())) or p.max_tokens, p.max_tokens, SERVING_MAX_TOKENS)
                 for p in prompts)
    lifetime = 1 + -(-(max(tokens, 1) - 1) // (inp.config.k + 1))
    return max(0, min(ARRIVAL_STEPS, lifetime - 1))


AXIS = AxisSpec(
    name="concurrency", order=20, levels=("8", "32"), build=build,
    proofs={"8": ("max_batch", "mixed_steps"), "32": ("max_batch", "mixed_steps")},
    floors=lambda level: {"max_batch": int(level)},  # a batch that never reached the level
    guards="wrong outputs only at high concurrency (SGLang #36548; #35150: 111 of 304 requests "
           "wrong at concurrency 8; vLLM #42728: more than one in-flight DFlash request)",
    description="Requests arrive while others decode, up to the level in flight (steps mix a "
                "prefill with verifies, freed slots are reused); each gives its tokens alone.")
