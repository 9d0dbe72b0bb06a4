"""AbScreen: hub vs direct on the fleet, with a synthetic workload (fleetd.fleet.ab.compare, the
layer split `fleetctl ab` runs) or a real model through the llama tools
(fleetd.fleet.model_ab.run_model_ab, imported when first used, so the screen works without it).

Each run goes in a thread worker; the previous results stay on screen, dimmed, until the new
ones arrive. Every run that finished is kept in the history (JSON export: `e`). The verdict says
the speed-up with its spread and warns when the direct arm never copied or fell back, with the
reasons the nodes counted (their fallback counters, before and after the run).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, DataTable, Footer, Header, Input, Label, OptionList, Select, Static
from textual.worker import get_current_worker

from fleetd.fleet.ab import abba, compare
from fleetd.fleet.node import Fleet
from fleetd.fleet.render import ab_table, ab_verdict, fmt_count, reason


@dataclass(frozen=True)
class AbSettings:
    """The form's starting values (fleetctl tui --ab-rows/--ab-n-embd/--ab-steps)."""

    rows: int = 32
    n_embd: int = 1024
    steps: int = 5
    local_last: bool = True
    model: str = ""  # a GGUF for the model workload
    rounds: int = 3


# (input id, label, smallest value accepted, workload it belongs to)
FIELDS = (
    ("rows", "rows", 1, "synthetic"),
    ("n_embd", "n_embd", 1, "synthetic"),
    ("steps", "steps", 2, "synthetic"),
    ("rounds", "rounds", 1, "both"),
)
WORKLOADS = (("synthetic layer split", "synthetic"), ("model (llama tools)", "model"))
BAR_WIDTH = 30


@dataclass
class AbRun:
    """One finished run: what was asked, the document it produced, and what the screen shows."""

    workload: str
    settings: dict
    started: float  # time.time()
    seconds: float
    doc: dict
    ok: bool
    verdict: str
    speedup: str  # "x1.23 (1.10-1.31)" or ""
    warning: str  # the direct arm did not copy (or fell back), and why; "" when it did
    chart: list[tuple[str, str, float]] = field(default_factory=list)  # (round, arm, value)
    unit: str = ""

    def as_dict(self) -> dict:
        return {
            "workload": self.workload,
            "settings": self.settings,
            "started": self.started,
            "seconds": self.seconds,
            "ok": self.ok,
            "verdict": self.verdict,
            "speedup": self.speedup,
            "warning": self.warning,
            "result": self.doc,
        }


def fallback_reasons(before: dict, after: dict) -> dict[str, int]:
    """Fallbacks the nodes counted between two {node: NodeStats | exception} snapshots, by reason."""
    out: dict[str, int] = {}
    for name, a in after.items():
        b = before.get(name)
        if isinstance(a, BaseException) or b is None or isinstance(b, BaseException):
            continue
        for r, n in a.peer.fallbacks.items():
            d = n - b.peer.fallbacks.get(r, 0)
            if d > 0:
                out[r] = out.get(r, 0) + d
    return out


def synthetic_run(
    doc: dict, settings: dict, started: float, seconds: float, reasons: dict[str, int]
) -> AbRun:
    runs = doc["runs"]
    per_arm = {
        arm: [1 / r["seconds_per_step"] for r in runs if r["arm"] == arm and r["seconds_per_step"] > 0]
        for arm in ("hub", "direct")
    }
    speedup = ""
    if per_arm["hub"] and per_arm["direct"]:
        ratios = [d / h for d in per_arm["direct"] for h in per_arm["hub"]]
        speedup = f"x{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
    direct = doc["arms"].get("direct", {})
    warning = _warning(direct.get("node_peer_copies", 0), direct.get("node_fallbacks", 0), reasons)
    same = doc["outputs_identical"]
    verdict = ("outputs identical" if same else "outputs DIFFERENT") + (
        f"; direct vs hub steps/s {speedup}" if speedup else ""
    )
    chart = [
        (f"run {i + 1}", r["arm"], 1 / r["seconds_per_step"])
        for i, r in enumerate(runs)
        if r["seconds_per_step"] > 0
    ]
    return AbRun(
        "synthetic",
        settings,
        started,
        seconds,
        doc,
        same and not warning,
        verdict,
        speedup,
        warning,
        chart,
        "steps/s",
    )


