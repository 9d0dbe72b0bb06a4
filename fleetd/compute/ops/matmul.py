"""MUL_MAT: dst[i, j] = sum_k src0[k, i] * src1[k, j], batch dims broadcast by division."""

from __future__ import annotations

from fleetd.compute.ops import register
from fleetd.compute.ops.common import as_f32, store
from fleetd.wire import GgmlOp


def _batch_broadcast(xp, w, n3, n2):
    """Repeat-interleave the weight's batch dims (ggml's "div" broadcast) up to (n3, n2)."""
    r3, r2 = n3 // w.shape[0], n2 // w.shape[1]
    if r2 != 1:
        w = xp.repeat(w, r2, axis=1)
    if r3 != 1:
        w = xp.repeat(w, r3, axis=0)
    return w


@register(GgmlOp.MUL_MAT)
def op_mul_mat(xp, dst, srcs, node, src_tensors):
    w = as_f32(xp, srcs[0], src_tensors[0])  # (b3, b2, M, K)
    x = as_f32(xp, srcs[1], src_tensors[1])  # (B3, B2, N, K)
    w = _batch_broadcast(xp, w, x.shape[0], x.shape[1])
    store(xp, dst, node, xp.matmul(x, w.swapaxes(-1, -2)))
