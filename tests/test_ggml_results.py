"""The ggml device computes what ggml's kernels compute, where its rules are relaxed or new, and
never writes outside a result the rules took."""

from __future__ import annotations

import numpy as np
import pytest
from ggml_cases import (
    BF16,
    F16,
    F32,
    HADAMARD,
    I32,
    Q4_K,
    Q8_0,
    Slab,
    bf16_bits,
    cpy_count,
    hadamard,
    permuted,
    q8_0_blocks,
    raw,
    send,
)
from helpers import endpoint

from fleetd.client.graph import Tensor, f32_bits
from fleetd.client.rpc import RpcClient
from fleetd.errors import PeerClosed, TransportError
from fleetd.wire import GgmlOp, GgmlType

try:
    from fleetd.compute.ggml.device import load_device

    load_device()
except OSError as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"ggml libraries: {exc}", allow_module_level=True)


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
        np.testing.assert_allclose(
            values(y, np.float32, (3, 4)), xw @ values(w, np.float32, (4, 8)).T, rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(
            values(y16, np.float32, (3, 4)),
            values(x16, np.float16, (3, 8)).astype(np.float32) @ values(w, np.float32, (4, 8)).T,
            rtol=1e-5,
            atol=1e-6,
        )
        np.testing.assert_allclose(
            values(hy, np.float32, (3, 16)),
            values(hx, np.float32, (3, 16)) @ hadamard(16).T,
            rtol=1e-5,
            atol=1e-5,
        )
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
            "sqr": av * av,
            "leaky": np.where(av > 0, av, 0.1 * av),
            "sum": av.sum(),
            "cumsum": np.cumsum(av, 1),
            "repeat": np.tile(bv, (2, 2)),
            "fill": np.full((4, 8), 2.5),
            "arange": np.arange(1.0, 4.0, 0.5),
            "set": placed,
            "acc": added,
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
