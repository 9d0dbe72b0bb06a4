"""Attention: SOFT_MAX (scale, mask, ALiBi, sinks) and FLASH_ATTN_EXT.

FLASH_ATTN_EXT is computed as plain softmax attention in f32 (the CPU's online softmax
gives the same values up to rounding); Q is first rounded to K's vec_dot type as the CPU does.
"""

from __future__ import annotations

import math

import numpy as np

from fleetd.compute import dequant
from fleetd.compute.ops import register
from fleetd.compute.ops.common import (
    FLOAT_TYPES,
    as_f32,
    f32_param,
    i32_param,
    quiet,
    repeat_to,
    store,
    unsupported,
)
from fleetd.compute.ops.matmul import activations_like_cpu
from fleetd.wire import GgmlOp, GgmlType

TILE_Q = 64  # from this many queries on, the CPU takes its tiled path (f32 accumulators)
LIVE_ROUND = 16  # decode scores the KV prefix up to the last visible entry, in whole 16s
ONLINE_CHUNK_ELEMENTS = 1 << 20  # f32 v*vs products precomputed at once by the online f16 path


def alibi_slopes(xp, n_head: int, max_bias: float):
    """Per-head ALiBi slope (1 everywhere when max_bias is 0), shape (n_head,)."""
    if max_bias <= 0:
        return xp.ones(n_head, dtype=xp.float32)
    n_head_log2 = 1 << math.floor(math.log2(n_head))
    m0 = np.float32(2.0 ** (-max_bias / n_head_log2))
    m1 = np.float32(2.0 ** (-(max_bias / 2.0) / n_head_log2))
    h = np.arange(n_head)
    slopes = np.where(h < n_head_log2, m0 ** (h + 1), m1 ** (2 * (h - n_head_log2) + 1))
    return xp.asarray(slopes.astype(np.float32))


def _mask_for(xp, mask_view, mask_t, rows: int, heads: int, seqs: int):
    """The mask (S_m, H_m, ≥rows, n) as f32, cut to `rows` and repeated (mod) over heads/seqs."""
    m = as_f32(xp, mask_view, mask_t)[:, :, :rows, :]
    return repeat_to(xp, m, (seqs, heads, rows, m.shape[-1]))


def bind_head_slopes(xp, node, src_tensors):
    """SOFT_MAX and FLASH_ATTN_EXT: the per-head ALiBi slopes (max_bias @1), as (1, H, 1, 1);
    heads are dim 2 of src0 (the scores, or Q)."""
    return alibi_slopes(xp, src_tensors[0].ne[2], f32_param(node, 1))[None, :, None, None]


@register(GgmlOp.SOFT_MAX, bind=bind_head_slopes)
def op_soft_max(xp, dst, srcs, node, src_tensors):
    """SOFT_MAX of f32 rows: scaled, plus the ALiBi-sloped mask and per-head sinks; sums in f64."""
    # w = a*scale + slope(h)*mask; dst = exp(w - M) / (Σ exp(w - M) + exp(sink - M))
    at = src_tensors[0]
    if at.type != GgmlType.F32 or node.type != GgmlType.F32:
        raise unsupported(node, src_tensors)
    scale = f32_param(node, 0)
    a = srcs[0]  # (S, H, R, n)
    seqs, heads, rows, _ = a.shape
    w = a * np.float32(scale)
    mask_t = src_tensors[1] if len(src_tensors) > 1 else None
    if mask_t is not None:
        if mask_t.type not in (GgmlType.F16, GgmlType.F32):
            raise unsupported(node, src_tensors)
        slopes = node.bound if node.bound is not None else bind_head_slopes(xp, node, src_tensors)
        w = w + slopes * _mask_for(xp, srcs[1], mask_t, rows, heads, seqs)
    sinks = None
    if len(src_tensors) > 2 and src_tensors[2] is not None:
        sinks = srcs[2].reshape(-1)[:heads].astype(xp.float32)[None, :, None, None]
    with quiet(xp):
        peak = xp.max(w, axis=-1, keepdims=True)
        if sinks is not None:
            peak = xp.maximum(peak, sinks)
        e = xp.exp(w - peak)
        total = xp.sum(e, axis=-1, keepdims=True, dtype=xp.float64)
        if sinks is not None:
            total = total + xp.exp(sinks - peak)
        store(xp, dst, node, e * (1.0 / total).astype(xp.float32))


