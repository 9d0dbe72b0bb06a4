"""Row normalisations: RMS_NORM, NORM (op_params: eps f32 @0)."""

from __future__ import annotations

from fleetd.compute.ops import register
from fleetd.compute.ops.common import as_f32, f32_param, store
from fleetd.wire import GgmlOp


@register(GgmlOp.RMS_NORM)
def op_rms_norm(xp, dst, srcs, node, src_tensors):
    x = as_f32(xp, srcs[0], src_tensors[0])
    eps = f32_param(node, 0)
    # ggml accumulates the sum of squares in double.
    mean_sq = xp.mean(xp.square(x, dtype=xp.float64), axis=-1, keepdims=True)
    store(xp, dst, node, x * (1.0 / xp.sqrt(mean_sq + eps)).astype(xp.float32))


@register(GgmlOp.NORM)
def op_norm(xp, dst, srcs, node, src_tensors):
    x = as_f32(xp, srcs[0], src_tensors[0])
    eps = f32_param(node, 0)
    centered = x - xp.mean(x, axis=-1, keepdims=True, dtype=xp.float64).astype(xp.float32)
    var = xp.mean(xp.square(centered, dtype=xp.float64), axis=-1, keepdims=True)
    store(xp, dst, node, centered * (1.0 / xp.sqrt(var + eps)).astype(xp.float32))
