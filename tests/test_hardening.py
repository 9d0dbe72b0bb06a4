"""One test per defect of issue 11, each against a live in-process fleetd over raw frames (the
protocol document's layout, as tests/test_fuzz.py writes it), each with a log handler that fails
the test on any record carrying a traceback: bad input is one clear line and a closed connection,
never an internal error, and the daemon serves the next client.
"""

from __future__ import annotations

import http.client
import json
import logging
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
from helpers import (
    ALLOC_BUFFER,
    BOUND_S,
    BUFFER_GET_BASE,
    COPY_TENSOR,
    COPY_TENSOR_TO,
    DEVICE_COUNT,
    FREE_BUFFER,
    GET_ALLOC_SIZE,
    GET_DEVICE_MEMORY,
    GRAPH_COMPUTE,
    GRAPH_RECOMPUTE,
    HELLO_FRAME,
    INIT_TENSOR,
    MEMSET_TENSOR,
    SET_TENSOR,
    U32,
    Closed,
    Conn,
    frame,
    hello,
    rpc_tensor,
    tensor,
)

from fleetd.compute.buffers import BufferRegistry
from fleetd.compute.device import NumpyDevice
from fleetd.errors import RemoteProtocolError
from fleetd.server import Server
from fleetd.server.config import ServerLimits
from fleetd.server.peer import PeerLinks
from fleetd.wire import GetAllocSizeReply, ServerConnection

OP_ADD, COMPUTE = 2, 16


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def lines(self, level: int = logging.INFO) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= level]


@pytest.fixture
def log_records():
    handler = Records()
    root = logging.getLogger("fleetd")
    root.addHandler(handler)
    old = root.level
    root.setLevel(logging.DEBUG)
    yield handler
    root.removeHandler(handler)
    root.setLevel(old)
    tracebacks = [f"{r.name}: {r.getMessage()}" for r in handler.records if r.exc_info]
    assert not tracebacks, "internal errors logged:\n" + "\n".join(tracebacks)


@pytest.fixture
def daemon(fleetd_server):
    """A fleetd with the given limits (ServerLimits fields as keywords)."""

    def start(allow=None, **limits) -> Server:
        return fleetd_server(limits=ServerLimits(**limits), allow=allow)

    return start


def port_of(srv: Server) -> int:
    return srv.address[1]


def served(srv: Server) -> None:
    """A new client gets HELLO and DEVICE_COUNT answered."""
    c = Conn(port_of(srv))
    try:
        hello(c)
        assert struct.unpack("<I", c.call(DEVICE_COUNT, b"", 4))[0] == 1
    finally:
        c.close()


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {BOUND_S}s: {what}")
        time.sleep(0.02)


def alloc(c: Conn, size: int) -> tuple[int, int]:
    handle, got = struct.unpack("<QQ", c.call(ALLOC_BUFFER, struct.pack("<IQ", 0, size), 16))
    if not handle:
        return 0, 0
    (base,) = struct.unpack("<Q", c.call(BUFFER_GET_BASE, struct.pack("<Q", handle), 8))
    return handle, base


def one_warning(records: Records, needle: str) -> str:
    lines = [m for m in records.lines(logging.WARNING) if needle in m]
    assert len(lines) == 1, f"expected one line with {needle!r}, got {records.lines()}"
    assert "\n" not in lines[0]
    return lines[0]


# -- 1. internal errors on bad input -------------------------------------------------------------


def test_alloc_size_of_2_64_bytes_is_a_protocol_error(daemon, log_records):
    srv = daemon()
    c = Conn(port_of(srv))
    hello(c)
    huge = tensor(buffer=0, ne=(U32, U32, U32, U32), nb=(U32, U32, U32, U32))  # nbytes > 2^64
    with pytest.raises(Closed):
        c.call(GET_ALLOC_SIZE, struct.pack("<I", 0) + huge + bytes(296 * 10), 8)
    one_warning(log_records, "does not fit the response")
    served(srv)


def test_response_values_are_checked_in_one_place():
    conn = ServerConnection()
    with pytest.raises(RemoteProtocolError, match="does not fit"):
        conn.send(GetAllocSizeReply(1 << 64))
    assert conn.send(GetAllocSizeReply((1 << 64) - 1))[8:] == b"\xff" * 8


