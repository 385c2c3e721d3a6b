#!/usr/bin/env python3
"""What the workload axes cost the default run: `speccheck run` with every default axis against
`speccheck run --axes none`, each from an empty store, the two arms interleaved (A B B A per
pair of rounds) so that both see the same load on a shared machine.

    python benchmarks/axes_cost.py [--rounds 2] [--corpus default] [--axes default] [-- extra run args]

Per arm: wall seconds and CPU seconds (user + system of the run and its worker processes,
from getrusage of the children), summed over the rounds; the ratios all-axes / none; the gate's
verdict on each all-axes store. The CPU-time ratio is the one to read on a shared machine (the
wall clock waits for other jobs too). Prints the CPU model (lscpu) with the figures.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", "unknown CPU").strip()
    return f"{name}, {os.cpu_count()} CPUs"


def timed(cmd: list[str], log) -> tuple[float, float, int]:
    """(wall s, CPU s of the command and everything it waited for, exit code)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="rounds per arm (ABBA order)")
    ap.add_argument("--corpus", default="default")
    ap.add_argument("--keep", type=Path, help="keep the stores and logs here")
    ap.add_argument("--axes", default="default", help="the axes of the second arm (`run --axes`)")
    ap.add_argument("extra", nargs="*", help="more `speccheck run` arguments (after --)")
    a = ap.parse_args(argv)
    work = a.keep or Path(tempfile.mkdtemp(prefix="axes-cost-"))
    work.mkdir(parents=True, exist_ok=True)
    arms = {"none": ["--axes", "none"], "all": ["--axes", a.axes]}
    order = [("none", "all") if r % 2 == 0 else ("all", "none") for r in range(a.rounds)]
    total = {arm: [0.0, 0.0] for arm in arms}
    print(f"machine: {cpu_model()}; python {sys.version.split()[0]}", flush=True)
    for r, pair in enumerate(order):
        for arm in pair:
            store = work / f"{arm}-{r}"
            cmd = [sys.executable, "-m", "speccheck.cli", "run", "--corpus", a.corpus, "--store",
                   str(store), *arms[arm], *a.extra]
            with open(work / f"{arm}-{r}.log", "w") as log:
                wall, cpu, rc = timed(cmd, log)
            if rc != 0:
                print(f"round {r} {arm}: `speccheck run` exited {rc} (see {work}/{arm}-{r}.log)")
                return rc
            total[arm][0] += wall
            total[arm][1] += cpu
            verdict = ""
            if arm == "all":
                with open(work / f"gate-{r}.log", "w") as log:
                    gate = subprocess.run([sys.executable, "-m", "speccheck.cli", "gate", "--store", str(store)],
                                          cwd=ROOT, capture_output=True, text=True)
                    log.write(gate.stdout + gate.stderr)
                verdict = "; " + (gate.stdout.strip().splitlines() or ["gate: no output"])[-1]
            print(f"round {r} {arm:4}: {wall:7.1f} s wall, {cpu:7.1f} s CPU{verdict}", flush=True)
    (wn, cn), (wa, ca) = total["none"], total["all"]
    print(f"all axes / none over {a.rounds} round(s): wall {wa:.1f} / {wn:.1f} s = {wa / wn:.2f}x, "
          f"CPU {ca:.1f} / {cn:.1f} s = {ca / cn:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
