"""Static checks: mypy over the files [tool.mypy] in pyproject.toml lists (the ggml binding, the
wire, the transport, the local fleet), with its settings, and ruff (lint and format, [tool.ruff]) over
all the Python code. Both are in the `test` extra, which scripts/bootstrap.sh installs: without
them these fail, they do not skip."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
with open(ROOT / "pyproject.toml", "rb") as f:
    CHECKED = tomllib.load(f)["tool"]["mypy"]["files"]


LINTED = ["fleetd", "tui", "tests", "scripts", "benchmarks"]


def _require(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.fail(
            f"{module} is not installed in {sys.executable}'s environment: it is in the "
            f"test extra (pip install -e '.[test]', as scripts/bootstrap.sh does)"
        )


@pytest.mark.parametrize("check", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_is_clean(check):
    _require("ruff")
    r = subprocess.run(
        [sys.executable, "-m", "ruff", *check, *LINTED], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, f"ruff {' '.join(check)}: rc {r.returncode}\n{r.stdout}{r.stderr}"


def test_mypy_is_clean_on_the_files_pyproject_lists():
    _require("mypy")
    r = subprocess.run(
        [sys.executable, "-m", "mypy", *CHECKED], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert r.returncode == 0, f"mypy {' '.join(CHECKED)}: rc {r.returncode}\n{r.stdout}{r.stderr}"
