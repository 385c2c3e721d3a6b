"""The check registry: every check module is found, declares what it must, and every renderer
(diff, Markdown and HTML report, gate, JUnit, golden, the pytest plugin) shows a check it has
never heard of."""
from __future__ import annotations

import importlib
import math
import pkgutil
import xml.etree.ElementTree as ET
from dataclasses import asdict, field, make_dataclass

import pytest

import speccheck.checks as checks_pkg
from speccheck import golden
from speccheck.checks import CheckSpec, PolicyKey, RegistryError
from speccheck.checks import _registry as reg
from speccheck.evaluate import evaluate_suite
from speccheck.gate import gate_text, write_junit
from speccheck.policy import KEYS, Policy, PolicyError
from speccheck.report import diff_text, html_report, markdown_report
from speccheck.results import Check
from tests.test_evaluate import suite  # noqa: F401  (the constructed suite fixture)


def test_every_check_module_is_registered_once_with_what_it_must_declare():
    modules = {m.name for m in pkgutil.iter_modules(checks_pkg.__path__)
               if not m.name.startswith("_")}
    specs = reg.registry()
    assert {s.name for s in specs} == modules  # one module per check, named after it
    for s in specs:
        assert s.guards and s.description and callable(s.judge), s.name
        for k in s.policy:
            assert k.doc and isinstance(k.default, (bool, int, float)) and k.lo <= k.default <= k.hi, k
    orders = [s.order for s in specs]
    assert orders == sorted(orders) and len(set(orders)) == len(orders)


def test_the_policy_is_made_of_the_checks_keys():
    """Every check's keys are policy fields with their defaults, validated by their ranges."""
    for s in reg.registry():
        for k in s.policy:
            assert getattr(Policy(), k.name) == k.default and KEYS[k.name] is k
    shares = [k for k in KEYS.values() if k.hi == 1.0 and not isinstance(k.default, bool)]
    assert shares, "some key is a share"
    with pytest.raises(PolicyError, match="fraction"):
        Policy().with_overrides({shares[0].name: "98"}, "--set")
    with pytest.raises(PolicyError, match="unknown policy key"):
        Policy().with_overrides({"no_such_key": "1"}, "--set")


def test_a_module_without_check_and_a_name_twice_are_refused(monkeypatch, tmp_path):
    pkg = tmp_path / "fakechecks"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "empty.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fake = importlib.import_module("fakechecks")
    monkeypatch.setattr(checks_pkg, "__path__", fake.__path__)
    monkeypatch.setattr(checks_pkg, "__name__", "fakechecks")
    reg.registry.cache_clear()
    try:
        with pytest.raises(RegistryError, match="defines no CHECK"):
            reg.registry()
        (pkg / "empty.py").write_text(_module("twice", 1))
        (pkg / "other.py").write_text(_module("twice", 2))
        importlib.invalidate_caches()
        for name in ("fakechecks.empty", "fakechecks.other"):
            importlib.import_module(name)
            importlib.reload(importlib.import_module(name))
        with pytest.raises(RegistryError, match="registered twice: twice"):
            reg.registry()
    finally:
        reg.registry.cache_clear()


def _module(name: str, order: int) -> str:
    return ("from speccheck.checks import CheckSpec\nfrom speccheck.results import Check\n"
            f"CHECK = CheckSpec(name={name!r}, label=None, order={order}, guards='g', description='d',\n"
            f"                  judge=lambda r, p: Check({name!r}, True, 'ok'))\n")


#: a check no renderer was written for (test double: it fails on every spec config and says so)
NEW = CheckSpec(
    name="made_up_check", label="made up", order=999,
    guards="a bug class invented for this test", description="Passes never: a test double.",
    policy=(PolicyKey("made_up_threshold", 0.5, "a key only this check reads", hi=1.0),),
    measure=lambda ctx: len(ctx.runs),
    judge=lambda r, p: Check("made_up_check", False,
                             f"made-up failure over {r.measured['made_up_check']} run(s), "
                             f"threshold {p.made_up_threshold}"))


