"""The session's C fast path (fleetd/compute/native/fastpath.c via fleetd.server.fast_path).

The rule it must keep: it serves a request only when the Python path (regions.region) accepts it,
and it serves every eligible request that Python accepts. Checked differentially over seeded
hostile SET_TENSOR / GET_TENSOR requests (strides, shapes, offsets, sizes and addresses a little
off, flush with the buffer's end, wrapping values, other buffers' handles), then end to end
through a real daemon: the bytes, the counters, the session closed on a bad request while the
other sessions carry on.
"""

from __future__ import annotations

import ctypes
import random
import socket
import struct

import numpy as np
import pytest
from helpers import connection_closed, wait_until

from fleetd.client import RpcClient
from fleetd.compute import native
from fleetd.compute.buffers import BufferRegistry
from fleetd.errors import RemoteProtocolError
from fleetd.server import regions
from fleetd.server.config import ServerConfig
from fleetd.server.daemon import Server
from fleetd.server.fast_path import FastPath
from fleetd.server.peer_async import _Pusher
from fleetd.wire import (
    GGML_TYPE_COUNT,
    MAX_ENDPOINT_LEN,
    TYPE_TRAITS,
    ClientConnection,
    Cmd,
    GgmlType,
    Hello,
    RpcTensor,
    ServerConnection,
    contiguous_strides,
)
from fleetd.wire.commands import GetTensor, SetTensor

pytestmark = pytest.mark.skipif(native.fast_requests() is None, reason="libfleetd-native not built")

BUF_SIZE = 64 * 1024


class HostMemory:
    """Plain numpy memory for a registry outside a daemon."""

    def alloc(self, size: int):
        return np.zeros(size, np.uint8)

    def buffer_allocated(self, buf) -> None: ...

    def buffer_written(self, buf) -> None: ...

    def buffer_freed(self, buf) -> None: ...


def _edge(rng: random.Random, around: int, spread: int = 64) -> int:
    return max(0, around + rng.randint(-spread, spread))


def hostile_tensor(rng: random.Random, buf, other) -> RpcTensor:
    """A tensor near the edges of `buf` (sometimes of `other`, or of nothing)."""
    known = [t for t in range(GGML_TYPE_COUNT) if t in TYPE_TRAITS]
    type_ = rng.choice(known + [GGML_TYPE_COUNT, 255]) if rng.random() < 0.05 else rng.choice(known)
    tr = TYPE_TRAITS.get(type_)
    blck = tr.blck_size if tr else 1
    ne = [rng.choice([1, 1, 2, 3, rng.randint(0, 64), blck, 2 * blck]) for _ in range(4)]
    if rng.random() < 0.05:
        ne[rng.randrange(4)] = rng.choice([0, 2**32 - 1, 2**31])
    if tr and ne[0] % blck == 0 and rng.random() < 0.7:
        nb = list(contiguous_strides(type_, tuple(ne)))
    else:
        nb = [rng.choice([0, 1, 2, 4, 8, 64, 4096, rng.randint(0, 2**32 - 1)]) for _ in range(4)]
    target = other if rng.random() < 0.1 else buf
    handle = target.handle if rng.random() > 0.03 else rng.getrandbits(64)
    if rng.random() < 0.5:
        data = target.base + _edge(rng, 0, 128)
    else:
        data = target.base + _edge(rng, target.size - 256, 300)
    if rng.random() < 0.03:
        data = rng.choice([0, 2**64 - 1, target.base - 1])
    name = b"blk.3.attn" if rng.random() < 0.05 else b"inp"
    return RpcTensor(
        id=1,
        type=type_,
        buffer=handle,
        ne=tuple(ne),
        nb=tuple(x % 2**32 for x in nb),
        data=data % 2**64,
        name=name,
    )


def python_accepts(registry, t: RpcTensor, offset: int, size: int) -> tuple | None:
    """What the Python path does: (buffer, start) or None when it closes the connection."""
    try:
        return regions.region(registry, t, offset, size, "TEST")
    except (RemoteProtocolError, KeyError):
        return None


def frame_set(t: RpcTensor, offset: int, data: bytes, cache: int = 0) -> bytes:
    body = SetTensor(t, offset, len(data), cache).encode() + data
    return struct.pack("<BQ", Cmd.SET_TENSOR, len(body)) + body


def frame_get(t: RpcTensor, offset: int, size: int) -> bytes:
    body = GetTensor(t, offset, size).encode()
    return struct.pack("<BQ", Cmd.GET_TENSOR, len(body)) + body


