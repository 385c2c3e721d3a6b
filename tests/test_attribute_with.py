"""`--attribute-with LABEL=URL` for the openai engine, for real over HTTP: the matrix runs
against `speccheck serve` (baseline, then MTP on the same port), and the divergences are
re-scored on two further `speccheck serve` processes started with other kernel knobs."""
from __future__ import annotations

import json

import httpx
import pytest
from click.testing import CliRunner

from speccheck.cli import main
from speccheck.engines.openai import parse_metrics
from speccheck.serve import running_server
from speccheck.store import Store


def _served(url: str) -> int:
    return parse_metrics(httpx.get(url + "/metrics").text)["requests"]


@pytest.mark.slow
def test_attribute_with_second_servers_over_http(tmp_path, free_port, serve_process):
    # the baseline server computes in fp32, the MTP server in bf16: they may disagree at
    # close calls, and the attribution servers (bf16 and fp32 prefill) say which side each
    # takes. Whether bf16 and fp32 split anywhere on smoke is the CPU's matter (with native
    # bf16 they agree everywhere), so the MTP server also takes its bonus token from the
    # wrong position (planted fault bonus-off-by-one): divergences no path reproduces, certain
    store = str(tmp_path / "store")
    port = free_port
    cli = CliRunner()
    with serve_process() as bf16, serve_process("dtype=fp32") as fp32:
        for method, k, knobs in (("baseline", None, {"dtype": "fp32"}),
                                 ("mtp", 2, {"fault": "bonus-off-by-one"})):
            with running_server(method, k, engine_args=knobs, port=port) as url:
                before = {u: _served(u) for u in (bf16, fp32)}
                args = ["run", "--engine", "openai", "--base-url", url, "--method", method,
                        "--corpus", "smoke", "--store", store, "--concurrent", "off", "--axes", "none",
                        "--repeats", "1", "--attribute-with", f"bf16={bf16}",
                        "--attribute-with", f"fp32={fp32}"]
                res = cli.invoke(main, args + (["--k", str(k)] if k else []))
                assert res.exit_code == 0, res.output
        suite = Store(store).latest()
        items = suite.load_attribution("mtp-k2")
        assert items is not None
        assert items, "MTP with a wrong bonus token against an fp32 baseline diverged nowhere"
        # one prompt_logprobs request per divergence on each attribution server
        for u in (bf16, fp32):
            assert _served(u) - before[u] == len(items)
    for it in items:
        assert set(it["paths"]) == {"bf16", "fp32"}
        assert it["reproduces_spec"] == sorted(l for l, t in it["paths"].items()
                                               if t == it["spec_token"])
    # the report names the path per divergence, as on the reference engine
    report = cli.invoke(main, ["diff", "--store", store])
    for it in items:  # each path's token at the divergent position
        assert f"bf16→{it['paths']['bf16']}" in report.output, report.output
        assert f"fp32→{it['paths']['fp32']}" in report.output
    # the second servers are not part of the suite's identity
    assert "attribute_with" not in json.dumps(suite.meta)


def test_attribute_with_is_refused_where_it_cannot_work():
    cli = CliRunner()
    res = cli.invoke(main, ["run", "--engine", "reference", "--corpus", "smoke",
                            "--attribute-with", "eager=http://127.0.0.1:9"])
    assert res.exit_code == 2 and "does not talk to a server" in res.output
    res = cli.invoke(main, ["run", "--engine", "openai", "--method", "baseline",
                            "--attribute-with", "eager=localhost:8001"])
    assert res.exit_code == 2 and "not an http(s) URL" in res.output
    res = cli.invoke(main, ["run", "--engine", "openai", "--method", "baseline",
                            "--attribute-with", "eager"])
    assert res.exit_code == 2 and "LABEL=URL" in res.output


def test_server_info_kernel_settings_are_recorded():
    """vLLM's /server_info (VLLM_SERVER_DEV_MODE=1), shaped as vLLM 0.26 dumps VllmConfig."""
    from speccheck.engines.openai import server_kernels

    info = {"vllm_config": {
        "attention_config": {"backend": None},
        "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE", "mode": 3},
        "model_config": {"enforce_eager": False},
        "additional_config": {"gdn_prefill_backend": "triton"},
        "speculative_config": {"method": "mtp", "attention_backend": None}},
        "vllm_env": {"VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE": False, "VLLM_API_KEY_X": "no"}}
    k = server_kernels(info)
    assert k["attention_backend_requested"] == "auto"
    assert k["gdn_prefill_backend_requested"] == "triton"
    assert k["cudagraph_mode"] == "FULL_AND_PIECEWISE" and k["enforce_eager"] is False
    assert k["VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE"] is False
    assert not any("KEY" in name for name in k)
    assert server_kernels({"vllm_config": "text form"}) == {}
