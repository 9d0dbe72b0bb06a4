"""Peer copy (COPY_TENSOR_TO / PEER_BARRIER) and the P2P-aware layer-split coordinator.

Real servers on loopback in this process (and the pinned stock ggml-rpc-server where built);
small shapes; every wait is bounded so a hang fails the test instead of stalling the run.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import threading
import time

import numpy as np
import pytest
from helpers import frame, needs_tool

from fleetd.client import GraphBuilder, RpcClient
from fleetd.errors import TransportError
from fleetd.pipeline import Pipeline, per_step
from fleetd.server.peer import FALLBACK_REASONS, PeerPolicy
from fleetd.server.peer_policy import ANSWERS_KEPT
from fleetd.transport import Timeout, send_parts
from fleetd.wire import Cmd, Feature, GgmlType

pytestmark = pytest.mark.timeout(90)

ROWS, N_EMBD = 4, 64
H = ROWS * N_EMBD * 4  # hidden state bytes
# Coordinator-side request/response sizes (protocol §3, §7; 296-byte rpc_tensor, 9-byte header).
SET_REQ = 9 + 296 + 1 + 8 + H
GET_REQ, GET_RESP = 9 + 296 + 8 + 8, 8 + H
RECOMPUTE_REQ = 9 + 4
COPY_RESP = 8 + 1
BOUNDED = Timeout(connect=5.0, read=30.0)  # a hung server fails the test, never stalls it


def copy_req(endpoint: str) -> int:
    return 9 + 2 * 296 + 8 + 4 + len(endpoint)


def ep(srv) -> str:
    return f"{srv.address[0]}:{srv.address[1]}"


def run_arm(endpoints, p2p, steps=3, layers=None, **kw):
    stages = len(endpoints) + int(kw.get("local_last", False))
    with Pipeline(
        endpoints, layers or stages, ROWS, N_EMBD, p2p=p2p, timeout=BOUNDED, stats=False, **kw
    ) as p:
        return p.run(steps)


def md5s(results) -> list[str]:
    return [r.md5 for r in results]


def f32_tensor(ptr: int, base: int, n: int, offset: int = 0):
    return GraphBuilder().tensor(GgmlType.F32, (n,), ptr, base + offset).rpc()


# -- per-step accounting -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "remote, local_last",
    [(2, False), (3, False), (4, False), (2, True)],
    ids=["P2", "P3", "P4", "P3-local-last"],
)
def test_per_step_accounting_hub_vs_direct(fleetd_server, remote, local_last):
    servers = [fleetd_server() for _ in range(remote)]
    eps = [ep(s) for s in servers]
    hub = run_arm(eps, p2p=False, local_last=local_last)
    direct = run_arm(eps, p2p=True, local_last=local_last)

    assert md5s(hub) == md5s(direct)
    assert len(set(md5s(hub))) == len(hub)  # each step's input differs, so must its output

    b = remote - 1  # remote-to-remote boundaries; a remote-to-local one is a GET either way
    dst_eps = eps[1:]
    for r in hub[1:]:
        assert dict(r.counters.count) == {
            Cmd.SET_TENSOR: 1 + b,
            Cmd.GET_TENSOR: remote,
            Cmd.GRAPH_RECOMPUTE: remote,
        }
        assert sum(r.counters.request_bytes.values()) == (1 + b) * SET_REQ + remote * (
            GET_REQ + RECOMPUTE_REQ
        )
        assert sum(r.counters.response_bytes.values()) == remote * GET_RESP
        assert (r.direct, r.fallbacks) == (0, 0)
    for r in direct[1:]:
        expect = {Cmd.SET_TENSOR: 1, Cmd.GET_TENSOR: 1, Cmd.GRAPH_RECOMPUTE: remote}
        if b:
            expect[Cmd.COPY_TENSOR_TO] = b
        assert dict(r.counters.count) == expect
        assert sum(r.counters.request_bytes.values()) == (
            SET_REQ + GET_REQ + remote * RECOMPUTE_REQ + sum(copy_req(e) for e in dst_eps)
        )
        assert sum(r.counters.response_bytes.values()) == GET_RESP + b * COPY_RESP
        assert (r.direct, r.fallbacks) == (b, 0)
    # The first step sends whole graphs instead of GRAPH_RECOMPUTE; the movers are the same.
    assert hub[0].counters.count[Cmd.GRAPH_COMPUTE] == remote
    assert direct[0].counters.count[Cmd.COPY_TENSOR_TO] == b

    # One COPY_TENSOR_TO replaces one GET + one SET per remote-to-remote boundary, and the
    # coordinator's bytes drop by twice the hidden state per boundary, less the header delta.
    h, d = per_step(hub[1:]), per_step(direct[1:])
    saved = (h["request_bytes"] + h["response_bytes"]) - (d["request_bytes"] + d["response_bytes"])
    headers = sum(SET_REQ - H + GET_REQ + GET_RESP - H - copy_req(e) - COPY_RESP for e in dst_eps)
    assert saved == 2 * H * b + headers
    assert abs(headers) < 64 * max(b, 1)

    # Server side: each source confirmed its pushes, each destination saw the barriers.
    for src in servers[:-1]:
        stats = src.state.peer_stats.as_dict()
        assert stats["copies_ok"] == len(direct)
        assert stats["bytes_confirmed"] == len(direct) * H
        assert not any(stats["fallbacks"].values())


def test_outputs_match_numpy_reference_and_topology(fleetd_server):
    """The pipeline computes the stated workload, and where the layers run does not change it."""
    a, b, c = (fleetd_server() for _ in range(3))
    three_remote = run_arm([ep(a), ep(b), ep(c)], p2p=True, steps=2)
    two_plus_local = run_arm([ep(a), ep(b)], p2p=True, steps=2, layers=3, local_last=True)
    assert md5s(three_remote) == md5s(two_plus_local)

    from fleetd.pipeline import Workload

    work = Workload(3, ROWS, N_EMBD)
    x = work.hidden_input(1).astype(np.float64)
    for layer in range(3):
        n = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        x = (n * work.norm_weight(layer)) @ work.matrix(layer).T.astype(np.float64) + x
    got = np.frombuffer(three_remote[1].output, np.float32).reshape(ROWS, N_EMBD)
    np.testing.assert_allclose(got, x, rtol=1e-4, atol=1e-4)


def test_env_forces_hub_and_prints_stats(fleetd_server, monkeypatch, capsys):
    a, b = fleetd_server(), fleetd_server()
    monkeypatch.setenv("GGML_RPC_P2P", "0")
    monkeypatch.setenv("GGML_RPC_STATS", "1")
    with Pipeline([ep(a), ep(b)], 2, ROWS, N_EMBD, timeout=BOUNDED) as p:
        results = p.run(2)
    assert [r.counters.count[Cmd.COPY_TENSOR_TO] for r in results] == [0, 0]
    err = capsys.readouterr().err
    assert "rpc stats: step 1: " in err
    assert "request bytes from the coordinator" in err
    assert a.state.peer_stats.as_dict()["copies_ok"] == 0


# -- no deadlock in a ring -------------------------------------------------------------------------


def test_ring_under_concurrent_coordinators(fleetd_server):
    """Every server is source and destination of several coordinators at once; one server is
    even two stages of one pipeline. Bounded: a deadlock fails at the join."""
    servers = [fleetd_server() for _ in range(3)]
    eps = [ep(s) for s in servers]
    reference = md5s(run_arm(eps + eps[:1], p2p=False, steps=4))
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def coordinator(k: int) -> None:
        ring = [eps[(k + i) % 3] for i in range(4)]
        try:
            results[k] = run_arm(ring, p2p=True, steps=4)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=coordinator, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    for t in threads:
        t.join(timeout=max(0.1, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "ring did not finish: deadlock?"
    assert not errors, errors
    for res in results.values():
        assert md5s(res) == reference
        assert [r.direct for r in res] == [3] * 4
    assert sum(s.state.peer_stats.as_dict()["copies_ok"] for s in servers) == 4 * 4 * 3


# -- fallbacks ---------------------------------------------------------------------------------------


def _closed_port_endpoint() -> str:
    from fleetd.transport import free_port

    return f"127.0.0.1:{free_port()}"


@pytest.mark.parametrize("case", ["dst_down", "p2p_off_dst", "p2p_off_src", "not_allowed"])
def test_fallback_answers_0_with_identical_outputs(fleetd_server, case):
    src_kw = {"peer_allow": ["10.255.0.0/16"]} if case == "not_allowed" else {}
    src, dst = fleetd_server(**src_kw), fleetd_server()
    eps = [ep(src), ep(dst)]
    reference = md5s(run_arm(eps, p2p=False))
    peers = [eps[0], _closed_port_endpoint()] if case == "dst_down" else None
    with Pipeline(eps, 2, ROWS, N_EMBD, p2p=True, timeout=BOUNDED, stats=False, peer_endpoints=peers) as p:
        assert p.direct_boundary(0)  # both advertised the bit at HELLO: the copy is tried
        first = p.step()
        if case == "p2p_off_dst":
            assert (first.direct, first.fallbacks) == (1, 0)  # a cached link exists now
            dst.state.set_p2p(False)
        elif case == "p2p_off_src":
            assert (first.direct, first.fallbacks) == (1, 0)
            src.state.set_p2p(False)
        results = [first] + p.run(2)
    assert md5s(results) == reference
    failed = results if case in ("dst_down", "not_allowed") else results[1:]
    assert all((r.direct, r.fallbacks) == (0, 1) for r in failed)
    assert all(r.counters.count[Cmd.COPY_TENSOR_TO] == 1 for r in failed)
    reason = {
        "dst_down": "unreachable",
        "p2p_off_dst": "refused",
        "p2p_off_src": "disabled",
        "not_allowed": "not_allowed",
    }[case]
    fallbacks = src.state.peer_stats.as_dict()["fallbacks"]
    assert fallbacks == {r: len(failed) if r == reason else 0 for r in FALLBACK_REASONS}
    if case == "p2p_off_dst":  # new connections no longer see the bit
        with RpcClient(ep(dst), BOUNDED) as c:
            assert not c.features & Feature.PEER_COPY


def test_fallback_destination_bounds_violated(fleetd_server):
    src, dst = fleetd_server(), fleetd_server()
    data = np.arange(256, dtype=np.float32).tobytes()
    with RpcClient(ep(src), BOUNDED) as cs, RpcClient(ep(dst), BOUNDED) as cd:
        ps, _ = cs.alloc_buffer(1024)
        pd, _ = cd.alloc_buffer(1024)
        ts = f32_tensor(ps, cs.buffer_get_base(ps), 256)
        base_d = cd.buffer_get_base(pd)
        td = f32_tensor(pd, base_d, 256)
        cs.set_tensor(ts, data)
        cd.set_tensor(td, bytes(1024))
        # 1024 bytes at offset 512 of a 1024-byte buffer: the destination's own check refuses.
        bad = f32_tensor(pd, base_d, 256, offset=512)
        assert cs.copy_tensor_to(ts, bad, 1024, ep(dst)) is False
        assert src.state.peer_stats.as_dict()["fallbacks"]["write_rejected"] == 1
        # The destination closed only the source's link: the coordinator's session is intact.
        assert cd.get_tensor(td) == bytes(1024)
        cd.set_tensor(td, cs.get_tensor(ts))  # the hub path
        assert hashlib.md5(cd.get_tensor(td)).digest() == hashlib.md5(data).digest()
        assert cs.copy_tensor_to(ts, td, 1024, ep(dst)) is True  # a fresh link works again
    src.state.peer_stats.reset()  # the control API's stats reset
    assert src.state.peer_stats.as_dict() == {
        "copies_ok": 0,
        "bytes_pushed": 0,
        "bytes_confirmed": 0,
        "links_opened": 0,
        "copies_taken": 0,
        "gates_failed": 0,
        "commands_skipped": 0,
        "fallbacks": dict.fromkeys(FALLBACK_REASONS, 0),
    }


@needs_tool("ggml-rpc-server")
def test_fallback_stock_destination(fleetd_server, stock_server):
    """A stock server never advertises the bit: idle it refuses at HELLO (and is let go at once),
    busy with another client it never answers HELLO, and the copy answers 0 within the HELLO
    bound. The client's read timeout bounds the whole call: a hang fails here."""
    src = fleetd_server()
    stock = stock_server()
    data = np.arange(256, dtype=np.float32).tobytes()
    with RpcClient(ep(src), Timeout(connect=5.0, read=10.0)) as cs:
        ps, _ = cs.alloc_buffer(1024)
        ts = f32_tensor(ps, cs.buffer_get_base(ps), 256)
        cs.set_tensor(ts, data)
        fake_dst = f32_tensor(0x100, 0x1000, 256)
        assert cs.copy_tensor_to(ts, fake_dst, 1024, stock) is False  # idle: refused
        with RpcClient(stock, BOUNDED) as busy:  # served now, so the stock server is busy
            assert not busy.features & Feature.PEER_COPY
            pd, _ = busy.alloc_buffer(1024)
            td = f32_tensor(pd, busy.buffer_get_base(pd), 256)
            assert cs.copy_tensor_to(ts, td, 1024, stock) is False  # busy: HELLO timeout
            busy.set_tensor(td, cs.get_tensor(ts))  # the hub path
            assert busy.get_tensor(td) == data
    assert src.state.peer_stats.as_dict()["fallbacks"] == {
        r: 1 if r in ("refused", "timeout") else 0 for r in FALLBACK_REASONS
    }


