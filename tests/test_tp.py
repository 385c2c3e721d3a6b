"""Tensor-parallel runs without a GPU: the parallel layout checked before a vLLM worker starts,
recorded in the identity (what vLLM resolved, NCCL, the links between the GPUs used), compared
across TP sizes (and any other identity change), and checked by `speccheck doctor --tp N`.

Fixtures:
- tests/fixtures/topo/*.txt: ``nvidia-smi topo -m`` outputs of an NVLink 2-GPU host (HGX H200
  pair, NV18), an NVLink 4-GPU host with NICs (HGX H100, NV18), a PCIe 2-GPU host (L40S across
  sockets, SYS) and a 4-GPU host with two NVLink bridges (NV4 pairs, NODE across). Written by
  hand in nvidia-smi's own format (tab-separated matrix under a header row that starts with a
  tab, " X " on the diagonal, NIC rows/columns, affinity columns, nvidia-smi's legend); see
  tests/fixtures/topo/README.md.
- tests/fixtures/vllm/*.json: what vLLM 0.26.0 returned on the H200 (see tests/engines/test_vllm.py);
  the two TP suites below are built from those recorded outputs, with planted changes.
"""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from speccheck.cli import main
from speccheck.compare import attribute_across, compare_suites
from speccheck.doctor import (
    FAIL,
    OK,
    UNKNOWN,
    WARN,
    model_findings,
    parallel_findings,
    wsl_finding,
)
from speccheck.engines.base import EngineUsageError
from speccheck.engines.vllm import (
    VllmEngine,
    completion_from_dict,
    model_heads,
    parallel_problem,
    tp_fits,
)
from speccheck.engines.vllm_worker import format_nccl_version, gpu_links, parallel_facts
from speccheck.identity import changes_cause, identity_changes
from speccheck.plan import RunPlan, plan_suite_id
from speccheck.policy import Policy
from speccheck.store import Store
from speccheck.topology import (
    describe_link,
    is_nvlink,
    link_rank,
    parse_topo,
    visible_gpus,
    weakest_link,
)
from speccheck.types import RunRecord, Scored, SpecConfig
from tests.test_evaluate import complete_as_run_would

FIX = Path(__file__).parent / "fixtures"
REF_CONFIG = Path(__file__).parents[1] / "speccheck" / "reference" / "weights" / "config.json"


def topo(name: str):
    return parse_topo((FIX / "topo" / f"{name}.txt").read_text())


# ---------------------------------------------------------------- nvidia-smi topo -m

def test_topo_nvlink_2gpu():
    t = topo("nvlink_2gpu")
    assert t.gpus == 2 and t.link(0, 1) == t.link(1, 0) == "NV18"
    assert weakest_link(t, [0, 1]) == "NV18" and is_nvlink("NV18")
    assert weakest_link(t, [0]) is None


def test_topo_nvlink_4gpu_skips_nics_and_affinities():
    t = topo("nvlink_4gpu")
    assert t.gpus == 4
    assert set(t.links.values()) == {"NV18"}  # the NICs' PXB/SYS are not GPU links
    assert len(t.links) == 12
    assert weakest_link(t, [0, 1, 2, 3]) == "NV18"


def test_topo_pcie_and_nvlink_bridges():
    assert weakest_link(topo("pcie_2gpu"), [0, 1]) == "SYS"
    pairs = topo("nvlink_pairs_4gpu")
    assert weakest_link(pairs, [0, 1]) == "NV4" and weakest_link(pairs, [2, 3]) == "NV4"
    assert weakest_link(pairs, [1, 2]) == "NODE"
    assert weakest_link(pairs, [0, 1, 2, 3]) == "NODE"  # TP=4 waits on the PCIe hop
    assert "NVLink, 4 bonded links" in describe_link("NV4") and "NUMA" in describe_link("SYS")


