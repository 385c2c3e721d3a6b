"""`speccheck` command line: run, diff, gate, report, golden record|check, sweep, corpus,
export-reference, serve. Exit codes: 0 pass, 1 gate failed, 2 bad input or usage, 3 engine failure."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from speccheck.config import MatrixError, build_matrix
from speccheck.corpus import CorpusError, list_corpora, load_corpus
from speccheck.engines import EngineError, EngineUsageError, engine_class
from speccheck.gate import EXIT_ENGINE, EXIT_USAGE, exit_code, gate_text, write_junit
from speccheck.policy import PolicyError, load_policy
from speccheck.store import Store, StoreError

USAGE_ERRORS = (CorpusError, MatrixError, PolicyError, StoreError, EngineUsageError)


class SpeccheckGroup(click.Group):
    """Turns every known error into a one-paragraph message and the documented exit code."""

    def invoke(self, ctx: click.Context):
        from speccheck.golden import GoldenMismatch

        try:
            return super().invoke(ctx)
        except (*USAGE_ERRORS, GoldenMismatch) as e:
            click.echo(f"speccheck: error: {e}", err=True)
            sys.exit(EXIT_USAGE)
        except EngineError as e:
            click.echo(f"speccheck: engine failure: {e}", err=True)
            sys.exit(EXIT_ENGINE)


def _engine_args(items: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r}: write --engine-arg key=value", param_hint="--engine-arg")
        out[key.strip()] = value
    return out


def _settings(items: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise PolicyError(f"--set {item!r}: write --set key=value (e.g. --set min_token_agreement=0.99).")
        out[key.strip()] = value
    return out


store_option = click.option("--store", "store_dir", default=".speccheck", show_default=True,
                            type=click.Path(file_okay=False), help="Store directory.")
golden_option = click.option("--golden", "golden_dir", default="golden", show_default=True,
                             type=click.Path(file_okay=False), help="Golden directory.")
suite_option = click.option("--suite", default=None, help="Suite id in the store (default: the last run).")
policy_options = [
    click.option("--policy", "policy_file", default=None, help="Policy TOML file."),
    click.option("--set", "settings", multiple=True, help="Policy override key=value (repeatable)."),
]


def _apply(options):
    def deco(f):
        for opt in reversed(options):
            f = opt(f)
        return f
    return deco


run_options = [
    click.option("--engine", default="reference", show_default=True, help="reference | vllm | openai"),
    click.option("--model", default=None, help="Model path (engine-specific; reference: shipped weights)."),
    click.option("--draft", default=None, help="External drafter path (dflash)."),
    click.option("--method", "methods", multiple=True, help="baseline | mtp | dflash | ... (repeatable)."),
    click.option("--k", "k", default=None, help="K values: 7, 1-12 or 1,3,7."),
    click.option("--config", "configs", multiple=True, help="Config by name, e.g. mtp-k3 (repeatable)."),
    click.option("--corpus", default="default", show_default=True,
                 help="Built-in corpus name or a file path (also Spec-Bench's question.jsonl)."),
    click.option("--max-tokens", "max_tokens", default=None, type=click.IntRange(1, 32768),
                 help="max_tokens for corpora whose prompts carry none, e.g. Spec-Bench's "
                      "question.jsonl (default 128)."),
    click.option("--repeats", default=2, show_default=True, type=click.IntRange(1, 100)),
    click.option("--top-k", "top_k", default=5, show_default=True, type=click.IntRange(2, 20)),
    click.option("--engine-arg", "engine_args", multiple=True, help="Engine option key=value (repeatable)."),
    click.option("--no-attribution", is_flag=True, help="Skip kernel-path attribution of divergences."),
    click.option("--concurrent", default=2, show_default=True, type=click.IntRange(0, 64),
                 help="Also run each config on the whole corpus at once, every prompt N times: "
                      "batch-composition invariance and N identical concurrent requests (0: off)."),
    click.option("--base-url", default=None, help="openai engine: server URL (e.g. http://127.0.0.1:8000)."),
    click.option("--served-model", default=None, help="openai engine: the server's model name."),
    click.option("--api-key-env", default=None,
                 help="openai engine: env var holding the API key (default OPENAI_API_KEY)."),
    click.option("--attribute-with", "attribute_with", multiple=True, metavar="LABEL=URL",
                 help="openai engine: attribute divergences by re-scoring them on a second "
                      "server started with other kernel settings (repeatable)."),
]


def _attribute_with(items: tuple[str, ...], cls) -> dict[str, str]:
    """--attribute-with LABEL=URL pairs, checked by the engine before anything runs."""
    out: dict[str, str] = {}
    for item in items:
        label, sep, url = item.partition("=")
        if not sep or not label.strip() or not url.strip():
            raise click.BadParameter(f"{item!r}: write --attribute-with LABEL=URL, e.g. "
                                     "eager=http://127.0.0.1:8001", param_hint="--attribute-with")
        if label.strip() in out:
            raise click.BadParameter(f"label {label.strip()!r} is given twice",
                                     param_hint="--attribute-with")
        cls.attribution_server_args(label.strip(), url.strip())  # EngineUsageError if not
        out[label.strip()] = url.strip()
    return out


def _plan(engine, model, draft, methods, k, configs, corpus, repeats, top_k, engine_args,
          no_attribution=False, base_url=None, served_model=None, api_key_env=None, concurrent=0,
          attribute_with=(), max_tokens=None):
    from speccheck.runner import RunPlan

    args = _engine_args(engine_args)
    server = {"base_url": base_url, "served_model": served_model, "api_key_env": api_key_env}
    args.update({key: v for key, v in server.items() if v is not None})
    cls = engine_class(engine)
    if cls.serves_one_config and not (methods or configs):
        raise MatrixError(f"the {engine} engine runs the one config its server runs: say which with "
                          "--method baseline, or e.g. --method mtp --k 7 (run the baseline first, "
                          "against a server without speculative decoding, into the same --store).")
    default_k = {}
    if "dflash" in methods:
        probe = cls(model=model, engine_args=args, draft=draft)
        try:
            default_k["dflash"] = probe.default_k("dflash")
        finally:
            probe.close()
    matrix = build_matrix(methods, k, configs, offered=cls.methods, engine=engine,
                          default_k=default_k, draft=draft, include_baseline=not cls.serves_one_config)
    return RunPlan(engine=engine, model=model, draft=draft, engine_args=args, corpus=corpus,
                   configs=matrix, repeats=repeats, top_k=top_k, attribute=not no_attribution,
                   concurrent=concurrent, attribute_with=_attribute_with(attribute_with, cls),
                   max_tokens=max_tokens)


def _suite(store_dir: str, suite_id: str | None):
    store = Store(store_dir)
    return store.suite(suite_id) if suite_id else store.latest()


def _detok_for(suite):
    """Decode token ids for human-readable evidence. Only for the reference engine, which loads
    in a second with no server or GPU; other engines' evidence shows ids (and stored text)."""
    meta = suite.meta
    if meta.get("engine") != "reference":
        return None
    try:
        from speccheck.engines import make_engine

        engine = make_engine("reference", meta.get("model"), meta.get("engine_args"), meta.get("draft"))
        return engine.detokenize
    except Exception:  # noqa: BLE001 - evidence without decoded text is still evidence
        return None


