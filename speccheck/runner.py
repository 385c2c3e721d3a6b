"""What the plan's cells compute, whichever executor runs them (speccheck/executors/): the
runs of a config (corpus × matrix × repeats), workload-axis runs, and what verify/ needs from an
engine after them: teacher-forced rescoring of every config's output by the (non-speculative)
engine, the acceptance each spec config's output should have had, replayed by the engine's own
independent drafter pass (where it has one), and kernel-path attribution of each first
divergence (re-scoring the divergent prefix under the engine's alternative kernel knobs). All
are stored next to the runs, so diff/gate/report never need an engine; what is already stored
is skipped (runs_to_do), so a run resumes.
"""
from __future__ import annotations

import fnmatch

import json
import time
import traceback
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence

import numpy as np

from speccheck.version import __version__
from speccheck.corpus import Corpus
from speccheck.engines import Engine, EngineError, EngineUsageError, make_engine
from speccheck.engines.base import ScoringUnavailable
from speccheck.axes import AxisInput
from speccheck.axes import get as get_axis
from speccheck.plan import RunPlan, plan_suite_id
from speccheck.store import Store, StoreError, Suite
from speccheck.types import TOGETHER, RunRecord, SpecConfig, Workload, WorkloadResult
from speccheck.verify import first_divergence


Log = Callable[[str], None]


def _print(msg: str) -> None:
    print(msg, flush=True)


def open_suite(plan: RunPlan, store: Store, corpus: Corpus) -> Suite:
    return store.suite(plan_suite_id(plan, corpus), plan.suite_meta(corpus))


def weights_fingerprint(identity: dict) -> tuple:
    """What makes a stored run stale when it changes: the weights and tokenizer it ran with."""
    return tuple(identity.get(k) for k in ("model_hash", "draft_hash", "tokenizer_hash"))


def tokenized_inputs(suite: Suite, engine: Engine, corpus: Corpus) -> dict[str, np.ndarray]:
    """Prompts are tokenised once per suite and stored, so every config sees identical input."""
    try:
        inputs = suite.load_inputs()
    except StoreError:  # damaged: tokenise again
        inputs = None
    if inputs is None or set(inputs) != {p.id for p in corpus.prompts}:
        suite.write_inputs({p.id: engine.tokenize(p) for p in corpus.prompts})
        inputs = suite.load_inputs()
    assert inputs is not None
    return inputs


def check_context(engine: Engine, corpus: Corpus) -> None:
    """Every prompt plus its max_tokens must fit the model's positions, checked before any run
    (an 8192-position model given a 20k-token prompt would otherwise run for many minutes)."""
    limit = engine.max_positions()
    if not limit:
        return
    for p in corpus.prompts:
        n = len(engine.tokenize(p))
        if n + p.max_tokens > limit:
            raise EngineUsageError(
                f"{corpus.path}: prompt {p.id!r} is {n} tokens + max_tokens {p.max_tokens} = "
                f"{n + p.max_tokens} positions, more than the {limit} the model holds; "
                + (f"shorten the prompt or lower its max_tokens to at most {limit - n}." if n < limit else
                   f"the prompt alone does not fit: shorten it to under {limit} tokens."))


def run_one(engine: Engine, suite: Suite, corpus: Corpus, inputs: dict[str, np.ndarray],
            config: SpecConfig, repeat: int, top_k: int, fresh_process: bool,
            copies: int = 0) -> RunRecord:
    """Generate the whole corpus under one config and store it; an engine failure is stored
    as a failed run (the matrix goes on), bad usage is raised. With ``copies`` N the corpus
    goes to the engine all at once, N times over (slot TOGETHER)."""
    t0 = time.perf_counter()
    record = RunRecord(config=config, identity={}, corpus=corpus.name, corpus_hash=corpus.hash,
                       repeat=TOGETHER if copies else repeat, fresh_process=fresh_process, copies=copies)
    try:
        prompts = list(corpus.prompts) * max(copies, 1)
        ids = [inputs[p.id].tolist() for p in prompts]
        generate = engine.generate_together if copies else engine.generate
        record.completions = generate(prompts, ids, config, top_k)
    except EngineUsageError:
        raise
    except Exception as e:  # noqa: BLE001 - any engine crash is recorded, not fatal to the matrix
        _failed(record, e)
    _identify(record, engine)
    if engine.last_call_fresh_process is not None:
        record.fresh_process = engine.last_call_fresh_process
    record.wall_s = time.perf_counter() - t0
    suite.write_run(record)
    return record


