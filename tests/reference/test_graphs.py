"""The CUDA-graph step loops (reference/graphs.py), run eagerly on the CPU: the same
tokens and acceptance as Decoder's eager loops, exact losslessness with equal numerics, the
capacity buffers reused across prompts; the fused Triton GDN kernel (through Triton's
interpreter, where Triton is installed) against the PyTorch recurrence. On a GPU the same
steps are captured once and replayed (benchmarks/bench_reference.py measures them)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from speccheck.corpus import load_corpus
from speccheck.engines.base import EngineUsageError
from speccheck.reference.engine import ReferenceEngine
from speccheck.reference.graphs import CAPACITY_STEP, GraphDecoding, capacity
from speccheck.types import Prompt, SpecConfig

EQUAL = {"dtype": "fp32", "gdn_decode": "recurrent", "gdn_verify": "recurrent",
         "attn_decode": "single", "attn_verify": "single"}
CONFIGS = [SpecConfig(), SpecConfig("mtp", 3), SpecConfig("dflash", 7), SpecConfig("dflash2", 7),
           SpecConfig("dflash", 2)]


def _prompts(n: int = 24):
    ps = list(load_corpus("smoke").prompts) + list(load_corpus("code").prompts)[:2]
    return [Prompt(p.id, p.category, n, p.text, p.messages) for p in ps]


@pytest.fixture(scope="module")
def engine():
    return ReferenceEngine(engine_args=EQUAL)


def _graphed(engine) -> ReferenceEngine:
    """The engine with its decoder's one-prompt loops on the graph steps (eager on CPU)."""
    e = engine.with_args()
    e.decoder.graphs = GraphDecoding(e.decoder)
    return e


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_graph_steps_decode_what_the_eager_loops_decode(engine, config):
    prompts = _prompts()
    ids = [engine.tokenize(p) for p in prompts]
    eager = engine.generate(prompts, ids, config, 5)
    graphed = _graphed(engine).generate(prompts, ids, config, 5)
    for a, b in zip(eager, graphed):
        assert b.token_ids.tolist() == a.token_ids.tolist(), a.prompt_id
        assert b.finish_reason == a.finish_reason
        assert np.allclose(b.logprobs, a.logprobs, atol=1e-5)
        assert np.array_equal(b.topk_ids[:, 0], a.topk_ids[:, 0])
        if config.is_baseline:
            assert b.spec is None
        else:  # the same drafts accepted at the same positions
            assert b.spec.accepted_per_pos == a.spec.accepted_per_pos
            assert (b.spec.drafts, b.spec.accepted_tokens) == (a.spec.drafts, a.spec.accepted_tokens)
            assert b.spec.iterations == b.spec.drafts
            assert (b.spec.draft_s or 0) > 0 if b.spec.drafts else b.spec.draft_s is None


@pytest.mark.slow
def test_graph_steps_are_lossless_with_equal_numerics(engine):
    e = _graphed(engine)
    prompts = _prompts(32)
    ids = [e.tokenize(p) for p in prompts]
    base = e.generate(prompts, ids, SpecConfig(), 5)
    rejected = 0
    for config in CONFIGS[1:]:
        for s, b in zip(e.generate(prompts, ids, config, 5), base):
            assert s.token_ids.tolist() == b.token_ids.tolist(), (config.name, s.prompt_id)
            rejected += s.spec.draft_tokens - s.spec.accepted_tokens
    assert rejected > 0  # rollback happened


def test_buffers_are_shared_by_capacity_and_reset_between_prompts(engine):
    e = _graphed(engine)
    p = _prompts(16)[0]
    ids = e.tokenize(p)
    first = e.generate([p], [ids], SpecConfig("dflash", 7), 5)[0]
    other = _prompts(16)[1]
    e.generate([other], [e.tokenize(other)], SpecConfig("dflash", 7), 5)  # same capacity bucket
    again = e.generate([p], [ids], SpecConfig("dflash", 7), 5)[0]
    assert again.token_ids.tolist() == first.token_ids.tolist()
    assert np.array_equal(again.logprobs, first.logprobs)
    assert list(e.decoder.graphs.buffers) == [capacity(len(ids) + 16 + 7 + 4)]
    assert capacity(1) == capacity(CAPACITY_STEP) == CAPACITY_STEP < capacity(CAPACITY_STEP + 1)


