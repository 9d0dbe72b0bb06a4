"""RpcClient: one connection to a ggml RPC server, one method per command.

    with RpcClient("127.0.0.1:50052") as c:      # connects and says HELLO
        ptr, size = c.alloc_buffer(1 << 20)
        c.set_tensor(t, data)                     # no response: pipelined, as the stock client
        out = c.get_tensor(t, 0, t.nbytes)        # waits for its response

Commands without a response are only written to the socket; the next response-bearing request
is the barrier, as with the stock client. In-band "no" (ALLOC_BUFFER pointer 0, SET_TENSOR_HASH
or COPY_TENSOR(_TO) result 0) comes back as a value; protocol and transport failures raise.
"""

from __future__ import annotations

from fleetd.client.stats import ClientCounters
from fleetd.transport.channel import RpcChannel
from fleetd.transport.stream import Stream, TcpStream
from fleetd.transport.tcp import Timeout, parse_endpoint
from fleetd.wire import (
    AllocBuffer,
    BufferClear,
    BufferGetBase,
    ClientConnection,
    CopyTensor,
    CopyTensorTo,
    CopyTensorToAsync,
    DeviceCount,
    Feature,
    FreeBuffer,
    GetAlignment,
    GetAllocSize,
    GetDeviceMemory,
    GetMaxSize,
    GetTensor,
    GraphCompute,
    GraphRecompute,
    Hello,
    InitTensor,
    MemsetTensor,
    PeerBarrier,
    PeerGate,
    PeerResume,
    PeerStream,
    PeerTake,
    PeerWait,
    Reply,
    Request,
    RpcTensor,
    SetTensor,
    SetTensorHash,
)


