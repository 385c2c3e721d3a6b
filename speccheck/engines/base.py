"""The one small interface every engine implements.

An engine describes itself, turns prompts into token ids, generates greedy completions
under one SpecConfig with top-k logprobs at every position, and scores given token
sequences teacher-forced (prompt logprobs). Everything else in speccheck is
engine-agnostic.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, ClassVar, Sequence

import numpy as np

from speccheck.types import Completion, Prompt, Replay, Scored, SpecConfig, Workload, WorkloadResult


class EngineError(RuntimeError):
    """The engine failed (crash, OOM, server error): exit code 3 territory."""


class EngineUsageError(ValueError):
    """Bad engine options or input (unknown arg, wrong API key, missing model): exit code 2."""


class ScoringUnavailable(EngineError):
    """The engine cannot give trustworthy teacher-forced scores where it runs now (a server
    that speculates); the runner leaves the rescoring to a later run that can, and the gate
    counts the evidence as missing until then."""


#: generate_streaming()'s callback: the tokens one step decided, their logprobs, and the top-k
#: ids and logprobs at each of them (plain lists: [n], [n], [n][k], [n][k])
OnTokens = Callable[[list, list, list, list], None]


#: the tag a chat template opens a model's reasoning with (Qwen3's family and most others)
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def rendered_thinking(with_thinking: str, without: str) -> bool:
    """Whether a chat template rendered thinking mode for a conversation: its rendering with
    ``enable_thinking`` differs from the one without (Qwen3 closes an empty think block when
    it is off; the reference template opens one when it is on), or it leaves a think block
    open for the model. A template that ignores the switch renders both alike: False."""
    i = with_thinking.rfind(THINK_OPEN)
    return with_thinking != without or (i >= 0 and THINK_CLOSE not in with_thinking[i:])


#: workload knobs of the chat-template axis, which every engine that serves it reads itself:
#: ``chat_template=on`` renders each request's messages through the engine's own template
#: (the request's token ids are not used), ``thinking=on|off`` its enable_thinking
CHAT_KNOBS = ("chat_template", "thinking")


def chat_knobs(knobs: dict[str, str]) -> tuple[bool | None, dict[str, str]]:
    """(enable_thinking, or None where no rendering is asked; the other knobs)."""
    rest = {k: v for k, v in knobs.items() if k not in CHAT_KNOBS}
    render, thinking = knobs.get("chat_template"), knobs.get("thinking", "off")
    if render is None:
        if "thinking" in knobs:
            raise EngineUsageError("workload knob thinking without chat_template=on")
        return None, rest
    if render != "on" or thinking not in ("on", "off"):
        raise EngineUsageError(f"workload knobs chat_template={render}, thinking={thinking}: give "
                               "chat_template=on and thinking=on or off")
    return thinking == "on", rest


def vllm_capture_sizes(max_num_seqs: int, tokens_per_request: int = 1,
                       max_num_batched_tokens: int | None = None) -> tuple[int, ...]:
    """The batch sizes, in tokens, vLLM captures a CUDA graph for when the user names none
    (``VllmConfig._set_cudagraph_sizes``, unchanged from 0.26 through 0.33): 1, 2, 4, then
    multiples of 8 below 256 and of 16 from 256, up to min(2 x max_num_seqs x tokens per
    request, 512, max_num_batched_tokens); with speculation (1 + K tokens per request) rounded
    up to multiples of 1 + K (``adjust_cudagraph_sizes_for_spec_decode``), so that a uniform
    verify batch of n requests is n x (1 + K) tokens. The reference engine models this rule;
    the vllm engine predicts the sizes with it before a worker has reported them."""
    q = max(int(tokens_per_request), 1)
    top = min(max_num_seqs * q * 2, 512)
    if max_num_batched_tokens:
        top = min(top, max_num_batched_tokens)
    base = [s for s in [1, 2, 4, *range(8, 256, 8), *range(256, top + 1, 16)] if s <= top]
    if q == 1:
        return tuple(base)
    rounded = sorted({-(-s // q) * q for s in base if -(-s // q) * q <= top})
    return tuple(rounded or ([q] if q <= top else []))


def padded_size(n_tokens: int, capture_sizes: Sequence[int]) -> int | None:
    """The captured size a step of ``n_tokens`` replays, padded up to it; None past the
    largest (the step runs without a graph)."""
    return min((c for c in capture_sizes if c >= n_tokens), default=None)


class Engine(ABC):
    name: ClassVar[str]
    #: run every config in a fresh subprocess (GPU memory and engine state released between
    #: configs); the reference engine runs in-process and uses a fresh process for one repeat.
    fresh_process_per_config: ClassVar[bool] = False
    #: the runner may run the fresh-process repeat of one config alongside the in-process runs
    #: (an engine that uses fewer cores than the machine has, and no device memory to share)
    fresh_process_alongside: bool = False
    #: the engine runs only the one config its server runs (openai): the matrix is exactly what
    #: the user names, without the implicit baseline.
    serves_one_config: ClassVar[bool] = False
    #: set by engines that run calls in worker processes: whether the last generate() ran in a
    #: process of its own (None: the runner knows, it ran in-process or in its own worker)
    last_call_fresh_process: bool | None = None
    #: speculative methods this engine runs besides "baseline"; None = passes any through.
    methods: ClassVar[tuple[str, ...] | None] = ("mtp", "dflash")
    #: attribution variants that may run at once, each an engine of its own (vLLM: a worker
    #: process each, engine arg attribution_jobs); 1 for engines that share one device or core
    attribution_jobs: int = 1

    @classmethod
    def preflight(cls, model: str | None, engine_args: dict[str, str],
                  draft: str | None) -> None:
        """Checks that need no engine start (its arguments, a package it needs), made by
        `speccheck run` before anything is written or torch loads: EngineUsageError."""

    def __init__(self, model: str | None = None, engine_args: dict[str, str] | None = None,
                 draft: str | None = None) -> None:
        self.model = model
        self.engine_args = dict(engine_args or {})
        self.draft = draft

    @abstractmethod
    def identity(self) -> dict:
        """Which engine, model and kernels produced a run. Keys every engine gives (None when
        unknowable): ``engine``, ``model_id``, ``model_hash`` (content hash of the target
        weights), ``tokenizer_hash``, ``dtype``, ``device``; plus the engine's own (version,
        kernel knobs, backends, GPU, ...). Golden check compares model, tokenizer and corpus hashes."""

    @abstractmethod
    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of the prompt exactly as they will be fed to generate()."""

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str: ...

    @abstractmethod
    def generate(self, prompts: Sequence[Prompt], prompt_ids: Sequence[Sequence[int]],
                 config: SpecConfig, top_k: int) -> list[Completion]:
        """Greedy (temperature 0) completions of every prompt under one config, with the
        chosen token's logprob and the top-k at each generated position and spec counters."""

    def generate_streaming(self, prompt: Prompt, prompt_ids: Sequence[int], config: SpecConfig,
                           top_k: int, on_tokens: OnTokens) -> Completion:
        """generate() of one prompt that hands tokens to ``on_tokens`` as they are decided (what
        `speccheck serve` streams). An engine that cannot see its steps hands them all at the end."""
        c = self.generate([prompt], [prompt_ids], config, top_k)[0]
        on_tokens(c.token_ids.tolist(), c.logprobs.tolist(), c.topk_ids.tolist(),
                  c.topk_logprobs.tolist())
        return c

    def generate_together(self, prompts: Sequence[Prompt], prompt_ids: Sequence[Sequence[int]],
                          config: SpecConfig, top_k: int) -> list[Completion]:
        """Like generate(), but every prompt is submitted at once (one batch, or concurrent
        requests) instead of one after another: what a busy server does. Comparing the two
        checks batch-composition invariance; duplicate prompts check that identical
        concurrent requests get one answer. Spec counters may be absent (None) here."""
        raise EngineUsageError(f"the {self.name} engine cannot submit requests together; "
                               "run with --concurrent off")

    #: the workload axes this engine can run (see run_workload); the plan asks only for these
    axes: ClassVar[frozenset[str]] = frozenset()

    def run_workload(self, workload: Workload, config: SpecConfig, top_k: int) -> WorkloadResult:
        """Run a workload axis's requests as a serving engine would: each submitted at its
        arrival step, at most ``max_in_flight`` decoding together (a request that arrives while
        others decode joins the running batch; a finished one frees its slot for the next),
        under ``workload.knobs``; return every completion and the proof read back from the
        engine's own accounting. Only for the axes in ``axes``."""
        raise EngineUsageError(f"the {self.name} engine cannot run the {workload.axis} workload axis")

    @abstractmethod
    def score(self, prompt_ids: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
              top_k: int) -> list[Scored]:
        """Teacher-forced scores of each continuation after its prompt (non-speculative)."""

    def score_sampled(self, prompt_ids: Sequence[Sequence[int]],
                      continuations: Sequence[Sequence[int]]) -> list:
        """The target's sampling distribution at each sampled position, as the distribution
        check reads it: float64 [n, 6] per continuation (verify/sampling_dist.sampled_rows).
        The engine gives only raw teacher-forced logprobs (:meth:`score`, top
        :meth:`sampled_score_top_k`); the sampling transform (this run's temperature, top-k,
        top-p) is applied by speccheck, never by the engine's own sampler code, so a sampler
        bug cannot hide by agreeing with itself. ScoringUnavailable where the engine cannot
        score (a greedy run, a server that speculates)."""
        from speccheck.types import sampling_of
        from speccheck.verify.sampling_dist import sampled_rows

        sp = sampling_of(self.engine_args)
        if sp is None:
            raise ScoringUnavailable("not a sampled run (temperature 0)")
        k = self.sampled_score_top_k()
        scored = self.score(prompt_ids, continuations, top_k=k)
        return [sampled_rows(s.topk_ids, s.topk_logprobs, np.asarray(c, np.int64),
                             sp["temperature"], sp["top_p"], sp["top_k"], self.vocab_size(),
                             s.token_logprobs)
                for s, c in zip(scored, continuations)]

    def sampled_score_top_k(self) -> int:
        """Logprobs per position the sampled positions are scored with (vLLM's default
        ``max_logprobs`` is 20): tokens past them are one tail category."""
        return 20

    def vocab_size(self) -> int | None:
        """Logits per position (the lm head's rows, padding included), where known: it bounds
        the tail's mass under temperature; None leaves the looser bound."""
        return None

    #: replay_acceptance() is implemented (the plan then asks for a replay of each spec config)
    replays_acceptance: ClassVar[bool] = False

    def replay_acceptance(self, config: SpecConfig, prompt_ids: Sequence[Sequence[int]],
                          outputs: Sequence[Sequence[int]],
                          max_tokens: Sequence[int]) -> list[Replay] | None:
        """An independent expectation of acceptance: per request, the verify steps a correct
        engine takes under ``config`` to emit ``outputs`` (each cut at its max_tokens), with
        the drafts each accepts, recomputed by a plain drafter pass of its own (see
        :class:`~speccheck.types.Replay`). None: this engine cannot replay (vLLM, openai).

        Why it exists: at temperature 0 the emitted tokens and the drafter determine every
        step's acceptance, so this predicts the spec counters a run should report. Judged only
        against a recorded golden, a drafter-side bug that lowers acceptance (stale hidden
        states, the wrong aux layer, a perturbed drafter), or a counter that inflates it,
        passes on any corpus without a golden; against the replay it shows on the run itself.
        A replay must never carry the engine's planted fault (``fault`` engine arg): it is
        the expectation the engine under test is judged by."""
        return None

    def attribution_variants(self, configs: Sequence[SpecConfig] = (),
                             ran: dict | None = None) -> dict[str, dict[str, str]]:
        """Alternative kernel-path knob settings (label -> engine args overriding this
        engine's) to re-score a divergent prefix with; empty when the engine has none.
        ``configs``: the speculative configs of the run (an engine may offer their verify
        path as a variant); ``ran``: the identity the attributed baseline run stored (the
        kernels it read back), for an engine that has not run in this process (a resume)."""
        return {}

    def rerun_variants(self, configs: Sequence[SpecConfig] = (),
                       ran: dict | None = None) -> dict[str, dict[str, str]]:
        """The kernel switches to regenerate the baseline with (``--attribution-mode rerun``):
        engine args that change a kernel for the whole run. By default the attribution
        variants; an engine whose variants also name score-only paths leaves those out."""
        return self.attribution_variants(configs, ran)

    @classmethod
    def attribution_server_args(cls, label: str, url: str) -> dict[str, str]:
        """Engine args that re-score on a second server started with other kernel settings
        (``--attribute-with LABEL=URL``); only engines that talk to servers take one."""
        raise EngineUsageError(f"--attribute-with {label}={url}: the {cls.name} engine does not "
                               "talk to a server; use --engine openai, or let the engine's own "
                               "attribution variants run")

    def token_bytes(self, token_id: int) -> bytes | None:
        """The raw bytes a token stands for (byte-level tokenizers), so that a token holding
        part of a UTF-8 character can be shown as ``<0xE3>`` instead of '\ufffd'; None: unknown."""
        return None

    def capture_sizes(self, config: SpecConfig) -> tuple[int, ...]:
        """The batch sizes, in tokens, this engine replays a captured CUDA graph for under
        ``config`` (a step of another size is padded up to the next one): the shapes axis
        sends batches of requests at them and one either side. Empty: none (eager)."""
        return ()

    def cache_block_size(self) -> int:
        """Tokens per KV-cache block (vLLM's block_size; prefix-cache hits and hybrid state are
        kept at block boundaries): the shapes axis probes lengths around it."""
        return 16

    def max_positions(self) -> int | None:
        """Positions the model can hold (prompt + generated); None when the engine cannot tell."""
        return None

    def gpus(self) -> int:
        """GPUs one engine of these arguments holds (TP x PP), all on one node: what an
        executor that places engines (ray) reserves for each of its cells. 0: none."""
        return 0

    def default_k(self, method: str) -> int | None:
        """K to use for ``method`` when the user names none (e.g. block_size - 1 for dflash)."""
        return None

    def close(self) -> None:
        pass
