"""Executors: where the plan's cells run. ``local`` (the default: this process, one run after
another, the fresh-process repeat in a process of its own) or ``ray`` (every cell a Ray task
sized to its engine, on a laptop or a GPU cluster). Either way the cells compute what
runner.py says, and only this process writes the store, under its lock; nothing downstream
of an executor knows where a cell ran.

The ray executor is imported only when a plan asks for it: the local path never imports Ray
(an import contract in pyproject.toml holds it to that)."""
from __future__ import annotations

from typing import Callable

from speccheck.executors import local
from speccheck.plan import EXECUTORS, RunPlan, check_executor
from speccheck.runner import Log, _print
from speccheck.store import Store, Suite

__all__ = ["EXECUTORS", "run_suite"]


def run_suite(plan: RunPlan, store: Store, log: Log = _print,
              progress: Callable[[int, int, str], None] | None = None) -> Suite:
    """Run what the plan has left to do on its executor (plan.executor) and return the
    suite. ``progress(done, total, what)`` is the same display for both."""
    check_executor(plan.executor, plan.address, plan.engine)
    if plan.executor == "ray":
        from speccheck.executors.ray import run_suite as run_on_ray

        return run_on_ray(plan, store, log, progress)
    return local.run_suite(plan, store, log, progress)
