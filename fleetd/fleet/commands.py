"""fleetctl subcommands. Each registers itself with @command in fleetd.fleet.cli.

Pure formatters (`status_table`, `sessions_table`, `stats_table`, `activity_table`,
`p2p_table`) take `{node name: answer dict or exception}` and return rich Tables; the `cmd_*`
functions fetch, print and raise FleetFailed at the edge when a node failed (exit 1, one line
on stderr after the table, which already shows each down node and its reason).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Mapping

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from fleetd.errors import FleetError
from fleetd.fleet.cli import command
from fleetd.fleet.node import Fleet, FleetResult
from fleetd.fleet.nodes import NODES_FILE_HELP
from fleetd.fleet.ssh import SshOptions

Answers = Mapping[str, "dict | BaseException"]

# -- formatting helpers -----------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_duration(s: float) -> str:
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def down_text(answers: Answers) -> Text | None:
    """Down nodes and their reasons, one line each, printed under a table (too long for a cell)."""
    down = [f"{name}: down: {reason(v)}" for name, v in answers.items() if isinstance(v, BaseException)]
    return Text("\n".join(down), style="red") if down else None


def _down_row(t: Table, name: str) -> None:
    t.add_row(name, Text("down", style="bold red"), *[""] * (len(t.columns) - 2))


def p2p_text(p2p: dict) -> Text:
    if not p2p.get("served", True):
        return Text("n/a", style="dim")
    return Text("on", style="green") if p2p.get("enabled") else Text("off", style="yellow")


def _device_text(d: dict) -> str:
    if d["free"] == d["total"]:
        return f"{d['name']} {fmt_bytes(d['total'])}"
    return f"{d['name']} {fmt_bytes(d['free'])} free of {fmt_bytes(d['total'])}"


# -- pure formatters ---------------------------------------------------------------------------


def status_table(answers: Answers) -> Table:
    """One row per node from GET /v1/status; a down node's row says down, its reason goes below."""
    t = Table(title="fleetd nodes", title_justify="left")
    for col in ("Node", "State", "Version", "RPC", "P2P", "Devices", "Uptime", "Sessions"):
        t.add_column(col, justify="right" if col in ("Uptime", "Sessions") else "left",
                     style="bold" if col == "Node" else None, no_wrap=col != "Devices")
    for name, st in answers.items():
        if isinstance(st, BaseException):
            _down_row(t, name)
            continue
        t.add_row(
            name, Text("up", style="bold green"), st.get("version", "?"),
            f":{st.get('rpc', {}).get('port', '?')}", p2p_text(st.get("p2p", {})),
            ", ".join(_device_text(d) for d in st.get("devices", [])),
            fmt_duration(st.get("uptime_seconds", 0)), str(len(st.get("sessions", []))),
        )
    return t


def sessions_table(answers: Answers) -> Table | None:
    """Open RPC sessions of every node that answered; None when there are none."""
    rows = [(name, s) for name, st in answers.items() if isinstance(st, dict) for s in st.get("sessions", [])]
    if not rows:
        return None
    t = Table(title="sessions", title_justify="left")
    for col in ("Node", "Session", "Peer", "Age", "Commands", "Received", "Sent"):
        t.add_column(col, justify="left" if col in ("Node", "Peer") else "right")
    for name, s in rows:
        t.add_row(name, str(s["id"]), s["peer"], fmt_duration(s["age_seconds"]), f"{s['commands']:,}",
                  fmt_bytes(s["request_bytes"]), fmt_bytes(s["response_bytes"]))
    return t


