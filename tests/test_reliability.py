"""Nothing lost, nothing silently wrong (issue 12): honest exit codes, a store that notices
damage and says which command redoes just that part, a store lock, and bad input caught early.

One small real store (reference engine, smoke corpus, baseline + mtp-k2, one repeat) is made
once per module; every test damages its own copy of it."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from speccheck import cli
from speccheck.cli import main

RUN = ["--corpus", "smoke", "--config", "mtp-k2", "--repeats", "1", "--concurrent", "off", "--no-attribution",
       "--axes", "none"]
LOOSE = ["--set", "min_token_agreement=0.01"]


def invoke(*args):
    return CliRunner().invoke(main, list(args))


def assert_clean(r, code):
    """The contract: the exit code it names, one paragraph, no traceback."""
    out = r.output
    assert r.exit_code == code, out
    assert "Traceback" not in out, out
    if code == 2:
        assert "error:" in out and len([ln for ln in out.splitlines() if "error:" in ln]) == 1, out


@pytest.fixture(scope="module")
def made_store(tmp_path_factory):
    st = tmp_path_factory.mktemp("made") / "st"
    r = invoke("run", "--store", str(st), *RUN)
    assert r.exit_code == 0, r.output
    g = invoke("gate", "--store", str(st), *LOOSE)
    return st, g.exit_code


@pytest.fixture
def store(made_store, tmp_path):
    st = tmp_path / "st"
    shutil.copytree(made_store[0], st)
    return st


def suite_dir(st: Path) -> Path:
    return st / "suites" / (st / "LATEST").read_text().strip()


def snapshot(st: Path) -> dict:
    return {str(p.relative_to(st)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(st.rglob("*")) if p.is_file() and p.name != "lock"}


# --- 1. exit codes ---------------------------------------------------------------------------

def test_help_and_readme_list_the_exit_codes():
    r = invoke("--help")
    text = " ".join(r.output.split())
    for code in ("0 pass", "1 gate failed", "2 bad input", "3 engine failure", "4 internal error", "130"):
        assert code in text, text
    readme = " ".join((Path(__file__).parent.parent / "README.md").read_text().split())
    for code in ("**0** pass", "**1** the gate failed", "**2** bad input", "**3** engine failure",
                 "**4** internal error", "**130** interrupted"):
        assert code in readme
    ci = (Path(__file__).parent.parent / "docs" / "how-to" / "ci.md").read_text()
    assert "| 4 |" in ci and "| 130 |" in ci


@pytest.mark.parametrize("command", [["gate"], ["diff"], ["report"]])
def test_a_crash_inside_a_command_exits_4_and_saves_the_traceback(store, monkeypatch, command):
    """Test double: `evaluate_suite` is replaced by one that raises, standing in for a bug."""
    import speccheck.api

    def broken(*a, **k):
        raise ZeroDivisionError("planted bug")

    monkeypatch.setattr(speccheck.api, "evaluate_suite", broken)
    r = invoke(*command, "--store", str(store))
    assert r.exit_code == 4, r.output
    line = [ln for ln in r.output.splitlines() if "internal error" in ln]
    assert len(line) == 1 and "ZeroDivisionError: planted bug" in line[0]
    path = Path(line[0].split("the traceback is in ")[1].split(";")[0])
    assert path.exists() and "Traceback" in path.read_text() and "planted bug" in path.read_text()
    assert "Traceback" not in r.output
    path.unlink()


@pytest.mark.parametrize("command", [["gate"], ["report"]])
def test_ctrl_c_exits_130_and_keeps_the_store(store, monkeypatch, command):
    """Test double: `evaluate_suite` raises KeyboardInterrupt, as Ctrl-C would mid-command."""
    import speccheck.api

    before = snapshot(store)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(speccheck.api, "evaluate_suite", interrupted)
    r = invoke(*command, "--store", str(store))
    assert r.exit_code == 130 and "interrupted" in r.output and "Traceback" not in r.output
    assert snapshot(store) == before


def test_ctrl_c_in_a_real_process_exits_130(store):
    """A real SIGINT to a real `speccheck gate` process. Test double: its evaluate_suite says
    so and then waits, so the signal lands inside the command, not inside a native library's
    import (a SIGINT while torch loads can abort the process: -6, seen under load)."""
    import signal

    code = ("import sys, time, torch, speccheck.cli, speccheck.api as ev\n"
            "def waiting(*a, **k):\n    print('evaluating', flush=True); time.sleep(60)\n"
            "ev.evaluate_suite = waiting\n"
            f"sys.argv = ['speccheck', 'gate', '--store', {str(store)!r}]; speccheck.cli.main()")
    # SIGINT at its default, as in a terminal: a background job of a non-interactive shell (a CI
    # step run with `&`) passes it on ignored, and Python then never raises KeyboardInterrupt
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline().strip() == "evaluating"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in out + err and "Traceback" not in err


# --- 2. store integrity ----------------------------------------------------------------------

def _truncate(p: Path):
    p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])


def _flip(p: Path):
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x40
    p.write_bytes(bytes(b))


def _manifest_drop(key, in_completion=False):
    def mutate(p: Path):
        m = json.loads(p.read_text())
        del (m["completions"][0] if in_completion else m)[key]
        p.write_text(json.dumps(m))
    return mutate


def _attribution_broken(p: Path):
    p.write_text(json.dumps({"not": "a list"}))


DAMAGE = [
    ("runs/mtp-k2/r0/arrays.npz", _truncate, "mtp-k2"),
    ("runs/mtp-k2/r0/arrays.npz", _flip, "mtp-k2"),
    ("runs/baseline/r0/arrays.npz", _flip, "baseline"),
    ("runs/mtp-k2/r0/manifest.json", _manifest_drop("text", in_completion=True), "mtp-k2"),
    ("runs/mtp-k2/r0/manifest.json", _manifest_drop("status"), "mtp-k2"),
    ("runs/mtp-k2/r0/manifest.json", _truncate, "mtp-k2"),
    ("rescore/mtp-k2-r0.npz", _truncate, "mtp-k2"),
    ("rescore/mtp-k2-r0.npz", _flip, "mtp-k2"),
    ("rescore/baseline-r0.npz", _flip, "baseline"),
    ("attribution/mtp-k2.json", _attribution_broken, "mtp-k2"),
]


@pytest.mark.parametrize("rel,mutate,config", DAMAGE, ids=[f"{d[0]}-{d[1].__name__}" for d in DAMAGE])
def test_damage_is_exit_2_naming_the_file_and_the_redo_command(store, rel, mutate, config):
    path = suite_dir(store) / rel
    if not path.exists():  # attribution is not made by --no-attribution: plant a valid one first
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("[]")
    mutate(path)
    for command in (["gate", *LOOSE], ["diff", "--json"], ["report"]):
        r = invoke(*command, "--store", str(store))
        assert_clean(r, 2)
        assert path.name in r.output, r.output
        assert "speccheck run" in r.output and f"--config {config}" in r.output, r.output


@pytest.mark.parametrize("rel,mutate,config", DAMAGE[:4] + DAMAGE[6:8],
                         ids=[f"{d[0]}-{d[1].__name__}" for d in DAMAGE[:4] + DAMAGE[6:8]])
def test_run_redoes_just_the_damaged_part(store, made_store, rel, mutate, config):
    """`run` no longer reports a damaged run as "already stored": it redoes it (and only it),
    after which the store gates as it did before the damage."""
    mutate(suite_dir(store) / rel)
    r = invoke("run", "--store", str(store), *RUN)
    assert r.exit_code == 0, r.output
    redone_runs = 1 if rel.startswith("runs/") else 0
    assert f"{2 - redone_runs} already stored, {redone_runs} to run" in r.output, r.output
    assert invoke("gate", "--store", str(store), *LOOSE).exit_code == made_store[1]


def test_truncated_inputs_are_noticed_and_tokenised_again(store):
    inputs = suite_dir(store) / "inputs.npz"
    good = inputs.read_bytes()
    _truncate(inputs)
    r = invoke("run", "--store", str(store), *RUN)
    assert r.exit_code == 0 and "2 already stored, 0 to run" in r.output, r.output
    assert inputs.read_bytes() == good


def test_a_store_without_checksums_is_damage(store):
    """A missing checksum is damage, never "unknown": a store without the manifests' file lists
    and the sidecars (as a speccheck from before checksums wrote it) is exit 2 naming what is
    missing, for the gate and for `run` alike, and nothing in it is touched."""
    for m in suite_dir(store).rglob("manifest.json"):
        data = json.loads(m.read_text())
        data.pop("files")
        m.write_text(json.dumps(data))
    for side in store.rglob("*.sha256"):
        side.unlink()
    before = snapshot(store)
    for command in (["gate", *LOOSE], ["run", *RUN]):
        r = invoke(*command, "--store", str(store))
        assert_clean(r, 2)
        assert ".sha256: missing" in r.output and "a missing checksum is damage" in r.output, r.output
    assert snapshot(store) == before


def test_every_stored_file_is_listed_or_has_a_sum(store):
    from speccheck.store import file_sum

    sd = suite_dir(store)
    for run in sd.glob("runs/*/r*"):
        files = json.loads((run / "manifest.json").read_text())["files"]
        assert files == {"arrays.npz": file_sum(run / "arrays.npz")}
    for p in [sd / "inputs.npz", sd / "suite.json", sd / "plan.json", store / "LATEST", *sd.glob("rescore/*.npz"),
              *sd.glob("runs/*/*/manifest.json")]:
        assert json.loads(p.with_name(p.name + ".sha256").read_text()) == file_sum(p)


def test_resume_with_nothing_to_do_writes_nothing(store):
    before = snapshot(store)
    r = invoke("run", "--store", str(store), *RUN)
    assert "0 to run" in r.output
    assert snapshot(store) == before


def test_files_are_shared_as_the_umask_says(store, tmp_path):
    old = os.umask(0o022)
    try:
        st = tmp_path / "fresh"
        from speccheck.store import Store

        s = Store(st).suite("s1", {"engine": "reference", "corpus": "smoke", "corpus_hash": "x"})
        s.write_inputs({"a": [1, 2]})
    finally:
        os.umask(old)
    for p in [s.root / "inputs.npz", s.root / "suite.json"]:
        assert p.stat().st_mode & 0o777 == 0o644, oct(p.stat().st_mode)
    for p in suite_dir(store).rglob("*"):
        assert p.stat().st_mode & 0o044, p  # group/others can read what `run` stored


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600)])
def test_exported_checkpoint_is_shared_as_the_umask_says(tmp_path, umask, mode):
    """export-reference's files (safetensors included, which safetensors itself writes 0600)
    can be read by a vLLM container running as another user unless the umask says no."""
    old = os.umask(umask)
    try:
        r = invoke("export-reference", str(tmp_path / "ckpt"))
    finally:
        os.umask(old)
    assert r.exit_code == 0, r.output
    files = [p for p in (tmp_path / "ckpt").rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files)
    assert {str(p): oct(p.stat().st_mode & 0o777) for p in files} == {str(p): oct(mode) for p in files}


@pytest.mark.parametrize("store_arg,needle", [
    ("/proc/speccheck-store", "/proc/speccheck-store"),
    ("/dev/full/store", "/dev/full"),
])
def test_unusable_store_path_is_exit_2(store_arg, needle):
    r = invoke("run", "--store", store_arg, *RUN)
    assert_clean(r, 2)
    assert needle in r.output


def test_store_that_is_a_file_is_exit_2(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    for cmd in (["run", *RUN], ["gate"]):
        r = invoke(*cmd, "--store", str(f))
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output


def test_lock_is_exclusive_and_released_when_the_holder_dies(tmp_path):
    """The holder's pid is in the lock; a second writer refuses (wait=False) naming it; a
    holder killed with -9 leaves no stale lock."""
    from speccheck.store import Store, StoreError

    st = Store(tmp_path / "st")
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sys,time; from speccheck.store import Store\n"
                               f"with Store({str(st.root)!r}).lock():\n print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(StoreError, match=f"pid {holder.pid}"):
        with st.lock(wait=False):
            pass
    holder.kill()
    holder.wait()
    with st.lock(wait=False):
        assert (st.root / "lock").read_text().strip() == str(os.getpid())


@pytest.mark.slow
def test_two_concurrent_runs_on_one_store(tmp_path):
    """Two real `speccheck run` processes on one store at once: both exit 0, the second waits
    and finds the work done, the store gates, and no temp file or directory is left."""
    st = str(tmp_path / "st")
    cmd = [sys.executable, "-m", "speccheck.cli", "run", "--store", st, *RUN]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sum("0 to run" in o + e for o, e in outs) == 1, outs
    assert invoke("gate", "--store", st, "--set", "require_deterministic=false").exit_code == 0
    litter = [p for p in Path(st).rglob("*") if p.name.startswith(".") or ".tmp" in p.name or ".old" in p.name]
    assert litter == []


def test_write_run_race_in_one_process_leaves_no_litter(tmp_path):
    """Many threads writing the same run (what the lock prevents between processes) never
    fail with 'Directory not empty' and leave one intact run and no temp directories."""
    from concurrent.futures import ThreadPoolExecutor

    from speccheck.store import Store
    from speccheck.types import Completion, RunRecord, SpecConfig

    s = Store(tmp_path / "st").suite("s1", {"engine": "reference", "corpus": "smoke", "corpus_hash": "x"})
    rec = RunRecord(SpecConfig("mtp", 3), {}, "smoke", "x", 0, False, completions=[
        Completion("p", [1, 2], [3, 4], [-0.1, -0.2], np.zeros((2, 2)), np.zeros((2, 2)), text="ab")])
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: s.write_run(rec), range(60)))
    assert s.is_complete("mtp-k3", 0) and s.load_run("mtp-k3", 0).completions[0].text == "ab"
    assert [p.name for p in s.run_dir("mtp-k3", 0).parent.iterdir()] == ["r0"]


def test_fresh_process_worker_stops_when_its_parent_dies(tmp_path):
    """The worker's parent watch: a child started with a parent pid that is already gone
    exits (code 3) within a second instead of running on."""
    code = ("import time; from speccheck.executors.local import _exit_with_parent\n"
            "import os; _exit_with_parent(os.getppid() + 10**6)\ntime.sleep(30)")
    proc = subprocess.run([sys.executable, "-c", code], timeout=20)
    assert proc.returncode == 3


# --- 3. validated inputs, early ----------------------------------------------------------------

@pytest.mark.parametrize("setting,needle", [
    ("min_token_agreement=5.0", "(0, 1]"),
    ("min_token_agreement=-0.1", "(0, 1]"),
    ("min_text_similarity=nan", "finite"),
    ("max_high_confidence=-1", ">= 0"),
    ("max_high_confidence=2.5", "whole number"),
    ("tie_floor=nan", "finite"),
    ("tie_floor=-0.02", ">= 0"),
    ("tie_noise_multiple=-4", ">= 0"),
    ("low_noise_multiple=inf", "finite"),
    ("tie_floor=0.5", "must not exceed low_floor"),
    ("min_speedup=fast", "> 0 or false"),
    ("require_deterministic=maybe", "true or false"),
    ("max_acceptance_drop=5", "[0, 1]"),
])
def test_policy_values_are_range_checked(store, setting, needle):
    r = invoke("gate", "--store", str(store), "--set", setting)
    assert_clean(r, 2)
    assert setting.split("=")[0] in r.output and needle in r.output, r.output


@pytest.mark.parametrize("toml,needle", [
    ("require_deterministic = 1", "true or false"),
    ("require_deterministic = 0", "never with 0"),
    ("agreement_alpha = 0", "above 0"),
    ("max_high_confidence = true", "boolean"),
    ("min_token_agreement = 99.5", "a fraction"),
    ("tie_floor = nan", "finite"),
])
def test_policy_file_values_are_range_checked(store, tmp_path, toml, needle):
    f = tmp_path / "policy.toml"
    f.write_text(toml + "\n")
    r = invoke("gate", "--store", str(store), "--policy", str(f))
    assert_clean(r, 2)
    assert str(f) in r.output and needle in r.output


def test_prompt_longer_than_the_model_is_refused_before_any_run(tmp_path):
    corpus = tmp_path / "long.jsonl"
    corpus.write_text(json.dumps({"id": "long", "category": "x", "max_tokens": 8000,
                                  "text": "the cat sat on the mat " * 100}) + "\n")
    r = invoke("run", "--store", str(tmp_path / "st"), "--corpus", str(corpus), "--config", "mtp-k2")
    assert_clean(r, 2)
    assert "long.jsonl" in r.output and "'long'" in r.output and "8192" in r.output
    assert not (tmp_path / "st" / "suites").exists()


def test_bad_engine_args_leave_no_suite_directory(tmp_path):
    r = invoke("run", "--store", str(tmp_path / "st"), "--engine-arg", "nonsense=1", *RUN)
    assert_clean(r, 2)
    assert "nonsense" in r.output
    assert not (tmp_path / "st" / "suites").exists()


@pytest.mark.parametrize("args,needle", [
    (["--corpus", "DIR"], "is a directory"),
    (["--corpus", "DIR/typo.jsonl"], "does not exist"),
    (["--corpus", "nonesuch"], "unknown corpus"),
    (["--engine", "tgi"], "unknown engine 'tgi'"),
    (["--method", "mtp", "--k", "1-x"], "--k '1-x'"),
    (["--config", "mtp-kk"], "--config 'mtp-kk'"),
    (["--engine-arg", "novalue"], "--engine-arg"),
    pytest.param(["--engine", "vllm", "--model", str(Path(__file__).parents[1] / "speccheck" /
                                                     "reference" / "weights")], "cannot import it",
                 marks=pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is not None,
                                          reason="vLLM is importable here"), id="vllm-not-installed"),
])
def test_cheap_errors_come_before_torch_loads(tmp_path, args, needle):
    args = [a.replace("DIR", str(tmp_path)) for a in args]
    code = ("import sys, speccheck.cli\n"
            f"sys.argv = ['speccheck', 'run', '--store', {str(tmp_path / 'st')!r}, *{args!r}]\n"
            "try:\n    speccheck.cli.main()\nexcept SystemExit as e:\n"
            "    print('EXIT', e.code, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "EXIT 2 False" in r.stdout, (r.stdout, r.stderr)
    assert needle in r.stderr + r.stdout and "Traceback" not in r.stderr
    assert not (tmp_path / "st").exists()


def test_unknown_method_in_config_blames_the_config(tmp_path):
    r = invoke("run", "--store", str(tmp_path / "st"), "--config", "turbo-k3")
    assert_clean(r, 2)
    assert "--config 'turbo-k3'" in r.output and "--method" not in r.output


def test_corpus_with_a_byte_order_mark_loads(tmp_path):
    from speccheck.corpus import load_corpus

    line = json.dumps({"id": "a", "category": "x", "max_tokens": 4, "text": "hello"})
    plain, bom = tmp_path / "plain.jsonl", tmp_path / "bom.jsonl"
    plain.write_text(line + "\n")
    bom.write_bytes(b"\xef\xbb\xbf" + (line + "\n").encode())
    assert load_corpus(bom).hash == load_corpus(plain).hash


# --- 4. golden safety ------------------------------------------------------------------------

PASSING = ["--set", "require_deterministic=false"]  # one repeat: nothing to compare determinism with


def test_golden_record_refuses_a_failing_suite(store, tmp_path):
    gold = tmp_path / "golden"
    r = invoke("golden", "record", "--store", str(store), "--golden", str(gold))  # 1 repeat: gate fails
    assert_clean(r, 2)
    assert "fails the gate" in r.output and not gold.exists()


def reseal(path: Path) -> None:
    """A changed file given the checksum its writer would have given it (a golden recorded
    otherwise, not a damaged one)."""
    from speccheck.store import file_sum

    path.with_name(path.name + ".sha256").write_text(json.dumps(file_sum(path)))


def test_golden_record_refuses_to_overwrite_without_force(store, tmp_path):
    from speccheck.store import file_sum

    gold = tmp_path / "golden"
    assert invoke("golden", "record", "--store", str(store), "--golden", str(gold), *PASSING).exit_code == 0
    gjson = next(gold.rglob("golden.json"))
    before = gjson.read_bytes()
    # tamper with the recorded golden's tokens so that recording would change something
    base_dir = gjson.parent / "baseline"
    a = dict(np.load(base_dir / "arrays.npz"))
    a["token_ids"] = a["token_ids"].copy()
    a["token_ids"][0] += 1
    np.savez(base_dir / "arrays.npz", **a)
    m = json.loads((base_dir / "manifest.json").read_text())
    m["files"]["arrays.npz"] = file_sum(base_dir / "arrays.npz")
    (base_dir / "manifest.json").write_text(json.dumps(m))
    reseal(base_dir / "manifest.json")
    r = invoke("golden", "record", "--store", str(store), "--golden", str(gold), *PASSING)
    assert_clean(r, 2)
    assert "--force" in r.output and "would change 1 of 4" in r.output, r.output
    assert gjson.read_bytes() == before
    r = invoke("golden", "record", "--store", str(store), "--golden", str(gold), *PASSING, "--force")
    assert r.exit_code == 0, r.output


def test_golden_record_force_judges_the_suite_without_the_golden_it_replaces(store, tmp_path):
    """After an intended change of numerics the suite drifts from the old golden's logprob
    noise: the gate against that golden fails, and --force still records the new one."""
    gold = tmp_path / "golden"
    assert invoke("golden", "record", "--store", str(store), "--golden", str(gold), *PASSING).exit_code == 0
    noise = next(gold.rglob("noise.npz"))
    np.savez(noise, **{k: v * 0.01 for k, v in np.load(noise).items()})  # a far quieter golden
    reseal(noise)
    r = invoke("gate", "--store", str(store), "--golden", str(gold), *PASSING)
    assert r.exit_code == 1 and "drifted from the golden" in r.output, r.output
    r = invoke("golden", "record", "--store", str(store), "--golden", str(gold), *PASSING, "--force")
    assert r.exit_code == 0, r.output
    assert invoke("gate", "--store", str(store), "--golden", str(gold), *PASSING).exit_code == 0


def test_golden_key_includes_engine_args_and_numerics_are_checked(store, tmp_path):
    """A golden recorded with engine args lands in its own directory; a golden whose recorded
    numerics (dtype) differ from today's is refused with exit 2."""
    from speccheck.golden import golden_dir

    meta = {"engine": "reference", "corpus": "smoke", "engine_args": {"fault": "stale-state", "dtype": "fp32"}}
    plain = golden_dir(tmp_path, {"engine": "reference", "model_id": "m"}, {**meta, "engine_args": {}})
    faulty = golden_dir(tmp_path, {"engine": "reference", "model_id": "m"}, meta)
    assert plain != faulty and "fault_stale-state" in faulty.name
    # memory sizing is not numerics: a vLLM golden is found whatever share of the GPU it had
    vllm = {"engine": "vllm", "corpus": "smoke", "engine_args": {"attention_backend": "TRITON_ATTN"}}
    roomy = {**vllm, "engine_args": {**vllm["engine_args"], "gpu_memory_utilization": "0.2",
                                     "kv_cache_memory_bytes": "4000000000", "worker": "per-config"}}
    ident = {"engine": "vllm", "model_id": "m"}
    assert golden_dir(tmp_path, ident, roomy) == golden_dir(tmp_path, ident, vllm)
    assert "TRITON_ATTN" in golden_dir(tmp_path, ident, vllm).name
    # many settings: a short stable label (their hash), whatever order they were given in
    many = {"engine": "vllm", "corpus": "smoke", "engine_args": {f"env.VLLM_SETTING_{i}": "1" for i in range(6)}}
    shuffled = {**many, "engine_args": dict(reversed(list(many["engine_args"].items())))}
    label = golden_dir(tmp_path, ident, many).name
    assert label.startswith("smoke_settings-") and len(label) < 40
    assert golden_dir(tmp_path, ident, shuffled).name == label
    assert label != golden_dir(tmp_path, ident, {**many, "engine_args": {"env.VLLM_SETTING_0": "2"}}).name
    gold = tmp_path / "golden"
    assert invoke("golden", "record", "--store", str(store), "--golden", str(gold), *PASSING).exit_code == 0
    gjson = next(gold.rglob("golden.json"))
    g = json.loads(gjson.read_text())
    assert g["numerics"]["dtype"] == "bf16" and g["engine_settings"] == {}  # the settings it was recorded under
    g["numerics"]["dtype"] = "fp32"
    gjson.write_text(json.dumps(g))
    reseal(gjson)
    r = invoke("golden", "check", "--store", str(store), "--golden", str(gold))
    assert_clean(r, 2)
    assert "dtype: fp32 -> bf16" in r.output


