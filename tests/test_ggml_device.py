"""The ggml device (`--device cpu`): ggml's CPU kernels over fleetd's buffers.

- Every op rule of fleetd/compute/ggml/rules.py, broken one at a time, through fleetd's own
  GraphBuilder/RpcClient: the connection that sent it is closed, the next client is answered;
  the same graph unbroken computes (so a rule that refuses everything fails here).
- The graphs that kill the stock ggml-rpc-server (a failed GGML_ASSERT) do not kill fleetd.
- 100 graph computes from 4 concurrent sessions leave RSS, threads and fds where they were.
- `llama-completion --temp 0 -n 64` prints byte-identical text through fleetd and the stock
  server for every family and weight type of tests/test_llama_e2e.py, flash attention on and off.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import endpoint
from helpers import needs_tool

from fleetd.client.graph import GraphBuilder, Tensor, f32_bits
from fleetd.client.rpc import RpcClient
from fleetd.compute.device import Device, make_device
from fleetd.errors import PeerClosed, TransportError
from fleetd.models import generate
from fleetd.tools import find_tool, portable_ggml_dir
from fleetd.wire import GgmlOp, GgmlType

try:
    from fleetd.compute.ggml.device import GgmlCpuDevice, load_device

    load_device()
except OSError as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"ggml libraries: {exc}", allow_module_level=True)

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
    return [order, s.node(GgmlOp.MUL_MAT_ID, F32, (4, 2, 3), [s.leaf(F32, (8, 4, 3)), s.leaf(F32, (8, 1, 3)), ids])]


def ids_rewritten_before_use(s, bad):
    # ARGSORT makes in-range ids; a CPY in between may not overwrite them with client bytes
    order = s.node(GgmlOp.ARGSORT, I32, (3, 3), [s.leaf(F32, (3, 3))], [1])
    ids = s.g.view_of(order, (2, 3), (4, 12, 36, 36), 0)
    junk = s.leaf(I32, (3, 3), np.full(9, 7, np.int32))
    nodes = [order, s.g.cpy(junk, order)] if bad else [order]
    return nodes + [s.node(GgmlOp.MUL_MAT_ID, F32, (4, 2, 3), [s.leaf(F32, (8, 4, 3)), s.leaf(F32, (8, 1, 3)), ids])]


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
    return [s.node(GgmlOp.MUL_MAT, F32, (4, 3), [w, s.leaf(BF16, (8, 3), bf16_bits(s.rng.standard_normal(24)))])]


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
    return [s.node(GgmlOp.ARANGE, F32, (16 if bad else 8,), [], [f32_bits(0.0), f32_bits(8.0), f32_bits(1.0)])]


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
    return [s.node(GgmlOp.GROUP_NORM, F32, (4, 2, 6), [s.leaf(F32, (4, 2, 6))], [0 if bad else 3, f32_bits(1e-6)])]


def rope_back_dims(s, bad):
    pos = s.leaf(I32, (3,), np.arange(3, dtype=np.int32))
    params = [0, 16 if bad else 8, 2, 0, 0, f32_bits(10000.0), f32_bits(1.0), 0, f32_bits(1.0), 0, 0]
    return [s.node(GgmlOp.ROPE_BACK, F32, (8, 2, 3), [s.leaf(F32, (8, 2, 3)), pos], params)]


def rope_mrope_sections(s, bad):
    # the mrope cache takes i0/2 modulo the sections' sum: 1 + -1 divides by zero
    pos = s.leaf(I32, (12,), np.arange(12, dtype=np.int32))
    params = [0, 8, 8, 0, 0, f32_bits(10000.0), f32_bits(1.0), 0, f32_bits(1.0), 0, 0,
              1 if bad else 2, -1 if bad else 2, 0, 0]
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


CASES = [mul_mat_k, mul_mat_shape, mul_mat_type, mul_mat_id_ids, ids_view_not_inside_argsort,
         ids_rewritten_before_use, op_past_enum, op_without_rule, add_repeat, mul_result_shape,
         rms_norm_type, get_rows_range, set_rows_range, rope_dims, soft_max_mask, flash_attn_kv,
         glu_shape, unary_op, cpy_count, cpy_quant_block, mul_mat_bf16_src1, mul_mat_hadamard,
         mul_mat_q8_k_src1, cpy_quant_permuted, cpy_dequant_permuted, cpy_f32_i32, cont_dequant,
         sqr_types, leaky_relu_type, sum_type, cumsum_shape, repeat_shape, fill_type,
         arange_count, set_offset, acc_strides, group_norm_groups, rope_back_dims,
         rope_mrope_sections, unary_f16, glu_bf16, concat_f16, clamp_f16, outside_buffer]




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


@pytest.mark.parametrize("case", CASES, ids=lambda f: f.__name__)
def test_rule_refuses_the_broken_graph_and_serves_the_next(ggml_server, case):
    ep = endpoint(ggml_server)
    assert send(ep, case, bad=False), f"{case.__name__}: the valid graph was refused"
    assert not send(ep, case, bad=True), f"{case.__name__}: the broken graph was computed"
    assert send(ep, case, bad=False), "fleetd did not answer the next client"


def test_results_are_ggml_kernels(ggml_server):
    with RpcClient(endpoint(ggml_server)).open() as c:
        s = Slab(c)
        w, x = s.leaf(F32, (8, 4)), s.leaf(F32, (8, 3))
        y = s.node(GgmlOp.MUL_MAT, F32, (4, 3), [w, x])
        s.compute(y)
        wv = np.frombuffer(c.get_tensor(w.rpc()), np.float32).reshape(4, 8)
        xv = np.frombuffer(c.get_tensor(x.rpc()), np.float32).reshape(3, 8)
        got = np.frombuffer(c.get_tensor(y.rpc()), np.float32).reshape(3, 4)
        np.testing.assert_allclose(got, xv @ wv.T, rtol=1e-5)
        c.set_tensor(x.rpc(), np.ones(24, np.float32).tobytes())
        c.graph_recompute()  # the stored ggml graph, new input bytes
        got = np.frombuffer(c.get_tensor(y.rpc()), np.float32).reshape(3, 4)
        np.testing.assert_allclose(got, np.ones((3, 8), np.float32) @ wv.T, rtol=1e-5)


def test_relaxed_rules_compute_what_ggml_means(ggml_server):
    # The cases the rules used to refuse though the stock server computes them right.
    with RpcClient(endpoint(ggml_server)).open() as c:
        s = Slab(c)

        def values(t: Tensor, dtype, shape) -> np.ndarray:
            return np.frombuffer(c.get_tensor(t.rpc()), dtype).reshape(shape)

        # f32 x bf16: src1 widened to f32
        w, xv = s.leaf(F32, (8, 4)), s.rng.standard_normal((3, 8)).astype(np.float32)
        x = s.leaf(BF16, (8, 3), bf16_bits(xv))
        y = s.node(GgmlOp.MUL_MAT, F32, (4, 3), [w, x])
        x16 = s.leaf(F16, (8, 3))  # f16 is widened the same way
        y16 = s.node(GgmlOp.MUL_MAT, F32, (4, 3), [w, x16])
        # the hadamard hint: a transform of src1's rows, equal to the product with src0
        h, hx = s.leaf(F32, (16, 16), hadamard(16)), s.leaf(F32, (16, 3))
        hy = s.node(GgmlOp.MUL_MAT, F32, (16, 3), [h, hx], [0, HADAMARD])
        # same-type q4_K from a permuted src0, block bytes moved as they are
        q = raw(s, Q4_K, (256, 2, 3, 4))
        qp = permuted(s, q, (0, 2, 1, 3))
        qc = s.g.cpy(qp, raw(s, Q4_K, qp.ne))
        # q8_0 -> f32 from a permuted src0
        scales, quants = s.rng.uniform(0.5, 2, 6).astype(np.float16), s.rng.integers(-127, 128, 192)
        d8 = s.leaf(Q8_0, (32, 2, 3), q8_0_blocks(scales, quants))
        dp = permuted(s, d8, (0, 2, 1, 3))
        df = s.g.cpy(dp, raw(s, F32, dp.ne))
        # i32 -> f32 from a transposed src0
        iv = s.leaf(I32, (8, 2), np.arange(-8, 8, dtype=np.int32))
        fi = s.g.cpy(s.g.transpose(iv), raw(s, F32, (2, 8)))
        s.compute(y, y16, hy, qc, df, fi)

        xw = (bf16_bits(xv).astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_allclose(values(y, np.float32, (3, 4)), xw @ values(w, np.float32, (4, 8)).T, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(values(y16, np.float32, (3, 4)),
                                   values(x16, np.float16, (3, 8)).astype(np.float32) @ values(w, np.float32, (4, 8)).T,
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(values(hy, np.float32, (3, 16)), values(hx, np.float32, (3, 16)) @ hadamard(16).T,
                                   rtol=1e-5, atol=1e-5)
        blocks = values(q, np.uint8, (4, 3, 2, 144))
        assert (values(qc, np.uint8, (4, 2, 3, 144)) == blocks.transpose(0, 2, 1, 3)).all()
        want = (scales.astype(np.float32)[:, None] * quants.reshape(6, 32)).reshape(3, 2, 32)
        np.testing.assert_array_equal(values(df, np.float32, (2, 3, 32)), want.transpose(1, 0, 2))
        np.testing.assert_array_equal(values(fi, np.float32, (8, 2)), np.arange(-8, 8).reshape(2, 8).T)


def test_ops_with_new_rules_compute_what_numpy_says(ggml_server):
    with RpcClient(endpoint(ggml_server)).open() as c:
        s = Slab(c)

        def values(t: Tensor, shape) -> np.ndarray:
            return np.frombuffer(c.get_tensor(t.rpc()), np.float32).reshape(shape)

        a, b = s.leaf(F32, (8, 4)), s.leaf(F32, (4, 2))
        x = s.leaf(F32, (4, 2, 6))
        nodes = {
            "sqr": s.node(GgmlOp.SQR, F32, (8, 4), [a]),
            "leaky": s.node(GgmlOp.LEAKY_RELU, F32, (8, 4), [a], [f32_bits(0.1)]),
            "sum": s.node(GgmlOp.SUM, F32, (1,), [a]),
            "cumsum": s.node(GgmlOp.CUMSUM, F32, (8, 4), [a]),
            "repeat": s.node(GgmlOp.REPEAT, F32, (8, 4), [b]),
            "fill": s.node(GgmlOp.FILL, F32, (8, 4), [a], [f32_bits(2.5)]),
            "arange": s.node(GgmlOp.ARANGE, F32, (6,), [], [f32_bits(1.0), f32_bits(4.0), f32_bits(0.5)]),
            # b into rows 1-2, from column 4 (nb1 = 32 bytes, offset = 32 + 16)
            "set": s.node(GgmlOp.SET, F32, (8, 4), [a, b], [32, 128, 128, 48, 0]),
            "acc": s.node(GgmlOp.ACC, F32, (8, 4), [a, b], [32, 128, 128, 48, 0]),
            "group_norm": s.node(GgmlOp.GROUP_NORM, F32, (4, 2, 6), [x], [3, f32_bits(1e-6)]),
        }
        s.compute(*nodes.values())
        av, bv, xv = values(a, (4, 8)), values(b, (2, 4)), values(x, (6, 2, 4))
        got = {k: values(t, t.ne[::-1]).squeeze() for k, t in nodes.items()}
        placed = av.copy()
        placed[1:3, 4:8] = bv
        added = av.copy()
        added[1:3, 4:8] += bv
        groups = xv.reshape(3, -1)
        normed = (groups - groups.mean(1, keepdims=True)) / np.sqrt(groups.var(1, keepdims=True) + 1e-6)
        want = {
            "sqr": av * av, "leaky": np.where(av > 0, av, 0.1 * av), "sum": av.sum(),
            "cumsum": np.cumsum(av, 1), "repeat": np.tile(bv, (2, 2)), "fill": np.full((4, 8), 2.5),
            "arange": np.arange(1.0, 4.0, 0.5), "set": placed, "acc": added,
            "group_norm": normed.reshape(6, 2, 4),
        }
        for k in nodes:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=k)


def test_rope_reads_freq_factors_past_n_dims_from_a_padded_copy(ggml_server):
    # ggml's rope cache reads ne0/2 factors though ggml_rope_ext needs n_dims/2: with 4 factors
    # at the very end of a buffer the kernel would read 48 bytes past it. It reads a padded
    # copy, and the result is the one a tensor of all 16 factors gives (only 4 are used).
    with RpcClient(endpoint(ggml_server)).open() as c:
        s = Slab(c)
        a, pos = s.leaf(F32, (32, 2, 3)), s.leaf(I32, (3,), np.arange(3, dtype=np.int32))
        factors = s.rng.uniform(1, 4, 16).astype(np.float32)
        long = s.leaf(F32, (16,), factors)
        handle, _ = c.alloc_buffer(16)
        short = s.g.place(s.g.tensor(F32, (4,)), handle, c.buffer_get_base(handle))
        c.set_tensor(short.rpc(), factors[:4].tobytes())
        params = [0, 8, 0, 0, 0, f32_bits(10000.0), f32_bits(1.0), 0, f32_bits(1.0), 0, 0]
        want = s.node(GgmlOp.ROPE, F32, a.ne, [a, pos, long], params)
        got = s.node(GgmlOp.ROPE, F32, a.ne, [a, pos, short], params)
        s.compute(want, got)
        c.set_tensor(short.rpc(), (factors[:4] * 2).tobytes())
        c.graph_recompute()  # the copy is refreshed before every run
        twice = c.get_tensor(got.rpc())
        c.set_tensor(long.rpc(), (factors * 2).tobytes())
        s.compute(want)
        assert c.get_tensor(got.rpc()) == twice == c.get_tensor(want.rpc())


def test_copies_the_rules_take_never_write_outside_their_result(ggml_server):
    # Seeded random same-type block copies and dequantizing copies, permuted, reshaped, gapped:
    # whatever the rules let through must leave every byte of the result's buffer outside the
    # result's extent as it was.
    rng = np.random.default_rng(11)
    ep, taken, size, at = endpoint(ggml_server), 0, 1 << 16, 8192

    def view(s, t, ne, nb):
        return s.g.view_of(t, ne, nb, 0)

    for _ in range(60):
        with RpcClient(ep).open() as c:
            s = Slab(c)
            kind = rng.choice(["same", "dequant"])
            qtype = Q4_K if kind == "same" and rng.random() < 0.5 else Q8_0
            blck = 256 if qtype == Q4_K else 32
            ne = (blck * int(rng.integers(1, 3)), *(int(n) for n in rng.integers(1, 4, 3)))
            a = raw(s, qtype, ne)
            if rng.random() < 0.6:
                a = permuted(s, a, (0, *(int(i) + 1 for i in rng.permutation(3))))
            dtype = qtype if kind == "same" else F32
            handle, _ = c.alloc_buffer(size)
            base = c.buffer_get_base(handle)
            whole = s.g.place(s.g.tensor(GgmlType.I8, (size,)), handle, base)
            c.set_tensor(whole.rpc(), np.full(size, 0xAB, np.uint8).tobytes())
            n = int(np.prod(a.ne))
            # the source's shape, rows of one block, or (dequantizing) rows of half a block
            row = rng.choice([blck, blck // 2] if kind == "dequant" else [blck])
            shape = a.ne if rng.random() < 0.5 else (int(row), n // int(row))
            dst = s.g.place(s.g.tensor(dtype, shape), handle, base + at)
            layout = rng.choice(["contiguous", "permuted", "gapped"])
            if layout == "permuted":
                dst = permuted(s, dst, (0, 2, 1, 3))
            elif layout == "gapped":
                nb1 = dst.nb[1] + dst.nb[0]  # one element (block) between rows
                dst = view(s, dst, dst.ne, (dst.nb[0], nb1, nb1 * dst.ne[1], nb1 * dst.ne[1] * dst.ne[2]))
            node = s.g.cpy(a, dst)
            try:
                s.compute(node)
                after = np.frombuffer(c.get_tensor(whole.rpc()), np.uint8)
            except (PeerClosed, TransportError, ConnectionError):
                continue  # refused: this connection closed
            taken += 1
            lo, hi = at, at + node.nbytes
            outside = np.r_[after[:lo], after[hi:]]
            assert (outside == 0xAB).all(), (kind, qtype, a.ne, a.nb, node.ne, node.nb)
    assert 20 <= taken < 60, f"{taken} of 60 copies were taken"
    assert send(ep, cpy_count, bad=False)


def test_numpy_device_still_there_and_cpu_falls_back(monkeypatch, tmp_path, caplog):
    assert type(make_device("numpy")).__name__ == "NumpyDevice"
    monkeypatch.setenv("FLEETD_GGML_LIB_DIR", str(tmp_path))  # no libraries there
    with caplog.at_level("WARNING", logger="fleetd"):
        dev = make_device("cpu")
    assert type(dev).__name__ == "NumpyDevice"
    assert [r.message for r in caplog.records if "numpy device" in r.message]


def test_both_devices_have_what_the_server_calls():
    # Device is a Protocol: each implements every member (the ggml device without importing it)
    assert isinstance(make_device("numpy"), Device)
    assert isinstance(load_device(), Device)


def test_buffers_are_aligned_for_ggml():
    dev = load_device()
    for size in (1, 33, 4097, 1 << 20):
        assert dev.alloc(size).ctypes.data % 32 == 0


PORTABLE = portable_ggml_dir()


@pytest.mark.skipif(not list(PORTABLE.glob("libggml-cpu-*.so")), reason="no portable build "
                    "(FLEETD_GGML_PORTABLE=1 scripts/build-llama.sh ggml)")
def test_portable_build_loads_the_variant_this_cpu_scores_best():
    # A process of its own: this one already holds the native libggml-base.
    code = """if 1:
        import numpy as np
        from fleetd.client.graph import GraphBuilder
        from fleetd.compute.buffers import BufferRegistry
        from fleetd.compute.device import make_device
        from fleetd.wire import GgmlType
        dev, reg = make_device("cpu"), BufferRegistry()
        buf = reg.alloc(0, dev, 4096, owner=1)
        g = GraphBuilder()
        w = g.tensor(GgmlType.F32, (8, 4), buf.handle, buf.base)
        x = g.tensor(GgmlType.F32, (8, 3), buf.handle, buf.base + 256)
        y = g.place(g.mul_mat(w, x), buf.handle, buf.base + 512)
        buf.array[:128] = np.arange(32, dtype=np.float32).view(np.uint8)
        buf.array[256:352] = np.ones(24, np.float32).view(np.uint8)
        dev.build_plan(g.serialize([y]), reg).run()
        got = buf.array[512:560].view(np.float32).reshape(3, 4)
        assert (got == np.arange(32, dtype=np.float32).reshape(4, 8).sum(1)).all(), got
        print(type(dev).__name__, dev.lib.cpu_path.name)
    """
    env = dict(os.environ, FLEETD_GGML_LIB_DIR=str(PORTABLE))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    kind, lib_name = out.stdout.split()
    assert kind == "GgmlCpuDevice" and lib_name.startswith("libggml-cpu-"), out.stdout + out.stderr


@pytest.mark.skipif(not list(PORTABLE.glob("libggml-cpu-*.so")), reason="no portable build "
                    "(FLEETD_GGML_PORTABLE=1 scripts/build-llama.sh ggml)")
def test_a_shipped_portable_dir_loads_its_own_base_and_the_best_variant_that_loads(tmp_path):
    # As fleetctl deploy ships it into fleetd/compute/ggml/_lib: the *.so files only (no soname
    # links: the variants' libggml-base.so.0 is not there), plus here a variant that does not
    # load, sorted first. Only this directory's libggml-base may end up mapped.
    shipped = tmp_path / "_lib"
    shipped.mkdir()
    for f in PORTABLE.glob("*.so"):
        shutil.copyfile(f, shipped / f.name)
    (shipped / "libggml-cpu-alderlake.so").write_bytes(b"not an ELF file")
    code = """if 1:
        from fleetd.compute.device import make_device
        dev = make_device("cpu")
        maps = open("/proc/self/maps").read().splitlines()
        print(type(dev).__name__, dev.library, *sorted({l.split()[-1] for l in maps if "/libggml" in l}))
    """
    env = dict(os.environ, FLEETD_GGML_LIB_DIR=str(shipped))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    kind, library, *mapped = out.stdout.split()
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    haswell = (shipped / "libggml-cpu-haswell.so").exists() and {"avx2", "fma", "f16c", "bmi2"} <= set(flags.split())
    assert kind == "GgmlCpuDevice", out.stdout + out.stderr
    if (shipped / "libggml-cpu-x64.so").exists():  # the two variants bootstrap builds
        assert Path(library).name == ("libggml-cpu-haswell.so" if haswell else "libggml-cpu-x64.so")
    assert mapped and all(m.startswith(str(shipped)) for m in mapped), mapped
    assert str(shipped / "libggml-base.so") in mapped


def _proc_counts() -> tuple[int, int, int]:
    status = Path("/proc/self/status").read_text()
    rss = int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])
    threads = int(next(line for line in status.splitlines() if line.startswith("Threads")).split()[1])
    return rss, threads, len(os.listdir("/proc/self/fd"))


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


# Threads of this process that are not Python threads (BLAS, the ggml library): counted once.
NATIVE_ONLY = native_threads() - threading.active_count()


def settle() -> None:
    """Wait until every session the clients closed has ended and its OS thread exited."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        sessions = [t for t in threading.enumerate() if t.name.startswith("fleetd-session")]
        if not sessions and native_threads() - threading.active_count() <= NATIVE_ONLY:
            return
        time.sleep(0.05)
    raise AssertionError(f"sessions still running: {threading.enumerate()}")


