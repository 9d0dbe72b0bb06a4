"""The manual pages: no stray control bytes, and clean under groff's and mandoc's checkers."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

PAGES = sorted((Path(__file__).resolve().parent.parent / "man").glob("*.[0-9]"))
CONTROL = re.compile(rb"[\x00-\x08\x0b-\x1f\x7f]")


def test_there_are_pages():
    assert {p.name for p in PAGES} >= {"fleetctl.1", "fleetd.8", "fleetd-protocol.7"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_control_bytes(page):
    bad = [f"{page.name}:{n}" for n, line in enumerate(page.read_bytes().splitlines(), 1)
           if CONTROL.search(line)]
    assert not bad, f"control bytes (a typo for a font escape?) at {', '.join(bad)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_groff_has_no_warnings(page):
    groff = shutil.which("groff")
    assert groff, "groff is missing (scripts/bootstrap.sh installs groff-base)"
    p = subprocess.run([groff, "-ww", "-z", "-man", str(page)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and not p.stderr.strip(), p.stderr


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_mandoc_lint_is_clean(page):
    mandoc = shutil.which("mandoc")
    assert mandoc, "mandoc is missing (scripts/bootstrap.sh installs it)"
    # -W warning: every warning and error counts; the STYLE level (lines over 80 bytes) does not.
    p = subprocess.run([mandoc, "-T", "lint", "-W", "warning", str(page)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and not (p.stdout + p.stderr).strip(), p.stdout + p.stderr