def _failed(record: RunRecord, e: BaseException) -> None:
    """An engine crash, stored as the run's failure (with where it happened)."""
    record.status = "failed"
    record.error = f"{type(e).__name__}: {e}\n" + "".join(traceback.format_exc(limit=8))


def _identify(record: RunRecord, engine: Engine) -> None:
    """The engine's identity, read after the run: some facts (kernels chosen, GPU, K notes) are
    known only once it ran."""
    try:
        record.identity = {**engine.identity(), "speccheck_version": __version__}
    except Exception as e:  # noqa: BLE001
        record.identity = {"engine": engine.name, "identity_error": str(e)}


def _summary_line(record: RunRecord) -> str:
    if record.status != "ok":
        first = (record.error or "").splitlines()[0] if record.error else ""
        return f"{record.config.name:>12} {record.label}  FAILED  {first}"
    n = sum(c.n_tokens for c in record.completions)
    dec = sum(c.decode_s for c in record.completions)
    spec = record.spec_total()
    tpi = f"  {1 + spec.accepted_tokens / spec.drafts:.2f} tok/iter" if spec and spec.drafts else ""
    fresh = f"  [{record.fresh_note}]" if record.fresh_note else ""
    rate = f"{n / dec:7.1f} tok/s" if dec > 0 else "      - tok/s"
    if record.axis:
        proof = ", ".join(f"{k} {v}" for k, v in record.proof.items() if not isinstance(v, list))
        return (f"{record.config.name:>12} {record.label}: {len(record.completions)} requests  {n:6d} tok"
                + (f"  ({proof})" if proof else ""))
    if record.copies:
        return (f"{record.config.name:>12} all at once: {len(record.completions)} requests "
                f"({record.copies} of each prompt)  {n:6d} tok")
    return (f"{record.config.name:>12} r{record.repeat}  {len(record.completions)} prompts  "
            f"{n:6d} tok  {rate}{tpi}{fresh}")


# --- what a run of the plan has left to do (both executors) ------------------------------------

def start_engine(plan: RunPlan, store: Store, corpus: Corpus) -> tuple[Engine, Suite]:
    """The engine this process runs or plans with (its arguments checked, so bad input writes
    nothing), checked against the corpus and the attribution paths, and the suite with the plan
    recorded in it before anything generates. A crash at engine start still records the plan,
    so every verdict names what is missing."""

    def open_planned() -> Suite:
        suite = open_suite(plan, store, corpus)
        if plan.moves_latest:
            store.set_latest(suite.id)
        suite.extend_plan(plan.planned(), plan.run_args())
        return suite

    try:
        engine = make_engine(plan.engine, plan.model, plan.engine_args, plan.draft)
    except EngineUsageError:
        raise
    except BaseException:
        open_planned()
        raise
    try:
        check_context(engine, corpus)
        check_attribution_paths(plan, engine)
        return engine, open_planned()
    except BaseException:
        engine.close()
        raise


def is_fresh_repeat(plan: RunPlan, engine: Engine, repeat: int) -> bool:
    """Whether the plan runs this repeat in a process of its own (the last of two or more,
    unless the engine already starts a process per config)."""
    return (plan.fresh_process_repeat and plan.repeats > 1 and repeat == plan.repeats - 1
            and not engine.fresh_process_per_config)


