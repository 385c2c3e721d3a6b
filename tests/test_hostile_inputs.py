"""Every hostile input answered: one clear paragraph naming the file, line or option and what
to do, the exit code of the contract (2 bad input, 3 engine failure), no traceback, no hang,
and nothing already stored lost.

The catalogue is a table, one row per hostile input: how it is made, the command, the exit
code and a phrase the paragraph must contain. A small real store (reference engine, smoke
corpus, baseline + mtp-k2, two repeats and the corpus all at once: it passes the gate) is made
once per module; every row damages a copy of its own and runs the command in this process
under an alarm, so a hang fails the row instead of the suite. Servers that misbehave are test
doubles (:class:`HostileServer`, a raw socket server that says what it does wrong); `speccheck
serve`'s answers to malformed requests are a second table, against the real server."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from click.testing import CliRunner

from speccheck.cli import main

RUN = ["--corpus", "smoke", "--config", "mtp-k2", "--repeats", "2", "--concurrent", "2", "--no-attribution",
       "--axes", "none"]
#: a row that takes longer than this hangs (the issue's bar is 60 s)
ROW_LIMIT_S = 50


@pytest.fixture(scope="module")
def made_store(tmp_path_factory):
    st = tmp_path_factory.mktemp("made") / "st"
    r = CliRunner().invoke(main, ["run", "--store", str(st), *RUN])
    assert r.exit_code == 0, r.output
    assert CliRunner().invoke(main, ["gate", "--store", str(st)]).exit_code == 0  # a store that passes
    return st


@dataclass
class Ctx:
    """One row's scratch space: a copy of the made store, a folder for its files (the current
    directory while the command runs), and the URL of a hostile server where the row has one."""

    tmp: Path
    store: Path
    url: str = ""
    #: stored files a row may change on purpose (LATEST moves when a command runs a new suite)
    moves: set = field(default_factory=set)

    @property
    def suite(self) -> Path:
        return self.store / "suites" / (self.store / "LATEST").read_text().strip()

    def file(self, rel: str) -> Path:
        return self.suite / rel


def resum(path: Path) -> None:
    """Rewrite a file's checksum to match its (damaged) content: damage that its sum does not
    catch, so what reads it must check what it holds."""
    from speccheck.store import file_sum

    path.with_name(path.name + ".sha256").write_text(json.dumps(file_sum(path)))


def edit_json(path: Path, change: Callable[[dict], object], keep_sum: bool = False) -> None:
    """``change`` the JSON file's data in place (``keep_sum``: and re-sum it)."""
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    if keep_sum:
        resum(path)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def replace_with_symlink(path: Path, target: Path) -> None:
    path.unlink()
    path.symlink_to(target)


def snapshot(st: Path) -> dict[str, bytes]:
    """Every regular file of a store and its bytes (FIFOs and links planted by a row are not
    content; the lock file is the holder's pid)."""
    return {str(p.relative_to(st)): p.read_bytes() for p in sorted(st.rglob("*"))
            if p.is_file() and not p.is_symlink() and p.name != "lock"}


# --- the hostile server (a test double) ------------------------------------------------------

def _canned_stream(n: int = 3, lp: float = -0.1) -> list[dict]:
    """A valid streamed completion of ``n`` tokens for a baseline server (top-5 per position)."""
    return [{"choices": [{"index": 0, "text": "x", "token_ids": [5 + i], "finish_reason": None,
                          "logprobs": {"tokens": [f"token_id:{5 + i}"], "token_logprobs": [lp],
                                       "top_logprobs": [{f"token_id:{5 + i}": lp,
                                                         **{f"token_id:{50 + j}": -3.0 - j for j in range(4)}}]}}]}
            for i in range(n)]


class HostileServer:
    """Test double: an HTTP server on a raw socket that misbehaves in one named way; every
    other answer is a canned, valid one of a baseline OpenAI-compatible server (one model
    ``m``, /version absent as on some servers, empty /metrics, /tokenize by characters).

    ``behaviour`` is ``<path key>_<how>``: models_hang (accepts, never answers), models_close
    (closes at once), models_garbage (bytes that are not HTTP), models_list (200 with a JSON
    list), models_html (200 with an HTML page), models_500, models_drip (a byte at a time,
    slower than the deadline allows), models_partial (promises 1000 bytes, sends 20, closes),
    metrics_text (a /metrics page that is not Prometheus text), tokenize_list (a JSON list),
    completion_nan (NaN logprobs), completion_short (fewer logprobs than tokens),
    completion_hang, completion_drip (a stream that never ends a line), completion_ctype
    (an SSE body sent as text/plain), completion_500."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        for c in self._conns:
            with contextlib.suppress(OSError):
                c.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _request(conn: socket.socket) -> tuple[str, bytes] | None:
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        length = next((int(v) for k, _, v in (ln.partition(":") for ln in lines[1:])
                       if k.strip().lower() == "content-length"), 0)
        while len(body) < length:
            body += conn.recv(65536)
        return lines[0].split()[1].split("?")[0], body

    @staticmethod
    def _answer(conn, status: int, body: bytes, ctype: str = "application/json") -> None:
        conn.sendall(f"HTTP/1.1 {status} X\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                     f"\r\n".encode() + body)

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            while (req := self._request(conn)) is not None:
                path, body = req
                key = {"/v1/models": "models", "/v1/completions": "completion", "/metrics": "metrics",
                       "/tokenize": "tokenize"}.get(path)
                how = self.behaviour.split("_", 1)[1] if key and self.behaviour.startswith(key) else None
                if how is None:
                    self._valid(conn, path, body)
                elif not self._misbehave(conn, how):
                    return

    def _valid(self, conn, path: str, body: bytes) -> None:
        if path == "/v1/models":
            self._answer(conn, 200, json.dumps({"data": [{"id": "m", "max_model_len": 8192}]}).encode())
        elif path == "/tokenize":
            text = json.loads(body).get("prompt") or "x"
            self._answer(conn, 200, json.dumps({"tokens": [1 + (ord(c) % 100) for c in text[:50]]}).encode())
        elif path == "/metrics":
            self._answer(conn, 200, b"", "text/plain")
        elif path == "/v1/completions":
            events = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in _canned_stream())
            self._answer(conn, 200, events + b"data: [DONE]\n\n", "text/event-stream")
        else:
            self._answer(conn, 404, b'{"detail": "Not Found"}')

    def _misbehave(self, conn: socket.socket, how: str) -> bool:
        """Answer one request wrongly; False: the connection is done with."""
        if how == "hang":
            self._stop.wait(120)
            return False
        if how == "close":
            return False
        if how == "garbage":
            conn.sendall(b"\x00\xff\xfeNOT HTTP AT ALL\r\n\r\n")
            return False
        if how == "list":
            self._answer(conn, 200, b"[1, 2, 3]")
        elif how == "html":
            self._answer(conn, 200, b"<html><body>Sign in to the Wi-Fi</body></html>", "text/html")
        elif how == "text":
            self._answer(conn, 200, b'vllm:request_success_total{model_name="m"} NaN{\n', "text/plain")
        elif how == "500":
            self._answer(conn, 500, b'{"error": {"message": "engine core died"}}')
        elif how in ("drip", "partial"):
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
            for _ in range(20 if how == "partial" else 10_000):
                conn.sendall(b" ")
                if how == "drip" and self._stop.wait(0.2):
                    break
            return False
        elif how == "nan":
            events = _canned_stream(lp=float("nan"))
            self._answer(conn, 200, b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
                         + b"data: [DONE]\n\n", "text/event-stream")
        elif how == "short":
            choice = {"index": 0, "text": "xyz", "token_ids": [5, 6, 7], "finish_reason": "length",
                      "logprobs": {"tokens": ["token_id:5", "token_id:6", "token_id:7"], "token_logprobs": [-0.1],
                                   "top_logprobs": [{f"token_id:{t}": -0.1 - t for t in range(5, 10)}] * 3}}
            self._answer(conn, 200, json.dumps({"choices": [choice]}).encode())
        elif how == "ctype":
            self._answer(conn, 200, b"data: " + json.dumps(_canned_stream()[0]).encode() + b"\n\n", "text/plain")
        elif how == "drip_stream":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            while not self._stop.wait(0.2):
                conn.sendall(b"1\r\na\r\n")
            return False
        elif how == "huge":  # promises 4 GiB and sends it as fast as it can
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 4294967296\r\n\r\n")
            block = b" " * (1 << 20)
            for _ in range(4096):
                if self._stop.is_set():
                    break
                conn.sendall(block)
            return False
        elif how == "flood":  # a stream of tokens that never ends, and never says [DONE]
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            event = b"data: " + json.dumps(_canned_stream(1)[0]).encode() + b"\n\n"
            chunk = f"{len(event):x}\r\n".encode() + event + b"\r\n"
            while not self._stop.is_set():
                conn.sendall(chunk * 64)
            return False
        elif how == "long":  # 40 tokens, whatever max_tokens asked for
            events = _canned_stream(40)
            self._answer(conn, 200, b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
                         + b"data: [DONE]\n\n", "text/event-stream")
        elif how == "dupids":  # one id listed twice in a top-k, spelled two ways
            events = _canned_stream()
            for e in events:
                top = e["choices"][0]["logprobs"]["top_logprobs"][0]
                first = next(iter(top))
                top["token_id:0" + first.split(":")[1]] = top[first]
            self._answer(conn, 200, b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
                         + b"data: [DONE]\n\n", "text/event-stream")
        elif how == "mass":  # a top-5 whose probabilities add up to 4.5
            events = _canned_stream(lp=-0.1)
            for e in events:
                lp = e["choices"][0]["logprobs"]
                lp["top_logprobs"] = [{k: -0.1 - 0.001 * j for j, k in enumerate(t)} for t in lp["top_logprobs"]]
            self._answer(conn, 200, b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
                         + b"data: [DONE]\n\n", "text/event-stream")
        elif how == "empty":
            self._answer(conn, 200, b"")
        elif how == "truncated":
            self._answer(conn, 200, json.dumps({"choices": [{"index": 0, "text": "x"}]}).encode()[:25])
        elif how == "redirect":
            conn.sendall(b"HTTP/1.1 302 Found\r\nLocation: /v1/models\r\nContent-Length: 0\r\n\r\n")
        elif how == "maxlen":  # a model whose context length is not a number
            self._answer(conn, 200, json.dumps({"data": [{"id": "m", "max_model_len": "lots"}]}).encode())
        elif how == "negative":  # token ids that cannot be
            self._answer(conn, 200, json.dumps({"tokens": [-1, 2, 3]}).encode())
        elif how == "nanmetric":
            self._answer(conn, 200, b"vllm:spec_decode_num_drafts_total NaN\nvllm:request_success_total 0\n",
                         "text/plain")
        return True


# --- the catalogue ----------------------------------------------------------------------------

OPENAI = ["run", "--engine", "openai", "--method", "baseline", "--corpus", "smoke", "--repeats", "1",
          "--concurrent", "off", "--no-attribution", "--axes", "none", "--served-model", "m",
          "--engine-arg", "retries=1", "--engine-arg", "backoff=0"]


def _gate(c: Ctx) -> list[str]:
    return ["gate", "--store", str(c.store)]


def _store_row(change: Callable[[Ctx], None], *extra: str, command: str = "gate") -> Callable[[Ctx], list[str]]:
    """Damage the row's store with ``change``, then run ``command`` on it."""
    def make(c: Ctx) -> list[str]:
        change(c)
        return [*command.split(), "--store", str(c.store),
                *(a.replace("{store}", str(c.store)).replace("{tmp}", str(c.tmp)) for a in extra)]
    return make


