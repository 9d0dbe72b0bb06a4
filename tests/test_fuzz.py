"""Property tests against a live fleetd: random and mutated command streams over real sockets.

Written from the protocol document (shared/docs/ggml-rpc-protocol.md), not from fleetd's own
encoders, so a mistake in fleetd.wire cannot hide itself here. Every case holds to:

- the daemon never answers with a response of the wrong size, and never answers a command that
  has no response: it answers correctly or closes that connection;
- nothing hangs: every read is bounded, and a complete request is answered or the connection
  closed within the bound;
- a session opened before the case keeps working after it, and a new client is served;
- no internal error (a logged traceback) for any input.

CI runs a few hundred cases per property; `FLEETD_FUZZ_EXAMPLES=100000` (scripts/fuzz.sh) runs
the full set.
"""

from __future__ import annotations

import logging
import os
import socket
import struct

import pytest
from helpers import (
    ALLOC_BUFFER,
    BOUND_S,
    BUFFER_CLEAR,
    BUFFER_GET_BASE,
    COPY_TENSOR,
    COPY_TENSOR_TO,
    DEVICE_COUNT,
    F16,
    F32,
    FREE_BUFFER,
    GET_ALIGNMENT,
    GET_ALLOC_SIZE,
    GET_DEVICE_MEMORY,
    GET_TENSOR,
    GRAPH_COMPUTE,
    GRAPH_RECOMPUTE,
    HELLO_FRAME,
    INIT_TENSOR,
    MEMSET_TENSOR,
    PEER_BARRIER,
    Q8_0,
    RESPONSE_SIZE,
    SET_TENSOR,
    SET_TENSOR_HASH,
    U32,
    U64,
    Closed,
    Conn,
    frame,
    hello,
    tensor,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetd.server import Server, ServerConfig

EXAMPLES = int(os.environ.get("FLEETD_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not os.environ.get("FLEETD_FUZZ_RANDOM"),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- the daemon under test -------------------------------------------------------------------------


class InternalErrors(logging.Handler):
    """Collects fleetd log records that carry a traceback: an internal error, never allowed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.records.append(record)


@pytest.fixture(scope="module")
def daemon():
    srv = Server(ServerConfig(host="127.0.0.1", port=0, control_port=None))
    srv.start()
    errors = InternalErrors()
    logging.getLogger("fleetd").addHandler(errors)
    sentinel = Conn(srv.address[1])
    hello(sentinel)
    srv.fuzz_errors = errors
    srv.fuzz_sentinel = sentinel
    yield srv
    logging.getLogger("fleetd").removeHandler(errors)
    sentinel.close()
    srv.stop()


def still_healthy(srv: Server) -> None:
    srv.fuzz_sentinel.no_response_then_probe()
    fresh = Conn(srv.address[1])
    try:
        hello(fresh)
        assert struct.unpack("<I", fresh.call(DEVICE_COUNT, b"", 4))[0] == 1
    finally:
        fresh.close()
    tracebacks = [f"{r.name}: {r.getMessage()}" for r in srv.fuzz_errors.records]
    srv.fuzz_errors.records.clear()
    assert not tracebacks, "internal errors logged:\n" + "\n".join(tracebacks)


def drain_until_closed(conn: Conn) -> None:
    """After a blind stream and our half-close: read whatever comes until the daemon closes."""
    try:
        conn.sock.shutdown(socket.SHUT_WR)
    except OSError:  # closed by the daemon already
        return
    conn.sock.settimeout(BOUND_S)
    total = 0
    while True:
        try:
            chunk = conn.sock.recv(65536)
        except ConnectionResetError:
            return
        except TimeoutError:
            raise AssertionError(f"daemon neither answered nor closed within {BOUND_S}s") from None
        if not chunk:
            return
        total += len(chunk)
        assert total < 64 << 20, "the daemon keeps sending"


# -- strategies --------------------------------------------------------------------------------------

edge_u64 = st.one_of(
    st.sampled_from([0, 1, 31, 32, 255, 256, 4096, U32, U32 + 1, 1 << 62, 1 << 63, U64]), st.integers(0, U64)
)
edge_u32 = st.one_of(st.sampled_from([0, 1, 2, 4, 255, 65535, U32]), st.integers(0, U32))
small_u32 = st.integers(0, 64)


@st.composite
def blind_frame(draw) -> bytes:
    """A frame with any command byte, a size that may lie, and a payload that may be cut."""
    cmd = draw(st.one_of(st.sampled_from(sorted(RESPONSE_SIZE)), st.integers(0, 255)))
    payload = draw(st.binary(max_size=700))
    size = draw(st.one_of(st.just(len(payload)), edge_u64))
    return frame(cmd, payload, size)


@st.composite
def mutated_stream(draw) -> bytes:
    """A valid-looking session with bytes flipped, cut or overwritten by edge values."""
    t = tensor(buffer=draw(st.sampled_from([0, 0x100, 0x101, 0x200])), data=draw(edge_u64), ne=(4, 1, 1, 1))
    valid = b"".join(
        [
            HELLO_FRAME,
            frame(ALLOC_BUFFER, struct.pack("<IQ", 0, draw(st.sampled_from([0, 64, 4096])))),
            frame(BUFFER_GET_BASE, struct.pack("<Q", 0x100)),
            frame(SET_TENSOR, t + b"\x00" + struct.pack("<Q", 0) + bytes(16)),
            frame(GET_TENSOR, t + struct.pack("<QQ", 0, 16)),
            frame(GRAPH_COMPUTE, struct.pack("<II", 0, 1) + struct.pack("<Q", 1) + struct.pack("<I", 1) + t),
            frame(GRAPH_RECOMPUTE, struct.pack("<I", 0)),
            frame(GET_ALLOC_SIZE, struct.pack("<I", 0) + t + bytes(296 * 10)),
        ]
    )
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["flip", "u64", "cut", "insert"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if kind == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "u64":
            data[at : at + 8] = struct.pack("<Q", draw(edge_u64))
        elif kind == "cut":
            del data[at:]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=32))
        if not data:
            break
    return bytes(data)


# -- the properties ----------------------------------------------------------------------------------


@FUZZ
@given(frames=st.lists(blind_frame(), min_size=1, max_size=6), with_hello=st.booleans())
def test_blind_frames(daemon, frames, with_hello):
    conn = Conn(daemon.address[1])
    try:
        conn.send((HELLO_FRAME if with_hello else b"") + b"".join(frames))
    except Closed:
        pass
    else:
        drain_until_closed(conn)
    finally:
        conn.close()
    still_healthy(daemon)


@FUZZ
@given(stream=mutated_stream())
def test_mutated_streams(daemon, stream):
    conn = Conn(daemon.address[1])
    try:
        conn.send(stream)
    except Closed:
        pass
    else:
        drain_until_closed(conn)
    finally:
        conn.close()
    still_healthy(daemon)


@st.composite
def region_tensor(draw, buffer: int, base: int, size: int) -> tuple[bytes, int]:
    """A tensor near (or outside) a real buffer: offsets at the edges, strides of 0, absurd
    element counts, any type. Returns the tensor and its claimed byte size."""
    type_ = draw(st.sampled_from([F32, F32, F16, Q8_0, 2, 12, 30, 39, 40, 41, 100, U32]))
    ne = tuple(draw(st.one_of(st.sampled_from([0, 1, 2, 4, 32]), edge_u32)) for _ in range(4))
    stride0 = draw(st.booleans())
    nb = (
        tuple(0 for _ in range(4))
        if stride0
        else tuple(draw(st.one_of(st.sampled_from([0, 1, 4, 128]), edge_u32)) for _ in range(4))
    )
    shape = draw(st.sampled_from(["small", "small", "drawn", "huge"]))
    if shape == "small":
        ne, nb, type_ = (draw(st.integers(0, 16)), 1, 1, 1), (4, 64, 64, 64), F32
    elif shape == "huge":  # byte sizes at and past 2^64
        ne = tuple(draw(st.sampled_from([U32, 1 << 31, 1])) for _ in range(4))
        nb = tuple(draw(st.sampled_from([0, U32, 1 << 31, 4])) for _ in range(4))
    offset = draw(st.one_of(st.sampled_from([0, size - 4, size, size + 1]), st.integers(0, 2 * size)))
    data = draw(st.one_of(st.just(base + offset), edge_u64)) if base else draw(edge_u64)
    handle = draw(st.sampled_from([buffer, buffer, 0, buffer + 1, U64]))
    t = tensor(
        id=draw(st.integers(1, 8)),
        type=type_,
        buffer=handle,
        ne=ne,
        nb=nb,
        data=data,
        op=draw(st.one_of(st.just(0), st.integers(0, 120))),
        flags=draw(st.sampled_from([0, 16])),
        src=tuple(draw(st.sampled_from([0, 0, 1, 2, 3])) for _ in range(10)),
        view_src=draw(st.sampled_from([0, 0, 1, 2])),
        view_offs=draw(edge_u64),
        name=draw(st.binary(max_size=64)),
    )
    return t, draw(st.one_of(st.sampled_from([0, 4, 16, size]), edge_u64))


@st.composite
def interactive_command(draw, buffer: int, base: int, size: int) -> tuple[int, bytes, object]:
    t, n = draw(region_tensor(buffer, base, size))
    t2, _ = draw(region_tensor(buffer, base, size))
    cmd = draw(
        st.sampled_from(
            [
                SET_TENSOR,
                GET_TENSOR,
                COPY_TENSOR,
                MEMSET_TENSOR,
                INIT_TENSOR,
                GET_ALLOC_SIZE,
                SET_TENSOR_HASH,
                BUFFER_CLEAR,
                BUFFER_GET_BASE,
                GRAPH_COMPUTE,
                GRAPH_RECOMPUTE,
                ALLOC_BUFFER,
                GET_DEVICE_MEMORY,
                COPY_TENSOR_TO,
                PEER_BARRIER,
            ]
        )
    )
    if cmd == SET_TENSOR:
        data = bytes(min(n, 256))
        return cmd, t + b"\x00" + struct.pack("<Q", draw(st.sampled_from([0, 4, size]))) + data, None
    if cmd == GET_TENSOR:
        off = draw(st.sampled_from([0, 4, size, U64]))
        return cmd, t + struct.pack("<QQ", off, n), ("req", n)
    if cmd == COPY_TENSOR:
        return cmd, t + t2, 1
    if cmd == MEMSET_TENSOR:
        return cmd, t + struct.pack("<QQB", draw(st.sampled_from([0, 4, U64])), n, 0xAB), None
    if cmd == INIT_TENSOR:
        return cmd, t, None
    if cmd == GET_ALLOC_SIZE:
        srcs = t2 + bytes(296 * 9) if draw(st.booleans()) else bytes(296 * 10)
        return cmd, struct.pack("<I", draw(st.sampled_from([0, 0, 1, U32]))) + t + srcs, 8
    if cmd == SET_TENSOR_HASH:
        return cmd, t + struct.pack("<QQ", 0, draw(edge_u64)), 1
    if cmd == BUFFER_CLEAR:
        return cmd, struct.pack("<QB", draw(st.sampled_from([buffer, 0, buffer + 1])), 7), None
    if cmd == BUFFER_GET_BASE:
        return cmd, struct.pack("<Q", draw(st.sampled_from([buffer, 0, buffer ^ 1]))), 8
    if cmd == GRAPH_COMPUTE:
        tensors = draw(st.lists(region_tensor(buffer, base, size), min_size=0, max_size=5))
        nodes = draw(st.lists(st.integers(0, 9), min_size=0, max_size=5))
        n_nodes = draw(st.one_of(st.just(len(nodes)), edge_u32))
        n_tensors = draw(st.one_of(st.just(len(tensors)), edge_u32))
        payload = (
            struct.pack("<II", 0, n_nodes)
            + b"".join(struct.pack("<Q", i) for i in nodes)
            + struct.pack("<I", n_tensors)
            + b"".join(x for x, _ in tensors)
        )
        return cmd, payload, None
    if cmd == GRAPH_RECOMPUTE:
        return cmd, struct.pack("<I", draw(st.sampled_from([0, 1]))), None
    if cmd == ALLOC_BUFFER:
        return (
            cmd,
            struct.pack(
                "<IQ", draw(st.sampled_from([0, 0, 1])), draw(st.sampled_from([0, 64, 1 << 40, U64]))
            ),
            16,
        )
    if cmd == GET_DEVICE_MEMORY:
        return cmd, struct.pack("<I", draw(st.sampled_from([0, 0, 1, U32]))), 16
    if cmd == COPY_TENSOR_TO:
        endpoint = draw(st.sampled_from([b"127.0.0.1:1", b"127.0.0.1:0", b":", b"x" * 300, b"[::1]:99999"]))
        return cmd, t + t2 + struct.pack("<QI", n, len(endpoint)) + endpoint, 1
    return PEER_BARRIER, b"", 1


@FUZZ
@given(data=st.data())
def test_interactive_sessions(daemon, data):
    conn = Conn(daemon.address[1])
    try:
        hello(conn)
        size = data.draw(st.sampled_from([64, 256, 4096]), label="size")
        handle, got = struct.unpack("<QQ", conn.call(ALLOC_BUFFER, struct.pack("<IQ", 0, size), 16))
        assert handle and got == size
        (base,) = struct.unpack("<Q", conn.call(BUFFER_GET_BASE, struct.pack("<Q", handle), 8))
        for _ in range(data.draw(st.integers(1, 6), label="commands")):
            cmd, payload, expect = data.draw(interactive_command(handle, base, size), label="command")
            if isinstance(expect, tuple):
                expect = expect[1] if expect[1] <= 1 << 20 else None
                if expect is None:
                    conn.send(frame(cmd, payload))
                    drain_until_closed(conn)
                    break
            try:
                conn.call(cmd, payload, expect)
                if expect is None:
                    conn.no_response_then_probe()
            except Closed:
                break
    except Closed:
        pass
    finally:
        conn.close()
    still_healthy(daemon)


@FUZZ
@given(data=st.data())
def test_chunked_pipelined_requests(daemon, data):
    """Valid requests pipelined and cut at arbitrary points (each write may end mid-request):
    every answer arrives, in order, and nothing is held beyond one request per connection."""
    conn = Conn(daemon.address[1])
    try:
        hello(conn)
        size = data.draw(st.sampled_from([64, 4096]), label="size")
        handle, _ = struct.unpack("<QQ", conn.call(ALLOC_BUFFER, struct.pack("<IQ", 0, size), 16))
        (base,) = struct.unpack("<Q", conn.call(BUFFER_GET_BASE, struct.pack("<Q", handle), 8))
        t = tensor(buffer=handle, ne=(size // 4, 1, 1, 1), data=base)
        pool = [
            (frame(GET_ALIGNMENT, struct.pack("<I", 0)), 8),
            (frame(DEVICE_COUNT, b""), 4),
            (frame(SET_TENSOR, t + b"\x00" + struct.pack("<Q", 0) + bytes(size)), None),
            (frame(GET_TENSOR, t + struct.pack("<QQ", 0, size)), size),
            (frame(GET_ALLOC_SIZE, struct.pack("<I", 0) + t + bytes(296 * 10)), 8),
            (frame(GRAPH_COMPUTE, struct.pack("<II", 0, 0) + struct.pack("<I", 0)), None),
        ]
        picks = data.draw(
            st.lists(st.sampled_from(range(len(pool))), min_size=1, max_size=12), label="requests"
        )
        stream = b"".join(pool[i][0] for i in picks)
        cuts = sorted(data.draw(st.lists(st.integers(1, max(1, len(stream) - 1)), max_size=8), label="cuts"))
        for a, b in zip([0] + cuts, cuts + [len(stream)]):
            conn.send(stream[a:b])
        for i in picks:
            expect = pool[i][1]
            if expect is not None:
                (n,) = struct.unpack("<Q", conn.recv_exact(8))
                assert n == expect
                conn.recv_exact(n)
        conn.no_response_then_probe()
    finally:
        conn.close()
    still_healthy(daemon)


@FUZZ
@given(data=st.data())
def test_two_sessions_share_and_free(daemon, data):
    """One session's buffer used by another (handed its handle), freed or dropped at any point:
    the other's stored graph and commands fail cleanly, never touch freed memory."""
    owner, other = Conn(daemon.address[1]), Conn(daemon.address[1])
    try:
        hello(owner)
        hello(other)
        handle, _ = struct.unpack("<QQ", owner.call(ALLOC_BUFFER, struct.pack("<IQ", 0, 64), 16))
        (base,) = struct.unpack("<Q", owner.call(BUFFER_GET_BASE, struct.pack("<Q", handle), 8))
        a = tensor(id=1, buffer=handle, ne=(4, 1, 1, 1), data=base)
        out = tensor(
            id=2, buffer=handle, ne=(4, 1, 1, 1), data=base + 16, op=2, src=(1, 1) + (0,) * 8, flags=16
        )
        graph = frame(GRAPH_COMPUTE, struct.pack("<IIQI", 0, 1, 2, 2) + a + out)
        steps = data.draw(
            st.lists(
                st.sampled_from(["compute", "recompute", "get", "free", "drop"]), min_size=1, max_size=6
            ),
            label="steps",
        )
        owner_open = True
        for step in steps:
            try:
                if step in ("free", "drop") and not owner_open:
                    continue
                if step == "compute":
                    other.send(graph)
                    other.no_response_then_probe()
                elif step == "recompute":
                    other.send(frame(GRAPH_RECOMPUTE, struct.pack("<I", 0)))
                    other.no_response_then_probe()
                elif step == "get":
                    other.call(GET_TENSOR, a + struct.pack("<QQ", 0, 16), 16)
                elif step == "free":
                    owner.send(frame(FREE_BUFFER, struct.pack("<Q", handle)))
                    owner.no_response_then_probe()
                else:
                    owner.close()
                    owner_open = False
            except Closed:
                other.close()
                other = Conn(daemon.address[1])
                hello(other)
    except Closed:
        pass
    finally:
        owner.close()
        other.close()
    still_healthy(daemon)


@FUZZ
@given(data=st.data())
def test_mutated_streams_on_a_live_buffer(daemon, data):
    """As test_mutated_streams, with the session's real buffer handle and base (handles are
    random, so a blind stream rarely gets past its first buffer command)."""
    conn = Conn(daemon.address[1])
    try:
        hello(conn)
        size = data.draw(st.sampled_from([64, 4096]), label="size")
        handle, _ = struct.unpack("<QQ", conn.call(ALLOC_BUFFER, struct.pack("<IQ", 0, size), 16))
        (base,) = struct.unpack("<Q", conn.call(BUFFER_GET_BASE, struct.pack("<Q", handle), 8))
        t = tensor(
            buffer=handle,
            data=base + data.draw(st.sampled_from([0, 16, size - 16]), label="at"),
            ne=(4, 1, 1, 1),
        )
        out = tensor(id=2, buffer=handle, data=base, ne=(4, 1, 1, 1), op=2, src=(1, 1) + (0,) * 8, flags=16)
        stream = bytearray(
            b"".join(
                [
                    frame(SET_TENSOR, t + b"\x00" + struct.pack("<Q", 0) + bytes(16)),
                    frame(GET_TENSOR, t + struct.pack("<QQ", 0, 16)),
                    frame(GRAPH_COMPUTE, struct.pack("<IIQI", 0, 1, 2, 2) + t + out),
                    frame(GRAPH_RECOMPUTE, struct.pack("<I", 0)),
                    frame(COPY_TENSOR, t + out),
                    frame(MEMSET_TENSOR, t + struct.pack("<QQB", 0, 16, 1)),
                    frame(GET_ALLOC_SIZE, struct.pack("<I", 0) + t + bytes(296 * 10)),
                    frame(FREE_BUFFER, struct.pack("<Q", handle)),
                ]
            )
        )
        for _ in range(data.draw(st.integers(1, 8), label="mutations")):
            kind = data.draw(st.sampled_from(["flip", "u64", "cut", "insert"]))
            at = data.draw(st.integers(0, max(0, len(stream) - 1)))
            if kind == "flip":
                stream[at] ^= 1 << data.draw(st.integers(0, 7))
            elif kind == "u64":
                stream[at : at + 8] = struct.pack("<Q", data.draw(edge_u64))
            elif kind == "cut":
                del stream[at:]
            else:
                stream[at:at] = data.draw(st.binary(min_size=1, max_size=32))
            if not stream:
                break
        conn.send(bytes(stream))
        drain_until_closed(conn)
    except Closed:
        pass
    finally:
        conn.close()
    still_healthy(daemon)
