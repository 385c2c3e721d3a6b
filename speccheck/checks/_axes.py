"""What every workload axis's check does: load the config's runs of that axis, require the
proof that each level was exercised, and compare each request with its reference (the same
prompt alone, the cold or unpressured level, the baseline's run of the same request),
classified by margin like any divergence."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from speccheck.axes import get as get_axis
from speccheck.checks import Context
from speccheck.checks._text import fmt_div, untrusted_tau
from speccheck.results import Check, ConfigResult
from speccheck.types import Completion, RunRecord, axis_slot, slot_label
from speccheck.verify import Divergence, find_divergences

#: a request's reference: (completion to compare with, or None: nothing to compare with)
Reference = Callable[[Context, RunRecord, Completion], Completion | None]


@dataclass
class AxisLevel:
    slot: str
    label: str
    requests: int = 0
    compared: int = 0
    exact: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    #: proof keys the level needed that read back absent or zero ("prefix_hits = 0")
    unproven: list[str] = field(default_factory=list)
    proof: dict = field(default_factory=dict)
    failed: str | None = None
    #: tokens/iteration of the compared requests and of their references (None: no counters)
    tpi: float | None = None
    ref_tpi: float | None = None
    #: an axis's own statistic over this level (e.g. kv_pressure: the preempted requests'
    #: acceptance against themselves unpressured), None where it has none
    preempted: object | None = None

    @property
    def high(self) -> list[Divergence]:
        return [d for d in self.divergences if d.cls == "high_confidence"]


def prompt_of(request_id: str) -> str:
    """The corpus prompt a request asks: request ids are ``<axis request>:<prompt id>``, the
    request part never holding a colon (a prompt id may: ``mt-bench:81``)."""
    return request_id.split(":", 1)[-1]


def measure_axis(ctx: Context, axis: str, reference: Reference) -> list[AxisLevel]:
    """Each level of ``axis`` the plan asked of this config (or that is stored)."""
    planned = ((ctx.suite.load_plan() or {}).get("configs", {}).get(ctx.config) or {}).get("axes", [])
    spec = get_axis(axis)
    slots = sorted({s for s in planned if s.startswith(f"axis-{axis}-")}
                   | {s for s in ctx.suite.axis_slots(ctx.config) if s.startswith(f"axis-{axis}-")})
    out = []
    for slot in slots:
        level = AxisLevel(slot, slot_label(slot))
        run = ctx.suite.load_axis(ctx.config, slot)
        if run is None:
            continue  # not stored: `ran` names it (planned but not stored)
        if run.status != "ok":
            level.failed = (run.error or "failed").splitlines()[0]
            out.append(level)
            continue
        level.proof = dict(run.proof)
        lv = slot.split("-", 2)[2]
        floors = spec.floors(lv) if spec.floors else {}
        level.unproven = [f"{k} = {run.proof.get(k, 'not read back')}"
                          + (f" < {floors[k]:g}" if k in floors else "") for k in spec.proofs.get(lv, ())
                          if not (isinstance(run.proof.get(k), (int, float)) and run.proof.get(k) > 0
                                  and run.proof.get(k) >= floors.get(k, 0))]
        level.requests = len(run.completions)
        counted = []  # (request's counters, reference's): acceptance must not move either
        for c in run.completions:
            ref = reference(ctx, run, c)
            if ref is None:
                continue
            if c.spec is not None and ref.spec is not None and c.token_ids.tolist() == ref.token_ids.tolist():
                counted.append((c.spec, ref.spec))
            n = min(ref.n_tokens, c.n_tokens)
            divs = find_divergences(c.prompt_id, ref.token_ids[:n], ref.topk_ids[:n], ref.topk_logprobs[:n],
                                    c.token_ids[:n], c.topk_ids[:n], c.topk_logprobs[:n], ctx.tau_tie,
                                    ctx.tau_low, ctx.noise, max_gap=ctx.tau_low)
            level.compared += 1
            level.exact += not divs
            level.divergences += divs[:1]  # the first: after it the contexts differ
        if counted:
            level.tpi = _tpi([a for a, _ in counted])
            level.ref_tpi = _tpi([b for _, b in counted])
        out.append(level)
    return out


def _tpi(counters) -> float:
    drafts = sum(c.drafts for c in counters)
    return 1 + sum(c.accepted_tokens for c in counters) / drafts if drafts else 1.0


def judge_axis(name: str, axis: str, r: ConfigResult, p, what: str) -> Check:
    """Fails on a level that did not run, did not prove itself, or changed a token beyond a
    near-tie; says what each level exercised."""
    levels: list[AxisLevel] = r.measured.get(name) or []
    if not levels:
        return Check(name, True, "not asked of this config (speccheck run --axes)", skipped=True)
    problems, lines = [], []
    for lv in levels:
        if lv.failed:
            problems.append(f"{lv.label} failed: {lv.failed}")
            continue
        if lv.unproven:
            problems.append(f"{lv.label} was not exercised: {', '.join(lv.unproven)} (the engine served "
                            f"it without doing what the axis is for; nothing it shows counts)")
        bad = [d for d in lv.high]
        if len(bad) > p.max_high_confidence:
            problems.append(f"{lv.label}: {len(bad)} request(s) {what} beyond a near-tie"
                            + "".join("\n    " + fmt_div(d) for d in bad[:5]))
        if lv.tpi is not None and lv.ref_tpi and abs(lv.tpi / lv.ref_tpi - 1) > p.max_acceptance_drop:
            problems.append(f"{lv.label}: acceptance {lv.tpi:.2f} tokens/iteration where the same outputs "
                            f"got {lv.ref_tpi:.2f} ({lv.tpi / lv.ref_tpi - 1:+.0%}, more than "
                            f"{p.max_acceptance_drop:.0%}): the regime moves the drafts (drafter state lost or "
                            "shared) even where the tokens hold")
        excused = len(lv.divergences) - len(bad)
        if r.noise_missing and excused:
            problems.append(f"{lv.label}: " + untrusted_tau(excused, r.noise_missing))
        proof = ", ".join(f"{k} {v}" for k, v in lv.proof.items() if not isinstance(v, list))
        lines.append(f"{lv.label}: " + (f"{lv.exact}/{lv.compared} requests exact" if lv.compared else
                                        f"{lv.requests} requests served (the reference the others are judged by)")
                     + (f", {lv.tpi:.2f} tokens/iteration (reference {lv.ref_tpi:.2f})" if lv.tpi is not None else "")
                     + (f", {len(lv.divergences)} near-tie/low-confidence" if lv.divergences and not bad else "")
                     + (f" ({proof})" if proof else ""))
    summary = "; ".join(lines)
    if problems:
        return Check(name, False, "; ".join(problems) + (f" ({summary})" if summary else ""))
    return Check(name, True, summary)


def slot_for(axis: str, level: str) -> str:
    return axis_slot(axis, level)
