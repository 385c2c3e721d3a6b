"""DFlash2 on the reference engine: the grouped dynamic convolution and the selector walk do
what DFLASH2.md says, drafting with them is lossless where numerics are equal (with
rejections), the knobs change drafts only, and at initialisation DFlash2 drafts as DFlash."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from speccheck.engines.base import EngineUsageError
from speccheck.reference.dflash2 import (DFLASH2_FILE, DFlash2Drafter, DFlashGroupedConv,
                                         block_reach, block_slots, candidates,
                                         init_from_dflash, load_dflash2, save_dflash2, walk)
from speccheck.reference.engine import WEIGHTS_DIR, ReferenceEngine, load_networks
from speccheck.types import SpecConfig

from tests.reference.test_decode import EQUAL, _prompts, _total


def test_grouped_conv_matches_its_formula():
    """out[i, c] = Σ_t (base[side, t, c] + δ[i, t, group(c)]) x[i - t, c], never across a block."""
    torch.manual_seed(0)
    conv = DFlashGroupedConv(hidden=32, taps=2, group_size=16)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x = torch.randn(1, 6, 32)
    slot = block_slots(6, 3, x.device)  # two blocks of 3
    reach = block_reach(slot, 2)
    out, delta = conv.prepare(x, reach)
    delta0 = conv.kernel_projection(x).view(1, 6, 2, 2, 2)[:, :, 0]
    want = torch.zeros_like(x)
    for i in range(6):
        for c in range(32):
            for t in range(2):
                if slot[i] >= t:
                    want[0, i, c] += (conv.base_kernel[0, t, c] + delta0[0, i, t, c // 16]) \
                        * x[0, i - t, c]
    assert torch.allclose(out, want, atol=1e-5)
    y = torch.randn(1, 6, 32)
    fin = conv.finish(y, delta, reach)
    assert torch.allclose(fin[0, 3], (conv.base_kernel[1, 0] + delta[0, 3, 1, 0].repeat_interleave(16)) * y[0, 3],
                          atol=1e-5)  # slot 0 of block 2: no tap from block 1


@settings(max_examples=int(os.environ.get("CONV_EXAMPLES", 60)), deadline=None)
@given(b=st.integers(1, 2), t=st.integers(1, 9), block=st.integers(1, 9), taps=st.integers(1, 3),
       side=st.integers(0, 1), bf16=st.booleans(), seed=st.integers(0, 2**16))
def test_grouped_conv_kernel_has_the_bits_of_the_ops(b, t, block, taps, side, bf16, seed):
    """The CPU's C convolution (cpu_kernels.grouped_conv) against the same ops in PyTorch,
    bit for bit, in bf16 and fp32, with zeros of both signs among the inputs."""
    from speccheck.reference import dflash2
    from speccheck.reference.kernels import cpu as cpu_kernels

    if cpu_kernels._kernel() is None:
        pytest.skip("no C compiler here")
    assume(taps <= t)  # (the op form's shift assumes a tap reaches no further than the block)
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    conv = DFlashGroupedConv(hidden=32, taps=taps, group_size=8).to(dtype)

    def draw(*shape):
        v = torch.randn(*shape, generator=g)
        v[torch.rand(*shape, generator=g) < 0.1] = 0.0
        v[torch.rand(*shape, generator=g) < 0.1] = -0.0
        return v.to(dtype)

    with torch.inference_mode():
        conv.base_kernel.copy_(draw(2, taps, 32))
        x, delta = draw(b, t, 32), draw(b, t, 2, taps, 4)
        reach = block_reach(block_slots(t, block, x.device), taps)
        got = conv._convolve(x, delta, side, reach)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(dflash2, "grouped_conv", lambda *a: None)
            want = conv._convolve(x, delta, side, reach)
    view = torch.int16 if bf16 else torch.int32
    assert torch.equal(got.view(view), want.view(view))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3), l=st.integers(1, 7), v=st.integers(8, 40), k=st.integers(1, 8),
       r=st.integers(1, 6), bf16=st.booleans(), seed=st.integers(0, 2**16))
def test_selector_kernel_drafts_as_the_ops(n, l, v, k, r, bf16, seed):
    """The CPU's C selector (cpu_kernels.dflash2_select: candidates, the edge-score row the
    walk reads, the walk) against candidates + CandidateSelector.edge_scores + walk. Small
    integers everywhere: every sum is exact in any order, and ties are everywhere (equal
    unary scores go to the lower token id, equal edge scores to the lower candidate)."""
    from speccheck.reference.kernels import cpu as cpu_kernels
    from speccheck.reference.dflash2 import CandidateSelector

    if cpu_kernels._kernel() is None:
        pytest.skip("no C compiler here")
    assume(k <= v)
    g = torch.Generator().manual_seed(seed)
    ints = lambda lo, hi, *shape: torch.randint(lo, hi + 1, shape, generator=g).float()
    unary, hidden = ints(-3, 3, n, l, v), ints(-2, 2, n, l, r)
    anchor = torch.randint(0, v, (n,), generator=g)
    sel = CandidateSelector(hidden=r, vocab=v, rank=r, top_k=k)
    with torch.inference_mode():
        sel.hidden_projection.weight.copy_(torch.eye(r))  # h = the hidden states, exactly
        for book in (sel.predecessor_codebook, sel.successor_codebook):
            book.copy_(ints(-2, 2, v, r))
        if bf16:
            sel = sel.bfloat16()
        got = cpu_kernels.dflash2_select(unary, hidden, sel.predecessor_codebook,
                                         sel.successor_codebook, anchor, k)
        ids, vals = candidates(unary, k)
        want = ids.gather(-1, walk(sel.float().edge_scores(ids, vals, hidden, anchor))[..., None])[..., 0]
    assert torch.equal(got, want)


def test_conv_initialised_to_identity():
    conv = DFlashGroupedConv(hidden=32, taps=2, group_size=16)
    x = torch.randn(1, 5, 32)
    y, delta = conv.prepare(x, block_reach(block_slots(5, 5, x.device), 2))
    assert torch.equal(y, x)
    assert torch.equal(conv.finish(x, delta, block_reach(block_slots(5, 5, x.device), 2)), x)


def test_walk_follows_previous_choice_and_breaks_ties_low():
    scores = torch.zeros(1, 3, 4, 4)
    scores[0, 0, 0] = torch.tensor([1.0, 3.0, 3.0, 0.0])  # tie: index 1 wins
    scores[0, 1, 1] = torch.tensor([0.0, 0.0, 0.0, 5.0])  # row of the previous choice (1)
    scores[0, 1, 0] = torch.tensor([9.0, 0.0, 0.0, 0.0])  # another row: ignored
    scores[0, 2, 3] = torch.tensor([2.0, 2.0, 2.0, 2.0])
    assert walk(scores).tolist() == [[1, 3, 0]]


def test_candidates_order_ties_by_token_id():
    ids, vals = candidates(torch.tensor([[0.5, 2.0, 1.0, 2.0, 2.0]]), 3)
    assert ids.tolist() == [[1, 3, 4]] and vals.tolist() == [[2.0, 2.0, 2.0]]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([0.0, -0.0, 1.5, -1.5, 2.0, -3.25, 7.0, 1e-30, -1e-30,
                                 float("inf"), float("-inf"), 3.0e38]), min_size=1, max_size=40),
       st.data())
def test_candidates_are_the_stable_sorts_first_k(values, data):
    """The topk on one key per score picks what the stable descending sort picks first, ties
    (a bf16 score has many), signed zeros and infinities included; rows apart."""
    x = torch.tensor([values, values[::-1]])
    k = data.draw(st.integers(1, len(values)))
    vals, ids = torch.sort(x, dim=-1, descending=True, stable=True)
    got_ids, got_vals = candidates(x, k)
    assert got_ids.tolist() == ids[..., :k].tolist()
    assert got_vals.tolist() == vals[..., :k].tolist()


def _weights_dir(tmp_path, mutate=None):
    """A copy of the shipped weights whose dflash2.safetensors is DFlash2 initialised from the
    shipped DFlash drafter, then ``mutate``d."""
    for name in ("config.json", "model.safetensors", "drafter.safetensors", "tokenizer.json"):
        shutil.copyfile(WEIGHTS_DIR / name, tmp_path / name)
    cfg, _, _, drafter, _ = load_networks(WEIGHTS_DIR)
    d2 = DFlash2Drafter(cfg)
    init_from_dflash(d2, drafter)
    if mutate:
        mutate(d2)
    save_dflash2(d2, tmp_path / DFLASH2_FILE)
    return tmp_path


def _active(d2):
    """Conv and selector made to matter: random δ projections and hidden_projection."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in d2.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                w = conv.kernel_projection.weight
                w.copy_(torch.randn(w.shape, generator=gen) * 0.02)
        w = d2.candidate_selector.hidden_projection.weight
        w.copy_(torch.randn(w.shape, generator=gen) * 0.5)