def test_golden_check_explains_near_tie_differences_from_the_platform():
    """GoldenCheck.why() over a comparison with near-ties only (a test double of Comparison)."""
    from types import SimpleNamespace

    from speccheck.golden import GoldenCheck

    cmp = SimpleNamespace(divergences=[object()], high=[], passed=True)
    chk = GoldenCheck(Path("g"), cmp, {}, ("cpu_capability: AVX512 -> AVX2", "torch: 2.12 -> 2.13"))
    assert "cpu_capability: AVX512 -> AVX2" in chk.why() and "near-ties" in chk.why()
    assert GoldenCheck(Path("g"), SimpleNamespace(divergences=[], high=[], passed=True), {}).why() is None
    assert GoldenCheck(Path("g"), SimpleNamespace(divergences=[1], high=[1], passed=False), {}, ("x",)).why() is None


# --- 5. conventions -----------------------------------------------------------------------------

@pytest.mark.parametrize("given,root", [
    ("http://h:8000/v1", "http://h:8000"), ("http://h:8000/v1/", "http://h:8000"),
    ("http://h:8000", "http://h:8000"), ("https://h/api/v1", "https://h/api"),
])
def test_base_url_with_or_without_v1(given, root):
    from speccheck.engines.openai import OpenAIEngine, server_root

    assert server_root(given) == root
    assert OpenAIEngine(engine_args={"base_url": given}).base_url == root


