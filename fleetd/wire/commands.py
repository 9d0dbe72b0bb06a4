"""Commands of protocol 7 plus fleetd's extension, as events and one table.

Each request is a small frozen dataclass that knows its own payload layout (`encode` for the
client side, `decode` for the server side). `COMMANDS` maps the command byte to its event class,
its size rule, its reply class (fleetd.wire.replies) and what sets it apart (a streamed body, the
handshake); a byte missing from the table is a protocol error.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from fleetd.errors import LocalProtocolError, RemoteProtocolError
from fleetd.wire.replies import (
    AllocBufferReply,
    BufferGetBaseReply,
    CopyTensorReply,
    CopyTensorToReply,
    DataReply,
    DeviceCountReply,
    GetAlignmentReply,
    GetAllocSizeReply,
    GetDeviceMemoryReply,
    GetMaxSizeReply,
    HelloReply,
    PeerBarrierReply,
    PeerPushReply,
    PeerStreamReply,
    PeerWaitReply,
    Reply,
    SetTensorHashReply,
)
from fleetd.wire.tensor import RPC_TENSOR_DTYPE, RpcTensor

PROTOCOL_VERSION = (7, 0, 0)

# Largest graph a client may send: llama.cpp sizes graphs at max(1024, 8 * n_tensors) nodes and
# a 400-layer model has ~20k tensors, so 1 Mi nodes is far beyond any real graph while bounding a
# hostile n_nodes before we buffer its payload.
MAX_GRAPH_NODES = 1 << 20
MAX_GRAPH_PAYLOAD = 12 + MAX_GRAPH_NODES * (8 + 296)
# "host:port" of a peer: a DNS name is at most 253 bytes, plus ":65535".
MAX_ENDPOINT_LEN = 260


class Cmd(enum.IntEnum):
    """The command byte that opens every request frame: protocol 7's values, then fleetd's extension."""

    ALLOC_BUFFER = 0
    GET_ALIGNMENT = 1
    GET_MAX_SIZE = 2
    BUFFER_GET_BASE = 3
    FREE_BUFFER = 4
    BUFFER_CLEAR = 5
    SET_TENSOR = 6
    SET_TENSOR_HASH = 7
    GET_TENSOR = 8
    COPY_TENSOR = 9
    GRAPH_COMPUTE = 10
    GET_DEVICE_MEMORY = 11
    INIT_TENSOR = 12
    GET_ALLOC_SIZE = 13
    HELLO = 14
    DEVICE_COUNT = 15
    GRAPH_RECOMPUTE = 16
    MEMSET_TENSOR = 17
    # fleetd's extension, far from upstream's growing enum (DESIGN.md "Peer copy").
    COPY_TENSOR_TO = 0x40
    PEER_BARRIER = 0x41
    # the asynchronous peer copy (DESIGN.md "Asynchronous peer copy")
    COPY_TENSOR_TO_ASYNC = 0x42
    PEER_STREAM = 0x43
    PEER_PUSH = 0x44
    PEER_WAIT = 0x45
    PEER_TAKE = 0x46
    PEER_GATE = 0x47
    PEER_RESUME = 0x48


class Feature(enum.IntFlag):
    """Bits of the HELLO response byte that stock servers send as padding (always 0 there)."""

    PEER_COPY = 1  # COPY_TENSOR_TO / PEER_BARRIER served and enabled now
    PEER_COPY_ASYNC = 2  # COPY_TENSOR_TO_ASYNC, PEER_STREAM/PUSH/WAIT/TAKE served and enabled now
    PEER_GATE = 4  # PEER_GATE / PEER_RESUME served (with bit 1): a copy's wait nobody waits for
    ALL = PEER_COPY | PEER_COPY_ASYNC | PEER_GATE


def cmd_name(byte: int) -> str:
    try:
        return Cmd(byte).name
    except ValueError:
        return f"command {byte:#x}"


_T = 296
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class Request:
    """Base of the request events: `cmd` is the command byte, `encode`/`decode` the payload."""

    cmd: ClassVar[Cmd]

    def encode(self) -> bytes:
        raise NotImplementedError

    @classmethod
    def decode(cls, payload: memoryview) -> Request:
        raise NotImplementedError


def _fixed(fmt: str):
    """Class decorator for requests whose payload is one packed struct of the dataclass fields."""
    layout = struct.Struct("<" + fmt)

    def wrap(cls):
        cls.layout = layout
        names = [f.name for f in dataclasses.fields(cls)]

        def encode(self) -> bytes:
            return layout.pack(*(getattr(self, f) for f in names))

        def decode(klass, payload):
            return klass(*layout.unpack(payload))

        cls.encode = encode
        cls.decode = classmethod(decode)
        return cls

    return wrap


@_fixed("24s")
@dataclass(frozen=True, slots=True)
class Hello(Request):
    """HELLO, the first command: | conn_caps 24 bytes |, all zero for plain TCP."""

    cmd: ClassVar[Cmd] = Cmd.HELLO
    conn_caps: bytes = bytes(24)


@_fixed("")
@dataclass(frozen=True, slots=True)
class DeviceCount(Request):
    """DEVICE_COUNT: an empty payload; the reply says how many devices the server serves."""

    cmd: ClassVar[Cmd] = Cmd.DEVICE_COUNT


@_fixed("IQ")
@dataclass(frozen=True, slots=True)
class AllocBuffer(Request):
    """ALLOC_BUFFER: | device u32 | size u64 |, a new buffer of `size` bytes on that device."""

    cmd: ClassVar[Cmd] = Cmd.ALLOC_BUFFER
    device: int
    size: int


@_fixed("I")
@dataclass(frozen=True, slots=True)
class GetAlignment(Request):
    """GET_ALIGNMENT: | device u32 |, the alignment the device's buffers need."""

    cmd: ClassVar[Cmd] = Cmd.GET_ALIGNMENT
    device: int


