"""The reference model's numerics: GDN forms agree, rollback is exact, cache forward equals
the training forward, names follow the HF / vLLM layouts, shipped weights fit the budget."""
from __future__ import annotations

import json

import pytest
import torch

from speccheck.reference.engine import WEIGHTS_DIR, load_networks
from speccheck.reference.model import (Cache, DFlashDrafter, MTPModule, Qwen3_5TextModel,
                                       ReferenceConfig, gdn_chunked, gdn_recurrent,
                                       init_weights)


def _gdn_inputs(T, seed=0, B=1, H=4, D=64):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    decay = -torch.rand(B, T, H, generator=g) * 2  # log decay <= 0
    beta = torch.rand(B, T, H, generator=g)
    state = torch.randn(B, H, D, D, generator=g) * 0.1
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("T,chunk", [(1, 64), (5, 64), (37, 16), (130, 64)])
def test_chunked_equals_recurrent(T, chunk):
    q, k, v, g, beta, s0 = _gdn_inputs(T)
    o_r, s_r, none_r = gdn_recurrent(q, k, v, g, beta, s0)
    o_c, s_c, none_c = gdn_chunked(q, k, v, g, beta, s0, chunk)
    assert none_r is None and none_c is None
    assert torch.allclose(o_r, o_c, atol=1e-5, rtol=1e-4)
    assert torch.allclose(s_r, s_c, atol=1e-5, rtol=1e-4)
    # with per-position states the final state is the last of them, not returned twice
    o_rp, no_r, per_r = gdn_recurrent(q, k, v, g, beta, s0, per_position=True)
    o_cp, no_c, per_c = gdn_chunked(q, k, v, g, beta, s0, chunk, per_position=True)
    assert no_r is None and no_c is None and len(per_r) == len(per_c) == T
    assert torch.equal(o_rp, o_r) and torch.equal(o_cp, o_c)
    assert torch.equal(per_r.at(T - 1), s_r)
    assert torch.allclose(per_c.at(T - 1), s_c, atol=1e-5, rtol=1e-4)
    assert torch.allclose(per_r.stack(), per_c.stack(), atol=1e-5, rtol=1e-4)


