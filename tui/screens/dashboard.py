"""DashboardScreen: every node's state, live rates and their history, staleness, the P2P
switches (per node and fleet-wide), stats reset.

Polling: a `set_interval` timer starts one thread worker per node (group `poll:<key>`), which
asks /v1/status and /v1/stats and hands both back with `call_from_thread`, with how long the
poll took. A node whose poll is still running is skipped, so a slow or hung node holds one
thread, not one per tick; the same tick marks it stale once its last answer is older than two
intervals (long before the control API's read timeout gives up). A P2P switch or a stats reset
re-polls at once; `exclusive=True` then cancels the poll in flight, whose answer predates the
change and is dropped (`is_cancelled`).

Serving: the same tick starts one more thread worker (group `poll:serve`, skipped while one
runs) that finds the `fleetctl serve` to show (`--serve-url`, else the first one whose state
file names a live serve on this machine; serve_control.running_serves, which drops stale
files as `fleetctl serve --stop` does) and takes a sample of it (fleetd.fleet.serve_control,
each GET bounded by SERVE_TIMEOUT_S). The serving panel shows it with the rates since the sample
before; a serve that stops answering, or whose state file goes, shows "not running" with the
reason. No serve found and none shown before: the panel stays hidden.
"""

from __future__ import annotations

import http.client
import statistics
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Static
from textual.worker import Worker, get_current_worker

from fleetd.fleet.control_docs import NodeStats, NodeStatus, P2pState
from fleetd.fleet.node import Fleet, FleetResult, Node
from fleetd.fleet.render import down_text, reason
from fleetd.fleet.serve_control import ServingSample, read_serving, running_serves, serving_rates
from tui.history import History, Rates, rates_between
from tui.screens.confirm import ConfirmScreen
from tui.screens.deploy import DeployScreen
from tui.screens.node import NodeScreen
from tui.widgets import Counters, HistoryPanel, NodeRow, NodeTable, PeerToggle
from tui.widgets.counters import CounterSample
from tui.widgets.node_table import SPARK_WIDTH
from tui.widgets.serving_panel import ServingPanel, ServingView, StageLayers, stage_layers

# A node is stale when its last answer is older than this many poll intervals.
STALE_INTERVALS = 2
# The latency shown is the median of the last polls: one slow answer on a busy machine does not
# flip the cell (and redraw the table) every second.
LATENCY_POLLS = 5
# Each of a serving sample's two GETs (/fleet/status, /metrics) gives up after this many seconds.
SERVE_TIMEOUT_S = 2.0
# Below this many rows the serving panel folds its layers line into its first line.
SERVING_ONE_LINE_BELOW_ROWS = 24

# What a serving poll hands back: a sample with its stages, why there is none, or None (no serve found).
ServeAnswer = tuple[ServingSample, tuple[StageLayers, ...]] | BaseException | None


def serve_problem(exc: BaseException) -> str:
    """Why the serve gave no sample, in one line."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()  # "connection refused"
    if isinstance(exc, OSError | http.client.HTTPException):
        return reason(exc)
    return f"not a fleetctl serve? ({reason(exc)})"


@dataclass(frozen=True)
class Sample:
    """One node's latest poll."""

    status: NodeStatus | BaseException
    stats: NodeStats | None
    at: float  # time.monotonic() when the answer arrived
    latency: float | None = None  # seconds the polls took (median of the last LATENCY_POLLS)
    rates: Rates | None = None  # since the poll before, when both had counters


