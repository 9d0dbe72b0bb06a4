"""The op table: one small kernel per ggml op, keyed by GgmlOp.

A kernel is `op_<name>(xp, dst, srcs, node, src_tensors)`: `dst` is the node's array view (it
writes there and returns nothing: ggml placed the result in client-owned memory), `srcs` the
source views (None where absent or empty), `node` the node's RpcTensor (op_params, types,
shapes), `src_tensors` the sources' RpcTensors. Views are numpy order (ne3, ne2, ne1, ne0);
block-quantized tensors are uint8 rows of whole blocks. `xp` is the array module (numpy or
cupy), so each kernel exists once for every device. A type or parameter a kernel cannot
compute raises UnsupportedOp naming both: never approximate numbers.

Modules: binary (ADD … SCALE), unary (UNARY, GLU, SQR …), norm, matmul (MUL_MAT, MUL_MAT_ID),
rows (GET_ROWS, SET_ROWS), copy (CPY, DUP, CONT), reduce (SUM_ROWS … TOP_K), shape (CONCAT,
PAD, REPEAT …), rope, attention (SOFT_MAX, FLASH_ATTN_EXT).
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
from fleetd.compute.ops import (  # noqa: F401
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
