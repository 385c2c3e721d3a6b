"""The HTML report: one self-contained file (inline CSS and SVG; no script, no network) that
shows in ten seconds what a suite found -- the verdict first, then the K-sweep as
plots, acceptance per draft position, every divergence's margin against the thresholds, the
prompts x configs agreement grid, every check of every config, and the engine identity.

Everything from the store (prompt ids, decoded text, messages, identity) is HTML-escaped here.
Checks are rendered from ``ConfigResult.checks`` as they come, so new checks need no code here.
"""
from __future__ import annotations

import math
import re
from html import escape
from pathlib import Path

from speccheck.checks import get as get_check
from speccheck.checks import registry
from speccheck.results import ConfigResult, SuiteResult
from speccheck.report.text import (acceptance_str, attribution_str, best_configs, determinism_str,
                              recommendation, speedup_table)
from speccheck.report.svgplot import PALETTE, StripPoint, heat_grid, line_plot, log_strip
from speccheck.verify import END, Divergence

CLASS_COLORS = {"near_tie": "#2a9d8f", "low_confidence": "#e09f3e", "high_confidence": "#d62828"}
SECTIONS = (("configs", "configs"), ("sweep", "K-sweep"), ("acceptance", "acceptance"),
            ("margins", "margins"), ("agreement", "agreement"), ("divergences", "divergences"),
            ("checks", "checks"), ("identity", "identity"))
BANNER_ITEMS = 12  # failing configs listed in the banner; every check is in the checks table
VERDICT_TEXT = {"pass": "PASS", "fail": "FAIL", "inconclusive": "INCONCLUSIVE", "error": "ENGINE FAILURE"}

CSS = """
body{font-family:system-ui,sans-serif;margin:0 24px 40px;color:#222;max-width:1500px}
h1{font-size:22px;margin:18px 0 8px} h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd}
h3{font-size:15px;margin:16px 0 6px}
.banner{padding:14px 18px;border-radius:6px;color:#fff;margin:10px 0 14px}
.banner .big{font-size:26px;font-weight:bold;margin-right:14px}
.banner.pass{background:#2b8a3e} .banner.fail{background:#c92a2a} .banner.error{background:#5f3dc4}
.banner ul{margin:8px 0 0;padding-left:22px} .banner li{margin:2px 0} .banner .why{opacity:.85;font-size:13px}
table{border-collapse:collapse;font-size:13px;margin:6px 0}
th,td{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f3f3f3} td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
table.summary td:first-child,table.checks td:first-child{white-space:nowrap}
.chip{display:inline-block;padding:1px 7px;border-radius:9px;font-size:12px;font-weight:bold;color:#fff}
.chip.pass{background:#2b8a3e} .chip.fail{background:#c92a2a} .chip.error{background:#5f3dc4}
.chip.skipped{background:#868e96} .chip.inconclusive{background:#e67700}
.cls-near_tie{color:#2a9d8f} .cls-low_confidence{color:#b7791f} .cls-high_confidence{color:#d62828;font-weight:bold}
.grid td{text-align:center;font-size:12px;min-width:64px}
.grid td.exact{background:#e6f4ea;color:#2b8a3e}
.grid td.near_tie{background:#d8f0ec} .grid td.low_confidence{background:#fbeccd}
.grid td.high_confidence{background:#f8d0d0;font-weight:bold} .grid td.failed{background:#555;color:#fff}
.grid th.prompt{text-align:right}
pre.msg{white-space:pre-wrap;margin:0;font-family:inherit}
code.ctx{white-space:pre-wrap;background:#f6f6f6;padding:1px 3px}
code.ctx mark{background:#ffe066}
.plots{display:flex;flex-wrap:wrap;gap:18px;align-items:flex-start}
.note{color:#555;font-size:13px;margin:4px 0}
details{margin:6px 0} summary{cursor:pointer}
"""


def _e(x) -> str:
    return escape(str(x), quote=True)


def _pct(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f} %"


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else fmt.format(x)


def method_and_k(name: str) -> tuple[str, int] | None:
    """('mtp', 7) for 'mtp-k7'; None for the baseline or any other name."""
    m = re.fullmatch(r"(.+)-k(\d+)", name)
    return (m.group(1), int(m.group(2))) if m else None


#: whose tokens a divergence's decoded context shows, by how the divergence was found
CONTEXT_OF = {"first": "baseline output", "teacher-forced": "spec output", "in a batch": "prompt alone"}
METHOD_ORDER = ("mtp", "dflash", "dflash2")  # fixed colours for the methods people compare