def _golden(change: Callable[[Path], None], command: str = "golden check") -> Callable[[Ctx], list[str]]:
    """Record a golden of the made store, damage it, then run ``command`` against it."""
    def make(c: Ctx) -> list[str]:
        g = c.tmp / "golden"
        r = CliRunner().invoke(main, ["golden", "record", "--store", str(c.store), "--golden", str(g)])
        assert r.exit_code == 0, r.output
        change(next(g.rglob("golden.json")).parent)
        return [*command.split(), "--store", str(c.store), "--golden", str(g)]
    return make


def _pyproject(text: str, command: tuple[str, ...] = ("gate",)) -> Callable[[Ctx], list[str]]:
    def make(c: Ctx) -> list[str]:
        (c.tmp / "pyproject.toml").write_text(text)
        return [*command, "--store", str(c.store)]
    return make


def _corpus(content: str | bytes) -> Callable[[Ctx], list[str]]:
    """`run` on a corpus file holding ``content``."""
    def make(c: Ctx) -> list[str]:
        f = c.tmp / "mine.jsonl"
        f.write_bytes(content if isinstance(content, bytes) else content.encode())
        return ["run", "--store", str(c.store), "--corpus", str(f), "--config", "baseline", "--repeats", "1",
                "--concurrent", "off", "--no-attribution", "--axes", "none"]
    return make


def _prompt(**fields) -> str:
    return json.dumps({"id": "p", "category": "code", "max_tokens": 4, "text": "def f(x):", **fields}) + "\n"


def _args(*args: str) -> Callable[[Ctx], list[str]]:
    return lambda c: [a.replace("{store}", str(c.store)).replace("{tmp}", str(c.tmp)) for a in args]


def _served(behaviour: str, *extra: str) -> Callable[[Ctx], list[str]]:
    def make(c: Ctx) -> list[str]:
        c.moves |= {"LATEST", "LATEST.sha256"}  # a run of a new suite moves LATEST to it
        return [*OPENAI, "--store", str(c.store), "--base-url", c.url, *extra]
    return make


def _merge_failing(c: Ctx) -> list[str]:
    """Another store whose last suite fails the gate (an engine with a planted fault), merged
    into an empty store: `gate` after it must judge that suite, not the first by name."""
    src = c.tmp / "other"
    shutil.copytree(c.store, src)
    r = CliRunner().invoke(main, ["run", "--store", str(src), *RUN, "--engine-arg", "fault=accept-top2"])
    assert r.exit_code == 0, r.output
    dst = c.tmp / "merged"
    assert CliRunner().invoke(main, ["merge", str(src), "--store", str(dst)]).exit_code == 0
    return ["gate", "--store", str(dst)]


def _sweep_into_run_store(c: Ctx) -> list[str]:
    r = CliRunner().invoke(main, ["sweep", "--store", str(c.store), "--method", "mtp", "--k", "3",
                                  "--corpus", "smoke", "--repeats", "2"])
    assert r.exit_code == 0, r.output
    return ["gate", "--store", str(c.store)]


def _selftest_corpus(c: Ctx) -> list[str]:
    f = c.tmp / "long.jsonl"
    f.write_text(_prompt(max_tokens=32768))
    return ["selftest", "--corpus", str(f), "--fault", "past-eos"]


def _export_over(c: Ctx) -> list[str]:
    out = c.tmp / "ckpt"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    return ["export-reference", str(out)]


def _npz(path: Path, change: Callable[[dict], None]) -> None:
    """Rewrite a stored .npz with ``change`` applied to its arrays, and re-sum it."""
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    change(arrays)
    np.savez(path, **arrays)
    resum(path)


def _plan_all(c: Ctx, **demand) -> None:
    """Every config of the plan asking for less (``demand``), its sum rewritten to match."""
    edit_json(c.file("plan.json"), lambda p: [cfg.update(demand) for cfg in p["configs"].values()], keep_sum=True)


def _escalated_to_itself(c: Ctx) -> list[str]:
    """A policy that makes the clean top-k test inconclusive, so `run` escalates; then the
    link is pointed at the suite itself, its sum rewritten: still inconclusive, a failure."""
    (c.tmp / "speccheck.toml").write_text("topk_drift_max_ratio = 1.0\ntopk_drift_alpha = 1e-12\n"
                                          "topk_drift_look_closer = 1\nescalation_budget = 1\n")
    r = CliRunner().invoke(main, ["run", "--store", str(c.store), *RUN])
    assert r.exit_code == 0 and "escalating" in r.output, r.output
    edit_json(c.file("escalation.json"), lambda link: link.update(suite=c.suite.name), keep_sum=True)
    return ["gate", "--store", str(c.store)]


