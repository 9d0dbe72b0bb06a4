"""TCP endpoints and timeouts: "host:port" parsing, the client's Timeout, local free ports."""

from __future__ import annotations

import random
import socket
import time
from dataclasses import dataclass
from pathlib import Path


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


# Ports free_port hands out lie below the kernel's ephemeral range: a port bind(0) returned is
# in that range, and the kernel may give it to any outgoing connection (this process makes
# many) between free_port's close and the server's bind, which then fails "Address already in
# use" (seen in CI: a local fleet's node, once in ~780 tests).
FREE_PORT_FLOOR = 20000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FREE_PORT_TRIES = 200


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (for local fleets, tests and benchmarks), chosen
    below the ephemeral range so that no outgoing connection takes it before it is bound; a
    bind(0) port when none there is free."""
    low = _ephemeral_low()
    if low > FREE_PORT_FLOOR:
        for _ in range(FREE_PORT_TRIES):
            port = random.randrange(FREE_PORT_FLOOR, low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:  # in use, or in TIME_WAIT
                    continue
                return port
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
