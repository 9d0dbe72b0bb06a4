"""ROPE and ROPE_BACK: rotary position embeddings, with the YaRN/ext parameters and the
multi-section variants (MROPE, IMROPE, VISION). Angles follow the CPU kernel step for step:
`p * theta_scale^m` is a running f32 product, then the YaRN ramp, then cosf/sinf times mscale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fleetd.compute.ops import register
from fleetd.compute.ops.common import as_f32, f32_param, i32_param, store, unsupported
from fleetd.wire import GgmlOp, GgmlType

NORMAL, NEOX, MROPE, VISION, IMROPE = 0, 2, 8, 24, 40
MULTI_MODES = (MROPE, VISION, IMROPE)


def corr_dims(n_dims: int, n_ctx_orig: int, freq_base, beta_fast, beta_slow):
    """ggml_rope_yarn_corr_dims in f32, with C's IEEE results for n_ctx_orig = 0 (log 0 = -inf)."""
    f32 = np.float32

    def corr_dim(n_rot):
        return (
            f32(n_dims) * np.log(f32(n_ctx_orig) / (n_rot * f32(2 * math.pi))) / (f32(2) * np.log(freq_base))
        )

    with np.errstate(all="ignore"):
        low = np.maximum(f32(0), np.floor(corr_dim(beta_fast)))
        high = np.minimum(f32(n_dims - 1), np.ceil(corr_dim(beta_slow)))
    return f32(low), f32(high)


def running_thetas(xp, positions, theta_scale, n_pairs: int):
    """(n_tok, n_pairs): p, p*ts, (p*ts)*ts, … in f32, as the CPU's cache loop multiplies."""
    steps = xp.full((positions.shape[0], n_pairs), theta_scale, dtype=xp.float32)
    steps[:, 0] = positions.astype(xp.float32)
    return xp.cumprod(steps, axis=1, dtype=xp.float32)


@dataclass(frozen=True, slots=True)
class RopeParams:
    """What a ROPE node's parameters and shapes fix, worked out once per plan."""

    n_pairs: int
    theta_scale: np.float32
    freq_scale: np.float32
    ramp: object  # (n_pairs,) YaRN blend toward the extrapolated angle, None without ext_factor
    mscale: np.float32
    sections: tuple | None  # multi-RoPE: (which position, exponent) per pair
    halves: tuple[slice, slice]


def bind_rope(xp, node, src_tensors) -> RopeParams | None:
    """ROPE and ROPE_BACK: the RopeParams of the node's op_params and src0's shape, or None for a
    mode or n_dims the kernel refuses (it says why)."""
    n_dims, mode, n_ctx_orig = i32_param(node, 1), i32_param(node, 2), i32_param(node, 4)
    freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow = (
        np.float32(f32_param(node, i)) for i in range(5, 11)
    )
    n_offs, ne0 = i32_param(node, 15), src_tensors[0].ne[0]
    if mode not in (NORMAL, NEOX) + MULTI_MODES or n_dims % 2 or n_offs % 2 or n_offs + n_dims > ne0:
        return None  # the kernel says why
    theta_scale = np.float32(freq_base ** np.float32(-2.0 / n_dims))
    n_pairs = ne0 // 2 if mode == VISION else n_dims // 2
    sections = section_indices(node, n_pairs, mode) if mode in MULTI_MODES else None
    ramp, mscale = None, attn_factor
    if ext_factor != 0:
        low, high = corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
        with np.errstate(all="ignore"):
            ramp_y = (np.arange(n_pairs, dtype=np.float32) - low) / np.maximum(np.float32(0.001), high - low)
        ramp = xp.asarray((1 - np.minimum(1, np.maximum(0, ramp_y))) * ext_factor, dtype=xp.float32)
        mscale = np.float32(mscale * np.float32(1.0 + 0.1 * np.log(np.float32(1.0) / freq_scale)))
    return RopeParams(
        n_pairs, theta_scale, freq_scale, ramp, mscale, sections, _halves(mode, n_offs, n_dims, n_pairs)
    )


def section_indices(node, n_pairs: int, mode: int):
    """Multi-RoPE: for each pair, which of the four positions it turns by, and its exponent."""
    s = [i32_param(node, 11 + i) for i in range(4)]
    total = sum(s)
    if total <= 0:
        raise unsupported(node, [], "multi-RoPE with empty sections")
    sector = np.arange(n_pairs) % total
    which = np.full(n_pairs, 3)  # p_e unless a rule below picks t, h or w
    if mode == IMROPE:
        which[(sector % 3 == 0) & (sector < 3 * s[0])] = 0
        which[(sector % 3 == 1) & (sector < 3 * s[1])] = 1
        which[(sector % 3 == 2) & (sector < 3 * s[2])] = 2
    else:
        which[sector < s[0] + s[1] + s[2]] = 2
        which[sector < s[0] + s[1]] = 1
        which[sector < s[0]] = 0
    exponent = np.arange(n_pairs)
    if mode == VISION:
        # Each section restarts its running product at the section's first pair.
        starts = np.array([0, s[0], s[0] + s[1], s[0] + s[1] + s[2]])
        exponent = sector - starts[which]
    return which, exponent


