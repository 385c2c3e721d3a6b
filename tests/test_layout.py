"""The layout shows the flow, and stays that way: the import contracts in pyproject.toml
([tool.importlinter]) hold -- no import circle in any package, nothing importing back up the
flow, verify/ pure, the engines ignorant of the store -- and the installed package carries no
training code."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def test_imports_follow_the_flow(capsys):
    importlinter = pytest.importorskip("importlinter.cli")
    code = importlinter.lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True,
                                     no_logo=True)
    assert code == 0, capsys.readouterr().out


def test_importing_speccheck_and_its_engine_loads_no_training_code():
    """What a user's `import speccheck` and a run of the reference engine load: no trainer."""
    code = ("import sys, speccheck, speccheck.cli, speccheck.reference.engine\n"
            "print([m for m in sys.modules if m.split('.')[0] in ('tools', 'train_reference') or "
            "(m.startswith('speccheck.') and m.rsplit('.', 1)[-1] in "
            "('train', 'train_dflash2', 'tokenizer_train', 'data'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT / "tests")
    assert out.stdout.strip() == "[]"


def test_the_local_path_never_imports_ray():
    """Ray is an optional extra: the command line, the Python API, the pytest plugin and the
    local executor (its fresh-process worker included) load without it, so a user without it
    never pays its import (the import contract holds the same statically)."""
    code = ("import sys, speccheck.cli, speccheck.api, speccheck.pytest_plugin, speccheck.executors.local\n"
            "print([m for m in sys.modules if m.split('.')[0] == 'ray'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT / "tests")
    assert out.stdout.strip() == "[]"


def test_every_package_is_in_the_distribution():
    """`pip install .` (not editable) ships only the packages pyproject.toml lists: a new
    subpackage left out of that list imports from a checkout and fails in every install."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "speccheck").rglob("__init__.py")}
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"


def test_committed_goldens_name_no_machine_paths():
    """A golden is read on other machines: the identities it keeps carry no absolute paths of
    the machine that recorded it (golden.portable_identity), and only what `golden check` reads
    lives under golden/."""
    import json

    from speccheck.golden import portable_identity

    for path in list((ROOT / "golden").rglob("golden.json")) + list((ROOT / "golden").rglob("manifest.json")):
        ident = json.loads(path.read_text()).get("identity") or {}
        assert ident == portable_identity(ident), path
    assert not [p for p in (ROOT / "golden").rglob("*") if p.suffix in (".md", ".html")]
    assert portable_identity({"model": "/tmp/ckpt", "dtype": "bf16"}) == {"model": "ckpt", "dtype": "bf16"}
