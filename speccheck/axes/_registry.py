"""The axis registry: the modules of this package, in order."""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Sequence

import numpy as np

from speccheck.corpus import Corpus
from speccheck.types import Prompt, Request, SpecConfig, Workload

#: a serving axis's requests: prompts up to this many tokens, outputs up to SERVING_MAX_TOKENS
#: (each is judged against its reference over the tokens both have)
SERVING_PROMPT_TOKENS = 256
SERVING_MAX_TOKENS = 32


@dataclass(frozen=True)
class AxisInput:
    """What a generator builds a level's workload from: the corpus as the engine tokenised it,
    the config it runs under, every K of the plan (so the baseline runs the shapes of every
    spec config it is compared with), the stored outputs of the config's first repeat (a
    conversation's next turn carries its answer), and the seed."""

    corpus: Corpus
    inputs: dict[str, np.ndarray]
    config: SpecConfig
    level: str
    ks: tuple[int, ...] = ()
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    seed: int = 0
    #: tokens per cache block of the engine (vLLM's block_size; the reference engine's)
    block_size: int = 16
    #: the batch sizes, in tokens, the engine replays a captured CUDA graph for under this
    #: config (Engine.capture_sizes; empty: none)
    capture_sizes: tuple[int, ...] = ()

    def serving_prompts(self, n: int | None = None) -> list[Prompt]:
        """The corpus prompts a serving axis sends: those of at most SERVING_PROMPT_TOKENS tokens
        (a 2k-token OCR prompt in flight with others tests nothing more, at many times the cost),
        all if none is that short; the first ``n``."""
        short = [p for p in self.corpus.prompts if len(self.inputs[p.id]) <= SERVING_PROMPT_TOKENS]
        return (short or list(self.corpus.prompts))[:n]

    def request(self, rid: str, prompt: Prompt, ids: Sequence[int], max_tokens: int | None = None,
                **kw) -> Request:
        """A request of ``prompt`` with its own id, token ids and (optionally) max_tokens."""
        p = prompt if max_tokens is None else Prompt(prompt.id, prompt.category, max_tokens, prompt.text,
                                                     prompt.messages, prompt.ignore_eos)
        return Request(rid, p, tuple(int(t) for t in ids), **kw)


@dataclass(frozen=True)
class AxisSpec:
    name: str
    #: the bug class it drives the engine into (public reports)
    guards: str
    description: str
    #: the levels the default run asks for (each a workload of its own)
    levels: tuple[str, ...]
    build: Callable[[AxisInput], Workload]
    #: proof keys that must read back > 0 for a level to count as exercised, per level
    #: (a level not listed needs none beyond its requests being served)
    proofs: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: "runner": any engine runs it through generate() (what was sent is the proof);
    #: "engine": the engine must serve it (Engine.axes, Engine.run_workload)
    runs_on: str = "engine"
    #: levels of an engine axis that every engine runs through generate() instead, one request
    #: after another, even one that serves the axis's other levels (shapes: the prompt lengths
    #: need no scheduler, its batch sizes do)
    generate_levels: tuple[str, ...] = ()
    order: int = 100
    #: per level, proof values a level must reach to count as exercised (beyond > 0): e.g. a
    #: concurrency level whose batch never reached the level did not test that level
    floors: Callable[[str], dict[str, float]] | None = None
    #: a spec config's run is judged against the baseline's run of the same level (shapes,
    #: chat_thinking), which must then run too; else against the config's own runs
    against_baseline: bool = False


    def runnable(self, level: str, served: frozenset[str] | set[str]) -> bool:
        """Whether an engine that serves the axes ``served`` (Engine.axes) can run ``level``."""
        return self.runs_on == "runner" or level in self.generate_levels or self.name in served

    def served(self, level: str, served: frozenset[str] | set[str]) -> bool:
        """Whether ``level`` goes through the engine's own serving loop (Engine.run_workload)
        rather than generate()."""
        return self.name in served and level not in self.generate_levels


@lru_cache(maxsize=None)
def registry() -> tuple[AxisSpec, ...]:
    import speccheck.axes as package

    specs = []
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_"):
            continue
        spec = getattr(importlib.import_module(f"{package.__name__}.{info.name}"), "AXIS", None)
        if not isinstance(spec, AxisSpec):
            raise RuntimeError(f"speccheck/axes/{info.name}.py defines no AXIS = AxisSpec(...)")
        specs.append(spec)
    return tuple(sorted(specs, key=lambda s: (s.order, s.name)))


def get(name: str) -> AxisSpec:
    for spec in registry():
        if spec.name == name:
            return spec
    raise KeyError(name)


def names() -> list[str]:
    return [s.name for s in registry()]
