"""Human-readable output of a SuiteResult: the `diff` text and the Markdown report with its
tables (K, warm tok/s, tokens per iteration, acceptance p0.., agreement,
determinism)."""
from __future__ import annotations


from speccheck.checks import registry
from speccheck.results import ConfigResult, SuiteResult
from speccheck.types import SpecConfig
from speccheck.verify import END, Divergence, SpeedupModel


def _pct(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f} %"


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def acceptance_str(r: ConfigResult, limit: int = 8) -> str:
    if r.acceptance is None or not r.acceptance.per_pos:
        return "-"
    per = [f".{round(100 * p):02d}" if p < 1 else "1.0" for p in r.acceptance.per_pos[:limit]]
    return "/".join(per) + ("/..." if len(r.acceptance.per_pos) > limit else "")


def determinism_str(r: ConfigResult) -> str:
    if r.identical_runs is None:
        text = "-"
    else:
        text = f"identical x{r.repeats}" if r.identical_runs else f"DIFFERS ({len(r.nondeterminism)})"
    t = r.together
    if t is not None:  # the corpus all at once: prompts unchanged by the batch, split copies
        text += f"; in a batch {t.exact}/{t.prompts} exact" + (
            f", {len(t.split)} prompt(s) split by {t.copies} concurrent copies" if t.split else "")
    return text


def attribution_str(a: dict) -> str:
    """Which kernel path gives which token at the divergent position: the baseline under
    each path, and (rerun) the spec run under each path where no baseline run gave its token."""
    if not a.get("paths") and not a.get("spec_paths"):
        return "kernel path: unattributed (no alternative paths)"
    spec, base = a.get("reproduces_spec") or [], a.get("reproduces_base") or []
    from_spec = a.get("spec_reproduces_base") or []
    if spec and not base and len(spec) == len(a["paths"]):
        head = "every re-scored path gives the spec token: the baseline's decode path is the odd one"
    elif spec and not base:
        head = f"attributed to {', '.join(spec)}"
    elif spec and base:
        head = f"paths split: spec token from {', '.join(spec)}; baseline token from {', '.join(base)}"
    elif from_spec:
        head = (f"attributed to {', '.join(from_spec)}: the spec run with it gives the baseline "
                f"token (no baseline run gave the spec token)")
    else:
        head = "unattributed: no alternative path reproduces the other side's token"
    text = head + "; " + " ".join(f"{label}→{tok}" for label, tok in sorted(a["paths"].items()))
    if a.get("spec_paths"):
        text += "; spec run: " + " ".join(f"{label}→{tok}"
                                          for label, tok in sorted(a["spec_paths"].items()))
    return text


def divergence_line(d: Divergence, detok=None, attribution: dict | None = None) -> str:
    c = d.classification

    def tok(t: int) -> str:
        if t == END:
            return "⟨end⟩"
        return f"{detok([t])!r}({t})" if detok else str(t)

    rank = "absent" if c.spec_rank_in_base is None else f"rank {c.spec_rank_in_base + 1}"
    line = (f"{d.prompt_id} @{d.position}: {tok(d.base_token)} -> {tok(d.spec_token)}  "
            f"margin {c.base_margin:.3f}/{c.spec_margin:.3f} nats "
            f"({_num(d.margin_in_noise)}x noise), spec token {rank} in baseline top-k  {c.cls}")
    if attribution:
        line += f"  [{attribution_str(attribution)}]"
    if d.context:
        line += f"\n        context: {d.context!r}"
    return line


def noise_str(result: SuiteResult) -> str:
    taus = f"tau_tie {result.tau_tie:.3f}, tau_low {result.tau_low:.3f}"
    if result.noise_missing:
        return (f"path noise NOT MEASURED ({result.noise_missing}) -> {taus} are the policy floors; "
                "no divergence is excused by them")
    return f"path noise {result.noise:.4f} nats -> {taus}"


def check_rows(r: ConfigResult, detok=None) -> list[str]:
    """One row per check that has a diff label, in registry order: ``label   figures``."""
    out = []
    for spec in registry():
        if spec.label is None or not spec.applies_to(r.config):
            continue
        c = r.check(spec.name)
        lines = spec.diff_row(r, c).splitlines() or [""]
        if not spec.label and out and out[-1].endswith(" " + lines[0]) and len(lines) == 1:
            continue  # the row above says it already (e.g. no run of the corpus all at once)
        out.append(f"  {spec.label:<13} {lines[0]}" if spec.label else f"{'':15} {lines[0]}")
        out += [f"{'':15} {x}" for x in lines[1:]]
        if c.message.startswith("not exercised"):
            continue  # its evidence lists (greedy divergences, stops) mean nothing here
        if spec.name == "divergences_are_low_confidence":
            attr = {(a["prompt_id"], a["position"]): a for a in r.attribution}
            out += ["    " + divergence_line(d, detok, attr.get((d.prompt_id, d.position)))
                    for d in r.divergences]
        elif spec.name == "same_stopping":
            out += ["    " + b.describe() for b in r.boundaries]
    return out


