"""The runner's time savers: the fresh-process repeat alongside the in-process runs, shared
re-scores, and the per-config time left in the progress line."""
from __future__ import annotations

import numpy as np

from speccheck import runner
from speccheck.engines import make_engine
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
    all there (the run all at once included), and each computes exactly what it would alone.

    The run all at once is compared with the same batch generated here afterwards, not with
    r0: a batch of 8 rows may round bf16 GEMMs differently from one row (CPUs with native
    bf16 split the near-tie prompt smoke-tie that way), which the gate judges, not this test."""
    lines = []
    plan = RunPlan(corpus="smoke", configs=[SpecConfig(), SpecConfig("mtp", 2)], repeats=2,
                   rescore=False, attribute=False, concurrent=2)
    suite = run_suite(plan, Store(tmp_path / "store"), log=lines.append)
    engine = make_engine(plan.engine, plan.model, plan.engine_args, plan.draft)
    corpus = plan.load_corpus()
    prompts = list(corpus.prompts) * plan.concurrent
    inputs = suite.load_inputs()
    for config in plan.configs:
        r0, r1 = suite.load_run(config.name, 0), suite.load_run(config.name, 1)
        assert r0.status == r1.status == "ok" and not r0.fresh_process and r1.fresh_process
        for a, b in zip(r0.completions, r1.completions, strict=True):
            assert np.array_equal(a.token_ids, b.token_ids)
        together = suite.load_together(config.name)  # on whichever lane was free
        assert together.status == "ok" and together.copies == 2
        alone = engine.generate_together(prompts, [inputs[p.id].tolist() for p in prompts],
                                          config, plan.top_k)
        for a, b in zip(together.completions, alone, strict=True):
            assert a.prompt_id == b.prompt_id
            assert np.array_equal(a.token_ids, b.token_ids), (config.name, a.prompt_id)
            assert np.array_equal(a.logprobs, np.asarray(b.logprobs, np.float32)), a.prompt_id
    engine.close()
    assert sum("[fresh process]" in line for line in lines) == 2