# -- malformed requests ------------------------------------------------------------------------------


def _raw_copy(endpoint_bytes: bytes, declared_len: int) -> bytes:
    t = f32_tensor(0x100, 0x1000, 4).pack()
    return frame(Cmd.COPY_TENSOR_TO, t + t + struct.pack("<QI", 16, declared_len) + endpoint_bytes)


@pytest.mark.parametrize("case", ["source_out_of_bounds", "endpoint_len_mismatch", "bad_endpoint"])
def test_malformed_copy_closes_only_that_connection(fleetd_server, case):
    src, dst = fleetd_server(), fleetd_server()
    with RpcClient(ep(src), BOUNDED) as bystander, RpcClient(ep(dst), BOUNDED) as cd:
        pb, _ = bystander.alloc_buffer(64)
        pd, _ = cd.alloc_buffer(64)
        td = f32_tensor(pd, cd.buffer_get_base(pd), 16)
        c = RpcClient(ep(src), BOUNDED).open()
        try:
            ps, _ = c.alloc_buffer(64)
            ts = f32_tensor(ps, c.buffer_get_base(ps), 16)
            with pytest.raises(TransportError):
                if case == "source_out_of_bounds":
                    c.copy_tensor_to(f32_tensor(ps, c.buffer_get_base(ps), 16, offset=32), td, 64, ep(dst))
                elif case == "endpoint_len_mismatch":
                    c.send_raw(_raw_copy(b"127.0.0.1:1", 5))
                    c.get_alignment()
                else:
                    c.copy_tensor_to(ts, td, 64, "no-port-here")
        finally:
            c.close()
        # Only that connection closed: the bystander and the server carry on.
        assert bystander.buffer_get_base(pb) > 0
        with RpcClient(ep(src), BOUNDED) as again:
            assert again.features & Feature.PEER_COPY
    assert src.state.peer_stats.as_dict()["copies_ok"] == 0


