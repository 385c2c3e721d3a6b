"""The GDN differential harness: its fp64 ground truth is right, the reference kernels sit at
bf16-output distance from it, and a broken kernel is caught."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from speccheck.cli import main
from speccheck.kernels.gdn import compare, fp64_recurrence, kernels, make_inputs, table


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
    res = {r.name: r for r in compare(x, kernels("cpu"), repeats=1)}
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
    res = {r.name: r for r in compare(x, impls, repeats=1)}
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
    if not torch.cuda.is_available():
        bad = CliRunner().invoke(main, ["kernels", "gdn", "--device", "cuda"])
        assert bad.exit_code == 2 and "CUDA is not available" in bad.output


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_kernels_run():
    x = make_inputs(512, device="cuda")
    res = compare(x, kernels("cuda"), repeats=1)
    assert all(r.state_rel_err < 1e-2 for r in res), res
