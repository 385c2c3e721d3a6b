"""The planted faults' mechanics on the reference engine, below the gate: each hook of
Cache.commit does what its fault says, steps without a draft are lossless and counted, and a
fault changes only what it models (the gate's side is tests/test_gate_faults.py)."""
from __future__ import annotations

import pytest
import torch

from speccheck.corpus import load_corpus
from speccheck.engines.base import EngineUsageError
from speccheck.reference.decode import FAULTS
from speccheck.reference.engine import ReferenceEngine
from speccheck.reference.model import Cache
from speccheck.types import SpecConfig
from speccheck.verify import counter_problems

#: equal numerics in decode and verify, so speculative output must equal the baseline's exactly
EQUAL = {"dtype": "fp32", "gdn_decode": "recurrent", "gdn_verify": "recurrent",
         "attn_decode": "single", "attn_verify": "single"}


@pytest.fixture(scope="module")
def engine():
    return ReferenceEngine(engine_args=EQUAL)


@pytest.fixture(scope="module")
def corpus(engine):
    ps = list(load_corpus("selftest").prompts)
    return ps, [engine.tokenize(p) for p in ps]


@pytest.fixture(scope="module")
def baseline(engine, corpus):
    return engine.generate(*corpus, SpecConfig(), 5)


def _gdn_layers(target):
    return [i for i, layer in enumerate(target.layers) if layer.layer_type == "linear_attention"]


def _verified(target, ids, keep, **commit):
    """A cache that prefilled 14 tokens, verified 6 more and committed ``keep`` of them."""
    c = Cache(len(target.layers), 32)
    target(ids[:, :14], c)
    target(ids[:, 14:20], c, per_position=True)
    c.commit(keep, **commit)
    return c


def _seen(target, ids, n):
    """A cache that only ever saw the first n tokens."""
    c = Cache(len(target.layers), 32)
    target(ids[:, :n], c)
    return c


@torch.no_grad()
def test_commit_fault_hooks(engine):
    """roll_back_conv=False keeps the rejected inputs in the conv window (the GDN state still
    rolls back); state_keep keeps the state at fewer positions than the tokens."""
    target = engine.target
    ids = torch.randint(0, engine.cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3))
    exact, at_16, at_20 = _verified(target, ids, 3), _seen(target, ids, 16), _seen(target, ids, 20)
    conv_kept = _verified(target, ids, 3, roll_back_conv=False)
    lagging = _verified(target, ids, 3, state_keep=[2])
    assert exact.length == conv_kept.length == lagging.length == 17
    for i in _gdn_layers(target):
        assert torch.allclose(conv_kept.gdn[i], exact.gdn[i])
        assert torch.allclose(conv_kept.conv[i], at_20.conv[i], atol=1e-5)  # the rejected inputs
        assert not torch.allclose(conv_kept.conv[i], exact.conv[i])
        assert torch.allclose(lagging.gdn[i], at_16.gdn[i], atol=1e-4, rtol=1e-3)
        assert torch.allclose(lagging.conv[i], at_16.conv[i], atol=1e-5)


@torch.no_grad()
def test_commit_alias_first_gives_every_row_row_0s_state(engine):
    target = engine.target
    gen = torch.Generator().manual_seed(4)
    rows = [torch.randint(0, engine.cfg.vocab_size, (1, n), generator=gen) for n in (12, 15, 9)]
    caches = []
    for ids in rows:
        c = Cache(len(target.layers), 40)
        target(ids, c)
        caches.append(c)
    batch, aliased = Cache.join(caches), Cache.join(caches)
    step = torch.randint(0, engine.cfg.vocab_size, (3, 4), generator=gen)
    for c, alias in ((batch, False), (aliased, True)):
        target(step, c, per_position=True)
        c.commit([2, 4, 1], alias_first=alias)
    for i in _gdn_layers(target):
        assert all(torch.equal(aliased.gdn[i][b], batch.gdn[i][0]) for b in range(3))
        assert not torch.allclose(batch.gdn[i][1], batch.gdn[i][0])
    assert batch.lengths.tolist() == aliased.lengths.tolist() == [14, 19, 10]


