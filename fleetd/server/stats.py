"""Counters: per command count and bytes, per session, summed into totals when read.

Each session writes only its own counters (no lock on the hot path); readers sum live sessions
plus what closed sessions left behind. A connection that did nothing but HELLO (fleetctl status,
a deploy's health check, a port probe) is counted apart, in `probe_connections`: polling a node
must not show up as traffic in its command counters.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from fleetd.wire import COMMANDS, Cmd, cmd_name

COMMAND_CODES = sorted(COMMANDS)  # every command code, ascending: the counters' keys


@dataclass
class CommandCounters:
    """Per command: how many were served and the bytes each way; graph computes and their time."""

    count: dict[int, int] = field(default_factory=lambda: dict.fromkeys(COMMAND_CODES, 0))
    request_bytes: dict[int, int] = field(default_factory=lambda: dict.fromkeys(COMMAND_CODES, 0))
    response_bytes: dict[int, int] = field(default_factory=lambda: dict.fromkeys(COMMAND_CODES, 0))
    graph_computes: int = 0
    compute_seconds: float = 0.0
    probe_connections: int = 0  # connections that sent nothing but HELLO (not in `count`)

    @property
    def is_probe(self) -> bool:
        """Nothing but HELLO so far (or nothing at all): a health check, not a client's work."""
        return sum(self.count.values()) == self.count[Cmd.HELLO] <= 1

    def record(self, cmd: int, request_bytes: int, response_bytes: int) -> None:
        """One served command: the session's hot path, so three dict updates and nothing else."""
        self.count[cmd] += 1
        self.request_bytes[cmd] += request_bytes
        self.response_bytes[cmd] += response_bytes

    def add(self, other: CommandCounters) -> None:
        for c in COMMAND_CODES:
            self.count[c] += other.count[c]
            self.request_bytes[c] += other.request_bytes[c]
            self.response_bytes[c] += other.response_bytes[c]
        self.graph_computes += other.graph_computes
        self.compute_seconds += other.compute_seconds
        self.probe_connections += other.probe_connections

    def as_dict(self) -> dict:
        """The counters as /v1/stats sends them: per command by name, then the graph and probe totals."""
        return {
            "commands": {
                cmd_name(c): {
                    "count": self.count[c],
                    "request_bytes": self.request_bytes[c],
                    "response_bytes": self.response_bytes[c],
                }
                for c in COMMAND_CODES
            },
            "graph_computes": self.graph_computes,
            "compute_seconds": round(self.compute_seconds, 6),
            "probe_connections": self.probe_connections,
        }


class StatsBook:
    """Totals across sessions: closed sessions fold their counters in here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.closed = CommandCounters()

    def fold(self, counters: CommandCounters) -> None:
        """A closed session's counters into the totals; a probe only adds to probe_connections."""
        with self._lock:
            if counters.is_probe:
                self.closed.probe_connections += 1
            else:
                self.closed.add(counters)

    def total(self, live: list[CommandCounters]) -> CommandCounters:
        out = CommandCounters()
        with self._lock:
            out.add(self.closed)
        for c in live:
            if not c.is_probe:  # a poll in flight is not traffic either
                out.add(c)
        return out

    def reset(self) -> None:
        """Forget the closed sessions' totals (live sessions zero their own)."""
        with self._lock:
            self.closed = CommandCounters()
