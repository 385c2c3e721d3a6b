"""The reference engine as a serving engine (reference/serving.py, Engine.run_workload):
requests joining a running batch give the bits they give alone, a prefix-cache hit gives the
bits of a miss and the tokens of a cold prefill, preemption and recompute give the unpressured
tokens, each axis proves it was exercised, and each planted fault of this regime changes
outputs in it and nowhere else."""
from __future__ import annotations

import numpy as np
import pytest

from speccheck.axes import AxisInput, get
from speccheck.corpus import load_corpus
from speccheck.engines.base import EngineError, EngineUsageError
from speccheck.reference.engine import ReferenceEngine
from speccheck.reference.serving import blocks, capture_sizes
from speccheck.types import Prompt, Request, SpecConfig, Workload
from speccheck.verify import counter_problems, find_divergences

CONFIGS = [SpecConfig(), SpecConfig("mtp", 3), SpecConfig("dflash2", 7)]
#: the default policy's thresholds at the reference engine's calibrated path noise (0.038 nats)
NOISE, TAU_TIE, TAU_LOW = 0.038, 0.152, 0.456


@pytest.fixture(scope="module")
def engine():
    return ReferenceEngine(engine_args={"threads": "1"})


@pytest.fixture(scope="module")
def corpus():
    return load_corpus("smoke")


@pytest.fixture(scope="module")
def inputs(engine, corpus):
    return {p.id: np.array(engine.tokenize(p)) for p in corpus.prompts}


@pytest.fixture(scope="module")
def alone(engine, corpus, inputs):
    """Each prompt decoded alone, per config (what every served request is judged by)."""
    memo = {}

    def get_alone(config: SpecConfig) -> dict:
        if config.name not in memo:
            ps = list(corpus.prompts)
            memo[config.name] = {c.prompt_id: c for c in engine.generate(
                ps, [inputs[p.id].tolist() for p in ps], config, 5)}
        return memo[config.name]
    return get_alone


def _build(axis, level, corpus, inputs, config, outputs=None):
    return get(axis).build(AxisInput(corpus, inputs, config, level, (3, 7), outputs or {}))


def _batches(corpus, inputs, config):
    """The shapes axis's batch level at the engine's capture sizes for this config."""
    sizes = capture_sizes(0 if config.is_baseline else config.k)
    return get("shapes").build(AxisInput(corpus, inputs, config, "batch", (3, 7), {}, capture_sizes=sizes))


def _bits(c) -> tuple:
    return (c.token_ids.tobytes(), c.logprobs.tobytes(), c.topk_ids.tobytes(),
            c.topk_logprobs.tobytes())


def _high(ref, got) -> list:
    """The first divergence of got from ref, where it is not a near-tie or low-confidence."""
    d = find_divergences(got.prompt_id, ref.token_ids, ref.topk_ids, ref.topk_logprobs,
                         got.token_ids, got.topk_ids, got.topk_logprobs, TAU_TIE, TAU_LOW, NOISE,
                         max_gap=TAU_LOW)
    return [x for x in d if x.cls == "high_confidence"]


def _consistent(c, k: int) -> bool:
    """The spec counters explain the tokens after the first (verify.counter_problems)."""
    s = c.spec
    return not counter_problems(s.drafts, s.draft_tokens, s.accepted_tokens, s.accepted_per_pos, k,
                                c.n_tokens - 1, s.iterations)


