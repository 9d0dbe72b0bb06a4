"""Helpers shared by kernels: reading any element type as f32, writing f32 to any type."""

from __future__ import annotations

import numpy as np

from fleetd.errors import UnsupportedOp
from fleetd.wire import GgmlType, RpcTensor, type_name


def bf16_to_f32(xp, raw):
    return (raw.astype(xp.uint32) << 16).view(xp.float32)


def f32_to_bf16(xp, x):
    # Round to nearest even, NaN kept quiet: ggml_compute_fp32_to_bf16.
    bits = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return xp.where(nan, (bits >> 16) | 64, rounded).astype(xp.uint16)


def as_f32(xp, view, t: RpcTensor):
    """The tensor's values as float32 (a view when already f32)."""
    if t.type == GgmlType.F32:
        return view
    if t.type == GgmlType.BF16:
        return bf16_to_f32(xp, view)
    if t.type in (GgmlType.F16, GgmlType.F64, GgmlType.I32, GgmlType.I16, GgmlType.I8, GgmlType.I64):
        return view.astype(xp.float32)
    raise UnsupportedOp(f"reading {type_name(t.type)} as f32 is not supported")


def store(xp, dst, node: RpcTensor, value) -> None:
    """Write f32 `value` (broadcastable to dst) into dst, converting as ggml's from_float does."""
    if node.type == GgmlType.BF16:
        dst[...] = f32_to_bf16(xp, xp.broadcast_to(value, dst.shape))
    elif node.type == GgmlType.I32:
        # C truncation toward zero.
        dst[...] = xp.trunc(value).astype(xp.int32)
    elif node.type in (GgmlType.F32, GgmlType.F16, GgmlType.F64):
        dst[...] = value
    else:
        raise UnsupportedOp(f"{type_name(node.type)} destination is not supported")


def repeat_to(xp, a, shape):
    """Broadcast `a` to `shape` by tiling (ggml_repeat semantics: index mod size)."""
    if a.shape == tuple(shape):
        return a
    reps = []
    for have, want in zip(a.shape, shape):
        if have == want or have == 1:
            reps.append(1)
        elif want % have == 0:
            reps.append(want // have)
        else:
            raise UnsupportedOp(f"cannot repeat shape {a.shape} to {tuple(shape)}")
    if any(r != 1 for r in reps):
        a = xp.tile(a, reps)
    return xp.broadcast_to(a, shape)


def f32_param(node: RpcTensor, slot: int) -> float:
    return float(np.array(node.op_params[slot], dtype=np.int32).view(np.float32))
