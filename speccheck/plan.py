"""The plan: which configs, repeats and runs a suite holds, built from the options a user gives
(`speccheck run`, ``pytest -m spec``, :func:`speccheck.run`) and checked before any engine starts."""
from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from speccheck.axes import get as get_axis
from speccheck.axes import registry as axes_registry
from speccheck.config import MatrixError, build_matrix
from speccheck.corpus import Corpus, load_corpus
from speccheck.engines import RUN_ONLY_ARGS, EngineUsageError, engine_class, engine_names
from speccheck.store import suite_id
from speccheck.types import SpecConfig, axis_slot, sampling_of, sampling_problem
from speccheck.version import __version__, release


class PlanError(ValueError):
    """An option that cannot make a plan (exit code 2)."""


#: the largest numeric level an axis takes (requests at once; requests in one long-lived session)
AXIS_LEVEL_MAX = {"concurrency": 4096, "long_lived": 100_000}
#: the axes whose levels are numbers (of requests); every other axis has its named levels only
NUMBERED_AXES = ("concurrency", "long_lived")


def parse_axes(spec: str | None, supported: frozenset[str]) -> tuple[str, ...]:
    """``--axes``: "default" (every axis the engine runs, at its default levels), "none", or
    a comma list of axes, each optionally with levels (``concurrency=4+8+32``, ``long_lived=500``).
    An axis the engine cannot run is refused by name, never dropped."""
    runnable = [a for a in axes_registry() if any(a.runnable(lv, supported) for lv in a.levels)]
    if spec is not None and not spec.strip():  # an empty shell variable is not a choice
        raise PlanError("--axes '': give default (every axis the engine runs), none, or axes with "
                        "levels, e.g. 'concurrency=4+8,long_lived=500' (see `speccheck axes`).")
    if spec in (None, "default"):
        return tuple(axis_slot(a.name, lv) for a in runnable for lv in a.levels
                     if a.runnable(lv, supported))
    if spec == "none":
        return ()
    slots = []
    for item in spec.split(","):
        name, _, levels = item.strip().partition("=")
        try:
            axis = get_axis(name)
        except KeyError:
            raise PlanError(f"--axes {item!r}: no axis {name!r}; the axes: "
                            f"{', '.join(a.name for a in axes_registry())} (or default / none).") from None
        if axis not in runnable:
            raise PlanError(f"--axes {item!r}: this engine cannot run the {name} axis (it runs: "
                            f"{', '.join(a.name for a in runnable)}); leave it out.")
        if _ and not levels:
            raise PlanError(f"--axes {item!r}: no level after '='; give levels (e.g. "
                            f"{name}={'+'.join(axis.levels)}) or the axis name alone for its defaults.")
        for level in (levels.split("+") if levels else [lv for lv in axis.levels if axis.runnable(lv, supported)]):
            if not level or "-" in level:
                raise PlanError(f"--axes {item!r}: a level is a word or a number without '-', e.g. {name}=8.")
            if name in NUMBERED_AXES and not level.isdigit():
                raise PlanError(f"--axes {item!r}: the {name} levels are numbers of requests, e.g. {name}=8.")
            if name not in NUMBERED_AXES and level not in axis.levels:  # a typo must not run as another level
                raise PlanError(f"--axes {item!r}: the {name} axis has the levels {', '.join(axis.levels)}; "
                                f"{level!r} is not one of them.")
            if not axis.runnable(level, supported):
                raise PlanError(f"--axes {item!r}: this engine cannot run the {name} axis's {level} "
                                f"level (it runs {'+'.join(lv for lv in axis.levels if axis.runnable(lv, supported))}).")
            if level.isdigit() and not 1 <= int(level) <= AXIS_LEVEL_MAX.get(name, 1 << 20):
                raise PlanError(f"--axes {item!r}: level {level} is out of range: the {name} axis takes "
                                f"1 to {AXIS_LEVEL_MAX.get(name, 1 << 20)} (requests at once, or in one "
                                "session); a larger one would run for hours, not find more.")
            slots.append(axis_slot(name, level))
    return tuple(dict.fromkeys(slots))


