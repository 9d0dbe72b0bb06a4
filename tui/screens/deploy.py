"""DeployScreen: `fleetctl deploy` from the TUI, and restart, stop and logs of one node or all.

The same Deployer as the CLI runs in a thread worker over the same fleet: its progress callback
(node, step) comes back through `call_from_thread` and moves that node's bar; the outcome table
at the end is the CLI's (unchanged / deployed / rolled-back with the reason). Everything that
changes nodes asks first, naming the nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Header, Label, ProgressBar, RichLog, Static
from textual.worker import get_current_worker

from fleetd.fleet.deploy import STEPS, Build, Deployer, NodeOutcome, build, clean_build
from fleetd.fleet.node import Fleet, Node
from fleetd.fleet.render import lifecycle_table, outcome_table, reason
from tui.screens.confirm import ConfirmScreen

# (action, what the question and the log call it)
LIFECYCLE = {"restart": "restart fleetd on", "stop": "stop fleetd on", "logs": "fetch the log of"}
LOG_TAIL = 30


class DeployScreen(Screen):
    """fleetctl deploy, restart, stop and logs from the TUI: per-node progress, a log, the outcome table."""

    BINDINGS: ClassVar[list[BindingType]] = [
        ("escape", "app.pop_screen", "Back"),
        ("t", "toggle_target", "Target"),
        ("D", "deploy(False)", "Deploy"),
        ("n", "deploy(True)", "Dry run"),
        ("R", "lifecycle('restart')", "Restart"),
        ("S", "lifecycle('stop')", "Stop"),
        ("L", "lifecycle('logs')", "Logs"),
    ]

    def __init__(
        self, fleet: Fleet, selected: Node | None = None, build_fn: Callable[[], Build] = build
    ) -> None:
        super().__init__()
        self.fleet = fleet
        self.selected = selected
        self.all_nodes = selected is None
        self.build_fn = build_fn
        self.outcomes: list[NodeOutcome] | None = None
        self.results: dict[str, dict] | None = None
        self.busy = False

    @property
    def targets(self) -> Fleet:
        return self.fleet if self.all_nodes or self.selected is None else Fleet([self.selected])

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="deploy-target")
        with Vertical(id="deploy-nodes"):
            for i, node in enumerate(self.fleet):
                with Horizontal(classes="deploy-node"):
                    yield Label(node.name, classes="deploy-name")
                    yield ProgressBar(total=len(STEPS), show_eta=False, id=f"bar-{i}")
                    yield Label("", id=f"step-{i}", classes="deploy-step")
        yield Static(id="deploy-summary")
        # wrapped: a deploy's failure line or a log line is read whole at 80 columns
        yield RichLog(id="deploy-log", wrap=True, max_lines=500)
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "deploy"
        self.query_one("#deploy-log", RichLog).border_title = "log"
        self._show_target()

    def _show_target(self) -> None:
        names = ", ".join(n.name for n in self.targets)
        other = (
            ""
            if self.selected is None
            else ("   t: only " + self.selected.name if self.all_nodes else "   t: all nodes")
        )
        self.query_one("#deploy-target", Static).update(
            Text.assemble(
                "target: ",
                (names, "bold"),
                (other, "dim"),
                ("\nD deploy · R restart · S stop (each asks first) · n dry run · L logs", "dim"),
            )
        )

    def action_toggle_target(self) -> None:
        if self.selected is not None and not self.busy:
            self.all_nodes = not self.all_nodes
            self._show_target()

    def _log(self, line: str | Text) -> None:
        self.query_one("#deploy-log", RichLog).write(line)

    def _index(self, node: Node) -> int:
        return next(i for i, n in enumerate(self.fleet) if n is node)

    def _ask(self, question: str | None, then: Callable[[], None]) -> None:
        """Run `then` after a yes to `question`; no question (a read-only action) runs it now."""
        if self.busy:
            self.notify("a deploy or lifecycle command is still running", severity="warning")
            return
        if question is None:
            then()
            return
        self.app.push_screen(ConfirmScreen(question), lambda yes: then() if yes else None)

    # -- deploy ------------------------------------------------------------------------------

    def action_deploy(self, dry_run: bool) -> None:
        names = ", ".join(n.name for n in self.targets)
        if dry_run:  # nothing changes on a node: nothing to confirm
            self._ask(None, lambda: self._start_deploy(True))
        else:
            self._ask(
                f"Deploy fleetd to {names}? Nodes whose build differs restart.",
                lambda: self._start_deploy(False),
            )

    def _start_deploy(self, dry_run: bool) -> None:
        self.busy, self.outcomes = True, None
        for node in self.targets:
            i = self._index(node)
            self.query_one(f"#bar-{i}", ProgressBar).update(progress=0)
            self.query_one(f"#step-{i}", Label).update("waiting")
        self.query_one("#deploy-summary", Static).update("")
        self._log(Text(("dry run: " if dry_run else "deploy: ") + "building wheels…", style="bold"))
        self.run_deploy(self.targets, dry_run)

    @work(thread=True, exclusive=True, group="deploy")
    def run_deploy(self, fleet: Fleet, dry_run: bool) -> None:
        worker = get_current_worker()

        def say(fn, *args) -> None:
            if not worker.is_cancelled:
                self.app.call_from_thread(fn, *args)

        try:
            b = self.build_fn()
        except Exception as exc:
            say(self._deploy_failed, exc)
            return
        say(self._log, f"release {b.release}: {len(b.files)} wheel(s)")
        if b.warning:
            say(self._log, Text(f"warning: {b.warning}", style="yellow"))
        try:
            deployer = Deployer(fleet, b, progress=lambda node, step: say(self._step, node, step))
            result = fleet.map(deployer.plan if dry_run else deployer.deploy)
        finally:
            clean_build(b)
        outcomes = [
            v if isinstance(v, NodeOutcome) else NodeOutcome(n.name, "failed", detail=reason(v))
            for n, v in result.items()
        ]
        say(self._deployed, outcomes)

    def _step(self, node: Node, step: str) -> None:
        i = self._index(node)
        self.query_one(f"#bar-{i}", ProgressBar).update(progress=STEPS.index(step))
        self.query_one(f"#step-{i}", Label).update(step)
        self._log(f"{node.name}: {step}")

    def _deploy_failed(self, exc: BaseException) -> None:
        self.busy = False
        self._log(Text(f"deploy failed: {reason(exc)}", style="bold red"))

    def _deployed(self, outcomes: list[NodeOutcome]) -> None:
        self.busy, self.outcomes = False, outcomes
        by_name = {n.name: n for n in self.fleet}
        for o in outcomes:
            i = self._index(by_name[o.node])
            self.query_one(f"#bar-{i}", ProgressBar).update(progress=len(STEPS))
            self.query_one(f"#step-{i}", Label).update(o.status)
            self._log(
                Text(
                    f"{o.node}: {o.status}" + (f": {o.detail}" if o.detail else ""),
                    style="red" if o.status in ("failed", "rolled-back") else "",
                )
            )
            for w in o.warnings:
                self._log(Text(f"{o.node}: warning: {w}", style="yellow"))
        self.query_one("#deploy-summary", Static).update(outcome_table(outcomes))

    # -- restart | stop | logs ---------------------------------------------------------------

    def action_lifecycle(self, action: str) -> None:
        names = ", ".join(n.name for n in self.targets)
        question = (
            None if action == "logs" else f"{LIFECYCLE[action].capitalize()} {names}?"
        )  # logs: read-only
        self._ask(question, lambda: self._start_lifecycle(action))

    def _start_lifecycle(self, action: str) -> None:
        self.busy, self.results = True, None
        self._log(Text(f"{action}: {', '.join(n.name for n in self.targets)}", style="bold"))
        self.run_lifecycle(self.targets, action)

    @work(thread=True, exclusive=True, group="deploy")
    def run_lifecycle(self, fleet: Fleet, action: str) -> None:
        worker = get_current_worker()
        deployer = Deployer(fleet, None)
        fn = getattr(deployer, action)
        result = fleet.map((lambda n: fn(n, LOG_TAIL)) if action == "logs" else fn)
        rows = {
            n.name: (v if not isinstance(v, Exception) else {"error": reason(v)}) for n, v in result.items()
        }
        if not worker.is_cancelled:
            self.app.call_from_thread(self._lifecycle_done, action, rows)

    def _lifecycle_done(self, action: str, rows: dict[str, dict]) -> None:
        self.busy, self.results = False, rows
        if action == "logs":
            for node, v in rows.items():
                self._log(Text(f"==> {node} {v.get('path', '')} <==", style="bold"))
                for line in v.get("lines", []):
                    self._log(line)
                if "error" in v:
                    self._log(Text(v["error"], style="red"))
        self.query_one("#deploy-summary", Static).update(lifecycle_table(action, rows))
