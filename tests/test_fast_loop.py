"""A decode step in C end to end: the session's fast loop (fastpath.c's fleetd_fast_loop) serves
SET_TENSOR, GET_TENSOR and the stored graph's GRAPH_RECOMPUTE, and the worker answers the RUN in
worker_loop.c; every way out of those loops (a row id out of range, a worker killed or stopped,
a client gone, a buffer freed, a second session computing) ends as the Python path ends."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

import numpy as np
import pytest
from helpers import connection_closed, endpoint, frame, wait_until
from test_fast_path import frame_set
from test_workers import Bystander, Slab, cpu_ticks, gone, long_graph, start, worker_pid_of_new_session

from fleetd.client.rpc import RpcClient
from fleetd.compute import native
from fleetd.server import fast_path
from fleetd.wire import Cmd, GgmlOp, GgmlType

F32, I32 = GgmlType.F32, GgmlType.I32
pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        native.fast_loop() is None or native.worker_loop() is None, reason="no libfleetd-native"
    ),
]


@pytest.fixture(autouse=True)
def patient_loop(monkeypatch):
    """C keeps waiting for the next request: on a loaded machine a client may pause past the
    20 ms after which the session's own recv (and so Python) would serve it, which these tests
    would read as a step C did not serve."""
    monkeypatch.setattr(fast_path, "LOOP_WAIT_MS", 60_000)


def served_so_far(s, gets: int) -> int:
    """The session's requests served by C, once its `gets` GET_TENSORs are counted."""
    assert wait_until(lambda: s.counters_now().count[Cmd.GET_TENSOR] == gets)
    return s.fast.requests_served


@pytest.fixture(params=["stints", "daemon"])
def mode(request, monkeypatch) -> str:
    """Where the loop runs: in the session's worker, which takes the connection for stints
    (the default), or in the daemon, which hands each recompute to the worker (FLEETD_STINTS=0,
    and what a session on the direct path keeps)."""
    monkeypatch.setenv("FLEETD_STINTS", "1" if request.param == "stints" else "0")
    return request.param


def handed_over_once(s, mode: str) -> bool:
    """The recompute reached the worker through the loop: one hand-over, or (stints on and no
    other session with a worker) in a stint."""
    if mode == "stints" and s.fast.stints:
        return s.fast.handovers == 0
    return s.fast.handovers == 1


@pytest.fixture
def server(mode):
    srv = start()
    yield srv
    srv.stop()


class Decoder:
    """A stored graph shaped like a decode step: row ids pick rows of a table (GET_ROWS, its ids
    checked on the worker's private copy), plus an input the client sets every step."""

    ROWS, WIDTH = 64, 32

    def __init__(self, ep: str, seed: int = 0):
        self.client = RpcClient(ep).open()
        self.slab = Slab(self.client, 1 << 16)
        rng = np.random.default_rng(seed)
        self.table_v = rng.standard_normal((self.ROWS, self.WIDTH)).astype(np.float32)
        self.table = self.slab.place(F32, (self.WIDTH, self.ROWS))
        self.ids = self.slab.place(I32, (2,))
        self.x = self.slab.place(F32, (self.WIDTH, 2))
        self.rows = self.slab.node(GgmlOp.GET_ROWS, F32, (self.WIDTH, 2), [self.table, self.ids])
        self.out = self.slab.node(GgmlOp.ADD, F32, (self.WIDTH, 2), [self.rows, self.x])
        self.client.set_tensor(self.table.rpc(), self.table_v.tobytes())
        self.rng = rng

    def step(self, first: bool = False, ids=None) -> None:
        ids = np.asarray(ids if ids is not None else self.rng.integers(0, self.ROWS, 2), np.int32)
        x = self.rng.standard_normal((2, self.WIDTH)).astype(np.float32)
        self.client.set_tensor(self.ids.rpc(), ids.tobytes())
        self.client.set_tensor(self.x.rpc(), x.tobytes())
        if first:
            self.client.graph_compute(self.slab.g.serialize([self.rows, self.out]))
        else:
            self.client.graph_recompute(0)
        got = np.frombuffer(self.client.get_tensor(self.out.rpc()), np.float32).reshape(2, self.WIDTH)
        np.testing.assert_array_equal(got, self.table_v[ids] + x)


def session_of(srv, client: RpcClient):
    port = client.sock.getsockname()[1]
    for s in srv.state.sessions.live():
        if s.peer.endswith(f":{port}"):
            return s
    raise AssertionError("session not found")