def test_copy_tensor_on_zero_byte_buffer_answers_like_stock(daemon, log_records):
    srv = daemon()
    c = Conn(port_of(srv))
    hello(c)
    handle, _ = alloc(c, 0)
    empty = tensor(buffer=handle, ne=(0, 1, 1, 1), data=0)
    assert c.call(COPY_TENSOR, empty + empty, 1) == b"\x00"  # as stock (test_conformance)
    c.no_response_then_probe()
    c.close()


def test_memset_on_zero_byte_buffer_closes_with_one_line(daemon, log_records):
    srv = daemon()
    c = Conn(port_of(srv))
    hello(c)
    handle, _ = alloc(c, 0)
    empty = tensor(buffer=handle, ne=(0, 1, 1, 1), data=0)
    c.send(frame(MEMSET_TENSOR, empty + struct.pack("<QQB", 0, 0, 1)))
    assert c.closed_by_daemon()
    one_warning(log_records, "MEMSET_TENSOR")
    served(srv)


def stride0_graph(handle: int, base: int, ne: tuple[int, int, int, int]) -> bytes:
    a = tensor(id=1, buffer=handle, ne=ne, nb=(0, 0, 0, 0), data=base)
    out = tensor(
        id=2,
        buffer=handle,
        ne=ne,
        nb=(0, 0, 0, 0),
        data=base,
        op=OP_ADD,
        src=(1, 1) + (0,) * 8,
        flags=COMPUTE,
    )
    return struct.pack("<IIQI", 0, 1, 2, 2) + a + out


def test_stride0_view_of_2_124_elements_is_refused(daemon, log_records):
    srv = daemon()
    c = Conn(port_of(srv))
    hello(c)
    handle, base = alloc(c, 64)
    c.send(frame(GRAPH_COMPUTE, stride0_graph(handle, base, (U32, U32, U32, U32))))
    assert c.closed_by_daemon()
    one_warning(log_records, "stands for")
    served(srv)


def test_stride0_view_driving_large_temporaries_is_refused(daemon, log_records):
    # 64 bytes standing for 48 Mi float32 elements: ~192 MiB of temporaries, not allowed.
    srv = daemon()
    c = Conn(port_of(srv))
    hello(c)
    handle, base = alloc(c, 64)
    c.send(frame(GRAPH_COMPUTE, stride0_graph(handle, base, (4096, 4096, 3, 1))))
    assert c.closed_by_daemon()
    one_warning(log_records, "stands for")


def test_graph_size_limit(daemon, log_records):
    srv = daemon(max_graph_tensors=4)
    c = Conn(port_of(srv))
    hello(c)
    handle, base = alloc(c, 64)
    ts = b"".join(tensor(id=i, buffer=handle, data=base) for i in range(1, 6))
    c.send(frame(GRAPH_COMPUTE, struct.pack("<IIQI", 0, 1, 1, 5) + ts))
    assert c.closed_by_daemon()
    one_warning(log_records, "limit 4")


# -- 2. limits -----------------------------------------------------------------------------------


def test_memory_limits_answer_the_null_buffer_and_free_memory_follows(daemon, log_records):
    mib = 1 << 20
    srv = daemon(max_memory=4 * mib, max_session_memory=3 * mib)
    a, b = Conn(port_of(srv)), Conn(port_of(srv))
    hello(a)
    hello(b)
    assert alloc(a, 2 * mib)[0]
    free, total = struct.unpack("<QQ", a.call(GET_DEVICE_MEMORY, struct.pack("<I", 0), 16))
    assert free == 1 * mib and total >= 4 * mib  # the session's own limit binds first
    assert alloc(a, 2 * mib) == (0, 0)  # past the session's 3 MiB: the null buffer
    assert alloc(b, 2 * mib)[0]
    assert alloc(b, 1 * mib) == (0, 0)  # past the daemon's 4 MiB
    free_b, _ = struct.unpack("<QQ", b.call(GET_DEVICE_MEMORY, struct.pack("<I", 0), 16))
    assert free_b == 0
    a.close()  # a's buffers go with its session
    wait_for(lambda: srv.state.registry.allocated == 2 * mib, "a's buffers freed")
    assert alloc(b, 1 * mib)[0]
    b.close()


def test_request_bigger_than_the_connection_limit_is_cut(daemon, log_records):
    srv = daemon(max_request_bytes=64 << 10)
    c = Conn(port_of(srv))
    hello(c)
    c.send(struct.pack("<BQ", GRAPH_COMPUTE, 1 << 20))  # announces 1 MiB; nothing buffered yet
    assert c.closed_by_daemon()
    one_warning(log_records, "per connection")
    served(srv)


