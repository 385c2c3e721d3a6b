"""pytest plugin: the gate as tests, one per (check, config), e.g. ``test_deterministic[mtp-k7]``,
generated from the check registry (speccheck/checks/): a new check is a new test.

Registered through the ``pytest11`` entry point (and loaded by the repo's conftest.py). It adds
the ``spec`` marker and ``--spec-*`` options; the matrix runs once per session into the store
(resuming what is already there) and every generated test reads its verdict from there.
To use the tests in your own repository, import them into a test module::

    from speccheck.pytest_plugin import *  # noqa: F401,F403  (test_deterministic, ...)
"""
from __future__ import annotations

import contextlib

from pathlib import Path

import pytest

from speccheck.checks import registry



def _count(lo: int, hi: int, off: bool = False):
    """An option's value as a count in [lo, hi] (``off``: or the word off, read as 0; a 0 is
    refused, never read as off): a bad value is pytest's usage error, before any run."""
    import argparse

    def convert(text: str) -> int:
        word = str(text).strip().lower()
        if off and word in ("off", "false", "no", "none"):
            return 0
        try:
            n = int(word)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from {lo} to {hi}"
                                             + (" (or off)" if off else "")) from None
        if off and n == 0:
            raise argparse.ArgumentTypeError("0: write off to leave this run out (its tests are then "
                                             f"skipped), or a number from {lo} to {hi}")
        if not lo <= n <= hi:
            raise argparse.ArgumentTypeError(f"{n} is not in the range {lo} to {hi}"
                                             + (" (or off)" if off else ""))
        return n
    return convert


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("speccheck", "speculative-decoding gate (speccheck)")
    g.addoption("--spec-engine", default="reference", help="engine: reference | vllm | openai")
    g.addoption("--spec-model", default=None, help="model path for the engine")
    g.addoption("--spec-draft", default=None, help="external drafter path (dflash)")
    g.addoption("--spec-method", action="append", default=[], help="method (repeatable)")
    g.addoption("--spec-k", default=None, help="K values: 7, 1-12 or 1,3,7")
    g.addoption("--spec-config", action="append", default=[], help="config by name, e.g. mtp-k3 "
                "(repeatable)")
    g.addoption("--spec-corpus", default=None,
                help="corpus name or file (default: the ini value spec_corpus, else 'default')")
    g.addoption("--spec-store", default=".speccheck", help="store directory")
    g.addoption("--spec-golden", default="golden", help="golden directory")
    g.addoption("--spec-repeats", default=2, type=_count(1, 100), help="repeats per config (1-100)")
    from speccheck.plan import ENGINE_ARG_HELP

    g.addoption("--spec-engine-arg", action="append", default=[],
                help=ENGINE_ARG_HELP.replace("Engine option", "engine option"))
    g.addoption("--spec-policy", default=None, help="policy TOML file")
    g.addoption("--spec-concurrent", default=2, type=_count(1, 64, off=True),
                help="also run the corpus all at once, each prompt N times (batch invariance, "
                     "identical concurrent requests), 1-64; off: not run")
    g.addoption("--spec-ignore-eos", action="store_true",
                help="decode every prompt's full max_tokens past end-of-sequence")
    g.addoption("--spec-axes", default="default",
                help="workload axes: default, none, or e.g. 'concurrency=4+8,long_lived=500'")
    g.addoption("--spec-executor", default="local",
                help="where the cells run: local, or ray (every cell a Ray task; speccheck[ray])")
    g.addoption("--spec-ray-address", default=None,
                help="with --spec-executor ray: the cluster (auto, HOST:PORT or ray://HOST:PORT)")
    parser.addini("spec_corpus", default="default",
                  help="speccheck: the corpus `pytest -m spec` runs unless --spec-corpus says")


def _corpus(config: pytest.Config) -> str:
    return config.getoption("--spec-corpus") or config.getini("spec_corpus")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "spec: speculative-decoding gate tests generated per config")


def _plan(config: pytest.Config):
    from speccheck.plan import make_plan as plan_from_options

    o = config.getoption
    return plan_from_options(o("--spec-engine"), o("--spec-model"), o("--spec-draft"),
                             tuple(o("--spec-method")), o("--spec-k"), tuple(o("--spec-config")),
                             _corpus(config), o("--spec-repeats"), 5,
                             tuple(o("--spec-engine-arg")), concurrent=o("--spec-concurrent"),
                             ignore_eos=o("--spec-ignore-eos"), axes=o("--spec-axes"),
                             executor=o("--spec-executor"), address=o("--spec-ray-address"))


class _BadOptions(Exception):
    """A --spec-* option (or the policy file) is bad input: said once as pytest's usage error
    (pytest_collection_modifyitems), not as a collection traceback per generated test."""


