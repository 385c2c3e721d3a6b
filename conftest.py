"""Loads speccheck's pytest plugin when it is not installed through its pytest11 entry point
(e.g. running from a plain checkout with PYTHONPATH=.), and turns off hypothesis's per-example
deadline: a first example that pays a lazy import or a kernel build (Triton's, the C kernels')
exceeds 200 ms on a slow or busy CI machine and fails as "unreliable timing", which tests
nothing the suite is for (speed lives in benchmarks/)."""
from importlib.metadata import entry_points

from hypothesis import settings

settings.register_profile("speccheck", deadline=None)
settings.load_profile("speccheck")

_installed = any(ep.value == "speccheck.pytest_plugin" for ep in entry_points(group="pytest11"))
pytest_plugins = [] if _installed else ["speccheck.pytest_plugin"]
