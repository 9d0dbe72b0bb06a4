"""Pure renderers: fleet data in, rich renderables or text out; nothing printed, nothing asked.

fleetctl prints them and the TUI's widgets show them, so both say the same thing the same way.
The tables over many nodes take `{node name: answer or the exception its call raised}`: a down
node gets a "down" row, and `down_text` lists the reasons under the table (too long for a cell).

    status_table, sessions_table   NodeStatus answers (fleetctl status, fleetctl demo)
    fallback_text                  devices that fell back (cpu -> numpy) and why, under the table
    devices_table, fallbacks_table one node's devices and peer copies (the TUI's node screen)
    fmt_count, spark_text          the one number format; a sparkline of recent values
    stats_table, activity_table    NodeStats answers (fleetctl stats, the TUI's counters)
    p2p_table, p2p_text            P2pState answers (fleetctl p2p, the TUI's node table)
    ab_table, ab_verdict           fleetd.fleet.ab.compare's document
    outcome_table, lifecycle_table        fleetctl deploy and start/stop/restart/uninstall
"""

from __future__ import annotations

from collections.abc import Mapping

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from fleetd.fleet.control_docs import Device, NodeStats, NodeStatus, P2pState
from fleetd.fleet.deploy import STEPS, NodeOutcome

Answers = Mapping[str, "NodeStatus | NodeStats | P2pState | BaseException"]

# -- small formatters --------------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_count(n: float, decimals: int = 0) -> str:
    """A count or rate with thousands grouped by spaces, the one number format of every table
    (fleetd.pipeline.report's step table groups the same way): 1 312 016, 3 250.5."""
    return f"{n:,.{decimals}f}".replace(",", " ")


SPARK_BLOCKS = "▁▂▃▄▅▆▇█"


def spark_text(values, width: int = 12, style: str = "cyan") -> Text:
    """The last `width` values as a one-line sparkline, scaled to their own maximum (a run of
    zeros shows as the lowest block, so an idle node still shows a line)."""
    tail = list(values)[-width:]
    if not tail:
        return Text("")
    top = max(tail)
    blocks = "".join(
        SPARK_BLOCKS[0]
        if top <= 0
        else SPARK_BLOCKS[min(len(SPARK_BLOCKS) - 1, int(v / top * (len(SPARK_BLOCKS) - 1) + 0.5))]
        for v in tail
    )
    return Text(blocks.rjust(width, " "), style=style)


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
    """An exception as one line: its class and message."""
    return f"{type(exc).__name__}: {exc}"


def down_text(answers: Answers) -> Text | None:
    """Down nodes and their reasons, one line each, printed under a table (too long for a cell)."""
    down = [f"{name}: down: {reason(v)}" for name, v in answers.items() if isinstance(v, BaseException)]
    return Text("\n".join(down), style="red") if down else None


def fallback_text(answers: Answers) -> Text | None:
    """Devices that came up as a stand-in (cpu -> numpy) and the daemon's reason, one line each."""
    lines = [
        f"{name}: device {d.index} is {d.kind}: {d.fallback}"
        for name, st in answers.items()
        if isinstance(st, NodeStatus)
        for d in st.devices
        if d.fallback
    ]
    return Text("\n".join(lines), style="yellow") if lines else None


def p2p_text(p2p: P2pState) -> Text:
    if not p2p.served:
        return Text("n/a", style="dim")
    return Text("on", style="green") if p2p.enabled else Text("off", style="yellow")


def _on_off(enabled: bool) -> Text:
    return Text("on", style="green") if enabled else Text("off", style="yellow")


def _down_row(t: Table, name: str) -> None:
    t.add_row(name, Text("down", style="bold red"), *[""] * (len(t.columns) - 2))


def _device_text(d: Device) -> str:
    kind = f"{d.kind}, fell back" if d.kind and d.fallback else d.kind
    name = f"{d.name} ({kind})" if kind else d.name
    if d.free == d.total:
        return f"{name} {fmt_bytes(d.total)}"
    return f"{name} {fmt_bytes(d.free)} free of {fmt_bytes(d.total)}"


# -- the control API's answers -----------------------------------------------------------------