def test_axes_and_knobs(engine, corpus, inputs):
    assert engine.axes == {"concurrency", "prefix_cache", "kv_pressure", "long_lived", "async_scheduling",
                           "chat_thinking", "shapes"}
    wl = _build("concurrency", "4", corpus, inputs, SpecConfig())
    for knobs, msg in (({"prefix_cache": "maybe"}, "prefix_cache"), ({"kv_blocks": "0"}, "kv_blocks"),
                       ({"swap": "on"}, "swap"), ({"async_scheduling": "yes"}, "async_scheduling")):
        with pytest.raises(EngineUsageError, match=msg):
            engine.run_workload(Workload("concurrency", "x", wl.requests, 4, knobs), SpecConfig(), 5)
    with pytest.raises(EngineUsageError, match="swap"):
        engine.run_workload(Workload("swap", "k", wl.requests), SpecConfig(), 5)
    with pytest.raises(EngineUsageError, match="cudagraph_metrics"):
        engine.run_workload(Workload("shapes", "batch", wl.requests, 4, {"cudagraph_metrics": "yes"}),
                            SpecConfig(), 5)
    with pytest.raises(EngineUsageError, match="eagle"):
        engine.run_workload(wl, SpecConfig("eagle", 3), 5)
    with pytest.raises(EngineUsageError, match="not in the workload"):
        engine.run_workload(Workload("concurrency", "x", [Request("a", wl.requests[0].prompt, (1, 2),
                                                                 after="b")]), SpecConfig(), 5)
    with pytest.raises(EngineError, match="alone needs"):  # a budget no request fits: a failed run
        engine.run_workload(Workload("kv_pressure", "x", wl.requests[:2], 2, {"kv_blocks": "1"}),
                            SpecConfig(), 5)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_concurrency_gives_each_request_its_bits_alone(engine, corpus, inputs, alone, config):
    """Requests arriving every 2 steps, 4 in flight: they join a running batch (a step that
    prefills one while verifying others), leave it, and their slots are reused; on the CPU in
    bf16 every request gives the tokens, logprobs, top-k and acceptance it gives alone."""
    ref = alone(config)
    res = engine.run_workload(_build("concurrency", "4", corpus, inputs, config), config, 5)
    assert len(res.completions) == 8
    for c in res.completions:
        a = ref[c.prompt_id.rsplit(":", 1)[1]]
        assert _bits(c) == _bits(a), c.prompt_id
        assert c.prompt_ids.tolist() == a.prompt_ids.tolist()
        if config.is_baseline:
            assert c.spec is None
        else:
            assert c.spec.accepted_per_pos == a.spec.accepted_per_pos, c.prompt_id
            assert c.spec.iterations == a.spec.iterations
    p = res.proof
    assert p["max_batch"] == 4 and p["mixed_steps"] > 0 and p["slot_reuses"] > 0
    assert p["requests_served"] >= 8 and "prefix_hits" not in p and "preemptions" not in p


@pytest.mark.parametrize("config", CONFIGS[:2], ids=lambda c: c.name)
def test_batches_at_capture_sizes_give_each_request_its_bits_alone(engine, corpus, inputs, alone, config):
    """The shapes axis's batch level: batches of exactly the captured sizes and one either side
    (the baseline: 3, 4, 5 and 7, 8, 9 requests; MTP K=3, 4 tokens a request: 3 to 7), each
    arriving after the one before ended; the steps padded up to a captured size are counted,
    and every request gives the bits it gives alone."""
    from speccheck.axes.shapes import batch_targets

    ref = alone(config)
    wl = _batches(corpus, inputs, config)
    res = engine.run_workload(wl, config, 5)
    q = 1 + config.k if not config.is_baseline else 1
    want = {"baseline": [3, 4, 5, 7, 8, 9], "mtp-k3": [3, 4, 5, 6, 7]}[config.name]
    assert batch_targets(capture_sizes(config.k if q > 1 else 0), q) == want
    p = res.proof
    assert set(want) <= set(p["batch_sizes"]) and p["tokens_per_request"] == q
    assert p["padded_steps"] > 0 and p["graph_steps"] >= p["padded_steps"] and p["eager_steps"] == 0
    assert p["max_batch"] == max(want) and len(res.completions) == sum(want)
    for c in res.completions:  # past the prompt's own end-of-sequence too: compared where both ran
        a = ref[c.prompt_id.rsplit(":", 1)[1]]
        n = min(a.n_tokens, c.n_tokens)
        assert c.n_tokens == 8 and c.token_ids[:n].tolist() == a.token_ids[:n].tolist(), c.prompt_id
        assert c.topk_logprobs[:n].tobytes() == a.topk_logprobs[:n].tobytes(), c.prompt_id
    assert "capture_sizes" not in engine.run_workload(_build("concurrency", "4", corpus, inputs, config),
                                                      config, 5).proof  # asked for by the knob only


