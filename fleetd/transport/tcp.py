"""TCP endpoints and timeouts: "host:port" parsing, the client's Timeout, local free ports."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Timeout:
    """A client's timeouts in seconds: for the connect, and for each wait on a reply."""

    connect: float | None = 10.0
    read: float | None = None  # None: wait as long as the server computes


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """ "host:port" split at the first ':' as the stock client does (no IPv6 literals)."""
    host, sep, port = endpoint.partition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint {endpoint!r}: expected host:port")
    return host, int(port)


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
