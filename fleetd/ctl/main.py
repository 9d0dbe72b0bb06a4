"""fleetctl: the subcommand table, the parser built from it, and main().

Every subcommand is one row of SUBCOMMANDS: its name, its help line, a function that adds its
arguments to its parser, and `cmd_<name>(args) -> int` over fleetd.fleet. Nothing registers
itself on import: this table is the whole list. NUMBER_RANGES is the one place numeric options
are range-checked, for every subcommand that has them.

Exit codes (fleetctl(1)): 0 success; 1 a node failed or outputs differ; 2 a usage error (a bad
flag or value, a bad nodes file); 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from fleetd import __version__
from fleetd.ctl import ab_commands as ab
from fleetd.ctl import control_commands as control
from fleetd.ctl import demo_command as demo
from fleetd.ctl import deploy_commands as deploy
from fleetd.ctl import lab_commands as lab
from fleetd.ctl import model_command as model
from fleetd.ctl import plan_command as plan
from fleetd.ctl import serve_command as serve
from fleetd.ctl import stage_command as stage
from fleetd.ctl import tui_command
from fleetd.ctl.extra import missing_ctl_package
from fleetd.errors import FleetdError, UsageError
from fleetd.fleet.lab import MAX_NODES as MAX_LAB_NODES
from fleetd.fleet.nodes_file import NODES_FILE_HELP, NodesFileError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


@dataclass(frozen=True)
class Subcommand:
    """One row of SUBCOMMANDS: the name, the help line, what adds its flags, what runs it."""

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
    Subcommand("wheels", deploy.WHEELS_HELP, deploy.configure_wheels, deploy.cmd_wheels),
    Subcommand("ab", ab.AB_HELP, ab.configure_ab, ab.cmd_ab),
    Subcommand("demo", demo.DEMO_HELP, demo.configure_demo, demo.cmd_demo),
    Subcommand("lab", lab.LAB_HELP, lab.configure_lab, lab.cmd_lab),
    Subcommand("model", model.MODEL_HELP, model.configure_model, model.cmd_model),
    Subcommand("plan", plan.PLAN_HELP, plan.configure_plan, plan.cmd_plan),
    Subcommand("stage", stage.STAGE_HELP, stage.configure_stage, stage.cmd_stage),
    Subcommand("serve", serve.SERVE_HELP, serve.configure_serve, serve.cmd_serve),
    Subcommand("tui", tui_command.TUI_HELP, tui_command.configure_tui, tui_command.cmd_tui),
)
COMMANDS = {c.name: c for c in SUBCOMMANDS}

# Numeric options by argparse dest: (smallest allowed, whether that value itself is allowed,
# largest allowed or None). Checked for whichever subcommand has the option.
NUMBER_RANGES: dict[str, tuple[float, bool, float | None]] = {
    "interval": (0, False, None),
    "connect_timeout": (0, False, None),
    "timeout": (0, False, None),
    "count": (1, True, None),
    "lines": (1, True, None),
    "rows": (1, True, None),
    "n_embd": (1, True, None),
    "layers": (0, True, None),
    "steps": (2, True, None),
    "ab_rows": (1, True, None),
    "ab_n_embd": (1, True, None),
    "ab_steps": (2, True, None),
    "rounds": (1, True, 50),
    "n_prompt": (1, True, 4096),
    "n_gen": (2, True, 1024),
    "micro_batches": (2, True, 64),  # ab --model, its ubatch shape
    "server_clients": (1, True, 64),  # ab --model, its server shape
    "server_requests": (1, True, 1000),
    "server_seconds": (0, False, 3600),
    "ctx": (1, True, 1 << 24),
    "parallel": (1, True, 256),
    "port": (0, True, 65535),  # serve's front (0: any free port)
    "replan_after": (0, True, None),  # serve: 0 never
    "threads": (1, True, 4096),  # serve (llama-server's -t), lab up (per fleetd)
    "start_timeout": (0, False, None),
    "nodes": (1, True, 64),  # demo --nodes (elsewhere NODES is the nodes file, a str, not checked)
}
# A subcommand whose option of the same name has another range.
COMMAND_RANGES: dict[str, dict[str, tuple[float, bool, float | None]]] = {
    "lab": {"nodes": (1, True, MAX_LAB_NODES)},
}


def range_error(args: argparse.Namespace) -> str | None:
    """The first numeric option out of its range, as one line; None when all are in range.
    nan and inf are never in range (a timeout of inf is "never", which no command means)."""
    ranges = dict(NUMBER_RANGES, **COMMAND_RANGES.get(getattr(args, "command", None) or "", {}))
    for dest, (least, inclusive, most) in ranges.items():
        value = getattr(args, dest, None)
        if not isinstance(value, int | float) or isinstance(value, bool):
            continue
        flag = "--" + dest.replace("_", "-")
        if not math.isfinite(value):
            return f"{flag} {value}: must be a finite number"
        low = value < least or (value == least and not inclusive)
        if most is not None and inclusive and (low or value > most):
            return f"{flag} {value:g}: must be in {least:g}..{most:g}"
        if low:
            return f"{flag} {value:g}: must be {'at least' if inclusive else 'above'} {least:g}"
        if most is not None and value > most:
            return f"{flag} {value:g}: must be at most {most:g}"
    return None


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """fleetctl's parser and each subcommand's own, by name (for a usage line of the right one)."""
    p = argparse.ArgumentParser(
        prog="fleetctl",
        description="Run fleets of fleetd nodes.",
        epilog=NODES_FILE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("-V", "--version", action="version", version=f"fleetctl {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    parsers = {}
    for c in sorted(SUBCOMMANDS, key=lambda c: c.name):  # --help lists them alphabetically
        parsers[c.name] = sub.add_parser(c.name, help=c.help, description=c.help)
        c.configure(parsers[c.name])
    return p, parsers


def _usage_error(parser: argparse.ArgumentParser, message: str) -> int:
    parser.print_usage(sys.stderr)
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    """Parse, range-check, run the subcommand; our errors become one line and an exit code
    (fleetctl(1)), tracebacks only with --debug."""
    parser, parsers = build_parser()
    # parse_known_args: a flag the subcommand does not know is reported with *its* usage,
    # not the top-level one argparse would print.
    args, unknown = parser.parse_known_args(argv)
    if not args.command:
        return _usage_error(parser, "a command is required (see fleetctl --help)")
    sub = parsers[args.command]
    if unknown:
        return _usage_error(sub, f"unrecognized arguments: {' '.join(unknown)}")
    bad = range_error(args)
    if bad:
        print(f"{sub.prog}: error: {bad}", file=sys.stderr)
        return EXIT_USAGE
    try:
        code = COMMANDS[args.command].run(args)
        sys.stdout.flush()  # here, so a closed pipe is caught below and not at interpreter exit
        return code
    except (NodesFileError, UsageError) as exc:  # the operator's input, like a bad flag
        if args.debug:
            raise
        if isinstance(exc, UsageError):  # a flag: its usage line, as argparse does
            sub.print_usage(sys.stderr)
        print(f"{sub.prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except FleetdError as exc:
        if args.debug:
            raise
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except ModuleNotFoundError as exc:  # `fleetctl tui` imports textual only when it runs
        missing = missing_ctl_package(exc)
        if missing is None or args.debug:
            raise
        print(missing, file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `fleetctl ... | head` closed the pipe: not an error of ours. Point stdout at /dev/null
        # so the interpreter's final flush does not raise again (the Python docs' recipe).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EFBIG) or exc.filename:
            raise
        # `> /dev/full`, a full disk: one line, and no second error at the final flush
        print(f"fleetctl: error: cannot write the output: {exc.strerror}", file=sys.stderr)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
