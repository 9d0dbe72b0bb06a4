"""MUL_MAT and MUL_MAT_ID: weights (any float or quantized type) times f32 activations.

The CPU backend converts the activations to the weight type's `vec_dot_type` before the dot
products (protocol §16.3): f16 weights see f16-rounded activations, q8_0-family weights see
activations quantized to q8_0 blocks, K-quants to q8_K. We round the activations the same way
and multiply against the dequantized weights in f32, which lands within a few ulp of the CPU
instead of the ~1e-3 relative gap an exact f32 product would leave.
"""

from __future__ import annotations

from fleetd.compute import dequant
from fleetd.compute.ops import register
from fleetd.compute.ops.common import (
    FLOAT_TYPES,
    as_f32,
    check_indices,
    round_bf16,
    round_f16,
    store,
    unsupported,
    weights_f32,
)
from fleetd.wire import GgmlOp, GgmlType

Q8_0_FAMILY = frozenset(
    {
        GgmlType.Q4_0,
        GgmlType.Q5_0,
        GgmlType.Q8_0,
        GgmlType.IQ4_NL,
        GgmlType.MXFP4,
        GgmlType.NVFP4,
        GgmlType.Q1_0,
        GgmlType.Q2_0,
    }
)
Q8_1_FAMILY = frozenset({GgmlType.Q4_1, GgmlType.Q5_1})
NOT_MATMUL_WEIGHTS = frozenset({GgmlType.Q8_1, GgmlType.Q8_K})


def fake_q8_0(xp, x):
    """x quantized to q8_0 blocks of 32 and back, as the x86 quantize_row_q8_0: d = max/127
    stored f16, q = round-half-even(x * (127/max))."""
    blocks = x.reshape(x.shape[:-1] + (-1, 32))
    amax = xp.max(xp.abs(blocks), axis=-1, keepdims=True)
    inv = xp.where(amax > 0, xp.float32(127) / xp.where(amax > 0, amax, 1), 0).astype(xp.float32)
    q = xp.rint(blocks * inv)
    return (q * round_f16(xp, amax / xp.float32(127))).reshape(x.shape)


def fake_q8_k(xp, x):
    """x quantized to q8_K blocks of 256 (f32 scale from the signed extreme) and back."""
    blocks = x.reshape(x.shape[:-1] + (-1, 256))
    extreme = xp.take_along_axis(blocks, xp.argmax(xp.abs(blocks), axis=-1)[..., None], axis=-1)
    safe = xp.where(extreme == 0, 1, extreme)
    iscale = xp.where(extreme == 0, 0, xp.float32(-127) / safe).astype(xp.float32)
    q = xp.minimum(xp.rint(blocks * iscale), 127)
    d = xp.where(iscale == 0, 0, 1 / xp.where(iscale == 0, 1, iscale)).astype(xp.float32)
    return (q * d).reshape(x.shape)


def activations_like_cpu(xp, x, weight_type: int):
    """Round f32 activations the way the CPU converts them to the weights' vec_dot_type."""
    if weight_type == GgmlType.F32:
        return x
    if weight_type == GgmlType.F16:
        return round_f16(xp, x)
    if weight_type == GgmlType.BF16:
        return round_bf16(xp, x)
    if weight_type in Q8_0_FAMILY or weight_type in Q8_1_FAMILY:
        return fake_q8_0(xp, x)
    return fake_q8_k(xp, x)


def _check_types(node, src_tensors):
    wt, xt = src_tensors[0], src_tensors[1]
    weights_ok = wt.type in FLOAT_TYPES or (
        dequant.is_packed(wt.type) and wt.type in dequant.DEQUANTIZABLE and wt.type not in NOT_MATMUL_WEIGHTS
    )
    if not weights_ok or xt.type not in FLOAT_TYPES or node.type != GgmlType.F32:
        raise unsupported(node, src_tensors)


def _activations(xp, view, xt, wt):
    x = as_f32(xp, view, xt)
    # Activations already in the vec_dot_type are used as they are.
    return x if xt.type == wt.type else activations_like_cpu(xp, x, wt.type)


def _overlaps(xp, dst, srcs) -> bool:
    return any(s is not None and xp.shares_memory(dst, s) for s in srcs[:2])


@register(GgmlOp.MUL_MAT)
def op_mul_mat(xp, dst, srcs, node, src_tensors):
    """MUL_MAT: x times the f32 form of the weights (cached), broadcast over batches; one GEMM
    when a single weight matrix serves every batch."""
    # dst[b3, b2, n, m] = sum_k x[b3, b2, n, k] * w[b3 // r3, b2 // r2, m, k]
    _check_types(node, src_tensors)
    wt, xt = src_tensors[0], src_tensors[1]
    w = weights_f32(xp, node, 0, srcs[0], wt)  # (A3, A2, M, K)
    x = _activations(xp, srcs[1], xt, wt)  # (B3, B2, N, K)
    a3, a2, m, k = w.shape
    b3, b2, n, _ = x.shape
    if a3 == a2 == 1:
        # One weight matrix for every batch: a single GEMM over all rows, straight into dst
        # when dst is plain f32 memory that no operand shares.
        rows = x.reshape(-1, k)
        if node.type == GgmlType.F32 and dst.flags.c_contiguous and not _overlaps(xp, dst, srcs):
            xp.matmul(rows, w[0, 0].T, out=dst.reshape(-1, m))
            return
        out = rows @ w[0, 0].T
    else:
        r3, r2 = b3 // a3, b2 // a2
        x6 = x.reshape(a3, r3, a2, r2, n, k)
        out = x6 @ w.reshape(a3, 1, a2, 1, m, k).swapaxes(-1, -2)
    store(xp, dst, node, out.reshape(b3, b2, n, m))


@register(GgmlOp.MUL_MAT_ID)
def op_mul_mat_id(xp, dst, srcs, node, src_tensors):
    """MUL_MAT_ID: each token's rows times the experts `ids` picks, one GEMM per expert used."""
    # dst[t, e, :] = experts[ids[t, e]] @ x[t, e % n_b1, :]; experts (1, n_expert, M, K),
    # x (1, n_tok, n_b1, K), ids (1, 1, n_tok, n_used), dst (1, n_tok, n_used, M)
    _check_types(node, src_tensors)
    wt, xt, it = src_tensors[0], src_tensors[1], src_tensors[2]
    if it.type != GgmlType.I32:
        raise unsupported(node, src_tensors)
    experts = weights_f32(xp, node, 0, srcs[0], wt)[0]  # (n_expert, M, K)
    x = _activations(xp, srcs[1], xt, wt)[0]  # (n_tok, n_b1, K)
    ids = srcs[2][0, 0]  # (n_tok, n_used)
    check_indices(xp, node, ids, experts.shape[0])
    n_tok, n_used = ids.shape
    n_b1 = x.shape[1]
    out = xp.empty((n_tok, n_used, experts.shape[1]), dtype=xp.float32)
    rows_for = x[:, xp.arange(n_used) % n_b1]  # (n_tok, n_used, K)
    for expert in xp.unique(ids).tolist():
        t, e = xp.nonzero(ids == expert)
        out[t, e] = rows_for[t, e] @ experts[expert].T
    store(xp, dst, node, out[None])
