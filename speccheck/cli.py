"""`speccheck` command line: run, diff, gate, report, golden record|check, sweep, corpus,
selftest, export-reference, serve. Exit codes: 0 pass, 1 gate failed, 2 bad input or usage, 3 engine
failure, 4 internal error (a bug: the traceback is saved to a file the message names), 130
interrupted (Ctrl-C)."""
from __future__ import annotations

import errno
import json
import math
import os
import select
import sys
import tempfile
import time
import traceback
from pathlib import Path

import click

from speccheck import api
from speccheck.config import MatrixError, build_matrix
from speccheck.corpus import CorpusError, list_corpora, load_corpus
from speccheck.engines import EngineError, EngineUsageError
from speccheck.engines import engine_class as engine_class_of
from speccheck.files import OutputError, write_output
from speccheck.gate import (EXIT_ENGINE, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_PIPE_CLOSED, EXIT_USAGE,
                            plan_note)
from speccheck.plan import (ENGINE_ARG_HELP, REFERENCE_ARG_KEYS, PlanError, make_plan, parse_engine_args,
                            sampling_engine_args)
from speccheck.policy import PolicyError, load_policy
from speccheck.store import Store, StoreError
from speccheck.types import TOGETHER, slot_label

USAGE_ERRORS = (CorpusError, MatrixError, PlanError, PolicyError, StoreError, EngineUsageError, OutputError)


EXIT_CODES_HELP = ("Exit codes: 0 pass, 1 gate failed, 2 bad input or usage, 3 engine failure, "
                   "4 internal error (traceback saved to a file the message names), 130 interrupted, "
                   "141 output pipe closed (`| head`).")

#: OS errors that are the user's environment, not a bug: a read-only or full disk, a
#: permission, a path that is not a directory. They name the path and exit 2.
_ENVIRONMENT_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR,
                       errno.EISDIR, errno.ENOENT, errno.ENAMETOOLONG, errno.EEXIST, errno.ENOTEMPTY,
                       # a file-size limit (ulimit -f), a link loop, no file descriptors left
                       errno.EFBIG, errno.ELOOP, errno.EMFILE, errno.ENFILE}


def save_traceback() -> Path | None:
    """Write the current exception's traceback where the user can attach it to a report."""
    text = f"speccheck {' '.join(sys.argv[1:])}\n\n{traceback.format_exc()}"
    name = f"speccheck-crash-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    for folder in (Path(tempfile.gettempdir()), Path.cwd()):
        try:
            path = folder / name
            path.write_text(text)
            return path
        except OSError:
            continue
    return None


def _output_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll reports an error on it)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll here, or no real stdout
        return False


