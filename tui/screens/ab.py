"""AbScreen: run fleetd.fleet.ab.compare (hub vs direct, ABBA order) in a thread worker and show
both arms side by side, with the renderers fleetctl ab prints (fleetd.fleet.render)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import Button, Footer, Header, Input, Label, Static
from textual.worker import get_current_worker

from fleetd.fleet.ab import compare
from fleetd.fleet.node import Fleet
from fleetd.fleet.render import ab_steps_text, ab_table, ab_verdict, reason


@dataclass(frozen=True)
class AbSettings:
    """The form's starting values (fleetctl tui --ab-rows/--ab-n-embd/--ab-steps)."""

    rows: int = 32
    n_embd: int = 1024
    steps: int = 5
    local_last: bool = True


# (input id, label, smallest value accepted)
FIELDS = (("rows", "rows", 1), ("n_embd", "n_embd", 1), ("steps", "steps", 2))


class AbScreen(Screen):
    BINDINGS: ClassVar[list[BindingType]] = [("escape", "app.pop_screen", "Back")]

    def __init__(self, fleet: Fleet, settings: AbSettings | None = None) -> None:
        super().__init__()
        self.fleet = fleet
        self.settings = settings or AbSettings()
        self.result: dict | None = None  # compare()'s document from the last run that finished

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="ab-form"):
            for field, label, _ in FIELDS:
                yield Label(label)
                yield Input(str(getattr(self.settings, field)), type="integer", id=field)
            yield Button("Run A/B", id="ab-run", variant="primary")
        yield Static(Text(f"hub vs direct over {len(self.fleet)} node(s): press Run", style="dim"),
                     id="ab-state")
        with Horizontal(id="ab-results"):
            yield Static(id="ab-table")
            yield Static(id="ab-steps")
        yield Static(id="ab-verdict")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#ab-run", Button).focus()  # so the app's keys (q, a) work at once

    def _form(self) -> dict | str:
        """The form's values, or a one-line error."""
        values = {}
        for field, label, least in FIELDS:
            text = self.query_one(f"#{field}", Input).value.strip()
            try:
                values[field] = int(text)
            except ValueError:
                return f"{label}: {text!r} is not a whole number"
            if values[field] < least:
                return f"{label}: must be at least {least}"
        return values

    @on(Button.Pressed, "#ab-run")
    def start(self) -> None:
        form = self._form()
        if isinstance(form, str):
            self.query_one("#ab-state", Static).update(Text(form, style="bold red"))
            return
        self.query_one("#ab-run", Button).disabled = True
        self.query_one("#ab-state", Static).update(Text(
            f"running hub, direct, direct, hub: {form['rows']} x {form['n_embd']} f32, "
            f"{form['steps']} steps per run…", style="italic"))
        self.run_ab(form["rows"], form["n_embd"], form["steps"])

    @work(thread=True, exclusive=True, group="ab")
    def run_ab(self, rows: int, n_embd: int, steps: int) -> None:
        worker = get_current_worker()
        try:
            outcome = compare(self.fleet, None, rows, n_embd, steps, self.settings.local_last)
        except Exception as exc:  # a node down, refused, too small: shown, never a traceback
            outcome = exc
        if not worker.is_cancelled:
            self.app.call_from_thread(self._finished, outcome)

    def _finished(self, outcome: dict | BaseException) -> None:
        self.query_one("#ab-run", Button).disabled = False
        state = self.query_one("#ab-state", Static)
        if isinstance(outcome, BaseException):
            state.update(Text(f"A/B failed: {reason(outcome)}", style="bold red"))
            return
        self.result = outcome
        state.update(Text(f"done: {outcome['stages']} stages, {outcome['layers']} layers"))
        self.query_one("#ab-table", Static).update(ab_table(outcome))
        self.query_one("#ab-steps", Static).update(Text(ab_steps_text(outcome)))
        self.query_one("#ab-verdict", Static).update(ab_verdict(outcome))
