"""The runner's time savers: the fresh-process repeat alongside the in-process runs, shared
re-scores, and the per-config time left in the progress line."""
from __future__ import annotations

import numpy as np
import pytest

from speccheck.engines import make_engine
from speccheck.plan import RunPlan
from speccheck.executors import run_suite
from speccheck.executors.local import RunEta
from speccheck.store import Store
from speccheck.types import SpecConfig


def test_progress_shows_each_configs_time_left():
    """Each config's time left comes from its own runs (the baseline and a spec config run at
    different speeds); a config not yet run is guessed from the mean run; two lanes halve
    the matrix's time left."""
    base, mtp = SpecConfig(), SpecConfig("mtp", 1)
    eta = RunEta([(base, 0), (base, 1), (mtp, 0), (mtp, 1)])
    assert eta.text(base) == " (configs done 0/2)"  # nothing finished: no guess
    eta.finish(base, 0, 30.0)
    assert eta.text(base) == (" (baseline: 1 run left, about 30 s; configs done 0/2, runs 1/4, "
                              "about 1 min 30 s left)")
    assert eta.text(mtp).startswith(" (mtp-k1: 2 runs left, about 1 min 00 s;")
    eta.finish(base, 1, 30.0)
    eta.finish(mtp, 0, 10.0)
    assert eta.text(mtp) == (" (mtp-k1: 1 run left, about 10 s; configs done 1/2, runs 3/4, "
                             "about 10 s left)")
    two = RunEta([(base, 0), (base, 1), (mtp, 0), (mtp, 1)], lanes=2)
    two.finish(base, 0, 30.0)
    assert two.text().endswith("about 45 s left)")


@pytest.mark.slow
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
