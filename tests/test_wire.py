"""Sans-IO wire core: byte literals in, events out, for both roles; size rules; the HELLO gate."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from helpers import frame

from fleetd.errors import LocalProtocolError, RemoteProtocolError
from fleetd.wire import (
    COMMANDS,
    NEED_DATA,
    PROTOCOL_VERSION,
    PUSH_FAILED,
    RPC_TENSOR,
    AllocBuffer,
    AllocBufferReply,
    ClientConnection,
    Cmd,
    CopyTensorTo,
    CopyTensorToAsync,
    DataReply,
    DeviceCount,
    DeviceCountReply,
    FreeBuffer,
    GetAlignment,
    GetAlignmentReply,
    GetTensor,
    GgmlType,
    GraphCompute,
    Hello,
    HelloReply,
    PeerBarrier,
    PeerBarrierReply,
    PeerPush,
    PeerPushReply,
    PeerStream,
    PeerStreamReply,
    PeerTake,
    PeerWait,
    PeerWaitReply,
    RpcTensor,
    ServerConnection,
    SetTensor,
    State,
    contiguous_strides,
    encode_response,
    fnv1a_64,
    hello_response,
    nbytes,
)

HELLO = b"\x0e" + struct.pack("<Q", 24) + bytes(24)


def t(**kw) -> RpcTensor:
    ne = kw.pop("ne", (4, 1, 1, 1))
    ty = kw.pop("type", GgmlType.F32)
    return RpcTensor(
        id=kw.pop("id", 1),
        type=ty,
        buffer=kw.pop("buffer", 0x100),
        ne=ne,
        nb=contiguous_strides(ty, ne),
        data=kw.pop("data", 0x1000),
        **kw,
    )


def ready() -> ServerConnection:
    conn = ServerConnection()
    conn.receive_data(HELLO)
    assert isinstance(conn.next_event(), Hello)
    return conn


def test_rpc_tensor_layout_is_296_bytes_and_round_trips():
    assert RPC_TENSOR.size == 296
    x = t(name=b"blk.0.attn", op=29, src=(5, 6) + (0,) * 8, use_count=3, flags=16)
    assert RpcTensor.unpack_from(x.pack()) == x
    assert RpcTensor.unpack_from(x.pack()).use_count == 3


def test_hello_bytes_match_protocol_example():
    assert hello_response(0) == bytes.fromhex("1c00000000000000") + b"\x07\x00\x00\x00" + bytes(24)
    assert hello_response(1)[8 + 3] == 1  # the feature byte is the padding byte


@pytest.mark.parametrize("split", ["whole", "bytewise"])
def test_hello_then_alloc(split):
    conn = ServerConnection()
    data = HELLO + frame(Cmd.ALLOC_BUFFER, struct.pack("<IQ", 0, 1000))
    chunks = [data] if split == "whole" else [data[i : i + 1] for i in range(len(data))]
    events = []
    for c in chunks:
        conn.receive_data(c)
        while (ev := conn.next_event()) is not NEED_DATA:
            events.append(ev)
    assert events == [Hello(bytes(24)), AllocBuffer(0, 1000)]


def test_trailing_bytes_stay_buffered():
    conn = ServerConnection()
    conn.receive_data(HELLO + b"\x0f")
    assert isinstance(conn.next_event(), Hello)
    assert conn.next_event() is NEED_DATA
    assert conn.buffered == 1


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"\x0f" + bytes(8), "expected HELLO"),
        (b"\x0e" + struct.pack("<Q", 20), "expected 24"),
    ],
)
def test_hello_gate_refuses(data, reason):
    conn = ServerConnection()
    conn.receive_data(data)
    with pytest.raises(RemoteProtocolError, match=reason):
        conn.next_event()
    assert conn.state is State.ERROR
    with pytest.raises(RemoteProtocolError):
        conn.next_event()


@pytest.mark.parametrize(
    "data, reason",
    [
        (HELLO, "second HELLO"),
        (frame(18, b""), "unknown command 0x12"),
        (frame(0x99, b""), "unknown command 0x99"),
        (frame(Cmd.GET_ALIGNMENT, bytes(8)), "payload size 8, expected 4"),
        (frame(Cmd.DEVICE_COUNT, b"\x00"), "payload size 1, expected 0"),
        (frame(Cmd.SET_TENSOR, bytes(300)), "below minimum 305"),
        (struct.pack("<BQ", Cmd.GRAPH_COMPUTE, 1 << 63), "above limit"),
        (struct.pack("<BQ", Cmd.GET_TENSOR, 1 << 63), "expected 312"),
    ],
)
def test_size_rules_fail_before_the_payload_arrives(data, reason):
    conn = ready()
    conn.receive_data(data)
    with pytest.raises(RemoteProtocolError, match=reason):
        conn.next_event()


FIXED_SIZE = sorted(c for c, spec in COMMANDS.items() if spec.size is not None and c != Cmd.HELLO)


@pytest.mark.parametrize("cmd", FIXED_SIZE)
def test_every_fixed_size_command_waits_for_its_whole_payload(cmd):
    spec = COMMANDS[cmd]
    conn = ready()
    payload = bytes(spec.size)
    data = frame(cmd, payload)
    conn.receive_data(data[:-1]) if spec.size else None
    if spec.size:
        assert conn.next_event() is NEED_DATA
        conn.receive_data(data[-1:])
    else:
        conn.receive_data(data)
    ev = conn.next_event()
    assert ev.cmd == cmd
    assert conn.request_bytes == 9 + spec.size


def test_set_tensor_body_is_left_for_the_shell():
    conn = ready()
    data = np.arange(4, dtype="<f4").tobytes()
    req = SetTensor(t(), 0, len(data))
    wire = ClientConnection()
    wire.send(Hello())
    conn.receive_data(wire.send(req) + data[:6])
    ev = conn.next_event()
    assert ev.size == 16 and ev.tensor == t()
    dst = bytearray(16)
    assert conn.read_body_into(memoryview(dst)) == 6
    assert conn.body_remaining == 10
    conn.receive_data(data[6:] + frame(Cmd.DEVICE_COUNT, b""))
    assert conn.read_body_into(memoryview(dst)[6:]) == 10
    assert bytes(dst) == data
    assert conn.next_event().cmd == Cmd.DEVICE_COUNT


def test_graph_compute_round_trip_and_truncation():
    from fleetd.wire import RPC_TENSOR_DTYPE

    recs = np.zeros(2, RPC_TENSOR_DTYPE)
    recs["id"] = [7, 8]
    g = GraphCompute(0, (8,), recs)
    payload = g.encode()
    assert len(payload) == 12 + 8 + 2 * 296
    back = GraphCompute.decode(memoryview(payload))
    assert back.nodes == (8,) and back.tensors["id"].tolist() == [7, 8]
    with pytest.raises(RemoteProtocolError, match="tensors do not fit"):
        GraphCompute.decode(memoryview(payload[:-1]))
    with pytest.raises(RemoteProtocolError, match="nodes do not fit"):
        GraphCompute.decode(memoryview(struct.pack("<II", 0, 1000) + bytes(8)))


def test_copy_tensor_to_endpoint_length_must_match():
    req = CopyTensorTo(t(), t(id=2), 16, "127.0.0.1:50052")
    assert CopyTensorTo.decode(memoryview(req.encode())) == req
    bad = bytearray(req.encode())
    struct.pack_into("<I", bad, 2 * 296 + 8, 3)
    with pytest.raises(RemoteProtocolError, match="endpoint_len 3"):
        CopyTensorTo.decode(memoryview(bytes(bad)))


def test_async_peer_copy_commands_round_trip_through_both_connections():
    """The asynchronous copy's five commands, client bytes in, server events out, replies back."""
    copy = CopyTensorToAsync(t(), t(id=2), 16, 0xDEADBEEF, 7, "10.0.0.2:50052")
    assert CopyTensorToAsync.decode(memoryview(copy.encode())) == copy
    bad = bytearray(copy.encode())
    struct.pack_into("<I", bad, 2 * 296 + 24, 2)
    with pytest.raises(RemoteProtocolError, match="endpoint_len 2"):
        CopyTensorToAsync.decode(memoryview(bytes(bad)))

    client, server = ClientConnection(), ServerConnection()
    server.receive_data(client.send(Hello()))
    assert isinstance(server.next_event(), Hello)
    client.receive_data(server.send(HelloReply(PROTOCOL_VERSION, 3)))
    assert client.next_event().features == 3
    push = PeerPush(0xDEADBEEF, 7, t(id=2), 16, 0)
    data = bytes(range(16))
    wire = b"".join(
        [client.send(copy), client.send(PeerStream()), client.send(push) + data]
        + [client.send(PeerWait(0xDEADBEEF, 7)), client.send(PeerTake(0xDEADBEEF, 7, 16))]
    )
    server.receive_data(wire)
    assert server.next_event() == copy
    assert server.next_event() == PeerStream()
    got = server.next_event()
    assert got == push and server.body_remaining == 16
    body = bytearray(16)
    assert server.read_body_into(memoryview(body)) == 16 and bytes(body) == data
    assert server.next_event() == PeerWait(0xDEADBEEF, 7)
    assert server.next_event() == PeerTake(0xDEADBEEF, 7, 16)
    assert server.next_event() is NEED_DATA
    replies = [PeerStreamReply(0xDEADBEEF), PeerPushReply(1), PeerWaitReply(0)]
    client.receive_data(b"".join(server.send(r) for r in replies) + DataReply.header(16) + data)
    assert [client.next_event() for _ in replies] == replies
    assert bytes(client.next_event().data) == data  # PEER_TAKE's bytes, sized by its request
    failed = PeerPush(1, 2, t(), 0, PUSH_FAILED)
    header = client.send(failed)
    assert header[0] == Cmd.PEER_PUSH and len(header) == 9 + PeerPush.HEADER_SIZE


