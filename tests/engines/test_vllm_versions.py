"""The vLLM engine's version table against facts recorded from vLLM's own source of 0.26.0,
0.27.1, 0.28.0 and 0.33.0 (tests/fixtures/vllm/versions/, scripts/record_vllm_facts.py), and
the objects of each version (RequestOutput, a model runner with its drafter) built from those
recorded field and attribute names."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from speccheck.checks import get as get_check
from speccheck.engines.vllm import (
    METRIC_NAMES,
    combination_problem,
    completion_from_dict,
    dflash2_identity,
    metric_names,
    speculative_config,
)
from speccheck.engines.vllm_versions import (
    DFLASH2_ARCHITECTURE,
    DFLASH2_MIN_VLLM,
    MIN_VLLM,
    VLLM_RELEASES,
    golden_series,
    release,
    release_entry,
    version_problem,
)
from speccheck.engines.vllm_worker import drafter_facts, request_output_to_dict
from speccheck.types import SpecConfig

FIX = Path(__file__).parents[1] / "fixtures" / "vllm" / "versions"
VERSIONS = sorted((p.stem for p in FIX.glob("*.json")), key=release)


def facts(version: str) -> dict:
    return json.loads((FIX / f"{version}.json").read_text())


def test_fixtures_cover_the_table():
    """Every entry of the table opens at a recorded release or is read by one, and the
    recorded range runs from the oldest supported release to the newest entry."""
    assert VERSIONS[0] == "0.26.0" and release(VERSIONS[0])[:2] == MIN_VLLM
    assert max(VLLM_RELEASES) <= release(VERSIONS[-1])
    assert {release_entry(v).since for v in VERSIONS} == set(VLLM_RELEASES)


@pytest.mark.parametrize("version", VERSIONS)
def test_table_entry_matches_the_recorded_source(version):
    f, rel = facts(version), release_entry(version)
    assert f["vllm_version"] == version
    assert set(rel.metrics.values()) <= set(f["metric_names"])
    assert metric_names(version) == dict(rel.metrics) == METRIC_NAMES[rel.since]
    assert rel.spec_keys <= set(f["speculative_config_fields"])
    assert rel.spec_methods <= set(f["speculative_methods"])
    assert rel.dflash2 == (DFLASH2_ARCHITECTURE in f["dflash_architectures"])
    assert rel.v2_runner_env in f["envs"] and rel.packed_decode_env in f["envs"]
    assert (rel.gdn_decode_kernel_env is not None) == ("VLLM_GDN_DECODE_KERNEL" in f["envs"])
    assert (rel.gdn_decode_kernel_env is not None) == ("gdn_decode_kernel" in f["gdn_layer_attrs"])
    assert {"gdn_prefill_backend", "enable_packed_recurrent_decode"} <= set(f["gdn_layer_attrs"])
    assert sorted(rel.gdn_prefill_backends) == f["gdn_prefill_backends"]
    assert set(rel.attention_backends) <= set(f["attention_backends"])
    assert set(rel.logprob_fields) <= set(f["logprob_fields"])
    assert set(rel.request_stats) <= set(f["request_state_stats_fields"])
    assert rel.async_scheduling == ("async_scheduling" in f["scheduler_config_fields"])
    v2_attr, v1_attr = rel.drafter_attrs
    assert f["model_runner_v2"]["exists"] and rel.runner_v2.endswith("." + f["model_runner_v2"]["class"])
    assert v2_attr in f["model_runner_v2"]["attrs"] and v1_attr in f["model_runner_v1"]["attrs"]
    assert rel.block_attr in f["dflash_speculator_attrs"]
    assert rel.steps_attr in f["draft_model_speculator_attrs"]


@pytest.mark.parametrize("version", [v for v in VERSIONS if facts(v)["dflash2_speculator_attrs"]])
def test_dflash2_entry_matches_the_recorded_source(version):
    f, rel = facts(version), release_entry(version)
    assert f["dflash_architectures"][DFLASH2_ARCHITECTURE][-1] == rel.dflash2_draft_class
    assert rel.dflash2_draft_class in f["dflash2_model"]["classes"]
    assert "candidate_selector" in f["dflash2_model"]["model_attrs"]
    assert rel.selector_top_k_attr in f["dflash2_speculator_attrs"]
    assert f["dflash2_v2_test"] is not None  # vLLM knows the draft needs the V2 runner


def test_versions_between_entries_read_the_older_one():
    assert release_entry("0.27.1").since == (0, 26) and not release_entry("0.27.1").dflash2
    assert release_entry("0.30.2rc1.dev5+gabc").since == (0, 28)
    assert release_entry("0.33.0").selector_top_k_attr == "top_k"
    assert release_entry(None) == VLLM_RELEASES[max(VLLM_RELEASES)]
    assert DFLASH2_MIN_VLLM == (0, 28)
    assert golden_series("0.28.1rc2.dev77+gac75") == "0.28.1" and golden_series(None) is None


# ---------------------------------------------------------------- refusals

@pytest.fixture
def drafts(tmp_path):
    out = {}
    for name, arch in (("d2", DFLASH2_ARCHITECTURE), ("d1", "DFlashDraftModel")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(
            {"architectures": [arch], "dflash_config": {"block_size": 8, "selector_top_k": 16}}))
        out[name] = str(tmp_path / name)
    return out


@pytest.mark.parametrize("config, draft, version, env, llm, says", [
    ("baseline", None, "0.25.2", {}, {}, "older than the oldest release"),
    ("dflash2-k7", "d2", "0.27.1", {}, {}, "DFlash2 needs vLLM ≥ 0.28"),
    ("dflash2-k7", "d1", "0.33.0", {}, {}, "needs a DFlash2 draft"),
    ("dflash2-k7", "d2", "0.28.0", {"VLLM_USE_V2_MODEL_RUNNER": "0"}, {}, "only in vLLM's V2 model runner"),
    ("dflash2-k7", "d2", None, {"VLLM_USE_V2_MODEL_RUNNER": "false"}, {}, "V2 model runner"),
    ("mtp-k3", None, "0.26.0", {"VLLM_GDN_DECODE_KERNEL": "triton"}, {}, "no such switch"),
    ("mtp-k3", None, "0.28.0", {}, {"additional_config": {"gdn_prefill_backend": "sycl"}}, "offers"),
])
def test_unsupported_combinations_are_refused(drafts, config, draft, version, env, llm, says):
    msg = combination_problem(SpecConfig.from_name(config), drafts.get(draft), version, env, llm)
    assert msg and says in msg, msg


@pytest.mark.parametrize("config, draft, version, env, llm", [
    ("baseline", None, "0.26.0", {}, {}),
    ("dflash2-k7", "d2", "0.28.0", {"VLLM_USE_V2_MODEL_RUNNER": "1"}, {}),
    ("dflash2-k3", "d2", "0.33.0", {}, {"additional_config": {"gdn_prefill_backend": "triton"}}),
    ("mtp-k3", None, "0.28.0", {"VLLM_GDN_DECODE_KERNEL": "triton"}, {}),
    ("mtp-k3", None, "0.33.0", {}, {"additional_config": {"gdn_prefill_backend": "sycl"}}),
    ("dflash-k7", "d1", None, {}, {}),
])
def test_supported_combinations_pass(drafts, config, draft, version, env, llm):
    assert combination_problem(SpecConfig.from_name(config), drafts.get(draft), version, env, llm) is None
    assert version_problem(version) is None


def test_speculative_config_keys_are_the_tables(drafts):
    for name in ("mtp-k3", "dflash-k7", "dflash2-k7"):
        spec = speculative_config(SpecConfig.from_name(name), drafts["d2"], {"attention_backend": "TRITON_ATTN"})
        for v in VERSIONS:
            assert set(spec) <= release_entry(v).spec_keys
            assert spec["method"] in release_entry(v).spec_methods


# ---------------------------------------------------------------- objects of each version

def _obj(fields, **given):
    """A vLLM object of the recorded field names (each None unless given): a test double of
    that version's class."""
    return SimpleNamespace(**{**{f: None for f in fields}, **given})