class DashboardScreen(Screen):
    """Every node at a glance: the node table, the selected node's counters, last minutes and P2P switch."""

    BINDINGS: ClassVar[list[BindingType]] = [
        # the counters box scrolls at 80x24 (the copies table below the fold), whatever has the focus
        Binding("pagedown", "scroll_screen(1)", "Page down", show=False, priority=True),
        Binding("pageup", "scroll_screen(-1)", "Page up", show=False, priority=True),
        ("p", "toggle_p2p", "P2P"),
        ("P", "toggle_fleet_p2p", "P2P all"),
        ("r", "reset_stats", "Reset"),
        ("d", "show_deploy", "Deploy"),
    ]

    def __init__(self, fleet: Fleet, interval: float = 1.0, serve_url: str | None = None) -> None:
        super().__init__()
        self.fleet = fleet
        self.interval = interval
        self.serve_url = serve_url  # None: the fleetctl serve running on this machine, if any
        # Row keys are positions in the nodes file: names are not guaranteed to be unique.
        self.nodes: dict[str, Node] = {str(i): node for i, node in enumerate(fleet)}
        self.samples: dict[str, Sample] = {}
        self.histories: dict[str, History] = {key: History() for key in self.nodes}
        self.p2p_pending: set[str] = set()
        self._polls: dict[str, Worker] = {}
        self._poll_started: dict[str, float] = {}  # a poll in flight: when it began
        self._answered_at: dict[str, float] = {}  # the last poll the node answered (not a failure)
        self.clock = time.monotonic  # what ages are measured with (the snapshot tests fix it)
        self._down_shown = ""
        self._latencies: dict[str, deque[float]] = {}
        self.serving: ServingView | None = None  # what the serving panel shows
        self._serve_poll: Worker | None = None
        self._serve_sample: tuple[str, ServingSample] | None = None  # the last one, and its URL

    def compose(self) -> ComposeResult:
        yield Header()
        yield NodeTable(id="nodes")
        yield Static(id="down")
        yield ServingPanel(id="serving")
        yield PeerToggle(id="p2p")
        yield HistoryPanel(id="history")
        # a Static cannot scroll itself: the box around it does (the copies table at 80x24)
        with VerticalScroll(id="counters-box"):
            yield Counters(id="counters")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(NodeTable)
        table.fit(self.size.width or self.app.size.width)
        for key in self.nodes:
            table.show(key, self._row(key))
        self._show_selected()
        self._fit_serving(self.size.height or self.app.size.height)
        self.poll_all()
        self.poll_serving()
        self._timer = self.set_interval(self.interval, self._tick)

    def on_resize(self) -> None:
        self.query_one(NodeTable).fit(self.size.width)
        self._fit_serving(self.size.height)

    def _fit_serving(self, rows: int) -> None:
        self.query_one(ServingPanel).one_line = rows < SERVING_ONE_LINE_BELOW_ROWS

    # The A/B runner measures: it says so with `pauses_polling`, and gets the nodes to itself.
    # Other screens on top (a node's detail, deploy) keep the data coming.
    def on_screen_suspend(self) -> None:
        if getattr(self.app.screen, "pauses_polling", False):
            self._timer.pause()

    def on_screen_resume(self) -> None:
        self._timer.resume()
        self.poll_all()
        self.poll_serving()

    # -- polling -----------------------------------------------------------------------------

    def _tick(self) -> None:
        self.poll_all()
        self.poll_serving()
        for key in self.nodes:  # ages and staleness move on even when no answer came
            self._show_row(key)

    def poll_all(self) -> None:
        for key in self.nodes:
            running = self._polls.get(key)
            if running is None or running.is_finished:
                self.poll(key)

    def poll(self, key: str) -> None:
        self._poll_started[key] = self.clock()
        self._polls[key] = self.run_worker(
            partial(self._poll_node, key, self.nodes[key]),
            name=f"poll {self.nodes[key].name}",
            group=f"poll:{key}",
            exclusive=True,
            thread=True,
        )

    def _poll_node(self, key: str, node: Node) -> None:
        """Thread: ask the node; any failure, an answer of another shape too, is the node's
        state, shown with its reason."""
        worker = get_current_worker()
        started = self.clock()
        try:
            status = node.status()
            stats = node.stats()
        except Exception as exc:
            status, stats = exc, None
        at = self.clock()
        if not worker.is_cancelled:
            self.app.call_from_thread(self.polled, key, status, stats, at, at - started)

    def polled(
        self,
        key: str,
        status: NodeStatus | BaseException,
        stats: NodeStats | None,
        at: float,
        latency: float | None = None,
    ) -> None:
        """One node's answer (or failure) arrived at `at`: keep it, its rates and history, show it."""
        before = self.samples.get(key)
        rates = None
        if before is not None and before.stats is not None and stats is not None:
            rates = rates_between(before.stats, stats, at - before.at)
        recent = self._latencies.setdefault(key, deque(maxlen=LATENCY_POLLS))
        if latency is not None:
            recent.append(latency)
        self._poll_started.pop(key, None)
        if not isinstance(status, BaseException):
            self._answered_at[key] = at
        self.samples[key] = Sample(status, stats, at, statistics.median(recent) if recent else None, rates)
        self.histories[key].add(at, rates)
        self._show(key)

    # -- the serving panel -------------------------------------------------------------------

    def poll_serving(self) -> None:
        if self._serve_poll is not None and not self._serve_poll.is_finished:
            return  # a serve that hangs holds one thread, not one per tick
        self._serve_poll = self.run_worker(
            self._poll_serving, name="poll serve", group="poll:serve", exclusive=True, thread=True
        )

    def _poll_serving(self) -> None:
        """Thread: find the serve and take a sample; any failure is the serve's state, shown
        with its reason."""
        worker = get_current_worker()
        url = self.serve_url
        answer: ServeAnswer = None
        try:
            if url is None:
                found = running_serves()
                url = found[0].url if found else None
            if url is not None:
                sample = read_serving(url, SERVE_TIMEOUT_S)
                answer = (sample, stage_layers(sample.stages))
        except Exception as exc:
            answer = exc
        if not worker.is_cancelled:
            self.app.call_from_thread(self.served, url, answer)

    def served(self, url: str | None, answer: ServeAnswer) -> None:
        """A serving poll ended: the sample (rates against the one before from the same URL), or
        "not running" with why, goes to the panel."""
        before, self._serve_sample = self._serve_sample, None
        if url is not None and isinstance(answer, tuple):
            sample, stages = answer
            rates = serving_rates(before[1], sample) if before is not None and before[0] == url else None
            self._serve_sample = (url, sample)
            view = ServingView.of(url, sample, stages, rates)
        elif url is not None:
            why = serve_problem(answer) if isinstance(answer, BaseException) else "no answer"
            view = ServingView.not_running(url, why)
        elif self.serving is not None:  # the serve shown so far is gone, state file and all
            view = ServingView.not_running(self.serving.url, "no fleetctl serve runs on this machine")
        else:
            return  # none found, none shown: the panel stays hidden
        self.serving = view
        self.query_one(ServingPanel).view = view

    # -- attributes down ---------------------------------------------------------------------

    def answered_age(self, key: str, now: float | None = None) -> float | None:
        """Seconds since the node last answered (a failed poll is no answer); None: never."""
        at = self._answered_at.get(key)
        return None if at is None else (self.clock() if now is None else now) - at

    def hanging_poll_age(self, key: str, now: float | None = None) -> float | None:
        """Seconds a poll still in flight has run, when that is longer than the last poll took
        (a frozen node: its poll's age is what the Poll column shows); None otherwise."""
        started = self._poll_started.get(key)
        if started is None:
            return None
        age = (self.clock() if now is None else now) - started
        sample = self.samples.get(key)
        last = sample.latency if sample is not None and sample.latency is not None else 0.0
        return age if age > max(last, self.interval) else None

    def is_stale(self, key: str, now: float | None = None) -> bool:
        sample = self.samples.get(key)
        if sample is None:
            return False
        now = self.clock() if now is None else now
        return now - sample.at > STALE_INTERVALS * self.interval

    def _row(self, key: str) -> NodeRow:
        node = self.nodes[key]
        host = node.spec.target if node.spec.target != node.name else ""
        row = NodeRow(node.name, host, p2p_pending=key in self.p2p_pending)
        sample = self.samples.get(key)
        if sample is None:
            return row
        now = self.clock()
        history = self.histories[key].series("commands_per_s")[-SPARK_WIDTH:]
        answered = self.answered_age(key, now)
        hanging = self.hanging_poll_age(key, now)
        return replace(
            row,
            status=sample.status,
            stats=sample.stats,
            rates=sample.rates,
            history=tuple(history),
            seen_seconds=None if answered is None else round(answered, 1),
            never_answered=answered is None,
            fresh_seconds=1.5 * self.interval,
            latency_seconds=hanging if hanging is not None else sample.latency,
            poll_hanging=hanging is not None,
            stale=self.is_stale(key, now),
        )

    def _show_row(self, key: str) -> None:
        self.query_one(NodeTable).show(key, self._row(key))

    def _show(self, key: str) -> None:
        self._show_row(key)
        down = down_text(
            {
                self.nodes[k].name: s.status
                for k, s in self.samples.items()
                if isinstance(s.status, BaseException)
            }
        )
        plain = down.plain if down is not None else ""
        if plain != self._down_shown:  # a new line under the table is a layout pass: only on change
            self._down_shown = plain
            self.query_one("#down", Static).update(down or "")
        if key == self.query_one(NodeTable).selected_key:
            self._show_selected()

    def _show_selected(self) -> None:
        key = self.query_one(NodeTable).selected_key
        toggle, counters = self.query_one(PeerToggle), self.query_one(Counters)
        history = self.query_one(HistoryPanel)
        if key is None:
            toggle.node_key, counters.sample, history.history = None, None, None
            return
        name, sample = self.nodes[key].name, self.samples.get(key)
        status = sample.status if sample is not None else None
        p2p = status.p2p if isinstance(status, NodeStatus) else None
        toggle.node_key, toggle.node_name = key, name
        for widget, title in (
            (self.query_one("#counters-box"), f"{name}: commands since the last reset"),
            (history, f"{name}: the last minutes"),
        ):
            if widget.border_title != title:  # setting it, even to the same, repaints
                widget.border_title = title
        toggle.enabled = p2p.enabled if p2p is not None and p2p.served else None
        toggle.pending = key in self.p2p_pending
        counters.sample = (
            CounterSample(name, sample.stats, sample.rates)
            if sample is not None
            else CounterSample(name, None)
        )
        history.history = self.histories[key]

    @on(DataTable.RowHighlighted, "#nodes")
    def _selection_moved(self) -> None:
        self._show_selected()

    @on(DataTable.RowSelected, "#nodes")
    def _row_chosen(self) -> None:
        self.action_show_node()

    # -- other screens -----------------------------------------------------------------------

    @property
    def selected_node(self) -> Node | None:
        key = self.query_one(NodeTable).selected_key
        return self.nodes[key] if key is not None else None

    def action_scroll_screen(self, pages: int) -> None:
        """The counters box is what holds more than fits (the copies table at 80x24)."""
        box = self.query_one("#counters-box", VerticalScroll)
        if pages > 0:
            box.scroll_page_down(animate=False)
        else:
            box.scroll_page_up(animate=False)

    def action_show_node(self) -> None:
        key = self.query_one(NodeTable).selected_key
        if key is not None:
            self.app.push_screen(NodeScreen(self, key))

    def action_show_deploy(self) -> None:
        self.app.push_screen(DeployScreen(self.fleet, self.selected_node))

    # -- P2P switch --------------------------------------------------------------------------

    def why_not_switchable(self, key: str) -> str | None:
        """Why `p` cannot switch P2P on this node now, or None when it can."""
        name, sample = self.nodes[key].name, self.samples.get(key)
        if key in self.p2p_pending:
            return f"{name}: a P2P switch is already under way"
        if sample is None:
            return f"{name}: not answered yet, so its P2P state is unknown"
        if isinstance(sample.status, BaseException):
            return f"{name} is down, nothing switched: {reason(sample.status)}"
        if not sample.status.p2p.served:
            return f"{name}: this fleetd does not serve COPY_TENSOR_TO, so P2P cannot be switched"
        return None

    def action_toggle_p2p(self) -> None:
        key = self.query_one(NodeTable).selected_key
        if key is None:
            return
        why = self.why_not_switchable(key)
        if why is not None:
            self.notify(why, severity="warning")
            return
        self.query_one(PeerToggle).toggle()

    def on_peer_toggle_changed(self, event: PeerToggle.Changed) -> None:
        self._switch(event.node_key, event.enabled)

    def action_toggle_fleet_p2p(self) -> None:
        """Every node that can switch goes the same way: off when all are on, else on; one
        notification when every node has answered, not one per node."""
        ready = [k for k in self.nodes if self.why_not_switchable(k) is None]
        skipped = [why for k in self.nodes if k not in ready and (why := self.why_not_switchable(k))]
        if not ready:
            self.notify("no node can switch P2P now:\n" + "\n".join(skipped), severity="warning")
            return
        enabled = not all(self.samples[k].status.p2p.enabled for k in ready)
        for key in ready:
            self.p2p_pending.add(key)
            self._show(key)
        self.run_worker(
            partial(self._switch_fleet_p2p, ready, enabled, skipped),
            name="p2p fleet",
            group="p2p:fleet",
            exclusive=True,
            thread=True,
        )

    def _switch_fleet_p2p(self, keys: list[str], enabled: bool, skipped: list[str]) -> None:
        worker = get_current_worker()

        def one(key: str) -> P2pState | BaseException:
            try:
                return self.nodes[key].set_p2p(enabled)
            except Exception as exc:  # refused, unreachable: named in the notification
                return exc

        with ThreadPoolExecutor(max_workers=min(len(keys), 16)) as pool:
            answers = dict(zip(keys, pool.map(one, keys)))
        if not worker.is_cancelled:
            self.app.call_from_thread(self._fleet_p2p_switched, answers, enabled, skipped)

    def _fleet_p2p_switched(
        self, answers: dict[str, P2pState | BaseException], enabled: bool, skipped: list[str]
    ) -> None:
        switched = [self.nodes[k].name for k, a in answers.items() if not isinstance(a, BaseException)]
        failed = [
            f"{self.nodes[k].name}: {reason(a)}" for k, a in answers.items() if isinstance(a, BaseException)
        ]
        for key, answer in answers.items():
            self._apply_p2p_answer(key, answer)
        lines = [f"P2P {'on' if enabled else 'off'} on {', '.join(switched)}"] if switched else []
        lines += ["not switched: " + "; ".join(failed)] if failed else []
        lines += ["skipped: " + "; ".join(skipped)] if skipped else []
        self.notify("\n".join(lines), severity="error" if failed else "information")

    def _switch(self, key: str, enabled: bool) -> None:
        self.p2p_pending.add(key)
        self._show(key)
        node = self.nodes[key]
        self.run_worker(
            partial(self._switch_p2p, key, node, enabled),
            name=f"p2p {node.name}",
            group=f"p2p:{key}",
            exclusive=True,
            thread=True,
        )

    def _switch_p2p(self, key: str, node: Node, enabled: bool) -> None:
        worker = get_current_worker()
        try:
            answer = node.set_p2p(enabled)
        except Exception as exc:  # refused, unreachable: a notification, never a traceback
            answer = exc
        if not worker.is_cancelled:
            self.app.call_from_thread(self._p2p_switched, key, answer)

    def _p2p_switched(self, key: str, answer: P2pState | BaseException) -> None:
        name = self.nodes[key].name
        if isinstance(answer, BaseException):
            self.notify(f"{name}: P2P not switched: {reason(answer)}", severity="error")
        else:
            self.notify(f"{name}: P2P {'on' if answer.enabled else 'off'}")
        self._apply_p2p_answer(key, answer)

    def _apply_p2p_answer(self, key: str, answer: P2pState | BaseException) -> None:
        """A switch answered: the row shows the node's answer now, and the node is polled."""
        self.p2p_pending.discard(key)
        if not isinstance(answer, BaseException):
            sample = self.samples.get(key)
            if sample is not None and isinstance(sample.status, NodeStatus):
                p2p = P2pState(answer.enabled, answer.served)
                self.samples[key] = replace(sample, status=replace(sample.status, p2p=p2p))
        self._show(key)
        self.poll(key)

    # -- stats reset -------------------------------------------------------------------------

    def action_reset_stats(self) -> None:
        names = ", ".join(n.name for n in self.nodes.values())
        question = f"Reset the counters of {len(self.nodes)} node(s): {names}?"
        self.app.push_screen(ConfirmScreen(question), self._reset_confirmed)

    def _reset_confirmed(self, yes: bool | None) -> None:
        if yes:
            self.run_worker(self._reset_stats, name="reset stats", group="reset", exclusive=True, thread=True)

    def _reset_stats(self) -> None:
        worker = get_current_worker()
        result = self.fleet.map(lambda node: node.reset_stats())
        if not worker.is_cancelled:
            self.app.call_from_thread(self._stats_reset, result)

    def _stats_reset(self, result: FleetResult) -> None:
        for node, exc in result.failed.items():
            self.notify(f"{node.name}: stats not reset: {reason(exc)}", severity="error")
        done = [n.name for n in result.succeeded]
        if done:
            self.notify(f"counters reset on {', '.join(done)}")
        for key, node in self.nodes.items():
            if node in result.succeeded:
                sample = self.samples.get(key)
                if sample is not None:  # the next rate starts from the reset, not across it
                    self.samples[key] = replace(sample, stats=None, rates=None)
                self.poll(key)
