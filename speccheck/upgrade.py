"""An engine upgrade as the gated change: two suites of the same corpus and configs, run before
and after (e.g. vLLM 0.26 and 0.28 on the same checkpoint and machine), judged per config on
outputs (each divergence classified as for spec vs baseline: only near-ties may pass),
acceptance per draft position (two-sided, statistical, prompts paired), speed, and every
workload axis the old suite ran (its outputs, and its exercise proof still showing it)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from speccheck.compare import Comparison, SuiteComparison, compare_runs, compare_suites
from speccheck.evaluate import speed_of
from speccheck.store import Suite
from speccheck.types import SpecConfig
from speccheck.verify.acceptance_stats import AcceptanceComparison, compare_acceptance

#: a config whose warm tok/s (or, across devices, speedup over its own suite's baseline) falls by
#: more than this share fails the upgrade
MAX_SLOWDOWN = 0.10


def per_prompt_counters(suite: Suite, config: str) -> dict[str, object]:
    """{prompt id: spec counters} of a config's first run (the unit acceptance_stats samples)."""
    return {c.prompt_id: c.spec for c in suite.load_run(config, 0).completions if c.spec is not None}


def same_counters(a: dict, b: dict) -> bool:
    """The same prompts with the same drafts and accepted counts per position on both sides."""
    def key(c) -> tuple:
        return int(c.drafts), tuple(int(x) for x in c.accepted_per_pos)
    return a.keys() == b.keys() and all(key(a[p]) == key(b[p]) for p in a)


@dataclass
class Speed:
    """Warm decode tok/s (medians over every stored repeat) and, for a spec config, its speedup
    over its own suite's baseline."""

    old: float | None
    new: float | None
    speedup_old: float | None = None
    speedup_new: float | None = None

    @property
    def change(self) -> float | None:
        return self.new / self.old - 1.0 if self.old and self.new else None

    @property
    def speedup_change(self) -> float | None:
        return self.speedup_new / self.speedup_old - 1.0 if self.speedup_old and self.speedup_new else None


@dataclass
class ConfigUpgrade:
    config: str
    outputs: Comparison
    attribution: list[dict]
    acceptance: AcceptanceComparison | None
    speed: Speed
    problems: list[str] = field(default_factory=list)
    #: every prompt's spec counters equal on both sides (the exact version of "unchanged")
    acceptance_identical: bool = False

    @property
    def passed(self) -> bool:
        return not self.problems


@dataclass
class AxisUpgrade:
    config: str
    slot: str
    outputs: Comparison | None
    problems: list[str] = field(default_factory=list)


@dataclass
class Upgrade:
    old: str
    new: str
    old_version: str | None
    new_version: str | None
    suites: SuiteComparison
    configs: dict[str, ConfigUpgrade]
    axes: list[AxisUpgrade]
    missing: list[str]

    @property
    def problems(self) -> list[str]:
        out = [f"{m}: in the old suite, not complete in the new one" for m in self.missing]
        out += [f"{c.config}: {p}" for c in self.configs.values() for p in c.problems]
        out += [f"{a.config} {a.slot}: {p}" for a in self.axes for p in a.problems]
        return out

    @property
    def passed(self) -> bool:
        return not self.problems


def _acceptance_problems(acc: AcceptanceComparison) -> list[str]:
    if acc.inconclusive:
        return [f"acceptance inconclusive ({acc.reason}): run more prompts before the upgrade may pass"]
    out = []
    for d in (acc.overall, *acc.per_pos):
        if d.direction in ("fell", "rose"):
            out.append(f"acceptance {d.direction} at {d.name}: {d.expected:.3f} -> {d.observed:.3f} "
                       f"({d.relative:+.1%}, Holm p {d.p_holm:.2g} <= alpha {acc.alpha:g}, "
                       f"{acc.prompts[0]} prompts paired)")
    return out


def _speed(old: Suite, new: Suite, config: str, base_old: float | None, base_new: float | None) -> Speed:
    so = speed_of(list(old.records(config)))[0]
    sn = speed_of(list(new.records(config)))[0]
    s = Speed(so, sn)
    if not SpecConfig.from_name(config).is_baseline and base_old and base_new and so and sn:
        s.speedup_old, s.speedup_new = so / base_old, sn / base_new
    return s


def _axis(old: Suite, new: Suite, config: str, slot: str, tau_tie: float, tau_low: float,
          noise: float, detok=None) -> AxisUpgrade:
    a = AxisUpgrade(config, slot, None)
    ro, rn = old.load_axis(config, slot), new.load_axis(config, slot)
    if rn is None or rn.status != "ok":
        a.problems.append("the old suite ran this workload axis; the new one holds no complete run of it")
        return a
    if ro is None or ro.status != "ok":
        return a
    a.outputs = compare_runs(ro, rn, tau_tie, tau_low, noise, detok)
    if a.outputs.high:
        a.problems.append(f"{len(a.outputs.high)} high-confidence divergence(s) between the versions")
    for key, was in sorted((ro.proof or {}).items()):
        now = (rn.proof or {}).get(key)
        if isinstance(was, (int, float)) and not isinstance(was, bool) and was > 0 and \
                not (isinstance(now, (int, float)) and now > 0):
            a.problems.append(f"proof {key}: {was} in the old suite, {now} in the new one (the axis "
                              "was not exercised the same way)")
    return a


