"""The benchmark scripts still run against today's engine (they are not imported anywhere
else, so an API change would break them silently), and what they print holds together."""
from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_reference_table_in_fp32_every_spec_config_is_identical(capsys):
    """In fp32 with equal kernel forms the speculative configs reproduce the baseline, so the
    bench's last column must read 4/4 (smoke corpus) for each of them."""
    bench = _load("bench_reference")
    args = ["--corpus", "smoke", "--repeats", "1", "--mtp-k", "2", "--dflash-k", "3",
            "--dflash2-k", "3", "--clock", "cpu"]
    for kv in ("dtype=fp32", "gdn_verify=recurrent", "attn_verify=single", "threads=1"):
        args += ["--engine-arg", kv]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    rows = {m[1]: m for m in re.finditer(
        r"^(\S+)\s+([\d.]+)\s+([\d.]+)x\s+([\d.]+)\s+\[[\d., ]+\]\s*(\d+/\d+)?$", out, re.M)}
    assert set(rows) == {"baseline", "mtp-k2", "dflash-k3", "dflash2-k3"}, out
    assert float(rows["baseline"][3]) == 1.0
    for name in ("mtp-k2", "dflash-k3", "dflash2-k3"):
        assert rows[name][5] == "4/4", out
        assert float(rows[name][4]) > 1.0  # some drafts were accepted


@pytest.mark.slow
def test_profile_reference_prints_every_phase_and_the_loop_split(capsys):
    prof = _load("profile_reference")
    assert prof.main(["--context", "24", "--k", "1,3", "--iters", "3", "--top", "2",
                      "--corpus", "smoke", "--prompts", "2", "--engine-arg", "threads=1"]) == 0
    out = capsys.readouterr().out
    for needle in ("decode step (1 token", "verify K=3", "MTP draft step", "DFlash block draft",
                   "profiled ops per step"):
        assert needle in out, out
    loop = {m[1]: m for m in re.finditer(
        r"^  (baseline|mtp-k3|dflash-k7)\s+([\d.]+) ms/iter, ([\d.]+) tok/iter.*\| (.*)$",
        out, re.M)}
    assert set(loop) == {"baseline", "mtp-k3", "dflash-k7"}, out
    assert float(loop["baseline"][3]) == 1.0
    assert "MTP drafting" in loop["mtp-k3"][4] and "DFlash draft" in loop["dflash-k7"][4]
    assert "target forward" in loop["baseline"][4] and "commit" not in loop["baseline"][4]


