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

from speccheck.engines.reference import export as ex
from speccheck.engines.reference.model import (Cache, DFlashDrafter, MTPModule, Qwen3_5TextModel,
                                               ReferenceConfig, init_weights)

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
    """(cfg, target, mtp, drafter, tokenizer_json) — shipped weights when present."""
    if (ex.default_weights_dir() / "model.safetensors").is_file():
        cfg, target, mtp, drafter, tok = ex.load_reference(ex.default_weights_dir())
        target, mtp = target.float(), mtp.float()
        drafter = drafter.float() if drafter is not None else None
    else:
        cfg, target, mtp, drafter = _random_reference()
        tok = None
    if tok is None:
        from speccheck.engines.reference.tokenizer_train import build_tokenizer
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
    with pytest.raises(ex.ExportError, match="config.json"):
        ex.export_reference(tmp_path / "out", weights_dir=tmp_path / "nowhere")
