"""fleetctl: the subcommand table, the parser built from it, and main().

Every subcommand is one row of SUBCOMMANDS: its name, its help line, a function that adds its
arguments to its parser, and `cmd_<name>(args) -> int` over fleetd.fleet. Nothing registers
itself on import: this table is the whole list.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from fleetd import __version__
from fleetd.ctl import ab_commands as ab
from fleetd.ctl import control_commands as control
from fleetd.ctl import deploy_commands as deploy
from fleetd.ctl import lab_commands as lab
from fleetd.ctl import tui_command
from fleetd.errors import FleetdError
from fleetd.fleet.nodes_file import NODES_FILE_HELP


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


SUBCOMMANDS = (
    Subcommand("status", control.STATUS_HELP, control.configure_status, control.cmd_status),
    Subcommand("stats", control.STATS_HELP, control.configure_stats, control.cmd_stats),
    Subcommand("p2p", control.P2P_HELP, control.configure_p2p, control.cmd_p2p),
    Subcommand("deploy", deploy.DEPLOY_HELP, deploy.configure_deploy, deploy.cmd_deploy),
    Subcommand("start", deploy.START_HELP, deploy.configure_lifecycle, deploy.cmd_start),
    Subcommand("stop", deploy.STOP_HELP, deploy.configure_lifecycle, deploy.cmd_stop),
    Subcommand("restart", deploy.RESTART_HELP, deploy.configure_lifecycle, deploy.cmd_restart),
    Subcommand("logs", deploy.LOGS_HELP, deploy.configure_logs, deploy.cmd_logs),
    Subcommand("uninstall", deploy.UNINSTALL_HELP, deploy.configure_lifecycle, deploy.cmd_uninstall),
    Subcommand("inventory", deploy.INVENTORY_HELP, deploy.configure_inventory, deploy.cmd_inventory),
    Subcommand("ab", ab.AB_HELP, ab.configure_ab, ab.cmd_ab),
    Subcommand("demo", ab.DEMO_HELP, ab.configure_demo, ab.cmd_demo),
    Subcommand("lab", lab.LAB_HELP, lab.configure_lab, lab.cmd_lab),
    Subcommand("tui", tui_command.TUI_HELP, tui_command.configure_tui, tui_command.cmd_tui),
)
COMMANDS = {c.name: c for c in SUBCOMMANDS}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fleetctl", description="Run fleets of fleetd nodes.", epilog=NODES_FILE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("-V", "--version", action="version", version=f"fleetctl {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for c in sorted(SUBCOMMANDS, key=lambda c: c.name):  # --help lists them alphabetically
        c.configure(sub.add_parser(c.name, help=c.help, description=c.help))
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_usage(sys.stderr)
        print("fleetctl: error: a command is required (see fleetctl --help)", file=sys.stderr)
        return 2
    try:
        return COMMANDS[args.command].run(args)
    except FleetdError as exc:
        if args.debug:
            raise
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