def _model(change: Callable[[Path], None], *command: str) -> Callable[[Ctx], list[str]]:
    """A copy of the shipped reference weights, damaged by ``change``, given with --model."""
    def make(c: Ctx) -> list[str]:
        from speccheck.reference.export import default_weights_dir

        shutil.copytree(default_weights_dir(), c.tmp / "model")
        change(c.tmp / "model")
        return [*(command or ("run", "--store", str(c.store), *RUN)), "--model", str(c.tmp / "model")]
    return make


def _doctor(c: Ctx) -> list[str]:
    return ["doctor", "--engine", "openai", "--base-url", c.url]


@dataclass(frozen=True)
class Row:
    name: str
    make: Callable[[Ctx], list[str]]  # damages the row's copy, returns the command line
    code: int
    phrase: str  # the paragraph must contain it
    server: str = ""  # a HostileServer behaviour the command talks to
    slow: bool = False
    needs: str = ""  # a module the row needs (an optional extra): skipped without it


ROWS = [
    # the store: stray, damaged, missing or special files in every folder
    Row("stray directory under runs/", _store_row(lambda c: c.file("runs/junk").mkdir()), 2, "runs/junk: a directory"),
    Row("dangling symlink under runs/", _store_row(lambda c: c.file("runs/lnk").symlink_to("/nonexistent")),
        2, "runs/lnk: a symlink"),
    Row("symlinked config directory", _store_row(lambda c: c.file("runs/mtp-k3").symlink_to(c.file("runs/mtp-k2"))),
        2, "runs/mtp-k3: a symlink"),
    Row("stray file under runs/", _store_row(lambda c: c.file("runs/notes.txt").write_text("x")), 2,
        "runs/notes.txt: a file"),
    Row("stray file as a repeat", _store_row(lambda c: c.file("runs/mtp-k2/r7").write_text("x")), 2,
        "mtp-k2/r7: a file"),
    Row("edited manifest", _store_row(lambda c: edit_json(c.file("runs/mtp-k2/r0/manifest.json"),
                                                          lambda m: m["completions"][0].update(text="EDITED")),
                                      "--set", "min_text_similarity=off"), 2, "manifest.json: changed since it was written"),
    Row("manifest checksum deleted", _store_row(lambda c: c.file("runs/mtp-k2/r0/manifest.json.sha256").unlink()),
        2, "manifest.json.sha256: missing"),
    Row("manifest is a FIFO", _store_row(lambda c: fifo(c.file("runs/mtp-k2/r0/manifest.json"))), 2,
        "manifest.json: is a FIFO"),
    Row("manifest is a directory", _store_row(lambda c: (c.file("runs/baseline/r1/manifest.json").unlink(),
                                                          c.file("runs/baseline/r1/manifest.json").mkdir())),
        2, "manifest.json: is a directory"),
    Row("manifest is a symlink to another run's", _store_row(lambda c: replace_with_symlink(
        c.file("runs/mtp-k2/r1/manifest.json"), c.file("runs/mtp-k2/r0/manifest.json"))), 2, "is a symlink"),
    Row("empty manifest", _store_row(lambda c: c.file("runs/mtp-k2/r0/manifest.json").write_text("")), 2,
        "mtp-k2/r0/manifest.json: changed"),
    Row("manifest of the wrong shape, its sum matching", _store_row(lambda c: edit_json(
        c.file("runs/mtp-k2/r0/manifest.json"), lambda m: m.update(completions={}), keep_sum=True)), 2,
        "'completions' is dict"),
    Row("manifest with a huge number, its sum matching", _store_row(lambda c: (
        c.file("runs/mtp-k2/r0/manifest.json").write_text(
            c.file("runs/mtp-k2/r0/manifest.json").read_text().replace('"repeat": 0', '"repeat": 1e999')),
        resum(c.file("runs/mtp-k2/r0/manifest.json")))), 2, "'repeat' is float"),
    Row("spec counters of the wrong type, the sum matching", _store_row(lambda c: edit_json(
        c.file("runs/mtp-k2/r0/manifest.json"), lambda m: m["completions"][0]["spec"].update(
            accepted_per_pos="many"), keep_sum=True)), 2, "spec counters accepted_per_pos are not counts"),
    Row("NaN timing, the sum matching", _store_row(lambda c: edit_json(
        c.file("runs/mtp-k2/r0/manifest.json"), lambda m: m["completions"][1].update(decode_s=float("nan")),
        keep_sum=True)), 2, "'decode_s' is nan, not a number of seconds"),
    Row("a prompt stored twice, the sum matching", _store_row(lambda c: edit_json(
        c.file("runs/baseline/r1/manifest.json"), lambda m: m["completions"][1].update(
            prompt_id=m["completions"][0]["prompt_id"]), keep_sum=True)), 2, "repeats prompt"),
    Row("plan of a billion repeats, its sum matching", _store_row(lambda c: edit_json(
        c.file("plan.json"), lambda p: p["configs"]["mtp-k2"].update(repeats=10 ** 9), keep_sum=True)), 2,
        "plans 1000000000 repeats"),
    Row("suite.json engine_args a list, its sum matching", _store_row(lambda c: edit_json(
        c.file("suite.json"), lambda m: m.update(engine_args=[1]), keep_sum=True)), 2, "engine_args/model/draft"),
    Row("manifest lists no file sums, its sum matching", _store_row(lambda c: edit_json(
        c.file("runs/baseline/r0/manifest.json"), lambda m: m.pop("files"), keep_sum=True)), 2, "no file checksums"),
    Row("manifest lists a file outside the run", _store_row(lambda c: edit_json(
        c.file("runs/baseline/r0/manifest.json"), lambda m: m["files"].update({"../../suite.json": {
            "size": 1, "sha256": "0"}}), keep_sum=True)), 2, "not a file of a run"),
    Row("truncated run arrays", _store_row(lambda c: truncate(c.file("runs/mtp-k2/r1/arrays.npz"))), 2,
        "arrays.npz: changed"),
    Row("run arrays are a symlink", _store_row(lambda c: replace_with_symlink(
        c.file("runs/mtp-k2/r1/arrays.npz"), c.file("runs/mtp-k2/r0/arrays.npz"))), 2, "arrays.npz: is a symlink"),
    Row("rescore checksum deleted", _store_row(lambda c: c.file("rescore/mtp-k2-r0.npz.sha256").unlink()), 2,
        "mtp-k2-r0.npz.sha256: missing"),
    Row("rescore checksum of the wrong type", _store_row(lambda c: c.file("rescore/mtp-k2-r0.npz.sha256")
                                                          .write_text("[1, 2]")), 2, "not a size/sha256 record"),
    Row("replay arrays flipped", _store_row(lambda c: c.file("replay/mtp-k2-r0.npz").write_bytes(
        c.file("replay/mtp-k2-r0.npz").read_bytes()[:-9] + b"123456789")), 2, "mtp-k2-r0.npz: changed"),
    Row("truncated inputs.npz (gate)", _store_row(lambda c: truncate(c.file("inputs.npz"))), 2, "inputs.npz: changed"),
    Row("truncated inputs.npz (diff)", _store_row(lambda c: truncate(c.file("inputs.npz")), command="diff"), 2,
        "inputs.npz: changed"),
    Row("truncated inputs.npz (report)", _store_row(lambda c: truncate(c.file("inputs.npz")), command="report"),
        2, "inputs.npz: changed"),
    Row("inputs.npz deleted", _store_row(lambda c: c.file("inputs.npz").unlink()), 2, "inputs.npz: missing"),
    Row("plan deleted, with a config's runs", _store_row(lambda c: (c.file("plan.json").unlink(),
                                                                     c.file("plan.json.sha256").unlink(),
                                                                     shutil.rmtree(c.file("runs/mtp-k2")))), 2,
        "plan.json: missing, though runs are stored"),
    Row("a run directory without its manifest", _store_row(lambda c: (
        c.file("runs/mtp-k2/r1/manifest.json").unlink(), c.file("runs/mtp-k2/r1/manifest.json.sha256").unlink())),
        2, "r1/manifest.json: missing or unreadable"),
    Row("edited plan", _store_row(lambda c: edit_json(c.file("plan.json"), lambda p: p["configs"].pop("mtp-k2"))),
        2, "plan.json: changed"),
    Row("plan checksum deleted", _store_row(lambda c: c.file("plan.json.sha256").unlink()), 2,
        "plan.json.sha256: missing"),
    Row("plan of the wrong shape, its sum matching", _store_row(lambda c: edit_json(
        c.file("plan.json"), lambda p: p.update(configs=[1]), keep_sum=True)), 2, "'configs' is list"),
    Row("truncated suite.json", _store_row(lambda c: truncate(c.file("suite.json"))), 2, "suite.json: changed"),
    Row("LATEST names no suite", _store_row(lambda c: ((c.store / "LATEST").write_text("gone\n"),
                                                        resum(c.store / "LATEST"))), 2, "no suite 'gone'"),
    Row("LATEST climbs out of the store", _store_row(lambda c: ((c.store / "LATEST").write_text("../../etc\n"),
                                                                 resum(c.store / "LATEST"))), 2, "does not name a suite"),
    Row("LATEST checksum deleted", _store_row(lambda c: (c.store / "LATEST.sha256").unlink()), 2,
        "LATEST.sha256: missing"),
    Row("LATEST is a FIFO", _store_row(lambda c: fifo(c.store / "LATEST")), 2, "LATEST: is a FIFO"),
    Row("store is a file", _args("gate", "--store", "{tmp}/afile"), 2, "afile' is a file"),
    Row("compare a damaged config", _store_row(lambda c: (shutil.copytree(c.store, c.tmp / "copy"),
                                                          truncate(c.file("runs/mtp-k2/r0/arrays.npz"))),
                                               "--with-store", "{tmp}/copy", command="compare"), 2, "arrays.npz: changed"),
    Row("merge a damaged store", lambda c: (truncate(c.file("runs/mtp-k2/r1/arrays.npz")),
                                            ["merge", str(c.store), "--store", str(c.tmp / "dst")])[1], 2,
        "arrays.npz: changed"),
    # goldens
    Row("truncated golden.json", _golden(lambda g: truncate(g / "golden.json")), 2, "golden.json: changed"),
    Row("golden noise.npz deleted (gate)", _golden(lambda g: (g / "noise.npz").unlink(), "gate"), 2,
        "noise.npz: missing"),
    Row("golden checksum deleted", _golden(lambda g: (g / "golden.json.sha256").unlink()), 2,
        "golden.json.sha256: missing"),
    Row("golden baseline manifest edited", _golden(lambda g: edit_json(
        g / "baseline" / "manifest.json", lambda m: m["completions"][0].update(text="x"))), 2, "manifest.json: changed"),
    Row("golden.json of the wrong shape, its sum matching", _golden(lambda g: (
        (g / "golden.json").write_text("[]"), resum(g / "golden.json"))), 2, "not a golden record"),
    # policy: pyproject.toml, policy files, --set
    Row("pyproject policy = 5", _pyproject("[tool.speccheck]\npolicy = 5\n"), 2, "[tool.speccheck].policy is 5"),
    Row("pyproject tool = 'x'", _pyproject('tool = "x"\n'), 2, "'tool' is 'x', not a table"),
    Row("pyproject [tool] speccheck = 3", _pyproject("[tool]\nspeccheck = 3\n"), 2, "[tool.speccheck] is 3"),
    Row("pyproject unknown key", _pyproject("[tool.speccheck]\nmin_token_agrement = 0.9\n"), 2,
        "unknown policy key 'min_token_agrement'"),
    Row("pyproject policy table and keys beside it", _pyproject(
        "[tool.speccheck]\nmax_high_confidence = 1\n[tool.speccheck.policy]\ntie_floor = 0.01\n"), 2,
        "both a policy table and keys beside it"),
    Row("agreement_alpha = 0 in pyproject", _pyproject("[tool.speccheck]\nagreement_alpha = 0\n"), 2,
        "'agreement_alpha' is a significance level: it must be above 0"),
    Row("a check turned off with 0", _pyproject("[tool.speccheck]\nrequire_deterministic = 0\n"), 2,
        "never with 0"),
    Row("--set acceptance_alpha=0", _args("gate", "--store", "{store}", "--set", "acceptance_alpha=0"), 2,
        "'acceptance_alpha' is a significance level"),
    Row("--set a check off with 0", _args("gate", "--store", "{store}", "--set", "require_batch_invariant=0"),
        2, "never with 0"),
    Row("--set a huge number", _args("gate", "--store", "{store}", "--set", "max_high_confidence=1e999"), 2,
        "finite"),
    Row("--set NaN", _args("gate", "--store", "{store}", "--set", "tie_floor=nan"), 2, "finite"),
    Row("--set without =", _args("gate", "--store", "{store}", "--set", "tie_floor"), 2, "key=value"),
    Row("policy file is a directory", _args("gate", "--store", "{store}", "--policy", "{tmp}"), 2,
        "is not a regular file"),
    Row("policy file is not UTF-8", lambda c: ((c.tmp / "p.toml").write_bytes(b"\xff\xfe = 1"),
                                               ["gate", "--store", str(c.store), "--policy", str(c.tmp / "p.toml")])[1],
        2, "cannot read policy TOML"),
    # corpora
    Row("corpus line that is not JSON", _corpus(_prompt() + "{nope\n"), 2, "mine.jsonl:2"),
    Row("duplicate prompt ids", _corpus(_prompt() * 2), 2, "duplicate prompt id 'p'"),
    Row("empty prompt", _corpus(_prompt(text="   ")), 2, "is empty"),
    Row("prompt past the model's positions", _corpus(_prompt(text="word " * 9000)), 2,
        "the prompt alone does not fit"),
    Row("empty corpus", _corpus(""), 2, "has no prompts"),
    Row("corpus not UTF-8", _corpus(b"\xff\xfe{}"), 2, "not UTF-8"),
    Row("max_tokens 0", _corpus(_prompt(max_tokens=0)), 2, "bad max_tokens 0"),
    Row("max_tokens huge", _corpus(_prompt(max_tokens=10 ** 12)), 2, "bad max_tokens"),
    Row("max_tokens a string", _corpus(_prompt(max_tokens="8")), 2, "bad max_tokens '8'"),
    Row("id not a string", _corpus(_prompt(id=7)), 2, "'id' must be a non-empty string"),
    Row("unknown prompt field", _corpus(_prompt(temperature=1)), 2, "unknown field(s) ['temperature']"),
    Row("corpus is a FIFO", lambda c: (os.mkfifo(c.tmp / "f.jsonl"),
                                       ["run", "--store", str(c.store), "--corpus", str(c.tmp / "f.jsonl")])[1],
        2, "is not a regular file"),
    # options out of range, or that would be ignored
    Row("--max-tokens on a corpus that sets its own", _args("run", "--store", "{store}", *RUN, "--max-tokens", "7"),
        2, "--max-tokens 7: corpus smoke gives every prompt its own max_tokens"),
    Row("--attribution-paths matching nothing", _args("run", "--store", "{tmp}/new", "--corpus", "smoke", "--config",
                                                      "mtp-k2", "--attribution-paths", "decode*"), 2,
        "'decode*' matches no kernel path"),
    Row("--attribution-paths with --no-attribution", _args("run", "--store", "{store}", *RUN, "--attribution-paths",
                                                           "gdn=*"), 2, "--no-attribution turns attribution off"),
    Row("--repeats 0", _args("run", "--store", "{store}", "--repeats", "0"), 2, "--repeats"),
    Row("--top-k 1", _args("run", "--store", "{store}", "--top-k", "1"), 2, "--top-k"),
    Row("--concurrent -1", _args("run", "--store", "{store}", "--concurrent", "-1"), 2, "--concurrent"),
    Row("--k 0", _args("run", "--store", "{store}", "--method", "mtp", "--k", "0"), 2, "--k '0'"),
    Row("--k huge", _args("run", "--store", "{store}", "--method", "mtp", "--k", "99999999999"), 2,
        "between 1 and"),
    Row("--engine-arg without =", _args("run", "--store", "{store}", "--engine-arg", "dtype"), 2, "key=value"),
    # where the cells run: an executor of no name, an address without Ray, a cluster nobody runs
    Row("--executor of no executor", _args("run", "--store", "{store}", *RUN, "--executor", "foo"), 2,
        "--executor 'foo': no such executor"),
    Row("--address without --executor ray", _args("run", "--store", "{store}", *RUN, "--address", "127.0.0.1:1"), 2,
        "--address 127.0.0.1:1: an address names a Ray cluster"),
    Row("--address that is no address", _args("run", "--store", "{store}", *RUN, "--executor", "ray", "--address",
                                              "headnode"), 2, "--address headnode: write auto, HOST:PORT", needs="ray"),
    Row("--address of a dashboard", _args("run", "--store", "{store}", *RUN, "--executor", "ray", "--address",
                                          "http://127.0.0.1:8265"), 2, "that is a dashboard's address", needs="ray"),
    Row("--address nothing answers at", _args("run", "--store", "{store}", *RUN, "--config", "mtp-k3", "--executor",
                                              "ray", "--address", "127.0.0.1:1"), 2,
        "--address 127.0.0.1:1: nothing answers there", needs="ray"),
    Row("openai timeout=0", _args(*OPENAI, "--store", "{store}", "--engine-arg", "timeout=0"), 2,
        "timeout='0' must be a number of seconds above 0"),
    Row("openai deadline=nan", _args(*OPENAI, "--store", "{store}", "--engine-arg", "deadline=nan"), 2,
        "deadline='nan'"),
    Row("openai retries=1.5", _args(*OPENAI, "--store", "{store}", "--engine-arg", "retries=1.5"), 2,
        "retries='1.5' must be a whole number"),
    Row("openai base_url that cannot parse", _args(*OPENAI, "--store", "{store}", "--base-url", "http://[::1"), 2,
        "base_url='http://[::1' is not an http(s) URL"),
    Row("openai base_url with port 99999", _args(*OPENAI, "--store", "{store}", "--base-url", "http://127.0.0.1:99999"),
        2, "port of 1-65535"),
    Row("pyproject.toml is a FIFO", lambda c: (os.mkfifo(c.tmp / "pyproject.toml"), ["gate", "--store", str(c.store)])[1],
        2, "pyproject.toml: is not a regular file"),
    Row("--axes level of a hundred million requests", _args("run", "--store", "{store}", "--corpus", "smoke",
                                                           "--axes", "concurrency=99999999"), 2, "1 to 4096"),
    Row("--axes level 0", _args("run", "--store", "{store}", "--corpus", "smoke", "--axes", "long_lived=0"), 2,
        "level 0 is out of range"),
    Row("doctor --base-url that cannot parse", _args("doctor", "--base-url", "http://[::1"), 1,
        "server: http://[::1: not a URL"),
    Row("doctor --engine foo", _args("doctor", "--engine", "foo"), 2, "unknown engine 'foo'"),
    Row("export-reference over a checkpoint", _export_over, 2, "already holds files (config.json)"),
    Row("selftest past the model's positions", _selftest_corpus, 2, "more than the 8192 the model holds"),
    Row("serve --port out of range", _args("serve", "--port", "70000"), 2, "--port"),
    Row("kernels gdn --positions 0", _args("kernels", "gdn", "--positions", "0"), 2, "--positions"),
    Row("gate --junit into a directory", _args("gate", "--store", "{store}", "--junit", "{tmp}"), 2, "--junit"),
    Row("compare --with-store that holds nothing", _args("compare", "--store", "{store}", "--with-store", "{tmp}/no"),
        2, "--with-store"),
    # what a gate must not pass on less evidence
    Row("merge of a failing suite, then gate", _merge_failing, 1, "FAIL", slow=True),
    Row("sweep into a run's store, then gate", _sweep_into_run_store, 1, "the fresh-process repeat of mtp-k3",
        slow=True),
    # servers that misbehave (test doubles)
    Row("server accepts, never answers", _served("models_hang", "--engine-arg", "deadline=1"), 3,
        "did not answer GET /v1/models", server="models_hang"),
    Row("server closes at once", _served("models_close"), 3, "did not answer GET /v1/models", server="models_close"),
    Row("server speaks no HTTP", _served("models_garbage"), 3, "did not answer GET /v1/models",
        server="models_garbage"),
    Row("server answers a JSON list", _served("models_list"), 3, "not a JSON object", server="models_list"),
    Row("server answers HTML", _served("models_html"), 3, "non-JSON text", server="models_html"),
    Row("server answers 500", _served("models_500"), 3, "HTTP 500: engine core died", server="models_500"),
    Row("server drips its answer", _served("models_drip", "--engine-arg", "deadline=1"), 3, "still arriving",
        server="models_drip"),
    Row("server sends part of a body", _served("models_partial"), 3, "did not answer GET /v1/models",
        server="models_partial"),
    Row("server's /metrics is not Prometheus text", _served("metrics_text"), 3, "is not Prometheus text",
        server="metrics_text"),
    Row("server's /tokenize answers a list", _served("tokenize_list"), 3, "answered /tokenize with '[1, 2, 3]'",
        server="tokenize_list"),
    Row("baseline server gives NaN logprobs", _served("completion_nan"), 3, "which no probability has",
        server="completion_nan"),
    Row("server gives fewer logprobs than tokens", _served("completion_short"), 3,
        "every token needs its logprob", server="completion_short"),
    Row("server never answers a completion", _served("completion_hang", "--engine-arg", "timeout=1",
                                                     "--engine-arg", "deadline=1"), 3,
        "did not answer POST /v1/completions (streamed)", server="completion_hang"),
    Row("server drips a stream without line ends", _served("completion_drip_stream", "--engine-arg", "deadline=1"),
        3, "the stream was still arriving", server="completion_drip_stream"),
    Row("server sends SSE as text/plain", _served("completion_ctype"), 3, "non-JSON text", server="completion_ctype"),
    Row("server answers completions with 500", _served("completion_500"), 3, "HTTP 500", server="completion_500"),
    # --- the second catalogue -------------------------------------------------------------------
    # the store: files rewritten with their sums made to match, so what reads them checks what they hold
    Row("plan drops the all-at-once runs, its sum matching", _store_row(lambda c: _plan_all(c, concurrent=0)), 2,
        "all at once (runs/baseline/together), which is stored"),
    Row("plan drops the fresh-process repeat, its sum matching", _store_row(lambda c: _plan_all(
        c, repeats=1, fresh_process_repeat=False)), 2, "does not plan repeat r1 of baseline"),
    Row("plan drops the rescoring, its sum matching", _store_row(lambda c: _plan_all(c, rescore=False)), 2,
        "the rescoring of baseline"),
    Row("plan drops a config, its sum matching", _store_row(lambda c: edit_json(
        c.file("plan.json"), lambda p: p["configs"].pop("mtp-k2"), keep_sum=True)), 2, "does not plan config mtp-k2"),
    Row("suite.json names another engine, its sum matching", _store_row(lambda c: edit_json(
        c.file("suite.json"), lambda m: m.update(engine="vllm"), keep_sum=True)), 2,
        "its engine is 'reference', but the suite's"),
    Row("suite.json names another corpus, its sum matching", _store_row(lambda c: edit_json(
        c.file("suite.json"), lambda m: m.update(corpus_hash="0" * 16), keep_sum=True)), 2, "its corpus hash is"),
    Row("replay margins NaN, the sum matching", _store_row(lambda c: _npz(
        c.file("replay/mtp-k2-r0.npz"), lambda a: a.update(margins=a["margins"] * np.nan))), 2, "NaN or negative"),
    Row("suite directory a symlink to a copy", _store_row(lambda c: (
        shutil.copytree(c.suite, c.tmp / "elsewhere"), shutil.rmtree(c.suite), c.suite.symlink_to(c.tmp / "elsewhere"))),
        2, "a symlink speccheck did not write"),
    Row("lock file is a FIFO", _store_row(lambda c: fifo(c.store / "lock"), *RUN, command="run"), 2,
        "where speccheck keeps its lock file"),
    Row("escalation linked to the suite itself, its sum matching", _escalated_to_itself, 1,
        "still inconclusive after the escalation budget", slow=True),
    # goldens rewritten with their sums matching
    Row("golden noise NaN, its sum matching (gate)", _golden(lambda g: _npz(
        g / "noise.npz", lambda a: a.update({k: v * np.nan for k, v in a.items()})), "gate"), 2,
        "not finite |Δ logprob| >= 0"),
    Row("golden noise without the kernel-path sample, its sum matching", _golden(lambda g: _npz(
        g / "noise.npz", lambda a: a.pop("kernel_path")), "gate"), 2, "lacks the kernel-path noise sample"),
    Row("golden acceptance NaN, its sum matching (gate)", _golden(lambda g: edit_json(
        g / "golden.json", lambda m: m["acceptance"]["mtp-k2"].update(tokens_per_iter=float("nan")), keep_sum=True),
        "gate"), 2, "has no finite tokens_per_iter"),
    Row("golden acceptance a string, its sum matching", _golden(lambda g: edit_json(
        g / "golden.json", lambda m: m.update(acceptance={"mtp-k2": "fast"}), keep_sum=True), "gate"), 2,
        "has no finite tokens_per_iter"),
    Row("golden per-prompt acceptance of another shape, its sum matching", _golden(lambda g: edit_json(
        g / "golden.json", lambda m: m["acceptance"]["mtp-k2"].update(per_prompt={"x": "y"}), keep_sum=True),
        "gate"), 2, "per_prompt entries that are not"),
    Row("golden checks a list, its sum matching", _golden(lambda g: edit_json(
        g / "golden.json", lambda m: m.update(checks=[1]), keep_sum=True)), 2, "its checks are not"),
    Row("golden noise level negative, its sum matching", _golden(lambda g: edit_json(
        g / "golden.json", lambda m: m.update(noise=-5.0), keep_sum=True)), 2, "not a finite number >= 0"),
    Row("golden directory a symlink", _golden(lambda g: (shutil.copytree(g, g.parent / "elsewhere"), shutil.rmtree(g),
                                                         g.symlink_to(g.parent / "elsewhere"))), 2,
        "a symlink, not a golden"),
    # policy: a zero is a threshold or refused, off is a word
    Row("min_speedup = 0 in pyproject", _pyproject("[tool.speccheck]\nmin_speedup = 0\n"), 2,
        "write min_speedup = false"),
    Row("--set min_prefix_agreement=0", _args("gate", "--store", "{store}", "--set", "min_prefix_agreement=0"), 2,
        "a floor of 0 is met by every config"),
    Row("--set min_token_agreement=0", _args("gate", "--store", "{store}", "--set", "min_token_agreement=0"), 2,
        "a floor of 0 is met by every config"),
    Row("--set min_speedup=true", _args("gate", "--store", "{store}", "--set", "min_speedup=true"), 2,
        "is a threshold"),
    Row("--set topk_drift_max_ratio=0", _args("gate", "--store", "{store}", "--set", "topk_drift_max_ratio=0"), 2,
        "a limit of 0 is exceeded by every config"),
    Row("--set max_logprob_drift=0", _args("gate", "--store", "{store}", "--set", "max_logprob_drift=0"), 2,
        "a limit of 0 is exceeded by every config"),
    Row("--set topk_tail_max_odds=0", _args("gate", "--store", "{store}", "--set", "topk_tail_max_odds=0"), 2,
        "'topk_tail_max_odds' must be > 0"),
    Row("--set agreement_look_closer=0", _args("gate", "--store", "{store}", "--set", "agreement_look_closer=0"), 2,
        "is below agreement_alpha"),
    Row("--set escalation_budget=1e9", _args("gate", "--store", "{store}", "--set", "escalation_budget=1000000000"),
        2, "must be in [0, 64]"),
    Row("pyproject.toml a link to itself", lambda c: ((c.tmp / "pyproject.toml").symlink_to(c.tmp / "pyproject.toml"),
                                                      ["gate", "--store", str(c.store)])[1], 2, "dangling or a loop"),
    Row("speccheck.toml a dangling link", lambda c: ((c.tmp / "speccheck.toml").symlink_to(c.tmp / "gone.toml"),
                                                     ["gate", "--store", str(c.store)])[1], 2, "dangling or a loop"),
    Row("--policy ''", _args("gate", "--store", "{store}", "--policy", ""), 2, "--policy ''"),
    # options
    Row("--concurrent 0", _args("run", "--store", "{store}", "--concurrent", "0"), 2, "write off"),
    Row("--temperature nan", _args("run", "--store", "{store}", *RUN, "--temperature", "nan"), 2,
        "is not a finite number"),
    Row("--temperature inf", _args("run", "--store", "{store}", *RUN, "--temperature", "inf"), 2, "--temperature"),
    Row("--engine-arg temperature=nan", _args("run", "--store", "{store}", *RUN, "--engine-arg", "temperature=nan"),
        2, "temperature='nan'"),
    Row("--engine-arg samples=0", _args("run", "--store", "{store}", *RUN, "--engine-arg", "temperature=0.5",
                                        "--engine-arg", "samples=0"), 2, "samples='0'"),
    Row("--seed past 32 bits", _args("run", "--store", "{store}", *RUN, "--temperature", "0.5", "--seed",
                                     "99999999999999999999999"), 2, "--seed"),
    Row("--engine-arg threads=100000", _args("run", "--store", "{store}", *RUN, "--engine-arg", "threads=100000"), 2,
        "give at most 1024"),
    Row("--axes ''", _args("run", "--store", "{store}", "--corpus", "smoke", "--axes", ""), 2, "--axes ''"),
    Row("--axes with an empty level", _args("run", "--store", "{store}", "--corpus", "smoke", "--axes",
                                            "concurrency="), 2, "no level after '='"),
    Row("--axes level misspelt", _args("run", "--store", "{store}", "--corpus", "smoke", "--axes",
                                       "kv_pressure=presure"), 2, "is not one of them"),
    Row("--k with a range of 1e11", _args("run", "--store", "{store}", "--method", "mtp", "--k", "1-99999999999"), 2,
        "got 99999999999"),
    Row("upgrade --alpha nan", _args("upgrade", "{store}", "{store}", "--alpha", "nan"), 2, "--alpha"),
    Row("upgrade --alpha 0", _args("upgrade", "{store}", "{store}", "--alpha", "0"), 2, "--alpha"),
    Row("upgrade --max-slowdown nan", _args("upgrade", "{store}", "{store}", "--max-slowdown", "nan"), 2,
        "--max-slowdown"),
    Row("upgrade a store against itself", _args("upgrade", "{store}", "{store}"), 2, "compared with itself"),
    Row("compare a store with itself", _args("compare", "--store", "{store}", "--with-store", "{store}"), 2,
        "compared with itself"),
    Row("merge from a folder that is no store", _args("merge", "{tmp}", "--store", "{tmp}/dst"), 2,
        "holds no suites"),
    Row("sweep --method baseline", _args("sweep", "--store", "{store}", "--method", "baseline"), 2,
        "a sweep runs a speculative method"),
    Row("kernels gdn --positions 1048576", _args("kernels", "gdn", "--device", "cpu", "--positions", "1048576"), 2,
        "would take about"),
    # corpora
    Row("corpus text with a lone surrogate", _corpus('{"id": "p", "category": "c", "max_tokens": 4, '
                                                      '"text": "\\ud800"}\n'), 2, "lone UTF-16 surrogate"),
    Row("corpus line nested past the parser", _corpus("[" * 100_000 + "\n"), 2, "nested too deeply"),
    Row("prompt id with a newline", _corpus(_prompt(id="a\nb")), 2, "must be printable text on one line"),
    Row("prompt id of 300 characters", _corpus(_prompt(id="p" * 300)), 2, "at most 200 characters"),
    # a reference model directory that is not one
    Row("--model config.json not JSON", _model(lambda m: (m / "config.json").write_text("{")), 2,
        "config.json: cannot be loaded as the reference model's config"),
    Row("--model config.json a field of the wrong type", _model(lambda m: (m / "config.json").write_text(json.dumps(
        {**json.loads((m / "config.json").read_text()), "hidden_size": "big"}))), 2, "cannot be loaded"),
    Row("--model weights truncated", _model(lambda m: truncate(m / "model.safetensors")), 2,
        "model.safetensors: cannot be loaded as the reference model's weights"),
    Row("--model tokenizer not JSON", _model(lambda m: (m / "tokenizer.json").write_text("{")), 2,
        "tokenizer.json: cannot be loaded"),
    Row("export-reference from weights truncated", _model(lambda m: truncate(m / "model.safetensors"),
                                                          "export-reference", "out"), 2, "cannot be loaded"),
    Row("serve from weights truncated", _model(lambda m: truncate(m / "model.safetensors"), "serve", "--port", "0"),
        2, "cannot be loaded"),
    # files written where a FIFO sits
    Row("--junit onto a FIFO", lambda c: (os.mkfifo(c.tmp / "j.xml"),
                                          ["gate", "--store", str(c.store), "--junit", str(c.tmp / "j.xml")])[1], 2,
        "a FIFO (named pipe) is there"),
    Row("report --html onto a FIFO", lambda c: (os.mkfifo(c.tmp / "r.html"),
                                                ["report", "--store", str(c.store), "--html", str(c.tmp / "r.html")])[1],
        2, "a FIFO (named pipe) is there"),
    # servers that misbehave in other ways (test doubles)
    Row("server sends a 4 GiB body", _served("models_huge"), 3, "sent more than 128 MiB", server="models_huge"),
    Row("server streams tokens forever", _served("completion_flood"), 3, "does not honour max_tokens",
        server="completion_flood"),
    Row("server returns more tokens than max_tokens", _served("completion_long"), 3, "does not honour max_tokens",
        server="completion_long"),
    Row("server lists one id twice in a top-k", _served("completion_dupids"), 3, "twice in one top_logprobs entry",
        server="completion_dupids"),
    Row("server's top-k adds up past probability 1", _served("completion_mass"), 3, "more than 1",
        server="completion_mass"),
    Row("server redirects", _served("models_redirect"), 2, "does not follow redirects", server="models_redirect"),
    Row("server answers an empty body", _served("models_empty"), 3, "non-JSON text", server="models_empty"),
    Row("server answers truncated JSON", _served("completion_truncated"), 3, "non-JSON text",
        server="completion_truncated"),
    Row("server's /tokenize gives negative ids", _served("tokenize_negative"), 3, "not a list of token ids",
        server="tokenize_negative"),
    Row("server's /metrics holds NaN counts", _served("metrics_nanmetric"), 3, "counts that are not numbers",
        server="metrics_nanmetric"),
    Row("doctor: server accepts, never answers", _doctor, 1, "did not answer in time", server="models_hang"),
    Row("doctor: server drips its answer", _doctor, 1, "still arriving", server="models_drip"),
]