def test_pipelined_requests_split_mid_request_keep_the_buffer_bounded():
    # Every write ends in the middle of a request, so a read never ends on a request boundary:
    # consumed bytes must still be dropped, or the buffer grows with everything ever received.
    request = frame(Cmd.GET_ALIGNMENT, struct.pack("<I", 0))
    stream = HELLO + request * 20_000
    conn = ServerConnection()
    chunk = 4096 + 5  # not a multiple of the 13-byte request
    events, most_held = 0, 0
    for i in range(0, len(stream), chunk):
        conn.receive_data(stream[i : i + chunk])
        while conn.next_event() is not NEED_DATA:
            events += 1
        most_held = max(most_held, conn.held)
    assert events == 20_001
    assert most_held <= chunk + len(request)


def server_reply(request, reply) -> ClientConnection:
    """A client that sent HELLO and `request`, with the HELLO reply already taken."""
    c = ClientConnection()
    c.send(Hello())
    c.receive_data(hello_response(1))
    assert c.next_event() == HelloReply(PROTOCOL_VERSION, 1)
    c.send(request)
    c.receive_data(reply)
    return c


@pytest.mark.parametrize(
    "request_, reply",
    [
        (AllocBuffer(0, 1000), AllocBufferReply(0x100, 1024)),
        (GetAlignment(0), GetAlignmentReply(32)),
        (DeviceCount(), DeviceCountReply(1)),
        (PeerBarrier(), PeerBarrierReply(1)),
    ],
)
def test_client_turns_reply_bytes_into_the_reply_event(request_, reply):
    wire = reply.frame()
    assert wire == encode_response(request_.cmd, *[getattr(reply, f) for f in reply.__slots__])
    for split in (len(wire), 1):  # whole, then byte by byte
        c = ClientConnection()
        c.send(Hello())
        c.receive_data(hello_response(0))
        assert isinstance(c.next_event(), HelloReply)
        c.send(request_)
        events = []
        for i in range(0, len(wire), split):
            c.receive_data(wire[i : i + split])
            while (ev := c.next_event()) is not NEED_DATA:
                events.append(ev)
        assert events == [reply] and c.awaiting == 0 and c.response_bytes == len(wire)