class SpeccheckGroup(click.Group):
    """Turns every known error into a one-paragraph message and the documented exit code;
    anything else is a bug in speccheck: one line, the traceback in a file, exit 4."""

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
        except (click.exceptions.Exit, click.ClickException, click.Abort, SystemExit):
            raise
        except KeyboardInterrupt:
            click.echo("\nspeccheck: interrupted; runs already stored are kept (a re-run resumes).", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except BrokenPipeError as e:
            if not _output_reader_gone():  # a pipe of speccheck's own broke: a bug
                self._internal_error(e)
            # the reader left (`speccheck ... | head`): stop quietly, as other tools do; stdout
            # now goes nowhere, so that the interpreter's last flush does not fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(EXIT_PIPE_CLOSED)
        except ValueError as e:
            if "embedded null" not in str(e):  # what os.* says of a path with a NUL in it
                self._internal_error(e)
            click.echo("speccheck: error: a path given on the command line (--store / --out / "
                       "--golden / --policy ...) contains a NUL byte; no file can have that name: "
                       "give the path without it.", err=True)
            sys.exit(EXIT_USAGE)
        except OSError as e:
            if e.errno not in _ENVIRONMENT_ERRNOS:
                self._internal_error(e)
            where = f"cannot use {e.filename}" if e.filename else "a file could not be written or read"
            click.echo(f"speccheck: error: {where}: {e.strerror or e} (check the path given with --store / "
                       "--out / --golden, its permissions, free space and file-size limit (ulimit -f); "
                       "what was stored before is kept).", err=True)
            sys.exit(EXIT_USAGE)
        except Exception as e:  # noqa: BLE001 - the top-level guard
            self._internal_error(e)

    @staticmethod
    def _internal_error(e: BaseException):
        path = save_traceback()
        where = f"the traceback is in {path}" if path else "the traceback could not be saved"
        click.echo(f"speccheck: internal error ({type(e).__name__}: {e}); this is a bug in speccheck, "
                   f"not in your model or input: {where}; please report it with that file.", err=True)
        sys.exit(EXIT_INTERNAL)


def _settings(items: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise PolicyError(f"--set {item!r}: write --set key=value (e.g. --set min_token_agreement=0.99).")
        out[key.strip()] = value
    return out


class OffOrCount(click.ParamType):
    """A count in [lo, hi], or ``off``: what turns a run off is said in a word, never by a 0
    (read as 0 internally)."""

    name = "count|off"

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool):
            text = str(value)
        else:
            text = str(value).strip().lower()
        if text in ("off", "false", "no", "none"):
            return 0
        try:
            n = int(text)
        except ValueError:
            self.fail(f"{value!r} is neither a whole number from {self.lo} to {self.hi} nor off.", param, ctx)
        if n == 0:
            self.fail("0: write off to leave this run out (its checks are then skipped, not passed), "
                      f"or a number from {self.lo} to {self.hi}.", param, ctx)
        if not self.lo <= n <= self.hi:
            self.fail(f"{n} is not in the range {self.lo} to {self.hi} (or off).", param, ctx)
        return n


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
    click.option("--draft", default=None, help="External drafter path (dflash, dflash2)."),
    click.option("--method", "methods", multiple=True, help="baseline | mtp | dflash | dflash2 | ... (repeatable)."),
    click.option("--k", "k", default=None, help="K values: 7, 1-12 or 1,3,7."),
    click.option("--config", "configs", multiple=True, help="Config by name, e.g. mtp-k3 (repeatable)."),
    click.option("--corpus", default="default", show_default=True,
                 help="Built-in corpus name or a file path (also Spec-Bench's question.jsonl)."),
    click.option("--max-tokens", "max_tokens", default=None, type=click.IntRange(1, 32768),
                 help="max_tokens for corpora whose prompts carry none, e.g. Spec-Bench's "
                      "question.jsonl (default 128)."),
    click.option("--repeats", default=2, show_default=True, type=click.IntRange(1, 100),
                 help="Runs per config (the last in a fresh process); determinism needs 2."),
    click.option("--top-k", "top_k", default=5, show_default=True, type=click.IntRange(2, 20),
                 help="Logprobs kept per position (the margin needs 2)."),
    click.option("--engine-arg", "engine_args", multiple=True, help=ENGINE_ARG_HELP),
    click.option("--no-attribution", is_flag=True, help="Skip kernel-path attribution of divergences."),
    click.option("--attribution-paths", "attribution_paths", default=None, metavar="GLOBS",
                 help="Attribute only with the kernel paths whose labels match these comma-separated "
                      "globs, e.g. 'decode*,verify*' (default: all; each path costs an engine start; "
                      "the run log lists the labels)."),
    click.option("--attribution-mode", "attribution_mode", default="rescore", show_default=True,
                 type=click.Choice(["rescore", "rerun"]),
                 help="rescore: score each divergent prefix under each kernel path (one call per "
                      "path); rerun: regenerate the divergent prompts' baseline with each switch "
                      "flipped and read the token where the spec run diverged (slower; it follows "
                      "the path the run took, where a re-score prefills the prefix)."),
    click.option("--concurrent", default="2", show_default=True, type=OffOrCount(1, 64), metavar="N|off",
                 help="Also run each config on the whole corpus at once, every prompt N times: "
                      "batch-composition invariance and N identical concurrent requests (off: not "
                      "run; those checks are then skipped, not passed)."),
    click.option("--base-url", default=None,
                 help="openai engine: server URL, with or without /v1 (default $OPENAI_BASE_URL, "
                      "else http://127.0.0.1:8000)."),
    click.option("--served-model", default=None, help="openai engine: the server's model name."),
    click.option("--api-key-env", default=None,
                 help="openai engine: env var holding the API key (default OPENAI_API_KEY)."),
    click.option("--attribute-with", "attribute_with", multiple=True, metavar="LABEL=URL",
                 help="openai engine: attribute divergences by re-scoring them on a second "
                      "server started with other kernel settings (repeatable)."),
    click.option("--ignore-eos", is_flag=True,
                 help="Decode every prompt's full max_tokens past end-of-sequence (a new suite)."),
    click.option("--axes", "axes", default="default", show_default=True, metavar="AXES",
                 help="Workload axes to drive (see `speccheck axes`): default (every axis the engine "
                      "runs, at small default levels), none, or e.g. 'concurrency=4+8+32,long_lived=500'."),
    click.option("--axes-on", "axes_on", default="default", show_default=True,
                 type=click.Choice(["default", "all"]),
                 help="Configs the axes run on: default (the baseline and each method's largest K) or all."),
]


class FiniteFloat(click.FloatRange):
    """A float range that also refuses NaN (which compares false with every bound, so click's
    own range lets it through) and the infinities."""

    def convert(self, value, param, ctx):
        x = super().convert(value, param, ctx)
        if not math.isfinite(x):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return x


sampling_options = [
    click.option("--temperature", default=0.0, show_default=True, type=FiniteFloat(0, 100),
                 help="Sample at this temperature (0: greedy). A sampled suite is its own suite; "
                      "every request carries its own seed, and the distribution check judges it."),
    click.option("--top-p", "top_p", default=1.0, show_default=True,
                 type=FiniteFloat(0, 1, min_open=True), help="Sampling: nucleus mass kept."),
    click.option("--sample-top-k", "sample_top_k", default=0, show_default=True,
                 type=click.IntRange(0, 2 ** 31 - 1),
                 help="Sampling: most likely tokens kept (0: all; --top-k is the logprobs width)."),
    click.option("--seed", "seed", default=0, show_default=True, type=click.IntRange(0, 2 ** 32 - 1),
                 help="Sampling: the run's seed (each request's derives from it and the prompt)."),
    click.option("--samples", "samples", default=1, show_default=True, type=click.IntRange(1, 64),
                 help="Sampling: requests per prompt, each with its own seed (more samples: a "
                      "smaller effect the distribution check detects)."),
]


@click.group(cls=SpeccheckGroup, epilog=EXIT_CODES_HELP)
@click.version_option(package_name="speccheck")
def main() -> None:
    """Correctness and determinism gate for speculative decoding."""


