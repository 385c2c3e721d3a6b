"""The HTML report: parsed back with the stdlib's html.parser (every config, check and divergence
present; plots are SVG with data points; no external URL; store text escaped), written by
`speccheck report --html` from a store of constructed runs, and rendered by headless Chromium
where it is installed."""
from __future__ import annotations

import math
import shutil
import subprocess
from html.parser import HTMLParser

import numpy as np
import pytest
from click.testing import CliRunner

from speccheck.cli import main
from speccheck.report.html import html_report, method_and_k, ordered
from speccheck.report.svgplot import (
    StripPoint,
    heat_grid,
    line_plot,
    log_strip,
    nice_ticks,
)
from speccheck.results import Check, ConfigResult, Speed, SuiteResult, Together
from speccheck.store import Store
from speccheck.types import Completion, RunRecord, SpecConfig, SpecCounters
from speccheck.verify import Acceptance, Divergence
from speccheck.verify.margins import Classification
from tests.test_evaluate import complete_as_run_would

EVIL = "<script>alert('x')</script>&amp;"


class Dom(HTMLParser):
    """Elements as (tag, attrs) in document order, and all text."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self.stack: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))
        self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag in self.stack:
            while self.stack.pop() != tag:
                pass

    def handle_data(self, data):
        self.text.append(data)

    def all(self, tag=None, **attrs) -> list[dict]:
        return [a for t, a in self.elements if (tag is None or t == tag)
                and all(a.get(k.replace("_", "-")) == v for k, v in attrs.items())]

    @property
    def full_text(self) -> str:
        return "".join(self.text)


def div(pid, pos, cls, margin, context="", base=5, spec=6):
    c = Classification(cls, margin, 0.02, 1 if cls != "high_confidence" else None, 1)
    return Divergence(pid, pos, base, spec, c, 0.01, margin / 0.01 if margin == margin else math.nan,
                      [(base, -0.5), (spec, -0.5 - margin)], [(spec, -0.5), (base, -0.52)], context)


def config(name, *, divs=(), tf=(), tpi=None, per_pos=(), tok_s=None, speedup=None, checks=None,
           failed=(), prompts=("p1", "p2", "p3"), together=None):
    acc = Acceptance(10, 10 * len(per_pos), 7, tpi, 0.7, tuple(per_pos)) if tpi is not None else None
    checks = checks if checks is not None else [Check("ran", True, "all runs completed"),
                                                Check("deterministic", True, "2 runs identical")]
    cc = {"near_tie": 0, "low_confidence": 0, "high_confidence": 0}
    for d in list(divs) + list(tf):
        cc[d.classification.cls] += 1
    return ConfigResult(
        config=name, repeats=2, failed_runs=list(failed), identical_runs=None if failed else True,
        nondeterminism=[], prompts=len(prompts), prompts_exact=len(prompts) - len(divs),
        prefix_agreement=0.99, token_agreement=0.995, text_similarity=0.99, divergences=list(divs),
        tf_divergences=list(tf), class_counts=cc, attribution=[], acceptance=acc,
        golden_tokens_per_iter=None, speed=Speed(tok_s, tok_s, 0.01, speedup), together=together,
        checks=checks, prompt_ids=[] if failed else list(prompts))


def synthetic_suite() -> SuiteResult:
    """A suite with every shape the page must show: several methods and Ks (one a method this
    module has never heard of), an exact tie (margin 0), a divergence with no margin (a stream
    ended), store text carrying markup, a failing check of a name no code knows, an engine
    failure, figures missing (None)."""
    t = Together(2, 6, 3, 2, 0.98, [div("p2", 4, "near_tie", 0.003)], {"p2": 2})
    configs = [
        config("baseline", tok_s=30.0),
        config("mtp-k1", tpi=1.8, per_pos=[0.8], tok_s=34.0, speedup=1.13),
        config("mtp-k3", tpi=2.9, per_pos=[0.85, 0.65, 0.5], tok_s=49.0, speedup=1.63,
               divs=[div("p1", 17, "near_tie", 0.0, context="Hello⟦ world⟧")],
               tf=[div("p1", 30, "low_confidence", 0.04)], together=t),
        config("dflash-k7", tpi=3.9, per_pos=[0.77, 0.6, 0.5, 0.42, 0.29, 0.19, 0.15], tok_s=58.5,
               speedup=1.95, divs=[div("p3", 2, "high_confidence", 2.5, context=f"a {EVIL}⟦<b>⟧")],
               checks=[Check("ran", True, "ok"),
                       Check("divergences_are_low_confidence", False, "1 high-confidence divergence\n    p3 @2"),
                       Check("some_future_check", False, f"evidence {EVIL}"),
                       Check("speedup", True, "not gated", skipped=True)]),
        config("dflash2-k7", tpi=4.1, per_pos=[0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2], tok_s=None,
               divs=[div("p2", 9, "high_confidence", math.nan)]),
        config("mtp-k5", failed=["r0: EngineError: CUDA out of memory"],
               checks=[Check("ran", False, "engine failure: r0: EngineError")]),
    ]
    return SuiteResult("suite-1", {"engine": "reference", "corpus": "smoke", "corpus_hash": "abc"},
                       {"engine": "reference", "dtype": "float32", "gdn_verify": "chunked"},
                       0.001, 0.01, 0.05, {"max_high_confidence": 0}, configs)


def all_divergences(res: SuiteResult):
    for r in res.configs:
        for kind, ds in (("first", r.divergences), ("teacher-forced", r.tf_divergences),
                         ("in a batch", r.together.divergences if r.together else [])):
            for d in ds:
                yield r.config, kind, d


def test_every_config_check_and_divergence_appears():
    res = synthetic_suite()
    dom = Dom(html_report(res))
    summary = {a["data-config"] for a in dom.all("tr") if "data-config" in a}
    assert summary == {r.config for r in res.configs}
    for r in res.configs:  # every check of every config, including names no code here knows
        names = {a.get("data-check") for a in dom.all("tr", data_config=r.config)}
        assert {c.name for c in r.checks} <= names
    rows = {(a["data-config"], a["data-kind"], a["data-prompt"], a["data-position"])
            for a in dom.all("tr") if a.get("class") == "div"}
    expected = {(c, k, d.prompt_id, str(d.position)) for c, k, d in all_divergences(res)}
    assert rows == expected and len(expected) == 5
    # and every divergence is a point of the margin plot
    pts = {(a["data-row"], a["data-kind"], a["data-prompt"], a["data-position"])
           for a in dom.all() if a.get("class") == "pt" and "data-kind" in a}
    assert pts == expected


def test_verdict_banner_comes_first_and_names_failures():
    dom = Dom(html_report(synthetic_suite()))
    first_div = next(a for t, a in dom.elements if t == "div")
    assert first_div.get("id") == "verdict" and "error" in first_div["class"]
    text = dom.full_text
    banner = text[text.index("ENGINE FAILURE"):text.index("Configs")]
    assert "dflash-k7" in banner and "some_future_check" in banner and "mtp-k5" in banner
    assert "mtp-k1" not in banner.split("do not pass:")[1].split("divergences:")[0]


def test_banner_stays_short():
    """One line per failing config (its failed checks, the first message clipped), at most
    BANNER_ITEMS configs; the full messages are in the checks table."""
    long = "evidence " * 100
    many = [config(f"mtp-k{k}", checks=[Check(f"c{i}", False, long) for i in range(5)]) for k in range(1, 16)]
    html = html_report(SuiteResult("s", {}, {}, 0.0, 0.01, 0.05, {}, [config("baseline")] + many))
    dom = Dom(html)
    banner = html[html.index('id="verdict"'):html.index("<h2")]
    assert banner.count("<li>") == 12 and "… and 3 more failing configs" in banner
    assert "c0, c1, c2, c3, c4" in banner and len(banner) < 12 * 400
    assert len(dom.all("tr", data_check="c4")) == 15  # every check in the checks table


def test_plots_are_svg_with_points():
    res = synthetic_suite()
    dom = Dom(html_report(res))
    svgs = dom.all("svg")
    kinds = {a["class"] for a in svgs}
    assert {"plot line", "plot heat", "plot strip"} <= kinds
    series = {a["data-series"] for a in dom.all("circle") if a.get("class") == "pt" and "data-series" in a}
    assert series == {"mtp", "dflash", "dflash2"}  # methods come from the config names
    # warm tok/s of dflash2-k7 is None: it is on the tokens/iteration plot only
    xy = [(a["data-series"], a["data-x"], a["data-y"]) for a in dom.all("circle") if "data-series" in a]
    assert ("dflash2", "7", "4.1") in xy and ("mtp", "3", "49") in xy
    assert sum(1 for s, _, _ in xy if s == "dflash2") == 1
    heat = {(a["data-row"], a["data-col"]) for a in dom.all("g") if a.get("class") == "pt"}
    assert ("dflash-k7", "p6") in heat and ("mtp-k1", "p0") in heat and ("mtp-k1", "p1") not in heat
    # the exact tie sits at the axis floor, the missing margin at the ceiling, both drawn
    assert dom.all("polygon", data_clamped="floor", data_prompt="p1")
    assert dom.all("rect", data_clamped="ceiling", data_prompt="p2")
    assert {"τ_tie 0.01", "τ_low 0.05", "path noise 0.001"} <= set(dom.text)


def test_agreement_grid_cells():
    dom = Dom(html_report(synthetic_suite()))
    cell = {(a["data-config"], a["data-prompt"]): a["class"] for a in dom.all("td") if "data-prompt" in a}
    assert cell[("mtp-k3", "p1")] == "near_tie" and cell[("mtp-k3", "p2")] == "exact"
    assert cell[("dflash-k7", "p3")] == "high_confidence"
    assert cell[("mtp-k5", "p1")] == "failed"
    assert len(cell) == 3 * 5  # prompts x spec configs


def test_no_external_urls_and_store_text_is_escaped():
    html = html_report(synthetic_suite())
    dom = Dom(html)
    for _, a in dom.elements:
        for k in ("src", "href"):
            assert not str(a.get(k, "")).startswith(("http:", "https:", "//")), a
    assert "http://" not in html and "https://" not in html
    ids = {a["id"] for _, a in dom.elements if "id" in a}
    links = [a["href"] for a in dom.all("a")]
    assert links and all(h.startswith("#") and h[1:] in ids for h in links)  # in-page links only
    assert not dom.all("script") and "<script>" not in html
    assert EVIL in dom.full_text  # shown as text, the divergence context and the check message
    assert dom.full_text.count("<script>") >= 2


def test_missing_figures_everywhere():
    """An empty result and a result with nothing measured still render."""
    empty = SuiteResult("s", {}, {}, None, None, None, {}, [])
    assert "FAIL" in html_report(empty)
    bare = SuiteResult("s", {}, {}, 0.0, 0.01, 0.05, {},
                       [config("baseline"), config("mtp-k2", checks=[])])
    dom = Dom(html_report(bare))
    assert "no data" in dom.full_text and "no checks evaluated" in dom.full_text


def test_method_and_k_and_config_order():
    assert method_and_k("dflash2-k7") == ("dflash2", 7) and method_and_k("baseline") is None
    names = ["zeta-k2", "mtp-k10", "dflash-k7", "mtp-k9", "baseline", "dflash2-k7", "eagle-k3"]
    res = SuiteResult("s", {}, {}, 0.0, 0.01, 0.05, {}, [config(n) for n in names])
    assert [r.config for r in ordered(res)] == ["baseline", "mtp-k9", "mtp-k10", "dflash-k7", "dflash2-k7",
                                                "eagle-k3", "zeta-k2"]
    dom = Dom(html_report(res))
    assert [a["data-config"] for a in dom.all("tr") if "data-config" in a and a.get("class") is None] \
        == [r.config for r in ordered(res)]


def test_svg_primitives():
    assert nice_ticks(0, 1) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    svg = line_plot({"a": [(1, 2.0), (2, None), (3, 4.0)]}, title="t", xlabel="K", ylabel="y")
    assert svg.count('class="pt"') == 2
    svg = heat_grid(["r"], ["c0", "c1"], [[0.5, None]], title="h")
    assert svg.count('class="pt"') == 1
    svg = log_strip(["r"], [StripPoint("r", 0.0, "#000", "tie"), StripPoint("r", 1e-3, "#000", "x"),
                            StripPoint("r", math.inf, "#000", "end")], title="s", xlabel="m",
                    vlines=[(0.01, "τ", "#f00")])
    assert svg.count('class="pt"') == 3 and 'data-clamped="floor"' in svg and 'data-clamped="ceiling"' in svg


# --- through the CLI, from a store ---------------------------------------------------------------

def _comp(pid, tokens, spec=None, near=None, swap_at=None):
    n = len(tokens)
    ids = np.array([[t, t + 1, t + 2, t + 3, t + 4] for t in tokens], np.int32)
    lp = np.tile(np.array([-0.5, -3.5, -6, -7, -8], np.float32), (n, 1))
    if near is not None:
        lp[near, 1] = -0.505
    if swap_at is not None:  # this side chose what the baseline had as its runner-up
        ids[swap_at, 1] = tokens[swap_at] - 1
    return Completion(pid, [1, 2], tokens, lp[:, 0], ids, lp, text=" ".join(map(str, tokens)),
                      ttft_s=0.01, decode_s=0.1, spec=spec)


def test_cli_report_html_from_a_store(tmp_path):
    """`speccheck report --html FILE` on a store of constructed runs (no engine): the file holds
    every stored config and the near-tie divergence; report.md and report.json still written."""
    s = Store(tmp_path / "st").suite("t", {"corpus_hash": "h", "engine": "t", "corpus": "c"})
    base = {"a": [5, 6, 7, 8], "b": [11, 12, 13, 14]}
    counters = SpecCounters(4, 12, 8, [4, 3, 1])
    flipped = [5, 6, 8, 20]  # baseline's runner-up at position 2 (a near tie there), then its own way
    for r in (0, 1):
        for name, comps in (("baseline", [_comp("a", base["a"], near=2), _comp("b", base["b"])]),
                            ("mtp-k3", [_comp("a", base["a"], counters, near=2), _comp("b", base["b"], counters)]),
                            ("dflash-k7", [_comp("a", flipped, counters, near=2, swap_at=2),
                                           _comp("b", base["b"], counters)])):
            s.write_run(RunRecord(SpecConfig.from_name(name), {"engine": "t", "dtype": "float32"}, "c", "h",
                                  r, r == 1, completions=comps))
    complete_as_run_would(s)
    out = tmp_path / "page.html"
    res = CliRunner().invoke(main, ["report", "--store", str(tmp_path / "st"), "--suite", "t", "--out", str(tmp_path / "rep"),
                                    "--html", str(out), "--set", "min_token_agreement=0.01"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "rep" / "report.md").exists() and f"wrote {out}" in res.output
    dom = Dom(out.read_text())
    assert {a["data-config"] for a in dom.all("tr") if "data-config" in a} == {"baseline", "mtp-k3", "dflash-k7"}
    divs = [a for a in dom.all("tr") if a.get("class") == "div"]
    first = [(a["data-config"], a["data-prompt"], a["data-position"]) for a in divs if a["data-kind"] == "first"]
    assert first == [("dflash-k7", "a", "2")]
    grid = {(a["data-config"], a["data-prompt"]): a["class"] for a in dom.all("td") if "data-prompt" in a}
    assert grid == {("mtp-k3", "a"): "exact", ("mtp-k3", "b"): "exact",
                    ("dflash-k7", "a"): "near_tie", ("dflash-k7", "b"): "exact"}


# --- a real browser ------------------------------------------------------------------------------

def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(_chromium() is None, reason="headless Chromium not installed (apt-get install chromium)")
def test_chromium_renders_every_config(tmp_path):
    """Headless Chromium loads the file offline and its DOM (read back with --dump-dom) holds
    every config, the plots and every divergence row."""
    res = synthetic_suite()
    page = tmp_path / "r.html"
    page.write_text(html_report(res), encoding="utf-8")
    proc = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = Dom(proc.stdout)
    assert {a["data-config"] for a in dom.all("tr") if "data-config" in a} == {r.config for r in res.configs}
    assert len([a for a in dom.all("tr") if a.get("class") == "div"]) == len(list(all_divergences(res)))
    assert len(dom.all("svg")) >= 4 and not dom.all("script")
    assert EVIL in dom.full_text