def _evaluate(store_dir, suite_id, policy_file, settings, configs=None, golden_dir="golden"):
    from speccheck.evaluate import evaluate_suite
    from speccheck.golden import golden_acceptance, golden_noise

    suite = _suite(store_dir, suite_id)
    policy = load_policy(policy_file, _settings(settings))
    detok = _detok_for(suite)
    have_base = suite.is_complete("baseline", 0)
    gold = golden_acceptance(suite, Path(golden_dir)) if have_base else None
    gold_noise = golden_noise(suite, Path(golden_dir)) if have_base else None
    return suite, evaluate_suite(suite, policy, configs, gold, detok, gold_noise), detok


@click.group(cls=SpeccheckGroup)
@click.version_option(package_name="speccheck")
def main() -> None:
    """Correctness and determinism gate for speculative decoding."""


@main.command()
@_apply(run_options)
@store_option
def run(engine, model, draft, methods, k, configs, corpus, max_tokens, repeats, top_k, engine_args,
        no_attribution, concurrent, base_url, served_model, api_key_env, attribute_with, store_dir):
    """Run the matrix (baseline always included) into the store; resumes finished runs."""
    from speccheck.runner import run_suite

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    plan = _plan(engine, model, draft, methods, k, configs, corpus, repeats, top_k, engine_args, no_attribution,
                 base_url, served_model, api_key_env, concurrent, attribute_with, max_tokens)
    console = Console(stderr=True)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("starting", total=None)

        def progress(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what)

        suite = run_suite(plan, Store(store_dir), log=bar.console.print if console.is_terminal else click.echo,
                          progress=progress)
    runs = list(range(plan.repeats)) + ([-1] if plan.concurrent else [])
    failed = [f"{c.name} " + ("all at once" if r < 0 else f"r{r}") for c in plan.configs
              for r in runs if not suite.is_complete(c.name, r)]
    click.echo(f"stored in {suite.root}" + (f"; FAILED runs: {', '.join(failed)}" if failed else ""))
    if failed:
        sys.exit(EXIT_ENGINE)


