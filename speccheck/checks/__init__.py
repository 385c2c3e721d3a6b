"""The checks: one module per check, found by :func:`registry` (see ``_registry.py``).

A check module defines ``CHECK = CheckSpec(...)``; nothing else needs to know it exists."""
from speccheck.checks._registry import (
                                        CheckSpec,
                                        Context,
                                        Evidence,
                                        PolicyKey,
                                        RegistryError,
                                        first_line,
                                        get,
                                        judge_all,
                                        measure_all,
                                        names,
                                        policy_keys,
                                        registry,
)

__all__ = ["CheckSpec", "Context", "Evidence", "PolicyKey", "RegistryError", "first_line", "get",
           "judge_all", "measure_all", "names", "policy_keys", "registry"]
