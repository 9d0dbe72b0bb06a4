"""The op table: one small kernel per ggml op, keyed by GgmlOp.

A kernel is `op_<name>(xp, dst, srcs, node, src_tensors)`: `dst` is the node's array view (it
writes there and returns nothing: ggml placed the result in client-owned memory), `srcs` the
source views (None where absent or empty), `node` the node's BoundNode (its RpcTensor plus
what the plan worked out once: op_params decoded, the sources' buffer regions, and what the
op's bind companion precomputed), `src_tensors` the sources' RpcTensors. Views are numpy order
(ne3, ne2, ne1, ne0);
block-quantized tensors are uint8 rows of whole blocks. `xp` is the array module (numpy or
cupy), so each kernel exists once for every device. A type or parameter a kernel cannot
compute raises UnsupportedOp naming both: never approximate numbers.

A bind companion, `bind(xp, node, src_tensors) -> object`, runs once when the plan is built
(GRAPH_RECOMPUTE replays without it); the kernel finds its result in `node.bound`. A bind
never reports errors: when it raises, `node.bound` is None and the kernel, checking its
inputs first, meets the error at run time as it would without a bind.

Modules: binary (ADD … SCALE), unary (UNARY, GLU, SQR …), norm, matmul (MUL_MAT, MUL_MAT_ID),
rows (GET_ROWS, SET_ROWS), copy (CPY, DUP, CONT), reduce (SUM_ROWS … TOP_K), shape (CONCAT,
PAD, REPEAT …), rope, attention (SOFT_MAX, FLASH_ATTN_EXT).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

from fleetd.errors import UnsupportedOp
from fleetd.wire import GgmlOp, RpcTensor, op_name, type_name

Kernel = Callable[..., None]
Bind = Callable[..., object]
OPS: dict[GgmlOp, Kernel] = {}
BINDS: dict[GgmlOp, Bind] = {}


def register(*ops: GgmlOp, bind: Bind | None = None):
    def wrap(fn: Kernel) -> Kernel:
        for op in ops:
            assert op not in OPS, f"{op.name} registered twice"
            OPS[op] = fn
            if bind is not None:
                BINDS[op] = bind
        return fn

    return wrap


@dataclass(frozen=True, slots=True)
class Region:
    """Where a source's bytes are: [start, end) of `buffer` (a Buffer)."""

    buffer: object
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class BoundNode(RpcTensor):
    """A graph node as its kernel sees it: the wire tensor plus what the plan bound once."""

    i32: tuple[int, ...] = ()  # op_params as signed 32-bit integers
    f32: tuple[float, ...] = ()  # the same 16 words read as f32
    sources: tuple[Region | None, ...] = field(default=(), compare=False)  # per src_tensors entry
    bound: object = field(default=None, compare=False)  # the op's bind result

    @classmethod
    def of(cls, t: RpcTensor, sources: tuple[Region | None, ...]) -> BoundNode:
        words = struct.pack(f"<{len(t.op_params)}I", *(p & 0xFFFFFFFF for p in t.op_params))
        return cls(
            **{name: getattr(t, name) for name in _WIRE_FIELDS},
            i32=struct.unpack(f"<{len(t.op_params)}i", words),
            f32=struct.unpack(f"<{len(t.op_params)}f", words),
            sources=sources,
        )


_WIRE_FIELDS = tuple(f.name for f in fields(RpcTensor))


def bind_node(xp, t: RpcTensor, src_tensors: list[RpcTensor | None], sources) -> BoundNode:
    node = BoundNode.of(t, tuple(sources))
    bind = BINDS.get(t.op)
    if bind is None:
        return node
    try:
        bound = bind(xp, node, src_tensors)
    except Exception:  # noqa: BLE001 - the kernel reports it at run time, see above
        return node
    return replace(node, bound=bound) if bound is not None else node


def kernel_for(node: RpcTensor, src_tensors: list[RpcTensor | None]) -> Kernel:
    try:
        return OPS[GgmlOp(node.op)]
    except (KeyError, ValueError):
        pass
    types = ", ".join(type_name(s.type) for s in src_tensors if s is not None)
    raise UnsupportedOp(
        f"{op_name(node.op)}: not supported by fleetd (dst {type_name(node.type)}; srcs {types})"
    )


# Importing the kernel modules fills OPS.
from fleetd.compute.ops import (  # noqa: F401, E402
    attention,
    binary,
    copy,
    matmul,
    norm,
    reduce,
    rope,
    rows,
    shape,
    unary,
)
