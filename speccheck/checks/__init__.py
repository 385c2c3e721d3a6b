"""The checks: one module per check (see :mod:`speccheck.checks.registry`)."""
from speccheck.checks.registry import (CheckSpec, Context, Evidence, PolicyKey, RegistryError, get,
                                       judge_all, measure_all, names, policy_keys, registry)

__all__ = ["CheckSpec", "Context", "Evidence", "PolicyKey", "RegistryError", "get", "judge_all",
           "measure_all", "names", "policy_keys", "registry"]
