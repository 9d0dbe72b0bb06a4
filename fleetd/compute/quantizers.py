"""f32 -> k-quant, IQ4_XS and NVFP4 blocks, as ggml's CPU backend writes them (CPY, SET_ROWS).

The CPU backend's from_float for these types is the reference quantizer in ggml-quants.c, which
lives in ggml-base and is built without -march=native: plain float32 arithmetic, no FMA, every
sum accumulated left to right. To agree with it bit for bit, everything here stays float32,
keeps the C's operation order, and sums with `running_sum` (sequential) rather than np.sum
(pairwise). Blocks are processed all at once; the only loops run over the C's small fixed
search ranges and over the 16 or 32 elements of a group where the C updates state per element.

Each public quantizer takes f32 values (any shape whose size is a multiple of the block size)
and returns uint8 blocks of shape (n_blocks, type_size).
"""

from __future__ import annotations

import functools

import numpy as np

F32 = np.float32
QK_K = 256
GROUP_MAX_EPS = F32(1e-15)  # groups whose largest |x| is below this quantize to zero

IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], F32)
FP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], F32)  # E2M1, doubled


# ---- helpers shared by the types -------------------------------------------------------------


def running_sum(terms: np.ndarray) -> np.ndarray:
    """Sum over the last axis left to right in float32, as the C's `s += term` loops do."""
    return np.add.accumulate(terms.astype(F32, copy=False), axis=-1, dtype=F32)[..., -1]


def nearest_int(values) -> np.ndarray:
    """ggml's nearest_int: add 1.5 * 2^23 in float32 and read the low mantissa bits back
    (round half to even; reproduces the C's result even outside its asserted range)."""
    with np.errstate(over="ignore", invalid="ignore"):
        shifted = (np.asarray(values, F32) + F32(12582912.0)).astype(F32)
    return (shifted.view(np.int32) & 0x007FFFFF) - 0x00400000


def to_f16_bytes(values: np.ndarray) -> np.ndarray:
    """float32 (n,) -> (n, 2) little-endian fp16 bytes, rounded to nearest even like GGML_FP32_TO_FP16."""
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(values.astype(np.float16)).view(np.uint8).reshape(-1, 2)


def f16_round(values: np.ndarray) -> np.ndarray:
    """The value an fp16 field reads back as (GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(v)))."""
    with np.errstate(over="ignore"):
        return values.astype(np.float16).astype(F32)


def signed_extreme(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(max |v|, the v it came from) over the last axis; the first wins ties, as the C's `>` scan."""
    where = np.abs(values).argmax(axis=-1)[..., None]
    extreme = np.take_along_axis(values, where, axis=-1)[..., 0]
    return np.abs(extreme), extreme


def nearest_table_index(table: np.ndarray, scaled: np.ndarray) -> np.ndarray:
    """best_index_int8: index of the nearest entry of the sorted table, ties to the upper one."""
    upper = np.clip(np.searchsorted(table, scaled, side="right"), 1, len(table) - 1)
    lower = upper - 1
    pick = np.where(scaled - table[lower] < table[upper] - scaled, lower, upper)
    return np.where(scaled <= table[0], 0, np.where(scaled >= table[-1], len(table) - 1, pick))


def pack_bits(bits: np.ndarray, width: int) -> np.ndarray:
    """OR together fields of `width` bits: bits (..., k, m) -> (..., m), field i shifted by i*width."""
    shifts = (np.arange(bits.shape[-2]) * width).astype(np.int64)[:, None]
    return np.bitwise_or.reduce(bits.astype(np.int64) << shifts, axis=-2).astype(np.uint8)


def as_blocks(values: np.ndarray, size: int) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=F32).reshape(-1, size)


def safe(denominator: np.ndarray) -> np.ndarray:
    """A denominator that is never zero; the callers discard the lanes where it was."""
    return np.where(denominator == 0, F32(1), denominator).astype(F32)


# ---- the C's per-group scale searches, vectorized over groups (rows) --------------------------


