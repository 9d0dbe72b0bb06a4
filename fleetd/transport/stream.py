"""Byte streams the RPC channel runs over: a TCP socket, or an SSH channel to a node's port.

A stream has four verbs (send parts, receive into, a timeout, close) and one timeout rule: a
send or a receive that makes no progress for `timeout` seconds raises TimeoutError; None waits
as long as the other end takes. Streams raise the builtin errors (TimeoutError, ConnectionError,
OSError); the channel above maps them to fleetd's once (`mapped_errors`).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from typing import Protocol

from fleetd.errors import ConnectTimeout, TransportError

_TIMEVAL = struct.Struct("@ll")


def timeval(seconds: float | None) -> bytes:
    """`struct timeval` for SO_RCVTIMEO / SO_SNDTIMEO (None: no timeout). The socket stays
    blocking, so a recv or send stays one syscall (settimeout() would put a poll() before each)."""
    if seconds is None:
        return _TIMEVAL.pack(0, 0)
    whole = int(seconds)
    micros = int((seconds - whole) * 1e6)
    return _TIMEVAL.pack(whole, micros if whole or micros else 1)  # 0 would mean "no timeout"


def set_recv_timeout(sock: socket.socket, seconds: float | None) -> None:
    """Kernel-side timeout on a blocking socket: a recv that waits longer fails with EAGAIN,
    which Python raises as BlockingIOError."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(seconds))


def set_send_timeout(sock: socket.socket, seconds: float | None) -> None:
    """The same for a send that makes no progress (the other end stopped reading)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval(seconds))


def set_io_timeout(sock: socket.socket, recv: float | None = None, send: float | None = None) -> None:
    set_recv_timeout(sock, recv)
    set_send_timeout(sock, send)


def closed_by_peer(sock: socket.socket) -> bool:
    """The other end closed its side: a peek that consumes nothing and never blocks (bytes
    waiting mean it is still there)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


def send_parts(sock: socket.socket, parts) -> int:
    """Write `parts` (bytes-like, in order) with as few sendmsg calls as the kernel allows: a
    request header, its data straight from the tensor's memory and a following small request
    go out in one syscall, no joined copy. Returns the bytes written."""
    views = [memoryview(p).cast("B") for p in parts]
    views = [v for v in views if len(v)]
    total = sum(len(v) for v in views)
    while views:
        n = sock.sendmsg(views)
        while n and n >= len(views[0]):  # drop what went, keep the rest of a part cut short
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]
    return total


class Stream(Protocol):
    """What RpcChannel needs of a byte stream."""

    name: str  # what error messages call the other end ("127.0.0.1:50052", "node-1 port 50052")

    def send_parts(self, parts: Sequence) -> int: ...

    def recv_into(self, buf: memoryview) -> int: ...

    def set_timeout(self, seconds: float | None) -> None: ...

    def close(self) -> None: ...


class TcpStream:
    """A connected, blocking TCP socket with TCP_NODELAY, bounded by SO_RCVTIMEO/SO_SNDTIMEO."""

    def __init__(self, sock: socket.socket, name: str) -> None:
        self.socket, self.name = sock, name
        self._timeout: float | None = None
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @classmethod
    def connect(
        cls, addr: tuple[str, int], connect_timeout: float | None, name: str | None = None
    ) -> TcpStream:
        """Connect to (host, port) within `connect_timeout`: ConnectTimeout, or TransportError
        with the system's reason (refused, unreachable, unknown host)."""
        name = name or f"{addr[0]}:{addr[1]}"
        try:
            sock = socket.create_connection(addr, timeout=connect_timeout)
        except TimeoutError as exc:
            raise ConnectTimeout(f"connect {name}: timed out after {connect_timeout:g}s") from exc
        except OSError as exc:
            raise TransportError(f"connect {name}: {exc.strerror or exc}") from exc
        return cls(sock, name)

    def set_timeout(self, seconds: float | None) -> None:
        if seconds != self._timeout:
            set_io_timeout(self.socket, seconds, seconds)
            self._timeout = seconds

    def send_parts(self, parts: Sequence) -> int:
        try:
            return send_parts(self.socket, parts)
        except BlockingIOError:  # SO_SNDTIMEO ran out (EAGAIN on a blocking socket)
            raise TimeoutError(f"no progress sending for {self._timeout:g}s") from None

    def recv_into(self, buf: memoryview) -> int:
        try:
            return self.socket.recv_into(buf)
        except BlockingIOError:  # SO_RCVTIMEO ran out
            raise TimeoutError(f"no reply for {self._timeout:g}s") from None

    def closed_by_peer(self) -> bool:
        """The other end closed meanwhile (a cached connection to reopen); never blocks."""
        return closed_by_peer(self.socket)

    def close(self) -> None:
        try:
            self.socket.close()
        except OSError:
            pass


class ChannelStream:
    """A paramiko channel (an SSH direct-tcpip channel to a port on the node's side)."""

    def __init__(self, channel, name: str) -> None:
        self.channel, self.name = channel, name

    def set_timeout(self, seconds: float | None) -> None:
        self.channel.settimeout(seconds)  # paramiko raises socket.timeout (TimeoutError)

    def send_parts(self, parts: Sequence) -> int:
        data = b"".join(bytes(p) for p in parts)
        self.channel.sendall(data)
        return len(data)

    def recv_into(self, buf: memoryview) -> int:
        data = self.channel.recv(len(buf))
        buf[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self.channel.close()
