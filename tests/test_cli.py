"""The command line as a user meets it: bad input gets one clear paragraph and exit 2, and
loses nothing already stored; a small real run on the reference engine goes end to end."""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from speccheck.cli import main


def speccheck(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "speccheck.cli", *args], capture_output=True, text=True,
                          cwd=cwd)


def test_duplicate_id_in_corpus_file(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"id": "a", "category": "code", "max_tokens": 8, "text": "x = 1"}\n'
                 '{"id": "a", "category": "code", "max_tokens": 8, "text": "y = 2"}\n')
    r = speccheck("run", "--corpus", str(f), "--store", str(tmp_path / "st"))
    assert r.returncode == 2
    assert "mine.jsonl:2" in r.stderr and "duplicate" in r.stderr.lower()
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--method", "eagle9"], "--method 'eagle9'"),
    (["--method", "mtp", "--k", "0"], "--k '0'"),
    (["--method", "mtp", "--k", "40"], "between 1 and 32"),
    (["--corpus", "nonesuch"], "nonesuch"),
    (["--engine", "tgi"], "unknown engine 'tgi'"),
])
def test_bad_options_exit_2(tmp_path, args, needle):
    r = CliRunner().invoke(main, ["run", "--store", str(tmp_path / "st"), *args])
    assert r.exit_code == 2, r.output
    assert needle in r.output


def test_commands_on_an_empty_store_explain(tmp_path):
    for cmd in (["gate"], ["diff"], ["report"], ["golden", "check"]):
        r = CliRunner().invoke(main, [*cmd, "--store", str(tmp_path / "nothing")])
        assert r.exit_code == 2 and "speccheck run" in r.output, (cmd, r.output)


def test_unknown_policy_key_exit_2(tmp_path):
    r = CliRunner().invoke(main, ["gate", "--store", str(tmp_path), "--set", "min_speed=3"])
    assert r.exit_code == 2


@pytest.mark.slow
def test_end_to_end_smoke_run_diff_gate_report(tmp_path):
    """A real (small) run on the reference engine: run -> diff --json -> gate -> report, and a
    second `run` resumes without redoing anything."""
    st = str(tmp_path / "st")
    runner = CliRunner()
    r = runner.invoke(main, ["run", "--store", st, "--corpus", "smoke", "--config", "mtp-k2",
                             "--repeats", "2", "--no-attribution"])
    assert r.exit_code == 0, r.output
    again = runner.invoke(main, ["run", "--store", st, "--corpus", "smoke", "--config", "mtp-k2",
                                 "--repeats", "2", "--no-attribution"])
    assert "0 to run" in again.output
    d = runner.invoke(main, ["diff", "--store", st, "--method", "mtp", "--json"])
    data = json.loads(d.output)
    names = [c["config"] for c in data["configs"]]
    assert names == ["baseline", "mtp-k2"]
    mtp = data["configs"][1]
    assert mtp["identical_runs"] is True and mtp["acceptance"]["drafts"] > 0
    g = runner.invoke(main, ["gate", "--store", st, "--junit", str(tmp_path / "j.xml"),
                             "--set", "min_token_agreement=0.01"])
    assert g.exit_code in (0, 1) and "gate:" in g.output and (tmp_path / "j.xml").exists()
    rep = runner.invoke(main, ["report", "--store", st, "--out", str(tmp_path / "rep")])
    assert rep.exit_code == 0 and "| mtp-k2 | 2 |" in (tmp_path / "rep" / "report.md").read_text()
    page = (tmp_path / "rep" / "report.html").read_text()  # the HTML report beside it
    assert "data-config='mtp-k2'" in page and "class=\"plot line\"" in page

    # golden: record, check passes; a golden of another model is refused with exit 2
    gold = str(tmp_path / "golden")
    rec = runner.invoke(main, ["golden", "record", "--store", st, "--golden", gold])
    assert rec.exit_code == 0, rec.output
    chk = runner.invoke(main, ["golden", "check", "--store", st, "--golden", gold])
    assert chk.exit_code == 0 and "4/4 prompts exact" in chk.output, chk.output
    gjson = next((tmp_path / "golden").rglob("golden.json"))
    meta = json.loads(gjson.read_text())
    meta["fingerprint"]["model_hash"] = "0" * 64
    gjson.write_text(json.dumps(meta))
    from speccheck.store import file_sum  # with its checksum, as a golden of another model has one

    gjson.with_name("golden.json.sha256").write_text(json.dumps(file_sum(gjson)))
    bad = runner.invoke(main, ["golden", "check", "--store", st, "--golden", gold])
    assert bad.exit_code == 2 and "another model" in bad.output
    # the same suite, copied to another store, agrees exactly (the store against itself is refused)
    import shutil

    shutil.copytree(st, tmp_path / "copy")
    same = runner.invoke(main, ["compare", "--store", st, "--with-store", str(tmp_path / "copy")])
    assert same.exit_code == 0 and "4/4 prompts exact" in same.output
    assert runner.invoke(main, ["compare", "--store", st, "--with-store", st]).exit_code == 2


