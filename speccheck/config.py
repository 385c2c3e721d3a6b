"""The matrix: which SpecConfigs a command covers, from `--method`, `--k` and `--config`."""
from __future__ import annotations

import re
from typing import Sequence

from speccheck.types import K_MAX, SpecConfig

#: what `speccheck run` covers with no --method/--config: baseline + MTP K=1..7 + the block
#: drafters (DFlash, DFlash2) at K=7 = block_size - 1 (the comparison that motivated speccheck)
DEFAULT_MATRIX = ("baseline",) + tuple(f"mtp-k{k}" for k in range(1, 8)) + ("dflash-k7",
                                                                           "dflash2-k7")
DEFAULT_K = {"mtp": list(range(1, 8))}

#: engine args that change how speccheck talks to an engine or how much memory it takes, not
#: what it computes: left out of the suite's id and of a golden's directory (kept here, not on
#: the engine classes, so that no engine loads to compute an id or name a golden)
RUN_ONLY_ARGS: dict[str, frozenset[str]] = {
    "openai": frozenset({"score_base_url", "timeout", "deadline", "retries", "backoff", "api_key_env"}),
    "vllm": frozenset({"gpu_memory_utilization", "kv_cache_memory_bytes", "worker", "python",
                       "timeout_s", "warmup", "attribution_jobs",
                       # what the model is called (the golden's folder takes it; not numerics)
                       "served_model_name",
                       # a path (its weights' hash is in the identity, as --draft's is)
                       "dflash2_draft"}),
}


class MatrixError(ValueError):
    """A bad --method / --k / --config (exit code 2)."""


def parse_k(spec: str) -> list[int]:
    """'7' -> [7]; '1-12' -> [1..12]; '1,3,7' -> [1,3,7]; mixed '1-3,7' works too."""
    ks: list[int] = []
    for part in spec.replace(" ", "").split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise MatrixError(f"--k {spec!r}: cannot read {part!r}; write e.g. --k 7, --k 1-12 or --k 1,3,7.")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if lo > hi:
            raise MatrixError(f"--k {spec!r}: range {part!r} runs backwards; write it low-high.")
        if hi > K_MAX:  # before the range is made: 1-99999999999 is not a billion Ks in memory
            ks.append(hi)
            break
        ks.extend(range(lo, hi + 1))
    bad = [k for k in ks if not 1 <= k <= K_MAX]
    if bad:
        raise MatrixError(f"--k {spec!r}: K must be between 1 and {K_MAX} (got {bad[0]}); "
                          "K is the number of draft tokens per step, so K=0 is the baseline, which "
                          "always runs anyway.")
    return sorted(set(ks))


def check_method(method: str, offered: Sequence[str] | None, engine: str, option: str | None = None) -> None:
    """``option`` names what the user wrote (e.g. ``--config 'turbo-k3'``), so the error
    blames that, not an option they never used."""
    if method == "baseline" or offered is None or method in offered:
        return
    configs = ", ".join(f"{m}-kN" for m in offered)
    what = option or f"--method {method!r}"
    raise MatrixError(f"{what}: the {engine} engine has no method {method!r}; it offers "
                      f"{', '.join(('baseline',) + tuple(offered))}"
                      + (f" (configs baseline, {configs})" if option else "") + "; pick one of those.")


def build_matrix(methods: Sequence[str] = (), k: str | None = None, configs: Sequence[str] = (),
                 offered: Sequence[str] | None = ("mtp", "dflash", "dflash2"), engine: str = "reference",
                 default_k: dict[str, int | None] | None = None, draft: str | None = None,
                 include_baseline: bool = True) -> list[SpecConfig]:
    """The configs to run, baseline first. With nothing asked for: DEFAULT_MATRIX."""
    names: list[str] = list(configs)
    if not methods and not configs:
        if k is not None:
            raise MatrixError("--k needs a --method to apply to (e.g. --method mtp --k 1-7).")
        names = list(DEFAULT_MATRIX)
    ks = parse_k(k) if k is not None else None
    for method in methods:
        check_method(method, offered, engine)
        if method == "baseline":
            names.append("baseline")
            continue
        method_ks = ks or ([default_k[method]] if default_k and default_k.get(method) else None) \
            or DEFAULT_K.get(method) or [1]
        names.extend(f"{method}-k{kk}" for kk in method_ks)
    out: list[SpecConfig] = []
    for name in (["baseline"] if include_baseline else []) + names:
        try:
            cfg = SpecConfig.from_name(name, draft)
        except ValueError as e:
            raise MatrixError(f"--config {name!r}: {e}") from None
        check_method(cfg.method, offered, engine, None if name in names[len(configs):] or name == "baseline"
                     else f"--config {name!r}")
        if cfg.is_baseline:
            cfg = SpecConfig()
        if cfg not in out:
            out.append(cfg)
    return out