@pytest.fixture(scope="module")
def prompts():
    eng = ReferenceEngine(engine_args=EQUAL)
    ps = _prompts()
    ids = [eng.tokenize(p) for p in ps]
    return ps, ids, eng.generate(ps, ids, SpecConfig(), 5)


def _check_lossless(out, baseline, k):
    for spec, base in zip(out, baseline):
        assert spec.token_ids.tolist() == base.token_ids.tolist(), spec.prompt_id
        assert np.allclose(spec.logprobs, base.logprobs, atol=1e-4)
    tot = _total(out)
    assert tot.draft_tokens == tot.drafts * k
    assert 0 < tot.accepted_tokens < tot.draft_tokens  # drafts are accepted and rejected
    assert sum(tot.accepted_per_pos) == tot.accepted_tokens
    return tot


@pytest.mark.parametrize("k", [1, 3, 7, 10])
def test_lossless_with_equal_numerics(prompts, k):
    """The shipped DFlash2 drafter at K = 1, 3, 7, 10 (shorter and longer blocks than trained)."""
    ps, ids, baseline = prompts
    eng = ReferenceEngine(engine_args=EQUAL)
    _check_lossless(eng.generate(ps, ids, SpecConfig("dflash2", k), 5), baseline, k)


@pytest.fixture(scope="module")
def active_dir(tmp_path_factory):
    return _weights_dir(tmp_path_factory.mktemp("active"), _active)