def test_capture_sizes_pad_a_batch_at_every_k():
    """vLLM's rule at 32 requests: the baseline captures 1, 2, 4, 8, ... 64 tokens; K=7 every
    count of 8-token requests up to 32, then every other one, so the batch level sends 31 to 35
    and 33 and 35 are padded: a spec config's padding is exercised at the default run's K too."""
    from speccheck.axes.shapes import batch_targets
    from speccheck.engines.base import padded_size

    assert capture_sizes(0)[:6] == (1, 2, 4, 8, 16, 24) and capture_sizes(0)[-1] == 64
    assert batch_targets(capture_sizes(7), 8) == [31, 32, 33, 34, 35]
    assert padded_size(33 * 8, capture_sizes(7)) == 34 * 8 and padded_size(65 * 8, capture_sizes(7)) is None


@pytest.mark.slow
def test_concurrency_in_fp32_gives_the_tokens_alone(corpus, inputs):
    """fp32's GEMMs are not row-invariant: the tokens are those alone, logprobs within 1e-4."""
    eng = ReferenceEngine(engine_args={"threads": "1", "dtype": "fp32"})
    for config in (SpecConfig(), SpecConfig("mtp", 3)):
        ps = list(corpus.prompts)
        ref = {c.prompt_id: c for c in eng.generate(ps, [inputs[p.id].tolist() for p in ps], config, 5)}
        res = eng.run_workload(_build("concurrency", "8", corpus, inputs, config), config, 5)
        for c in res.completions:
            a = ref[c.prompt_id.rsplit(":", 1)[1]]
            assert c.token_ids.tolist() == a.token_ids.tolist(), (config.name, c.prompt_id)
            np.testing.assert_allclose(c.logprobs, a.logprobs, atol=1e-4)
        assert res.proof["max_batch"] > 4


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_prefix_cache_hit_is_a_miss_and_near_cold(corpus, inputs, alone, config):
    """Conversations (turn 2 = turn 1 + its answer + new text), a poison prefix and the probe:
    with the cache on, a hit restores the K/V and the GDN + conv state a miss computed at the
    block boundary, so it gives the miss's bits; a miss prefills in pieces ending at block
    boundaries (to keep their state), not the same sum as one prefill, so against the cache off
    the comparison is classified: no divergence beyond a near-tie."""
    outputs = {k: v.token_ids for k, v in alone(config).items()}
    eng = ReferenceEngine(engine_args={"threads": "1"})  # an empty prefix cache
    cold = eng.run_workload(_build("prefix_cache", "cold", corpus, inputs, config, outputs), config, 5)
    hit = eng.run_workload(_build("prefix_cache", "hit", corpus, inputs, config, outputs), config, 5)
    assert "prefix_hits" not in cold.proof
    assert hit.proof["prefix_hits"] > 0 and hit.proof["prefix_hit_tokens"] >= 16 * hit.proof["prefix_hits"]
    fresh = ReferenceEngine(engine_args={"threads": "1"}).with_args()
    for c, h in zip(cold.completions, hit.completions):
        assert c.prompt_id == h.prompt_id
        assert not _high(c, h), h.prompt_id
        req = next(r for r in _build("prefix_cache", "hit", corpus, inputs, config, outputs).requests
                   if r.id == h.prompt_id)
        miss = fresh.with_args().run_workload(Workload("prefix_cache", "miss", [Request(req.id, req.prompt,
                                              req.prompt_ids)], 1, {"prefix_cache": "on"}), config, 5)
        assert miss.proof["prefix_hits"] == 0
        assert _bits(miss.completions[0]) == _bits(h), h.prompt_id


