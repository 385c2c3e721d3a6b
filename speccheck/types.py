"""The few data types every part speaks: Prompt, SpecConfig, Completion, RunRecord.

Nothing downstream of ``engines/`` knows which engine produced a record, so these
types carry everything verify/, report and gate need, and nothing engine-specific
beyond the free-form ``identity`` dict.
"""
from __future__ import annotations

import math

import re
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

METHODS_BUILTIN = ("baseline", "mtp", "dflash", "dflash2")
K_MAX = 32


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    max_tokens: int
    text: str | None = None
    messages: tuple[dict, ...] | None = None  # chat form: ({"role":..., "content":...}, ...)
    #: decode the full max_tokens even past end-of-sequence, so a prompt whose first token
    #: would be EOS still yields tokens to compare (vLLM's ``ignore_eos``)
    ignore_eos: bool = False
    #: which of a sampled run's samples of one prompt this request is (run --samples N gives
    #: each prompt N requests, ids ``<id>#s<j>`` for j >= 1); part of the request's seed
    sample: int = 0
    #: the request's own sampling seed where a client sent one (a server's per-request
    #: ``seed``); None: the engine derives it (types.request_seed)
    seed: int | None = None

    def as_text(self) -> str:
        """The prompt as one plain string (chat messages joined in a simple template)."""
        if self.text is not None:
            return self.text
        parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in self.messages or ()]
        return "".join(parts) + "<|assistant|>\n"


@dataclass(frozen=True)
class SpecConfig:
    """One point of the matrix: a speculative method at one K (or the baseline)."""

    method: str = "baseline"
    k: int = 0
    draft: str | None = None  # path of an external drafter (dflash)

    def __post_init__(self) -> None:
        if self.method == "baseline" and self.k != 0:
            raise ValueError("baseline takes no K")
        if self.method != "baseline" and not (1 <= self.k <= K_MAX):
            raise ValueError(f"K must be in 1..{K_MAX} for method {self.method!r}, got {self.k}")

    @property
    def name(self) -> str:
        return "baseline" if self.method == "baseline" else f"{self.method}-k{self.k}"

    @property
    def is_baseline(self) -> bool:
        return self.method == "baseline"

    @classmethod
    def from_name(cls, name: str, draft: str | None = None) -> "SpecConfig":
        if name == "baseline":
            return cls()
        m = re.fullmatch(r"([a-z0-9_]+)-k(\d+)", name)
        if not m:
            raise ValueError(f"not a config name: {name!r} (expected 'baseline' or e.g. 'mtp-k7')")
        return cls(m.group(1), int(m.group(2)), draft)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class SpecCounters:
    """Speculative-decoding counters for one request (or summed over many)."""

    drafts: int = 0  # verify iterations that carried a draft
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted count at draft position i
    #: verify steps the engine ran for the request, with and without a draft (None where the
    #: engine cannot say, e.g. a server's /metrics): what tokens/iteration is checked against
    iterations: int | None = None
    #: seconds of the request's decode_s spent drafting (None where the engine cannot say):
    #: what separates the drafter's cost from the target's verify cost in the speedup model (a
    #: timing, not a count: two runs with equal counters are equal)
    draft_s: float | None = field(default=None, compare=False)
    #: requests the counters cover: 1, or the n samples of one vLLM request (they decode
    #: together and share the engine's counters, which the first sample's completion carries)
    requests: int = field(default=1, compare=False)

    def __add__(self, other: "SpecCounters") -> "SpecCounters":
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        a = self.accepted_per_pos + [0] * (n - len(self.accepted_per_pos))
        b = other.accepted_per_pos + [0] * (n - len(other.accepted_per_pos))
        return SpecCounters(
            self.drafts + other.drafts,
            self.draft_tokens + other.draft_tokens,
            self.accepted_tokens + other.accepted_tokens,
            [x + y for x, y in zip(a, b)],
            None if self.iterations is None or other.iterations is None
            else self.iterations + other.iterations,
            None if self.draft_s is None or other.draft_s is None else self.draft_s + other.draft_s,
            self.requests + other.requests,
        )

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Completion:
    """One prompt, one run. Arrays: n generated positions, top-k of width k (k >= 2)."""

    prompt_id: str
    prompt_ids: np.ndarray  # int32 [p]   the exact input token ids
    token_ids: np.ndarray  # int32 [n]
    logprobs: np.ndarray  # float32 [n]  logprob of the chosen token
    topk_ids: np.ndarray  # int32 [n, k]  sorted by logprob, descending
    topk_logprobs: np.ndarray  # float32 [n, k]
    text: str = ""
    finish_reason: str = "length"
    ttft_s: float = 0.0
    decode_s: float = 0.0
    spec: SpecCounters | None = None
    #: CPU seconds of the engine's process during decode, where they measure the decode's own
    #: work (a CPU engine on one thread; None elsewhere): on a machine shared with other load
    #: they are what an idle machine's wall clock would show, so the speedup model prefers them
    decode_cpu_s: float | None = None

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, dtype=np.int32)
        self.token_ids = np.asarray(self.token_ids, dtype=np.int32)
        self.logprobs = np.asarray(self.logprobs, dtype=np.float32)
        self.topk_ids = _rows(self.topk_ids, len(self.token_ids), np.int32)
        self.topk_logprobs = _rows(self.topk_logprobs, len(self.token_ids), np.float32)

    @property
    def n_tokens(self) -> int:
        return int(len(self.token_ids))