@pytest.mark.parametrize("version", VERSIONS)
def test_request_output_of_each_version_converts(version):
    """A RequestOutput/CompletionOutput/Logprob/RequestStateStats built from the fields recorded
    for this version (test doubles of its classes) becomes a Completion with the timings."""
    f = facts(version)
    lp = lambda v, r: _obj(f["logprob_fields"], logprob=v, rank=r, decoded_token="x")
    positions = [{5: lp(-0.1, 1), 6: lp(-2.5, 2)}, {7: lp(-0.2, 1), 5: lp(-1.9, 2)}]
    comp = _obj(f["completion_output_fields"], index=0, text="ab", token_ids=[5, 7],
                logprobs=positions, finish_reason="length")
    stats = _obj(f["request_state_stats_fields"], first_token_latency=0.05, first_token_ts=1.0,
                 last_token_ts=1.5, num_generation_tokens=2)
    out = _obj(f["request_output_fields"], request_id="r", prompt_token_ids=[1, 2], outputs=[comp],
               finished=True, metrics=stats)
    c = completion_from_dict("p", {"output": request_output_to_dict(out), "wall_s": 2.0}, 2, spec=False)
    assert c.token_ids.tolist() == [5, 7] and c.topk_ids.tolist() == [[5, 6], [7, 5]]
    assert c.ttft_s == pytest.approx(0.05) and c.decode_s == pytest.approx(0.5)


