"""fleetctl tui: the Textual dashboard (tui/) over a nodes file."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

from fleetd.ctl.options import fleet_args, open_fleet

TUI_HELP = "live dashboard: nodes, rates and history, node detail, deploy, P2P switch, A/B runs"


def configure_tui(p) -> None:
    """The flags of `fleetctl tui`: the nodes file, the poll interval, screenshots, the A/B screen."""
    fleet_args(p, json_output=False)
    p.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds between polls of every node (default 1)",
    )
    p.add_argument(
        "--screenshot",
        metavar="PATH",
        help="where the s key writes SVG screenshots: a directory, or a file ending in "
        ".svg (default: the current directory)",
    )
    p.add_argument("--ab-rows", type=int, default=32, metavar="N", help="A/B screen: rows (default 32)")
    p.add_argument(
        "--ab-n-embd", type=int, default=1024, metavar="N", help="A/B screen: hidden size (default 1024)"
    )
    p.add_argument(
        "--ab-steps", type=int, default=5, metavar="N", help="A/B screen: steps per run (default 5)"
    )
    p.add_argument("--ab-model", metavar="GGUF", default="", help="A/B screen: model for the model workload")
    p.add_argument(
        "--no-local", action="store_true", help="A/B screen: no coordinator stage, every stage is a node"
    )
    p.add_argument(
        "--serve-url",
        metavar="URL",
        help="serving panel: the fleetctl serve at URL (http://HOST:PORT; default: the one running "
        "on this machine, if any)",
    )


def _writable_place(path: Path) -> str | None:
    """Why screenshots could not be written under `path` (created on the first one), or None."""
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def tui_args_problem(args) -> str | None:
    """What is wrong with the paths given, found before the dashboard takes the terminal (the
    numbers are range-checked with every command's, fleetd.ctl.main.range_error), or None."""
    if args.screenshot is not None:
        shot = Path(args.screenshot).expanduser()
        if shot.suffix.lower() == ".svg":
            if shot.is_dir():
                return f"--screenshot {args.screenshot}: is a directory (a file path must end in .svg)"
            problem = _writable_place(shot.parent)
        elif shot.exists() and not shot.is_dir():
            return f"--screenshot {args.screenshot}: not a directory, and not a file ending in .svg"
        else:
            problem = _writable_place(shot)
        if problem:
            return f"--screenshot {args.screenshot}: {problem}"
    if args.ab_model and not Path(args.ab_model).expanduser().is_file():
        return f"--ab-model {args.ab_model}: no such file"
    if args.serve_url is not None:
        parts = urlsplit(args.serve_url)
        try:
            parts.port  # noqa: B018 (raises ValueError when out of range or not a number)
        except ValueError:
            return f"--serve-url {args.serve_url}: not a port"
        if parts.scheme != "http" or not parts.hostname:
            return f"--serve-url {args.serve_url}: not an http://HOST:PORT URL"
    return None


def cmd_tui(args) -> int:
    """fleetctl tui: the paths checked (exit 2, one line), then the dashboard over the fleet until
    the operator quits."""
    problem = tui_args_problem(args)
    if problem:
        print(f"fleetctl tui: error: {problem}", file=sys.stderr)
        return 2
    # Imported here: textual loads only for this command, not for every fleetctl call.
    from tui.app import FleetApp
    from tui.screens.ab import AbSettings

    ab = AbSettings(args.ab_rows, args.ab_n_embd, args.ab_steps, not args.no_local, args.ab_model)
    with open_fleet(args) as fleet:
        FleetApp(fleet, args.interval, ab, args.screenshot, args.serve_url).run()
    return 0
