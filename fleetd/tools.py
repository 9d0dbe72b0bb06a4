"""Locate the pinned llama.cpp tools that scripts/build-llama.sh caches outside the repo."""

from __future__ import annotations

import os
from pathlib import Path

LLAMA_VERSION = "0.3.36"  # llama-cpp-python sdist that vendors the pinned llama.cpp


def build_dir() -> Path:
    """scripts/build-llama.sh's cache for the pinned version ($FLEETD_LLAMA_CACHE or
    ~/.cache/fleetd): bin/, lib/, lib-portable/, p2p/."""
    root = Path(os.environ.get("FLEETD_LLAMA_CACHE", Path.home() / ".cache" / "fleetd"))
    return root / f"llama.cpp-{LLAMA_VERSION}"


def tools_dir() -> Path:
    return build_dir() / "bin"


def _find(directory: Path, name: str, build: str) -> Path:
    path = directory / name
    if path.is_file() and os.access(path, os.X_OK):
        return path
    raise FileNotFoundError(f"{name} not found in {directory}: run {build}")


def find_tool(name: str) -> Path:
    """Path of a pinned stock tool; raises FileNotFoundError naming the build script when missing."""
    return _find(tools_dir(), name, "scripts/build-llama.sh (about 20 min on 2 cores)")


def have_tool(name: str) -> bool:
    try:
        find_tool(name)
        return True
    except FileNotFoundError:
        return False


def portable_ggml_dir() -> Path:
    """The portable ggml build (FLEETD_GGML_PORTABLE=1 scripts/build-llama.sh ggml): CPU variants
    without -march=native, what `fleetctl deploy` ships to nodes."""
    return build_dir() / "lib-portable"


def p2p_tools_dir() -> Path:
    """The patched client (scripts/build-llama-p2p.sh): tools that take the direct path."""
    return build_dir() / "p2p" / "bin"


def find_p2p_tool(name: str) -> Path:
    return _find(p2p_tools_dir(), name, "scripts/build-llama-p2p.sh (10-20 min on 2 cores)")
