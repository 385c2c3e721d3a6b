"""The policy: thresholds that turn measurements into pass/fail. Each check declares its own
keys and defaults (speccheck/checks/); the few every comparison shares live here.
`[tool.speccheck]` in pyproject.toml, a `speccheck.toml`, `--policy FILE` and `--set key=value`
override them, in that order."""
from __future__ import annotations

import math
import sys
from dataclasses import asdict, field, make_dataclass, replace
from pathlib import Path

from speccheck.checks import PolicyKey, policy_keys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class PolicyError(ValueError):
    """A bad policy file or override (exit code 2)."""


#: thresholds that belong to no one check: the divergence classes every comparison uses
CORE_KEYS = (
    PolicyKey("tie_noise_multiple", 4.0,
              "thresholds scale with the engine's own measured path noise: tau = max(floor, multiple "
              "x noise) (noise = 99th percentile |decode-path - prefill-path logprob| of the "
              "baseline's own tokens). Calibrated on the reference engine (bf16, default corpus, noise "
              "0.038 nats): every clean divergence had a baseline margin <= 1.9x noise; planted faults "
              "flipped tokens at 0.9x-180x (and mostly far outside the other side's top-2, which no "
              "tau excuses)."),
    PolicyKey("low_noise_multiple", 12.0, "see tie_noise_multiple"),
    PolicyKey("tie_floor", 0.02, "nats; see tie_noise_multiple"),
    PolicyKey("low_floor", 0.1, "nats; see tie_noise_multiple"),
)

#: every key: the core ones, then each check's own (speccheck/checks/), in check order
KEYS: dict[str, PolicyKey] = {k.name: k for k in (*CORE_KEYS, *policy_keys())}


def _with_overrides(self, overrides: dict[str, object], source: str):
    clean: dict[str, object] = {}
    for key, value in overrides.items():
        key = key.replace("-", "_")
        if key not in KEYS:
            raise PolicyError(f"{source}: unknown policy key {key!r}; known keys: {', '.join(KEYS)}.")
        clean[key] = _coerce(KEYS[key], value, source)
    policy = replace(self, **clean)
    for low, high in (("tie_floor", "low_floor"), ("tie_noise_multiple", "low_noise_multiple")):
        if getattr(policy, low) > getattr(policy, high):
            raise PolicyError(f"{source}: {low} ({getattr(policy, low)}) must not exceed {high} "
                              f"({getattr(policy, high)}): a near-tie is the narrower class.")
    return policy


#: the thresholds that turn measurements into pass/fail, one field per key (frozen)
Policy = make_dataclass(
    "Policy", [(k.name, type(k.default), field(default=k.default)) for k in KEYS.values()],
    frozen=True, namespace={"with_overrides": _with_overrides, "to_dict": lambda self: asdict(self),
                            "__module__": __name__})


def _coerce(spec: PolicyKey, value: object, source: str) -> object:
    """``value`` as the type of the key's default, in its range: a NaN or a negative threshold
    would quietly turn a check off, an int is not a bool, 2.5 is not a count."""
    key, default = spec.name, spec.default
    kind = type(default).__name__
    lo, hi = spec.lo, spec.hi
    where = f"{source}: policy key {key!r}"
    span = f"in [{lo:g}, {hi:g}]" if hi < math.inf else f">= {lo:g}"
    if isinstance(default, bool):
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        if isinstance(value, bool):
            return value
        raise PolicyError(f"{where} wants true or false, got {value!r}.")
    if isinstance(value, bool):
        raise PolicyError(f"{where} wants a {kind} {span}, got the boolean {value!r}.")
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise PolicyError(f"{where} wants a {kind} {span}, got {value!r}.") from None
    if not math.isfinite(number):
        raise PolicyError(f"{where} wants a finite {kind} {span}, got {value!r}.")
    if isinstance(default, int) and number != int(number):
        raise PolicyError(f"{where} wants a whole number >= {lo:g}, got {value!r}.")
    if not lo <= number <= hi:
        scale = " (a fraction: 0.98, not 98)" if hi == 1.0 else ""
        raise PolicyError(f"{where} must be {span}{scale}, got {value!r}.")
    return int(number) if isinstance(default, int) else number


def _read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise PolicyError(f"{path}: cannot read policy TOML ({e}); fix the file or pass another "
                          "with --policy.") from None


def load_policy(policy_file: str | None = None, overrides: dict[str, str] | None = None,
                cwd: Path | None = None) -> Policy:
    cwd = cwd or Path.cwd()
    policy = Policy()
    pyproject = cwd / "pyproject.toml"
    if pyproject.exists():
        section = _read_toml(pyproject).get("tool", {}).get("speccheck", {})
        policy = policy.with_overrides(section.get("policy", section) if isinstance(section, dict) else {},
                                       f"{pyproject} [tool.speccheck]")
    for path in ([cwd / "speccheck.toml"] if (cwd / "speccheck.toml").exists() else []) + \
            ([Path(policy_file)] if policy_file else []):
        if not path.exists():
            raise PolicyError(f"--policy {path}: no such file.")
        data = _read_toml(path)
        data = data.get("tool", {}).get("speccheck", data)
        policy = policy.with_overrides(data.get("policy", data), str(path))
    return policy.with_overrides(overrides or {}, "--set")
