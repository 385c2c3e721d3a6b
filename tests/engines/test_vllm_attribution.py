"""vLLM kernel-path attribution without a GPU: the kernel probe's summary, the variants
offered relative to what ran, the two-step score path and the token-budget grouping."""
from __future__ import annotations

import json

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from speccheck.engines.vllm import (PACKED_DECODE_ENV, attribution_variants, gdn_prefill_args,
                                    requested_gdn_prefill, scored_from_steps, split_engine_args,
                                    step_inputs)
from speccheck.engines.vllm_worker import kernel_paths, token_budget_groups
from speccheck.types import SpecConfig


def probe(attn="FLASH_ATTN", gdn="flashinfer", packed=True, draft=None, decode_kernel=None):
    layers = {f"model.layers.{i}.linear_attn": {"kind": "gdn", "prefill": gdn,
                                                "packed_decode": packed,
                                                "decode_kernel": decode_kernel} for i in range(3)}
    layers["model.layers.3.self_attn.attn"] = {"kind": "attention", "backend": attn, "draft": False}
    if draft:
        layers["mtp.layers.0.self_attn.attn"] = {"kind": "attention", "backend": draft, "draft": True}
    return {"layers": layers, "cudagraph_mode": "FULL_AND_PIECEWISE",
            "compilation_mode": "VLLM_COMPILE", "enforce_eager": False}


def test_kernel_paths_name_each_phase():
    k = kernel_paths(probe(draft="TRITON_ATTN"), speculative=True)
    assert k["attention_backend"] == "FLASH_ATTN" and k["draft_attention_backend"] == "TRITON_ATTN"
    assert k["gdn_prefill_backend"] == "flashinfer" and k["gdn_layers"] == 3
    assert k["gdn_decode_kernel"] == "fla_packed_recurrent_decode"
    assert k["gdn_verify_kernel"] == "fused_sigmoid_gating_delta_rule_update"
    k = kernel_paths(probe(packed=False), speculative=False)
    assert k["gdn_decode_kernel"] == "fused_sigmoid_gating_delta_rule_update"
    assert k["gdn_verify_kernel"] is None and k["draft_attention_backend"] is None
    # vLLM >= 0.28: the CUDA verify kernel where VLLM_GDN_DECODE_KERNEL resolved to cuda
    k = kernel_paths(probe(decode_kernel="cuda"), speculative=True)
    assert k["gdn_verify_kernel"].startswith("fused_gdn_decode_post_conv_mtp")
    assert k["gdn_decode_kernel_setting"] == "cuda"


def current(**kw):
    base = {"attention_backend": "FLASH_ATTN", "gdn_prefill_backend": "flashinfer",
            "enforce_eager": False, "packed_decode": True, "capability": "9.0",
            "flashinfer_available": True, "llm_kwargs": {}}
    return {**base, **kw}


def test_variants_flip_only_what_differs():
    v = attribution_variants(current(), [SpecConfig(), SpecConfig("mtp", 3)])
    assert "verify baseline" not in v and "verify mtp-k3" in v
    assert "prefill gdn=triton" in v and "prefill gdn=flashinfer" not in v
    assert {"prefill attention=TRITON_ATTN", "prefill attention=FLASHINFER"} <= set(v)
    assert "prefill attention=FLASH_ATTN" not in v
    assert "prefill eager" in v and "decode eager" in v
    v = attribution_variants(current(gdn_prefill_backend="triton", enforce_eager=True,
                                     packed_decode=False, attention_backend="TRITON_ATTN"))
    assert "prefill gdn=flashinfer" in v and "prefill gdn=triton" not in v
    assert v["prefill cudagraphs"] == {"enforce_eager": "false"}
    assert v["decode gdn=packed_recurrent"][f"env.{PACKED_DECODE_ENV}"] == "1"
    # FlashInfer's GDN only where vLLM 0.26 would run it: SM90 with flashinfer installed
    for kw in ({"capability": "8.0"}, {"flashinfer_available": False}):
        v = attribution_variants(current(gdn_prefill_backend="triton", **kw))
        assert "prefill gdn=flashinfer" not in v
    # unknown attention backend (nothing read back yet): no attention variant is guessed
    v = attribution_variants(current(attention_backend=None))
    assert not any(label.startswith("prefill attention") for label in v)
    # vLLM >= 0.28 with the CUDA verify kernel: its triton fallback is a variant
    v = attribution_variants(current(gdn_decode_kernel_setting="cuda"), [SpecConfig("mtp", 3)])
    assert v["verify mtp-k3 gdn=triton"]["env.VLLM_GDN_DECODE_KERNEL"] == "triton"
    for args in v.values():  # every variant parses as engine args
        split_engine_args(args)


