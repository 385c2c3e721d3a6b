"""Engine registry: name -> class, imported lazily so no engine's heavy dependencies
load unless that engine is used."""
from __future__ import annotations

import importlib

from speccheck.config import RUN_ONLY_ARGS
from speccheck.engines.base import Engine, EngineError, EngineUsageError

ENGINES = {
    "reference": "speccheck.reference.engine:ReferenceEngine",
    "vllm": "speccheck.engines.vllm:VllmEngine",
    "openai": "speccheck.engines.openai:OpenAIEngine",
}


def engine_class(name: str) -> type[Engine]:
    try:
        target = ENGINES[name]
    except KeyError:
        raise EngineUsageError(
            f"unknown engine {name!r} (option --engine): choose one of {', '.join(ENGINES)}"
        ) from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def make_engine(name: str, model: str | None = None, engine_args: dict | None = None,
                draft: str | None = None) -> Engine:
    return engine_class(name)(model=model, engine_args=engine_args, draft=draft)


__all__ = ["Engine", "EngineError", "EngineUsageError", "ENGINES", "RUN_ONLY_ARGS", "engine_class", "make_engine"]
