"""Executors: where the plan's cells run. ``local`` (the default: this process, one run after
another, the fresh-process repeat in a process of its own). The cells compute what runner.py
says, and only this process writes the store, under its lock; nothing downstream of an
executor knows where a cell ran."""
from __future__ import annotations

from typing import Callable

from speccheck.executors import local
from speccheck.plan import RunPlan
from speccheck.runner import Log, _print
from speccheck.store import Store, Suite

__all__ = ["run_suite"]


def run_suite(plan: RunPlan, store: Store, log: Log = _print,
              progress: Callable[[int, int, str], None] | None = None) -> Suite:
    """Run what the plan has left to do and return the suite. ``progress(done, total, what)``
    is called as it goes."""
    return local.run_suite(plan, store, log, progress)
