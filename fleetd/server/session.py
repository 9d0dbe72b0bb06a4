"""One session per connection: the wsproto-style blocking loop over a ServerConnection.

recv_into -> receive_data -> next_event -> HANDLERS[type(event)]. A peer's protocol error closes
this socket with one log line; our own bug logs a traceback and closes this socket; the daemon
and every other session carry on.
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
from fleetd.server.stats import CommandCounters
from fleetd.wire import (
    NEED_DATA,
    AllocBuffer,
    BufferClear,
    BufferGetBase,
    Cmd,
    CopyTensor,
    CopyTensorTo,
    DeviceCount,
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
    RpcTensor,
    ServerConnection,
    SetTensor,
    SetTensorHash,
    check_type,
    data_response_header,
    encode_response,
    hello_response,
)

if TYPE_CHECKING:
    from fleetd.server.daemon import Server

log = logging.getLogger("fleetd.session")

RECV_CHUNK = 64 * 1024
# A read that starts a new request asks for less: every fixed-size request fits (GET_ALLOC_SIZE,
# the largest, is 3269 bytes), and of a SET_TENSOR no more than this of its data takes the
# buffered path; the rest goes with recv_into straight into the tensor's buffer.
FIRST_READ = 4 * 1024
# Responses up to this size are joined with their header into one send (one segment, one syscall).
SMALL_RESPONSE = 64 * 1024


class Session:
    def __init__(self, server: Server, sock: socket.socket, peer: tuple, sid: int) -> None:
        self.server = server
        self.sock = sock
        self.peer = f"{peer[0]}:{peer[1]}"
        self.id = sid
        self.started = time.time()
        self.conn = ServerConnection()
        self.counters = CommandCounters()
        self.plans: dict[int, Plan] = {}  # stored graph per device
        self.peer_links = None  # set by the peer-copy extension on first use
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
        record = self.counters.record if self.server.config.count_commands else _not_counted
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
        if self.peer_links is not None:
            self.peer_links.close()
        for buf in self.server.registry.owned_by(self.id):
            self.server.registry.free(buf)
        self.plans.clear()
        self.server.session_ended(self)

    # -- helpers ----------------------------------------------------------------------------

    def respond(self, cmd: Cmd, *values) -> int:
        data = encode_response(cmd, *values)
        self.sock.sendall(data)
        return len(data)

    def device(self, index: int, what: str):
        devices = self.server.devices
        if index >= len(devices):
            raise RemoteProtocolError(f"{what}: device {index} out of range (have {len(devices)})")
        return devices[index]

    def buffer(self, handle: int, what: str) -> Buffer:
        buf = self.server.registry.get(handle)
        if buf is None:
            raise RemoteProtocolError(f"{what}: unknown buffer {handle:#x}")
        return buf

    def tensor_buffer(self, t: RpcTensor, what: str) -> tuple[Buffer, int]:
        """Deserialize with a non-null buffer, as the memory commands require; returns the
        buffer and the tensor's offset in it."""
        check_type(t, what)
        buf = self.buffer(t.buffer, what)
        return buf, check_extent(buf, t, what)

    def region(self, t: RpcTensor, offset: int, size: int, what: str) -> tuple[Buffer, int]:
        """SET/GET region rule of the stock server plus its `offset + size <= nbytes` assert."""
        buf, start = self.tensor_buffer(t, what)
        p1 = buf.base + buf.size
        at = t.data + offset
        if at < buf.base or at >= p1 or size > p1 - at:
            raise RemoteProtocolError(
                f"{what}: region {at:#x}+{size} outside buffer [{buf.base:#x}, {p1:#x})"
            )
        if offset + size > t.nbytes:
            raise RemoteProtocolError(
                f"{what}: offset {offset} + size {size} beyond tensor of {t.nbytes} bytes"
            )
        return buf, start + offset


def _not_counted(cmd: int, request_bytes: int, response_bytes: int) -> None:
    """Stands in for CommandCounters.record when counting is off (benchmarks/transfer.py
    measures what counting costs against this)."""


# -- handlers: one per request type, each returns the response bytes it sent ---------------------


def on_hello(s: Session, ev: Hello) -> int:
    data = hello_response(s.server.features())
    s.sock.sendall(data)
    return len(data)