@main.command()
@click.argument("sources", nargs=-1, required=True, type=click.Path(file_okay=False, exists=True))
@store_option
def merge(sources, store_dir):
    """Copy into --store the suites, runs, rescoring and attribution that the SOURCES stores
    hold and it lacks (configs run side by side, e.g. one GPU each); nothing is overwritten."""
    store = Store(store_dir)
    with store.lock(notify=click.echo):
        for src in sources:
            for line in store.merge(Store(src)):
                click.echo(f"{src}: {line}")


executor_options = [
    click.option("--executor", default="local", show_default=True, metavar="local|ray",
                 help="Where the cells run: local (this machine, one after another) or ray (every "
                      "cell a Ray task sized to its engine; pip install 'speccheck[ray]')."),
    click.option("--address", default=None, metavar="ADDRESS",
                 help="--executor ray: the cluster, auto, HOST:PORT or ray://HOST:PORT (default: "
                      "$RAY_ADDRESS, else Ray started on this machine)."),
]


@main.command()
@_apply(run_options)
@_apply(sampling_options)
@_apply(executor_options)
@store_option
def run(engine, model, draft, methods, k, configs, corpus, max_tokens, repeats, top_k, engine_args,
        no_attribution, attribution_paths, attribution_mode, concurrent, base_url, served_model,
        api_key_env, attribute_with, ignore_eos, axes, axes_on, temperature, top_p, sample_top_k,
        seed, samples, executor, address, store_dir):
    """Run the matrix (baseline always included) and the workload axes into the store; resumes
    finished runs."""
    from speccheck.executors import run_suite

    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    engine_args = tuple(engine_args) + sampling_engine_args(temperature, top_p, sample_top_k, seed,
                                                              samples)
    plan = make_plan(engine, model, draft, methods, k, configs, corpus, repeats, top_k, engine_args,
                     no_attribution, base_url, served_model, api_key_env, concurrent, attribute_with,
                     max_tokens, ignore_eos, attribution_paths, attribution_mode, axes, axes_on,
                     executor, address)
    console = Console(stderr=True)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=console,
                  transient=True) as bar:
        task = bar.add_task("starting", total=None)

        def progress(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what)

        log = bar.console.print if console.is_terminal else click.echo
        suite = run_suite(plan, Store(store_dir), log=log, progress=progress)
        if suite.is_complete("baseline", 0):  # inconclusive checks: judged again on more prompts
            from speccheck.escalate import escalate

            escalate(plan, Store(store_dir), suite, log)
    runs = list(range(plan.repeats)) + ([TOGETHER] if plan.concurrent else [])
    on = {c.name for c in plan.axis_configs()}
    failed = [f"{c.name} {slot_label(r)}" for c in plan.configs
              for r in runs + (list(plan.axes) if c.name in on else []) if not suite.is_complete(c.name, r)]
    click.echo(f"stored in {suite.root}" + (f"; FAILED runs: {', '.join(failed)}" if failed else ""))
    if failed:
        sys.exit(EXIT_ENGINE)


def _select(suite, methods, k, configs) -> list[str] | None:
    if k and not methods:
        raise MatrixError(f"--k {k}: say which method it applies to (e.g. --method mtp --k {k}), "
                          "or name configs with --config.")
    from speccheck.evaluate import judged_configs

    if not methods and not configs:
        return None
    wanted = {c.name for c in build_matrix(methods, k, configs, offered=None)} if (k or configs) else None
    names = [n for n in judged_configs(suite)
             if n == "baseline" or (wanted is not None and n in wanted)
             or (wanted is None and n.split("-k")[0] in methods)]
    return names


@main.command()
@click.option("--method", "methods", multiple=True, help="Method(s) to show besides the baseline (repeatable).")
@click.option("--k", "k", default=None, help="K values of --method to show: 7, 1-12 or 1,3,7.")
@click.option("--config", "configs", multiple=True, help="Config by name, e.g. mtp-k3 (repeatable).")
@click.option("--against", type=click.Choice(["baseline", "golden"]), default="baseline", show_default=True,
              help="Also compare today's baseline with the golden (golden).")
@click.option("--json", "as_json", is_flag=True, help="Print the same figures as JSON.")
@click.option("--run", "run_missing", is_flag=True,
              help="Run what is missing first (reference engine, --corpus); LATEST is not moved.")
@click.option("--corpus", default=None, help="With --run: the corpus to run (default: the last suite's, or default).")
@suite_option
@store_option
@golden_option
@_apply(policy_options)
def diff(methods, k, configs, against, as_json, run_missing, corpus, suite, store_dir, golden_dir, policy_file,
         settings):
    """Compare spec configs with the baseline: determinism, agreement, divergences, acceptance."""
    from speccheck.report import diff_text

    if corpus and not run_missing:
        raise MatrixError("--corpus applies with --run (diff reads the stored suite; pick it with --suite).")
    if run_missing:
        from speccheck.executors import run_suite

        store = Store(store_dir)
        previous = store.latest_id()
        if corpus is None:
            corpus = store.latest().meta["corpus"] if previous else "default"
        plan = make_plan("reference", None, None, methods, k, configs, corpus, 2, 5, (), concurrent=2,
                         axes="none")  # what diff shows; the workload axes are `run`'s
        ran = run_suite(plan, store, log=lambda m: click.echo(m, err=True))
        if previous is not None and previous.strip() != ran.id:
            store.set_latest(previous.strip())  # diff looks; only `run` moves LATEST
        suite = ran.id
    s = api.open_suite(store_dir, suite)
    names = _select(s, methods, k, configs)
    if names is not None and len(names) <= 1 and (methods or configs):
        raise MatrixError(f"no stored runs for {', '.join(methods or configs)} in suite {s.id}; "
                          "run them first (`speccheck run --method ...`) or pass --run.")
    s, result, detok = api.evaluate(store_dir, suite, policy_file, _settings(settings), names, golden_dir)
    if against == "golden":
        _golden_check_print(s, result, golden_dir, policy_file, settings)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=1, default=str, ensure_ascii=False))
    else:
        click.echo(diff_text(result, detok) + (f"\n{plan_note(result)}" if plan_note(result) else ""))