def make_qkx2_quants(x, weights, nmax, rmin, rdelta, nstep, use_mad):
    """As make_qkx2_quants: levels 0..nmax with a scale and a (non-positive) offset, first from
    the min/max range, then the weighted least-squares fit of each of nstep+1 nudged scales,
    keeping whichever gives the smallest weighted error. As in the C, a better fit's offset
    becomes the origin and range of the later trials. Returns (levels, scale, -offset)."""
    lowest = np.minimum(x.min(axis=1), F32(0))  # the C clamps min to at most 0
    highest = x.max(axis=1)
    flat = highest == lowest
    sum_w = running_sum(weights)
    sum_x = running_sum(weights * x)

    def levels_for(iscale, offset):
        return np.clip(nearest_int(iscale * (x - offset[:, None])), 0, nmax).astype(F32)

    def weighted_error(scale, offset, levels):
        diff = (scale[:, None] * levels + offset[:, None]) - x
        return running_sum(weights * (np.abs(diff) if use_mad else diff * diff))

    iscale = F32(nmax) / safe(highest - lowest)[:, None]
    scale = (F32(1) / iscale)[:, 0]
    offset = lowest
    levels = levels_for(iscale, offset)
    best_error = weighted_error(scale, offset, levels)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for step in range(nstep + 1):
            span = (highest - offset)[:, None]
            trial_iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / span
            trial = levels_for(trial_iscale, offset)
            wl = weights * trial
            sum_l, sum_l2, sum_xl = running_sum(wl), running_sum(wl * trial), running_sum(wl * x)
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe(det)
            this_offset = (sum_l2 * sum_x - sum_l * sum_xl) / safe(det)
            # a positive offset is not representable: refit the scale alone through zero
            positive = this_offset > 0
            this_scale = np.where(positive, sum_xl / safe(sum_l2), this_scale)
            this_offset = np.where(positive, F32(0), this_offset)
            error = weighted_error(this_scale, this_offset, trial)
            better = (det > 0) & (error < best_error)
            levels = np.where(better[:, None], trial, levels)
            best_error = np.where(better, error, best_error)
            scale = np.where(better, this_scale, scale)
            offset = np.where(better, this_offset, offset)
    levels = np.where(flat[:, None], F32(0), levels)
    scale = np.where(flat, F32(0), scale)
    the_min = np.where(flat, -lowest, -offset)
    return levels.astype(np.int64), scale.astype(F32), the_min.astype(F32)


def make_qx_quants_rmse1(x, nmax):
    """As make_qx_quants(rmse_type=1, no importance weights): symmetric levels -nmax..nmax-1
    (returned offset by nmax), weights x^2, trying the scales nmax + 0.1*is for is in -9..9."""
    amax, extreme = signed_extreme(x)
    live = amax >= GROUP_MAX_EPS
    extreme = safe(np.where(live, extreme, F32(0)))[:, None]
    weights = x * x

    def fit(iscale):
        levels = np.clip(nearest_int(iscale * x), -nmax, nmax - 1).astype(F32)
        return levels, running_sum(weights * x * levels), running_sum(weights * levels * levels)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        levels, sumlx, suml2 = fit(F32(-nmax) / extreme)
        scale = np.where(suml2 != 0, sumlx / safe(suml2), F32(0))
        best = scale * sumlx
        for step in (*range(-9, 0), *range(1, 10)):
            trial, sumlx, suml2 = fit(-(F32(nmax) + F32(0.1) * F32(step)) / extreme)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            levels = np.where(better[:, None], trial, levels)
            scale = np.where(better, sumlx / safe(suml2), scale)
            best = np.where(better, scale * sumlx, best)
    levels = np.where(live[:, None], levels.astype(np.int64) + nmax, 0)
    return levels, np.where(live, scale, F32(0)).astype(F32)