def stats_table(answers: Answers, previous: Answers | None = None, interval: float | None = None) -> Table:
    """Per node, the commands used since the last reset (count, request and response bytes) and
    a total row; with `previous` (the sample `interval` seconds earlier) also commands per second."""
    rate = bool(previous is not None and interval)
    t = Table(title="RPC commands", title_justify="left")
    t.add_column("Node", style="bold")
    t.add_column("Command")
    t.add_column("Count", justify="right")
    if rate:
        t.add_column("Count/s", justify="right")
    t.add_column("Request", justify="right")
    t.add_column("Response", justify="right")
    for name, st in answers.items():
        if isinstance(st, BaseException):
            _down_row(t, name)
            continue
        cmds = st["total"]["commands"]
        before = previous.get(name) if rate else None
        before = before["total"]["commands"] if isinstance(before, dict) else None
        used = [(c, v) for c, v in cmds.items() if v["count"]]
        total = {k: sum(v[k] for _, v in used) for k in ("count", "request_bytes", "response_bytes")}
        for i, (c, v) in enumerate(used + [("all", total)]):
            row = [name if i == 0 else "", Text(c, style="bold") if c == "all" else c, f"{v['count']:,}"]
            if rate:
                if before is None:
                    row.append("")
                else:
                    prev = sum(b["count"] for b in before.values()) if c == "all" else before.get(c, {}).get("count", 0)
                    row.append(f"{max(0, v['count'] - prev) / interval:,.1f}")
            row += [fmt_bytes(v["request_bytes"]), fmt_bytes(v["response_bytes"])]
            t.add_row(*row, end_section=(c == "all"))
    return t


def activity_table(answers: Answers) -> Table:
    """Per node: graph computes and compute time; peer copies, bytes pushed, fallbacks by reason."""
    t = Table(title="graph computes and peer copies (COPY_TENSOR_TO)", title_justify="left")
    for col in ("Node", "Graphs", "Compute", "Copies", "Pushed", "Confirmed", "Fallbacks"):
        t.add_column(col, justify="left" if col in ("Node", "Fallbacks") else "right")
    for name, st in answers.items():
        if isinstance(st, BaseException):
            _down_row(t, name)
            continue
        total, peer = st["total"], st.get("peer") or {}
        fallbacks = ", ".join(f"{r} {n:,}" for r, n in (peer.get("fallbacks") or {}).items() if n) or "-"
        t.add_row(
            name, f"{total['graph_computes']:,}", f"{total['compute_seconds']:.3f}s",
            f"{peer.get('copies_ok', 0):,}", fmt_bytes(peer.get("bytes_pushed", 0)),
            fmt_bytes(peer.get("bytes_confirmed", 0)), fallbacks,
        )
    return t


def p2p_table(answers: Answers) -> Table:
    """One row per node: peer copy on/off (and what it was, after a switch), or down."""
    t = Table(title="peer copy (P2P)", title_justify="left")
    t.add_column("Node", style="bold")
    t.add_column("P2P")
    t.add_column("Was")
    for name, p in answers.items():
        if isinstance(p, BaseException):
            _down_row(t, name)
            continue
        was = ""
        if "was" in p:
            was = Text("on", style="green") if p["was"] else Text("off", style="yellow")
        t.add_row(name, p2p_text(p), was)
    return t


# -- shared arguments and plumbing -------------------------------------------------------------


def arguments(configure):
    """Attach `configure(parser)` to a command function (read by @command, so it goes below it)."""

    def wrap(fn):
        fn.configure = configure
        return fn

    return wrap