@main.command()
@click.option("--method", "methods", multiple=True,
              help="Demand configs of this method (with --k; repeatable): absent ones fail.")
@click.option("--k", "k", default=None, help="K values of --method: 7, 1-12 or 1,3,7.")
@click.option("--config", "configs", multiple=True, help="Demand a config by name, e.g. mtp-k3 (repeatable).")
@suite_option
@store_option
@golden_option
@_apply(policy_options)
@click.option("--junit", default=None, type=click.Path(dir_okay=False), help="Write JUnit XML here.")
def gate(methods, k, configs, suite, store_dir, golden_dir, policy_file, settings, junit):
    """Apply the policy to every config stored, planned (by `run`) or demanded here: exit 0
    pass, 1 fail, 3 engine failure. A planned or demanded config that is missing fails."""
    verdict = api.gate(store_dir, suite, policy=policy_file, settings=_settings(settings), golden=golden_dir,
                       methods=methods, k=k, configs=configs, junit=junit)
    click.echo(verdict.text)
    sys.exit(verdict.exit_code)


@main.command()
@suite_option
@store_option
@golden_option
@_apply(policy_options)
@click.option("--out", default=None, type=click.Path(file_okay=False),
              help="Directory for report.md, report.json and report.html (default: the suite directory).")
@click.option("--html", "html_file", default=None, type=click.Path(dir_okay=False),
              help="Write the HTML report here instead of report.html in the --out directory.")
def report(suite, store_dir, golden_dir, policy_file, settings, out, html_file):
    """Write a Markdown report (the K-sweep and method tables), a JSON summary and a self-contained
    HTML report (verdict, K-sweep and margin plots, every check and divergence)."""
    from speccheck.report import method_table, write_report

    s, result, detok = api.evaluate(store_dir, suite, policy_file, _settings(settings), golden_dir=golden_dir)
    paths = write_report(result, Path(out) if out else s.root, detok, Path(html_file) if html_file else None)
    click.echo(method_table(result) + "\n")
    click.echo("\n".join(f"wrote {p}" for p in paths))
    for line in (m for r in result.configs for m in r.missing):
        click.echo(f"FAIL  {line}")
    if plan_note(result):
        click.echo(plan_note(result))


@main.command()
@click.option("--method", "methods", multiple=True, required=True, help="Method(s) to sweep, e.g. dflash.")
@click.option("--k", "k", default="1-10", show_default=True, help="K values: 7, 1-12 or 1,3,7.")
@click.option("--engine", default="reference", show_default=True, help="reference | vllm | openai")
@click.option("--model", default=None, help="Model path (engine-specific; reference: shipped weights).")
@click.option("--draft", default=None, help="External drafter path (dflash, dflash2).")
@click.option("--corpus", default="default", show_default=True, help="Built-in corpus name or a file path.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 100),
              help="Rounds: runs per config, round-robin (the spread of the recommendation; 2 or "
                   "more also gates determinism).")
@click.option("--engine-arg", "engine_args", multiple=True, help=ENGINE_ARG_HELP)
@store_option
@_apply(policy_options)
def sweep(methods, k, engine, model, draft, corpus, repeats, engine_args, store_dir, policy_file, settings):
    """K-sweep: run a method over a K range, round-robin (every K once per round, with the
    baseline), and print the seed's table, then per method the speedup model — measured and
    predicted speedup per K, the model checked on the Ks its fit left out — and the K it
    recommends, or that the top two are within noise. Use --repeats 3 or more for a spread."""
    from speccheck.report import recommendation, speedup_table, sweep_table
    from speccheck.executors import run_suite

    if all(m == "baseline" for m in methods):
        raise MatrixError(f"--method {' --method '.join(methods)}: a sweep runs a speculative method over "
                          "K (the baseline always runs beside it); name one, e.g. --method mtp.")
    plan = make_plan(engine, model, draft, methods, k, (), corpus, repeats, 5, engine_args, no_attribution=True,
                     axes="none")  # a sweep measures speed; the gate's axes are `run`'s
    plan.round_robin = True  # every K of a round meets the same spells of load on a shared machine
    plan.fresh_process_repeat = False  # speed and acceptance; determinism across processes is `run`'s
    suite = run_suite(plan, Store(store_dir), log=lambda m: click.echo(m, err=True))
    if repeats < 2:  # a sweep is about speed and acceptance; determinism needs --repeats 2
        settings = ("require_deterministic=false", *settings)
    _, result, _ = api.evaluate(store_dir, suite.id, policy_file, _settings(settings), [c.name for c in plan.configs])
    click.echo(sweep_table(result))
    for method in dict.fromkeys(c.method for c in plan.configs if not c.is_baseline):
        click.echo("\n" + recommendation(result, method))
        if method in result.speedup:
            click.echo(speedup_table(result.speedup[method]))
        else:
            click.echo(f"no speedup model for {method}: it needs two or more Ks and a baseline run in the same round")