def test_openai_base_url_environment_is_honoured(monkeypatch):
    from speccheck.engines.openai import OpenAIEngine

    monkeypatch.setenv("OPENAI_BASE_URL", "http://envhost:9000/v1")
    assert OpenAIEngine().base_url == "http://envhost:9000"
    assert OpenAIEngine(engine_args={"base_url": "http://given:1"}).base_url == "http://given:1"


def test_byte_tokens_are_shown_as_hex_bytes():
    from speccheck.api import bytes_shown
    from speccheck.engines import make_engine

    e = make_engine("reference")
    detok = bytes_shown(e.detokenize, e.token_bytes)
    partial = [t for t in range(e.tokenizer.get_vocab_size()) if "\ufffd" in e.detokenize([t])]
    assert partial  # a byte-level vocabulary has tokens that hold part of a character
    for t in partial:
        shown = detok([t])
        assert "\ufffd" not in shown and "<0x" in shown, (t, shown)
        hexes = re.findall(r"<0x([0-9A-F]{2})>", shown)
        assert bytes.fromhex("".join(hexes)) in e.token_bytes(t)
    ids = e.tokenizer.encode("日本語の文章 text").ids
    assert detok(ids) == e.detokenize(ids)  # whole characters stay text


def test_every_option_has_help_and_engine_args_are_listed():
    import click

    missing = []

    def walk(cmd, path):
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                walk(sub, path + [name])
            return
        missing.extend(f"{' '.join(path)} --{p.name}" for p in cmd.params
                       if isinstance(p, click.Option) and not p.help)

    walk(main, [])
    assert missing == []