def test_unfinished_requests_of_all_connections_are_bounded(daemon, log_records):
    srv = daemon(max_buffered_bytes=400 << 10, max_request_bytes=1 << 20)
    conns = [Conn(port_of(srv)) for _ in range(3)]
    for c in conns:
        hello(c)
    part = struct.pack("<BQ", GRAPH_COMPUTE, 800 << 10) + bytes(256 << 10)
    cut = 0
    for c in conns:  # 3 x 256 KiB held > 400 KiB: the third is cut
        try:
            c.send(part)
        except Closed:
            cut += 1
            continue
    wait_for(lambda: any("unfinished requests" in m for m in log_records.lines()), "a connection cut")
    assert srv.state.receive_budget.held <= 400 << 10
    for c in conns:
        c.close()
    wait_for(lambda: srv.state.receive_budget.held == 0, "budget returned")
    served(srv)


def test_connection_cap_refuses_and_recovers(daemon, log_records):
    srv = daemon(max_connections=3)
    held = [Conn(port_of(srv)) for _ in range(3)]
    for c in held:
        hello(c)
    extra = Conn(port_of(srv))
    assert extra.closed_by_daemon()
    wait_for(lambda: any("3 connections open" in m for m in log_records.lines(logging.WARNING)), "logged")
    held.pop().close()
    wait_for(lambda: srv.state.sessions.count() < 3, "a session ended")
    served(srv)
    for c in held:
        c.close()


def test_one_address_at_its_cap_does_not_stop_another(daemon, log_records):
    srv = daemon(max_connections=16, max_connections_per_address=3)
    held = [Conn(port_of(srv)) for _ in range(3)]  # 127.0.0.1 holds its three
    for c in held:
        hello(c)
    extra = Conn(port_of(srv))
    assert extra.closed_by_daemon()
    wait_for(
        lambda: any("3 connections open from that address" in m for m in log_records.lines(logging.WARNING)),
        "logged",
    )
    # another host (127.0.0.2 is loopback too) is served while the first holds its cap
    with Conn(port_of(srv), source_address=("127.0.0.2", 0)) as other:
        hello(other)  # raises Closed if the second address was refused
    held.pop().close()
    wait_for(lambda: srv.state.sessions.count_from("127.0.0.1") < 3, "a session ended")
    served(srv)
    for c in held:
        c.close()


def test_allow_list_refuses_other_clients(daemon, log_records):
    srv = daemon(allow=["10.99.0.0/16"])
    c = Conn(port_of(srv))
    assert c.closed_by_daemon()
    wait_for(lambda: any("not in --allow" in m for m in log_records.lines(logging.WARNING)), "logged")


# -- 3. timeouts ---------------------------------------------------------------------------------


def test_no_hello_is_cut(daemon, log_records):
    srv = daemon(hello_timeout=0.3)
    c = Conn(port_of(srv))
    assert c.closed_by_daemon()
    assert any("no HELLO" in m for m in log_records.lines())
    served(srv)


def test_idle_connection_is_closed(daemon, log_records):
    srv = daemon(idle_timeout=0.3)
    c = Conn(port_of(srv))
    hello(c)
    assert c.closed_by_daemon()
    assert any("idle for" in m for m in log_records.lines())


def test_stalled_request_is_cut(daemon, log_records):
    srv = daemon(request_timeout=0.3)
    c = Conn(port_of(srv))
    hello(c)
    c.send(struct.pack("<BQ", DEVICE_COUNT, 0)[:5])  # half a header, then nothing
    assert c.closed_by_daemon()
    assert any("no byte of a started request" in m for m in log_records.lines())


def test_slow_sender_is_cut(daemon, log_records):
    srv = daemon(request_timeout=0.3, min_request_rate=1000)
    c = Conn(port_of(srv))
    hello(c)
    request = frame(GRAPH_COMPUTE, bytes(4000))
    stop = time.monotonic() + BOUND_S
    try:
        for byte in request:  # one byte every 50 ms: 20 B/s, far below 1000 B/s
            c.send(bytes([byte]))
            time.sleep(0.05)
            if time.monotonic() > stop:
                break
    except Closed:
        pass
    assert c.closed_by_daemon()
    assert any("slow sender" in m for m in log_records.lines())


