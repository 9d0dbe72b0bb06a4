"""Sans-IO connections, the same three verbs for both roles: send, receive_data, next_event.

    server = ServerConnection()              client = ClientConnection()
    server.receive_data(chunk)               sock.sendall(client.send(AllocBuffer(0, n)))
    event = server.next_event()              client.receive_data(chunk)
    sock.sendall(server.send(reply))         reply = client.next_event()   # AllocBufferReply

`next_event()` returns an event or NEED_DATA. A command with a streamed body leaves its data in
the stream: a SET_TENSOR request on the server side, a GET_TENSOR reply (`DataReply`) on the
client side. The shell moves what is already buffered with `read_body_into` (server) or lets
`next_event` do it (client), reads the rest itself straight into the destination (`recv_into`)
and reports it with `body_received(n)`.

Nothing here touches a socket, a thread or a clock.
"""

from __future__ import annotations

import collections
import struct

from fleetd.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from fleetd.wire.commands import COMMANDS, PROTOCOL_VERSION, Feature, Request, cmd_name
from fleetd.wire.receive_buffer import ReceiveBuffer
from fleetd.wire.replies import DataReply, HelloReply, Reply
from fleetd.wire.state import HelloGate, State

_HEADER = struct.Struct("<BQ")  # | cmd u8 | payload_size u64 |
_SIZE = struct.Struct("<Q")  # | payload_size u64 | of a response


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
    """The server's view of one RPC connection: bytes in, request events out, replies to bytes."""

    def __init__(self, max_request: int | None = None) -> None:
        self._buf = ReceiveBuffer()
        # Largest request held in memory whole (SET_TENSOR data is streamed and does not count).
        self.max_request = max_request
        self._gate = HelloGate()
        self.body_remaining = 0
        self._gate_passed = False  # the command byte at the read position was already let through
        self.request_bytes = 0  # bytes of the last complete request, header included

    @property
    def state(self) -> State:
        return self._gate.state

    def receive_data(self, data) -> None:
        self._buf.append(data)

    @property
    def buffered(self) -> int:
        """Received bytes not yet consumed."""
        return len(self._buf)

    @property
    def held(self) -> int:
        """Bytes this connection keeps in memory, consumed ones included (bounded)."""
        return self._buf.held

    def next_event(self):
        """The next whole request as an event, or NEED_DATA. A SET_TENSOR's data is left in the stream
        (`body_remaining`); anything malformed is a RemoteProtocolError and fails the connection."""
        if self.body_remaining:
            raise LocalProtocolError("next_event() while a streamed request body is pending")
        buf = self._buf
        avail = len(buf)
        if avail < 1:
            return NEED_DATA
        cmd = buf.byte()
        try:
            if not self._gate_passed:
                self._gate.check(cmd)
                self._gate_passed = True
            if avail < 9:
                return NEED_DATA
            _, size = buf.unpack(_HEADER)
            spec = COMMANDS[cmd]
            if size != spec.size:
                reason = size_rule_error(cmd, size)
                if reason is not None:
                    raise RemoteProtocolError(reason)
            # A streamed body: only the header is buffered and decoded; the data is left in place.
            decoded = spec.min_size if spec.streamed_body else size
            if self.max_request is not None and decoded > self.max_request:
                raise RemoteProtocolError(
                    f"{cmd_name(cmd)}: request of {size} bytes above this "
                    f"daemon's limit of {self.max_request} per connection"
                )
            if avail < 9 + decoded:
                return NEED_DATA
            payload = buf.view(9, decoded)
            try:
                if spec.streamed_body:
                    event = spec.request.decode_header(payload, size - decoded)
                else:
                    event = spec.request.decode(payload)
            finally:
                payload.release()
        except RemoteProtocolError:
            self._gate.fail()
            raise
        except Exception as exc:  # a decoder's struct.error, ValueError, ...: the peer's bytes
            self._gate.fail()
            raise RemoteProtocolError(f"{cmd_name(cmd)}: malformed payload: {exc}") from exc
        buf.consume(9 + decoded)
        self._gate_passed = False
        self.body_remaining = size - decoded
        self.request_bytes = 9 + size
        return event

    def pending_requests(self) -> tuple[bytearray, int, int] | None:
        """Between requests of a connection past HELLO: the receive buffer, where its unread
        bytes start and how many there are, for a fast path that serves whole requests in place
        and reports them with `served(n)`; None when no request may be taken that way now."""
        if self.body_remaining or self._gate_passed or self._gate.state is not State.READY:
            return None
        buf = self._buf
        return buf.raw, buf.start, len(buf)

    def served(self, n: int) -> None:
        """`n` bytes of whole requests at the front were served outside next_event()."""
        self._buf.consume(n)

    def read_body_into(self, dst: memoryview) -> int:
        """Move already-buffered body bytes into `dst`; return how many."""
        n = self._buf.move_into(dst, self.body_remaining)
        self.body_remaining -= n
        return n

    def body_received(self, n: int) -> None:
        """The shell read `n` body bytes from the stream itself."""
        if n > self.body_remaining:
            raise LocalProtocolError(f"body_received({n}) with {self.body_remaining} pending")
        self.body_remaining -= n

    def send(self, reply: Reply) -> bytes:
        """The bytes of `reply` (for a large DataReply send `DataReply.header(n)` and the data
        itself instead: no copy).

        A value that does not fit its response field (a size of 2^64 or more computed from
        the request's tensor) is the request's fault: a RemoteProtocolError, checked here for
        every response rather than in each handler."""
        try:
            return reply.frame()
        except struct.error as exc:
            self._gate.fail()
            raise RemoteProtocolError(
                f"{type(reply).__name__}: a value computed from the request "
                f"does not fit the response: {reply}"
            ) from exc

    def fail(self) -> None:
        self._gate.fail()


