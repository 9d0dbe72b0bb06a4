"""Row normalisations (op_params: eps f32 @0): RMS_NORM, NORM, L2_NORM; GROUP_NORM."""

from __future__ import annotations

from fleetd.compute.ops import register
from fleetd.compute.ops.common import f32_param, i32_param, require_types, store
from fleetd.wire import GgmlOp, GgmlType

F32 = {GgmlType.F32}


@register(GgmlOp.RMS_NORM)
def op_rms_norm(xp, dst, srcs, node, src_tensors):
    require_types(node, src_tensors, F32, F32)
    x = srcs[0]
    eps = f32_param(node, 0)
    # Squares in f32, summed in double, as ggml does.
    mean_sq = (xp.sum(xp.square(x), axis=-1, keepdims=True, dtype=xp.float64) / x.shape[-1]).astype(
        xp.float32
    )
    store(xp, dst, node, x * (1.0 / xp.sqrt(mean_sq + xp.float32(eps))))


@register(GgmlOp.NORM)
def op_norm(xp, dst, srcs, node, src_tensors):
    require_types(node, src_tensors, F32, F32)
    x = srcs[0]
    eps = f32_param(node, 0)
    n = x.shape[-1]
    mean = (xp.sum(x, axis=-1, keepdims=True, dtype=xp.float64) / n).astype(xp.float32)
    centered = x - mean
    var = (xp.sum(xp.square(centered), axis=-1, keepdims=True, dtype=xp.float64) / n).astype(xp.float32)
    store(xp, dst, node, centered * (1.0 / xp.sqrt(var + xp.float32(eps))))


@register(GgmlOp.L2_NORM)
def op_l2_norm(xp, dst, srcs, node, src_tensors):
    require_types(node, src_tensors, F32, F32)
    x = srcs[0]
    eps = f32_param(node, 0)
    norm = xp.sqrt(xp.sum(xp.square(x), axis=-1, keepdims=True, dtype=xp.float64)).astype(xp.float32)
    store(xp, dst, node, x * (1.0 / xp.maximum(norm, xp.float32(eps))))


@register(GgmlOp.GROUP_NORM)
def op_group_norm(xp, dst, srcs, node, src_tensors):
    """GROUP_NORM: mean and variance per group of channels (dim 2), accumulated in f64."""
    # Groups partition dim 2 (channels); mean and variance over (ne0, ne1, channels of group).
    require_types(node, src_tensors, F32, F32)
    x = srcs[0]  # (ne3, ne2, ne1, ne0)
    n_groups, eps = i32_param(node, 0), f32_param(node, 1)
    channels = x.shape[1]
    per_group = (channels + n_groups - 1) // n_groups
    out = xp.empty(x.shape, dtype=xp.float32)
    for start in range(0, channels, per_group):
        g = x[:, start : start + per_group]
        mean = xp.mean(g, axis=(1, 2, 3), keepdims=True, dtype=xp.float64).astype(xp.float32)
        centered = g - mean
        var = xp.mean(xp.square(centered), axis=(1, 2, 3), keepdims=True, dtype=xp.float64)
        out[:, start : start + per_group] = centered / xp.sqrt(var + eps).astype(xp.float32)
    store(xp, dst, node, out)