def _pressured(corpus, inputs, config, max_tokens=40):
    """The first four prompts at 40 tokens past EOS, under a budget of exactly the blocks their
    prompts take: all four are admitted and the first block any of them crosses preempts."""
    ps = [Prompt(p.id, p.category, max_tokens, p.text, p.messages, True) for p in corpus.prompts[:4]]
    reqs = [Request(f"kv:{p.id}", p, tuple(int(t) for t in inputs[p.id])) for p in ps]
    budget = sum(blocks(len(r.prompt_ids) + config.k, 16) for r in reqs)
    return (Workload("kv_pressure", "free", reqs, 4),
            Workload("kv_pressure", "pressure", reqs, 4, {"kv_blocks": str(budget)}))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_kv_pressure_preempts_recomputes_and_keeps_the_tokens(engine, corpus, inputs, config):
    """The newest request is preempted when a step needs more blocks than the budget and
    recomputed later (prompt + its tokens prefilled, then it goes on): the recompute's state
    comes from the prefill path, not decode's, so the comparison is classified; every token
    after the first is still explained by a step (a recompute counts as an iteration)."""
    free_wl, pressure_wl = _pressured(corpus, inputs, config)
    free = engine.run_workload(free_wl, config, 5)
    pressed = engine.run_workload(pressure_wl, config, 5)
    assert "preemptions" not in free.proof
    assert pressed.proof["preemptions"] > 0 and pressed.proof["recomputed_tokens"] > 0
    for a, b in zip(free.completions, pressed.completions):
        assert a.n_tokens == b.n_tokens == 40
        assert not _high(a, b), b.prompt_id
        if not config.is_baseline:
            assert _consistent(b, config.k), b.prompt_id


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_async_scheduling_plans_ahead_and_keeps_the_bits(engine, corpus, inputs, alone, config):
    """With async scheduling the scheduler plans each step before the one in flight has
    reported (placeholders fixed up afterwards, finishes seen a step late): every request
    still gives the bits it gives alone, and the engine says it scheduled ahead."""
    ref = alone(config)
    res = engine.run_workload(_build("async_scheduling", "on", corpus, inputs, config), config, 5)
    off = engine.run_workload(_build("async_scheduling", "off", corpus, inputs, config), config, 5)
    for c in res.completions:
        assert _bits(c) == _bits(ref[c.prompt_id.rsplit(":", 1)[1]]), c.prompt_id
        if not config.is_baseline:
            assert _consistent(c, config.k), c.prompt_id
    p = res.proof
    assert p["async_scheduling"] == 1 and p["steps_scheduled_ahead"] > 0
    # a verify keeps fewer than its K + 1 placeholders whenever a draft is rejected
    assert (p["placeholder_fixups"] > 0) == (not config.is_baseline)
    assert "async_scheduling" not in off.proof and "steps_scheduled_ahead" not in off.proof


def test_chat_thinking_renders_through_the_template_and_proves_it(engine, corpus, inputs):
    """The engine renders each request's messages itself (the ids sent are not used), with
    enable_thinking as the level says, and counts what it rendered from the rendered ids."""
    from speccheck.reference.chat import render

    config = SpecConfig("mtp", 3)
    for level in ("off", "on"):
        wl = _build("chat_thinking", level, corpus, inputs, config)
        res = engine.run_workload(wl, config, 5)
        assert res.proof["chat_rendered"] == len(wl.requests) == len(res.completions)
        assert res.proof["thinking_prompts"] == (len(wl.requests) if level == "on" else 0)
        for r, c in zip(wl.requests, res.completions):
            want = engine.tokenizer.encode(render(r.prompt.messages, level == "on")).ids
            assert c.prompt_ids.tolist() == want
            assert engine.detokenize(want).endswith("<think>\n") == (level == "on")
    text = Workload("chat_thinking", "on", [Request("t", Prompt("t", "x", 4, "plain"), (5, 6))],
                    knobs={"chat_template": "on", "thinking": "on"})
    with pytest.raises(EngineUsageError, match="needs chat messages"):
        engine.run_workload(text, config, 5)
    for knobs in ({"thinking": "on"}, {"chat_template": "on", "thinking": "maybe"}):
        with pytest.raises(EngineUsageError, match="thinking"):
            engine.run_workload(Workload("chat_thinking", "x", wl.requests, None, knobs), config, 5)


def test_long_lived_counts_every_request(corpus, inputs):
    """requests_served counts generate() and workloads alike, since the engine started."""
    eng = ReferenceEngine(engine_args={"threads": "1"})
    ps = list(corpus.prompts)
    eng.generate(ps, [inputs[p.id].tolist() for p in ps], SpecConfig(), 5)
    assert eng.requests_served == len(ps)
    wl = _build("long_lived", "12", corpus, inputs, SpecConfig())
    res = eng.run_workload(wl, SpecConfig(), 5)
    assert res.proof["requests_served"] == eng.requests_served == len(ps) + 12 + len(ps)
    assert res.proof["slot_reuses"] > 0