@pytest.mark.parametrize("knobs", [{}, {"dflash2_walk": "bf16"}, {"dflash2_top_k": "4"},
                                   {"dflash2_selector": "off"}])
def test_knobs_change_drafts_only(prompts, active_dir, knobs):
    """With a convolution and selector that matter: every knob setting stays lossless."""
    ps, ids, baseline = prompts
    eng = ReferenceEngine(str(active_dir), {**EQUAL, **knobs})
    _check_lossless(eng.generate(ps, ids, SpecConfig("dflash2", 7), 5), baseline, 7)
    assert eng.identity()["dflash2"]["walk"] == knobs.get("dflash2_walk", "fp32")


def test_selector_changes_drafts(prompts, active_dir):
    ps, ids, _ = prompts
    on = ReferenceEngine(str(active_dir), EQUAL).generate(ps, ids, SpecConfig("dflash2", 7), 5)
    off = ReferenceEngine(str(active_dir), {**EQUAL, "dflash2_selector": "off"}).generate(
        ps, ids, SpecConfig("dflash2", 7), 5)
    assert [c.spec.accepted_per_pos for c in on] != [c.spec.accepted_per_pos for c in off]


def test_initialised_dflash2_drafts_as_dflash(prompts, tmp_path):
    """Body from DFlash, identity convs, zero edge term: same drafts, so same counters (bf16)."""
    ps, ids, _ = prompts
    eng = ReferenceEngine(str(_weights_dir(tmp_path)), {})
    want = [c.spec for c in eng.generate(ps, ids, SpecConfig("dflash", 7), 5)]
    assert [c.spec for c in eng.generate(ps, ids, SpecConfig("dflash2", 7), 5)] == want


def test_file_roundtrip_and_identity(tmp_path):
    d = _weights_dir(tmp_path, _active)
    cfg, *_ = load_networks(d)
    a = load_dflash2(d / DFLASH2_FILE, cfg)
    save_dflash2(a, tmp_path / "again.safetensors")
    b = load_dflash2(tmp_path / "again.safetensors", cfg)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    eng = ReferenceEngine(str(d), {"dflash2_top_k": "8"})
    ident = eng.identity()
    assert ident["dflash2"]["top_k"] == 8 and ident["dflash2"]["selector"] == "on"
    assert ident["weights_sha256"][DFLASH2_FILE]
    assert eng.default_k("dflash2") == cfg.drafter.block_size - 1