def _rows(a, n: int, dtype) -> np.ndarray:
    """As an [n, k] array (an empty one keeps its width, or gets width 0)."""
    a = np.asarray(a, dtype=dtype)
    if a.ndim == 2 and a.shape[0] == n:
        return a
    return a.reshape(n, -1) if n else a.reshape(0, a.shape[-1] if a.ndim == 2 else 0)


@dataclass
class Scored:
    """Teacher-forced scores of a given continuation: at each continuation position, the
    scoring engine's own top-k and the logprob it gives the forced token."""

    topk_ids: np.ndarray  # int32 [n, k]
    topk_logprobs: np.ndarray  # float32 [n, k]
    token_logprobs: np.ndarray  # float32 [n]

    def __post_init__(self) -> None:
        self.token_logprobs = np.asarray(self.token_logprobs, dtype=np.float32)
        self.topk_ids = _rows(self.topk_ids, len(self.token_logprobs), np.int32)
        self.topk_logprobs = _rows(self.topk_logprobs, len(self.token_logprobs), np.float32)


@dataclass
class Replay:
    """The acceptance one request should have had, replayed from its own emitted tokens by an
    independent drafter pass (Engine.replay_acceptance): per verify step, in order, how many
    of the K drafts were accepted, and how firmly the drafter decided that step.

    At temperature 0 a step accepts the longest prefix of its drafts equal to the next emitted
    tokens, so given the tokens the drafter alone fixes every step; a replay differs from the
    engine's counters only through the drafter's numerics at near-ties (small margins) or a
    bug on either side."""

    k: int
    #: int32 [n_steps]: drafts accepted at each step (0..k); -1 for a step without a draft
    #: (engine arg no_draft_every): it emits one token and counts as an iteration only
    accepted: np.ndarray
    #: float32 [n_steps]: the drafter's top-1 minus top-2 score (nats) at the step's first
    #: rejected slot, the one that decided it; +inf when all k were accepted; NaN: no draft
    margins: np.ndarray
    #: float32 [n_steps]: the smallest such margin over every slot the step's outcome rests on
    #: (each accepted slot and the rejected one): how near the step came to another count
    min_margins: np.ndarray

    def __post_init__(self) -> None:
        self.accepted = np.asarray(self.accepted, dtype=np.int32).reshape(-1)
        n = len(self.accepted)
        self.margins = np.asarray(self.margins, dtype=np.float32).reshape(n)
        self.min_margins = np.asarray(self.min_margins, dtype=np.float32).reshape(n)

    @property
    def n_steps(self) -> int:
        return len(self.accepted)

    @property
    def drafted(self) -> np.ndarray:
        """bool [n_steps]: the steps that carried a draft."""
        return self.accepted >= 0

    @property
    def counters(self) -> SpecCounters:
        """The spec counters these steps imply (what a correct engine reports; no draft_s)."""
        a = self.accepted[self.drafted]
        return SpecCounters(drafts=len(a), draft_tokens=len(a) * self.k,
                            accepted_tokens=int(a.sum()),
                            accepted_per_pos=[int((a > i).sum()) for i in range(self.k)],
                            iterations=self.n_steps)


