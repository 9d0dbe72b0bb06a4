"""Counters: the selected node's commands since the last reset, with per-second rates (count and
bytes) of each, and its graph computes, peer copies and fallbacks. The tables are
fleetd.fleet.render's, the same ones fleetctl stats prints."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Group
from rich.text import Text
from textual.reactive import reactive
from textual.widgets import Static

from fleetd.fleet.control_docs import NodeStats
from fleetd.fleet.render import activity_table, command_table
from tui.history import Rates, rates_between

__all__ = ["CounterSample", "Counters", "Rates", "rates_between"]


@dataclass(frozen=True)
class CounterSample:
    """What the screen hands down: one node's latest stats and the rates since the poll before."""

    node: str
    stats: NodeStats | None  # None: the node is down or not polled yet
    rates: Rates | None = None


def per_command(rates: Rates | None) -> dict[str, tuple[float, float]] | None:
    if rates is None:
        return None
    return {name: (r.count_per_s, r.bytes_per_s) for name, r in rates.per_command.items()}


class Counters(Static):
    """Per-command table of one node, with the renderers fleetctl stats uses."""

    # always_update: two samples of an idle node compare equal but still deserve a redraw
    # (the Count/s column goes back to 0).
    sample: reactive[CounterSample | None] = reactive(None, always_update=True, repaint=False)
    _shape: tuple | None = None
    _shown: tuple | None = None

    def watch_sample(self, sample: CounterSample | None) -> None:
        if sample is None:
            self.update(Text("no node selected", style="dim"))
        elif sample.stats is None:
            self.update(Text(f"{sample.node}: no counters (down or not answered yet)", style="dim"))
        else:
            rates = per_command(sample.rates)
            shown = (sample.node, sample.stats.total, sample.stats.peer, rates)
            if shown == self._shown:
                return  # an idle node: the same numbers, no redraw
            # The same commands in the same rows: the height is the same, no layout pass.
            shape = (sample.node, tuple(sample.stats.total.used()), rates is not None)
            self.update(
                Group(command_table(sample.stats, rates), activity_table({sample.node: sample.stats})),
                layout=shape != self._shape,
            )
            self._shape, self._shown = shape, shown
            return
        self._shape = self._shown = None