def test_topo_as_printed_to_a_terminal_and_garbage():
    text = (FIX / "topo" / "nvlink_2gpu.txt").read_text()
    # nvidia-smi underlines the header cells on a terminal
    tty = text.replace("\tGPU0\tGPU1\t", "\t\x1b[4mGPU0\x1b[0m\t\x1b[4mGPU1\x1b[0m\t", 1)
    tty = tty.replace("GPU0\t X", "\x1b[4mGPU0\x1b[0m\t X", 1)
    assert parse_topo(tty).links == parse_topo(text).links
    with pytest.raises(ValueError, match="no GPU matrix"):
        parse_topo("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")


@given(st.lists(st.sampled_from(["NV1", "NV4", "NV12", "NV18", "PIX", "PXB", "PHB", "NODE", "SYS"]),
                min_size=1, max_size=8))
def test_link_rank_orders_nvlink_first_sys_last(links):
    ranked = sorted(links, key=link_rank)
    nv = [x for x in ranked if is_nvlink(x)]
    assert ranked[:len(nv)] == sorted(nv, key=lambda x: -int(x[2:]))  # more links first
    order = ["PIX", "PXB", "PHB", "NODE", "SYS"]
    rest = ranked[len(nv):]
    assert [order.index(x) for x in rest] == sorted(order.index(x) for x in rest)


def test_visible_gpus_reads_cuda_visible_devices_as_cuda_does():
    assert visible_gpus(None, 4) == (4, [0, 1, 2, 3])
    assert visible_gpus("2,3", 4) == (2, [2, 3])
    assert visible_gpus("0,-1,1", 4) == (1, [0])  # an invalid entry ends the list
    assert visible_gpus("5", 4) == (0, [])
    assert visible_gpus("", 4) == (0, [])
    assert visible_gpus("GPU-8a1b,GPU-77c2", 4) == (2, None)  # counted, indices unknown
    assert visible_gpus(None, None) == (None, None)
    assert visible_gpus("0,1", None) == (2, [0, 1])


def test_gpu_links_of_the_gpus_a_run_uses():
    assert gpu_links(1, topo("nvlink_4gpu"), None) == {"interconnect": None}
    got = gpu_links(2, topo("nvlink_4gpu"), "2,3")
    assert got == {"interconnect": "NV18", "gpu_links": {"GPU2-GPU3": "NV18"}}
    assert gpu_links(2, topo("nvlink_pairs_4gpu"), "1,2")["interconnect"] == "NODE"
    assert gpu_links(4, topo("nvlink_pairs_4gpu"), None)["interconnect"] == "NODE"
    assert gpu_links(2, None, None)["interconnect"] is None
    assert "unknown" in gpu_links(2, topo("pcie_2gpu"), "GPU-1,GPU-2")["topology_error"]


def test_nccl_version_formats():
    assert format_nccl_version((2, 21, 5)) == "2.21.5"
    assert format_nccl_version(21903) == "2.19.3"
    assert format_nccl_version(2708) == "2.7.8"


# ---------------------------------------------------------------- the layout, checked early

def ref_config() -> dict:
    return json.loads(REF_CONFIG.read_text())


def test_model_heads_read_top_level_and_text_config():
    flat = ref_config()
    assert model_heads(flat) == {"num_attention_heads": 4, "num_key_value_heads": 2,
                                 "linear_num_key_heads": 4, "linear_num_value_heads": 4}
    assert model_heads({"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": flat}) \
        == model_heads(flat)


def test_tp_fits_as_vllm_shards():
    heads = {"num_attention_heads": 8, "num_key_value_heads": 2}
    assert tp_fits(heads, 2) == [] and tp_fits(heads, 8) == []  # KV heads replicated at 8
    assert tp_fits({"num_attention_heads": 6, "num_key_value_heads": 3}, 2) == ["3 KV heads (num_key_value_heads)"]
    assert tp_fits({"linear_num_value_heads": 6}, 4) == ["6 GDN value heads (linear_num_value_heads)"]


@pytest.mark.parametrize("value", ["two", 0, -1, True, 1.5])
def test_parallel_sizes_must_be_positive_ints(value):
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        msg = parallel_problem({key: value}, ref_config(), "/m")
        assert msg.startswith(f"--engine-arg {key}={value}: give a positive whole number")


