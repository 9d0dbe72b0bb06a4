"""The HELLO gate: every rule about command order and the handshake lives here, for both roles.

Protocol 7 has one ordering rule: the handshake command (HELLO, `CommandSpec.handshake` in the
table) first, exactly once. A peer that breaks it, or sends a byte not in the command table, puts
the connection in ERROR and every later call refuses. The client side also keeps what the
handshake negotiated: the server's version and the feature bits both sides know.
"""

from __future__ import annotations

import enum

from fleetd.errors import LocalProtocolError, RemoteProtocolError
from fleetd.wire.commands import COMMANDS, PROTOCOL_VERSION, Feature, cmd_name

KNOWN_FEATURES = sum(Feature)


class State(enum.Enum):
    """Where a connection stands in the HELLO gate; ERROR is final."""

    AWAIT_HELLO = "await-hello"
    READY = "ready"
    ERROR = "error"


class HelloGate:
    """One connection's handshake state, for either role, and what the client's HELLO negotiated."""

    __slots__ = ("state", "version", "features")

    def __init__(self) -> None:
        self.state = State.AWAIT_HELLO
        self.version: tuple[int, int, int] | None = None  # the server's, once negotiated
        self.features = Feature(0)

    def check(self, cmd: int) -> None:
        """Server side: accept received command byte `cmd` or raise RemoteProtocolError (and move
        to ERROR)."""
        if self.state is State.READY:
            spec = COMMANDS.get(cmd)
            if spec is not None and not spec.handshake:
                return
        reason = self._refusal(cmd)
        if reason is None:
            self.state = State.READY
            return
        self.state = State.ERROR
        raise RemoteProtocolError(reason)

    def check_send(self, cmd: int) -> None:
        """Client side: may request `cmd` go out now? LocalProtocolError if not (our own misuse:
        the connection stays usable)."""
        reason = self._refusal(cmd)
        if reason is not None:
            raise LocalProtocolError(f"{cmd_name(cmd)}: {reason}")
        self.state = State.READY

    def _refusal(self, cmd: int) -> str | None:
        if self.state is State.ERROR:
            return "connection already failed"
        spec = COMMANDS.get(cmd)
        if self.state is State.AWAIT_HELLO:
            if spec is None or not spec.handshake:
                return f"expected HELLO first, got {cmd_name(cmd)}"
            return None
        if spec is None:
            return f"unknown command {cmd:#x}"
        return f"second {cmd_name(cmd)} on one connection" if spec.handshake else None

    def negotiate(self, version: tuple[int, int, int], features: int) -> None:
        """Client side: the server's HELLO reply. Same major, a minor we know; feature bits we
        do not know stay off."""
        major, minor, patch = version
        if major != PROTOCOL_VERSION[0] or minor > PROTOCOL_VERSION[1]:
            self.state = State.ERROR
            raise RemoteProtocolError(f"HELLO: server version {major}.{minor}.{patch} unsupported")
        self.version = (major, minor, patch)
        self.features = Feature(features & KNOWN_FEATURES)

    def fail(self) -> None:
        self.state = State.ERROR
