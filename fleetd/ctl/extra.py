"""fleetctl's own dependencies are the `ctl` extra, not the daemon's (pyproject.toml): a node
installs fleetd without them. A fleetctl without them says how to get them, in one line."""

from __future__ import annotations

CTL_PACKAGES = frozenset({"rich", "textual", "paramiko"})
INSTALL_CTL = "pip install 'fleetd[ctl]'"


def missing_ctl_package(exc: ModuleNotFoundError) -> str | None:
    """The line to print when `exc` is one of the ctl extra's packages missing, else None."""
    package = (exc.name or "").partition(".")[0]
    if package not in CTL_PACKAGES:
        return None
    return f"fleetctl: {package} is not installed: fleetctl needs the ctl extra ({INSTALL_CTL})"
