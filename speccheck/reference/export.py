"""Write the reference checkpoint in the Hugging Face layouts that transformers and vLLM load.

The point of the export is that three independent implementations run the very same network:
the reference engine, transformers' ``Qwen3_5ForCausalLM`` (the cross-check in
``tests/reference/test_export.py``) and vLLM (the vLLM engine). Layout of ``export_reference(DIR)``::

    DIR/config.json             Qwen3_5ForConditionalGeneration, model_type qwen3_5, text_config
                                + a ``speccheck`` key: ``model_name`` (the name engines give
                                the model, e.g. a golden's folder) and, when the GDN heads are
                                padded, what was padded (``pad_gdn_head_dims``)
    DIR/model.safetensors       model.language_model.* + mtp.* (no lm_head: tied embeddings)
    DIR/tokenizer.json          the reference tokenizer (``tokenizers`` library)
    DIR/tokenizer_config.json   PreTrainedTokenizerFast + bos/eos/pad + the chat template
    DIR/generation_config.json  bos/eos/pad
    DIR/drafter/config.json     DFlashDraftModel, model_type qwen3, dflash_config
    DIR/drafter/model.safetensors  layers.* fc hidden_norm norm (embed/lm_head shared with target)
    DIR/dflash2/config.json     DFlash2DraftModel (DFlash's config + conv/selector dflash_config)
    DIR/dflash2/model.safetensors  DFlash's tensors + layers.*.{attention,mlp}_conv.*, candidate_selector.*

What the loaders expect (read from source, vLLM main ≈ 0.26, transformers 5.24):

* vLLM ``models/qwen3_5.py``: ``Qwen3_5ForConditionalGeneration`` reads ``hf_config.text_config``
  (``hf_text_config``) for everything: ``layer_types`` (one entry per layer, "linear_attention" |
  "full_attention"), ``linear_num_key_heads/linear_num_value_heads/linear_key_head_dim/
  linear_value_head_dim/linear_conv_kernel_dim`` (GDN state shapes), ``tie_word_embeddings`` (lm_head is
  embed_tokens when true), ``model_type == "qwen3_5_text"`` (dense MLP; "qwen3_5_moe_text" is MoE).
  The MLP/attention come from ``qwen3_next.py`` (gated attention: ``attn_output_gate``, q_proj rows per
  head = [q | gate]; q_norm/k_norm and all decoder norms are GemmaRMSNorm ``x*(1+w)``).
  GDN (``GatedDeltaNetAttention(gqa_interleaved_layout=False)``) takes the HF names ``in_proj_qkv``
  (rows [q|k|v]), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``conv1d``, ``A_log``, ``dt_bias``,
  ``norm`` (gated RMSNorm, plain weight), ``out_proj`` and fuses them itself (stacked_params_mapping
  in ``Qwen3_5Model.load_weights``). Checkpoint prefixes go through ``hf_to_vllm_mapper`` of
  ``Qwen3VLForConditionalGeneration``: ``model.language_model.`` -> ``language_model.model.``,
  ``model.visual.`` -> ``visual.``, ``lm_head.`` -> ``language_model.lm_head.``;
  ``load_weights`` skips ``mtp.``. RoPE: ``rope_parameters`` with ``rope_theta``,
  ``partial_rotary_factor`` and, as in the released Qwen3.5 configs, ``mrope_section`` (must sum to
  rotary_dim/2) + ``mrope_interleaved``; for text the three M-RoPE sections get the same position, so
  this is plain partial neox RoPE.
* The vision tower: ``Qwen3_5ForConditionalGeneration`` always builds ``visual`` from
  ``vision_config`` inside ``_mark_tower_model``; with ``language_model_only=True`` (or
  ``limit_mm_per_prompt`` 0 for image and video) it becomes a ``StageMissingLayer`` whose weights are
  neither created nor expected (``AutoWeightsLoader._load_module`` returns early for it). This export
  ships NO vision weights (a text model has none to ship), only a tiny ``vision_config`` (so that the
  meta-device construction is cheap): run vLLM with ``language_model_only=True``; without it vLLM's
  strict loader stops with "Following weights were not initialized from checkpoint: visual.*".
  image/video token ids keep the family defaults (outside this vocabulary, so no text token can
  ever be taken for an image placeholder).
* MTP, vLLM ``config/speculative.py``: ``model_type in ("qwen3_5", "qwen3_5_moe")`` -> draft
  architecture ``Qwen3_5MTP``, ``n_predict = mtp_num_hidden_layers``; ``models/qwen3_5_mtp.py``
  builds ``mtp_num_hidden_layers`` full-attention Qwen3.5 decoder layers (from ``hf_text_config``) plus
  ``fc`` [hidden, 2*hidden] over ``cat(pre_fc_norm_embedding(embed), pre_fc_norm_hidden(h))``, ``norm``;
  its ``load_weights`` renames ``mtp.`` -> ``model.`` and takes ``embed_tokens`` from
  ``model.language_model.embed_tokens`` (shared; ``mtp_use_dedicated_embeddings: false``).
  A checkpoint without ``mtp.*`` fails to load with method "mtp" (seen with vLLM 0.26).
* DFlash, vLLM ``models/qwen3_dflash.py`` + registry ``"DFlashDraftModel": ("qwen3_dflash",
  "DFlashQwen3ForCausalLM")``: the draft config is a Qwen3 config (``model_type "qwen3"``) with
  ``dflash_config = {block_size, mask_token_id, target_layer_ids}``. ``load_weights`` prefixes every
  name except lm_head with ``model.``, so checkpoint names are ``layers.{i}.self_attn.{q,k,v,o}_proj``,
  ``layers.{i}.self_attn.{q,k}_norm``, ``layers.{i}.mlp.{gate,up,down}_proj``,
  ``layers.{i}.{input,post_attention}_layernorm``, ``fc`` [hidden, n_target_layers*target_hidden],
  ``hidden_norm``, ``norm``; a draft without ``embed_tokens``/``lm_head`` shares the target's. Draft
  layers are plain Qwen3 layers: RMSNorm ``x*w``, no output gate, full RoPE over head_dim.
  ``target_layer_ids`` mean "output of target layer i": newer vLLM reads them from ``dflash_config``
  and adds 1 (``eagle3_utils.get_eagle3_aux_layers_from_config``); older vLLM only reads
  ``eagle_aux_hidden_state_layer_ids``, so we write both (``[i + 1 ...]`` in the latter). Block size
  is written in ``dflash_config`` and at top level (older DFlash tooling reads it there).
* transformers: ``Qwen3_5ForCausalLM`` (config class ``Qwen3_5TextConfig``, ``base_config_key
  "text_config"``) loads the composite dir: the text config is taken from ``text_config`` and the
  ``qwen3_5_text`` conversion mapping (``conversion_mapping.py``: ``PrefixChange(prefix_to_remove=
  "language_model", model_prefix="model")``) strips ``language_model``; ``mtp.*`` and
  ``model.visual.*`` are ignored on load (``_keys_to_ignore_on_load_unexpected``). Its decoder norms
  are ``(1+w)``, the GDN norm plain ``w`` - the same as vLLM.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Mapping

import torch
from safetensors.torch import load_file, save_file

from speccheck.files import share_mode

TARGET_ARCHITECTURE = "Qwen3_5ForConditionalGeneration"
DRAFTER_ARCHITECTURE = "DFlashDraftModel"
# Family defaults for the multimodal placeholders (transformers Qwen3_5Config); unused by text.
_MM_TOKEN_IDS = {"image_token_id": 248056, "video_token_id": 248057,
                 "vision_start_token_id": 248053, "vision_end_token_id": 248054}
# Smallest vision tower vLLM/transformers will construct; no weights are shipped for it.
_TINY_VISION = {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 32, "intermediate_size": 64,
                "num_heads": 2, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
                "temporal_patch_size": 2, "num_position_embeddings": 64,
                "hidden_act": "gelu_pytorch_tanh", "initializer_range": 0.02}


class ExportError(ValueError):
    """The reference checkpoint cannot be written in the requested layout."""


def mrope_section(rotary_dim: int) -> list[int]:
    """Split rotary_dim/2 frequencies into the family's three M-RoPE sections (32 -> [11, 11, 10])."""
    half = rotary_dim // 2
    t = math.ceil(half / 3)
    h = math.ceil((half - t) / 2)
    return [t, h, half - t - h]