def test_bench_verify_builds_a_tiny_store_and_its_benchmarks_run(tmp_path, capsys):
    """The verifier benchmark's store builder still writes a store the evaluator reads (run
    here on 12 short prompts; the speed target itself lives in the benchmark, not here): every
    config is judged, the one it plants high-confidence divergences in fails on them, and
    the others pass; and benchmarks/test_bench_verify.py runs on it (pytest-benchmark with
    timing off: each benchmark once)."""
    import os
    import subprocess
    import sys

    bench = _load("bench_verify")
    assert bench.main(["--prompts", "12", "--min-len", "16", "--max-len", "48", "--cache", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    m = re.search(r"12 prompts, 12 runs, (\d+) completions, ([\d,]+) generated tokens", out)
    assert m and int(m[1]) == 12 * 4 * 4, out  # 4 configs x (r0, r1, 2 copies all at once)
    env = {**os.environ, "BENCH_VERIFY_PROMPTS": "12", "BENCH_VERIFY_MIN_LEN": "16",
           "BENCH_VERIFY_MAX_LEN": "48", "BENCH_VERIFY_CACHE": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "--benchmark-disable",
                        str(BENCHMARKS / "test_bench_verify.py")],
                       cwd=BENCHMARKS.parent, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "7 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    from speccheck.cli import main

    root = next(p for p in tmp_path.iterdir() if (p / "BUILT").exists())
    with pytest.raises(SystemExit) as e:
        main.main(["gate", "--store", str(root)], standalone_mode=False)
    gate = capsys.readouterr().out
    assert e.value.code == 1, gate
    assert re.findall(r"^(PASS|FAIL)  (\S+)$", gate, re.M) == [
        ("PASS", "baseline"), ("PASS", "dflash-k7"), ("FAIL", "dflash2-k7"), ("PASS", "mtp-k3")], gate
    assert "divergences_are_low_confidence failed for config dflash2-k7: 2 high-confidence" in gate, gate


def test_loop_split_accounts_for_every_step_of_the_graph_loops(monkeypatch):
    """--loop-split's parts of the step-graph loops (run eagerly on the CPU): one mark per
    step the loop queued, as many as the generation's iterations (nothing past max_tokens),
    a baseline that never waits for the host (one token a step: the end is known ahead), the
    parts summing to the decode time, none negative."""
    import gc
    from speccheck.corpus import load_corpus
    from speccheck.reference import graphs
    from speccheck.reference.engine import ReferenceEngine
    from speccheck.types import Prompt, SpecConfig

    bench = _load("bench_reference")
    monkeypatch.setattr(graphs, "_Ahead", bench.MarkedAhead)
    monkeypatch.setattr(bench.MarkedAhead, "generations", [])
    e = ReferenceEngine(engine_args={"threads": "1"})
    e.decoder.graphs = graphs.GraphDecoding(e.decoder)
    p = load_corpus("smoke").prompts[0]
    p = Prompt(p.id, p.category, 24, p.text, p.messages)
    ids = e.tokenize(p)
    for config in (SpecConfig(), SpecConfig("dflash2", 3), SpecConfig("mtp", 2)):
        got = e.generate([p], [ids], config, 5)[0]
        assert got.finish_reason == "length"
        marked = bench.MarkedAhead.generations[-1]
        parts = bench.loop_split(got.decode_s, marked)
        steps = got.n_tokens - 1 if config.is_baseline else got.spec.drafts
        assert parts["n"] == steps == len(marked.steps), config.name
        names = ("steps", "gap behind", "gap serial", "to first", "after")
        assert min(parts[k] for k in names) >= 0
        assert abs(sum(parts[k] for k in names) - got.decode_s) < 1e-6
        assert parts["first"] <= parts["steps"]
        if config.is_baseline:
            assert parts["serial"] == 0 and parts["gap serial"] == 0.0
    assert len(bench.MarkedAhead.generations) == 3
    # only the marks outlive a generation (a queue kept keeps its pinned host buffers)
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is bench.MarkedAhead]


@pytest.mark.slow
def test_axes_cost_runs_both_arms_and_prints_the_ratios(tmp_path, capsys):
    """Both arms from empty stores (the baseline, one repeat, the smoke corpus, one axis level):
    the axis store holds axis runs and the none store none, the ratios are printed with the
    machine."""
    bench = _load("axes_cost")
    assert bench.main(["--rounds", "1", "--corpus", "smoke", "--keep", str(tmp_path), "--axes", "shapes=k", "--",
                       "--config", "baseline", "--repeats", "1", "--no-attribution", "--concurrent", "off"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("machine: ") and "CPUs" in out.splitlines()[0]
    m = re.search(r"wall ([\d.]+) / ([\d.]+) s = ([\d.]+)x, CPU ([\d.]+) / ([\d.]+) s = ([\d.]+)x", out)
    assert m, out
    arms = {a: (float(w), float(c)) for a, w, c in
            re.findall(r"round 0 (none|all) *: +([\d.]+) s wall, +([\d.]+) s CPU", out)}
    assert (float(m[1]), float(m[4])) == arms["all"] and (float(m[2]), float(m[5])) == arms["none"], out
    # (the figures are printed to 0.1 s: the ratio of the printed ones is near, not equal)
    assert float(m[3]) == pytest.approx(arms["all"][0] / arms["none"][0], rel=0.05)
    assert float(m[6]) == pytest.approx(arms["all"][1] / arms["none"][1], rel=0.05)
    assert list((tmp_path / "all-0").rglob("axis-*")) and not list((tmp_path / "none-0").rglob("axis-*"))


def test_sampling_false_alarms_prints_both_checks_per_config(capsys):
    """One seed, four tokens per prompt: the table has the baseline (its distribution check
    only) and the config (both checks), with Clopper-Pearson bounds and costs."""
    bench = _load("sampling_false_alarms")
    assert bench.main(["--seeds", "1", "--max-tokens", "4", "--configs", "mtp-k3"]) == 0
    out = capsys.readouterr().out
    base = re.search(r"^\| baseline \| 1 \| (\d) \(0\.\d+\) \| - \|", out, re.M)
    spec = re.search(r"^\| mtp-k3 \| 1 \| (\d) \(0\.\d+\) \| (\d) \(0\.\d+\) \|", out, re.M)
    assert base and spec, out


def test_sampling_false_alarms_exact_null_table_holds_together(capsys):
    """--null-redraws: one seed, four tokens per prompt, 20 redraws per trial; each row of the
    exact-null table counts at most its redraws, its rate is alarms / redraws inside its
    Clopper-Pearson interval, and the rejected tests' counts add up to at least the alarms."""
    bench = _load("sampling_false_alarms")
    assert bench.main(["--seeds", "1", "--max-tokens", "4", "--configs", "mtp-k3",
                       "--null-redraws", "20"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (shipped|redrawn) \| (\S+) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| "
                      r"([\d.]+) \| \[([\d.]+), ([\d.]+)\] \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|",
                      out, re.M)
    assert {(r[0], r[1]) for r in rows} == {(m, c) for m in ("shipped", "redrawn")
                                            for c in ("baseline", "mtp-k3", "all")}, out
    for mode, config, trials, positions, n, k, rate, lo, hi, *tests in rows:
        n, k = int(n), int(k)
        assert n == 20 * int(trials) and int(positions) > 0
        assert 0 <= k <= n
        assert float(rate) == pytest.approx(k / n, abs=1e-4)
        assert float(lo) <= float(rate) <= float(hi)
        assert k <= sum(int(t) for t in tests) <= 4 * k


def _oracle(logprobs: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """The sampling distribution written out token by token: tempered softmax, tokens in
    descending order (ties by lowest id) kept while the mass before them is below top_p."""
    w = [math.exp((x - max(logprobs)) / temperature) for x in logprobs]
    total = sum(w)
    keep, before = [], 0.0
    for i in sorted(range(len(w)), key=lambda i: (-logprobs[i], i)):
        if before < top_p * total and w[i] > 0:
            keep.append(i)
        before += w[i]
    p = np.zeros(len(w))
    p[keep] = [w[i] for i in keep]
    return p / p.sum()


@pytest.mark.parametrize("score_top_k", [64, 5])
def test_exact_null_redraws_follow_the_exact_distribution_and_rows_match_sampled_rows(score_top_k):
    """The redraw draws from the target's sampling distribution (20,000 draws at each position
    against an independent oracle, chi-square, with ties at the nucleus boundary), and the rows
    looked up for the redrawn tokens are those sampled_rows computes for them (the scorer's
    full row, or its top 5 with a tail)."""
    from scipy.stats import chisquare

    from speccheck.types import Scored
    from speccheck.verify.sampling_dist import sampled_rows

    bench = _load("sampling_false_alarms")
    V, T, P = 64, 0.8, 0.9
    rng = np.random.default_rng(7)
    raw = rng.normal(0, 2, (3, V))
    raw[1, [3, 9, 40]] = raw[1].max() + 0.5  # a three-way tie at the top
    raw[2, :] = -3.0
    raw[2, [5, 6, 7, 8]] = 0.0  # four tied tokens at the nucleus boundary, the rest far below
    lp = (raw - np.log(np.exp(raw).sum(1, keepdims=True))).astype(np.float32)
    perm = np.stack([rng.permutation(V) for _ in range(3)])  # the scorer's order is arbitrary
    scored = [Scored(perm[:2], np.take_along_axis(lp[:2], perm[:2], 1), lp[0, :2]),
              Scored(perm[2:], np.take_along_axis(lp[2:], perm[2:], 1), lp[2, :1])]
    sp = {"temperature": T, "top_p": P, "top_k": 0}
    null = bench.ExactNull(scored, sp, V, score_top_k)
    assert null.positions == 3 and null.lengths == [2, 1]
    n = 20000
    drawn = null.draw(n, np.random.default_rng(11))
    for t in range(3):
        exact = _oracle(lp[t].astype(np.float64).tolist(), T, P)
        counts = np.bincount(null.tokens[t][drawn[:, t]], minlength=V)
        assert counts[exact == 0].sum() == 0
        expected = exact * n
        big = expected >= 5  # pool the rare categories into one bin
        obs = np.append(counts[big], counts[~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        obs, exp = (obs, exp) if exp[-1] > 0 else (obs[:-1], exp[:-1])
        assert chisquare(obs, exp).pvalue > 1e-3, (t, obs, exp)
    order = [np.lexsort((np.arange(V), -lp[t].astype(np.float64)))[:score_top_k] for t in range(3)]
    for r in range(5):
        rows = null.rows(drawn[r])
        toks = [null.tokens[t][drawn[r, t]] for t in range(3)]
        for o, (a, b) in enumerate([(0, 2), (2, 3)]):
            want = sampled_rows(np.stack(order[a:b]),
                                np.stack([lp[t, order[t]] for t in range(a, b)]),
                                np.array(toks[a:b]), T, P, 0, V,
                                np.array([lp[t, toks[t]] for t in range(a, b)]))
            np.testing.assert_array_equal(rows[o], want)
