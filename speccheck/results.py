"""What a judged suite is made of: per config its measured figures and the checks' verdicts.

Data only: the figures are measured in :mod:`speccheck.evaluate`, judged by the modules of
:mod:`speccheck.checks`, and rendered by report, gate, golden and the pytest plugin.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from speccheck.verify import (Acceptance, Boundary, Divergence, DriftTest, FlipBudget,
                              PairedDriftTest, RepeatTiming, SameOutputAcceptance, SpeedupModel)


@dataclass
class Check:
    """One check's verdict on one config. ``inconclusive``: a statistical test saw an effect
    beyond its limit at a p between its alpha and its looser look-closer threshold -- not a
    pass (``passed`` is False); `speccheck run` escalates it to more prompts and the gate
    judges it there (speccheck.escalate), and one that stays inconclusive fails."""

    name: str
    passed: bool
    message: str
    skipped: bool = False
    inconclusive: bool = False

    @property
    def state(self) -> str:
        """skip, pass, inconclusive or fail: the word every renderer shows."""
        if self.skipped:
            return "skip"
        if self.passed:
            return "pass"
        return "inconclusive" if self.inconclusive else "fail"


@dataclass
class Speed:
    warm_tok_s: float | None  # median over warm requests (the first request of each run excluded)
    cold_tok_s: float | None  # the first request of the first run
    ttft_s: float | None  # median
    speedup: float | None  # warm tok/s over the baseline's, same suite
    #: per stored repeat, its warm requests' tokens, steps and seconds: the speedup model's
    #: input, in wall seconds and (where every request has them) in the engine's CPU seconds
    repeats: tuple[RepeatTiming, ...] = ()
    cpu_repeats: tuple[RepeatTiming, ...] = ()

    @property
    def cpu_timed(self) -> bool:
        return bool(self.cpu_repeats) and len(self.cpu_repeats) == len(self.repeats)


@dataclass
class Together:
    """The config's run of the whole corpus at once, each prompt ``copies`` times, against
    its first run (one prompt at a time)."""

    copies: int
    requests: int
    prompts: int
    exact: int  # prompts whose first copy equals the prompt alone, token for token
    prefix_agreement: float
    divergences: list[Divergence]  # first copy vs alone
    split: dict[str, int]  # prompt -> distinct completions among its copies, where > 1
    #: where a copy differs from the first copy of its prompt: the split, classified by margin
    split_divergences: list[Divergence] = field(default_factory=list)
    #: the baseline's own run all at once splits copies or changes prompts: the engine is not
    #: batch-invariant at ties with or without speculation (set by evaluate_config)
    baseline_not_invariant: bool = False
    of_baseline: bool = False

    @property
    def high(self) -> list[Divergence]:
        return [d for d in self.divergences if d.classification.cls == "high_confidence"]

    @property
    def not_invariant(self) -> bool:
        """This run itself shows the engine is not batch-invariant."""
        return bool(self.split or self.divergences)


@dataclass
class LogprobConsistency:
    """The spec engine's reported logprobs against the baseline's teacher-forced logprobs of
    the same tokens in the same context (positions where both chose the token): one by one
    against ``limit``, as a distribution against the engine's own kernel-path noise (and the
    golden's sample of this config, when recorded), position by position against the
    baseline's own decode path where both outputs still share context and token (``paired``),
    and the teacher-forced flips against what that noise predicts."""

    positions: int
    limit: float
    over: list[str]  # evidence of the worst positions over the limit
    n_over: int
    drift: DriftTest
    golden_drift: DriftTest | None
    flips: FlipBudget
    paired: PairedDriftTest | None = None
    #: the smallest typical paired ratio the paired test would find (80 % power at its alpha)
    paired_detectable: float | None = None


@dataclass
class ConfigResult:
    config: str
    repeats: int
    failed_runs: list[str]
    identical_runs: bool | None
    nondeterminism: list[str]  # "r1 prompt p3 position 17 (fresh process)"
    prompts: int
    prompts_exact: int
    prefix_agreement: float | None
    token_agreement: float | None  # teacher-forced
    text_similarity: float | None
    divergences: list[Divergence]  # first divergences, free-running
    tf_divergences: list[Divergence]  # teacher-forced disagreements, all positions
    class_counts: dict[str, int]
    attribution: list[dict]
    acceptance: Acceptance | None
    golden_tokens_per_iter: float | None
    speed: Speed
    together: Together | None = None
    logprobs: LogprobConsistency | None = None
    checks: list[Check] = field(default_factory=list)
    #: the suite's sampling settings (types.sampling_of), None for a greedy suite
    sampling: dict | None = None
    #: evidence the store lacks (rescoring absent or short): never read as agreement
    missing_evidence: list[str] = field(default_factory=list)
    #: why the engine's path noise (and so tau) could not be measured; None when it was
    noise_missing: str | None = None
    #: prompts whose spec output stops elsewhere than the baseline's (explained or not)
    boundaries: list[Boundary] = field(default_factory=list)
    #: acceptance against the golden's on the prompts whose output is the golden run's
    golden_same_output: SameOutputAcceptance | None = None
    #: impossible spec counters ("r0 prompt p: ..."), and the run's tokens/iteration three ways
    counter_problems: list[str] = field(default_factory=list)
    counter_views: dict[str, float | None] = field(default_factory=dict)
    #: spec counters identical run to run (None: fewer than 2 runs with counters)
    acceptance_identical: bool | None = None
    acceptance_nondeterminism: list[str] = field(default_factory=list)
    prompt_ids: list[str] = field(default_factory=list)  # the prompts compared with the baseline
    token_agreement_n: int = 0  # teacher-forced positions compared
    missing: list[str] = field(default_factory=list)  # planned or demanded, not stored
    #: figures a check measures for itself (its ``measure`` hook), by check name
    measured: dict[str, object] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        if self.failed_runs:
            return "error"
        states = {c.state for c in self.checks} - {"pass", "skip"}
        return "pass" if not states else ("inconclusive" if states == {"inconclusive"} else "fail")

    def check(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["verdict"] = self.verdict
        return d


@dataclass
class SuiteResult:
    suite: str
    meta: dict
    identity: dict
    noise: float
    tau_tie: float
    tau_low: float
    policy: dict
    configs: list[ConfigResult]
    #: why path noise was not measured (tau then comes from the policy floors); None when it was
    noise_missing: str | None = None
    plan: dict | None = None  # what `speccheck run` recorded it would store (None: older suite)
    #: per method swept over two or more Ks: the speedup model and the K it recommends
    speedup: dict[str, SpeedupModel] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(c.verdict == "pass" for c in self.configs)

    @property
    def engine_failed(self) -> bool:
        return any(c.verdict == "error" for c in self.configs)

    def get(self, name: str) -> ConfigResult:
        for c in self.configs:
            if c.config == name:
                return c
        raise KeyError(name)

    def to_dict(self) -> dict:
        return {"suite": self.suite, "meta": self.meta, "identity": self.identity,
                "noise": self.noise, "noise_missing": self.noise_missing,
                "tau_tie": self.tau_tie, "tau_low": self.tau_low, "policy": self.policy,
                "plan": self.plan, "passed": self.passed,
                "configs": [c.to_dict() for c in self.configs],
                "speedup": {m: asdict(model) for m, model in self.speedup.items()}}

