"""fleetctl demo: a local fleet on loopback, llama.cpp and an A/B through it, the stats after.

With --keep the fleet stays up after the report, its nodes file kept on disk, until Ctrl-C or SIGTERM
(whatever signal disposition fleetctl inherited):
`fleetctl tui` or `fleetctl stats` can then be pointed at it from another terminal.
"""

from __future__ import annotations

import json
import signal
import tempfile
import threading
from pathlib import Path

from rich.console import Console

from fleetd.ctl.ab_commands import DEMO_HELP, _llama_run, _print_ab
from fleetd.ctl.options import by_name
from fleetd.fleet.ab import compare
from fleetd.fleet.local import LocalFleet
from fleetd.fleet.render import stats_table, status_table

__all__ = ["DEMO_HELP", "cmd_demo", "configure_demo"]

# What ends a kept demo fleet: Ctrl-C, or a plain kill.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def configure_demo(p) -> None:
    p.add_argument("--nodes", type=int, default=2, help="fleetd processes to start (default 2)")
    p.add_argument("--rows", type=int, default=32, help="hidden state rows of the A/B (default 32)")
    p.add_argument("--n-embd", type=int, default=1024, help="hidden size of the A/B (default 1024)")
    p.add_argument("--steps", type=int, default=5, help="steps per A/B run (default 5)")
    p.add_argument("--no-llama", action="store_true", help="skip the llama.cpp run")
    p.add_argument(
        "--keep",
        action="store_true",
        help="leave the fleet running after the report, until Ctrl-C or SIGTERM; its nodes file stays",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _wait_for_ctrl_c(console: Console, local: LocalFleet) -> None:
    console.print(
        f"[bold]the fleet keeps running[/]: fleetctl tui {local.nodes_file}\n"
        f"nodes file {local.nodes_file} (kept); Ctrl-C stops the fleet"
    )
    stop = threading.Event()
    # Handlers of our own, whatever disposition this process inherited: a parent that starts
    # it in the background (SIGINT ignored, as a non-interactive shell does) can still stop it.
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in STOP_SIGNALS}
    try:
        stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    console.print("stopping the fleet")


def cmd_demo(args) -> int:
    """fleetctl demo: a local fleet, llama-completion against the stock server, the A/B and the
    stats; exit 1 when either comparison differs."""
    console = Console(stderr=args.json)
    report: dict = {}
    console.print(f"starting {args.nodes} fleetd nodes on loopback")
    # --keep: a directory that outlives the command, so the nodes file printed stays valid.
    tmp = tempfile.mkdtemp(prefix="fleetd-demo-") if args.keep else None
    holder = tempfile.TemporaryDirectory(prefix="fleetd-demo-") if tmp is None else None
    workdir = Path(tmp or holder.name)
    try:
        with LocalFleet(args.nodes, workdir) as local:
            fleet = local.fleet
            console.print(f"local fleet: {', '.join(local.endpoints)} (nodes file {local.nodes_file})")
            console.print(status_table(by_name(fleet.map(lambda n: n.status()))))
            if not args.no_llama:
                with console.status("llama-completion on a generated model through the fleet"):
                    report["llama"] = _llama_run(fleet, workdir, console)
                if report["llama"]:
                    console.print(f"[bold]llama-completion --rpc {','.join(local.endpoints)}[/]")
                    console.print(report["llama"]["output"].strip())
                    same = report["llama"]["same_as_stock"]
                    console.print(
                        "(random weights, so the text is noise) same output as the stock "
                        f"ggml-rpc-server: {'[green]yes[/]' if same else '[red]NO[/]'}"
                    )
            with console.status("A/B: hub path vs direct path"):
                report["ab"] = compare(fleet, None, args.rows, args.n_embd, args.steps, True)
            stats = by_name(fleet.map(lambda n: n.stats()))
            report["stats"] = {
                k: (v.doc if not isinstance(v, Exception) else str(v)) for k, v in stats.items()
            }
            report["nodes_file"] = str(local.nodes_file)
            if not args.json:
                _print_ab(report["ab"])
                console.print(stats_table(stats))
            else:
                print(json.dumps(report, indent=2, default=str), flush=True)
            if args.keep:
                _wait_for_ctrl_c(console, local)
    finally:
        if holder is not None:
            holder.cleanup()
    llama_ok = report.get("llama") is None or report["llama"]["same_as_stock"]
    return 0 if report["ab"]["outputs_identical"] and llama_ok else 1