@pytest.mark.parametrize("config", [SpecConfig(), SpecConfig("dflash", 7), SpecConfig("mtp", 3)],
                         ids=lambda c: c.name)
def test_no_step_runs_past_max_tokens(engine, config, monkeypatch):
    """A generation that ends by length runs no step past its end: the steps queued equal
    the steps read (one queued ahead and dropped cost a whole iteration, ~3 % of a spec
    generation of 96 tokens on the H200)."""
    from speccheck.reference import graphs

    queued = []
    queue = graphs._Ahead._queue
    monkeypatch.setattr(graphs._Ahead, "_queue", lambda self: (queued.append(1), queue(self)))
    e = _graphed(engine)
    for n in (2, 9, 24):
        p = _prompts(n)[0]
        p = Prompt(p.id, p.category, n, p.text, p.messages, ignore_eos=True)
        queued.clear()
        c = e.generate([p], [e.tokenize(p)], config, 5)[0]
        assert c.n_tokens == n and c.finish_reason == "length"
        assert len(queued) == (n - 1 if config.is_baseline else c.spec.drafts), n


def test_batches_and_faults_keep_the_eager_loops(engine):
    e = _graphed(engine)
    g = e.decoder.graphs
    assert g.handles("dflash", 1) and not g.handles("dflash", 2)
    faulty = e.with_args(fault="stale-state")
    faulty.decoder.graphs = GraphDecoding(faulty.decoder)
    assert not faulty.decoder.graphs.handles("mtp", 1)


def test_cpu_engine_runs_no_graphs_and_fused_needs_cuda():
    engine = ReferenceEngine(engine_args={**EQUAL, "device": "cpu"})  # a CPU engine on a GPU box too
    assert engine.decoder.graphs is None  # cuda_graphs=on applies on CUDA only
    assert "cuda_graphs" not in engine.identity()
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(EngineUsageError, match="gdn_verify=fused"):
            engine.with_args(gdn_verify="fused")
        with pytest.raises(EngineUsageError, match="attn_draft=fused"):
            engine.with_args(attn_draft="fused")
    with pytest.raises(EngineUsageError, match="attn_prefill=fused: the fused attention kernel"):
        engine.with_args(attn_prefill="fused")
    # the drafter's attention is in the identity only when not the default: goldens recorded
    # before the knob existed still compare equal
    assert "attn_draft" not in engine.identity()["knobs"]


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="Triton is not installed (the fused GDN kernel's tests "
                                         "run it through Triton's interpreter)")