# -- resources ------------------------------------------------------------------------------------


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _settle(measure, limit: int, timeout: float = 15.0) -> int:
    """Poll until `measure() <= limit` (sessions end asynchronously) or the bound passes."""
    deadline = time.monotonic() + timeout
    value = measure()
    while value > limit and time.monotonic() < deadline:
        time.sleep(0.05)
        value = measure()
    return value


@pytest.mark.timeout(120)
def test_peer_links_close_with_their_session(fleetd_server):
    src, dst = fleetd_server(), fleetd_server()
    data = bytes(range(256)) * 4

    def cycle(cd, td) -> None:
        with RpcClient(ep(src), BOUNDED) as c:
            ps, _ = c.alloc_buffer(1024)
            ts = f32_tensor(ps, c.buffer_get_base(ps), 256)
            c.set_tensor(ts, data)
            assert c.copy_tensor_to(ts, td, 1024, ep(dst)) is True

    with RpcClient(ep(dst), BOUNDED) as cd:
        pd, _ = cd.alloc_buffer(1024)
        td = f32_tensor(pd, cd.buffer_get_base(pd), 256)
        cycle(cd, td)  # warm-up: lazily created module state is not a leak
        _settle(lambda: len(src.state.live_sessions()) + len(dst.state.live_sessions()), 1)
        fds, threads = _open_fds(), threading.active_count()
        for _ in range(100):
            cycle(cd, td)
        assert _settle(lambda: len(src.state.live_sessions()) + len(dst.state.live_sessions()), 1) == 1
        assert _settle(_open_fds, fds) <= fds
        assert _settle(threading.active_count, threads) <= threads
        assert cd.get_tensor(td) == data
    stats = src.state.peer_stats.as_dict()
    assert stats["copies_ok"] == 101 and stats["links_opened"] == 101