@pytest.fixture
def with_new_check(monkeypatch):
    """The registry as it is plus NEW, registered the way a plugin distribution registers a
    check (the ``speccheck.checks`` entry point group), and a policy with its key (the
    process's Policy class was built from the registry before NEW existed)."""
    class EntryPoint:
        name, value = "made_up_check", "tests:NEW"

        def load(self):
            return NEW

    monkeypatch.setattr(reg, "entry_points", lambda group: [EntryPoint()] if group == "speccheck.checks" else [])
    reg.registry.cache_clear()
    keys = [*KEYS.values(), *NEW.policy]
    policy = make_dataclass("Policy", [(k.name, type(k.default), field(default=k.default)) for k in keys],
                            frozen=True, namespace={"to_dict": lambda self: asdict(self)})
    yield policy()
    monkeypatch.undo()
    reg.registry.cache_clear()


def test_a_new_check_shows_in_every_renderer_without_touching_them(suite, with_new_check, tmp_path):  # noqa: F811
    """Added to the registry alone, the check is judged with its own policy key and its own
    measurement, fails the gate by name, and appears in diff, Markdown, HTML, JUnit and
    golden's recorded states."""
    policy = with_new_check
    assert policy.made_up_threshold == 0.5
    result = evaluate_suite(suite, policy, ["baseline", "mtp-k3"])
    cfg = result.get("mtp-k3")
    assert cfg.check("made_up_check").message == "made-up failure over 2 run(s), threshold 0.5"
    assert "made_up_check" not in [c.name for c in result.get("baseline").checks]
    assert "made_up_check failed for config mtp-k3: made-up failure" in gate_text(result)
    assert "  made up       made-up failure over 2 run(s)" in diff_text(result)
    assert "`mtp-k3` made_up_check: **FAIL**" in markdown_report(result)
    html = html_report(result)
    assert "data-check='made_up_check'" in html and "a bug class invented for this test" in html
    write_junit(result, tmp_path / "j.xml")
    case = ET.parse(tmp_path / "j.xml").getroot().find(".//testcase[@name='made_up_check[mtp-k3]']")
    assert case is not None and case.find("failure") is not None
    assert case.find("properties/property[@name='description']").get("value") == NEW.description
    assert golden.check_states(result)["mtp-k3"]["made_up_check"] == "fail"
    recorded = golden.check_states(result)
    assert golden.check_changes(recorded, result) == []
    recorded["mtp-k3"]["made_up_check"] = "pass"
    assert golden.check_changes(recorded, result) == [
        f"mtp-k3 made_up_check: pass in the golden, fail today ({NEW.description})"]
    del recorded["mtp-k3"]["made_up_check"]
    assert golden.check_changes(recorded, result) == [
        f"mtp-k3 made_up_check: not in the golden (a newer check), fail today ({NEW.description})"]


def test_missing_evidence_fails_the_same_way_for_every_check_that_needs_it():
    """A blocking evidence stops the judge; a non-blocking one is named beside what the judge
    found in the evidence that is there."""
    from speccheck.checks import Evidence
    from speccheck.results import ConfigResult, Speed

    r = ConfigResult("mtp-k3", 1, [], None, [], 0, 0, None, None, None, [], [], {}, [], None, None,
                     Speed(None, None, None, None))
    never = Evidence("x", lambda r: False, lambda r: "no x stored; run y")
    judged = []
    for blocking in (True, False):
        spec = CheckSpec("c", None, "g", "d", lambda r, p: judged.append(1) or Check("c", True, "fine"), 1,
                         needs=(Evidence("x", never.present, never.missing, blocking),))
        c = spec.run(r, Policy())
        assert not c.passed and c.message.startswith("evidence missing: no x stored; run y")
    assert judged == [1]  # only the non-blocking case judged, and it still failed
    assert math.isinf(PolicyKey("k", 1, "d").hi)
