"""fleetctl status | stats | p2p: the control API of every node, side by side.

Each `cmd_*` fetches, prints (fleetd.fleet.render's tables, or --json) and raises FleetFailed at
the edge when a node failed (exit 1, one line on stderr after the table, which already shows each
down node and its reason).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from fleetd.ctl.options import by_name, fleet_args, json_doc, open_fleet, print_json, print_renderables
from fleetd.errors import UsageError
from fleetd.fleet.control_docs import NodeStats, NodeStatus
from fleetd.fleet.node import Fleet, FleetResult, Node
from fleetd.fleet.render import (
    activity_table,
    down_text,
    fallback_text,
    fmt_bytes,
    fmt_count,
    p2p_table,
    reason,
    sessions_table,
    stats_table,
    stats_watch_table,
    status_table,
)
from fleetd.fleet.stage import staged_models

# -- status ------------------------------------------------------------------------------------

STATUS_HELP = "version, devices, uptime, sessions and P2P state of every node"


def node_arg(p) -> None:
    p.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="NAME",
        help="only this node (its name, host or [user@]host[:port]; repeatable)",
    )


def configure_status(p) -> None:
    fleet_args(p)
    node_arg(p)


def _selected(fleet: Fleet, args) -> Fleet:
    return fleet.select(args.node) if args.node else fleet


def status_and_hello(node: Node) -> NodeStatus:
    """The control API's status, and HELLO on the RPC port: a node whose RPC port is closed is
    not up, whatever its control API says."""
    status = node.status()
    node.hello(status.rpc_host)
    return status


def cmd_status(args) -> int:
    """fleetctl status: every selected node's status and an RPC HELLO, and what `fleetctl stage`
    put in its cache directory; tables or --json."""
    with open_fleet(args) as fleet:
        fleet = _selected(fleet, args)
        result = fleet.map(status_and_hello)
        staged = fleet.map(staged_models)
    if args.json:
        doc = json_doc(result, "status")
        for node, models in staged.items():
            if not isinstance(models, BaseException):
                doc[node.name]["staged"] = [asdict(m) for m in models]
        print_json(doc)
    else:
        answers = by_name(result)
        hosts = {n.name: n.spec.target for n in result}
        print_renderables(
            status_table(answers, hosts),
            sessions_table(answers),
            staged_text(staged),
            fallback_text(answers),
            down_text(answers),
        )
    result.raise_on_failure()
    return 0


def staged_text(staged: FleetResult) -> Text | None:
    """One line per model a node holds staged ("n1: model m.gguf: 6 of 6 tensors (...) staged")."""
    lines = [
        f"{node.name}: {m.line()}"
        for node, models in staged.items()
        if not isinstance(models, BaseException)
        for m in models
    ]
    return Text("\n".join(lines)) if lines else None


# -- stats -------------------------------------------------------------------------------------

STATS_HELP = "per-command counts and bytes, graph computes, peer copies and fallbacks"


def configure_stats(p) -> None:
    fleet_args(p)
    node_arg(p)
    p.add_argument("--watch", action="store_true", help="refresh until Ctrl-C (or --count samples)")
    p.add_argument(
        "--interval", type=float, default=2.0, metavar="S", help="seconds between samples (default 2)"
    )
    p.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N samples")
    p.add_argument("--reset", action="store_true", help="zero the counters on every node first")


def _stats_view(answers, previous, interval: float | None) -> Group:
    parts = [stats_table(answers, previous, interval), activity_table(answers), down_text(answers)]
    return Group(*[p for p in parts if p is not None])


def watch_view(answers, previous, interval: float, console: Console) -> Group:
    """The per-command view when it fits the terminal, else one row per node: either way the
    peer copies table stays on screen."""
    full = _stats_view(answers, previous, interval)
    if len(console.render_lines(full, console.options, pad=False)) < console.height:
        return full
    parts = [stats_watch_table(answers, previous, interval), activity_table(answers), down_text(answers)]
    return Group(*[p for p in parts if p is not None])


def cmd_stats(args) -> int:
    """fleetctl stats: one sample of every selected node's counters, or --watch samples until
    Ctrl-C or --count."""
    if args.count is not None and not args.watch:
        raise UsageError(f"--count {args.count} counts --watch samples: add --watch")
    samples = (args.count or sys.maxsize) if args.watch else 1
    with open_fleet(args) as fleet:
        fleet = _selected(fleet, args)
        if args.reset:
            fleet.map(lambda n: n.reset_stats()).raise_on_failure()
        if not args.watch:
            result = fleet.map(lambda n: n.stats())
            if args.json:
                print_json(json_doc(result, "stats"))
            else:
                print_renderables(_stats_view(by_name(result), None, None))
            result.raise_on_failure()
            return 0
        return _watch(fleet, args, samples)


def stats_line(at: float, answers, previous, interval: float) -> str:
    """One sample as one line of text (stats --watch into a pipe or file): per node its commands
    and bytes since the reset, and commands per second since the sample before."""
    parts = []
    for name, st in answers.items():
        if isinstance(st, BaseException):
            parts.append(f"{name} down ({reason(st)})")
            continue
        before = (previous or {}).get(name)
        rate = ""
        if isinstance(before, NodeStats) and before.since == st.since:
            rate = (
                f" {fmt_count(max(0, st.total.command_count - before.total.command_count) / interval, 1)}/s"
            )
        parts.append(
            f"{name} {fmt_count(st.total.command_count)} commands{rate} "
            f"{fmt_bytes(st.total.bytes_moved)} peer copies {fmt_count(st.peer.copies_ok)}"
        )
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
    return f"{stamp} " + "; ".join(parts)


def _watch(fleet: Fleet, args, samples: int) -> int:
    previous, result = None, FleetResult()
    # A live table only on a terminal; into a pipe or file, one line per sample (JSON with --json).
    lines = args.json or not sys.stdout.isatty()
    live = None if lines else Live(console=Console(), auto_refresh=False, transient=False)
    try:
        if live is not None:
            live.start()
        for i in range(samples):  # bounded by --count, else until Ctrl-C
            if i:
                time.sleep(args.interval)
            result = fleet.map(lambda n: n.stats())
            answers = by_name(result)
            if args.json:
                sys.stdout.write(json.dumps({"time": time.time(), "nodes": json_doc(result, "stats")}) + "\n")
            elif lines:
                sys.stdout.write(stats_line(time.time(), answers, previous, args.interval) + "\n")
            else:
                live.update(watch_view(answers, previous, args.interval, live.console), refresh=True)
            if lines:
                sys.stdout.flush()
            previous = answers
    finally:  # Ctrl-C goes on to fleetctl's main: exit 130, as for every command
        if live is not None:
            live.stop()
    return 0 if result.ok else 1


# -- p2p ---------------------------------------------------------------------------------------

P2P_HELP = "switch direct server-to-server copy on or off at runtime, or show it"


def p2p_action(value: str) -> str:
    if value not in ("on", "off", "status"):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not on, off or status: the action comes "
            f"before the nodes file (fleetctl p2p status NODES)"
        )
    return value


def configure_p2p(p) -> None:
    p.add_argument(
        "action", type=p2p_action, metavar="{on,off,status}", help="switch peer copy on or off, or show it"
    )
    fleet_args(p)
    node_arg(p)


def cmd_p2p(args) -> int:
    """fleetctl p2p: show peer copy on the selected nodes, or switch it on or off."""
    with open_fleet(args) as fleet:
        fleet = _selected(fleet, args)
        if args.action == "status":
            result = fleet.map(lambda n: n.p2p())
        else:
            enabled = args.action == "on"
            result = fleet.map(lambda n: n.set_p2p(enabled))
    if args.json:
        print_json(json_doc(result, "p2p"))
    else:
        answers = by_name(result)
        print_renderables(p2p_table(answers), down_text(answers))
    result.raise_on_failure()
    return 0