def runs_to_do(plan: RunPlan, engine: Engine, suite: Suite, corpus: Corpus,
               log: Log = _print) -> list[tuple[SpecConfig, int]]:
    """The (config, repeat) runs not yet stored as the plan wants them, in the order to run
    them, said in one line. A run stored under other weights, a corpus-at-once run of another
    size, and a repeat that should have run in a fresh process but did not (a sweep's) are run
    again. Repeat TOGETHER is the corpus all at once (plan.concurrent copies of each prompt)."""
    current = weights_fingerprint(engine.identity())
    wanted = [(c, r) for c in plan.configs
              for r in list(range(plan.repeats)) + ([TOGETHER] if plan.concurrent else [])]
    if plan.round_robin:  # stable: configs keep their order within a round
        wanted.sort(key=lambda cr: cr[1] if cr[1] >= 0 else plan.repeats)
    todo = [(c, r) for c, r in wanted
            if not (suite.is_complete(c.name, r)
                    and weights_fingerprint(suite.run_identity(c.name, r)) == current
                    and (r >= 0 or suite.load_together(c.name).copies == plan.concurrent)
                    and (not is_fresh_repeat(plan, engine, r)
                         or suite.run_manifest(c.name, r).get("fresh_process")))]
    together = f" + all at once x{plan.concurrent}" if plan.concurrent else ""
    log(f"suite {suite.id}: {len(plan.configs)} configs x {plan.repeats} repeats{together} "
        f"on corpus {corpus.name} ({len(corpus.prompts)} prompts); {len(wanted) - len(todo)} already "
        f"stored, {len(todo)} to run")
    return todo


def axis_runs_to_do(plan: RunPlan, suite: Suite) -> list[tuple[SpecConfig, str]]:
    """Every planned axis level of every axis config not yet stored."""
    return [(c, slot) for c in plan.axis_configs() for slot in plan.axes if not suite.is_complete(c.name, slot)]


def attribution_paths(plan: RunPlan, engine: Engine, suite: Suite, log: Log = _print) -> dict[str, dict[str, str]]:
    """The kernel paths to attribute with (label -> engine args), as the engine offers them
    for the run its baseline made, with the plan's servers and --attribution-paths applied."""
    spec_configs = [c for c in plan.configs if not c.is_baseline]
    ran = suite.run_identity("baseline", 0) if suite.is_complete("baseline", 0) else None
    variants = (engine.rerun_variants(spec_configs, ran) if plan.attribution_mode == "rerun"
                else engine.attribution_variants(spec_configs, ran))
    for label, url in plan.attribute_with.items():
        variants[label] = engine.attribution_server_args(label, url)
    return select_paths(variants, plan.attribution_paths, log)


# --- workload axes -----------------------------------------------------------------------------

def run_axis(plan: RunPlan, engine: Engine, suite: Suite, corpus: Corpus, inputs: dict[str, np.ndarray],
             config: SpecConfig, slot: str) -> RunRecord:
    """Build one axis level's workload from the corpus, run it, store it with its proof; an
    engine failure is stored as a failed run (the matrix goes on)."""
    _, name, level = slot.split("-", 2)
    axis = get_axis(name)
    t0 = time.perf_counter()
    record = RunRecord(config=config, identity={}, corpus=corpus.name, corpus_hash=corpus.hash, repeat=0,
                       fresh_process=False, axis=name, level=level)
    try:
        outputs = ({c.prompt_id: c.token_ids for c in suite.load_run(config.name, 0).completions}
                   if suite.is_complete(config.name, 0) else {})
        ks = tuple(sorted({c.k for c in plan.configs if not c.is_baseline}))
        workload = axis.build(AxisInput(corpus, inputs, config, level, ks, outputs,
                                        block_size=engine.cache_block_size(),
                                        capture_sizes=tuple(engine.capture_sizes(config))))
        # an engine that serves the axis itself (its scheduler, slots, caches) runs it; any other
        # engine runs a runner-side axis (or level) through generate()
        result = (engine.run_workload(workload, config, plan.top_k) if axis.served(level, engine.axes)
                  else serve_in_order(engine, workload, config, plan.top_k))
        record.completions, record.proof = result.completions, dict(result.proof)
    except EngineUsageError:
        raise
    except Exception as e:  # noqa: BLE001 - recorded, not fatal to the matrix
        _failed(record, e)
    _identify(record, engine)
    record.wall_s = time.perf_counter() - t0
    suite.write_run(record)
    return record