def test_serve_help_names_the_reference_engine_s_keys_only():
    from speccheck.reference.engine import ENGINE_ARGS

    text = "".join(invoke("serve", "--help").output.split())
    assert all(key in text for key in ENGINE_ARGS) and "score_base_url" not in text


@pytest.mark.parametrize("command", [["run"], ["sweep", "--method", "mtp"]])
def test_engine_arg_help_names_every_key_each_engine_takes(command):
    """Every key the engines accept is named in --engine-arg's help (and the pytest plugin's
    --spec-engine-arg), from the engines' own lists, so the two cannot drift apart; and the
    help does not offer a key an engine refuses (vllm's speculative_config)."""
    from speccheck.engines.openai import ARGS as OPENAI_ARGS
    from speccheck.reference.engine import ENGINE_ARGS
    from speccheck.engines.vllm import OWN_OPTIONS

    text = "".join(invoke(*command, "--help").output.split())
    keys = [*ENGINE_ARGS, *OWN_OPTIONS, "env.NAME", "sampling.NAME", "spec.NAME",
            *(k for k, doc in OPENAI_ARGS.items() if not doc.startswith("ignored"))]
    for key in keys:
        assert key in text, key
    assert "speculative_configasJSON" not in text
    plugin = subprocess.run([sys.executable, "-m", "pytest", "--help", "-p", "no:randomly"],
                            capture_output=True, text=True, timeout=120).stdout
    plugin = "".join(plugin.split())
    assert all(key in plugin for key in keys), [k for k in keys if k not in plugin]


