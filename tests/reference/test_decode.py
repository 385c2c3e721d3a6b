"""Greedy speculative decoding on the reference engine: lossless where numerics are equal,
rejections really happen, every planted fault changes what it says, the engine API."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from speccheck.corpus import load_corpus
from speccheck.engines.base import EngineUsageError
from speccheck.reference.decode import FAULTS
from speccheck.reference.engine import ReferenceEngine
from speccheck.types import Prompt, SpecConfig
from speccheck.verify import counter_problems

#: equal numerics in decode and verify: fp32, recurrent GDN and per-query attention in both
EQUAL = {"dtype": "fp32", "gdn_decode": "recurrent", "gdn_verify": "recurrent",
         "attn_decode": "single", "attn_verify": "single", "threads": "1"}
MAX_TOKENS = 32


def _prompts(n_code: int = 2) -> list[Prompt]:
    ps = list(load_corpus("smoke").prompts) + list(load_corpus("code").prompts)[:n_code]
    return [Prompt(p.id, p.category, MAX_TOKENS, p.text, p.messages) for p in ps]


@pytest.fixture(scope="module")
def equal_engine():
    return ReferenceEngine(engine_args=EQUAL)


@pytest.fixture(scope="module")
def prompts(equal_engine):
    ps = _prompts()
    return ps, [equal_engine.tokenize(p) for p in ps]


@pytest.fixture(scope="module")
def baseline(equal_engine, prompts):
    return equal_engine.generate(*prompts, SpecConfig(), 5)


def _total(cs):
    tot = cs[0].spec
    for c in cs[1:]:
        tot = tot + c.spec
    return tot


@pytest.mark.parametrize("method,k", [("mtp", 1), ("mtp", 3), ("mtp", 7),
                                      ("dflash", 1), ("dflash", 3), ("dflash", 7),
                                      ("dflash", 10)])
def test_lossless_with_equal_numerics(equal_engine, prompts, baseline, method, k):
    out = equal_engine.generate(*prompts, SpecConfig(method, k), 5)
    for spec, base in zip(out, baseline):
        assert spec.token_ids.tolist() == base.token_ids.tolist(), spec.prompt_id
        assert np.allclose(spec.logprobs, base.logprobs, atol=1e-4)
        assert spec.topk_ids.shape == (spec.n_tokens, 5)
    tot = _total(out)
    assert tot.draft_tokens == tot.drafts * k
    assert 0 < tot.accepted_tokens < tot.draft_tokens  # drafts are accepted and rejected
    assert sum(tot.accepted_per_pos) == tot.accepted_tokens
    assert all(a >= b for a, b in zip(tot.accepted_per_pos, tot.accepted_per_pos[1:]))
    for c in out:  # every verify step drafted, and the steps explain the tokens emitted
        s = c.spec
        assert s.iterations == s.drafts and not counter_problems(
            s.drafts, s.draft_tokens, s.accepted_tokens, s.accepted_per_pos, k, c.n_tokens - 1, s.iterations)


@pytest.mark.parametrize("method,k", [("mtp", 3), ("dflash", 7)])
def test_bf16_is_lossless_bit_for_bit_with_equal_forms_on_the_cpu(prompts, method, k):
    """On the CPU every bf16 linear is row-invariant (reference/kernels/cpu_kernels.c), so with
    the same GDN and attention forms in decode and verify a bf16 spec run is the baseline token
    for token and logprob for logprob: what remains of decode-vs-verify flips is the forms."""
    eng = ReferenceEngine(engine_args={**EQUAL, "dtype": "bf16"})
    base = eng.generate(*prompts, SpecConfig(), 5)
    out = eng.generate(*prompts, SpecConfig(method, k), 5)
    for spec, b in zip(out, base):
        assert spec.token_ids.tolist() == b.token_ids.tolist(), spec.prompt_id
        assert np.array_equal(spec.logprobs, b.logprobs), spec.prompt_id
    tot = _total(out)
    assert 0 < tot.accepted_tokens < tot.draft_tokens


def test_completion_fields(baseline, prompts):
    for c, ids in zip(baseline, prompts[1]):
        assert c.prompt_ids.tolist() == ids
        assert 1 <= c.n_tokens <= MAX_TOKENS
        assert c.finish_reason in ("length", "stop")
        assert np.all(c.topk_logprobs[:, :-1] >= c.topk_logprobs[:, 1:])
        assert np.allclose(c.logprobs, c.topk_logprobs[:, 0], atol=1e-6)  # greedy: top-1
        assert c.spec is None and c.ttft_s > 0 and c.text


def test_score_matches_generation(equal_engine, prompts, baseline):
    scored = equal_engine.score(prompts[1], [c.token_ids for c in baseline], 5)
    for s, c in zip(scored, baseline):
        assert s.topk_ids[:, 0].tolist() == c.token_ids.tolist()
        assert np.allclose(s.token_logprobs, c.logprobs, atol=1e-3)


def _differs(a, b) -> bool:
    return any(x.token_ids.tolist() != y.token_ids.tolist() for x, y in zip(a, b))


@pytest.mark.parametrize("fault,method", [("stale-state", "mtp"), ("bonus-off-by-one", "dflash"),
                                          ("accept-top2", "mtp")])
def test_spec_faults_break_losslessness(prompts, baseline, fault, method):
    eng = ReferenceEngine(engine_args={**EQUAL, "fault": fault})
    out = eng.generate(*prompts, SpecConfig(method, 3), 5)
    assert _differs(out, baseline), f"fault {fault} left every output unchanged"
    # the baseline path has no drafts, so no spec fault can touch it
    assert not _differs(eng.generate(*prompts, SpecConfig(), 5), baseline)


def test_state_precision_moves_logprobs_not_the_baseline(prompts, baseline):
    """The carried GDN state rounded to bf16 between verify steps: with numerics otherwise
    equal, spec logprobs drift off the baseline's at many positions (tokens mostly survive);
    the baseline path carries no verify state and is untouched."""
    eng = ReferenceEngine(engine_args={**EQUAL, "fault": "state-precision"})
    out = eng.generate(*prompts, SpecConfig("mtp", 3), 5)
    deltas = [np.abs(s.logprobs[:n] - b.logprobs[:n])
              for s, b in zip(out, baseline)
              for n in [next((i for i, (x, y) in enumerate(zip(s.token_ids, b.token_ids)) if x != y),
                             min(s.n_tokens, b.n_tokens))]]
    d = np.concatenate(deltas)
    # clean, these numerics are lossless to 1e-4 (test_lossless_with_equal_numerics)
    assert np.mean(d > 1e-4) > 0.25 and d.max() > 1e-3, f"only {np.mean(d > 1e-4):.0%} of logprobs moved"
    assert not _differs(eng.generate(*prompts, SpecConfig(), 5), baseline)


def test_accept_top2_accepts_more(equal_engine, prompts):
    clean = _total(equal_engine.generate(*prompts, SpecConfig("mtp", 3), 5))
    eng = ReferenceEngine(engine_args={**EQUAL, "fault": "accept-top2"})
    faulty = _total(eng.generate(*prompts, SpecConfig("mtp", 3), 5))
    assert faulty.accepted_tokens > clean.accepted_tokens


@pytest.mark.slow
def test_nondeterministic_fault_varies_run_to_run():
    eng = ReferenceEngine(engine_args={"fault": "nondeterministic", "threads": "1"})
    ps = [Prompt(p.id, p.category, 48, p.text, p.messages) for p in load_corpus("code").prompts]
    ids = [eng.tokenize(p) for p in ps]
    runs = [eng.generate(ps, ids, SpecConfig(), 5) for _ in range(2)]
    lp_diff = max(float(np.abs(a.logprobs[:min(a.n_tokens, b.n_tokens)]
                                - b.logprobs[:min(a.n_tokens, b.n_tokens)]).max())
                  for a, b in zip(*runs))
    assert lp_diff > 0  # the reduction order really changes numbers between runs


def test_clean_engine_is_deterministic(prompts):
    eng = ReferenceEngine(engine_args={"threads": "1"})
    a = eng.generate(*prompts, SpecConfig("dflash", 7), 5)
    b = eng.generate(*prompts, SpecConfig("dflash", 7), 5)
    for x, y in zip(a, b):
        assert x.token_ids.tolist() == y.token_ids.tolist()
        assert np.array_equal(x.logprobs, y.logprobs)


def test_engine_args_and_api(equal_engine):
    with pytest.raises(EngineUsageError, match="gdn_verify"):
        ReferenceEngine(engine_args={"bogus": "1"})
    with pytest.raises(EngineUsageError, match="chunked, recurrent"):
        ReferenceEngine(engine_args={"gdn_verify": "fast"})
    with pytest.raises(EngineUsageError, match="stale-state"):
        ReferenceEngine(engine_args={"fault": "nope"})
    p = Prompt("x", "code", 4, text="def f():")
    with pytest.raises(EngineUsageError, match="--method"):
        equal_engine.generate([p], [equal_engine.tokenize(p)], SpecConfig("eagle", 3), 5)
    ident = equal_engine.identity()
    for key in ("engine", "model_id", "model_hash", "tokenizer_hash", "dtype", "device", "torch",
                "threads", "knobs", "fault", "speccheck_version"):
        assert key in ident
    assert ident["knobs"]["gdn_verify"] == "recurrent" and ident["dtype"] == "fp32"
    assert equal_engine.default_k("dflash") == equal_engine.cfg.drafter.block_size - 1
    variants = equal_engine.attribution_variants()
    assert "dtype=fp32" not in variants and "gdn=chunked" in variants
    assert {"stale-state", "bonus-off-by-one", "accept-top2", "nondeterministic", "state-precision"} <= set(FAULTS)


@pytest.mark.parametrize("form", ["single", "multi"])
def test_batched_baseline_equals_one_at_a_time(baseline, prompts, form):
    """A batch of prompts of 14..83 tokens, each prefilled alone, then decoded together at
    their own lengths: attention masks every key past a sequence's own position, so in fp32
    every sequence decodes what it decodes alone; only the summation order of batched kernels
    differs."""
    ps, ids = prompts
    eng = ReferenceEngine(engine_args={**EQUAL, "attn_decode": form, "batch": "4"})
    assert len({len(i) for i in ids}) > 2  # really different lengths, so really ragged
    batched = eng.generate(ps, ids, SpecConfig(), 5)
    alone = baseline if form == "single" else ReferenceEngine(
        engine_args={**EQUAL, "attn_decode": form}).generate(ps, ids, SpecConfig(), 5)
    for a, b in zip(alone, batched):
        assert a.token_ids.tolist() == b.token_ids.tolist(), a.prompt_id
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    assert eng.identity()["batch"] == 4


@pytest.mark.parametrize("method,k", [("mtp", 3), ("dflash", 7)])
def test_batched_speculative_is_lossless(equal_engine, baseline, prompts, method, k):
    """A batch of 4 speculating sequences drifts apart (each accepts its own tokens, so each
    keeps its own length and rolls back on its own) and one that stops leaves the batch; in
    fp32 with equal forms every sequence still reproduces the baseline, with the acceptance
    it has alone."""
    ps, ids = prompts
    eng = ReferenceEngine(engine_args={**EQUAL, "batch": "4"})
    batched = eng.generate(ps, ids, SpecConfig(method, k), 5)
    alone = equal_engine.generate(ps, ids, SpecConfig(method, k), 5)
    for a, b, base in zip(alone, batched, baseline):
        assert b.token_ids.tolist() == base.token_ids.tolist(), b.prompt_id
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    per_seq = [(c.spec.drafts, c.spec.accepted_tokens) for c in batched]
    assert len(set(d for d, _ in per_seq)) > 1  # the sequences really drifted apart
    assert _total(batched).accepted_tokens == pytest.approx(_total(alone).accepted_tokens, rel=0.05)


@pytest.mark.parametrize("config", [SpecConfig(), SpecConfig("dflash", 7)])
def test_identical_requests_in_one_batch_give_one_completion(config):
    """N identical requests decoded together (bf16, the default kernels) give one unique
    completion: rows of a batch do not leak into each other."""
    p = _prompts(0)[0]
    eng = ReferenceEngine(engine_args={"batch": "4"})
    ids = eng.tokenize(p)
    out = eng.generate([p] * 4, [ids] * 4, config, 5)
    assert len({tuple(c.token_ids.tolist()) for c in out}) == 1
    assert len({c.logprobs.tobytes() for c in out}) == 1


def test_batch_arg_is_validated():
    with pytest.raises(EngineUsageError, match="batch"):
        ReferenceEngine(engine_args={"batch": "0"})


@pytest.mark.parametrize("config", [SpecConfig(), SpecConfig("mtp", 3), SpecConfig("dflash", 7)])
def test_ignore_eos_decodes_the_full_budget(equal_engine, config):
    """A prompt whose first token is end-of-sequence (the default corpus's OCR invoice on
    the reference model) stops at once; with ignore_eos it decodes its full budget, alone
    and in a batch next to a prompt that does stop, and speculation stays lossless past EOS."""
    eos = equal_engine.cfg.eos_token_id
    ocr = dataclasses.replace(load_corpus("default").get("ocr-invoice"), max_tokens=12,
                              ignore_eos=False)
    ids = equal_engine.tokenize(ocr)
    stops = equal_engine.generate([ocr], [ids], config, 5)[0]
    assert stops.token_ids.tolist() == [eos] and stops.finish_reason == "stop"
    goes_on = dataclasses.replace(ocr, ignore_eos=True)
    alone = equal_engine.generate([goes_on], [ids], config, 5)[0]
    assert alone.n_tokens == 12 and alone.finish_reason == "length" and alone.token_ids[0] == eos
    batch = equal_engine.generate_together([ocr, goes_on], [ids, ids], config, 5)
    assert batch[0].token_ids.tolist() == [eos]
    assert batch[1].token_ids.tolist() == alone.token_ids.tolist()
    if config.is_baseline:
        return
    base = equal_engine.generate([goes_on], [ids], SpecConfig(), 5)[0]
    assert alone.token_ids.tolist() == base.token_ids.tolist()
    assert alone.spec.drafts > 0


@pytest.mark.slow
@pytest.mark.parametrize("batch", ["1", "3"])
def test_prefix_cache_gives_the_bits_of_a_fresh_prefill(prompts, batch):
    """A prompt prefilled before (prefix_cache, the default) decodes to exactly what a fresh
    prefill gives (bf16, the default kernels), whichever config prefilled it first: the
    baseline's prefills serve MTP, DFlash and DFlash2, which need more of the target's
    layers, and a repeat; prefilled once each, not once per config."""
    ps, ids = prompts
    on = ReferenceEngine(engine_args={"threads": "1", "batch": batch})
    off = on.with_args(prefix_cache="off")
    kept = None
    for config in [SpecConfig(), SpecConfig("mtp", 3), SpecConfig("dflash", 7),
                   SpecConfig("dflash2", 7), SpecConfig()]:
        for x, y in zip(on.generate(ps, ids, config, 5), off.generate(ps, ids, config, 5)):
            assert x.token_ids.tolist() == y.token_ids.tolist(), (config.name, x.prompt_id)
            assert x.logprobs.tobytes() == y.logprobs.tobytes(), (config.name, x.prompt_id)
            assert x.topk_logprobs.tobytes() == y.topk_logprobs.tobytes()
            if config.method != "baseline":
                assert x.spec.accepted_per_pos == y.spec.accepted_per_pos
        memo = on.decoder._prefilled
        assert set(memo) == {tuple(i) for i in ids}
        if kept is None:
            kept = {key: entry[1] for key, entry in memo.items()}
        assert all(memo[key][1] is h for key, h in kept.items())  # reused, not recomputed
    assert not off.decoder._prefilled
    assert on.identity()["prefix_cache"] == "on" and off.identity()["prefix_cache"] == "off"


def test_prefix_cache_keeps_a_bounded_number_of_tokens(prompts, monkeypatch):
    """The least recently used prefills go first."""
    from speccheck.reference import decode

    ps, ids = prompts
    monkeypatch.setattr(decode, "PREFIX_CACHE_TOKENS", len(ids[-1]) + len(ids[-2]))
    eng = ReferenceEngine(engine_args={"threads": "1"})
    eng.generate(ps, ids, SpecConfig(), 5)
    assert list(eng.decoder._prefilled) == [tuple(ids[-2]), tuple(ids[-1])]
