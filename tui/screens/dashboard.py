"""DashboardScreen: every node's state and live counters, the P2P switch, stats reset.

Polling: a `set_interval` timer starts one thread worker per node (group `poll:<key>`), which
asks /v1/status and /v1/stats and hands both back with `call_from_thread`. A node whose poll is
still running is skipped, so a slow or hung node holds one thread, not one per tick. A P2P
switch or a stats reset re-polls at once; `exclusive=True` then cancels the poll in flight, whose
answer predates the change and is dropped (`is_cancelled`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial
from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import BindingType
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Static
from textual.worker import Worker, get_current_worker

from fleetd.fleet.control_docs import NodeStats, NodeStatus, P2pState
from fleetd.fleet.node import Fleet, Node
from fleetd.fleet.render import down_text, reason
from tui.widgets import Counters, NodeRow, NodeTable, PeerToggle, Rates, rates_between
from tui.widgets.counters import CounterSample


@dataclass(frozen=True)
class Sample:
    """One node's latest poll, and what the rates need from the poll before it."""

    status: NodeStatus | BaseException
    stats: NodeStats | None
    at: float  # time.monotonic() when the answer arrived
    previous: NodeStats | None = None
    seconds: float | None = None
    rates: Rates | None = None


class DashboardScreen(Screen):
    BINDINGS: ClassVar[list[BindingType]] = [
        ("p", "toggle_p2p", "Toggle P2P"),
        ("r", "reset_stats", "Reset stats"),
    ]

    def __init__(self, fleet: Fleet, interval: float = 1.0) -> None:
        super().__init__()
        self.fleet = fleet
        self.interval = interval
        # Row keys are positions in the nodes file: names are not guaranteed to be unique.
        self.nodes: dict[str, Node] = {str(i): node for i, node in enumerate(fleet)}
        self.samples: dict[str, Sample] = {}
        self.p2p_pending: set[str] = set()
        self._polls: dict[str, Worker] = {}

    def compose(self) -> ComposeResult:
        yield Header()
        yield NodeTable(id="nodes")
        yield Static(id="down")
        yield PeerToggle(id="p2p")
        yield Counters(id="counters")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(NodeTable)
        for key, node in self.nodes.items():
            table.show(key, NodeRow(node.name))
        self._show_selected()
        self.poll_all()
        self._timer = self.set_interval(self.interval, self.poll_all)

    # Another screen on top (the A/B runner): stop polling, so the A/B has the nodes to itself.
    def on_screen_suspend(self) -> None:
        self._timer.pause()

    def on_screen_resume(self) -> None:
        self._timer.resume()
        self.poll_all()

    # -- polling -----------------------------------------------------------------------------

    def poll_all(self) -> None:
        for key in self.nodes:
            running = self._polls.get(key)
            if running is None or running.is_finished:
                self.poll(key)

    def poll(self, key: str) -> None:
        self._polls[key] = self.run_worker(
            partial(self._poll_node, key, self.nodes[key]), name=f"poll {self.nodes[key].name}",
            group=f"poll:{key}", exclusive=True, thread=True)

    def _poll_node(self, key: str, node: Node) -> None:
        """Thread: ask the node; any failure, an answer of another shape too, is the node's
        state, shown with its reason."""
        worker = get_current_worker()
        try:
            status = node.status()
            stats = node.stats()
        except Exception as exc:
            status, stats = exc, None
        at = time.monotonic()
        if not worker.is_cancelled:
            self.app.call_from_thread(self._polled, key, status, stats, at)

    def _polled(self, key: str, status: NodeStatus | BaseException, stats: NodeStats | None, at: float) -> None:
        before = self.samples.get(key)
        sample = Sample(status, stats, at)
        if before is not None and before.stats is not None and stats is not None:
            seconds = at - before.at
            sample = replace(sample, previous=before.stats, seconds=seconds,
                             rates=rates_between(before.stats, stats, seconds))
        self.samples[key] = sample
        self._show(key)

    # -- attributes down ---------------------------------------------------------------------

    def _show(self, key: str) -> None:
        sample = self.samples.get(key)
        row = NodeRow(self.nodes[key].name, p2p_pending=key in self.p2p_pending)
        if sample is not None:
            row = replace(row, status=sample.status, stats=sample.stats, rates=sample.rates)
        self.query_one(NodeTable).show(key, row)
        self.query_one("#down", Static).update(down_text({
            self.nodes[k].name: s.status for k, s in self.samples.items()
            if isinstance(s.status, BaseException)
        }) or "")
        if key == self.query_one(NodeTable).selected_key:
            self._show_selected()

    def _show_selected(self) -> None:
        key = self.query_one(NodeTable).selected_key
        toggle, counters = self.query_one(PeerToggle), self.query_one(Counters)
        if key is None:
            toggle.node_key, counters.sample = None, None
            return
        name, sample = self.nodes[key].name, self.samples.get(key)
        status = sample.status if sample is not None else None
        p2p = status.p2p if isinstance(status, NodeStatus) else None
        toggle.node_key, toggle.node_name = key, name
        counters.border_title = f"{name}: commands since the last reset"
        toggle.enabled = p2p.enabled if p2p is not None and p2p.served else None
        toggle.pending = key in self.p2p_pending
        counters.sample = (CounterSample(name, sample.stats, sample.previous, sample.seconds)
                           if sample is not None else CounterSample(name, None))

    @on(DataTable.RowHighlighted, "#nodes")
    def _selection_moved(self) -> None:
        self._show_selected()

    # -- P2P switch --------------------------------------------------------------------------

    def action_toggle_p2p(self) -> None:
        self.query_one(PeerToggle).toggle()

    def on_peer_toggle_changed(self, event: PeerToggle.Changed) -> None:
        self.p2p_pending.add(event.node_key)
        self._show(event.node_key)
        node = self.nodes[event.node_key]
        self.run_worker(partial(self._switch_p2p, event.node_key, node, event.enabled),
                        name=f"p2p {node.name}", group=f"p2p:{event.node_key}", exclusive=True, thread=True)

    def _switch_p2p(self, key: str, node: Node, enabled: bool) -> None:
        worker = get_current_worker()
        try:
            answer = node.set_p2p(enabled)
        except Exception as exc:  # refused, unreachable: a notification, never a traceback
            answer = exc
        if not worker.is_cancelled:
            self.app.call_from_thread(self._p2p_switched, key, answer)

    def _p2p_switched(self, key: str, answer: P2pState | BaseException) -> None:
        self.p2p_pending.discard(key)
        name = self.nodes[key].name
        if isinstance(answer, BaseException):
            self.notify(f"{name}: P2P not switched: {reason(answer)}", severity="error")
        else:
            sample = self.samples.get(key)
            if sample is not None and isinstance(sample.status, NodeStatus):  # show the answer now
                p2p = P2pState(answer.enabled, answer.served)
                self.samples[key] = replace(sample, status=replace(sample.status, p2p=p2p))
            self.notify(f"{name}: P2P {'on' if answer.enabled else 'off'}")
        self._show(key)
        self.poll(key)

    # -- stats reset -------------------------------------------------------------------------

    def action_reset_stats(self) -> None:
        self.run_worker(self._reset_stats, name="reset stats", group="reset", exclusive=True, thread=True)

    def _reset_stats(self) -> None:
        worker = get_current_worker()
        result = self.fleet.map(lambda node: node.reset_stats())
        if not worker.is_cancelled:
            self.app.call_from_thread(self._stats_reset, result)

    def _stats_reset(self, result) -> None:
        for node, exc in result.failed.items():
            self.notify(f"{node.name}: stats not reset: {reason(exc)}", severity="error")
        for key, node in self.nodes.items():
            if node in result.succeeded:
                sample = self.samples.get(key)
                if sample is not None:  # the next rate starts from the reset, not across it
                    self.samples[key] = replace(sample, stats=None, previous=None, rates=None)
                self.poll(key)