def model_run(result, settings: dict, started: float, seconds: float, reasons: dict[str, int]) -> AbRun:
    doc = result.as_dict()
    hub, direct = result.arms.get("hub"), result.arms.get("direct")
    metric = "tg_tps"
    speedup = ""
    if hub is not None and direct is not None and hub.median.get(metric):
        lo_d, hi_d = direct.spread.get(metric, (0.0, 0.0))
        lo_h, hi_h = hub.spread.get(metric, (0.0, 0.0))
        mid = direct.median[metric] / hub.median[metric]
        spread = f" ({lo_d / hi_h:.2f}-{hi_d / lo_h:.2f})" if hi_h and lo_h else ""
        speedup = f"x{mid:.2f}{spread} decode tok/s"
    copies = direct.copies_ok if direct is not None else 0
    counted = dict(direct.fallbacks) if direct is not None and direct.fallbacks else reasons
    warning = _warning(copies, sum(counted.values()), counted)
    if not warning and not getattr(result, "direct_ran", True):
        warning = "the direct arm never ran: " + "; ".join(
            getattr(result, "why_not_direct", []) or ["no copies"]
        )
    chart = []
    for rd in doc.get("rounds", []):
        for cell in rd.get("cells", []):
            if metric in cell:
                chart.append((f"round {rd.get('round', '?')}", cell.get("arm", "?"), float(cell[metric])))
    return AbRun(
        "model",
        settings,
        started,
        seconds,
        doc,
        bool(result.ok) and not warning,
        result.verdict,
        speedup,
        warning,
        chart,
        "decode tok/s",
    )


def _warning(copies: int, fallbacks: int, reasons: dict[str, int]) -> str:
    why = ", ".join(f"{r} {n}" for r, n in sorted(reasons.items())) or "no reason counted"
    if copies == 0:
        return (
            f"the direct arm never copied peer to peer (fallbacks: {why}): P2P off, allow-list "
            "or a down node?"
        )
    if fallbacks:
        return f"the direct arm fell back {fallbacks} time(s): {why}"
    return ""


def chart_table(run: AbRun) -> Table:
    """Bars of the run's rate per arm per round (or run), scaled to the fastest."""
    t = Table(title=f"{run.unit} per arm per round", title_justify="left", box=None, padding=(0, 1))
    t.add_column("")
    t.add_column("arm")
    t.add_column("")
    t.add_column(run.unit, justify="right")
    top = max((v for _, _, v in run.chart), default=0.0)
    for label, arm, value in run.chart:
        filled = 0 if top <= 0 else max(1, round(BAR_WIDTH * value / top))
        colour = "green" if arm == "direct" else "blue"
        t.add_row(label, arm, Text("█" * filled, style=colour), fmt_count(value, 1))
    return t


