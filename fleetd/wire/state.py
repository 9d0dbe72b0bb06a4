"""The HELLO gate: every rule about command order lives here, for both roles.

Protocol 7 has one ordering rule: HELLO first, exactly once. A peer that breaks it, or sends a
byte not in the command table, puts the connection in ERROR and every later call refuses.
"""

from __future__ import annotations

import enum

from fleetd.errors import RemoteProtocolError
from fleetd.wire.commands import COMMANDS, Cmd, cmd_name


class State(enum.Enum):
    AWAIT_HELLO = "await-hello"
    READY = "ready"
    ERROR = "error"


class HelloGate:
    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = State.AWAIT_HELLO

    def check(self, cmd: int) -> None:
        """Accept command byte `cmd` or raise RemoteProtocolError (and move to ERROR)."""
        if self.state is State.READY and cmd != Cmd.HELLO and cmd in COMMANDS:
            return
        reason = self._refusal(cmd)
        if reason is None:
            self.state = State.READY
            return
        self.state = State.ERROR
        raise RemoteProtocolError(reason)

    def _refusal(self, cmd: int) -> str | None:
        if self.state is State.ERROR:
            return "connection already failed"
        if self.state is State.AWAIT_HELLO:
            if cmd != Cmd.HELLO:
                return f"expected HELLO first, got {cmd_name(cmd)}"
            return None
        if cmd == Cmd.HELLO:
            return "second HELLO on one connection"
        return f"unknown command {cmd:#x}"

    def fail(self) -> None:
        self.state = State.ERROR