def _methods(result: SuiteResult) -> list[str]:
    """The methods in the suite's config names: the known ones first, in a fixed order (so a
    method keeps its colour from report to report), then any other, alphabetically."""
    found = {mk[0] for r in result.configs if (mk := method_and_k(r.config))}
    return [m for m in METHOD_ORDER if m in found] + sorted(found - set(METHOD_ORDER))


def ordered(result: SuiteResult) -> list[ConfigResult]:
    """Configs as a reader scans them: the baseline, then per method (fixed order) by K, so
    mtp-k10 follows mtp-k9; anything else last, by name."""
    methods = _methods(result)

    def key(r: ConfigResult):
        mk = method_and_k(r.config)
        if r.config == "baseline":
            return (0, 0, 0, "")
        return (1, methods.index(mk[0]), mk[1], "") if mk else (2, 0, 0, r.config)
    return sorted(result.configs, key=key)


def _method_colors(result: SuiteResult) -> dict[str, str]:
    return {m: PALETTE[i % len(PALETTE)] for i, m in enumerate(_methods(result))}


def _baseline(result: SuiteResult) -> ConfigResult | None:
    return next((r for r in result.configs if r.config == "baseline"), None)


def divergence_sets(r: ConfigResult) -> list[tuple[str, list[Divergence]]]:
    """Every divergence a config has, by how it was found."""
    sets = [("first", list(r.divergences)), ("teacher-forced", list(r.tf_divergences))]
    if r.together is not None:
        sets.append(("in a batch", list(r.together.divergences)))
    return sets