@main.group()
def golden() -> None:
    """Record or check a golden baseline (golden/<engine>/<model>/<corpus>/)."""


@golden.command("record")
@suite_option
@store_option
@golden_option
@_apply(policy_options)
@click.option("--force", is_flag=True, help="Overwrite an existing golden (the refusal shows what would change).")
def golden_record(suite, store_dir, golden_dir, policy_file, settings, force):
    """Record the store's baseline and per-config acceptance as the golden (the suite must pass the gate).

    With --force the gate is judged without the golden it replaces (as a snapshot update: an
    intended change of numerics moves logprobs and acceptance away from the old golden)."""
    from speccheck import golden as g

    s, result, _ = api.evaluate(store_dir, suite, policy_file, _settings(settings),
                             golden_dir=None if force else golden_dir)
    path = g.record(s, result, Path(golden_dir), force=force)
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
    detok = api.detokenizer(s)
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
    if chk.why():
        click.echo(f"    {chk.why()}")
    for r in result.configs:
        if r.acceptance is not None and r.config in chk.acceptance:
            click.echo(f"    {r.config}: {r.acceptance.tokens_per_iter:.2f} tokens/iter "
                       f"(golden {chk.acceptance[r.config]:.2f})")
    if chk.checks is not None:
        changed = g.check_changes(chk.checks, result)
        click.echo(f"    checks against the golden's: {len(changed)} changed state"
                   + "".join(f"\n      {line}" for line in changed))
    return chk.passed


@golden.command("check")
@suite_option
@store_option
@golden_option
@_apply(policy_options)
def golden_check(suite, store_dir, golden_dir, policy_file, settings):
    """Compare today's baseline with the golden; only classified near-ties may differ. A
    planned run missing from the suite fails the check too."""
    s, result, _ = api.evaluate(store_dir, suite, policy_file, _settings(settings), golden_dir=golden_dir)
    missing = [m for r in result.configs for m in r.missing]
    for line in missing:
        click.echo(f"FAIL  {line}")
    if s.is_complete("baseline", 0):
        ok = _golden_check_print(s, result, golden_dir, policy_file, settings) and not missing
    else:
        click.echo(f"FAIL  suite {s.id} holds no complete baseline r0 to compare with the golden")
        ok = False
    click.echo("golden check: PASS" if ok else "golden check: FAIL")
    sys.exit(0 if ok else 1)


@main.command()
@click.option("--config", "config_names", multiple=True,
              help="Config to compare (repeatable; default: every config both suites hold).")
@suite_option
@store_option
@click.option("--with-store", "other_store", required=True, type=click.Path(file_okay=False),
              help="Store holding the other suite (e.g. another engine's, or another TP size's).")
@click.option("--with-suite", "other_suite", default=None, help="Suite id there (default: its last run).")
@_apply(policy_options)
def compare(config_names, suite, store_dir, other_store, other_suite, policy_file, settings):
    """Cross-engine, cross-machine or cross-TP-size agreement: each config's first repeat in two
    suites, compared stream by stream, classified like any divergence, and attributed to what
    differs between the suites' identities (TP size, GPU model, engine version, ...) where each
    side's stored rescoring reproduces its own token (exit 1 on high-confidence)."""
    from speccheck.compare import compare_suites
    from speccheck.identity import changes_str
    from speccheck.report import divergence_line

    a = api.open_suite(store_dir, suite)
    try:
        b = api.open_suite(other_store, other_suite)
    except StoreError as e:
        raise StoreError(f"--with-store {other_store}: {e}") from None
    _two_suites(a, b, "--store / --suite", "--with-store / --with-suite")
    if config_names:
        for name in config_names:
            for side, opt in ((a, "--store"), (b, "--with-store")):
                if not side.check_run(name, 0):
                    raise MatrixError(f"--config {name}: suite {side.id} ({opt}) holds no complete run of it "
                                      f"(stored: {', '.join(side.configs()) or 'none'}); run it there first "
                                      f"with `speccheck run --config {name}`.")
        names = list(config_names)
    else:
        # a damaged first run on either side is an error (StoreError), never a config skipped
        names = [c for c in a.configs() if c in b.configs() and a.check_run(c, 0) & b.check_run(c, 0)]
        if not names:
            raise MatrixError(f"suites {a.id} (--store) and {b.id} (--with-store) hold no config in common "
                              f"with a complete first run (stored: {', '.join(a.configs()) or 'none'} / "
                              f"{', '.join(b.configs()) or 'none'}); run the same configs into both.")
    if a.meta.get("corpus_hash") != b.meta.get("corpus_hash"):
        raise StoreError(f"suites {a.id} and {b.id} ran different corpora (hash {a.meta.get('corpus_hash')} "
                         f"vs {b.meta.get('corpus_hash')}); compare runs of the same corpus.")
    policy = load_policy(policy_file, _settings(settings))
    detok = api.detokenizer(a)
    cmp = compare_suites(a, b, names, policy, detok)
    click.echo(f"{a.id} vs {b.id} (path noise {cmp.noise:.4f} nats, tau_tie {cmp.tau_tie:.3f}, "
               f"tau_low {cmp.tau_low:.3f})")
    click.echo(f"  the suites differ in: {changes_str(cmp.changes)}")
    for name, c in cmp.configs.items():
        lines = _comparison_lines(c, detok)
        click.echo(f"{name}: {lines[0]}")
        if cmp.config_changes.get(name):
            click.echo(f"    this config also differs in: {changes_str(cmp.config_changes[name])}")
        for d, why in zip(c.divergences, cmp.attribution[name]):
            click.echo("    " + divergence_line(d, detok))
            click.echo(f"        attributed to {why['cause']}: {why['why']}")
    click.echo(cmp.verdict())
    sys.exit(0 if cmp.passed else 1)