@dataclass
class RunPlan:
    """Everything that identifies a suite plus what to run in it."""

    engine: str = "reference"
    model: str | None = None
    draft: str | None = None
    engine_args: dict[str, str] = field(default_factory=dict)
    corpus: str = "default"
    configs: list[SpecConfig] = field(default_factory=lambda: [SpecConfig()])
    repeats: int = 2
    top_k: int = 5
    fresh_process_repeat: bool = True  # the last repeat runs in a fresh process
    rescore: bool = True
    attribute: bool = True
    #: N > 0: per config, also one run of the whole corpus at once with every prompt N times
    #: (batch-composition invariance; N identical concurrent requests give one completion)
    concurrent: int = 0
    #: label -> URL of a second server with other kernel settings to attribute with
    #: (openai engine; not part of the suite's identity)
    attribute_with: dict[str, str] = field(default_factory=dict)
    #: max_tokens of prompts from corpora that carry none (Spec-Bench's question.jsonl)
    max_tokens: int | None = None
    #: decode every prompt's full max_tokens past end-of-sequence (part of the suite identity)
    ignore_eos: bool = False
    #: globs over the engine's kernel-path labels to attribute with (empty: all of them);
    #: each path costs an engine start, so a user on a real engine picks the ones they need
    attribution_paths: tuple[str, ...] = ()
    #: "rescore": re-score each divergent prefix under each kernel path (one call per path);
    #: "rerun": regenerate the divergent prompts' baseline with one switch flipped per path and
    #: read the token at the divergent position (slower; follows the path the run took)
    attribution_mode: str = "rescore"
    #: run repeat 0 of every config, then repeat 1, ... (a sweep: a drift in machine load then
    #: hits every config of a round alike, instead of all repeats of one config)
    round_robin: bool = False
    #: workload axes to drive, as slots ("axis-<axis>-<level>"; see speccheck/axes/), and on
    #: which configs: "default" (the baseline and each method's largest K) or "all"
    axes: tuple[str, ...] = ()
    axes_on: str = "default"
    #: where the cells run (speccheck/executors/): "local" (this process, one run after another)
    #: or "ray" (each cell a Ray task); ``address``: the Ray cluster's (None: Ray's own default,
    #: RAY_ADDRESS or a Ray started on this machine). Not part of the suite's identity.
    executor: str = "local"
    address: str | None = None
    #: whether running the plan points LATEST at its suite (False for an escalation's suite,
    #: judged through the suite the user ran, which LATEST keeps naming meanwhile)
    moves_latest: bool = True

    def axis_configs(self) -> list[SpecConfig]:
        """The configs the axes run on: the baseline and, per method, its largest K (the
        default: where speculation does the most, against what it is judged by), or all."""
        if not self.axes:
            return []
        if self.axes_on == "all":
            return list(self.configs)
        largest: dict[str, SpecConfig] = {}
        for c in self.configs:
            if not c.is_baseline and (c.method not in largest or c.k > largest[c.method].k):
                largest[c.method] = c
        return [c for c in self.configs if c.is_baseline or largest.get(c.method) == c]

    def suite_meta(self, corpus: Corpus) -> dict:
        return {"engine": self.engine, "model": self.model, "draft": self.draft,
                "engine_args": self.engine_args, "corpus": corpus.name, "corpus_hash": corpus.hash,
                "ignore_eos": self.ignore_eos, "top_k": self.top_k, "speccheck_version": __version__}

    def load_corpus(self) -> Corpus:
        """The corpus; with ``ignore_eos`` every prompt decodes its full budget."""
        corpus = load_corpus(self.corpus, self.max_tokens)
        n = (sampling_of(self.engine_args) or {}).get("samples", 1)
        if n > 1:  # N samples per prompt, each its own request with its own seed
            corpus = replace(corpus, prompts=[replace(p, id=f"{p.id}#s{j}" if j else p.id, sample=j)
                                              for p in corpus.prompts for j in range(n)])
        if not self.ignore_eos:
            return corpus
        return replace(corpus, prompts=[replace(p, ignore_eos=True) for p in corpus.prompts])

    def run_args(self) -> list[str]:
        """The `speccheck run` options that name this plan's suite (to resume it)."""
        args = ["--engine", self.engine]
        args += ["--model", self.model] if self.model else []
        args += ["--draft", self.draft] if self.draft else []
        for key, value in sorted(self.engine_args.items()):
            args += ["--engine-arg", f"{key}={value}"]
        args += ["--corpus", self.corpus]
        args += ["--max-tokens", str(self.max_tokens)] if self.max_tokens else []
        args += ["--ignore-eos"] if self.ignore_eos else []
        args += ["--top-k", str(self.top_k)] if self.top_k != 5 else []
        args += ["--attribution-paths", ",".join(self.attribution_paths)] if self.attribution_paths else []
        args += ["--attribution-mode", "rerun"] if self.attribution_mode == "rerun" else []
        return args

    def planned(self) -> dict[str, dict]:
        """What each config must leave in the store (recorded before any engine starts)."""
        want = {"repeats": self.repeats,
                "fresh_process_repeat": self.fresh_process_repeat and self.repeats > 1,
                "concurrent": self.concurrent, "rescore": self.rescore}
        on = {c.name for c in self.axis_configs()}
        replays = self.replays_acceptance() and sampling_of(self.engine_args) is None
        # a sampled suite's outputs differ by design: no divergence to attribute, no greedy replay
        greedy = sampling_of(self.engine_args) is None
        return {c.name: {**want, "attribute": self.attribute and greedy and not c.is_baseline,
                         **({"replay": True} if replays and not c.is_baseline else {}),
                         **({"axes": list(self.axes)} if c.name in on else {})}
                for c in self.configs}

    def replays_acceptance(self) -> bool:
        """Whether each spec config's acceptance is replayed after its runs (the engine can:
        Engine.replay_acceptance)."""
        try:
            return bool(engine_class(self.engine).replays_acceptance)
        except EngineUsageError:
            return False