def test_diff_k_without_method_is_an_error(store):
    r = invoke("diff", "--store", str(store), "--k", "3")
    assert_clean(r, 2)
    assert "--method" in r.output


@pytest.mark.slow
def test_diff_run_honours_corpus_and_keeps_latest(store):
    latest = (store / "LATEST").read_text()
    r = invoke("diff", "--store", str(store), "--run", "--corpus", "smoke", "--config", "mtp-k2", "--json")
    assert r.exit_code == 0, r.output
    assert (store / "LATEST").read_text() == latest
    r = invoke("diff", "--store", str(store), "--corpus", "smoke")
    assert_clean(r, 2)


def test_best_config_is_never_slower_than_the_baseline():
    """best_configs over hand-made results (test doubles of ConfigResult): a passing config
    at 0.85x the baseline is not crowned; one at 1.4x is."""
    from types import SimpleNamespace

    from speccheck.report import best_configs

    def cfg(name, tok_s, speedup):
        return SimpleNamespace(config=name, verdict="pass", speed=SimpleNamespace(warm_tok_s=tok_s, speedup=speedup))

    slow = SimpleNamespace(configs=[cfg("baseline", 100, None), cfg("dflash-k1", 85, 0.85)])
    assert best_configs(slow) == {}
    fast = SimpleNamespace(configs=[cfg("baseline", 100, None), cfg("dflash-k1", 85, 0.85), cfg("dflash-k7", 140, 1.4)])
    assert best_configs(fast) == {"dflash": "dflash-k7"}


def test_server_repeats_are_not_called_fresh_processes():
    from speccheck.runner import _summary_line
    from speccheck.types import RunRecord, SpecConfig

    rec = RunRecord(SpecConfig(), {"engine": "openai", "base_url": "http://h"}, "smoke", "x", 1, True)
    assert "same server" in _summary_line(rec) and "[fresh process]" not in _summary_line(rec)
    assert rec.fresh_note == "new client, same server"  # diff's nondeterminism lines use it too
    rec.identity = {"engine": "reference"}
    assert "[fresh process]" in _summary_line(rec) and rec.fresh_note == "fresh process"
    rec.fresh_process = False
    assert rec.fresh_note == "" and "[" not in _summary_line(rec)


