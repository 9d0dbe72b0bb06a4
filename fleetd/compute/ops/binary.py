"""Element-wise binary ops with ggml's repeat broadcasting of src1, ADD1, ADD_ID and SCALE."""

from __future__ import annotations

from fleetd.compute import dequant
from fleetd.compute.ops import register
from fleetd.compute.ops.common import (
    FLOAT_TYPES,
    as_f32,
    check_indices,
    f32_param,
    quiet,
    repeat_to,
    require_types,
    store,
)
from fleetd.wire import GgmlOp, GgmlType


def _binary(fn, quantized_src0: bool = False):
    def kernel(xp, dst, srcs, node, src_tensors):
        a_t, b_t = src_tensors[0], src_tensors[1]
        if not (quantized_src0 and dequant.is_packed(a_t.type)):
            require_types(node, src_tensors, FLOAT_TYPES, FLOAT_TYPES, FLOAT_TYPES)
        a = as_f32(xp, srcs[0], a_t)
        b = repeat_to(xp, as_f32(xp, srcs[1], b_t), a.shape)
        with quiet(xp):
            store(xp, dst, node, fn(a, b))

    return kernel


op_add = register(GgmlOp.ADD)(_binary(lambda a, b: a + b, quantized_src0=True))
op_sub = register(GgmlOp.SUB)(_binary(lambda a, b: a - b))
op_mul = register(GgmlOp.MUL)(_binary(lambda a, b: a * b))
op_div = register(GgmlOp.DIV)(_binary(lambda a, b: a / b))
op_add1 = register(GgmlOp.ADD1)(_binary(lambda a, b: a + b, quantized_src0=True))


@register(GgmlOp.ADD_ID)
def op_add_id(xp, dst, srcs, node, src_tensors):
    # dst[:, i1, i2] = a[:, i1, i2] + b[:, ids[i1, i2]]: per-expert biases of MoE layers.
    require_types(node, src_tensors, {GgmlType.F32}, {GgmlType.F32}, {GgmlType.F32}, {GgmlType.I32})
    a, b, ids = srcs
    rows = b[0, 0]  # (n_ids, n)
    idx = ids[0, 0]  # (n_tok, n_rows)
    check_indices(xp, node, idx, rows.shape[0])
    store(xp, dst, node, a + rows[idx][None])


@register(GgmlOp.SCALE)
def op_scale(xp, dst, srcs, node, src_tensors):
    # op_params: s f32 @0, b f32 @1 -> x * s + b
    require_types(node, src_tensors, FLOAT_TYPES, FLOAT_TYPES)
    s, b = f32_param(node, 0), f32_param(node, 1)
    x = as_f32(xp, srcs[0], src_tensors[0])
    store(xp, dst, node, x * xp.float32(s) + xp.float32(b) if b else x * xp.float32(s))