def status_table(
    answers: Mapping[str, NodeStatus | BaseException], hosts: Mapping[str, str] | None = None
) -> Table:
    """One row per node from GET /v1/status; a down node's row says down, its reason goes below.
    `hosts` ({name: [user@]host[:port]}) puts the host under a node's name when they differ, so
    a node named with `name=` still shows where it is."""
    t = Table(title="fleetd nodes", title_justify="left")
    for col in ("Node", "State", "Version", "RPC", "P2P", "Devices", "Uptime", "Sessions"):
        t.add_column(
            col,
            justify="right" if col in ("Uptime", "Sessions") else "left",
            style="bold" if col == "Node" else None,
            no_wrap=col != "Devices",
        )
    for name, st in answers.items():
        host = (hosts or {}).get(name, name)
        label = name if host == name else Text.assemble(name, "\n", (host, "dim not bold"))
        if isinstance(st, BaseException):
            t.add_row(label, Text("down", style="bold red"), *[""] * (len(t.columns) - 2))
            continue
        t.add_row(
            label,
            Text("up", style="bold green"),
            st.version,
            f":{st.rpc_port}",
            p2p_text(st.p2p),
            ", ".join(_device_text(d) for d in st.devices),
            fmt_duration(st.uptime_seconds),
            str(len(st.sessions)),
        )
    return t


def memory_bar(used: int, total: int, width: int = 12) -> Text:
    """`used` of `total` as a bar: what is already allocated on a device, for a layer split."""
    filled = 0 if total <= 0 else round(width * min(1.0, used / total))
    return Text.assemble(("█" * filled, "magenta"), ("░" * (width - filled), "dim"))


def devices_table(status: NodeStatus) -> Table:
    """One node's devices: kind (when the daemon says), memory allocated against total."""
    t = Table(title="devices", title_justify="left")
    for col in ("Device", "Kind", "Allocated", "Free", "Total", ""):
        t.add_column(col, justify="right" if col in ("Allocated", "Free", "Total") else "left")
    for d in status.devices:
        used = max(0, d.total - d.free)
        t.add_row(
            f"{d.index}: {d.name}",
            d.kind or Text("-", style="dim"),
            fmt_bytes(used),
            fmt_bytes(d.free),
            fmt_bytes(d.total),
            memory_bar(used, d.total),
        )
    return t


def fallbacks_table(stats: NodeStats) -> Table:
    """One node's peer copies: pushes, bytes, links, and every fallback reason with its count."""
    peer = stats.peer
    t = Table(title="peer copies (COPY_TENSOR_TO)", title_justify="left")
    t.add_column("Counter")
    t.add_column("Value", justify="right")
    t.add_row("copies ok", fmt_count(peer.copies_ok))
    t.add_row("bytes pushed", fmt_bytes(peer.bytes_pushed))
    t.add_row("bytes confirmed", fmt_bytes(peer.bytes_confirmed))
    t.add_row("links opened", fmt_count(peer.links_opened))
    if peer.fallbacks:
        t.add_row(Text("fallbacks by reason", style="italic"), "", end_section=False)
    for r, n in peer.fallbacks.items():
        t.add_row(f"  {r}", Text(fmt_count(n), style="yellow" if n else "dim"))
    return t


def sessions_table(answers: Mapping[str, NodeStatus | BaseException]) -> Table | None:
    """Open RPC sessions of every node that answered; None when there are none."""
    rows = [(name, s) for name, st in answers.items() if isinstance(st, NodeStatus) for s in st.sessions]
    if not rows:
        return None
    t = Table(title="sessions", title_justify="left")
    # Short headers: nine columns and a peer address fit 80 columns; the peer is never folded
    for col in ("Node", "Id", "Peer", "Age", "Cmds", "Recv", "Sent", "Held", "Layers"):
        t.add_column(
            col, justify="left" if col in ("Node", "Peer", "Layers") else "right", no_wrap=col == "Peer"
        )
    for name, s in rows:
        t.add_row(
            name,
            str(s.id),
            s.peer,
            fmt_duration(s.age_seconds),
            fmt_count(s.commands),
            fmt_bytes(s.request_bytes),
            fmt_bytes(s.response_bytes),
            fmt_bytes(s.allocated_bytes),
            layer_ranges(s.layers) or "-",
        )
    return t