def test_steps_without_a_draft_are_lossless_and_counted(engine, corpus, baseline):
    """no_draft_every=2: every other verify step decodes one token without a draft. Output is
    the baseline's; the step counts as an iteration, not a draft, and the counters still
    explain every emitted token."""
    out = engine.with_args(no_draft_every="2").generate(*corpus, SpecConfig("mtp", 3), 5)
    assert [c.token_ids.tolist() for c in out] == [c.token_ids.tolist() for c in baseline]
    for c in out:
        s = c.spec
        if c.n_tokens > 1:
            assert s.iterations in (2 * s.drafts, 2 * s.drafts - 1)  # alternating, drafting first
        assert not counter_problems(s.drafts, s.draft_tokens, s.accepted_tokens,
                                    s.accepted_per_pos, 3, c.n_tokens - 1, s.iterations)


def test_with_args_shares_the_networks_and_only_takes_path_args(engine):
    variant = engine.with_args(fault="stale-state", no_draft_every="3")
    assert variant.target is engine.target and variant.mtp is engine.mtp
    assert variant.knobs.fault == "stale-state" and variant.knobs.no_draft_every == 3
    assert engine.knobs.fault is None and engine.identity()["fault"] == "none"
    assert variant.identity()["fault"] == "stale-state"
    with pytest.raises(EngineUsageError, match="dtype"):
        engine.with_args(dtype="bf16")
    with pytest.raises(EngineUsageError, match="no_draft_every"):
        engine.with_args(no_draft_every="-1")


def test_boundary_faults_emit_past_the_end(engine, corpus, baseline):
    """past-max-tokens and past-eos emit the rest of the step after the stop; the tokens before
    it are the baseline's."""
    ps, ids = corpus
    for fault, finish in (("past-max-tokens", "length"), ("past-eos", "stop")):
        out = engine.with_args(fault=fault).generate(ps, ids, SpecConfig("mtp", 3), 5)
        longer = [(c, b) for c, b in zip(out, baseline) if c.n_tokens > b.n_tokens]
        assert longer, f"{fault}: no output ran past its end"
        for c, b in longer:
            assert b.finish_reason == finish and c.finish_reason == finish
            assert c.token_ids[:b.n_tokens].tolist() == b.token_ids.tolist()
        if fault == "past-max-tokens":
            budget = {p.id: p.max_tokens for p in ps}
            assert all(c.n_tokens > budget[c.prompt_id] for c, _ in longer)


def test_counter_fault_lies_only_in_the_counter(engine, corpus, baseline):
    out = engine.with_args(fault="accepted-counts-bonus").generate(*corpus, SpecConfig("mtp", 3), 5)
    assert [c.token_ids.tolist() for c in out] == [c.token_ids.tolist() for c in baseline]
    for c in out:
        s = c.spec
        assert s.accepted_tokens == sum(s.accepted_per_pos) + s.drafts


@pytest.mark.parametrize("fault,method", [("mtp-stale-hidden", "mtp"), ("dflash-wrong-layer", "dflash")])
def test_acceptance_only_faults_keep_tokens_exact(engine, corpus, baseline, fault, method):
    clean = engine.generate(*corpus, SpecConfig(method, 3), 5)
    out = engine.with_args(fault=fault).generate(*corpus, SpecConfig(method, 3), 5)
    assert [c.token_ids.tolist() for c in out] == [c.token_ids.tolist() for c in baseline]
    accepted = [sum(c.spec.accepted_tokens for c in run) for run in (clean, out)]
    assert accepted[1] < accepted[0]


def test_batch_fault_needs_a_batch(engine, corpus, baseline):
    """batch-aliases-seq0 changes nothing one request at a time, and corrupts the other rows
    of a batch."""
    ps, ids = corpus
    alone = engine.with_args(fault="batch-aliases-seq0").generate(ps, ids, SpecConfig("mtp", 3), 5)
    assert [c.token_ids.tolist() for c in alone] == [c.token_ids.tolist() for c in baseline]
    batched = engine.with_args(fault="batch-aliases-seq0", batch=str(len(ps))).generate(
        ps, ids, SpecConfig("mtp", 3), 5)
    assert batched[0].token_ids.tolist() == baseline[0].token_ids.tolist()
    assert any(c.token_ids.tolist() != b.token_ids.tolist() for c, b in zip(batched[1:], baseline[1:]))


def test_every_fault_documents_the_bug_it_models():
    assert all(doc and len(doc) < 300 for doc in FAULTS.values())