@contextlib.contextmanager
def alarm(seconds: int):
    """A command still running after ``seconds`` is a hang: it fails the row."""
    def hung(*_):
        raise RuntimeError(f"hung: still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("row", [pytest.param(r, id=r.name, marks=([pytest.mark.slow] if r.slow else [])
                                              + ([pytest.mark.skipif(importlib.util.find_spec(r.needs) is None,
                                                                     reason=f"needs {r.needs}")] if r.needs else []))
                                 for r in ROWS])
def test_hostile_input_is_answered(row: Row, made_store, tmp_path, monkeypatch):
    monkeypatch.setattr("speccheck.engines.openai.HEARTBEAT_S", 0.5)  # the waits say so sooner here
    monkeypatch.setattr("speccheck.doctor.SERVER_DEADLINE_S", 6.0)  # doctor's deadline, shortened
    store = tmp_path / "st"
    shutil.copytree(made_store, store)
    (tmp_path / "afile").write_text("x")
    monkeypatch.chdir(tmp_path)  # a row's pyproject.toml is read from here
    server = HostileServer(row.server) if row.server else None
    ctx = Ctx(tmp_path, store, server.url if server else "")
    try:
        args = row.make(ctx)
        before = snapshot(store)
        t0 = time.monotonic()
        with alarm(ROW_LIMIT_S):
            r = CliRunner().invoke(main, args)
        took = time.monotonic() - t0
    finally:
        if server:
            server.close()
    out = r.output
    assert r.exit_code == row.code, out
    assert "Traceback" not in out and "internal error" not in out, out
    assert row.phrase in out, out
    if row.code == 2:  # one paragraph: one error line (click's usage errors too), nothing else
        assert len([ln for ln in out.splitlines() if "error:" in ln.lower()]) == 1, out
    if row.server.endswith(("hang", "drip", "drip_stream")):  # a wait says so, and ends at its deadline
        assert "still waiting for the server" in out and took < 20, (took, out)
    after = snapshot(store)
    lost = {k for k in before if k not in ctx.moves and after.get(k) != before[k]}
    assert not lost, f"{sorted(lost)} changed or went"


