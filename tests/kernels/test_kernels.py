"""The GDN differential harness: its fp64 ground truth is right, the reference kernels sit at
bf16-output distance from it, a broken kernel is caught, flips are binned by fp64 margin, and
the calls into vLLM's fused kernels and FlashInfer's follow their conventions (checked here
against torch test doubles; the kernels themselves run only on a GPU)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from speccheck.cli import main
from speccheck.kernels.gdn import (compare, default_head_dim, flashinfer_arch, fp64_recurrence,
                                   gating_inputs, kernels, make_inputs, margin_curves,
                                   margin_table, table)
from speccheck.verify.margin_bins import MARGIN_EDGES, flips_by_margin, margin_bin_index


def test_fp64_recurrence_one_step_from_zero_is_beta_qk_v():
    """From a zero state one step writes beta * k v^T, so o = beta (q̂ . k̂) v / sqrt(Dk)."""
    x = make_inputs(1, heads=2, dk=8, dv=4, seed=3)
    o, s = fp64_recurrence(x["q"], x["k"], x["v"], x["g"], x["beta"], torch.zeros(1, 2, 8, 4))
    q, k, v = (x[n].double()[0, 0] for n in ("q", "k", "v"))
    qk = (q / q.norm(dim=-1, keepdim=True) * k / k.norm(dim=-1, keepdim=True)).sum(-1)
    want = x["beta"].double()[0, 0, :, None] * qk[:, None] * v / 8 ** 0.5
    torch.testing.assert_close(o[0, 0], want, rtol=1e-12, atol=1e-12)
    assert s.abs().sum() > 0


def test_reference_kernels_are_bf16_rounding_away_from_fp64():
    x = make_inputs(256, heads=2, seed=0)
    res = {r.name: r for r in compare(x, kernels("cpu"), repeats=1).results}
    assert set(res) == {"reference recurrent", "reference chunked"}
    for r in res.values():
        assert r.state_rel_err < 1e-5  # fp32 state
        assert 1e-4 < r.out_rel_err < 4e-3  # the output rounded to bf16, as the layer does
        assert r.flip_rate < 0.02


def test_a_broken_kernel_is_caught():
    """Test double: a recurrent kernel that forgets the decay gate (a stale-gate bug)."""
    good = kernels("cpu")["reference recurrent"]

    def no_decay(q, k, v, g, beta, state):
        return good(q, k, v, torch.zeros_like(g), beta, state)

    def crashes(q, k, v, g, beta, state):
        raise RuntimeError("no kernel image for this GPU")

    x = make_inputs(256, heads=2, seed=0)
    impls = {"ok": good, "no decay": no_decay, "crashes": crashes}
    res = {r.name: r for r in compare(x, impls, repeats=1).results}
    assert res["no decay"].out_rel_err > 100 * res["ok"].out_rel_err
    assert res["no decay"].flips > 10 * max(res["ok"].flips, 1)
    assert res["crashes"].error == "RuntimeError: no kernel image for this GPU"
    assert "crashes                     failed: RuntimeError" in table(list(res.values()))


def test_cli_json_and_bad_device():
    r = CliRunner().invoke(main, ["kernels", "gdn", "--device", "cpu", "--positions", "48",
                                  "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)  # progress goes to stderr
    assert [k["name"] for k in data["kernels"]] == ["reference recurrent", "reference chunked"]
    pair = data["chunked_vs_recurrent"][0]
    assert pair["compared"] == 48 * 4 and 0 <= pair["flips"] <= pair["compared"]
    assert data["head_dim"] == 64 and data["flashinfer_auto"] is None  # no FlashInfer on a CPU
    assert sum(b["count"] for b in data["margin_bins"]) == 48 * 4
    curves = {(c["a"], c["b"]): c["flips"] for c in data["flips_by_margin"]}
    assert set(curves) == {("reference recurrent", "fp64"), ("reference chunked", "fp64"),
                           ("reference recurrent", "reference chunked")}
    for k in data["kernels"]:
        assert sum(curves[(k["name"], "fp64")]) == k["flips"]
    assert "readout argmax flips by fp64 top-1/top-2 margin" in r.stderr  # the table, on stderr
    if not torch.cuda.is_available():
        bad = CliRunner().invoke(main, ["kernels", "gdn", "--device", "cuda"])
        assert bad.exit_code == 2 and "CUDA is not available" in bad.output


def test_cli_json_to_a_file_keeps_the_table_on_stdout(tmp_path):
    out = tmp_path / "gdn.json"
    r = CliRunner().invoke(main, ["kernels", "gdn", "--device", "cpu", "--positions", "16",
                                  "--heads", "1", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["positions"] == 16
    assert "readout argmax flips by fp64 top-1/top-2 margin" in r.stdout
    bad = CliRunner().invoke(main, ["kernels", "gdn", "--device", "cpu", "--positions", "16",
                                    "--json", str(tmp_path / "no" / "such" / "gdn.json")])
    assert bad.exit_code == 2 and "--json" in bad.output and "does not exist" in bad.output
    assert "Traceback" not in bad.output


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_kernels_run():
    x = make_inputs(512, device="cuda")
    res = compare(x, kernels("cuda"), repeats=1).results
    assert all(r.state_rel_err < 1e-2 for r in res), res


# --- the flip-rate-vs-margin curve ---------------------------------------------------------------

margin_arrays = st.integers(1, 300).flatmap(lambda n: st.tuples(
    arrays(np.float64, n, elements=st.floats(0, 10, allow_nan=False)),
    arrays(np.int64, n, elements=st.integers(0, 3)),
    arrays(np.int64, n, elements=st.integers(0, 3))))


@given(margin_arrays)
def test_margin_bins_partition_positions_and_count_each_flip_once(data):
    margin, a, b = data
    bins = flips_by_margin(margin, a, b)
    assert len(bins) == len(MARGIN_EDGES) + 1
    assert sum(x.count for x in bins) == len(margin)
    assert sum(x.flips for x in bins) == int((a != b).sum())
    assert all(0 <= x.flips <= x.count for x in bins)
    idx = margin_bin_index(margin)
    for m, i in zip(margin, idx):  # each margin lies inside its bin's bounds
        assert bins[i].lo <= m < bins[i].hi
    assert all(x.flips == 0 for x in flips_by_margin(margin, a, a.copy()))


def test_margin_bins_reject_nan_and_bad_edges():
    with pytest.raises(ValueError, match="NaN"):
        margin_bin_index(np.array([0.1, np.nan]))
    with pytest.raises(ValueError, match="increasing"):
        margin_bin_index(np.array([0.1]), edges=(1e-2, 1e-3))
    with pytest.raises(ValueError, match="one shape"):
        flips_by_margin(np.zeros(3), np.zeros(3), np.zeros(4))
    assert [b.label for b in flips_by_margin(np.zeros(1), [0], [0], edges=(1e-3, 1.0))] == \
        ["<1e-3", "1e-3..1e0", ">=1e0"]


def test_margin_curves_cover_every_kernel_against_fp64_and_every_pair():
    x = make_inputs(128, heads=2, seed=2)
    good = kernels("cpu")["reference recurrent"]

    def no_decay(q, k, v, g, beta, state):  # test double: a stale-gate bug
        return good(q, k, v, torch.zeros_like(g), beta, state)

    comp = compare(x, {**kernels("cpu"), "no decay": no_decay}, repeats=1)
    curves = {(a, b): row for a, b, row in margin_curves(comp)}
    names = [r.name for r in comp.results]
    assert set(curves) == {(n, "fp64") for n in names} | {
        (a, b) for i, a in enumerate(names) for b in names[i + 1:]}
    for r in comp.results:  # the curve against fp64 adds up to the kernel's flips
        assert sum(x.flips for x in curves[(r.name, "fp64")]) == r.flips
    # the broken kernel flips at large margins too; the reference forms only at small ones
    big = [i for i, b in enumerate(curves[("no decay", "fp64")]) if b.lo >= 1e-2]
    assert sum(curves[("no decay", "fp64")][i].flips for i in big) > 0
    assert sum(curves[("reference chunked", "fp64")][i].flips for i in big) == 0
    assert "reference recurrent vs reference chunked" in margin_table(margin_curves(comp))


# --- vLLM's fused kernels and FlashInfer's, as the harness calls them ----------------------------

@given(st.floats(-40.0, -1e-6), st.floats(1e-4, 1 - 1e-4))
def test_gating_inputs_give_back_g_and_beta_through_the_fused_kernels_formula(g, beta):
    """The fused kernels compute g = -exp(A_log) softplus(a + dt_bias) (softplus linear above
    20) and beta = sigmoid(b) in fp32; the solved inputs reproduce g and beta to fp32."""
    gt, bt = torch.tensor([[g]], dtype=torch.float32), torch.tensor([[beta]], dtype=torch.float32)
    x = gating_inputs(gt, bt)
    z = x["a"] + x["dt_bias"]
    softplus = torch.where(z <= 20.0, torch.log(1 + torch.exp(z)), z)
    g_back = -torch.exp(x["A_log"]) * softplus
    torch.testing.assert_close(g_back, gt, rtol=1e-5, atol=2e-7)
    torch.testing.assert_close(torch.sigmoid(x["b"]), bt, rtol=1e-5, atol=1e-7)


def _fused_gating(A_log, a, b, dt_bias):
    z = a.float() + dt_bias.float()
    g = -torch.exp(A_log.float()) * torch.where(z <= 20.0, torch.log(1 + torch.exp(z)), z)
    return g, torch.sigmoid(b.float())


def _step(h, q, k, v, g, beta, scale):
    """One token of the fused kernels in torch: h [H, V, K] fp32."""
    q = q.float() / torch.sqrt((q.float() ** 2).sum(-1, keepdim=True) + 1e-6) * scale
    k = k.float() / torch.sqrt((k.float() ** 2).sum(-1, keepdim=True) + 1e-6)
    h = h * torch.exp(g)[:, None, None]
    u = (v.float() - (h * k[:, None, :]).sum(-1)) * beta[:, None]
    h = h + u[:, :, None] * k[:, None, :]
    return h, (h * q[:, None, :]).sum(-1)


def packed_decode_double(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out,
                         ssm_state_indices, use_qk_l2norm_in_kernel=False):
    """Test double of vLLM 0.26's ``fused_recurrent_gated_delta_rule_packed_decode`` in torch,
    written from its Triton source: state pool [slots, HV, V, K], slot 0 skipped, in place."""
    heads, dv, dk = initial_state.shape[-3:]
    for n, slot in enumerate(ssm_state_indices.tolist()):
        if slot <= 0:
            out[n] = 0
            continue
        q, k = mixed_qkv[n, :heads * dk].view(heads, dk), mixed_qkv[n, heads * dk:2 * heads * dk].view(heads, dk)
        v = mixed_qkv[n, 2 * heads * dk:].view(heads, dv)
        g, beta = _fused_gating(A_log, a[n], b[n], dt_bias)
        beta = beta.to(b.dtype).float()
        h, o = _step(initial_state[slot], q, k, v, g, beta, scale)
        initial_state[slot] = h
        out[n, 0] = o.to(out.dtype)
    return out, initial_state


def sigmoid_gating_double(A_log, a, b, dt_bias, q, k, v, beta=1.0, threshold=20.0, scale=None,
                          initial_state=None, inplace_final_state=True, cu_seqlens=None,
                          ssm_state_indices=None, num_accepted_tokens=None,
                          use_qk_l2norm_in_kernel=False, is_kda=False):
    """Test double of vLLM 0.26's ``fused_sigmoid_gating_delta_rule_update`` in torch, written
    from its Triton source, for the spec-decode call: varlen, continuous batching, the initial
    state read from slot ``indices[n, accepted - 1]``, every token's state to its own slot."""
    out = torch.empty_like(v)
    for n in range(len(cu_seqlens) - 1):
        bos, eos = int(cu_seqlens[n]), int(cu_seqlens[n + 1])
        h = initial_state[int(ssm_state_indices[n, int(num_accepted_tokens[n]) - 1])].clone()
        for i, t in enumerate(range(bos, eos)):
            g, bt = _fused_gating(A_log, a[t], b[t], dt_bias)
            h, o = _step(h, q[0, t], k[0, t], v[0, t], g, bt, scale or q.shape[-1] ** -0.5)
            initial_state[int(ssm_state_indices[n, i])] = h
            out[0, t] = o.to(out.dtype)
    return out, initial_state