def test_concurrent_sessions_do_not_leak(ggml_server):
    ep = endpoint(ggml_server)

    def session(n: int, errors: list) -> None:
        try:
            with RpcClient(ep).open() as c:
                s = Slab(c, 1 << 22)
                w, x = s.leaf(F32, (256, 256)), s.leaf(F32, (256, 8))
                y = s.node(GgmlOp.MUL_MAT, F32, (256, 8), [w, x])
                z = s.node(GgmlOp.SOFT_MAX, F32, (256, 8), [y], [f32_bits(1.0), 0])
                for _ in range(n):
                    s.compute(z)  # a new plan (ggml context, graph) every time
                c.get_tensor(z.rpc())
                c.free_buffer(s.handle)
        except Exception as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(exc)

    def run(n: int) -> None:
        errors: list = []
        threads = [threading.Thread(target=session, args=(n, errors)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        settle()

    run(5)  # warm up: backends, work buffers, allocator pools
    rss0, threads0, fds0 = _proc_counts()
    run(25)  # 100 graph computes
    rss1, threads1, fds1 = _proc_counts()
    assert threads1 == threads0 and fds1 == fds0, (threads0, threads1, fds0, fds1)
    assert rss1 - rss0 < 16 * 1024, f"RSS grew {rss1 - rss0} KiB over 100 graph computes"
    device = ggml_server.state.devices[0]
    assert device.workers.live() == 0, f"{device.workers.live()} compute workers outlived their sessions"


# -- against the stock server -------------------------------------------------------------------

STOCK_KILLERS = [mul_mat_shape, mul_mat_type, op_past_enum, get_rows_range, group_norm_groups,
                 rope_mrope_sections, cont_dequant]  # SIGFPE (division by zero) x2, SIGSEGV


@needs_tool("ggml-rpc-server")
@pytest.mark.parametrize("case", STOCK_KILLERS, ids=lambda f: f.__name__)
def test_graph_that_kills_stock_does_not_kill_fleetd(stock_server, ggml_server, case):
    stock = stock_server()
    send(stock, case, bad=True)
    assert stock_server.proc.wait(timeout=30) != 0, "the stock server survived: not a killer"
    assert not send(endpoint(ggml_server), case, bad=True)
    assert send(endpoint(ggml_server), case, bad=False)


ARCHS = ["llama", "qwen3", "qwen3moe", "gemma3"]
TYPES = ["f32", "f16", "q8_0", "q4_k"]
PROMPT = "the time of their first new"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("models")
    for arch in ARCHS:
        for type_name in TYPES:
            generate(arch, type_name, out)
    return out


def complete(model: Path, server: str, fa: str) -> bytes:
    args = [str(find_tool("llama-completion")), "-m", str(model), "--rpc", server, "-ngl", "99",
            "-p", PROMPT, "-n", "64", "--temp", "0", "-t", "1", "-no-cnv", "-fa", fa, "--seed", "1"]
    for _ in range(3):  # its asynchronous log thread can lose the tail on a busy machine
        proc = subprocess.run(args, capture_output=True, timeout=600, check=False)
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-2000:]
        if proc.stdout.endswith(b"\n\n"):
            break
    return proc.stdout


@needs_tool("llama-completion", "ggml-rpc-server")
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_completion_byte_identical_to_stock(models, stock_server, ggml_server, arch, type_name):
    model = models / f"{arch}-{type_name}.gguf"
    stock = stock_server()
    for fa in ("off", "on"):
        want = complete(model, stock, fa)
        got = complete(model, endpoint(ggml_server), fa)
        assert len(want) > len(PROMPT)  # some models end early with [end of text]
        assert got == want, f"{arch}-{type_name} -fa {fa}:\n stock {want!r}\nfleetd {got!r}"


def test_status_says_which_device_kind_computes(fleetd_server, monkeypatch, tmp_path):
    import json
    import urllib.request

    def devices_of(srv) -> list[dict]:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.control.port}/v1/status", timeout=10) as r:
            return json.load(r)["devices"]

    (ggml_dev,) = devices_of(fleetd_server(control_port=0, devices=["cpu"]))
    assert ggml_dev["kind"] == "ggml" and ggml_dev["fallback"] is None
    assert Path(ggml_dev["library"]).name.startswith("libggml-cpu")
    (numpy_dev,) = devices_of(fleetd_server(control_port=0, devices=["numpy"]))
    assert numpy_dev["kind"] == "numpy" and numpy_dev["fallback"] is None and numpy_dev["library"] is None
    # cpu where the library does not load: numpy, and the daemon says why
    monkeypatch.setenv("FLEETD_GGML_LIB_DIR", str(tmp_path))
    (fell_back,) = devices_of(fleetd_server(control_port=0, devices=["cpu"]))
    assert fell_back["kind"] == "numpy" and fell_back["library"] is None
    assert fell_back["fallback"] == f"device cpu: ggml libraries not found (run scripts/build-llama.sh ggml): {tmp_path}: no libggml-base.so"


def test_a_graph_without_nodes_computes_nothing_and_the_session_goes_on(fleetd_server):
    # Found by tests/test_fuzz.py: zero nodes made the graph builder raise (an internal error).
    from fleetd.client import RpcClient
    from fleetd.wire import GraphCompute, RPC_TENSOR_DTYPE

    srv = fleetd_server()
    with RpcClient(f"127.0.0.1:{srv.address[1]}") as c:
        c.graph_compute(GraphCompute(0, (), np.zeros(0, RPC_TENSOR_DTYPE)))
        c.graph_recompute()
        assert c.get_alignment() == 32
