"""Workload axes: generators are deterministic and reach the shapes they are for; an axis level
that was asked for but not exercised fails the gate naming the axis; a request that changes a
token beyond a near-tie fails its axis; a planned axis run that is missing fails `ran`."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from speccheck.axes import AxisInput, get, registry
from speccheck.corpus import load_corpus
from speccheck.evaluate import evaluate_suite
from speccheck.gate import gate_text
from speccheck.plan import PlanError, parse_axes
from speccheck.policy import Policy
from speccheck.types import RunRecord, SpecConfig, axis_slot
from tests.test_evaluate import BASE, MTP_COUNTERS, NEAR, comp, suite  # noqa: F401

LOOSE = Policy(min_token_agreement=0.5)
CORPUS = load_corpus("smoke")


def inputs(n: int = 40) -> dict[str, np.ndarray]:
    return {p.id: np.arange(100, 100 + n + i, dtype=np.int32) for i, p in enumerate(CORPUS.prompts)}


@pytest.mark.parametrize("axis", [a.name for a in registry()])
def test_every_generator_is_deterministic_and_names_each_request_once(axis):
    spec = get(axis)
    for level in spec.levels:
        inp = AxisInput(CORPUS, inputs(), SpecConfig("mtp", 3), level, (1, 3, 7),
                        {p.id: np.arange(5, 15) for p in CORPUS.prompts})
        a, b = spec.build(inp), spec.build(inp)
        assert [r.id for r in a.requests] == [r.id for r in b.requests]
        assert [r.prompt_ids for r in a.requests] == [r.prompt_ids for r in b.requests]
        ids = [r.id for r in a.requests]
        assert len(ids) == len(set(ids)) and a.requests and a.axis == axis and a.level == level
        assert all(r.id.rsplit(":", 1)[-1] in {p.id for p in CORPUS.prompts} for r in a.requests)


@given(ks=st.lists(st.integers(1, 15), min_size=1, max_size=4, unique=True), block=st.integers(4, 32))
def test_shapes_sends_every_length_around_k_and_the_block(ks, block):
    inp = AxisInput(CORPUS, inputs(60), SpecConfig("mtp", ks[0]), "k", tuple(ks), block_size=block)
    w = get("shapes").build(inp)
    sent = {len(r.prompt_ids) for r in w.requests}
    budgets = {r.prompt.max_tokens for r in w.requests}
    assert {1, block - 1, block, block + 1} <= sent
    for k in ks:
        assert {k, k + 1, k + 2} <= sent and {k, k + 1} <= budgets
    assert 1 in budgets


def test_concurrency_requests_arrive_while_others_decode():
    w = get("concurrency").build(AxisInput(CORPUS, inputs(), SpecConfig("mtp", 3), "8", (3,)))
    assert w.max_in_flight == 8 and len(w.requests) == 16
    arrivals = [r.arrive_after for r in w.requests]
    assert arrivals == sorted(arrivals) and len(set(arrivals[:8])) > 1  # staggered, not all at once


@given(k=st.integers(0, 15), level=st.sampled_from(["8", "32"]), lengths=st.lists(st.integers(1, 40), min_size=4,
                                                                                   max_size=4))
def test_concurrency_reaches_its_level_before_the_first_request_can_finish(k, level, lengths):
    """The first ``level`` requests all arrive while the first one still decodes, even if every
    draft is accepted (K + 1 tokens a step after its prefill step) and even for short outputs;
    a ladder slower than that never has the level in flight (mtp-k7 on the smoke corpus peaked
    at 30 of 32)."""
    outputs = {p.id: np.arange(n) for p, n in zip(CORPUS.prompts, lengths)}
    w = get("concurrency").build(AxisInput(CORPUS, inputs(), SpecConfig("mtp" if k else "baseline", k), level,
                                           (k,), outputs))
    first = w.requests[:int(level)]
    shortest = min(min(n, r.prompt.max_tokens) for r, n in
                   ((r, len(outputs[r.id.rsplit(":", 1)[-1]])) for r in first))
    steps_alive = -(-(shortest - 1) // (k + 1))  # steps after its prefill step
    assert max(r.arrive_after for r in first) <= steps_alive
    arrivals = [r.arrive_after for r in w.requests]
    assert arrivals == sorted(arrivals)


def test_the_axes_option():
    assert parse_axes("none", frozenset()) == ()
    default = parse_axes("default", frozenset())
    assert axis_slot("shapes", "k") in default and not any("concurrency" in s for s in default)
    assert parse_axes("concurrency=4+32", frozenset({"concurrency"})) == (
        axis_slot("concurrency", "4"), axis_slot("concurrency", "32"))
    with pytest.raises(PlanError, match="cannot run the concurrency axis"):
        parse_axes("concurrency=8", frozenset())
    with pytest.raises(PlanError, match="no axis 'bogus'"):
        parse_axes("bogus", frozenset())
    with pytest.raises(PlanError, match="numbers of requests"):
        parse_axes("concurrency=lots", frozenset({"concurrency"}))


def _plan_axes(s, slots):
    want = {"repeats": 2, "fresh_process_repeat": False, "concurrent": 0, "rescore": True,
            "attribute": False, "axes": list(slots)}
    s.extend_plan({"baseline": want, "mtp-k3": {**want, "attribute": True}}, ["--corpus", "c"])


def _axis_run(s, name, axis, level, comps, proof):
    s.write_run(RunRecord(SpecConfig.from_name(name), {"engine": "t"}, "c", "h", 0, False,
                          completions=comps, axis=axis, level=level, proof=proof))


def _requests(prefix, spec=None, flip=None):
    out = []
    for p, t in BASE.items():
        toks = list(t)
        if flip and p == "a":
            toks[1] = 40  # far from the baseline's top-k: high confidence
        c = comp(p, toks, NEAR.get(p), spec=spec)
        out.append(type(c)(f"{prefix}:{p}", c.prompt_ids, c.token_ids, c.logprobs, c.topk_ids, c.topk_logprobs,
                           text=c.text, ttft_s=c.ttft_s, decode_s=c.decode_s, spec=c.spec))
    return out


def test_an_axis_not_exercised_fails_naming_it(suite):  # noqa: F811
    """prefix caching switched off in the engine: the hit level served every request, but the
    engine read back no hit -- the axis fails, never passes."""
    slots = [axis_slot("prefix_cache", "cold"), axis_slot("prefix_cache", "hit")]
    _plan_axes(suite, slots)
    for name, spec in (("baseline", None), ("mtp-k3", MTP_COUNTERS)):
        _axis_run(suite, name, "prefix_cache", "cold", _requests("conv0/turn2", spec), {"prefix_hits": 0})
        _axis_run(suite, name, "prefix_cache", "hit", _requests("conv0/turn2", spec), {"prefix_hits": 0})
    res = evaluate_suite(suite, LOOSE, ["baseline", "mtp-k3"])
    c = res.get("mtp-k3").check("axis_prefix_cache")
    assert not c.passed and "axis prefix_cache (hit) was not exercised: prefix_hits = 0" in c.message
    assert "axis_prefix_cache failed for config mtp-k3" in gate_text(res)


def test_a_changed_token_beyond_a_near_tie_fails_its_axis_and_a_clean_one_passes(suite):  # noqa: F811
    slots = [axis_slot("kv_pressure", "free"), axis_slot("kv_pressure", "pressure")]
    _plan_axes(suite, slots)
    for name, spec in (("baseline", None), ("mtp-k3", MTP_COUNTERS)):
        _axis_run(suite, name, "kv_pressure", "free", _requests("kv", spec), {})
        _axis_run(suite, name, "kv_pressure", "pressure", _requests("kv", spec, flip=name == "mtp-k3"),
                  {"preemptions": 2})
    res = evaluate_suite(suite, LOOSE, ["baseline", "mtp-k3"])
    assert res.get("baseline").check("axis_kv_pressure").passed
    c = res.get("mtp-k3").check("axis_kv_pressure")
    assert not c.passed and "1 request(s) differ from the run without pressure beyond a near-tie" in c.message
    assert "prompt kv:a position 1" in c.message


def test_a_planned_axis_run_that_is_missing_fails_ran(suite):  # noqa: F811
    _plan_axes(suite, [axis_slot("shapes", "k")])
    res = evaluate_suite(suite, LOOSE, ["baseline", "mtp-k3"])
    c = res.get("mtp-k3").check("ran")
    assert not c.passed and "mtp-k3 axis shapes (k)" in c.message


@pytest.mark.parametrize("proof, unproven", [
    ({"chat_rendered": 0, "thinking_prompts": 0}, "chat_rendered = 0"),  # the template never applied
    ({"chat_rendered": 2, "thinking_prompts": 2}, "chat_rendered = 2 of 3 requests"),
    ({"chat_rendered": 3, "thinking_prompts": 1}, "thinking_prompts = 1 of 3 requests"),
    ({"chat_rendered": 3}, "thinking_prompts = not read back")])
def test_a_chat_prompt_not_rendered_in_thinking_mode_is_not_exercised(suite, proof, unproven):  # noqa: F811
    """A rendering that did not happen (for every request, or some) fails the chat axis by
    name, however well the tokens agree."""
    slots = [axis_slot("chat_thinking", "off"), axis_slot("chat_thinking", "on")]
    _plan_axes(suite, slots)
    for name, spec in (("baseline", None), ("mtp-k3", MTP_COUNTERS)):
        _axis_run(suite, name, "chat_thinking", "off", _requests("chat/off", spec),
                  {"chat_rendered": 3, "thinking_prompts": 0})
        _axis_run(suite, name, "chat_thinking", "on", _requests("chat/on", spec), proof)
    res = evaluate_suite(suite, LOOSE, ["baseline", "mtp-k3"])
    for name in ("baseline", "mtp-k3"):
        c = res.get(name).check("axis_chat_thinking")
        assert not c.passed and "chat_thinking (on) was not exercised" in c.message and unproven in c.message
    # every request rendered in thinking mode and every token the baseline's: a pass
    for name, spec in (("baseline", None), ("mtp-k3", MTP_COUNTERS)):
        _axis_run(suite, name, "chat_thinking", "on", _requests("chat/on", spec),
                  {"chat_rendered": 3, "thinking_prompts": 3})
    assert evaluate_suite(suite, LOOSE, ["mtp-k3"]).get("mtp-k3").check("axis_chat_thinking").passed


def test_async_scheduling_that_never_scheduled_ahead_is_not_exercised(suite):  # noqa: F811
    """An engine that took the switch but scheduled nothing ahead (or ignored it) fails."""
    slots = [axis_slot("async_scheduling", "off"), axis_slot("async_scheduling", "on")]
    _plan_axes(suite, slots)
    for name, spec in (("baseline", None), ("mtp-k3", MTP_COUNTERS)):
        _axis_run(suite, name, "async_scheduling", "off", _requests("async/00", spec), {})
        _axis_run(suite, name, "async_scheduling", "on", _requests("async/00", spec),
                  {"async_scheduling": 1, "steps_scheduled_ahead": 0})
    c = evaluate_suite(suite, LOOSE, ["mtp-k3"]).get("mtp-k3").check("axis_async_scheduling")
    assert not c.passed and "async_scheduling (on) was not exercised: steps_scheduled_ahead = 0" in c.message


def test_kv_pressure_judges_the_preempted_requests_acceptance(suite):  # noqa: F811
    """Tokens the same, but the preempted request drafts far worse after its recompute: the
    paired per-request test fails it; a request not preempted is not in the test."""
    from speccheck.types import SpecCounters

    slots = [axis_slot("kv_pressure", "free"), axis_slot("kv_pressure", "pressure")]
    _plan_axes(suite, slots)
    good = SpecCounters(drafts=17, draft_tokens=51, accepted_tokens=30, accepted_per_pos=[14, 10, 6])
    cold = SpecCounters(drafts=26, draft_tokens=78, accepted_tokens=8, accepted_per_pos=[6, 2, 0])
    _axis_run(suite, "baseline", "kv_pressure", "free", _requests("kv"), {})
    _axis_run(suite, "baseline", "kv_pressure", "pressure", _requests("kv"), {"preemptions": 1})
    free = _requests("kv", good)
    _axis_run(suite, "mtp-k3", "kv_pressure", "free", free, {})
    for preempted, fails in (("kv:a", True), ("kv:zz", False)):
        pressed = _requests("kv", good)
        pressed[0].spec = cold  # request kv:a
        _axis_run(suite, "mtp-k3", "kv_pressure", "pressure", pressed,
                  {"preemptions": 1, "preempted_requests": [preempted]})
        c = evaluate_suite(suite, LOOSE, ["mtp-k3"]).get("mtp-k3").check("axis_kv_pressure")
        assert ("the preempted requests' acceptance" in c.message
                and "beyond chance" in c.message) == fails, c.message


def test_a_concurrency_level_whose_batch_never_reached_it_fails(suite):  # noqa: F811
    """Requests finished before the next arrived: every request was served, mixed steps
    happened, but the batch peaked at 9 of level 32 -- that level was not tested."""
    slot = axis_slot("concurrency", "32")
    _plan_axes(suite, [slot])
    for name, spec in (("baseline", None), ("mtp-k3", MTP_COUNTERS)):
        _axis_run(suite, name, "concurrency", "32", _requests("c32/000", spec), {"max_batch": 9, "mixed_steps": 5})
    res = evaluate_suite(suite, LOOSE, ["baseline", "mtp-k3"])
    c = res.get("mtp-k3").check("axis_concurrency")
    assert not c.passed and "concurrency (32) was not exercised: max_batch = 9 < 32" in c.message


def test_batch_targets_are_the_capture_sizes_and_one_either_side():
    """In requests of 1 + K tokens: vLLM's default sizes (1, 2, 4, 8, 16, ... tokens) give the
    baseline 3, 4, 5 (5 pads to 8) and 7, 8, 9; rounded up to multiples of 4 for K=3 they are
    1, 2, 4, 6, 8, ... requests; with K=7 every count up to the last size is captured, so the
    last one and the first past every graph; no size reported: a fixed guess (the proof then
    shows no graph)."""
    from speccheck.axes.shapes import batch_targets

    base = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
    assert batch_targets(base, 1) == [3, 4, 5, 7, 8, 9]
    assert batch_targets(sorted({-(-s // 4) * 4 for s in base}), 4) == [3, 4, 5, 6, 7]
    assert batch_targets(list(range(8, 129, 8)), 8) == [15, 16, 17]
    assert batch_targets([], 4) == [3, 4, 5]
    assert max(batch_targets(range(1, 1000), 1)) <= 64


def test_shapes_batch_level_sends_each_target_batch_alone():
    """Each target size arrives at once, after the batch before it has ended (its requests
    decode a fixed budget past end-of-sequence), at most the largest in flight."""
    from speccheck.axes.shapes import BATCH_TOKENS, batch_targets

    sizes = tuple(range(4, 65, 4))  # 1 + K = 4 tokens a request
    w = get("shapes").build(AxisInput(CORPUS, inputs(), SpecConfig("mtp", 3), "batch", (3,),
                                      capture_sizes=sizes))
    want = batch_targets(sizes, 4)
    waves: dict[int, list] = {}
    for r in w.requests:
        waves.setdefault(r.arrive_after, []).append(r)
    assert [len(v) for _, v in sorted(waves.items())] == want
    starts = sorted(waves)
    assert all(b - a > BATCH_TOKENS for a, b in zip(starts, starts[1:]))
    assert all(r.prompt.ignore_eos and r.prompt.max_tokens == BATCH_TOKENS for r in w.requests)
    assert w.max_in_flight == max(want) and w.knobs == {"cudagraph_metrics": "on"}


def test_the_batch_level_runs_only_on_an_engine_that_serves_it():
    assert axis_slot("shapes", "batch") not in parse_axes("default", frozenset())
    assert {axis_slot("shapes", "k"), axis_slot("shapes", "batch")} <= set(parse_axes("default", frozenset({"shapes"})))
    with pytest.raises(PlanError, match="cannot run the shapes axis's batch level"):
        parse_axes("shapes=batch", frozenset())
    assert parse_axes("shapes=k", frozenset()) == (axis_slot("shapes", "k"),)


@pytest.mark.parametrize("proof, unproven", [
    ({"capture_sizes": [1, 2, 4, 8, 16], "tokens_per_request": 1, "batch_sizes": [3, 4, 5, 7, 8],
      "graph_steps": 9}, "batch sizes [9] of [3, 4, 5, 7, 8, 9] were never scheduled"),
    ({"capture_sizes": [], "tokens_per_request": 1, "batch_sizes": [3, 4, 5], "graph_steps": 0},
     "capture_sizes = []"),
    ({"batch_sizes": [3, 4, 5]}, "graph_steps = not read back"),
])
def test_a_batch_level_that_missed_its_sizes_is_not_exercised(suite, proof, unproven):  # noqa: F811
    """Batches that never reached a target size, an engine that captured no graph (eager),
    or one that reports nothing: the shapes axis fails naming what was missing."""
    _plan_axes(suite, [axis_slot("shapes", "batch")])
    for name, spec in (("baseline", None), ("mtp-k3", MTP_COUNTERS)):
        _axis_run(suite, name, "shapes", "batch", _requests("b3/00", spec), proof)
    c = evaluate_suite(suite, LOOSE, ["mtp-k3"]).get("mtp-k3").check("axis_shapes")
    assert not c.passed and "shapes (batch) was not exercised" in c.message and unproven in c.message, c.message
    good = {"capture_sizes": [1, 2, 4, 8, 16], "tokens_per_request": 1, "batch_sizes": [3, 4, 5, 7, 8, 9],
            "graph_steps": 9, "padded_steps": 4}
    for name, spec in (("baseline", None), ("mtp-k3", MTP_COUNTERS)):
        _axis_run(suite, name, "shapes", "batch", _requests("b3/00", spec), good)
    c = evaluate_suite(suite, LOOSE, ["mtp-k3"]).get("mtp-k3").check("axis_shapes")
    assert c.passed, c.message