def encode_response(cmd: int, *values) -> bytes:
    """The response to `cmd` from its reply fields, in table order."""
    reply = COMMANDS[cmd].response
    if reply is None:
        raise LocalProtocolError(f"{cmd_name(cmd)} has no response")
    return reply(*values).frame()


def data_response_header(size: int) -> bytes:
    """Header of a GET_TENSOR response; the `size` data bytes follow."""
    return DataReply.header(size)


def hello_response(features: int = 0) -> bytes:
    return HelloReply(PROTOCOL_VERSION, features).frame()


class ClientConnection:
    """The client's view of one RPC connection: requests to bytes, bytes in, reply events out.

    Replies come back in request order; `send` remembers which requests expect one. A reply
    that does not fit the request it answers (wrong size, unsupported HELLO version) is a
    RemoteProtocolError and the connection is failed.
    """

    def __init__(self) -> None:
        self._gate = HelloGate()
        self._buf = ReceiveBuffer()
        # (request, its `into` as (object, byte view) or None), in the order replies will come
        self._awaiting: collections.deque[tuple[Request, tuple | None]] = collections.deque()
        self._body: memoryview | None = None  # a DataReply's destination while it fills
        self._body_target = None
        self._body_got = 0
        self.response_bytes = 0  # bytes of the last complete reply, size prefix included

    @property
    def state(self) -> State:
        return self._gate.state

    @property
    def version(self) -> tuple[int, int, int] | None:
        return self._gate.version

    @property
    def features(self) -> Feature:
        return self._gate.features

    @property
    def awaiting(self) -> int:
        """Replies still to come."""
        return len(self._awaiting)

    @property
    def oldest_awaiting(self) -> Request | None:
        """The request whose reply comes next."""
        return self._awaiting[0][0] if self._awaiting else None

    def send(self, request: Request, into=None) -> bytes:
        """Header and payload of `request` (for SET_TENSOR: header only, its data follows).

        `into`: for a request with a streamed reply (GET_TENSOR), a writable buffer of exactly
        the requested size that the data lands in; the DataReply then carries it."""
        self._gate.check_send(request.cmd)
        spec = COMMANDS[request.cmd]
        payload = request.encode()
        size = len(payload) + (request.size if spec.streamed_body else 0)  # type: ignore[attr-defined]  # streamed: a SetTensor
        if spec.response is not None:
            if into is not None:
                view = memoryview(into).cast("B")
                if not spec.response.streamed or len(view) != request.size:  # type: ignore[attr-defined]  # streamed: a GetTensor
                    raise LocalProtocolError(
                        f"{request.cmd.name}: `into` of {len(view)} bytes does not fit this request"
                    )
                into = (into, view)
            self._awaiting.append((request, into))
        elif into is not None:
            raise LocalProtocolError(f"{request.cmd.name} has no reply to receive `into`")
        return _HEADER.pack(request.cmd, size) + payload

    def receive_data(self, data) -> None:
        self._buf.append(data)

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def next_event(self):
        try:
            return self._next_reply()
        except ProtocolError:
            self._gate.fail()
            raise
        except Exception as exc:  # a decoder's struct.error, ValueError, ...: the server's bytes
            self._gate.fail()
            what = self._awaiting[0][0].cmd.name if self._awaiting else "response"
            raise RemoteProtocolError(f"{what}: malformed response: {exc}") from exc

    def _next_reply(self):
        if self._body is not None:
            return self._fill_body()
        buf = self._buf
        avail = len(buf)
        if not self._awaiting:
            if avail:
                raise RemoteProtocolError(f"{avail} bytes received with no request awaiting a reply")
            return NEED_DATA
        if avail < 8:
            return NEED_DATA
        (size,) = buf.unpack(_SIZE)
        request, into = self._awaiting[0]
        reply = COMMANDS[request.cmd].response
        expected = request.size if reply.streamed else reply.layout.size
        if size != expected:
            raise RemoteProtocolError(f"{request.cmd.name}: response of {size} bytes, expected {expected}")
        if reply.streamed:
            buf.consume(8)
            if into is None:
                target = bytearray(size)
                into = (target, memoryview(target))
            self._body_target, self._body = into
            self._body_got = 0
            return self._fill_body()
        if avail < 8 + size:
            return NEED_DATA
        payload = buf.view(8, size)
        try:
            event = reply.decode(payload)
        finally:
            payload.release()
        buf.consume(8 + size)
        self._awaiting.popleft()
        self.response_bytes = 8 + size
        if reply is HelloReply:
            self._gate.negotiate(event.version, event.features)
        return event

    def _fill_body(self):
        body = self._body
        self._body_got = got = self._body_got + self._buf.move_into(body[self._body_got :])
        if got < len(body):
            return NEED_DATA
        event = DataReply(self._body_target)
        self._body = self._body_target = None
        self._awaiting.popleft()
        self.response_bytes = 8 + got
        return event

    def body_buffer(self) -> memoryview | None:
        """While a streamed reply fills and nothing of it is buffered: the part of its
        destination still to come, for the shell to `recv_into` directly (then `body_received`)."""
        if self._body is None or len(self._buf):
            return None
        return self._body[self._body_got :]

    def body_received(self, n: int) -> None:
        """The shell read `n` bytes of a streamed reply straight into `body_buffer()`."""
        if self._body is None or n > len(self._body) - self._body_got:
            raise LocalProtocolError(f"body_received({n}) with no streamed reply that long")
        self._body_got += n
