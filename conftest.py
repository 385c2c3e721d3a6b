"""Loads speccheck's pytest plugin when it is not installed through its pytest11 entry point
(e.g. running from a plain checkout with PYTHONPATH=.), and sets hypothesis's profile.

Both profiles turn off the per-example deadline: a first example that pays a lazy import or a
kernel build exceeds 200 ms on a busy machine and fails as "unreliable timing", which tests
nothing the suite is for (speed lives in benchmarks/). ``ci`` (loaded when ``CI`` is set) also
derandomizes, so a CI failure reproduces on the next run, and prints the blob to replay it."""
import os
from importlib.metadata import entry_points

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

_installed = any(ep.value == "speccheck.pytest_plugin" for ep in entry_points(group="pytest11"))
pytest_plugins = [] if _installed else ["speccheck.pytest_plugin"]