class AbScreen(Screen):
    """Hub vs direct on the fleet: the form, the run in a thread worker, its chart and the runs so far."""

    BINDINGS: ClassVar[list[BindingType]] = [
        ("escape", "app.pop_screen", "Back"),
        Binding("enter", "run", "Run", priority=True),
        ("e", "export", "Export JSON"),
    ]
    pauses_polling = True  # the dashboard stops polling while this screen is up: it measures

    def __init__(self, fleet: Fleet, settings: AbSettings | None = None) -> None:
        super().__init__()
        self.fleet = fleet
        self.settings = settings or AbSettings()
        self.result: dict | None = None  # the document of the last run that finished
        self.history: list[AbRun] = []
        self.running = False
        self.export_dir = Path.cwd()

    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical(id="ab-form"):
            with Horizontal(classes="ab-line"):
                yield Label("workload")
                yield Select(WORKLOADS, value="synthetic", allow_blank=False, id="workload", compact=True)
                yield Label("model")
                yield Input(self.settings.model, placeholder="path/to/model.gguf", id="model", compact=True)
            with Horizontal(classes="ab-line"):
                for field_id, label, _, _ in FIELDS:
                    yield Label(label)
                    yield Input(
                        str(getattr(self.settings, field_id)), type="integer", id=field_id, compact=True
                    )
                yield Button("Run A/B", id="ab-run", variant="primary", compact=True)
        yield Static(
            Text(f"hub vs direct over {len(self.fleet)} node(s): Enter or Run", style="dim"), id="ab-state"
        )
        with VerticalScroll(id="ab-body"):
            yield Static(id="ab-verdict")
            with Vertical(id="ab-results"):
                yield Static(id="ab-chart")
                yield Static(id="ab-table")
            yield DataTable(id="ab-history", cursor_type="row")
        yield Footer()

    def on_mount(self) -> None:
        history = self.query_one("#ab-history", DataTable)
        history.border_title = "runs (e: export JSON)"
        for label in ("#", "When", "Workload", "Took", "Outputs", "Speed-up", "Direct arm"):
            history.add_column(label)
        self.query_one("#ab-run", Button).focus()  # so the app's keys (q) work at once

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        # Enter runs from anywhere on the form (an input, the button) but still opens and picks in
        # the workload list; the footer hides Run while that list has the focus.
        if action == "run" and isinstance(self.focused, (Select, OptionList)):
            return False
        return True

    def _form(self) -> dict | str:
        """The form's values for the chosen workload, or a one-line error."""
        workload = self.query_one("#workload", Select).value
        values: dict = {"workload": workload}
        for field_id, label, least, used_by in FIELDS:
            if used_by not in (workload, "both"):
                continue
            text = self.query_one(f"#{field_id}", Input).value.strip()
            try:
                values[field_id] = int(text)
            except ValueError:
                return f"{label}: {text!r} is not a whole number"
            if values[field_id] < least:
                return f"{label}: must be at least {least}"
        if workload == "model":
            model = self.query_one("#model", Input).value.strip()
            if not model:
                return "model: give the path of a GGUF file"
            if not Path(model).expanduser().is_file():
                return f"model: {model}: no such file"
            values["model"] = str(Path(model).expanduser())
        return values

    @on(Button.Pressed, "#ab-run")
    def _pressed(self) -> None:
        self.action_run()

    def action_run(self) -> None:
        if self.running:
            self.notify("an A/B run is already going", severity="warning")
            return
        form = self._form()
        state = self.query_one("#ab-state", Static)
        if isinstance(form, str):
            state.update(Text(form, style="bold red"))
            return
        self.running = True
        self.query_one("#ab-run", Button).disabled = True
        for part in ("#ab-verdict", "#ab-results"):
            self.query_one(part).add_class("old")
        if form["workload"] == "synthetic":
            what = (
                f"running {', '.join(abba(form['rounds']))}: {form['rows']} x {form['n_embd']} f32, "
                f"{form['steps']} steps per run…"
            )
        else:
            what = f"running {form['model']} hub vs direct, {form['rounds']} round(s)…"
        state.update(Text(what, style="italic"))
        self.run_ab(form)

    @work(thread=True, exclusive=True, group="ab")
    def run_ab(self, form: dict) -> None:
        worker = get_current_worker()

        def progress(step: str, fraction: float) -> None:
            if not worker.is_cancelled:
                self.app.call_from_thread(self._progress, step, fraction)

        started, t0 = time.time(), time.monotonic()
        try:
            before = {n.name: v for n, v in self.fleet.map(lambda n: n.stats()).items()}
            if form["workload"] == "synthetic":
                doc = compare(
                    self.fleet,
                    None,
                    form["rows"],
                    form["n_embd"],
                    form["steps"],
                    self.settings.local_last,
                    abba(form["rounds"]),
                )
            else:
                from fleetd.fleet.model_ab import run_model_ab  # another part of the fleet library

                doc = run_model_ab(self.fleet, Path(form["model"]), rounds=form["rounds"], progress=progress)
            after = {n.name: v for n, v in self.fleet.map(lambda n: n.stats()).items()}
            reasons = fallback_reasons(before, after)
            settings = {k: v for k, v in form.items() if k != "workload"}
            make = synthetic_run if form["workload"] == "synthetic" else model_run
            outcome = make(doc, settings, started, time.monotonic() - t0, reasons)
        except Exception as exc:  # a node down, refused, no model tools: shown, never a traceback
            outcome = exc
        if not worker.is_cancelled:
            self.app.call_from_thread(self._finished, outcome)

    def _progress(self, step: str, fraction: float) -> None:
        self.query_one("#ab-state", Static).update(Text(f"{fraction:4.0%} {step}", style="italic"))

    def _finished(self, outcome: AbRun | BaseException) -> None:
        self.running = False
        self.query_one("#ab-run", Button).disabled = False
        self.query_one("#ab-run", Button).focus()  # disabling it moved the focus into the form
        for part in ("#ab-verdict", "#ab-results"):
            self.query_one(part).remove_class("old")
        state = self.query_one("#ab-state", Static)
        if isinstance(outcome, BaseException):
            state.update(Text(f"A/B failed: {reason(outcome)}", style="bold red"))
            return
        run = outcome
        self.history.append(run)
        self.result = run.doc
        state.update(Text(f"done in {run.seconds:.1f}s ({run.workload})"))
        verdict = [Text(run.verdict, style="bold green" if run.ok else "bold red")]
        if run.workload == "synthetic":
            verdict[0] = ab_verdict(run.doc)  # outputs, then the speed with the runs' spread
        if run.warning:
            verdict.append(Text(f"warning: {run.warning}", style="bold yellow"))
        self.query_one("#ab-verdict", Static).update(Group(*verdict))
        self.query_one("#ab-table", Static).update(
            ab_table(run.doc) if run.workload == "synthetic" else self._model_table(run)
        )
        self.query_one("#ab-chart", Static).update(chart_table(run))
        same = run.doc.get("outputs_identical", run.doc.get("ok"))
        self.query_one("#ab-history", DataTable).add_row(
            str(len(self.history)),
            time.strftime("%H:%M:%SZ", time.gmtime(run.started)),
            run.workload,
            f"{run.seconds:.1f}s",
            Text("identical", style="green") if same else Text("DIFFERENT", style="bold red"),
            run.speedup or "-",
            Text("copied", style="green")
            if not run.warning
            else Text("never copied" if "never" in run.warning else "fell back", style="yellow"),
        )

    @staticmethod
    def _model_table(run: AbRun) -> Table:
        arms = run.doc.get("arms", {})
        t = Table(title="hub vs direct: median (min-max) over rounds")
        t.add_column("")
        for arm in arms:
            t.add_column(arm, justify="right")
        metrics = sorted({m for a in arms.values() for m in a.get("median", {})})
        for m in metrics:
            cells = []
            for a in arms.values():
                lo, hi = a.get("spread", {}).get(m, (0, 0))
                cells.append(f"{a['median'].get(m, 0):.1f} ({lo:.1f}-{hi:.1f})")
            t.add_row(m, *cells)
        t.add_row("peer copies", *(str(a.get("copies_ok", 0)) for a in arms.values()))
        t.add_row("output md5", *(a.get("md5", "")[:12] for a in arms.values()))
        return t

    def action_export(self) -> None:
        if not self.history:
            self.notify("no finished run to export yet", severity="warning")
            return
        path = self.export_dir / time.strftime("fleetd-ab-%Y%m%d-%H%M%S.json")
        try:
            path.write_text(json.dumps([r.as_dict() for r in self.history], indent=2, default=str) + "\n")
        except OSError as exc:
            self.notify(f"export failed: {path}: {exc.strerror or exc}", severity="error")
            return
        self.notify(f"{len(self.history)} run(s) written to {path}")