class RpcClient:
    """One connection to a ggml RPC server, over a TCP endpoint ("host:port") or any Stream
    (as httpx's client takes a transport); every byte goes through one RpcChannel."""

    def __init__(
        self, endpoint: str | Stream, timeout: Timeout = Timeout(), counters: ClientCounters | None = None
    ):
        self._stream = None if isinstance(endpoint, str) else endpoint
        self.endpoint = endpoint if isinstance(endpoint, str) else endpoint.name
        self.timeout = timeout
        self.counters = counters if counters is not None else ClientCounters()
        self.channel: RpcChannel | None = None

    def __repr__(self) -> str:
        return f"<RpcClient endpoint={self.endpoint}>"

    # -- lifecycle --------------------------------------------------------------------------

    def open(self) -> RpcClient:
        if self.channel is None:
            stream = self._stream or TcpStream.connect(
                parse_endpoint(self.endpoint), self.timeout.connect, self.endpoint
            )
            self._stream = None  # a stream serves one connection
            self.channel = RpcChannel(stream, self.timeout.read)
            self._call(Hello())
        return self

    def close(self) -> None:
        if self.channel is not None:
            try:
                self.channel.close()
            finally:
                self.channel = None

    def __enter__(self) -> RpcClient:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def sock(self):
        """The TCP socket under the channel (tests reach past the protocol with it)."""
        return self.channel.stream.socket if self.channel is not None else None

    @property
    def conn(self) -> ClientConnection:
        return self.channel.conn

    @property
    def version(self) -> tuple[int, int, int] | None:
        return self.channel.conn.version if self.channel else None

    @property
    def features(self) -> Feature:
        return self.channel.conn.features if self.channel else Feature(0)

    # -- framing: the channel's, counted here ------------------------------------------------

    def _send(self, request: Request, data=None, into=None) -> None:
        sent = self.channel.send(request, data, into=into)
        self.counters.sent(request.cmd, sent)

    def _call(self, request: Request, into=None) -> Reply:
        """Send a request that has a reply and wait for its reply event."""
        self._send(request, into=into)
        event = self.channel.reply(f"{request.cmd.name} response")
        self.counters.received(request.cmd, self.channel.conn.response_bytes)
        return event

    def send_raw(self, data: bytes) -> None:
        """Write bytes as they are (tests of malformed input)."""
        self.channel.stream.send_parts([data])

    # -- commands ---------------------------------------------------------------------------

    def device_count(self) -> int:
        return self._call(DeviceCount()).count

    def alloc_buffer(self, size: int, device: int = 0) -> tuple[int, int]:
        """(remote_ptr, remote_size); remote_ptr 0 means the server could not allocate."""
        reply = self._call(AllocBuffer(device, size))
        return reply.remote_ptr, reply.remote_size

    def get_alignment(self, device: int = 0) -> int:
        return self._call(GetAlignment(device)).alignment

    def get_max_size(self, device: int = 0) -> int:
        return self._call(GetMaxSize(device)).max_size

    def get_device_memory(self, device: int = 0) -> tuple[int, int]:
        """(free, total) bytes."""
        reply = self._call(GetDeviceMemory(device))
        return reply.free, reply.total

    def buffer_get_base(self, remote_ptr: int) -> int:
        return self._call(BufferGetBase(remote_ptr)).base

    def free_buffer(self, remote_ptr: int) -> None:
        self._send(FreeBuffer(remote_ptr))

    def buffer_clear(self, remote_ptr: int, value: int) -> None:
        self._send(BufferClear(remote_ptr, value))

    def set_tensor(self, tensor: RpcTensor, data, offset: int = 0, cache: bool = False) -> None:
        view = memoryview(data).cast("B")
        self._send(SetTensor(tensor, offset, len(view), int(cache)), view)

    def set_tensor_hash(self, tensor: RpcTensor, hash_: int, offset: int = 0) -> bool:
        return bool(self._call(SetTensorHash(tensor, offset, hash_)).found)

    def get_tensor(self, tensor: RpcTensor, offset: int = 0, size: int | None = None, out=None):
        """The bytes of a region; read straight into `out` (any writable buffer) when given."""
        size = tensor.nbytes - offset if size is None else size
        if out is not None:
            n = memoryview(out).nbytes
            if n != size:
                raise ValueError(f"GET_TENSOR: out has {n} bytes, need {size}")
        return self._call(GetTensor(tensor, offset, size), into=out).data

    def copy_tensor(self, src: RpcTensor, dst: RpcTensor) -> bool:
        return bool(self._call(CopyTensor(src, dst)).copied)

    def graph_compute(self, graph: GraphCompute) -> None:
        self._send(graph)

    def graph_recompute(self, device: int = 0) -> None:
        self._send(GraphRecompute(device))

    def init_tensor(self, tensor: RpcTensor) -> None:
        self._send(InitTensor(tensor))

    def get_alloc_size(self, tensor: RpcTensor, srcs=(), device: int = 0) -> int:
        return self._call(GetAllocSize(device, tensor, tuple(srcs))).size

    def memset_tensor(self, tensor: RpcTensor, offset: int, size: int, value: int) -> None:
        self._send(MemsetTensor(tensor, offset, size, value))

    def copy_tensor_to(self, src: RpcTensor, dst: RpcTensor, size: int, endpoint: str) -> bool:
        """Ask this server to push `src` into `dst` on the peer at `endpoint` (extension)."""
        return bool(self._call(CopyTensorTo(src, dst, size, endpoint)).landed)

    def peer_barrier(self) -> bool:
        return bool(self._call(PeerBarrier()).landed)

    # -- the asynchronous peer copy (fleetd.server.peer_async) -------------------------------

    def peer_stream(self) -> int:
        """A stream id for asynchronous copies into this server (its PEER_WAITs are ours)."""
        return self._call(PeerStream()).stream

    def copy_tensor_to_async(
        self, src: RpcTensor, dst: RpcTensor, size: int, endpoint: str, stream: int, seq: int
    ) -> None:
        """Ask this server (the source) to push `src` into `dst` at `endpoint` as copy `seq` of
        the destination's `stream`; no answer: the destination's PEER_WAIT tells."""
        self._send(CopyTensorToAsync(src, dst, size, stream, seq, endpoint))

    def peer_wait(self, stream: int, seq: int) -> bool:
        """On the destination: True once copy `seq` is written; False: take it from the source."""
        return bool(self._call(PeerWait(stream, seq)).landed)

    def peer_gate(self, stream: int, seq: int) -> None:
        """On the destination: PEER_WAIT without waiting; read its answer with gate_result()
        before any other reply. If it is False, the server skips everything sent after the gate
        until peer_resume()."""
        self._send(PeerGate(stream, seq))

    def gate_result(self) -> bool:
        """The answer of the oldest PEER_GATE not read yet."""
        event = self.channel.reply("PEER_GATE response")
        self.counters.received(PeerGate.cmd, self.channel.conn.response_bytes)
        return bool(event.landed)

    def peer_resume(self) -> None:
        """End the skipping a failed PEER_GATE started."""
        self._send(PeerResume())

    def peer_take(self, stream: int, seq: int, size: int) -> bytearray:
        """On the source: the bytes of a copy whose push failed (after PEER_WAIT said 0)."""
        return self._call(PeerTake(stream, seq, size)).data

    def sync(self) -> None:
        """Wait until every pipelined command so far has been executed (a cheap round trip)."""
        self.get_alignment(0)

    def sync_begin(self) -> None:
        """sync() in two halves, for a round trip sent behind commands whose answers are read
        first (PEER_GATE's, as the client half sends its next graph right behind a gate): the
        request now, its reply with sync_end()."""
        self._send(GetAlignment(0))

    def sync_end(self) -> None:
        """Read sync_begin's reply (after every earlier answer was read)."""
        self.channel.reply("GET_ALIGNMENT response")
        self.counters.received(GetAlignment.cmd, self.channel.conn.response_bytes)
