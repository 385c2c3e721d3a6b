"""The check registry: one module per check, each declaring what it guards and needs.

A check module in this package defines ``CHECK = CheckSpec(...)``: its name, the bug class it
guards, one description, the evidence it needs, its policy keys, and the function that judges
a config's measured figures. Everything that shows checks -- diff, the Markdown and HTML
reports, the gate, JUnit, golden, the pytest plugin and selftest -- iterates :func:`registry`,
so a new check is one new file here (plus its tests). Checks from other distributions register
through the ``speccheck.checks`` entry point group, the same way.
"""
from __future__ import annotations

import importlib
import math
import pkgutil
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import entry_points
from typing import Any, Callable, Sequence

from speccheck.results import Check, ConfigResult
from speccheck.store import Suite
from speccheck.types import RunRecord


@dataclass(frozen=True)
class PolicyKey:
    """One threshold of the policy: its default, what it means, and the range it accepts
    (inclusive; shares are fractions, not percent). ``above``: the lower end is excluded (a
    floor of 0 would be met by every config, a ratio of 0 by none). ``optional``: the key may
    be turned off (report only) by an explicit ``false``/``"off"``, its default being off or a
    number; a zero is never read as off."""

    name: str
    default: bool | int | float
    doc: str
    lo: float = 0.0
    hi: float = math.inf
    above: bool = False
    optional: bool = False

    def is_off(self, value: object) -> bool:
        return self.optional and value is False


@dataclass(frozen=True)
class Evidence:
    """Something a check cannot judge without. Missing evidence fails the check the same way
    everywhere: ``evidence missing: <what, and how to get it>`` -- never a pass."""

    name: str
    present: Callable[[ConfigResult], bool]
    missing: Callable[[ConfigResult], str]
    #: the judge cannot run without it; otherwise it still judges what is there (a definite
    #: failure found in part of the evidence is shown beside what is missing)
    blocking: bool = False


@dataclass(frozen=True)
class Context:
    """What a check's own ``measure`` hook may read: the suite, the config's runs and the
    baseline's, and the thresholds calibrated on the engine's path noise."""

    suite: Suite
    config: str
    policy: Any
    runs: Sequence[RunRecord]  # this config's complete runs, in repeat order
    baseline_runs: Sequence[RunRecord]
    tau_tie: float
    tau_low: float
    noise: float
    detok: Callable | None = None
    #: this config's acceptance as the golden recorded it (tokens_per_iter, per_pos, per_prompt)
    golden_acceptance: dict | None = None


@dataclass(frozen=True)
class CheckSpec:
    name: str
    #: the row label in ``speccheck diff`` ("": a line under the row before; None: no row)
    label: str | None
    #: the bug class it guards (public reports where there are some)
    guards: str
    #: what passing means, in one sentence: the text every renderer shows
    description: str
    judge: Callable[[ConfigResult, Any], Check]
    #: place in every listing (checks are shown and judged in this order)
    order: int
    #: judged for the baseline too (most checks compare a spec config with the baseline)
    baseline: bool = False
    needs: tuple[Evidence, ...] = ()
    policy: tuple[PolicyKey, ...] = ()
    #: figures the check measures for itself from the store, kept in ``ConfigResult.measured``
    measure: Callable[[Context], object] | None = None
    #: the diff row (default: the check's message)
    row: Callable[[ConfigResult, Check], str] | None = None
    #: judged only for configs of these methods (empty: every method)
    methods: tuple[str, ...] = ()
    #: in a sampled suite (temperature > 0): "judged" as in a greedy one, "greedy-only" (it
    #: assumes argmax decoding: shown as not exercised, never as a pass) or "reported"
    #: (judged and shown, not gated)
    sampled: str = "judged"

    def applies_to(self, config: str) -> bool:
        if self.methods:
            return config.split("-k")[0] in self.methods
        return self.baseline or config != "baseline"

    def run(self, result: ConfigResult, policy) -> Check:
        """The verdict on one config: missing evidence fails uniformly, else the judge decides."""
        sampling = getattr(result, "sampling", None)
        if sampling and self.sampled == "greedy-only":
            return Check(self.name, True, f"not exercised: a sampled suite (temperature "
                         f"{sampling['temperature']:g}); this check assumes argmax decoding",
                         skipped=True)
        check = self._run(result, policy)
        if sampling and self.sampled == "reported":
            check.skipped = True
            check.message += " (reported, not gated at temperature > 0)"
        return check

    def _run(self, result: ConfigResult, policy) -> Check:
        absent = [e for e in self.needs if not e.present(result)]
        if not absent:
            return self.judge(result, policy)
        missing = "evidence missing: " + "; ".join(e.missing(result) for e in absent)
        if any(e.blocking for e in absent):
            return Check(self.name, False, missing)
        partial = self.judge(result, policy)
        return Check(self.name, False, f"{missing}; {partial.message}")

    def diff_row(self, result: ConfigResult, check: Check) -> str:
        if self.row is not None and not check.message.startswith(("evidence missing",
                                                                   "not exercised")):
            return self.row(result, check)
        return check.message


class RegistryError(RuntimeError):
    """Two checks of one name, or a check module without a CHECK."""


@lru_cache(maxsize=None)
def registry() -> tuple[CheckSpec, ...]:
    """Every check, in judging order: the modules of this package, then entry-point checks."""
    import speccheck.checks as package

    specs: list[CheckSpec] = []
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        spec = getattr(module, "CHECK", None)
        if not isinstance(spec, CheckSpec):
            raise RegistryError(f"speccheck/checks/{info.name}.py defines no CHECK = CheckSpec(...)")
        specs.append(spec)
    for ep in entry_points(group="speccheck.checks"):
        spec = ep.load()
        if not isinstance(spec, CheckSpec):
            raise RegistryError(f"entry point {ep.name} ({ep.value}) is not a CheckSpec")
        specs.append(spec)
    names = [s.name for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise RegistryError(f"checks registered twice: {', '.join(twice)}")
    return tuple(sorted(specs, key=lambda s: (s.order, s.name)))


def get(name: str) -> CheckSpec:
    for spec in registry():
        if spec.name == name:
            return spec
    raise KeyError(f"no check named {name!r}; the checks: {', '.join(s.name for s in registry())}")


def names(config: str | None = None) -> list[str]:
    """The check names in order (those that apply to ``config`` when given)."""
    return [s.name for s in registry() if config is None or s.applies_to(config)]


def policy_keys() -> tuple[PolicyKey, ...]:
    """Every check's policy keys, in check order."""
    return tuple(k for s in registry() for k in s.policy)


def measure_all(ctx: Context) -> dict[str, object]:
    """The figures every applicable check with a ``measure`` hook takes from the store."""
    return {s.name: s.measure(ctx) for s in registry()
            if s.measure is not None and s.applies_to(ctx.config)}


def first_line(result: ConfigResult, check: Check) -> str:
    """A diff row that shows only the head of a long message (the report has the rest)."""
    return check.message.splitlines()[0] if check.message else ""


def judge_all(result: ConfigResult, policy) -> list[Check]:
    """Every applicable check's verdict on one config, in order."""
    return [s.run(result, policy) for s in registry() if s.applies_to(result.config)]
