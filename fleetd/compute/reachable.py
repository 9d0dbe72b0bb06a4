"""The tensors a GRAPH_COMPUTE's nodes reach (src, view_src), checked as the stock
`create_node` does; every device starts its plan from this walk, then adds its own checks."""

from __future__ import annotations

from typing import Any, Protocol

from fleetd.errors import RemoteProtocolError
from fleetd.wire import GraphCompute, RpcTensor, check_type


class Registry(Protocol):
    """What the walk needs of fleetd.compute.buffers.BufferRegistry (not imported: the registry
    module sits below the devices, and the devices use this walk)."""

    def get(self, handle: int) -> Any: ...


_FIELDS = (
    "id",
    "type",
    "buffer",
    "ne",
    "nb",
    "op",
    "op_params",
    "flags",
    "src",
    "view_src",
    "view_offs",
    "data",
    "name",
    "use_count",
)


def reachable_tensors(
    graph: GraphCompute, registry: Registry
) -> tuple[dict[int, RpcTensor], dict[int, Any], dict[int, int]]:
    """(tensors by id, their buffers, their row in graph.tensors) for every reachable tensor.

    Refuses node id 0, an id missing from the tensor list, an unknown type, and data without a
    known buffer; duplicate ids: the first occurrence wins, as in the stock server."""
    records = graph.tensors
    # Whole columns to Python at once (per-record field access costs ~0.3 ms per tensor).
    columns = [records[f].tolist() for f in _FIELDS]
    index: dict[int, int] = {}
    for i, tid in enumerate(columns[0]):
        index.setdefault(tid, i)
    tensors: dict[int, RpcTensor] = {}
    buffers: dict[int, Any] = {}  # Buffer or None
    pending = list(graph.nodes)
    while pending:
        tid = pending.pop()
        if tid in tensors:
            continue
        if tid == 0:
            raise RemoteProtocolError("GRAPH_COMPUTE: node id 0")
        i = index.get(tid)
        if i is None:
            raise RemoteProtocolError(f"GRAPH_COMPUTE: tensor id {tid:#x} not in the tensor list")
        c = [col[i] for col in columns]
        t = RpcTensor(
            c[0],
            c[1],
            c[2],
            tuple(c[3]),
            tuple(c[4]),
            c[5],
            tuple(c[6]),
            c[7],
            tuple(c[8]),
            c[9],
            c[10],
            c[11],
            c[12].split(b"\0", 1)[0],
            c[13],
        )
        check_type(t, "GRAPH_COMPUTE")
        buf = registry.get(t.buffer) if t.buffer else None
        if buf is None and t.data != 0:
            raise RemoteProtocolError(
                f"GRAPH_COMPUTE: {t.describe()} has data {t.data:#x} but no known buffer"
            )
        tensors[tid] = t
        buffers[tid] = buf
        pending.extend(s for s in t.src if s)
        if t.view_src:
            pending.append(t.view_src)
    return tensors, buffers, {tid: index[tid] for tid in tensors}