@pytest.mark.slow
def test_a_server_that_never_answers_is_given_up_on_within_a_minute(tmp_path):
    """With the defaults (no deadline given): the quick endpoints give up within 45 s, and
    the wait is said on stderr within 10 s (a real process, as a user runs it)."""
    server = HostileServer("models_hang")
    try:
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "speccheck.cli", *OPENAI, "--store", str(tmp_path / "st"),
                                 "--base-url", server.url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = proc.stderr.readline()
        said = time.monotonic() - t0
        out, err = proc.communicate(timeout=60)
    finally:
        server.close()
    assert "still waiting for the server" in first and said < 10 + 5, (said, first)  # + the interpreter's start
    assert proc.returncode == 3 and "did not answer GET /v1/models" in err, err
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
def test_a_cluster_address_that_never_takes_the_driver_in_is_given_up_on(tmp_path):
    """--executor ray --address at a port that accepts connections and never answers (no Ray
    there): the wait is said within 10 s, and it ends at the deadline with exit 2 and one
    paragraph naming --address, nothing stored (a real process, as a user runs it)."""
    pytest.importorskip("ray")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "speccheck.cli", "run", "--store", str(tmp_path / "st"),
                                 *RUN, "--executor", "ray", "--address", address],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = proc.stdout.readline()
        said = time.monotonic() - t0
        out, err = proc.communicate(timeout=90)
    finally:
        listener.close()
    assert f"connecting to {address} (--address)" in first and said < 10 + 5, (said, first)
    assert proc.returncode == 2 and f"--address {address}: something answers there" in err, err
    assert len([ln for ln in err.splitlines() if "error:" in ln]) == 1 and "Traceback" not in err, err
    assert time.monotonic() - t0 < 60 and not (tmp_path / "st").exists()


