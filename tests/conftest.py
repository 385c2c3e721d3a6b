"""Fixtures the test modules share: a free loopback port, and `speccheck serve` processes.

(In-process servers are :func:`speccheck.serve.running_server`; ``serve_process`` is for a
server that must be a process of its own, as a user starts one.)"""
from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile

import pytest


@pytest.fixture
def free_port() -> int:
    """A loopback port nothing listens on right now: for a URL that must refuse connections,
    or for servers started one after another on the same port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def serve_process():
    """``with serve_process("dtype=fp32") as url:`` -- `speccheck serve` (baseline; each
    argument an ``--engine-arg``) in a process of its own on a port the system picks. The URL
    is the one the server prints once it listens, so it is ready when the block starts; the
    process is stopped when the block ends."""

    @contextlib.contextmanager
    def start(*engine_args: str):
        cmd = [sys.executable, "-m", "speccheck.cli", "serve", "--port", "0"]
        for a in engine_args:
            cmd += ["--engine-arg", a]
        with tempfile.TemporaryFile("w+") as err:  # request lines go there: a pipe could fill up
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
            try:
                line = proc.stdout.readline()  # "speccheck serve: http://127.0.0.1:PORT  model ..."
                if not line.startswith("speccheck serve: http://"):
                    proc.wait(timeout=60)
                    err.seek(0)
                    raise RuntimeError(f"speccheck serve did not start (exit {proc.returncode}): "
                                       f"{line}{err.read()[-2000:]}")
                yield line.split()[2]
            finally:
                proc.terminate()  # the process this fixture started
                proc.wait(timeout=30)
                proc.stdout.close()

    return start