def test_decode_steps_are_served_in_c_and_counted(server):
    d = Decoder(endpoint(server))
    d.step(first=True)
    s = session_of(server, d.client)
    before = served_so_far(s, 1)
    for _ in range(200):
        d.step()
    # every SET, GET and GRAPH_RECOMPUTE of the 200 steps was served by C (Python does not
    # count its own in requests_served)
    assert served_so_far(s, 201) - before == 200 * 4
    # the counters as the control API reads them while the loop is still in C
    now = s.counters_now()
    assert now.count[Cmd.GRAPH_RECOMPUTE] == 200
    assert now.request_bytes[Cmd.GRAPH_RECOMPUTE] == 200 * 13
    assert now.graph_computes == 201 and now.compute_seconds > 0
    from fleetd.server.control import stats_doc

    total = stats_doc(server.state, 0.0)["total"]
    assert total["commands"]["GRAPH_RECOMPUTE"]["count"] == 200 and total["graph_computes"] == 201
    server.state.reset_stats()  # zeroes what C counted too
    assert s.counters_now().count[Cmd.GRAPH_RECOMPUTE] == 0
    d.step()
    assert wait_until(lambda: s.counters_now().count[Cmd.GRAPH_RECOMPUTE] == 1)
    d.client.close()


def test_a_decode_stream_stays_in_c_and_the_session_says_so_at_debug(server, caplog):
    d = Decoder(endpoint(server))
    d.step(first=True)
    s = session_of(server, d.client)
    served_so_far(s, 1)
    back = s.fast.loop_answers[native.LOOP_PYTHON]
    for _ in range(200):
        d.step()
    served_so_far(s, 201)
    # the steady state never gives the connection back: were it once a step, this is 200
    assert s.fast.loop_answers[native.LOOP_PYTHON] - back <= 2
    caplog.set_level(logging.DEBUG, logger="fleetd.session")
    d.client.close()
    line = f"session {s.id}: "
    assert wait_until(
        lambda: any(line in r.getMessage() and "served in C" in r.getMessage() for r in caplog.records)
    )
    (text,) = [
        r.getMessage() for r in caplog.records if line in r.getMessage() and "served in C" in r.getMessage()
    ]
    # (the hang-up itself may land in C or, between two budgets of the loop, in Python)
    assert f"{s.fast.requests_served} requests served in C" in text and "loop gave back: " in text


def test_get_alignment_is_answered_in_c_and_counted_and_a_bad_device_closes(server):
    """GET_ALIGNMENT (a client's sync) is answered by the loop with the device's own value,
    counted as Python counts it; a device out of range is Python's, which closes only that
    connection."""
    c = RpcClient(endpoint(server)).open()
    s = session_of(server, c)
    before = s.fast.requests_served
    answers = {c.get_alignment(0) for _ in range(50)}
    assert answers == {server.state.devices[0].alignment}
    assert s.fast.requests_served - before == 50  # C's, not the interpreter's
    assert wait_until(lambda: s.counters_now().count[Cmd.GET_ALIGNMENT] == 50)
    assert s.counters_now().request_bytes[Cmd.GET_ALIGNMENT] == 50 * 13
    assert s.counters_now().response_bytes[Cmd.GET_ALIGNMENT] == 50 * 16
    c.send_raw(bytes([Cmd.GET_ALIGNMENT]) + (4).to_bytes(8, "little") + (7).to_bytes(4, "little"))
    assert connection_closed(c.sock, 30)
    other = RpcClient(endpoint(server)).open()  # the daemon carries on
    assert other.get_alignment(0) == server.state.devices[0].alignment
    other.close()