def _tensor_body_request(srv, size: int):
    """A raw connection past HELLO with a buffer of its own, and a SET_TENSOR of `size` bytes
    into it, framed: (connection, request) for a test to send as it likes."""
    from fleetd.wire import GgmlType, SetTensor

    c = Conn(port_of(srv))
    hello(c)
    handle, base = alloc(c, size)
    t = rpc_tensor(GgmlType.F32, (size // 4,), buffer=handle, data=base)
    body = SetTensor(t, 0, size, 0).encode() + bytes(size)
    return c, frame(SET_TENSOR, body)


@pytest.mark.parametrize("how", ["trickled", "stalled", "cut"])
def test_a_tensor_body_read_in_c_keeps_the_request_rules(daemon, log_records, how):
    # SET_TENSOR's data is read by fastpath.c's fleetd_recv_body: the same rules and texts as
    # the Python reads (slow sender, no byte of a started request), and a cut body ends only
    # its connection
    srv = daemon(request_timeout=0.3, min_request_rate=100_000)
    c, request = _tensor_body_request(srv, 1 << 20)
    head = request[: len(request) - (1 << 20) + 70_000]  # the fixed part and some data
    c.send(head)
    stop = time.monotonic() + BOUND_S
    try:
        if how == "trickled":  # 200 B every 20 ms: 10 kB/s, far below 100 kB/s
            rest = request[len(head) :]
            while rest and time.monotonic() < stop:
                c.send(rest[:200])
                rest = rest[200:]
                time.sleep(0.02)
        elif how == "cut":
            c.sock.shutdown(socket.SHUT_WR)
    except Closed:
        pass
    assert c.closed_by_daemon()
    want = {"trickled": "slow sender", "stalled": "no byte of a started request", "cut": "peer closed"}
    assert any(want[how] in m for m in log_records.lines()), log_records.lines()
    served(srv)


def test_a_pause_in_a_tensor_body_shorter_than_the_request_timeout_is_waited_out(daemon, log_records):
    # fastpath.c reads a body on the loop's short receive timeout (its tick, no socket option
    # set per body): silent ticks add up, and only a silence of request_timeout cuts the body
    srv = daemon(request_timeout=1.0)
    c, request = _tensor_body_request(srv, 1 << 20)
    head = request[: len(request) - (1 << 20) + 70_000]
    for part in (head, request[len(head) : len(head) + 100_000], request[len(head) + 100_000 :]):
        c.send(part)
        time.sleep(0.3)  # many of the loop's 20 ms ticks, well inside the second
    assert struct.unpack("<I", c.call(DEVICE_COUNT, b"", 4))[0] == 1  # the SET was whole
    assert not any("no byte" in m or "slow sender" in m for m in log_records.lines())
    c.close()


def test_a_pause_between_requests_is_not_charged_to_the_next(daemon, log_records):
    """test-backend-ops was cut after 1,434 cases: a SET_TENSOR whose data needed reads of its
    own left the request clock running; the client then computed its reference for longer than
    the grace, sent the next request's command byte apart from the rest (as the stock client
    does), and that request was "a slow sender" at once. Only time spent in recv counts now."""
    srv = daemon(request_timeout=0.3, min_request_rate=4096)
    from fleetd.client.graph import GraphBuilder
    from fleetd.client.rpc import RpcClient
    from fleetd.wire import GgmlType

    with RpcClient(f"127.0.0.1:{port_of(srv)}").open() as c:
        handle, _ = c.alloc_buffer(1 << 20)
        t = GraphBuilder().tensor(GgmlType.F32, (1024,), handle, c.buffer_get_base(handle))
        for _ in range(3):
            # 4 KiB of data: the first read takes the header and most of it, one more the rest
            c.set_tensor(t.rpc(), bytes(4096))  # no answer: the next request follows it directly
            time.sleep(0.8)  # the client thinks, longer than the grace
            request = struct.pack("<BQ", DEVICE_COUNT, 0)
            c.sock.sendall(request[:1])  # the command byte alone, then the size
            time.sleep(0.05)
            c.sock.sendall(request[1:])
            c.sock.settimeout(5)
            reply = b""
            while len(reply) < 12:
                chunk = c.sock.recv(12 - len(reply))
                assert chunk, "fleetd closed the connection"
                reply += chunk
            assert struct.unpack("<QI", reply) == (4, 1)  # | size u64 | count u32 |
        assert c.device_count() == 1
    assert not any("slow sender" in m for m in log_records.lines())


# -- 4. the accept loop --------------------------------------------------------------------------


def test_accept_loop_survives_thread_start_failures(fleetd_server, log_records, monkeypatch):
    srv = fleetd_server(control_port=0)
    real_start = threading.Thread.start
    failures = {"left": 3}
    lock = threading.Lock()

    def failing_start(self):
        if self.name.startswith("fleetd-session"):
            with lock:
                if failures["left"] > 0:
                    failures["left"] -= 1
                    raise RuntimeError("can't start new thread")
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", failing_start)
    c = Conn(port_of(srv))
    assert c.closed_by_daemon()  # its session could not start: closed, not left hanging
    status = control_status(srv)
    assert status["healthy"] is False and "thread" in status["unhealthy_reason"]
    while failures["left"]:
        assert Conn(port_of(srv)).closed_by_daemon()
    served(srv)
    assert control_status(srv)["healthy"] is True
    assert sum("backing off" in m for m in log_records.lines(logging.ERROR)) == 1  # once per episode


def control_status(srv: Server) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", srv.control.port, timeout=BOUND_S)
    try:
        conn.request("GET", "/v1/status")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def test_accept_loop_survives_fd_exhaustion(tmp_path):
    """A subprocess fleetd under a small RLIMIT_NOFILE: once its fds are used up, further
    clients wait; when they are given back, a new client is served."""
    nofile = 48
    code = (
        "import resource, sys; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({nofile}, {nofile})); "
        "from fleetd.server.main import main; sys.exit(main(sys.argv[1:]))"
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log_path = tmp_path / "fleetd.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, "-p", str(port), "--control-port", "0", "--max-connections", "1000"],
            stdout=log_file,
            stderr=log_file,
        )
    try:
        wait_for(lambda: _connectable(port), "fleetd listening")
        held: list[Conn] = []
        try:
            while len(held) < 2 * nofile:  # more than the fds the daemon has
                c = Conn(port)
                try:
                    c.send(HELLO_FRAME)
                    if len(c.sock.recv(64)) == 0:
                        break  # closed unserved: out of fds, the spare fd shed it
                except (Closed, ConnectionResetError):
                    break
                held.append(c)
            assert len(held) < 2 * nofile, "never ran out of fds"
        finally:
            for c in held:
                c.close()
        deadline = time.monotonic() + BOUND_S
        while True:
            try:
                fresh = Conn(port)
                hello(fresh)
                fresh.close()
                break
            except (Closed, AssertionError, OSError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=BOUND_S)
    log_text = log_path.read_text()
    assert log_text.count("backing off") == 1, log_text
    assert "Traceback" not in log_text, log_text


def _connectable(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


# -- 5. handles and stored graphs ----------------------------------------------------------------


def test_handles_and_bases_are_random():
    registry = BufferRegistry()
    bufs = [registry.alloc(0, NumpyDevice(), 64, owner=1) for _ in range(16)]
    handles = [b.handle for b in bufs]
    bases = [b.base for b in bufs]
    assert len(set(handles)) == 16 and all(h and h % 16 == 0 for h in handles)
    # Sequential schemes differ by a constant; random 60-bit handles do not, and spread wide.
    assert len({b - a for a, b in zip(handles, handles[1:])}) > 1
    assert max(handles) > 1 << 48 and max(bases) > 1 << 52
    spans = sorted((b.base, b.base + b.size) for b in bufs)
    assert all(end + 4096 <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # guard pages


def test_stored_graph_into_another_sessions_freed_buffer(daemon, log_records):
    srv = daemon()
    owner, other = Conn(port_of(srv)), Conn(port_of(srv))
    hello(owner)
    hello(other)
    handle, base = alloc(owner, 64)
    a = tensor(id=1, buffer=handle, ne=(4, 1, 1, 1), data=base)
    out = tensor(
        id=2, buffer=handle, ne=(4, 1, 1, 1), data=base + 16, op=OP_ADD, src=(1, 1) + (0,) * 8, flags=COMPUTE
    )
    other.send(frame(GRAPH_COMPUTE, struct.pack("<IIQI", 0, 1, 2, 2) + a + out))
    other.no_response_then_probe()
    other.send(frame(GRAPH_RECOMPUTE, struct.pack("<I", 0)))  # still fine: the buffer lives
    other.no_response_then_probe()
    buf = srv.state.registry.get(handle)
    owner.send(frame(FREE_BUFFER, struct.pack("<Q", handle)))
    owner.no_response_then_probe()
    assert buf.freed
    other.send(frame(GRAPH_RECOMPUTE, struct.pack("<I", 0)))
    assert other.closed_by_daemon()
    one_warning(log_records, "GRAPH_RECOMPUTE")
    owner.close()


def test_disconnect_drops_other_sessions_stored_graphs(daemon, log_records):
    srv = daemon()
    owner, other = Conn(port_of(srv)), Conn(port_of(srv))
    hello(owner)
    hello(other)
    handle, base = alloc(owner, 64)
    a = tensor(id=1, buffer=handle, ne=(4, 1, 1, 1), data=base)
    out = tensor(
        id=2, buffer=handle, ne=(4, 1, 1, 1), data=base + 16, op=OP_ADD, src=(1, 1) + (0,) * 8, flags=COMPUTE
    )
    other.send(frame(GRAPH_COMPUTE, struct.pack("<IIQI", 0, 1, 2, 2) + a + out))
    other.no_response_then_probe()
    session = next(s for s in srv.state.live_sessions() if s.graphs)
    owner.close()
    wait_for(lambda: srv.state.registry.get(handle) is None, "owner's buffer freed")
    assert not session.graphs  # the freed buffer is no longer kept alive by the stored graph


# -- 6. peer links -------------------------------------------------------------------------------


def test_peer_links_keyed_by_resolved_address_and_capped(fleetd_server, log_records):
    src, dst = fleetd_server(), fleetd_server()
    d = Conn(port_of(dst))
    hello(d)
    dst_handle, dst_base = alloc(d, 64)
    s = Conn(port_of(src))
    hello(s)
    src_handle, src_base = alloc(s, 64)
    t_src = tensor(buffer=src_handle, ne=(4, 1, 1, 1), data=src_base)
    t_dst = tensor(buffer=dst_handle, ne=(4, 1, 1, 1), data=dst_base)
    port = port_of(dst)
    for zeros in range(20):  # 20 spellings of one destination
        endpoint = f"127.0.0.1:{'0' * zeros}{port}".encode()
        payload = t_src + t_dst + struct.pack("<QI", 16, len(endpoint)) + endpoint
        assert s.call(COPY_TENSOR_TO, payload, 1) == b"\x01"
    assert src.peer_stats.as_dict()["links_opened"] == 1
    s.close()
    d.close()


def test_peer_links_cap_closes_least_recently_used():
    class FakeLink:
        def __init__(self, addr):
            self.addr, self.closed = addr, False

        def stale(self):
            return False

        def close(self):
            self.closed = True

    links = PeerLinks(cap=2)
    a, b, c = FakeLink(("10.0.0.1", 1)), FakeLink(("10.0.0.2", 1)), FakeLink(("10.0.0.3", 1))
    links.put(a)
    links.put(b)
    assert links.get(a.addr) is a  # a is now the most recently used
    links.put(c)
    assert len(links) == 2 and b.closed and not a.closed
    links.close()
    assert a.closed and c.closed


# -- 8. log lines and the control API ------------------------------------------------------------


def test_client_strings_are_escaped_in_log_lines(daemon, log_records):
    srv = daemon()
    c = Conn(port_of(srv))
    hello(c)
    handle, base = alloc(c, 64)
    forged = b"x\n2026-01-01 fleetd CRITICAL forged\x1b[31m"
    c.send(frame(INIT_TENSOR, tensor(buffer=handle, ne=(64, 1, 1, 1), data=base, name=forged)))
    assert c.closed_by_daemon()
    line = one_warning(log_records, "INIT_TENSOR")
    assert "\\n2026" in line and "\\x1b" in line and "\x1b" not in line


@pytest.fixture
def control(fleetd_server):
    srv = fleetd_server(control_port=0)
    return srv


def raw_http(port: int, request: bytes) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND_S) as sock:
        sock.sendall(request)
        head = sock.recv(4096)
    return int(head.split()[1])


def test_control_api_bad_inputs_are_4xx(control, log_records):
    port = control.control.port
    nested = b"[" * 100000 + b"]" * 100000
    assert raw_http(
        port,
        b"PUT /v1/p2p HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: "
        + str(len(nested)).encode()
        + b"\r\n\r\n"
        + nested,
    ) in (400, 413)
    small_nested = b"[" * 2000 + b"]" * 2000  # under the body limit, over the parser's depth
    assert (
        raw_http(
            port,
            b"PUT /v1/p2p HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: "
            + str(len(small_nested)).encode()
            + b"\r\n\r\n"
            + small_nested,
        )
        == 400
    )
    assert (
        raw_http(port, "PUT /v1/p2p HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: ²\r\n\r\n".encode()) == 400
    )
    assert (
        raw_http(port, f"GET /v1/status HTTP/1.1\r\nHost: 127.0.0.1:{port}, evil.com\r\n\r\n".encode()) == 403
    )
    assert raw_http(port, b"GET /v1/status HTTP/1.1\r\nHost: localhost.evil.com\r\n\r\n") == 403
    assert raw_http(port, f"GET /v1/status HTTP/1.1\r\nHost: localhost:{port}\r\n\r\n".encode()) == 200


def test_control_api_client_timeout_is_one_line(control, log_records, monkeypatch):
    from fleetd.server import control as control_module

    monkeypatch.setattr(control_module._Handler, "timeout", 0.3)
    port = control.control.port
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND_S) as sock:
        sock.sendall(b"PUT /v1/p2p HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{")
        reply = sock.recv(4096)  # the daemon gives up on the body and closes
    wait_for(lambda: any("too slow" in m for m in log_records.lines()), "the timeout logged")
    assert reply == b"" or reply.startswith(b"HTTP/1.1 ")


# -- config --------------------------------------------------------------------------------------


def test_limits_from_flags_and_config(tmp_path):
    from fleetd.server.main import _fleetd_parser, resolve_settings

    cfg = tmp_path / "fleetd.toml"
    cfg.write_text('[limits]\nmax_memory = "2G"\nmax_connections = 32\n')
    args = _fleetd_parser().parse_args(
        [
            "--config",
            str(cfg),
            "--max-connections",
            "8",
            "--idle-timeout",
            "60",
            "--allow",
            "10.0.0.0/8,127.0.0.1",
        ]
    )
    settings = resolve_settings(args)
    assert settings["limits"] == ServerLimits(max_memory=2 << 30, max_connections=8, idle_timeout=60.0)
    assert settings["allow"] == ["10.0.0.0/8", "127.0.0.1"]
    cfg.write_text("[limits]\nmax_conections = 1\n")
    with pytest.raises(ValueError, match="unknown key 'max_conections'"):
        resolve_settings(_fleetd_parser().parse_args(["--config", str(cfg)]))
    with pytest.raises(ValueError, match="not a number"):
        resolve_settings(_fleetd_parser().parse_args(["--max-memory", "lots"]))


def test_receive_budget_refuses_growth_past_its_limit_only():
    from fleetd.server.state import ReceiveBudget

    budget = ReceiveBudget(1000)
    assert budget.charge(0, 600) and budget.charge(0, 400)
    assert not budget.charge(0, 1) and budget.held == 1000  # refused: nothing charged
    assert budget.charge(600, 100) and budget.held == 500  # shrinking always succeeds
    assert budget.charge(100, 0) and budget.charge(400, 0) and budget.held == 0


def test_client_allow_list_defaults():
    from fleetd.server.daemon import ClientPolicy

    loopback = ClientPolicy(None, "127.0.0.1")
    assert loopback.allows(None, "127.0.0.1") and loopback.allows(None, "::ffff:127.0.0.1")
    assert not loopback.allows(None, "192.168.7.200")
    fleet = ClientPolicy(None, "192.168.7.10")  # loopback plus the bound subnet
    assert fleet.allows(None, "127.0.0.1") and fleet.allows(None, "192.168.7.200")
    assert not fleet.allows(None, "192.168.8.1") and not fleet.allows(None, "8.8.8.8")
    explicit = ClientPolicy(["10.0.0.0/8"], "127.0.0.1")
    assert explicit.allows(None, "10.1.2.3") and not explicit.allows(None, "127.0.0.1")
    with pytest.raises(ValueError, match="--allow"):
        ClientPolicy(["no.such.host.invalid"], "127.0.0.1")


def test_sessions_probe_vanished_hosts_with_keepalive(daemon):
    srv = daemon()
    c = Conn(port_of(srv))
    hello(c)
    (session,) = srv.state.live_sessions()
    assert session.sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    assert session.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 60
    c.close()
