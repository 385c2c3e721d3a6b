"""What a K buys: a speedup model of speculative decoding from stored timings and counters.

One run of a sweep on a shared machine is a coin toss between neighbouring Ks, so the
recommendation comes from a model, not from the fastest run:

- tokens per iteration τ(K) is measured (greedy counters repeat run to run); for a K that was
  not run it follows from a larger K's per-position acceptance: τ(K) = 1 + Σ_{i<K} P(the first
  i+1 draft tokens accepted) — exact for a drafter that writes the same tokens at positions < K
  whatever K is (MTP, drafting recursively), close for a block drafter whose block sees K masks;
- the cost of one target step at K, in one-token decode steps of the baseline measured in the
  same round, is a line in K (the verify forward grows with the K+1 tokens it checks, the
  drafter with the K tokens it writes); with the engine's drafting seconds it splits into
  verify(n tokens) and draft(K);
- speedup(K) = τ(K) / cost(K).

Every repeat of a sweep is a round (each config once, round-robin, so that every K meets the
same spells of load); a config's cost takes each request at its least disturbed round (other
load only ever adds time), and the uncertainty is how far the figures move when one round is
left out. Pure functions over numbers; the store is read elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np


@dataclass(frozen=True)
class RepeatTiming:
    """One run (repeat) of one config: per warm request (the first request of a run warms up
    and is left out, as in the warm tok/s) its tokens, steps and decode seconds; counters
    summed over them."""

    repeat: int
    prompts: tuple[str, ...]
    tokens: tuple[int, ...]  # generated after each request's first token (that one is the prefill's)
    iterations: tuple[int, ...]  # target steps that emitted them (baseline: one per token)
    seconds: tuple[float, ...]  # decode seconds on the model's clock (wall, or the engine's CPU seconds)
    drafts: int = 0  # steps that carried a draft
    draft_share: float | None = None  # the part of the seconds spent drafting (None: not measured)
    accepted_per_pos: tuple[int, ...] = ()

    @property
    def total_tokens(self) -> int:
        return int(sum(self.tokens))

    @property
    def total_iterations(self) -> int:
        return int(sum(self.iterations))


@dataclass(frozen=True)
class KRow:
    """One K of a method: measured and modelled figures, costs in one-token decode steps."""

    k: int
    tau: float  # measured tokens per iteration (median over rounds)
    cost: float  # seconds per target step / seconds per baseline decode step, least disturbed
    verify_cost: float | None  # the target's part of ``cost`` (None: no drafting seconds)
    draft_cost: float | None  # the drafter's seconds per drafting step, in decode steps
    measured: float  # τ / cost: the speedup over the baseline
    measured_spread: float  # half the range of the same with one round left out (0: one round)
    model: float  # τ / the cost line fitted on every K
    #: the larger of: half the range of the same with one round left out, and the standard
    #: error of the cost line at K (from the measured costs' scatter around it)
    model_spread: float
    conditional_acceptance: tuple[float, ...]  # P(position i accepted | positions < i accepted)
    predicted: float | None = None  # from the fit Ks only (None: K is one of them)
    error: float | None = None  # predicted / measured - 1

    @property
    def in_fit(self) -> bool:
        return self.predicted is None


@dataclass(frozen=True)
class SpeedupModel:
    """A method's K-sweep under the model, and the K it recommends."""

    method: str
    rounds: int
    rows: tuple[KRow, ...]
    cost_line: tuple[float, float]  # cost(K) = a + b·K, fitted on every K
    verify_line: tuple[float, float] | None  # verify(n) = a + b·n, n = K + 1 tokens verified
    draft_line: tuple[float, float] | None  # draft(K) = a + b·K per drafting step
    fit_ks: tuple[int, ...]  # the Ks the validation fit used (the rest validate it)
    holdout_line: tuple[float, float] | None  # cost line of the fit Ks alone
    recommended: int | None  # None: no eligible K is faster than the baseline
    runner_up: int | None
    within_noise: bool  # recommended and runner-up cannot be told apart
    #: the recommended K (or, with none, the fastest) cannot be told apart from the baseline
    baseline_within_noise: bool = False
    note: str = ""
    clock: str = "wall"  # which seconds the costs are in: "wall", or "cpu" (the engine's CPU seconds)

    def row(self, k: int) -> KRow:
        return next(r for r in self.rows if r.k == k)

    @property
    def max_error(self) -> float | None:
        errors = [abs(r.error) for r in self.rows if r.error is not None]
        return max(errors) if errors else None


