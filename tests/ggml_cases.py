"""The ggml device's rule cases, shared by its tests: a Slab of tensors in one remote buffer, one
case per rule of fleetd/compute/ggml/rules.py (build(slab, bad) returns the nodes; bad=True breaks
exactly that rule), and send(), which says whether a case computed or cost its connection."""

from __future__ import annotations

import numpy as np

from fleetd.client.graph import GraphBuilder, Tensor, f32_bits
from fleetd.client.rpc import RpcClient
from fleetd.errors import PeerClosed, TransportError
from fleetd.wire import GgmlOp, GgmlType

F32, F16, I32, I64, Q8_0 = GgmlType.F32, GgmlType.F16, GgmlType.I32, GgmlType.I64, GgmlType.Q8_0
BF16, Q4_K, Q8_K = GgmlType.BF16, GgmlType.Q4_K, GgmlType.Q8_K
HADAMARD = 1  # MUL_MAT op_params[1]: ggml_mul_mat_set_hint(GGML_HINT_SRC0_IS_HADAMARD)


class Slab:
    """Tensors placed one after another in one remote buffer, filled with seeded values."""

    def __init__(self, client: RpcClient, size: int = 1 << 20):
        self.client, self.g = client, GraphBuilder()
        self.handle, _ = client.alloc_buffer(size)
        self.base, self.next = client.buffer_get_base(self.handle), 0
        self.rng = np.random.default_rng(7)

    def place(self, t: Tensor) -> Tensor:
        self.g.place(t, self.handle, self.base + self.next)
        self.next += (t.nbytes + 63) // 64 * 64
        return t

    def leaf(self, type_, ne, values=None) -> Tensor:
        t = self.place(self.g.tensor(type_, ne))
        if values is None:
            n = int(np.prod(ne))
            values = self.rng.standard_normal(n).astype(np.float32)
            if type_ == F16:
                values = values.astype(np.float16)
        self.client.set_tensor(t.rpc(), np.ascontiguousarray(values).tobytes())
        return t

    def node(self, op, type_, ne, srcs, params=()) -> Tensor:
        t = self.g.tensor(type_, ne)
        t.op, t.src = op, list(srcs)
        for i, p in enumerate(params):
            t.op_params[i] = p
        return self.place(t)

    def compute(self, *nodes: Tensor) -> None:
        self.client.graph_compute(self.g.serialize(list(nodes)))


# One case per rule: build(slab, bad) returns the nodes; bad=True breaks exactly that rule.


def mul_mat_k(s, bad):
    return [s.node(GgmlOp.MUL_MAT, F32, (4, 3), [s.leaf(F32, (8, 4)), s.leaf(F32, (16 if bad else 8, 3))])]


def mul_mat_shape(s, bad):
    return [s.node(GgmlOp.MUL_MAT, F32, (4, 5 if bad else 3), [s.leaf(F32, (8, 4)), s.leaf(F32, (8, 3))])]


def mul_mat_type(s, bad):
    return [s.node(GgmlOp.MUL_MAT, F16 if bad else F32, (4, 3), [s.leaf(F32, (8, 4)), s.leaf(F32, (8, 3))])]


def mul_mat_id_ids(s, bad):
    ids = s.leaf(I32, (2, 3), np.array([0, 1, 1, 2, 2, 5 if bad else 0], np.int32))
    return [s.node(GgmlOp.MUL_MAT_ID, F32, (4, 2, 3), [s.leaf(F32, (8, 4, 3)), s.leaf(F32, (8, 1, 3)), ids])]


def ids_view_not_inside_argsort(s, bad):
    # ids claim to be a view of an ARGSORT of this graph but point at client bytes
    probs = s.leaf(F32, (3, 3))
    order = s.node(GgmlOp.ARGSORT, I32, (3, 3), [probs], [1])
    ids = s.leaf(I32, (2, 3), np.array([0, 1, 1, 2, 2, 7 if bad else 0], np.int32))
    ids.view_src, ids.op, ids.src = order, GgmlOp.VIEW, [order]
    return [
        order,
        s.node(GgmlOp.MUL_MAT_ID, F32, (4, 2, 3), [s.leaf(F32, (8, 4, 3)), s.leaf(F32, (8, 1, 3)), ids]),
    ]