@_fixed("I")
@dataclass(frozen=True, slots=True)
class GetMaxSize(Request):
    """GET_MAX_SIZE: | device u32 |, the largest single buffer the device allocates."""

    cmd: ClassVar[Cmd] = Cmd.GET_MAX_SIZE
    device: int


@_fixed("I")
@dataclass(frozen=True, slots=True)
class GetDeviceMemory(Request):
    """GET_DEVICE_MEMORY: | device u32 |, the device's free and total memory."""

    cmd: ClassVar[Cmd] = Cmd.GET_DEVICE_MEMORY
    device: int


@_fixed("Q")
@dataclass(frozen=True, slots=True)
class BufferGetBase(Request):
    """BUFFER_GET_BASE: | remote_ptr u64 |, the address of byte 0 of that buffer."""

    cmd: ClassVar[Cmd] = Cmd.BUFFER_GET_BASE
    remote_ptr: int


@_fixed("Q")
@dataclass(frozen=True, slots=True)
class FreeBuffer(Request):
    """FREE_BUFFER: | remote_ptr u64 |; no response. Stored graphs are discarded with it."""

    cmd: ClassVar[Cmd] = Cmd.FREE_BUFFER
    remote_ptr: int


@_fixed("QB")
@dataclass(frozen=True, slots=True)
class BufferClear(Request):
    """BUFFER_CLEAR: | remote_ptr u64 | value u8 |, the whole buffer filled with `value`; no response."""

    cmd: ClassVar[Cmd] = Cmd.BUFFER_CLEAR
    remote_ptr: int
    value: int


@_fixed("I")
@dataclass(frozen=True, slots=True)
class GraphRecompute(Request):
    """GRAPH_RECOMPUTE: | device u32 |, that device's stored graph run again; no response."""

    cmd: ClassVar[Cmd] = Cmd.GRAPH_RECOMPUTE
    device: int


@_fixed("")
@dataclass(frozen=True, slots=True)
class PeerBarrier(Request):
    """PEER_BARRIER (fleetd): an empty payload, answered once every earlier command has been served."""

    cmd: ClassVar[Cmd] = Cmd.PEER_BARRIER


_SET_HEADER = struct.Struct("<BQ")


@dataclass(frozen=True, slots=True)
class SetTensor(Request):
    """| rpc_tensor | cache_flag u8 | offset u64 | data... | — the data follows as a body.

    On the receive side the event carries `size` (payload length minus the 305-byte header);
    the bytes themselves are left in the stream for the I/O shell to read straight into the
    destination buffer. On the send side `data` may be given for small writes.
    """

    cmd: ClassVar[Cmd] = Cmd.SET_TENSOR
    HEADER_SIZE: ClassVar[int] = _T + 9
    tensor: RpcTensor
    offset: int
    size: int
    cache_flag: int = 0

    def encode(self) -> bytes:
        return self.tensor.pack() + _SET_HEADER.pack(self.cache_flag, self.offset)

    @classmethod
    def decode_header(cls, header: memoryview, size: int) -> SetTensor:
        cache_flag, offset = _SET_HEADER.unpack_from(header, _T)
        return cls(RpcTensor.unpack_from(header), offset, size, cache_flag)