def test_large_copy_lands_whole_through_a_small_send_buffer(fleetd_server):
    """A region many times the link's send buffer, sent straight from the source buffer in one
    sendmsg with its header and the barrier: it lands whole, and both byte counters agree."""
    src, dst = fleetd_server(), fleetd_server()
    n = 3 * (1 << 20) // 4 + 13  # 3 MiB and an odd tail, so no part boundary falls on a page
    data = np.random.default_rng(7).standard_normal(n, dtype=np.float32).tobytes()
    with RpcClient(ep(src), BOUNDED) as cs, RpcClient(ep(dst), BOUNDED) as cd:
        ps, _ = cs.alloc_buffer(len(data))
        ts = f32_tensor(ps, cs.buffer_get_base(ps), n)
        cs.set_tensor(ts, data)
        pd, _ = cd.alloc_buffer(len(data) + 64)
        td = f32_tensor(pd, cd.buffer_get_base(pd), n, offset=32)
        assert cs.copy_tensor_to(ts, td, len(data), ep(dst)) is True  # opens the link
        (link,) = src.state.sessions.live()[-1].peer_links._links.values()
        link.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        cd.set_tensor(td, bytes(len(data)))
        # SET_TENSOR has no answer: without a round trip on cd, its 3 MiB of zeros may still be
        # streaming into the tensor while the copy, on the link's own connection, writes it
        # (the two interleaved: the md5 was neither, once in ~20 CI runs)
        cd.sync()
        assert cs.copy_tensor_to(ts, td, len(data), ep(dst)) is True
        assert hashlib.md5(cd.get_tensor(td)).digest() == hashlib.md5(data).digest()
    stats = src.state.peer_stats.as_dict()
    assert stats["bytes_pushed"] == stats["bytes_confirmed"] == 2 * len(data)