def test_executor_ray_without_ray_says_how_to_install_it():
    """Ray missing (made unimportable in a process of its own): `--executor ray` is refused
    before anything loads, naming the extra."""
    code = ("import sys; sys.modules['ray'] = None; sys.argv = ['speccheck', 'run', '--corpus', 'smoke', "
            "'--executor', 'ray']\nfrom speccheck.cli import main; main()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "--executor ray: Ray is not installed" in r.stderr and "pip install 'speccheck[ray]'" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("option,phrase", [
    (["--spec-corpus", "nope"], "unknown corpus 'nope'"),
    (["--spec-policy", "/nonexistent/policy.toml"], "no such file"),
    (["--spec-engine-arg", "dtype=fp8"], "--engine-arg dtype='fp8'"),
    (["--spec-concurrent", "0"], "write off"),
])
def test_pytest_plugin_says_a_bad_option_once_before_any_run(tmp_path, option, phrase):
    """`pytest -m spec` with a bad --spec-* option: pytest's usage error (exit 4), one
    paragraph, no traceback and no run (a bad engine arg gave one traceback per generated test,
    a missing policy file was read only after every config had run)."""
    (tmp_path / "test_spec.py").write_text("from speccheck.pytest_plugin import *  # noqa\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-n", "0",
                        "-m", "spec", "test_spec.py", "--spec-store", str(tmp_path / "st"), *option],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 4, out
    assert phrase in out and "Traceback" not in out and not (tmp_path / "st" / "suites").exists(), out


