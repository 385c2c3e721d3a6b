"""acceptance_replayed: the engine's acceptance is what its drafter makes, replayed independently.

At temperature 0 every verify step's accepted count follows from the emitted tokens and the
drafter alone, so a plain, unbatched replay of the drafter over the run's own tokens (stored by
`speccheck run` where the engine can replay: Engine.replay_acceptance) predicts the counters
exactly -- no golden needed, on any corpus. A drafter-side bug lowers acceptance below the
replay; counters that count what was not accepted raise it above; both fail, prompt by prompt.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from speccheck.checks import CheckSpec, Context, PolicyKey
from speccheck.results import Check, ConfigResult
from speccheck.verify.acceptance_stats import compare_acceptance, minimum_detectable_drop

POLICY = (
    PolicyKey("replay_alpha", 0.01,
              "the paired test over prompts (tokens/iteration, Holm): acceptance that moved from the "
              "replay beyond chance fails even within max_acceptance_drop", hi=1.0),
    PolicyKey("replay_look_closer", 0.1,
              "a change from the replay of at least replay_min_change at replay_alpha < p < this is "
              "inconclusive: `speccheck run` escalates it to more prompts, and it fails if it stays so",
              hi=1.0),
    PolicyKey("replay_min_change", 0.02, "see replay_look_closer (relative, tokens/iteration)", hi=1.0),
    PolicyKey("replay_margin", 0.05,
              "nats: a prompt whose replayed counters differ from the engine's is named as off at a "
              "drafter near-tie where a step of the replay decided with a margin this small"),
)


@dataclass
class ReplayEvidence:
    prompts: int
    exact: int
    expected_tpi: float
    observed_tpi: float
    #: prompts whose counters differ with every step of the replay decided firmly
    unexplained: list[str] = field(default_factory=list)
    explained: list[str] = field(default_factory=list)
    p: float | None = None  # paired two-sided test over prompts (Holm), tokens/iteration
    detectable: float | None = None  # the relative change it detects with 80 % power


def _tpi(drafts: int, accepted: int) -> float:
    return 1 + accepted / drafts if drafts else 1.0


def measure(ctx: Context) -> ReplayEvidence | str | None:
    """None: no replay stored (the plan says whether one was due); a string: why none can be."""
    if not ctx.runs:
        return None
    replays = ctx.suite.load_replay(ctx.config, ctx.runs[0].repeat)
    if replays is None:
        want = ((ctx.suite.load_plan() or {}).get("configs", {}).get(ctx.config) or {}).get("replay")
        return None if want else "not replayable"
    expected, observed = {}, {}
    ev = ReplayEvidence(0, 0, 0.0, 0.0)
    for c in ctx.runs[0].completions:
        rp = replays.get(c.prompt_id)
        if c.spec is None or rp is None:
            continue
        want = rp.counters
        ev.prompts += 1
        expected[c.prompt_id] = (want.drafts, list(want.accepted_per_pos))
        observed[c.prompt_id] = (c.spec.drafts, list(c.spec.accepted_per_pos)[:len(want.accepted_per_pos)])
        same = (want.drafts == c.spec.drafts and want.accepted_tokens == c.spec.accepted_tokens
                and list(want.accepted_per_pos) == list(c.spec.accepted_per_pos))
        if same:
            ev.exact += 1
            continue
        line = (f"{c.prompt_id}: replayed {want.drafts} drafts / {want.accepted_tokens} accepted "
                f"({_tpi(want.drafts, want.accepted_tokens):.2f} tokens/iteration), engine "
                f"{c.spec.drafts} / {c.spec.accepted_tokens} ({_tpi(c.spec.drafts, c.spec.accepted_tokens):.2f})")
        weakest = float(min(rp.min_margins[rp.drafted], default=float("inf")))
        if weakest <= ctx.policy.replay_margin:
            ev.explained.append(line + f", a drafter near-tie at {weakest:.3f} nats")
        else:
            ev.unexplained.append(line + f", every step decided by >= {weakest:.3f} nats")
    if not ev.prompts:
        return ev
    ev.expected_tpi = _tpi(sum(d for d, _ in expected.values()), sum(sum(a) for _, a in expected.values()))
    # what the engine says it accepted (its per-position counts are judged by counters_consistent)
    spec = [c.spec for c in ctx.runs[0].completions if c.prompt_id in observed]
    ev.observed_tpi = _tpi(sum(x.drafts for x in spec), sum(x.accepted_tokens for x in spec))
    try:
        cmp = compare_acceptance(expected, observed, alpha=0.01, paired=True)
        ev.p = None if cmp.inconclusive else float(cmp.overall.p_holm)
        ev.detectable = float(minimum_detectable_drop(expected, observed, alpha=0.01, paired=True).relative)
    except ValueError:  # impossible counters: counters_consistent names them
        pass
    return ev


def judge(r: ConfigResult, p) -> Check:
    ev = r.measured.get("acceptance_replayed")
    if ev == "not replayable":
        return Check("acceptance_replayed", True, "the engine cannot replay its drafter: acceptance is "
                     "judged by its counters' consistency and against a golden only", skipped=True)
    if ev is None:
        return Check("acceptance_replayed", False, "evidence missing: no acceptance replay of this "
                     "config is stored; `speccheck run` again into the same --store makes it")
    if not ev.prompts:
        return Check("acceptance_replayed", False, "evidence missing: no prompt with spec counters "
                     "and a replay to compare")
    head = (f"replayed drafter {ev.expected_tpi:.2f} tokens/iteration, engine {ev.observed_tpi:.2f}; "
            f"{ev.exact}/{ev.prompts} prompts exact"
            + (f", {len(ev.explained)} off at drafter near-ties" if ev.explained else "")
            + (f" (paired over prompts: p {ev.p:.2g}" if ev.p is not None else "")
            + (f", detects a {ev.detectable:.1%} change)" if ev.p is not None and ev.detectable is not None
               else (")" if ev.p is not None else "")))
    change = ev.observed_tpi / ev.expected_tpi - 1 if ev.expected_tpi else 0.0
    way = "below" if change < 0 else "above"
    why = "a drafter-side bug" if change < 0 else "counted or accepted past a real verify"
    problems = []
    if abs(change) > p.max_acceptance_drop:
        problems.append(f"tokens/iteration {change:+.1%} from the replay, more than max_acceptance_drop "
                        f"{p.max_acceptance_drop:.0%}: accepted {way} what the drafter makes ({why})")
    elif ev.p is not None and ev.p <= p.replay_alpha:
        problems.append(f"acceptance {way} the replay on the prompts as a whole ({change:+.1%}, paired "
                        f"Holm p {ev.p:.2g} <= {p.replay_alpha:g}): {why}")
    # a prompt off with every step firmly decided is shown; alone it is not a verdict (the replay's
    # drafter sees prefill-path hidden states, the engine's verify-path ones)
    odd = ("".join("\n    " + x for x in ev.unexplained[:5])
           + (f"\n    ... and {len(ev.unexplained) - 5} more" if len(ev.unexplained) > 5 else ""))
    if problems:
        return Check("acceptance_replayed", False, "; ".join(problems) + f" ({head})" + odd)
    if (ev.p is not None and abs(change) >= p.replay_min_change
            and p.replay_alpha < ev.p < max(p.replay_look_closer, p.replay_alpha)):
        return Check("acceptance_replayed", False,
                     f"inconclusive: tokens/iteration {change:+.1%} from the replay at paired Holm p "
                     f"{ev.p:.2g}, between alpha {p.replay_alpha:g} and look-closer "
                     f"{p.replay_look_closer:g} ({head})" + odd, inconclusive=True)
    return Check("acceptance_replayed", True, head + (f"; {len(ev.unexplained)} prompt(s) off with every "
                                                      "step decided firmly, within chance" if ev.unexplained
                                                      else "") + odd)


CHECK = CheckSpec(
    sampled="greedy-only",
    name="acceptance_replayed", label="replayed", order=115, judge=judge, measure=measure, policy=POLICY,
    guards="acceptance-only bugs on any corpus, no golden needed: MTP fed the wrong hidden states "
           "(vLLM #36531), DFlash features from the wrong layer (#42704), a fall after an upgrade "
           "(syv-ai #73); and acceptance too high (rMLX #436: drafts accepted without a real verify)",
    description="Each prompt's spec counters equal what an independent replay of the drafter over "
                "the run's own tokens predicts (up to drafter near-ties), so acceptance neither fell "
                "nor rose against what the drafter makes.")
