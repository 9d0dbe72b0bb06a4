"""`--device cpu`: ggml's own CPU kernels (the stock server's), run over fleetd's buffers.

fleetd keeps owning buffers, sessions, validation and the wire. A GRAPH_COMPUTE is validated as
the stock `create_node` does (ids, types, buffers, extents), every node is checked against its
op's rule (rules.py), and the graph becomes a ggml graph once: one `ggml_tensor` per wire tensor
in a no_alloc context, data pointers into our buffers, src/view links, op, op_params and flags as
sent. The plan is kept for GRAPH_RECOMPUTE and computed in one `ggml_backend_graph_compute` call,
in the session's contained worker process (workers.py): the daemon validates and describes the
graph (a GraphSpec), the worker builds and computes it over its own mappings of the buffers.

This module imports nothing of fleetd.compute outside this package: `make_device` in
fleetd/compute/device.py imports it, and buffers/views import that module.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from fleetd.compute.ggml import lib as ggml
from fleetd.compute.ggml.rules import IndexUse, PaddedRead, Refused, TypeCaps, check_node, made_by
from fleetd.compute.ggml.worker import GraphSpec
from fleetd.compute.ggml.workers import WorkerPool
from fleetd.compute.ggml.writes import WriteLog
from fleetd.compute.host_memory import shared_pages
from fleetd.compute.reachable import reachable_tensors
from fleetd.errors import RemoteProtocolError
from fleetd.wire import METADATA_OPS, TYPE_TRAITS, GraphCompute, RpcTensor
from fleetd.wire.ggml import GGML_OP_COUNT


def default_threads() -> int:
    """`fleetd -t N` sets OMP_NUM_THREADS; without it, the stock server's default."""
    n = os.environ.get("OMP_NUM_THREADS", "")
    return int(n) if n.isdigit() and int(n) > 0 else max(1, (os.cpu_count() or 2) // 2)


@dataclass(slots=True)
class IndexCheck:
    """Row numbers that no node of the graph writes. Before each run the worker copies them out
    of the buffer into a private array (the kernel reads that copy: another session's SET_TENSOR
    cannot change them between the check and the kernel) and checks them there."""

    tensor: int  # wire id
    handle: int  # the buffer they are in, and where
    offset: int
    nbytes: int
    type: int
    ne: tuple
    nb: tuple
    bound: int
    what: str


_PLAN_KEYS = itertools.count(1)


class GgmlPlan:
    """A validated wire graph, described for the worker (spec), with the buffers it reaches."""

    def __init__(self, device: GgmlCpuDevice, spec: GraphSpec, buffers: dict, written: list) -> None:
        self.device, self.spec = device, spec
        self.key = next(_PLAN_KEYS)  # the worker's name for it: never reused
        self.buffers = buffers  # handle -> Buffer, for the worker's mappings
        self.written = written  # Buffers the graph writes (their generation is bumped)

    def run(self, owner: int = 0, timeout: float = 600.0) -> None:
        """Compute in the worker of `owner` (a session id; 0 for a caller outside the server)."""
        self.device.run(self, owner, time.monotonic() + timeout)


class GgmlCpuDevice:
    """A fleetd.compute.device.Device, as NumpyDevice is (by its members: see the module doc)."""

    name = "CPU"
    kind = "ggml"
    xp = np
    alignment = 32  # TENSOR_ALIGNMENT: ggml_backend_cpu_buffer_from_ptr asserts it
    max_size = (1 << 64) - 1
    fallback = None  # it is the device `cpu` asks for

    def __init__(self, lib: ggml.GgmlLibrary, threads: int | None = None) -> None:
        self.lib = lib  # for the type traits: the daemon itself never computes
        self.library = str(lib.cpu_path)  # which build and CPU variant computes (/v1/status)
        self.threads = threads or default_threads()
        self.caps = _type_caps(lib)
        self.workers: WorkerPool | None = None
        self._start_lock = threading.Lock()

    def start_workers(
        self, user: str | None, max_workers: int, idle_timeout: float, pin: bool = True
    ) -> WorkerPool:
        """Start the fork server: graphs compute in contained workers from now on."""
        self.workers = workers = WorkerPool(self.threads, user, max_workers, idle_timeout, pin)
        workers.start()
        return workers

    def run(self, plan: GgmlPlan, session_id: int, deadline: float, client=None) -> None:
        """Compute `plan` in this session's worker (see WorkerPool.compute for what it raises)."""
        workers = self.workers
        if workers is None:  # used outside a server (tests, tools): default limits
            with self._start_lock:
                workers = self.workers
                if workers is None:
                    workers = self.start_workers(None, 64, 300.0)
        workers.compute(session_id, plan, deadline, client)
        for buf in plan.written:
            buf.touched()

    def worker_stats(self) -> dict | None:
        w = self.workers
        if w is None:
            return {"live": 0, "started": 0, "died": 0, "sandbox": ""}
        return {"live": w.live(), "started": w.spawned, "died": w.deaths, "sandbox": w.sandbox}

    def session_ended(self, session_id: int) -> None:
        if self.workers is not None:
            self.workers.release(session_id)

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()

    # -- what the wire asks ---------------------------------------------------------------------

    def alloc(self, size: int):
        """A flat uint8 array of `size` bytes on a page boundary (`alignment` divides it), or None."""
        return shared_pages(size)

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
        threads = self.threads
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

        plan = _Draft()
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
        return _finish(self, plan, graph, tensors, buffers, rows)

    def _plan_padded_read(self, plan, consumer: int, use: PaddedRead, buffers, nodes, log):
        """The view's bytes copied before every run into an array of the size the kernel reads,
        the rest 1.0f (ROPE's freq factors past n_dims/2: read, never used)."""
        t = use.tensor
        if t.id in plan.private:
            return
        lo, hi = t.data, t.data + t.nbytes
        if (j := _writer_between(log, 0, t.buffer, lo, hi)) is not None:
            raise Refused(
                f"GRAPH_COMPUTE: {nodes[j].describe()} writes {t.describe()}, which "
                f"{nodes[consumer].describe()} reads past its end"
            )
        buf = buffers[t.id]
        handle, off = (buf.handle, lo - buf.base) if buf is not None else (0, 0)
        plan.padded.append((t.id, handle, off, t.nbytes if buf is not None else 0, use.nbytes))
        plan.private.add(t.id)

    def _plan_index_check(
        self, plan, consumer: int, use: IndexUse, tensors, buffers, nodes, log, first_at, checks
    ):
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
                check = checks[idx.id] = IndexCheck(
                    idx.id,
                    buf.handle,
                    idx.data - buf.base,
                    idx.nbytes,
                    idx.type,
                    tuple(idx.ne),
                    tuple(idx.nb),
                    use.bound,
                    idx.describe(),
                )
                plan.index_checks.append(check)
                plan.private.add(idx.id)
        if (j := _writer_between(log, after, idx.buffer, lo, hi)) is not None:
            raise Refused(
                f"GRAPH_COMPUTE: {nodes[j].describe()} overwrites the row ids {idx.describe()} "
                f"before {nodes[consumer].describe()} reads them"
            )


class _Draft:
    """What build_plan gathers before the spec is made: row-id checks and padded reads."""

    def __init__(self) -> None:
        self.index_checks: list[IndexCheck] = []
        self.padded: list[tuple] = []  # (tensor id, handle, offset, nbytes, padded nbytes)
        self.private: set[int] = set()  # tensor ids the kernel reads from a private copy


def _finish(device: GgmlCpuDevice, draft: _Draft, graph: GraphCompute, tensors, buffers, rows) -> GgmlPlan:
    """The GraphSpec the worker builds: the reachable tensors' wire records, the buffers with
    bytes, the checks; and what the daemon keeps (the Buffers, those the graph writes)."""
    order = list(tensors)
    wire = graph.tensors[np.fromiter((rows[tid] for tid in order), np.int64, len(order))].copy()
    mapped = {b.handle: b for b in buffers.values() if b is not None}
    # tensors whose buffer has no bytes (or none at all) point nowhere, as before
    no_memory = np.fromiter((buffers[tid] is None for tid in order), bool, len(order))
    wire["buffer"][no_memory] = 0
    wire["data"][no_memory] = 0
    written = {}
    for nid in graph.nodes:
        t = tensors[nid]
        if t.flags & ggml.GGML_TENSOR_FLAG_COMPUTE and t.op not in METADATA_OPS and buffers[nid]:
            written[buffers[nid].handle] = buffers[nid]
    spec = GraphSpec(
        order=np.fromiter(order, np.uint64, len(order)),
        wire=wire,
        nodes=list(graph.nodes),
        handles=list(mapped),
        index_checks=[
            (c.tensor, c.handle, c.offset, c.nbytes, c.type, c.ne, c.nb, c.bound, c.what)
            for c in draft.index_checks
        ],
        padded=draft.padded,
    )
    return GgmlPlan(device, spec, mapped, list(written.values()))


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
