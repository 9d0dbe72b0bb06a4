"""Element-wise binary ops with ggml's repeat broadcasting of src1, and SCALE."""

from __future__ import annotations

from fleetd.compute.ops import register
from fleetd.compute.ops.common import as_f32, f32_param, repeat_to, store
from fleetd.wire import GgmlOp


def _binary(fn):
    def kernel(xp, dst, srcs, node, src_tensors):
        a = as_f32(xp, srcs[0], src_tensors[0])
        b = repeat_to(xp, as_f32(xp, srcs[1], src_tensors[1]), a.shape)
        store(xp, dst, node, fn(xp, a, b))

    return kernel


op_add = register(GgmlOp.ADD)(_binary(lambda xp, a, b: a + b))
op_sub = register(GgmlOp.SUB)(_binary(lambda xp, a, b: a - b))
op_mul = register(GgmlOp.MUL)(_binary(lambda xp, a, b: a * b))
op_div = register(GgmlOp.DIV)(_binary(lambda xp, a, b: a / b))


@register(GgmlOp.SCALE)
def op_scale(xp, dst, srcs, node, src_tensors):
    # op_params: s f32 @0, b f32 @1 -> x * s + b
    s, b = f32_param(node, 0), f32_param(node, 1)
    x = as_f32(xp, srcs[0], src_tensors[0])
    store(xp, dst, node, x * xp.float32(s) + xp.float32(b) if b else x * xp.float32(s))
