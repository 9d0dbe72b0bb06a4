"""Sans-IO connections: bytes in, request events out (server); requests in, bytes out (client).

    conn = ServerConnection()
    conn.receive_data(chunk)
    event = conn.next_event()        # a Request, or NEED_DATA
    if isinstance(event, SetTensor): # its data follows as a body of event.size bytes
        n = conn.read_body_into(dst) # what is already buffered; the shell recv_into()s the rest
        conn.body_received(k)        # ...and reports what it read itself

Nothing here touches a socket, a thread or a clock.
"""

from __future__ import annotations

import struct

from fleetd.errors import LocalProtocolError, RemoteProtocolError
from fleetd.wire.commands import (
    COMMANDS,
    PROTOCOL_VERSION,
    Cmd,
    Feature,
    Request,
    SetTensor,
    cmd_name,
)
from fleetd.wire.state import HelloGate, State

_HEADER = struct.Struct("<BQ")  # | cmd u8 | payload_size u64 |
KNOWN_FEATURES = sum(Feature)
_SIZE = struct.Struct("<Q")


class _NeedData:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = _NeedData()


def size_rule_error(cmd: int, size: int) -> str | None:
    """Why a `payload_size` is unacceptable for `cmd`, checked before any payload is read."""
    spec = COMMANDS[cmd]
    if spec.size is not None:
        if size != spec.size:
            return f"{cmd_name(cmd)}: payload size {size}, expected {spec.size}"
        return None
    if size < spec.min_size:
        return f"{cmd_name(cmd)}: payload size {size} below minimum {spec.min_size}"
    if spec.max_size is not None and size > spec.max_size:
        return f"{cmd_name(cmd)}: payload size {size} above limit {spec.max_size}"
    return None


class ServerConnection:
    """The server's view of one RPC connection."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0
        self._gate = HelloGate()
        self.body_remaining = 0
        self._gate_passed = False  # the command byte at _pos was already let through the gate
        self.request_bytes = 0  # bytes of the last complete request, header included

    @property
    def state(self) -> State:
        return self._gate.state

    def receive_data(self, data) -> None:
        if self._pos and self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        self._buf += data

    @property
    def buffered(self) -> int:
        return len(self._buf) - self._pos

    def next_event(self):
        if self.body_remaining:
            raise LocalProtocolError("next_event() while a SET_TENSOR body is pending")
        avail = len(self._buf) - self._pos
        if avail < 1:
            return NEED_DATA
        try:
            cmd = self._buf[self._pos]
            if not self._gate_passed:
                self._gate.check(cmd)
                self._gate_passed = True
            if avail < 9:
                return NEED_DATA
            _, size = _HEADER.unpack_from(self._buf, self._pos)
            reason = size_rule_error(cmd, size)
            if reason is not None:
                raise RemoteProtocolError(reason)
            spec = COMMANDS[cmd]
            if cmd == Cmd.SET_TENSOR:
                # Only the header is buffered; the data is a body the shell reads in place.
                if avail < 9 + SetTensor.HEADER_SIZE:
                    return NEED_DATA
                start = self._pos + 9
                header = memoryview(self._buf)[start : start + SetTensor.HEADER_SIZE]
                try:
                    event = SetTensor.decode_header(header, size - SetTensor.HEADER_SIZE)
                finally:
                    header.release()
                self._pos = start + SetTensor.HEADER_SIZE
                self._gate_passed = False
                self.body_remaining = event.size
                self.request_bytes = 9 + size
                return event
            if avail < 9 + size:
                return NEED_DATA
            start = self._pos + 9
            payload = memoryview(self._buf)[start : start + size]
            try:
                event = spec.request.decode(payload)
            finally:
                payload.release()
            self._pos = start + size
            self._gate_passed = False
            self.request_bytes = 9 + size
            return event
        except RemoteProtocolError:
            self._gate.fail()
            raise
        except (struct.error, ValueError) as exc:
            self._gate.fail()
            raise RemoteProtocolError(f"{cmd_name(cmd)}: malformed payload: {exc}") from exc

    def read_body_into(self, dst: memoryview) -> int:
        """Move already-buffered body bytes into `dst`; return how many."""
        n = min(len(dst), self.body_remaining, len(self._buf) - self._pos)
        if n:
            dst[:n] = self._buf[self._pos : self._pos + n]
            self._pos += n
            self.body_remaining -= n
        return n

    def body_received(self, n: int) -> None:
        """The shell read `n` body bytes from the stream itself."""
        if n > self.body_remaining:
            raise LocalProtocolError(f"body_received({n}) with {self.body_remaining} pending")
        self.body_remaining -= n

    def fail(self) -> None:
        self._gate.fail()


def encode_response(cmd: int, *values) -> bytes:
    spec = COMMANDS[cmd]
    if spec.response is None:
        raise LocalProtocolError(f"{cmd_name(cmd)} has no response")
    return _SIZE.pack(spec.response.size) + spec.response.pack(*values)


def data_response_header(size: int) -> bytes:
    """Header of a GET_TENSOR response; the `size` data bytes follow."""
    return _SIZE.pack(size)


def hello_response(features: int = 0) -> bytes:
    major, minor, patch = PROTOCOL_VERSION
    return encode_response(Cmd.HELLO, major, minor, patch, features, bytes(24))


class ClientConnection:
    """The client's view: encodes requests, knows which ones carry a response and its size."""

    def __init__(self) -> None:
        self._hello_done = False
        self.version: tuple[int, int, int] | None = None
        self.features = Feature(0)

    def send(self, request: Request) -> bytes:
        """Header and payload of `request` (for SET_TENSOR: header only, data follows)."""
        if (request.cmd == Cmd.HELLO) == self._hello_done:
            raise LocalProtocolError(f"{request.cmd.name}: HELLO must come first, once")
        payload = request.encode()
        size = len(payload)
        if isinstance(request, SetTensor):
            size += request.size
        return _HEADER.pack(request.cmd, size) + payload

    @staticmethod
    def response_size(request: Request) -> int | None:
        spec = COMMANDS[request.cmd]
        if spec.variable_response:
            return request.size
        return None if spec.response is None else spec.response.size

    def decode_response(self, request: Request, payload) -> tuple:
        spec = COMMANDS[request.cmd]
        values = spec.response.unpack(payload)
        if request.cmd == Cmd.HELLO:
            major, minor, patch, features, _caps = values
            if major != PROTOCOL_VERSION[0] or minor > PROTOCOL_VERSION[1]:
                raise RemoteProtocolError(f"HELLO: server version {major}.{minor}.{patch} unsupported")
            self.version = (major, minor, patch)
            self.features = Feature(features & KNOWN_FEATURES)  # bits we do not know stay off
            self._hello_done = True
        return values

    @staticmethod
    def check_response_size(request: Request, size: int) -> None:
        expected = ClientConnection.response_size(request)
        if size != expected:
            raise RemoteProtocolError(
                f"{request.cmd.name}: response of {size} bytes, expected {expected}"
            )