def test_gdn_prefill_override_keeps_the_user_s_additional_config():
    llm = {"additional_config": {"gdn_prefill_backend": "flashinfer", "other": 1}}
    assert requested_gdn_prefill(llm) == "flashinfer"
    args = gdn_prefill_args(llm, "triton")
    assert json.loads(args["additional_config"]) == {"gdn_prefill_backend": "triton", "other": 1}
    assert "gdn_prefill_backend" not in args
    llm = {"gdn_prefill_backend": "FlashInfer"}  # the engine arg wins over additional_config
    assert requested_gdn_prefill(llm) == "flashinfer"
    assert gdn_prefill_args(llm, "triton")["gdn_prefill_backend"] == "triton"
    assert requested_gdn_prefill({}) == "auto"


def steps_row(tokens, dists):
    return {"output": {"outputs": [{"token_ids": tokens, "logprobs": [
        {str(t): {"logprob": lp} for t, lp in d.items()} for d in dists]}]}}


def test_scored_from_steps_keeps_only_what_the_step_computed():
    assert step_inputs([[1, 2], [3]], [[7, 8, 9], [4]]) == [[1, 2, 7], None]
    d1, d2 = {8: -0.1, 5: -2.5}, {9: -0.3, 6: -0.4}
    s = scored_from_steps(steps_row([8, 9], [d1, d2]), [7, 8, 9], 2)
    assert s.topk_ids.tolist() == [[-1, -1], [8, 5], [9, 6]]
    assert np.isnan(s.token_logprobs[0]) and s.token_logprobs[2] == np.float32(-0.3)
    # the first step left the prefix (5, not 8): the last position saw another history
    s = scored_from_steps(steps_row([5, 9], [d1, d2]), [7, 8, 9], 2)
    assert s.topk_ids[2].tolist() == [-1, -1] and s.topk_ids[1].tolist() == [8, 5]
    assert (scored_from_steps(None, [7, 8], 2).topk_ids == -1).all()


@given(st.lists(st.integers(1, 50), max_size=30), st.one_of(st.none(), st.integers(1, 80)))
def test_token_budget_groups_cover_in_order_and_fit(lengths, budget):
    groups = token_budget_groups(lengths, budget)
    assert [i for g in groups for i in g] == list(range(len(lengths)))
    assert all(groups)
    for g in groups:
        total = sum(lengths[i] for i in g)
        assert budget is None or total <= budget or len(g) == 1
    if budget is None and lengths:
        assert len(groups) == 1


def test_rerun_switches_add_the_padded_decode_paths():
    """For a rerun, the batch-size switches come as whole-run args: a batch of 2 (GEMMs with
    a K=1 verify's row count) on any backend, and on TRITON_ATTN a batch padded past the 3D
    threshold (its 2D kernel), each alone and with the GDN decode kernel a verify step uses;
    with the packed decode kernel already off only the padding is left to flip."""
    from speccheck.engines.vllm import PAD_FOR_2D, padded_decode_switches, split_engine_args

    v = padded_decode_switches(current(attention_backend="TRITON_ATTN"))
    assert v["decode attention=2d"] == {"pad_batch": str(PAD_FOR_2D)}
    assert v["decode batch=2"] == {"pad_batch": "1"}
    both = v["decode gdn=fused_sigmoid_gating attention=2d"]
    assert both[f"env.{PACKED_DECODE_ENV}"] == "0" and PAD_FOR_2D > 128
    assert v["decode gdn=fused_sigmoid_gating batch=2"] == {"pad_batch": "1",
                                                           f"env.{PACKED_DECODE_ENV}": "0"}
    assert list(padded_decode_switches(current(attention_backend="TRITON_ATTN", packed_decode=False))) \
        == ["decode batch=2", "decode attention=2d"]
    assert list(padded_decode_switches(current())) == ["decode batch=2",  # FLASH_ATTN: no 2D switch
                                                       "decode gdn=fused_sigmoid_gating batch=2"]
    assert split_engine_args(both)["own"]["pad_batch"] == PAD_FOR_2D