def test_tp_must_shard_every_head_group():
    msg = parallel_problem({"tensor_parallel_size": 3}, ref_config(), "/ckpt")
    assert "tensor_parallel_size=3 cannot shard --model /ckpt" in msg
    assert "4 attention heads (num_attention_heads)" in msg and "4 GDN value heads" in msg
    assert "TP sizes that fit: 1, 2, 4" in msg
    assert parallel_problem({"tensor_parallel_size": 2}, ref_config(), "/ckpt") is None
    assert parallel_problem({"tensor_parallel_size": 4}, ref_config(), "/ckpt") is None  # KV replicated


def test_drafter_runs_at_the_target_tp_unless_told():
    draft = {"num_attention_heads": 3, "num_key_value_heads": 1}
    msg = parallel_problem({"tensor_parallel_size": 2}, ref_config(), "/t", draft, "/d")
    assert "--draft /d" in msg and "spec.draft_tensor_parallel_size=1" in msg
    assert parallel_problem({"tensor_parallel_size": 2}, ref_config(), "/t", draft, "/d",
                            spec_extra={"draft_tensor_parallel_size": 1}) is None


def test_gpus_and_executor():
    cfg = ref_config()
    msg = parallel_problem({"tensor_parallel_size": 2}, cfg, "/t", visible=1)
    assert "needs 2 GPUs, and this process sees 1" in msg
    assert parallel_problem({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, cfg, "/t",
                            visible=4) is None
    assert "needs 4 GPUs" in parallel_problem({"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
                                              cfg, "/t", visible=2)
    # Ray spans hosts: the local count does not bound it
    assert parallel_problem({"tensor_parallel_size": 4, "distributed_executor_backend": "ray"}, cfg, "/t",
                            visible=1) is None
    assert "runs one process" in parallel_problem(
        {"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, cfg, "/t")
    assert "vLLM knows mp, ray, uni, external_launcher" in parallel_problem(
        {"distributed_executor_backend": "threads"}, cfg, "/t")
    assert parallel_problem({"distributed_executor_backend": "my_pkg.executor.MyExecutor"}, cfg, "/t") is None


@pytest.fixture
def target(tmp_path):
    d = tmp_path / "target"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"],
                                               "text_config": ref_config()}))
    return d


def test_engine_refuses_a_bad_layout_before_any_worker(target, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(EngineUsageError, match="cannot shard"):
        VllmEngine(model=str(target), engine_args={"tensor_parallel_size": "3"})
    with pytest.raises(EngineUsageError, match="this process sees 1"):
        VllmEngine(model=str(target), engine_args={"tensor_parallel_size": "2"})
    VllmEngine(model=str(target), engine_args={"tensor_parallel_size": "1"}).close()


def test_cli_run_with_a_bad_tp_is_exit_2_and_writes_nothing(target, tmp_path):
    store = tmp_path / "store"
    r = CliRunner().invoke(main, ["run", "--engine", "vllm", "--model", str(target), "--corpus", "smoke",
                                  "--store", str(store), "--engine-arg", "tensor_parallel_size=3"])
    assert r.exit_code == 2, r.output
    assert "tensor_parallel_size=3 cannot shard" in r.output and "Traceback" not in r.output
    assert not (store / "suites").exists()  # (the store takes its lock first)


def test_identity_records_the_layout_asked_for(target, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    eng = VllmEngine(model=str(target), engine_args={"tensor_parallel_size": "2"})
    try:
        ident = eng.identity()
    finally:
        eng.close()
    assert (ident["tensor_parallel_size"], ident["pipeline_parallel_size"], ident["gpus_used"]) == (2, 1, 2)
    assert ident["interconnect"] is None and ident["nccl_version"] is None  # not read back yet


def test_suite_id_differs_by_tp_size():
    plans = [RunPlan(engine="vllm", model="/m", corpus="smoke", engine_args=args)
             for args in ({}, {"tensor_parallel_size": "2"}, {"tensor_parallel_size": "4"})]
    assert len({plan_suite_id(p) for p in plans}) == 3


def test_parallel_facts_read_back_from_vllm_config():
    """Test double: a SimpleNamespace with the attribute names of vLLM 0.26's
    ``LLM.llm_engine.vllm_config.parallel_config``."""
    from types import SimpleNamespace

    pc = SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1, world_size=2,
                         distributed_executor_backend="mp", disable_custom_all_reduce=False)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=pc)))
    f = parallel_facts(llm)
    assert (f["tensor_parallel_size"], f["world_size"], f["distributed_executor_backend"]) == (2, 2, "mp")
    assert "nccl_version" in f and "interconnect" in f
    assert "parallel_config_error" in parallel_facts(SimpleNamespace())