def test_client_checks_version_and_reads_feature_bit():
    c = server_reply(DeviceCount(), b"")
    assert c.version == (7, 0, 0) and c.features == 1
    c2 = ClientConnection()
    c2.send(Hello())
    c2.receive_data(struct.pack("<Q", 28) + bytes([7, 1, 0, 0]) + bytes(24))
    with pytest.raises(RemoteProtocolError, match="unsupported"):
        c2.next_event()
    assert c2.state is State.ERROR


def test_client_hello_first_once_and_replies_in_request_order():
    c = ClientConnection()
    with pytest.raises(LocalProtocolError, match="HELLO first"):
        c.send(DeviceCount())
    c.send(Hello())
    with pytest.raises(LocalProtocolError, match="second HELLO"):
        c.send(Hello())
    c.send(FreeBuffer(0x100))  # no reply: nothing awaited
    c.send(GetAlignment(0))
    assert c.awaiting == 2
    c.receive_data(hello_response(0) + GetAlignmentReply(64).frame())
    assert isinstance(c.next_event(), HelloReply)
    assert c.next_event() == GetAlignmentReply(64)
    assert c.next_event() is NEED_DATA


@pytest.mark.parametrize(
    "reply, reason",
    [
        (struct.pack("<Q", 8), "response of 8 bytes, expected 16"),  # GET_TENSOR of 16 bytes
        (DataReply.header(16) + bytes(16) + b"\x00", "1 bytes received with no request"),
    ],
)
def test_client_refuses_replies_that_do_not_fit(reply, reason):
    c = server_reply(GetTensor(t(), 0, 16), reply)
    with pytest.raises(RemoteProtocolError, match=reason):
        while c.next_event() is NEED_DATA:
            pass
        c.next_event()
    assert c.state is State.ERROR


