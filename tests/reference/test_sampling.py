"""The reference engine's sampler (reference/sampling.py): speculative sampling leaves the
target's distribution unchanged, the planted sampler faults do not, and seeds repeat."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from speccheck.reference.sampling import SamplingParams, Uniforms, accept, icdf, transform


def _emitted_first(p, q, fault=None, n=6000, seed=0):
    """Histogram of the first emitted token of one-draft steps: draft ~ q, then accept()."""
    V = p.shape[-1]
    counts = np.zeros(V)
    for i in range(n):
        rng = Uniforms(seed, [i])
        d = icdf(q[0], rng(0, "draft"))
        out = accept(p, q, [d], rng, 0, fault)
        counts[out[0]] += 1
    return counts


def _pq(V=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(2, V, generator=g, dtype=torch.float64) * 1.5, -1)
    q = torch.softmax(torch.randn(1, V, generator=g, dtype=torch.float64) * 1.5, -1)
    return p, q


def test_speculative_sampling_is_exact():
    p, q = _pq()
    counts = _emitted_first(p, q)
    assert stats.chisquare(counts, p[0].numpy() * counts.sum()).pvalue > 1e-3


@pytest.mark.parametrize("fault", ["residual-is-p", "residual-unnormalised"])
def test_residual_faults_change_the_distribution(fault):
    p, q = _pq()
    counts = _emitted_first(p, q, fault)
    assert stats.chisquare(counts, p[0].numpy() * counts.sum()).pvalue < 1e-6


def test_transform_top_p_top_k():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64))
    p = transform(logits, SamplingParams(1.0, top_p=0.7))
    assert p.tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0, 0])
    p = transform(logits, SamplingParams(1.0, top_k=3))
    assert p.tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    p = transform(logits, SamplingParams(0.5))
    ref = np.array([0.5, 0.3, 0.15, 0.05]) ** 2
    assert p.tolist() == pytest.approx((ref / ref.sum()).tolist())


@pytest.mark.parametrize("t,top_p,top_k", [(0.7, 0.9, 0), (1.0, 0.6, 4), (1.3, 0.8, 7), (0.5, 1.0, 3)])
def test_transform_is_vllms_order(t, top_p, top_k):
    """Temperature, then top-k, then top-p over the renormalised survivors: the scorer's
    transform (verify/sampling_dist.transform_full) is the oracle the distribution check
    holds every engine's samples to."""
    from speccheck.verify.sampling_dist import transform_full

    g = torch.Generator().manual_seed(7)
    rows = torch.log_softmax(torch.randn(20, 32, generator=g, dtype=torch.float64) * 2, -1)
    ours = transform(rows, SamplingParams(t, top_p, top_k)).numpy()
    np.testing.assert_allclose(ours, transform_full(rows.numpy(), t, top_p, top_k), atol=1e-12)


def test_uniforms_depend_on_seed_prompt_position_only():
    a, b = Uniforms(1, [5, 6]), Uniforms(1, [5, 6])
    assert a(3, "accept") == b(3, "accept")
    assert a(3, "accept") != a(4, "accept") != Uniforms(2, [5, 6])(4, "accept")
    reused = Uniforms(1, [5, 6], reuse=True)
    assert reused(3, "draw") == reused(9, "draw")


def test_icdf_pit_is_u():
    p = torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64)
    assert icdf(p, 0.59) == 1 and icdf(p, 0.61) == 2 and icdf(p, 0.95) == 0


@pytest.mark.slow
def test_sampled_runs_repeat_and_judge_clean(tmp_path):
    """A sampled spec run: the same seed gives the same tokens in a fresh engine; another seed
    other tokens; the scores feed a passing distribution check."""
    from speccheck.corpus import load_corpus
    from speccheck.reference.engine import ReferenceEngine
    from speccheck.types import SpecConfig
    from speccheck.verify.sampled import fit

    args = {"temperature": "0.8", "top_p": "0.9", "seed": "3"}
    c = load_corpus("smoke")
    e1, e2 = ReferenceEngine(engine_args=args), ReferenceEngine(engine_args=args)
    ids = [e1.tokenize(p) for p in c.prompts]
    cfg = SpecConfig("mtp", 3)
    a, b = e1.generate(c.prompts, ids, cfg, 5), e2.generate(c.prompts, ids, cfg, 5)
    assert [x.token_ids.tolist() for x in a] == [y.token_ids.tolist() for y in b]
    other = ReferenceEngine(engine_args={**args, "seed": "4"}).generate(c.prompts, ids, cfg, 5)
    assert [x.token_ids.tolist() for x in a] != [y.token_ids.tolist() for y in other]
    scores = e1.score_sampled(ids, [x.token_ids for x in a])
    assert all(s.shape == (x.n_tokens, 6) for s, x in zip(scores, a))
    assert fit(scores, 0.01).passed
