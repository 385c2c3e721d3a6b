"""The GPU evidence and bundling scripts: valid bash, parameters only (no machine's paths or
names), and the evidence script's steps all defined."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parents[1] / "scripts"
GENERIC = ("gpu_evidence.sh", "bundle_vllm.sh")


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("name", GENERIC)
def test_script_parses_and_names_no_machine(name):
    text = (SCRIPTS / name).read_text()
    assert subprocess.run(["bash", "-n", str(SCRIPTS / name)], capture_output=True).returncode == 0
    for needle in ("h100", "h200", "/root/", "/work/", "$OUT", ".stage/", "piece"):
        assert needle.lower() not in text.lower(), needle


def test_every_default_step_of_the_evidence_script_is_defined():
    text = (SCRIPTS / "gpu_evidence.sh").read_text()
    steps = re.search(r"STEPS=\(env [^)]*\)", text).group(0)[7:-1].split()
    assert steps[:3] == ["env", "export", "run"] and "proof" in steps and "server" in steps
    for s in steps:
        assert f"step_{s}() {{" in text, s