# --- the pieces ----------------------------------------------------------------------------------

def acceptance_rates(accepted_per_pos: Sequence[int], drafts: int) -> np.ndarray:
    """P(draft token i accepted) per position: accepted there / drafts (a token is accepted only
    after every one before it, so these are the probabilities of accepting the first i+1)."""
    a = np.asarray(accepted_per_pos, dtype=np.float64)
    return a / drafts if drafts else np.zeros_like(a)


def conditional_acceptance(accepted_per_pos: Sequence[int], drafts: int) -> np.ndarray:
    """P(position i accepted | positions < i accepted); 0 after a position nothing reached."""
    a = np.asarray(accepted_per_pos, dtype=np.float64)
    before = np.concatenate([[float(drafts)], a[:-1]])
    return np.divide(a, before, out=np.zeros_like(a), where=before > 0)


def tau_at(accepted_per_pos: Sequence[int], drafts: int, k: int) -> float:
    """Tokens per iteration at ``k`` from a run at K ≥ k: 1 + Σ_{i<k} P(first i+1 accepted).
    Non-decreasing in k and at most k + 1."""
    if k > len(accepted_per_pos):
        raise ValueError(f"tau at K={k} needs acceptance at {k} positions, have {len(accepted_per_pos)}")
    return 1.0 + float(acceptance_rates(accepted_per_pos, drafts)[:k].sum())


def emitted_share(emitted_tau: float, counted_tau: float, ref: int, k: int) -> float:
    """Of the tokens the counters accept per iteration, the share a run at ``k`` emits, from a
    run at ``ref``: each request's last step is cut at its end (max_tokens, a stop), and what
    it loses there grows with K, so the share falls from 1 at K=0 to the one ``ref`` showed."""
    if not counted_tau or not ref:
        return 1.0
    return 1.0 - (1.0 - emitted_tau / counted_tau) * k / ref


def fit_line(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Least-squares (a, b) of y = a + b·x; needs two distinct x."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(np.unique(x)) < 2:
        raise ValueError(f"a line needs two distinct points, got x = {x.tolist()}")
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b)


def half_range(values: Sequence[float]) -> float:
    v = np.asarray(values, dtype=np.float64)
    return float((v.max() - v.min()) / 2) if len(v) else 0.0


