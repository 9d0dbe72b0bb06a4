"""`--device cpu`: ggml's own CPU kernels (the stock server's), run over fleetd's buffers.

fleetd keeps owning buffers, sessions, validation and the wire. A GRAPH_COMPUTE is validated as
the stock `create_node` does (ids, types, buffers, extents), every node is checked against its
op's rule (rules.py), and the graph becomes a ggml graph once: one `ggml_tensor` per wire tensor
in a no_alloc context, data pointers into our buffers, src/view links, op, op_params and flags as
sent. The plan is kept for GRAPH_RECOMPUTE and computed in one `ggml_backend_graph_compute` call.

This module imports nothing of fleetd.compute outside this package: `make_device` in
fleetd/compute/device.py imports it, and buffers/views import that module.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from fleetd.compute.ggml import lib as ggml
from fleetd.compute.ggml.rules import IndexUse, PaddedRead, Refused, TypeCaps, check_node, made_by
from fleetd.compute.ggml.writes import WriteLog
from fleetd.compute.host_memory import host_pages
from fleetd.compute.reachable import reachable_tensors
from fleetd.errors import ComputeError, RemoteProtocolError
from fleetd.wire import METADATA_OPS, TYPE_TRAITS, GgmlType, GraphCompute, RpcTensor
from fleetd.wire.ggml import GGML_OP_COUNT

INDEX_DTYPES = {GgmlType.I32: np.dtype("<i4"), GgmlType.I64: np.dtype("<i8")}


def default_threads() -> int:
    """`fleetd -t N` sets OMP_NUM_THREADS; without it, the stock server's default."""
    n = os.environ.get("OMP_NUM_THREADS", "")
    return int(n) if n.isdigit() and int(n) > 0 else max(1, (os.cpu_count() or 2) // 2)


class BackendPool:
    """CPU backends, one per graph computing at a time: a backend owns one work buffer."""

    def __init__(self, lib: ggml.GgmlLibrary, threads: int) -> None:
        self._lib, self.threads = lib, threads
        self._free: list[int] = []
        self._lock = threading.Lock()
        self.created = 0

    def acquire(self) -> int:
        with self._lock:
            if self._free:
                return self._free.pop()
            self.created += 1
        backend = self._lib.ggml_backend_cpu_init()
        if not backend:
            raise ComputeError("ggml_backend_cpu_init failed")
        self._lib.ggml_backend_cpu_set_n_threads(backend, self.threads)
        return backend

    def release(self, backend: int) -> None:
        with self._lock:
            self._free.append(backend)


@dataclass(slots=True)
class IndexCheck:
    """Row numbers that no node of the graph writes. Before each run they are copied out of the
    buffer into `private` (the kernel reads that copy: another session's SET_TENSOR cannot change
    them between the check and the kernel) and checked there."""

    tensor: int  # wire id
    source: np.ndarray  # the index tensor's bytes in its buffer
    private: np.ndarray  # a copy the ggml tensor points at
    view: np.ndarray  # the copy, typed and strided as the wire says
    bound: int
    what: str


class GgmlPlan:
    """A validated wire graph as a ggml graph over our buffers; computed in one call."""

    def __init__(self, device: GgmlCpuDevice, n_nodes: int) -> None:
        self.device, self.n_nodes = device, n_nodes
        self.keep_alive: list = []  # the buffers' arrays: a freed buffer's memory stays valid here
        self.index_checks: list[IndexCheck] = []
        self.padded: list[tuple[np.ndarray, np.ndarray]] = []  # (bytes in a buffer, their padded copy)
        self.written: list = []  # Buffers the graph writes (their generation is bumped)
        self.private_data: dict[int, int] = {}  # tensor id -> address of its checked copy
        self.graph = None
        self.foreign = _Foreign(device)
        weakref.finalize(self, self.foreign.free)

    def run(self, xp=None) -> None:  # xp: the numpy plan's signature, unused here
        for source, private in self.padded:
            private[: len(source)] = source
        for c in self.index_checks:
            c.private[:] = c.source
            if int(c.view.min()) < 0 or int(c.view.max()) >= c.bound:
                raise RemoteProtocolError(f"GRAPH_COMPUTE: {c.what} holds a row outside [0, {c.bound})")
        if self.graph is None:  # a graph without nodes: nothing to compute, as in ggml
            return
        lib, pool = self.device.lib, self.device.backends
        backend = pool.acquire()
        try:
            status = lib.ggml_backend_graph_compute(backend, self.graph)
        finally:
            pool.release(backend)
        for buf in self.written:
            buf.touched()
        if status != ggml.GGML_STATUS_SUCCESS:
            raise ComputeError(f"ggml compute: {lib.ggml_status_to_string(status).decode()}")


class _Foreign:
    """What a plan holds in the library: its context and the buffers wrapping our memory."""

    def __init__(self, device: GgmlCpuDevice) -> None:
        self.lib, self.device, self.ctx, self.buffers = device.lib, device, None, []
        device.live_plans += 1

    def free(self) -> None:
        self.device.live_plans -= 1
        for b in self.buffers:
            self.lib.ggml_backend_buffer_free(b)
        self.buffers.clear()
        if self.ctx:
            self.lib.ggml_free(self.ctx)
            self.ctx = None


class GgmlCpuDevice:
    """Same interface as fleetd.compute.device.NumpyDevice (not a subclass: see the module doc)."""

    name = "CPU"
    kind = "ggml"
    xp = np
    alignment = 32  # TENSOR_ALIGNMENT: ggml_backend_cpu_buffer_from_ptr asserts it
    max_size = (1 << 64) - 1
    fallback = None  # it is the device `cpu` asks for

    def __init__(self, lib: ggml.GgmlLibrary, threads: int | None = None) -> None:
        self.lib = lib
        self.library = str(lib.cpu_path)  # which build and CPU variant computes (/v1/status)
        self.backends = BackendPool(lib, threads or default_threads())
        self.caps = _type_caps(lib)
        self.live_plans = 0  # plans whose ggml context is not freed yet (tests watch it)

    # -- what the wire asks ---------------------------------------------------------------------

    def alloc(self, size: int):
        """A flat uint8 array of `size` bytes on a page boundary (`alignment` divides it), or None."""
        return host_pages(size)

    def memory(self) -> tuple[int, int]:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return total, total

    def alloc_size(self, nbytes: int) -> int:
        return nbytes

    # The buffer registry reports each buffer's life to its device; ggml reads the bytes as they
    # are, so there is no cache to keep in step.
    dequant_cache = None

    def buffer_allocated(self, buf) -> None:
        pass

    def buffer_written(self, buf) -> None:
        pass

    def buffer_freed(self, buf) -> None:
        pass

    def describe(self) -> str:
        free, total = self.memory()
        threads = self.backends.threads
        return f"{self.name} (ggml CPU kernels, {threads} threads, {total >> 20} MiB, {free >> 20} MiB free)"

    # -- graphs ----------------------------------------------------------------------------------

    def build_plan(self, graph: GraphCompute, registry) -> GgmlPlan:
        """Validate the graph (ids, types, buffers, extents, per-op rules), then build it in ggml.
        Linear in the nodes but for a log factor: one walk checks the rules, one plans the
        checked reads against a WriteLog."""
        tensors, buffers, sizes, rows = _reachable(graph, registry)
        nodes = [tensors[nid] for nid in graph.nodes]
        writes: list[tuple[int, int, int, int]] = []  # (node index, buffer, start, end), in order
        uses: list[tuple[int, IndexUse | PaddedRead]] = []
        first_at: dict[int, int] = {}  # wire id -> the first position it is computed at
        for i, node in enumerate(nodes):
            if node.op >= GGML_OP_COUNT:
                raise Refused(f"GRAPH_COMPUTE: {node.describe()}: op {node.op} past the op enum")
            if node.op in METADATA_OPS:
                continue
            srcs = [tensors[s] if s else None for s in node.src]
            while srcs and srcs[-1] is None:
                srcs.pop()
            uses += [(i, u) for u in check_node(node, srcs, self.caps)]
            for t in (node, *[s for s in srcs if s is not None]):
                if buffers[t.id] is None and sizes[t.id]:
                    raise RemoteProtocolError(
                        f"GRAPH_COMPUTE: {t.describe()} of {node.describe()} has no memory"
                    )
            if node.flags & ggml.GGML_TENSOR_FLAG_COMPUTE:
                writes.append((i, node.buffer, node.data, node.data + sizes[node.id]))
                first_at.setdefault(node.id, i)

        plan = GgmlPlan(self, len(nodes))
        read = [(u.tensor if isinstance(u, PaddedRead) else u.index) for _, u in uses]
        log = WriteLog([w[1:] for w in writes] + [(t.buffer, t.data, t.data + t.nbytes) for t in read])
        checks: dict[int, IndexCheck] = {}
        w = 0
        for i, use in uses:  # in node order: the writes of the nodes before i, then i's reads
            while w < len(writes) and writes[w][0] < i:
                log.write(*writes[w])
                w += 1
            if isinstance(use, PaddedRead):
                self._plan_padded_read(plan, i, use, buffers, nodes, log)
            else:
                self._plan_index_check(plan, i, use, tensors, buffers, nodes, log, first_at, checks)
        self.plan_steps = log.steps[0]  # tests count plan building's work
        if tensors:
            self._build_ggml_graph(plan, graph, tensors, buffers, rows)
        return plan

    def _plan_padded_read(self, plan, consumer: int, use: PaddedRead, buffers, nodes, log):
        """The view's bytes copied before every run into an array of the size the kernel reads,
        the rest 1.0f (ROPE's freq factors past n_dims/2: read, never used)."""
        t = use.tensor
        if t.id in plan.private_data:
            return
        lo, hi = t.data, t.data + t.nbytes
        if (j := _writer_between(log, 0, t.buffer, lo, hi)) is not None:
            raise Refused(f"GRAPH_COMPUTE: {nodes[j].describe()} writes {t.describe()}, which "
                          f"{nodes[consumer].describe()} reads past its end")
        buf = buffers[t.id]
        source = buf.array[lo - buf.base : hi - buf.base] if buf is not None else np.empty(0, np.uint8)
        private = np.ones(use.nbytes // 4, np.float32).view(np.uint8)
        plan.padded.append((source, private))
        plan.private_data[t.id] = private.ctypes.data
        plan.keep_alive.append(private)

    def _plan_index_check(self, plan, consumer: int, use: IndexUse, tensors, buffers, nodes, log,
                          first_at, checks):
        """Row ids are checked on the private copy the kernel reads, unless they are the very
        tensor an ARGSORT/TOP_K before the consumer wrote whole (rules.made_by) and nothing
        rewrote since; either way no node before the consumer may write them after that."""
        idx = use.index
        root = idx
        while root.view_src and root.op in METADATA_OPS and root.view_src in tensors:
            root = tensors[root.view_src]
        producer = first_at.get(root.id)
        lo, hi = idx.data, idx.data + idx.nbytes
        if producer is not None and producer < consumer and made_by(idx, root):
            # rows of the sorted src0; in range when the consumer indexes at least that many
            src0 = tensors.get(root.src[0])
            if src0 is None or src0.ne[0] > use.bound:
                raise Refused(
                    f"GRAPH_COMPUTE: {idx.describe()} indexes {use.bound} rows but was sorted "
                    f"from {src0 and src0.ne[0]}"
                )
            after = producer + 1
        else:
            after = 0
            same = checks.get(idx.id)
            if same is not None:  # one copy per tensor, checked against the smallest bound
                same.bound = min(same.bound, use.bound)
            elif idx.nbytes:
                buf = buffers[idx.id]
                off = idx.data - buf.base
                source = buf.array[off : off + idx.nbytes]
                private = np.empty(idx.nbytes, np.uint8)
                view = np.ndarray(idx.ne[::-1], INDEX_DTYPES[idx.type], buffer=private,
                                  strides=idx.nb[::-1])
                check = checks[idx.id] = IndexCheck(idx.id, source, private, view, use.bound,
                                                    idx.describe())
                plan.index_checks.append(check)
                plan.private_data[idx.id] = private.ctypes.data
                plan.keep_alive.append(private)
        if (j := _writer_between(log, after, idx.buffer, lo, hi)) is not None:
            raise Refused(
                f"GRAPH_COMPUTE: {nodes[j].describe()} overwrites the row ids {idx.describe()} "
                f"before {nodes[consumer].describe()} reads them"
            )

    def _build_ggml_graph(self, plan: GgmlPlan, graph: GraphCompute, tensors, buffers, rows) -> None:
        """One ggml_tensor per reachable wire tensor, filled column-wise straight from the wire
        records (per-field ctypes writes cost ~70 us per tensor)."""
        lib = self.lib
        n_nodes = max(1, len(graph.nodes))
        mem = lib.ggml_tensor_overhead() * len(tensors) + lib.ggml_graph_overhead_custom(n_nodes, False)
        ctx = lib.ggml_init(ggml.GgmlInitParams(mem, None, True))
        if not ctx:
            raise ComputeError("ggml_init failed")
        plan.foreign.ctx = ctx
        order = list(tensors)
        wire = graph.tensors[np.fromiter((rows[tid] for tid in order), np.int64, len(order))]
        ne = (ctypes.c_int64 * 4)(1, 1, 1, 1)
        addrs = np.empty(len(order), np.uint64)
        for i, tid in enumerate(order):
            addrs[i] = ctypes.addressof(lib.ggml_new_tensor(ctx, tensors[tid].type, 1, ne).contents)

        out = np.zeros(len(order), ggml.TENSOR_DTYPE)
        for field in ("type", "ne", "nb", "op", "op_params", "flags", "view_offs"):
            out[field] = wire[field]
        names = np.frombuffer(wire["name"].tobytes(), np.uint8).reshape(len(order), -1).copy()
        names[:, -1] = 0  # ggml_set_name keeps 63 bytes and a terminator
        out["name"] = names.view(out.dtype["name"]).ravel()
        # links: wire ids -> the ggml_tensor addresses just made (0 stays NULL)
        ids = np.fromiter(order, np.uint64, len(order))
        sorter = np.argsort(ids)

        def address_of(wire_ids: np.ndarray) -> np.ndarray:
            pos = np.searchsorted(ids, wire_ids, sorter=sorter).clip(0, len(ids) - 1)
            return np.where(wire_ids == 0, np.uint64(0), addrs[sorter[pos]])

        out["src"] = address_of(wire["src"])
        out["view_src"] = address_of(wire["view_src"])
        # memory: each distinct buffer becomes one ggml CPU buffer over our array
        for buf in {id(b): b for b in buffers.values() if b is not None}.values():
            mask = np.fromiter((buffers[tid] is buf for tid in order), bool, len(order))
            bb = lib.ggml_backend_cpu_buffer_from_ptr(buf.array.ctypes.data, buf.size)
            plan.foreign.buffers.append(bb)
            plan.keep_alive.append(buf.array)
            out["buffer"][mask] = bb
            out["data"][mask] = wire["data"][mask] - np.uint64(buf.base) + np.uint64(buf.array.ctypes.data)
        for i, tid in enumerate(order):
            if tid in plan.private_data:  # checked row ids: the kernel reads the checked copy
                out["data"][i] = plan.private_data[tid]
        step = int(addrs[1] - addrs[0]) if len(order) > 1 else 0
        if len(order) > 1 and np.all(np.diff(addrs) == step) and step >= out.itemsize:
            # the context lays its objects out back to back: one strided write
            span = (ctypes.c_char * (step * (len(order) - 1) + out.itemsize)).from_address(int(addrs[0]))
            np.ndarray(len(order), out.dtype, buffer=span, strides=(step,))[:] = out
        else:
            for i, a in enumerate(addrs):
                ctypes.memmove(int(a), out[i : i + 1].ctypes.data, out.itemsize)

        plan.graph = lib.ggml_new_graph_custom(ctx, n_nodes, False)
        where = dict(zip(order, addrs.tolist()))
        for nid in graph.nodes:
            lib.ggml_graph_add_node(plan.graph, ctypes.cast(where[nid], ggml.ggml_tensor_p))
        written = {}
        for nid in graph.nodes:
            t = tensors[nid]
            if t.flags & ggml.GGML_TENSOR_FLAG_COMPUTE and t.op not in METADATA_OPS and buffers[nid]:
                written[buffers[nid].handle] = buffers[nid]
        plan.written = list(written.values())


def _writer_between(log: WriteLog, first: int, buffer: int, lo: int, hi: int) -> int | None:
    """The latest node logged so far (all before the consumer) at or after `first` that writes
    bytes [lo, hi) of `buffer`, or None."""
    j = log.last(buffer, lo, hi)
    return j if j >= first else None


def _reachable(graph: GraphCompute, registry) -> tuple[dict[int, RpcTensor], dict, dict, dict]:
    """Every tensor the nodes reach, checked as the stock deserializer does, plus what ggml's
    kernels need: whole quantized blocks, extents inside their buffers."""
    tensors, buffers, rows = reachable_tensors(graph, registry)
    sizes: dict[int, int] = {}
    for tid, t in tensors.items():
        tr = TYPE_TRAITS[t.type]
        if t.ne[0] % tr.blck_size:
            raise RemoteProtocolError(f"GRAPH_COMPUTE: {t.describe()} splits a {tr.blck_size}-element block")
        buf = buffers[tid]
        size = sizes[tid] = t.nbytes
        if buf is not None and not buf.contains(t.data, size):
            raise RemoteProtocolError(
                f"GRAPH_COMPUTE: tensor {t.describe()} at {t.data:#x}+{size} outside buffer "
                f"[{buf.base:#x}, {buf.base + buf.size:#x})"
            )
        if buf is not None and buf.array is None:
            buffers[tid] = None  # a zero-size buffer: nothing to point at
    return tensors, buffers, sizes, rows


def _type_caps(lib: ggml.GgmlLibrary) -> TypeCaps:
    vec_dot, vec_dot_type, from_float, to_float = set(), {}, set(), set()
    for t in TYPE_TRAITS:
        cpu = lib.ggml_get_type_traits_cpu(t).contents
        base = lib.ggml_get_type_traits(t).contents
        if cpu.vec_dot:
            vec_dot.add(t)
            vec_dot_type[t] = cpu.vec_dot_type
        if cpu.from_float:
            from_float.add(t)
        if base.to_float:
            to_float.add(t)
    return TypeCaps(frozenset(vec_dot), vec_dot_type, frozenset(from_float), frozenset(to_float))


def load_device(threads: int | None = None) -> GgmlCpuDevice:
    """The ggml device; OSError when the libraries are missing or do not load on this machine."""
    return GgmlCpuDevice(ggml.load(), threads)