def _tensor_and(fmt: str):
    """Requests laid out as | rpc_tensor | fields... |."""
    layout = struct.Struct("<" + fmt)

    def wrap(cls):
        cls.layout = layout
        fields = [f.name for f in dataclasses.fields(cls) if f.name != "tensor"]

        def encode(self) -> bytes:
            return self.tensor.pack() + layout.pack(*(getattr(self, f) for f in fields))

        def decode(klass, payload):
            return klass(RpcTensor.unpack_from(payload), *layout.unpack_from(payload, _T))

        cls.encode = encode
        cls.decode = classmethod(decode)
        cls.SIZE = _T + layout.size
        return cls

    return wrap


@_tensor_and("QQ")
@dataclass(frozen=True, slots=True)
class SetTensorHash(Request):
    """SET_TENSOR_HASH: | rpc_tensor | offset u64 | hash u64 |, the cached file named by the
    FNV-1a `hash` written at `offset` in the tensor."""

    cmd: ClassVar[Cmd] = Cmd.SET_TENSOR_HASH
    SIZE: ClassVar[int]  # set by _tensor_and
    tensor: RpcTensor
    offset: int
    hash: int


@_tensor_and("QQ")
@dataclass(frozen=True, slots=True)
class GetTensor(Request):
    """GET_TENSOR: | rpc_tensor | offset u64 | size u64 |, `size` bytes read from `offset` in the tensor."""

    cmd: ClassVar[Cmd] = Cmd.GET_TENSOR
    SIZE: ClassVar[int]  # set by _tensor_and
    tensor: RpcTensor
    offset: int
    size: int


@_tensor_and("QQB")
@dataclass(frozen=True, slots=True)
class MemsetTensor(Request):
    """MEMSET_TENSOR: | rpc_tensor | offset u64 | size u64 | value u8 |, `size` bytes from `offset`
    set to `value`; no response."""

    cmd: ClassVar[Cmd] = Cmd.MEMSET_TENSOR
    SIZE: ClassVar[int]  # set by _tensor_and
    tensor: RpcTensor
    offset: int
    size: int
    value: int


@_tensor_and("")
@dataclass(frozen=True, slots=True)
class InitTensor(Request):
    """INIT_TENSOR: | rpc_tensor |, the buffer type's init hook for the tensor; no response."""

    cmd: ClassVar[Cmd] = Cmd.INIT_TENSOR
    SIZE: ClassVar[int]  # set by _tensor_and
    tensor: RpcTensor


@dataclass(frozen=True, slots=True)
class CopyTensor(Request):
    """| src rpc_tensor | dst rpc_tensor |"""

    cmd: ClassVar[Cmd] = Cmd.COPY_TENSOR
    src: RpcTensor
    dst: RpcTensor

    def encode(self) -> bytes:
        return self.src.pack() + self.dst.pack()

    @classmethod
    def decode(cls, payload):
        return cls(RpcTensor.unpack_from(payload), RpcTensor.unpack_from(payload, _T))


@dataclass(frozen=True, slots=True)
class GetAllocSize(Request):
    """| device u32 | tensor rpc_tensor | srcs rpc_tensor[10] (id 0 = absent) |"""

    cmd: ClassVar[Cmd] = Cmd.GET_ALLOC_SIZE
    device: int
    tensor: RpcTensor
    srcs: tuple[RpcTensor | None, ...] = ()

    def encode(self) -> bytes:
        srcs = list(self.srcs) + [None] * (10 - len(self.srcs))
        empty = bytes(_T)
        return (
            _U32.pack(self.device)
            + self.tensor.pack()
            + b"".join(s.pack() if s is not None else empty for s in srcs)
        )

    @classmethod
    def decode(cls, payload):
        (device,) = _U32.unpack_from(payload)
        tensor = RpcTensor.unpack_from(payload, 4)
        srcs = []
        for i in range(10):
            s = RpcTensor.unpack_from(payload, 4 + _T * (i + 1))
            srcs.append(s if s.id != 0 else None)
        return cls(device, tensor, tuple(srcs))


