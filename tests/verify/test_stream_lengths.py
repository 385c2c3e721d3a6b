"""Streams of different lengths -- empty, shorter, longer than the baseline, past an
end-of-sequence token -- through every verify/ entry point and evaluate's comparisons: no
exception, and figures that make sense (fractions in [0, 1], counts that add up). A spec
engine that emits past max_tokens once made `speccheck gate` die with an IndexError."""
from __future__ import annotations

import tempfile

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from speccheck.compare import compare_runs, decoded_context, together_result
from speccheck.evaluate import evaluate_config
from speccheck.evidence import measure_noise
from speccheck.policy import Policy
from speccheck.store import Store
from speccheck.types import Completion, RunRecord, Scored, SpecConfig, SpecCounters
from speccheck.verify import (END, acceptance_mismatches, boundary_divergence, counter_problems,
                              determinism, find_divergences, first_divergence, prefix_agreement,
                              stop_tokens, teacher_forced_agreement, teacher_forced_divergences,
                              text_similarity, unique_completions)

#: this module's example count, on top of the session's profile (conftest.py: ci or dev) -- a
#: profile loaded here would replace that one for every test collected after this module
EXAMPLES = settings(max_examples=60)

V, EOS, K = 8, 7, 3
small = st.lists(st.integers(0, V - 1), max_size=10)


def topk(tokens, margin=0.5):
    """Top-3 rows whose argmax is each token (k = 3)."""
    n = len(tokens)
    ids = np.array([[t, (t + 1) % V, (t + 2) % V] for t in tokens], np.int32).reshape(n, 3)
    lp = np.tile(np.array([-0.2, -0.2 - margin, -4.0], np.float32), (n, 1))
    return ids, lp


def completion(pid, tokens, margin=0.5, spec=None):
    ids, lp = topk(tokens, margin)
    finish = "stop" if tokens and tokens[-1] == EOS else "length"
    return Completion(pid, [1, 2], tokens, lp[:, 0], ids, lp, text=" ".join(map(str, tokens)),
                      finish_reason=finish, ttft_s=0.01, decode_s=0.1, spec=spec)


def detok(ids):
    return "".join(f"<{i}>" for i in ids)


@st.composite
def spec_of(draw, base):
    """A spec stream relative to a baseline: the same, cut short, run on, past its EOS,
    changed somewhere, or anything."""
    how = draw(st.sampled_from(["same", "shorter", "longer", "changed", "any"]))
    if how == "same":
        return list(base)
    if how == "shorter":
        return base[:draw(st.integers(0, len(base)))]
    if how == "longer":
        return base + draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=5))
    if how == "changed" and base:
        i = draw(st.integers(0, len(base) - 1))
        return base[:i] + [(base[i] + 1) % V] + draw(small)
    return draw(small)


@st.composite
def corpora(draw):
    n = draw(st.integers(1, 3))
    base = {f"p{i}": draw(small) for i in range(n)}
    spec = {p: draw(spec_of(t)) for p, t in base.items()}
    return base, spec


def counters_for(tokens, k=K):
    """Counters an honest engine would report for this many tokens (every step drafts K)."""
    left, steps, per, acc = max(len(tokens) - 1, 0), 0, [0] * k, 0
    while left > 0:
        m = min(k, left - 1) if left > 1 else 0
        steps += 1
        acc += m
        for i in range(m):
            per[i] += 1
        left -= m + 1
    return SpecCounters(steps, steps * k, acc, per, steps)


@EXAMPLES
@given(small, small)
def test_stream_functions_take_any_two_lengths(a, b):
    a, b = np.array(a, np.int32), np.array(b, np.int32)
    p = first_divergence(a, b)
    assert p is None or 0 <= p <= min(len(a), len(b))
    pa = prefix_agreement(a, b)
    assert 0 <= pa.matched <= pa.compared == max(len(a), len(b)) and 0.0 <= pa.fraction <= 1.0
    assert unique_completions([a, b]) in (1, 2)
    det = determinism([[a], [b]], [[a.astype(float)], [b.astype(float)]])
    assert det.identical == (p is None)
    assert 0.0 <= text_similarity(" ".join(map(str, a)), " ".join(map(str, b))) <= 1.0


@EXAMPLES
@given(small, small, st.floats(0, 1), st.floats(0, 2))
def test_divergences_and_boundaries_take_any_two_lengths(base, spec, tau_tie, extra):
    tau_low = tau_tie + extra
    b_ids, b_lp = topk(base)
    s_ids, s_lp = topk(spec, margin=0.01)
    divs = find_divergences("p", base, b_ids, b_lp, spec, s_ids, s_lp, tau_tie, tau_low, 0.01,
                            max_gap=tau_low)
    assert len(divs) == (first_divergence(np.array(base), np.array(spec)) is not None)
    for d in divs:
        assert d.cls in ("near_tie", "low_confidence", "high_confidence")
        if END in (d.base_token, d.spec_token):
            assert d.cls == "high_confidence" and len(base) != len(spec)
    # teacher-forced: the baseline scores the spec output (one row per spec token), here
    # preferring the baseline's token where the baseline has one
    scored = np.array(s_ids)
    n = min(len(base), len(spec))
    scored[:n, 0] = np.array(base[:n], np.int32)
    agree = teacher_forced_agreement(np.array(spec, np.int32), scored)
    assert len(agree) == len(spec)
    tfd = teacher_forced_divergences("p", spec, s_ids, s_lp, scored, s_lp, tau_tie, tau_low, 0.01)
    assert [d.position for d in tfd] == np.flatnonzero(~agree).tolist()
    fin = lambda t: "stop" if t and t[-1] == EOS else "length"  # noqa: E731
    stops = stop_tokens([(base, fin(base))])
    bd = boundary_divergence("p", base, fin(base), spec, fin(spec), divs[0] if divs else None, stops)
    if bd is None:
        assert len(base) == len(spec)
    else:
        assert 0 <= bd.position <= max(len(base), len(spec)) and bd.describe()
        assert not (bd.explained and base[:len(spec)] == spec[:len(base)])  # a prefix explains nothing
    if base == spec:
        assert bd is None