def target_config(text: Mapping) -> dict:
    """config.json of the target: the composite Qwen3.5 config around the given text config.

    ``text`` holds transformers ``Qwen3_5TextConfig`` field names (see ``text_config_fields``).
    """
    text = dict(text)
    text["model_type"] = "qwen3_5_text"
    hidden = text["hidden_size"]
    return {
        "architectures": [TARGET_ARCHITECTURE],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": {**_TINY_VISION, "out_hidden_size": hidden},
        "tie_word_embeddings": bool(text.get("tie_word_embeddings", False)),
        **_MM_TOKEN_IDS,
        "dtype": text.get("dtype", "bfloat16"),
    }


def text_config_fields(*, vocab_size: int, hidden_size: int, intermediate_size: int,
                       layer_types: list[str], num_attention_heads: int, num_key_value_heads: int,
                       head_dim: int, linear_num_key_heads: int, linear_num_value_heads: int,
                       linear_key_head_dim: int, linear_value_head_dim: int,
                       linear_conv_kernel_dim: int, rope_theta: float, partial_rotary_factor: float,
                       rms_norm_eps: float, max_position_embeddings: int, tie_word_embeddings: bool,
                       mtp_num_hidden_layers: int, bos_token_id: int | None,
                       eos_token_id: int | None, pad_token_id: int | None,
                       dtype: str = "bfloat16") -> dict:
    """The text_config dict, with the field names of the released Qwen3.5 configs."""
    rotary_dim = int(head_dim * partial_rotary_factor)
    if rotary_dim % 2:
        raise ExportError(f"head_dim*partial_rotary_factor = {rotary_dim} must be even")
    attn = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    interval = attn[0] + 1 if attn else len(layer_types)
    return {
        "model_type": "qwen3_5_text",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": len(layer_types),
        "layer_types": list(layer_types),
        "full_attention_interval": interval,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "attn_output_gate": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "linear_num_key_heads": linear_num_key_heads,
        "linear_num_value_heads": linear_num_value_heads,
        "linear_key_head_dim": linear_key_head_dim,
        "linear_value_head_dim": linear_value_head_dim,
        "linear_conv_kernel_dim": linear_conv_kernel_dim,
        "mamba_ssm_dtype": "float32",
        "hidden_act": "silu",
        "rms_norm_eps": rms_norm_eps,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(rope_theta),
            "partial_rotary_factor": float(partial_rotary_factor),
            "mrope_interleaved": True,
            "mrope_section": mrope_section(rotary_dim),
        },
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": 0.02,
        "tie_word_embeddings": tie_word_embeddings,
        "mtp_num_hidden_layers": mtp_num_hidden_layers,
        "mtp_use_dedicated_embeddings": False,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "dtype": dtype,
    }