def ids_rewritten_before_use(s, bad):
    # ARGSORT makes in-range ids; a CPY in between may not overwrite them with client bytes
    order = s.node(GgmlOp.ARGSORT, I32, (3, 3), [s.leaf(F32, (3, 3))], [1])
    ids = s.g.view_of(order, (2, 3), (4, 12, 36, 36), 0)
    junk = s.leaf(I32, (3, 3), np.full(9, 7, np.int32))
    nodes = [order, s.g.cpy(junk, order)] if bad else [order]
    return nodes + [
        s.node(GgmlOp.MUL_MAT_ID, F32, (4, 2, 3), [s.leaf(F32, (8, 4, 3)), s.leaf(F32, (8, 1, 3)), ids])
    ]


def op_past_enum(s, bad):
    return [s.node(250 if bad else GgmlOp.SCALE, F32, (8,), [s.leaf(F32, (8,))], [f32_bits(2.0)])]


def op_without_rule(s, bad):
    return [s.node(GgmlOp.POOL_1D if bad else GgmlOp.SCALE, F32, (8,), [s.leaf(F32, (8,))], [f32_bits(2.0)])]


def add_repeat(s, bad):
    return [s.node(GgmlOp.ADD, F32, (8, 4), [s.leaf(F32, (8, 4)), s.leaf(F32, (3 if bad else 8, 1))])]


def mul_result_shape(s, bad):
    return [s.node(GgmlOp.MUL, F32, (8, 8 if bad else 4), [s.leaf(F32, (8, 4)), s.leaf(F32, (8, 1))])]


def rms_norm_type(s, bad):
    t = F16 if bad else F32
    return [s.node(GgmlOp.RMS_NORM, t, (8, 2), [s.leaf(t, (8, 2))], [f32_bits(1e-6)])]


def get_rows_range(s, bad):
    rows = s.leaf(I32, (3,), np.array([0, 3, 9 if bad else 1], np.int32))
    return [s.node(GgmlOp.GET_ROWS, F32, (8, 3), [s.leaf(F32, (8, 4)), rows])]


def set_rows_range(s, bad):
    dst = s.leaf(F16, (8, 4))
    rows = s.leaf(I64, (2,), np.array([1, -1 if bad else 3], np.int64))
    node = s.g.view_of(dst, dst.ne, dst.nb, 0)
    node.op, node.src = GgmlOp.SET_ROWS, [s.leaf(F32, (8, 2)), rows, dst]
    return [node]


def rope_dims(s, bad):
    pos = s.leaf(I32, (3,), np.arange(3, dtype=np.int32))
    params = [0, 16 if bad else 8, 2, 0, 0, f32_bits(10000.0), f32_bits(1.0), 0, f32_bits(1.0), 0, 0]
    return [s.node(GgmlOp.ROPE, F32, (8, 2, 3), [s.leaf(F32, (8, 2, 3)), pos], params)]


def soft_max_mask(s, bad):
    mask = s.leaf(F32, (4 if bad else 8, 2))
    return [s.node(GgmlOp.SOFT_MAX, F32, (8, 2), [s.leaf(F32, (8, 2)), mask], [f32_bits(1.0), 0])]


def flash_attn_kv(s, bad):
    q, k = s.leaf(F32, (64, 1, 2)), s.leaf(F16, (64, 32, 2))
    v, mask = s.leaf(F16, (64, 16 if bad else 32, 2)), s.leaf(F16, (32, 1))
    return [s.node(GgmlOp.FLASH_ATTN_EXT, F32, (64, 2, 1), [q, k, v, mask], [f32_bits(0.125), 0, 0, 0])]


def glu_shape(s, bad):
    return [s.node(GgmlOp.GLU, F32, (8 if bad else 4, 2), [s.leaf(F32, (8, 2))], [2, 0])]