def test_get_tensor_data_streams_into_the_callers_buffer():
    data = np.arange(1024, dtype="<f4")
    out = np.zeros_like(data)
    c = ClientConnection()
    c.send(Hello())
    c.receive_data(hello_response(0))
    c.next_event()
    c.send(GetTensor(t(ne=(1024, 1, 1, 1)), 0, data.nbytes), into=out)
    c.receive_data(DataReply.header(data.nbytes) + data.tobytes()[:100])  # one read: header + some
    assert c.next_event() is NEED_DATA and c.buffered == 0
    rest = c.body_buffer()  # the shell recv_into()s this: no copy through the buffer
    assert rest.nbytes == data.nbytes - 100
    rest[:] = data.tobytes()[100:]
    c.body_received(rest.nbytes)
    reply = c.next_event()
    assert isinstance(reply, DataReply) and reply.data is out
    assert np.array_equal(out, data) and c.response_bytes == 8 + data.nbytes
    with pytest.raises(LocalProtocolError, match="does not fit"):
        c.send(GetTensor(t(), 0, 16), into=bytearray(8))


def test_every_command_with_a_response_has_a_reply_event():
    for cmd, spec in COMMANDS.items():
        if spec.response is not None:
            assert spec.response.streamed or spec.response.layout is not None, cmd
    assert COMMANDS[Cmd.GET_TENSOR].response is DataReply
    assert [c for c, s in COMMANDS.items() if s.handshake] == [Cmd.HELLO]
    assert [c for c, s in COMMANDS.items() if s.streamed_body] == [Cmd.SET_TENSOR, Cmd.PEER_PUSH]


def test_nbytes_matches_protocol_examples():
    assert contiguous_strides(GgmlType.Q4_0, (4096, 3, 1, 1)) == (18, 2304, 6912, 6912)
    assert nbytes(GgmlType.F32, (5, 3, 2, 1), (4, 20, 60, 120)) == 120
    assert nbytes(GgmlType.F32, (3, 5, 2, 1), (20, 4, 60, 120)) == 120  # transposed view
    assert nbytes(GgmlType.F32, (0, 3, 1, 1), (4, 0, 0, 0)) == 0


def test_fnv1a_check_values():
    assert fnv1a_64(b"") == 0xCBF29CE484222325
    assert fnv1a_64(b"a") == 0xAF63DC4C8601EC8C
    assert fnv1a_64(np.array([5, 6, 7, 8], "<f4").tobytes()) == 0x6A4CC67EA849DD72