@pytest.mark.parametrize("args", [{"dflash2_walk": "fp16"}, {"dflash2_top_k": "0"},
                                  {"dflash2_selector": "maybe"}])
def test_bad_knobs_refused(args):
    with pytest.raises(EngineUsageError, match="dflash2_"):
        ReferenceEngine(engine_args=args)


def test_missing_dflash2_file_is_a_clear_error(tmp_path, prompts):
    for name in ("config.json", "model.safetensors", "drafter.safetensors", "tokenizer.json"):
        shutil.copyfile(WEIGHTS_DIR / name, tmp_path / name)
    ps, ids, _ = prompts
    with pytest.raises(EngineUsageError, match="dflash2.safetensors"):
        ReferenceEngine(str(tmp_path), {}).generate(ps[:1], ids[:1], SpecConfig("dflash2", 7), 5)


def test_export_follows_the_dflash2_contract_and_reloads(tmp_path, prompts):
    """export-reference writes dflash2/ as vLLM 0.28+'s qwen3_dflash2.py expects (config
    fields, tensor names and shapes spelled out here from that file), and the exported
    tensors, loaded back into the reference engine, draft exactly as before."""
    import json

    from speccheck.reference import dflash2 as d2mod
    from speccheck.reference.export import export_reference, read_dflash2_dir

    (tmp_path / "w").mkdir()
    src = _weights_dir(tmp_path / "w", _active)
    out = tmp_path / "export"
    summary = export_reference(out, src)
    assert summary["dflash2"] == str(out / "dflash2")
    cfg = json.loads((out / "dflash2" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["is_causal"] is False and cfg["tie_word_embeddings"] is False
    n, H, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    assert cfg["layer_types"] == ["sliding_attention"] * n and cfg["sliding_window"] >= 1
    dc = cfg["dflash_config"]
    assert {"block_size", "mask_token_id", "target_layer_ids", "conv_kernel_size",
            "conv_group_size", "selector_rank", "selector_top_k"} <= set(dc)
    taps, groups, rank = dc["conv_kernel_size"], H // dc["conv_group_size"], dc["selector_rank"]
    assert taps == 2 and H % dc["conv_group_size"] == 0
    tensors = read_dflash2_dir(out / "dflash2")[1]
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    inter = cfg["intermediate_size"]
    want = {"fc.weight": (H, H * len(dc["target_layer_ids"])), "hidden_norm.weight": (H,),
            "norm.weight": (H,), "candidate_selector.hidden_projection.weight": (rank, H),
            "candidate_selector.predecessor_codebook": (V, rank),
            "candidate_selector.successor_codebook": (V, rank)}
    for i in range(n):
        p = f"layers.{i}."
        want.update({p + "self_attn.q_proj.weight": (heads * hd, H),
                     p + "self_attn.k_proj.weight": (kv * hd, H),
                     p + "self_attn.v_proj.weight": (kv * hd, H),
                     p + "self_attn.o_proj.weight": (H, heads * hd),
                     p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                     p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
                     p + "mlp.down_proj.weight": (H, inter),
                     p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)})
        for conv in ("attention_conv", "mlp_conv"):
            want[f"{p}{conv}.base_kernel"] = (2, taps, H)
            want[f"{p}{conv}.kernel_projection.weight"] = (2 * taps * groups, H)
    assert {k: tuple(t.shape) for k, t in tensors.items()} == want

    # reload: the exported tensors as the engine's dflash2.safetensors
    back = tmp_path / "back"
    back.mkdir()
    for name in ("config.json", "model.safetensors", "drafter.safetensors", "tokenizer.json"):
        shutil.copyfile(src / name, back / name)
    fields, state = read_dflash2_dir(out / "dflash2")
    cfg_ref, *_ = load_networks(src)
    d2 = DFlash2Drafter(cfg_ref, d2mod.DFlash2Config(**fields))
    d2.load_state_dict({k: v.float() for k, v in state.items()})
    save_dflash2(d2, back / DFLASH2_FILE)
    ps, ids, _ = prompts
    a = ReferenceEngine(str(src), {}).generate(ps, ids, SpecConfig("dflash2", 7), 5)
    b = ReferenceEngine(str(back), {}).generate(ps, ids, SpecConfig("dflash2", 7), 5)
    assert [c.spec for c in a] == [c.spec for c in b]
    assert all(np.array_equal(x.token_ids, y.token_ids) for x, y in zip(a, b))


def test_report_method_table_compares_mtp_dflash_dflash2_at_k7():
    """With stand-in ConfigResults (SimpleNamespace test doubles carrying the fields the table
    reads): baseline, then MTP / DFlash / DFlash2 at K=7, in that order, whatever the suite's
    order; a method without K=7 shows its best tokens/iteration."""
    from types import SimpleNamespace as NS

    from speccheck.report import compared_configs, method_table

    def res(name, tpi=None, tok_s=10.0):
        return NS(config=name, acceptance=tpi and NS(tokens_per_iter=tpi),
                  speed=NS(warm_tok_s=tok_s, speedup=tok_s / 10.0), token_agreement=0.995,
                  identical_runs=True, repeats=2, together=None)

    suite = NS(configs=[res("baseline"), res("dflash2-k7", 3.9, 58.5), res("mtp-k1", 1.9),
                        res("mtp-k7", 4.8, 59.2), res("dflash-k3", 2.5), res("dflash-k10", 3.1)])
    assert [r.config for r in compared_configs(suite)] == ["baseline", "mtp-k7", "dflash-k10",
                                                          "dflash2-k7"]
    table = method_table(suite).splitlines()
    assert table[0].startswith("| method | K | decode tok/s (warm) | speedup | tokens / iteration")
    assert table[-1] == "| dflash2 | 7 | 58.5 | 5.85x | 3.90 | 99.50 % | identical x2 |"


def test_triton_selector_drafts_as_the_ops():
    """The GPU's Triton selector (dflash2_fused: candidates, then the walk) against candidates
    + CandidateSelector.edge_scores + walk, through Triton's interpreter on the CPU (a
    subprocess: TRITON_INTERPRET is read at import). Small integers, as above: every sum is
    exact in any order and ties are everywhere (zeros of both signs among them); 60 random
    shapes and seeds. The slot pass's candidates and projection are checked too."""
    import importlib.util
    import subprocess
    import sys
    import textwrap

    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    code = textwrap.dedent("""
        import random, torch
        from speccheck.reference.dflash2 import CandidateSelector, candidates, walk
        from speccheck.reference.kernels.dflash2_fused import dflash2_select_fused, slot_pass
        rnd = random.Random(0)
        for case in range(60):
            n, l, r = rnd.randint(1, 3), rnd.randint(1, 7), rnd.randint(1, 6)
            v = rnd.randint(8, 40) if case % 4 else rnd.randint(100, 300)  # (many groups)
            k, bf16 = rnd.randint(1, min(8, v)), rnd.random() < 0.5
            g = torch.Generator().manual_seed(case)
            ints = lambda lo, hi, *shape: torch.randint(lo, hi + 1, shape, generator=g).float()
            unary, hidden = ints(-3, 3, n, l, v), ints(-2, 2, n, l, r)
            unary[unary == 0] *= torch.where(torch.rand(unary.shape, generator=g) < 0.5, -1.0, 1.0)[unary == 0]
            anchor = torch.randint(0, v, (n,), generator=g)
            sel = CandidateSelector(hidden=r, vocab=v, rank=r, top_k=k)
            with torch.inference_mode():
                sel.hidden_projection.weight.copy_(torch.eye(r))
                for book in (sel.predecessor_codebook, sel.successor_codebook):
                    book.copy_(ints(-2, 2, v, r))
                if bf16:
                    sel = sel.bfloat16()
                got = dflash2_select_fused(unary, hidden, sel.hidden_projection.weight,
                                           sel.predecessor_codebook, sel.successor_codebook,
                                           anchor, k)
                ids, vals = candidates(unary, k)
                scores = sel.float().edge_scores(ids, vals, hidden, anchor)
                want = ids.gather(-1, walk(scores)[..., None])[..., 0]
                h, got_ids, got_vals = slot_pass(unary, hidden, sel.hidden_projection.weight, k)
            assert torch.equal(got, want), (case, got, want)
            assert torch.equal(got_ids, ids) and torch.equal(got_vals, vals), case
            assert torch.equal(h, sel.float().project(hidden)), case
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
