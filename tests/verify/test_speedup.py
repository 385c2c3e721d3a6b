"""The speedup model (verify/speedup.py) on constructed timings and counters: its invariants
as properties, exact predictions on noise-free data, the recommendation and its noise call."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speccheck.verify.speedup import (
    RepeatTiming,
    choose_fit_ks,
    conditional_acceptance,
    fit_line,
    speedup_model,
    tau_at,
)


@st.composite
def acceptance_counts(draw, max_k=12):
    """Counters a real drafter can produce: drafts, and accepted per position non-increasing
    and never above drafts."""
    drafts = draw(st.integers(0, 500))
    k = draw(st.integers(1, max_k))
    counts, bound = [], drafts
    for _ in range(k):
        bound = draw(st.integers(0, bound))
        counts.append(bound)
    return drafts, counts


@given(acceptance_counts())
def test_tau_is_monotone_and_bounded(counters):
    drafts, counts = counters
    taus = [tau_at(counts, drafts, k) for k in range(1, len(counts) + 1)]
    assert all(1.0 <= t <= k + 1 + 1e-12 for k, t in enumerate(taus, start=1))
    assert all(b >= a - 1e-12 for a, b in zip(taus, taus[1:]))


@given(acceptance_counts())
def test_conditional_acceptance_multiplies_back_to_the_rates(counters):
    drafts, counts = counters
    q = conditional_acceptance(counts, drafts)
    assert np.all((q >= 0) & (q <= 1))
    if drafts:
        np.testing.assert_allclose(np.cumprod(q), np.asarray(counts) / drafts, atol=1e-12)


def test_tau_needs_the_positions_it_sums():
    with pytest.raises(ValueError, match="K=4"):
        tau_at([5, 3, 1], 10, 4)


@given(st.floats(-5, 5), st.floats(-2, 2), st.lists(st.integers(0, 30), min_size=2, max_size=8, unique=True))
def test_fit_line_recovers_a_line(a, b, xs):
    got = fit_line(xs, [a + b * x for x in xs])
    assert got == pytest.approx((a, b), abs=1e-6)


def test_fit_line_refuses_one_point():
    with pytest.raises(ValueError, match="two distinct"):
        fit_line([3, 3], [1.0, 2.0])


def test_fit_ks_leave_ks_out_to_validate():
    assert choose_fit_ks([1, 2]) == (1, 2)
    assert choose_fit_ks([1, 2, 3]) == (1, 3)
    assert choose_fit_ks(range(1, 8)) == (1, 4, 7)


# --- noise-free synthetic sweeps ------------------------------------------------------------------

def synthetic(ks, counts, drafts, cost, loads=(1.0,), draft_share=None, base_tokens=1000, step_s=0.01):
    """A sweep with exactly known answers: at every K the drafter proposes the same tokens, so a
    K run accepts the first K positions of ``counts`` (out of ``drafts`` steps, each drafting);
    a step costs ``cost(K)`` decode steps; round r runs on a machine ``loads[r]`` times slower
    (every config of a round alike). ``draft_share(K)``: the part of a step spent drafting."""
    base = [RepeatTiming(r, ("p",), (base_tokens,), (base_tokens,), (base_tokens * step_s * load,))
            for r, load in enumerate(loads)]
    per_k = {}
    for k in ks:
        acc = tuple(counts[:k])
        tokens = drafts + sum(acc)
        per_k[k] = [RepeatTiming(r, ("p",), (tokens,), (drafts,), (drafts * cost(k) * step_s * load,), drafts,
                                 None if draft_share is None else draft_share(k) / cost(k), acc)
                    for r, load in enumerate(loads)]
    return base, per_k


@settings(max_examples=60, deadline=None)
@given(acceptance_counts(max_k=10), st.floats(0.8, 2.0), st.floats(0.0, 0.4),
       st.lists(st.floats(0.5, 3.0), min_size=1, max_size=4))
def test_predictions_are_exact_on_noise_free_data(counters, a, b, loads):
    """A line cost and a fixed drafter: the fit Ks predict every other K exactly, whatever the
    load of each round (it cancels in the pairing with the baseline)."""
    drafts, counts = counters
    if drafts == 0 or len(counts) < 3:
        return
    ks = list(range(1, len(counts) + 1))
    base, per_k = synthetic(ks, counts, drafts, lambda k: a + b * k, tuple(loads))
    m = speedup_model("mtp", base, per_k)
    assert m is not None and m.rounds == len(loads)
    assert m.cost_line == pytest.approx((a, b), abs=1e-9)
    for row in m.rows:
        true = tau_at(counts, drafts, row.k) / (a + b * row.k)
        assert row.measured == pytest.approx(true, rel=1e-9)
        assert row.model == pytest.approx(true, rel=1e-9)
        assert row.measured_spread == pytest.approx(0, abs=1e-9)
        if row.k not in m.fit_ks:
            assert row.predicted == pytest.approx(true, rel=1e-9)
            assert row.error == pytest.approx(0, abs=1e-9)
    assert m.max_error is not None and m.max_error < 1e-9


def test_verify_and_draft_costs_are_separated():
    """Verify grows with the K+1 tokens checked, the MTP drafter with the K tokens written."""
    counts, drafts = [80, 60, 40, 25, 15], 100
    def verify(k): return 0.9 + 0.05 * (k + 1)
    def draft(k): return 0.12 * k
    base, per_k = synthetic(range(1, 6), counts, drafts, lambda k: verify(k) + draft(k), (1.0, 1.7),
                            draft_share=draft)
    m = speedup_model("mtp", base, per_k)
    assert m.verify_line == pytest.approx((0.9, 0.05), abs=1e-9)
    assert m.draft_line == pytest.approx((0.0, 0.12), abs=1e-9)
    assert m.row(3).verify_cost == pytest.approx(verify(3))
    assert m.row(3).draft_cost == pytest.approx(draft(3))


def test_recommends_the_modelled_best_and_names_a_clear_winner():
    counts, drafts = [90, 80, 70, 30, 10, 3, 1], 100  # acceptance collapses after position 4
    base, per_k = synthetic(range(1, 8), counts, drafts, lambda k: 1.0 + 0.1 * k, (1.0, 1.3, 0.9))
    m = speedup_model("mtp", base, per_k)
    ranked = sorted(m.rows, key=lambda r: -tau_at(counts, drafts, r.k) / (1.0 + 0.1 * r.k))
    assert (m.recommended, m.runner_up) == (ranked[0].k, ranked[1].k)
    assert m.runner_up is not None and not m.within_noise  # every round agrees, no spread


def test_a_k_slower_than_the_baseline_is_never_recommended():
    counts, drafts = [20, 5, 1], 100  # hardly anything accepted
    base, per_k = synthetic(range(1, 4), counts, drafts, lambda k: 1.3 + 0.2 * k, (1.0, 1.1))
    m = speedup_model("mtp", base, per_k)
    assert all(r.model < 1 and r.measured < 1 for r in m.rows)
    assert m.recommended is None and "faster than the baseline" in m.note


def test_only_eligible_ks_are_recommended():
    counts, drafts = [90, 80, 70, 30, 10], 100
    base, per_k = synthetic(range(1, 6), counts, drafts, lambda k: 1.0 + 0.1 * k, (1.0, 1.2))
    m = speedup_model("mtp", base, per_k, eligible=[1, 2, 4, 5])  # K=3 failed the gate
    assert m.recommended != 3 and m.recommended in (2, 4)
    assert speedup_model("mtp", base, per_k, eligible=[]).recommended is None


def noisy(per_k, factors):
    """The same sweep with the decode seconds of (K, round) scaled by factors[K][round]."""
    return {k: [RepeatTiming(t.repeat, t.prompts, t.tokens, t.iterations,
                             tuple(s * factors.get(k, {}).get(t.repeat, 1.0) for s in t.seconds),
                             t.drafts, t.draft_share, t.accepted_per_pos) for t in ts] for k, ts in per_k.items()}


def test_top_two_within_noise_when_rounds_disagree():
    """A flat optimum (K=4 and K=5 about equal) and round-to-round noise: said plainly."""
    counts, drafts = [90, 80, 70, 45, 27], 100
    base, per_k = synthetic(range(1, 6), counts, drafts, lambda k: 1.0 + 0.12 * k, (1.0, 1.0, 1.0))
    clean = speedup_model("mtp", base, per_k)
    assert (clean.recommended, clean.runner_up, clean.within_noise) == (4, 5, False)
    # K=4 ran undisturbed in round 0 only, K=5 in round 2 only: which is faster hangs on one round
    m = speedup_model("mtp", base, noisy(per_k, {4: {1: 1.06, 2: 1.06}, 5: {0: 1.06, 1: 1.06}}))
    assert {m.recommended, m.runner_up} == {4, 5}
    assert m.within_noise
    assert m.row(4).measured_spread > 0.02


def test_one_round_is_always_within_noise():
    counts, drafts = [90, 80, 70, 30, 10], 100
    base, per_k = synthetic(range(1, 6), counts, drafts, lambda k: 1.0 + 0.1 * k)
    m = speedup_model("mtp", base, per_k)
    assert m.rounds == 1 and m.within_noise


def test_rounds_are_the_repeats_every_config_ran():
    counts, drafts = [90, 80, 70], 100
    base, per_k = synthetic(range(1, 4), counts, drafts, lambda k: 1.0 + 0.1 * k, (1.0, 2.0, 3.0))
    per_k[2] = per_k[2][:2]  # K=2's last repeat is not stored
    assert speedup_model("mtp", base, per_k).rounds == 2
    assert speedup_model("mtp", base, {1: per_k[1]}) is None  # one K: nothing to fit
    assert speedup_model("mtp", [], per_k) is None  # no baseline
    other = [RepeatTiming(t.repeat, ("q",), t.tokens, t.iterations, t.seconds) for t in base]
    assert speedup_model("mtp", base[:1] + other[1:], per_k) is None  # no request in both rounds


# --- from a store: evaluate_suite -> SuiteResult.speedup -> report ---------------------------------

def _store_sweep(tmp_path, cost, counts, cpu=True, rounds=2, ks=(1, 2, 3, 4)):
    """A constructed suite (no engine): baseline and mtp-k*, every prompt decoding the same
    tokens; each verify step of K costs cost(K) decode steps of 10 ms (CPU seconds, when
    ``cpu``; the wall clock of round r runs 1 + r times slower, as on a loaded machine)."""
    from speccheck.store import Store
    from speccheck.types import Completion, RunRecord, SpecConfig, SpecCounters

    suite = Store(tmp_path).suite("t", {"corpus_hash": "h", "engine": "t", "corpus": "c"})

    def completion(pid, k, r):
        if k == 0:
            steps, spec, per_step, emitted = 40, None, 1.0, 40
        else:  # 10 drafted steps, each emitting its accepted tokens + 1 (counts: per 10 steps)
            steps, acc = 10, list(counts[:k])
            spec = SpecCounters(steps, steps * k, sum(acc), acc, iterations=steps, draft_s=0.0)
            per_step, emitted = cost(k), steps + sum(acc)
        tokens = np.arange(5, 6 + emitted)
        ids = np.stack([tokens, tokens + 1], 1)
        lps = np.tile(np.array([-0.1, -4.0], np.float32), (len(tokens), 1))
        cpu_s = steps * per_step * 0.01
        return Completion(pid, [1, 2], tokens, lps[:, 0], ids, lps, decode_s=cpu_s * (1 + r),
                          decode_cpu_s=cpu_s if cpu else None, spec=spec)

    for r in range(rounds):
        for k in (0, *ks):
            cfg = SpecConfig.from_name("baseline" if k == 0 else f"mtp-k{k}")
            suite.write_run(RunRecord(cfg, {"engine": "t", "model_hash": "m"}, "c", "h", r, False,
                                      completions=[completion(p, k, r) for p in ("w", "a", "b")]))
    return suite


def test_a_store_sweep_gets_a_model_on_the_cpu_clock(tmp_path):
    from speccheck.evaluate import evaluate_suite
    from speccheck.policy import Policy
    from speccheck.report import markdown_report

    counts = [8, 6, 4, 2]  # accepted per position, per 10 drafted steps
    suite = _store_sweep(tmp_path, lambda k: 1.2 + 0.1 * k, counts)
    res = evaluate_suite(suite, Policy(require_deterministic=False))
    m = res.speedup["mtp"]
    assert m.clock == "cpu" and m.rounds == 2 and m.fit_ks == (1, 4)
    for row in m.rows:  # the wall clock's load (1 + r) is not in the CPU seconds
        assert row.measured == pytest.approx(tau_at(counts, 10, row.k) / (1.2 + 0.1 * row.k))
        assert row.measured_spread == pytest.approx(0, abs=1e-9)
    assert m.max_error == pytest.approx(0, abs=1e-9)
    text = markdown_report(res)
    assert "## Which K: mtp" in text and "validation: K=2,3 predicted from K=1,4" in text
    assert res.to_dict()["speedup"]["mtp"]["clock"] == "cpu"
    from speccheck.report.html import html_report
    html = html_report(res)
    assert "speedup model, best mtp K: none — no K passes the gate" in html  # not rescored
    assert "recommended mtp: none (no mtp config that passes" in html


def test_a_store_without_cpu_seconds_falls_back_to_the_wall_clock(tmp_path):
    from speccheck.evaluate import evaluate_suite
    from speccheck.policy import Policy

    counts = [8, 6, 4, 2]
    suite = _store_sweep(tmp_path, lambda k: 1.2 + 0.1 * k, counts, cpu=False)
    m = evaluate_suite(suite, Policy(require_deterministic=False)).speedup["mtp"]
    assert m.clock == "wall"
    # each round's load hits baseline and every K alike: paired, it cancels
    assert m.row(2).measured == pytest.approx(tau_at(counts, 10, 2) / 1.4)


def test_a_k_about_as_fast_as_the_baseline_is_said_to_be_within_noise():
    counts, drafts = [30, 10, 2], 100  # tau(1) = 1.3 at a cost of 1.3: as fast as the baseline
    base, per_k = synthetic(range(1, 4), counts, drafts, lambda k: 1.2 + 0.1 * k, (1.0, 1.0, 1.0))
    m = speedup_model("mtp", base, noisy(per_k, {1: {0: 0.97}}))  # the rest of K=1 disturbed 3 %
    assert m.recommended == 1 and m.row(1).measured > 1.0  # on the least disturbed rounds
    assert m.baseline_within_noise  # without round 0 it is no faster
    clear = speedup_model("mtp", *synthetic(range(1, 4), [90, 80, 70], drafts, lambda k: 1.1 + 0.1 * k,
                                            (1.0, 1.2)))
    assert clear.recommended == 3 and not clear.baseline_within_noise
    slow = speedup_model("mtp", *synthetic(range(1, 4), [10, 1, 0], drafts, lambda k: 1.5 + 0.1 * k, (1.0, 1.2)))
    assert slow.recommended is None and not slow.baseline_within_noise


@given(st.lists(st.lists(st.floats(0.01, 10.0), min_size=3, max_size=3), min_size=1, max_size=5),
       st.integers(1, 50), st.floats(1.0, 4.0))
def test_least_disturbed_step_ignores_load_added_to_other_rounds(seconds, steps, extra):
    """Other load only adds time: the estimate is at most any run's own, and adding time to
    any request but the quietest does not move it."""
    from speccheck.verify.speedup import least_disturbed_step

    prompts = tuple(f"p{i}" for i in range(3))
    runs = [RepeatTiming(r, prompts, (steps,) * 3, (steps,) * 3, tuple(s)) for r, s in enumerate(seconds)]
    got = least_disturbed_step(runs)
    assert all(got <= min(t.seconds) / steps + 1e-12 for t in runs)
    quietest = min(((r, i) for r in range(len(runs)) for i in range(3)), key=lambda ri: seconds[ri[0]][ri[1]])
    slowed = [RepeatTiming(t.repeat, prompts, t.tokens, t.iterations,
                           tuple(s if (t.repeat, i) == quietest else s * extra for i, s in enumerate(t.seconds)))
              for t in runs]
    assert least_disturbed_step(slowed) == pytest.approx(got)


def test_the_recommendation_says_plainly_how_sure_it_is():
    from speccheck.report import recommendation_line, speedup_table

    clear = speedup_model("mtp", *synthetic(range(1, 8), [90, 80, 70, 30, 10, 3, 1], 100,
                                            lambda k: 1.0 + 0.1 * k, (1.0, 1.3, 0.9)))
    line = recommendation_line(clear)
    assert line.startswith(f"speedup model, best mtp K={clear.recommended}: ") and "clearly ahead of the runner-up" in line
    table = speedup_table(clear)
    assert "validation: K=2,3,5,6 predicted from K=1,4,7 alone" in table and "max |error| 0.0 %" in table
    assert table.count("| fit |") == 3

    counts, drafts = [90, 80, 70, 45, 27], 100
    base, per_k = synthetic(range(1, 6), counts, drafts, lambda k: 1.0 + 0.12 * k, (1.0, 1.0, 1.0))
    flat = speedup_model("mtp", base, noisy(per_k, {4: {1: 1.06, 2: 1.06}, 5: {0: 1.06, 1: 1.06}}))
    assert "is within noise of it — either will do" in recommendation_line(flat)

    slow = speedup_model("mtp", *synthetic(range(1, 4), [20, 5, 1], 100, lambda k: 1.3 + 0.2 * k, (1.0, 1.1)))
    assert recommendation_line(slow).startswith("speedup model, best mtp K: none — no K is faster than the baseline")


def test_the_emitted_share_falls_with_k_from_what_the_reference_run_emitted():
    from speccheck.verify.speedup import emitted_share

    assert emitted_share(2.2, 2.4, 4, 4) == pytest.approx(2.2 / 2.4)
    assert emitted_share(2.2, 2.4, 4, 0) == 1.0
    assert 2.2 / 2.4 < emitted_share(2.2, 2.4, 4, 2) < 1.0
    assert emitted_share(2.4, 2.4, 7, 3) == 1.0  # nothing cut at the reference: nothing cut below it


def test_cpu_seconds_and_drafting_seconds_survive_the_store(tmp_path):
    """decode_cpu_s and SpecCounters.draft_s are stored and read back; a run stored without
    them (an older speccheck, or an engine that cannot say) reads back as None."""
    from speccheck.store import Store
    from speccheck.types import Completion, RunRecord, SpecConfig, SpecCounters

    suite = Store(tmp_path).suite("t", {"corpus_hash": "h", "engine": "t", "corpus": "c"})
    ids = np.array([[5, 6], [6, 7], [7, 8]], np.int32)
    lps = np.tile(np.array([-0.1, -4.0], np.float32), (3, 1))
    spec = SpecCounters(1, 2, 1, [1, 0], iterations=1, draft_s=0.004)
    with_cpu = Completion("a", [1], [5, 6, 7], lps[:, 0], ids, lps, decode_s=0.03, decode_cpu_s=0.011, spec=spec)
    without = Completion("b", [1], [5, 6, 7], lps[:, 0], ids, lps, decode_s=0.03,
                         spec=SpecCounters(1, 2, 1, [1, 0], iterations=1))
    suite.write_run(RunRecord(SpecConfig("mtp", 2), {"engine": "t"}, "c", "h", 0, False,
                              completions=[with_cpu, without]))
    a, b = suite.load_run("mtp-k2", 0).completions
    assert a.decode_cpu_s == 0.011 and a.spec.draft_s == 0.004
    assert b.decode_cpu_s is None and b.spec.draft_s is None
    assert (a.spec + b.spec).draft_s is None and (a.spec + a.spec).draft_s == pytest.approx(0.008)