def make_q3_quants_rmse(x, nmax):
    """As make_q3_quants(do_rmse=true): symmetric levels from -nmax/max, then up to five passes
    that move one level at a time when that raises sumlx^2/suml2 (weights x^2). A pass that
    changes nothing ends the C's loop; further passes would change nothing either, so all
    groups simply run five. Returns (levels offset by nmax, scale)."""
    amax, extreme = signed_extreme(x)
    live = amax >= GROUP_MAX_EPS
    extreme = safe(np.where(live, extreme, F32(0)))[:, None]
    weights = x * x
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        levels = np.clip(nearest_int((F32(-nmax) / extreme) * x), -nmax, nmax - 1).astype(F32)
        sumlx = running_sum(weights * x * levels)
        suml2 = running_sum(weights * levels * levels)
        for _ in range(5):
            for i in range(x.shape[1]):
                w, xi, li = weights[:, i], x[:, i], levels[:, i]
                slx = sumlx - w * xi * li
                sl2 = suml2 - w * li * li
                new = np.clip(nearest_int(xi * sl2 / safe(slx)), -nmax, nmax - 1).astype(F32)
                slx_new = slx + w * xi * new
                sl2_new = sl2 + w * new * new
                accept = (
                    (slx > 0)
                    & (new != li)
                    & (sl2_new > 0)
                    & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new)
                )
                levels[:, i] = np.where(accept, new, li)
                sumlx = np.where(accept, slx_new, sumlx)
                suml2 = np.where(accept, sl2_new, suml2)
        scale = np.where(suml2 > 0, sumlx / safe(suml2), F32(0))
    levels = np.where(live[:, None], levels.astype(np.int64) + nmax, 0)
    return levels, np.where(live, scale, F32(0)).astype(F32)


def scale_and_min_codes(scales, mins, code_max=63):
    """The q4_K/q5_K 6-bit codes of each group's scale and min, relative to the block maxima
    (as the C: uint8 of nearest_int, capped at 63). Returns (codes_scale, codes_min, d, dmin)."""
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F32(code_max) / safe(max_scale), F32(0))[:, None]
        inv_min = np.where(max_min > 0, F32(code_max) / safe(max_min), F32(0))[:, None]
    code_scale = np.minimum(nearest_int(inv_scale * scales) & 0xFF, code_max)
    code_min = np.minimum(nearest_int(inv_min * mins) & 0xFF, code_max)
    return code_scale, code_min, max_scale / F32(code_max), max_min / F32(code_max)