def _clip(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"


def _chip(state: str, text: str | None = None) -> str:
    return f'<span class="chip {_e(state)}">{_e(text or state)}</span>'


def _check_state(c) -> str:
    return "skipped" if c.skipped else c.state


# --- sections ------------------------------------------------------------------------------------

def banner(result: SuiteResult) -> str:
    n = len(result.configs)
    bad = [r for r in ordered(result) if r.verdict != "pass"]
    state = "error" if result.engine_failed else ("pass" if result.passed and n else "fail")
    head = VERDICT_TEXT[state] if n else "FAIL"
    if not n:
        text = "the suite holds no configs"
    elif not bad:
        text = f"all {n} configs pass every check"
    else:
        text = f"{len(bad)} of {n} configs do not pass: " + ", ".join(r.config for r in bad)
    items = []
    for r in bad:  # one line per config: what failed, and the start of the first failure's evidence
        failed = [c for c in r.checks if not c.passed and not c.skipped]
        names = ", ".join(c.name for c in failed) or "engine failure"
        first = (failed[0].message if failed else "; ".join(r.failed_runs)).splitlines() or [""]
        items.append(f"<li><b>{_e(r.config)}</b> {_e(names)} <span class='why'>— {_e(_clip(first[0]))}</span></li>")
    counts = {k: 0 for k in CLASS_COLORS}
    for r in ordered(result):
        for _, divs in divergence_sets(r):
            for d in divs:
                counts[d.classification.cls] = counts.get(d.classification.cls, 0) + 1
    facts = [f"divergences: {counts['near_tie']} near-tie, {counts['low_confidence']} low-confidence, "
             f"{counts['high_confidence']} high-confidence"]
    facts += [_e(recommendation(result, m)) for m in best_configs(result)]
    return (f'<div class="banner {state}" id="verdict"><span class="big">{head}</span>{_e(text)}'
            f'<div>{" · ".join(facts)}</div>'
            + (f"<ul>{''.join(items[:BANNER_ITEMS])}</ul>" if items else "")
            + (f"<div>… and {len(items) - BANNER_ITEMS} more failing configs (see Checks below)</div>"
               if len(items) > BANNER_ITEMS else "") + "</div>")


def summary_table(result: SuiteResult) -> str:
    golden = any(r.golden_tokens_per_iter is not None for r in result.configs)
    rows = ["<table class='summary'><tr><th>config</th><th>verdict</th><th>failed checks</th>"
            "<th>warm tok/s</th><th>speedup</th><th>tokens / iter</th>"
            + ("<th>golden tokens / iter</th>" if golden else "") + "<th>acceptance p0..</th>"
            "<th>prompts exact</th><th>teacher-forced agreement</th><th>text</th>"
            "<th>divergences near / low / high</th><th>determinism</th></tr>"]
    for r in ordered(result):
        base = r.config == "baseline"
        failed = [c.name for c in r.checks if not c.passed and not c.skipped]
        cc = r.class_counts or {}
        tpi = "1.00" if base else _num(r.acceptance and r.acceptance.tokens_per_iter, "{:.2f}")
        classes = "-" if base else " / ".join(str(cc.get(k, 0)) for k in CLASS_COLORS)
        rows.append(
            f"<tr data-config='{_e(r.config)}'><td><b>{_e(r.config)}</b></td><td>{_chip(r.verdict)}</td>"
            f"<td>{_e(', '.join(failed) or '-')}</td><td class='num'>{_num(r.speed.warm_tok_s)}</td>"
            f"<td class='num'>{'1.00x' if base else _num(r.speed.speedup, '{:.2f}x')}</td>"
            f"<td class='num'>{tpi}</td>"
            + (f"<td class='num'>{_num(r.golden_tokens_per_iter, '{:.2f}')}</td>" if golden else "") +
            f"<td>{_e(acceptance_str(r))}</td>"
            f"<td class='num'>{'-' if base else f'{r.prompts_exact}/{r.prompts}'}</td>"
            f"<td class='num'>{'-' if base else _pct(r.token_agreement)}</td>"
            f"<td class='num'>{'-' if base else _pct(r.text_similarity)}</td>"
            f"<td class='num'>{classes}</td>"
            f"<td>{_e(determinism_str(r))}</td></tr>")
    rows.append("</table>")
    return "\n".join(rows)


def sweep_plots(result: SuiteResult) -> str:
    """Tokens per iteration and warm tok/s against K, one line per method, baseline dashed."""
    colors = _method_colors(result)
    tpi: dict[str, list] = {m: [] for m in colors}
    tps: dict[str, list] = {m: [] for m in colors}
    for r in ordered(result):
        mk = method_and_k(r.config)
        if not mk:
            continue
        tpi[mk[0]].append((mk[1], r.acceptance.tokens_per_iter if r.acceptance else None))
        tps[mk[0]].append((mk[1], r.speed.warm_tok_s))
    if not colors:
        return "<p class='note'>No speculative configs in this suite: nothing to sweep.</p>"
    base = _baseline(result)
    base_tps = base.speed.warm_tok_s if base else None
    return ("<div class='plots'>"
            + line_plot(tpi, title="tokens per iteration vs K", xlabel="K", ylabel="tokens / iteration",
                        hlines=[(1.0, "baseline 1.00")], colors=colors)
            + line_plot(tps, title="warm decode tok/s vs K", xlabel="K", ylabel="tok/s (warm, median)",
                        hlines=[(base_tps, f"baseline {_num(base_tps)}")] if base_tps else [], colors=colors)
            + "</div>")


def speedup_notes(result: SuiteResult) -> str:
    """Per method swept over Ks: the K the speedup model recommends, its figures folded."""
    return "".join(f"<p class='recommend'><b>{_e(recommendation(result, m.method))}</b></p><details><summary>"
                   f"{_e(m.method)}: the speedup model, measured and predicted speedup per K</summary>"
                   f"<pre>{_e(speedup_table(m))}</pre></details>" for m in result.speedup.values())


def acceptance_plot(result: SuiteResult) -> str:
    rows = [r for r in ordered(result) if r.acceptance is not None and r.acceptance.per_pos]
    if not rows:
        return "<p class='note'>No config reported per-position acceptance counters.</p>"
    width = max(len(r.acceptance.per_pos) for r in rows)
    values = [list(r.acceptance.per_pos) + [None] * (width - len(r.acceptance.per_pos)) for r in rows]
    return heat_grid([r.config for r in rows], [f"p{i}" for i in range(width)], values,
                     title="acceptance rate per draft position", xlabel="draft position")


def _tok(detok, t: int) -> str:
    if t == END:
        return "⟨end⟩"
    if detok is None:
        return str(t)
    try:
        return f"{detok([t])!r} ({t})"
    except Exception:  # noqa: BLE001 - an id that does not decode is still evidence
        return str(t)


def margin_plot(result: SuiteResult) -> str:
    """Every divergence's baseline margin on a log axis against tau_tie, tau_low and path noise."""
    points, rows = [], []
    for r in ordered(result):
        for kind, divs in divergence_sets(r):
            for d in divs:
                c = d.classification
                m = c.base_margin
                if r.config not in rows:
                    rows.append(r.config)
                where = ("exact tie, drawn at the floor" if m == 0 else
                         "margin unknown (a stream had ended), drawn at the right edge" if not math.isfinite(m) else
                         "negative margin, drawn at the floor" if m < 0 else f"{m:.3g} nats")
                points.append(StripPoint(
                    r.config, m, CLASS_COLORS.get(c.cls, "#000"),
                    f"{r.config} · {kind} · prompt {d.prompt_id} @{d.position}: baseline margin {where}, "
                    f"{_num(d.margin_in_noise)}x noise · {c.cls}",
                    hollow=kind != "first",
                    data=(("prompt", d.prompt_id), ("position", str(d.position)), ("cls", c.cls),
                          ("kind", kind))))
    if not points:
        return "<p class='note'>No divergences: every config reproduced the baseline token for token.</p>"
    vlines = [(result.noise, f"path noise {_num(result.noise, '{:.3g}')}", "#666"),
              (result.tau_tie, f"τ_tie {_num(result.tau_tie, '{:.3g}')}", CLASS_COLORS["near_tie"]),
              (result.tau_low, f"τ_low {_num(result.tau_low, '{:.3g}')}", CLASS_COLORS["low_confidence"])]
    return (log_strip(rows, points, title="baseline margin (top-1 − top-2, nats) at every divergence",
                      xlabel="baseline margin, nats (log)", vlines=vlines,
                      legend=[(k.replace("_", " "), v) for k, v in CLASS_COLORS.items()])
            + "<p class='note'>Filled: first divergence (free running); hollow: teacher-forced or "
              "in a batch. Triangles at the left edge are exact ties (margin 0); squares at the right "
              "edge have no margin (one stream had ended). Hover a point for its prompt and position."
            + ("" if (result.noise or 0) > 0 else " Path noise was not measured (no teacher-forced rescoring of "
               "the baseline): the thresholds are the policy's floors.") + "</p>")


def agreement_grid(result: SuiteResult) -> str:
    """Prompts x spec configs: exact, first divergence at position p (coloured by class), or
    failed / missing."""
    configs = [r for r in ordered(result) if r.config != "baseline"]
    if not configs:
        return "<p class='note'>No speculative configs.</p>"
    prompts: list[str] = []
    base = _baseline(result)
    for r in ([base] if base else []) + configs:
        for p in r.prompt_ids:
            if p not in prompts:
                prompts.append(p)
        for d in r.divergences:
            if d.prompt_id not in prompts:
                prompts.append(d.prompt_id)
    head = "".join(f"<th>{_e(r.config)}</th>" for r in configs)
    rows = [f"<table class='grid'><tr><th class='prompt'>prompt</th>{head}</tr>"]
    for p in prompts:
        cells = []
        for r in configs:
            d = next((d for d in r.divergences if d.prompt_id == p), None)
            if d is not None:
                c = d.classification
                cells.append(f"<td class='{_e(c.cls)}' data-config='{_e(r.config)}' data-prompt='{_e(p)}' "
                             f"title='{_e(c.cls)}: baseline margin {_num(c.base_margin, '{:.3g}')} nats'>"
                             f"@{d.position}</td>")
            elif p in r.prompt_ids:
                cells.append(f"<td class='exact' data-config='{_e(r.config)}' data-prompt='{_e(p)}'>exact</td>")
            else:
                why = "failed" if r.failed_runs else "missing"
                cells.append(f"<td class='failed' data-config='{_e(r.config)}' data-prompt='{_e(p)}'>{why}</td>")
        rows.append(f"<tr><th class='prompt'>{_e(p)}</th>{''.join(cells)}</tr>")
    rows.append("</table>")
    return ("\n".join(rows) + "<p class='note'>exact: the spec config reproduced the baseline token for "
            "token; @p: first divergence at generated position p (colour: its class); failed / missing: "
            "no completion to compare.</p>")


def _context_html(ctx: str) -> str:
    """'prefix⟦token⟧' with the divergent token highlighted; newlines shown as ↵."""
    def show(s: str) -> str:
        return _e(s).replace("\n", "↵")
    i = ctx.rfind("⟦")
    if i >= 0 and ctx.endswith("⟧"):
        return f"<code class='ctx'>{show(ctx[:i])}<mark>{show(ctx[i + 1:-1])}</mark></code>"
    return f"<code class='ctx'>{show(ctx)}</code>"


def _divergence_table(r: ConfigResult, divs: list[Divergence], kind: str, detok) -> str:
    attr = {(a.get("prompt_id"), a.get("position")): a for a in r.attribution} if kind == "first" else {}
    rows = ["<table class='divs'><tr><th>prompt</th><th>pos</th><th>class</th><th>baseline → spec token</th>"
            "<th>margin base / spec (nats)</th><th>× noise</th><th>spec token in baseline top-k</th>"
            f"<th>context ({CONTEXT_OF.get(kind, kind)})</th>" + ("<th>kernel path</th>" if attr else "") + "</tr>"]
    for d in divs:
        c = d.classification
        rank = "absent" if c.spec_rank_in_base is None else f"rank {c.spec_rank_in_base + 1}"
        a = attr.get((d.prompt_id, d.position))
        rows.append(
            f"<tr class='div' data-config='{_e(r.config)}' data-kind='{_e(kind)}' data-prompt='{_e(d.prompt_id)}' "
            f"data-position='{d.position}'><td>{_e(d.prompt_id)}</td><td class='num'>{d.position}</td>"
            f"<td class='cls-{_e(c.cls)}'>{_e(c.cls)}</td>"
            f"<td>{_e(_tok(detok, d.base_token))} → {_e(_tok(detok, d.spec_token))}</td>"
            f"<td class='num'>{_num(c.base_margin, '{:.3g}')} / {_num(c.spec_margin, '{:.3g}')}</td>"
            f"<td class='num'>{'∞' if d.margin_in_noise == math.inf else _num(d.margin_in_noise)}</td>"
            f"<td>{rank}</td>"
            f"<td>{_context_html(d.context) if d.context else '-'}</td>"
            + (f"<td>{_e(attribution_str(a)) if a else '-'}</td>" if attr else "") + "</tr>")
    rows.append("</table>")
    return "\n".join(rows)


def divergence_list(result: SuiteResult, detok=None) -> str:
    out = []
    for r in ordered(result):
        sets = [(k, d) for k, d in divergence_sets(r) if d]
        if not sets:
            continue
        out.append(f"<h3 id='div-{_e(r.config)}'>{_e(r.config)}</h3>")
        for kind, divs in sets:
            table = _divergence_table(r, divs, kind, detok)
            if kind == "first":
                out.append(f"<p class='note'>first divergence per prompt (free running): {len(divs)}</p>{table}")
            else:
                high = sum(d.classification.cls == "high_confidence" for d in divs)
                out.append(f"<details{' open' if high else ''}><summary>{_e(kind)} divergences: {len(divs)}"
                           f"{f', {high} high-confidence' if high else ''}</summary>{table}</details>")
    return "\n".join(out) or "<p class='note'>None: every config reproduced the baseline token for token.</p>"


def checks_section(result: SuiteResult) -> str:
    out = ["<table class='checks'><tr><th>config</th><th>check</th><th>result</th><th>message</th></tr>"]
    for r in ordered(result):
        checks = r.checks or []
        for i, c in enumerate(checks):
            cfg = (f"<td rowspan='{len(checks)}'><b>{_e(r.config)}</b><br>{_chip(r.verdict)}</td>"
                   if i == 0 else "")
            out.append(f"<tr class='check' data-config='{_e(r.config)}' data-check='{_e(c.name)}'>{cfg}"
                       f"<td title='{_e(_description(c.name))}'>{_e(c.name)}</td><td>{_chip(_check_state(c))}</td>"
                       f"<td><pre class='msg'>{_e(c.message)}</pre></td></tr>")
        if not checks:
            out.append(f"<tr class='check' data-config='{_e(r.config)}'><td><b>{_e(r.config)}</b></td>"
                       f"<td colspan='3'>no checks evaluated</td></tr>")
    out.append("</table>")
    return "\n".join(out) + checks_legend()


def _description(name: str) -> str:
    try:
        return get_check(name).description
    except KeyError:
        return ""


def checks_legend() -> str:
    """What each registered check means and which bug class it guards."""
    rows = "".join(f"<tr><td><code>{_e(s.name)}</code></td><td>{_e(s.description)}</td>"
                   f"<td>{_e(s.guards)}</td></tr>" for s in registry())
    return ("<details class='legend'><summary>what each check means</summary><table class='checks'>"
            f"<tr><th>check</th><th>passes when</th><th>guards against</th></tr>{rows}</table></details>")


def _flat(items, prefix: str = ""):
    """Nested dicts (kernel knobs, weight hashes) as dotted keys, one row each."""
    for k, v in items:
        if isinstance(v, dict) and v:
            yield from _flat(v.items(), f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _kv_table(items) -> str:
    items = _flat(items)
    return ("<table class='kv'>" + "".join(f"<tr><th>{_e(k)}</th><td><code>{_e(v)}</code></td></tr>"
                                           for k, v in items) + "</table>")


def identity_section(result: SuiteResult) -> str:
    meta = [(k, v) for k, v in (result.meta or {}).items() if v not in (None, "", [], {})]
    noise = [("path noise (nats)", _num(result.noise, "{:.4g}")), ("τ_tie", _num(result.tau_tie, "{:.4g}")),
             ("τ_low", _num(result.tau_low, "{:.4g}"))]
    return (f"<div class='plots'><div><h3>engine and kernels</h3>{_kv_table((result.identity or {}).items())}</div>"
            f"<div><h3>suite</h3>{_kv_table([('suite', result.suite)] + meta + noise)}</div>"
            f"<div><h3>policy</h3>{_kv_table((result.policy or {}).items())}</div></div>")


def sampling_plots(result: SuiteResult) -> str:
    """A sampled suite's distribution check per config: the PIT histogram (uniform under
    losslessness: density 1) and the per-position mean of log p - E[log p] (0 under
    losslessness). Nothing for a greedy suite."""
    fits = {r.config: r.measured.get("sampled_matches_target") for r in ordered(result)}
    fits = {c: f for c, f in fits.items() if hasattr(f, "pit_hist")}
    if not fits:
        return ""
    colors = {c: PALETTE[i % len(PALETTE)] for i, c in enumerate(fits)}
    hist = {c: [((i + 0.5) / len(f.pit_hist), n * len(f.pit_hist) / max(f.positions, 1))
                for i, n in enumerate(f.pit_hist)] for c, f in fits.items()}
    drift = {c: [(i, m if n >= 3 else None) for i, (m, n) in enumerate(zip(f.drift_mean, f.drift_n))]
             for c, f in fits.items()}
    return ("<h2 id='sampling'>Sampled distribution</h2>"
            + line_plot(hist, title="PIT histogram (uniform: 1)", xlabel="PIT", ylabel="density",
                        hlines=[(1.0, "uniform")], colors=colors, integer_x=False)
            + line_plot(drift, title="log-likelihood drift per position (lossless: 0)",
                        xlabel="output position", ylabel="mean log p - E log p (nats)",
                        hlines=[(0.0, "0")], colors=colors))


def html_report(result: SuiteResult, detok=None) -> str:
    engine = (result.identity or {}).get("engine") or (result.meta or {}).get("engine") or "?"
    corpus = (result.meta or {}).get("corpus") or "?"
    return "\n".join([
        "<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>",
        f"<title>speccheck — {_e(result.suite)}</title><style>{CSS}</style></head><body>",
        f"<h1>speccheck report — {_e(result.suite)}</h1>",
        f"<p class='note'>{_e(engine)} engine · corpus {_e(corpus)} · {len(result.configs)} configs · "
        f"path noise {_num(result.noise, '{:.4g}')} nats (τ_tie {_num(result.tau_tie, '{:.3g}')}, "
        f"τ_low {_num(result.tau_low, '{:.3g}')})</p>",
        banner(result),
        "<p class='note'>" + " · ".join(f"<a href='#{a}'>{t}</a>" for a, t in SECTIONS) + "</p>",
        "<h2 id='configs'>Configs</h2>", summary_table(result),
        "<h2 id='sweep'>K-sweep</h2>", sweep_plots(result), speedup_notes(result),
        "<h2 id='acceptance'>Acceptance per draft position</h2>", acceptance_plot(result),
        "<h2 id='margins'>Divergence margins</h2>", margin_plot(result),
        sampling_plots(result),
        "<h2 id='agreement'>Per-prompt agreement with the baseline</h2>", agreement_grid(result),
        "<h2 id='divergences'>Divergences</h2>", divergence_list(result, detok),
        "<h2 id='checks'>Checks</h2>", checks_section(result),
        "<h2 id='identity'>Engine, kernels, suite, policy</h2>", identity_section(result),
        "</body></html>", ""])


def write_html(result: SuiteResult, path: Path, detok=None) -> Path:
    from speccheck.files import write_output

    return write_output(Path(path), html_report(result, detok), "--html")
