"""HistoryPanel: one node's last minutes as sparklines, one line per series (commands/s, bytes
in/s, bytes out/s, peer bytes/s), each with its latest value and its peak."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widgets import Static

from fleetd.fleet.render import fmt_bytes, fmt_count, spark_text
from tui.history import History

# (History series, label, formatter, colour)
LINES = (
    ("commands_per_s", "commands/s", lambda v: fmt_count(v, 1), "cyan"),
    ("request_bytes_per_s", "bytes in/s", fmt_bytes, "green"),
    ("response_bytes_per_s", "bytes out/s", fmt_bytes, "blue"),
    ("peer_bytes_per_s", "peer bytes/s", fmt_bytes, "magenta"),
)
LABEL_WIDTH, VALUE_WIDTH, PEAK_WIDTH = 12, 11, 14


def spark_width(width: int) -> int:
    return max(8, width - LABEL_WIDTH - VALUE_WIDTH - PEAK_WIDTH - 3)


class HistoryPanel(Static):
    """A node's recent rates, one sparkline per series; redrawn only when what it shows changed."""

    DEFAULT_CSS = """
    HistoryPanel { height: auto; }
    """

    # repaint=False: the watcher redraws, and only when what it would draw changed.
    history: reactive[History | None] = reactive(None, always_update=True, repaint=False)

    _shown: tuple | None = None  # what the last update drew: an idle node's lines stay the same

    def watch_history(self, history: History | None) -> None:
        width = self.content_size.width
        tail = spark_width(width)
        has_points = history is not None and len(history) > 0
        shown = (
            id(history),
            width,
            has_points,
            tuple(tuple(history.series(series)[-tail:]) for series, *_ in LINES) if has_points else None,
        )
        if shown == self._shown:
            return
        # One line ("no history yet") or four: a layout pass whenever that changes, or the panel
        # keeps the height of the one line and shows the first series only.
        layout = self._shown is None or self._shown[2] != has_points
        self._shown = shown
        self.update(self.render_history(history, width), layout=layout)

    def on_resize(self) -> None:
        self._shown = None
        self.watch_history(self.history)

    @staticmethod
    def render_history(history: History | None, width: int):
        if history is None or not len(history):
            return Text("no history yet", style="dim")
        spark = spark_width(width)
        t = Table.grid(padding=(0, 1))
        t.add_column(width=LABEL_WIDTH, no_wrap=True)
        t.add_column(width=spark, no_wrap=True, overflow="crop")
        t.add_column(justify="right", width=VALUE_WIDTH, no_wrap=True)
        t.add_column(justify="right", width=PEAK_WIDTH, no_wrap=True)
        for series, label, fmt, colour in LINES:
            values = history.series(series)
            t.add_row(
                label,
                spark_text(values, spark, colour),
                fmt(values[-1]),
                Text(f"max {fmt(max(values))}", style="dim"),
            )
        return t