#: where a plan's cells may run (speccheck/executors/)
EXECUTORS = ("local", "ray")
#: the oldest Ray the ray executor is written against (pyproject's ``ray`` extra says the same)
RAY_MIN_VERSION = "2.40"


def check_executor(executor: str, address: str | None, engine: str = "reference") -> None:
    """``--executor`` and ``--address``, refused before an engine loads: an executor by name,
    Ray installed for ``ray`` (looked up, not imported: the local path never imports it), an
    address only with Ray, and an engine whose cells can run apart."""
    import importlib.util

    if executor not in EXECUTORS:
        raise PlanError(f"--executor {executor!r}: no such executor; give local (this machine, one run "
                        "after another: the default) or ray (every cell a task on a Ray cluster).")
    if executor == "local":
        if address is not None:
            raise PlanError(f"--address {address}: an address names a Ray cluster, and the local executor "
                            "uses none; add --executor ray, or drop --address.")
        return
    if importlib.util.find_spec("ray") is None:
        raise PlanError(f"--executor ray: Ray is not installed in this Python ({sys.executable}); install "
                        f"it with `pip install 'speccheck[ray]'` (ray>={RAY_MIN_VERSION}), or run without "
                        "--executor ray.")
    from importlib.metadata import PackageNotFoundError, version

    try:
        have = version("ray")
    except PackageNotFoundError:  # importable but not installed as a distribution: take it as is
        have = None
    if have is not None and release(have) < release(RAY_MIN_VERSION):
        raise PlanError(f"--executor ray: Ray {have} is installed, and speccheck needs ray>={RAY_MIN_VERSION}; "
                        f"upgrade it (`pip install -U 'speccheck[ray]'`), or run without --executor ray.")
    if engine_class(engine).serves_one_config:
        raise PlanError(f"--executor ray: the {engine} engine sends every run to the one server it is "
                        "given, so there is nothing to spread over a cluster; drop --executor ray.")
    if address is not None and not address.strip():
        raise PlanError("--address '': give the Ray cluster's address (auto, HOST:PORT or "
                        "ray://HOST:PORT), or drop --address to start Ray on this machine.")


def plan_suite_id(plan: RunPlan, corpus: Corpus | None = None) -> str:
    """The id of the suite this plan runs in (its corpus loaded unless given)."""
    corpus = corpus or plan.load_corpus()
    skip = RUN_ONLY_ARGS.get(plan.engine, frozenset())
    args = {k: v for k, v in plan.engine_args.items() if k not in skip}
    return suite_id(plan.engine, plan.model, plan.draft, args, corpus.name, corpus.hash, plan.ignore_eos)


