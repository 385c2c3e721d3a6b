"""Engine registry: name -> class, imported lazily so no engine's heavy dependencies
load unless that engine is used. Other distributions add engines through the
``speccheck.engines`` entry point group (``name = "package.module:Class"``)."""
from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from speccheck.config import RUN_ONLY_ARGS
from speccheck.engines.base import Engine, EngineError, EngineUsageError

ENGINES = {
    "reference": "speccheck.reference.engine:ReferenceEngine",
    "vllm": "speccheck.engines.vllm:VllmEngine",
    "openai": "speccheck.engines.openai:OpenAIEngine",
}


def engine_names() -> dict[str, str]:
    """The built-in engines and those other installed distributions register."""
    return {**{ep.name: ep.value for ep in entry_points(group="speccheck.engines")}, **ENGINES}


def engine_class(name: str) -> type[Engine]:
    known = engine_names()
    try:
        target = known[name]
    except KeyError:
        raise EngineUsageError(
            f"unknown engine {name!r} (option --engine): choose one of {', '.join(known)}"
        ) from None
    module, _, cls = target.partition(":")
    engine = getattr(importlib.import_module(module), cls)
    if not (isinstance(engine, type) and issubclass(engine, Engine)):
        raise EngineUsageError(f"engine {name!r} ({target}) is not a speccheck.engines.Engine "
                               "subclass; fix the entry point that registers it")
    return engine


def make_engine(name: str, model: str | None = None, engine_args: dict | None = None,
                draft: str | None = None) -> Engine:
    return engine_class(name)(model=model, engine_args=engine_args, draft=draft)


__all__ = [
    "ENGINES",
    "RUN_ONLY_ARGS",
    "Engine",
    "EngineError",
    "EngineUsageError",
    "engine_class",
    "engine_names",
    "make_engine",
]