#: where a config's runs are stored (a run's "slot"): repeat i of the corpus one prompt at a time
#: is slot i (0, 1, ...); the corpus all at once is TOGETHER; a workload axis at one level is
#: the string :func:`axis_slot` names
TOGETHER = -1


def axis_slot(axis: str, level: str) -> str:
    """The slot of one workload axis at one level: ``axis-<axis>-<level>``."""
    return f"axis-{axis}-{level}"


def slot_label(slot: int | str) -> str:
    """How messages name a run: ``r0``, ``all at once``, ``axis shapes (lengths)``."""
    if isinstance(slot, str):
        _, axis, level = slot.split("-", 2)
        return f"axis {axis} ({level})"
    return "all at once" if slot == TOGETHER else f"r{slot}"


@dataclass
class RunRecord:
    """One stored run of a suite -- a repeat, the corpus all at once, or a workload axis at one
    level: what ran, on what, and what came out."""

    config: SpecConfig
    identity: dict[str, Any]
    corpus: str
    corpus_hash: str
    repeat: int
    fresh_process: bool
    status: str = "ok"  # "ok" | "failed"
    error: str | None = None
    completions: list[Completion] = field(default_factory=list)
    wall_s: float = 0.0
    #: 0 for a run of the corpus one prompt at a time; N >= 1 for the run of the whole corpus
    #: at once with every prompt N times (copy-major: all prompts, then all again, ...), the
    #: batch-composition and concurrent-request variant of determinism (slot TOGETHER)
    copies: int = 0
    #: a workload axis's run: its axis and level, and the proof read back from the engine that
    #: the workload exercised what it was for (completions are per request, not per prompt)
    axis: str = ""
    level: str = ""
    proof: dict[str, Any] = field(default_factory=dict)

    @property
    def slot(self) -> int | str:
        """Where this run is stored among its config's runs."""
        if self.axis:
            return axis_slot(self.axis, self.level)
        return TOGETHER if self.copies else self.repeat

    def corpus_copy(self, j: int) -> list[Completion]:
        """The j-th copy of the corpus in a run with ``copies`` (the whole run if 0)."""
        if not self.copies:
            return list(self.completions)
        n = len(self.completions) // self.copies
        return self.completions[j * n:(j + 1) * n]

    def by_prompt(self) -> dict[str, Completion]:
        return {c.prompt_id: c for c in self.completions}

    @property
    def label(self) -> str:
        """How messages name this run: ``r0``, ``r1``, ..., ``all at once`` or ``axis ...``."""
        return slot_label(self.slot)

    @property
    def fresh_note(self) -> str:
        """What was new for this run ('' if nothing): a process of its own, or, against a
        server (which keeps its state across repeats), only the client."""
        if not self.fresh_process:
            return ""
        return "new client, same server" if self.identity.get("base_url") else "fresh process"

    def spec_total(self) -> SpecCounters | None:
        counters = [c.spec for c in self.completions if c.spec is not None]
        if not counters:
            return None
        total = counters[0] + SpecCounters(iterations=0, draft_s=0.0, requests=0)  # a copy; iterations, draft_s kept (or None)
        for c in counters[1:]:
            total = total + c
        return total


@dataclass(frozen=True)
class Request:
    """One request of a workload: its own id, the prompt it asks, and when it arrives."""

    id: str  # unique in the workload (the completion's prompt_id), e.g. "c8/03:code-2"
    prompt: Prompt
    prompt_ids: tuple[int, ...]
    #: engine steps after the workload starts before this request is submitted (0: at once):
    #: requests that arrive while others decode join a running batch
    arrive_after: int = 0
    #: a conversation's turns run in order, each after the one before has finished
    after: str | None = None


@dataclass
class Workload:
    """What a workload axis asks an engine to do: requests (arriving at their steps), at most
    ``max_in_flight`` at once, under the engine settings the axis needs (``knobs``, e.g. a
    prefix cache on, a KV block budget). The engine answers with a WorkloadResult."""

    axis: str  # "concurrency", "prefix_cache", "kv_pressure", ...
    level: str  # "8", "turns", "budget-64", ...
    requests: list[Request]
    max_in_flight: int | None = None
    knobs: dict[str, str] = field(default_factory=dict)