def _named(module: str, name: str, **attrs):
    """An instance of a class named ``module.name`` (a test double of that vLLM class)."""
    return type(name, (), {"__module__": module})() if not attrs else \
        type(name, (), {"__module__": module, **attrs})()


def _runner(version: str, k: int, v2: bool = True, speculator: str = "DFlash2Speculator",
            selector: bool = True):
    """A model runner as the recorded source of ``version`` builds it for a DFlash2 draft
    (test double): V2 holds ``speculator``, V1 ``drafter``; the DFlash2 speculator keeps its
    selector's top-k under this version's attribute name."""
    f, rel = facts(version), release_entry(version)
    mod = "vllm.v1.worker.gpu.spec_decode." + ("dflash2" if speculator == "DFlash2Speculator" else "dflash")
    spec = _named(mod + ".speculator" if v2 else "vllm.v1.spec_decode.dflash", speculator)
    inner = SimpleNamespace(candidate_selector=object() if selector else None)
    spec.model = _named("vllm.model_executor.models.qwen3_dflash2", "DFlash2Qwen3ForCausalLM", model=inner)
    spec.draft_model_config = SimpleNamespace(architectures=[DFLASH2_ARCHITECTURE],
                                              hf_config=SimpleNamespace(dflash_config={"block_size": 8}))
    setattr(spec, rel.block_attr, k + 1)
    setattr(spec, rel.steps_attr, k)
    for attr in f["dflash2_speculator_attrs"] or []:
        if "top_k" in attr:
            setattr(spec, attr, 16)
    runner_cls = rel.runner_v2 if v2 else rel.runner_v1
    runner = _named(runner_cls.rsplit(".", 1)[0], runner_cls.rsplit(".", 1)[1])
    setattr(runner, rel.drafter_attrs[0] if v2 else rel.drafter_attrs[1], spec)
    return runner


def _judge(version: str, runner, k: int):
    d = drafter_facts(runner, version)
    ident = {"dflash2": dflash2_identity(d, version), "draft_block": d["draft_block"],
             "draft_class": d["draft_class"], "block_size": 528}  # block_size: vLLM's KV cache block
    check = get_check("dflash2_facts")
    ctx = SimpleNamespace(runs=[SimpleNamespace(identity=ident)])
    r = SimpleNamespace(config=f"dflash2-k{k}", measured={"dflash2_facts": check.measure(ctx)})
    return check.judge(r, None)


@pytest.mark.parametrize("version", [v for v in VERSIONS if release_entry(v).dflash2])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_dflash2_proof_read_from_the_runner_passes(version, k):
    c = _judge(version, _runner(version, k), k)
    assert c.passed, c.message
    assert "DFlash2Qwen3ForCausalLM in model_runner.GPUModelRunner" in c.message
    assert f"selector on, top-16 candidates, block {k + 1} tokens for K = {k} (trained block 8)" in c.message


@pytest.mark.parametrize("version", [v for v in VERSIONS if release_entry(v).dflash2])
@pytest.mark.parametrize("fault, says", [
    ({"v2": False, "speculator": "DFlashProposer"}, "not the V2 model runner"),
    ({"speculator": "DFlashSpeculator"}, "selector was 'off'"),
    ({"selector": False}, "selector was 'off'"),
])
def test_dflash2_proof_fails_where_it_ran_as_dflash(version, fault, says):
    c = _judge(version, _runner(version, 7, **fault), 7)
    assert not c.passed and says in c.message, c.message


def test_dflash2_proof_fails_on_a_wrong_block():
    runner = _runner("0.28.0", 7)
    runner.speculator.num_query_per_req = 4
    c = _judge("0.28.0", runner, 7)
    assert not c.passed and "block was 4 tokens, not K + 1 = 8" in c.message


def test_no_drafter_read_back_is_no_proof():
    assert dflash2_identity(None, "0.28.0") is None
    assert drafter_facts(SimpleNamespace(speculator=None, drafter=None), "0.28.0") is None
