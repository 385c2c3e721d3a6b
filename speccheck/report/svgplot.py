"""Small inline SVG plots for the HTML report: a line plot, a heat grid and a strip plot on a
log axis. Pure functions from numbers to SVG text, so the report needs no plotting library, no
script and no network. Every data point is an element of class ``pt`` with a ``<title>`` (the
browser shows it on hover) and ``data-*`` attributes, so a test can find the points again.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape
from typing import Sequence

FONT = "font-family:system-ui,sans-serif;font-size:12px"
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")


def _e(x) -> str:
    return escape(str(x), quote=True)


def _f(x: float) -> str:
    return f"{x:.1f}"


def _fmt_tick(v: float) -> str:
    return f"{v:g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.0e}"


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About n round tick values covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo] if math.isfinite(lo) else [0.0]
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks, v = [], start
    while v <= hi + step * 1e-9:
        if v >= lo - step * 1e-9:
            ticks.append(round(v, 12))
        v += step
    return ticks


def _svg_open(width: int, height: int, title: str, kind: str) -> list[str]:
    return [f'<svg class="plot {kind}" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="{_e(title)}" style="{FONT}">',
            f'<text x="{width / 2:.0f}" y="16" text-anchor="middle" font-weight="bold">{_e(title)}</text>']


def line_plot(series: dict[str, Sequence[tuple[float, float | None]]], *, title: str, xlabel: str,
              ylabel: str, hlines: Sequence[tuple[float, str]] = (), colors: dict[str, str] | None = None,
              width: int = 520, height: int = 320, integer_x: bool = True) -> str:
    """One polyline with point markers per series; points with y None are left out. ``hlines``
    are dashed reference lines (e.g. the baseline)."""
    colors = colors or {}
    pts = {name: [(x, y) for x, y in s if y is not None and math.isfinite(y)] for name, s in series.items()}
    xs = [x for s in pts.values() for x, _ in s]
    ys = [y for s in pts.values() for _, y in s] + [y for y, _ in hlines if y is not None]
    out = _svg_open(width, height, title, "line")
    if not xs:
        out.append(f'<text x="{width / 2:.0f}" y="{height / 2:.0f}" text-anchor="middle" fill="#666">'
                   "no data</text></svg>")
        return "\n".join(out)
    left, right, top, bottom = 56, 130, 28, 44
    x0, x1 = min(xs), max(xs)
    pad = max((x1 - x0) * 0.06, 0.5)  # no point on the frame
    x0, x1 = x0 - pad, x1 + pad
    y0, y1 = min(0.0, min(ys)), max(ys) * 1.08 or 1.0
    pw, ph = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + ph - (y - y0) / (y1 - y0) * ph

    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>')
    for t in nice_ticks(y0, y1):
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{_f(sy(t))}" y2="{_f(sy(t))}" stroke="#eee"/>'
                   f'<text x="{left - 6}" y="{_f(sy(t) + 4)}" text-anchor="end">{_fmt_tick(t)}</text>')
    xt = sorted(set(xs)) if integer_x and len(set(xs)) <= 16 else nice_ticks(x0, x1)
    for t in xt:
        out.append(f'<text x="{_f(sx(t))}" y="{top + ph + 16}" text-anchor="middle">{_fmt_tick(t)}</text>')
    out.append(f'<text x="{left + pw / 2:.0f}" y="{height - 8}" text-anchor="middle">{_e(xlabel)}</text>')
    out.append(f'<text transform="translate(14,{top + ph / 2:.0f}) rotate(-90)" text-anchor="middle">'
               f'{_e(ylabel)}</text>')
    for y, label in hlines:
        if y is None or not math.isfinite(y):
            continue
        out.append(f'<g class="ref"><line x1="{left}" x2="{left + pw}" y1="{_f(sy(y))}" y2="{_f(sy(y))}" '
                   f'stroke="#555" stroke-dasharray="5,4"/><text x="{left + pw - 4}" y="{_f(sy(y) - 4)}" '
                   f'text-anchor="end" fill="#555">{_e(label)}</text></g>')
    for i, (name, s) in enumerate(pts.items()):
        color = colors.get(name, PALETTE[i % len(PALETTE)])
        s = sorted(s)
        out.append(f'<g class="series" data-series="{_e(name)}">')
        if len(s) > 1:
            path = " ".join(f"{_f(sx(x))},{_f(sy(y))}" for x, y in s)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for x, y in s:
            out.append(f'<circle class="pt" cx="{_f(sx(x))}" cy="{_f(sy(y))}" r="4" fill="{color}" '
                       f'data-series="{_e(name)}" data-x="{x:g}" data-y="{y:.6g}">'
                       f'<title>{_e(name)} {_e(xlabel)}={x:g}: {y:.3g}</title></circle>')
            if len(s) <= 12:  # few points: print each value, as the seed's table does
                dy = -8 if i % 2 == 0 else 15  # alternate series label below their points
                out.append(f'<text x="{_f(sx(x))}" y="{_f(sy(y) + dy)}" text-anchor="middle" font-size="10" '
                           f'fill="{color}">{y:.3g}</text>')
        out.append("</g>")
        ly = top + 14 + 18 * i
        out.append(f'<g class="legend"><rect x="{left + pw + 10}" y="{ly - 9}" width="12" height="12" '
                   f'fill="{color}"/><text x="{left + pw + 27}" y="{ly + 1}">{_e(name)}</text></g>')
    out.append("</svg>")
    return "\n".join(out)


def _heat_color(v: float) -> str:
    """White (0) to a saturated blue (1)."""
    v = min(max(v, 0.0), 1.0)
    r, g, b = (int(255 + (c - 255) * v) for c in (33, 102, 172))
    return f"rgb({r},{g},{b})"


def heat_grid(rows: Sequence[str], cols: Sequence[str], values: Sequence[Sequence[float | None]], *,
              title: str, xlabel: str = "", cell: int = 44, label_width: int = 110) -> str:
    """A rows x cols grid of values in [0, 1], each cell coloured and labelled with its value;
    None cells are left blank."""
    top = 40
    width = max(label_width + cell * max(len(cols), 1) + 20, 7 * len(title) + 40)  # room for the title
    height = top + 22 * len(rows) + 36
    out = _svg_open(width, height, title, "heat")
    for j, c in enumerate(cols):
        out.append(f'<text x="{label_width + cell * j + cell / 2:.0f}" y="{top - 6}" '
                   f'text-anchor="middle">{_e(c)}</text>')
    for i, row in enumerate(rows):
        y = top + 22 * i
        out.append(f'<text x="{label_width - 6}" y="{y + 15}" text-anchor="end">{_e(row)}</text>')
        for j, v in enumerate(values[i]):
            if v is None or not math.isfinite(v):
                continue
            x = label_width + cell * j
            ink = "#fff" if v > 0.55 else "#000"
            out.append(f'<g class="pt" data-row="{_e(row)}" data-col="{_e(cols[j])}" data-v="{v:.6g}">'
                       f'<rect x="{x + 1}" y="{y + 1}" width="{cell - 2}" height="20" fill="{_heat_color(v)}"/>'
                       f'<text x="{x + cell / 2:.0f}" y="{y + 15}" text-anchor="middle" fill="{ink}">'
                       f'{v:.2f}</text><title>{_e(row)} {_e(cols[j])}: {v:.3f}</title></g>')
    if xlabel:
        out.append(f'<text x="{label_width + cell * len(cols) / 2:.0f}" y="{height - 8}" '
                   f'text-anchor="middle">{_e(xlabel)}</text>')
    out.append("</svg>")
    return "\n".join(out)


@dataclass(frozen=True)
class StripPoint:
    row: str  # which row (e.g. the config) the point sits in
    x: float  # may be 0 (drawn at the floor, marked) or NaN/inf (drawn at the ceiling, marked)
    color: str
    label: str  # hover text
    hollow: bool = False
    data: tuple[tuple[str, str], ...] = ()  # extra data-* attributes


def log_strip(rows: Sequence[str], points: Sequence[StripPoint], *, title: str, xlabel: str,
              vlines: Sequence[tuple[float, str, str]] = (), legend: Sequence[tuple[str, str]] = (),
              width: int = 900, row_height: int = 28, label_width: int = 110) -> str:
    """Points on a log x axis, one row per category. Values <= 0 (an exact tie has margin 0)
    are drawn at the axis floor as a triangle and values that are not finite at the ceiling as
    a square, so no point disappears. ``vlines`` are (x, label, colour) thresholds."""
    pos = [p.x for p in points if math.isfinite(p.x) and p.x > 0] + \
          [x for x, _, _ in vlines if x is not None and math.isfinite(x) and x > 0]
    lo = math.floor(math.log10(min(pos))) if pos else -4
    hi = math.floor(math.log10(max(pos))) + 1 if pos else 1  # a decade of room for the labels
    if hi - lo < 2:
        lo, hi = lo - 1, hi + 1
    lo -= 1  # one decade below the smallest value: room for the floor (exact ties)
    top, bottom, right = 58, 56, 40
    pw = width - label_width - right
    ph = row_height * max(len(rows), 1)
    height = top + ph + bottom + (18 if legend else 0)

    def sx(x: float) -> float:
        return label_width + (math.log10(x) - lo) / (hi - lo) * pw

    out = _svg_open(width, height, title, "strip")
    out.append(f'<rect x="{label_width}" y="{top}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>')
    for d in range(lo, hi + 1):
        x = sx(10.0 ** d)
        label = "0 / tie" if d == lo else _fmt_tick(10.0 ** d)
        out.append(f'<line x1="{_f(x)}" x2="{_f(x)}" y1="{top}" y2="{top + ph}" stroke="#e4e4e4"/>'
                   f'<text x="{_f(x)}" y="{top + ph + 15}" text-anchor="middle">{label}</text>')
    out.append(f'<text x="{label_width + pw / 2:.0f}" y="{top + ph + 34}" text-anchor="middle">{_e(xlabel)}</text>')
    for i, row in enumerate(rows):
        y = top + row_height * i
        out.append(f'<text x="{label_width - 6}" y="{y + row_height / 2 + 4:.0f}" text-anchor="end">{_e(row)}</text>')
        if i:
            out.append(f'<line x1="{label_width}" x2="{label_width + pw}" y1="{y}" y2="{y}" stroke="#eee"/>')
    for k, (x, label, color) in enumerate(vlines):
        if x is None or not math.isfinite(x) or x <= 0:
            continue
        out.append(f'<g class="ref"><line x1="{_f(sx(x))}" x2="{_f(sx(x))}" y1="{top - 4}" y2="{top + ph}" '
                   f'stroke="{color}" stroke-width="1.5" stroke-dasharray="6,3"/>'
                   f'<text x="{_f(sx(x) + 3)}" y="{top - 6 - 12 * (k % 2)}" fill="{color}">{_e(label)}</text></g>')
    index = {r: i for i, r in enumerate(rows)}
    seen: dict[str, int] = {}
    for p in points:
        i = index.get(p.row, 0)
        n = seen.get(p.row, 0)
        seen[p.row] = n + 1
        jitter = ((n * 7) % 11 - 5) / 5 * (row_height / 2 - 5)  # spread points of one row
        y = top + row_height * i + row_height / 2 + jitter
        fill = "none" if p.hollow else p.color
        attrs = "".join(f' data-{_e(k)}="{_e(v)}"' for k, v in p.data)
        common = (f'class="pt" data-row="{_e(p.row)}" data-x="{p.x:.6g}"{attrs} fill="{fill}" '
                  f'stroke="{p.color}" stroke-width="1.5"')
        if math.isfinite(p.x) and p.x > 0:
            shape = f'<circle cx="{_f(sx(p.x))}" cy="{_f(y)}" r="4.5" {common}>'
            end = "</circle>"
        elif math.isfinite(p.x):  # an exact tie or a negative margin: the floor, a triangle
            x = sx(10.0 ** lo)
            shape = (f'<polygon points="{_f(x)},{_f(y - 6)} {_f(x - 5)},{_f(y + 4)} {_f(x + 5)},{_f(y + 4)}" '
                     f'{common} data-clamped="floor">')
            end = "</polygon>"
        else:  # margin unknown (a stream had ended): the ceiling, a square
            x = sx(10.0 ** hi)
            shape = f'<rect x="{_f(x - 4)}" y="{_f(y - 4)}" width="8" height="8" {common} data-clamped="ceiling">'
            end = "</rect>"
        out.append(f"{shape}<title>{_e(p.label)}</title>{end}")
    if legend:
        x = label_width
        for name, color in legend:
            out.append(f'<g class="legend"><circle cx="{x + 6}" cy="{height - 12}" r="5" fill="{color}"/>'
                       f'<text x="{x + 15}" y="{height - 8}">{_e(name)}</text></g>')
            x += 22 + 7 * len(name)
    out.append("</svg>")
    return "\n".join(out)