def _interpreted(code: str) -> None:
    """Run ``code`` in a fresh Python with Triton's interpreter on from the start (it must be
    set before Triton is first imported, which another test in this process may have done)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


@needs_triton
def test_fused_gdn_kernel_matches_the_recurrence():
    _interpreted("""
        import torch
        from speccheck.reference.kernels.gdn_fused import gdn_fused
        from speccheck.reference.model import gdn_recurrent

        gen = torch.Generator().manual_seed(1)
        B, T, H, D = 2, 5, 4, 64
        qkv = torch.randn(B, T, 3 * H * D, generator=gen)
        q, k, v = (x.reshape(B, T, H, D) for x in qkv.split(H * D, -1))  # strided, as the layer's
        g = -torch.nn.functional.softplus(torch.randn(B, T, H, generator=gen))
        beta = torch.sigmoid(torch.randn(B, T, H, generator=gen)).bfloat16()
        s0 = torch.randn(B, H, D, D, generator=gen) * 0.1
        o_ref, s_ref, _ = gdn_recurrent(q, k, v, g, beta, s0)
        o, s, _ = gdn_fused(q, k, v, g, beta, s0)
        assert torch.allclose(o, o_ref, atol=1e-6, rtol=1e-5), (o - o_ref).abs().max()
        assert torch.allclose(s, s_ref, atol=1e-6, rtol=1e-5), (s - s_ref).abs().max()
        o2, none, per = gdn_fused(q, k, v, g, beta, s0, per_position=True)
        _, _, per_ref = gdn_recurrent(q, k, v, g, beta, s0, per_position=True)
        assert none is None and torch.equal(o2, o)
        assert torch.allclose(per.stacked, per_ref.stacked, atol=1e-6, rtol=1e-5)
        assert torch.equal(per.at(T - 1), s)
    """)


@needs_triton
def test_fused_attention_kernel_matches_sdpa():
    """attn_fused against SDPA with the explicit mask: grouped queries, causal (the target's
    decode and verify) and block-visible (a DFlash block), sequences of a batch at their own
    positions, key counts across block boundaries (fp32: the interpreter's bf16 products are
    not bf16's; on the H200 bf16 agrees to bf16 rounding, benchmarks/README)."""
    _interpreted("""
        import torch, torch.nn.functional as F
        from speccheck.reference.kernels.attn_fused import attn_fused

        g = torch.Generator().manual_seed(0)
        for B, H, HKV, T, L, causal in [(1, 4, 2, 8, 300, True), (1, 4, 2, 1, 77, True),
                                        (2, 4, 2, 8, 130, False), (3, 4, 1, 6, 64, True),
                                        (1, 2, 2, 3, 5, False)]:
            q = torch.randn(B, H, T, 64, generator=g)
            K, V = torch.randn(B, HKV, L, 64, generator=g), torch.randn(B, HKV, L, 64, generator=g)
            base = torch.randint(0, L - T + 1, (B,), generator=g)
            got = attn_fused(q, K, V, base, causal)
            for b in range(B):
                n = int(base[b]) + T
                mask = torch.ones(T, n, dtype=torch.bool)
                mask = mask.tril(n - T) if causal else mask
                want = F.scaled_dot_product_attention(q[b:b + 1], K[b:b + 1, :, :n], V[b:b + 1, :, :n],
                                                      attn_mask=mask, enable_gqa=True)
                assert torch.allclose(got[b:b + 1], want, atol=2e-6), (B, T, L, causal)
    """)


@needs_triton
def test_fused_form_is_lossless_in_the_graph_steps():
    """The fused GDN kernel and the fused attention (target decode and verify, drafter) in the
    graph steps, fp32: every speculative method's output is the baseline's, with rejections."""
    _interpreted("""
        from speccheck.corpus import load_corpus
        from speccheck.reference.engine import ReferenceEngine
        from speccheck.reference.graphs import GraphDecoding
        from speccheck.types import Prompt, SpecConfig

        e = ReferenceEngine(engine_args={"dtype": "fp32", "gdn_decode": "fused",
                                         "gdn_verify": "fused", "attn_decode": "fused",
                                         "attn_verify": "fused", "attn_draft": "fused"})
        e.decoder.graphs = GraphDecoding(e.decoder)
        p = load_corpus("smoke").prompts[0]
        p = Prompt(p.id, p.category, 8, p.text, p.messages)
        ids = e.tokenize(p)
        base = e.generate([p], [ids], SpecConfig(), 5)[0]
        for config in (SpecConfig("dflash", 3), SpecConfig("dflash2", 3), SpecConfig("mtp", 2)):
            spec = e.generate([p], [ids], config, 5)[0]
            assert spec.token_ids.tolist() == base.token_ids.tolist(), config.name
            assert spec.spec.accepted_tokens < spec.spec.draft_tokens  # rolled back fused states
    """)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.compile of the graph steps: CUDA")
def test_compiled_steps_decode_what_the_uncompiled_ones_decode():
    """compile=on (each graph step torch.compile'd before its capture) on CUDA, fp32: the same
    tokens as the uncompiled graph steps for every method, with rejections (rollback ran), and
    the same acceptance; the DFlash2 selector, the GDN kernel and the attention are the Triton
    ones on both sides."""
    base = ReferenceEngine(engine_args={"dtype": "fp32", "device": "cuda", "gdn_decode": "fused",
                                        "gdn_verify": "fused", "attn_decode": "fused",
                                        "attn_verify": "fused", "attn_draft": "fused"})
    compiled = base.with_args(compile="on")
    assert compiled.identity()["compile"] == "on" and "compile" not in base.identity()
    prompts = _prompts(32)
    ids = [base.tokenize(p) for p in prompts]
    for config in CONFIGS:
        want = base.generate(prompts, ids, config, 5)
        got = compiled.generate(prompts, ids, config, 5)
        for a, b in zip(want, got):
            assert b.token_ids.tolist() == a.token_ids.tolist(), (config.name, a.prompt_id)
            assert np.allclose(b.logprobs, a.logprobs, atol=1e-4)
        if not config.is_baseline:
            assert sum(c.spec.accepted_tokens for c in got) == sum(c.spec.accepted_tokens for c in want)
            assert sum(c.spec.accepted_tokens for c in got) < sum(c.spec.draft_tokens for c in got)
