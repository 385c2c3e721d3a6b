"""The runner's time savers: the fresh-process repeat alongside the in-process runs, shared
re-scores, and the per-config time left in the progress line."""
from __future__ import annotations

import numpy as np

from speccheck import runner
from speccheck.runner import ConfigEta, RunPlan, run_suite
from speccheck.store import Store
from speccheck.types import SpecConfig


def test_config_eta_counts_down_from_the_configs_done(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(runner.time, "perf_counter", lambda: now[0])
    eta = ConfigEta(["baseline", "baseline", "mtp-k1", "mtp-k1", "dflash-k7"])
    eta.start("baseline")
    assert eta.text() == " (config 1/3)"  # nothing finished: no guess
    now[0] += 30
    eta.start("mtp-k1")
    assert eta.text() == " (config 2/3, ~30 s per config, about 1 min 00 s left)"
    now[0] += 50
    eta.start("dflash-k7")
    assert eta.text() == " (config 3/3, ~40 s per config, about 40 s left)"


def test_fresh_repeat_runs_alongside_and_matches(tmp_path):
    """On the CPU reference engine (one thread, two or more cores) the last repeat runs in a
    fresh process beside the in-process runs: it is stored as fresh, every config's runs are
    all there, and the two repeats agree token for token."""
    lines = []
    plan = RunPlan(corpus="smoke", configs=[SpecConfig(), SpecConfig("mtp", 2)], repeats=2,
                   rescore=False, attribute=False)
    suite = run_suite(plan, Store(tmp_path / "store"), log=lines.append)
    for name in ("baseline", "mtp-k2"):
        r0, r1 = suite.load_run(name, 0), suite.load_run(name, 1)
        assert r0.status == r1.status == "ok" and not r0.fresh_process and r1.fresh_process
        for a, b in zip(r0.completions, r1.completions):
            assert np.array_equal(a.token_ids, b.token_ids)
    assert sum("[fresh process]" in line for line in lines) == 2