def target_weights(text_state: Mapping[str, torch.Tensor], mtp_state: Mapping[str, torch.Tensor],
                   tie_word_embeddings: bool) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of the target from transformers ``Qwen3_5ForCausalLM`` names.

    ``model.X`` -> ``model.language_model.X`` (the released layout, which both vLLM's
    ``hf_to_vllm_mapper`` and transformers' ``qwen3_5_text`` conversion mapping expect);
    ``lm_head.weight`` is dropped when tied; ``mtp.*`` names are kept as they are.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in text_state.items():
        if name == "lm_head.weight":
            if not tie_word_embeddings:
                out[name] = t
        elif name.startswith("model."):
            out["model.language_model." + name[len("model."):]] = t
        else:
            raise ExportError(f"unexpected target tensor {name!r}: expected model.* or lm_head.weight")
    for name, t in mtp_state.items():
        if not name.startswith("mtp."):
            raise ExportError(f"unexpected MTP tensor {name!r}: expected mtp.*")
        out[name] = t
    if not any(k.startswith("mtp.") for k in out):
        raise ExportError("no mtp.* tensors: vLLM's method 'mtp' cannot load a target without them")
    return out


def drafter_config(*, vocab_size: int, hidden_size: int, intermediate_size: int, num_hidden_layers: int,
                   num_attention_heads: int, num_key_value_heads: int, head_dim: int,
                   rope_theta: float, rms_norm_eps: float, max_position_embeddings: int,
                   block_size: int, mask_token_id: int, target_layer_ids: list[int],
                   num_target_layers: int, target_hidden_size: int, dtype: str = "bfloat16") -> dict:
    """config.json of the DFlash draft (a Qwen3 config plus ``dflash_config``)."""
    bad = [i for i in target_layer_ids if not 0 <= i < num_target_layers - 1]
    if bad:
        raise ExportError(f"target_layer_ids {bad} out of range: vLLM captures the input of layer i+1, "
                          f"so ids must be in 0..{num_target_layers - 2}")
    return {
        "architectures": [DRAFTER_ARCHITECTURE],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "layer_types": ["full_attention"] * num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": float(rope_theta),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(rope_theta)},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": False,
        "block_size": block_size,
        "num_target_layers": num_target_layers,
        "target_hidden_size": target_hidden_size,
        "dflash_config": {"block_size": block_size, "mask_token_id": mask_token_id,
                          "target_layer_ids": list(target_layer_ids)},
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in target_layer_ids],
        "dtype": dtype,
    }


