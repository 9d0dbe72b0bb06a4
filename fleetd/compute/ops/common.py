"""Helpers shared by kernels: reading any element type as f32, writing f32 to any type, params."""

from __future__ import annotations

import contextlib

from fleetd.compute import dequant
from fleetd.errors import ComputeError, UnsupportedOp
from fleetd.wire import GgmlType, RpcTensor, op_name, type_name

FLOAT_TYPES = frozenset({GgmlType.F32, GgmlType.F16, GgmlType.BF16})
INT_TYPES = frozenset({GgmlType.I8, GgmlType.I16, GgmlType.I32, GgmlType.I64})


def bf16_to_f32(xp, raw):
    return (raw.astype(xp.uint32) << 16).view(xp.float32)


def f32_to_bf16(xp, x):
    # Round to nearest even, NaN kept quiet: ggml_compute_fp32_to_bf16.
    bits = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return xp.where(nan, (bits >> 16) | 64, rounded).astype(xp.uint16)


def round_bf16(xp, x):
    """x rounded to bf16 precision, kept as f32."""
    return bf16_to_f32(xp, f32_to_bf16(xp, x))


def round_f16(xp, x):
    return x.astype(xp.float16).astype(xp.float32)


def as_f32(xp, view, t: RpcTensor):
    """The tensor's values as float32 (a view when already f32)."""
    if t.type == GgmlType.F32:
        return view
    if t.type == GgmlType.BF16:
        return bf16_to_f32(xp, view)
    if t.type in (GgmlType.F16, GgmlType.F64) or t.type in INT_TYPES:
        return view.astype(xp.float32)
    if dequant.is_packed(t.type):
        return dequant.dequantize(xp, view, t.type)
    raise UnsupportedOp(f"reading {type_name(t.type)} as f32 is not supported")


def weights_f32(xp, node, slot: int, view, t: RpcTensor):
    """as_f32 for weights (source `slot` of `node`): non-f32 conversions are kept in the f32
    cache of the device holding the weights, until their region is written."""
    if t.type == GgmlType.F32:
        return view
    region = node.sources[slot]
    cache = region.buffer.memory.dequant_cache if region is not None and region.buffer.memory else None
    if cache is None:
        return as_f32(xp, view, t)
    return cache.get(region.buffer, region.start, view, t.type, lambda v: as_f32(xp, v, t))


def store(xp, dst, node: RpcTensor, value) -> None:
    """Write f32 `value` (broadcastable to dst's logical shape) into dst, converting as ggml's
    from_float does."""
    if getattr(value, "dtype", None) == xp.float64:
        value = value.astype(xp.float32)  # f64 -> f32 -> f16 as the CPU rounds, not f64 -> f16
    type_ = node.type
    if type_ == GgmlType.BF16:
        dst[...] = f32_to_bf16(xp, xp.broadcast_to(value, dst.shape))
    elif type_ in INT_TYPES:
        dst[...] = xp.trunc(value)  # C conversion: truncation toward zero
    elif type_ in (GgmlType.F32, GgmlType.F16, GgmlType.F64):
        dst[...] = value
    elif dequant.is_packed(type_):
        logical = dst.shape[:-1] + (node.ne[0],)
        dst[...] = dequant.quantize(xp, xp.broadcast_to(value, logical), type_)
    else:
        raise UnsupportedOp(f"{type_name(type_)} destination is not supported")


def repeat_to(xp, a, shape):
    """Broadcast `a` to `shape` by tiling (ggml_repeat semantics: index mod size)."""
    shape = tuple(shape)
    if a.shape == shape:
        return a
    reps = []
    for have, want in zip(a.shape, shape):
        if have == want or have == 1:
            reps.append(1)
        elif want % have == 0:
            reps.append(want // have)
        else:
            raise UnsupportedOp(f"cannot repeat shape {a.shape} to {shape}")
    if any(r != 1 for r in reps):
        a = xp.tile(a, reps)
    return xp.broadcast_to(a, shape)


def f32_param(node, slot: int) -> float:
    return node.f32[slot]  # decoded once, when the plan was built (BoundNode)


def i32_param(node, slot: int) -> int:
    return node.i32[slot]


def unsupported(node: RpcTensor, src_tensors, why: str = "") -> UnsupportedOp:
    types = ", ".join(type_name(s.type) for s in src_tensors if s is not None)
    extra = f": {why}" if why else ""
    return UnsupportedOp(f"{op_name(node.op)}: dst {type_name(node.type)}, srcs {types} not supported{extra}")


def require_types(node: RpcTensor, src_tensors, dst_types, *src_types) -> None:
    """Raise UnsupportedOp unless dst's type and each listed source's type are allowed."""
    ok = node.type in dst_types and all(
        s is not None and s.type in allowed for s, allowed in zip(src_tensors, src_types)
    )
    if not ok:
        raise unsupported(node, src_tensors)


def check_indices(xp, node: RpcTensor, idx, bound: int) -> None:
    """Row indices must lie in [0, bound): numpy would wrap negatives and read the wrong row."""
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= bound):
        raise ComputeError(
            f"{op_name(node.op)}: index {int(idx.min())}..{int(idx.max())} outside [0, {bound})"
        )


def quiet(xp):
    """IEEE results (log(-1), x/0, exp overflow) are the point, not warnings."""
    return xp.errstate(all="ignore") if hasattr(xp, "errstate") else contextlib.nullcontext()
