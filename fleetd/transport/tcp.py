"""TCP transport: connect with bounded timeouts, errors mapped to TransportError, local ports."""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from dataclasses import dataclass

from fleetd.errors import ConnectTimeout, PeerClosed, ReadTimeout, TransportError


@dataclass(frozen=True)
class Timeout:
    connect: float | None = 10.0
    read: float | None = None  # None: wait as long as the server computes


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """"host:port" split at the first ':' as the stock client does (no IPv6 literals)."""
    host, sep, port = endpoint.partition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint {endpoint!r}: expected host:port")
    return host, int(port)


@contextlib.contextmanager
def mapped_errors(what: str):
    try:
        yield
    except socket.timeout as exc:
        raise ReadTimeout(f"{what}: timed out") from exc
    except (ConnectionError, EOFError) as exc:
        raise PeerClosed(f"{what}: {exc}") from exc
    except OSError as exc:
        raise TransportError(f"{what}: {exc}") from exc


def connect(endpoint: str, timeout: Timeout = Timeout()) -> socket.socket:
    host, port = parse_endpoint(endpoint)
    try:
        sock = socket.create_connection((host, port), timeout=timeout.connect)
    except socket.timeout as exc:
        raise ConnectTimeout(f"connect {endpoint}: timed out after {timeout.connect}s") from exc
    except OSError as exc:
        raise TransportError(f"connect {endpoint}: {exc.strerror or exc}") from exc
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(timeout.read)
    return sock


_TIMEVAL = struct.Struct("@ll")


def timeval(seconds: float) -> bytes:
    """`struct timeval` for SO_RCVTIMEO / SO_SNDTIMEO: the socket stays blocking, so a recv or
    send stays one syscall (settimeout() would put a poll() before each)."""
    whole = int(seconds)
    micros = int((seconds - whole) * 1e6)
    return _TIMEVAL.pack(whole, micros if whole or micros else 1)  # 0 would mean "no timeout"


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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (for local fleets, tests and benchmarks)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_listening(port: int, timeout: float = 30.0, host: str = "127.0.0.1") -> None:
    """Return once something accepts connections on host:port; TimeoutError after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout:g}s")