def _two_suites(a, b, first: str, second: str) -> None:
    """Two sides of a comparison that are one suite would agree with themselves: a pass that
    compared nothing. Refused, naming the options."""
    if a.root.resolve() == b.root.resolve():
        raise MatrixError(f"{first} and {second} both name suite {a.id} of {a.root.parent.parent}: a suite "
                          "compared with itself agrees by construction. Give the other store (or suite) "
                          "to compare with.")


@main.command()
@click.argument("old_store", type=click.Path(file_okay=False, exists=True))
@click.argument("new_store", type=click.Path(file_okay=False, exists=True))
@click.option("--old-suite", default=None, help="Suite id in OLD_STORE (default: its last run).")
@click.option("--new-suite", default=None, help="Suite id in NEW_STORE (default: its last run).")
@click.option("--config", "config_names", multiple=True,
              help="Config to judge (repeatable; default: every config the old suite completed).")
@click.option("--alpha", type=FiniteFloat(0, 1, min_open=True, max_open=True), default=None,
              help="Acceptance tests' family-wise alpha (default: the policy's acceptance_alpha).")
@click.option("--max-slowdown", type=FiniteFloat(0, 1, max_open=True), default=0.10, show_default=True,
              help="Fail a config whose warm tok/s (or speedup over its baseline) falls by more than this "
                   "share (0 to below 1: a share of 1 would let any slowdown pass).")
@_apply(policy_options)
def upgrade(old_store, new_store, old_suite, new_suite, config_names, alpha, max_slowdown, policy_file,
            settings):
    """The engine upgrade as the gated change: OLD_STORE's suite (e.g. vLLM 0.26) against
    NEW_STORE's (the new version, same corpus and configs): per config, outputs (divergences
    classified; only near-ties pass), acceptance per draft position (two-sided, prompts paired),
    speed, and each workload axis the old suite ran (exit 1 on any failure)."""
    from speccheck.upgrade import upgrade_lines, upgrade_suites

    a, b = api.open_suite(old_store, old_suite), api.open_suite(new_store, new_suite)
    _two_suites(a, b, "OLD_STORE / --old-suite", "NEW_STORE / --new-suite")
    if a.meta.get("corpus_hash") != b.meta.get("corpus_hash"):
        raise StoreError(f"suites {a.id} and {b.id} ran different corpora (hash {a.meta.get('corpus_hash')} "
                         f"vs {b.meta.get('corpus_hash')}); an upgrade is judged on the same corpus.")
    names = list(config_names) or [c for c in a.configs() if a.is_complete(c, 0)]
    for name in names:
        if not a.is_complete(name, 0):
            raise MatrixError(f"--config {name}: the old suite {a.id} holds no complete run of it "
                              f"(stored: {', '.join(a.configs()) or 'none'}).")
    if not names:
        raise MatrixError(f"the old suite {a.id} holds no complete run to judge the upgrade on.")
    policy = load_policy(policy_file, _settings(settings))
    u = upgrade_suites(a, b, names, policy, api.detokenizer(a), alpha=alpha, max_slowdown=max_slowdown)
    for line in upgrade_lines(u):
        click.echo(line)
    sys.exit(0 if u.passed else 1)


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
        flag = " ignore_eos" if p.ignore_eos else ""
        click.echo(f"  {p.id:24} {p.category:14} max_tokens={p.max_tokens:<5}{flag} {text[:70]}")


@main.command("checks")
def checks_command():
    """Every check of the gate: what passing means and the bug class it guards."""
    from speccheck.checks import registry

    for spec in registry():
        click.echo(f"{spec.name}{'' if spec.baseline else '  (spec configs)'}\n  {spec.description}\n"
                   f"  guards: {spec.guards}" + "".join(f"\n  policy {k.name} = {k.default}" for k in spec.policy))


@main.command("axes")
@click.option("--engine", default="reference", show_default=True, help="reference | vllm | openai")
def axes_command(engine):
    """The workload axes `run --axes` drives, their default levels, and whether the engine runs them."""
    from speccheck.axes import registry

    supported = engine_class_of(engine).axes
    for a in registry():
        runs = [lv for lv in a.levels if a.runnable(lv, supported)]
        where = ("runs on " + engine if len(runs) == len(a.levels) else
                 f"only {'+'.join(runs)} run by the {engine} engine" if runs else
                 "NOT run by the " + engine + " engine")
        proofs = "; ".join(f"{lv}: {', '.join(keys)} > 0" for lv, keys in a.proofs.items())
        click.echo(f"{a.name:13} levels {'+'.join(a.levels):12} {where}\n"
                   f"  {a.description}\n  guards: {a.guards}" + (f"\n  proof: {proofs}" if proofs else ""))


