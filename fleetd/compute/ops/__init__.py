"""The op table: one small kernel per ggml op, keyed by GgmlOp.

A kernel is `op_<name>(xp, dst, srcs, node)`: `dst` is the node's array view (it writes there
and returns nothing: ggml placed the result in client-owned memory), `srcs` the source views
(None where absent), `node` the node's RpcTensor (op_params, types, shapes). `xp` is the array
module (numpy or cupy), so each kernel exists once for every device.
"""

from __future__ import annotations

from collections.abc import Callable

from fleetd.errors import UnsupportedOp
from fleetd.wire import GgmlOp, RpcTensor, type_name

Kernel = Callable[..., None]
OPS: dict[GgmlOp, Kernel] = {}


def register(*ops: GgmlOp):
    def wrap(fn: Kernel) -> Kernel:
        for op in ops:
            assert op not in OPS, f"{op.name} registered twice"
            OPS[op] = fn
        return fn

    return wrap


def kernel_for(node: RpcTensor, src_tensors: list[RpcTensor | None]) -> Kernel:
    try:
        return OPS[GgmlOp(node.op)]
    except (KeyError, ValueError):
        pass
    types = ", ".join(type_name(s.type) for s in src_tensors if s is not None)
    op = GgmlOp(node.op).name if node.op in GgmlOp._value2member_map_ else f"op {node.op}"
    raise UnsupportedOp(f"{op}: not supported by fleetd (dst {type_name(node.type)}; srcs {types})")


def supports_op(op: GgmlOp) -> bool:
    return op in OPS


# Importing the kernel modules fills OPS.
from fleetd.compute.ops import binary, copy, matmul, norm  # noqa: E402,F401
