"""prefix_cache: conversations whose next turn reuses the cached prefix, and a poison prefix."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from speccheck.axes._registry import SERVING_MAX_TOKENS, AxisInput, AxisSpec
from speccheck.types import Workload

CONVERSATIONS = 3
#: the new user text of a next turn, as tokens of the corpus's own prompts (no tokenizer here)
FOLLOW_UP = 12


def build(inp: AxisInput) -> Workload:
    """Per conversation: turn 1 = a corpus prompt; turn 2 = turn 1 + its answer (the config's
    stored output) + a follow-up (the start of another prompt); then a poison request that
    shares turn 1's prefix with another ending, and turn 2 again as the probe. Level ``cold``
    runs it with the prefix cache off, ``hit`` with it on: each hit request must give the cold
    tokens."""
    prompts = [replace(p, max_tokens=min(p.max_tokens, SERVING_MAX_TOKENS))
               for p in inp.serving_prompts() if p.id in inp.outputs][:CONVERSATIONS + 1]
    reqs = []
    for i, p in enumerate(prompts[:CONVERSATIONS]):
        other = prompts[(i + 1) % len(prompts)]
        first = inp.inputs[p.id]
        answer = inp.outputs[p.id]
        follow = inp.inputs[other.id][:FOLLOW_UP]
        turn2 = np.concatenate([first, answer, follow])
        poison = np.concatenate([first, follow[::-1]])
        reqs.append(inp.request(f"conv{i}/turn1:{p.id}", p, first))
        reqs.append(inp.request(f"conv{i}/turn2:{p.id}", p, turn2, after=f"conv{i}/turn1:{p.id}"))
        reqs.append(inp.request(f"conv{i}/poison:{p.id}", p, poison, after=f"conv{i}/turn2:{p.id}"))
        reqs.append(inp.request(f"conv{i}/probe:{p.id}", p, turn2, after=f"conv{i}/poison:{p.id}"))
    on = "off" if inp.level == "cold" else "on"
    return Workload("prefix_cache", inp.level, reqs, max_in_flight=1, knobs={"prefix_cache": on})


AXIS = AxisSpec(
    name="prefix_cache", order=30, levels=("cold", "hit"), build=build,
    proofs={"hit": ("prefix_hits",)},
    guards="prefix caching with speculation corrupting hybrid state on a hit (vLLM #43559, #53912, "
           "#48375), and hits silently disabled when speculation is on (#54360)",
    description="Multi-turn conversations and a poison-then-probe request with the prefix cache "
                "on give the tokens they give with it off, and the cache was actually hit.")
