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
    bad = [
        f"{page.name}:{n}" for n, line in enumerate(page.read_bytes().splitlines(), 1) if CONTROL.search(line)
    ]
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
    p = subprocess.run(
        [mandoc, "-T", "lint", "-W", "warning", str(page)], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0 and not (p.stdout + p.stderr).strip(), p.stdout + p.stderr


def rendered(page: Path) -> str:
    mandoc = shutil.which("mandoc")
    assert mandoc, "mandoc is missing (scripts/bootstrap.sh installs it)"
    out = subprocess.run(
        [mandoc, "-T", "ascii", "-O", "width=100", str(page)], capture_output=True, timeout=60, check=True
    ).stdout
    return re.sub(rb".\x08", b"", out).decode()  # overstrike (bold, underline) to plain text


def test_fleetctl_page_lists_every_subcommand_as_an_entry_of_its_own():
    """Rendered, not linted: an entry without its .TP runs into the previous paragraph, which
    no lint reports. Every subcommand of fleetctl's table starts a tag line of COMMANDS."""
    from fleetd.ctl.main import SUBCOMMANDS

    text = rendered(next(p for p in PAGES if p.name == "fleetctl.1"))
    section = text.split("\nCOMMANDS\n", 1)[1].split("\nENVIRONMENT\n", 1)[0]
    tags = [line.strip() for line in section.splitlines() if re.match(r"^ {7}\S", line)]
    words = {w for tag in tags for w in re.findall(r"[a-z][a-z0-9-]*", tag.split(" NODES")[0])}
    missing = [c.name for c in SUBCOMMANDS if c.name not in words]
    assert not missing, f"no COMMANDS entry starts with {missing}; tag lines: {tags}"
