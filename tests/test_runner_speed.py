"""The runner's time savers: the fresh-process repeat alongside the in-process runs, shared
re-scores, and the per-config time left in the progress line."""
from __future__ import annotations

import numpy as np

from speccheck import runner
from speccheck.runner import RunEta, RunPlan, run_suite
from speccheck.store import Store
from speccheck.types import SpecConfig


def test_progress_counts_configs_and_time_left(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(runner.time, "perf_counter", lambda: now[0])
    base, mtp = SpecConfig(), SpecConfig("mtp", 1)
    eta = RunEta([(base, 0), (base, 1), (mtp, 0), (mtp, 1)])
    assert eta.text() == " (configs done 0/2)"  # nothing finished: no guess
    now[0] += 30
    eta.finish(base, 1)
    assert eta.text() == " (configs done 0/2, runs 1/4, about 1 min 30 s left)"
    now[0] += 10
    eta.finish(base, 0)
    assert eta.text() == " (configs done 1/2, runs 2/4, about 40 s left)"


def test_fresh_repeat_runs_alongside_and_matches(tmp_path):
    """On the CPU reference engine (one thread, two or more cores) the last repeat runs in a
    fresh process beside the in-process runs: it is stored as fresh, every config's runs are
    all there (the run all at once included), and they agree token for token."""
    lines = []
    plan = RunPlan(corpus="smoke", configs=[SpecConfig(), SpecConfig("mtp", 2)], repeats=2,
                   rescore=False, attribute=False, concurrent=2)
    suite = run_suite(plan, Store(tmp_path / "store"), log=lines.append)
    for name in ("baseline", "mtp-k2"):
        r0, r1 = suite.load_run(name, 0), suite.load_run(name, 1)
        assert r0.status == r1.status == "ok" and not r0.fresh_process and r1.fresh_process
        for a, b in zip(r0.completions, r1.completions):
            assert np.array_equal(a.token_ids, b.token_ids)
        together = suite.load_together(name)  # on whichever lane was free
        assert together.status == "ok" and together.copies == 2
        for a, b in zip(r0.completions, together.corpus_copy(0)):
            assert np.array_equal(a.token_ids, b.token_ids)
    assert sum("[fresh process]" in line for line in lines) == 2