def fleet_args(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = NODES_FILE_HELP
    p.add_argument("nodes", metavar="NODES", help="nodes file (format below)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("-i", "--identity", action="append", default=[], metavar="FILE",
                   help="SSH private key to try first (repeatable; the agent and ~/.ssh are tried too)")
    p.add_argument("--known-hosts", action="append", default=[], metavar="FILE",
                   help="extra known_hosts file (repeatable; ~/.ssh/known_hosts is always read)")
    p.add_argument("--connect-timeout", type=float, default=10.0, metavar="S",
                   help="seconds for the SSH connect and channel open (default 10)")
    p.add_argument("--timeout", type=float, default=30.0, metavar="S",
                   help="seconds for one control API answer (default 30)")


def open_fleet(args) -> Fleet:
    if args.debug:
        logging.basicConfig(level=logging.DEBUG, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for flag, v in (("--connect-timeout", args.connect_timeout), ("--timeout", args.timeout)):
        if not v > 0:
            raise FleetError(f"{flag} {v:g}: must be above 0")
    ssh = SshOptions(connect_timeout=args.connect_timeout, timeout=args.timeout,
                     identity=tuple(args.identity), known_hosts=tuple(args.known_hosts))
    return Fleet.load(args.nodes, ssh)


def _by_name(result: FleetResult) -> dict:
    return {n.name: v for n, v in result.items()}


def _json_doc(result: FleetResult, key: str) -> dict:
    return {
        n.name: ({"up": False, "error": reason(v)} if isinstance(v, BaseException) else {"up": True, key: v})
        for n, v in result.items()
    }


def _print(*renderables) -> None:
    console = Console()
    for r in renderables:
        if r is not None:
            console.print(r)


def _print_json(doc) -> None:
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    sys.stdout.flush()


# -- status ------------------------------------------------------------------------------------


def _status_configure(p):
    fleet_args(p)


@command("status", "version, devices, uptime, sessions and P2P state of every node")
@arguments(_status_configure)
def cmd_status(args) -> int:
    with open_fleet(args) as fleet:
        result = fleet.map(lambda n: n.status())
    if args.json:
        _print_json(_json_doc(result, "status"))
    else:
        answers = _by_name(result)
        _print(status_table(answers), sessions_table(answers), down_text(answers))
    result.raise_on_failure()
    return 0



# -- stats -------------------------------------------------------------------------------------


def _stats_configure(p):
    fleet_args(p)
    p.add_argument("--watch", action="store_true", help="refresh until Ctrl-C (or --count samples)")
    p.add_argument("--interval", type=float, default=2.0, metavar="S", help="seconds between samples (default 2)")
    p.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N samples")
    p.add_argument("--reset", action="store_true", help="zero the counters on every node first")


def _stats_view(answers: Answers, previous: Answers | None, interval: float | None) -> Group:
    parts = [stats_table(answers, previous, interval), activity_table(answers), down_text(answers)]
    return Group(*[p for p in parts if p is not None])


@command("stats", "per-command counts and bytes, graph computes, peer copies and fallbacks")
@arguments(_stats_configure)
def cmd_stats(args) -> int:
    if args.interval <= 0:
        raise FleetError(f"--interval {args.interval:g}: must be above 0")
    if args.count is not None and args.count < 1:
        raise FleetError(f"--count {args.count}: must be 1 or more")
    samples = (args.count or sys.maxsize) if args.watch else 1
    with open_fleet(args) as fleet:
        if args.reset:
            fleet.map(lambda n: n.reset_stats()).raise_on_failure()
        if not args.watch:
            result = fleet.map(lambda n: n.stats())
            if args.json:
                _print_json(_json_doc(result, "stats"))
            else:
                _print(_stats_view(_by_name(result), None, None))
            result.raise_on_failure()
            return 0
        return _watch(fleet, args, samples)


def _watch(fleet: Fleet, args, samples: int) -> int:
    previous, result = None, FleetResult()
    live = None if args.json else Live(console=Console(), auto_refresh=False, transient=False)
    try:
        if live is not None:
            live.start()
        for i in range(samples):  # bounded by --count, else until Ctrl-C
            if i:
                time.sleep(args.interval)
            result = fleet.map(lambda n: n.stats())
            if args.json:  # one JSON object per line per sample
                sys.stdout.write(json.dumps({"time": time.time(), "nodes": _json_doc(result, "stats")}) + "\n")
                sys.stdout.flush()
            else:
                answers = _by_name(result)
                live.update(_stats_view(answers, previous, args.interval), refresh=True)
                previous = answers
    except KeyboardInterrupt:
        pass
    finally:
        if live is not None:
            live.stop()
    return 0 if result.ok else 1



# -- p2p ---------------------------------------------------------------------------------------


def _p2p_configure(p):
    p.add_argument("action", choices=["on", "off", "status"], help="switch peer copy on or off, or show it")
    fleet_args(p)
    p.add_argument("--node", action="append", default=[], metavar="NAME",
                   help="only this node (its name, host or [user@]host[:port]; repeatable)")


@command("p2p", "switch direct server-to-server copy on or off at runtime, or show it")
@arguments(_p2p_configure)
def cmd_p2p(args) -> int:
    with open_fleet(args) as fleet:
        if args.node:
            fleet = fleet.select(args.node)
        if args.action == "status":
            result = fleet.map(lambda n: n.p2p())
        else:
            enabled = args.action == "on"
            result = fleet.map(lambda n: n.set_p2p(enabled))
    if args.json:
        _print_json(_json_doc(result, "p2p"))
    else:
        answers = _by_name(result)
        _print(p2p_table(answers), down_text(answers))
    result.raise_on_failure()
    return 0

