"""Packed (block-quantized) tensors to f32 and back, with the gguf package doing the bit work.

The f32 copies of weights kept between decode steps are the device's (dequant_cache.py).

gguf's quantizers run on numpy only; cupy arrays go through the host (a later issue may move
the hot types onto the device).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from fleetd.compute import quantizers
from fleetd.errors import UnsupportedOp
from fleetd.wire import TYPE_TRAITS, GgmlType, type_name


def _has(cls, method: str) -> bool:
    # gguf's base class raises NotImplementedError; a real implementation overrides it.
    return method in vars(cls)


_GGUF_TRAITS = gguf_quants._type_traits  # qtype -> quant class, filled by gguf's subclasses


def _dequant_q1_0(blocks: np.ndarray) -> np.ndarray:
    # d f16 @0, qs[16] @2: element j is +d when bit (j % 8) of qs[j // 8] is set, else -d
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    bits = np.unpackbits(blocks[:, 2:18], axis=1, bitorder="little").astype(np.float32)
    return d * (2 * bits - 1)


def _dequant_q2_0(blocks: np.ndarray) -> np.ndarray:
    # d f16 @0, qs[16] @2: q = (qs[j // 4] >> 2 (j % 4)) & 3, element (q - 1) d
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)
    q = ((blocks[:, 2:18, None] >> shifts) & 3).reshape(blocks.shape[0], 64).astype(np.float32)
    return d * (q - 1)


def _quant_q8_0(values: np.ndarray) -> np.ndarray:
    # As the x86 SIMD quantize_row_q8_0: x * (127/max), rounded half to even (gguf's
    # reference multiplies by 1/d and rounds half away).
    blocks = values.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax == 0, np.float32(0), np.float32(127) / amax)
    q = np.rint(blocks * inv).astype(np.int8)
    return np.concatenate([d.astype(np.float16).view(np.uint8), q.view(np.uint8)], axis=1)


# Block types gguf does not dequantize, done here: type -> f(blocks (n, type_size)) -> (n, blck).
OWN_DEQUANTIZERS = {GgmlType.Q1_0: _dequant_q1_0, GgmlType.Q2_0: _dequant_q2_0}

DEQUANTIZABLE = frozenset(
    int(q) for q, cls in _GGUF_TRAITS.items() if _has(cls, "dequantize_blocks") and int(q) != GgmlType.BF16
) | frozenset(OWN_DEQUANTIZERS)


def roundf(xp, x):
    """C roundf: halves away from zero (floor(|x| + 0.5) would also round 0.49999997 up)."""
    whole = xp.trunc(x)
    return xp.where(xp.abs(x - whole) >= 0.5, whole + xp.sign(x), whole)


def _quant_q1_0(values: np.ndarray) -> np.ndarray:
    # d = mean |x| (f16), one sign bit per element (x >= 0 -> 1): quantize_row_q1_0_ref
    blocks = values.reshape(-1, 128)
    d = (np.abs(blocks).sum(axis=1, keepdims=True, dtype=np.float32) / np.float32(128)).astype(np.float16)
    bits = np.packbits(blocks >= 0, axis=1, bitorder="little")
    return np.concatenate([d.view(np.uint8), bits], axis=1)


def _quant_q2_0(values: np.ndarray) -> np.ndarray:
    # d = max |x| (f16); q = clamp(roundf(x / d) + 1, 0, 3), four per byte: quantize_row_q2_0_ref
    blocks = values.reshape(-1, 64)
    d = np.abs(blocks).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0))
    q = np.clip(roundf(np, blocks * inv) + 1, 0, 3).astype(np.uint8)
    q = q.reshape(-1, 16, 4) << np.array([0, 2, 4, 6], dtype=np.uint8)
    packed = np.bitwise_or.reduce(q, axis=2).astype(np.uint8)
    return np.concatenate([d.astype(np.float16).view(np.uint8), packed], axis=1)


IQ4_NL_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32
)


def _nearest_iq4_nl(scaled: np.ndarray) -> np.ndarray:
    """best_index_int8: the nearest table entry, ties to the upper one."""
    k = IQ4_NL_VALUES
    upper = np.clip(np.searchsorted(k, scaled, side="right"), 1, len(k) - 1)
    lower = upper - 1
    pick = np.where(scaled - k[lower] < k[upper] - scaled, lower, upper)
    return np.where(scaled <= k[0], 0, np.where(scaled >= k[-1], len(k) - 1, pick)).astype(np.uint8)


def _quant_iq4_nl(values: np.ndarray) -> np.ndarray:
    # quantize_row_iq4_nl_ref: indices from x / (max / -127) (max = the signed extreme), then
    # the least-squares scale sum(w q x) / sum(w q q) with weights w = x^2, stored f16.
    blocks = values.reshape(-1, 32)
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)
    live = np.abs(extreme) >= 1e-15  # GROUP_MAX_EPS: quieter blocks get d = 0
    d0 = np.where(live, extreme / IQ4_NL_VALUES[0], 1).astype(np.float32)
    idx = _nearest_iq4_nl(blocks * (np.float32(1) / d0))
    q = IQ4_NL_VALUES[idx]
    w = blocks * blocks
    sumqx = np.sum(w * q * blocks, axis=1, keepdims=True, dtype=np.float32)
    sumq2 = np.sum(w * q * q, axis=1, keepdims=True, dtype=np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.where(live & (sumq2 > 0), sumqx / sumq2, 0).astype(np.float16)
    packed = idx[:, :16] | (idx[:, 16:] << 4)
    return np.concatenate([d.view(np.uint8), packed.astype(np.uint8)], axis=1)


# Quantizers of ours, where gguf has none or differs from the CPU backend: f32 rows -> blocks.
OWN_QUANTIZERS = {
    GgmlType.Q8_0: _quant_q8_0,
    GgmlType.Q1_0: _quant_q1_0,
    GgmlType.Q2_0: _quant_q2_0,
    GgmlType.IQ4_NL: _quant_iq4_nl,
    GgmlType.Q2_K: quantizers.quant_q2_k,
    GgmlType.Q3_K: quantizers.quant_q3_k,
    GgmlType.Q4_K: quantizers.quant_q4_k,
    GgmlType.Q5_K: quantizers.quant_q5_k,
    GgmlType.Q6_K: quantizers.quant_q6_k,
    GgmlType.IQ4_XS: quantizers.quant_iq4_xs,
    GgmlType.NVFP4: quantizers.quant_nvfp4,
}

QUANTIZABLE = frozenset(
    int(q) for q, cls in _GGUF_TRAITS.items() if _has(cls, "quantize_blocks") and int(q) != GgmlType.BF16
) | frozenset(OWN_QUANTIZERS)


def is_packed(type_: int) -> bool:
    """Block types: their array views are uint8 rows of whole blocks (see views.py)."""
    return TYPE_TRAITS[type_].blck_size > 1


def to_host(x):
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


def dequantize(xp, view, type_: int):
    """uint8 rows (…, row_bytes) of `type_` -> f32 (…, ne0)."""
    if type_ not in DEQUANTIZABLE:
        raise UnsupportedOp(f"dequantizing {type_name(type_)} is not supported")
    host = np.ascontiguousarray(to_host(view))
    own = OWN_DEQUANTIZERS.get(type_)
    if own is not None:
        tr = TYPE_TRAITS[type_]
        rows = host.reshape(-1, tr.type_size)
        values = own(rows).reshape(host.shape[:-1] + (host.shape[-1] // tr.type_size * tr.blck_size,))
    else:
        values = gguf_quants.dequantize(host, GGMLQuantizationType(type_)).astype(np.float32, copy=False)
    return xp.asarray(values)


def quantize(xp, values, type_: int):
    """f32 (…, ne0) -> uint8 rows (…, row_bytes) of `type_`, as ggml's from_float does."""
    if type_ not in QUANTIZABLE:
        raise UnsupportedOp(f"quantizing to {type_name(type_)} is not supported")
    host = np.ascontiguousarray(to_host(values), dtype=np.float32)
    own = OWN_QUANTIZERS.get(type_)
    if own is not None:
        tr = TYPE_TRAITS[type_]
        packed = own(host).reshape(host.shape[:-1] + (host.shape[-1] // tr.blck_size * tr.type_size,))
    else:
        packed = gguf_quants.quantize(host, GGMLQuantizationType(type_))
    return xp.asarray(packed)