def _select(suite, methods, k, configs) -> list[str] | None:
    if not methods and not configs:
        return None
    wanted = {c.name for c in build_matrix(methods, k, configs, offered=None)} if (k or configs) else None
    names = [n for n in suite.configs()
             if n == "baseline" or (wanted is not None and n in wanted)
             or (wanted is None and n.split("-k")[0] in methods)]
    return names


@main.command()
@click.option("--method", "methods", multiple=True)
@click.option("--k", "k", default=None)
@click.option("--config", "configs", multiple=True)
@click.option("--against", type=click.Choice(["baseline", "golden"]), default="baseline", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the same figures as JSON.")
@click.option("--run", "run_missing", is_flag=True, help="Run what is missing first (reference engine defaults).")
@suite_option
@store_option
@golden_option
@_apply(policy_options)
def diff(methods, k, configs, against, as_json, run_missing, suite, store_dir, golden_dir, policy_file, settings):
    """Compare spec configs with the baseline: determinism, agreement, divergences, acceptance."""
    from speccheck.report import diff_text

    if run_missing:
        from speccheck.runner import run_suite

        plan = _plan("reference", None, None, methods, k, configs, "default", 2, 5, (), concurrent=2)
        run_suite(plan, Store(store_dir), log=lambda m: click.echo(m, err=True))
    s = _suite(store_dir, suite)
    names = _select(s, methods, k, configs)
    if names is not None and len(names) <= 1 and (methods or configs):
        raise MatrixError(f"no stored runs for {', '.join(methods or configs)} in suite {s.id}; "
                          "run them first (`speccheck run --method ...`) or pass --run.")
    s, result, detok = _evaluate(store_dir, suite, policy_file, settings, names, golden_dir)
    if against == "golden":
        _golden_check_print(s, result, golden_dir, policy_file, settings)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=1, default=str, ensure_ascii=False))
    else:
        click.echo(diff_text(result, detok))


@main.command()
@suite_option
@store_option
@golden_option
@_apply(policy_options)
@click.option("--junit", default=None, type=click.Path(dir_okay=False), help="Write JUnit XML here.")
def gate(suite, store_dir, golden_dir, policy_file, settings, junit):
    """Apply the policy to every config in the store: exit 0 pass, 1 fail, 3 engine failure."""
    _, result, _ = _evaluate(store_dir, suite, policy_file, settings, golden_dir=golden_dir)
    click.echo(gate_text(result))
    if junit:
        write_junit(result, Path(junit))
    sys.exit(exit_code(result))


@main.command()
@suite_option
@store_option
@golden_option
@_apply(policy_options)
@click.option("--out", default=None, type=click.Path(file_okay=False),
              help="Directory for report.md and report.json (default: the suite directory).")
def report(suite, store_dir, golden_dir, policy_file, settings, out):
    """Write a Markdown report (the seed article's tables) and a JSON summary."""
    from speccheck.report import write_report

    s, result, detok = _evaluate(store_dir, suite, policy_file, settings, golden_dir=golden_dir)
    md, js = write_report(result, Path(out) if out else s.root, detok)
    click.echo(f"wrote {md}\nwrote {js}")


@main.command()
@click.option("--method", "methods", multiple=True, required=True)
@click.option("--k", "k", default="1-10", show_default=True)
@click.option("--engine", default="reference", show_default=True)
@click.option("--model", default=None)
@click.option("--draft", default=None)
@click.option("--corpus", default="default", show_default=True)
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(1, 100))
@click.option("--engine-arg", "engine_args", multiple=True)
@store_option
@_apply(policy_options)
def sweep(methods, k, engine, model, draft, corpus, repeats, engine_args, store_dir, policy_file, settings):
    """K-sweep: run a method over a K range and print the seed's table with the best K."""
    from speccheck.report import best_configs, sweep_table
    from speccheck.runner import run_suite

    plan = _plan(engine, model, draft, methods, k, (), corpus, repeats, 5, engine_args, no_attribution=True)
    suite = run_suite(plan, Store(store_dir), log=lambda m: click.echo(m, err=True))
    if repeats < 2:  # a sweep is about speed and acceptance; determinism needs --repeats 2
        settings = ("require_deterministic=false", *settings)
    _, result, _ = _evaluate(store_dir, suite.id, policy_file, settings, [c.name for c in plan.configs])
    click.echo(sweep_table(result))
    for method, name in best_configs(result).items():
        click.echo(f"best {method}: {name}")


