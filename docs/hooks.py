"""mkdocs hook: the reference pages are generated from the code at build time, so they cannot
drift from it. A page asks for a table with a marker line such as ``<!-- speccheck:checks -->``."""
from __future__ import annotations

import re
from pathlib import Path

import click

MARKER = re.compile(r"^<!-- speccheck:(\w+)(?: (\S+))? -->$", re.MULTILINE)
ROOT = Path(__file__).resolve().parents[1]


def _cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def checks() -> str:
    from speccheck.checks import registry

    rows = ["| check | judged for | what passing means | bug class it guards |", "|---|---|---|---|"]
    for c in registry():
        where = ("DFlash2 configs" if c.methods == ("dflash2",) else
                 ", ".join(c.methods) + " configs" if c.methods else
                 "every config, the baseline too" if c.baseline else "every spec config")
        rows.append(f"| `{c.name}` | {where} | {_cell(c.description)} | {_cell(c.guards)} |")
    return "\n".join(rows)


def policy() -> str:
    from speccheck.policy import KEYS

    owner = {}
    from speccheck.checks import registry

    for c in registry():
        for k in c.policy:
            owner[k.name] = c.name
    rows = ["| key | default | accepts | used by | meaning |", "|---|---|---|---|---|"]
    for k in KEYS.values():
        accepts = ("true / false" if isinstance(k.default, bool) and not k.optional else
                   f"{'above ' if k.above else ''}{k.lo:g} … {'∞' if k.hi == float('inf') else f'{k.hi:g}'}"
                   + (" or false (report only)" if k.optional else ""))
        used = f"`{owner[k.name]}`" if k.name in owner else "divergence classes"
        rows.append(f"| `{k.name}` | `{str(k.default).lower() if isinstance(k.default, bool) else k.default}` "
                    f"| {accepts} | {used} | {_cell(k.doc)} |")
    return "\n".join(rows)


def axes() -> str:
    from speccheck.axes import registry

    rows = ["| axis | default levels | run by | proof that it was exercised | drives the engine into |",
            "|---|---|---|---|---|"]
    for a in registry():
        proofs = "; ".join(f"{lv}: {', '.join(f'`{k}`' for k in keys)} > 0"
                           for lv, keys in a.proofs.items()) or "its requests were served"
        served = [lv for lv in a.levels if lv not in a.generate_levels]
        by = ("any engine (one request after another)" if a.runs_on == "runner" else
              "; ".join(([f"{'+'.join(a.generate_levels)}: any engine"] if a.generate_levels else [])
                        + [f"{'+'.join(served)}: an engine that serves it"]))
        rows.append(f"| `{a.name}` | {', '.join(a.levels)} | {by} | {proofs} | "
                    f"{_cell(a.description)} *Guards:* {_cell(a.guards)} |")
    return "\n".join(rows)


def faults() -> str:
    from speccheck.reference.decode import FAULTS
    from speccheck.selftest import CASES

    case = {c.fault: c for c in CASES}
    rows = ["| fault | what it plants | bug class it models | check that must fail |",
            "|---|---|---|---|"]
    for name, what in FAULTS.items():
        c = case.get(name)
        rows.append(f"| `{name}` | {_cell(what)} | {_cell(c.models) if c else ''} | "
                    f"{f'`{c.check}`' if c else ''} |")
    return "\n".join(rows)


def cli() -> str:
    from speccheck.cli import main

    out = []

    def walk(cmd: click.Command, path: list[str]) -> None:
        ctx = click.Context(cmd, info_name=" ".join(path))
        out.append(f"## `{' '.join(path)}`\n\n```text\n{cmd.get_help(ctx)}\n```\n")
        if isinstance(cmd, click.Group):
            for name in sorted(cmd.commands):
                walk(cmd.commands[name], [*path, name])

    walk(main, ["speccheck"])
    return "\n".join(out)


def include(path: str) -> str:
    """A file of the repository shown in the site as it is (one source, e.g. the benchmarks)."""
    text = (ROOT / path).read_text(encoding="utf-8")
    return text.split("\n", 1)[1] if text.startswith("# ") else text  # the page has its own title


GENERATORS = {"checks": checks, "policy": policy, "axes": axes, "faults": faults, "cli": cli,
              "include": include}


def on_page_markdown(markdown: str, page, config, files) -> str:
    def render(m: re.Match) -> str:
        name = m.group(1)
        if name not in GENERATORS:
            raise ValueError(f"{page.file.src_path}: unknown generated table {name!r}; "
                             f"one of {', '.join(GENERATORS)}")
        return GENERATORS[name](*filter(None, [m.group(2)]))

    return MARKER.sub(render, markdown)