@register(GgmlOp.FLASH_ATTN_EXT, bind=bind_head_slopes)
def op_flash_attn_ext(xp, dst, srcs, node, src_tensors):
    """FLASH_ATTN_EXT: softmax(scale * Q K^T + mask) V, grouped heads, optional softcap and sinks;
    an f16 V with few queries takes the CPU's f16 online path, bit for bit."""
    qt, kt, vt = src_tensors[0], src_tensors[1], src_tensors[2]
    k_ok = kt.type in FLOAT_TYPES or kt.type in dequant.DEQUANTIZABLE
    v_ok = vt.type in FLOAT_TYPES or vt.type in dequant.DEQUANTIZABLE
    if qt.type != GgmlType.F32 or node.type != GgmlType.F32 or not (k_ok and v_ok):
        raise unsupported(node, src_tensors)
    if i32_param(node, 3) not in (0, 10):
        raise unsupported(node, src_tensors, f"precision {i32_param(node, 3)}")
    scale, softcap = f32_param(node, 0), f32_param(node, 2)
    if softcap != 0:
        scale = np.float32(scale) / np.float32(softcap)

    seqs, heads, n_q, d_k = srcs[0].shape
    d_v, n_kv, heads_kv, seqs_kv = vt.ne  # V [D_v, n_kv, H_kv, S_k] (a packed view holds bytes)
    mask_t = src_tensors[3] if len(src_tensors) > 3 else None
    # One query over >= 512 entries: the CPU splits KV across threads (thread-count
    # dependent sums), and one long f16 loop would be slow here: two-pass instead.
    split_kv = n_q == 1 and seqs == 1 and n_kv >= 512 and kt.type == vt.type
    online = vt.type == GgmlType.F16 and n_q < TILE_Q and not split_kv
    k_view, v_view, mask_view = srcs[1], srcs[2], srcs[3] if mask_t is not None else None
    if online and n_q == 1 and mask_t is not None:
        # Decode: the online path reads only entries some query sees, so the masked tail of
        # the KV cache need not be converted or scored at all.
        n_kv = _live_prefix(xp, mask_view, n_q, n_kv)
        k_view, v_view, mask_view = k_view[:, :, :n_kv], v_view[:, :, :n_kv], mask_view[..., :n_kv]

    q = activations_like_cpu(xp, srcs[0], kt.type)  # (S, H, n_q, D_k)
    # K and V are the KV cache, rewritten every step: converted, not cached.
    k = as_f32(xp, k_view, kt)  # (S_k, H_kv, n_kv, D_k)
    rs, rh = seqs // seqs_kv, heads // heads_kv
    # Grouped heads (and sequences) by division, without copying K and V.
    q6 = q.reshape(seqs_kv, rs, heads_kv, rh, n_q, d_k)
    scores = (q6 @ k[:, None, :, None].swapaxes(-1, -2)).reshape(seqs, heads, n_q, n_kv)
    scores = scores * np.float32(scale)
    with quiet(xp):
        if softcap != 0:
            scores = np.float32(softcap) * xp.tanh(scores)
        if mask_t is not None:
            slopes = node.bound if node.bound is not None else bind_head_slopes(xp, node, src_tensors)
            scores = scores + slopes * _mask_for(xp, mask_view, mask_t, n_q, heads, seqs)
        sinks = None
        if len(src_tensors) > 4 and src_tensors[4] is not None:
            sinks = srcs[4].reshape(-1)[:heads].astype(xp.float32)[None, :, None, None]
        if online:
            out = _online_f16(xp, scores, v_view, sinks, rs, rh)
        else:
            out = _two_pass(xp, scores, as_f32(xp, v_view, vt), sinks, rs, rh)
    # dst is [D_v, H, n_q, S]: numpy (S, n_q, H, D_v)
    store(xp, dst, node, out.reshape(seqs, heads, n_q, d_v).swapaxes(1, 2))