@dataclass
class WorkloadResult:
    """One completion per request (prompt_id = request id) and the proof, read back from the
    engine's own accounting, that the workload exercised what it was for: e.g. ``max_batch``
    (most requests in one step), ``mixed_steps`` (steps that prefilled while others decoded),
    ``prefix_hits`` (prompt tokens served from the prefix cache), ``preemptions``,
    ``requests_served``. A key the engine cannot read back is absent, never 0."""

    completions: list[Completion]
    proof: dict[str, Any] = field(default_factory=dict)


#: the engine args that say how a run samples (``speccheck run --temperature`` etc. set them);
#: being engine args they are part of the suite's identity, so a sampled suite never mixes
#: with a greedy one
SAMPLING_ARGS = ("temperature", "top_p", "sample_top_k", "seed", "samples")


def sampling_of(engine_args: dict | None) -> dict | None:
    """The run's sampling settings from its engine args, or None for a greedy run
    (temperature absent or 0)."""
    args = engine_args or {}
    try:
        t = float(args.get("temperature") or 0)
    except (TypeError, ValueError):
        return None
    if t <= 0:
        return None
    return {"temperature": t, "top_p": float(args.get("top_p") or 1.0),
            "top_k": int(args.get("sample_top_k") or 0), "seed": int(args.get("seed") or 0),
            "samples": max(1, int(args.get("samples") or 1))}


#: the highest temperature a run may ask for (far past it every token is as likely as any)
MAX_TEMPERATURE = 100.0
#: seeds are what every engine takes without overflow (numpy's and vLLM's unsigned 32 bits)
MAX_SEED = 2 ** 32 - 1
MAX_SAMPLES = 64


def sampling_problem(engine_args: dict | None) -> str | None:
    """What is wrong with a run's sampling engine args (``temperature``, ``top_p``,
    ``sample_top_k``, ``seed``, ``samples``), or None: each a finite number in its range, so
    that a NaN (which compares false with every bound) never reaches an engine."""
    args = engine_args or {}

    def number(key: str, whole: bool) -> float | None:
        if key not in args:
            return None
        try:
            x = float(args[key]) if not whole else int(str(args[key]).strip())
        except (TypeError, ValueError):
            raise _Bad(key) from None
        if not math.isfinite(x):
            raise _Bad(key)
        return x

    try:
        t, p = number("temperature", False), number("top_p", False)
        k, seed, n = number("sample_top_k", True), number("seed", True), number("samples", True)
        for key, x, ok in (("temperature", t, lambda v: 0 <= v <= MAX_TEMPERATURE),
                           ("top_p", p, lambda v: 0 < v <= 1), ("sample_top_k", k, lambda v: 0 <= v < 2 ** 31),
                           ("seed", seed, lambda v: 0 <= v <= MAX_SEED), ("samples", n, lambda v: 1 <= v <= MAX_SAMPLES)):
            if x is not None and not ok(x):
                raise _Bad(key)
    except _Bad as e:
        key = str(e)
        return (f"{key}={args[key]!r}: sampling takes a temperature from 0 to {MAX_TEMPERATURE:g} (0: greedy), "
                f"0 < top_p <= 1, a whole sample_top_k >= 0 (0: every token), a whole seed from 0 to "
                f"{MAX_SEED} and samples from 1 to {MAX_SAMPLES}, each a finite number")
    return None


class _Bad(ValueError):
    pass


def request_seed(seed: int, config: str, prompt_ids, sample: int = 0) -> int:
    """A sampled request's own seed: a 31-bit digest of the run's seed, the config that runs
    it and the prompt's token ids, plus which of the prompt's samples it is (sample j of a
    prompt is seed + j, as vLLM seeds the j-th of ``n`` samples of one seeded request).

    The config is mixed in so that the spec config's samples and the baseline's are
    independent draws: with one seed per prompt for both, a lossless engine would draw the
    first token (on the reference engine, much more) from the same random numbers in both,
    and the two-sample check would compare a seed with itself. Repeats of one config keep
    their seeds, so seeded determinism is still checked run to run and in a fresh process."""
    import hashlib

    text = ",".join(map(str, [int(seed), config, *map(int, prompt_ids)]))
    base = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") & 0x7FFFFFFF
    return base + int(sample)
