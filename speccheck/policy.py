"""The policy: thresholds that turn measurements into pass/fail. Each check declares its own
keys and defaults (speccheck/checks/); the few every comparison shares live here.
`[tool.speccheck]` in pyproject.toml, a `speccheck.toml`, `--policy FILE` and `--set key=value`
override them, in that order."""
from __future__ import annotations

import math
import os
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
    PolicyKey("escalation_budget", 3,
              "an inconclusive statistical check (an effect beyond its limit at a p between its "
              "alpha and its look-closer threshold) is judged again on more prompts: `speccheck "
              "run` continues every prompt of the corpus by its own baseline output and generates "
              "this many times its max_tokens, for the inconclusive configs and the baseline only, "
              "into a linked suite of the same store; one that stays inconclusive there fails "
              "(0: never escalate, an inconclusive fails; at most 64: the continued prompts must "
              "still fit the model)", hi=64),
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
    for alpha, look in LOOK_CLOSER:
        if getattr(policy, look) < getattr(policy, alpha):
            raise PolicyError(
                f"{source}: {look} ({getattr(policy, look):g}) is below {alpha} "
                f"({getattr(policy, alpha):g}): an effect at alpha <= p < {look} is inconclusive "
                f"and is judged again on more prompts. Set {look} = {getattr(policy, alpha):g} for "
                "no inconclusive band (then every p >= alpha passes), or above it.")
    return policy


#: (alpha, look-closer) pairs: the inconclusive band alpha <= p < look-closer must not be negative
LOOK_CLOSER = (("agreement_alpha", "agreement_look_closer"), ("replay_alpha", "replay_look_closer"),
               ("topk_drift_alpha", "topk_drift_look_closer"),
               ("logprob_drift_alpha", "logprob_drift_look_closer"))


#: the thresholds that turn measurements into pass/fail, one field per key (frozen); a key
#: that may be off holds False or its number
Policy = make_dataclass(
    "Policy", [(k.name, object if k.optional else type(k.default), field(default=k.default))
               for k in KEYS.values()],
    frozen=True, namespace={"with_overrides": _with_overrides, "to_dict": lambda self: asdict(self),
                            "__module__": __name__})


def _coerce(spec: PolicyKey, value: object, source: str) -> object:
    """``value`` as the type of the key's default, in its range: a NaN or a negative threshold
    would quietly turn a check off, an int is not a bool, 2.5 is not a count."""
    key, default = spec.name, spec.default
    kind = "number" if spec.optional else type(default).__name__
    lo, hi = spec.lo, spec.hi
    where = f"{source}: policy key {key!r}"
    opening = "(" if spec.above else "["
    span = (f"in {opening}{lo:g}, {hi:g}]" if hi < math.inf else f"{'>' if spec.above else '>='} {lo:g}")
    if spec.optional:
        # off (report only) is said in words; a zero is a number, and no floor is 0
        if value is False or (isinstance(value, str) and value.strip().lower() in ("false", "off", "no")):
            return False
        if value is True or (isinstance(value, str) and value.strip().lower() in ("true", "on", "yes")):
            raise PolicyError(f"{where} is a threshold: give a number {span}, or false (off: report "
                              f"only); got {value!r}.")
    elif isinstance(default, bool):
        # a check is turned off by an explicit false/off, never by a 0 (a number is a threshold)
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "yes", "no", "on", "off"):
            return value.strip().lower() in ("true", "yes", "on")
        if isinstance(value, bool):
            return value
        raise PolicyError(f"{where} wants true or false (on/off), got {value!r}; a check is turned "
                          "off with an explicit false, never with 0.")
    if isinstance(value, bool):
        raise PolicyError(f"{where} wants a {kind} {span}, got the boolean {value!r}.")
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        off = " or false (report only)" if spec.optional else ""
        raise PolicyError(f"{where} wants a {kind} {span}{off}, got {value!r}.") from None
    if not math.isfinite(number):
        raise PolicyError(f"{where} wants a finite {kind} {span}, got {value!r}.")
    whole = isinstance(default, int) and not isinstance(default, bool)
    if whole and number != int(number):
        raise PolicyError(f"{where} wants a whole number >= {lo:g}, got {value!r}.")
    if spec.above and number == lo:
        vacuous = ("a floor of 0 is met by every config, so it would check nothing"
                   if key.startswith("min_") else "a limit of 0 is exceeded by every config")
        off = (f"; to report it without gating write {key} = false (on the command line "
               f"--set {key}=off)" if spec.optional else "")
        raise PolicyError(f"{where} must be {span}, got {value!r}: {vacuous}{off}.")
    if not lo <= number <= hi:
        scale = " (a fraction: 0.98, not 98)" if hi == 1.0 else ""
        raise PolicyError(f"{where} must be {span}{scale}, got {value!r}.")
    if key.endswith("_alpha") and number <= 0:
        raise PolicyError(f"{where} is a significance level: it must be above 0{f' (at most {hi:g})' if hi < math.inf else ''}, got "
                          f"{value!r}; at 0 no p-value is ever below it, which would turn the test off "
                          "without saying so. Use a small alpha (e.g. 1e-6) for a stricter test, or "
                          "the check's own floor or require_* switch to change what fails.")
    return int(number) if whole else number