def diff_text(result: SuiteResult, detok=None) -> str:
    out = [f"suite {result.suite}  ({result.meta.get('engine')} engine, corpus {result.meta.get('corpus')})",
           noise_str(result), ""]
    for r in result.configs:
        out.append(f"{r.config}  —  {r.verdict.upper()}")
        if r.failed_runs:
            out.append("  engine failure  " + "; ".join(r.failed_runs))
        out += check_rows(r, detok)
        sp = r.speed
        out.append(f"  speed         warm {_num(sp.warm_tok_s)} tok/s"
                   + (f" ({sp.speedup:.2f}x baseline)" if sp.speedup else "")
                   + f" · cold {_num(sp.cold_tok_s)} tok/s · "
                   + (f"TTFT {sp.ttft_s * 1000:.1f} ms" if sp.ttft_s else "TTFT not measured"))
        for c in r.checks:
            if not c.passed and not c.skipped:
                out.append(f"  {c.state.upper()} {c.name}: {c.message}")
        out.append("")
    return "\n".join(out)


def sweep_table(result: SuiteResult) -> str:
    """The K-sweep table, Markdown: one row per config."""
    rows = ["| config | K | decode tok/s (warm) | speedup | tokens / iteration | acceptance p0.. "
            "| agreement (teacher-forced) | prefix agreement | determinism | verdict |",
            "|---|---:|---:|---:|---:|---|---:|---:|---|---|"]
    for r in result.configs:
        cfg = SpecConfig.from_name(r.config)
        tpi = "1.00" if cfg.is_baseline else _num(r.acceptance and r.acceptance.tokens_per_iter, "{:.2f}")
        rows.append(
            f"| {r.config} | {cfg.k or '-'} | {_num(r.speed.warm_tok_s)} | "
            f"{'1.00x' if cfg.is_baseline else _num(r.speed.speedup, '{:.2f}x')} | {tpi} | "
            f"{acceptance_str(r)} | {'-' if cfg.is_baseline else _pct(r.token_agreement)} | "
            f"{'-' if cfg.is_baseline else _pct(r.prefix_agreement)} | {determinism_str(r)} | {r.verdict} |")
    return "\n".join(rows)


#: the methods compared side by side, and the K they are compared at
COMPARED_METHODS = ("mtp", "dflash", "dflash2")
COMPARED_K = 7


def compared_configs(result: SuiteResult) -> list[ConfigResult]:
    """Baseline, then per method (MTP, DFlash, DFlash2, then any other) its config at K=7 when
    the suite ran one, else its config with the highest tokens/iteration."""
    by_method: dict[str, list[ConfigResult]] = {}
    base = []
    for r in result.configs:
        cfg = SpecConfig.from_name(r.config)
        (base if cfg.is_baseline else by_method.setdefault(cfg.method, [])).append(r)
    order = [m for m in COMPARED_METHODS if m in by_method] + \
        [m for m in by_method if m not in COMPARED_METHODS]
    rows = list(base)
    for m in order:
        rs = by_method[m]
        at_k = [r for r in rs if SpecConfig.from_name(r.config).k == COMPARED_K]
        rows.append(at_k[0] if at_k else max(rs, key=lambda r: (
            r.acceptance.tokens_per_iter if r.acceptance else 0.0)))
    return rows