def test_link_closed_by_destination_is_reopened(fleetd_server):
    """The destination ends the link's session between copies: the cached link is found stale
    (a non-blocking peek sees EOF) and the next copy opens a new one instead of answering 0."""
    src, dst = fleetd_server(), fleetd_server()
    data = bytes(range(256)) * 4
    with RpcClient(ep(src), BOUNDED) as cs, RpcClient(ep(dst), BOUNDED) as cd:
        ps, _ = cs.alloc_buffer(1024)
        ts = f32_tensor(ps, cs.buffer_get_base(ps), 256)
        cs.set_tensor(ts, data)
        pd, _ = cd.alloc_buffer(1024)
        td = f32_tensor(pd, cd.buffer_get_base(pd), 256)
        assert cs.copy_tensor_to(ts, td, 1024, ep(dst)) is True
        assert cs.copy_tensor_to(ts, td, 1024, ep(dst)) is True  # the cached link
        assert src.state.peer_stats.as_dict()["links_opened"] == 1
        # The source's link is the destination's one session without buffers of its own.
        (link_session,) = [s for s in dst.state.live_sessions() if not dst.state.registry.owned_by(s.id)]
        link_session.sock.shutdown(socket.SHUT_RDWR)
        _settle(lambda: len(dst.state.live_sessions()), 1)
        cd.set_tensor(td, bytes(1024))
        cd.sync()  # the zeros landed before the copy (it comes on another connection)
        assert cs.copy_tensor_to(ts, td, 1024, ep(dst)) is True
        assert cd.get_tensor(td) == data
    stats = src.state.peer_stats.as_dict()
    assert stats["links_opened"] == 2 and stats["copies_ok"] == 3
    assert sum(stats["fallbacks"].values()) == 0


