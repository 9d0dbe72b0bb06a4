"""DUP / CPY / CONT: copy src0's elements in logical row-major order into dst, converting type."""

from __future__ import annotations

from fleetd.compute.ops import register
from fleetd.compute.ops.common import as_f32, store
from fleetd.wire import GgmlOp


@register(GgmlOp.DUP, GgmlOp.CPY, GgmlOp.CONT)
def op_cpy(xp, dst, srcs, node, src_tensors):
    src, st = srcs[0], src_tensors[0]
    if st.type == node.type and src.shape == dst.shape:
        dst[...] = src
        return
    value = src if st.type == node.type else as_f32(xp, src, st)
    if value.shape != dst.shape:
        # Same element count, other shape: ggml walks both in row-major order.
        value = value.reshape(dst.shape)
    if st.type == node.type:
        dst[...] = value
    else:
        store(xp, dst, node, value)
