"""What a person reads: the `diff` text and the Markdown report (:mod:`.text`), the HTML report
(:mod:`.html`, with its SVG plots), and the JSON summary -- all rendered from a judged suite."""
from __future__ import annotations

import json
from pathlib import Path

from speccheck.report.html import html_report, write_html
from speccheck.report.text import (acceptance_str, attribution_str, best_configs, compared_configs,
                                   determinism_str, diff_text, divergence_line, markdown_report,
                                   method_table, recommendation, recommendation_line, speedup_table, sweep_table)
from speccheck.results import SuiteResult

__all__ = ["acceptance_str", "attribution_str", "best_configs", "compared_configs", "determinism_str",
           "diff_text", "divergence_line", "html_report", "markdown_report", "method_table",
           "recommendation", "recommendation_line", "speedup_table", "sweep_table", "write_html", "write_report"]


def write_report(result: SuiteResult, out_dir: Path, detok=None, html: Path | None = None) -> tuple[Path, ...]:
    """report.md, report.json and the HTML report (``html``, default report.html beside them)."""
    from speccheck.files import write_output

    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = out_dir / "report.md", out_dir / "report.json"
    write_output(md, markdown_report(result, detok), "--out")
    write_output(js, json.dumps(result.to_dict(), indent=1, default=str, ensure_ascii=False), "--out")
    return md, js, write_html(result, html or out_dir / "report.html", detok)