def test_sweep_prints_the_k_table_the_speedup_model_and_a_recommendation(tmp_path):
    """A real sweep on the reference engine (smoke corpus, K 1-3, one round): the seed's
    table, then the speedup model validated on the K its fit left out, and a recommendation
    (or none, where no K beats the baseline: which is a measurement of this machine)."""
    r = CliRunner().invoke(main, ["sweep", "--store", str(tmp_path / "st"), "--method", "mtp", "--k", "1-3",
                                  "--corpus", "smoke", "--repeats", "1"])
    assert r.exit_code == 0, r.output
    rows = [line for line in r.output.splitlines() if line.startswith("| mtp-k")]
    assert [row.split("|")[1].strip() for row in rows] == ["mtp-k1", "mtp-k2", "mtp-k3"]
    assert "speedup model from 1 round(s)" in r.output and "engine's CPU seconds" in r.output
    model = [line.split("|")[1:-1] for line in r.output.splitlines() if re.match(r"\| \d \|", line)]
    assert [m[0].strip() for m in model] == ["1", "2", "3"]
    assert [m[5].strip() for m in model][::2] == ["fit", "fit"]  # K=1 and K=3 fit, K=2 validates
    assert re.search(r"validation: K=2 predicted from K=1,3 alone: K=2 [+-]\d+\.\d %", r.output), r.output
    # one round cannot tell how sure it is: the line says so (a runner-up within noise, or no
    # spread measured), whichever K this machine's load makes fastest
    assert re.search(r"speedup model, best mtp K(=[123]: \d\.\d\dx ± \d\.\d\d .*(one round measures no spread"
                     r"|is within noise of it)|: none — no K is faster)", r.output), r.output
    # the recommendation is the table's: the passing config with the best measured speedup
    speedups = {row.split("|")[1].strip(): row for row in rows}
    rec = re.search(r"^recommended mtp: (mtp-k\d) at (\d\.\d\d)x|^recommended mtp: none", r.output, re.M)
    assert rec, r.output
    if rec[1]:
        assert f"{rec[2]}x" in speedups[rec[1]], (rec[0], speedups[rec[1]])


def test_runs_made_with_other_weights_are_redone(tmp_path):
    """A stored run whose weights fingerprint differs from the engine's now is stale: `run` redoes it."""
    st = tmp_path / "st"
    args = ["run", "--store", str(st), "--corpus", "smoke", "--method", "baseline", "--repeats", "1",
            "--no-attribution", "--axes", "none"]
    assert CliRunner().invoke(main, args).exit_code == 0
    manifest = next(st.rglob("manifest.json"))
    m = json.loads(manifest.read_text())
    m["identity"]["model_hash"] = "weights-of-last-week"
    manifest.write_text(json.dumps(m))
    again = CliRunner().invoke(main, args)
    assert "1 to run" in again.output
    assert json.loads(manifest.read_text())["identity"]["model_hash"] != "weights-of-last-week"


def _command_of_speccheck_group(body: str) -> list[str]:
    """A Python command line running one command, ``body``, in speccheck's CLI group."""
    code = ("import click\nfrom speccheck.cli import SpeccheckGroup\n"
            "@click.group(cls=SpeccheckGroup)\ndef cli(): pass\n"
            "@cli.command()\ndef one():\n" + textwrap.indent(body, "    ") + "\ncli(['one'])\n")
    return [sys.executable, "-c", code]


def test_a_reader_that_leaves_early_ends_the_command_quietly(tmp_path):
    """`speccheck ... | head`: once the reader has gone, the command stops with 141 (128 +
    SIGPIPE, as other tools), says nothing and saves no crash report (it did: exit 4 and a
    traceback file for a BrokenPipeError). A command of speccheck's group that prints 1 MB."""
    proc = subprocess.Popen(_command_of_speccheck_group("for i in range(20000):\n"
                                                        "    click.echo('x' * 50)"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "TMPDIR": str(tmp_path)}, cwd=tmp_path)
    assert proc.stdout.readline().strip() == b"x" * 50
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141, err
    assert err == b""
    assert not list(tmp_path.glob("speccheck-crash-*"))


def test_a_broken_pipe_of_speccheck_own_is_still_an_internal_error(tmp_path):
    """A BrokenPipeError while stdout is fine (a pipe to a process speccheck started broke)
    is a bug to report (exit 4, traceback saved), not a reader that left."""
    r = subprocess.run(_command_of_speccheck_group("raise BrokenPipeError(32, 'Broken pipe')"),
                       capture_output=True, text=True, env={**os.environ, "TMPDIR": str(tmp_path)},
                       cwd=tmp_path, timeout=60)
    assert r.returncode == 4 and "internal error (BrokenPipeError" in r.stderr, r.stderr
    assert len(list(tmp_path.glob("speccheck-crash-*"))) == 1
