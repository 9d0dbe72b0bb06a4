"""The asynchronous peer copy (COPY_TENSOR_TO_ASYNC, PEER_STREAM/PUSH/WAIT/TAKE/GATE/RESUME): real servers on
loopback in this process, fleetd's own client. Every failure the protocol names ends in a
PEER_WAIT of 0 and the source's kept bytes, never a hang and never a stale result; every wait
is bounded (the pytest timeout fails a hang)."""

from __future__ import annotations

import dataclasses
import socket
import struct
import threading

import numpy as np
import pytest
from helpers import connection_closed, endpoint, frame, needs_tool, rpc_tensor

from fleetd.client import RpcClient
from fleetd.errors import FleetdError
from fleetd.server.peer import FALLBACK_REASONS
from fleetd.transport import Timeout
from fleetd.wire import (
    Cmd,
    CopyTensorToAsync,
    Feature,
    GetTensor,
    GgmlType,
    PeerGate,
    PeerPush,
    hello_response,
)

pytestmark = pytest.mark.timeout(60)

BOUNDED = Timeout(connect=5.0, read=30.0)
N = 256  # f32 elements per tensor
NB = 4 * N


def f32(ptr: int, base: int, offset: int = 0):
    return rpc_tensor(GgmlType.F32, (N,), buffer=ptr, data=base + offset)


def values(seed: int) -> bytes:
    return (np.arange(N, dtype=np.float32) + 1000 * seed).tobytes()


class Pair:
    """A client's connections to a source and a destination, one tensor on each."""

    def __init__(self, src, dst) -> None:
        self.src_srv, self.dst_srv = src, dst
        self.cs = RpcClient(endpoint(src), BOUNDED).open()
        self.cd = RpcClient(endpoint(dst), BOUNDED).open()
        ps, _ = self.cs.alloc_buffer(NB)
        pd, _ = self.cd.alloc_buffer(NB)
        self.ts = f32(ps, self.cs.buffer_get_base(ps))
        self.base_d = self.cd.buffer_get_base(pd)
        self.pd = pd
        self.td = f32(pd, self.base_d)
        self.cd.set_tensor(self.td, bytes(NB))
        self.stream = self.cd.peer_stream()
        self.seq = 0

    def copy(self, data: bytes, dst=None, to: str | None = None) -> int:
        """src := data, then an asynchronous copy of it; returns its seq."""
        self.cs.set_tensor(self.ts, data)
        self.seq += 1
        target = endpoint(self.dst_srv) if to is None else to
        self.cs.copy_tensor_to_async(self.ts, dst or self.td, NB, target, self.stream, self.seq)
        return self.seq

    def close(self) -> None:
        self.cs.close()
        self.cd.close()


@pytest.fixture
def pair(fleetd_server):
    made = []

    def make(src_kw=None, dst_kw=None) -> Pair:
        p = Pair(fleetd_server(**(src_kw or {})), fleetd_server(**(dst_kw or {})))
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def short_waits(srv, seconds: float = 0.5) -> None:
    """The destination gives up on a copy that has not started arriving after `seconds`."""
    srv.state.peer_timeouts = dataclasses.replace(srv.state.peer_timeouts, wait=seconds)


def native_staging() -> bool:
    from fleetd.compute import native

    return native.peer_stage() is not None


def held(*servers) -> list[int]:
    return [s.state.peer_memory.held for s in servers]


def test_hello_advertises_the_three_bits_and_p2p_off_clears_them(fleetd_server):
    srv = fleetd_server()
    with RpcClient(endpoint(srv), BOUNDED) as c:
        assert c.features == Feature.ALL
    srv.state.set_p2p(False)
    with RpcClient(endpoint(srv), BOUNDED) as c:
        assert c.features == Feature(0)


def test_the_copy_carries_the_bytes_of_its_turn_and_lands_at_the_wait(pair):
    p = pair()
    a, b = values(1), values(2)
    seq = p.copy(a)
    p.cs.set_tensor(p.ts, b)  # the source's next command overwrites src: the copy still carries a
    p.cs.sync()
    # Staged, not written: the destination's own order puts the write at PEER_WAIT.
    assert p.cd.get_tensor(p.td) == bytes(NB)
    assert p.cd.peer_wait(p.stream, seq) is True
    assert p.cd.get_tensor(p.td) == a
    assert p.cd.peer_wait(p.stream, p.copy(b)) is True
    assert p.cd.get_tensor(p.td) == b
    # the source counts a copy once it has read the destination's ack, just after the wait
    _settled(lambda: p.src_srv.state.peer_stats.as_dict()["copies_ok"] == 2)
    stats = p.src_srv.state.peer_stats.as_dict()
    assert (stats["bytes_confirmed"], stats["links_opened"]) == (2 * NB, 1)
    assert p.cs.counters.count[Cmd.COPY_TENSOR_TO_ASYNC] == 2
    _settled(lambda: held(p.src_srv, p.dst_srv) == [0, 0])  # the source lets go once the ack is read