class Harness:
    """One FastPath over a socketpair and a registry with this session's buffer and another's."""

    def __init__(self) -> None:
        self.registry = BufferRegistry()
        mem = HostMemory()
        self.buf = self.registry.alloc(0, mem, BUF_SIZE, owner=1)
        self.other = self.registry.alloc(0, mem, BUF_SIZE, owner=2)
        self.a, self.b = socket.socketpair()
        self.a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 21)
        self.b.setblocking(False)
        self.fast = FastPath(self.a, None)
        self.fast.set_buffers([self.buf])  # only the session's own
        self.conn = ServerConnection()
        self.conn.receive_data(ClientConnection().send(Hello()))
        self.conn.next_event()

    def offer(self, frame: bytes) -> int:
        self.conn.receive_data(frame)
        served = self.fast.serve(self.conn)
        if not served:
            self.conn.served(len(frame))  # drop it: the Python path is not under test here
        return served

    def reply(self) -> bytes:
        out = b""
        try:
            while chunk := self.b.recv(1 << 20):
                out += chunk
        except BlockingIOError:
            pass
        return out

    def close(self) -> None:
        self.a.close()
        self.b.close()


def test_c_serves_exactly_what_python_accepts_over_hostile_requests():
    rng = random.Random(20261206)
    h = Harness()
    served = {"set": 0, "get": 0}
    declined = 0
    try:
        for case in range(20000):
            t = hostile_tensor(rng, h.buf, h.other)
            offset = rng.choice([0, 0, 1, rng.randint(0, 512), 2**64 - 1])
            size = rng.choice([1, 4, rng.randint(1, 1024), rng.randint(0, 300)])
            want = python_accepts(h.registry, t, offset, size)
            eligible = size > 0 and not t.name.startswith(b"blk.") and t.buffer == h.buf.handle
            if rng.random() < 0.5:
                payload = rng.randbytes(size)
                before = h.buf.array.copy()
                other_before = h.other.array.copy()
                got = h.offer(frame_set(t, offset, payload))
                if got:
                    assert want is not None, f"case {case}: C wrote what Python refuses: {t} {offset} {size}"
                    buf, start = want
                    assert buf is h.buf
                    expect = before.copy()
                    expect[start : start + size] = np.frombuffer(payload, np.uint8)
                    assert np.array_equal(h.buf.array, expect), f"case {case}: wrong bytes written"
                    served["set"] += 1
                else:
                    assert not (want is not None and eligible), f"case {case}: C declined a valid SET"
                    assert np.array_equal(h.buf.array, before), f"case {case}: declined SET wrote"
                    declined += 1
                assert np.array_equal(h.other.array, other_before), (
                    f"case {case}: another session's buffer changed"
                )
            else:
                got = h.offer(frame_get(t, offset, size))
                data = h.reply()
                if got:
                    assert want is not None, f"case {case}: C read what Python refuses: {t} {offset} {size}"
                    buf, start = want
                    assert data == struct.pack("<Q", size) + h.buf.array[start : start + size].tobytes()
                    served["get"] += 1
                else:
                    assert data == b"", f"case {case}: declined GET sent bytes"
                    assert not (want is not None and eligible), f"case {case}: C declined a valid GET"
                    declined += 1
    finally:
        h.close()
    # the generator reaches both outcomes of both commands
    assert served["set"] > 500 and served["get"] > 500 and declined > 2000, (served, declined)


def test_c_stops_at_the_first_request_it_does_not_serve_and_keeps_the_rest_for_python():
    h = Harness()
    try:
        ne = (4, 1, 1, 1)
        t = RpcTensor(
            id=1, type=GgmlType.F32, buffer=h.buf.handle, ne=ne, nb=contiguous_strides(0, ne), data=h.buf.base
        )
        cached = frame_set(t, 0, b"\1" * 16, cache=1)  # the cache flag: Python's
        stream = frame_set(t, 0, b"\2" * 16) + cached + frame_set(t, 0, b"\3" * 16)
        h.conn.receive_data(stream)
        used = h.fast.serve(h.conn)
        assert used == len(frame_set(t, 0, b"\2" * 16))
        assert bytes(h.buf.array[:16]) == b"\2" * 16
        assert h.conn.buffered == len(stream) - used  # the rest, untouched, for next_event
        ev = h.conn.next_event()
        assert isinstance(ev, SetTensor) and ev.cache_flag == 1
        h.conn.read_body_into(memoryview(bytearray(16)))
        assert h.fast.serve(h.conn) == len(stream) - used - len(cached)  # the third, in C
        assert bytes(h.buf.array[:16]) == b"\3" * 16
        # a request not whole yet is left alone
        partial = frame_get(t, 0, 16)[:-1]
        h.conn.receive_data(partial)
        assert h.fast.serve(h.conn) == 0 and h.conn.buffered == len(partial)
        assert h.reply() == b""
    finally:
        h.close()


