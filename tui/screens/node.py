"""NodeScreen: one node in detail. Per-command counters with their rates (count and bytes per
second), the last minutes as sparklines, sessions, peer copies and fallbacks by reason, memory
allocated per device against its total with the device kind, and the tail of the node's log,
fetched over SSH in a thread worker (the Deployer's `logs`, what `fleetctl logs` prints).

The dashboard under it keeps polling; this screen reads its samples and histories on its own
timer, so there is still one poll per node however many screens show it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar, Protocol

from rich.console import Group
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Static
from textual.worker import get_current_worker

from fleetd.fleet.control_docs import NodeStatus
from fleetd.fleet.deploy import Deployer
from fleetd.fleet.node import Fleet, Node
from fleetd.fleet.render import (
    command_table,
    devices_table,
    fallbacks_table,
    fmt_duration,
    p2p_text,
    reason,
    sessions_table,
)
from tui.history import History
from tui.widgets import HistoryPanel
from tui.widgets.counters import per_command
from tui.widgets.node_table import fmt_age


class NodeSource(Protocol):
    """What this screen reads from the screen that polls (the dashboard)."""

    fleet: Fleet
    interval: float
    nodes: Mapping[str, Node]
    samples: Mapping
    histories: Mapping[str, History]
    clock: Callable[[], float]

    def is_stale(self, key: str) -> bool: ...

    def answered_age(self, key: str) -> float | None: ...

    def hanging_poll_age(self, key: str) -> float | None: ...


LOG_LINES = 20
NARROW_NODE_SCREEN = 110  # columns below which peer copies and devices stack
LOG_REFRESH_S = 5.0


class NodeScreen(Screen):
    """One node in detail, from the dashboard's samples; its log fetched on demand."""

    BINDINGS: ClassVar[list[BindingType]] = [
        ("escape", "app.pop_screen", "Back"),
        ("l", "refresh_log", "Reload log"),
    ]

    def __init__(self, dashboard: NodeSource, key: str) -> None:
        super().__init__()
        self.dashboard = dashboard
        self.key = key
        self.node = dashboard.nodes[key]
        self.log_lines: list[str] | BaseException | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        with VerticalScroll(id="node-body"):
            yield Static(id="node-summary")
            yield HistoryPanel(id="node-history")
            yield Static(id="node-commands")
            with Horizontal(id="node-counters"):
                yield Static(id="node-peer")
                yield Static(id="node-devices")
            yield Static(id="node-sessions")
            yield Static(Text("log: fetching…", style="dim"), id="node-log")
        yield Footer()

    def on_resize(self) -> None:
        self.query_one("#node-counters").set_class(self.size.width < NARROW_NODE_SCREEN, "narrow")

    def on_mount(self) -> None:
        self.on_resize()
        self.sub_title = f"node {self.node.name}"
        self.query_one("#node-history").border_title = "the last minutes"
        self.query_one("#node-log").border_title = f"log (last {LOG_LINES} lines)"
        self.refresh_view()
        self.set_interval(self.dashboard.interval, self.refresh_view)
        self.action_refresh_log()
        self.set_interval(LOG_REFRESH_S, self.action_refresh_log)

    def refresh_view(self) -> None:
        sample = self.dashboard.samples.get(self.key)
        spec = self.node.spec
        where = f"{spec.target}  rpc {spec.rpc_endpoint}  control 127.0.0.1:{spec.control_port}"
        self.query_one("#node-history", HistoryPanel).history = self.dashboard.histories[self.key]
        commands = self.query_one("#node-commands", Static)
        if sample is None:
            self.query_one("#node-summary", Static).update(
                Text.assemble((self.node.name, "bold"), "  ", where, ("\nnot answered yet", "dim"))
            )
            commands.update("")
            return
        answered = self.dashboard.answered_age(self.key)
        hanging = self.dashboard.hanging_poll_age(self.key)
        if answered is None:
            when = "never answered"
        else:
            age = fmt_age(answered, 1.5 * self.dashboard.interval)
            when = "answered just now" if age == "now" else f"last answered {age} ago"
        if hanging is not None:
            poll = f"a poll has been waiting {fmt_duration(hanging)}"
        else:
            poll = (
                f"poll took {sample.latency * 1000:.0f} ms" if sample.latency is not None else "poll took ?"
            )
        stale = self.dashboard.is_stale(self.key)
        seen = Text(f"{when}, {poll}", style="bold yellow" if stale or hanging is not None else "dim")
        st = sample.status
        if isinstance(st, BaseException):
            state = Text(f"down: {reason(st)}", style="bold red")
        else:
            state = Text.assemble(
                ("stale" if stale else "up", "bold yellow" if stale else "bold green"),
                f"  fleetd {st.version}  protocol {st.protocol}  up {fmt_duration(st.uptime_seconds)}  P2P ",
                p2p_text(st.p2p),
            )
        self.query_one("#node-summary", Static).update(
            Text.assemble((self.node.name, "bold"), "  ", where, "\n", state, "\n", seen)
        )
        commands.update(
            command_table(sample.stats, per_command(sample.rates))
            if sample.stats is not None
            else Text("no counters", style="dim")
        )
        peer = self.query_one("#node-peer", Static)
        peer.update(fallbacks_table(sample.stats) if sample.stats is not None else "")
        if isinstance(st, NodeStatus):
            self.query_one("#node-devices", Static).update(devices_table(st))
            sessions = sessions_table({self.node.name: st})
            self.query_one("#node-sessions", Static).update(
                sessions if sessions is not None else Text("no open RPC sessions", style="dim")
            )

    # -- the log, over SSH -------------------------------------------------------------------

    def action_refresh_log(self) -> None:
        self.fetch_log()

    @work(thread=True, exclusive=True, group="node-log")
    def fetch_log(self) -> None:
        worker = get_current_worker()
        try:
            lines = Deployer(self.dashboard.fleet, None).logs(self.node, LOG_LINES)["lines"]
        except Exception as exc:  # not deployed here, SSH down: the reason is the log panel
            lines = exc
        if not worker.is_cancelled:
            self.app.call_from_thread(self._show_log, lines)

    def _show_log(self, lines: list[str] | BaseException) -> None:
        self.log_lines = lines
        panel = self.query_one("#node-log", Static)
        if isinstance(lines, BaseException):
            panel.update(Text(f"log: {reason(lines)}", style="yellow"))
        else:
            panel.update(Group(*(Text(line, no_wrap=True, overflow="ellipsis") for line in lines)))