def _live_prefix(xp, mask_view, n_q: int, n_kv: int) -> int:
    """Entries up to the last one some query may see (its mask is not -inf), rounded up to
    LIVE_ROUND. Scores of one query are a matrix-vector product, whose rows are dotted
    independently: the kept scores are bit-identical to the full product's."""
    m = mask_view[:, :, :n_q, :n_kv]
    seen = xp.flatnonzero(~xp.all(xp.isneginf(m.reshape(-1, m.shape[-1])), axis=0))
    last = int(seen[-1]) + 1 if seen.size else 0
    return min(n_kv, max(LIVE_ROUND, -(-last // LIVE_ROUND) * LIVE_ROUND))


def _two_pass(xp, scores, v, sinks, rs, rh):
    """Softmax over the kv axis, then the weighted sum of V rows (f32 throughout)."""
    n_q, n_kv = scores.shape[2:]
    peak = xp.max(scores, axis=-1, keepdims=True)
    if sinks is not None:
        peak = xp.maximum(peak, sinks)
    # Rows whose every entry is masked (-inf) give zeros, as the CPU's S == 0 case.
    peak = xp.where(xp.isneginf(peak), 0, peak)
    e = xp.exp(scores - peak)
    total = xp.sum(e, axis=-1, keepdims=True)
    if sinks is not None:
        total = total + xp.exp(sinks - peak)
    weights = e * xp.where(total == 0, 0, 1 / xp.where(total == 0, 1, total))
    seqs_kv, heads_kv = v.shape[0], v.shape[1]
    return weights.reshape(seqs_kv, rs, heads_kv, rh, n_q, n_kv) @ v[:, None, :, None]


def _online_f16(xp, scores, v16, sinks, rs, rh):
    """The CPU's one-chunk kernel for an f16 V: an online softmax over kv entries in order,
    the weighted V sum kept in f16 (rounded after every scale and every add). Below TILE_Q
    queries this is what the stock server computes, and f16 accumulation moves results by
    ~1e-3: enough to flip a greedy token, so it is reproduced step by step. The running max,
    the rescale factors and the weights do not depend on the sum, so they are computed for
    all entries at once; only the f16 accumulation walks the entries."""
    n_q, n_kv = scores.shape[2:]
    seqs_kv, heads_kv, _, d_v = v16.shape
    grouped = (seqs_kv, rs, heads_kv, rh, n_q)
    s_all = scores.reshape(grouped + (n_kv,))
    # Entries masked for every query (the unused tail of the KV cache) are skipped entirely.
    live = xp.nonzero(~xp.all(xp.isneginf(s_all.reshape(-1, n_kv)), axis=0))[0]
    s_live = s_all[..., live]
    peaks = xp.maximum.accumulate(s_live, axis=-1)  # M after each entry
    before = xp.concatenate([xp.full(grouped + (1,), -xp.inf, dtype=xp.float32), peaks[..., :-1]], axis=-1)
    valid = ~xp.isneginf(s_live)
    ms_all = xp.where(valid & (s_live > before), xp.exp(before - peaks), xp.float32(1)).astype(xp.float32)
    vs_all = xp.where(valid, xp.exp(xp.where(valid, s_live, 0) - xp.where(valid, peaks, 0)), 0).astype(
        xp.float32
    )
    n_live = int(live.size)
    # Per entry: does any query/head rescale there (the running max rose)?
    rescale = xp.any((ms_all != 1).reshape(-1, n_live), axis=0).tolist() if n_live else []
    ms_t = xp.moveaxis(ms_all, -1, 0)[..., None]  # (n_live,) + grouped + (1,)
    vs_t = xp.moveaxis(vs_all, -1, 0)[..., None]
    total = _running_total(xp, ms_t, vs_t, rescale, grouped)
    v_live = xp.moveaxis(v16[:, :, live, :], 2, 0)[:, :, None, :, None, None, :]  # (n_live, S, 1, H, 1, 1, D)
    acc = xp.zeros(grouped + (d_v,), dtype=xp.float16)
    per_entry = max(1, acc.size)
    chunk = max(1, ONLINE_CHUNK_ELEMENTS // per_entry)
    for c0 in range(0, n_live, chunk):
        # v_row * vs for a chunk of entries at once (elementwise f32: the same products).
        prods = v_live[c0 : c0 + chunk].astype(xp.float32) * vs_t[c0 : c0 + chunk]
        for n in range(c0, min(c0 + chunk, n_live)):
            # f16(f32(acc) * ms), then f16(f32(acc) + v*vs): one ufunc each, cast on the way out.
            if rescale[n]:
                xp.multiply(acc, ms_t[n], out=acc, dtype=xp.float32, casting="unsafe")
            xp.add(acc, prods[n - c0], out=acc, dtype=xp.float32, casting="unsafe")
    peak = peaks[..., -1:] if live.size else xp.full(grouped + (1,), -xp.inf, dtype=xp.float32)
    out = acc.astype(xp.float32)
    if sinks is not None:
        sink = xp.broadcast_to(sinks.reshape(1, 1, heads_kv, rh, 1, 1), grouped + (1,))
        above = sink > peak
        ms = xp.where(above, xp.exp(peak - sink), xp.float32(1))
        vs = xp.where(above, xp.float32(1), xp.exp(sink - peak))
        out = out * ms
        total = total * ms + vs
    return out * xp.where(total == 0, 0, 1 / xp.where(total == 0, 1, total))


def _running_total(xp, ms_t, vs_t, rescale, grouped):
    """total = total * ms + vs over the entries in order, in f32. ms is exactly 1 away from
    the rescale points, so between them the running total is a plain sequential sum (an
    add.accumulate, which sums left to right as the loop does)."""
    total = xp.zeros(grouped + (1,), dtype=xp.float32)
    n_live = len(rescale)
    points = [n for n in range(n_live) if rescale[n]] + [n_live]
    start = 0
    for stop in points:
        if stop > start:
            seq = xp.concatenate([total[None], vs_t[start:stop]])
            total = xp.add.accumulate(seq, axis=0)[-1]
        if stop < n_live:
            total = total * ms_t[stop]
            start = stop
    return total