def test_gdn_per_position_state_is_prefix_state():
    """The state kept for position i is the state after exactly the first i+1 tokens."""
    q, k, v, g, beta, s0 = _gdn_inputs(9, seed=1)
    _, _, per = gdn_chunked(q, k, v, g, beta, s0, 64, per_position=True)
    per = per.stack()
    for i in (0, 3, 8):
        _, s_i, _ = gdn_recurrent(q[:, : i + 1], k[:, : i + 1], v[:, : i + 1], g[:, : i + 1],
                                  beta[:, : i + 1], s0)
        assert torch.allclose(per[:, i], s_i, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_per_row_state_of_a_batch_is_that_rows_prefix_state(form):
    """A ragged batch keeps a different count per row: at_rows(idx)[b] is row b's state
    after position idx[b], as the one-row at() gives it."""
    q, k, v, g, beta, s0 = _gdn_inputs(8, seed=2, B=3)
    fn = gdn_chunked if form == "chunked" else gdn_recurrent
    _, _, per = fn(q, k, v, g, beta, s0, per_position=True)
    idx = torch.tensor([0, 7, 4])
    rows = per.at_rows(idx)
    assert rows.shape == s0.shape
    for b, i in enumerate(idx.tolist()):
        assert torch.allclose(rows[b], per.at(i)[b], atol=1e-6, rtol=1e-5)
    assert not torch.allclose(rows[0], rows[1], atol=1e-3)  # the rows really differ


@pytest.fixture(scope="module")
def nets():
    cfg = ReferenceConfig()
    target, mtp, drafter = Qwen3_5TextModel(cfg), MTPModule(cfg), DFlashDrafter(cfg)
    for seed, n in enumerate((target, mtp, drafter)):
        init_weights(n, seed)
        n.eval()
    return cfg, target, mtp, drafter


@torch.no_grad()
def test_cache_forward_equals_training_forward(nets):
    cfg, target, _, _ = nets
    ids = torch.randint(0, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    full, _ = target(ids)
    cache = Cache(len(target.layers), 64)
    parts = [target(ids[:, :23], cache)[0]]
    for t in range(23, 40):  # one token at a time, recurrent GDN, per-query attention
        parts.append(target(ids[:, t:t + 1], cache, gdn_form="recurrent", attn_form="single")[0])
    assert cache.length == 40
    assert torch.allclose(full, torch.cat(parts, 1), atol=1e-4, rtol=1e-3)


@torch.no_grad()
@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_rollback_is_exact(nets, form):
    """Verify 6 tokens, keep 3: the cache equals one that only ever saw those 3."""
    cfg, target, _, _ = nets
    ids = torch.randint(0, cfg.vocab_size, (1, 30), generator=torch.Generator().manual_seed(1))
    a, b = Cache(len(target.layers), 64), Cache(len(target.layers), 64)
    target(ids[:, :24], a)
    target(ids[:, :24], b)
    target(ids[:, 24:30], a, gdn_form=form, per_position=True)
    a.commit(3)
    target(ids[:, 24:27], b, gdn_form=form)
    assert a.length == b.length == 27
    for i, layer in enumerate(target.layers):
        if layer.layer_type == "linear_attention":
            assert torch.allclose(a.gdn[i], b.gdn[i], atol=1e-5, rtol=1e-4)
            assert torch.allclose(a.conv[i], b.conv[i], atol=1e-5, rtol=1e-4), (i, (a.conv[i] - b.conv[i]).abs().max())
    nxt = ids[:, 27:28]
    ha, _ = target(nxt, a, gdn_form="recurrent")
    hb, _ = target(nxt, b, gdn_form="recurrent")
    assert torch.allclose(ha, hb, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_stale_commit_keeps_rejected_updates(nets):
    """commit(roll_back_gdn=False) is the planted 'stale-state' bug: the state differs."""
    cfg, target, _, _ = nets
    ids = torch.randint(0, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2))
    a, b = Cache(len(target.layers), 32), Cache(len(target.layers), 32)
    for c, rollback in ((a, True), (b, False)):
        target(ids[:, :14], c)
        target(ids[:, 14:20], c, per_position=True)
        c.commit(2, roll_back_gdn=rollback)
    assert not torch.allclose(a.gdn[0], b.gdn[0])


def test_parameter_names_follow_hf_and_vllm(nets):
    _, target, mtp, drafter = nets
    t = set(target.state_dict())
    assert {"embed_tokens.weight", "norm.weight", "layers.0.linear_attn.in_proj_qkv.weight",
            "layers.0.linear_attn.in_proj_z.weight", "layers.0.linear_attn.in_proj_b.weight",
            "layers.0.linear_attn.in_proj_a.weight", "layers.0.linear_attn.conv1d.weight",
            "layers.0.linear_attn.A_log", "layers.0.linear_attn.dt_bias",
            "layers.0.linear_attn.norm.weight", "layers.0.linear_attn.out_proj.weight",
            "layers.3.self_attn.q_proj.weight", "layers.3.self_attn.q_norm.weight",
            "layers.3.self_attn.k_norm.weight", "layers.3.mlp.gate_proj.weight",
            "layers.3.input_layernorm.weight", "layers.3.post_attention_layernorm.weight"} <= t
    assert "lm_head.weight" not in t  # tied
    assert {"fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight",
            "layers.0.self_attn.q_proj.weight", "norm.weight"} <= set(mtp.state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight",
            "layers.1.mlp.down_proj.weight"} <= set(drafter.state_dict())


def test_config_round_trip_and_bad_field():
    cfg = ReferenceConfig()
    assert ReferenceConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="hidden_sise"):
        ReferenceConfig.from_dict({"hidden_sise": 3})


def test_shipped_weights_load_and_fit_budget():
    files = ["model.safetensors", "drafter.safetensors"]
    if not all((WEIGHTS_DIR / f).is_file() for f in files):
        pytest.skip("no trained weights shipped yet")
    assert sum((WEIGHTS_DIR / f).stat().st_size for f in files) <= 20_000_000
    cfg, target, mtp, drafter, trained = load_networks(WEIGHTS_DIR)
    assert trained and mtp is not None and drafter is not None
    assert cfg.drafter.block_size == 8


@torch.no_grad()
def test_bf16_logits_are_the_fp32_product_and_a_row_is_the_same_alone_or_in_a_batch():
    """The CPU lm head keeps the bf16 operands' product in fp32 (no bf16 ties for argmax to
    break by token id), and a row's logits do not depend on the rows beside it (a decode step
    and a verify then score a position identically)."""
    cfg = ReferenceConfig()
    target = Qwen3_5TextModel(cfg)
    init_weights(target, 0, std=0.5)
    target = target.to(torch.bfloat16)
    h = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
    got = target.logits(h)
    assert got.dtype == torch.float32
    full = torch.nn.functional.linear(h.float(), target.embed_tokens.weight.float())
    assert torch.allclose(got, full, rtol=0, atol=1e-4)
    assert torch.equal(got.topk(5, dim=-1).indices, full.topk(5, dim=-1).indices)
    for i in range(6):
        assert torch.equal(target.logits(h[i:i + 1])[0], got[i])


@pytest.mark.parametrize("T", [2, 33, 257, 700])
def test_prefill_attention_is_the_masked_form_bit_for_bit(T):
    """A prefill (queries = keys, from position 0) attends with ``is_causal`` on the CPU, which
    skips the keys above the diagonal; it must give the bits of the explicit causal mask it
    replaced, or every prefill and teacher-forced rescoring (the same square call) would move
    against the stored runs and goldens."""
    from speccheck.reference.model import _attend

    g = torch.Generator().manual_seed(T)
    q = torch.randn(1, 4, T, 64, generator=g).bfloat16()
    K, V = (torch.randn(1, 2, T, 64, generator=g).bfloat16() for _ in range(2))
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(q, K, V, attn_mask=mask,
                                                            enable_gqa=True)
    assert torch.equal(_attend(q, K, V, 0, "multi"), want)