@dataclass(frozen=True, slots=True)
class GraphCompute(Request):
    """| device u32 | n_nodes u32 | nodes u64[n_nodes] | n_tensors u32 | tensors rpc_tensor[n] |

    `tensors` is a numpy array of RPC_TENSOR_DTYPE records (parsed in one call: graphs of
    thousands of tensors arrive every step).
    """

    cmd: ClassVar[Cmd] = Cmd.GRAPH_COMPUTE
    device: int
    nodes: tuple[int, ...]
    tensors: np.ndarray

    def encode(self) -> bytes:
        return b"".join(
            [
                struct.pack("<II", self.device, len(self.nodes)),
                struct.pack(f"<{len(self.nodes)}Q", *self.nodes),
                _U32.pack(len(self.tensors)),
                np.ascontiguousarray(self.tensors, dtype=RPC_TENSOR_DTYPE).tobytes(),
            ]
        )

    @classmethod
    def decode(cls, payload):
        """n_nodes and n_tensors are checked against the payload before either list is read."""
        size = len(payload)
        if size < 8:
            raise RemoteProtocolError(f"GRAPH_COMPUTE: payload of {size} bytes, need at least 8")
        device, n_nodes = struct.unpack_from("<II", payload)
        if n_nodes > MAX_GRAPH_NODES or size < 12 + 8 * n_nodes:
            raise RemoteProtocolError(f"GRAPH_COMPUTE: {n_nodes} nodes do not fit {size} bytes")
        nodes = tuple(np.frombuffer(payload, "<u8", n_nodes, 8).tolist())
        (n_tensors,) = _U32.unpack_from(payload, 8 + 8 * n_nodes)
        start = 12 + 8 * n_nodes
        if size < start + _T * n_tensors:
            raise RemoteProtocolError(f"GRAPH_COMPUTE: {n_tensors} tensors do not fit {size} bytes")
        tensors = np.frombuffer(payload, RPC_TENSOR_DTYPE, n_tensors, start).copy()
        return cls(device, nodes, tensors)


_COPY_TO_HEADER = struct.Struct("<QI")


def _endpoint_bytes(endpoint: str, what: str) -> bytes:
    ep = endpoint.encode()
    if len(ep) > MAX_ENDPOINT_LEN:
        raise LocalProtocolError(f"{what}: endpoint of {len(ep)} bytes")
    return ep


def _endpoint_at(payload, start: int, ep_len: int, what: str) -> str:
    """The "host:port" that ends a copy request: exactly `ep_len` ASCII bytes from `start`."""
    if start + ep_len != len(payload):
        raise RemoteProtocolError(f"{what}: endpoint_len {ep_len} does not match payload {len(payload)}")
    try:
        return bytes(payload[start:]).decode("ascii")
    except UnicodeDecodeError:
        raise RemoteProtocolError(f"{what}: endpoint is not ASCII") from None


@dataclass(frozen=True, slots=True)
class CopyTensorTo(Request):
    """| src rpc_tensor | dst rpc_tensor | size u64 | endpoint_len u32 | endpoint "host:port" |"""

    cmd: ClassVar[Cmd] = Cmd.COPY_TENSOR_TO
    MIN_SIZE: ClassVar[int] = 2 * _T + 12
    src: RpcTensor
    dst: RpcTensor
    size: int
    endpoint: str

    def encode(self) -> bytes:
        ep = _endpoint_bytes(self.endpoint, "COPY_TENSOR_TO")
        return self.src.pack() + self.dst.pack() + _COPY_TO_HEADER.pack(self.size, len(ep)) + ep

    @classmethod
    def decode(cls, payload):
        size, ep_len = _COPY_TO_HEADER.unpack_from(payload, 2 * _T)
        endpoint = _endpoint_at(payload, cls.MIN_SIZE, ep_len, "COPY_TENSOR_TO")
        return cls(RpcTensor.unpack_from(payload), RpcTensor.unpack_from(payload, _T), size, endpoint)


_COPY_ASYNC_HEADER = struct.Struct("<QQQI")


@dataclass(frozen=True, slots=True)
class CopyTensorToAsync(Request):
    """COPY_TENSOR_TO_ASYNC (fleetd), to the source; no response:
    | src rpc_tensor | dst rpc_tensor | size u64 | stream u64 | seq u64 | endpoint_len u32 |
    endpoint "host:port" |. The source reads `size` bytes of src now and pushes them to `dst` on
    the destination as copy `seq` of the destination's `stream` (PEER_STREAM)."""

    cmd: ClassVar[Cmd] = Cmd.COPY_TENSOR_TO_ASYNC
    MIN_SIZE: ClassVar[int] = 2 * _T + _COPY_ASYNC_HEADER.size
    src: RpcTensor
    dst: RpcTensor
    size: int
    stream: int
    seq: int
    endpoint: str

    def encode(self) -> bytes:
        ep = _endpoint_bytes(self.endpoint, "COPY_TENSOR_TO_ASYNC")
        header = _COPY_ASYNC_HEADER.pack(self.size, self.stream, self.seq, len(ep))
        return self.src.pack() + self.dst.pack() + header + ep

    @classmethod
    def decode(cls, payload):
        size, stream, seq, ep_len = _COPY_ASYNC_HEADER.unpack_from(payload, 2 * _T)
        endpoint = _endpoint_at(payload, cls.MIN_SIZE, ep_len, "COPY_TENSOR_TO_ASYNC")
        src, dst = RpcTensor.unpack_from(payload), RpcTensor.unpack_from(payload, _T)
        return cls(src, dst, size, stream, seq, endpoint)


