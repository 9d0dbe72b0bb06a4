"""TCP transport: connect with bounded timeouts, exact reads, errors mapped to TransportError."""

from __future__ import annotations

import contextlib
import socket
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


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` completely from `sock`; EOF before that is PeerClosed."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise PeerClosed(f"peer closed after {got} of {n} bytes")
        got += k