def method_table(result: SuiteResult) -> str:
    """The side-by-side table (MTP vs DFlash vs DFlash2), Markdown."""
    rows = ["| method | K | decode tok/s (warm) | speedup | tokens / iteration (τ) | agreement "
            "| determinism |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in compared_configs(result):
        cfg = SpecConfig.from_name(r.config)
        tpi = "1.00" if cfg.is_baseline else _num(r.acceptance and r.acceptance.tokens_per_iter, "{:.2f}")
        rows.append(f"| {cfg.method} | {cfg.k or '-'} | {_num(r.speed.warm_tok_s)} | "
                    f"{'1.00x' if cfg.is_baseline else _num(r.speed.speedup, '{:.2f}x')} | {tpi} | "
                    f"{'-' if cfg.is_baseline else _pct(r.token_agreement)} | {determinism_str(r)} |")
    return "\n".join(rows)


def best_configs(result: SuiteResult) -> dict[str, str]:
    """Per method, the passing config with the highest warm tok/s, if it beats the baseline
    measured in the same suite (a config slower than no speculation is nobody's best)."""
    best: dict[str, ConfigResult] = {}
    for r in result.configs:
        cfg = SpecConfig.from_name(r.config)
        if cfg.is_baseline or r.verdict != "pass" or r.speed.warm_tok_s is None:
            continue
        if r.speed.speedup is None or r.speed.speedup <= 1.0:
            continue
        if cfg.method not in best or r.speed.warm_tok_s > best[cfg.method].speed.warm_tok_s:
            best[cfg.method] = r
    return {m: r.config for m, r in best.items()}


def recommendation(result: SuiteResult, method: str) -> str:
    """The one recommendation every output gives (report, HTML, sweep): the config of the
    method with the best measured speedup among those that pass, with that figure -- the same
    figure the config table shows."""
    config = best_configs(result).get(method)
    if config is None:
        return f"recommended {method}: none (no {method} config that passes is faster than the baseline)"
    speedup = next(r.speed.speedup for r in result.configs if r.config == config)
    return f"recommended {method}: {config} at {speedup:.2f}x (the fastest measured config that passes)"


def _line(a: float, b: float, var: str) -> str:
    return f"{a:.2f} {'+' if b >= 0 else '-'} {abs(b):.3f}·{var}"


def recommendation_line(m: SpeedupModel) -> str:
    """The K the speedup model favours, with its uncertainty, and whether the runner-up is
    indistinguishable from it (a model of the sweep; the recommendation is `recommendation`)."""
    if m.recommended is None:
        return f"speedup model, best {m.method} K: none — {m.note}" + (
            "; within noise of the baseline" if m.baseline_within_noise else "")
    r = m.row(m.recommended)
    text = (f"speedup model, best {m.method} K={r.k}: {r.model:.2f}x ± {r.model_spread:.2f} modelled "
            f"(measured {r.measured:.2f}x ± {r.measured_spread:.2f}, {m.rounds} round(s))")
    if m.runner_up is not None:
        u = m.row(m.runner_up)
        text += (f"; K={u.k} ({u.model:.2f}x) is within noise of it — either will do" if m.within_noise
                 else f"; clearly ahead of the runner-up K={u.k} ({u.model:.2f}x) in every round")
    elif m.within_noise:
        text += "; one round measures no spread: run --repeats 3 or more to know how sure this is"
    if m.baseline_within_noise and m.rounds > 1:
        text += "; not clearly faster than the baseline (within noise of 1.00x)"
    return text


def speedup_table(m: SpeedupModel) -> str:
    """Measured and modelled speedup per K, the validation of the model on the Ks its fit did
    not use, and the recommendation."""
    clock = ("the engine's CPU seconds (decode on one CPU thread: what an idle machine's wall clock "
             "shows; this machine's wall clock also measures the other load on it)" if m.clock == "cpu"
             else "wall seconds")
    out = [f"{m.method}: speedup model from {m.rounds} round(s) (each K's cost from its least disturbed request; "
           f"±: how far a figure moves with one round left out, for the model at least the cost line's "
           f"standard error); step costs in one-token decode steps "
           f"of the baseline, from {clock}",
           f"  step cost(K) = {_line(*m.cost_line, 'K')}"
           + (f"  (target verify(n tokens) = {_line(*m.verify_line, 'n')}; drafter per step = "
              f"{_line(*m.draft_line, 'K')})" if m.verify_line and m.draft_line else ""), ""]
    fit = ",".join(map(str, m.fit_ks))
    out += [f"| K | tokens/iter | step cost | measured speedup | modelled (all K) | predicted from K={fit or '-'} "
            "| error | conditional acceptance p0.. |", "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in m.rows:
        pred = "fit" if r.k in m.fit_ks else ("-" if r.predicted is None else f"{r.predicted:.2f}x")
        err = "-" if r.error is None else f"{100 * r.error:+.1f} %"
        acc = "/".join(f".{round(100 * q):02d}" if q < 1 else "1.0" for q in r.conditional_acceptance[:8])
        out.append(f"| {r.k} | {r.tau:.2f} | {r.cost:.2f} | {r.measured:.2f}x ± {r.measured_spread:.2f} | "
                   f"{r.model:.2f}x ± {r.model_spread:.2f} | {pred} | {err} | {acc or '-'} |")
    checked = [r for r in m.rows if r.error is not None]
    if checked:
        out.append(f"\nvalidation: K={','.join(str(r.k) for r in checked)} predicted from K={fit} alone: "
                   + ", ".join(f"K={r.k} {100 * r.error:+.1f} %" for r in checked)
                   + f" (max |error| {100 * m.max_error:.1f} %)")
    else:
        out.append("\nvalidation: none (the fit needs every K of this sweep; sweep 3 or more Ks)")
    out.append(recommendation_line(m))
    return "\n".join(out)


def markdown_report(result: SuiteResult, detok=None) -> str:
    ident = result.identity
    lines = [f"# speccheck report — {result.suite}", "",
             f"**Verdict: {'PASS' if result.passed else 'FAIL'}**", "",
             "| | |", "|---|---|"]
    for key in ("engine", "version", "model_id", "model_hash", "tokenizer_hash", "dtype", "device",
                "torch", "vllm_version", "gpu", "ttft"):
        if key in ident:
            lines.append(f"| {key} | `{ident[key]}` |")
    lines += [f"| corpus | {result.meta.get('corpus')} (`{str(result.meta.get('corpus_hash'))[:16]}`) |",
              f"| path noise | {noise_str(result).removeprefix('path noise ')} |",
              "", "## Configs", "", sweep_table(result), "",
              "## MTP vs DFlash vs DFlash2", "", method_table(result), ""]
    methods = dict.fromkeys(SpecConfig.from_name(r.config).method for r in result.configs
                            if r.config != "baseline")
    lines += [f"- {recommendation(result, m)}" for m in methods] + ([""] if methods else [])
    for model in result.speedup.values():
        lines += [f"## Which K: {model.method}", "", speedup_table(model), ""]
    lines += ["## Divergences from the baseline", ""]
    any_div = False
    for r in result.configs:
        if not r.divergences:
            continue
        any_div = True
        attr = {(a["prompt_id"], a["position"]): a for a in r.attribution}
        lines.append(f"### {r.config}")
        lines.append("")
        for d in r.divergences:
            lines.append("- " + divergence_line(d, detok, attr.get((d.prompt_id, d.position))).replace("\n", "  \n"))
        lines.append("")
    if not any_div:
        lines += ["None: every config reproduced the baseline token for token.", ""]
    lines += logprobs_table(result) + split_lines(result, detok)
    lines += ["## Checks", ""]
    for r in result.configs:
        for c in r.checks:
            mark = c.state if c.passed or c.skipped else f"**{c.state.upper()}**"
            lines.append(f"- `{r.config}` {c.name}: {mark} — {c.message.splitlines()[0]}")
    return "\n".join(lines) + "\n"


def logprobs_table(result: SuiteResult) -> list[str]:
    """Per spec config: |spec-reported - baseline logprob| where both chose the token, against
    the engine's kernel-path noise (two-sample test) and the flips that noise predicts."""
    rows = [r for r in result.configs if r.logprobs is not None]
    if not rows:
        return []
    k = rows[0].logprobs.drift.reference
    out = ["## Reported logprobs against the baseline", "",
           f"Kernel-path noise (baseline decode vs prefill path, {k.n} positions): median "
           f"{k.median:.4f} / p99 {k.p99:.4f} / max {k.max:.4f} nats.", "",
           "| config | positions | \\|Δ\\| median | p99 | max | ratio | KS D+ | rank-test p | golden ratio | flips "
           "(expected, allowed) | verdict |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lc = r.logprobs
        d, f = lc.drift, lc.flips
        gold = "-" if lc.golden_drift is None else f"{lc.golden_drift.ratio:.2f}"
        ok = r.check("logprobs_consistent").passed
        out.append(f"| {r.config} | {d.spec.n} | {d.spec.median:.4f} | {d.spec.p99:.4f} | {d.spec.max:.4f} | "
                   f"{d.ratio:.2f} | {d.ks:.3f} | {d.p:.2g} | {gold} | {f.flips} ({f.expected:.1f}, "
                   f"{f.allowed}) | {'pass' if ok else '**FAIL**'} |")
    return out + [""]


def split_lines(result: SuiteResult, detok=None) -> list[str]:
    """Identical concurrent requests that got different completions, with their margins."""
    out = []
    for r in result.configs:
        t = r.together
        if t is None or not t.split_divergences:
            continue
        out += [f"### {r.config}: identical concurrent requests split", ""]
        out += ["- " + divergence_line(d, detok).replace("\n", "  \n") for d in t.split_divergences]
        out.append("")
    return (["## Concurrent splits", ""] + out) if out else []