def _usage(config: pytest.Config, make):
    from speccheck.config import MatrixError
    from speccheck.corpus import CorpusError
    from speccheck.engines import EngineUsageError
    from speccheck.plan import PlanError
    from speccheck.policy import PolicyError
    from speccheck.store import StoreError

    try:
        return make()
    except (CorpusError, MatrixError, PlanError, PolicyError, StoreError, EngineUsageError) as e:
        raise _BadOptions(str(e)) from None


_BAD = pytest.StashKey[str]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """After -m has deselected what it does: a spec test left to run with bad options ends
    the session with one paragraph (pytest's usage error, exit 4), before any engine starts."""
    bad = config.stash.get(_BAD, None)
    if bad and any(item.get_closest_marker("spec") for item in items):
        raise pytest.UsageError(f"speccheck: {bad}")


def _config_names(config: pytest.Config) -> list[str]:
    """The configs the options demand, and every config an earlier run planned in the same
    suite: a planned config the store misses fails its tests instead of going unseen."""
    from speccheck.plan import plan_suite_id
    from speccheck.policy import load_policy
    from speccheck.store import Store, StoreError, config_sort_key

    plan = _usage(config, lambda: _plan(config))
    _usage(config, lambda: load_policy(config.getoption("--spec-policy")))  # read before the runs, not after
    names = {c.name for c in plan.configs}
    try:
        names |= set(Store(config.getoption("--spec-store")).suite(plan_suite_id(plan)).planned_configs())
    except StoreError:  # no such suite yet: nothing planned before
        pass
    return sorted(names, key=config_sort_key)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "spec_config" not in metafunc.fixturenames:
        return
    try:
        names = _config_names(metafunc.config)
    except _BadOptions as e:
        metafunc.config.stash[_BAD] = str(e)
        names = []
    spec = getattr(metafunc.function, "check_spec", None)
    if spec is not None:  # a check's test for the configs it judges
        names = [n for n in names if spec.applies_to(n)]
    else:
        names = [n for n in names if n != "baseline"]
    metafunc.parametrize("spec_config", names, ids=names)


@pytest.fixture(scope="session")
def spec_result(request: pytest.FixtureRequest):
    """Run the matrix once per session (store-backed, resumable) and evaluate it."""
    from speccheck.escalate import escalate, resolve
    from speccheck.evaluate import evaluate_suite
    from speccheck.golden import golden_acceptance, golden_noise
    from speccheck.policy import load_policy
    from speccheck.executors import run_suite
    from speccheck.store import Store

    cfg = request.config
    plan = _plan(cfg)
    reporter = cfg.pluginmanager.get_plugin("terminalreporter")
    capman = cfg.pluginmanager.get_plugin("capturemanager")

    def log(msg: str) -> None:
        if reporter is None:
            return
        # the session fixture runs under output capture: lift it, or progress shows only with -s
        with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
            reporter.write_line(f"speccheck: {msg}")

    def progress(done: int, total: int, what: str) -> None:
        log(f"[{done}/{total}] {what}")  # what carries the configs done and the time left

    store = Store(cfg.getoption("--spec-store"))
    suite = run_suite(plan, store, log=log, progress=progress)
    policy = load_policy(cfg.getoption("--spec-policy"))
    golden = Path(cfg.getoption("--spec-golden"))
    escalate(plan, store, suite, log, policy, golden)  # inconclusive checks: judged on more prompts
    result = evaluate_suite(suite, policy, _config_names(cfg), golden_acceptance(suite, golden),
                            golden_noise=golden_noise(suite, golden))
    return suite, resolve(store, suite, result, policy), policy, golden


def _assert_check(spec_result, config: str, check: str) -> None:
    _, result, _, _ = spec_result
    c = result.get(config).check(check)
    if c.skipped:
        pytest.skip(c.message)
    assert c.passed, f"{check} {'inconclusive' if c.inconclusive else 'failed'} for {config}: {c.message}"


def _check_test(spec):
    """``test_<check>[<config>]``: one registered check on one config, its description as docs."""
    @pytest.mark.spec
    def test(spec_result, spec_config):
        if spec.name != "ran":  # a config that did not run fails every test with why
            _assert_check(spec_result, spec_config, "ran")
        _assert_check(spec_result, spec_config, spec.name)

    test.__name__ = test.__qualname__ = f"test_{spec.name}"
    test.__doc__ = spec.description
    test.check_spec = spec
    return test


for _spec in registry():
    globals()[f"test_{_spec.name}"] = _check_test(_spec)
__all__ = [f"test_{s.name}" for s in registry()] + ["test_baseline_matches_golden"]


@pytest.mark.spec
def test_baseline_matches_golden(spec_result):
    """Today's baseline equals the committed golden up to classified near-ties."""
    from speccheck.golden import GoldenMismatch, check

    suite, result, policy, golden = spec_result
    try:
        chk = check(suite, golden, result.noise, policy)
    except GoldenMismatch as e:
        if "no golden" in str(e):
            pytest.skip(str(e))
        raise
    high = chk.comparison.high
    assert chk.passed, f"{len(high)} high-confidence divergence(s) from golden {chk.path}: {high[:3]}"
