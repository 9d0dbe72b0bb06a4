"""Rates between two /v1/stats answers, and the last minutes of them per node.

    rates = rates_between(before, after, seconds)    # None across a counter reset
    history = History()                              # one per node, kept by the dashboard
    history.add(at, rates)
    history.series("commands_per_s")                 # oldest first, what a sparkline draws

Pure data: no Textual, no SSH. The dashboard feeds it; the node table, the node screen and
their sparklines read it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from fleetd.fleet.control_docs import NodeStats

# Five minutes at the default 1 s poll: what "the last minutes" means on every screen.
HISTORY_POINTS = 300


@dataclass(frozen=True)
class CommandRate:
    """One command's rate between two polls."""

    count_per_s: float
    bytes_per_s: float  # request and response bytes of this command together


@dataclass(frozen=True)
class Rates:
    """A node's rates between two polls: commands, bytes each way, peer copy, and per command."""

    commands_per_s: float
    request_bytes_per_s: float  # into the node (what clients sent)
    response_bytes_per_s: float  # out of the node (what it answered)
    peer_bytes_per_s: float = 0.0  # pushed to peers by COPY_TENSOR_TO
    per_command: Mapping[str, CommandRate] = field(default_factory=dict)

    @property
    def bytes_per_s(self) -> float:
        return self.request_bytes_per_s + self.response_bytes_per_s


def rates_between(before: NodeStats, after: NodeStats, seconds: float) -> Rates | None:
    """Rates over two successive /v1/stats answers `seconds` apart; None when the counters were
    reset in between (a new `since`, or totals that went down), since no rate is known then."""
    if seconds <= 0 or before.since != after.since:
        return None
    b, a = before.total, after.total
    if a.command_count < b.command_count or a.bytes_moved < b.bytes_moved:
        return None
    per_command = {}
    for name, c in a.commands.items():
        old = b.commands.get(name)
        if old is None:
            continue
        moved = (c.request_bytes + c.response_bytes) - (old.request_bytes + old.response_bytes)
        per_command[name] = CommandRate((c.count - old.count) / seconds, max(0, moved) / seconds)
    req = sum(c.request_bytes for c in a.commands.values()) - sum(
        c.request_bytes for c in b.commands.values()
    )
    resp = sum(c.response_bytes for c in a.commands.values()) - sum(
        c.response_bytes for c in b.commands.values()
    )
    peer = max(0, after.peer.bytes_pushed - before.peer.bytes_pushed)
    return Rates(
        (a.command_count - b.command_count) / seconds,
        max(0, req) / seconds,
        max(0, resp) / seconds,
        peer / seconds,
        per_command,
    )


# The series a History keeps, by the Rates attribute they come from.
SERIES = ("commands_per_s", "request_bytes_per_s", "response_bytes_per_s", "peer_bytes_per_s")


class History:
    """One node's recent rates (at most `points`), oldest first. A poll without a rate (the
    first one, a reset, the node down) adds a gap as 0, so time stays even along the line."""

    def __init__(self, points: int = HISTORY_POINTS) -> None:
        self.points: deque[tuple[float, Rates | None]] = deque(maxlen=points)

    def add(self, at: float, rates: Rates | None) -> None:
        self.points.append((at, rates))

    def __len__(self) -> int:
        return len(self.points)

    def series(self, name: str) -> list[float]:
        return [getattr(r, name) if r is not None else 0.0 for _, r in self.points]

    @property
    def latest(self) -> Rates | None:
        return self.points[-1][1] if self.points else None
