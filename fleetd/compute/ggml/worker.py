"""The contained side of the ggml device: one process per session, forked by the fork server.

It maps only the buffers its daemon hands it (memfds, one per buffer), builds the validated
graphs it is sent as ggml graphs over those mappings and computes them. Before its first
message it drops to the worker user and loads the seccomp filter (fleetd.compute.sandbox), so
a kernel that goes wrong can hurt only its own session: the other sessions' bytes are not in
its address space, and it can neither open nor connect nor exec. Anything unexpected ends the
process; the daemon sees its channel close and closes that session's connection.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import socket
import struct
from dataclasses import dataclass, field

import numpy as np

from fleetd.compute import native
from fleetd.compute.ggml import lib as ggml
from fleetd.compute.ggml.channel import (
    MSG_COMPUTE,
    MSG_FORGET,
    MSG_RUN,
    MSG_SERVE,
    REPLY_DONE,
    REPLY_FAILED,
    REPLY_READY,
    REPLY_REFUSED,
    REPLY_SERVED,
    RUN,
    SERVE,
    SERVE_REGION,
    SERVED,
    recv_message,
    send_message,
)

# GGML_TYPE_I32, GGML_TYPE_I64
INDEX_DTYPES: dict[int, np.dtype] = {26: np.dtype("<i4"), 27: np.dtype("<i8")}
# Row ids up to this many are checked as a Python list: a decode step's token id and KV slots
# (a few each) then cost ~1 us instead of numpy's ~4 us per reduction; more go through numpy.
SMALL_INDEX = 64
MAX_MESSAGE = 1 << 30


@dataclass
class GraphSpec:
    """A graph the daemon validated, as plain data: what the worker needs to build it in ggml.

    `wire` holds the wire records of every reachable tensor (in `order`); their `buffer` and
    `data` fields are the daemon's handles and addresses, which the worker maps to its own."""

    order: np.ndarray  # uint64 wire ids
    wire: np.ndarray  # wire tensor records, one per id in `order`
    nodes: list[int]
    handles: list[int]  # the buffers (with bytes) the graph reaches
    # (tensor id, handle, offset, nbytes, type, ne, nb, bound, what): row ids copied out,
    # checked, and read by the kernel from the copy
    index_checks: list[tuple] = field(default_factory=list)
    # (tensor id, handle, offset, nbytes, padded nbytes): read into a copy of the padded size
    padded: list[tuple] = field(default_factory=list)


class Mapping:
    """One buffer's memfd mapped into this process."""

    def __init__(self, fd: int, base: int, size: int) -> None:
        self.pages = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        probe = ctypes.c_char.from_buffer(self.pages)
        self.address = ctypes.addressof(probe)
        del probe  # the address stays valid while the mapping lives; no export keeps it open
        self.base, self.size = base, size

    def bytes_at(self, offset: int, n: int) -> np.ndarray:
        return np.frombuffer(self.pages, np.uint8, n, offset)