@main.group()
def golden() -> None:
    """Record or check a golden baseline (golden/<engine>/<model>/<corpus>/)."""


@golden.command("record")
@suite_option
@store_option
@golden_option
@_apply(policy_options)
def golden_record(suite, store_dir, golden_dir, policy_file, settings):
    """Record the store's baseline and per-config acceptance as the golden."""
    from speccheck import golden as g

    s, result, _ = _evaluate(store_dir, suite, policy_file, settings, golden_dir=golden_dir)
    path = g.record(s, result, Path(golden_dir))
    click.echo(f"recorded golden {path} ({len(result.configs)} configs' acceptance)")


def _comparison_lines(cmp, detok) -> list[str]:
    from speccheck.report import divergence_line

    lines = [f"{cmp.exact}/{cmp.prompts} prompts exact · prefix agreement {cmp.prefix_agreement:.2%} · "
             f"{len(cmp.divergences)} divergence(s), {len(cmp.high)} high-confidence"]
    lines += ["    " + divergence_line(d, detok) for d in cmp.divergences]
    return lines


def _golden_check_print(s, result, golden_dir, policy_file, settings) -> bool:
    from speccheck import golden as g

    policy = load_policy(policy_file, _settings(settings))
    detok = _detok_for(s)
    chk = g.check(s, Path(golden_dir), result.noise, policy, detok)
    lines = _comparison_lines(chk.comparison, detok)
    click.echo(f"golden {chk.path}: {lines[0]}")
    for line in lines[1:]:
        click.echo(line)
    if chk.noise_drift is not None:
        t = chk.noise_drift
        click.echo(f"    kernel-path noise {'DRIFTED' if t.drifted else 'as recorded'}: |Δ| median "
                   f"{t.spec.median:.4f} / p90 {t.spec.p90:.4f} nats vs golden {t.reference.median:.4f} / "
                   f"{t.reference.p90:.4f} (ratio {t.ratio:.2f}, KS D+ {t.ks:.3f}, rank-test p {t.p:.2g})")
    for r in result.configs:
        if r.acceptance is not None and r.config in chk.acceptance:
            click.echo(f"    {r.config}: {r.acceptance.tokens_per_iter:.2f} tokens/iter "
                       f"(golden {chk.acceptance[r.config]:.2f})")
    return chk.passed


@golden.command("check")
@suite_option
@store_option
@golden_option
@_apply(policy_options)
def golden_check(suite, store_dir, golden_dir, policy_file, settings):
    """Compare today's baseline with the golden; only classified near-ties may differ."""
    s, result, _ = _evaluate(store_dir, suite, policy_file, settings, golden_dir=golden_dir)
    ok = _golden_check_print(s, result, golden_dir, policy_file, settings)
    click.echo("golden check: PASS" if ok else "golden check: FAIL")
    sys.exit(0 if ok else 1)


@main.command()
@click.option("--config", "config_name", default="baseline", show_default=True)
@suite_option
@store_option
@click.option("--with-store", "other_store", required=True, type=click.Path(file_okay=False),
              help="Store holding the other suite (e.g. another engine's).")
@click.option("--with-suite", "other_suite", default=None, help="Suite id there (default: its last run).")
@_apply(policy_options)
def compare(config_name, suite, store_dir, other_store, other_suite, policy_file, settings):
    """Cross-engine (or cross-machine) agreement: one config's first repeat in two suites,
    compared stream by stream and classified like any divergence (exit 1 on high-confidence)."""
    from speccheck.evaluate import compare_runs, suite_noise
    from speccheck.verify import calibrate_thresholds

    a, b = _suite(store_dir, suite), _suite(other_store, other_suite)
    if a.meta.get("corpus_hash") != b.meta.get("corpus_hash"):
        raise StoreError(f"suites {a.id} and {b.id} ran different corpora (hash {a.meta.get('corpus_hash')} "
                         f"vs {b.meta.get('corpus_hash')}); compare runs of the same corpus.")
    policy = load_policy(policy_file, _settings(settings))
    noise = max(suite_noise(a), suite_noise(b))
    tau_tie, tau_low = calibrate_thresholds(noise, policy.tie_noise_multiple, policy.low_noise_multiple,
                                            policy.tie_floor, policy.low_floor)
    cmp = compare_runs(a.load_run(config_name, 0), b.load_run(config_name, 0), tau_tie, tau_low, noise,
                       _detok_for(a))
    click.echo(f"{config_name}: {a.id} vs {b.id} (path noise {noise:.4f} nats, tau_tie {tau_tie:.3f}, "
               f"tau_low {tau_low:.3f})")
    for line in _comparison_lines(cmp, _detok_for(a)):
        click.echo(line)
    sys.exit(0 if cmp.passed else 1)