@pytest.mark.slow
def test_prefix_cache_overreach_corrupts_the_next_request_of_the_prompt(engine, corpus, baseline):
    """The first speculative request of a prompt decodes as the clean engine's (it filled the
    prefix cache); its repeat, a prefix hit, starts from the state the first one ended at and
    decodes otherwise; with the prefix cache off there is nothing to reuse, and the clean
    engine's repeat is its first request bit for bit."""
    ps, ids = corpus
    mtp = SpecConfig("mtp", 3)
    faulty = engine.with_args(fault="prefix-cache-overreach")
    first = faulty.generate(ps, ids, mtp, 5)
    again = faulty.generate(ps, ids, mtp, 5)
    clean = engine.with_args()
    want = clean.generate(ps, ids, mtp, 5)
    assert [c.token_ids.tolist() for c in first] == [c.token_ids.tolist() for c in want]
    assert [c.token_ids.tolist() for c in clean.generate(ps, ids, mtp, 5)] == \
        [c.token_ids.tolist() for c in want]
    moved = sum(a.token_ids.tolist() != b.token_ids.tolist() for a, b in zip(again, first))
    assert moved >= len(ps) // 2, moved
    off = faulty.with_args(prefix_cache="off")
    runs = [off.generate(ps, ids, mtp, 5) for _ in range(2)]
    assert [c.token_ids.tolist() for c in runs[1]] == [c.token_ids.tolist() for c in want]


def test_conv_block_boundary_acts_only_across_a_block(engine, corpus, baseline):
    """In equal numerics the faulted speculative output is the baseline's until a verify step
    has crossed a 16-position block (the stale window is read from the next step on), and it
    departs from it on most prompts after that."""
    from speccheck.reference.decode import CONV_BLOCK

    ps, ids = corpus
    got = engine.with_args(fault="conv-block-boundary").generate(ps, ids, SpecConfig("mtp", 3), 5)
    departed = 0
    for p_ids, g, b in zip(ids, got, baseline):
        g, b = g.token_ids.tolist(), b.token_ids.tolist()
        first = next((i for i, (x, y) in enumerate(zip(g, b)) if x != y), None)
        if first is None:
            continue
        departed += 1
        # the cache holds the prompt and all generated tokens but the last: position of token i
        # is len(prompt) + i; a crossing step's own tokens are still right
        assert len(p_ids) + first > (len(p_ids) // CONV_BLOCK + 1) * CONV_BLOCK - 1, (first, len(p_ids))
    assert departed >= len(ps) // 2


@torch.no_grad()
def test_gdn_stale_keeps_the_unrolled_gdn_state_of_its_rows_only(engine):
    """(fault rollback-skipped-at-k-minus-1) gdn_stale keeps, for the rows it marks, the GDN
    state at the end of the forward (the rejected position's update in it); the conv window and
    the other rows roll back."""
    target = engine.target
    gen = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, engine.cfg.vocab_size, (1, n), generator=gen) for n in (12, 15)]
    caches = []
    for ids in rows:
        c = Cache(len(target.layers), 40)
        target(ids, c)
        caches.append(c)
    exact, stale, unrolled = Cache.join(caches), Cache.join(caches), Cache.join(caches)
    step = torch.randint(0, engine.cfg.vocab_size, (2, 4), generator=gen)
    for c, kw in ((exact, {}), (stale, {"gdn_stale": [True, False]}), (unrolled, {"roll_back_gdn": False})):
        target(step, c, per_position=True)
        c.commit([3, 2], **kw)
    for i in _gdn_layers(target):
        assert torch.equal(stale.gdn[i][0], unrolled.gdn[i][0])
        assert not torch.allclose(stale.gdn[i][0], exact.gdn[i][0])
        assert torch.equal(stale.gdn[i][1], exact.gdn[i][1])
        assert torch.equal(stale.conv[i], exact.conv[i])


@pytest.mark.slow
def test_rare_rollback_and_verify_drift_faults_change_only_spec_tokens(engine, corpus, baseline):
    """Both act on the verify path only: the baseline stays exact (verify-drift's factor is off
    outside a verify), and speculative output departs from the exact one somewhere."""
    prompts, ids = corpus
    for fault, cfg in (("rollback-skipped-at-k-minus-1", SpecConfig("mtp", 3)),
                       ("verify-drift", SpecConfig("mtp", 3))):
        faulty = engine.with_args(fault=fault)
        base = faulty.generate(prompts, ids, SpecConfig(), 5)
        assert [c.token_ids.tolist() for c in base] == [c.token_ids.tolist() for c in baseline]
        spec = faulty.generate(prompts, ids, cfg, 5)
        clean = engine.generate(prompts, ids, cfg, 5)
        assert any(not (a.logprobs == b.logprobs).all() or a.token_ids.tolist() != b.token_ids.tolist()
                   for a, b in zip(spec, clean)), fault
