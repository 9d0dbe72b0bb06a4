"""ServingPanel: the `fleetctl serve` the dashboard follows, in one or two lines.

    Serve http://127.0.0.1:8080  serving  2.0 req/s  prompt 1 149 t/s  decode 36.1 t/s
    layers local-0 0-0 (1) · local-1 1-1 (1) + output

The first line: the URL, the phase (serving; loading, down or stopped with the reason; not
running when the serve does not answer), and while it serves the requests/s and prompt and
decode t/s between the last two polls. Its parts have priorities as the node table's columns
do: on a narrow terminal the prompt rate gives way first, then requests/s and decode; the URL
and the phase stay (a long reason ends in an ellipsis). The second line: the layers each node
of the plan holds. `one_line` (the screen sets it on a short terminal) folds that line into the
first as its last part, cut at the edge, or left out where fewer than ONE_LINE_LAYERS_MIN cells
remain. Without a view (no serve found) the panel is hidden and
takes no room.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.cells import cell_len
from rich.text import Text
from textual.reactive import reactive
from textual.widgets import Static

from fleetd.fleet.render import fmt_count
from fleetd.fleet.serve_control import ServingRates, ServingSample

NOT_RUNNING = "not running"
PHASE_COLOURS = {"serving": "green", "loading": "yellow"}  # any other phase: red
LAYER_SEPARATOR = " · "
ONE_LINE_LAYERS_MIN = 24  # cells the layers need on a folded line (cut shorter they say nothing)


@dataclass(frozen=True)
class StageLayers:
    """One node of the serve's plan and the layers it holds: [first, stop), and the output."""

    name: str
    first: int
    stop: int
    output: bool = False

    def text(self) -> str:
        count = self.stop - self.first
        held = f"{self.first}-{self.stop - 1} ({count})" if count > 0 else "none"
        return f"{self.name} {held}" + (" + output" if self.output else "")


@dataclass(frozen=True)
class ServingView:
    """What the screen hands down: the serve's URL, its phase and reason, the layers per node and
    the rates since the poll before (None until there are two samples, or while not serving)."""

    url: str
    phase: str
    reason: str = ""
    stages: tuple[StageLayers, ...] = ()
    rates: ServingRates | None = None

    @classmethod
    def of(
        cls, url: str, sample: ServingSample, stages: tuple[StageLayers, ...], rates: ServingRates | None
    ) -> ServingView:
        return cls(url, sample.phase, sample.reason, stages, rates if sample.phase == "serving" else None)

    @classmethod
    def not_running(cls, url: str, why: str) -> ServingView:
        return cls(url, NOT_RUNNING, why)


def stage_layers(stages: Sequence[dict]) -> tuple[StageLayers, ...]:
    """The stages of /fleet/status as StageLayers; ValueError when one is not of that shape."""
    try:
        return tuple(
            StageLayers(str(s["name"]), int(s["layers"][0]), int(s["layers"][1]), bool(s.get("output")))
            for s in stages
        )
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ValueError(f"/fleet/status: a stage without its name or layers ({exc!r})") from exc


def fmt_tps(v: float) -> str:
    return fmt_count(v, 0 if v >= 100 else 1)


def fit_parts(parts: Sequence[tuple[Text, int]], width: int) -> Text:
    """The parts (text, priority) that fit `width` cells, by priority then in their order, two
    spaces apart (one when that keeps more); priority 1 always stays."""
    best: list[Text] = []
    best_gap = 2
    for gap in (2, 1):
        chosen: set[int] = set()
        used = -gap
        for i, (text, priority) in sorted(enumerate(parts), key=lambda p: p[1][1]):
            need = gap + cell_len(text.plain)
            if used + need > width and priority > 1:
                continue
            chosen.add(i)
            used += need
        kept = [text for i, (text, _) in enumerate(parts) if i in chosen]
        if len(kept) > len(best):
            best, best_gap = kept, gap
        if len(kept) == len(parts):
            break
    return Text(" " * best_gap).join(best)


def status_line(view: ServingView, width: int) -> Text:
    parts: list[tuple[Text, int]] = [(Text.assemble(("Serve", "bold"), " ", view.url), 1)]
    colour = PHASE_COLOURS.get(view.phase, "red")
    phase = Text(view.phase, style=f"bold {colour}")
    if view.reason:
        phase.append(f": {view.reason}", style=colour)
    parts.append((phase, 1))
    if view.rates is not None:
        r = view.rates
        parts.append((Text(f"{fmt_count(r.requests_per_s, 1)} req/s"), 2))
        parts.append((Text(f"prompt {fmt_tps(r.prompt_tps)} t/s"), 3))
        parts.append((Text(f"decode {fmt_tps(r.decode_tps)} t/s"), 2))
    return fit_parts(parts, width)


def layers_line(view: ServingView) -> Text | None:
    if view.phase == NOT_RUNNING or not view.stages:
        return None
    return Text.assemble(("layers ", "dim"), LAYER_SEPARATOR.join(s.text() for s in view.stages))


def serving_text(view: ServingView, width: int, one_line: bool = False) -> Text:
    """The panel's text at `width` cells: each line cut there with an ellipsis."""
    first, layers = status_line(view, width), layers_line(view)
    if layers is None:
        lines = [first]
    elif one_line:
        room = width - cell_len(first.plain) - 2
        fits = room >= min(cell_len(layers.plain), ONE_LINE_LAYERS_MIN)
        lines = [Text("  ").join([first, layers]) if fits else first]
    else:
        lines = [first, layers]
    for line in lines:
        line.truncate(max(width, 1), overflow="ellipsis")
    return Text("\n").join(lines)


class ServingPanel(Static):
    """The serve's state in one or two lines; hidden while the screen has no serve to show."""

    DEFAULT_CSS = """
    ServingPanel { height: auto; display: none; }
    """

    # repaint=False: the watchers redraw, and only when the text changed.
    view: reactive[ServingView | None] = reactive(None, always_update=True, repaint=False)
    one_line = reactive(False, repaint=False)

    text: Text | None = None  # what the panel shows now (None: hidden)

    def watch_view(self, view: ServingView | None) -> None:
        self.display = view is not None
        self._redraw()

    def watch_one_line(self) -> None:
        self._redraw()

    def on_resize(self) -> None:
        self._redraw(layout=True)  # the text laid out at the old width may have wrapped

    def _redraw(self, layout: bool = False) -> None:
        if self.view is None:
            self.text = None
            return
        width = self.content_size.width or max(self.app.size.width - 2, 1)  # before the first layout
        text = serving_text(self.view, width, self.one_line)
        if text == self.text and not layout:
            return  # the same numbers: no redraw
        # The same number of lines: the same height, no layout pass.
        layout = layout or self.text is None or len(text.split()) != len(self.text.split())
        self.text = text
        self.update(text, layout=layout)
