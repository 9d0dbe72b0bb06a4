"""Static checks: mypy over the ggml binding (fleetd/compute/ggml) and the wire (fleetd/wire),
with the settings of [tool.mypy] in pyproject.toml. mypy is in the `test` extra, which
scripts/bootstrap.sh installs: without it this fails, it does not skip."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ["fleetd/compute/ggml", "fleetd/wire"]


def test_mypy_is_clean_on_the_ggml_binding_and_the_wire():
    if importlib.util.find_spec("mypy") is None:
        pytest.fail(f"mypy is not installed in {sys.executable}'s environment: it is in the "
                    f"test extra (pip install -e '.[test]', as scripts/bootstrap.sh does)")
    r = subprocess.run([sys.executable, "-m", "mypy", *CHECKED], cwd=ROOT,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"mypy {' '.join(CHECKED)}: rc {r.returncode}\n{r.stdout}{r.stderr}"