def unary_op(s, bad):
    return [s.node(GgmlOp.UNARY, F32, (8,), [s.leaf(F32, (8,))], [99 if bad else 10])]


def cpy_count(s, bad):
    dst = s.leaf(F16, (8, 3 if bad else 2))
    return [s.g.cpy(s.leaf(F32, (8, 2)), dst)]


def cpy_quant_block(s, bad):
    # f32 rows of 16 into q8_0 (blocks of 32): the quantizer would write past the row
    dst = s.leaf(Q8_0, (32, 1), np.zeros(34, np.uint8))
    return [s.g.cpy(s.leaf(F32, (16 if bad else 32, 1)), dst)]


def raw(s, type_, ne) -> Tensor:
    """A leaf of seeded bytes (quantized blocks: the kernels only move or read them)."""
    t = s.place(s.g.tensor(type_, ne))
    s.client.set_tensor(t.rpc(), s.rng.integers(0, 256, t.nbytes, np.uint8).tobytes())
    return t


def bf16_bits(values: np.ndarray) -> np.ndarray:
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def mul_mat_bf16_src1(s, bad):
    # f32 weights' dot is f32's own: bf16 src1 is widened into it; f16 weights dot with f16,
    # and their kernel has no bf16 conversion of src1
    w = s.leaf(F16 if bad else F32, (8, 4))
    return [
        s.node(GgmlOp.MUL_MAT, F32, (4, 3), [w, s.leaf(BF16, (8, 3), bf16_bits(s.rng.standard_normal(24)))])
    ]


def hadamard(n: int) -> np.ndarray:
    """What GGML_HINT_SRC0_IS_HADAMARD says src0 holds: (-1)^popcount(r & c) / sqrt(n)."""
    r, c = np.indices((n, n))
    parity = np.vectorize(lambda v: bin(v).count("1") & 1)(r & c)
    return np.where(parity == 0, 1.0, -1.0).astype(np.float32) / np.sqrt(n, dtype=np.float32)


def mul_mat_hadamard(s, bad):
    # the hinted kernel writes ne10 floats per result row: a one-row src0 leaves rows of one
    w = s.leaf(F32, (16, 1)) if bad else s.leaf(F32, (16, 16), hadamard(16))
    return [s.node(GgmlOp.MUL_MAT, F32, (w.ne[1], 3), [w, s.leaf(F32, (16, 3))], [0, HADAMARD])]


def mul_mat_q8_k_src1(s, bad):
    # q4_K weights dot with q8_K; the tiled kernel (src1 rows >= 8) reads q8_K rows at r * nb1
    # over all 32 rows: a broadcast src1 (nb2 = 0) holds 8
    x = raw(s, Q8_K, (256, 8, 4))
    if bad:
        x = s.g.view_of(x, (256, 8, 4), (x.nb[0], x.nb[1], 0, 0), 0)
    return [s.node(GgmlOp.MUL_MAT, F32, (4, 8, 4), [raw(s, Q4_K, (256, 4)), x])]


def permuted(s, t: Tensor, axes) -> Tensor:
    """ggml_permute(t, *axes): dim i of t becomes dim axes[i]."""
    ne, nb = [0] * 4, [0] * 4
    for i, j in enumerate(axes):
        ne[j], nb[j] = t.ne[i], t.nb[i]
    return s.g.view_of(t, ne, nb, 0, GgmlOp.PERMUTE)


def cpy_quant_permuted(s, bad):
    # same-type q4_K, permuted src0: copied row by row when the shapes match; into a
    # contiguous result of another shape ggml would copy 256x a row per row
    a = permuted(s, raw(s, Q4_K, (256, 2, 3, 4)), (0, 2, 1, 3))
    return [s.g.cpy(a, raw(s, Q4_K, (256, 6, 4) if bad else a.ne))]


def q8_0_blocks(scales: np.ndarray, quants: np.ndarray) -> np.ndarray:
    """q8_0 bytes: per block an f16 scale, then 32 int8."""
    blocks = np.zeros(len(scales), np.dtype([("d", "<f2"), ("qs", "i1", 32)]))
    blocks["d"], blocks["qs"] = scales, quants.reshape(-1, 32)
    return blocks.view(np.uint8)


