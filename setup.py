"""The install's one native step; pyproject.toml holds everything else.

build_ext compiles the reference engine's CPU kernels (speccheck/reference/kernels/cpu_kernels.c)
into one plain shared library per vector instruction set, _cpu_<isa>.so next to cpu.py, which
loads the widest the CPU has through ctypes (they are no Python extension modules; see
speccheck/reference/kernels/build.py for the compiler and flags). ``pip install .`` puts them in
the wheel; ``pip install -e .`` (and ``python setup.py build_ext --inplace``) into the checkout.
A library that fails to build (no C compiler, an instruction set the compiler lacks) is a
warning, not a failed install: the engine then loads a narrower build or runs those kernels as
PyTorch ops (the same bits, slower), and says so once at first use.
"""
import importlib.util
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent
KERNELS = Path("speccheck", "reference", "kernels")


def _kernel_build():
    """speccheck/reference/kernels/build.py, loaded by path (speccheck is not importable yet)."""
    spec = importlib.util.spec_from_file_location("_speccheck_kernel_build",
                                                  HERE / KERNELS / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BinaryDistribution(Distribution):
    """Native libraries inside: a platform wheel, and `build` runs build_ext."""

    def has_ext_modules(self):
        return True


class BuildCPUKernels(build_ext):
    """build_ext plus the CPU kernels' libraries (into build_lib, and into the source tree when
    in place: an editable install or --inplace)."""

    def run(self):
        super().run()
        kb = _kernel_build()
        out = Path(self.build_lib) / KERNELS
        for stale in out.glob("_cpu_*.so"):  # an earlier build's: a failed one must ship none
            stale.unlink()
        built = kb.build_all(out, log=self._warn)
        if not built:
            self._warn("speccheck: no CPU kernel library was built; the reference engine will run "
                       "its CPU kernels as PyTorch ops (same bits, slower)")
        self._built = sorted(built.values())
        if self.inplace:
            for path in self._built:
                self.copy_file(str(path), str(HERE / KERNELS / path.name), level=self.verbose)

    @staticmethod
    def _warn(line):
        print(line, file=sys.stderr, flush=True)

    def _pairs(self):
        """(built file, its place in the source tree) of each library built."""
        return [(str(p), str(HERE / KERNELS / p.name)) for p in getattr(self, "_built", [])]

    def get_outputs(self):
        mine = [dst if self.inplace else src for src, dst in self._pairs()]
        return [*super().get_outputs(), *mine]

    def get_output_mapping(self):
        mapping = super().get_output_mapping()
        if self.inplace:
            mapping.update(self._pairs())
        return mapping


setup(distclass=BinaryDistribution, cmdclass={"build_ext": BuildCPUKernels})