def serve_in_order(engine: Engine, workload: Workload, config: SpecConfig, top_k: int) -> WorkloadResult:
    """An axis any engine runs: its requests in order through one generate() call (one engine,
    one process), each completion named by its request. The proof is what was sent: requests,
    prompt lengths and budgets as the engine tokenised them (and the engine's own count of
    requests served, where it keeps one)."""
    reqs = workload.requests
    comps = engine.generate([r.prompt for r in reqs], [list(r.prompt_ids) for r in reqs], config, top_k)
    if len(comps) != len(reqs):
        raise EngineError(f"{len(comps)} completions for the {len(reqs)} requests of the {workload.axis} axis")
    comps = [replace(c, prompt_id=r.id) for c, r in zip(comps, reqs)]
    proof = {"requests": len(reqs), "prompt_lengths": sorted({len(r.prompt_ids) for r in reqs}),
             "max_tokens": sorted({r.prompt.max_tokens for r in reqs})}
    served = getattr(engine, "requests_served", None)
    if isinstance(served, int):
        proof["engine_requests_served"] = served
    return WorkloadResult(comps, proof)


# --- rescoring ---------------------------------------------------------------------------------

def rescore_suite(engine: Engine, suite: Suite, config_names: Sequence[str], log: Log = _print) -> None:
    """Teacher-forced baseline scores of each config's first repeat (the baseline included:
    its decode-path vs prefill-path logprobs measure the engine's own path noise).

    Only outputs that differ from the baseline's are scored again; identical ones share the
    baseline's scores, which are exactly what the engine would give. Says what it will score
    before it starts, then each config's share with the time left at the pace so far."""
    if not suite.is_complete("baseline", 0):
        return
    # also what an earlier run stored but could not rescore (a server that speculates)
    config_names = list(dict.fromkeys([*config_names, *suite.configs()]))
    base = suite.load_run("baseline", 0).by_prompt()
    base_scores = suite.load_rescore("baseline", 0) if suite.has_rescore("baseline", 0) else None
    work: list[tuple[str, list, list]] = []  # (config, its completions, those to score)
    if base_scores is None:
        work.append(("baseline", list(base.values()), list(base.values())))
    # outputs several configs share (they often diverge from the baseline alike) are scored once
    known: dict[tuple, object] = {}
    for name in config_names:
        if name == "baseline" or not suite.is_complete(name, 0) or suite.has_rescore(name, 0):
            continue
        comps = suite.load_run(name, 0).completions
        work.append((name, comps, [c for c in comps if c.prompt_id not in base
                                   or first_divergence(c.token_ids, base[c.prompt_id].token_ids) is not None]))
    tokens = [sum(c.n_tokens for c in differ) for _, _, differ in work]
    if any(tokens):
        log(f"rescoring teacher-forced: {sum(len(d) for _, _, d in work)} output(s) of "
            f"{sum(1 for t in tokens if t)} config(s), {sum(tokens)} tokens")
    started, done = time.perf_counter(), 0
    for (name, comps, differ), n in zip(work, tokens):
        if done and differ:
            left = (time.perf_counter() - started) / done * (sum(tokens) - done)
            log(f"rescoring {name} ({len(differ)} output(s); about {left:.0f} s left)")
        key = {c.prompt_id: (c.prompt_id, c.prompt_ids.tobytes(), c.token_ids.tobytes()) for c in differ}
        new = [c for c in differ if key[c.prompt_id] not in known]
        try:
            known.update({key[pid]: s for pid, s in _score_record(engine, new).items()})
        except ScoringUnavailable as e:
            log(f"rescoring {name} left for later: {e}")
            return
        scores = {pid: known[k] for pid, k in key.items()}
        done += n
        if name == "baseline":
            base_scores = scores
            suite.write_rescore("baseline", 0, list(scores), list(scores.values()))
            continue
        merged = {c.prompt_id: scores.get(c.prompt_id) or base_scores[c.prompt_id] for c in comps}
        suite.write_rescore(name, 0, list(merged), list(merged.values()))
        log(f"{name:>12} rescored teacher-forced ({len(differ)} of {len(comps)} outputs differ from baseline)")