def test_copies_from_two_sources_apply_in_the_clients_order(fleetd_server):
    """Pushes may arrive in any order; each is written at its own PEER_WAIT, so the destination
    tensor goes through exactly the client's sequence."""
    s1, s2, dst = fleetd_server(), fleetd_server(), fleetd_server()
    with (
        RpcClient(endpoint(s1), BOUNDED) as c1,
        RpcClient(endpoint(s2), BOUNDED) as c2,
        RpcClient(endpoint(dst), BOUNDED) as cd,
    ):
        srcs = []
        for c in (c1, c2):
            ptr, _ = c.alloc_buffer(NB)
            srcs.append(f32(ptr, c.buffer_get_base(ptr)))
        pd, _ = cd.alloc_buffer(NB)
        td = f32(pd, cd.buffer_get_base(pd))
        stream = cd.peer_stream()
        order = [(c1, srcs[0]), (c2, srcs[1])] * 4
        for seq, (c, ts) in enumerate(order, 1):
            c.set_tensor(ts, values(seq))
            c.copy_tensor_to_async(ts, td, NB, endpoint(dst), stream, seq)
        c1.sync()
        c2.sync()
        for seq in range(1, len(order) + 1):
            assert cd.peer_wait(stream, seq) is True
            assert cd.get_tensor(td) == values(seq)
    _settled(lambda: held(s1, s2, dst) == [0, 0, 0])  # the source lets go once the ack is read


def _take_and_set(p: Pair, seq: int, data: bytes) -> None:
    """The client's fallback after a PEER_WAIT of 0: the source's kept bytes, written by SET_TENSOR."""
    kept = p.cs.peer_take(p.stream, seq, NB)
    assert bytes(kept) == data  # the bytes of the copy's turn, never what src holds now
    p.cd.set_tensor(p.td, kept)
    assert p.cd.get_tensor(p.td) == data


@pytest.mark.parametrize(
    "case, reason",
    [
        ("dst_p2p_off", "refused"),  # the destination refuses the push: its wait says 0 at once
        ("src_p2p_off", "disabled"),  # the source tells the destination over its open link
        ("not_allowed", "not_allowed"),  # no link, no traffic: the wait runs out
        ("dst_unreachable", "unreachable"),  # the endpoint named is closed: the wait runs out
        ("old_destination", "refused"),  # a fleetd with the synchronous bit only
    ],
)
def test_a_failed_push_answers_the_wait_0_and_the_source_keeps_the_bytes(pair, case, reason):
    src_kw = {"peer_allow": ["10.255.0.0/16"]} if case == "not_allowed" else {}
    p = pair(src_kw=src_kw)
    short_waits(p.dst_srv)
    a, b = values(1), values(2)
    if case in ("dst_p2p_off", "src_p2p_off"):
        assert p.cd.peer_wait(p.stream, p.copy(values(0))) is True  # the link is open now
        p.src_srv.state.peer_stats.reset()
        (p.dst_srv if case == "dst_p2p_off" else p.src_srv).state.set_p2p(False)
        short_waits(p.dst_srv, 30.0)  # a lost notice would hang here (the pytest timeout fails it)
    if case == "old_destination":
        p.dst_srv.state.features = lambda: int(Feature.PEER_COPY)
    to = None
    if case == "dst_unreachable":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            to = f"127.0.0.1:{s.getsockname()[1]}"
    seq = p.copy(a, to=to)
    p.cs.set_tensor(p.ts, b)
    assert p.cd.peer_wait(p.stream, seq) is False
    assert p.cd.get_tensor(p.td) != a  # nothing written behind the client's back
    _take_and_set(p, seq, a)
    stats = p.src_srv.state.peer_stats.as_dict()
    assert stats["fallbacks"] == {r: 1 if r == reason else 0 for r in FALLBACK_REASONS}
    assert stats["copies_taken"] == 1
    _settled(lambda: held(p.src_srv, p.dst_srv) == [0, 0])  # the source lets go once the ack is read