def choose_fit_ks(ks: Sequence[int]) -> tuple[int, ...]:
    """The Ks the validation fit uses: smallest and largest (and the middle one from six Ks
    up), so that at least one K in between validates it; all of them when fewer than three."""
    ks = sorted(set(ks))
    if len(ks) < 3:
        return tuple(ks)
    if len(ks) < 6:
        return (ks[0], ks[-1])
    return (ks[0], ks[len(ks) // 2], ks[-1])


def _rounds(base: Sequence[RepeatTiming], per_k: Mapping[int, Sequence[RepeatTiming]]) -> list[int]:
    """Repeats that every K and the baseline ran (a round), with tokens and time to divide;
    none when some config made no request in every one of them."""
    def usable(ts):
        return {t.repeat for t in ts if t.total_tokens > 0 and t.total_iterations > 0 and sum(t.seconds) > 0}
    common = usable(base)
    for ts in per_k.values():
        common &= usable(ts)
    for ts in [base, *per_k.values()]:
        runs = [t for t in ts if t.repeat in common]
        if runs and not set(runs[0].prompts).intersection(*(t.prompts for t in runs[1:])):
            return []
    return sorted(common)


def least_disturbed_step(runs: Sequence[RepeatTiming]) -> float:
    """Seconds per step of one config over several runs: its least disturbed request, the
    minimum of seconds / steps over the requests that every run made. Other load on a shared
    machine only ever adds time, and it comes in spells of seconds to minutes that can cover
    a whole run, so the config's quietest request is the best estimate of its own cost (as
    timeit takes the minimum); requests differ less in their own cost per step (context
    length) than load changes it."""
    per = [{p: s / n for p, n, s in zip(t.prompts, t.iterations, t.seconds) if n > 0} for t in runs]
    common = sorted(set(per[0]).intersection(*per[1:]))
    if not common:
        raise ValueError("no request that every run made")
    return float(min(r[p] for r in per for p in common))


def line_standard_error(x: Sequence[float], y: Sequence[float], line: tuple[float, float]) -> np.ndarray:
    """Standard error of a least-squares line at each x, from the points' scatter around it
    (0 with two points: a line through two points has no scatter to tell)."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) < 3:
        return np.zeros_like(x)
    residual = y - (line[0] + line[1] * x)
    sigma = np.sqrt((residual ** 2).sum() / (len(x) - 2))
    return sigma * np.sqrt(1 / len(x) + (x - x.mean()) ** 2 / ((x - x.mean()) ** 2).sum())


def _estimate(base, per_k, ks, rounds, fit):
    """Costs (decode steps) per K from these rounds, the line through every K and through the
    fit Ks."""
    step = least_disturbed_step([base[r] for r in rounds])
    cost = {k: least_disturbed_step([per_k[k][r] for r in rounds]) / step for k in ks}
    line = fit_line(ks, [cost[k] for k in ks])
    holdout = fit_line(fit, [cost[k] for k in fit]) if 2 <= len(fit) < len(ks) else None
    return cost, line, holdout


# --- the model -----------------------------------------------------------------------------------

def speedup_model(method: str, base: Sequence[RepeatTiming], per_k: Mapping[int, Sequence[RepeatTiming]],
                  eligible: Sequence[int] | None = None,
                  fit_ks: Sequence[int] | None = None, clock: str = "wall") -> SpeedupModel | None:
    """The model of one method's sweep (None with fewer than two Ks, or no round that the
    baseline and every K ran). ``eligible``: the Ks that may be recommended (e.g. those that
    pass the gate; default all). ``fit_ks``: the Ks the validation fit uses (default
    :func:`choose_fit_ks`); the others are predicted from them and compared with what they
    measured. Spreads: the same figures with one round left out at a time."""
    ks = sorted(per_k)
    rounds = _rounds(base, per_k)
    if len(ks) < 2 or not rounds:
        return None
    fit = tuple(sorted(set(fit_ks))) if fit_ks is not None else choose_fit_ks(ks)
    if not set(fit) <= set(ks):
        raise ValueError(f"fit Ks {list(fit)} are not all among the measured Ks {ks}")
    by = {k: {t.repeat: t for t in per_k[k]} for k in ks}
    b = {t.repeat: t for t in base}
    runs = {k: [by[k][r] for r in rounds] for k in ks}

    tau = {k: sum(t.total_tokens for t in runs[k]) / sum(t.total_iterations for t in runs[k]) for k in ks}
    accepted = {k: np.sum([t.accepted_per_pos for t in runs[k]], axis=0) if runs[k][0].accepted_per_pos
                else np.zeros(k, dtype=np.int64) for k in ks}
    drafts = {k: sum(t.drafts for t in runs[k]) for k in ks}
    cost, cost_line, holdout = _estimate(b, by, ks, rounds, fit)
    # leave one round out: how much each figure hangs on a single round
    reps = [_estimate(b, by, ks, [r for r in rounds if r != left], fit) for left in rounds] if len(rounds) > 1 else []
    measured_reps = {k: np.array([tau[k] / c[k] for c, _, _ in reps]) for k in ks}
    model_reps = {k: np.array([tau[k] / (line[0] + line[1] * k) for _, line, _ in reps]) for k in ks}
    line_at = {k: cost_line[0] + cost_line[1] * k for k in ks}
    line_se = dict(zip(ks, line_standard_error(ks, [cost[k] for k in ks], cost_line)))

    timed = all(t.draft_share is not None and t.drafts > 0 for k in ks for t in runs[k])
    share = {k: float(np.median([t.draft_share for t in runs[k]])) if timed else None for k in ks}
    drafted = {k: drafts[k] / sum(t.total_iterations for t in runs[k]) for k in ks}

    rows = []
    for k in ks:
        predicted = error = None
        if holdout is not None and k not in fit:
            larger = [f for f in fit if f >= k and len(accepted[f]) >= k]
            if larger:  # τ from the nearest larger fit K's acceptance
                ref = larger[0]
                t = tau_at(accepted[ref], drafts[ref], k) * emitted_share(
                    tau[ref], tau_at(accepted[ref], drafts[ref], ref), ref, k)
                predicted = t / (holdout[0] + holdout[1] * k)
                error = predicted / (tau[k] / cost[k]) - 1
        rows.append(KRow(
            k=k, tau=tau[k], cost=cost[k],
            verify_cost=cost[k] * (1 - share[k]) if timed else None,
            draft_cost=cost[k] * share[k] / drafted[k] if timed else None,
            measured=tau[k] / cost[k], measured_spread=half_range(measured_reps[k]),
            model=tau[k] / line_at[k],
            model_spread=max(half_range(model_reps[k]), tau[k] / line_at[k] * float(line_se[k]) / line_at[k]),
            conditional_acceptance=tuple(float(q) for q in conditional_acceptance(accepted[k], drafts[k])),
            predicted=predicted, error=error))

    recommended, runner_up, within, near_base, note = recommend(rows, model_reps, eligible, len(rounds))
    return SpeedupModel(
        method=method, rounds=len(rounds), rows=tuple(rows), cost_line=cost_line,
        verify_line=fit_line([k + 1 for k in ks], [r.verify_cost for r in rows]) if timed else None,
        draft_line=fit_line(ks, [r.draft_cost for r in rows]) if timed else None,
        fit_ks=fit if holdout is not None else (), holdout_line=holdout,
        recommended=recommended, runner_up=runner_up, within_noise=within, note=note, clock=clock,
        baseline_within_noise=near_base)


def recommend(rows: Sequence[KRow], model_reps: Mapping[int, np.ndarray], eligible: Sequence[int] | None,
              rounds: int) -> tuple[int | None, int | None, bool, bool, str]:
    """(recommended K, runner-up, whether the two are within noise, whether the recommended
    K — or with none, the fastest — is within noise of the baseline, why none). A K is a
    candidate if it may be recommended and both its modelled and measured speedups beat the
    baseline: a K slower than no speculation is nobody's best; the runner-up is the next K
    faster than the baseline by the model. Two figures are within noise when one round alone
    cannot say, when leaving out one round (``model_reps``) changes which is faster, or when
    the gap is no larger than their spreads together."""
    def near_baseline(r: KRow) -> bool:
        per_round = model_reps[r.k]
        ties = np.isclose(per_round, 1.0, rtol=0, atol=1e-9)  # a tie, up to float rounding
        return rounds < 2 or bool(np.any((per_round <= 1.0) | ties) and np.any(per_round > 1.0)) \
            or abs(r.model - 1.0) <= r.model_spread

    allowed = set(r.k for r in rows) if eligible is None else set(eligible)
    faster = sorted((r for r in rows if r.k in allowed and r.model > 1.0), key=lambda r: (-r.model, r.k))
    tops = [r for r in faster if r.measured > 1.0]
    candidates = tops[:1] + [r for r in faster if tops and r.k != tops[0].k]
    if not candidates:
        pool = [r for r in rows if r.k in allowed] or list(rows)
        best = max(pool, key=lambda r: r.model)
        why = "no K is faster than the baseline" if allowed else "no K passes the gate"
        return None, None, False, near_baseline(best), (
            f"{why} (highest: K={best.k} at {best.model:.2f}x ± {best.model_spread:.2f} modelled, "
            f"{best.measured:.2f}x measured)")
    top = candidates[0]
    if len(candidates) == 1:
        return top.k, None, rounds < 2, near_baseline(top), ""
    second = candidates[1]
    gaps = model_reps[top.k] - model_reps[second.k]
    within = rounds < 2 or bool(np.any(gaps <= 0)) or top.model - second.model <= top.model_spread + second.model_spread
    return top.k, second.k, within, near_baseline(top), ""