def score_sampled_suite(engine: Engine, suite: Suite, config_names: Sequence[str],
                        log: Log = _print) -> None:
    """A sampled suite: each config's first repeat scored teacher-forced by the target's
    full next-token distribution at every sampled position (the distribution check's
    evidence), unless stored already or the engine cannot (left missing, said once)."""
    for name in config_names:
        if not suite.is_complete(name, 0) or suite.load_sampled_scores(name, 0) is not None:
            continue
        comps = suite.load_run(name, 0).completions
        began = time.perf_counter()
        try:
            scores = engine.score_sampled([c.prompt_ids.tolist() for c in comps],
                                          [c.token_ids.tolist() for c in comps])
        except ScoringUnavailable as e:
            log(f"sampled outputs not scored: {e}")
            return
        suite.write_sampled_scores(name, 0, [c.prompt_id for c in comps], scores)
        log(f"{name:>12} sampled positions scored by the target "
            f"({sum(c.n_tokens for c in comps)} tokens, {time.perf_counter() - began:.1f} s)")


def _score_record(engine: Engine, comps) -> dict:
    if not comps:
        return {}
    scored = engine.score([c.prompt_ids.tolist() for c in comps], [c.token_ids.tolist() for c in comps],
                          top_k=comps[0].topk_ids.shape[1] or 5)
    return {c.prompt_id: s for c, s in zip(comps, scored)}


# --- acceptance replay -------------------------------------------------------------------------

def replay_suite(plan: RunPlan, engine: Engine, suite: Suite, corpus: Corpus, log: Log = _print,
                 progress: Callable[[int, int, str], None] | None = None) -> None:
    """The acceptance replay of each spec config the plan asks one of (its first repeat's own
    outputs; one already stored is kept). The replay runs without the engine's planted fault
    (engine arg ``fault``): a fault models a bug in the engine under test, the replay is the
    independent expectation it is judged by, so with a fault a fresh engine of the same weights
    and other args replays."""
    planned = plan.planned()
    todo = [c for c in plan.configs if planned.get(c.name, {}).get("replay")
            and suite.is_complete(c.name, 0) and not suite.has_replay(c.name, 0)]
    if not todo:
        return
    replayer, own = engine, False
    if "fault" in plan.engine_args:
        args = {k: v for k, v in plan.engine_args.items() if k != "fault"}
        try:
            replayer, own = make_engine(plan.engine, plan.model, args, plan.draft), True
        except (EngineError, EngineUsageError, RuntimeError) as e:
            log(f"acceptance replay left for later: no engine without the fault ({e})")
            return
    try:
        replay_configs(replayer, suite, todo, {p.id: p.max_tokens for p in corpus.prompts}, log,
                       progress)
    finally:
        if own:
            replayer.close()


def replay_configs(engine: Engine, suite: Suite, configs: Sequence[SpecConfig],
                   max_tokens: dict[str, int], log: Log = _print,
                   progress: Callable[[int, int, str], None] | None = None) -> None:
    """Replay each config's first repeat with ``engine`` (which must carry no planted fault)
    and store it; a replay that fails is said and left missing (the verdict names it)."""
    for i, config in enumerate(configs):
        if progress:
            progress(i, len(configs), f"replaying the acceptance of {config.name}")
        t0 = time.perf_counter()
        comps = suite.load_run(config.name, 0).completions
        try:
            replays = engine.replay_acceptance(
                config, [c.prompt_ids.tolist() for c in comps], [c.token_ids.tolist() for c in comps],
                [max_tokens.get(c.prompt_id, c.n_tokens) for c in comps])
        except Exception as e:  # noqa: BLE001 - recorded as missing, not fatal to the run
            log(f"acceptance replay of {config.name} failed: {type(e).__name__}: {e}")
            continue
        if replays is None:
            return  # this engine cannot replay
        suite.write_replay(config.name, 0, [c.prompt_id for c in comps], replays)
        log(f"{config.name:>12} acceptance replayed: {_tpi([r.counters for r in replays])} tok/iter "
            f"expected, {_tpi([c.spec for c in comps if c.spec])} reported "
            f"({time.perf_counter() - t0:.1f} s)")


