"""Builds the reference engine's CPU kernels (cpu_kernels.c) into plain shared libraries, one
per vector instruction set (:data:`ISAS`), that cpu.py loads through ctypes (they are no Python
extension modules). The install runs this (setup.py's build_ext, at ``pip install``); a
checkout can run it by hand, into this folder by default::

    python -m speccheck.reference.kernels.build [--out DIR] [--isa NAME ...]

The compiler is ``$CC`` where set, else the one Python was built with, else ``cc`` / ``gcc`` on
the PATH. ``$CFLAGS`` is not read: the flags below are part of the kernels' arithmetic (no
floating-point contraction, no fast math), and every build gives the same bits (the tests
compare them). Each library records the sha256 of the source it was built from, so cpu.py
refuses one built from another cpu_kernels.c (a checkout edited since its last build).

Standard library only: setup.py loads this file by path, before speccheck is installed.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path

SOURCE = Path(__file__).with_name("cpu_kernels.c")
#: vector instruction sets the kernels are built for, widest first; all give the same bits
ISAS = ("avx512", "avx2", "generic")
#: the CPU flags (/proc/cpuinfo) each needs
ISA_NEEDS = {"avx512": frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}),
             "avx2": frozenset({"avx2", "fma"}), "generic": frozenset()}
BASE_FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC")
ISA_FLAGS = {"avx512": ("-mavx2", "-mfma", "-DUSE_FMA",  # a sum's 16 lanes in one zmm register
                        "-mavx512f", "-mavx512bw", "-mavx512vl", "-DUSE_AVX512"),
             "avx2": ("-mavx2", "-mfma", "-DUSE_FMA"),  # the lanes in two ymm registers; fused adds
             "generic": ()}


class BuildError(Exception):
    """A library that could not be built (no compiler, or the compiler failed)."""


def library_name(isa: str) -> str:
    """The file name of the library built for ``isa`` (next to cpu.py once installed)."""
    return f"_cpu_{isa}.so"


def source_sha256(source: Path = SOURCE) -> str:
    return hashlib.sha256(source.read_bytes()).hexdigest()


def compiler() -> list[str] | None:
    """The C compiler command: ``$CC`` where set (as given, even if it fails), else Python's
    own (sysconfig's CC) where it is on the PATH, else ``cc`` or ``gcc``; None where none is."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    for cmd in (sysconfig.get_config_var("CC"), "cc", "gcc"):
        argv = shlex.split(cmd) if cmd else []
        if argv and shutil.which(argv[0]):
            return argv
    return None


def build(isa: str, out: Path, cc: list[str] | None = None) -> Path:
    """Compile the kernels for ``isa`` into the library ``out`` (written to a temporary name,
    then renamed: a racing build or a failed one leaves no half-written library). Raises
    :class:`BuildError` with the compiler's last line where it fails."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"unknown instruction set {isa!r}: choose one of {ISAS}")
    cc = cc or compiler()
    if not cc:
        raise BuildError("no C compiler found (set CC)")
    sha = source_sha256()
    cmd = [*cc, *BASE_FLAGS, *ISA_FLAGS[isa], f'-DCPU_KERNELS_SHA256="{sha}"']
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.stem}-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([*cmd, "-o", tmp, str(SOURCE)], capture_output=True, text=True,
                           timeout=300)
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or [""])[-1]
            raise BuildError(f"{shlex.join(cc)} exited with status {r.returncode}"
                             + (f": {last}" if last else ""))
        os.chmod(tmp, 0o755)  # (mkstemp's 0600 would keep other users from loading it)
        os.replace(tmp, out)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{shlex.join(cc)}: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def build_all(out_dir: Path, isas=ISAS, cc: list[str] | None = None,
              log: Callable[[str], None] = _stderr) -> dict[str, Path]:
    """Every library of ``isas`` into ``out_dir``; {isa: path} of those built. A failure is a
    line on ``log``, never an exception: the engine then loads a narrower build, or runs the
    kernels as PyTorch ops (the same bits, slower), and says so at first use."""
    built = {}
    for isa in isas:
        try:
            built[isa] = build(isa, Path(out_dir) / library_name(isa), cc)
        except BuildError as e:
            log(f"speccheck: could not build the CPU kernels for {isa} ({e})")
    return built


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=SOURCE.parent,
                    help="folder for the libraries (default: next to cpu.py, where it loads them)")
    ap.add_argument("--isa", action="append", choices=ISAS,
                    help="build only this instruction set (repeatable; default: all)")
    a = ap.parse_args(argv)
    built = build_all(a.out, a.isa or ISAS)
    for isa, path in built.items():
        print(f"built {isa}: {path}")
    return 0 if built else 1


if __name__ == "__main__":
    sys.exit(main())