DRAFTER_TENSOR_PREFIXES = ("layers.", "fc.", "hidden_norm.", "norm.")


def drafter_weights(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of the drafter: vLLM DFlash names, without embed_tokens/lm_head (shared)."""
    out = {}
    for name, t in state.items():
        if name.startswith(("embed_tokens.", "lm_head.")):
            continue
        if not name.startswith(DRAFTER_TENSOR_PREFIXES):
            raise ExportError(f"unexpected drafter tensor {name!r}: expected one of "
                              f"{', '.join(p + '*' for p in DRAFTER_TENSOR_PREFIXES)}")
        out[name] = t
    return out


def _save(tensors: Mapping[str, torch.Tensor], path: Path, dtype: torch.dtype | None) -> None:
    """safetensors with independent contiguous storage (tied/shared views would be refused)."""
    out = {}
    for k, t in tensors.items():
        t = t.detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[k] = t.contiguous().clone()
    save_file(out, str(path), metadata={"format": "pt"})
    share_mode(path)  # safetensors writes 0600: a vLLM container running as another user must read it


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_tokenizer_files(out: Path, tokenizer_json: Path, *, bos: int | None, eos: int | None,
                          pad: int | None, model_max_length: int) -> None:
    """tokenizer.json (copied) + tokenizer_config.json naming the special tokens by their strings."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    shutil.copyfile(tokenizer_json, out / "tokenizer.json")
    from .chat import CHAT_TEMPLATE

    # the reference's chat template (reference/chat.py), so that a server renders chat prompts,
    # thinking mode included, as the reference engine does
    cfg: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
                 "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    for key, tid in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad)):
        if tid is not None:
            s = tok.id_to_token(tid)
            if s is None:
                raise ExportError(f"{key} id {tid} is not in {tokenizer_json}")
            cfg[key] = s
    _write_json(out / "tokenizer_config.json", cfg)


def write_target_dir(out_dir: str | Path, text: Mapping, text_state: Mapping[str, torch.Tensor],
                     mtp_state: Mapping[str, torch.Tensor], tokenizer_json: str | Path | None = None,
                     dtype: torch.dtype | None = None, note: Mapping | None = None) -> Path:
    """Write config.json, model.safetensors, generation_config.json (+ tokenizer files) of the
    target; ``note`` goes to config.json's ``speccheck`` key (how this export differs)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = dict(text)
    if dtype is not None:
        text["dtype"] = str(dtype).removeprefix("torch.")
    cfg = target_config(text)
    if note:
        cfg["speccheck"] = dict(note)
    _write_json(out / "config.json", cfg)
    _save(target_weights(text_state, mtp_state, bool(text.get("tie_word_embeddings"))),
          out / "model.safetensors", dtype)
    gen = {"do_sample": False}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if text.get(k) is not None:
            gen[k] = text[k]
    _write_json(out / "generation_config.json", gen)
    if tokenizer_json is not None:
        write_tokenizer_files(out, Path(tokenizer_json), bos=text.get("bos_token_id"),
                              eos=text.get("eos_token_id"), pad=text.get("pad_token_id"),
                              model_max_length=int(text["max_position_embeddings"]))
    return out


def write_drafter_dir(out_dir: str | Path, config: Mapping, state: Mapping[str, torch.Tensor],
                      dtype: torch.dtype | None = None) -> Path:
    """Write the DFlash draft checkpoint (config.json + model.safetensors)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(config)
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
    _write_json(out / "config.json", config)
    _save(drafter_weights(state), out / "model.safetensors", dtype)
    return out


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a model.safetensors (for tests and inspection)."""
    return load_file(str(path))


# --------------------------------------------------------------------------- padded GDN heads


def padded_gdn_note(dk: int, dv: int, head_dim: int, eps: float, padded_eps: float) -> dict:
    """The ``speccheck`` key of a padded export's config.json: what was padded, and why."""
    return {
        "padded_export_of": "the speccheck reference checkpoint",
        "original_linear_key_head_dim": dk,
        "original_linear_value_head_dim": dv,
        "original_rms_norm_eps": eps,
        "linear_head_dim": head_dim,
        "rms_norm_eps": padded_eps,
        "why": (f"vLLM 0.26 on Hopper picks FlashInfer's GDN prefill kernel by default without "
                f"checking the head dim, and FlashInfer's SM90 kernel only supports head dim 128; "
                f"the reference has {dk}/{dv}. This export is the same network with GDN heads "
                f"{head_dim} wide: q/k zero-padded (l2norm and dot products unchanged), v and z "
                f"repeated per head (each value column of the delta-rule state evolves on its own), "
                f"the gated norm's weight repeated, out_proj [W/{head_dim // dv}, ...]. The kernel's "
                f"scale {head_dim}^-0.5 instead of {dk}^-0.5 scales the GDN output by "
                f"sqrt({dk}/{head_dim}); the gated RMSNorm after it is exact again with its epsilon "
                f"scaled by {dk}/{head_dim} (the trained GDN outputs' mean square is below "
                f"{eps:g}, so the epsilon matters), and the family has one rms_norm_eps for all "
                f"norms: rms_norm_eps {eps:g} -> {padded_eps:g}. That is the one inexact change: "
                f"the other norms' inputs have mean squares >> {eps:g}."),
    }


def pad_gdn_head_dims(text_state: Mapping[str, torch.Tensor], text: Mapping,
                      head_dim: int) -> tuple[dict[str, torch.Tensor], dict]:
    """The same network with GDN key and value head dims ``head_dim``: (tensors, text_config).

    Layout (HF Qwen3.5 and vLLM ``gqa_interleaved_layout=False`` alike): ``in_proj_qkv`` rows
    and ``conv1d`` channels are [q | k | v], each head-major ``(heads, dim)``; ``in_proj_z``
    rows and ``out_proj`` columns are ``(value heads, dv)``; the gated norm's weight is per dv.
    Keys get zero rows/channels; values are repeated ``head_dim // dv`` times per head (a power
    of two, so that out_proj's division by it is exact in binary floating point).

    The kernel's q scale ``head_dim**-0.5`` (not ``dk**-0.5``) shrinks the GDN output o by
    ``sqrt(dk/head_dim)``, and no weight can undo that (q and k are l2-normalised in the kernel,
    v comes out of a SiLU). The gated RMSNorm ``o / sqrt(ms(o) + eps)`` after it is the same
    function of the shrunk o with ``eps * dk/head_dim``; Qwen3.5 has one ``rms_norm_eps``, so
    every norm gets it (the others see mean squares far above eps: their change is ~eps/ms).
    """
    text = dict(text)
    nk, nv = int(text["linear_num_key_heads"]), int(text["linear_num_value_heads"])
    dk, dv = int(text["linear_key_head_dim"]), int(text["linear_value_head_dim"])
    if not all(head_dim % d == 0 and (head_dim // d) & (head_dim // d - 1) == 0 for d in (dk, dv)):
        raise ExportError(f"--linear-head-dim {head_dim}: the GDN heads are {dk} (key) and {dv} "
                          f"(value) wide; the padded dim must be a power-of-two multiple of both "
                          f"(e.g. 128 for 64/64), so that the value copies and the scale change "
                          f"divide exactly")
    rep = head_dim // dv

    def keys(w: torch.Tensor) -> torch.Tensor:  # [nk*dk, ...] -> [nk*head_dim, ...], zeros appended
        w = w.reshape(nk, dk, *w.shape[1:])
        pad = w.new_zeros(nk, head_dim - dk, *w.shape[2:])
        return torch.cat([w, pad], 1).reshape(nk * head_dim, *w.shape[2:])

    def values(w: torch.Tensor) -> torch.Tensor:  # [nv*dv, ...] -> each head's rows repeated
        w = w.reshape(nv, dv, *w.shape[1:])
        return w.repeat(1, rep, *[1] * (w.ndim - 2)).reshape(nv * head_dim, *w.shape[2:])

    out = dict(text_state)
    layers = sorted({name.split(".linear_attn.")[0] + ".linear_attn" for name in text_state
                     if ".linear_attn." in name})
    for p in layers:
        for name in ("in_proj_qkv.weight", "conv1d.weight"):
            q, k, v = text_state[f"{p}.{name}"].split([nk * dk, nk * dk, nv * dv])
            out[f"{p}.{name}"] = torch.cat([keys(q), keys(k), values(v)])
        out[f"{p}.in_proj_z.weight"] = values(text_state[f"{p}.in_proj_z.weight"])
        out[f"{p}.norm.weight"] = text_state[f"{p}.norm.weight"].repeat(rep)
        w = text_state[f"{p}.out_proj.weight"]  # [hidden, nv*dv]
        out[f"{p}.out_proj.weight"] = values(w.t()).t() / rep
    text.update(linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
                rms_norm_eps=float(text["rms_norm_eps"]) * dk / head_dim)
    return out, text


# --------------------------------------------------------------------------- the reference model


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def text_config_from_reference(cfg, dtype: torch.dtype = torch.bfloat16) -> dict:
    """text_config of a :class:`~speccheck.reference.model.ReferenceConfig`.

    The reference tokenizer has no BOS (like Qwen's, whose bos is its end-of-text token): bos and
    eos are both ``<|endoftext|>``; no pad id (padding is the tokenizer's business).
    """
    return text_config_fields(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, layer_types=list(cfg.layer_types),
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, linear_num_key_heads=cfg.linear_num_key_heads,
        linear_num_value_heads=cfg.linear_num_value_heads,
        linear_key_head_dim=cfg.linear_key_head_dim, linear_value_head_dim=cfg.linear_value_head_dim,
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim, rope_theta=cfg.rope_theta,
        partial_rotary_factor=cfg.partial_rotary_factor, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, mtp_num_hidden_layers=cfg.mtp_num_hidden_layers,
        bos_token_id=cfg.eos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=None,
        dtype=_dtype_name(dtype))


def drafter_config_from_reference(cfg, dtype: torch.dtype = torch.bfloat16) -> dict:
    """DFlash draft config.json of the reference drafter (hidden size = the target's)."""
    dc = cfg.drafter
    return drafter_config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=dc.intermediate_size,
        num_hidden_layers=dc.num_hidden_layers, num_attention_heads=dc.num_attention_heads,
        num_key_value_heads=dc.num_key_value_heads, head_dim=dc.head_dim, rope_theta=dc.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        block_size=dc.block_size, mask_token_id=cfg.mask_token_id,
        target_layer_ids=list(dc.target_layer_ids), num_target_layers=cfg.num_hidden_layers,
        target_hidden_size=cfg.hidden_size, dtype=_dtype_name(dtype))


def export_modules(out_dir: str | Path, cfg, target, mtp, drafter=None,
                   tokenizer_json: str | Path | None = None,
                   dtype: torch.dtype | None = None, linear_head_dim: int | None = None,
                   name: str | None = None) -> dict:
    """Export in-memory reference networks: target + MTP to ``out_dir``, drafter to
    ``out_dir/drafter``. ``dtype`` None keeps the networks' own dtype (lossless).
    ``linear_head_dim``: GDN key/value head dims padded to it (:func:`pad_gdn_head_dims`).
    ``name``: the model's name, written to config.json's ``speccheck.model_name`` (what engines
    loading the checkpoint call the model, e.g. in a golden's folder, instead of whatever
    directory it was exported to).

    The reference modules carry transformers'/vLLM's names already (model.py), so this is
    prefixing only: target ``X`` -> ``model.X`` (-> ``model.language_model.X`` on disk), MTP
    ``X`` -> ``mtp.X``, drafter unchanged.
    """
    if mtp is None:
        raise ExportError("the target export needs the MTP module (vLLM method 'mtp' loads mtp.*)")
    dtype = dtype or target.embed_tokens.weight.dtype
    out = Path(out_dir)
    text_state = {"model." + k: v for k, v in target.state_dict().items()}
    mtp_state = {"mtp." + k: v for k, v in mtp.state_dict().items()}
    text = text_config_from_reference(cfg, dtype)
    note = None
    if linear_head_dim is not None and (linear_head_dim, linear_head_dim) != (
            cfg.linear_key_head_dim, cfg.linear_value_head_dim):
        text_state, text = pad_gdn_head_dims(text_state, text, linear_head_dim)
        note = padded_gdn_note(cfg.linear_key_head_dim, cfg.linear_value_head_dim, linear_head_dim,
                               cfg.rms_norm_eps, text["rms_norm_eps"])
    if name:
        note = {"model_name": name, **(note or {})}
    write_target_dir(out, text, text_state, mtp_state, tokenizer_json, dtype, note)
    summary = {"target": str(out), **({"model_name": name} if name else {}),
               "target_tensors": len(text_state), "mtp_tensors": len(mtp_state),
               "dtype": _dtype_name(dtype), "tokenizer": tokenizer_json is not None}
    if note:
        summary["linear_head_dim"] = linear_head_dim
    if drafter is not None:
        write_drafter_dir(out / "drafter", drafter_config_from_reference(cfg, dtype),
                          drafter.state_dict(), dtype)
        summary["drafter"] = str(out / "drafter")
        summary["drafter_tensors"] = len(drafter.state_dict())
    return summary


def default_weights_dir() -> Path:
    """Where the reference engine ships its trained weights."""
    return Path(__file__).resolve().parent / "weights"


def _stored_dtype(path: Path) -> torch.dtype | None:
    """dtype of the first floating tensor of a safetensors file (None: no file)."""
    if not path.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        for k in f.keys():
            t = f.get_slice(k)
            dt = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(t.get_dtype())
            if dt is not None:
                return dt
    return None


def export_reference(out_dir: str | Path, weights_dir: str | Path | None = None,
                     linear_head_dim: int | None = None) -> dict:
    """``speccheck export-reference DIR``: the network the reference engine runs, as a Hugging Face
    Qwen3.5 dir with ``mtp.*`` plus a DFlash draft dir at ``DIR/drafter``; ``linear_head_dim``
    pads the target's GDN heads (:func:`pad_gdn_head_dims`; the drafters have no GDN).

    ``weights_dir`` None = the package's weights (trained when shipped, else the engine's
    fixed-seed init, which is what the engine then runs too). Tensors keep the stored dtype (fp32
    for the fixed-seed init), so nothing is rounded on the way. Returns a summary for the CLI.
    """
    from .engine import load_networks, reference_model_name

    d = Path(weights_dir) if weights_dir is not None else default_weights_dir()
    if weights_dir is not None and not (d / "model.safetensors").is_file():
        raise ExportError(f"{d / 'model.safetensors'} not found: --weights must be a reference weights "
                          f"directory (config.json, model.safetensors, drafter.safetensors, "
                          f"tokenizer.json); leave it out to export the shipped weights")
    cfg, target, mtp, drafter, trained = load_networks(d)
    if mtp is None:
        raise ExportError(f"{d / 'model.safetensors'} has no mtp.* tensors; vLLM's method 'mtp' needs "
                          f"them: re-run the reference training script")
    tok = d / "tokenizer.json"
    if not tok.is_file():
        tok = default_weights_dir() / "tokenizer.json"
    dtype = _stored_dtype(d / "model.safetensors") or torch.float32
    summary = export_modules(out_dir, cfg, target.eval(), mtp.eval(),
                             drafter.eval() if drafter is not None else None,
                             tok if tok.is_file() else None, dtype=dtype,
                             linear_head_dim=linear_head_dim,
                             name=reference_model_name(trained, linear_head_dim if linear_head_dim and (
                                 linear_head_dim, linear_head_dim) != (cfg.linear_key_head_dim,
                                                                       cfg.linear_value_head_dim) else None))
    summary.update(weights_dir=str(d), trained=trained)
    from .dflash2 import DFLASH2_FILE, load_dflash2

    if (d / DFLASH2_FILE).is_file():
        d2 = load_dflash2(d / DFLASH2_FILE, cfg)
        write_dflash2_dir(Path(out_dir) / "dflash2", dflash2_config_from_reference(cfg, d2.d2, dtype),
                          d2.state_dict(), dtype)
        summary["dflash2"] = str(Path(out_dir) / "dflash2")
    if drafter is None:
        summary["note"] = "no drafter.safetensors: drafter not exported"
    return summary


# --------------------------------------------------------------------------- DFlash2


DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
DFLASH2_TENSOR_PREFIXES = DRAFTER_TENSOR_PREFIXES + ("candidate_selector.",)


def dflash2_config_from_reference(cfg, d2, dtype: torch.dtype = torch.bfloat16) -> dict:
    """config.json of the DFlash2 draft, by the contract of vLLM 0.28+'s ``qwen3_dflash2.py``
    (registry ``"DFlash2DraftModel"`` -> ``DFlash2Qwen3ForCausalLM``): the DFlash config with
    ``is_causal: false``, every layer ``sliding_attention``, and ``dflash_config`` extended by
    ``conv_kernel_size`` (taps), ``conv_group_size``, ``selector_rank``, ``selector_top_k``.
    The reference drafter attends to its whole context, so the window is the model's whole
    length (no position is ever outside it)."""
    out = drafter_config_from_reference(cfg, dtype)
    n = out["num_hidden_layers"]
    out.update(architectures=[DFLASH2_ARCHITECTURE], is_causal=False,
               layer_types=["sliding_attention"] * n, use_sliding_window=True,
               sliding_window=cfg.max_position_embeddings, max_window_layers=n)
    out["dflash_config"] = {**out["dflash_config"],
                            "conv_kernel_size": d2.conv_kernel_size,
                            "conv_group_size": d2.conv_group_size,
                            "selector_rank": d2.selector_rank,
                            "selector_top_k": d2.selector_top_k}
    return out


def write_dflash2_dir(out_dir: str | Path, config: Mapping, state: Mapping[str, torch.Tensor],
                      dtype: torch.dtype | None = None) -> Path:
    """Write the DFlash2 draft checkpoint (config.json + model.safetensors); names as vLLM's
    ``DFlash2Qwen3Model`` (its ``load_weights`` adds ``model.``), no embed_tokens / lm_head."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(config)
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
    bad = [k for k in state if not k.startswith(DFLASH2_TENSOR_PREFIXES)]
    if bad:
        raise ExportError(f"unexpected DFlash2 tensor {bad[0]!r}: expected one of "
                          f"{', '.join(p + '*' for p in DFLASH2_TENSOR_PREFIXES)}")
    _write_json(out / "config.json", config)
    _save(state, out / "model.safetensors", dtype)
    return out


def read_dflash2_dir(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(DFlash2 fields of ``dflash_config``, tensors) of an exported DFlash2 draft, for
    loading it back into the reference engine (:func:`dflash2.save_dflash2`)."""
    d = Path(path)
    config = json.loads((d / "config.json").read_text())
    if config.get("architectures") != [DFLASH2_ARCHITECTURE]:
        raise ExportError(f"{d / 'config.json'}: architectures {config.get('architectures')}, "
                          f"expected [{DFLASH2_ARCHITECTURE!r}]")
    dc = config["dflash_config"]
    fields = {k: int(dc[k]) for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                      "selector_top_k")}
    return fields, read_checkpoint(d / "model.safetensors")
