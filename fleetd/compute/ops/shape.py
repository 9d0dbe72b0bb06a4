"""Ops that move elements without arithmetic: CONCAT, PAD, REPEAT; and the fillers ARANGE, FILL."""

from __future__ import annotations

from fleetd.compute.ops import register
from fleetd.compute.ops.common import (
    f32_param,
    i32_param,
    repeat_to,
    require_types,
    store,
    unsupported,
)
from fleetd.wire import GgmlOp, GgmlType

F32 = {GgmlType.F32}


def _axis(dim: int) -> int:
    """ggml dim k is numpy axis 3 - k."""
    return 3 - dim


@register(GgmlOp.CONCAT)
def op_concat(xp, dst, srcs, node, src_tensors):
    """CONCAT of src0 and src1 along dim op_params[0]; all three of one type."""
    a, b = srcs
    at, bt = src_tensors
    if not at.type == bt.type == node.type:
        raise unsupported(node, src_tensors)
    # Packed rows concatenate as bytes along dim 0: both extents are whole blocks.
    dim = i32_param(node, 0)
    split = a.shape[_axis(dim)]
    index = [slice(None)] * 4
    index[_axis(dim)] = slice(0, split)
    dst[tuple(index)] = a
    index[_axis(dim)] = slice(split, None)
    dst[tuple(index)] = b


@register(GgmlOp.PAD)
def op_pad(xp, dst, srcs, node, src_tensors):
    """PAD with zeros by the left and right amounts per dim, or circularly (op_params[8])."""
    # slots 0-7: lp0, rp0, lp1, rp1, lp2, rp2, lp3, rp3; slot 8: circular
    require_types(node, src_tensors, F32, F32)
    a = srcs[0]
    lefts = [i32_param(node, 2 * d) for d in range(4)]
    if i32_param(node, 8):
        out = a
        for d in range(4):
            axis, n = _axis(d), dst.shape[_axis(d)]
            positions = (xp.arange(n) - lefts[d]) % a.shape[axis]
            out = xp.take(out, positions, axis=axis)
        dst[...] = out
        return
    dst[...] = 0
    index = tuple(slice(lefts[3 - ax], lefts[3 - ax] + a.shape[ax]) for ax in range(4))
    dst[index] = a


@register(GgmlOp.REPEAT)
def op_repeat(xp, dst, srcs, node, src_tensors):
    if src_tensors[0].type != node.type:
        raise unsupported(node, src_tensors)
    dst[...] = repeat_to(xp, srcs[0], dst.shape)


@register(GgmlOp.ARANGE)
def op_arange(xp, dst, srcs, node, src_tensors):
    require_types(node, src_tensors, F32)
    start, step = f32_param(node, 0), f32_param(node, 2)
    n = node.ne[0]
    values = xp.float32(start) + xp.float32(step) * xp.arange(n, dtype=xp.float32)
    store(xp, dst, node, values.reshape(dst.shape))


@register(GgmlOp.FILL)
def op_fill(xp, dst, srcs, node, src_tensors):
    if node.type not in (GgmlType.F32, GgmlType.F16, GgmlType.BF16):
        raise unsupported(node, src_tensors)
    store(xp, dst, node, xp.float32(f32_param(node, 0)))


@register(GgmlOp.SET, GgmlOp.ACC)
def op_set(xp, dst, srcs, node, src_tensors):
    """SET and ACC: src1 stored into, or added to, the strided window op_params give of the
    result (a copy of src0 unless in place)."""
    # Copy a (unless in place), then store (SET) or add (ACC) b into the strided window of dst
    # given by op_params nb1, nb2, nb3, offset.
    require_types(
        node,
        src_tensors,
        {GgmlType.F32, GgmlType.I32},
        {GgmlType.F32, GgmlType.I32},
        {GgmlType.F32, GgmlType.I32},
    )
    a, b = srcs
    if not i32_param(node, 4):
        dst[...] = a
    nb1, nb2, nb3, offset = (i32_param(node, i) for i in range(4))
    es = dst.itemsize
    strides = (nb3, nb2, nb1, es)
    last = offset + sum((n - 1) * st for n, st in zip(b.shape, strides)) + es
    if not dst.flags.c_contiguous or offset < 0 or min(strides) < 0 or last > dst.nbytes:
        raise unsupported(node, src_tensors, f"window {offset}+{last - offset} outside {dst.nbytes} bytes")
    window = xp.lib.stride_tricks.as_strided(dst.reshape(-1)[offset // es :], shape=b.shape, strides=strides)
    if node.op == GgmlOp.ACC:
        window[...] = window + b
    else:
        window[...] = b