def test_tp_reaches_llm_and_is_read_back_with_fake_vllm(fake_vllm, monkeypatch):
    """With the fake vLLM (test double, tests/engines/test_vllm.py), whose LLM resolves the
    parallel config as vLLM 0.26 does (one GPU: uni, more: mp): tensor_parallel_size goes
    through to LLM(...) and the identity records what came back."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    from speccheck.types import Prompt

    target, _ = fake_vllm
    seen = {}
    for tp in (1, 2):
        eng = VllmEngine(model=str(target), engine_args={"warmup": "false", "tensor_parallel_size": str(tp)})
        try:
            eng.generate([Prompt("a", "x", 4, text="a")], [[1, 2]], SpecConfig(), 5)
            seen[tp] = eng.identity()
        finally:
            eng.close()
    assert seen[1]["tensor_parallel_size"] == 1 and seen[1]["distributed_executor_backend"] == "uni"
    assert seen[2]["tensor_parallel_size"] == 2 and seen[2]["distributed_executor_backend"] == "mp"
    assert seen[2]["gpus_used"] == seen[2]["world_size"] == 2
    changes = identity_changes(seen[1], seen[2])
    assert changes_cause(changes) == "TP size"


from tests.engines.test_vllm import dirs, fake_vllm  # noqa: E402,F401 - fixtures (the fake vLLM, test doubles)

# ---------------------------------------------------------------- two suites, TP 1 vs 2

def recorded_completions() -> list:
    """One completion per recorded vLLM output (baseline, MTP K=1/3/7, DFlash K=7), as prompts
    p0..p4 of one run."""
    out = []
    for i, name in enumerate(["baseline", "mtp_k1", "mtp_k3", "mtp_k7", "dflash_k7"]):
        fx = json.loads((FIX / "vllm" / f"{name}.json").read_text())
        out.append(completion_from_dict(f"p{i}", fx["row"], fx["top_k"], spec=False))
    return out


def identity(tp: int, **kw) -> dict:
    fx = json.loads((FIX / "vllm" / "baseline.json").read_text())["runtime"]
    base = {"engine": "vllm", "version": fx.get("vllm_version", "0.26.0"), "model_hash": "m" * 64,
            "tokenizer_hash": "t" * 64, "dtype": "bfloat16", "device": fx.get("gpu", "NVIDIA H200"),
            "tensor_parallel_size": tp, "pipeline_parallel_size": 1, "gpus_used": tp,
            "interconnect": "NV18" if tp > 1 else None, "distributed_executor_backend": "mp" if tp > 1 else "uni",
            "all_reduce": "custom+pynccl" if tp > 1 else None, "nccl_version": "2.27.3"}
    return {**base, **kw}


def rescored(comps) -> dict:
    """Teacher-forced scores that reproduce each run's own tokens (as the suite's own baseline
    engine does on the prefill path), off the decode path by a little path noise."""
    return {c.prompt_id: Scored(c.topk_ids.copy(), c.topk_logprobs.copy(), c.logprobs - 0.002)
            for c in comps}


def near_tie_at(c) -> int:
    """Where a recorded output's own margin is smallest (past position 0) with its runner-up
    clear of the third (recorded exact three-way bf16 ties are left alone)."""
    lp = c.topk_logprobs.astype(np.float64)
    m = np.where((lp[:, 1] - lp[:, 2] > 0.1) & (np.arange(len(lp)) > 0), lp[:, 0] - lp[:, 1], np.inf)
    assert np.isfinite(m).any()
    return int(np.argmin(m))


def make_tie(c, i, gap=0.004):
    c.topk_logprobs[i, 1] = c.topk_logprobs[i, 0] - gap


def flip_top2(c, i):
    """This side chose the other's runner-up at i (ranks 1 and 2 swapped)."""
    c.topk_ids[i, [0, 1]] = c.topk_ids[i, [1, 0]]
    c.token_ids[i] = c.topk_ids[i, 0]
    c.logprobs[i] = c.topk_logprobs[i, 0]


