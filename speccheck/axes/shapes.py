"""shapes: prompt lengths and output budgets around K and the cache block size, and batches of
requests at the engine's CUDA-graph capture sizes and one either side."""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from speccheck.axes._registry import AxisInput, AxisSpec
from speccheck.types import Workload

#: corpus prompts cut to each length (the first ones long enough)
PROMPTS_PER_SHAPE = 2
#: captured batch sizes (in requests) the batch level sends, each with one request fewer and
#: one more: the first ones of at least MIN_EDGE whose next size up is padded or past every graph
BOUNDARIES = 2
MIN_EDGE = 4
#: no batch level sends more requests at once than this (engines whose sizes start higher)
MAX_BATCH = 64
#: what the batch level sends where the engine reports no captured size (it runs eagerly):
#: the proof then says no step replayed a graph, and the level fails as not exercised
NO_GRAPHS = (3, 4, 5)
#: tokens each request of a batch decodes, end-of-sequence ignored, so that its batch holds
BATCH_TOKENS = 8


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


def batch_targets(capture_sizes: Sequence[int], tokens_per_request: int) -> list[int]:
    """The batch sizes, in requests, at which a step is a captured size (a uniform step of n
    requests is n x tokens_per_request tokens: 1 + K with speculation) and one either side:
    the padded ones (a size past a captured one is padded up to the next, where padding rows
    that are read as real corrupt a real row: vLLM #45100) and the last before the graphs end.
    Derived from what the engine reports, so the proof is judged by the same rule."""
    q = max(int(tokens_per_request), 1)
    reqs = sorted({c // q for c in capture_sizes if c > 0 and c % q == 0})
    edges = [r for r in reqs if MIN_EDGE <= r < MAX_BATCH and r + 1 not in reqs][:BOUNDARIES]
    if not edges and reqs:
        edges = [min(reqs[-1], MAX_BATCH - 1)]
    if not edges:
        return list(NO_GRAPHS)
    return sorted({n for r in edges for n in (r - 1, r, r + 1) if n >= 1})


def _build_lengths(inp: AxisInput) -> Workload:
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


def _build_batches(inp: AxisInput) -> Workload:
    """Per target size n (batch_targets of the engine's capture sizes for this config), n
    distinct short corpus prompts arriving together, decoding BATCH_TOKENS tokens each past any
    end-of-sequence, so that their steps hold exactly n requests; each batch arrives after the
    one before has finished. Each request is judged against the same prompt alone."""
    q = 1 + (0 if inp.config.is_baseline else inp.config.k)
    targets = batch_targets(inp.capture_sizes, q)
    prompts = sorted(inp.serving_prompts(), key=lambda p: (len(inp.inputs[p.id]), p.id))
    reqs, start = [], 0
    for n in targets:
        for i in range(n):
            p = replace(prompts[i % len(prompts)], max_tokens=BATCH_TOKENS, ignore_eos=True)
            reqs.append(inp.request(f"b{n}/{i:02d}:{p.id}", p, inp.inputs[p.id], arrive_after=start))
        start += BATCH_TOKENS + 3  # every request of this batch has ended by then
    return Workload("shapes", inp.level, reqs, max_in_flight=max(targets),
                    knobs={"cudagraph_metrics": "on"})


def build(inp: AxisInput) -> Workload:
    return _build_batches(inp) if inp.level == "batch" else _build_lengths(inp)


AXIS = AxisSpec(
    name="shapes", order=10, levels=("k", "batch"), build=build, generate_levels=("k",),
    against_baseline=True, proofs={"batch": ("graph_steps",)},
    guards="a prompt of length 1 + K taken down the verify path at prefill (vLLM #53051); lengths "
           "just past a cache block, and batches just past a CUDA-graph capture size, reading "
           "padding as real (vLLM #45100); output budgets of 1, K, K + 1 cut inside accepted drafts",
    description="Prompts of 1, K, K+1, K+2 and block size ± 1 tokens and budgets of 1, K and K+1 "
                "tokens, each spec output judged against the baseline's on the same request; and "
                "batches of requests at the engine's CUDA-graph capture sizes ± 1, each request "
                "judged against the same prompt alone.")