def _read_toml(path: Path) -> dict:
    try:
        if not path.is_file():
            what = ("a symlink to nothing readable (dangling or a loop)" if path.is_symlink()
                    else "not a regular file")
            raise PolicyError(f"{path}: is {what}; fix it, or pass a policy TOML file with --policy.")
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError) as e:
        raise PolicyError(f"{path}: cannot read policy TOML ({e}); fix the file or pass another "
                          "with --policy.") from None


def _table(data: object, where: str, path: Path) -> dict:
    """The policy keys of one source: ``[policy]`` (or ``[tool.speccheck.policy]``) or the
    table itself, never both; anything that is not a table is named, not skipped."""
    if not isinstance(data, dict):
        raise PolicyError(f"{path}: {where} is {data!r:.60}, not a table of policy keys; "
                          "write it as a TOML table, e.g. [tool.speccheck] then min_token_agreement = 0.98.")
    if "policy" not in data:
        return data
    if not isinstance(data["policy"], dict):
        raise PolicyError(f"{path}: {where}.policy is {data['policy']!r:.60}, not a table of "
                          "policy keys; write it as [policy] (or [tool.speccheck.policy]) with key = value lines.")
    others = [k for k in data if k != "policy"]
    if others:
        raise PolicyError(f"{path}: {where} has both a policy table and keys beside it "
                          f"({', '.join(map(repr, others))}); put every key in one of them.")
    return data["policy"]


def _section(data: dict, path: Path, pyproject: bool) -> dict:
    """``[tool.speccheck]`` of a TOML file (a pyproject.toml must hold it there; a policy file
    may, or hold its keys at the top)."""
    tool = data.get("tool")
    if tool is None:
        return {} if pyproject else _table(data, "the file", path)
    if not isinstance(tool, dict):
        raise PolicyError(f"{path}: 'tool' is {tool!r:.60}, not a table (TOML's [tool.*] "
                          "tables); fix the file.")
    if "speccheck" not in tool:
        if pyproject:
            return {}
        rest = {k: v for k, v in data.items() if k != "tool"}
        return _table(rest, "the file", path)
    return _table(tool["speccheck"], "[tool.speccheck]", path)


def load_policy(policy_file: str | None = None, overrides: dict[str, str] | None = None,
                cwd: Path | None = None) -> Policy:
    cwd = cwd or Path.cwd()
    policy = Policy()
    if policy_file is not None and not str(policy_file).strip():
        raise PolicyError("--policy '': give the path of a policy TOML file (or leave the option out).")
    pyproject = cwd / "pyproject.toml"
    # lexists: a dangling or looping link where the policy belongs is said, not read as no policy
    if os.path.lexists(pyproject):
        policy = policy.with_overrides(_section(_read_toml(pyproject), pyproject, True),
                                       f"{pyproject} [tool.speccheck]")
    for path in ([cwd / "speccheck.toml"] if os.path.lexists(cwd / "speccheck.toml") else []) + \
            ([Path(policy_file)] if policy_file else []):
        if not os.path.lexists(path):
            raise PolicyError(f"--policy {path}: no such file.")
        policy = policy.with_overrides(_section(_read_toml(path), path, False), str(path))
    return policy.with_overrides(overrides or {}, "--set")
