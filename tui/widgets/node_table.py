"""NodeTable: one row per fleetd node, filled from /v1/status and /v1/stats answers."""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.widgets import DataTable

from fleetd.fleet.control_docs import NodeStats, NodeStatus
from fleetd.fleet.render import fmt_bytes, fmt_duration, p2p_text
from tui.widgets.counters import Rates

# (column key, label); the keys are what tests and update_cell use.
COLUMNS = (
    ("node", "Node"), ("state", "State"), ("version", "Version"), ("rpc", "RPC"), ("p2p", "P2P"),
    ("sessions", "Sessions"), ("uptime", "Uptime"), ("commands", "Commands"),
    ("commands_per_s", "Cmd/s"), ("bytes_per_s", "Bytes/s"), ("copies", "Peer copies"),
    ("fallbacks", "Fallbacks"),
)


@dataclass(frozen=True)
class NodeRow:
    name: str
    status: NodeStatus | BaseException | None = None  # None: no answer yet
    stats: NodeStats | None = None
    rates: Rates | None = None
    p2p_pending: bool = False


def row_cells(row: NodeRow) -> list:
    blank = [""] * (len(COLUMNS) - 2)
    if row.status is None:
        return [row.name, Text("…", style="dim"), *blank]
    if isinstance(row.status, BaseException):  # the reason goes under the table: too long here
        return [row.name, Text("down", style="bold red"), *blank]
    st = row.status
    p2p = Text("switching…", style="italic") if row.p2p_pending else p2p_text(st.p2p)
    cells = [
        row.name, Text("up", style="bold green"), st.version, f":{st.rpc_port}", p2p,
        str(len(st.sessions)), fmt_duration(st.uptime_seconds),
    ]
    if row.stats is None:
        return cells + [""] * 5
    peer = row.stats.peer
    rates = row.rates
    return cells + [
        f"{row.stats.total.command_count:,}",
        f"{rates.commands_per_s:,.1f}" if rates else "",
        f"{fmt_bytes(rates.bytes_per_s)}/s" if rates else "",
        f"{peer.copies_ok:,}",
        f"{peer.fallback_count:,}",
    ]


class NodeTable(DataTable):
    """Rows are keyed by the screen's node key; `show` adds or refreshes one."""

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        for key, label in COLUMNS:
            self.add_column(label, key=key)

    def show(self, key: str, row: NodeRow) -> None:
        cells = row_cells(row)
        if key not in self.rows:
            self.add_row(*cells, key=key)
            return
        for (column, _), cell in zip(COLUMNS, cells, strict=True):
            self.update_cell(key, column, cell, update_width=True)

    @property
    def selected_key(self) -> str | None:
        if not self.row_count:
            return None
        return self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value