def test_the_run_all_at_once_is_never_called_r_minus_1():
    from speccheck.runner import _summary_line
    from speccheck.types import RunRecord, SpecConfig

    rec = RunRecord(SpecConfig(), {"engine": "vllm"}, "smoke", "x", -1, True, status="failed",
                    error="EngineError: vLLM worker died", copies=2)
    assert rec.label == "all at once" and "r-1" not in _summary_line(rec)
    assert "baseline all at once  FAILED  EngineError: vLLM worker died" in _summary_line(rec)


def test_kernels_gdn_unknown_device_is_exit_2():
    r = invoke("kernels", "gdn", "--device", "tpu", "--positions", "8")
    assert_clean(r, 2) if "error:" in r.output else None
    assert r.exit_code == 2 and "--device" in r.output and "Traceback" not in r.output


# --- 6. doctor ---------------------------------------------------------------------------------

def test_doctor_on_this_machine_says_what_it_cannot_check(tmp_path):
    """Here (CPU only, no vLLM): every finding has a status; the GPU and vLLM's backend choice
    are reported as not checkable rather than guessed; a checkpoint is sized."""
    out = tmp_path / "ckpt"
    assert invoke("export-reference", str(out)).exit_code == 0
    r = invoke("doctor", "--engine", "vllm", "--model", str(out), "--k", "7")
    assert r.exit_code in (0, 1) and "Traceback" not in r.output
    text = r.output
    for topic in ("python", "torch", "WSL2", "vLLM", "GDN kernels", "attention backend", "model:"):
        assert topic in text, text
    import torch

    if not torch.cuda.is_available():
        assert "can't check" in text and "no CUDA device" in text
    assert "2 attention + 6 GDN layers" in text and "8192 positions" in text


@pytest.mark.slow
def test_doctor_and_run_against_speccheck_serve_with_v1_url(tmp_path):
    """A real `speccheck serve` (reference engine behind vLLM's endpoints): doctor finds it
    through a /v1 URL, and `speccheck run --engine openai --base-url .../v1` works."""
    from speccheck.serve import running_server

    with running_server("baseline", 0, served_model="ref") as url:
        r = invoke("doctor", "--base-url", url + "/v1")
        assert "Traceback" not in r.output
        assert "serves ref" in r.output and "server version" in r.output, r.output
        st = tmp_path / "st"
        r = invoke("run", "--engine", "openai", "--base-url", url + "/v1", "--method", "baseline",
                   "--store", str(st), "--corpus", "smoke", "--repeats", "1", "--concurrent", "off",
                   "--no-attribution", "--axes", "none")
        assert r.exit_code == 0, r.output
        assert "4 prompts" in r.output
    r = invoke("doctor", "--base-url", url + "/v1")  # the server is gone now
    assert r.exit_code == 1 and "start the server" in r.output and "Traceback" not in r.output


# --- 8. fuzz: damaged stores and hostile arguments never crash -----------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

MUTATIONS = ("truncate", "flip", "delete", "duplicate", "empty")


def _mutate(root: Path, data) -> str:
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != "lock")
    target = data.draw(st.sampled_from(files), label="file")
    how = data.draw(st.sampled_from(MUTATIONS), label="mutation")
    raw = target.read_bytes()
    if how == "truncate":
        target.write_bytes(raw[: data.draw(st.integers(0, max(len(raw) - 1, 0)), label="keep")])
    elif how == "flip" and raw:
        i = data.draw(st.integers(0, len(raw) - 1), label="byte")
        b = bytearray(raw)
        b[i] ^= data.draw(st.integers(1, 255), label="mask")
        target.write_bytes(bytes(b))
    elif how == "delete":
        target.unlink()
    elif how == "duplicate":  # another stored file of the same name written over this one
        same = [p for p in files if p.name == target.name and p != target]
        if same:
            shutil.copyfile(data.draw(st.sampled_from(same), label="source"), target)
    elif how == "empty":
        target.write_bytes(b"")
    return f"{how} {target.relative_to(root)}"


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 30)), deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzz_damaged_stores_never_crash(made_store, tmp_path_factory, data):
    root = tmp_path_factory.mktemp("fuzz") / "st"
    shutil.copytree(made_store[0], root)
    what = _mutate(root, data)
    command = data.draw(st.sampled_from([["gate"], ["diff", "--json"], ["report"], ["golden", "check"]]),
                        label="command")
    r = invoke(*command, "--store", str(root))
    assert r.exit_code in (0, 1, 2, 3), (what, command, r.output)
    assert "Traceback" not in r.output, (what, r.output)


TOKENS = ["--store", "STORE", "--suite", "nope", "--suite", "", "--set", "min_token_agreement=2",
          "--set", "=", "--set", "tie_floor=1e309", "--policy", "/dev/null", "--policy", "/nonexistent",
          "--method", "mtp", "--method", "", "--k", "3", "--k", "0-99", "--k", "-1", "--config", "baseline",
          "--config", "mtp-k99", "--config", "x", "--json", "--against", "golden", "--golden", "/proc/x",
          "--junit", "/proc/nope/j.xml", "--out", "/dev/full", "--with-store", "STORE", "--force", "\x00",
          "é", "--k", "1,,3", "--unknown"]


@pytest.mark.parametrize("damage", [("\"configs\"", "\"confihs\""), ("\"baseline\"", "\"caseline\""),
                                    ("\"repeats\": 1", "\"repeats\": \"1\"")])
def test_a_damaged_plan_is_a_damaged_store(made_store, tmp_path, damage):
    """Byte flips the fuzz below found in plan.json: valid JSON, wrong schema (a KeyError and a
    bad config name, each an internal error before)."""
    root = tmp_path / "st"
    shutil.copytree(made_store[0], root)
    plan = next(root.rglob("plan.json"))
    text = plan.read_text()
    assert damage[0] in text
    plan.write_text(text.replace(damage[0], damage[1], 1))
    reseal(plan)  # its sum matches: the schema must catch it
    r = invoke("gate", "--store", str(root))
    assert r.exit_code == 2 and "plan.json" in r.output and "the plan is damaged" in r.output, r.output


