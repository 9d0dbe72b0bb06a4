"""Counters: per command count and bytes, per session, summed into totals when read.

Each session writes only its own counters (no lock on the hot path); readers sum live sessions
plus what closed sessions left behind.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from fleetd.wire import COMMANDS, cmd_name

COMMAND_CODES = sorted(COMMANDS)  # every command code, ascending: the counters' keys


@dataclass
class CommandCounters:
    count: dict[int, int] = field(default_factory=lambda: dict.fromkeys(COMMAND_CODES, 0))
    request_bytes: dict[int, int] = field(default_factory=lambda: dict.fromkeys(COMMAND_CODES, 0))
    response_bytes: dict[int, int] = field(default_factory=lambda: dict.fromkeys(COMMAND_CODES, 0))
    graph_computes: int = 0
    compute_seconds: float = 0.0

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

    def as_dict(self) -> dict:
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
        }


class StatsBook:
    """Totals across sessions: closed sessions fold their counters in here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.closed = CommandCounters()

    def fold(self, counters: CommandCounters) -> None:
        with self._lock:
            self.closed.add(counters)

    def total(self, live: list[CommandCounters]) -> CommandCounters:
        out = CommandCounters()
        with self._lock:
            out.add(self.closed)
        for c in live:
            out.add(c)
        return out

    def reset(self, live: list[CommandCounters]) -> None:
        with self._lock:
            self.closed = CommandCounters()
        for c in live:
            c.__init__()