def _tpi(counters) -> str:
    """Tokens per iteration of summed counters (emitted tokens over verify steps)."""
    drafts = sum(c.drafts for c in counters)
    steps = sum(c.iterations if c.iterations is not None else c.drafts for c in counters)
    return f"{(sum(c.accepted_tokens for c in counters) + steps) / steps:.2f}" if steps and drafts else "-"


# --- kernel-path attribution -------------------------------------------------------------------

def check_attribution_paths(plan: RunPlan, engine: Engine) -> None:
    """Every ``--attribution-paths`` glob must match a kernel path the engine offers, said before
    anything runs (a typo would otherwise attribute with nothing, minutes later)."""
    spec = [c for c in plan.configs if not c.is_baseline]
    if not (plan.attribute and plan.attribution_paths and spec):
        return
    labels = list((engine.rerun_variants(spec, None) if plan.attribution_mode == "rerun"
                   else engine.attribution_variants(spec, None))) + list(plan.attribute_with)
    unmatched = [g for g in plan.attribution_paths if not any(fnmatch.fnmatchcase(x, g) for x in labels)]
    if unmatched:
        raise EngineUsageError(f"--attribution-paths: {', '.join(map(repr, unmatched))} matches no kernel path "
                               f"of the {plan.engine} engine; it offers: {'; '.join(labels) or 'none'}. "
                               "Give globs of those labels (e.g. 'gdn=*'), or drop the option.")


def select_paths(variants: dict[str, dict[str, str]], globs: Sequence[str],
                 log: Log = _print) -> dict[str, dict[str, str]]:
    """The kernel paths whose label matches one of ``globs`` (all of them without globs)."""
    if not globs:
        return variants
    chosen = {label: args for label, args in variants.items()
              if any(fnmatch.fnmatchcase(label, g) for g in globs)}
    if not chosen:
        log(f"attribution: no kernel path matches --attribution-paths {','.join(globs)}; "
            f"this engine offers: {'; '.join(variants) or 'none'}")
    else:
        log(f"attribution: {len(chosen)} of {len(variants)} kernel paths chosen by "
            f"--attribution-paths ({'; '.join(chosen)})")
    return chosen


