"""long_lived: one engine serves many requests, then the probe set."""
from __future__ import annotations

from speccheck.axes._registry import AxisInput, AxisSpec
from speccheck.types import Workload

#: the probe: the first prompts of the corpus, decoded as their repeats decode them
PROBES = 6
#: the requests served before the probe: short, mixed (every corpus prompt in turn)
WARMUP_TOKENS = 2


def build(inp: AxisInput) -> Workload:
    """``level`` requests of the corpus's prompts in turn (a few tokens each), then the probe
    set; the probe's outputs and acceptance are judged against the config's fresh-process run."""
    n = int(inp.level)
    prompts = list(inp.corpus.prompts)
    reqs = [inp.request(f"warm{i:04d}:{prompts[i % len(prompts)].id}", prompts[i % len(prompts)],
                        inp.inputs[prompts[i % len(prompts)].id], max_tokens=WARMUP_TOKENS)
            for i in range(n)]
    # the probe decodes as the repeats do (its acceptance is compared with theirs)
    reqs += [inp.request(f"probe:{p.id}", p, inp.inputs[p.id]) for p in inp.serving_prompts(PROBES)]
    return Workload("long_lived", inp.level, reqs)


AXIS = AxisSpec(
    name="long_lived", order=40, levels=("200",), build=build, runs_on="runner",
    guards="state leaking across requests in a long-lived server: right after a restart, wrong "
           "after many requests (vLLM #35800, #36872; a poison request then a probe)",
    description="After the engine has served many mixed requests in one process, the probe "
                "prompts give the tokens and acceptance of a fresh process.")