@pytest.mark.parametrize("command, option", [(["gate"], "--store"), (["gate"], "--golden"),
                                             (["golden", "check"], "--golden"), (["report"], "--out"),
                                             (["golden", "record"], "--golden")])
def test_a_nul_byte_in_a_path_is_bad_input(made_store, command, option):
    """Python's os functions refuse such a name with ValueError, not OSError (the fuzz below
    drew it once in 40 examples: an internal error, a red CI)."""
    r = invoke(*command, "--store", str(made_store[0]), option, "a\x00b")
    assert r.exit_code == 2 and "NUL byte" in r.output, r.output


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 40)), deadline=None, suppress_health_check=list(HealthCheck))
@given(command=st.sampled_from([["gate"], ["diff"], ["report"], ["golden", "check"], ["golden", "record"],
                                ["compare"], ["corpus", "show"], ["sweep"]]),
       args=st.lists(st.sampled_from(TOKENS), max_size=6))
def test_fuzz_cli_arguments_never_crash(made_store, tmp_path_factory, command, args):
    root = tmp_path_factory.mktemp("fuzzargs") / "st"
    shutil.copytree(made_store[0], root)
    args = [str(root) if a == "STORE" else a for a in args]
    if command == ["sweep"]:
        args += ["--method", "bogus"]  # a sweep that would run is not what this fuzz is for
    r = invoke(*command, *args)
    assert r.exit_code in (0, 1, 2, 3), (command, args, r.output)
    assert "Traceback" not in r.output and "internal error" not in r.output, (command, args, r.output)


# --- 7. progress ---------------------------------------------------------------------------------

def test_kernels_gdn_says_what_it_does_and_how_long_before_it_starts():
    r = invoke("kernels", "gdn", "--device", "cpu", "--positions", "32", "--heads", "1", "--head-dim", "8")
    assert r.exit_code == 0, r.output
    first = r.output.splitlines()[0]
    assert first.startswith("kernels gdn:") and "32 positions" in first and "s on 2 CPU cores" in first


@pytest.mark.slow
def test_pytest_plugin_progress_is_visible_without_s(tmp_path):
    """A real pytest session using the plugin's spec_result fixture (smoke corpus, mtp-k2, one
    repeat), run without -s: the runs, with [done/total], reach the terminal."""
    (tmp_path / "test_one.py").write_text("def test_it(spec_result):\n    assert spec_result\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                        "-n", "0", "test_one.py", "--spec-corpus", "smoke", "--spec-method", "mtp", "--spec-k", "2",
                        "--spec-repeats", "1", "--spec-concurrent", "off", "--spec-store", str(tmp_path / "st")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "speccheck: [0/2] baseline r0" in r.stdout and "speccheck: [2/2] rescoring" in r.stdout, r.stdout


@pytest.mark.slow
def test_rescoring_says_what_it_will_score_and_how_long_is_left(tmp_path):
    """A run whose spec configs diverge (the planted conv-not-rolled-back fault) announces
    the rescoring (outputs, configs, tokens) before it starts, and each later config's share
    with the time left at the pace so far."""
    r = invoke("run", "--store", str(tmp_path / "st"), "--corpus", "smoke", "--config", "mtp-k2",
               "--config", "dflash-k3", "--repeats", "1", "--concurrent", "off", "--no-attribution",
               "--engine-arg", "fault=conv-not-rolled-back")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("rescoring teacher-forced: "))
    m = re.match(r"rescoring teacher-forced: (\d+) output\(s\) of (\d+) config\(s\), (\d+) tokens", lines[start])
    assert m and int(m.group(1)) > 0 and int(m.group(3)) > 0, lines[start]
    done = [i for i, ln in enumerate(lines) if "rescored teacher-forced" in ln]
    assert done and min(done) > start
    assert any(re.match(r"rescoring \S+ \(\d+ output\(s\); about \d+ s left\)", ln) for ln in lines), r.output


def test_compare_a_config_never_run_says_so(store, tmp_path):
    shutil.copytree(store, tmp_path / "other")
    r = invoke("compare", "--store", str(store), "--with-store", str(tmp_path / "other"), "--config", "dflash-k7")
    assert_clean(r, 2)
    assert "holds no complete run" in r.output and "delete" not in r.output
    # a suite compared with itself agrees by construction: refused, not passed
    r = invoke("compare", "--store", str(store), "--with-store", str(store))
    assert_clean(r, 2)
    assert "compared with itself" in r.output


# --- 9. streamed requests that go wrong, and an engine that is not installed ----------------------

STREAM_KEY_ENV = "SPECCHECK_TEST_STREAM_KEY"
OPENAI_RUN = ["--engine", "openai", "--axes", "none", "--method", "baseline", "--corpus", "smoke", "--repeats", "1",
              "--concurrent", "off", "--no-attribution", "--engine-arg", "retries=1",
              "--engine-arg", "backoff=0", "--api-key-env", STREAM_KEY_ENV]
#: (misbehaviour of the stream, exit code by the contract, what the paragraph must say)
STREAM_FAULTS = [
    ("drop", 3, "the stream broke off after 1 event ("),
    ("no_done", 3, "without data: [DONE]"),
    ("garbage", 3, "sent a stream event that is not JSON"),
    ("truncated_json", 3, "sent a stream event that is not JSON"),
    ("error_event", 3, "in the middle of the stream (event 2): Internal server error"),
    ("nan_event", 3, "produced NaN logprobs"),
    ("second_choice", 3, "a choice other than the one asked for"),
    ("list_event", 3, "not a JSON object"),
    ("empty", 3, "carried no tokens"),
    ("bad_types", 3, "is malformed"),
    ("status_401", 2, f"HTTP 401 (Unauthorized): the API key comes from the environment variable "
                      f"{STREAM_KEY_ENV}, which is set but the server rejected its value"),
    ("status_403", 2, "HTTP 403 (Forbidden: this key may not stream)"),
    ("status_400", 2, "rejected /v1/completions (streamed) with HTTP 400: logprobs must be"),
    ("status_404", 2, "answered 404 for /v1/completions (streamed)"),
    ("status_503", 3, "after 2 attempts (last: HTTP 503: engine is sleeping)"),
    ("html_200", 3, "with non-JSON text"),
]