@main.group()
def kernels() -> None:
    """Kernel-level harnesses (below the model)."""


@kernels.command("gdn")
@click.option("--device", default="auto", show_default=True, help="auto | cpu | cuda")
@click.option("--positions", default=8192, show_default=True, type=click.IntRange(1, 1 << 20),
              help="Sequence length of the synthetic inputs (bounded by the memory it takes: "
                   "about heads x head dim^2 x 4 bytes per position).")
@click.option("--heads", default=4, show_default=True, type=click.IntRange(1, 256), help="GDN heads.")
@click.option("--head-dim", default=None, type=click.IntRange(1, 512),
              help="Key/value head dim [default: 128 where FlashInfer's GDN prefill runs (its only "
                   "head dim), else 64].")
@click.option("--verify-block", default=8, show_default=True, type=click.IntRange(1, 64),
              help="Tokens per call of vLLM's fused verify kernel (K+1 for K speculative tokens).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the synthetic inputs.")
@click.option("--json", "json_out", is_flag=False, flag_value="-", default=None, metavar="[PATH]",
              help="Write the results as JSON to PATH (the table still to stdout); alone: print "
                   "the JSON to stdout and the table to stderr.")
def kernels_gdn(device, positions, heads, head_dim, verify_block, seed, json_out):
    """Every gated-delta-rule kernel here (reference recurrent/chunked; on CUDA FLA's Triton
    kernels, FlashInfer's GDN prefill and vLLM's fused decode/verify kernels) on the same bf16
    inputs against an fp64 recurrence: error, argmax flips, and flips by fp64 margin."""
    import torch

    from speccheck.kernels.gdn import (MAX_BYTES, compare, default_head_dim, flashinfer_auto_path,
                                       form_flips, kernels as gdn_kernels, make_inputs, margin_curves,
                                       margin_table, max_positions, memory_budget, memory_needed, table)

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.split(":")[0] not in ("cpu", "cuda"):
        raise click.BadParameter(f"{device!r}: use auto, cpu or cuda (cuda:N)", param_hint="--device")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise click.UsageError("--device cuda: CUDA is not available here; use --device cpu")
    if json_out not in (None, "-") and not Path(json_out).resolve().parent.is_dir():
        raise click.BadParameter(f"{json_out}: its folder does not exist; create it or give "
                                 "another path (or --json alone for stdout)", param_hint="--json")
    if head_dim is None:
        head_dim = default_head_dim(device)
    need, budget = memory_needed(positions, heads, head_dim, head_dim), memory_budget(device)
    if need > budget:
        most = max_positions(heads, head_dim, head_dim, budget)
        raise click.BadParameter(
            f"{positions} positions x {heads} heads at head dim {head_dim} would take about "
            f"{need / 2 ** 30:.1f} GiB ({device} has room for {budget / 2 ** 30:.1f} GiB here: half of "
            f"what is free, at most {MAX_BYTES // 2 ** 30} GiB); the kernels keep a state per position "
            f"and head. Give at most --positions {most} at these --heads/--head-dim"
            + (", or fewer --heads" if heads > 1 else "") + ".", param_hint="--positions")
    inputs = make_inputs(positions, heads, head_dim, head_dim, seed, device)
    missing: list[str] = []
    impls = gdn_kernels(device, missing, head_dim, verify_block)
    # measured on 2 CPU cores: 8192 x 4 heads at head dim 64 in 4 s, 16384 x 4 in 16 s, 4096 x 4 at
    # head dim 256 in 12 s: about 0.2 ms per position and head, head dim 64 (within 2x)
    cpu_eta = (f", roughly {2e-4 * positions * heads * (1 + head_dim * head_dim / 4096) / 2:.0f} s on 2 CPU cores"
               if device == "cpu" else "")
    click.echo(f"kernels gdn: fp64 reference, then {len(impls)} kernel(s) x 3 timed repeats on {positions} "
               f"positions x {heads} heads ({device}, about {need / 2 ** 30:.1f} GiB{cpu_eta}) ...", err=True)
    comparison = compare(inputs, impls)
    results, curves = comparison.results, margin_curves(comparison)
    fi_auto = flashinfer_auto_path(device, heads) if "flashinfer chunked" in impls else None
    lines = [f"gated delta rule on {device}: {positions} positions x {heads} heads, head dim "
             f"{head_dim}, bf16 q/k/v, fp32 g/beta/state, seed {seed}", table(results),
             margin_table(curves), *([f"note: {fi_auto}"] if fi_auto else []),
             *(f"not here: {why}" for why in missing)]
    # JSON on stdout moves the table to stderr, so that one run gives both
    click.echo("\n".join(lines), err=json_out == "-")
    if json_out is not None:
        text = json.dumps({
            "device": device, "positions": positions, "heads": heads, "head_dim": head_dim,
            "verify_block": verify_block, "seed": seed,
            "gpu": torch.cuda.get_device_name(device) if device.startswith("cuda") else None,
            "kernels": [r.to_dict() for r in results],
            "chunked_vs_recurrent": [{"chunked": a, "recurrent": b, "flips": n, "compared": t}
                                     for a, b, n, t in form_flips(results)],
            "margin_bins": [{"label": b.label, **{k: v for k, v in b.to_dict().items() if k != "flips"}}
                            for b in (curves[0][2] if curves else [])],
            "flips_by_margin": [{"a": a, "b": b, "flips": [x.flips for x in row]} for a, b, row in curves],
            "flashinfer_auto": fi_auto, "not_here": missing}, indent=1)
        if json_out == "-":
            click.echo(text)
        else:
            write_output(Path(json_out), text + "\n", "--json")