def test_a_gate_lets_the_commands_sent_behind_it_run_on_the_copied_bytes(pair):
    """PEER_GATE: the client sends on at once; what follows the gate runs after the write."""
    p = pair()
    a = values(1)
    seq = p.copy(a)
    p.cd.peer_gate(p.stream, seq)
    # behind the gate, before its answer: a memset of the copy's second half must come after it
    p.cd.memset_tensor(p.td, NB // 2, NB // 2, 0)
    assert p.cd.gate_result() is True
    assert p.cd.get_tensor(p.td) == a[: NB // 2] + bytes(NB // 2)
    assert p.dst_srv.state.peer_stats.as_dict()["gates_failed"] == 0


def test_a_round_trip_sent_behind_a_gate_is_answered_after_the_gate(pair):
    """sync_begin/sync_end (benchmarks/p2p.py --boundary): the round trip goes out behind the
    gate, before its answer is read, and its reply comes after the gate's, the copy landed."""
    p = pair()
    a = values(2)
    seq = p.copy(a)
    p.cd.peer_gate(p.stream, seq)
    p.cd.sync_begin()
    assert p.cd.gate_result() is True
    p.cd.sync_end()
    assert p.cd.get_tensor(p.td) == a
    assert p.cd.counters.response_bytes[Cmd.GET_ALIGNMENT] > 0  # its reply was counted


@pytest.mark.parametrize("case", ["nothing_came", "src_p2p_off"])
def test_a_failed_gate_skips_what_follows_until_resume(pair, case):
    """A gate of 0: the commands behind it are skipped (a streamed SET_TENSOR's data too), so
    none runs on the old bytes; after PEER_RESUME the client writes the copy and sends them
    again, and the session carries on."""
    p = pair()
    short_waits(p.dst_srv, 0.3)
    a, later = values(1), values(7)
    if case == "src_p2p_off":
        assert p.cd.peer_wait(p.stream, p.copy(values(0))) is True  # the link is open now
        p.src_srv.state.set_p2p(False)
        short_waits(p.dst_srv, 30.0)  # the source's notice answers the gate, not the timeout
        seq = p.copy(a)
    else:
        seq = 1  # never sent: the gate runs out
    old = p.cd.get_tensor(p.td)
    p.cd.peer_gate(p.stream, seq)
    p.cd.set_tensor(p.td, later)  # skipped: it would have run on the tensor's old bytes
    p.cd.memset_tensor(p.td, 0, 4, 0xFF)  # skipped too
    assert p.cd.gate_result() is False
    p.cd.peer_resume()
    assert p.cd.get_tensor(p.td) == old  # nothing behind the gate ran
    stats = p.dst_srv.state.peer_stats.as_dict()
    assert (stats["gates_failed"], stats["commands_skipped"]) == (1, 2)
    if case == "src_p2p_off":
        _take_and_set(p, seq, a)
    p.cd.set_tensor(p.td, later)  # the client's replay: served again
    assert p.cd.get_tensor(p.td) == later
    assert p.dst_srv.state.peer_stats.as_dict()["commands_skipped"] == 2
    p.cd.peer_resume()  # a resume with nothing skipped is a no-op
    assert p.cd.get_tensor(p.td) == later


def test_a_push_that_comes_after_its_wait_gave_up_is_refused_as_late(pair):
    p = pair()
    short_waits(p.dst_srv, 0.2)
    assert p.cd.peer_wait(p.stream, 1) is False  # nothing sent yet: the wait runs out
    seq = p.copy(values(1))
    assert seq == 1
    kept = p.cs.peer_take(p.stream, seq, NB)  # settles once the destination refused the late push
    assert bytes(kept) == values(1)
    assert p.cd.get_tensor(p.td) == bytes(NB)  # the late push was never written
    assert p.src_srv.state.peer_stats.as_dict()["fallbacks"]["refused"] == 1
    _settled(lambda: held(p.src_srv, p.dst_srv) == [0, 0])  # the source lets go once the ack is read


def test_a_push_out_of_the_destination_buffer_closes_only_the_link(pair):
    p = pair()
    bad = f32(p.pd, p.base_d, offset=NB // 2)  # half of it past the buffer's end
    seq = p.copy(values(1), dst=bad)
    assert p.cd.peer_wait(p.stream, seq) is False  # told before the link closed: no wait out
    assert bytes(p.cs.peer_take(p.stream, seq, NB)) == values(1)
    assert p.src_srv.state.peer_stats.as_dict()["fallbacks"]["write_rejected"] == 1
    assert p.cd.peer_wait(p.stream, p.copy(values(2))) is True  # a new link works
    assert p.cd.get_tensor(p.td) == values(2)


def test_a_client_gone_between_copy_and_wait_leaves_nothing_held(pair):
    p = pair()
    stream = p.stream
    p.cd.close()  # the destination drops the client's stream
    p.cs.set_tensor(p.ts, values(1))
    p.cs.copy_tensor_to_async(p.ts, p.td, NB, endpoint(p.dst_srv), stream, 1)
    assert bytes(p.cs.peer_take(stream, 1, NB)) == values(1)  # refused: unknown stream
    p.cs.copy_tensor_to_async(p.ts, p.td, NB, endpoint(p.dst_srv), stream, 2)
    p.cs.close()  # and then the source's session ends with a copy kept or in flight
    _settled(lambda: held(p.src_srv, p.dst_srv) == [0, 0])


def test_a_source_gone_before_its_push_ends_the_wait_with_0(pair):
    p = pair()
    short_waits(p.dst_srv)
    p.cs.close()  # the source session ends before it ever gets the copy
    assert p.cd.peer_wait(p.stream, 1) is False
    _settled(lambda: held(p.src_srv, p.dst_srv) == [0, 0])  # the source lets go once the ack is read


def test_the_source_serves_its_next_commands_while_a_push_hangs(fleetd_server):
    """A destination that takes the push's bytes and never answers: the source's session goes on
    (its pusher is the one waiting); when that destination dies, the copy is kept."""
    src = fleetd_server()
    listener = socket.create_server(("127.0.0.1", 0))
    conns = []

    def never_answer(conn):
        conns.append(conn)
        while conn.recv(65536):  # the push, never answered
            pass

    to, t = fake_destination(listener, Feature.PEER_COPY | Feature.PEER_COPY_ASYNC, never_answer)
    with RpcClient(endpoint(src), BOUNDED) as cs:
        ps, _ = cs.alloc_buffer(NB)
        ts = f32(ps, cs.buffer_get_base(ps))
        cs.set_tensor(ts, values(1))
        cs.copy_tensor_to_async(ts, f32(0x10, 0x1000), NB, to, 7, 1)
        _settled(lambda: len(conns) == 1)
        for i in range(5):  # answered while the push waits on the destination
            cs.set_tensor(ts, values(2 + i))
            assert cs.get_tensor(ts) == values(2 + i)
        conns[0].shutdown(socket.SHUT_RDWR)
        assert bytes(cs.peer_take(7, 1, NB)) == values(1)
    listener.close()
    t.join(10)


@pytest.mark.parametrize(
    "case", ["foreign_stream", "wait_out_of_order", "repeated_seq", "lower_seq", "take_landed"]
)
def test_misuse_closes_only_that_connection(pair, fleetd_server, case):
    p = pair()
    first = p.copy(values(1))
    assert p.cd.peer_wait(p.stream, first) is True
    with pytest.raises(FleetdError):
        if case == "foreign_stream":
            with RpcClient(endpoint(p.dst_srv), BOUNDED) as other:
                other.peer_wait(p.stream, 2)  # a stream this connection does not own
        elif case == "wait_out_of_order":
            p.cd.peer_wait(p.stream, first)
        elif case == "repeated_seq":
            p.cs.copy_tensor_to_async(p.ts, p.td, NB, endpoint(p.dst_srv), p.stream, 5)
            p.cs.copy_tensor_to_async(p.ts, p.td, NB, endpoint(p.dst_srv), p.stream, 5)
            p.cs.sync()
        elif case == "lower_seq":
            p.cs.copy_tensor_to_async(p.ts, p.td, NB, endpoint(p.dst_srv), p.stream, first - 1 or 0)
            p.cs.sync()
        else:
            p.cs.peer_take(p.stream, first, NB)  # it landed: nothing is kept
    # The daemons and the other connection carry on.
    if case in ("foreign_stream",):
        assert p.cd.peer_wait(p.stream, p.copy(values(3))) is True
    elif case == "wait_out_of_order":
        with RpcClient(endpoint(p.src_srv), BOUNDED) as c:
            assert c.get_alignment() > 0
    else:
        assert p.cd.get_tensor(p.td) == values(1)


def test_malformed_async_copy_closes_the_connection(fleetd_server):
    from helpers import frame

    src = fleetd_server()
    with RpcClient(endpoint(src), BOUNDED) as c:
        t = f32(0x10, 0x1000).pack()
        c.send_raw(frame(Cmd.COPY_TENSOR_TO_ASYNC, t + t + struct.pack("<QQQI", NB, 1, 1, 99) + b"x:1"))
        with pytest.raises(FleetdError):
            c.sync()
    with RpcClient(endpoint(src), BOUNDED) as c:
        assert c.get_alignment() > 0


def test_the_destination_refuses_what_does_not_fit_its_peer_memory(pair):
    p = pair(dst_kw={})
    p.dst_srv.state.peer_memory.limit = NB - 1
    seq = p.copy(values(1))
    assert p.cd.peer_wait(p.stream, seq) is False
    _take_and_set(p, seq, values(1))
    _settled(lambda: held(p.src_srv, p.dst_srv) == [0, 0])  # the source lets go once the ack is read


@needs_tool("ggml-rpc-server")
def test_a_stock_destination_is_refused_and_the_bytes_kept(fleetd_server, stock_server):
    src = fleetd_server()
    stock = stock_server()
    with RpcClient(endpoint(src), BOUNDED) as cs:
        ps, _ = cs.alloc_buffer(NB)
        ts = f32(ps, cs.buffer_get_base(ps))
        cs.set_tensor(ts, values(1))
        cs.copy_tensor_to_async(ts, f32(0x10, 0x1000), NB, stock, 3, 1)
        assert bytes(cs.peer_take(3, 1, NB)) == values(1)
    assert src.state.peer_stats.as_dict()["fallbacks"]["refused"] == 1


def fake_destination(listener: socket.socket, features: Feature, serve) -> tuple[str, threading.Thread]:
    """A peer on `listener` for one link, in a daemon thread: accepts it, answers its HELLO with
    `features`, then serve(conn). Returns (its endpoint, the thread)."""

    def run() -> None:
        conn, _ = listener.accept()
        conn.recv(9 + 24)  # HELLO
        conn.sendall(hello_response(int(features)))
        serve(conn)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return f"127.0.0.1:{listener.getsockname()[1]}", t


def read_push(f) -> int:
    """One PEER_PUSH read whole from the link's file object: its command byte."""
    head = f.read(9)
    f.read(struct.unpack_from("<Q", head, 1)[0])
    return head[0]


STAGED = struct.pack("<QB", 1, 1)  # a PEER_PUSH's answer: staged


def _settled(check, seconds: float = 10.0, seen=None) -> None:
    """Wait (bounded) until check() holds; `seen()` says in the failure what there was instead."""
    import time

    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"not settled in {seconds:g}s" + (f": {seen()}" if seen else "")
        time.sleep(0.02)


@pytest.mark.parametrize(
    "gate, local_last", [(True, False), (False, False), (True, True)], ids=["gate", "wait", "gate-local-last"]
)
def test_a_pipeline_with_asynchronous_boundaries_matches_the_hub(
    fleetd_server, gate, local_last, monkeypatch
):
    """The layer-split coordinator over 3 servers: same outputs as the hub path, one
    COPY_TENSOR_TO_ASYNC and one PEER_GATE per remote boundary per step (PEER_WAIT where the
    servers do not advertise the gate), no fallback. With the coordinator's own device last,
    the last remote stage is read (GET_TENSOR) right behind its gate."""
    from fleetd.pipeline import Pipeline
    from fleetd.pipeline.stages import RemoteStage

    if not gate:  # a server of an older fleetd: bit 1 without bit 2
        monkeypatch.setattr(RemoteStage, "peer_gate", property(lambda stage: False))
    eps = [endpoint(fleetd_server()) for _ in range(3)]
    kw = dict(
        layers=4 if local_last else 3, rows=4, n_embd=64, timeout=BOUNDED, stats=False, local_last=local_last
    )
    with Pipeline(eps, p2p=False, **kw) as hub:
        reference = [r.md5 for r in hub.run(3)]
    with Pipeline(eps, p2p=True, async_copy=True, **kw) as p:
        results = p.run(3)
    assert [r.md5 for r in results] == reference
    wait = Cmd.PEER_GATE if gate else Cmd.PEER_WAIT
    for r in results:
        assert (r.direct, r.fallbacks) == (2, 0)
        assert r.counters.count[Cmd.COPY_TENSOR_TO_ASYNC] == 2 and r.counters.count[wait] == 2
        assert Cmd.COPY_TENSOR_TO not in r.counters.count
        assert (Cmd.PEER_WAIT if gate else Cmd.PEER_GATE) not in r.counters.count


@pytest.mark.parametrize("when", ["first_step", "later_step"])
def test_a_pipeline_redoes_the_step_on_the_hub_path_when_a_gate_fails(fleetd_server, when):
    """The middle server turns its peer copy off under a gated pipeline: its pushes are
    refused, the gates behind them answer 0 and their stages skip their graphs. The step is
    redone from that boundary on the hub path (on the first step the skipped GRAPH_COMPUTE is
    sent whole again): the same outputs as the hub, every failed gate counted, no hang."""
    from fleetd.pipeline import Pipeline

    servers = [fleetd_server() for _ in range(4)]
    for srv in servers:
        short_waits(srv, 0.5)
    eps = [endpoint(srv) for srv in servers]
    kw = dict(layers=4, rows=4, n_embd=64, timeout=BOUNDED, stats=False)
    with Pipeline(eps, p2p=False, **kw) as hub:
        reference = [r.md5 for r in hub.run(3)]
    with Pipeline(eps, p2p=True, async_copy=True, **kw) as p:
        results = [] if when == "first_step" else [p.step()]
        servers[1].state.set_p2p(False)
        results += p.run(3 - len(results))
        servers[1].state.set_p2p(True)
        results.append(p.step())  # and the gates work again
    assert [r.md5 for r in results] == reference + [results[-1].md5]
    assert results[-1].md5 != reference[-1]  # a new input: not the last step's bytes again
    off = results[1:3] if when == "later_step" else results[0:3]
    for r in off:
        assert r.direct + r.fallbacks == 3 and r.fallbacks >= 2, (r.direct, r.fallbacks)
        assert r.counters.count[Cmd.PEER_RESUME] == r.fallbacks
    assert (results[-1].direct, results[-1].fallbacks) == (3, 0)
    gates_failed = sum(srv.state.peer_stats.as_dict()["gates_failed"] for srv in servers)
    assert gates_failed == sum(r.fallbacks for r in results)


def test_a_stream_holds_a_bounded_number_of_copies_not_waited_for(pair, monkeypatch):
    from fleetd.server import peer_streams

    monkeypatch.setattr(peer_streams, "MAX_UNWAITED", 2)
    p = pair()
    short_waits(p.dst_srv)
    seqs = [p.copy(values(i)) for i in (1, 2, 3)]
    assert bytes(p.cs.peer_take(p.stream, seqs[2], NB)) == values(3)  # the third is refused
    assert [p.cd.peer_wait(p.stream, s) for s in seqs] == [True, True, False]
    assert p.cd.get_tensor(p.td) == values(2)


def test_a_copy_skipped_behind_a_failed_gate_fails_the_next_gate_at_once(fleetd_server):
    """A -> B -> C: B's gate fails, so B skips the copy B -> C queued behind it; C is told over
    the link it already has and its gate answers 0 now, not when its (long) wait runs out."""
    b_srv, c_srv = fleetd_server(), fleetd_server()
    short_waits(b_srv, 0.3)
    short_waits(c_srv, 600.0)  # a lost notice hangs: the pytest timeout fails it
    with RpcClient(endpoint(b_srv), BOUNDED) as cb, RpcClient(endpoint(c_srv), BOUNDED) as cc:
        pb, _ = cb.alloc_buffer(NB)
        pc, _ = cc.alloc_buffer(NB)
        tb, tc = f32(pb, cb.buffer_get_base(pb)), f32(pc, cc.buffer_get_base(pc))
        stream_b, stream_c = cb.peer_stream(), cc.peer_stream()
        cb.set_tensor(tb, values(1))
        cb.copy_tensor_to_async(tb, tc, NB, endpoint(c_srv), stream_c, 1)  # opens B's link to C
        assert cc.peer_wait(stream_c, 1) is True
        cb.peer_gate(stream_b, 1)  # nothing comes into B: it fails after 0.3 s
        cb.copy_tensor_to_async(tb, tc, NB, endpoint(c_srv), stream_c, 2)  # skipped by B
        cc.peer_gate(stream_c, 2)
        assert cb.gate_result() is False
        assert cc.gate_result() is False  # told by B, not timed out
        cb.peer_resume()
        cc.peer_resume()
        # the client's replay: B sends copy 2 now; C already gave up on it, so it is kept at B
        cb.copy_tensor_to_async(tb, tc, NB, endpoint(c_srv), stream_c, 2)
        assert bytes(cb.peer_take(stream_c, 2, NB)) == values(1)
        assert b_srv.state.peer_stats.as_dict()["commands_skipped"] == 1


def _live_sessions(srv) -> list:
    with srv.state.sessions._lock:
        return list(srv.state.sessions._by_id.values())


@pytest.mark.skipif(not native_staging(), reason="libfleetd-native without peer_stage.c")
def test_a_decode_stream_of_gated_copies_is_staged_and_written_in_c(pair):
    """After the first push of a stream (Python checks its destination and vouches for it), the
    destination's loops stage the pushes and answer the gates in C: the link's session and the
    client's session serve them without the interpreter, the bytes land in order, and the
    counters say every PEER_PUSH and PEER_GATE as the Python path would. The source's loop
    pushes the copies on its link itself and reads the answers as they come."""
    p = pair()
    steps = 40
    for i in range(1, steps + 1):
        seq = p.copy(values(i))
        p.cd.peer_gate(p.stream, seq)
        assert p.cd.gate_result() is True
        assert p.cd.get_tensor(p.td) == values(i)
    sessions = _live_sessions(p.dst_srv)

    def by_cmd() -> dict[int, int]:
        out: dict[int, int] = {}
        for s in sessions:
            counts = s.counters_now().count
            for cmd in (Cmd.PEER_PUSH, Cmd.PEER_GATE):
                out[cmd] = out.get(cmd, 0) + counts[cmd]
        return out

    # a push Python serves is counted when its handler returns, after its answer
    _settled(lambda: by_cmd() == {Cmd.PEER_PUSH: steps, Cmd.PEER_GATE: steps}, seen=by_cmd)
    served = {s.id: s.fast._ctx.served for s in sessions}
    pushes = sum(v.push_count for v in served.values())
    gates = sum(v.gate_count for v in served.values())
    # the first push is Python's (it vouches), and a gate that outran its push by more than the
    # loop's wait would be too: on loopback nearly all are C's
    assert pushes >= steps - 5 and gates >= steps - 5, (pushes, gates)
    # the source: after the first two (the pusher's, then one inline that makes the route), its
    # loop reads each copy and pushes it on the link itself
    copies = sum(s.fast._ctx.served.copy_count for s in _live_sessions(p.src_srv))
    assert copies >= steps - 5, copies
    # the loop's answers are counted when it returns (at the latest when it idles, 20 ms on)
    _settled(lambda: p.src_srv.state.peer_stats.as_dict()["copies_ok"] == steps)
    _settled(lambda: held(p.src_srv, p.dst_srv) == [0, 0])


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "the server closed the connection"
        out += chunk
    return bytes(out)


@pytest.mark.skipif(not native_staging(), reason="libfleetd-native without peer_stage.c")
def test_an_answer_ahead_of_a_gate_leaves_before_the_gate_waits(pair, monkeypatch):
    """The loop gathers the replies of requests that came together and sends them at once
    (a gate's and the sync behind it in one send), but never past a wait: a GET_TENSOR's reply
    ahead of a gate whose copy has not come reaches the client while the gate still waits in C
    (its wait here as long as the test), and the gate then answers 1 once the copy lands."""
    from fleetd.server import fast_path

    monkeypatch.setattr(fast_path, "LOOP_WAIT_MS", 60_000)
    p = pair()
    seq = p.copy(values(1))
    p.cd.peer_gate(p.stream, seq)  # the stream vouched, the sessions in their loops
    assert p.cd.gate_result() is True
    get = frame(Cmd.GET_TENSOR, GetTensor(p.td, 0, NB).encode())
    gate = frame(Cmd.PEER_GATE, PeerGate(p.stream, seq + 1).encode())
    sock = p.cd.sock
    sock.sendall(get + gate + frame(Cmd.GET_ALIGNMENT, struct.pack("<I", 0)))
    sock.settimeout(10.0)  # the gate waits up to 60 s: a reply held behind it times out here
    assert _recv_exactly(sock, 8 + NB) == struct.pack("<Q", NB) + values(1)
    p.copy(values(2))
    # the gate's answer and the sync's, in order
    assert _recv_exactly(sock, 9) == struct.pack("<QB", 1, 1)
    assert struct.unpack("<QQ", _recv_exactly(sock, 16))[0] == 8
    sock.settimeout(BOUNDED.read)
    assert p.cd.get_tensor(p.td) == values(2)
    gates_in_c = sum(s.fast._ctx.served.gate_count for s in _live_sessions(p.dst_srv))
    assert gates_in_c >= 1, gates_in_c


@pytest.mark.skipif(not native_staging(), reason="libfleetd-native without peer_stage.c")
def test_a_free_sends_the_next_push_back_to_python_and_its_checks(pair):
    """A vouched destination is trusted only until something is freed: after a free the next
    push is checked in Python again, so one out of bounds now closes the link as before."""
    p = pair()
    assert p.cd.peer_wait(p.stream, p.copy(values(1))) is True  # vouched
    q, _ = p.cd.alloc_buffer(NB)
    p.cd.free_buffer(q)  # any free
    bad = f32(p.pd, p.base_d, offset=NB // 2)
    seq = p.copy(values(2), dst=bad)
    assert p.cd.peer_wait(p.stream, seq) is False
    assert bytes(p.cs.peer_take(p.stream, seq, NB)) == values(2)
    assert p.src_srv.state.peer_stats.as_dict()["fallbacks"]["write_rejected"] == 1


@pytest.mark.skipif(not native_staging(), reason="libfleetd-native without peer_stage.c")
def test_a_push_refused_on_a_route_the_source_loop_holds_is_kept_for_the_take(pair):
    """The destination switches P2P off while the source's loop holds its link: the loop's
    push is refused, the gate answers 0, and PEER_TAKE gets the bytes the copy read, after
    which the next copies go through again."""
    p = pair()
    for i in range(1, 6):  # the route is made and held
        assert p.cd.peer_wait(p.stream, p.copy(values(i))) is True
    assert sum(s.fast._ctx.served.copy_count for s in _live_sessions(p.src_srv)) >= 1
    p.dst_srv.state.set_p2p(False)
    seq = p.copy(values(9))
    assert p.cd.peer_wait(p.stream, seq) is False
    assert bytes(p.cs.peer_take(p.stream, seq, NB)) == values(9)
    assert p.src_srv.state.peer_stats.as_dict()["fallbacks"]["refused"] == 1
    p.dst_srv.state.set_p2p(True)
    assert p.cd.peer_wait(p.stream, p.copy(values(10))) is True
    assert p.cd.get_tensor(p.td) == values(10)
    _settled(lambda: held(p.src_srv, p.dst_srv) == [0, 0])


@pytest.mark.skipif(not native_staging(), reason="libfleetd-native without peer_stage.c")
def test_a_destination_that_stops_reading_never_blocks_the_source_loop(fleetd_server):
    """The source's loop holds a link whose destination answers a few pushes and then stops
    reading at all (a tiny receive window): the loop never waits on that socket, so the
    session answers its client throughout; the copies that did not land are kept for
    PEER_TAKE once the destination is gone."""
    src = fleetd_server()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stop_reading, gone = threading.Event(), threading.Event()
    answered = []

    def answer_three_then_stop_reading(conn):
        f = conn.makefile("rb")
        while len(answered) < 3:
            answered.append(read_push(f))
            conn.sendall(STAGED)
        stop_reading.set()
        gone.wait(60)
        conn.close()

    to, t = fake_destination(listener, Feature.ALL, answer_three_then_stop_reading)
    big = 64 * 1024
    with RpcClient(endpoint(src), BOUNDED) as cs:
        ptr, _ = cs.alloc_buffer(big + NB)
        base = cs.buffer_get_base(ptr)
        ts = rpc_tensor(GgmlType.F32, (big // 4,), buffer=ptr, data=base)
        small = f32(ptr, base, big)
        data = bytes(range(256)) * (big // 256)
        cs.set_tensor(ts, data)
        dst = rpc_tensor(GgmlType.F32, (big // 4,), buffer=0x10, data=0x1000)
        for seq in (1, 2, 3):  # landed: the route is made and held
            cs.copy_tensor_to_async(ts, dst, big, to, 7, seq)
            _settled(lambda seq=seq: len(answered) >= seq)
        for seq in range(4, 64):  # never read: the window closes, the loop must not wait on it
            cs.copy_tensor_to_async(ts, dst, big, to, 7, seq)
            cs.set_tensor(small, values(seq))
            assert cs.get_tensor(small) == values(seq)  # within the client's 30 s read timeout
        assert stop_reading.is_set()
        listener.close()  # the destination is gone: no new link either
        gone.set()
        t.join(10)
        assert bytes(cs.peer_take(7, 63, big)) == data  # the link died with it unanswered


@pytest.mark.skipif(not native_staging(), reason="libfleetd-native without peer_stage.c")
def test_a_route_outlives_a_quiet_client_whose_answers_come_late(fleetd_server):
    """The client pauses right after a copy whose answer the destination sends only 150 ms on:
    the source's loop idles with the push unanswered, and the session keeps holding the route
    (it waits for the answer or the client) rather than hand the link to its pusher, so the
    copies after the pause are pushed from the loop again, not queued behind a busy thread."""
    src = fleetd_server()
    listener = socket.create_server(("127.0.0.1", 0))
    pushes = 4

    def answer_late(conn):
        f = conn.makefile("rb")
        for _ in range(pushes):
            read_push(f)
            threading.Event().wait(0.15)
            conn.sendall(STAGED)
        f.read(1)  # until the source closes the link
        conn.close()

    to, t = fake_destination(listener, Feature.ALL, answer_late)
    with RpcClient(endpoint(src), BOUNDED) as cs:
        ptr, _ = cs.alloc_buffer(NB)
        ts = f32(ptr, cs.buffer_get_base(ptr))
        cs.set_tensor(ts, values(1))
        dst = f32(0x10, 0x1000)
        cs.copy_tensor_to_async(ts, dst, NB, to, 7, 1)  # the pusher's: it opens the link
        _settled(lambda: src.state.peer_stats.as_dict()["copies_ok"] == 1)
        cs.copy_tensor_to_async(ts, dst, NB, to, 7, 2)  # the route's first, from Python
        threading.Event().wait(0.05)  # quiet: the loop idles with copy 2 unanswered
        cs.copy_tensor_to_async(ts, dst, NB, to, 7, 3)  # read by Python after the idle
        assert cs.get_tensor(ts) == values(1)  # served: the loop runs again
        cs.copy_tensor_to_async(ts, dst, NB, to, 7, 4)  # the loop's
        assert cs.get_tensor(ts) == values(1)  # the loop has read copy 4
        assert sum(s.fast._ctx.served.copy_count for s in _live_sessions(src)) >= 1
        _settled(lambda: src.state.peer_stats.as_dict()["copies_ok"] == pushes)
    listener.close()
    t.join(10)
    assert not t.is_alive()


def _mutated(rng, raw: bytes, fixed: int) -> bytes:
    """`raw` (a whole request: header and payload) with a few of its first `fixed` payload
    bytes or its size field set to hostile values, the fields C reads before it decides; one
    in four also cut short."""
    b = bytearray(raw)
    for _ in range(int(rng.integers(1, 4))):
        kind = int(rng.integers(0, 3))
        if kind == 0:  # one byte of the fixed part
            b[9 + int(rng.integers(0, fixed))] = int(rng.integers(0, 256))
        elif kind == 1:  # a u64 of the fixed part: 0, huge, or anything
            at = 9 + 8 * int(rng.integers(0, fixed // 8))
            value = [0, 1, 2**63, 2**64 - 1, int(rng.integers(0, 2**32))][int(rng.integers(0, 5))]
            b[at : at + 8] = struct.pack("<Q", value)
        else:  # the request's size field, shorter than what follows
            size = struct.unpack_from("<Q", b, 1)[0]
            b[1:9] = struct.pack("<Q", max(0, size - int(rng.integers(1, 64))))
    if rng.integers(0, 4) == 0:
        b = b[: int(rng.integers(9, len(b)))]
    return bytes(b)


@pytest.mark.skipif(not native_staging(), reason="libfleetd-native without peer_stage.c")
def test_hostile_copy_push_and_gate_requests_close_only_their_connection(pair):
    """Seeded mutations of the three requests the loops now serve in C, each where C would take
    it: COPY_TENSOR_TO_ASYNC on a source session that holds its route, PEER_PUSH to a stream
    whose destination was vouched for, PEER_GATE. Every one is served or closes that connection
    only; the daemons live and a pair of sessions copies correctly after each batch."""
    p = pair()
    rng = np.random.default_rng(20261206)
    assert p.cd.peer_wait(p.stream, p.copy(values(1))) is True  # vouched
    to = endpoint(p.dst_srv)

    def hostile(srv, client, raw: bytes, fixed: int) -> None:
        sock = client.channel.stream.socket
        try:
            client.send_raw(_mutated(rng, raw, fixed))
            sock.shutdown(socket.SHUT_WR)  # a cut request ends here
            connection_closed(sock, timeout=15.0)
        except OSError:
            pass  # closed under us: that connection only

    (first_id,) = [s.id for s in _live_sessions(p.src_srv)]
    in_c = 0
    for i in range(30):  # the source: a session whose loop holds its route
        with RpcClient(endpoint(p.src_srv), BOUNDED) as cs:
            ptr, _ = cs.alloc_buffer(NB)
            ts = f32(ptr, cs.buffer_get_base(ptr))
            cs.set_tensor(ts, values(i))
            stream = p.cd.peer_stream()
            for seq in range(1, 7):  # the pusher's, one inline (the route), then the loop's
                cs.copy_tensor_to_async(ts, p.td, NB, to, stream, seq)
                assert p.cd.peer_wait(stream, seq) is True
            (mine,) = [s for s in _live_sessions(p.src_srv) if s.id != first_id]
            in_c += mine.fast._ctx.served.copy_count
            raw = frame(Cmd.COPY_TENSOR_TO_ASYNC, CopyTensorToAsync(ts, p.td, NB, stream, 7, to).encode())
            hostile(p.src_srv, cs, raw, 2 * 296 + 28)
            _settled(lambda: len(_live_sessions(p.src_srv)) == 1)
    push = frame(Cmd.PEER_PUSH, PeerPush(p.stream, 1000, p.td, NB).encode() + values(3))
    gate = frame(Cmd.PEER_GATE, PeerGate(p.stream, 1000).encode())
    for raw, fixed in ((push, 17 + 296), (gate, 16)):
        for _ in range(30):
            with RpcClient(endpoint(p.dst_srv), BOUNDED) as c:
                hostile(p.dst_srv, c, raw, fixed)
    seq = p.copy(values(10))
    assert p.cd.peer_wait(p.stream, seq) is True
    assert p.cd.get_tensor(p.td) == values(10)
    assert in_c > 0  # the loops served copies of those sessions: the path the mutations hit


def test_pairs_copying_while_p2p_flips_land_every_copy_and_leave_nothing_held(fleetd_server):
    """Four client pairs copy and gate (or wait) at once, each for a bounded number of steps,
    while P2P flips on the destination (and now and then the source): every copy lands, by
    the direct path or, after a 0, by PEER_TAKE and SET_TENSOR, with the bytes of its turn; the
    daemons hold no peer-copy bytes afterwards and no thread or descriptor is left."""
    import os
    import random
    import time

    src, dst = fleetd_server(), fleetd_server()
    before = (threading.active_count(), len(os.listdir("/proc/self/fd")))
    deadline = time.monotonic() + 8.0
    errors: list[str] = []
    done = {"copies": 0, "taken": 0}

    def client(k: int) -> None:
        rng = random.Random(k)
        try:
            for _ in range(20):  # sessions, each bounded in steps; all bounded by the deadline
                p = Pair(src, dst)
                try:
                    for _ in range(rng.randint(5, 100)):
                        data = values(rng.randint(0, 10**6))
                        seq = p.copy(data)
                        if rng.random() < 0.7:
                            p.cd.peer_gate(p.stream, seq)
                            landed = p.cd.gate_result()
                            if not landed:
                                p.cd.peer_resume()
                        else:
                            landed = p.cd.peer_wait(p.stream, seq)
                        if not landed:
                            _take_and_set(p, seq, data)
                            done["taken"] += 1
                        assert p.cd.get_tensor(p.td) == data
                        done["copies"] += 1
                        if time.monotonic() > deadline:
                            return
                finally:
                    p.close()
        except Exception as exc:  # reported below, with the pair's seed
            errors.append(f"client {k}: {exc!r}")

    def flipper() -> None:
        rng = random.Random(99)
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(0.05, 0.3))
            dst.state.set_p2p(rng.random() < 0.7)
            if rng.random() < 0.2:
                src.state.set_p2p(rng.random() < 0.7)
        dst.state.set_p2p(True)
        src.state.set_p2p(True)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    threads.append(threading.Thread(target=flipper))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert done["copies"] > 0 and not any(t.is_alive() for t in threads)
    _settled(lambda: held(src, dst) == [0, 0], 30)
    _settled(lambda: (threading.active_count(), len(os.listdir("/proc/self/fd"))) == before, 30)