def on_device_count(s: Session, ev: DeviceCount) -> int:
    return s.respond(Cmd.DEVICE_COUNT, len(s.server.devices))


def on_alloc_buffer(s: Session, ev: AllocBuffer) -> int:
    dev = s.device(ev.device, "ALLOC_BUFFER")
    buf = s.server.registry.alloc(ev.device, dev, ev.size, s.id)
    if buf is None:
        log.warning("session %d: ALLOC_BUFFER of %d bytes failed on %s", s.id, ev.size, dev.name)
        return s.respond(Cmd.ALLOC_BUFFER, 0, 0)
    return s.respond(Cmd.ALLOC_BUFFER, buf.handle, buf.size)


def on_get_alignment(s: Session, ev: GetAlignment) -> int:
    return s.respond(Cmd.GET_ALIGNMENT, s.device(ev.device, "GET_ALIGNMENT").alignment)


def on_get_max_size(s: Session, ev: GetMaxSize) -> int:
    return s.respond(Cmd.GET_MAX_SIZE, s.device(ev.device, "GET_MAX_SIZE").max_size)


def on_get_device_memory(s: Session, ev: GetDeviceMemory) -> int:
    free, total = s.device(ev.device, "GET_DEVICE_MEMORY").memory()
    return s.respond(Cmd.GET_DEVICE_MEMORY, free, total)


def on_buffer_get_base(s: Session, ev: BufferGetBase) -> int:
    return s.respond(Cmd.BUFFER_GET_BASE, s.buffer(ev.remote_ptr, "BUFFER_GET_BASE").base)


def on_free_buffer(s: Session, ev: FreeBuffer) -> int:
    buf = s.buffer(ev.remote_ptr, "FREE_BUFFER")
    if buf.owner != s.id:
        raise RemoteProtocolError(f"FREE_BUFFER: buffer {ev.remote_ptr:#x} belongs to another session")
    # Stored graphs may point into the freed buffer: drop them, as the stock server does.
    s.plans.clear()
    s.server.registry.free(buf)
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
    if ev.cache_flag and s.server.cache_dir is not None and ev.size:
        s.server.cache_store(dst)
    return 0


def on_set_tensor_hash(s: Session, ev: SetTensorHash) -> int:
    data = s.server.cache_load(ev.hash)
    if data is None:
        return s.respond(Cmd.SET_TENSOR_HASH, 0)
    buf, start = s.region(ev.tensor, ev.offset, len(data), "SET_TENSOR_HASH")
    memoryview(buf.array)[start : start + len(data)] = data
    buf.touched()
    return s.respond(Cmd.SET_TENSOR_HASH, 1)


def on_get_tensor(s: Session, ev: GetTensor) -> int:
    buf, start = s.region(ev.tensor, ev.offset, ev.size, "GET_TENSOR")
    header = data_response_header(ev.size)
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
    with s.server.exec_lock:
        dst_buf.array[dst_start : dst_start + n] = src_buf.array[src_start : src_start + n]
    dst_buf.touched()
    return s.respond(Cmd.COPY_TENSOR, 1)


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
    buf = s.server.registry.get(ev.tensor.buffer)
    if buf is not None:
        check_extent(buf, ev.tensor, "INIT_TENSOR")
    return 0


def on_get_alloc_size(s: Session, ev: GetAllocSize) -> int:
    dev = s.device(ev.device, "GET_ALLOC_SIZE")
    check_type(ev.tensor, "GET_ALLOC_SIZE")
    buf = s.server.registry.get(ev.tensor.buffer)
    if buf is not None:
        check_extent(buf, ev.tensor, "GET_ALLOC_SIZE")
    return s.respond(Cmd.GET_ALLOC_SIZE, dev.alloc_size(ev.tensor.nbytes))


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
    return s.server.peer_copy(s, ev)


def on_peer_barrier(s: Session, ev: PeerBarrier) -> int:
    # Commands on one connection are served in order: reaching this proves earlier writes landed.
    # 0 when P2P is off now, so a source's cached link stops counting as a successful copy.
    return s.respond(Cmd.PEER_BARRIER, 1 if s.server.p2p_enabled else 0)


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