def cpy_dequant_permuted(s, bad):
    # q8_0 -> f32 from a permuted src0; each block lands as 32 floats from its element on:
    # rows of 16 with a gap after each would take a block's second half past its row
    if bad:
        dst = raw(s, F32, (16, 13))
        return [s.g.cpy(raw(s, Q8_0, (32, 6)), s.g.view_of(dst, (16, 12), (4, 68, 816, 816), 0))]
    a = permuted(s, raw(s, Q8_0, (32, 2, 3)), (0, 2, 1, 3))
    return [s.g.cpy(a, raw(s, F32, a.ne))]


def cpy_f32_i32(s, bad):
    # f32 <-> i32 converts element by element at any strides; i32 -> f16 is no kernel
    a = s.g.transpose(s.leaf(I32, (8, 2), np.arange(16, dtype=np.int32)))
    return [s.g.cpy(a, s.leaf(F16 if bad else F32, (2, 8)))]


def cont_dequant(s, bad):
    # ggml's dequantizing copy reads the result's layout from src1: a CONT has none
    a = s.leaf(Q8_0, (32, 2), q8_0_blocks(np.ones(2, np.float16), np.arange(64) - 32))
    if bad:
        return [s.node(GgmlOp.CONT, F32, (32, 2), [a])]
    return [s.g.cpy(a, raw(s, F32, (32, 2)))]


def sqr_types(s, bad):
    # unary-ops.cpp aborts on f32 -> f16
    return [s.node(GgmlOp.SQR, F16 if bad else F32, (8, 2), [s.leaf(F32, (8, 2))])]


def leaky_relu_type(s, bad):
    # the kernel goes by src0's type: f32 rows written into f16 ones run past them
    return [s.node(GgmlOp.LEAKY_RELU, F16 if bad else F32, (8, 2), [s.leaf(F32, (8, 2))], [f32_bits(0.1)])]


def sum_type(s, bad):
    # a transposed src0 is summed as the stock server does; an f16 result of f32 is no kernel
    return [s.node(GgmlOp.SUM, F16 if bad else F32, (1,), [s.g.transpose(s.leaf(F32, (8, 2)))])]


def cumsum_shape(s, bad):
    return [s.node(GgmlOp.CUMSUM, F32, (8, 3 if bad else 2), [s.leaf(F32, (8, 2))])]


def repeat_shape(s, bad):
    return [s.node(GgmlOp.REPEAT, F32, (8, 2), [s.leaf(F32, (3 if bad else 4, 1))])]


def fill_type(s, bad):
    t = I32 if bad else F32
    return [s.node(GgmlOp.FILL, t, (8, 2), [s.leaf(t, (8, 2), np.zeros(16, np.int32))], [f32_bits(2.5)])]


def arange_count(s, bad):
    return [
        s.node(GgmlOp.ARANGE, F32, (16 if bad else 8,), [], [f32_bits(0.0), f32_bits(8.0), f32_bits(1.0)])
    ]


def set_offset(s, bad):
    # a 32-float result; the ggml kernel's assert lets the view's last element start at the
    # result's end (offset 100 + 7 floats = 128) and writes 4 bytes past it
    a, b = s.leaf(F32, (8, 4)), s.leaf(F32, (8, 1))
    return [s.node(GgmlOp.SET, F32, (8, 4), [a, b], [32, 128, 128, 100 if bad else 96, 0])]


def acc_strides(s, bad):
    a, b = s.leaf(F32, (8, 4)), s.leaf(F32, (4, 2))
    return [s.node(GgmlOp.ACC, F32, (8, 4), [a, b], [-32 if bad else 32, 128, 128, 16, 0])]


def group_norm_groups(s, bad):
    # 0 groups: ggml divides by it (SIGFPE)
    return [
        s.node(GgmlOp.GROUP_NORM, F32, (4, 2, 6), [s.leaf(F32, (4, 2, 6))], [0 if bad else 3, f32_bits(1e-6)])
    ]


