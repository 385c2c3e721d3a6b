"""The gate: a SuiteResult becomes an exit code, a failure text and JUnit XML for CI."""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Sequence

from speccheck.checks import get
from speccheck.results import SuiteResult

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_ENGINE, EXIT_INTERNAL = 0, 1, 2, 3, 4
EXIT_INTERRUPTED = 130  # Ctrl-C, the shell convention (128 + SIGINT)
EXIT_PIPE_CLOSED = 141  # the reader of the output left (`| head`): 128 + SIGPIPE


def exit_code(result: SuiteResult) -> int:
    if result.engine_failed:
        return EXIT_ENGINE
    return EXIT_PASS if result.passed else EXIT_FAIL


def plan_note(result: SuiteResult) -> str | None:
    """Said wherever a suite is judged that recorded no plan (stored by an older speccheck)."""
    if result.plan is not None:
        return None
    return (f"note: suite {result.suite} has no recorded plan (stored before speccheck recorded "
            "what `run` was asked for): only the configs stored are judged, a config that never "
            "ran cannot be missed; demand configs with --method/--k/--config.")


def gate_text(result: SuiteResult, unmet: Sequence[str] = ()) -> str:
    """One line per config and per failed check; ``unmet``: demands no config answers (each
    fails the gate)."""
    lines = [f"FAIL  {u}" for u in unmet]
    for r in result.configs:
        failed = [c for c in r.checks if not c.passed and not c.skipped]
        lines.append(f"{'PASS' if not failed else 'FAIL'}  {r.config}")
        for c in failed:
            said = "inconclusive (not a pass)" if c.inconclusive else "failed"
            lines.append(f"      {c.name} {said} for config {r.config}: {c.message}")
    note = plan_note(result)
    if note:
        lines.append(note)
    n_fail = sum(1 for r in result.configs if r.verdict != "pass")
    verdict = "PASS" if result.passed and not unmet else "FAIL"
    lines.append(f"gate: {verdict} — {len(result.configs) - n_fail} of {len(result.configs)} configs "
                 f"pass (suite {result.suite})")
    return "\n".join(lines)


def _spec(name: str):
    try:
        return get(name)
    except KeyError:
        return None


def write_junit(result: SuiteResult, path: Path) -> None:
    """One testsuite per suite, one testcase per (config, check): CI systems render it."""
    cases = [(r.config, c) for r in result.configs for c in r.checks]
    suite = ET.Element("testsuite", name=f"speccheck.{result.suite}", tests=str(len(cases)),
                       failures=str(sum(1 for _, c in cases if not c.passed and not c.skipped)),
                       skipped=str(sum(1 for _, c in cases if c.skipped)))
    for config, c in cases:
        case = ET.SubElement(suite, "testcase", classname=f"speccheck.{config}", name=f"{c.name}[{config}]")
        spec = _spec(c.name)
        if spec is not None:  # what the check means and guards, as pytest's record_property writes it
            props = ET.SubElement(case, "properties")
            ET.SubElement(props, "property", name="description", value=spec.description)
            ET.SubElement(props, "property", name="guards", value=spec.guards)
        if c.skipped:
            ET.SubElement(case, "skipped", message=c.message.splitlines()[0])
        elif not c.passed:
            el = ET.SubElement(case, "failure", message=("inconclusive: " if c.inconclusive else "")
                               + c.message.splitlines()[0])
            el.text = c.message
    from speccheck.files import write_output

    root = ET.Element("testsuites")
    root.append(suite)
    write_output(Path(path), ET.tostring(root, encoding="utf-8", xml_declaration=True), "--junit")
