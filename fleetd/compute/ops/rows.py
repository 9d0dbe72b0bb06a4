"""Row gathers and scatters: GET_ROWS (embedding lookup), SET_ROWS (KV-cache writes)."""

from __future__ import annotations

from fleetd.compute.ops import register
from fleetd.compute.ops.common import (
    FLOAT_TYPES,
    as_f32,
    check_indices,
    store,
    unsupported,
)
from fleetd.wire import GgmlOp, GgmlType

INDEX_TYPES = frozenset({GgmlType.I32, GgmlType.I64})


@register(GgmlOp.GET_ROWS)
def op_get_rows(xp, dst, srcs, node, src_tensors):
    """GET_ROWS: the rows `idx` names, broadcast over dims 2 and 3; only those rows are converted."""
    # dst[:, i, i2, i3] = a[:, idx[i, i2, i3], i2, i3]; a (A3, A2, n_rows, ·), idx (1, A3, A2, n_idx)
    a, idx = srcs
    at = src_tensors[0]
    if src_tensors[1].type != GgmlType.I32 or (at.type == GgmlType.I32) != (node.type == GgmlType.I32):
        raise unsupported(node, src_tensors)
    idx = idx[0]  # (A3, A2, n_idx)
    check_indices(xp, node, idx, a.shape[2])
    i3 = xp.arange(idx.shape[0]).reshape(-1, 1, 1)
    i2 = xp.arange(idx.shape[1]).reshape(1, -1, 1)
    # Only the gathered rows are converted: an embedding table is far bigger than a batch.
    rows = a[i3 % a.shape[0], i2 % a.shape[1], idx]
    if at.type == node.type:
        dst[...] = rows
    else:
        store(xp, dst, node, as_f32(xp, rows, at))


@register(GgmlOp.SET_ROWS)
def op_set_rows(xp, dst, srcs, node, src_tensors):
    """SET_ROWS: the rows of src0 stored at the row numbers in src1, converted to the destination's
    type (a raw copy when the types match)."""
    # src0 = new rows b (B3, B2, n_set, n), src1 = idx (1, I2, I1, n_set), src2 = a (the target):
    # dst[:, idx[i, i2 % I1, i3 % I2], i2, i3] = b[:, i, i2, i3]
    b, idx = srcs[0], srcs[1]
    if b is None or idx is None:
        return  # no rows to set (an empty view of the new rows)
    bt, it = src_tensors[0], src_tensors[1]
    if it.type not in INDEX_TYPES or bt.type not in FLOAT_TYPES:
        raise unsupported(node, src_tensors)
    idx = idx[0]  # (I2, I1, n_set)
    check_indices(xp, node, idx, node.ne[1])
    n3, n2, n_set = b.shape[0], b.shape[1], b.shape[2]
    i3 = xp.arange(n3).reshape(-1, 1, 1)
    i2 = xp.arange(n2).reshape(1, -1, 1)
    targets = idx[i3 % idx.shape[0], i2 % idx.shape[1], xp.arange(n_set).reshape(1, 1, -1)]
    if bt.type == node.type:
        dst[i3, i2, targets] = b  # f16 into an f16 cache: a raw copy
        return
    rows = dst[i3, i2, targets]  # a gathered copy in the destination's row layout
    store(xp, rows, node, as_f32(xp, b, bt))
    dst[i3, i2, targets] = rows