@_fixed("")
@dataclass(frozen=True, slots=True)
class PeerStream(Request):
    """PEER_STREAM (fleetd), to the destination: an empty payload; the reply is a new stream id
    that this connection owns (its PEER_WAITs) and sources push to (PEER_PUSH)."""

    cmd: ClassVar[Cmd] = Cmd.PEER_STREAM


_PUSH_HEADER = struct.Struct("<QQB")
PUSH_FAILED = 1  # PEER_PUSH flag: the source could not read or send the copy; no data follows


@dataclass(frozen=True, slots=True)
class PeerPush(Request):
    """PEER_PUSH (fleetd), source to destination: | stream u64 | seq u64 | flags u8 |
    dst rpc_tensor | data... |; the data is a streamed body, as SET_TENSOR's. The destination
    stages it until the stream owner's PEER_WAIT(seq) writes it into `dst`."""

    cmd: ClassVar[Cmd] = Cmd.PEER_PUSH
    HEADER_SIZE: ClassVar[int] = _PUSH_HEADER.size + _T
    stream: int
    seq: int
    dst: RpcTensor
    size: int
    flags: int = 0

    def encode(self) -> bytes:
        return _PUSH_HEADER.pack(self.stream, self.seq, self.flags) + self.dst.pack()

    @classmethod
    def decode_header(cls, header: memoryview, size: int) -> PeerPush:
        stream, seq, flags = _PUSH_HEADER.unpack_from(header)
        return cls(stream, seq, RpcTensor.unpack_from(header, _PUSH_HEADER.size), size, flags)


@_fixed("QQ")
@dataclass(frozen=True, slots=True)
class PeerWait(Request):
    """PEER_WAIT (fleetd), to the destination, by the stream's owner: | stream u64 | seq u64 |.
    Answered once copy `seq` is written into its destination tensor (1), or did not come in time
    or was refused (0: the client takes the bytes from the source and writes them itself)."""

    cmd: ClassVar[Cmd] = Cmd.PEER_WAIT
    stream: int
    seq: int


@_fixed("QQ")
@dataclass(frozen=True, slots=True)
class PeerGate(Request):
    """PEER_GATE (fleetd), to the destination, by the stream's owner: | stream u64 | seq u64 |.
    PEER_WAIT for a client that does not wait for the answer: it sends its next commands at
    once. An answer of 0 also means the destination skips every command after the gate, unread
    in effect, until PEER_RESUME: the client writes the copy itself and sends them again."""

    cmd: ClassVar[Cmd] = Cmd.PEER_GATE
    stream: int
    seq: int


@_fixed("")
@dataclass(frozen=True, slots=True)
class PeerResume(Request):
    """PEER_RESUME (fleetd): empty, no response; ends the skipping a failed PEER_GATE started
    (and is a no-op otherwise)."""

    cmd: ClassVar[Cmd] = Cmd.PEER_RESUME


@_fixed("QQQ")
@dataclass(frozen=True, slots=True)
class PeerTake(Request):
    """PEER_TAKE (fleetd), to the source: | stream u64 | seq u64 | size u64 |; the reply is the
    `size` bytes the source read for that copy and kept because its push failed."""

    cmd: ClassVar[Cmd] = Cmd.PEER_TAKE
    stream: int
    seq: int
    size: int


@dataclass(frozen=True, slots=True)
class CommandSpec:
    """One row of `COMMANDS`: a command's event class, its payload size rule and its reply."""

    request: type[Request]
    size: int | None  # exact payload size, None = variable
    min_size: int = 0  # variable-size requests
    max_size: int | None = None  # variable-size requests checked before buffering; None = body
    response: type[Reply] | None = None  # None = no response (the next response is the barrier)
    # The payload is a fixed header (`request.HEADER_SIZE`) and then data the I/O shell reads
    # straight into its destination (SET_TENSOR): the core buffers only the header.
    streamed_body: bool = False
    # The opening command (HELLO): allowed only first on a connection, and exactly once.
    handshake: bool = False


