"""One session per connection: the wsproto-style blocking loop over a ServerConnection.

recv_into -> receive_data -> next_event -> HANDLERS[type(event)] -> a reply event sent through the
connection. A session reads and writes the daemon's ServerState (never the daemon) and owns its
peer links. A peer's protocol error closes this socket with one log line; our own bug logs a
traceback and closes this socket; the daemon and every other session carry on.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import TYPE_CHECKING

from fleetd.compute.buffers import Buffer
from fleetd.compute.graph import Plan, build_plan
from fleetd.compute.views import check_extent
from fleetd.errors import ComputeError, FleetdError, RemoteProtocolError
from fleetd.server import regions
from fleetd.server.peer import PeerLinks, serve_copy
from fleetd.server.stats import CommandCounters
from fleetd.wire import (
    NEED_DATA,
    PROTOCOL_VERSION,
    AllocBuffer,
    AllocBufferReply,
    BufferClear,
    BufferGetBase,
    BufferGetBaseReply,
    CopyTensor,
    CopyTensorReply,
    CopyTensorTo,
    CopyTensorToReply,
    DataReply,
    DeviceCount,
    DeviceCountReply,
    FreeBuffer,
    GetAlignment,
    GetAlignmentReply,
    GetAllocSize,
    GetAllocSizeReply,
    GetDeviceMemory,
    GetDeviceMemoryReply,
    GetMaxSize,
    GetMaxSizeReply,
    GetTensor,
    GraphCompute,
    GraphRecompute,
    Hello,
    HelloReply,
    InitTensor,
    MemsetTensor,
    PeerBarrier,
    PeerBarrierReply,
    Reply,
    RpcTensor,
    ServerConnection,
    SetTensor,
    SetTensorHash,
    SetTensorHashReply,
    check_type,
)

if TYPE_CHECKING:
    from fleetd.server.state import ServerState

log = logging.getLogger("fleetd.session")

RECV_CHUNK = 64 * 1024
# A read that starts a new request asks for less: every fixed-size request fits (GET_ALLOC_SIZE,
# the largest, is 3269 bytes), and of a SET_TENSOR no more than this of its data takes the
# buffered path; the rest goes with recv_into straight into the tensor's buffer.
FIRST_READ = 4 * 1024
# Responses up to this size are joined with their header into one send (one segment, one syscall).
SMALL_RESPONSE = 64 * 1024


class Session:
    def __init__(self, state: ServerState, sock: socket.socket, peer: tuple, sid: int) -> None:
        self.state = state
        self.sock = sock
        self.peer = f"{peer[0]}:{peer[1]}"
        self.id = sid
        self.started = time.time()
        self.conn = ServerConnection()
        self.counters = CommandCounters()
        self.plans: dict[int, Plan] = {}  # stored graph per device
        self.peer_links = PeerLinks()  # this session's links to COPY_TENSOR_TO destinations
        self._scratch = bytearray(RECV_CHUNK)
        self._scratch_view = memoryview(self._scratch)

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> None:
        try:
            self._serve()
        except RemoteProtocolError as exc:
            log.warning("session %d %s: closed: %s", self.id, self.peer, exc)
        except ComputeError as exc:
            log.warning("session %d %s: graph failed, closed: %s", self.id, self.peer, exc)
        except (ConnectionError, TimeoutError) as exc:
            log.info("session %d %s: connection lost: %s", self.id, self.peer, exc)
        except FleetdError as exc:
            log.warning("session %d %s: closed: %s", self.id, self.peer, exc)
        except OSError as exc:
            log.info("session %d %s: socket error: %s", self.id, self.peer, exc)
        except Exception:
            log.exception("session %d %s: internal error, closing this session", self.id, self.peer)
        finally:
            self.close()

    def _serve(self) -> None:
        conn = self.conn
        record = self.counters.record if self.state.config.count_commands else _not_counted
        while True:
            event = conn.next_event()
            if event is NEED_DATA:
                n = self.sock.recv_into(self._scratch, RECV_CHUNK if conn.buffered else FIRST_READ)
                if n == 0:
                    if conn.buffered:
                        raise ConnectionError("peer closed in the middle of a request")
                    return
                conn.receive_data(self._scratch_view[:n])
                continue
            cmd = event.cmd
            sent = HANDLERS[type(event)](self, event)
            record(cmd, conn.request_bytes, sent)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
        self.peer_links.close()
        for buf in self.state.registry.owned_by(self.id):
            self.state.registry.free(buf)
        self.plans.clear()
        self.state.session_ended(self)
        log.debug("session %d %s: closed", self.id, self.peer)

    # -- helpers ----------------------------------------------------------------------------

    # The state under its old name, only for the build_plan / plan.run lines of on_graph_compute
    # and _run, which the compute branch rewrites; to go once both branches are merged.
    server = property(lambda self: self.state)

    def respond(self, reply: Reply) -> int:
        data = self.conn.send(reply)
        self.sock.sendall(data)
        return len(data)

    def device(self, index: int, what: str):
        devices = self.state.devices
        if index >= len(devices):
            raise RemoteProtocolError(f"{what}: device {index} out of range (have {len(devices)})")
        return devices[index]

    def buffer(self, handle: int, what: str) -> Buffer:
        return regions.buffer_of(self.state.registry, handle, what)

    def tensor_buffer(self, t: RpcTensor, what: str) -> tuple[Buffer, int]:
        return regions.tensor_buffer(self.state.registry, t, what)

    def region(self, t: RpcTensor, offset: int, size: int, what: str) -> tuple[Buffer, int]:
        return regions.region(self.state.registry, t, offset, size, what)

    def local_addr(self) -> str | None:
        """The IP address the client reached this daemon on (None off TCP, e.g. a socket pair)."""
        if self.sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        try:
            return self.sock.getsockname()[0]
        except OSError:
            return None


def _not_counted(cmd: int, request_bytes: int, response_bytes: int) -> None:
    """Stands in for CommandCounters.record when counting is off (benchmarks/transfer.py
    measures what counting costs against this)."""


# -- handlers: one per request type, each returns the response bytes it sent ---------------------


def on_hello(s: Session, ev: Hello) -> int:
    return s.respond(HelloReply(PROTOCOL_VERSION, s.state.features()))


def on_device_count(s: Session, ev: DeviceCount) -> int:
    return s.respond(DeviceCountReply(len(s.state.devices)))


def on_alloc_buffer(s: Session, ev: AllocBuffer) -> int:
    dev = s.device(ev.device, "ALLOC_BUFFER")
    buf = s.state.registry.alloc(ev.device, dev, ev.size, s.id)
    if buf is None:
        log.warning("session %d: ALLOC_BUFFER of %d bytes failed on %s", s.id, ev.size, dev.name)
        return s.respond(AllocBufferReply(0, 0))
    return s.respond(AllocBufferReply(buf.handle, buf.size))


def on_get_alignment(s: Session, ev: GetAlignment) -> int:
    return s.respond(GetAlignmentReply(s.device(ev.device, "GET_ALIGNMENT").alignment))


def on_get_max_size(s: Session, ev: GetMaxSize) -> int:
    return s.respond(GetMaxSizeReply(s.device(ev.device, "GET_MAX_SIZE").max_size))


def on_get_device_memory(s: Session, ev: GetDeviceMemory) -> int:
    free, total = s.device(ev.device, "GET_DEVICE_MEMORY").memory()
    return s.respond(GetDeviceMemoryReply(free, total))


def on_buffer_get_base(s: Session, ev: BufferGetBase) -> int:
    return s.respond(BufferGetBaseReply(s.buffer(ev.remote_ptr, "BUFFER_GET_BASE").base))


def on_free_buffer(s: Session, ev: FreeBuffer) -> int:
    buf = s.buffer(ev.remote_ptr, "FREE_BUFFER")
    if buf.owner != s.id:
        raise RemoteProtocolError(f"FREE_BUFFER: buffer {ev.remote_ptr:#x} belongs to another session")
    # Stored graphs may point into the freed buffer: drop them, as the stock server does.
    s.plans.clear()
    s.state.registry.free(buf)
    return 0


def on_buffer_clear(s: Session, ev: BufferClear) -> int:
    buf = s.buffer(ev.remote_ptr, "BUFFER_CLEAR")
    if buf.size:
        buf.array.fill(ev.value)
        buf.touched()
    return 0


def on_set_tensor(s: Session, ev: SetTensor) -> int:
    buf, start = s.region(ev.tensor, ev.offset, ev.size, "SET_TENSOR")
    dst = memoryview(buf.array)[start : start + ev.size]
    got = s.conn.read_body_into(dst)
    while got < ev.size:
        n = s.sock.recv_into(dst[got:])
        if n == 0:
            raise ConnectionError("peer closed in the middle of SET_TENSOR data")
        s.conn.body_received(n)
        got += n
    buf.touched()
    if ev.cache_flag and s.state.cache_dir is not None and ev.size:
        s.state.cache_store(dst)
    return 0


def on_set_tensor_hash(s: Session, ev: SetTensorHash) -> int:
    data = s.state.cache_load(ev.hash)
    if data is None:
        return s.respond(SetTensorHashReply(0))
    buf, start = s.region(ev.tensor, ev.offset, len(data), "SET_TENSOR_HASH")
    memoryview(buf.array)[start : start + len(data)] = data
    buf.touched()
    return s.respond(SetTensorHashReply(1))


def on_get_tensor(s: Session, ev: GetTensor) -> int:
    buf, start = s.region(ev.tensor, ev.offset, ev.size, "GET_TENSOR")
    header = DataReply.header(ev.size)
    if ev.size <= SMALL_RESPONSE:
        s.sock.sendall(header + buf.array[start : start + ev.size].tobytes())
    else:
        s.sock.sendall(header)
        s.sock.sendall(memoryview(buf.array)[start : start + ev.size])
    return len(header) + ev.size


def on_copy_tensor(s: Session, ev: CopyTensor) -> int:
    src_buf, src_start = s.tensor_buffer(ev.src, "COPY_TENSOR")
    dst_buf, dst_start = s.tensor_buffer(ev.dst, "COPY_TENSOR")
    n = ev.src.nbytes
    if ev.dst.data + n > dst_buf.base + dst_buf.size:
        raise RemoteProtocolError(
            f"COPY_TENSOR: {n} bytes at {ev.dst.data:#x} overflow destination buffer "
            f"[{dst_buf.base:#x}, {dst_buf.base + dst_buf.size:#x})"
        )
    with s.state.exec_lock:
        dst_buf.array[dst_start : dst_start + n] = src_buf.array[src_start : src_start + n]
    dst_buf.touched()
    return s.respond(CopyTensorReply(1))


def on_graph_compute(s: Session, ev: GraphCompute) -> int:
    dev = s.device(ev.device, "GRAPH_COMPUTE")
    plan = getattr(dev, "build_plan", build_plan)(ev, s.server.registry)  # ggml device: its own plan
    s.plans.pop(ev.device, None)
    _run(s, plan, dev)
    s.plans[ev.device] = plan
    return 0


def on_graph_recompute(s: Session, ev: GraphRecompute) -> int:
    dev = s.device(ev.device, "GRAPH_RECOMPUTE")
    plan = s.plans.get(ev.device)
    if plan is None:
        raise RemoteProtocolError(f"GRAPH_RECOMPUTE: no stored graph for device {ev.device}")
    _run(s, plan, dev)
    return 0


def _run(s: Session, plan: Plan, dev) -> None:
    t0 = time.perf_counter()
    with s.server.exec_lock:
        plan.run(dev.xp)
    s.counters.graph_computes += 1
    s.counters.compute_seconds += time.perf_counter() - t0


def on_init_tensor(s: Session, ev: InitTensor) -> int:
    # The CPU buffer type has no init_tensor hook: validating the tensor is all there is.
    check_type(ev.tensor, "INIT_TENSOR")
    buf = s.state.registry.get(ev.tensor.buffer)
    if buf is not None:
        check_extent(buf, ev.tensor, "INIT_TENSOR")
    return 0


def on_get_alloc_size(s: Session, ev: GetAllocSize) -> int:
    dev = s.device(ev.device, "GET_ALLOC_SIZE")
    check_type(ev.tensor, "GET_ALLOC_SIZE")
    buf = s.state.registry.get(ev.tensor.buffer)
    if buf is not None:
        check_extent(buf, ev.tensor, "GET_ALLOC_SIZE")
    return s.respond(GetAllocSizeReply(dev.alloc_size(ev.tensor.nbytes)))


def on_memset_tensor(s: Session, ev: MemsetTensor) -> int:
    buf, start = s.tensor_buffer(ev.tensor, "MEMSET_TENSOR")
    n = ev.tensor.nbytes
    if ev.offset > n or ev.size > n - ev.offset:
        raise RemoteProtocolError(
            f"MEMSET_TENSOR: offset {ev.offset} + size {ev.size} beyond tensor of {n} bytes"
        )
    buf.array[start + ev.offset : start + ev.offset + ev.size] = ev.value
    buf.touched()
    return 0


def on_copy_tensor_to(s: Session, ev: CopyTensorTo) -> int:
    landed = serve_copy(s.state, s.peer_links, ev, s.local_addr(), f"session {s.id} {s.peer}")
    return s.respond(CopyTensorToReply(landed))


def on_peer_barrier(s: Session, ev: PeerBarrier) -> int:
    # Commands on one connection are served in order: reaching this proves earlier writes landed.
    # 0 when P2P is off now, so a source's cached link stops counting as a successful copy.
    return s.respond(PeerBarrierReply(1 if s.state.p2p_enabled else 0))


HANDLERS = {
    Hello: on_hello,
    DeviceCount: on_device_count,
    AllocBuffer: on_alloc_buffer,
    GetAlignment: on_get_alignment,
    GetMaxSize: on_get_max_size,
    GetDeviceMemory: on_get_device_memory,
    BufferGetBase: on_buffer_get_base,
    FreeBuffer: on_free_buffer,
    BufferClear: on_buffer_clear,
    SetTensor: on_set_tensor,
    SetTensorHash: on_set_tensor_hash,
    GetTensor: on_get_tensor,
    CopyTensor: on_copy_tensor,
    GraphCompute: on_graph_compute,
    GraphRecompute: on_graph_recompute,
    InitTensor: on_init_tensor,
    GetAllocSize: on_get_alloc_size,
    MemsetTensor: on_memset_tensor,
    CopyTensorTo: on_copy_tensor_to,
    PeerBarrier: on_peer_barrier,
}
