"""How long the verifier takes: `speccheck diff` and `speccheck gate` on a store of >= 1 M
generated tokens (built once and cached by bench_verify.py), timed by pytest-benchmark:

    pytest benchmarks/ --benchmark-only [--benchmark-columns=median,min,max,rounds]
        [--benchmark-cprofile=cumtime]   # the functions one run spends its time in

Not collected by the default test run (testpaths is tests/): numbers depend on the machine.
Per command (one table group each): in-process wall time -- the command through click with
the file checksum cache cleared, what a fresh process does (load + verify + format) without
interpreter start-up or imports; the 2 s target is this row --, in-process CPU time (the
steadier figure on a shared machine) and the `speccheck` console script end to end in a
subprocess; and the console script's start-up alone (`speccheck --version`).

The store's shape comes from the environment: BENCH_VERIFY_PROMPTS (500), BENCH_VERIFY_MIN_LEN
(64), BENCH_VERIFY_MAX_LEN (256), BENCH_VERIFY_CONFIGS (baseline,mtp-k3,dflash-k7,dflash2-k7),
BENCH_VERIFY_SEED (0), BENCH_VERIFY_CACHE (/tmp/speccheck-bench-verify); BENCH_VERIFY_ROUNDS
(3) timed rounds per row. Each row's store and the gate's verdict are in
``--benchmark-json``'s extra_info.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import bench_verify as bv
import pytest

ROUNDS = int(os.environ.get("BENCH_VERIFY_ROUNDS", 3))
COMMANDS = ("diff", "gate")


@pytest.fixture(scope="module")
def store() -> tuple[Path, dict]:
    """The cached synthetic store (built on first use: minutes at the default size)."""
    env = os.environ.get
    root, stats = bv.cached_store(Path(env("BENCH_VERIFY_CACHE", "/tmp/speccheck-bench-verify")),
                                  int(env("BENCH_VERIFY_PROMPTS", 500)), int(env("BENCH_VERIFY_MIN_LEN", 64)),
                                  int(env("BENCH_VERIFY_MAX_LEN", 256)), env("BENCH_VERIFY_CONFIGS", bv.CONFIG_NAMES),
                                  int(env("BENCH_VERIFY_SEED", 0)))
    bv.in_process(["diff", "--store", str(root)], root)  # imports and the page cache, not timed
    return root, {**stats, "mb": round(bv.store_size(root) / 1e6)}


def _args(command: str, root: Path) -> list[str]:
    return [command, "--store", str(root)]


def _check(benchmark, command: str, out: str, code: int, stats: dict) -> None:
    """What ran is what was meant: diff exits 0; gate 0 or 1 (1 on the default store, where
    one config has planted high-confidence divergences), never a usage error or a crash."""
    assert code in ((0,) if command == "diff" else (0, 1)), out[-2000:]
    benchmark.extra_info.update(store=stats, exit_code=code,
                                last_line=(out.strip().splitlines() or [""])[-1])


@pytest.mark.parametrize("command", COMMANDS)
def test_in_process_wall(benchmark, store, command):
    root, stats = store
    benchmark.group = f"speccheck {command}"
    out, code = benchmark.pedantic(bv.in_process, (_args(command, root), root), rounds=ROUNDS, iterations=1)
    _check(benchmark, command, out, code, stats)


@pytest.mark.benchmark(timer=time.process_time)
@pytest.mark.parametrize("command", COMMANDS)
def test_in_process_cpu(benchmark, store, command):
    root, stats = store
    benchmark.group = f"speccheck {command}"
    out, code = benchmark.pedantic(bv.in_process, (_args(command, root), root), rounds=ROUNDS, iterations=1)
    _check(benchmark, command, out, code, stats)


@pytest.mark.parametrize("command", COMMANDS)
def test_cli_end_to_end(benchmark, store, command):
    root, stats = store
    benchmark.group = f"speccheck {command}"
    out, code = benchmark.pedantic(bv.cli, (_args(command, root), root), rounds=ROUNDS, iterations=1)
    _check(benchmark, command, out, code, stats)


def test_cli_start_up(benchmark, store):
    root, _ = store
    benchmark.group = "CLI start-up"
    out, code = benchmark.pedantic(bv.cli, (["--version"], root), rounds=ROUNDS, iterations=1)
    assert code == 0 and out.strip(), out