def write_suite(root: Path, runs: dict, scores: dict, ident) -> None:
    s = Store(root).suite("vllm-ckpt-smoke_code-tp", {"corpus_hash": "h", "engine": "vllm", "corpus": "smoke+code"})
    for name, comps in runs.items():
        s.write_run(RunRecord(SpecConfig.from_name(name), ident(name), "smoke+code", "h", 0, False,
                              completions=comps))
        if scores.get(name) is not None:
            s.write_rescore(name, 0, [c.prompt_id for c in comps], [scores[name][c.prompt_id] for c in comps])
    complete_as_run_would(s)
    Store(root).set_latest(s.id)


@pytest.fixture
def tp_stores(tmp_path):
    """TP=1 and TP=2 suites of baseline + mtp-k3 from the recorded outputs. Planted: at the
    baseline's prompt p1, a near-tie (gap 0.004 nats) that TP=2 breaks the other way, on its
    prefill path too (its rescoring gives its token); at mtp-k3's prompt p2, TP=2's run emits
    a token outside TP=1's top-k while TP=2's own prefill scoring agrees with TP=1 (a
    high-confidence difference of the verify path, not a tie)."""
    a = {"baseline": recorded_completions(), "mtp-k3": recorded_completions()}
    tie = near_tie_at(a["baseline"][1])
    for run in a.values():
        make_tie(run[1], tie)
    b = copy.deepcopy(a)
    a_scores = {k: rescored(v) for k, v in a.items()}
    flip_top2(b["baseline"][1], tie)
    b_scores = {k: rescored(v) for k, v in b.items()}  # TP=2's prefill gives its own token
    hi = 3
    c = b["mtp-k3"][2]
    c.token_ids[hi] = 99_999  # in nobody's top-k
    c.topk_ids[hi, 0] = 99_999
    b_scores["mtp-k3"] = rescored(a["mtp-k3"])  # TP=2's prefill scores agree with TP=1 there
    write_suite(tmp_path / "tp1", a, a_scores, lambda name: identity(1))
    write_suite(tmp_path / "tp2", b, b_scores, lambda name: identity(2))
    return tmp_path / "tp1", tmp_path / "tp2", tie, hi


def test_compare_across_tp_classifies_and_attributes(tp_stores):
    one, two, tie, hi = tp_stores
    a, b = Store(one).latest(), Store(two).latest()
    cmp = compare_suites(a, b, ["baseline", "mtp-k3"], Policy())
    assert changes_cause(cmp.changes) == "TP size"
    assert {c.key for c in cmp.changes if c.follows} == {"gpus_used", "interconnect",
                                                         "distributed_executor_backend", "all_reduce"}
    (d,) = cmp.configs["baseline"].divergences
    assert (d.prompt_id, d.position, d.cls) == ("p1", tie, "near_tie")
    (why,) = cmp.attribution["baseline"]
    assert why["cause"] == "TP size" and why["a_scores"] == d.base_token and why["b_scores"] == d.spec_token
    (h,) = cmp.configs["mtp-k3"].divergences
    assert (h.prompt_id, h.position, h.cls) == ("p2", hi, "high_confidence")
    assert cmp.attribution["mtp-k3"][0]["cause"] == "kernel path in TP=2"
    assert not cmp.passed
    v = cmp.verdict()
    assert v.startswith("TP size 1 → 2: changes outputs BEYOND near-ties (1 high-confidence, 0 low-confidence)")
    assert "1 to TP size" in v and "1 to kernel path in TP=2" in v