@main.group()
def corpus() -> None:
    """List or show prompt corpora."""


@corpus.command("list")
def corpus_list():
    for name in list_corpora():
        c = load_corpus(name)
        cats = sorted({p.category for p in c.prompts})
        click.echo(f"{name:12} {len(c.prompts):3d} prompts  {c.hash[:12]}  {', '.join(cats)}")


@corpus.command("show")
@click.argument("name")
def corpus_show(name):
    c = load_corpus(name)
    click.echo(f"{c.name}  {c.path}  hash {c.hash}")
    for p in c.prompts:
        text = p.as_text().replace("\n", " ")
        click.echo(f"  {p.id:24} {p.category:14} max_tokens={p.max_tokens:<5} {text[:70]}")


@main.group()
def kernels() -> None:
    """Kernel-level harnesses (below the model)."""


@kernels.command("gdn")
@click.option("--device", default="auto", show_default=True, help="auto | cpu | cuda")
@click.option("--positions", default=8192, show_default=True, type=click.IntRange(1, 1 << 20))
@click.option("--heads", default=4, show_default=True, type=click.IntRange(1, 256))
@click.option("--head-dim", default=64, show_default=True, type=click.IntRange(1, 512))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def kernels_gdn(device, positions, heads, head_dim, seed, as_json):
    """Every gated-delta-rule kernel here (reference recurrent/chunked; on CUDA the FLA kernels
    of vLLM or fla) on the same bf16 inputs against an fp64 recurrence: error and argmax flips."""
    import torch

    from speccheck.kernels.gdn import compare, form_flips, kernels as gdn_kernels, make_inputs, table

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise click.UsageError("--device cuda: CUDA is not available here; use --device cpu")
    inputs = make_inputs(positions, heads, head_dim, head_dim, seed, device)
    missing: list[str] = []
    results = compare(inputs, gdn_kernels(device, missing))
    if as_json:
        click.echo(json.dumps({"device": device, "positions": positions, "heads": heads,
                               "head_dim": head_dim, "seed": seed,
                               "kernels": [r.to_dict() for r in results],
                               "chunked_vs_recurrent": [
                                   {"chunked": a, "recurrent": b, "flips": n, "compared": t}
                                   for a, b, n, t in form_flips(results)],
                               "not_here": missing}, indent=1))
    else:
        click.echo(f"gated delta rule on {device}: {positions} positions x {heads} heads, "
                   f"head dim {head_dim}, bf16 q/k/v, fp32 g/beta/state, seed {seed}")
        click.echo(table(results))
        for why in missing:
            click.echo(f"not here: {why}")


@main.command("export-reference")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--model", default=None, help="Reference weights dir (default: the shipped ones).")
def export_reference_cmd(out_dir, model):
    """Write the reference checkpoint in the Hugging Face layouts vLLM loads (target + drafter)."""
    from speccheck.engines.reference.export import export_reference

    info = export_reference(out_dir, model)
    click.echo(json.dumps(info, indent=1, default=str))


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--method", default="baseline", show_default=True)
@click.option("--k", "k", default=None, type=int)
@click.option("--model", default=None)
@click.option("--api-key-env", default=None, help="Require this env var's value as Bearer key.")
@click.option("--engine-arg", "engine_args", multiple=True)
def serve(host, port, method, k, model, api_key_env, engine_args):
    """OpenAI-compatible server (vLLM's endpoints and metric names) in front of the reference engine."""
    from speccheck.serve import serve as serve_forever

    if method != "baseline":
        build_matrix([method], str(k) if k is not None else None, offered=("mtp", "dflash"))
    serve_forever(host=host, port=port, method=method, k=k or 0, api_key_env=api_key_env,
                  engine_args=_engine_args(engine_args), model=model)


if __name__ == "__main__":
    main()