def test_a_file_size_limit_is_said_and_nothing_stored_is_lost(made_store, tmp_path):
    """A disk-full-like failure (here a file-size limit, ulimit -f) while writing a report: exit
    2 naming the file, no traceback, the old report kept whole (written beside, then renamed)."""
    import resource

    store = tmp_path / "st"
    shutil.copytree(made_store, store)
    assert CliRunner().invoke(main, ["report", "--store", str(store)]).exit_code == 0
    before = snapshot(store)

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
    r = subprocess.run([sys.executable, "-m", "speccheck.cli", "report", "--store", str(store)],
                       capture_output=True, text=True, timeout=120, preexec_fn=limit)
    assert r.returncode == 2, r.stderr
    assert "File too large" in r.stderr and "report" in r.stderr and "Traceback" not in r.stderr
    assert snapshot(store) == before


def test_prompt_ids_may_hold_a_colon():
    """Axis requests are `<request>:<prompt id>`: a prompt id with a colon (mt-bench:81) is
    paired with its own prompt, not with the part after its last colon."""
    from speccheck.checks._axes import prompt_of

    assert prompt_of("c8/003:mt-bench:81") == "mt-bench:81" and prompt_of("kv:code-2") == "code-2"


def test_serve_without_its_extra_says_how_to_install_it():
    """The serve stack missing (starlette made unimportable in a process of its own)."""
    code = ("import sys; sys.modules['starlette'] = None; sys.argv = ['speccheck', 'serve', '--port', '0']\n"
            "from speccheck.cli import main; main()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "pip install 'speccheck[serve]'" in r.stderr and "Traceback" not in r.stderr


# --- `speccheck serve` against malformed requests --------------------------------------------

def _http(body: bytes = b"{}", length: str | None = None, path: str = "/v1/completions", method: str = "POST",
          extra: str = "") -> bytes:
    n = str(len(body)) if length is None else length
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {n}\r\n"
            f"{extra}\r\n").encode() + body


