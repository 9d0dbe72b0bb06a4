"""fleetctl, the operator's command line (entry point `fleetctl = fleetd.ctl:main`)."""

from fleetd.fleet.cli import main

__all__ = ["main"]