COMMANDS: dict[int, CommandSpec] = {
    Cmd.ALLOC_BUFFER: CommandSpec(AllocBuffer, 12, response=AllocBufferReply),
    Cmd.GET_ALIGNMENT: CommandSpec(GetAlignment, 4, response=GetAlignmentReply),
    Cmd.GET_MAX_SIZE: CommandSpec(GetMaxSize, 4, response=GetMaxSizeReply),
    Cmd.BUFFER_GET_BASE: CommandSpec(BufferGetBase, 8, response=BufferGetBaseReply),
    Cmd.FREE_BUFFER: CommandSpec(FreeBuffer, 8),
    Cmd.BUFFER_CLEAR: CommandSpec(BufferClear, 9),
    Cmd.SET_TENSOR: CommandSpec(SetTensor, None, min_size=SetTensor.HEADER_SIZE, streamed_body=True),
    Cmd.SET_TENSOR_HASH: CommandSpec(SetTensorHash, SetTensorHash.SIZE, response=SetTensorHashReply),
    Cmd.GET_TENSOR: CommandSpec(GetTensor, GetTensor.SIZE, response=DataReply),
    Cmd.COPY_TENSOR: CommandSpec(CopyTensor, 2 * _T, response=CopyTensorReply),
    Cmd.GRAPH_COMPUTE: CommandSpec(GraphCompute, None, min_size=8, max_size=MAX_GRAPH_PAYLOAD),
    Cmd.GET_DEVICE_MEMORY: CommandSpec(GetDeviceMemory, 4, response=GetDeviceMemoryReply),
    Cmd.INIT_TENSOR: CommandSpec(InitTensor, InitTensor.SIZE),
    Cmd.GET_ALLOC_SIZE: CommandSpec(GetAllocSize, 4 + 11 * _T, response=GetAllocSizeReply),
    Cmd.HELLO: CommandSpec(Hello, 24, response=HelloReply, handshake=True),
    Cmd.DEVICE_COUNT: CommandSpec(DeviceCount, 0, response=DeviceCountReply),
    Cmd.GRAPH_RECOMPUTE: CommandSpec(GraphRecompute, 4),
    Cmd.MEMSET_TENSOR: CommandSpec(MemsetTensor, MemsetTensor.SIZE),
    Cmd.COPY_TENSOR_TO: CommandSpec(
        CopyTensorTo,
        None,
        min_size=CopyTensorTo.MIN_SIZE,
        max_size=CopyTensorTo.MIN_SIZE + MAX_ENDPOINT_LEN,
        response=CopyTensorToReply,
    ),
    Cmd.PEER_BARRIER: CommandSpec(PeerBarrier, 0, response=PeerBarrierReply),
    Cmd.COPY_TENSOR_TO_ASYNC: CommandSpec(
        CopyTensorToAsync,
        None,
        min_size=CopyTensorToAsync.MIN_SIZE,
        max_size=CopyTensorToAsync.MIN_SIZE + MAX_ENDPOINT_LEN,
    ),
    Cmd.PEER_STREAM: CommandSpec(PeerStream, 0, response=PeerStreamReply),
    Cmd.PEER_PUSH: CommandSpec(
        PeerPush, None, min_size=PeerPush.HEADER_SIZE, streamed_body=True, response=PeerPushReply
    ),
    Cmd.PEER_WAIT: CommandSpec(PeerWait, 16, response=PeerWaitReply),
    Cmd.PEER_TAKE: CommandSpec(PeerTake, 24, response=DataReply),
    Cmd.PEER_GATE: CommandSpec(PeerGate, 16, response=PeerWaitReply),
    Cmd.PEER_RESUME: CommandSpec(PeerResume, 0),
}

for _cmd, _spec in COMMANDS.items():
    assert _spec.request.cmd == _cmd
    if _spec.size is not None and hasattr(_spec.request, "layout"):
        assert _spec.request.layout.size + (_T if hasattr(_spec.request, "SIZE") else 0) == _spec.size, _cmd
    if _spec.streamed_body:
        # getattr: only the streamed-body requests have it, and type[Request] does not declare it
        assert _spec.size is None and _spec.min_size == getattr(_spec.request, "HEADER_SIZE"), _cmd  # noqa: B009