def attribute_suite(plan: RunPlan, variants: dict[str, dict[str, str]], suite: Suite,
                    config_names: Sequence[str], log: Log = _print, jobs: int = 1,
                    map_units: MapUnits | None = None) -> None:
    """For each first divergence of a spec config from the baseline, compute the divergent
    position under every alternative kernel-path setting the engine offers and record which
    setting gives which token there: the shared prefix re-scored (rescore), or the baseline
    regenerated with the switch flipped (rerun). In rerun mode, where no switch gives the
    baseline the spec token, the spec config is regenerated with each switch too: a switch
    under which the spec run gives the baseline's token is as much the cause. Up to ``jobs``
    engine starts run at once (where the engine says its variants can), or as ``map_units``
    runs them (an executor's cells); each one's tokens are stored as it ends, so a run stopped
    half-way resumes with the starts still to do."""
    if not suite.is_complete("baseline", 0):
        return
    todo = _first_divergences(suite, config_names)
    if not todo:
        return
    rerun = plan.attribution_mode == "rerun"
    weights = weights_fingerprint(suite.run_identity("baseline", 0))
    # configs that diverge at the same place share one computation per kernel path
    unique: dict[tuple, list[dict]] = {}
    for items in todo.values():
        for it in items:
            unique.setdefault((it["prompt_id"], tuple(it["prompt_ids"]), tuple(it["prefix"])), []).append(it)
    firsts = [group[0] for group in unique.values()]
    if firsts:
        tokens_at = _rerun_tokens(plan, SpecConfig()) if rerun else _rescored_tokens
        units = [_Unit(label, "baseline", firsts, tokens_at) for label in variants]
        found = _over_units(plan, variants, units, jobs, log, suite, weights, map_units,
                            f"on {len(firsts)} divergent prefix(es)" + (" by rerun" if rerun else ""))
        for unit, tokens in zip(units, found):
            for group, token in zip(unique.values(), tokens or []):
                if token >= 0:  # -1: that path could not compute this position (engine says why)
                    for it in group:
                        it.setdefault("paths", {})[unit.label] = token
    left = {name: [it for it in items if it["spec_token"] not in it.get("paths", {}).values()]
            for name, items in todo.items()} if rerun else {}
    left = {name: items for name, items in left.items() if items}
    if left:
        # one engine start per (switch, spec config): on vLLM each config is a worker of its own
        units = [_Unit(label, name, items, _rerun_tokens(plan, SpecConfig.from_name(name)))
                 for label in variants for name, items in left.items()]
        n = sum(map(len, left.values()))
        found = _over_units(plan, variants, units, jobs, log, suite, weights, map_units,
                            f"regenerating {len(left)} spec config(s) on the {n} divergence(s) "
                            f"no baseline rerun reproduced")
        for unit, tokens in zip(units, found):
            for it, token in zip(unit.items, tokens or []):
                if token >= 0:
                    it.setdefault("spec_paths", {})[unit.label] = token
    for name, items in todo.items():
        for it in items:
            it.pop("prompt_ids"), it.pop("prefix")
            paths, spec_paths = it.setdefault("paths", {}), it.pop("spec_paths", {})
            it["reproduces_spec"] = sorted(k for k, t in paths.items() if t == it["spec_token"])
            it["reproduces_base"] = sorted(k for k, t in paths.items() if t == it["base_token"])
            if rerun:
                it["spec_paths"] = spec_paths
                it["spec_reproduces_base"] = sorted(k for k, t in spec_paths.items()
                                                    if t == it["base_token"])
            it["attributed_to"] = (it["reproduces_spec"] or it.get("spec_reproduces_base")
                                   or "unattributed")
            it["by"] = plan.attribution_mode
        suite.write_attribution(name, items)
        if items:
            log(f"{name:>12} attributed {len(items)} divergence(s) over {len(variants)} kernel paths")
    suite.clear_attribution_parts()


def _first_divergences(suite: Suite, config_names: Sequence[str]) -> dict[str, list[dict]]:
    """Per config not yet attributed, its first divergence from the baseline on each prompt
    (with the prompt's ids and the shared prefix, for the kernel paths to compute)."""
    base = suite.load_run("baseline", 0).by_prompt()
    todo: dict[str, list[dict]] = {}
    for name in config_names:
        if not suite.is_complete(name, 0) or suite.has_attribution(name):
            continue
        items = []
        for c in suite.load_run(name, 0).completions:
            b = base.get(c.prompt_id)
            if b is None:
                continue
            pos = first_divergence(b.token_ids, c.token_ids)
            if pos is None or pos >= min(b.n_tokens, c.n_tokens):
                continue
            items.append({"prompt_id": c.prompt_id, "position": int(pos),
                          "base_token": int(b.token_ids[pos]), "spec_token": int(c.token_ids[pos]),
                          "prompt_ids": b.prompt_ids.tolist(), "prefix": b.token_ids[:pos + 1].tolist()})
        todo[name] = items
    return todo


@dataclass
class _Unit:
    """One engine start of attribution: the kernel path (its label among the variants), the
    config it generates or scores (``baseline`` for the baseline side), the divergences, and
    ``tokens_at(engine, items)``: the token at each divergent position, -1 where none."""
    label: str
    config: str
    items: list[dict]
    tokens_at: Callable

    def key(self, plan: RunPlan, weights: tuple) -> str:
        """What its stored tokens stay valid for: the same computation on the same positions
        of the same stored runs' weights."""
        where = [(it["prompt_id"], it["position"], it["prefix"]) for it in self.items]
        return json.dumps([plan.attribution_mode, self.label, self.config, list(weights), where])


#: runs attribution units elsewhere: given (name, engine args, unit) per unit, yields
#: (index, tokens) as each ends, tokens None where its engine failed (said by the mapper)
MapUnits = Callable[[list[tuple[str, dict[str, str], _Unit]]], Iterator[tuple[int, list[int] | None]]]


