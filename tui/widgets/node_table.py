"""NodeTable: one row per fleetd node, filled from /v1/status and /v1/stats answers.

Columns have a priority: `fit(width)` keeps, in table order, the most important ones that fit
the width it is given, so an 80-column terminal still shows node, state, P2P, rates, the
history line and staleness without a horizontal scroll; version, uptime and the like come back
on a wider terminal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rich.cells import cell_len
from rich.text import Text
from textual.binding import Binding, BindingType
from textual.widgets import DataTable
from textual.widgets.data_table import ColumnKey

from fleetd.fleet.control_docs import NodeStats, NodeStatus
from fleetd.fleet.render import fmt_bytes, fmt_count, fmt_duration, p2p_text, spark_text
from tui.history import Rates

SPARK_WIDTH = 10


@dataclass(frozen=True)
class Column:
    """A NodeTable column: its key, header, width and priority (lower stays longer when narrow)."""

    key: str  # what tests and update_cell use
    label: str
    priority: int  # 1 is kept longest when the terminal is narrow
    width: int  # the widest cell expected, for fitting


COLUMNS = (
    Column("node", "Node", 1, 12),
    Column("host", "Host", 8, 16),
    Column("state", "State", 1, 5),
    Column("version", "Version", 7, 8),
    Column("rpc", "RPC", 7, 6),
    Column("p2p", "P2P", 1, 3),
    Column("sessions", "Sess", 5, 4),
    Column("uptime", "Uptime", 7, 7),
    Column("commands", "Commands", 4, 9),
    Column("commands_per_s", "Cmd/s", 2, 8),
    Column("bytes_per_s", "Bytes/s", 2, 11),
    Column("history", "History", 3, SPARK_WIDTH),
    Column("copies", "Copies", 6, 7),
    Column("fallbacks", "Fallb.", 6, 6),
    Column("seen", "Seen", 2, 5),
    Column("latency", "Poll", 3, 5),
)
CELL_PADDING = 2  # DataTable's one space each side


def fit_columns(width: int) -> tuple[Column, ...]:
    """The columns to show in `width` cells: by priority, then in table order."""
    chosen: set[str] = set()
    used = 0
    for col in sorted(COLUMNS, key=lambda c: c.priority):
        need = max(col.width, len(col.label)) + CELL_PADDING
        if used + need > width and col.priority > 1:
            continue
        chosen.add(col.key)
        used += need
    return tuple(c for c in COLUMNS if c.key in chosen)


@dataclass(frozen=True)
class NodeRow:
    """What one row shows, already formatted: the table only places it."""

    name: str
    host: str = ""
    status: NodeStatus | BaseException | None = None  # None: no answer yet
    stats: NodeStats | None = None
    rates: Rates | None = None
    p2p_pending: bool = False
    history: tuple[float, ...] = ()  # commands/s of the recent polls, oldest first
    seen_seconds: float | None = None  # since the node last answered (a failed poll is no answer)
    never_answered: bool = False  # polled, and no poll was ever answered
    fresh_seconds: float = 1.5  # an answer younger than this shows as "now"
    latency_seconds: float | None = None  # how long the last poll took, or the hanging one runs
    poll_hanging: bool = False  # a poll still in flight, longer than the last one took
    stale: bool = False  # no answer for two poll intervals: the values shown are old


def fmt_age(seconds: float | None, fresh: float = 1.0) -> str:
    """How long ago a node last answered: "now" within `fresh` seconds (the poll interval and a
    half: a healthy node's cell stays the same from poll to poll, so the idle dashboard does not
    redraw it), else the age itself."""
    if seconds is None:
        return ""
    if seconds < fresh:
        return "now"
    return f"{seconds:.1f}s" if seconds < 10 else fmt_duration(seconds)


def fmt_uptime(seconds: float) -> str:
    """Uptime to the minute past the first minute: one redraw a minute, not one a second."""
    if seconds < 60:
        return fmt_duration(seconds)
    return f"{int(seconds) // 60}m" if seconds < 3600 else fmt_duration(seconds)


def fmt_latency(seconds: float | None) -> str:
    """A poll's latency to one significant figure from 10 ms up ("<10ms", "30ms", "200ms"): what
    tells a loaded link from a healthy one, without a redraw for every millisecond of jitter."""
    if seconds is None:
        return ""
    ms = seconds * 1000
    if ms < 10:
        return "<10ms"
    digits = len(str(int(ms))) - 1
    return f"{round(ms, -digits):.0f}ms" if ms < 10_000 else f"{seconds:.0f}s"


def row_cells(row: NodeRow) -> dict[str, object]:
    cells: dict[str, object] = {c.key: "" for c in COLUMNS}
    cells.update(
        node=row.name,
        host=row.host,
        seen="never" if row.never_answered else fmt_age(row.seen_seconds, row.fresh_seconds),
        latency=fmt_latency(row.latency_seconds),
    )
    if row.poll_hanging:  # its age so far, growing: not the last good poll's
        cells["latency"] = Text(f">{fmt_latency(row.latency_seconds)}", style="bold yellow")
    if row.stale:
        cells["seen"] = Text(cells["seen"], style="bold yellow")
    if row.status is None:
        cells["state"] = Text("…", style="dim")
        return cells
    if isinstance(row.status, BaseException):  # the reason goes under the table: too long here
        cells["state"] = Text("down", style="bold red")
        return cells
    st = row.status
    cells.update(
        state=Text("stale", style="bold yellow") if row.stale else Text("up", style="bold green"),
        version=st.version,
        rpc=f":{st.rpc_port}",
        p2p=Text("…", style="italic") if row.p2p_pending else p2p_text(st.p2p),
        sessions=str(len(st.sessions)),
        uptime=fmt_uptime(st.uptime_seconds),
    )
    if row.stats is not None:
        cells.update(
            commands=fmt_count(row.stats.total.command_count),
            copies=fmt_count(row.stats.peer.copies_ok),
            fallbacks=fmt_count(row.stats.peer.fallback_count),
        )
    if row.rates is not None:
        cells.update(
            commands_per_s=fmt_count(row.rates.commands_per_s, 1),
            bytes_per_s=f"{fmt_bytes(row.rates.bytes_per_s)}/s",
        )
    if row.history:
        cells["history"] = spark_text(row.history, SPARK_WIDTH)
    return cells


def _same(a: object, b: object) -> bool:
    if isinstance(a, Text) and isinstance(b, Text):
        return a.plain == b.plain and a.style == b.style and a.spans == b.spans
    return type(a) is type(b) and a == b


class NodeTable(DataTable):
    """Rows are keyed by the screen's node key; `show` adds or refreshes one, `fit` picks the
    columns for a width."""

    # DataTable's own Enter is hidden: this one says in the footer what it opens
    BINDINGS: ClassVar[list[BindingType]] = [Binding("enter", "select_cursor", "Node", show=True)]

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self.columns_shown: tuple[Column, ...] = ()
        self._rows: dict[str, NodeRow] = {}
        self._set_columns(COLUMNS)

    def _set_columns(self, columns: tuple[Column, ...]) -> None:
        cursor = self.cursor_row
        self.clear(columns=True)
        self.columns_shown = columns
        for c in columns:
            self.add_column(c.label, key=c.key)
        for key, row in self._rows.items():
            cells = row_cells(row)
            self.add_row(*(cells[c.key] for c in columns), key=key)
        if self.row_count:
            self.move_cursor(row=min(cursor, self.row_count - 1))

    def fit(self, width: int) -> None:
        columns = fit_columns(width)
        if columns != self.columns_shown:
            self._set_columns(columns)

    def show(self, key: str, row: NodeRow) -> None:
        before = self._rows.get(key)
        if before == row:
            return  # nothing new: no redraw (the idle dashboard's CPU)
        self._rows[key] = row
        cells = row_cells(row)
        if key not in self.rows:
            self.add_row(*(cells[c.key] for c in self.columns_shown), key=key)
            return
        old = row_cells(before) if before is not None else {}
        for c in self.columns_shown:
            cell = cells[c.key]
            if c.key in old and _same(old[c.key], cell):
                continue
            # Widths are measured again only when a cell outgrows its column: a re-measure
            # means a layout pass, the costliest part of a refresh.
            wider = cell_len(str(cell)) > self.columns[ColumnKey(c.key)].content_width
            self.update_cell(key, c.key, cell, update_width=wider)

    @property
    def selected_key(self) -> str | None:
        if not self.row_count:
            return None
        return self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value
