"""DUP / CPY / CONT: copy src0's elements in logical row-major order into dst, converting type.

Same type: a raw copy (for block types the unit is a block). Otherwise every value goes
through f32: dequantized, widened or truncated as ggml's to_float/from_float do.
"""

from __future__ import annotations

from fleetd.compute import dequant
from fleetd.compute.ops import register
from fleetd.compute.ops.common import as_f32, store
from fleetd.wire import GgmlOp


@register(GgmlOp.DUP, GgmlOp.CPY, GgmlOp.CONT)
def op_cpy(xp, dst, srcs, node, src_tensors):
    src, st = srcs[0], src_tensors[0]
    if st.type == node.type:
        dst[...] = src if src.shape == dst.shape else _reflow(xp, src, dst.shape, node)
        return
    value = as_f32(xp, src, st)
    logical = dst.shape[:-1] + (node.ne[0],) if dequant.is_packed(node.type) else dst.shape
    if value.shape != logical:
        # Same element count, other shape: ggml walks both in row-major order.
        value = value.reshape(logical)
    store(xp, dst, node, value)


def _reflow(xp, src, shape, node):
    """Same-type copy between shapes: elements (or whole blocks) in row-major order."""
    if dequant.is_packed(node.type):
        # Rows of bytes: regroup the byte stream, which keeps blocks whole.
        return xp.ascontiguousarray(src).reshape(shape)
    return src.reshape(shape)