def test_send_parts_resumes_partial_writes():
    """send_parts over a socket pair whose buffers hold far less than the parts: every byte
    arrives once and in order, empty parts included. With a timeout the socket is non-blocking
    underneath, so sendmsg returns short and send_parts must resume mid-part."""

    class Counting(socket.socket):
        calls = 0

        def sendmsg(self, *args):
            Counting.calls += 1
            return super().sendmsg(*args)

    a0, b = socket.socketpair()
    a = Counting(fileno=a0.detach())
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    a.settimeout(30)
    parts = [b"head", b"", memoryview(bytes(range(256)) * 4099)[3:], bytearray(b"tail")]
    want = b"".join(bytes(p) for p in parts)
    got = bytearray()

    def drain():
        while len(got) < len(want):
            chunk = b.recv(65536)
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        assert send_parts(a, parts) == len(want)
    finally:
        reader.join(30)
        a.close()
        b.close()
    assert bytes(got) == want
    assert Counting.calls > 1  # the resume path ran


# -- policy and toggle --------------------------------------------------------------------------------


def test_peer_allow_default_and_explicit():
    default = PeerPolicy(None, "192.168.7.10")
    assert default.allows("127.0.0.1") and default.allows("127.5.5.5") and default.allows("::1")
    assert default.allows("192.168.7.200") and not default.allows("192.168.8.1")
    assert not default.allows("8.8.8.8")
    wildcard = PeerPolicy(None, "0.0.0.0")  # the subnet the client came in on counts instead
    assert wildcard.allows("10.1.2.3", local_addr="10.1.2.1")
    assert not wildcard.allows("10.1.3.3", local_addr="10.1.2.1")
    explicit = PeerPolicy(["10.0.0.0/8", "localhost"], "192.168.7.10")
    assert explicit.allows("10.9.9.9") and explicit.allows("127.0.0.1")
    assert not explicit.allows("192.168.7.11")
    assert not explicit.allows("192.168.7.11", local_addr="192.168.7.10")  # only the default widens
    with pytest.raises(ValueError):
        PeerPolicy(["no.such.host.invalid"], "127.0.0.1")


def test_peer_allow_answers_remembered_stay_right():
    """Answers are remembered per (address, local address), bounded; asked again, past the
    bound and with another local address, they stay what the networks say."""
    policy = PeerPolicy(None, "0.0.0.0")
    for _ in range(2):
        assert policy.allows("127.0.0.1") and not policy.allows("10.1.2.3")
        assert policy.allows("10.1.2.3", local_addr="10.1.2.1")
        assert not policy.allows("10.1.2.3", local_addr="10.9.9.1")
    for i in range(3 * ANSWERS_KEPT):
        assert policy.allows(f"10.7.{i // 256 % 256}.{i % 256}", local_addr="10.7.0.1") == (i < 256)
    assert len(policy._answers) <= ANSWERS_KEPT
    assert not policy.allows("10.1.2.3") and policy.allows("10.1.2.3", local_addr="10.1.2.1")


def test_runtime_toggle_clears_bit_for_new_connections(fleetd_server):
    srv = fleetd_server()
    with RpcClient(ep(srv), BOUNDED) as before:
        srv.state.set_p2p(False)
        with RpcClient(ep(srv), BOUNDED) as off:
            assert not off.features & Feature.PEER_COPY
        assert before.features & Feature.PEER_COPY  # negotiated at its own HELLO
        srv.state.set_p2p(True)
        with RpcClient(ep(srv), BOUNDED) as on:
            assert on.features & Feature.PEER_COPY
    assert set(srv.state.peer_stats.as_dict()["fallbacks"]) == set(FALLBACK_REASONS)
