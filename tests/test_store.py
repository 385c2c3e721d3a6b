"""The store: atomic run directories, exact round trips, resume markers, corrupted files."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speccheck.store import Store, StoreError, suite_id
from speccheck.types import Completion, RunRecord, Scored, SpecConfig, SpecCounters


def completion(pid, n, k=5, seed=0):
    rng = np.random.default_rng(seed)
    lp = -np.sort(rng.random((n, k)), axis=1).astype(np.float32)
    return Completion(pid, rng.integers(0, 100, 7), rng.integers(0, 4096, n), lp[:, 0],
                      rng.integers(0, 4096, (n, k)), lp, text=f"t{pid}", ttft_s=0.1, decode_s=0.5,
                      spec=SpecCounters(3, 9, 4, [2, 1, 1]))


def record(config="mtp-k3", repeat=0, comps=None, status="ok"):
    return RunRecord(SpecConfig.from_name(config), {"engine": "x"}, "smoke", "h", repeat, False,
                     status=status, completions=comps if comps is not None else [completion("a", 5)])


@pytest.fixture
def suite(tmp_path):
    return Store(tmp_path / "st").suite("s1", {"corpus_hash": "h"})


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=5), k=st.integers(2, 6))
def test_round_trip_is_exact(tmp_path_factory, lengths, k):
    suite = Store(tmp_path_factory.mktemp("st")).suite("s", {"corpus_hash": "h"})
    comps = [completion(f"p{i}", n, k, seed=i) for i, n in enumerate(lengths)]
    suite.write_run(record(comps=comps))
    back = suite.load_run("mtp-k3", 0).completions
    assert [c.prompt_id for c in back] == [c.prompt_id for c in comps]
    for a, b in zip(comps, back):
        for field in ("prompt_ids", "token_ids", "logprobs", "topk_ids", "topk_logprobs"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
        assert b.spec == a.spec and b.text == a.text


def test_failed_run_is_not_complete_and_is_replaced(suite):
    suite.write_run(record(status="failed", comps=[]))
    assert not suite.is_complete("mtp-k3", 0)
    suite.write_run(record())
    assert suite.is_complete("mtp-k3", 0)
    assert [p.name for p in suite.run_dir("mtp-k3", 0).parent.iterdir()] == ["r0"]


def test_configs_sorted_baseline_first(suite):
    for name in ["mtp-k10", "dflash-k7", "mtp-k2", "baseline"]:
        suite.write_run(record(name if name != "baseline" else "baseline"))
    assert suite.configs() == ["baseline", "dflash-k7", "mtp-k2", "mtp-k10"]


def test_corrupted_arrays_give_clear_error(suite):
    suite.write_run(record())
    (suite.run_dir("mtp-k3", 0) / "arrays.npz").write_bytes(b"not a zip")
    with pytest.raises(StoreError, match="arrays.npz.*damaged"):
        suite.load_run("mtp-k3", 0)


def test_each_file_is_read_once_until_it_changes(suite, monkeypatch):
    """An evaluation asks for the same runs and rescoring many times: one Suite reads (and
    sum-checks) each file once while it is unchanged, and again once it is replaced or
    damaged, so a damaged file still fails every later read."""
    import speccheck.store as store_mod

    suite.write_run(record())
    suite.write_rescore("mtp-k3", 0, ["a"], [Scored(np.arange(10).reshape(2, 5), -np.ones((2, 5)),
                                                    np.array([-0.1, -0.2]))])
    loads = []
    real = store_mod._load_npz
    monkeypatch.setattr(store_mod, "_load_npz",
                        lambda path, *a, **k: loads.append(path.name) or real(path, *a, **k))
    first = suite.load_run("mtp-k3", 0)
    assert suite.load_run("mtp-k3", 0) is first and suite.is_complete("mtp-k3", 0)
    assert suite.load_rescore("mtp-k3", 0) is suite.load_rescore("mtp-k3", 0)
    assert loads == ["arrays.npz", "mtp-k3-r0.npz"]
    suite.write_run(record(comps=[completion("b", 3)]))  # replaced: read again
    assert [c.prompt_id for c in suite.load_run("mtp-k3", 0).completions] == ["b"]
    path = suite.run_dir("mtp-k3", 0) / "arrays.npz"
    path.write_bytes(path.read_bytes()[:-1] + b"x")  # damaged in place, same size
    with pytest.raises(StoreError, match="changed since it was written"):
        suite.load_run("mtp-k3", 0)
    assert not suite.is_complete("mtp-k3", 0)


def test_pickled_object_arrays_are_refused(suite):
    suite.write_run(record())
    path = suite.run_dir("mtp-k3", 0) / "arrays.npz"
    np.savez(path, token_ids=np.array([{"evil": 1}], dtype=object))
    with pytest.raises(StoreError):
        suite.load_run("mtp-k3", 0)


def test_rescore_round_trip(suite):
    s = [Scored(np.arange(10).reshape(2, 5), -np.ones((2, 5)), np.array([-0.1, -0.2]))]
    suite.write_rescore("mtp-k3", 0, ["a"], s)
    back = suite.load_rescore("mtp-k3", 0)["a"]
    np.testing.assert_array_equal(back.topk_ids, s[0].topk_ids)
    np.testing.assert_array_equal(back.token_logprobs, s[0].token_logprobs)


def test_latest_and_missing_suite(tmp_path):
    store = Store(tmp_path)
    with pytest.raises(StoreError, match="holds no runs"):
        store.latest()
    store.suite("abc", {"corpus_hash": "h"})
    store.set_latest("abc")
    assert store.latest().id == "abc"
    with pytest.raises(StoreError, match="no suite 'zzz'"):
        store.suite("zzz")


def test_suite_id_separates_engine_args():
    a = suite_id("reference", None, None, {}, "default", "h")
    b = suite_id("reference", None, None, {"fault": "stale-state"}, "default", "h")
    assert a != b and a.startswith("reference-default-default-")


def test_manifest_is_plain_json(suite):
    path = suite.write_run(record()) / "manifest.json"
    m = json.loads(path.read_text())
    assert m["complete"] is True and m["config"]["method"] == "mtp" and m["completions"][0]["n_tokens"] == 5


def test_new_first_repeat_drops_stale_rescoring(suite):
    suite.write_run(record())
    suite.write_rescore("mtp-k3", 0, ["a"], [Scored(np.zeros((1, 2)), np.zeros((1, 2)), np.zeros(1))])
    suite.write_attribution("mtp-k3", [])
    suite.write_run(record())
    assert suite.load_rescore("mtp-k3", 0) is None and suite.load_attribution("mtp-k3") is None


def test_counters_iterations_round_trip_and_old_stores_load(suite):
    """SpecCounters.iterations is stored and read back; a store written before the field
    existed (no "iterations" key) loads with None, and a key of a newer version is ignored."""
    a = completion("a", 5)
    a.spec = SpecCounters(2, 6, 2, [1, 1, 0], iterations=3)
    suite.write_run(record(comps=[a, completion("b", 4)]))
    back = suite.load_run("mtp-k3", 0).completions
    assert back[0].spec.iterations == 3 and back[1].spec.iterations is None
    manifest = suite.run_dir("mtp-k3", 0) / "manifest.json"
    m = json.loads(manifest.read_text())
    del m["completions"][0]["spec"]["iterations"]
    m["completions"][1]["spec"]["from_a_newer_version"] = 1
    manifest.write_text(json.dumps(m))
    from speccheck.store import file_sum  # as that version wrote it: with its own checksum

    manifest.with_name("manifest.json.sha256").write_text(json.dumps(file_sum(manifest)))
    old = suite.load_run("mtp-k3", 0).completions
    assert old[0].spec == SpecCounters(2, 6, 2, [1, 1, 0]) and old[1].spec == SpecCounters(3, 9, 4, [2, 1, 1])


def test_counters_add_keeps_iterations_only_when_every_side_has_them():
    a, b = SpecCounters(1, 3, 2, [1, 1, 0], 2), SpecCounters(2, 6, 1, [1], 4)
    assert (a + b) == SpecCounters(3, 9, 3, [2, 1, 0], 6)
    assert (a + SpecCounters(1, 3, 0, [0, 0, 0])).iterations is None
    rec = record(comps=[completion("x", 3), completion("y", 3)])
    rec.completions[0].spec, rec.completions[1].spec = a, b
    assert rec.spec_total() == a + b and rec.spec_total() is not a
    rec.completions[1].spec = SpecCounters(1, 3, 0, [0, 0, 0])
    assert rec.spec_total().iterations is None


def test_merge_joins_configs_run_side_by_side_and_overwrites_nothing(tmp_path):
    """Two stores of one suite, each with the baseline and one spec config (as parallel jobs
    on two GPUs leave them): merged, one store holds both configs with their rescoring, a
    `run` of both finds nothing to generate, and the gate judges them together. A run both
    hold is kept as it is here, a difference in its outputs said; the source is untouched."""
    from dataclasses import replace

    from click.testing import CliRunner

    from speccheck.cli import main
    from speccheck.plan import RunPlan
    from speccheck.executors import run_suite

    def plan(name):
        return RunPlan(corpus="smoke", configs=[SpecConfig(), SpecConfig.from_name(name)],
                       repeats=1, concurrent=0, attribute=False)

    a = run_suite(plan("mtp-k3"), Store(tmp_path / "a"), log=lambda _: None)
    b = run_suite(plan("dflash-k7"), Store(tmp_path / "b"), log=lambda _: None)
    assert a.id == b.id
    before = sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*"))
    r = CliRunner().invoke(main, ["merge", str(tmp_path / "b"), "--store", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    assert "dflash-k7 r0 copied" in r.output and "dflash-k7 rescoring copied" in r.output
    assert "baseline r0 copied" not in r.output  # both hold it: this store's is kept
    assert sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*")) == before
    merged = Store(tmp_path / "a").suite(a.id)
    assert sorted(merged.configs()) == ["baseline", "dflash-k7", "mtp-k3"]
    assert merged.load_rescore("dflash-k7", 0) is not None
    assert set(merged.planned_configs()) == {"baseline", "mtp-k3", "dflash-k7"}
    lines = []
    both = replace(plan("mtp-k3"), configs=[SpecConfig(), SpecConfig.from_name("mtp-k3"),
                                            SpecConfig.from_name("dflash-k7")])
    run_suite(both, Store(tmp_path / "a"), log=lines.append)
    assert any("3 already stored, 0 to run" in line for line in lines), lines
    g = CliRunner().invoke(main, ["gate", "--store", str(tmp_path / "a")])
    assert "dflash-k7" in g.output and "mtp-k3" in g.output
    # a baseline whose outputs differ is said, and this store's copy stays
    run = b.load_run("baseline", 0)
    c0 = run.completions[0]
    changed = replace(c0, token_ids=np.where(np.arange(len(c0.token_ids)) == 0, c0.token_ids + 1,
                                             c0.token_ids))
    b.write_run(replace(run, completions=[changed] + run.completions[1:]))
    kept = merged.load_run("baseline", 0)
    again = Store(tmp_path / "a").merge(Store(tmp_path / "b"))
    assert any("baseline r0: both stores hold it and 1 prompt(s)' tokens or logprobs differ" in s
               for s in again), again
    assert np.array_equal(merged.load_run("baseline", 0).completions[0].token_ids,
                          kept.completions[0].token_ids)
    with pytest.raises(StoreError, match="is the store itself"):
        Store(tmp_path / "a").merge(Store(tmp_path / "a"))