def rope_back_dims(s, bad):
    pos = s.leaf(I32, (3,), np.arange(3, dtype=np.int32))
    params = [0, 16 if bad else 8, 2, 0, 0, f32_bits(10000.0), f32_bits(1.0), 0, f32_bits(1.0), 0, 0]
    return [s.node(GgmlOp.ROPE_BACK, F32, (8, 2, 3), [s.leaf(F32, (8, 2, 3)), pos], params)]


def rope_mrope_sections(s, bad):
    # the mrope cache takes i0/2 modulo the sections' sum: 1 + -1 divides by zero
    pos = s.leaf(I32, (12,), np.arange(12, dtype=np.int32))
    params = [
        0,
        8,
        8,
        0,
        0,
        f32_bits(10000.0),
        f32_bits(1.0),
        0,
        f32_bits(1.0),
        0,
        0,
        1 if bad else 2,
        -1 if bad else 2,
        0,
        0,
    ]
    return [s.node(GgmlOp.ROPE, F32, (8, 2, 3), [s.leaf(F32, (8, 2, 3)), pos], params)]


def unary_f16(s, bad):
    # gelu's f16 kernel writes f16: an f32 result is no kernel
    x = s.leaf(F16, (8, 2))
    return [s.node(GgmlOp.UNARY, F32 if bad else F16, (8, 2), [x], [8])]  # 8: GELU


def glu_bf16(s, bad):
    # swiglu has a bf16 kernel, swiglu_oai none
    x = s.leaf(BF16, (8, 2), bf16_bits(s.rng.standard_normal(16)))
    return [s.node(GgmlOp.GLU, BF16, (4, 2), [x], [3 if bad else 2, 0])]


def concat_f16(s, bad):
    b = s.leaf(F32 if bad else F16, (8, 3))
    return [s.node(GgmlOp.CONCAT, F16, (8, 5), [s.leaf(F16, (8, 2)), b], [1])]


def clamp_f16(s, bad):
    # f16 rows clamped into f16; into f32 the kernel would write f16 (no kernel for it)
    x = s.leaf(F16, (8, 2))
    return [s.node(GgmlOp.CLAMP, F32 if bad else F16, (8, 2), [x], [f32_bits(-0.5), f32_bits(0.5)])]


def outside_buffer(s, bad):
    node = s.node(GgmlOp.SCALE, F32, (8,), [s.leaf(F32, (8,))], [f32_bits(2.0)])
    if bad:
        node.data = s.base + (1 << 20) - 16  # 32 bytes from 16 before the end
    return [node]


CASES = [
    mul_mat_k,
    mul_mat_shape,
    mul_mat_type,
    mul_mat_id_ids,
    ids_view_not_inside_argsort,
    ids_rewritten_before_use,
    op_past_enum,
    op_without_rule,
    add_repeat,
    mul_result_shape,
    rms_norm_type,
    get_rows_range,
    set_rows_range,
    rope_dims,
    soft_max_mask,
    flash_attn_kv,
    glu_shape,
    unary_op,
    cpy_count,
    cpy_quant_block,
    mul_mat_bf16_src1,
    mul_mat_hadamard,
    mul_mat_q8_k_src1,
    cpy_quant_permuted,
    cpy_dequant_permuted,
    cpy_f32_i32,
    cont_dequant,
    sqr_types,
    leaky_relu_type,
    sum_type,
    cumsum_shape,
    repeat_shape,
    fill_type,
    arange_count,
    set_offset,
    acc_strides,
    group_norm_groups,
    rope_back_dims,
    rope_mrope_sections,
    unary_f16,
    glu_bf16,
    concat_f16,
    clamp_f16,
    outside_buffer,
]


def send(server_endpoint: str, case, bad: bool) -> bool:
    """True when the graph computed (and a GET_TENSOR answered), False when the server closed."""
    with RpcClient(server_endpoint).open() as c:
        s = Slab(c)
        nodes = case(s, bad)
        try:
            s.compute(*nodes)
            c.get_tensor(nodes[0].rpc())
            return True
        except (PeerClosed, TransportError, ConnectionError):
            return False
