"""shapes: prompt lengths and output budgets around K and the cache block size."""
from __future__ import annotations

from speccheck.axes._registry import AxisInput, AxisSpec
from speccheck.types import Workload

#: corpus prompts cut to each length (the first ones long enough)
PROMPTS_PER_SHAPE = 2


def lengths(inp: AxisInput) -> list[int]:
    """1, every planned K and K+1, K+2, and the cache block size ± 1."""
    b = inp.block_size
    out = {1, b - 1, b, b + 1}
    for k in inp.ks:
        out |= {k, k + 1, k + 2}
    return sorted(n for n in out if n >= 1)


def budgets(inp: AxisInput) -> list[int]:
    """max_tokens 1, and every planned K and K+1."""
    return sorted({1, *inp.ks, *(k + 1 for k in inp.ks)})


def build(inp: AxisInput) -> Workload:
    """Each length: the first prompts of the corpus long enough, cut to it, with a short budget;
    each budget: the first prompts whole, with that max_tokens. Every request runs alone."""
    prompts = list(inp.corpus.prompts)
    reqs = []
    for n in lengths(inp):
        long_enough = [p for p in prompts if len(inp.inputs[p.id]) >= n][:PROMPTS_PER_SHAPE]
        for p in long_enough:
            reqs.append(inp.request(f"len{n}:{p.id}", p, inp.inputs[p.id][:n], max_tokens=min(p.max_tokens, 16)))
    for m in budgets(inp):
        for p in prompts[:PROMPTS_PER_SHAPE]:
            reqs.append(inp.request(f"max{m}:{p.id}", p, inp.inputs[p.id], max_tokens=m))
    return Workload("shapes", inp.level, reqs)


AXIS = AxisSpec(
    name="shapes", order=10, levels=("k",), build=build, runs_on="runner", against_baseline=True,
    guards="a prompt of length 1 + K taken down the verify path at prefill (vLLM #53051); lengths "
           "just past a cache block or a graph size read padding as real (vLLM #45100); output "
           "budgets of 1, K, K + 1 cut inside accepted drafts",
    description="Prompts of 1, K, K+1, K+2 and block size ± 1 tokens and budgets of 1, K and K+1 "
                "tokens, each spec output judged against the baseline's on the same request.")