def _completion(**fields) -> bytes:
    return json.dumps({"prompt": [1, 2, 3], "temperature": 0, "max_tokens": 2, **fields}).encode()


#: (name, raw request, expected status, phrase of the JSON error)
SERVE_ROWS = [
    ("Content-Length: abc", _http(length="abc"), 400, "malformed HTTP request"),
    ("Content-Length: -5", _http(length="-5"), 400, "malformed HTTP request"),
    ("two Content-Lengths that differ", _http(extra="Content-Length: 7\r\n"), 400, "malformed HTTP request"),
    ("not HTTP", b"\x16\x03\x01 TLS hello?\r\n\r\n", 400, "malformed HTTP request"),
    ("chunked body with a bad chunk size", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
     b"\r\n\r\nzz\r\nabc\r\n0\r\n\r\n", 400, "malformed HTTP request"),
    ("a 200 kB header", b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n", 400,
     "malformed HTTP request"),
    ("stream request refused before its first token", _http(_completion(stream=True, logprobs=25)), 400,
     "`logprobs` must be an integer"),
    ("body not JSON", _http(b"prompt=1"), 400, "request body is not JSON"),
    ("body not UTF-8", _http(b"\xff\xfe"), 400, "request body is not JSON"),
    ("body nested past the parser", _http(b"[" * 100_000), 400, "request body is not JSON"),
    ("body a JSON list", _http(b"[1, 2]"), 400, "request body must be an object"),
    ("prompt of the wrong type", _http(_completion(prompt={"a": 1})), 400, "field `prompt`"),
    ("negative token id", _http(_completion(prompt=[-1])), 400, "field `prompt`"),
    ("token id past the vocabulary", _http(_completion(prompt=[10 ** 9])), 400, "not in the model's vocabulary"),
    ("temperature a string", _http(_completion(temperature="hot")), 400,
     "for greedy decoding or > 0 to sample"),
    ("temperature NaN", _http(_completion().replace(b'"temperature": 0', b'"temperature": NaN')), 400,
     "for greedy decoding or > 0 to sample"),
    ("max_tokens true", _http(_completion(max_tokens=True)), 400, "`max_tokens` must be a positive integer"),
    ("max_tokens huge", _http(_completion(max_tokens=10 ** 12)), 400, "maximum context length is 8192"),
    ("logprobs out of range", _http(_completion(logprobs=99)), 400, "`logprobs` must be an integer"),
    ("stream not a boolean", _http(_completion(stream="yes")), 400, "`stream` must be true or false"),
    ("stream_options of the wrong type", _http(_completion(stream=True, stream_options=5)), 400, "`stream_options`"),
    ("messages of the wrong shape", _http(json.dumps({"messages": ["hi"]}).encode(), path="/tokenize"), 400,
     "`messages` must be a list of objects"),
    ("detokenize ids of the wrong type", _http(b'{"tokens": "abc"}', path="/detokenize"), 400, "field `tokens`"),
    ("unknown model", _http(_completion(model="other")), 404, "does not exist"),
    ("unknown path", _http(path="/v2/nothing"), 404, "Not Found"),
    ("wrong method", _http(method="PUT"), 405, "Method Not Allowed"),
    ("detokenize an id past 2^63", _http(b'{"tokens": [100000000000000000000]}', path="/detokenize"), 400,
     "not in the model's vocabulary"),
    ("stop strings it would not honour", _http(_completion(stop=["\n"])), 400, "`stop` is not supported"),
    ("a penalty it would not apply", _http(_completion(presence_penalty=1.5)), 400,
     "`presence_penalty` is not supported"),
    ("a logit bias it would not apply", _http(_completion(logit_bias={"5": 100})), 400,
     "`logit_bias` is not supported"),
    ("best_of 3", _http(_completion(best_of=3)), 400, "`best_of` is not supported"),
    ("seed a string", _http(_completion(seed="x")), 400, "`seed` must be an integer"),
    ("top_p 0", _http(_completion(top_p=0)), 400, "`top_p` must be a number in (0, 1]"),
    ("a body declared past the limit", _http(length="10000000000"), 413, "request body over 32 MiB"),
]


@pytest.fixture(scope="module")
def served():
    from speccheck.serve import running_server

    with running_server("baseline") as url:
        yield url


def _raw(url: str, request: bytes, wait: float = 20.0) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as s:
        s.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _length(data: bytes) -> int:
    head = data.partition(b"\r\n\r\n")[0].decode("latin-1").lower()
    return next((int(v) for k, _, v in (ln.partition(":") for ln in head.split("\r\n")) if k == "content-length"), 0)


@pytest.mark.parametrize("name,request_bytes,status,phrase", SERVE_ROWS, ids=[r[0] for r in SERVE_ROWS])
def test_serve_answers_malformed_requests_with_json_errors(served, name, request_bytes, status, phrase):
    code, body = _raw(served, request_bytes)
    assert code == status, body
    assert phrase in json.dumps(body), body
    # and the server still serves
    ok, answer = _raw(served, _http(_completion()))
    assert ok == 200 and len(answer["choices"][0]["text"]) >= 0


def test_serve_outlives_clients_that_hang_up_mid_request(served):
    """A body promised and never sent, a request line and no more: the client leaves; the
    server serves the next request."""
    host, port = served.removeprefix("http://").split(":")
    for partial in (_http(length="100"), b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(partial)
    ok, answer = _raw(served, _http(_completion()))
    assert ok == 200 and answer["usage"]["completion_tokens"] == 2
    assert np.isfinite(answer["usage"]["total_tokens"])
