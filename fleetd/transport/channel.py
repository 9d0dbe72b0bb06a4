"""RpcChannel: the one blocking client side of the ggml RPC protocol, over any Stream.

    channel = RpcChannel(TcpStream.connect(("127.0.0.1", 50052), 10.0))
    channel.hello()                                   # HelloReply; features negotiated
    channel.send(SetTensor(t, 0, n), data)            # no reply: pipelined, as the stock client
    reply = channel.call(GetTensor(t, 0, n))          # waits for its reply

Every byte goes through the sans-IO ClientConnection; every stream error is mapped here, once,
to fleetd's (ReadTimeout, PeerClosed, TransportError), with the command and the other end in
its message. RpcClient (fleetd/client), the peer links of a daemon (fleetd/server/peer.py) and
fleetctl's HELLO through SSH (fleetd/fleet/node.py) all sit on it.
"""

from __future__ import annotations

import contextlib

from fleetd.errors import PeerClosed, ReadTimeout, TransportError
from fleetd.transport.stream import Stream
from fleetd.wire import COMMANDS, NEED_DATA, ClientConnection, DataReply, Hello, Reply, Request

# One read of a reply: every fixed-size reply and a small GET_TENSOR fit; a larger GET_TENSOR's
# data goes with recv_into straight into its destination.
RECV_CHUNK = 64 * 1024
# SET_TENSOR data up to this size is copied behind its header (one small write beats a sendmsg
# of two parts); larger data goes out from its own memory.
SMALL_WRITE = 64 * 1024


@contextlib.contextmanager
def mapped_errors(what: str):
    """The builtin errors of a stream as fleetd's, named by `what`."""
    try:
        yield
    except TimeoutError as exc:  # TimeoutError
        raise ReadTimeout(f"{what}: timed out ({exc})" if str(exc) else f"{what}: timed out") from exc
    except (ConnectionError, EOFError) as exc:
        raise PeerClosed(f"{what}: {exc}") from exc
    except OSError as exc:
        raise TransportError(f"{what}: {exc}") from exc


class RpcChannel:
    """Requests out, replies in, over one stream; `timeout` bounds each wait for progress."""

    def __init__(self, stream: Stream, timeout: float | None = None) -> None:
        self.stream = stream
        self.conn = ClientConnection()
        self._scratch = bytearray(RECV_CHUNK)
        self._scratch_view = memoryview(self._scratch)
        self.stream.set_timeout(timeout)

    @property
    def name(self) -> str:
        return self.stream.name

    def set_timeout(self, seconds: float | None) -> None:
        self.stream.set_timeout(seconds)

    def send(self, request: Request, data=None, *more: Request, into=None) -> int:
        """Write `request` (SET_TENSOR: with its `data`) and any `more` requests behind it in one
        write; returns the bytes written. `into`: where a GET_TENSOR's data is to land."""
        parts = [self.conn.send(request, into)]
        if data is not None:
            if len(data) <= SMALL_WRITE:
                parts[0] += bytes(data)
            else:
                parts.append(data)
        parts += [self.conn.send(r) for r in more]
        with mapped_errors(f"{request.cmd.name} to {self.name}"):
            return self.stream.send_parts(parts)

    def reply(self, what: str) -> Reply:
        """Wait for the reply of the oldest request that asks for one (`what`: for errors)."""
        conn, stream = self.conn, self.stream
        what = f"{what} from {self.name}"
        with mapped_errors(what):
            while (event := conn.next_event()) is NEED_DATA:
                body = conn.body_buffer()
                if body is not None:  # a streamed reply: straight into its destination
                    n = stream.recv_into(body)
                    if n:
                        conn.body_received(n)
                else:
                    n = stream.recv_into(self._scratch_view[: self._read_size()])
                    if n:
                        conn.receive_data(self._scratch_view[:n])
                if n == 0:
                    raise PeerClosed(f"{what}: the other end closed the connection")
        return event

    def _read_size(self) -> int:
        # A large GET_TENSOR (or PEER_TAKE) reply: its 8-byte size prefix alone, so that all of its data can
        # then go straight into the destination.
        request = self.conn.oldest_awaiting
        if (
            not self.conn.buffered
            and request is not None
            and COMMANDS[request.cmd].response is DataReply
            and request.size > RECV_CHUNK - 8  # type: ignore[attr-defined]  # a DataReply's request has a size
        ):
            return 8
        return RECV_CHUNK

    def call(self, request: Request, into=None) -> Reply:
        """Send a request that has a reply and wait for it."""
        self.send(request, into=into)
        return self.reply(f"{request.cmd.name} response")

    def hello(self) -> Reply:
        return self.call(Hello())

    def close(self) -> None:
        self.stream.close()
