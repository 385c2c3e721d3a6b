"""speccheck: a correctness and determinism gate for speculative decoding.

The Python API (:mod:`speccheck.api`) is reachable from here without loading it until used:
``speccheck.run(...)``, ``speccheck.evaluate(...)``, ``speccheck.gate(...)``.
"""
from speccheck.version import __version__

_API = ("run", "evaluate", "gate", "open_suite")
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        from speccheck import api

        return getattr(api, name)
    raise AttributeError(f"module 'speccheck' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_API])
