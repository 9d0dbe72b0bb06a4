"""Build ggml graphs in Python and serialize them for GRAPH_COMPUTE.

    g = GraphBuilder()
    a = g.tensor(GgmlType.F32, (4, 2), buf, offset=0)     # placed in a remote buffer
    c = g.add(a, b)                                        # new node (placed by the caller)
    g.place(c, buf, offset=64)
    payload = g.serialize([c], device=0)                   # a GraphCompute request

Serialization walks each node depth-first as the stock client does (srcs, then view_src, then
the tensor), lists every reachable tensor once, and fills use_count and the COMPUTE flag.
"""

from __future__ import annotations

import itertools
import struct
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from fleetd.wire import (
    RPC_TENSOR_DTYPE,
    GgmlOp,
    GgmlType,
    GraphCompute,
    RpcTensor,
    TensorFlag,
    contiguous_strides,
    nbytes,
)

_ids = itertools.count(0x1000, 0x40)  # fake client-side "addresses", never 0


def f32_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


@dataclass(eq=False)
class Tensor:
    """A graph tensor on the client side: sources and view links are Python objects, `id` a fake
    address; `rpc()` gives its wire form."""

    type: int
    ne: tuple[int, int, int, int]
    nb: tuple[int, int, int, int]
    op: int = GgmlOp.NONE
    op_params: list[int] = field(default_factory=lambda: [0] * 16)
    src: list[Tensor] = field(default_factory=list)
    view_src: Tensor | None = None
    view_offs: int = 0
    buffer: int = 0
    data: int = 0
    name: str = ""
    flags: int = 0
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def nbytes(self) -> int:
        return nbytes(self.type, self.ne, self.nb)

    def rpc(self, use_count: int = 0) -> RpcTensor:
        """The wire record: links become ids, missing sources 0, the name cut to 63 bytes."""
        srcs = tuple(s.id for s in self.src) + (0,) * (10 - len(self.src))
        return RpcTensor(
            id=self.id,
            type=self.type,
            buffer=self.buffer,
            ne=self.ne,
            nb=self.nb,
            op=self.op,
            op_params=tuple(self.op_params),
            flags=self.flags,
            src=srcs,
            view_src=self.view_src.id if self.view_src else 0,
            view_offs=self.view_offs,
            data=self.data,
            name=self.name.encode()[:63],
            use_count=use_count,
        )


def _ne4(ne) -> tuple[int, int, int, int]:
    ne = tuple(ne) + (1,) * (4 - len(ne))
    return ne  # type: ignore[return-value]


class GraphBuilder:
    """Makes leaf tensors and op nodes and serializes the graph as a GRAPH_COMPUTE request."""

    def tensor(self, type_: int, ne, buffer: int = 0, data: int = 0, name: str = "") -> Tensor:
        ne4 = _ne4(ne)
        return Tensor(type_, ne4, contiguous_strides(type_, ne4), buffer=buffer, data=data, name=name)

    @staticmethod
    def place(t: Tensor, buffer: int, data: int) -> Tensor:
        t.buffer, t.data = buffer, data
        return t

    # -- ops (result placement is the caller's: place() or a view) --------------------------

    def _node(self, op: GgmlOp, type_: int, ne, srcs, params=(), name="") -> Tensor:
        t = self.tensor(type_, ne, name=name)
        t.op = op
        t.src = list(srcs)
        for i, p in enumerate(params):
            t.op_params[i] = p
        return t

    def add(self, a: Tensor, b: Tensor) -> Tensor:
        return self._node(GgmlOp.ADD, a.type, a.ne, [a, b])

    def sub(self, a: Tensor, b: Tensor) -> Tensor:
        return self._node(GgmlOp.SUB, a.type, a.ne, [a, b])

    def mul(self, a: Tensor, b: Tensor) -> Tensor:
        return self._node(GgmlOp.MUL, a.type, a.ne, [a, b])

    def div(self, a: Tensor, b: Tensor) -> Tensor:
        return self._node(GgmlOp.DIV, a.type, a.ne, [a, b])

    def scale(self, a: Tensor, s: float, b: float = 0.0) -> Tensor:
        return self._node(GgmlOp.SCALE, a.type, a.ne, [a], [f32_bits(s), f32_bits(b)])

    def rms_norm(self, a: Tensor, eps: float = 1e-6) -> Tensor:
        return self._node(GgmlOp.RMS_NORM, a.type, a.ne, [a], [f32_bits(eps)])

    def mul_mat(self, w: Tensor, x: Tensor) -> Tensor:
        ne = (w.ne[1], x.ne[1], x.ne[2], x.ne[3])
        return self._node(GgmlOp.MUL_MAT, GgmlType.F32, ne, [w, x])

    def cpy(self, a: Tensor, dst: Tensor) -> Tensor:
        """ggml_cpy: a node viewing dst that receives a's elements converted to dst's type."""
        t = self.view_of(dst, dst.ne, dst.nb, 0)
        t.op = GgmlOp.CPY
        t.src = [a, dst]
        return t

    def view_of(self, a: Tensor, ne, nb, offset: int, op: GgmlOp = GgmlOp.VIEW) -> Tensor:
        """A view of `a` at byte `offset`, linked to the tensor that owns the memory (a view of a view
        points at the root); VIEW nodes also carry the offset in op_params[0:2]."""
        root = a.view_src or a
        base_offs = a.view_offs if a.view_src else 0
        t = Tensor(
            a.type,
            _ne4(ne),
            tuple(nb),
            op=op,
            src=[a],
            view_src=root,
            view_offs=base_offs + offset,
            buffer=a.buffer,
            data=a.data + offset if a.data else 0,
        )
        if op == GgmlOp.VIEW:
            t.op_params[0] = offset & 0xFFFFFFFF
            t.op_params[1] = offset >> 32
        return t

    def transpose(self, a: Tensor) -> Tensor:
        ne = (a.ne[1], a.ne[0], a.ne[2], a.ne[3])
        nb = (a.nb[1], a.nb[0], a.nb[2], a.nb[3])
        return self.view_of(a, ne, nb, 0, GgmlOp.TRANSPOSE)

    # -- serialization ----------------------------------------------------------------------

    def serialize(self, nodes: list[Tensor], device: int = 0) -> GraphCompute:
        """The GRAPH_COMPUTE request computing `nodes` on `device`: every reachable tensor once, sources
        before users, use counts filled and `nodes` flagged COMPUTE."""
        order: list[Tensor] = []
        seen: set[int] = set()

        def visit(t: Tensor) -> None:
            stack = [(t, False)]
            while stack:
                cur, expanded = stack.pop()
                if cur.id in seen:
                    continue
                if expanded:
                    seen.add(cur.id)
                    order.append(cur)
                    continue
                stack.append((cur, True))
                if cur.view_src is not None:
                    stack.append((cur.view_src, False))
                for s in reversed(cur.src):
                    stack.append((s, False))

        for n in nodes:
            visit(n)
        uses = Counter(s.id for n in nodes for s in n.src)
        node_ids = {n.id for n in nodes}
        records = np.zeros(len(order), dtype=RPC_TENSOR_DTYPE)
        for i, t in enumerate(order):
            if t.id in node_ids and t.op not in (GgmlOp.NONE,):
                t.flags |= TensorFlag.COMPUTE
            records[i] = np.frombuffer(t.rpc(uses.get(t.id, 0)).pack(), RPC_TENSOR_DTYPE)[0]
        return GraphCompute(device, tuple(n.id for n in nodes), records)