def test_vllm_fused_kernel_calls_carry_the_state_as_the_engine_does(monkeypatch):
    """Test doubles of vLLM's two fused kernels (torch, from their Triton source) stand in for
    the GPU: decode one token at a time and verify in blocks of 3 (the last one short) must land
    at fp32 distance of the fp64 recurrence, so slots, layouts and gating are wired right."""
    import speccheck.kernels.gdn as gdn

    doubles = {"fused_recurrent_gated_delta_rule_packed_decode": packed_decode_double,
               "fused_sigmoid_gating_delta_rule_update": sigmoid_gating_double}
    monkeypatch.setattr(gdn, "_vllm_fused", lambda name: doubles[name])
    x = make_inputs(40, heads=2, dk=8, dv=4, seed=5)
    o64, s64 = fp64_recurrence(**x)
    for fn in (gdn._vllm_fused_decode(), gdn._vllm_fused_verify(3)):
        o, s = fn(**x)
        assert o.shape == o64.shape and o.dtype == torch.bfloat16 and s.shape == s64.shape
        assert float((o.double() - o64).norm() / o64.norm()) < 4e-3  # bf16 output rounding
        assert float((s.double() - s64).norm() / s64.norm()) < 1e-5  # fp32 state


def test_flashinfer_call_follows_vllms_conventions(monkeypatch):
    """Test double of ``flashinfer.gdn_prefill.chunk_gated_delta_rule`` (torch, from its
    documented contract: [T, H, D] inputs, alpha = exp(g), fp32 state [N, H, V, K], q and k
    normalised by the caller) put in sys.modules: the harness's call must land at fp64."""
    import sys
    import types

    import speccheck.kernels.gdn as gdn

    def chunk_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                               output_final_state=False, cu_seqlens=None, use_cp="auto"):
        assert q.dim() == 3 and g.dtype == beta.dtype == initial_state.dtype == torch.float32
        assert cu_seqlens.tolist() == [0, q.shape[0]] and (g > 0).all() and (g <= 1).all()
        h, outs = initial_state[0].clone(), []
        for t in range(q.shape[0]):
            h = h * g[t][:, None, None]
            u = (v[t].float() - (h * k[t].float()[:, None, :]).sum(-1)) * beta[t][:, None]
            h = h + u[:, :, None] * k[t].float()[:, None, :]
            outs.append((h * (q[t].float() * scale)[:, None, :]).sum(-1))
        return torch.stack(outs).to(q.dtype), h[None]

    monkeypatch.setitem(sys.modules, "flashinfer.gdn_prefill",
                        types.SimpleNamespace(chunk_gated_delta_rule=chunk_gated_delta_rule))
    x = make_inputs(40, heads=2, dk=8, dv=8, seed=6)
    o64, s64 = fp64_recurrence(**x)
    o, s = gdn._flashinfer(use_cp=False)(**x)
    assert o.shape == o64.shape and s.shape == s64.shape
    assert float((o.double() - o64).norm() / o64.norm()) < 1e-2  # q, k rounded to bf16 once more
    assert float((s.double() - s64).norm() / s64.norm()) < 1e-2


