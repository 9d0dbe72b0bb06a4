"""fleetd.transport.free_port: a port below the kernel's ephemeral range (so no outgoing
connection is given it before a local fleet's node binds it), free when it is returned."""

from __future__ import annotations

import socket

from fleetd.transport import tcp


def test_free_ports_lie_below_the_ephemeral_range_and_bind():
    low = tcp._ephemeral_low()
    assert low > tcp.FREE_PORT_FLOOR  # this machine's range leaves room below it
    for _ in range(20):
        port = tcp.free_port()
        assert tcp.FREE_PORT_FLOOR <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_skipped(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = iter([busy, tcp.FREE_PORT_FLOOR + 7])
        monkeypatch.setattr(tcp, "_ephemeral_low", lambda: 65535)
        monkeypatch.setattr(tcp.random, "randrange", lambda a, b: next(picks))
        assert tcp.free_port() == tcp.FREE_PORT_FLOOR + 7