@main.command()
@click.option("--method", default="mtp", show_default=True,
              help="Method for the faults that are not method-specific (any the reference engine offers).")
@click.option("--corpus", default="selftest", show_default=True, help="Built-in corpus name or a file path.")
@click.option("--fault", "faults", multiple=True, help="Only this planted fault (repeatable).")
@click.option("--store", "store_dir", default=None, type=click.Path(file_okay=False),
              help="Keep the runs in this store (default: a temporary directory).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def selftest(method, corpus, faults, store_dir, as_json):
    """Plant every reference-engine fault and show which check catches it: exit 1 when one is
    missed or the clean engine fails a check."""
    from speccheck.selftest import run_selftest, selftest_text

    result = run_selftest(method, corpus, store_dir, list(faults) or None,
                          log=lambda m: click.echo(m, err=True))
    click.echo(json.dumps(result.to_dict(), indent=1, ensure_ascii=False) if as_json
               else selftest_text(result))
    sys.exit(0 if result.passed else 1)


@main.command()
@click.option("--engine", default="reference", show_default=True, help="reference | vllm | openai")
@click.option("--model", default=None, help="Checkpoint directory to size the KV cache and weights for.")
@click.option("--k", "k", default=7, show_default=True, type=click.IntRange(0, 32), help="K to size for.")
@click.option("--tp", "tp", default=1, show_default=True, type=click.IntRange(1, 64),
              help="Tensor parallel size to check for (GPU count, links, P2P, memory per GPU, heads).")
@click.option("--base-url", default=None, help="A server to check (with or without /v1).")
@click.option("--api-key-env", default=None, help="Env var holding the server's API key (default OPENAI_API_KEY).")
def doctor(engine, model, k, tp, base_url, api_key_env):
    """What this machine can run: GPU, driver, torch/vLLM, the GDN and attention backends, WSL2,
    GPU memory vs the model's KV cache, a server, and with --tp N the multi-GPU preconditions;
    each finding with its fix (exit 1 if any FAIL)."""
    from speccheck.doctor import FAIL, diagnose
    from speccheck.engines import engine_names

    if engine not in engine_names():  # checked without importing any engine
        raise EngineUsageError(f"unknown engine {engine!r} (option --engine): choose one of "
                               f"{', '.join(engine_names())}.")
    findings = diagnose(engine, model, base_url, api_key_env, k, tp)
    for f in findings:
        click.echo(f.line())
    sys.exit(1 if any(f.status == FAIL for f in findings) else 0)


@main.command("export-reference")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--model", default=None, help="Reference weights dir (default: the shipped ones).")
@click.option("--linear-head-dim", type=click.IntRange(min=1), default=None,
              help="Pad the target's GDN key/value head dims to this (128: what FlashInfer's GDN "
                   "prefill kernel, vLLM's default on Hopper, requires); the same network, see the "
                   "speccheck key of its config.json.")
@click.option("--force", is_flag=True, help="Write into OUT_DIR even though it already holds files.")
def export_reference_cmd(out_dir, model, linear_head_dim, force):
    """Write the reference checkpoint in the Hugging Face layouts vLLM loads (target + drafter)."""
    from speccheck.reference.export import ExportError, export_reference

    out = Path(out_dir)
    if out.is_dir() and not force and any(out.iterdir()):
        held = ", ".join(sorted(p.name for p in out.iterdir())[:5])
        raise PolicyError(f"export-reference {out_dir}: the directory already holds files ({held}); "
                          "writing there would overwrite a checkpoint (config.json, weights). Give a new "
                          "or empty directory, or pass --force to overwrite.")

    try:
        info = export_reference(out_dir, model, linear_head_dim)
    except ExportError as e:
        click.echo(f"speccheck: error: {e}", err=True)
        sys.exit(EXIT_USAGE)
    click.echo(json.dumps(info, indent=1, default=str))


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option("--method", default="baseline", show_default=True, help="What the server runs: baseline | mtp | dflash | dflash2.")
@click.option("--k", "k", default=None, type=int, help="K for --method mtp/dflash/dflash2.")
@click.option("--model", default=None, help="Reference weights dir (default: the shipped ones).")
@click.option("--api-key-env", default=None, help="Require this env var's value as Bearer key.")
@click.option("--engine-arg", "engine_args", multiple=True,
              help=f"Option key=value of the reference engine behind the server (repeatable): "
                   f"{REFERENCE_ARG_KEYS}.")
def serve(host, port, method, k, model, api_key_env, engine_args):
    """OpenAI-compatible server (vLLM's endpoints and metric names) in front of the reference engine."""
    from speccheck.serve import serve as serve_forever

    if method != "baseline":
        build_matrix([method], str(k) if k is not None else None, offered=("mtp", "dflash", "dflash2"))
    serve_forever(host=host, port=port, method=method, k=k or 0, api_key_env=api_key_env,
                  engine_args=parse_engine_args(engine_args), model=model)


if __name__ == "__main__":
    main()