def test_without_a_gpu_flashinfer_is_not_asked_for_and_the_head_dim_stays_64():
    assert default_head_dim("cpu") == 64
    assert isinstance(flashinfer_arch("cpu"), str)
    missing = []
    assert set(kernels("cpu", missing, head_dim=128)) == {"reference recurrent", "reference chunked"}


@pytest.mark.parametrize("pth, line, folder", [
    ("nvidia_cutlass_dsl.pth", "nvidia_cutlass_dsl/python_packages", "python_packages"),  # 4.5.0
    ("nvidia_cutlass_dsl_packages.pth", "import sys, os, nvidia_cutlass_dsl; sys.path.insert(0, "
     "os.path.join(nvidia_cutlass_dsl.__path__[0], 'dsl_packages'))", "dsl_packages")])  # 4.8.1
def test_cutlass_dsl_pth_in_a_pythonpath_folder_is_read(tmp_path, monkeypatch, pth, line, folder):
    """A staged site tree on PYTHONPATH (the .pth lines of nvidia-cutlass-dsl 4.5.0 and 4.8.1
    as shipped): its .pth puts the cutlass package folder on sys.path, as site does only for
    site-packages; other .pth files there are left alone."""
    import sys

    from speccheck.kernels.gdn import read_cutlass_dsl_pth

    pkgs = tmp_path / "nvidia_cutlass_dsl" / folder
    pkgs.mkdir(parents=True)
    (tmp_path / pth).write_text(line + "\n")
    (tmp_path / "other.pth").write_text(str(tmp_path / "elsewhere") + "\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    monkeypatch.delitem(sys.modules, "nvidia_cutlass_dsl", raising=False)
    assert read_cutlass_dsl_pth() == [str(tmp_path / pth)]
    assert str(pkgs) in sys.path and str(tmp_path / "elsewhere") not in sys.path
    assert read_cutlass_dsl_pth() == []  # once per process
