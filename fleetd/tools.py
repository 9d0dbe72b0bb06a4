"""Locate the pinned llama.cpp tools that scripts/build-llama.sh caches outside the repo."""

from __future__ import annotations

import os
from pathlib import Path

LLAMA_VERSION = "0.3.36"  # llama-cpp-python sdist that vendors the pinned llama.cpp


def tools_dir() -> Path:
    root = Path(os.environ.get("FLEETD_LLAMA_CACHE", Path.home() / ".cache" / "fleetd"))
    return root / f"llama.cpp-{LLAMA_VERSION}" / "bin"


def find_tool(name: str) -> Path:
    """Path of a pinned tool; raises FileNotFoundError naming the build script when missing."""
    path = tools_dir() / name
    if path.is_file() and os.access(path, os.X_OK):
        return path
    raise FileNotFoundError(
        f"{name} not found in {tools_dir()}: run scripts/build-llama.sh (about 20 min on 2 cores)"
    )


def have_tool(name: str) -> bool:
    try:
        find_tool(name)
        return True
    except FileNotFoundError:
        return False


def p2p_tools_dir() -> Path:
    """The patched client (scripts/build-llama-p2p.sh): tools that take the direct path."""
    return tools_dir().parent / "p2p" / "bin"


def find_p2p_tool(name: str) -> Path:
    path = p2p_tools_dir() / name
    if path.is_file() and os.access(path, os.X_OK):
        return path
    raise FileNotFoundError(
        f"{name} not found in {p2p_tools_dir()}: run scripts/build-llama-p2p.sh (10-20 min on 2 cores)"
    )
