"""GRAPH_COMPUTE: tensors by id -> views over buffers -> a plan of bound kernels, kept for
GRAPH_RECOMPUTE (llama.cpp sends it for every decode step whose graph is unchanged).

Binding happens once, here: views resolved, op_params decoded, each source's buffer region
named, and whatever an op precomputes from its parameters and shapes (ops/__init__.py). The
f32 weight cache is the device's that holds the weights' buffer, reached through the buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fleetd.compute.buffers import Buffer, BufferRegistry
from fleetd.compute.dequant_cache import DequantCache
from fleetd.compute.ops import BoundNode, Kernel, Region, bind_node, kernel_for
from fleetd.compute.reachable import reachable_tensors
from fleetd.compute.views import tensor_view
from fleetd.errors import ComputeError, RemoteProtocolError
from fleetd.wire import METADATA_OPS, GraphCompute, RpcTensor, TensorFlag, op_name


@dataclass(slots=True)
class Step:
    """One node bound to its kernel: views of its result and sources, and the result's byte range."""

    kernel: Kernel
    dst: object
    srcs: list
    node: BoundNode
    src_tensors: list
    dst_buffer: Buffer  # the step writes [dst_start, dst_end) of it: cached f32 copies there go
    dst_start: int
    dst_end: int
    dst_cache: DequantCache | None  # the dst buffer's device's cache


@dataclass(slots=True)
class Plan:
    """A graph's bound steps in run order; a session keeps its last one per device for
    GRAPH_RECOMPUTE."""

    device: int
    steps: list[Step]
    n_nodes: int
    caches: list[DequantCache]  # of the devices whose buffers the plan reads

    def run(self, xp) -> None:
        """Run the steps in order; a kernel's failure comes out as one ComputeError naming the op and
        the node."""
        for cache in self.caches:
            cache.start_run()
        for s in self.steps:
            try:
                s.kernel(xp, s.dst, s.srcs, s.node, s.src_tensors)
            except ComputeError as exc:
                # One line naming op, node and types: "CPY node f32 ne=[…]: quantizing to …"
                op, msg = op_name(s.node.op), str(exc)
                msg = msg[len(op) :].lstrip(":") if msg.startswith(op) else " " + msg
                raise type(exc)(f"{op} {s.node.describe()}:{msg}") from exc
            except Exception as exc:  # a kernel meeting a shape it does not handle
                raise ComputeError(
                    f"{op_name(s.node.op)} {s.node.describe()}: {type(exc).__name__}: {exc}"
                ) from exc
            finally:
                if s.dst_cache is not None:
                    s.dst_cache.note_write(s.dst_buffer, s.dst_start, s.dst_end)


def build_plan(graph: GraphCompute, registry: BufferRegistry) -> Plan:
    """Validate every reachable tensor as the stock `create_node` does, then bind kernels."""
    tensors, buffers, _ = reachable_tensors(graph, registry)
    views = {
        tid: tensor_view(buffers[tid], t, "GRAPH_COMPUTE") if buffers[tid] is not None else None
        for tid, t in tensors.items()
    }

    steps = []
    caches: dict[int, DequantCache] = {}
    for nid in graph.nodes:
        node = tensors[nid]
        if node.op in METADATA_OPS or not node.flags & TensorFlag.COMPUTE or node.nbytes == 0:
            continue
        src_tensors = [tensors[s] if s else None for s in node.src]
        while src_tensors and src_tensors[-1] is None:
            src_tensors.pop()
        kernel = kernel_for(node, src_tensors)
        dst = views[nid]
        if dst is None:
            raise RemoteProtocolError(f"GRAPH_COMPUTE: node {node.describe()} has no memory")
        srcs = [views[s.id] if s is not None else None for s in src_tensors]
        for s, v in zip(src_tensors, srcs):
            if s is not None and v is None and s.nbytes:
                raise RemoteProtocolError(
                    f"GRAPH_COMPUTE: source {s.describe()} of {node.describe()} has no memory"
                )
        regions = [_region(buffers[s.id], s) if s is not None else None for s in src_tensors]
        for r in regions:
            cache = _cache_of(r.buffer) if r is not None else None
            if cache is not None:
                caches[id(cache)] = cache
        buf = buffers[nid]
        xp = buf.memory.xp if buf.memory is not None else np
        bound = bind_node(xp, node, src_tensors, regions)
        start = node.data - buf.base
        steps.append(
            Step(kernel, dst, srcs, bound, src_tensors, buf, start, start + node.nbytes, _cache_of(buf))
        )
    return Plan(graph.device, steps, len(graph.nodes), list(caches.values()))


def _region(buf: Buffer | None, t: RpcTensor) -> Region | None:
    if buf is None:
        return None
    start = t.data - buf.base
    return Region(buf, start, start + t.nbytes)


def _cache_of(buf: Buffer) -> DequantCache | None:
    return buf.memory.dequant_cache if buf.memory is not None else None