@pytest.fixture
def daemon():
    srv = Server(ServerConfig(host="127.0.0.1", port=0, devices=["cpu"], control_port=None, threads=1))
    host, port = srv.start()
    yield srv, f"{host}:{port}"
    srv.stop()


def _session(srv, client: RpcClient):
    """The daemon's Session object of `client`'s connection (by its local port)."""
    port = client.sock.getsockname()[1]
    for s in srv.state.live_sessions():
        if s.peer.endswith(f":{port}"):
            return s
    raise AssertionError("session not found")


def test_a_real_session_serves_small_commands_in_c_and_counts_them(daemon):
    srv, ep = daemon
    with RpcClient(ep) as c:
        ptr, _ = c.alloc_buffer(BUF_SIZE)
        base = c.buffer_get_base(ptr)
        ne = (256, 1, 1, 1)
        t = RpcTensor(id=1, type=GgmlType.F32, buffer=ptr, ne=ne, nb=contiguous_strides(0, ne), data=base)
        rng = np.random.default_rng(5)
        for _ in range(50):
            x = rng.standard_normal(256).astype(np.float32)
            c.set_tensor(t, x)
            assert np.array_equal(np.frombuffer(c.get_tensor(t), np.float32), x)
        s = _session(srv, c)
        # every SET and GET above took the C path (counted once the session folds them in)
        assert wait_until(lambda: s.fast.requests_served >= 100)
        now = s.counters_now()  # the C loop's counts, folded in or not
        assert now.count[Cmd.SET_TENSOR] == 50 and now.count[Cmd.GET_TENSOR] == 50
        assert now.response_bytes[Cmd.GET_TENSOR] == 50 * (8 + 1024)


def test_an_out_of_bounds_get_still_closes_only_its_session(daemon):
    srv, ep = daemon
    with RpcClient(ep) as good, RpcClient(ep) as bad:
        gptr, _ = good.alloc_buffer(4096)
        gbase = good.buffer_get_base(gptr)
        ne = (1024, 1, 1, 1)
        gt = RpcTensor(id=1, type=GgmlType.F32, buffer=gptr, ne=ne, nb=contiguous_strides(0, ne), data=gbase)
        good.set_tensor(gt, np.arange(1024, dtype=np.float32))
        bptr, _ = bad.alloc_buffer(4096)
        bbase = bad.buffer_get_base(bptr)
        # flush with the end of its buffer, one row too long: C declines, Python closes
        ne2 = (1025, 1, 1, 1)
        bt = RpcTensor(
            id=1, type=GgmlType.F32, buffer=bptr, ne=ne2, nb=contiguous_strides(0, ne2), data=bbase
        )
        bad.send_raw(frame_get(bt, 0, 4100))
        assert connection_closed(bad.sock)
        assert np.array_equal(
            np.frombuffer(good.get_tensor(gt), np.float32), np.arange(1024, dtype=np.float32)
        )


@pytest.mark.parametrize(
    "function, expected",
    [
        (
            "fleetd_fast_layout",  # fastpath.c
            lambda: [
                ctypes.sizeof(native.FastContext),
                ctypes.sizeof(native.FastServed),
                ctypes.sizeof(native.FastRecompute),
                ctypes.sizeof(native.FastRegion),
                native.FastContext.served.offset,
                native.FastContext.have.offset,
                native.FastContext.rc.offset,
                native.FastRecompute.timeout_ns.offset,
                native.FastContext.body.offset,
                ctypes.sizeof(native.FastBody),
                native.FastContext.peer.offset,
                ctypes.sizeof(native.FastPeer),
                native.FastContext.align.offset,
                native.FastContext.n_align.offset,
            ],
        ),
        (
            "fleetd_route_layout",  # peer_stage.c
            lambda: [
                ctypes.sizeof(native.FastRoute),
                ctypes.sizeof(native.FastPush),
                native.FastRoute.broken.offset,
                native.FastRoute.ring.offset,
                _Pusher.INLINE_MAX,  # the largest copy a route pushes, on both sides
                MAX_ENDPOINT_LEN,  # a route's endpoint bytes hold any the wire allows
            ],
        ),
        (
            "fleetd_worker_layout",  # worker_loop.c
            lambda: [
                ctypes.sizeof(native.WorkerState),
                ctypes.sizeof(native.WorkerCopy),
                ctypes.sizeof(native.WorkerIndexCheck),
                native.WorkerState.runs.offset,
                native.WorkerIndexCheck.elem.offset,
            ],
        ),
    ],
)
def test_the_ctypes_mirrors_match_what_the_compiler_laid_out(function, expected):
    layout = getattr(native.load(), function)
    layout.argtypes, layout.restype = [ctypes.c_int], ctypes.c_size_t
    assert [layout(i) for i in range(len(expected()))] == expected()
