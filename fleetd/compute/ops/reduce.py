"""Reductions along rows (dim 0): SUM, SUM_ROWS, MEAN, CUMSUM, ARGMAX, ARGSORT, TOP_K."""

from __future__ import annotations

from fleetd.compute.ops import register
from fleetd.compute.ops.common import (
    FLOAT_TYPES,
    as_f32,
    i32_param,
    require_types,
    store,
    unsupported,
)
from fleetd.wire import GgmlOp, GgmlType

F32 = {GgmlType.F32}
I32 = {GgmlType.I32}


@register(GgmlOp.SUM)
def op_sum(xp, dst, srcs, node, src_tensors):
    require_types(node, src_tensors, FLOAT_TYPES, FLOAT_TYPES)
    x = as_f32(xp, rows_as_cpu_reads(xp, srcs[0], node, src_tensors), src_tensors[0])
    store(xp, dst, node, xp.sum(x, dtype=xp.float64))


def rows_as_cpu_reads(xp, view, node, src_tensors):
    """The CPU's SUM reads ne0 packed elements from each row start, whatever nb0 says (a
    permuted source gives other numbers than the math). Same memory, same answer; bounded by
    the source's buffer."""
    if view.strides[-1] == view.itemsize:
        return view
    region = node.sources[0]
    strides = view.strides[:-1] + (view.itemsize,)
    extent = sum((n - 1) * s for n, s in zip(view.shape, strides)) + view.itemsize
    if region is None or min(strides) < 0 or region.start + extent > region.buffer.size:
        raise unsupported(node, src_tensors, "permuted rows")
    return xp.lib.stride_tricks.as_strided(view, shape=view.shape, strides=strides)


@register(GgmlOp.SUM_ROWS)
def op_sum_rows(xp, dst, srcs, node, src_tensors):
    # The CPU accumulates rows in double, then rounds to f32.
    require_types(node, src_tensors, FLOAT_TYPES, FLOAT_TYPES)
    x = as_f32(xp, srcs[0], src_tensors[0])
    store(xp, dst, node, xp.sum(x, axis=-1, keepdims=True, dtype=xp.float64))


@register(GgmlOp.MEAN)
def op_mean(xp, dst, srcs, node, src_tensors):
    require_types(node, src_tensors, F32, F32)
    x = srcs[0]
    row_sum = xp.sum(x, axis=-1, keepdims=True, dtype=xp.float64).astype(xp.float32)
    store(xp, dst, node, row_sum / xp.float32(x.shape[-1]))


@register(GgmlOp.CUMSUM)
def op_cumsum(xp, dst, srcs, node, src_tensors):
    # Sequential f32 accumulation, as the CPU loop does.
    require_types(node, src_tensors, F32, F32)
    store(xp, dst, node, xp.cumsum(srcs[0], axis=-1, dtype=xp.float32))


@register(GgmlOp.ARGMAX)
def op_argmax(xp, dst, srcs, node, src_tensors):
    # Ties go to the last index holding the maximum.
    require_types(node, src_tensors, I32, F32)
    x = srcs[0][0, 0]  # (ne1, ne0)
    last = x.shape[-1] - 1 - xp.argmax(x[:, ::-1], axis=-1)
    dst[...] = last.astype(xp.int32).reshape(dst.shape)


def _descending(xp, x):
    return xp.argsort(-x, axis=-1, kind="stable")


@register(GgmlOp.ARGSORT)
def op_argsort(xp, dst, srcs, node, src_tensors):
    require_types(node, src_tensors, I32, F32)
    x = srcs[0]
    order = _descending(xp, x) if i32_param(node, 0) == 1 else xp.argsort(x, axis=-1, kind="stable")
    dst[...] = order.astype(xp.int32)


@register(GgmlOp.TOP_K)
def op_top_k(xp, dst, srcs, node, src_tensors):
    # The CPU's exact output: the k largest in descending order, then the first two swapped
    # (ggml documents the order as unspecified; matching it keeps outputs byte-identical).
    require_types(node, src_tensors, I32, F32)
    k = node.ne[0]
    top = _descending(xp, srcs[0])[..., :k]
    if k > 1:
        top = xp.concatenate([top[..., 1:2], top[..., 0:1], top[..., 2:]], axis=-1)
    dst[...] = top.astype(xp.int32)