def upgrade_suites(old: Suite, new: Suite, configs: Sequence[str], policy, detok=None,
                   alpha: float | None = None, max_slowdown: float = MAX_SLOWDOWN) -> Upgrade:
    """Judge ``new`` against ``old`` for every config of ``configs`` the old suite holds."""
    alpha = policy.acceptance_alpha if alpha is None else alpha
    both = [c for c in configs if new.is_complete(c, 0)]
    missing = [c for c in configs if c not in both]
    suites = compare_suites(old, new, both, policy, detok)
    ident_old = old.run_identity(both[0], 0) if both else {}
    ident_new = new.run_identity(both[0], 0) if both else {}
    same_device = ident_old.get("device") == ident_new.get("device")
    base_old = speed_of(list(old.records("baseline")))[0] if "baseline" in both else None
    base_new = speed_of(list(new.records("baseline")))[0] if "baseline" in both else None
    out = Upgrade(old.id, new.id, ident_old.get("version"), ident_new.get("version"), suites, {}, [], missing)
    for name in both:
        cmp = suites.configs[name]
        cu = ConfigUpgrade(name, cmp, suites.attribution[name], None,
                           _speed(old, new, name, base_old, base_new))
        if cmp.high:
            cu.problems.append(f"{len(cmp.high)} high-confidence divergence(s) between the versions "
                               f"(first at {cmp.high[0].prompt_id} position {cmp.high[0].position})")
        if not SpecConfig.from_name(name).is_baseline:
            co, cn = per_prompt_counters(old, name), per_prompt_counters(new, name)
            if not co or not cn:
                cu.problems.append("no per-prompt spec counters in "
                                   + " and ".join(s for s, c in (("the old suite", co), ("the new suite", cn)) if not c))
            else:
                cu.acceptance = compare_acceptance(co, cn, alpha=alpha, paired=True)
                cu.acceptance_identical = same_counters(co, cn)
                if not cu.acceptance_identical:  # identical counts need no test, however few
                    cu.problems += _acceptance_problems(cu.acceptance)
        sp = cu.speed
        if same_device and sp.change is not None and sp.change < -max_slowdown:
            cu.problems.append(f"warm decode {sp.old:.1f} -> {sp.new:.1f} tok/s ({sp.change:+.1%}, more "
                               f"than {max_slowdown:.0%} slower)")
        if sp.speedup_change is not None and sp.speedup_change < -max_slowdown:
            cu.problems.append(f"speedup over its baseline {sp.speedup_old:.2f}x -> {sp.speedup_new:.2f}x "
                               f"({sp.speedup_change:+.1%}, more than {max_slowdown:.0%} lower)")
        out.configs[name] = cu
        for slot in old.axis_slots(name):
            out.axes.append(_axis(old, new, name, slot, suites.tau_tie, suites.tau_low, suites.noise, detok))
    return out


def upgrade_lines(u: Upgrade) -> list[str]:
    """The upgrade's report, one line per config and axis, then the verdict."""
    head = f"upgrade {u.old_version or '?'} ({u.old}) -> {u.new_version or '?'} ({u.new})"
    lines = [head, f"  path noise {u.suites.noise:.4f} nats, tau_tie {u.suites.tau_tie:.3f}, "
                   f"tau_low {u.suites.tau_low:.3f}"]
    for name, c in u.configs.items():
        o = c.outputs
        counts = {k: sum(d.cls == k for d in o.divergences)
                  for k in ("near_tie", "low_confidence", "high_confidence")}
        s = c.speed
        speed = (f"{s.old:.1f} -> {s.new:.1f} tok/s" if s.old and s.new else "speed n/a")
        if s.speedup_old and s.speedup_new:
            speed += f", speedup {s.speedup_old:.2f}x -> {s.speedup_new:.2f}x"
        acc = ""
        if c.acceptance is not None and (c.acceptance_identical or not c.acceptance.inconclusive):
            a = c.acceptance.overall
            said = "identical per prompt" if c.acceptance_identical else a.direction
            acc = f", tokens/iteration {a.expected:.3f} -> {a.observed:.3f} ({said})"
        lines.append(f"{'PASS' if c.passed else 'FAIL'}  {name}: {o.exact}/{o.prompts} exact, near_tie "
                     f"{counts['near_tie']}, low_confidence {counts['low_confidence']}, high_confidence "
                     f"{counts['high_confidence']}{acc}; {speed}")
        lines += [f"      {p}" for p in c.problems]
    for a in u.axes:
        lines.append(f"{'PASS' if not a.problems else 'FAIL'}  {a.config} {a.slot}"
                     + (f": {a.outputs.exact}/{a.outputs.prompts} exact" if a.outputs else ""))
        lines += [f"      {p}" for p in a.problems]
    lines += [f"MISSING  {m}" for m in u.missing]
    lines.append(f"upgrade: {'PASS' if u.passed else 'FAIL'} ({len(u.problems)} problem(s))")
    return lines
