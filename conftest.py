"""Loads speccheck's pytest plugin when it is not installed through its pytest11 entry point
(e.g. running from a plain checkout with PYTHONPATH=.)."""
from importlib.metadata import entry_points

_installed = any(ep.value == "speccheck.pytest_plugin" for ep in entry_points(group="pytest11"))
pytest_plugins = [] if _installed else ["speccheck.pytest_plugin"]
