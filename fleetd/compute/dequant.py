"""Packed (block-quantized) tensors to f32 and back, with the gguf package doing the bit work.

Dequantized weights are cached per buffer region: a MUL_MAT against Q4_K weights would
otherwise unpack the whole matrix on every decode step. A cache entry remembers the buffer's
`generation` when it was made; every write to a buffer (SET_TENSOR, COPY_TENSOR, a graph node
writing there) bumps it, so a stale entry is never served.

gguf's quantizers run on numpy only; cupy arrays go through the host (a later issue may move
the hot types onto the device).
"""

from __future__ import annotations

import collections
import threading
import weakref

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from fleetd.compute import quantizers
from fleetd.compute.buffers import Buffer
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


IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


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


WRITE_LOG_LENGTH = 4096  # graph writes remembered per buffer; older ones count as "anything"
RECENT_VIEWS = 4096  # views remembered by `lookup`; forgotten all at once past that
ENTRIES_PER_BUFFER = 64  # a KV cache read through growing views must not pile up f32 copies


class DequantCache:
    """f32 copies of buffer regions, keyed by (offset, type, shape, strides), per buffer.

    An entry is valid while its buffer's generation is unchanged, or when every write since
    was a graph node's write (logged with its byte range by `note_write`) outside the entry's
    region: weights sharing a buffer with activations stay cached. Writes by commands
    (SET_TENSOR, COPY_TENSOR, …) bump the generation without a range, so they invalidate.
    Buffers are held weakly: a freed buffer takes its entries with it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_buffer: weakref.WeakKeyDictionary[Buffer, dict] = weakref.WeakKeyDictionary()
        self._writes: weakref.WeakKeyDictionary[Buffer, collections.deque] = weakref.WeakKeyDictionary()
        self.hits = 0
        self.misses = 0
        # id(view) -> (weakref to the view, buffer, generation, type, f32 value): a plan's
        # views live as long as the plan, so a recompute finds its weights here with one
        # generation compare, before any key or extent is worked out.
        self._recent: dict[int, tuple] = {}

    def note_write(self, buf: Buffer, start: int, end: int) -> None:
        """A graph node wrote bytes [start, end) of `buf` (offsets in the buffer)."""
        buf.touched()
        with self._lock:
            log = self._writes.get(buf)
            if log is None:
                log = self._writes[buf] = collections.deque(maxlen=WRITE_LOG_LENGTH)
            log.append((buf.generation, start, end))

    def lookup(self, view, type_: int, convert):
        """`get` for a view whose buffer is found by `owner_of`; a view seen before whose
        buffer has not been written since is answered at once."""
        seen = self._recent.get(id(view))
        if seen is not None and seen[0]() is view and seen[1].generation == seen[2] and seen[3] == type_:
            self.hits += 1
            return seen[4]
        buf = owner_of(view)
        if buf is None:
            return convert(view)
        generation = buf.generation
        value = self.get(buf, view, type_, convert)
        if len(self._recent) >= RECENT_VIEWS:
            self._recent.clear()
        self._recent[id(view)] = (weakref.ref(view), buf, generation, type_, value)
        return value

    def get(self, buf: Buffer | None, view, type_: int, convert):
        """`convert(view)` as f32, reusing the last result while its region is unwritten."""
        if buf is None:
            return convert(view)
        start = offset_in(buf, view)
        key = (start, type_, view.shape, view.strides)
        end = start + _extent(view)
        with self._lock:
            entries = self._by_buffer.setdefault(buf, {})
            hit = entries.get(key)
            if hit is not None and self._unwritten(buf, hit[0], start, end):
                entries[key] = (buf.generation, hit[1], end)
                self.hits += 1
                return hit[1]
        generation = buf.generation
        value = convert(view)
        with self._lock:
            self.misses += 1
            entries = self._by_buffer.setdefault(buf, {})
            for k in [k for k, (g, _, e) in entries.items() if not self._unwritten(buf, g, k[0], e)]:
                del entries[k]  # stale: its region was written
            while len(entries) >= ENTRIES_PER_BUFFER:
                del entries[next(iter(entries))]  # the oldest
            entries[key] = (generation, value, end)
        return value

    def _unwritten(self, buf: Buffer, since: int, start: int, end: int) -> bool:
        if since == buf.generation:
            return True
        log = self._writes.get(buf, ())
        needed = buf.generation - since
        seen = 0
        for generation, w_start, w_end in reversed(log):
            if generation <= since:
                break
            if w_start < end and start < w_end:
                return False
            seen += 1
        return seen == needed  # any unlogged write (a command) may have touched the region

    def entries(self, buf: Buffer) -> int:
        with self._lock:
            return len(self._by_buffer.get(buf, ()))

    def clear(self) -> None:
        with self._lock:
            self._by_buffer.clear()
            self._writes.clear()
            self._recent.clear()


def _extent(view) -> int:
    """Bytes from the view's first element to one past its last (non-negative strides)."""
    if view.size == 0:
        return 0
    return sum((n - 1) * s for n, s in zip(view.shape, view.strides)) + view.itemsize


def offset_in(buf: Buffer, view) -> int:
    return _address(view) - _address(buf.array)


def _address(a) -> int:
    if isinstance(a, np.ndarray):
        return a.__array_interface__["data"][0]
    return int(a.data.ptr)  # cupy


CACHE = DequantCache()

# Flat buffer arrays back to their Buffer, so kernels that see only array views can key the
# cache. Filled by the plan builder; an entry lives as long as its Buffer.
_OWNERS: weakref.WeakValueDictionary[int, Buffer] = weakref.WeakValueDictionary()


def note_owner(buf: Buffer) -> None:
    if buf.array is not None:
        _OWNERS[id(buf.array)] = buf


def owner_of(view) -> Buffer | None:
    base = view
    while getattr(base, "base", None) is not None:
        base = base.base
    buf = _OWNERS.get(id(base))
    return buf if buf is not None and buf.array is base else None