def pack_k4_scales(code_scale, code_min):
    """The 12-byte 6-bit scale/min layout of q4_K and q5_K (get_scale_min_k4 reads it back)."""
    packed = np.zeros((code_scale.shape[0], 12), np.int64)
    packed[:, 0:4] = code_scale[:, :4] | ((code_scale[:, 4:] >> 4) << 6)
    packed[:, 4:8] = code_min[:, :4] | ((code_min[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (code_scale[:, 4:] & 0xF) | ((code_min[:, 4:] & 0xF) << 4)
    return packed.astype(np.uint8)


def requantize_with_min(x, code_scale, code_min, d, dmin, levels, nmax):
    """Final levels from the stored (fp16) super-scales: nearest_int((x + dm)/d), clamped; a
    group whose scale reads back as zero keeps the levels of its search, as the C does."""
    group_d = (f16_round(d)[:, None] * code_scale.astype(F32))[..., None]
    group_dm = (f16_round(dmin)[:, None] * code_min.astype(F32))[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(nearest_int((x + group_dm) / safe(group_d)), 0, nmax)
    return np.where(group_d != 0, requant, levels)


# ---- the types -------------------------------------------------------------------------------


def quietly(quantizer):
    """Huge inputs overflow fp16 scales to inf and 0 * inf to NaN, exactly as in the C; that is
    the format's answer, not an error worth a warning."""

    @functools.wraps(quantizer)
    def run(values):
        with np.errstate(all="ignore"):
            return quantizer(values)

    return run


@quietly
def quant_q2_k(values: np.ndarray) -> np.ndarray:
    """f32 -> Q2_K blocks, 84 bytes per 256 values, as ggml's reference quantizer writes them."""
    # quantize_row_q2_K_ref: 16 groups of 16, levels 0..3 with scale and min (weights |x|),
    # both coded in 4 bits against fp16 super-scales max/15.
    blocks = as_blocks(values, QK_K)
    groups = blocks.reshape(-1, 16)
    levels, scales, mins = make_qkx2_quants(groups, np.abs(groups), 3, -0.5, 0.1, 15, True)
    n = blocks.shape[0]
    x, levels, scales, mins = (
        blocks.reshape(n, 16, 16),
        levels.reshape(n, 16, 16),
        scales.reshape(n, 16),
        mins.reshape(n, 16),
    )
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    with np.errstate(divide="ignore"):
        code_scale = np.where(
            (max_scale > 0)[:, None], nearest_int((F32(15) / safe(max_scale))[:, None] * scales), 0
        )
        code_min = np.where((max_min > 0)[:, None], nearest_int((F32(15) / safe(max_min))[:, None] * mins), 0)
    d = np.where(max_scale > 0, max_scale / F32(15), F32(0))
    dmin = np.where(max_min > 0, max_min / F32(15), F32(0))
    scale_bytes = ((code_scale & 0xFF) | (code_min << 4)) & 0xFF
    levels = requantize_with_min(x, scale_bytes & 0xF, scale_bytes >> 4, d, dmin, levels, 3).reshape(
        n, 2, 4, 32
    )
    qs = pack_bits(levels, 2).reshape(n, 64)
    return np.concatenate([scale_bytes.astype(np.uint8), qs, to_f16_bytes(d), to_f16_bytes(dmin)], axis=1)


@quietly
def quant_q3_k(values: np.ndarray) -> np.ndarray:
    """f32 -> Q3_K blocks, 110 bytes per 256 values, as ggml's reference quantizer writes them."""
    # quantize_row_q3_K_ref: 16 groups of 16, symmetric levels -4..3; group scales coded in
    # 6 bits (signed, -32..31) against the fp16 super-scale, then every level requantized.
    blocks = as_blocks(values, QK_K)
    n = blocks.shape[0]
    levels, scales = make_q3_quants_rmse(blocks.reshape(-1, 16), 4)
    levels, scales = levels.reshape(n, 16, 16), scales.reshape(n, 16)
    _, max_scale = signed_extreme(scales)
    live = max_scale != 0
    with np.errstate(divide="ignore"):
        iscale = np.where(live, F32(-32) / safe(max_scale), F32(0))
        d = np.where(live, F32(1) / safe(iscale), F32(0))
    as_int8 = ((nearest_int(iscale[:, None] * scales) + 128) & 0xFF) - 128
    codes = np.where(live[:, None], np.clip(as_int8, -32, 31) + 32, 0)
    group_d = (f16_round(d)[:, None] * (codes - 32).astype(F32))[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(nearest_int(blocks.reshape(n, 16, 16) / safe(group_d)), -4, 3) + 4
    levels = np.where(live[:, None, None] & (group_d != 0), requant, levels).reshape(n, 8, 32)
    hmask = pack_bits(levels > 3, 1)
    low = (levels & 3).reshape(n, 2, 4, 32)
    qs = pack_bits(low, 2).reshape(n, 64)
    scale_bytes = np.zeros((n, 12), np.int64)
    scale_bytes[:, :8] = (codes[:, :8] & 0xF) | ((codes[:, 8:] & 0xF) << 4)
    scale_bytes[:, 8:] = pack_bits((codes >> 4).reshape(n, 4, 4), 2)
    return np.concatenate([hmask, qs, scale_bytes.astype(np.uint8), to_f16_bytes(d)], axis=1)


def _qkx_groups_of_32(blocks, nmax, rmin, nstep):
    # q4_K/q5_K group search: weights av_x + |x| with av_x the group's RMS.
    groups = blocks.reshape(-1, 32)
    rms = np.sqrt(running_sum(groups * groups) / F32(32))
    return make_qkx2_quants(groups, rms[:, None] + np.abs(groups), nmax, rmin, 0.1, nstep, False)


@quietly
def quant_q4_k(values: np.ndarray) -> np.ndarray:
    # quantize_row_q4_K_ref: 8 groups of 32, levels 0..15 with scale and min, 6-bit codes.
    blocks = as_blocks(values, QK_K)
    n = blocks.shape[0]
    levels, scales, mins = _qkx_groups_of_32(blocks, 15, -1.0, 20)
    code_scale, code_min, d, dmin = scale_and_min_codes(scales.reshape(n, 8), mins.reshape(n, 8))
    levels = requantize_with_min(
        blocks.reshape(n, 8, 32), code_scale, code_min, d, dmin, levels.reshape(n, 8, 32), 15
    )
    qs = pack_bits(levels.reshape(n, 4, 2, 32), 4).reshape(n, 128)
    return np.concatenate(
        [to_f16_bytes(d), to_f16_bytes(dmin), pack_k4_scales(code_scale, code_min), qs], axis=1
    )


@quietly
def quant_q5_k(values: np.ndarray) -> np.ndarray:
    """f32 -> Q5_K blocks, 176 bytes per 256 values, as ggml's reference quantizer writes them."""
    # quantize_row_q5_K_ref: as q4_K with levels 0..31; the fifth bits go to qh.
    blocks = as_blocks(values, QK_K)
    n = blocks.shape[0]
    levels, scales, mins = _qkx_groups_of_32(blocks, 31, -0.5, 15)
    code_scale, code_min, d, dmin = scale_and_min_codes(scales.reshape(n, 8), mins.reshape(n, 8))
    levels = requantize_with_min(
        blocks.reshape(n, 8, 32), code_scale, code_min, d, dmin, levels.reshape(n, 8, 32), 31
    )
    qh = pack_bits(levels > 15, 1)
    qs = pack_bits((levels & 0xF).reshape(n, 4, 2, 32), 4).reshape(n, 128)
    return np.concatenate(
        [to_f16_bytes(d), to_f16_bytes(dmin), pack_k4_scales(code_scale, code_min), qh, qs], axis=1
    )


@quietly
def quant_q6_k(values: np.ndarray) -> np.ndarray:
    """f32 -> Q6_K blocks, 210 bytes per 256 values, as ggml's reference quantizer writes them."""
    # quantize_row_q6_K_ref: 16 groups of 16, symmetric levels -32..31, int8 group scales
    # against the fp16 super-scale; a block whose group scales are all ~0 is all zero bytes.
    blocks = as_blocks(values, QK_K)
    n = blocks.shape[0]
    levels, scales = make_qx_quants_rmse1(blocks.reshape(-1, 16), 32)
    levels, scales = levels.reshape(n, 16, 16), scales.reshape(n, 16)
    max_abs, max_scale = signed_extreme(scales)
    live = max_abs >= GROUP_MAX_EPS
    with np.errstate(divide="ignore"):
        iscale = np.where(live, F32(-128) / safe(max_scale), F32(0))
        d = np.where(live, F32(1) / safe(iscale), F32(0))
    codes = np.where(live[:, None], np.minimum(127, nearest_int(iscale[:, None] * scales)), 0)
    codes = ((codes + 128) & 0xFF) - 128  # stored as int8
    group_d = (f16_round(d)[:, None] * codes.astype(F32))[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(nearest_int(blocks.reshape(n, 16, 16) / safe(group_d)), -32, 31) + 32
    levels = np.where(live[:, None, None], np.where(group_d != 0, requant, levels), 0)
    quarters = levels.reshape(n, 2, 4, 32)  # [half][quarter][l]
    # quarters 0|2 and 1|3 share the bytes of ql: [half][upper nibble?][quarter % 2][l]
    pairs = (quarters & 0xF).reshape(n, 2, 2, 2, 32).transpose(0, 1, 3, 2, 4)
    ql = pack_bits(pairs, 4).reshape(n, 128)
    qh = pack_bits(quarters >> 4, 2).reshape(n, 64)
    return np.concatenate([ql, qh, codes.astype(np.int8).view(np.uint8), to_f16_bytes(d)], axis=1)


@quietly
def quant_iq4_xs(values: np.ndarray) -> np.ndarray:
    """f32 -> IQ4_XS blocks, 136 bytes per 256 values, as ggml's quantizer writes them without
    importance weights."""
    # quantize_iq4_xs without importance weights (quantize_row_iq4_nl_impl, super-block 256,
    # ntry 7): per group of 32 the best non-linear-grid scale over 15 trial scales (weights
    # x^2), then 6-bit group scales against d = -max/32 and every index chosen again.
    blocks = as_blocks(values, QK_K)
    n = blocks.shape[0]
    groups = blocks.reshape(-1, 32)
    amax, extreme = signed_extreme(groups)
    live = amax >= GROUP_MAX_EPS
    extreme = safe(np.where(live, extreme, F32(0)))[:, None]
    weights = groups * groups

    def fit(inverse_scale):
        grid = IQ4_NL_VALUES[nearest_table_index(IQ4_NL_VALUES, inverse_scale * groups)]
        return running_sum(weights * grid * groups), running_sum(weights * grid * grid)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        sumqx, sumq2 = fit(F32(1) / (-extreme / IQ4_NL_VALUES[0]))
        scale = np.where(sumq2 > 0, sumqx / safe(sumq2), F32(0))
        best = scale * sumqx
        for step in range(-7, 8):
            sumqx, sumq2 = fit((F32(step) + IQ4_NL_VALUES[0]) / extreme)
            better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            scale = np.where(better, sumqx / safe(sumq2), scale)
            best = np.where(better, scale * sumqx, best)
    scales = np.where(live, scale, F32(0)).reshape(n, 8)
    _, max_scale = signed_extreme(scales)
    d = -max_scale / F32(32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv_d = np.where(d != 0, F32(1) / safe(d), F32(0))
        codes = np.clip(nearest_int(inv_d[:, None] * scales), -32, 31)
        group_d = d[:, None] * codes.astype(F32)
        inv_group_d = np.where(group_d != 0, F32(1) / safe(group_d), F32(0))
    indices = nearest_table_index(IQ4_NL_VALUES, inv_group_d[..., None] * blocks.reshape(n, 8, 32))
    qs = pack_bits(indices.reshape(n, 8, 2, 16), 4).reshape(n, 128)
    codes = codes + 32
    high = np.bitwise_or.reduce((codes >> 4) << (2 * np.arange(8)), axis=1).astype(np.uint16)
    low = pack_bits((codes & 0xF).reshape(n, 4, 2).transpose(0, 2, 1), 4)
    return np.concatenate([to_f16_bytes(d), high[:, None].view(np.uint8), low, qs], axis=1)


def _ue4m3_table() -> np.ndarray:
    # ggml_ue4m3_to_fp32 for every code; 0 and 0x7F read as zero
    table = np.zeros(128, F32)
    for code in range(1, 127):
        exponent, mantissa = code >> 3, code & 7
        raw = mantissa * 2.0**-9 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7)
        table[code] = F32(raw * 0.5)
    return table


UE4M3_VALUES = _ue4m3_table()


def fp32_to_ue4m3(x: np.ndarray) -> np.ndarray:
    """ggml_fp32_to_ue4m3: round the mantissa on its 4th bit, saturating at 0x7E; values below
    the normal range round to a subnormal code (trunc(x*512 + 0.5), at most 7)."""
    x = np.minimum(x.astype(F32), F32(448))
    bits = x.view(np.uint32).astype(np.int64)
    exponent = ((bits >> 23) & 0xFF) - 127 + 7
    mantissa = ((bits >> 20) & 7) + ((bits >> 19) & 1)
    carry = mantissa > 7
    exponent = np.where(carry, exponent + 1, exponent)
    mantissa = np.where(carry, 0, mantissa)
    normal = np.where(exponent >= 15, 0x7E, (exponent << 3) | mantissa)
    subnormal = np.minimum(np.trunc(x * F32(512) + F32(0.5)).astype(np.int64), 7)
    subnormal = np.where(subnormal < 1, 0, subnormal)
    code = np.where(((bits >> 23) & 0xFF) - 127 + 7 <= 0, subnormal, normal)
    return np.where(x > 0, code, 0).astype(np.uint8)


@quietly
def quant_nvfp4(values: np.ndarray) -> np.ndarray:
    # quantize_row_nvfp4_ref: per 16 values a UE4M3 scale of max|x|/6, each value the nearest
    # E2M1 grid point (the first of equals, as best_index_mxfp4's strict `<`).
    subs = as_blocks(values, 16)
    n = subs.shape[0] // 4
    amax = np.abs(subs).max(axis=1)
    codes = fp32_to_ue4m3(amax / F32(6))
    scale = UE4M3_VALUES[codes & 0x7F][:, None, None]
    error = np.abs(FP4_VALUES[None, None, :] * scale - subs[:, :, None])
    indices = error.argmin(axis=2).reshape(n, 4, 2, 8)
    qs = pack_bits(indices, 4).reshape(n, 32)
    return np.concatenate([codes.reshape(n, 4), qs], axis=1)
