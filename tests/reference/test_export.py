"""The HF export runs the same network in an independent implementation.

The reference target is exported, loaded with transformers' own ``Qwen3_5ForCausalLM`` (its torch
fallbacks for the causal conv and the chunked gated delta rule, no fla), and its prefill logits are
compared with the reference engine's, in fp32 and in bf16. Uses the shipped trained weights when they
exist, else a seeded random model with randomised norms (so that ``1+w`` vs ``w`` would show).
"""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from speccheck.reference import export as ex
from speccheck.reference.model import (Cache, DFlashDrafter, MTPModule, Qwen3_5TextModel,
                                       ReferenceConfig, init_weights)

from tests.training_code import train_reference

transformers = pytest.importorskip("transformers")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TEXTS = ["def add(a, b):\n    return a + b\n",
         "The quick brown fox jumps over the lazy dog. " * 4,
         "import os\nfor name in sorted(os.listdir('.')):\n    print(name, len(name))\n" * 3]


def _random_reference():
    cfg = ReferenceConfig()
    nets = Qwen3_5TextModel(cfg), MTPModule(cfg), DFlashDrafter(cfg)
    gen = torch.Generator().manual_seed(1)
    for seed, net in enumerate(nets):
        init_weights(net, seed=seed)
        with torch.no_grad():  # norms away from their init, so a (1+w) / w mix-up shows
            for name, p in net.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return cfg, *nets


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(cfg, target, mtp, drafter, tokenizer_json), fp32 — the shipped trained weights when present."""
    from speccheck.reference.engine import load_networks

    weights = ex.default_weights_dir()
    if (weights / "model.safetensors").is_file():
        cfg, target, mtp, drafter, _ = load_networks(weights)
    else:
        cfg, target, mtp, drafter = _random_reference()
    tok = weights / "tokenizer.json"
    if not tok.is_file():
        build_tokenizer = train_reference("tokenizer_train").build_tokenizer
        tok = tmp_path_factory.mktemp("tok") / "tokenizer.json"
        build_tokenizer(TEXTS * 5, vocab_size=300).save(str(tok))
    return cfg, target.eval(), mtp.eval(), drafter, tok


@pytest.fixture(scope="module")
def exported(reference, tmp_path_factory):
    cfg, target, mtp, drafter, tok = reference
    out = tmp_path_factory.mktemp("export")
    summary = ex.export_modules(out, cfg, target, mtp, drafter, tok, dtype=torch.float32)
    return out, summary


def _prompts(tok_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    ids = [tok.encode(t).ids for t in TEXTS]
    assert max(len(i) for i in ids) > 64  # crosses a GDN chunk boundary (chunk 64)
    return ids


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _ref_logits(target, ids, gdn_form=None):
    """Prefill logits of the reference: the training path (no cache) or the engine's cached
    prefill with the given GDN form."""
    with torch.no_grad():
        x = torch.tensor([ids])
        if gdn_form is None:
            h, _ = target(x)
        else:
            h, _ = target(x, Cache(len(target.layers), len(ids) + 1), gdn_form=gdn_form)
        return target.logits(h[0]).float()


def test_layout_and_key_set(reference, exported):
    cfg, target, mtp, drafter, _ = reference
    out, summary = exported
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "drafter"} <= files
    sd = ex.read_checkpoint(out / "model.safetensors")
    want = {"model.language_model." + k for k in target.state_dict()}
    want |= {"mtp." + k for k in mtp.state_dict()}
    assert set(sd) == want  # tied embeddings: no lm_head
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight"} <= set(sd)
    for k, v in target.state_dict().items():
        assert torch.equal(sd["model.language_model." + k], v.float()), k
    for k, v in mtp.state_dict().items():
        assert torch.equal(sd["mtp." + k], v.float()), k
    if drafter is not None:
        dsd = ex.read_checkpoint(out / "drafter" / "model.safetensors")
        assert set(dsd) == set(drafter.state_dict())
        assert {"fc.weight", "hidden_norm.weight", "norm.weight",
                "layers.0.self_attn.q_proj.weight"} <= set(dsd)
        assert not any(k.startswith(("embed_tokens", "lm_head")) for k in dsd)


def test_config_round_trip(reference, exported):
    cfg, *_ = reference
    out, _ = exported
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert raw["model_type"] == "qwen3_5" and raw["text_config"]["model_type"] == "qwen3_5_text"
    hf = transformers.AutoConfig.from_pretrained(out)
    assert type(hf).__name__ == "Qwen3_5Config"
    t = hf.text_config
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
                 "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel_dim", "rms_norm_eps", "tie_word_embeddings",
                 "mtp_num_hidden_layers"):
        assert getattr(t, name) == getattr(cfg, name), name
    assert t.layer_types == cfg.layer_types
    assert t.rope_parameters["rope_theta"] == cfg.rope_theta
    assert t.rope_parameters["partial_rotary_factor"] == cfg.partial_rotary_factor
    rot = int(cfg.head_dim * cfg.partial_rotary_factor)
    assert sum(t.rope_parameters["mrope_section"]) == rot // 2
    assert hf.vision_config.out_hidden_size == cfg.hidden_size
    d = json.loads((out / "drafter" / "config.json").read_text())
    assert d["architectures"] == ["DFlashDraftModel"] and d["model_type"] == "qwen3"
    assert d["dflash_config"] == {"block_size": cfg.drafter.block_size,
                                  "mask_token_id": cfg.mask_token_id,
                                  "target_layer_ids": cfg.drafter.target_layer_ids}
    assert d["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in cfg.drafter.target_layer_ids]
    dq = transformers.AutoConfig.from_pretrained(out / "drafter")
    assert dq.num_hidden_layers == cfg.drafter.num_hidden_layers
    assert dq.dflash_config["target_layer_ids"] == cfg.drafter.target_layer_ids


def test_tokenizer_loads_with_transformers(reference, exported):
    from tokenizers import Tokenizer

    _, _, _, _, tok_path = reference
    out, _ = exported
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    raw = Tokenizer.from_file(str(tok_path))
    for text in TEXTS:
        assert hf_tok(text)["input_ids"] == raw.encode(text).ids
    assert hf_tok.eos_token_id == reference[0].eos_token_id


def test_prefill_logits_match_transformers_fp32(reference, exported):
    cfg, target, *_ , tok = reference
    out, _ = exported
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    worst = 0.0
    for ids in _prompts(tok):
        want = _hf_logits(hf, ids)
        for form in (None, "chunked", "recurrent"):
            got = _ref_logits(target.float(), ids, form)
            worst = max(worst, (got - want).abs().max().item())
            assert torch.equal(got.argmax(-1), want.argmax(-1))
    print(f"fp32 max |dlogit| reference vs transformers: {worst:.2e}")
    assert worst < 1e-4


def test_prefill_logits_match_transformers_bf16(reference, exported):
    cfg, target, *_ , tok = reference
    out, _ = exported
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    ref = copy.deepcopy(target).to(torch.bfloat16)
    hf32 = transformers.Qwen3_5ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    worst, worst32 = 0.0, 0.0
    for ids in _prompts(tok):
        want = _hf_logits(hf, ids)
        got = _ref_logits(ref, ids, "chunked")
        exact = _hf_logits(hf32, ids)
        worst = max(worst, (got - want).abs().max().item())
        # the two bf16 implementations differ from each other by no more than bf16 differs
        # from fp32 (both round at slightly different places)
        worst32 = max(worst32, (want - exact).abs().max().item(), (got - exact).abs().max().item())
    print(f"bf16 max |dlogit| reference vs transformers: {worst:.3e} (bf16 vs fp32: {worst32:.3e})")
    scale = max(_ref_logits(target.float(), ids).abs().max().item() for ids in _prompts(tok))
    assert worst <= max(2 * worst32, 1e-2)
    assert worst < 0.05 * scale


def test_bad_target_layer_ids_are_refused():
    with pytest.raises(ex.ExportError, match="target_layer_ids"):
        ex.drafter_config(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                          num_attention_heads=1, num_key_value_heads=1, head_dim=8, rope_theta=1e4,
                          rms_norm_eps=1e-6, max_position_embeddings=64, block_size=8,
                          mask_token_id=1, target_layer_ids=[7], num_target_layers=8,
                          target_hidden_size=8)


def test_missing_weights_dir_is_a_clear_error(tmp_path):
    with pytest.raises(ex.ExportError, match="model.safetensors"):
        ex.export_reference(tmp_path / "out", weights_dir=tmp_path / "nowhere")


def test_export_reference_writes_what_the_engine_runs(tmp_path):
    """The CLI path: the package's weights (or the engine's fixed-seed init) end to end."""
    summary = ex.export_reference(tmp_path / "ref")
    assert (tmp_path / "ref" / "config.json").is_file()
    assert (tmp_path / "ref" / "tokenizer.json").is_file()
    assert summary["mtp_tensors"] > 0 and summary["target_tensors"] > 0
    sd = ex.read_checkpoint(tmp_path / "ref" / "model.safetensors")
    assert any(k.startswith("mtp.") for k in sd)
    assert all(k.startswith(("model.language_model.", "mtp.")) for k in sd)
    # the checkpoint declares the reference engine's own model name, wherever it was written
    from speccheck.engines.vllm import model_name
    from speccheck.reference.engine import ReferenceEngine

    cfg = json.loads((tmp_path / "ref" / "config.json").read_text())
    assert cfg["speccheck"]["model_name"] == ReferenceEngine().identity()["model_id"] == summary["model_name"]
    assert model_name(str(tmp_path / "ref"), cfg, {}) == summary["model_name"]
    assert model_name(str(tmp_path / "ref"), cfg, {"served_model_name": "mine"}) == "mine"
    assert model_name(str(tmp_path / "ref"), {}, {}) == "ref"
    assert model_name(str(tmp_path / "ref"), {"_name_or_path": "/tmp/x"}, {}) == "ref"


def _load(module, state, prefix):
    module.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)},
                           strict=True)
    return module


def _hf_mtp_logits(out, prompts):
    """vLLM's Qwen3_5MultiTokenPredictor rebuilt from transformers' Qwen3.5 layers and the mtp.*
    tensors and config of the export in ``out``, fed that export's own target (transformers):
    fc(cat[pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)]) -> one full-attention
    decoder layer at position t -> norm -> shared lm head. One logits tensor per prompt."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q35

    sd = ex.read_checkpoint(out / "model.safetensors")
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tc = hf.config
    h = tc.hidden_size
    layer = _load(q35.Qwen3_5DecoderLayer(tc, tc.layer_types.index("full_attention")), sd,
                  "mtp.layers.0.").eval()
    fc = _load(torch.nn.Linear(2 * h, h, bias=False), sd, "mtp.fc.")
    norms = {n: _load(q35.Qwen3_5RMSNorm(h, tc.rms_norm_eps), sd, f"mtp.{n}.")
             for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    rotary = q35.Qwen3_5TextRotaryEmbedding(tc)
    logits = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            hid = hf.model(x).last_hidden_state[:, :-1]  # post final norm, as vLLM passes it
            emb = hf.model.embed_tokens(x[:, 1:])
            z = fc(torch.cat([norms["pre_fc_norm_embedding"](emb), norms["pre_fc_norm_hidden"](hid)], -1))
            pos = torch.arange(z.shape[1])[None]
            z = layer(z, position_embeddings=rotary(z, pos), attention_mask=None, position_ids=pos)
            logits.append(hf.lm_head(norms["norm"](z))[0])
    return logits


def _ref_mtp_logits(target, mtp, ids):
    with torch.no_grad():
        x = torch.tensor([ids])
        rh, _ = target(x)
        return target.logits(mtp(target.embed_tokens(x[:, 1:]), rh[:, :-1]))[0]


def test_mtp_export_matches_transformers_building_blocks(reference, exported):
    """The exported MTP head (vLLM's algorithm on transformers' pieces, see _hf_mtp_logits)
    computes what the reference MTP module computes."""
    cfg, target, mtp, _, tok = reference
    out, _ = exported
    prompts = _prompts(tok)
    worst = max((got - _ref_mtp_logits(target, mtp, ids)).abs().max().item()
                for ids, got in zip(prompts, _hf_mtp_logits(out, prompts)))
    print(f"MTP max |dlogit| reference vs transformers blocks: {worst:.2e}")
    assert worst < 1e-4


def test_dflash_export_matches_vllm_algorithm(reference, exported):
    """vLLM's DFlashQwen3Model rebuilt from transformers' Qwen3 pieces, the exported draft config
    and tensors: context = hidden_norm(fc(cat of target layer outputs at target_layer_ids)), which
    only feeds each layer's k_proj/k_norm/RoPE and v_proj; the block [x, mask...] attends to
    context + block without a causal mask; plain RMSNorm; the target's embedding and lm head.
    Target layer outputs come from transformers' hidden_states at index i+1 (vLLM's aux id)."""
    from transformers.models.qwen3 import modeling_qwen3 as q3

    cfg, target, _, drafter, tok = reference
    if drafter is None:
        pytest.skip("no drafter weights")
    out, _ = exported
    dcfg = transformers.AutoConfig.from_pretrained(out / "drafter")
    sd = ex.read_checkpoint(out / "drafter" / "model.safetensors")
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    h, d = dcfg.hidden_size, dcfg.head_dim
    nh, nkv = dcfg.num_attention_heads, dcfg.num_key_value_heads

    def norm(name, dim=h):
        return _load(q3.Qwen3RMSNorm(dim, dcfg.rms_norm_eps), sd, name + ".")

    def lin(name):
        return lambda x: torch.nn.functional.linear(x, sd[name + ".weight"])

    rotary = q3.Qwen3RotaryEmbedding(dcfg)
    k = cfg.drafter.block_size - 1
    worst = 0.0
    with torch.no_grad():
        for ids in _prompts(tok):
            L = len(ids) - 1
            x = torch.tensor([ids[:L]])
            states = hf.model(x, output_hidden_states=True).hidden_states
            aux = torch.cat([states[i] for i in dcfg.eagle_aux_hidden_state_layer_ids], -1)
            ctx = norm("hidden_norm")(lin("fc")(aux))  # [1, L, h]
            block = torch.tensor([[ids[L]] + [dcfg.dflash_config["mask_token_id"]] * k])
            y = hf.model.embed_tokens(block)
            cos_c, sin_c = rotary(ctx, torch.arange(L)[None])
            cos_b, sin_b = rotary(y, torch.arange(L, L + k + 1)[None])
            for i in range(dcfg.num_hidden_layers):
                p = f"layers.{i}."
                kc = norm(p + "self_attn.k_norm", d)(lin(p + "self_attn.k_proj")(ctx).view(1, L, nkv, d))
                vc = lin(p + "self_attn.v_proj")(ctx).view(1, L, nkv, d).transpose(1, 2)
                kc = q3.apply_rotary_pos_emb(kc.transpose(1, 2), kc.transpose(1, 2), cos_c, sin_c)[1]
                a = norm(p + "input_layernorm")(y)
                q = norm(p + "self_attn.q_norm", d)(lin(p + "self_attn.q_proj")(a).view(1, k + 1, nh, d))
                kb = norm(p + "self_attn.k_norm", d)(lin(p + "self_attn.k_proj")(a).view(1, k + 1, nkv, d))
                vb = lin(p + "self_attn.v_proj")(a).view(1, k + 1, nkv, d).transpose(1, 2)
                q, kb = q3.apply_rotary_pos_emb(q.transpose(1, 2), kb.transpose(1, 2), cos_b, sin_b)
                K = q3.repeat_kv(torch.cat([kc, kb], 2), nh // nkv)
                V = q3.repeat_kv(torch.cat([vc, vb], 2), nh // nkv)
                att = torch.softmax(q @ K.transpose(-1, -2) * d ** -0.5, -1) @ V
                y = y + lin(p + "self_attn.o_proj")(att.transpose(1, 2).reshape(1, k + 1, nh * d))
                m = norm(p + "post_attention_layernorm")(y)
                y = y + lin(p + "mlp.down_proj")(torch.nn.functional.silu(lin(p + "mlp.gate_proj")(m))
                                                 * lin(p + "mlp.up_proj")(m))
            want = hf.lm_head(norm("norm")(y))[0]
            # the reference drafter, fed the reference target's own layer outputs
            _, raux = target(x, aux_layers=tuple(cfg.drafter.target_layer_ids))
            raux = torch.cat([raux[i] for i in cfg.drafter.target_layer_ids], -1)
            ckv = drafter.context_kv(raux, torch.arange(L))
            got = target.logits(drafter(target.embed_tokens(block), torch.arange(L, L + k + 1), ckv))[0]
            worst = max(worst, (got - want).abs().max().item())
    print(f"DFlash max |dlogit| reference vs vLLM algorithm on transformers pieces: {worst:.2e}")
    assert worst < 1e-4


# --------------------------------------------------------------------------- GDN heads padded to 128
# ``export-reference --linear-head-dim 128``: the same network with GDN key/value head dims 128
# (FlashInfer's Hopper GDN prefill kernel, vLLM's default there, supports no other). The padding
# itself is exact up to fp32 rounding; the one inexact change is rms_norm_eps * 64/128 in every
# norm (see export.pad_gdn_head_dims), which the tests below measure separately. On the shipped
# weights it moves the logits by ~1e-3, nearly all of it through layer 0's two norms (their input
# is the embedding, mean square ~3e-3); the GDN norms' inputs (mean square ~1e-7, below eps) are
# why the epsilon has to change at all.

PADDED = 128


@pytest.fixture(scope="module")
def exported_padded(reference, tmp_path_factory):
    cfg, target, mtp, drafter, tok = reference
    out = tmp_path_factory.mktemp("export_padded")
    summary = ex.export_modules(out, cfg, target, mtp, drafter, tok, dtype=torch.float32,
                                linear_head_dim=PADDED)
    return out, summary


def _gdn_norms_only(model, eps):
    """Set the GDN gated norms of a transformers Qwen3.5 model to ``eps`` (the others keep theirs)."""
    for name, m in model.named_modules():
        if name.endswith("linear_attn.norm"):
            m.variance_epsilon = eps
    return model


def _all_norms(model, eps):
    """Set every norm of a transformers Qwen3.5 model to ``eps``."""
    n = 0
    for m in model.modules():
        for attr in ("eps", "variance_epsilon"):  # Qwen3_5RMSNorm, Qwen3_5RMSNormGated
            if "Norm" in type(m).__name__ and hasattr(m, attr):
                setattr(m, attr, eps)
                n += 1
    assert n > 2 * len(model.model.layers)
    return model


def test_padded_layout_and_config(reference, exported, exported_padded):
    cfg, target, *_ = reference
    out, _ = exported
    pout, summary = exported_padded
    raw = json.loads((pout / "config.json").read_text())
    t = raw["text_config"]
    assert (t["linear_key_head_dim"], t["linear_value_head_dim"]) == (PADDED, PADDED)
    assert t["rms_norm_eps"] == cfg.rms_norm_eps * cfg.linear_key_head_dim / PADDED
    note = raw["speccheck"]
    assert note["original_linear_key_head_dim"] == cfg.linear_key_head_dim
    assert note["original_linear_value_head_dim"] == cfg.linear_value_head_dim
    assert "FlashInfer" in note["why"] and summary["linear_head_dim"] == PADDED
    hf = transformers.AutoConfig.from_pretrained(pout).text_config
    assert (hf.linear_key_head_dim, hf.linear_value_head_dim) == (PADDED, PADDED)
    # the unpadded export carries no note; the drafter is the same files
    assert "speccheck" not in json.loads((out / "config.json").read_text())
    assert (pout / "drafter" / "config.json").read_text() == (out / "drafter" / "config.json").read_text()
    sd, psd = ex.read_checkpoint(out / "model.safetensors"), ex.read_checkpoint(pout / "model.safetensors")
    assert set(sd) == set(psd)
    nk, nv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    p = "model.language_model.layers.0.linear_attn."
    w, pw = sd[p + "in_proj_qkv.weight"], psd[p + "in_proj_qkv.weight"]
    assert pw.shape[0] == (2 * nk + nv) * PADDED
    pq, pk, pv = pw.split(nk * PADDED)
    assert torch.equal(pq.view(nk, PADDED, -1)[:, :dk], w[:nk * dk].view(nk, dk, -1))
    assert not pq.view(nk, PADDED, -1)[:, dk:].any() and not pk.view(nk, PADDED, -1)[:, dk:].any()
    v = w[2 * nk * dk:].view(nv, dv, -1)
    for r in range(PADDED // dv):
        assert torch.equal(pv.view(nv, PADDED, -1)[:, r * dv:(r + 1) * dv], v)
    assert not psd[p + "conv1d.weight"][:2 * nk * PADDED].view(2, nk, PADDED, -1)[:, :, dk:].any()
    assert torch.equal(psd[p + "out_proj.weight"].view(-1, nv, PADDED)[..., :dv] * (PADDED // dv),
                       sd[p + "out_proj.weight"].view(-1, nv, dv))
    for k in sd:  # everything outside the GDN layers is untouched
        if ".linear_attn." not in k:
            assert torch.equal(sd[k], psd[k]), k


def test_padded_export_is_another_engine_identity(exported, exported_padded):
    """A vLLM run on the padded export must not be taken for one on the unpadded export."""
    from speccheck.engines.vllm import weights_sha256

    assert weights_sha256(str(exported[0])) != weights_sha256(str(exported_padded[0]))


def test_padded_prefill_logits_fp32(reference, exported, exported_padded):
    """fp32: (1) the padding is exact: the padded export equals the unpadded one run with the
    padded export's norm epsilons everywhere but in the GDN norms (where the padding's scale
    change is exactly compensated by them); (2) the padded export vs the unpadded one and vs the
    reference engine (both GDN forms): the epsilon change alone; (3) the reference engine runs
    the padded checkpoint too (its GDN at head dim 128) and matches transformers on it."""
    from speccheck.reference.model import ReferenceConfig

    cfg, target, *_, tok = reference
    out, _ = exported
    pout, _ = exported_padded
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    phf = transformers.Qwen3_5ForCausalLM.from_pretrained(pout, dtype=torch.float32).eval()
    peps = phf.config.rms_norm_eps
    same_math = _gdn_norms_only(_all_norms(
        transformers.Qwen3_5ForCausalLM.from_pretrained(out, dtype=torch.float32).eval(), peps),
        cfg.rms_norm_eps)
    pcfg = ReferenceConfig.from_dict({**cfg.to_dict(), "linear_key_head_dim": PADDED,
                                      "linear_value_head_dim": PADDED, "rms_norm_eps": peps})
    pref = Qwen3_5TextModel(pcfg)
    sd = ex.read_checkpoint(pout / "model.safetensors")
    pref.load_state_dict({k[len("model.language_model."):]: v for k, v in sd.items()
                          if k.startswith("model.language_model.")})
    pref.eval()
    exact = eps_only = vs_engine = ref_padded = 0.0
    agree = total = 0
    for ids in _prompts(tok):
        got = _hf_logits(phf, ids)
        exact = max(exact, (got - _hf_logits(same_math, ids)).abs().max().item())
        want = _hf_logits(hf, ids)
        eps_only = max(eps_only, (got - want).abs().max().item())
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += len(ids)
        for form in (None, "chunked", "recurrent"):
            vs_engine = max(vs_engine, (got - _ref_logits(target, ids, form)).abs().max().item())
            ref_padded = max(ref_padded, (got - _ref_logits(pref, ids, form)).abs().max().item())
    print(f"fp32 max |dlogit| padded vs unpadded with the same epsilons (the padding): {exact:.2e}; "
          f"padded vs unpadded (the epsilon change): {eps_only:.2e}; padded vs reference engine: "
          f"{vs_engine:.2e}; reference engine on the padded checkpoint vs transformers: "
          f"{ref_padded:.2e}; argmax agreement {agree}/{total}")
    assert exact < 1e-4 and ref_padded < 1e-4
    assert eps_only < 1e-2 and vs_engine < 1e-2
    assert agree == total


def test_padded_prefill_logits_bf16(reference, exported, exported_padded):
    """bf16 (as vLLM runs it): the padded and unpadded exports differ by no more than bf16 differs
    from fp32, and their argmax agrees except where fp32's top-2 margin is within that noise."""
    cfg, *_, tok = reference
    out, _ = exported
    pout, _ = exported_padded
    hf32 = transformers.Qwen3_5ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    phf = transformers.Qwen3_5ForCausalLM.from_pretrained(pout, dtype=torch.bfloat16).eval()
    worst = noise = 0.0
    agree = total = 0
    flips = []
    for ids in _prompts(tok):
        got, want, exact = _hf_logits(phf, ids), _hf_logits(hf, ids), _hf_logits(hf32, ids)
        worst = max(worst, (got - want).abs().max().item())
        noise = max(noise, (want - exact).abs().max().item(), (got - exact).abs().max().item())
        same = got.argmax(-1) == want.argmax(-1)
        agree += int(same.sum())
        total += len(ids)
        top2 = exact.topk(2, dim=-1).values
        flips += (top2[:, 0] - top2[:, 1])[~same].tolist()
    print(f"bf16 max |dlogit| padded vs unpadded: {worst:.3e} (bf16 vs fp32: {noise:.3e}); "
          f"argmax agreement {agree}/{total}; fp32 top-2 margins where they differ: "
          f"{[round(m, 4) for m in flips]}")
    assert worst <= 2 * noise
    assert all(m <= 2 * noise for m in flips)


def test_padded_mtp_head(reference, exported, exported_padded):
    """The MTP head on the padded export (its mtp.* tensors are the same; its hidden states come
    from the padded target, its norms take the padded export's epsilon) vs the unpadded one and
    the reference MTP module."""
    cfg, target, mtp, _, tok = reference
    out, _ = exported
    pout, _ = exported_padded
    prompts = _prompts(tok)
    padded, unpadded = _hf_mtp_logits(pout, prompts), _hf_mtp_logits(out, prompts)
    vs_export = max((a - b).abs().max().item() for a, b in zip(padded, unpadded))
    vs_ref = max((a - _ref_mtp_logits(target, mtp, ids)).abs().max().item()
                 for a, ids in zip(padded, prompts))
    agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(padded, unpadded))
    total = sum(len(a) for a in padded)
    print(f"MTP fp32 max |dlogit| padded vs unpadded export: {vs_export:.2e}, vs reference: "
          f"{vs_ref:.2e}; argmax agreement {agree}/{total}")
    assert vs_export < 1e-2 and vs_ref < 1e-2 and agree == total


def test_export_reference_cli_pads(tmp_path):
    """The CLI path: --linear-head-dim 128 writes the padded target; a width that cannot be
    padded to exactly is bad input (exit 2, one message naming the option)."""
    from click.testing import CliRunner

    from speccheck.cli import main

    r = CliRunner().invoke(main, ["export-reference", str(tmp_path / "p"), "--linear-head-dim", "128"])
    assert r.exit_code == 0, r.output
    t = json.loads((tmp_path / "p" / "config.json").read_text())["text_config"]
    assert (t["linear_key_head_dim"], t["linear_value_head_dim"]) == (128, 128)
    assert json.loads(r.output)["linear_head_dim"] == 128
    # another checkpoint (another hash), another name: a golden of it is not the unpadded one's
    name = json.loads((tmp_path / "p" / "config.json").read_text())["speccheck"]["model_name"]
    assert name.endswith("-gdn128") and json.loads(r.output)["model_name"] == name
    r = CliRunner().invoke(main, ["export-reference", str(tmp_path / "q"), "--linear-head-dim", "96"])
    assert r.exit_code == 2 and "--linear-head-dim 96" in r.output
    assert not (tmp_path / "q" / "config.json").exists()


def test_the_exported_tokenizer_renders_chat_as_the_reference(exported):
    """transformers (what vLLM's LLM.chat renders with) gives the reference template's text and
    ids, thinking off and on."""
    transformers = pytest.importorskip("transformers")
    from speccheck.reference.chat import render

    out, _ = exported
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"},
            {"role": "assistant", "content": "<think>\nhm\n</think>\nbecause"},
            {"role": "user", "content": "and?"}]
    for thinking in (False, True):
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                       enable_thinking=thinking)
        assert text == render(msgs, thinking)
        assert text.endswith("<think>\n") == thinking