def layer_ranges(layers) -> str:
    """0,1,2,3,7 -> "0-3,7": which layers of a model a node holds, short."""
    out: list[str] = []
    for n in sorted(set(layers)):
        if out and out[-1].split("-")[-1] == str(n - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{n}"
        else:
            out.append(str(n))
    return ",".join(out)


def stats_table(
    answers: Mapping[str, NodeStats | BaseException],
    previous: Mapping[str, NodeStats | BaseException | None] | None = None,
    interval: float | None = None,
) -> Table:
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
        if isinstance(st, BaseException):  # "down" where the numbers go, not as a command
            t.add_row(name, "", Text("down", style="bold red"), *[""] * (len(t.columns) - 3))
            continue
        before = previous.get(name) if rate else None
        before = before.total if isinstance(before, NodeStats) else None
        used = list(st.total.used().items())
        total = (
            sum(c.count for _, c in used),
            sum(c.request_bytes for _, c in used),
            sum(c.response_bytes for _, c in used),
        )
        rows = [(c, v.count, v.request_bytes, v.response_bytes) for c, v in used] + [("all", *total)]
        for i, (c, count, req, resp) in enumerate(rows):
            row = [name if i == 0 else "", Text(c, style="bold") if c == "all" else c, fmt_count(count)]
            if rate:
                if before is None:
                    row.append("")
                else:
                    prev = before.command_count if c == "all" else getattr(before.commands.get(c), "count", 0)
                    row.append(fmt_count(max(0, count - prev) / interval, 1))
            row += [fmt_bytes(req), fmt_bytes(resp)]
            t.add_row(*row, end_section=(c == "all"))
    return t


def stats_watch_table(
    answers: Mapping[str, NodeStats | BaseException],
    previous: Mapping[str, NodeStats | BaseException | None] | None = None,
    interval: float | None = None,
) -> Table:
    """One row per node (stats --watch where the per-command table does not fit): commands and
    bytes since the reset, their rates since the sample before, and the busiest commands."""
    t = Table(title="RPC commands (busiest since the sample before)", title_justify="left")
    for col in ("Node", "Commands", "/s", "Bytes", "Bytes/s", "Busiest"):
        t.add_column(col, justify="left" if col in ("Node", "Busiest") else "right", no_wrap=col != "Busiest")
    for name, st in answers.items():
        if isinstance(st, BaseException):
            t.add_row(name, Text("down", style="bold red"), *[""] * 4)
            continue
        before = (previous or {}).get(name)
        before = before if isinstance(before, NodeStats) and before.since == st.since else None
        used = st.total.used()
        if before is not None and interval:
            delta = {c: v.count - getattr(before.total.commands.get(c), "count", 0) for c, v in used.items()}
            moved = st.total.bytes_moved - before.total.bytes_moved
            rates = (
                fmt_count(max(0, st.total.command_count - before.total.command_count) / interval, 1),
                f"{fmt_bytes(max(0, moved) / interval)}/s",
            )
        else:
            delta, rates = {c: v.count for c, v in used.items()}, ("", "")
        busiest = sorted((n, c) for c, n in delta.items() if n > 0)[::-1][:2]
        t.add_row(
            name,
            fmt_count(st.total.command_count),
            rates[0],
            fmt_bytes(st.total.bytes_moved),
            rates[1],
            ", ".join(f"{c} {fmt_count(n)}" for n, c in busiest) or "-",
        )
    return t


def command_table(stats: NodeStats, rates: Mapping[str, tuple[float, float]] | None = None) -> Table:
    """One node's commands since the last reset: count, bytes in and out, and with `rates`
    ({command: (count/s, bytes/s)}, from the last two polls) the rate of each."""
    t = Table(title="RPC commands", title_justify="left")
    cols = ("Command", "Count", *(("Count/s", "Bytes/s") if rates is not None else ()), "Request", "Response")
    for col in cols:
        t.add_column(col, justify="left" if col == "Command" else "right")
    for name, c in stats.total.used().items():
        r = (rates or {}).get(name, (0.0, 0.0))
        live = (fmt_count(r[0], 1), f"{fmt_bytes(r[1])}/s") if rates is not None else ()
        t.add_row(name, fmt_count(c.count), *live, fmt_bytes(c.request_bytes), fmt_bytes(c.response_bytes))
    return t


def activity_table(answers: Mapping[str, NodeStats | BaseException]) -> Table:
    """Per node: graph computes and compute time; peer copies, bytes pushed, fallbacks by reason."""
    t = Table(title="graph computes and peer copies (COPY_TENSOR_TO)", title_justify="left")
    for col in ("Node", "Graphs", "Compute", "Copies", "Pushed", "Confirmed", "Fallbacks"):
        t.add_column(col, justify="left" if col in ("Node", "Fallbacks") else "right")
    for name, st in answers.items():
        if isinstance(st, BaseException):
            _down_row(t, name)
            continue
        peer = st.peer
        fallbacks = ", ".join(f"{r} {fmt_count(n)}" for r, n in peer.fallbacks.items() if n) or "-"
        t.add_row(
            name,
            fmt_count(st.total.graph_computes),
            f"{st.total.compute_seconds:.3f}s",
            fmt_count(peer.copies_ok),
            fmt_bytes(peer.bytes_pushed),
            fmt_bytes(peer.bytes_confirmed),
            fallbacks,
        )
    return t


def p2p_table(answers: Mapping[str, P2pState | BaseException]) -> Table:
    """One row per node: peer copy on/off (and what it was, after a switch), or down."""
    t = Table(title="peer copy (P2P)", title_justify="left")
    t.add_column("Node", style="bold")
    t.add_column("P2P")
    switched = any(not isinstance(p, BaseException) and p.was is not None for p in answers.values())
    if switched:  # only after a switch: `p2p status` has nothing to put there
        t.add_column("Was")
    for name, p in answers.items():
        if isinstance(p, BaseException):
            _down_row(t, name)
            continue
        t.add_row(name, p2p_text(p), *([] if not switched else ["" if p.was is None else _on_off(p.was)]))
    return t


# -- A/B ---------------------------------------------------------------------------------------


def ab_table(doc: dict) -> Table:
    """Both arms of fleetd.fleet.ab.compare side by side: commands and bytes per step, what the
    nodes counted, time per step, output md5."""
    arms = doc["arms"]
    table = Table(
        title=f"hub vs direct: {doc['stages']} stages, {doc['layers']} layers, "
        f"{doc['rows']} x {doc['n_embd']} f32"
    )
    table.add_column("")
    for arm in arms:
        table.add_column(arm, justify="right")
    rows = [
        ("COPY_TENSOR_TO per step", lambda a: f"{a['per_step']['commands'].get('COPY_TENSOR_TO', 0):.2f}"),
        ("GET_TENSOR per step", lambda a: f"{a['per_step']['commands'].get('GET_TENSOR', 0):.2f}"),
        ("SET_TENSOR per step", lambda a: f"{a['per_step']['commands'].get('SET_TENSOR', 0):.2f}"),
        (
            "coordinator bytes per step",
            lambda a: fmt_count(a["per_step"]["request_bytes"] + a["per_step"]["response_bytes"]),
        ),
        ("peer copies counted by nodes", lambda a: str(a["node_peer_copies"])),
        ("fallbacks counted by nodes", lambda a: str(a["node_fallbacks"])),
        ("seconds per step (median)", lambda a: f"{a['seconds_per_step']:.4f}"),
        ("output md5", lambda a: a["md5"][:12]),
    ]
    for label, fn in rows:
        table.add_row(label, *(fn(a) for a in arms.values()))
    return table


def ab_verdict(doc: dict) -> Text:
    """Outputs first (they must match), then the speed: time per step of hub over direct, and
    whether the runs' ranges overlap (ABBA: one run per arm and round; one round has no spread)."""
    if not doc["outputs_identical"]:
        return Text("outputs of all runs: DIFFERENT", style="bold red")
    per_arm: dict[str, list[float]] = {}
    for run in doc.get("runs", []):
        per_arm.setdefault(run["arm"], []).append(run["seconds_per_step"])
    hub, direct = per_arm.get("hub"), per_arm.get("direct")
    speed = ""
    if doc["arms"].get("direct", {}).get("node_peer_copies", 1) == 0:
        speed = "; the direct arm never copied (both arms ran the hub path): no speed verdict"
    elif hub and direct and min(direct) > 0:
        ratio = doc["arms"]["hub"]["seconds_per_step"] / doc["arms"]["direct"]["seconds_per_step"]
        if len(direct) < 2 or len(hub) < 2:
            spread = "one run per arm: no spread to judge it by"
        elif max(direct) < min(hub):
            spread = "faster beyond the spread of the runs"
        elif min(direct) > max(hub):
            spread = "slower beyond the spread of the runs"
        else:
            spread = "within the spread of the runs"
        speed = f"; direct vs hub: x{ratio:.2f} steps/s ({spread})"
    return Text(f"outputs of all runs: identical{speed}", style="bold green")


# -- deploy and the lifecycle commands ---------------------------------------------------------

OUTCOME_STYLE = {
    "deployed": "green",
    "unchanged": "cyan",
    "planned": "blue",
    "rolled-back": "yellow",
    "failed": "red",
}


def outcome_table(outcomes: list[NodeOutcome]) -> Table:
    """deploy's table: one row per node, its status, releases, steps, detail and warnings."""
    table = Table(title="fleetctl deploy")
    for col in ("Node", "Status", "Release", "Previous", "Steps"):
        table.add_column(col, overflow="fold")
    for o in outcomes:
        style = OUTCOME_STYLE.get(o.status, "")
        steps = "\n".join(f"{s}: {o.steps[s]}" for s in STEPS if s in o.steps)
        # a warning: the node is up, not as configured; under its steps, in yellow
        warnings = [f"[yellow]warning: {escape(w)}[/]" for w in o.warnings]
        table.add_row(
            o.node,
            f"[{style}]{o.status}[/]",
            o.release or "-",
            o.previous or "-",
            "\n".join(x for x in (steps, o.detail, *warnings) if x),
        )
    return table


def lifecycle_table(command: str, rows: Mapping[str, dict]) -> Table:
    """One row per node: its status, or its error in red (fleetctl start/stop/restart/uninstall)."""
    table = Table(title=f"fleetctl {command}")
    table.add_column("Node")
    table.add_column("Result")
    for node, v in rows.items():
        table.add_row(node, v.get("error") and f"[red]{v['error']}[/]" or v.get("status", ""))
    return table


# -- A/B on a real model (fleetd.fleet.model_ab) -----------------------------------------------


def model_ab_metrics(doc: dict) -> dict[str, str]:
    """{metric: label} of what the run measured (its arms' medians), in METRICS order."""
    from fleetd.fleet.model_ab import METRIC_LABELS

    measured = next(iter(doc["arms"].values()))["median"] if doc["arms"] else {}
    return {m: label for m, label in METRIC_LABELS.items() if m in measured}


def _model_ab_sizes(s: dict) -> str:
    """The sizes in a title: "pp 128, tg 32, 4 micro-batches of 32, 4 and 8 sequences, server
    4 clients"; pp and tg always (llama-completion uses them), the rest when its shape ran."""
    shapes = s.get("shapes", ())
    parts = [f"pp {s['n_prompt']}", f"tg {s['n_gen']}"]
    if "ubatch" in shapes:
        parts.append(f"{s['micro_batches']} micro-batches of {s['ubatch']}")
    if s.get("batched_sequences"):
        parts.append(f"{' and '.join(map(str, s['batched_sequences']))} sequences")
    if "server" in shapes:
        parts.append(f"server {s['server_clients']} clients")
    return ", ".join(parts)


def model_ab_table(doc: dict) -> Table:
    """ModelAbResult.as_dict(): per arm the median and min..max over rounds, copies, md5."""
    s = doc["settings"]
    table = Table(
        title=f"hub vs direct: {doc['stages']} RPC stages, {doc['model'].rsplit('/', 1)[-1]}, "
        f"{s['rounds']} rounds, {_model_ab_sizes(s)}"
    )
    table.add_column("")
    for arm in doc["arms"]:
        table.add_column(arm, justify="right")
    for key, label in model_ab_metrics(doc).items():
        table.add_row(
            f"{label} (median, min..max)",
            *(
                f"{a['median'][key]:.2f} ({a['spread'][key][0]:.2f}..{a['spread'][key][1]:.2f})"
                for a in doc["arms"].values()
            ),
        )
    table.add_row("peer copies counted by nodes", *(str(a["copies_ok"]) for a in doc["arms"].values()))
    table.add_row(
        "fallbacks counted by nodes",
        *(", ".join(f"{r} {n}" for r, n in a["fallbacks"].items()) or "0" for a in doc["arms"].values()),
    )
    table.add_row("greedy text md5", *(a["md5"][:12] for a in doc["arms"].values()))
    if any(a.get("server_md5") for a in doc["arms"].values()):
        table.add_row("llama-server texts md5", *(a["server_md5"][:12] for a in doc["arms"].values()))
    return table


def model_ab_steps_table(doc: dict) -> Table:
    """Per decode step: the commands and bytes on the coordinator's links (the client's
    GGML_RPC_STATS) and the commands the nodes served (/v1/stats)."""
    from fleetd.fleet.model_ab import STEP_COMMANDS

    table = Table(title="per decode step (llama-completion -n N minus -n 1, over N-1 steps)")
    table.add_column("")
    for arm in doc["arms"]:
        table.add_column(arm, justify="right")
    steps = {arm: a["per_step"] for arm, a in doc["arms"].items()}
    for cmd in STEP_COMMANDS:
        table.add_row(
            f"coordinator {cmd}", *(f"{s['client'].get(cmd, {}).get('count', 0):.2f}" for s in steps.values())
        )
    for cmd in STEP_COMMANDS:
        table.add_row(f"nodes {cmd}", *(f"{s['nodes'].get(cmd, 0):.2f}" for s in steps.values()))
    table.add_row("coordinator link bytes", *(fmt_bytes(s["coordinator_bytes"]) for s in steps.values()))
    table.add_row("peer link bytes", *(fmt_bytes(s["peer_bytes"]) for s in steps.values()))
    return table


def model_ab_bars(doc: dict, columns: int = 80) -> Table:
    """The terminal plot: one bar per arm and metric, scaled to the metric's largest max, as
    wide as `columns` leaves after the labels (a bar rich had to cut would hide the ratio)."""
    table = Table(title="rates, median (bar) and min..max over rounds", show_header=False, box=None)
    for col in ("metric", "arm", "bar", "value"):
        table.add_column(col, no_wrap=True)
    styles = ("blue", "dark_orange", "green", "magenta")
    metrics = model_ab_metrics(doc)
    values = [
        f"{a['median'][k]:.2f} ({a['spread'][k][0]:.2f}..{a['spread'][k][1]:.2f})"
        for k in metrics
        for a in doc["arms"].values()
    ]
    labels = max(map(len, metrics.values())) + max(map(len, doc["arms"])) + max(map(len, values))
    width = max(8, min(40, columns - labels - 8))  # 8: the padding between four columns
    for key, label in metrics.items():
        peak = max(a["spread"][key][1] for a in doc["arms"].values()) or 1.0
        for i, (arm, a) in enumerate(doc["arms"].items()):
            n = round(width * a["median"][key] / peak)
            bar = Text("█" * n + " " * (width - n), style=styles[i % len(styles)])
            lo, hi = a["spread"][key]
            table.add_row(label if i == 0 else "", arm, bar, f"{a['median'][key]:.2f} ({lo:.2f}..{hi:.2f})")
    return table


def model_ab_verdict(doc: dict) -> Text:
    if not doc["ok"]:
        return Text(doc["verdict"], style="bold red")
    return Text(doc["verdict"], style="bold green" if doc["direct_ran"] else "bold yellow")


def model_ab_chart_panels(doc: dict) -> dict:
    """{metric label: {arm: (median, min, max)}}: what fleetd.fleet.chart draws."""
    return {
        label: {arm: (a["median"][key], *a["spread"][key]) for arm, a in doc["arms"].items()}
        for key, label in model_ab_metrics(doc).items()
    }