class WorkerPlan:
    """A GraphSpec built in ggml over this process's mappings."""

    def __init__(self, lib: ggml.GgmlLibrary, spec: GraphSpec, maps: dict[int, Mapping]) -> None:
        self.lib, self.handles = lib, set(spec.handles)
        self.ctx: int | None = None
        self.graph: int | None = None
        self.buffers: list[int] = []
        # (source bytes, private copy's bytes, typed view, bound, what)
        self.checks: list[tuple[memoryview, memoryview, np.ndarray, int, str]] = []
        self.padded: list[tuple[np.ndarray, np.ndarray]] = []  # (source view, private copy)
        private: dict[int, int] = {}
        native_checks = []
        for tid, handle, off, nbytes, typ, ne, nb, bound, what in spec.index_checks:
            copy = np.empty(nbytes, np.uint8)
            view = np.ndarray(ne[::-1], INDEX_DTYPES[typ], buffer=copy, strides=nb[::-1])
            source = maps[handle].bytes_at(off, nbytes)
            # .data: memoryview(a), which numpy's stubs allow only from Python 3.12
            self.checks.append((source.data, copy.data, view, bound, what))
            native_checks.append(
                native.WorkerIndexCheck(
                    source.ctypes.data,
                    copy.ctypes.data,
                    nbytes,
                    tuple(ne),
                    tuple(nb),
                    bound,
                    INDEX_DTYPES[typ].itemsize,
                )
            )
            private[tid] = copy.ctypes.data
        for tid, handle, off, nbytes, padded_nbytes in spec.padded:
            copy = np.ones(padded_nbytes // 4, np.float32).view(np.uint8)
            source = maps[handle].bytes_at(off, nbytes) if handle else np.empty(0, np.uint8)
            self.padded.append((source, copy))
            private[tid] = copy.ctypes.data
        if len(spec.order):
            self._build(spec, maps, private)
        # what worker_loop.c needs to run it (the arrays above stay alive with this plan)
        self._native_checks = (native.WorkerIndexCheck * len(native_checks))(*native_checks)
        self._native_copies = (native.WorkerCopy * len(self.padded))(
            *(native.WorkerCopy(s.ctypes.data, c.ctypes.data, s.size) for s, c in self.padded)
        )

    def native_state(self, sock: socket.socket, backend: int) -> native.WorkerState | None:
        """The loop state for worker_loop.c, or None when there is no graph to run (Python
        answers that case)."""
        if self.graph is None:
            return None
        lib = self.lib
        return native.WorkerState(
            fd=sock.fileno(),
            backend=backend,
            graph=self.graph,
            compute=lib.function_address("ggml_backend_graph_compute"),
            set_threads=lib.function_address("ggml_backend_cpu_set_n_threads"),
            n_copies=len(self._native_copies),
            copies=self._native_copies,
            n_checks=len(self._native_checks),
            checks=self._native_checks,
        )

    def _build(self, spec: GraphSpec, maps: dict[int, Mapping], private: dict[int, int]) -> None:
        """One ggml_tensor per reachable wire tensor, filled column-wise from the wire records
        (per-field ctypes writes cost ~70 us per tensor)."""
        lib, order, wire = self.lib, spec.order, spec.wire
        n = len(order)
        n_nodes = max(1, len(spec.nodes))
        mem = lib.ggml_tensor_overhead() * n + lib.ggml_graph_overhead_custom(n_nodes, False)
        self.ctx = lib.ggml_init(ggml.GgmlInitParams(mem, None, True))
        if not self.ctx:
            raise MemoryError("ggml_init failed")
        ne = (ctypes.c_int64 * 4)(1, 1, 1, 1)
        addrs = np.empty(n, np.uint64)
        for i in range(n):
            addrs[i] = ctypes.addressof(lib.ggml_new_tensor(self.ctx, int(wire["type"][i]), 1, ne).contents)
        out = np.zeros(n, ggml.TENSOR_DTYPE)
        for name in ("type", "ne", "nb", "op", "op_params", "flags", "view_offs"):
            out[name] = wire[name]
        names = np.frombuffer(wire["name"].tobytes(), np.uint8).reshape(n, -1).copy()
        names[:, -1] = 0  # ggml_set_name keeps 63 bytes and a terminator
        out["name"] = names.view(out.dtype["name"]).ravel()
        sorter = np.argsort(order)

        def address_of(wire_ids: np.ndarray) -> np.ndarray:
            pos = np.searchsorted(order, wire_ids, sorter=sorter).clip(0, n - 1)
            return np.where(wire_ids == 0, np.uint64(0), addrs[sorter[pos]])

        out["src"] = address_of(wire["src"])
        out["view_src"] = address_of(wire["view_src"])
        for handle in spec.handles:  # each buffer becomes one ggml CPU buffer over its mapping
            m = maps[handle]
            mask = wire["buffer"] == np.uint64(handle)
            bb = lib.ggml_backend_cpu_buffer_from_ptr(m.address, m.size)
            self.buffers.append(bb)
            out["buffer"][mask] = bb
            out["data"][mask] = wire["data"][mask] - np.uint64(m.base) + np.uint64(m.address)
        if private:
            pos = np.searchsorted(order, np.fromiter(private, np.uint64), sorter=sorter)
            out["data"][sorter[pos]] = np.fromiter(private.values(), np.uint64)
        step = int(addrs[1] - addrs[0]) if n > 1 else 0
        if n > 1 and np.all(np.diff(addrs) == step) and step >= out.itemsize:
            # the context lays its objects out back to back: one strided write
            span = (ctypes.c_char * (step * (n - 1) + out.itemsize)).from_address(int(addrs[0]))
            np.ndarray(n, out.dtype, buffer=memoryview(span), strides=(step,))[:] = out
        else:
            for i, a in enumerate(addrs):
                ctypes.memmove(int(a), out[i : i + 1].ctypes.data, out.itemsize)
        self.graph = lib.ggml_new_graph_custom(self.ctx, n_nodes, False)
        pos = np.searchsorted(order, np.asarray(spec.nodes, np.uint64), sorter=sorter)
        for a in addrs[sorter[pos]].tolist():
            lib.ggml_graph_add_node(self.graph, ctypes.cast(a, ggml.ggml_tensor_p))

    def run(self, backend: int) -> tuple[int, str]:
        """Refresh the private copies, check the row ids, compute: (REPLY_* kind, text) for the daemon."""
        for data, padded in self.padded:
            padded[: len(data)] = data
        for source, copy, view, bound, what in self.checks:
            copy[:] = source
            if view.size <= SMALL_INDEX:
                ids = view.ravel().tolist()  # the elements the kernel reads, strides and all
                bad = bool(ids) and (min(ids) < 0 or max(ids) >= bound)
            else:
                bad = int(view.min()) < 0 or int(view.max()) >= bound
            if bad:
                return REPLY_REFUSED, f"GRAPH_COMPUTE: {what} holds a row outside [0, {bound})"
        if self.graph is None:  # a graph without nodes: nothing to compute, as in ggml
            return REPLY_DONE, ""
        status = self.lib.ggml_backend_graph_compute(backend, self.graph)
        if status != ggml.GGML_STATUS_SUCCESS:
            return self.failed(status)
        return REPLY_DONE, ""

    def refused(self, check: int) -> tuple[int, str]:
        *_, bound, what = self.checks[check]
        return REPLY_REFUSED, f"GRAPH_COMPUTE: {what} holds a row outside [0, {bound})"

    def failed(self, status: int) -> tuple[int, str]:
        return REPLY_FAILED, f"ggml compute: {self.lib.ggml_status_to_string(status).decode()}"

    def free(self) -> None:
        for b in self.buffers:
            self.lib.ggml_backend_buffer_free(b)
        self.buffers.clear()
        if self.ctx:
            self.lib.ggml_free(self.ctx)
            self.ctx = None
        self.checks.clear()
        self.padded.clear()


STINT_CAPACITY = 64 * 1024  # the session's receive chunk: a request larger goes to the daemon
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class Stint:
    """The session's connection served in this worker for a while (MSG_SERVE), so a decode step
    is one process's wake-up, as on a stock server: fastpath.c's loop, the same checks as the
    daemon's, over this worker's own mappings (a region it does not map stays the daemon's), the
    built graph's GRAPH_RECOMPUTE computed in place. The loop stops at the first request that is
    not a plain SET_TENSOR, GET_TENSOR, GET_ALIGNMENT or that GRAPH_RECOMPUTE, at the budget or
    after an idle wait, and what it read of the next request goes back to the daemon."""

    def __init__(self) -> None:
        self.ctx: native.FastContext | None = None  # in the daemon's page: its counts are live there
        self.loop = native.fast_loop()
        self.buffer = ctypes.create_string_buffer(STINT_CAPACITY)
        self.blck, self.tsize = native.type_tables()
        # A stint's graph reaches only its session's buffers, which nobody frees while the
        # daemon's session thread waits for the stint: the frees count and the compute count
        # are the stint's own.
        self.frees = ctypes.c_uint64(0)
        self.computing = ctypes.c_int32(0)

    @staticmethod
    def nothing_served(payload: bytes) -> bytes:
        """REPLY_SERVED's payload for a stint that served nothing (LOOP_PYTHON, no byte read):
        the daemon then keeps the connection."""
        n_regions = SERVE.unpack_from(payload)[3]
        return SERVED.pack(native.LOOP_PYTHON, 0, 0, 0, n_regions, 0) + bytes(n_regions)

    def serve(
        self, fds: list[int], payload: bytes, maps: dict[int, Mapping], plan: WorkerPlan, state
    ) -> bytes:
        """One stint on the client's socket (fds[0]; fds[1] is the daemon's page for the loop's
        context; the caller closes both) with `plan` built (`state`, its native_state); the
        REPLY_SERVED payload. The daemon zeroed the page before it sent this, and reads what
        the loop served from there."""
        client_fd, page_fd = fds
        if self.ctx is None:
            self.page = mmap.mmap(page_fd, ctypes.sizeof(native.FastContext), mmap.MAP_SHARED)
            self.ctx = native.FastContext.from_buffer(self.page)
        device, threads, budget_ms, n_regions, n_written, n_align = SERVE.unpack_from(payload)
        at = SERVE.size
        mine: list[tuple[int, int, int, int, int]] = []  # (daemon's index, handle, base, size, address)
        for i in range(n_regions):
            handle, base, size = SERVE_REGION.unpack_from(payload, at)
            at += SERVE_REGION.size
            m = maps.get(handle)
            if m is not None and m.base == base and m.size == size:
                mine.append((i, handle, base, size, m.address))
        local = {daemon_index: k for k, (daemon_index, *_) in enumerate(mine)}
        written = []
        for _ in range(n_written):
            (i,) = _U32.unpack_from(payload, at)
            at += 4
            if i not in local:  # the graph writes a region not mapped here: not a stint's
                return self.nothing_served(payload)
            written.append(local[i])
        ctx = self.ctx
        ctx.have = 0
        regions = (native.FastRegion * len(mine))()
        for r, (_, handle, base, size, address) in zip(regions, mine):
            r.handle, r.base, r.size, r.host = handle, base, size, address
        ctx.fd, ctx.regions, ctx.n_regions = client_fd, regions, len(mine)
        ctx.blck, ctx.tsize, ctx.n_types = self.blck, self.tsize, len(self.blck)
        ctx.n_align = min(n_align, native.FAST_DEVICES)
        for d in range(ctx.n_align):
            (ctx.align[d],) = _U64.unpack_from(payload, at + 8 * d)
        rc = ctx.rc
        written_ids = (ctypes.c_int32 * len(written))(*written)
        rc.device, rc.worker_fd, rc.threads = device, -1, threads
        rc.n_written, rc.written = len(written), written_ids
        rc.frees, rc.frees_seen = ctypes.pointer(self.frees), self.frees.value
        rc.computing = ctypes.pointer(self.computing)
        rc.inline_worker = ctypes.addressof(state)
        answer = self.loop(ctypes.byref(ctx), self.buffer, STINT_CAPACITY, -1, budget_ms)
        failed, text = 0, b""
        if answer == native.LOOP_WORKER:  # the graph did not compute: the daemon says why
            failed, message = (
                plan.refused(state.failed)
                if rc.inline_status == native.WORKER_REFUSED
                else plan.failed(state.failed)
            )
            text = message.encode()
        flags = bytearray(n_regions)
        for (daemon_index, *_), r in zip(mine, regions):
            flags[daemon_index] = 1 if r.written else 0
        left = ctx.have
        return b"".join(
            (
                SERVED.pack(answer, failed, ctx.error, left, n_regions, len(text)),
                bytes(flags),
                self.buffer.raw[:left],
                text,
            )
        )


def warm_up(lib: ggml.GgmlLibrary, backend: int) -> None:
    """One tiny graph before the sandbox closes: the CPU backend's lazy set-up (feature
    detection, the thread pool) happens while it may still read /proc and /sys."""
    ctx = lib.ggml_init(ggml.GgmlInitParams(1 << 20, None, False))
    try:
        ne = (ctypes.c_int64 * 4)(64, 1, 1, 1)
        a = lib.ggml_new_tensor(ctx, 0, 1, ne)
        b = lib.ggml_new_tensor(ctx, 0, 1, ne)
        ctypes.memset(a.contents.data, 0, 256)
        ctypes.memset(b.contents.data, 0, 256)
        graph = lib.ggml_new_graph_custom(ctx, 4, False)
        lib.ggml_graph_add_node(graph, lib.ggml_add(ctx, a, b))
        lib.ggml_backend_graph_compute(backend, graph)
    finally:
        lib.ggml_free(ctx)


def serve(sock: socket.socket, lib: ggml.GgmlLibrary, backend: int, threads: int, ready: str) -> None:
    """The worker's loop: messages in, one reply per compute. Returns when the daemon closes."""
    current_threads = threads
    maps: dict[int, Mapping] = {}
    plans: dict[int, WorkerPlan] = {}
    send_message(sock, REPLY_READY, ready.encode())
    key = -1  # the plan a RUN computes (a RUN before any COMPUTE: KeyError, the process ends)
    loop = native.worker_loop()  # RUNs in C, while the plan stays; None: all in Python
    state: native.WorkerState | None = None
    state_of: WorkerPlan | None = None  # the plan `state` points into (its arrays, its graph)
    stint = Stint()
    while True:
        if loop is not None and key in plans:
            if state_of is not plans[key]:
                state_of = plans[key]
                state = state_of.native_state(sock, backend)
            if state is not None:
                state.threads = current_threads
                answer = loop(ctypes.byref(state))
                current_threads = state.threads
                if answer == native.WORKER_CLOSED:
                    return
                if answer == native.WORKER_ERROR:
                    raise OSError(ctypes.get_errno(), "the channel to the daemon failed")
                if answer in (native.WORKER_REFUSED, native.WORKER_FAILED):
                    plan = plans[key]
                    status, text = (
                        plan.refused(state.failed)
                        if answer == native.WORKER_REFUSED
                        else plan.failed(state.failed)
                    )
                    send_message(sock, status, text.encode())
                    continue
        try:
            kind, payload, fds = recv_message(sock, MAX_MESSAGE, max_fds=1 << 16)
        except EOFError:
            return
        if kind == MSG_SERVE:
            try:
                if len(fds) != 2:
                    raise ValueError(f"MSG_SERVE with {len(fds)} fds")
                plan = plans[key]
                if state_of is not plan:
                    state_of = plan
                    state = plan.native_state(sock, backend)
                if state is None or loop is None:  # nothing to compute in C: all the daemon's
                    served = Stint.nothing_served(payload)
                else:
                    state.threads = current_threads
                    served = stint.serve(fds, payload, maps, plan, state)
                    current_threads = state.threads
            finally:
                for fd in fds:
                    os.close(fd)
            send_message(sock, REPLY_SERVED, served)
            continue
        if kind == MSG_RUN:  # the hot path: no pickle, the graph and mappings as they were
            (want,) = RUN.unpack(payload)
            if want != current_threads:
                lib.ggml_backend_cpu_set_n_threads(backend, want)
                current_threads = want
            status, text = plans[key].run(backend)
            send_message(sock, status, text.encode())
            continue
        msg = pickle.loads(payload)
        for handle in msg.get("unmap", ()):
            for stale in [k for k, p in plans.items() if handle in p.handles]:
                plans.pop(stale).free()
            m = maps.pop(handle, None)
            if m is not None:
                m.pages.close()
        for (handle, base, size), fd in zip(msg.get("maps", ()), fds):
            try:
                maps[handle] = Mapping(fd, base, size)
            finally:
                os.close(fd)  # the mapping keeps the memory; the worker holds no fd
        if kind == MSG_FORGET:
            for stale in msg.get("keys", ()):
                if stale in plans:
                    plans.pop(stale).free()
            continue
        if kind != MSG_COMPUTE:
            raise ValueError(f"unknown message {kind}")
        for stale in msg.get("forget", ()):
            if stale in plans:
                plans.pop(stale).free()
        key = msg["key"]
        if msg.get("spec") is not None:
            if key in plans:
                plans.pop(key).free()
            plans[key] = WorkerPlan(lib, msg["spec"], maps)
        want = msg.get("threads") or threads
        if want != current_threads:
            lib.ggml_backend_cpu_set_n_threads(backend, want)
            current_threads = want
        status, text = plans[key].run(backend)
        send_message(sock, status, text.encode())