def unit_tokens(plan: RunPlan, args: dict[str, str], unit: _Unit) -> list[int]:
    """One attribution unit computed: an engine under the unit's kernel path (engine args
    ``args``) started, asked, closed. Engine failures are raised."""
    engine = make_engine(plan.engine, plan.model, args, plan.draft)
    try:
        return [int(t) for t in unit.tokens_at(engine, unit.items)]
    finally:
        engine.close()


def _over_units(plan: RunPlan, variants: dict[str, dict[str, str]], units: list[_Unit], jobs: int,
                log: Log, suite: Suite, weights: tuple, map_units: MapUnits | None,
                what: str) -> list[list[int] | None]:
    """Each unit's tokens, computed with an engine under its kernel path (``jobs`` at once, or
    by ``map_units``) or read back where a stopped run stored them; None for a path that failed
    (logged)."""
    results = [suite.load_attribution_part(u.key(plan, weights)) for u in units]
    todo = [i for i, r in enumerate(results) if r is None]
    if len(todo) < len(units):
        log(f"attribution: {len(units) - len(todo)} of {len(units)} kernel-path run(s) {what} "
            f"already stored by an earlier run, kept")
    started = time.perf_counter()
    several = len({u.config for u in units}) > 1

    def name(u: _Unit) -> str:
        return f"{u.label}, {u.config}" if several else u.label

    def one(n: int) -> list[int] | None:
        u = units[todo[n]]
        done = n - min(n, max(jobs, 1) - 1)  # runs finished before this one started, about
        eta = (f", about {(time.perf_counter() - started) / done * (len(todo) - n):.0f} s left"
               if done > 0 else "")
        log(f"attribution: kernel path {n + 1}/{len(todo)} ({name(u)}) {what}{eta}")
        try:
            tokens = unit_tokens(plan, {**plan.engine_args, **variants[u.label]}, u)
        except (EngineError, EngineUsageError, RuntimeError) as e:
            log(f"attribution variant {u.label} failed: {e}")
            return None
        suite.write_attribution_part(u.key(plan, weights), tokens)
        return tokens

    if map_units is not None and todo:
        log(f"attribution: {len(todo)} kernel-path run(s) {what}")
        computed: list[list[int] | None] = [None] * len(todo)
        calls = [(name(units[i]), {**plan.engine_args, **variants[units[i].label]}, units[i]) for i in todo]
        for n, tokens in map_units(calls):
            if tokens is not None:
                suite.write_attribution_part(units[todo[n]].key(plan, weights), tokens)
            computed[n] = tokens
    elif jobs > 1 and len(todo) > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="speccheck-attribution") as pool:
            computed = list(pool.map(one, range(len(todo))))
    else:
        computed = [one(n) for n in range(len(todo))]
    for i, tokens in zip(todo, computed):
        results[i] = tokens
    return results


def _rescored_tokens(engine: Engine, firsts: list[dict]) -> list[int]:
    """The top-1 token at each divergent position, the shared prefix re-scored."""
    scored = engine.score([it["prompt_ids"] for it in firsts], [it["prefix"] for it in firsts],
                          top_k=2)
    return [int(s.topk_ids[it["position"], 0]) for it, s in zip(firsts, scored)]


def _rerun_tokens(plan: RunPlan, config: SpecConfig):
    """A ``tokens_at`` that regenerates each divergent prompt under ``config`` (the baseline,
    or a spec config), the same request the stored run made: the token at the divergent
    position, or -1 where the rerun left the shared prefix earlier (a switch that changes an
    earlier token says nothing of this one)."""
    prompts = {p.id: p for p in plan.load_corpus().prompts}

    def tokens_at(engine: Engine, items: list[dict]) -> list[int]:
        asked = [prompts[it["prompt_id"]] for it in items]
        comps = engine.generate(asked, [it["prompt_ids"] for it in items], config, 2)
        out = []
        for it, c in zip(items, comps):
            pos, ids = it["position"], np.asarray(c.token_ids)
            same = len(ids) > pos and np.array_equal(ids[:pos], np.asarray(it["prefix"][:pos]))
            out.append(int(ids[pos]) if same else -1)
        return out
    return tokens_at