def test_replies_of_requests_sent_together_come_whole_and_in_order(server):
    """The loop gathers the replies of requests that came in one piece and sends them at once:
    small ones copied (a SET behind a GET does not change the GET's answer), a large one sent
    behind those gathered before it; every answer whole and in request order."""
    from test_fast_path import frame_get

    client = RpcClient(endpoint(server)).open()
    slab = Slab(client, 1 << 17)
    small, large = slab.place(F32, (256,)), slab.place(F32, (8192,))  # 1 KiB, 32 KiB
    old = np.arange(256, dtype=np.float32).tobytes()
    new = (np.arange(256, dtype=np.float32) + 7).tobytes()
    big = np.arange(8192, dtype=np.float32).tobytes()
    client.set_tensor(small.rpc(), old)
    client.set_tensor(large.rpc(), big)
    assert client.get_alignment(0)  # the session is in its loop
    s = session_of(server, client)
    before = s.fast.requests_served
    align = frame(Cmd.GET_ALIGNMENT, (0).to_bytes(4, "little"))
    burst = (
        frame_get(small.rpc(), 0, 1024)
        + frame_get(large.rpc(), 0, 32768)
        + align
        + frame_get(small.rpc(), 0, 1024)
        + frame_set(small.rpc(), 0, new)
        + frame_get(small.rpc(), 0, 1024)
        + frame_get(large.rpc(), 4, 8)
    )
    client.send_raw(burst)
    want = [old, big, server.state.devices[0].alignment.to_bytes(8, "little"), old, new, big[4:12]]
    sock = client.sock
    for i, body in enumerate(want):
        got = bytearray()
        while len(got) < 8 + len(body):
            chunk = sock.recv(8 + len(body) - len(got))
            assert chunk, f"closed before answer {i}"
            got += chunk
        assert int.from_bytes(got[:8], "little") == len(body), i
        assert bytes(got[8:]) == body, i
    assert s.fast.requests_served - before == 7  # the loop's, not the interpreter's
    client.close()


def test_after_an_idle_wait_a_stream_of_gets_goes_back_to_the_loop(server, monkeypatch):
    """The loop gives the connection to Python after LOOP_WAIT_MS without a byte; the request
    that ends the wait is Python's to read, and the ones after it are the loop's again, also
    when none of them is a command Python handles itself (a stream of GET_TENSORs, as
    benchmarks/transfer.py sends: all of them went through Python's recv, 0.66-0.86x the stock
    server at 4-64 KiB)."""
    monkeypatch.setattr(fast_path, "LOOP_WAIT_MS", 5)
    client = RpcClient(endpoint(server)).open()
    slab = Slab(client, 1 << 16)
    t = slab.place(F32, (1024,))
    client.set_tensor(t.rpc(), np.arange(1024, dtype=np.float32).tobytes())
    s = session_of(server, client)
    for gap in range(3):
        time.sleep(0.05)  # the loop's wait runs out: Python waits in its own recv
        before = s.fast.buffer_serves
        for _ in range(100):
            assert client.get_tensor(t.rpc())[:8] == np.arange(2, dtype=np.float32).tobytes()
        # the first GET after the gap is served from Python's buffer, the rest by the loop
        # (one more where the loop's 5 ms ran out between two of them on a loaded machine)
        assert s.fast.buffer_serves - before <= 10, (gap, s.fast.buffer_serves - before)
    client.close()


