"""speccheck's Python API: what the command line and the pytest plugin call.

    import speccheck
    suite = speccheck.run(methods=["mtp"], k="1,3,7", corpus="smoke")   # into .speccheck/
    verdict = speccheck.gate()                                          # the last suite run
    print(verdict.text); raise SystemExit(verdict.exit_code)

Every function takes the same options as the command of its name (``--engine-arg`` items as
``"key=value"`` strings, K as ``"1-7"``); errors are the exceptions the command turns into exit
code 2 (bad input) or 3 (engine failure).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from speccheck.config import build_matrix
from speccheck.escalate import escalate, resolve
from speccheck.evaluate import evaluate_suite, judged_configs
from speccheck.gate import EXIT_FAIL, EXIT_PASS, exit_code, gate_text, write_junit
from speccheck.golden import golden_acceptance, golden_noise
from speccheck.plan import make_plan
from speccheck.policy import load_policy
from speccheck.results import SuiteResult
from speccheck.executors import run_suite
from speccheck.store import Store, Suite


def run(engine: str = "reference", *, store: str | Path = ".speccheck", methods: Sequence[str] = (),
        k: str | None = None, configs: Sequence[str] = (), corpus: str = "default", repeats: int = 2,
        concurrent: int = 2, engine_args: Sequence[str] = (), log: Callable[[str], None] = print,
        progress: Callable[[int, int, str], None] | None = None, **options) -> Suite:
    """Run the matrix (the baseline always included) into ``store``, resuming what is stored;
    ``options``: the rest of `speccheck run`'s options by their Python names (model, draft,
    top_k, no_attribution, max_tokens, ignore_eos, attribution_paths, attribution_mode, ...;
    ``executor="ray"`` and ``address`` run every cell as a Ray task, see docs/how-to/ray.md)."""
    plan = make_plan(engine, methods=methods, k=k, configs=configs, corpus=corpus, repeats=repeats,
                     engine_args=engine_args, concurrent=concurrent, **options)
    suite = run_suite(plan, Store(store), log=log, progress=progress)
    escalate(plan, Store(store), suite, log)  # inconclusive checks: judged again on more prompts
    return suite


def open_suite(store_dir: str | Path = ".speccheck", suite_id: str | None = None) -> Suite:
    """A stored suite by id (default: the last one run into the store)."""
    store = Store(store_dir)
    suite = store.suite(suite_id) if suite_id else store.latest()
    suite.check_inputs()
    return suite


def detokenizer(suite: Suite):
    """Decode token ids for human-readable evidence. Only for the reference engine, which loads
    in a second with no server or GPU; other engines' evidence shows ids (and stored text)."""
    meta = suite.meta
    if meta.get("engine") != "reference":
        return None
    try:
        from speccheck.engines import make_engine

        engine = make_engine("reference", meta.get("model"), meta.get("engine_args"), meta.get("draft"))
        return bytes_shown(engine.detokenize, engine.token_bytes)
    except Exception:  # noqa: BLE001 - evidence without decoded text is still evidence
        return None


def bytes_shown(detokenize, token_bytes):
    """A detokenizer that shows bytes which are not whole UTF-8 characters as ``<0xE3>``
    (a byte-level token often holds a third of a CJK character) instead of '\ufffd'."""
    def detok(ids) -> str:
        text = detokenize(ids)
        if "\ufffd" not in text:
            return text
        parts = [token_bytes(int(t)) for t in ids]
        if any(p is None for p in parts):
            return text
        raw, out, i = b"".join(parts), [], 0
        while i < len(raw):
            for n in (1, 2, 3, 4):
                try:
                    out.append(raw[i:i + n].decode("utf-8"))
                    i += n
                    break
                except UnicodeDecodeError:
                    continue
            else:
                out.append(f"<0x{raw[i]:02X}>")
                i += 1
        return "".join(out)
    return detok


def evaluate(store_dir: str | Path = ".speccheck", suite_id: str | None = None, policy_file: str | None = None,
             settings: dict[str, str] | None = None, configs: Sequence[str] | None = None,
             golden_dir: str | Path | None = "golden") -> tuple[Suite, SuiteResult, object]:
    """``(suite, result, detokenizer)``: the suite judged by the policy (defaults, overridden by
    pyproject.toml, speccheck.toml, ``policy_file`` and ``settings``), against the golden in
    ``golden_dir`` (None: without one)."""
    suite = open_suite(store_dir, suite_id)
    policy = load_policy(policy_file, settings)
    detok = detokenizer(suite)
    have_base = suite.is_complete("baseline", 0) and golden_dir is not None
    gold = golden_acceptance(suite, Path(golden_dir)) if have_base else None
    gold_noise = golden_noise(suite, Path(golden_dir)) if have_base else None
    result = evaluate_suite(suite, policy, configs, gold, detok, gold_noise)
    return suite, resolve(Store(store_dir), suite, result, policy), detok


def demanded_configs(suite, methods, k, configs) -> tuple[list[str], list[str]]:
    """Configs named on the command line: (names, methods named without --k that have no
    config stored or planned). A method without --k means every K of it stored or planned."""
    from speccheck.evaluate import judged_configs

    names = [c.name for c in build_matrix(methods if k is not None else (), k, configs, offered=None,
                                          include_baseline=False)] if (k is not None or configs) else []
    unmet = []
    for m in methods if k is None else ():
        have = [n for n in judged_configs(suite) if n == m or n.startswith(f"{m}-k")]
        names += have
        unmet += [] if have else [m]
    return names, unmet


@dataclass
class GateVerdict:
    exit_code: int  # 0 pass, 1 gate failed, 3 engine failure
    text: str  # one line per config and per failed check
    result: SuiteResult


def gate(store_dir: str | Path = ".speccheck", suite_id: str | None = None, *, policy: str | None = None,
         settings: dict[str, str] | None = None, golden: str | Path | None = "golden",
         methods: Sequence[str] = (), k: str | None = None, configs: Sequence[str] = (),
         junit: str | Path | None = None) -> GateVerdict:
    """The policy applied to every config stored, planned or demanded (``methods``/``k``/
    ``configs``): a planned or demanded config that is missing fails."""
    s = open_suite(store_dir, suite_id)
    demanded, unmet = demanded_configs(s, methods, k, configs)
    names = judged_configs(s, demanded) if demanded else None
    _, result, _ = evaluate(store_dir, s.id, policy, settings, names, golden_dir=golden)
    unmet = [f"--method {m}: demanded, but suite {s.id} stores and plans no {m} config; run one: "
             f"`{s.run_command('--method', m)}`" for m in unmet]
    if junit:
        write_junit(result, Path(junit))
    return GateVerdict(exit_code(result) or (EXIT_FAIL if unmet else EXIT_PASS), gate_text(result, unmet), result)
