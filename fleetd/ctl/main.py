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
from fleetd.ctl import ab_commands, control_commands, deploy_commands, tui_command
from fleetd.errors import FleetdError
from fleetd.fleet.nodes_file import NODES_FILE_HELP


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


SUBCOMMANDS = (
    Subcommand("status", control_commands.STATUS_HELP, control_commands.configure_status,
               control_commands.cmd_status),
    Subcommand("stats", control_commands.STATS_HELP, control_commands.configure_stats,
               control_commands.cmd_stats),
    Subcommand("p2p", control_commands.P2P_HELP, control_commands.configure_p2p, control_commands.cmd_p2p),
    Subcommand("deploy", deploy_commands.DEPLOY_HELP, deploy_commands.configure_deploy,
               deploy_commands.cmd_deploy),
    Subcommand("start", deploy_commands.START_HELP, deploy_commands.configure_lifecycle,
               deploy_commands.cmd_start),
    Subcommand("stop", deploy_commands.STOP_HELP, deploy_commands.configure_lifecycle,
               deploy_commands.cmd_stop),
    Subcommand("restart", deploy_commands.RESTART_HELP, deploy_commands.configure_lifecycle,
               deploy_commands.cmd_restart),
    Subcommand("logs", deploy_commands.LOGS_HELP, deploy_commands.configure_logs, deploy_commands.cmd_logs),
    Subcommand("uninstall", deploy_commands.UNINSTALL_HELP, deploy_commands.configure_lifecycle,
               deploy_commands.cmd_uninstall),
    Subcommand("inventory", deploy_commands.INVENTORY_HELP, deploy_commands.configure_inventory,
               deploy_commands.cmd_inventory),
    Subcommand("ab", ab_commands.AB_HELP, ab_commands.configure_ab, ab_commands.cmd_ab),
    Subcommand("demo", ab_commands.DEMO_HELP, ab_commands.configure_demo, ab_commands.cmd_demo),
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