def test_a_set_larger_than_the_loop_buffer_is_streamed_into_its_tensor_in_c(server):
    # a 64 KiB hidden state and up: the fixed part checked in C, the data read straight into the
    # tensor (its bytes in place, counted, the buffer's write generation bumped)
    client = RpcClient(endpoint(server)).open()
    slab = Slab(client, 8 << 20)
    rng = np.random.default_rng(7)
    small = slab.place(F32, (16,))
    client.set_tensor(small.rpc(), np.zeros(16, np.float32).tobytes())
    client.get_tensor(small.rpc())
    s = session_of(server, client)
    buf = server.state.registry.get(slab.handle)
    sizes = (64 * 1024, 64 * 1024 + 4, 1 << 20, 3 << 20)
    tensors = [slab.place(F32, (n // 4,)) for n in sizes]
    before, generation = served_so_far(s, 1), buf.generation
    values = []
    for t, n in zip(tensors, sizes):
        v = rng.standard_normal(n // 4).astype(np.float32)
        client.set_tensor(t.rpc(), v.tobytes())
        values.append(v)
    for t, v in zip(tensors, values):
        np.testing.assert_array_equal(np.frombuffer(client.get_tensor(t.rpc()), np.float32), v)
    # every SET and GET served by C; the counters hold the SETs' bytes
    assert served_so_far(s, 1 + len(sizes)) - before == 2 * len(sizes)
    now = s.counters_now()
    assert now.count[Cmd.SET_TENSOR] == 1 + len(sizes)
    assert now.request_bytes[Cmd.SET_TENSOR] == sum(9 + 305 + n for n in (64, *sizes))
    client.close()  # the loop returns and folds what it wrote into the write generation
    assert wait_until(lambda: buf.generation > generation)


def test_a_hidden_state_still_arriving_goes_straight_into_its_tensor(server):
    # a 16 KiB SET whose bytes come in pieces (a shaped link): C reads the rest into the tensor,
    # not through its buffer, and the request behind it is served as before
    client = RpcClient(endpoint(server)).open()
    slab = Slab(client, 1 << 20)
    small = slab.place(F32, (16,))
    client.set_tensor(small.rpc(), np.zeros(16, np.float32).tobytes())
    client.get_tensor(small.rpc())
    s = session_of(server, client)
    before = served_so_far(s, 1)
    hidden = slab.place(F32, (4096,))
    value = np.random.default_rng(3).standard_normal(4096).astype(np.float32)
    request = frame_set(hidden.rpc(), 0, value.tobytes())
    for at in range(0, len(request), 5000):  # the fixed part, then the data, in four pieces
        client.send_raw(request[at : at + 5000])
        time.sleep(0.02)
    np.testing.assert_array_equal(np.frombuffer(client.get_tensor(hidden.rpc()), np.float32), value)
    assert served_so_far(s, 2) - before == 2  # the SET and the GET, both in C
    assert s.fast.loop_answers[native.LOOP_BODY] == 0
    # cut in the middle of the data: only that connection ends, with the tensor's rule
    client.send_raw(request[: len(request) // 2])
    client.sock.shutdown(socket.SHUT_WR)
    assert connection_closed(client.sock)
    assert s.fast.loop_answers[native.LOOP_BODY] == 1  # cut while C streamed it into the tensor
    other = RpcClient(endpoint(server)).open()
    assert other.get_alignment(0) > 0
    other.close()


def test_a_row_id_out_of_range_in_a_recompute_closes_only_its_session(server, caplog):
    ep = endpoint(server)
    bystander = Bystander(ep, 1)
    want = bystander.compute_and_check()
    d = Decoder(ep)
    d.step(first=True)
    for _ in range(5):
        d.step()
    with caplog.at_level(logging.WARNING, logger="fleetd"):
        d.client.set_tensor(d.ids.rpc(), np.array([3, Decoder.ROWS], np.int32).tobytes())
        d.client.graph_recompute(0)
        assert connection_closed(d.client.sock, 30)
    assert any("holds a row outside [0, 64)" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]
    assert bystander.compute_and_check() == want
    bystander.client.close()
    d.client.close()


def test_a_negative_int64_row_id_is_refused_in_c_too(server):
    # GET_ROWS takes I32 ids; SET_ROWS's may be I64: the C check reads both widths
    d = Decoder(server_ep := endpoint(server))
    d.step(first=True)
    d.step()
    c = RpcClient(server_ep).open()
    slab = Slab(c, 1 << 16)
    dst = slab.place(F32, (8, 16))
    src = slab.place(F32, (8, 2))
    ids = slab.place(GgmlType.I64, (2,))
    out = slab.node(GgmlOp.SET_ROWS, F32, (8, 16), [src, ids])
    out.view_src = dst
    c.set_tensor(src.rpc(), np.ones((2, 8), np.float32).tobytes())
    c.set_tensor(ids.rpc(), np.array([0, 15], np.int64).tobytes())
    c.graph_compute(slab.g.serialize([out]))
    c.get_tensor(dst.rpc())
    c.graph_recompute(0)
    c.get_tensor(dst.rpc())
    c.set_tensor(ids.rpc(), np.array([0, -1], np.int64).tobytes())
    c.graph_recompute(0)
    assert connection_closed(c.sock, 30)
    d.step()  # the other session goes on
    c.close()
    d.client.close()


def test_a_worker_killed_during_a_recompute_in_c_costs_only_its_session(server, mode, caplog):
    ep = endpoint(server)
    pool = server.state.devices[0].workers
    bystander = Bystander(ep, 2)  # its buffer set; it computes after the death (with stints on,
    want = bystander.slab.whole()  # a session of its own computing would keep the other's off)
    c = RpcClient(ep).open()
    slab = Slab(c, 8 << 20)
    known = set(pool.worker_pids().values())
    c.graph_compute(long_graph(slab, 1000))
    c.get_alignment()  # answered once the first compute is done
    pid = worker_pid_of_new_session(server, known)
    s = session_of(server, c)
    ticks = cpu_ticks(pid)
    c.graph_recompute(0)  # seconds of MUL_MATs, handed over in C
    assert wait_until(lambda: cpu_ticks(pid) >= ticks + 3, 30), "the recompute never started"
    os.kill(pid, signal.SIGSEGV)
    assert connection_closed(c.sock, 30)
    assert gone(pid)
    assert wait_until(lambda: pool.deaths == 1)
    assert handed_over_once(s, mode)  # C handed the recompute over, Python read the death
    assert bystander.slab.whole() == want
    bystander.compute_and_check()
    closed = [r.getMessage() for r in caplog.records if "graph failed, closed" in r.getMessage()]
    assert len(closed) == 1 and "killed by SIGSEGV" in closed[0], closed
    c.close()
    bystander.client.close()


def decoding_with_a_stopped_worker(srv):
    """A decoder two steps in and its session, whose worker is then SIGSTOPped: the next RUN
    is never answered. (decoder, session, worker pid)"""
    d = Decoder(endpoint(srv))
    d.step(first=True)
    d.step()
    s = session_of(srv, d.client)
    pid = srv.state.devices[0].workers.worker_pids()[s.id]
    os.kill(pid, signal.SIGSTOP)
    return d, s, pid


def test_a_stopped_worker_meets_the_deadline_during_a_recompute_in_c(mode):
    srv = start(graph_timeout=1.0)
    try:
        ep = endpoint(srv)
        pool = srv.state.devices[0].workers
        d, s, pid = decoding_with_a_stopped_worker(srv)
        t0 = time.monotonic()
        d.client.set_tensor(d.ids.rpc(), np.array([1, 2], np.int32).tobytes())
        d.client.graph_recompute(0)
        assert connection_closed(d.client.sock, 30)
        assert time.monotonic() - t0 < 20
        assert gone(pid)
        assert pool.deaths == 1 and handed_over_once(s, mode)
        b = Bystander(ep, 3)
        b.compute_and_check()
        b.client.close()
        d.client.close()
    finally:
        srv.stop()


def test_a_client_that_hangs_up_during_a_recompute_in_c_cancels_it(server, mode):
    ep = endpoint(server)
    pool = server.state.devices[0].workers
    d, s, pid = decoding_with_a_stopped_worker(server)
    d.client.graph_recompute(0)
    time.sleep(0.2)
    d.client.close()
    assert gone(pid), "the worker outlived a client that had gone"
    assert handed_over_once(s, mode)
    assert wait_until(lambda: server.state.sessions.count() == 0 and pool.live() == 0, 10)
    b = Bystander(ep, 4)
    b.compute_and_check()
    b.client.close()


def test_a_free_between_recomputes_is_checked_and_the_loop_goes_on(server, mode):
    ep = endpoint(server)
    d = Decoder(ep)
    d.step(first=True)
    d.step()
    with RpcClient(ep) as other:  # a free by another session: the next recompute is rechecked
        spare, _ = other.alloc_buffer(4096)
        other.free_buffer(spare)
        other.get_alignment()  # FREE_BUFFER has no answer: this one comes after the free
    s = session_of(server, d.client)
    # Its GRAPH_RECOMPUTE rechecked in Python, the rest in C; in a stint (a graph over the
    # session's own buffers only, which no other session can free) the worker computes it.
    d.step()
    before = served_so_far(s, 3)
    assert before == 1 + 3 + 4 + (4 if mode == "stints" else 3)  # the table's SET, three steps
    for _ in range(20):
        d.step()
    assert served_so_far(s, 23) - before == 20 * 4
    d.client.free_buffer(d.slab.handle)  # the graph's own buffer: gone with the stored graph
    d.client.graph_recompute(0)
    assert connection_closed(d.client.sock, 30)
    d.client.close()


def test_two_sessions_decoding_at_once_get_their_own_results(server):
    ep = endpoint(server)
    errors: list = []

    def decode(seed: int) -> None:
        try:
            d = Decoder(ep, seed)
            d.step(first=True)
            for _ in range(300):
                d.step()
            d.client.close()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=decode, args=(seed,)) for seed in (10, 11, 12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    # a stint counts as computing until its session sees the client's close
    assert wait_until(lambda: server.state.devices[0].workers.computing.value == 0, 10)


@pytest.mark.parametrize("mode", ["stints"], indirect=True)
def test_a_stint_ends_when_another_session_starts_computing_not_at_its_budget(server, monkeypatch):
    # A budget no test waits for: only the other session's ask can end the stint here.
    monkeypatch.setattr(fast_path, "STINT_BUDGET_MS", 600_000)
    ep = endpoint(server)
    a = Decoder(ep, 20)
    a.step(first=True)
    for _ in range(3):
        a.step()
    s = session_of(server, a.client)
    assert s.fast.stints == 1 and s.fast.handovers == 0
    pool = server.state.devices[0].workers
    b = Decoder(ep, 21)
    b.step(first=True)  # computes beside the stint, with its share of the threads, and asks
    assert s.fast.loop_answers[native.LOOP_BUDGET] == 0  # the stint waits in its recv
    a.step()  # served in the stint; then, between requests, it sees the ask and ends
    assert wait_until(lambda: s.fast.loop_answers[native.LOOP_BUDGET] == 1, 30)
    for _ in range(3):  # two sessions with workers: no new stint, the daemon's loop serves
        a.step()
        b.step()
    assert s.fast.stints == 1 and s.counters_now().count[Cmd.GRAPH_RECOMPUTE] == 7
    assert not pool._stinting
    b.client.close()
    a.client.close()
    assert wait_until(lambda: pool.computing.value == 0, 10)


def test_the_c_row_id_check_agrees_with_the_python_one():
    """worker_loop.c's check against WorkerPlan.run's (numpy over the strided view), on seeded
    random index tensors: widths, shapes with size-1 and empty dims, padded and permuted
    strides, values on both sides of the bound."""
    import ctypes

    from fleetd.compute.ggml.worker import INDEX_DTYPES

    check = native.load().fleetd_index_check_passes
    check.argtypes, check.restype = [ctypes.c_void_p], ctypes.c_int
    rng = np.random.default_rng(17)
    disagreements, refused = [], 0
    for case in range(3000):
        typ = int(rng.choice([26, 27]))  # I32, I64
        dtype = INDEX_DTYPES[typ]
        ne = [int(rng.integers(0, 5)) if rng.random() < 0.1 else int(rng.integers(1, 5)) for _ in range(4)]
        order = rng.permutation(4) if rng.random() < 0.3 else np.arange(4)
        nb, step = [0] * 4, dtype.itemsize
        for d in order:  # each dim's stride past the ones inside it, sometimes with a gap
            nb[d] = step
            step *= ne[d] if ne[d] else 1
            step += dtype.itemsize * int(rng.integers(0, 3)) if rng.random() < 0.3 else 0
        nbytes = dtype.itemsize + sum((n - 1) * b for n, b in zip(ne, nb)) if all(ne) else 0  # ggml_nbytes
        bound = int(rng.integers(1, 100))
        lo, hi = (-2, bound + 2) if rng.random() < 0.5 else (0, bound)
        source = rng.integers(lo, hi, max(1, nbytes // dtype.itemsize + 1)).astype(dtype).view(np.uint8)
        source = np.ascontiguousarray(source[:nbytes])
        copy = np.zeros(max(nbytes, 1), np.uint8)
        view = np.ndarray(ne[::-1], dtype, buffer=source, strides=nb[::-1]) if nbytes else np.zeros(0)
        python_ok = not view.size or (int(view.min()) >= 0 and int(view.max()) < bound)
        c = native.WorkerIndexCheck(
            source.ctypes.data, copy.ctypes.data, nbytes, tuple(ne), tuple(nb), bound, dtype.itemsize
        )
        c_ok = bool(check(ctypes.byref(c)))
        refused += not c_ok
        if c_ok != python_ok:
            disagreements.append((case, typ, ne, nb, bound))
    assert not disagreements, disagreements[:5]
    assert 300 < refused < 2700  # both answers were exercised


def test_a_stored_graph_without_nodes_leaves_the_connection_with_the_daemon(server, mode):
    """Nothing for a worker to compute: a stint serves nothing, says so, and the session keeps
    its connection (and takes no more stints); every request is answered."""
    client = RpcClient(endpoint(server)).open()
    slab = Slab(client, 1 << 16)
    x = slab.place(F32, (16,))
    client.graph_compute(slab.g.serialize([]))  # no nodes: nothing the worker builds
    s = session_of(server, client)
    for _ in range(5):
        client.set_tensor(x.rpc(), np.arange(16, dtype=np.float32).tobytes())
        assert client.get_alignment() > 0
        assert np.frombuffer(client.get_tensor(x.rpc()), np.float32)[3] == 3
    if mode == "stints":
        assert wait_until(lambda: not s._stints, 10)
    client.close()
