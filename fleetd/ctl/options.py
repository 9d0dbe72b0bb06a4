"""What every fleet subcommand shares: the nodes file and SSH flags, opening the fleet, and
printing results (tables or --json)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from rich.console import Console

from fleetd.errors import FleetError
from fleetd.fleet.node import Fleet, FleetResult
from fleetd.fleet.nodes_file import NODES_FILE_HELP
from fleetd.fleet.render import reason
from fleetd.fleet.ssh import SshOptions


def fleet_args(p: argparse.ArgumentParser, json_output: bool = True, nodes_optional: bool = False) -> None:
    """The nodes file argument and the flags every fleet subcommand shares (SSH keys, known_hosts,
    timeouts, and --json unless `json_output` is False). `nodes_optional`: NODES may be left out
    (the command checks when it needs it)."""
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = NODES_FILE_HELP
    p.add_argument(
        "nodes", metavar="NODES", nargs="?" if nodes_optional else None, help="nodes file (format below)"
    )
    if json_output:
        p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument(
        "-i",
        "--identity",
        action="append",
        default=[],
        metavar="FILE",
        help="SSH private key to try first (repeatable; the agent and ~/.ssh are tried too)",
    )
    p.add_argument(
        "--known-hosts",
        action="append",
        default=[],
        metavar="FILE",
        help="extra known_hosts file (repeatable; ~/.ssh/known_hosts is always read)",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds for the SSH connect and channel open (default 10)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds for one control API answer (default 30)",
    )


def open_fleet(args) -> Fleet:
    """The fleet of the nodes file, with the SSH options of `fleet_args`' flags."""
    if args.debug:
        logging.basicConfig(level=logging.DEBUG, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for flag, v in (("--connect-timeout", args.connect_timeout), ("--timeout", args.timeout)):
        if not v > 0:
            raise FleetError(f"{flag} {v:g}: must be above 0")
    ssh = SshOptions(
        connect_timeout=args.connect_timeout,
        timeout=args.timeout,
        identity=tuple(args.identity),
        known_hosts=tuple(args.known_hosts),
    )
    return Fleet.load(args.nodes, ssh)


def by_name(result: FleetResult) -> dict:
    """{node name: value or exception}: what the renderers take."""
    return {n.name: v for n, v in result.items()}


def json_doc(result: FleetResult, key: str) -> dict:
    """Per node {"up": true, key: the answer as the daemon sent it} or {"up": false, "error": ...}."""
    return {
        n.name: (
            {"up": False, "error": reason(v)}
            if isinstance(v, BaseException)
            else {"up": True, key: getattr(v, "doc", v)}
        )
        for n, v in result.items()
    }


def print_renderables(*renderables) -> None:
    console = Console()
    for r in renderables:
        if r is not None:
            console.print(r)


def print_json(doc) -> None:
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    sys.stdout.flush()
