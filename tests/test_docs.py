"""The user guide builds without a broken link, its generated reference pages come from the
code, its examples run, and the README stays a README: the two commands first, then a short
guide (under 250 lines) that leaves the details to docs/."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def test_the_docs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    checks = (tmp_path / "site" / "reference" / "checks" / "index.html").read_text()
    from speccheck.checks import registry

    for spec in registry():  # generated from the registry, so every check is there
        assert f"<code>{spec.name}</code>" in checks


def test_readme_opens_with_the_two_commands_and_stays_short():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert "pip install" in blocks[0] and "speccheck run" in blocks[0] and "speccheck gate" in blocks[0]
    assert blocks[1].strip() == "pytest -n auto && pytest -m slow -n auto && pytest -m spec"
    ci = (ROOT / ".ci" / "run").read_text()
    assert blocks[1].strip() in ci, "CI runs the README's test command"
    assert len(text.splitlines()) <= 250
    for link in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)", text):
        assert (ROOT / link).exists(), f"README links to {link}, which does not exist"


def test_the_add_a_check_example_is_one_file_every_listing_shows(tmp_path):
    """The how-to's example check, installed as another distribution would install it (a module
    and an entry point), shows up in `speccheck checks` with its policy key, untouched code."""
    page = (ROOT / "docs" / "how-to" / "check.md").read_text()
    code = re.search(r"```python\n(.*?)```", page, re.S)[1]
    (tmp_path / "my_check.py").write_text(code)
    dist = tmp_path / "my_check-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-check\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[speccheck.checks]\nfew_low_confidence = my_check:CHECK\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        from speccheck.cli import main
        main(["checks"])""")], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "few_low_confidence" in r.stdout and "max_low_confidence = 10" in r.stdout, r.stdout[-2000:]


def test_every_check_is_in_the_triage_tables():
    """What to do when a check fails is in the README's table and the triage page for every
    registered check, once (a new check without a row fails here, and so does a row that a
    merge wrote twice)."""
    from speccheck.checks import registry

    readme = (ROOT / "README.md").read_text().split("## What to do on FAIL")[1].split("\n## ")[0]
    page = (ROOT / "docs" / "triage.md").read_text()
    for spec in registry():
        for name, text in (("README.md", readme), ("docs/triage.md", page)):
            rows = [ln for ln in text.splitlines() if ln.startswith("|") and f"`{spec.name}`" in ln.split("|")[1]]
            assert len(rows) == 1, f"{name}: {len(rows)} triage rows name `{spec.name}`, not one"
