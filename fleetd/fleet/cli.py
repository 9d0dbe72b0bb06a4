"""fleetctl: one small cmd_<name>(args) -> int per subcommand over fleetd.fleet."""

from __future__ import annotations

import argparse
import sys

from fleetd import __version__
from fleetd.errors import FleetdError

COMMANDS: dict[str, tuple] = {}  # name -> (configure(parser), run(args) -> int, help)


def command(name: str, help: str):
    def wrap(fn):
        COMMANDS[name] = (getattr(fn, "configure", lambda p: None), fn, help)
        return fn

    return wrap


def build_parser() -> argparse.ArgumentParser:
    from fleetd.fleet.nodes import NODES_FILE_HELP

    p = argparse.ArgumentParser(
        prog="fleetctl", description="Run fleets of fleetd nodes.", epilog=NODES_FILE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("-V", "--version", action="version", version=f"fleetctl {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (configure, _, help_) in sorted(COMMANDS.items()):
        configure(sub.add_parser(name, help=help_, description=help_))
    return p


def main(argv: list[str] | None = None) -> int:
    from fleetd.fleet import commands, deploy_cli, run_cli, tui_cli  # noqa: F401  (fill COMMANDS)

    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_usage(sys.stderr)
        print("fleetctl: error: a command is required (see fleetctl --help)", file=sys.stderr)
        return 2
    try:
        return COMMANDS[args.command][1](args)
    except FleetdError as exc:
        if args.debug:
            raise
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