# ------------------------------------------------------------------ planted faults

def _short(corpus, inputs, config):
    """Every other request a prompt of 1 + K tokens, joining others."""
    reqs = [Request(f"s{i}:{p.id}", p,
                    tuple(int(t) for t in (inputs[p.id][: config.k + 1] if i % 2 else inputs[p.id])),
                    arrive_after=2 * i)
            for i, p in enumerate(corpus.prompts)]
    return Workload("concurrency", "short", reqs, 4)


#: fault -> (config, the workload of its regime)
REGIME = {
    "join-contaminates": (SpecConfig("mtp", 3), lambda c, i, cfg, o: _build("concurrency", "4", c, i, cfg)),
    "padded-row-real": (SpecConfig(), lambda c, i, cfg, o: _batches(c, i, cfg)),
    "slot-residue": (SpecConfig(), lambda c, i, cfg, o: _build("concurrency", "8", c, i, cfg)),
    "prefix-wrong-block": (SpecConfig(), lambda c, i, cfg, o: _build("prefix_cache", "hit", c, i, cfg, o)),
    "short-prompt-verify": (SpecConfig("mtp", 3), lambda c, i, cfg, o: _short(c, i, cfg)),
    "thinking-no-rollback": (SpecConfig("dflash2", 7),
                             lambda c, i, cfg, o: _build("chat_thinking", "on", c, i, cfg)),
    "async-stale-accepted": (SpecConfig("mtp", 3),
                             lambda c, i, cfg, o: _build("async_scheduling", "on", c, i, cfg)),
}


#: faults of an axis with an off level: they show with the switch on only
SWITCHED = {"async-stale-accepted": "async_scheduling", "thinking-no-rollback": "chat_thinking"}


@pytest.mark.parametrize("fault", list(REGIME))
def test_serving_fault_changes_its_regime_only(engine, corpus, inputs, alone, fault):
    """With the fault on, a prompt alone and the corpus all at once give the clean bits (the
    default run stays clean); in its regime the outputs change."""
    config, build = REGIME[fault]
    ps = list(corpus.prompts)
    ids = [inputs[p.id].tolist() for p in ps]
    faulty = engine.with_args(fault=fault)
    for clean_run, faulty_run in ((alone(config).values(), faulty.generate(ps, ids, config, 5)),
                                  (engine.generate_together(ps, ids, config, 5),
                                   faulty.generate_together(ps, ids, config, 5))):
        assert [_bits(c) for c in clean_run] == [_bits(c) for c in faulty_run]
    wl = build(corpus, inputs, config, {k: v.token_ids for k, v in alone(config).items()})
    clean = engine.with_args().run_workload(wl, config, 5).completions  # fresh prefix caches
    bad = faulty.run_workload(wl, config, 5).completions
    changed = [c.prompt_id for c, b in zip(clean, bad) if c.token_ids.tolist() != b.token_ids.tolist()]
    assert changed, f"{fault} left every output of its regime unchanged"
    if fault in SWITCHED:  # and only with the switch on
        off = _build(SWITCHED[fault], "off", corpus, inputs, config)
        assert [_bits(c) for c in engine.run_workload(off, config, 5).completions] == \
            [_bits(c) for c in faulty.run_workload(off, config, 5).completions]


def test_short_prompt_verify_in_generate_needs_1_plus_k_tokens(engine, corpus, inputs):
    """generate() plants it too (vLLM takes any prefill of 1 + K tokens for a verify): a prompt
    of 1 + K tokens (the shapes axis sends them) decodes otherwise, one of K or K + 2 does not."""
    config = SpecConfig("mtp", 3)
    faulty = engine.with_args(fault="short-prompt-verify")
    p = corpus.prompts[0]
    moved = {}
    for n in (3, 4, 5):
        ids = inputs[p.id][:n].tolist()
        want, got = (e.generate([p], [ids], config, 5)[0] for e in (engine, faulty))
        moved[n] = _bits(want) != _bits(got)
    assert moved == {3: False, 4: True, 5: False}