def test_cli_compare_across_tp(tp_stores):
    one, two, tie, _ = tp_stores
    r = CliRunner().invoke(main, ["compare", "--store", str(one), "--with-store", str(two)])
    assert r.exit_code == 1, r.output
    assert "the suites differ in: TP size 1 → 2 (with it: GPUs used 1 → 2; interconnect — → NV18" in r.output
    assert f"p1 @{tie}:" in r.output and "attributed to TP size: each side's teacher-forced score" in r.output
    assert "BEYOND near-ties" in r.output
    # the baseline alone: TP changes it at a near-tie only
    r = CliRunner().invoke(main, ["compare", "--store", str(one), "--with-store", str(two), "--config", "baseline"])
    assert r.exit_code == 0, r.output
    assert "TP size 1 → 2: changes outputs only at near-ties — 1 divergence(s)" in r.output
    assert "attributed: 1 to TP size" in r.output


def test_compare_identical_outputs_and_missing_rescoring(tp_stores, tmp_path):
    one, two, _, _ = tp_stores
    a = Store(one).latest()
    same = tmp_path / "same"
    shutil.copytree(one, same)
    cmp = compare_suites(a, Store(same).latest(), ["baseline"], Policy())
    assert cmp.changes == [] and cmp.verdict().startswith("nothing in the identity: outputs identical")
    # without TP=2's rescoring the difference is classified but not attributed
    b = Store(two).latest()
    b.rescore_path("baseline", 0).unlink()
    cmp = compare_suites(a, b, ["baseline"], Policy())
    (why,) = cmp.attribution["baseline"]
    assert why["cause"] == "unattributed" and "no stored rescoring" in why["why"]
    assert cmp.configs["baseline"].divergences[0].cls == "near_tie"


def test_compare_with_nothing_in_common_is_exit_2(tp_stores, tmp_path):
    one, _, _, _ = tp_stores
    other = tmp_path / "other"
    write_suite(other, {"mtp-k7": recorded_completions()}, {}, lambda name: identity(2))
    r = CliRunner().invoke(main, ["compare", "--store", str(one), "--with-store", str(other)])
    assert r.exit_code == 2 and "hold no config in common" in r.output, r.output


def test_other_identity_changes_are_named_and_blamed():
    a, b = identity(1), identity(1, device="NVIDIA H100 80GB HBM3", version="0.28.0", dtype="bf16")
    changes = identity_changes(a, b)
    assert [c.label for c in changes] == ["engine version", "GPU model"]  # bf16 is bfloat16
    assert changes_cause(changes) == "engine version, GPU model"
    ref = {"engine": "reference", "model_hash": "r" * 64, "dtype": "fp32", "device": "cpu"}
    cause = changes_cause(identity_changes(ref, identity(2)))
    assert cause.startswith("engine, engine version, model weights, tokenizer")
    # a kernel knob of the reference engine, by name
    knobs = identity_changes({"engine": "reference", "knobs": {"gdn_decode": "recurrent", "attn_decode": "single"}},
                             {"engine": "reference", "knobs": {"gdn_decode": "chunked", "attn_decode": "single"}})
    assert [str(c) for c in knobs] == ["kernel knob gdn_decode recurrent → chunked"]
    # TP and the links: the links follow TP; on their own (another host) they are the cause
    assert changes_cause(identity_changes(identity(2), identity(2, interconnect="SYS"))) == "interconnect"


def test_attribute_across_each_case():
    from speccheck.verify import Classification, Divergence

    cls = Classification("near_tie", 0.01, 0.01, 1, 1)
    d = Divergence("p", 1, 5, 6, cls, 0.001, 10.0, [(5, -0.1), (6, -0.11)], [(6, -0.1), (5, -0.11)])

    def scored(top):
        ids = np.array([[1, 2], [top, 7]], np.int32)
        return {"p": Scored(ids, np.array([[-0.1, -3.0], [-0.1, -0.2]], np.float32), np.zeros(2, np.float32))}

    assert attribute_across(d, scored(5), scored(6), "TP size")["cause"] == "TP size"
    assert attribute_across(d, scored(5), scored(5), "TP size", "TP=1", "TP=2")["cause"] == "kernel path in TP=2"
    assert attribute_across(d, scored(6), scored(6), "TP size", "TP=1", "TP=2")["cause"] == "kernel path in TP=1"
    assert attribute_across(d, scored(7), scored(6), "TP size")["cause"] == "unattributed"
    assert attribute_across(d, None, scored(6), "TP size")["cause"] == "unattributed"


