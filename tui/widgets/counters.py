"""Counters: the selected node's commands since the last reset, with per-second rates, and its
graph computes, peer copies and fallbacks. `rates_between` turns two /v1/stats answers into
commands/s and bytes/s for the node table. The tables are fleetd.fleet.render's, the same
ones fleetctl stats prints."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Group
from rich.text import Text
from textual.reactive import reactive
from textual.widgets import Static

from fleetd.fleet.control_docs import NodeStats
from fleetd.fleet.render import activity_table, stats_table


@dataclass(frozen=True)
class Rates:
    commands_per_s: float
    bytes_per_s: float  # request and response bytes together


def rates_between(before: NodeStats, after: NodeStats, seconds: float) -> Rates | None:
    """Rates over two successive /v1/stats answers `seconds` apart; None when the counters were
    reset in between (a new `since`, or totals that went down), since no rate is known then."""
    if seconds <= 0 or before.since != after.since:
        return None
    c0, b0 = before.total.command_count, before.total.bytes_moved
    c1, b1 = after.total.command_count, after.total.bytes_moved
    if c1 < c0 or b1 < b0:
        return None
    return Rates((c1 - c0) / seconds, (b1 - b0) / seconds)


@dataclass(frozen=True)
class CounterSample:
    """What the screen hands down: one node's latest stats and the sample before it."""

    node: str
    stats: NodeStats | None  # None: the node is down or not polled yet
    previous: NodeStats | None = None
    seconds: float | None = None


class Counters(Static):
    """Per-command table of one node, with the renderers fleetctl stats uses."""

    # always_update: two samples of an idle node compare equal but still deserve a redraw
    # (the Count/s column goes back to 0).
    sample: reactive[CounterSample | None] = reactive(None, always_update=True)

    def watch_sample(self, sample: CounterSample | None) -> None:
        if sample is None:
            self.update(Text("no node selected", style="dim"))
        elif sample.stats is None:
            self.update(Text(f"{sample.node}: no counters (down or not answered yet)", style="dim"))
        else:
            previous = {sample.node: sample.previous} if sample.previous is not None else None
            self.update(Group(
                stats_table({sample.node: sample.stats}, previous, sample.seconds),
                activity_table({sample.node: sample.stats}),
            ))