@EXAMPLES
@given(small, st.integers(-2, 14))
def test_decoded_context_at_any_position(tokens, pos):
    c = completion("p", tokens)
    text = decoded_context(detok, c, pos)
    assert ("⟨end⟩" in text) == (not 0 <= pos < len(tokens))


@EXAMPLES
@given(st.lists(small, min_size=1, max_size=4))
def test_honest_counters_are_consistent_for_any_length(streams):
    for t in streams:
        c = counters_for(t)
        assert counter_problems(c.drafts, c.draft_tokens, c.accepted_tokens, c.accepted_per_pos, K,
                                emitted=max(len(t) - 1, 0), iterations=c.iterations) == []
    runs = [[counters_for(t) for t in streams]] * 2
    assert acceptance_mismatches([[(x.drafts, x.accepted_tokens) for x in r] for r in runs]) == []


@EXAMPLES
@given(corpora(), st.booleans(), st.booleans())
def test_evaluate_takes_any_lengths(corpus, rescored, with_noise):
    """compare_runs, together_result and evaluate_config on a store of such streams: no
    exception, fractions in [0, 1], counts consistent, and identical streams pass."""
    base, spec = corpus
    base_rec = RunRecord(SpecConfig(), {"engine": "t"}, "c", "h", 0, False,
                         completions=[completion(p, t) for p, t in base.items()])
    spec_comps = [completion(p, t, spec=counters_for(t)) for p, t in spec.items()]
    spec_rec = RunRecord(SpecConfig("mtp", K), {"engine": "t"}, "c", "h", 0, False, completions=spec_comps)

    cmp = compare_runs(base_rec, spec_rec, 0.02, 0.1, 0.01, detok)
    assert cmp.prompts == len(base) and 0 <= cmp.exact <= cmp.prompts
    assert 0 <= cmp.matched <= cmp.compared and 0.0 <= cmp.prefix_agreement <= 1.0
    assert len(cmp.boundaries) <= cmp.prompts

    together = RunRecord(SpecConfig("mtp", K), {"engine": "t"}, "c", "h", -1, False,
                         completions=spec_comps + [completion(p, t) for p, t in base.items()], copies=2)
    tog = together_result(base_rec, together, 0.02, 0.1, 0.01, detok)
    assert tog.prompts == len(base) and 0.0 <= tog.prefix_agreement <= 1.0
    assert all(n == 2 for n in tog.split.values())

    with tempfile.TemporaryDirectory() as d:
        suite = Store(d).suite("t", {"corpus_hash": "h", "engine": "t", "corpus": "c"})
        for r in (0, 1):
            suite.write_run(RunRecord(SpecConfig(), {"engine": "t"}, "c", "h", r, False,
                                      completions=base_rec.completions))
            suite.write_run(RunRecord(SpecConfig("mtp", K), {"engine": "t"}, "c", "h", r, False,
                                      completions=spec_comps))
        suite.write_run(together)
        if rescored:  # the baseline scores each output teacher-forced (its own argmax = the token)
            for name, comps in (("baseline", base_rec.completions), ("mtp-k3", spec_comps)):
                suite.write_rescore(name, 0, [c.prompt_id for c in comps],
                                    [Scored(c.topk_ids, c.topk_logprobs, c.logprobs) for c in comps])
        noise, missing = measure_noise(suite)
        assert (missing is None) == (rescored and any(base.values()))
        res = evaluate_config(suite, "mtp-k3", Policy(), 0.02, 0.1, noise, [base_rec], detok=detok,
                              noise_missing=missing)
        for x in (res.prefix_agreement, res.token_agreement, res.text_similarity):
            assert x is None or 0.0 <= x <= 1.0
        assert 0 <= res.prompts_exact <= res.prompts == len(base)
        assert sum(res.class_counts.values()) <= len(res.divergences) + len(res.tf_divergences)
        names = [c.name for c in res.checks]
        assert "same_stopping" in names and "counters_consistent" in names
        assert res.check("counters_consistent").passed  # honest counters, whatever the lengths
        stopping = res.check("same_stopping")
        if base == spec:
            assert stopping.passed and res.check("divergences_are_low_confidence").passed == rescored
        if any(len(base[p]) != len(spec[p]) and base[p][:len(spec[p])] == spec[p][:len(base[p])]
               for p in base):
            assert not stopping.passed  # one stream a prefix of the other: nothing explains it
        if not rescored:
            assert not res.check("agrees_with_baseline").passed