@pytest.fixture(scope="module")
def served_store(tmp_path_factory):
    """A real `speccheck serve` (reference engine, baseline) and a store holding one complete
    run made through it with `speccheck run --engine openai`."""
    from speccheck.serve import running_server

    st = tmp_path_factory.mktemp("served") / "st"
    mp = pytest.MonkeyPatch()
    mp.setenv(STREAM_KEY_ENV, "sk-stream-test")
    with running_server("baseline", served_model="ref") as url:
        r = invoke("run", "--store", str(st), "--base-url", url, *OPENAI_RUN)
        assert r.exit_code == 0 and "baseline r0" in r.output, r.output
        yield url, st
    mp.undo()


@pytest.mark.slow
@pytest.mark.parametrize("behaviour,code,needle", STREAM_FAULTS, ids=[f[0] for f in STREAM_FAULTS])
def test_streams_that_go_wrong_exit_per_contract_and_keep_the_store(served_store, tmp_path,
                                                                     monkeypatch, behaviour, code,
                                                                     needle):
    """`speccheck run --engine openai` through a server whose streamed completions go wrong
    (test double: stream_doubles' proxy in front of the real `speccheck serve`): a refusal
    the user must fix is exit 2, a server fault exit 3 with the run recorded as failed; the
    paragraph says what the server did; no traceback; the run stored before is intact."""
    from tests.stream_doubles import misbehaving_proxy

    url, made = served_store
    st = tmp_path / "st"
    shutil.copytree(made, st)
    before = snapshot(st)
    monkeypatch.setenv(STREAM_KEY_ENV, "sk-stream-test")
    with misbehaving_proxy(url, behaviour) as proxy:
        r = invoke("run", "--store", str(st), "--base-url", f"http://127.0.0.1:{proxy.server_port}",
                   *OPENAI_RUN)
        assert proxy.streamed >= 1
    assert_clean(r, code)
    assert needle in r.output, r.output
    if code == 3:
        assert "FAILED runs: baseline r0" in r.output, r.output
    assert "sk-stream-test" not in r.output
    after = snapshot(st)  # LATEST (and its sum) moves to the new run's suite; every stored file is as it was
    moved = ("LATEST", "LATEST.sha256")
    assert {k: v for k, v in after.items() if k in before and k not in moved} == \
        {k: v for k, v in before.items() if k not in moved}
    assert invoke("gate", "--store", str(st), "--suite", (made / "LATEST").read_text().strip(),
                  "--set", "require_deterministic=false").exit_code == 0


def _fake_interpreter(tmp_path: Path, with_vllm: bool) -> Path:
    """Test double: a 'python' that is this interpreter with a fake (empty) vllm package on
    its path, or with none -- another environment, as --engine-arg python= names one."""
    site = tmp_path / "other-site"
    if with_vllm:
        (site / "vllm").mkdir(parents=True)
        (site / "vllm" / "__init__.py").write_text("__version__ = '0.0-fake'\n")
    exe = tmp_path / "other-python"
    exe.write_text(f"#!/bin/sh\nPYTHONPATH={site}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} \"$@\"\n")
    exe.chmod(0o755)
    return exe


NO_VLLM_HERE = pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is not None,
                                  reason="vLLM is importable here")


@pytest.mark.parametrize("python,needles", [
    pytest.param(None, ["this Python", "cannot import it", "pip install vllm==0.26.0",
                        "--engine-arg python="], marks=NO_VLLM_HERE, id="no-vllm-here"),
    pytest.param("/nonexistent/bin/python3", ["python=/nonexistent/bin/python3",
                                              "no executable there"], id="no-such-interpreter"),
    pytest.param("DIR", ["no executable there"], id="a-directory"),
    pytest.param("/bin/false", ["/bin/false", "cannot import vLLM", "-m pip install vllm==0.26.0"],
                 id="not-a-python"),
    pytest.param("OTHER-WITHOUT", ["other-python", "cannot import vLLM",
                                   "ModuleNotFoundError: No module named 'vllm'"],
                 id="other-python-without-vllm"),
])
def test_vllm_engine_without_vllm_fails_at_once(tmp_path, python, needles):
    """`--engine vllm` where the worker's interpreter cannot import vLLM: exit 2 (bad input:
    the setup, found before anything runs -- 3 is for runs that crashed), one paragraph, the
    store untouched (not even created)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    args = []
    if python == "DIR":
        args = ["--engine-arg", f"python={tmp_path}"]
    elif python == "OTHER-WITHOUT":
        args = ["--engine-arg", f"python={_fake_interpreter(tmp_path, with_vllm=False)}"]
    elif python:
        args = ["--engine-arg", f"python={python}"]
    r = invoke("run", "--engine", "vllm", "--model", str(ckpt), "--store", str(tmp_path / "st"),
               "--corpus", "smoke", "--method", "mtp", "--k", "3", *args)
    assert_clean(r, 2)
    for needle in needles:
        assert needle in r.output, r.output
    assert not (tmp_path / "st").exists()


def test_vllm_check_is_made_against_the_named_interpreter(tmp_path):
    """With --engine-arg python=PATH the check runs PATH, not this Python: an interpreter
    that has vllm (test double: an empty fake vllm package on its path) passes it where this
    Python has none, and the run goes on to start workers there (which then fail, the fake
    having no LLM: exit 3, each run recorded as failed)."""
    from speccheck.engines.vllm import vllm_import_problem

    other = _fake_interpreter(tmp_path, with_vllm=True)
    assert vllm_import_problem(str(other), {}) is None
    if __import__("importlib").util.find_spec("vllm") is None:
        assert "No module named 'vllm'" in vllm_import_problem(None, {})
    ckpt = Path(__file__).parents[1] / "speccheck" / "reference" / "weights"  # config + tokenizer
    r = invoke("run", "--engine", "vllm", "--model", str(ckpt), "--store", str(tmp_path / "st"),
               "--corpus", "smoke", "--method", "mtp", "--k", "3", "--repeats", "1",
               "--concurrent", "off", "--no-attribution", "--axes", "none", "--engine-arg", f"python={other}")
    assert r.exit_code == 3 and "cannot import vLLM" not in r.output, r.output
    assert "FAILED runs: baseline r0, mtp-k3 r0" in r.output and "Traceback" not in r.output
    assert "other-site/vllm" in r.output  # the workers ran there, and found the fake's vllm