def section_thetas(xp, sections, pos, n_tok: int, theta_scale, n_pairs: int):
    """Per-pair thetas of the multi-RoPE modes: each pair picks one of four positions."""
    which, exponent = sections
    tables = [running_thetas(xp, pos[k * n_tok : (k + 1) * n_tok], theta_scale, n_pairs) for k in range(4)]
    stacked = xp.stack(tables)  # (4, n_tok, n_pairs)
    return stacked[xp.asarray(which), :, xp.asarray(exponent)].T  # (n_tok, n_pairs)


def _rope(xp, dst, srcs, node, src_tensors, sin_sign: float):
    xt = src_tensors[0]
    if (
        xt.type not in (GgmlType.F32, GgmlType.F16)
        or node.type != xt.type
        or src_tensors[1].type != GgmlType.I32
    ):
        raise unsupported(node, src_tensors)
    n_dims, mode, n_offs = i32_param(node, 1), i32_param(node, 2), i32_param(node, 15)
    x = as_f32(xp, srcs[0], xt)  # (ne3, n_tok, n_head, ne0)
    ne0, n_tok = x.shape[3], x.shape[1]
    if mode not in (NORMAL, NEOX) + MULTI_MODES or n_dims % 2 or n_offs % 2 or n_offs + n_dims > ne0:
        raise unsupported(node, src_tensors, f"mode {mode}, n_dims {n_dims}, n_offs {n_offs}")
    p = node.bound or bind_rope(xp, node, src_tensors)
    pos = srcs[1].reshape(-1)
    n_pairs = p.n_pairs
    if p.sections is not None:
        theta_extrap = section_thetas(xp, p.sections, pos, n_tok, p.theta_scale, n_pairs)
    else:
        theta_extrap = running_thetas(xp, pos[:n_tok], p.theta_scale, n_pairs)
    if len(srcs) > 2 and srcs[2] is not None:
        factors = as_f32(xp, srcs[2], src_tensors[2]).reshape(-1)[:n_pairs]
        theta_extrap = theta_extrap / factors
    theta = p.freq_scale * theta_extrap
    if p.ramp is not None:
        theta = theta * (1 - p.ramp) + theta_extrap * p.ramp
    cos = (xp.cos(theta) * p.mscale)[None, :, None, :]
    sin = (xp.sin(theta) * p.mscale * np.float32(sin_sign))[None, :, None, :]

    first, second = p.halves
    x0, x1 = x[..., first], x[..., second]
    # Both halves computed before any write: dst may share memory with x (ggml runs ROPE
    # in place when it can).
    rot0 = x0 * cos - x1 * sin
    rot1 = x0 * sin + x1 * cos
    if node.type == GgmlType.F32:
        if n_pairs * 2 < ne0:
            dst[...] = x  # the dimensions past n_dims pass through
        dst[..., first] = rot0
        dst[..., second] = rot1
        return
    out = x.copy()
    out[..., first] = rot0
    out[..., second] = rot1
    store(xp, dst, node, out)


def _halves(mode: int, n_offs: int, n_dims: int, n_pairs: int) -> tuple[slice, slice]:
    """The two elements each rotation pairs, as slices of the last axis."""
    if mode == NORMAL:  # adjacent: (n_offs + 2i, n_offs + 2i + 1)
        end = n_offs + 2 * n_pairs
        return slice(n_offs, end, 2), slice(n_offs + 1, end, 2)
    if mode == VISION:  # i and i + n_dims
        return slice(0, n_pairs), slice(n_dims, n_dims + n_pairs)
    half = n_offs + n_dims // 2  # NEOX and the multi modes: i and i + n_dims / 2
    return slice(n_offs, n_offs + n_pairs), slice(half, half + n_pairs)


@register(GgmlOp.ROPE, bind=bind_rope)
def op_rope(xp, dst, srcs, node, src_tensors):
    _rope(xp, dst, srcs, node, src_tensors, 1.0)


@register(GgmlOp.ROPE_BACK, bind=bind_rope)
def op_rope_back(xp, dst, srcs, node, src_tensors):
    # The inverse rotation: the same angles with the sine negated.
    _rope(xp, dst, srcs, node, src_tensors, -1.0)