def sampling_engine_args(temperature: float = 0.0, top_p: float = 1.0, sample_top_k: int = 0,
                         seed: int = 0, samples: int = 1) -> tuple[str, ...]:
    """``--temperature/--top-p/--sample-top-k/--seed`` as engine args (types.SAMPLING_ARGS):
    none at temperature 0, so a greedy suite keeps its identity; sampling settings without a
    temperature are refused rather than ignored."""
    if not temperature:
        if top_p != 1.0 or sample_top_k or seed or samples != 1:
            raise PlanError("--top-p, --sample-top-k, --seed and --samples shape sampling: give --temperature "
                            "> 0 with them (temperature 0 decodes greedily).")
        return ()
    return (f"temperature={temperature:g}", f"top_p={top_p:g}", f"sample_top_k={sample_top_k}",
            f"seed={seed}") + ((f"samples={samples}",) if samples != 1 else ())


def parse_engine_args(items: Sequence[str]) -> dict[str, str]:
    """``--engine-arg key=value`` items as a dict (a later key wins)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise PlanError(f"--engine-arg {item!r}: write --engine-arg key=value, e.g. --engine-arg dtype=fp32.")
        out[key.strip()] = value
    return out


REFERENCE_ARG_KEYS = (
    "dtype=bf16|fp32, gdn_prefill/gdn_decode/gdn_verify=chunked|recurrent|fused (fused: a "
    "Triton kernel, CUDA), attn_prefill=single|multi, attn_decode/attn_verify=single|multi|fused, "
    "attn_draft=multi|fused (fused: a Triton kernel, CUDA), device=auto|cpu|cuda, "
    "cuda_graphs=on|off, compile=on|off (torch.compile of the CUDA graph steps), "
    "prefix_cache=on|off, threads=N, batch=N, no_draft_every=N, "
    "fault=NAME (planted bug), "
    "dflash2_selector=on|off, dflash2_top_k=N, dflash2_walk=fp32|bf16, "
    "thinking=on|off (chat prompts in the template's thinking mode); every engine: temperature, "
    "top_p, sample_top_k, seed, samples (what --temperature, --top-p, --sample-top-k, --seed "
    "and --samples set)")
ENGINE_ARG_HELP = (
    f"Engine option key=value (repeatable). reference: {REFERENCE_ARG_KEYS}. vllm: worker=per-call|"
    "per-config, timeout_s=N, warmup=true|false, python=PATH (the worker's interpreter), "
    "score_path=prefill|decode|verify, score_spec=CONFIG, pad_batch=N (decode beside N copies), "
    "attribution_jobs=N (attribution switches at once, a worker each), "
    "dflash2_draft=PATH (the DFlash2 configs' draft, beside --draft's DFlash one), "
    "score_top_k=N (logprobs a sampled run's outputs are scored with, default 20), "
    "async_scheduling=on|off, env.NAME=value (worker environment), "
    "sampling.NAME=value (SamplingParams), spec.NAME=value (extra speculative_config keys; the "
    "config itself comes from --method/--k/--draft), any other key a keyword argument of "
    "vllm.LLM (e.g. attention_backend, gpu_memory_utilization, max_model_len, dtype; JSON "
    "values). openai: base_url, served_model, api_key_env, timeout, deadline, retries, backoff, "
    "tokenizer, score_base_url.")


def parse_attribute_with(items: Sequence[str], cls) -> dict[str, str]:
    """--attribute-with LABEL=URL pairs, checked by the engine before anything runs."""
    out: dict[str, str] = {}
    for item in items:
        label, sep, url = item.partition("=")
        if not sep or not label.strip() or not url.strip():
            raise PlanError(f"--attribute-with {item!r}: write --attribute-with LABEL=URL, e.g. "
                            "eager=http://127.0.0.1:8001")
        if label.strip() in out:
            raise PlanError(f"--attribute-with: label {label.strip()!r} is given twice; give each "
                            "server its own label")
        cls.attribution_server_args(label.strip(), url.strip())  # EngineUsageError if not
        out[label.strip()] = url.strip()
    return out


def make_plan(engine: str = "reference", model: str | None = None, draft: str | None = None,
              methods: Sequence[str] = (), k: str | None = None, configs: Sequence[str] = (),
              corpus: str = "default", repeats: int = 2, top_k: int = 5,
              engine_args: Sequence[str] = (), no_attribution: bool = False, base_url: str | None = None,
              served_model: str | None = None, api_key_env: str | None = None, concurrent: int = 0,
              attribute_with: Sequence[str] = (), max_tokens: int | None = None, ignore_eos: bool = False,
              attribution_paths: str | None = None, attribution_mode: str = "rescore",
              axes: str | None = "default", axes_on: str = "default", executor: str = "local",
              address: str | None = None) -> RunPlan:
    """The plan `speccheck run` (and ``pytest -m spec``) would run, from its options as given on
    the command line; every cheap mistake is refused before an engine (and torch) loads."""
    for option, value, lo, hi in (("--repeats", repeats, 1, 100), ("--top-k", top_k, 2, 20),
                                  ("--concurrent", concurrent, 0, 64)):
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise PlanError(f"{option} {value!r}: give a whole number from {max(lo, 1)} to {hi}"
                            + (" (or off)" if option == "--concurrent" else "") + ".")
    args = parse_engine_args(engine_args)
    bad = sampling_problem(args)
    if bad:
        raise PlanError(f"--engine-arg {bad} (--temperature, --top-p, --sample-top-k, --seed and --samples "
                        "set these).")
    server = {"base_url": base_url, "served_model": served_model, "api_key_env": api_key_env}
    args.update({key: v for key, v in server.items() if v is not None})
    # cheap errors first, before an engine (and torch) loads: the corpus, the engine's name,
    # the matrix's syntax
    if max_tokens is not None and load_corpus(corpus, max_tokens).hash == load_corpus(corpus).hash:
        raise PlanError(f"--max-tokens {max_tokens}: corpus {corpus} gives every prompt its own max_tokens, "
                        "so the option would be ignored; it sets max_tokens for corpora whose prompts carry "
                        "none (Spec-Bench's question.jsonl). Drop --max-tokens, or edit max_tokens in a copy "
                        "of the corpus (`speccheck corpus show` lists them).")
    load_corpus(corpus)
    if engine not in engine_names():  # by name: importing an engine loads torch
        engine_class(engine)  # raises the one-paragraph error naming the engines there are
    check_executor(executor, address, engine)
    build_matrix(methods, k, configs, offered=None, engine=engine)
    cls = engine_class(engine)
    cls.preflight(model, args, draft)  # e.g. vLLM not importable: one paragraph, not one per run
    if cls.serves_one_config and not (methods or configs):
        raise MatrixError(f"the {engine} engine runs the one config its server runs: say which with "
                          "--method baseline, or e.g. --method mtp --k 7 (run the baseline first, "
                          "against a server without speculative decoding, into the same --store).")
    default_k = {}
    block_methods = [m for m in ("dflash", "dflash2") if m in methods]
    if block_methods:  # K hint = the drafter's block_size - 1
        probe = cls(model=model, engine_args=args, draft=draft)
        try:
            default_k.update({m: probe.default_k(m) for m in block_methods})
        finally:
            probe.close()
    matrix = build_matrix(methods, k, configs, offered=cls.methods, engine=engine,
                          default_k=default_k, draft=draft, include_baseline=not cls.serves_one_config)
    paths = tuple(g.strip() for g in (attribution_paths or "").split(",") if g.strip())
    if attribution_paths is not None and (not paths or no_attribution):
        raise PlanError(f"--attribution-paths {attribution_paths!r}: "
                        + ("--no-attribution turns attribution off, so it would be ignored; drop one of them."
                           if no_attribution else "names no kernel path; give globs like 'decode*,verify*'."))
    return RunPlan(engine=engine, model=model, draft=draft, engine_args=args, corpus=corpus,
                   configs=matrix, repeats=repeats, top_k=top_k, attribute=not no_attribution,
                   concurrent=concurrent, attribute_with=parse_attribute_with(attribute_with, cls),
                   max_tokens=max_tokens, ignore_eos=ignore_eos,
                   attribution_paths=paths,
                   attribution_mode=attribution_mode,
                   axes=parse_axes("none" if sampling_of(args) and axes in (None, "", "default")
                                   else axes, cls.axes),
                   axes_on=axes_on, executor=executor, address=address)
