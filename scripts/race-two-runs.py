"""Two `speccheck run` on one store at once, N times (issue 12): every time both must exit 0,
the store must pass `gate` and no temp file or directory may be left. Prints one line a round."""
import subprocess
import sys
import tempfile
from pathlib import Path

RUN = ["--corpus", "smoke", "--config", "mtp-k2", "--repeats", "1", "--concurrent", "0", "--no-attribution"]


def main(rounds: int) -> int:
    bad = 0
    for i in range(rounds):
        st = Path(tempfile.mkdtemp(prefix="race-")) / "st"
        cmd = [sys.executable, "-m", "speccheck.cli", "run", "--store", str(st), *RUN]
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        outs = [p.communicate() for p in procs]
        # one repeat: determinism has nothing to compare, so it is not asked here
        gate = subprocess.run([sys.executable, "-m", "speccheck.cli", "gate", "--store", str(st),
                               "--set", "require_deterministic=false"], capture_output=True, text=True)
        litter = [str(p) for p in st.rglob("*") if p.name.startswith(".") or ".tmp" in p.name or ".old" in p.name]
        codes = [p.returncode for p in procs]
        ok = codes == [0, 0] and gate.returncode == 0 and "Traceback" not in gate.stderr and not litter
        bad += not ok
        print(f"round {i + 1}: run exits {codes}, gate exit {gate.returncode}, "
              f"{sum('0 to run' in o for o, _ in outs)} run found the work done, litter {litter}  "
              f"{'ok' if ok else 'BAD'}", flush=True)
    print(f"{rounds - bad}/{rounds} rounds clean")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 20))
