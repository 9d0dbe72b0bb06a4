"""ServerState without a daemon: the peer copy and a Session run on the state object alone.

The source side here is a bare ServerState (no listener, no control API); the destination is
a real in-process fleetd, reached over real sockets.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest
from helpers import endpoint

from fleetd.client import RpcClient
from fleetd.server.config import ServerConfig
from fleetd.server.peer import PeerLinks, serve_copy
from fleetd.server.session import Session
from fleetd.server.state import ServerState
from fleetd.transport import Timeout
from fleetd.wire import (
    NEED_DATA,
    ClientConnection,
    CopyTensorTo,
    CopyTensorToReply,
    GgmlType,
    Hello,
    RpcTensor,
    contiguous_strides,
)

BOUNDED = Timeout(connect=10, read=30)
DATA = bytes(range(256)) * 4


def f32(buffer: int, base: int, n: int) -> RpcTensor:
    ne = (n, 1, 1, 1)
    return RpcTensor(
        id=1, type=GgmlType.F32, buffer=buffer, ne=ne, nb=contiguous_strides(GgmlType.F32, ne), data=base
    )


def source(**kw) -> tuple[ServerState, RpcTensor]:
    """A daemon's state with one buffer holding DATA, as a client session would have left it."""
    state = ServerState(ServerConfig(host="127.0.0.1", port=0, control_port=None, **kw))
    buf = state.registry.alloc(0, state.devices[0], len(DATA), owner=1)
    buf.array[:] = np.frombuffer(DATA, np.uint8)
    return state, f32(buf.handle, buf.base, len(DATA) // 4)


def destination_tensor(client: RpcClient) -> RpcTensor:
    ptr, _ = client.alloc_buffer(len(DATA))
    client.buffer_clear(ptr, 0)
    return f32(ptr, client.buffer_get_base(ptr), len(DATA) // 4)


def test_serve_copy_lands_and_reuses_its_link(fleetd_server):
    state, ts = source()
    dst = fleetd_server()
    links = PeerLinks()
    with RpcClient(endpoint(dst), BOUNDED) as c:
        td = destination_tensor(c)
        ev = CopyTensorTo(ts, td, len(DATA), endpoint(dst))
        assert serve_copy(state, links, ev) == 1
        assert c.get_tensor(td) == DATA
        assert serve_copy(state, links, ev) == 1
    stats = state.peer_stats.as_dict()
    assert (stats["copies_ok"], stats["bytes_confirmed"], stats["links_opened"]) == (2, 2 * len(DATA), 1)
    assert len(links) == 1
    links.close()
    assert len(links) == 0


@pytest.mark.parametrize("case, reason", [("p2p_off_src", "disabled"), ("p2p_off_dst", "refused")])
def test_serve_copy_falls_back_and_counts_why(fleetd_server, case, reason):
    state, ts = source(p2p=case != "p2p_off_src")
    dst = fleetd_server(p2p=case != "p2p_off_dst")
    links = PeerLinks()
    with RpcClient(endpoint(dst), BOUNDED) as c:
        td = destination_tensor(c)
        assert serve_copy(state, links, CopyTensorTo(ts, td, len(DATA), endpoint(dst))) == 0
        assert c.get_tensor(td) == bytes(len(DATA))  # nothing written
    stats = state.peer_stats.as_dict()
    assert stats["copies_ok"] == 0 and stats["fallbacks"][reason] == 1
    assert sum(stats["fallbacks"].values()) == 1
    assert len(links) == 0  # a refused destination is never cached


def _settle(measure, want, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while measure() != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return measure()


def test_a_session_over_a_socket_pair_owns_and_closes_its_links(fleetd_server):
    """A Session on a bare ServerState, its client at the other end of a socket pair: the
    COPY_TENSOR_TO goes out on the session's own link, which closes when the session ends."""
    state, ts = source()
    dst = fleetd_server()
    ours, theirs = socket.socketpair()
    session = Session(state, ours, ("pair", 0), state.sessions.new_id())
    state.sessions.add(session)
    worker = threading.Thread(target=session.run, daemon=True)
    worker.start()
    with RpcClient(endpoint(dst), BOUNDED) as c, theirs:
        td = destination_tensor(c)
        theirs.settimeout(30)
        conn = ClientConnection()
        theirs.sendall(conn.send(Hello()) + conn.send(CopyTensorTo(ts, td, len(DATA), endpoint(dst))))
        replies = []
        while len(replies) < 2:
            while (ev := conn.next_event()) is NEED_DATA:
                chunk = theirs.recv(4096)
                assert chunk, "the session closed its client's connection"
                conn.receive_data(chunk)
            replies.append(ev)
        assert replies[1] == CopyTensorToReply(1)
        assert c.get_tensor(td) == DATA
        assert len(session.peer_links) == 1
        assert _settle(lambda: len(dst.state.live_sessions()), 2) == 2  # ours and the link
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert len(session.peer_links) == 0 and state.live_sessions() == []
    assert _settle(lambda: len(dst.state.live_sessions()), 0) == 0
    assert state.total_counters().count[CopyTensorTo.cmd] == 1


def test_cache_store_names_each_file_by_the_hash_of_its_bytes(tmp_path, caplog):
    from fleetd.wire import fnv1a_64

    state = ServerState(
        ServerConfig(host="127.0.0.1", port=0, cache_dir=tmp_path / "cache", control_port=None)
    )
    buf = np.random.default_rng(3).integers(0, 256, (3 << 20) + 5, dtype=np.uint8)
    for view in (memoryview(buf)[7:], memoryview(buf)[:0], memoryview(buf)[1:2]):
        state.cache_store(view)
    names = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert names == sorted(f"{fnv1a_64(v):016x}" for v in (buf[7:], b"", buf[1:2]))  # no temp file left
    for name in names:
        assert f"{fnv1a_64((tmp_path / 'cache' / name).read_bytes()):016x}" == name
        with state.cache_open(int(name, 16)) as f:
            assert f.read() == (tmp_path / "cache" / name).read_bytes()
    assert state.cache_open(0x1234) is None
    # A cache directory that went away costs the entry, not the SET_TENSOR: one warning.
    for p in (tmp_path / "cache").iterdir():
        p.unlink()
    (tmp_path / "cache").rmdir()
    state.cache_store(memoryview(buf)[:100])
    assert "not stored" in caplog.text