# ---------------------------------------------------------------- doctor --tp

def gpus(n: int, free_gib: float = 100.0) -> dict:
    g = {"name": "NVIDIA H200", "capability": (9, 0), "free": int(free_gib * 2**30), "total": 141 * 2**30}
    return {"gpus": [dict(g) for _ in range(n)]}


def by_topic(findings) -> dict:
    return {f.topic: f for f in findings}


def test_doctor_tp_on_an_nvlink_host():
    f = by_topic(parallel_findings(2, gpus(2), topo("nvlink_2gpu"), [0, 1], {(0, 1): True, (1, 0): True}))
    assert f["GPUs for TP=2"].status == OK
    assert f["GPU links"].status == OK and "NV18 (NVLink, 18 bonded links)" in f["GPU links"].seen
    assert f["P2P access"].status == OK


def test_doctor_tp_too_few_gpus_fails_with_the_fix(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    (f,) = parallel_findings(2, gpus(1), topo("nvlink_2gpu"), [0], None)
    assert f.status == FAIL and "1 GPU(s) visible" in f.seen
    assert "CUDA_VISIBLE_DEVICES=0,1" in f.fix and "tensor_parallel_size" in f.fix


def test_doctor_tp_pcie_links_and_no_p2p_warn():
    f = by_topic(parallel_findings(2, gpus(2), topo("pcie_2gpu"), [0, 1], {(0, 1): False, (1, 0): False}))
    assert f["GPU links"].status == WARN and "SYS" in f["GPU links"].seen and f["GPU links"].fix
    assert f["P2P access"].status == WARN and "0->1" in f["P2P access"].seen
    assert "disable_custom_all_reduce=true" in f["P2P access"].fix
    # four GPUs not all on NVLink: vLLM turns custom all-reduce off
    f = by_topic(parallel_findings(4, gpus(4), topo("nvlink_pairs_4gpu"), [0, 1, 2, 3], None))
    assert f["GPU links"].status == WARN and "custom all-reduce off" in f["GPU links"].seen
    assert f["P2P access"].status == UNKNOWN
    # the first two are one NVLink pair: fine at TP=2
    assert by_topic(parallel_findings(2, gpus(4), topo("nvlink_pairs_4gpu"), [0, 1, 2, 3], None))[
        "GPU links"].status == OK


def test_doctor_tp_without_a_gpu_says_what_it_cannot_check():
    (f,) = parallel_findings(2, {}, None, None, None)
    assert f.status == UNKNOWN and "cannot be checked here" in f.seen
    assert parallel_findings(1, {}, None, None, None) == []


def test_doctor_memory_per_gpu_and_heads(target):
    f = by_topic(model_findings(str(target), gpus(2), 7, tp=2))
    assert f["model heads at TP=2"].status == OK and "per GPU at TP=2" in f["model"].seen
    assert f["GPU memory for this model"].status == OK
    f = by_topic(model_findings(str(target), gpus(3), 7, tp=3))
    assert f["model heads at TP=3"].status == FAIL and "use a TP size that fits: 1, 2, 4" in f["model heads at TP=3"].fix
    full = gpus(2)
    full["gpus"][1]["free"] = 1000  # GPU 1 is nearly full
    m = by_topic(model_findings(str(target), full, 7, tp=2))["GPU memory for this model"]
    assert m.status == FAIL and "on GPU 1, the fullest of the 2" in m.seen
    # the per-GPU need falls with TP: weights (a sparse 1 GiB file) split two ways
    with open(target / "model.safetensors", "wb") as w:
        w.truncate(2**30)
    need = [float(by_topic(model_findings(str(target), {}, 7, tp=t))["GPU memory for this model"]
                  .seen.split("~")[1].split(" ")[0]) for t in (1, 2)]
    assert need[0] > 1.0 and need[1] < 0.6 * need[0]


@pytest.mark.parametrize("release,pin,status", [
    ("5.15.167.4-microsoft-standard-WSL2", None, WARN),
    ("5.15.167.4-microsoft-standard-WSL2", "1", OK),
    ("5.15.167.4-microsoft-standard-WSL2", "0", WARN),
    ("4.19.104-microsoft-standard", "1", WARN),
    ("5.15.167.4-microsoft-standard-WSL2", "yes", FAIL),
])
def test_doctor_wsl2_pin_memory(release, pin, status):
    f = wsl_finding(f"Linux version {release} (gcc) #1 SMP", release, pin)
    assert f.status == status
    if status != OK:
        assert "VLLM_WSL2_ENABLE_PIN_MEMORY=1" in f.fix
    if release.startswith("4.19.104"):
        assert "wsl --update" in f.fix
    assert wsl_finding("Linux version 6.8.0-45-generic", "6.8.0-45-generic", None).status == OK


def test_cli_doctor_tp_here(target):
    r = CliRunner().invoke(main, ["doctor", "--engine", "vllm", "--model", str(target), "--tp", "2"])
    assert "GPUs for TP=2" in r.output and "model heads at TP=2" in r.output
    if "no CUDA device visible" in r.output:  # this CPU machine
        assert "[can't check] GPUs for TP=2" in r.output and r.exit_code == 0, r.output


def test_the_gpu_evidence_script_has_the_tp_step():
    """The GPU evidence script parses and runs the matrix at two TP sizes and compares them (it
    runs only on a multi-GPU machine)."""
    import subprocess

    script = Path(__file__).parents[1] / "scripts" / "gpu_evidence.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert "step_tp() {" in text and '--engine-arg "tensor_parallel_size=$size"' in text
    assert 'compare --store "$RESULTS/store-tp1"' in text


@pytest.mark.parametrize("cap,head,fi,dsl,status,words", [
    ((9, 0), 64, "0.6.14", True, "FAIL", "head dim 128 only"),
    ((9, 0), 128, "0.6.14", True, "ok", "CuTe-DSL"),
    ((9, 0), 128, None, False, "FAIL", "not installed"),
    ((9, 0), 128, "0.6.14", False, "FAIL", "dsl_packages"),
    ((10, 0), 64, "0.6.14", True, "ok", "Triton/FLA"),
    ((8, 9), 128, None, False, "ok", "Triton/FLA"),
    (None, 128, None, False, "can't check", "needs a GPU"),
])
def test_doctor_says_which_gdn_prefill_kernel_vllm_runs(cap, head, fi, dsl, status, words):
    """vLLM 0.26 picks FlashInfer's GDN prefill on SM90 whatever the head dim; FlashInfer's SM90
    kernel takes 128 only: doctor must say so before the first prefill fails."""
    from speccheck.doctor import gdn_prefill_finding

    f = gdn_prefill_finding(cap, head, fi, dsl)
    assert f.status == status, f.line()
    assert words in f.line()
    if status == "FAIL":
        assert "gdn-prefill-backend triton" in f.fix


def test_doctor_says_when_vllm_s_cute_dsl_warmup_would_fail():
    """Seen on the H200: with CuTe DSL importable (FlashInfer's GDN prefill needs it) vLLM 0.26's
    warm-up imports quack; without it every engine start fails. Doctor says so before."""
    from speccheck.doctor import cute_dsl_warmup_finding

    assert cute_dsl_warmup_finding(None, True, False) is None
    assert cute_dsl_warmup_finding((8, 9), True, False) is None
    assert cute_dsl_warmup_finding((9, 0), False, False) is None
    bad = cute_dsl_warmup_finding((9, 0), True, False)
    assert bad.status == "FAIL" and "quack-kernels" in bad.fix
    assert cute_dsl_warmup_finding((9, 0), True, True).status == "ok"
