"""The compute engine where test-backend-ops does not reach: the plan kept for GRAPH_RECOMPUTE,
the device's f32 weight cache (its invalidation by writes, its release with the buffer, its
byte budget), view bounds, and graphs fleetd cannot
compute (one clear log line, that connection closed, the daemon serving on). Plus op semantics
checked in-process against numpy references: plan building and kernels over a real registry.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from helpers import connection_closed, endpoint

from fleetd.client import GraphBuilder, RpcClient
from fleetd.client.graph import f32_bits
from fleetd.compute import dequant
from fleetd.compute.buffers import BufferRegistry
from fleetd.compute.dequant_cache import CacheBudget
from fleetd.compute.device import NumpyDevice
from fleetd.compute.graph import build_plan
from fleetd.compute.ops import rope
from fleetd.compute.views import ELEMENT_DTYPES
from fleetd.errors import ComputeError, RemoteProtocolError, UnsupportedOp
from fleetd.wire import GgmlOp, GgmlType, row_size

RNG = np.random.default_rng(7)


def q8_0(values: np.ndarray) -> bytes:
    return gguf_quants.quantize(values.astype(np.float32), GGMLQuantizationType.Q8_0).tobytes()


def dequant_q8_0(raw: bytes, shape) -> np.ndarray:
    blocks = np.frombuffer(raw, np.uint8).reshape(shape[0], -1)
    return gguf_quants.dequantize(blocks, GGMLQuantizationType.Q8_0)


# -- in-process: a registry, a graph, a plan -------------------------------------------------


class Local:
    """One device's buffer registry with a bump allocator, for plans run without sockets."""

    def __init__(self, size: int = 1 << 20, dequant_cache=None) -> None:
        self.registry = BufferRegistry()
        self.device = NumpyDevice(dequant_cache)
        self.cache = self.device.dequant_cache
        self.buf = self.registry.alloc(0, self.device, size, owner=1)
        self.g = GraphBuilder()
        self._next = self.buf.base

    def place(self, t):
        self._next = (self._next + 63) // 64 * 64
        self.g.place(t, self.buf.handle, self._next)
        self._next += t.nbytes
        return t

    def tensor(self, type_, ne, values=None):
        t = self.place(self.g.tensor(type_, ne))
        if values is not None:
            dtype = ELEMENT_DTYPES.get(type_)
            self.write(t, values if dtype is None else np.asarray(values).astype(dtype))
        return t

    def write(self, t, data) -> None:
        raw = data if isinstance(data, bytes) else np.ascontiguousarray(data).tobytes()
        start = t.data - self.buf.base
        self.buf.array[start : start + len(raw)] = np.frombuffer(raw, np.uint8)
        self.buf.touched()

    def read(self, t, dtype="<f4") -> np.ndarray:
        start = t.data - self.buf.base
        return self.buf.array[start : start + t.nbytes].view(dtype).copy()

    def node(self, op, type_, ne, srcs, params=()):
        return self.place(self.g._node(op, type_, ne, srcs, params))

    def run(self, *nodes):
        plan = build_plan(self.g.serialize(list(nodes)), self.registry)
        plan.run(np)
        return plan


def test_plan_runs_again_on_new_inputs():
    m = Local()
    w = m.tensor(GgmlType.F32, (8, 3), RNG.standard_normal((3, 8)))
    x = m.tensor(GgmlType.F32, (8, 2), RNG.standard_normal((2, 8)))
    y = m.place(m.g.mul_mat(w, x))
    plan = m.run(y)
    fresh = RNG.standard_normal((2, 8)).astype(np.float32)
    m.write(x, fresh)
    plan.run(np)  # what GRAPH_RECOMPUTE does: same plan, current memory
    want = fresh @ m.read(w).reshape(3, 8).T
    np.testing.assert_allclose(m.read(y).reshape(2, 3), want, rtol=1e-5)


def test_quantized_weights_are_cached_until_their_buffer_is_written():
    m = Local()
    w_values = RNG.standard_normal((4, 64)).astype(np.float32)
    w = m.tensor(GgmlType.Q8_0, (64, 4), q8_0(w_values))
    x = m.tensor(GgmlType.F32, (64, 1), np.ones(64, np.float32))
    y = m.place(m.g.mul_mat(w, x))
    plan = m.run(y)
    misses = m.cache.misses
    plan.run(np)
    assert m.cache.misses == misses  # second run: the cached f32 weights
    first = m.read(y)
    m.write(w, q8_0(-w_values))
    assert m.cache.buffer_bytes(m.buf) == 0  # a command write releases the buffer's copies
    plan.run(np)
    assert m.cache.misses == misses + 1
    np.testing.assert_allclose(m.read(y), -first, rtol=1e-6)
    np.testing.assert_allclose(first, dequant_q8_0(q8_0(w_values), (4,)).sum(axis=1), rtol=1e-4)


def test_a_graph_write_drops_only_the_cached_regions_it_overlaps():
    m = Local()
    values = RNG.standard_normal((64, 32)).astype(np.float32)
    kv = m.tensor(GgmlType.Q8_0, (32, 64), q8_0(values))
    start = kv.data - m.buf.base

    def rows(first, n):
        view = m.buf.array[start + first * 34 : start + (first + n) * 34].reshape(1, 1, n, 34)
        return m.cache.get(
            m.buf, start + first * 34, view, GgmlType.Q8_0, lambda v: dequant.dequantize(np, v, GgmlType.Q8_0)
        )

    for first in range(0, 64, 8):
        got = rows(first, 8)
        np.testing.assert_array_equal(got[0, 0], dequant_q8_0(q8_0(values), (64,))[first : first + 8])
    assert m.cache.entries(m.buf) == 8
    m.cache.note_write(m.buf, start + 9 * 34, start + 17 * 34)  # rows 9..16: two regions
    assert m.cache.entries(m.buf) == 6
    assert m.cache.buffer_bytes(m.buf) == 6 * 8 * 32 * 4


def weight_stack(m: Local, n_layers: int, k: int = 64):
    """x -> MUL_MAT(w_i, x) for n_layers Q8_0 weights (k x k) chained: a decode-like cycle."""
    weights = [RNG.standard_normal((k, k)).astype(np.float32) * 0.1 for _ in range(n_layers)]
    h = m.tensor(GgmlType.F32, (k, 1), RNG.standard_normal(k))
    nodes = []
    for w_values in weights:
        w = m.tensor(GgmlType.Q8_0, (k, k), q8_0(w_values))
        h = m.place(m.g.mul_mat(w, h))
        nodes.append(h)
    return nodes


def test_freed_buffer_releases_its_cached_bytes():
    m = Local()
    weights = m.registry.alloc(0, m.device, 1 << 16, owner=1)
    w_values = RNG.standard_normal((4, 64)).astype(np.float32)
    w = m.g.place(m.g.tensor(GgmlType.Q8_0, (64, 4)), weights.handle, weights.base)
    weights.array[: len(q8_0(w_values))] = np.frombuffer(q8_0(w_values), np.uint8)
    weights.touched()
    x = m.tensor(GgmlType.F32, (64, 1), np.ones(64, np.float32))
    m.run(m.place(m.g.mul_mat(w, x)))
    assert m.cache.buffer_bytes(weights) == 4 * 64 * 4
    m.registry.free(weights)
    assert m.cache.buffer_bytes(weights) == 0
    assert m.cache.nbytes == 0 and m.cache.entries() == 0


@pytest.mark.parametrize("budget", [0, 5 * 64 * 64 * 4 + 100, "0.01x"])
def test_a_budget_smaller_than_the_weights_gives_the_same_bytes(budget):
    full, small = Local(), Local(dequant_cache=budget)
    outs = []
    for m in (full, small):
        state = RNG.bit_generator.state
        nodes = weight_stack(m, 12)
        RNG.bit_generator.state = state  # the same weights in both
        plan = m.run(*nodes)
        for _ in range(3):
            plan.run(np)
        outs.append(b"".join(m.read(y).tobytes() for y in nodes))
    assert outs[0] == outs[1]
    assert full.cache.entries() == 12
    assert small.cache.nbytes <= small.cache.limit() < 12 * 64 * 64 * 4
    if small.cache.limit() >= 64 * 64 * 4:
        # LRU over a cyclic scan would miss every time: a fixed share stays cached instead.
        hits = small.cache.hits
        plan.run(np)
        assert small.cache.hits - hits == small.cache.limit() // (64 * 64 * 4)


def test_hundreds_of_weight_regions_in_one_buffer_stay_cached():
    m = Local(size=8 << 20, dequant_cache="1x")
    plan = m.run(*weight_stack(m, 300, k=32))
    misses = m.cache.misses
    plan.run(np)
    assert m.cache.misses == misses
    assert m.cache.entries(m.buf) == 300


def test_a_departed_sessions_weights_leave_the_cache(fleetd_server):
    srv = fleetd_server(devices=["numpy"])
    cache = srv.state.devices[0].dequant_cache
    g = GraphBuilder()
    with RpcClient(endpoint(srv)) as c:
        ptr, _ = c.alloc_buffer(4096)
        base = c.buffer_get_base(ptr)
        w = g.tensor(GgmlType.Q8_0, (64, 4), ptr, base)
        x = g.tensor(GgmlType.F32, (64, 1), ptr, base + 1024)
        y = g.place(g.mul_mat(w, x), ptr, base + 2048)
        c.set_tensor(w.rpc(), np.frombuffer(q8_0(RNG.standard_normal((4, 64))), np.uint8))
        c.set_tensor(x.rpc(), np.ones(64, np.float32))
        c.graph_compute(g.serialize([y]))
        c.get_tensor(y.rpc())  # answered after the graph ran
        assert cache.nbytes == 4 * 64 * 4
    deadline = time.monotonic() + 10  # the server notices the closed connection on its own
    while len(srv.state.registry) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(srv.state.registry) == 0
    assert cache.nbytes == 0 and cache.entries() == 0


def test_a_graph_writing_quantized_weights_invalidates_their_cache():
    # CPY f32 -> Q8_0 into the weights, then a MUL_MAT over them, in one plan run twice.
    m = Local()
    source = m.tensor(GgmlType.F32, (32, 2), np.ones((2, 32), np.float32))
    w = m.tensor(GgmlType.Q8_0, (32, 2))
    x = m.tensor(GgmlType.F32, (32, 1), np.ones(32, np.float32))
    cpy = m.g.cpy(source, w)
    y = m.place(m.g.mul_mat(w, x))
    plan = m.run(cpy, y)
    np.testing.assert_allclose(m.read(y), [32, 32], rtol=1e-3)
    m.write(source, np.full((2, 32), 2, np.float32))
    plan.run(np)
    np.testing.assert_allclose(m.read(y), [64, 64], rtol=1e-3)


def test_view_beyond_its_buffer_is_a_protocol_error():
    m = Local(size=4096)
    a = m.tensor(GgmlType.F32, (16,))
    b = m.g.tensor(GgmlType.F32, (2048,))
    m.g.place(b, m.buf.handle, m.buf.base + 64)  # 8 KiB in a 4 KiB buffer
    s = m.place(m.g.add(a, a))
    s.src = [a, b]
    with pytest.raises(RemoteProtocolError, match="outside buffer"):
        build_plan(m.g.serialize([s]), m.registry)


def test_unknown_op_names_op_and_types():
    m = Local()
    a = m.tensor(GgmlType.F32, (4, 4))
    node = m.node(GgmlOp.IM2COL, GgmlType.F16, (4, 4), [a, a])
    with pytest.raises(UnsupportedOp, match=r"IM2COL.*F16.*F32"):
        m.run(node)


def test_unsupported_type_pair_is_refused_not_approximated():
    # IQ2_XXS has no from_float in ggml either (it needs ggml_quantize_init).
    m = Local()
    a = m.tensor(GgmlType.F32, (256, 1), np.ones(256, np.float32))
    dst = m.tensor(GgmlType.IQ2_XXS, (256, 1))
    with pytest.raises(UnsupportedOp, match="CPY.*IQ2_XXS"):
        m.run(m.g.cpy(a, dst))


def test_row_index_out_of_range_fails_instead_of_wrapping():
    m = Local()
    table = m.tensor(GgmlType.F32, (4, 3), np.arange(12, dtype=np.float32))
    idx = m.tensor(GgmlType.I32, (2,), np.array([0, -1], np.int32))
    rows = m.node(GgmlOp.GET_ROWS, GgmlType.F32, (4, 2), [table, idx])
    with pytest.raises(ComputeError, match=r"GET_ROWS.*-1\.\.0 outside \[0, 3\)"):
        m.run(rows)


def test_get_rows_dequantizes_only_the_gathered_rows():
    m = Local()
    values = RNG.standard_normal((5, 64)).astype(np.float32)
    table = m.tensor(GgmlType.Q8_0, (64, 5), q8_0(values))
    idx = m.tensor(GgmlType.I32, (3,), np.array([4, 0, 4], np.int32))
    rows = m.node(GgmlOp.GET_ROWS, GgmlType.F32, (64, 3), [table, idx])
    m.run(rows)
    want = dequant_q8_0(q8_0(values), (5,))[[4, 0, 4]]
    np.testing.assert_array_equal(m.read(rows).reshape(3, 64), want)


def test_set_rows_converts_into_an_f16_cache_at_the_given_rows():
    m = Local()
    cache = m.tensor(GgmlType.F16, (8, 4), np.zeros((4, 8), np.float16))
    new = m.tensor(GgmlType.F32, (8, 2), np.array([[1 / 3] * 8, [2.5] * 8], np.float32))
    idx = m.tensor(GgmlType.I64, (2,), np.array([3, 1], np.int64))
    node = m.g.view_of(cache, cache.ne, cache.nb, 0)
    node.op, node.src = GgmlOp.SET_ROWS, [new, idx, cache]
    m.run(node)
    got = m.read(cache, "<f2").reshape(4, 8)
    np.testing.assert_array_equal(got[3], np.float16(1 / 3))
    np.testing.assert_array_equal(got[1], np.float16(2.5))
    np.testing.assert_array_equal(got[[0, 2]], 0)


def test_argmax_ties_go_to_the_last_index_and_top_k_matches_cpu_order():
    m = Local()
    a = m.tensor(GgmlType.F32, (5, 1), np.array([1, 3, 2, 3, 0], np.float32))
    am = m.node(GgmlOp.ARGMAX, GgmlType.I32, (1,), [a])
    v = m.tensor(GgmlType.F32, (6, 1), np.array([0.1, 0.9, 0.5, 0.7, 0.3, 0.8], np.float32))
    top = m.node(GgmlOp.TOP_K, GgmlType.I32, (3, 1), [v])
    m.run(am, top)
    assert m.read(am, "<i4").tolist() == [3]
    assert m.read(top, "<i4").tolist() == [5, 1, 3]  # protocol §15.21, verified on the CPU


def test_swiglu_fused_plain_and_swapped():
    m = Local()
    a = m.tensor(GgmlType.F32, (4, 1), np.array([1, 2, 3, 4], np.float32))
    plain = m.node(GgmlOp.GLU, GgmlType.F32, (2, 1), [a], [2, 0])
    swapped = m.node(GgmlOp.GLU, GgmlType.F32, (2, 1), [a], [2, 1])
    m.run(plain, swapped)

    def silu(x):
        return x / (1 + np.exp(-x))

    np.testing.assert_allclose(m.read(plain), [silu(1) * 3, silu(2) * 4], rtol=1e-6)
    np.testing.assert_allclose(m.read(swapped), [silu(3) * 1, silu(4) * 2], rtol=1e-6)


def test_rope_neox_rotates_split_halves():
    m = Local()
    x_values = RNG.standard_normal((1, 6)).astype(np.float32)
    x = m.tensor(GgmlType.F32, (6, 1, 1), x_values)
    pos = m.tensor(GgmlType.I32, (1,), np.array([1], np.int32))
    params = [
        0,
        4,
        2,
        0,
        0,
        f32_bits(10000.0),
        f32_bits(1.0),
        0,
        f32_bits(1.0),
        f32_bits(32.0),
        f32_bits(1.0),
    ]
    out = m.node(GgmlOp.ROPE, GgmlType.F32, (6, 1, 1), [x, pos], params)
    m.run(out)
    theta = np.array([1.0, 1.0 * 10000 ** (-2 / 4)])
    x0, x1 = x_values[0, [0, 1]], x_values[0, [2, 3]]
    want = np.concatenate(
        [x0 * np.cos(theta) - x1 * np.sin(theta), x0 * np.sin(theta) + x1 * np.cos(theta), x_values[0, 4:]]
    )
    np.testing.assert_allclose(m.read(out), want, rtol=1e-5)


def test_recompute_replays_rope_without_binding_again(monkeypatch):
    # The angles' static parts are worked out when the plan is built; a replay (what
    # GRAPH_RECOMPUTE does) with new positions uses them and gives what a fresh plan gives.
    m = Local()
    x = m.tensor(GgmlType.F32, (8, 2, 3), RNG.standard_normal((3, 2, 8)))
    pos = m.tensor(GgmlType.I32, (3,), np.array([0, 1, 2], np.int32))
    params = [
        0,
        8,
        2,
        0,
        4096,
        f32_bits(10000.0),
        f32_bits(0.5),
        f32_bits(1.0),
        f32_bits(1.0),
        f32_bits(32.0),
        f32_bits(1.0),
    ]
    out = m.node(GgmlOp.ROPE, GgmlType.F32, (8, 2, 3), [x, pos], params)
    plan = m.run(out)
    assert isinstance(plan.steps[0].node.bound, rope.RopeParams)
    m.write(pos, np.array([5, 6, 7], np.int32))
    m.run(out)  # a fresh plan over the new positions
    want = m.read(out)
    binds = []
    monkeypatch.setattr(rope, "bind_rope", lambda *a: binds.append(a))
    m.write(out, np.zeros((3, 2, 8), np.float32))
    plan.run(np)
    assert binds == []
    assert m.read(out).tobytes() == want.tobytes()


def test_a_bind_that_fails_reports_at_run_time():
    m = Local()
    x = m.tensor(GgmlType.F32, (8, 1, 1), np.ones((1, 1, 8)))
    pos = m.tensor(GgmlType.I32, (1,), np.array([0], np.int32))
    out = m.node(GgmlOp.ROPE, GgmlType.F32, (8, 1, 1), [x, pos], [0, 0, 0])  # n_dims 0
    plan = build_plan(m.g.serialize([out]), m.registry)
    assert plan.steps[0].node.bound is None
    with pytest.raises(ComputeError, match="ROPE.*ZeroDivisionError"):
        plan.run(np)


def test_cache_budget_spellings():
    assert CacheBudget.parse("0.5x").limit(1000) == 500
    assert CacheBudget.parse("512M").limit(0) == 512 << 20
    assert CacheBudget.parse("0").limit(1 << 30) == 0
    assert CacheBudget.parse(None) == CacheBudget.parse("0.5x")
    with pytest.raises(ValueError, match="expected a fraction"):
        CacheBudget.parse("lots")


@pytest.mark.parametrize("kv_type", [GgmlType.F32, GgmlType.F16])
def test_flash_attention_matches_softmax_attention_with_grouped_heads(kv_type):
    m = Local(size=4 << 20)
    d, n_q, n_kv, heads, heads_kv = 32, 3, 5, 4, 2
    q = RNG.standard_normal((heads, n_q, d)).astype(np.float32)
    k = RNG.standard_normal((heads_kv, n_kv, d)).astype(np.float32)
    v = RNG.standard_normal((heads_kv, n_kv, d)).astype(np.float32)
    mask = np.zeros((n_q, n_kv), np.float16)
    mask[0, 3:] = -np.inf  # causal-style: the first query sees 3 entries
    qt = m.tensor(GgmlType.F32, (d, n_q, heads), q)
    kt = m.tensor(kv_type, (d, n_kv, heads_kv), k)
    vt = m.tensor(kv_type, (d, n_kv, heads_kv), v)
    mt = m.tensor(GgmlType.F16, (n_kv, n_q), mask)
    scale = 1 / np.sqrt(d)
    out = m.node(GgmlOp.FLASH_ATTN_EXT, GgmlType.F32, (d, heads, n_q), [qt, kt, vt, mt], [f32_bits(scale)])
    m.run(out)
    kk, vv = np.repeat(k, 2, axis=0), np.repeat(v, 2, axis=0)
    scores = q @ kk.transpose(0, 2, 1) * scale + mask.astype(np.float32)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ vv  # (heads, n_q, d)
    # f16 K/V: Q rounded to f16 and the V sum accumulated in f16, as the CPU does.
    tol = 1e-5 if kv_type == GgmlType.F32 else 3e-3
    np.testing.assert_allclose(
        m.read(out).reshape(n_q, heads, d), want.transpose(1, 0, 2), rtol=tol, atol=tol
    )


# -- over the wire: what a client sees -------------------------------------------------------


def test_recompute_after_set_tensor_sees_new_weights(fleetd_server):
    ep = endpoint(fleetd_server(devices=["numpy"]))
    g = GraphBuilder()
    w_values = RNG.standard_normal((4, 64)).astype(np.float32)
    with RpcClient(ep) as c:
        ptr, _ = c.alloc_buffer(4096)
        base = c.buffer_get_base(ptr)
        w = g.tensor(GgmlType.Q8_0, (64, 4), ptr, base)
        x = g.tensor(GgmlType.F32, (64, 1), ptr, base + 1024)
        y = g.place(g.mul_mat(w, x), ptr, base + 2048)
        c.set_tensor(w.rpc(), np.frombuffer(q8_0(w_values), np.uint8))
        c.set_tensor(x.rpc(), np.ones(64, np.float32))
        c.graph_compute(g.serialize([y]))
        first = np.frombuffer(c.get_tensor(y.rpc()), "<f4").copy()
        c.set_tensor(w.rpc(), np.frombuffer(q8_0(2 * w_values), np.uint8))
        c.graph_recompute(0)
        second = np.frombuffer(c.get_tensor(y.rpc()), "<f4").copy()
    assert row_size(GgmlType.Q8_0, 64) * 4 == len(q8_0(w_values))
    np.testing.assert_allclose(second, 2 * first, rtol=1e-2)
    assert not np.allclose(second, first)


def test_unsupported_graph_closes_only_its_connection(fleetd_server, caplog):
    ep = endpoint(fleetd_server(devices=["numpy"]))
    g = GraphBuilder()
    with RpcClient(ep) as keeper:
        kptr, _ = keeper.alloc_buffer(64)
        kbase = keeper.buffer_get_base(kptr)
        kept = g.tensor(GgmlType.F32, (16,), kptr, kbase)
        keeper.set_tensor(kept.rpc(), np.arange(16, dtype=np.float32))
        with caplog.at_level(logging.WARNING, logger="fleetd"):
            c = RpcClient(ep).open()
            try:
                ptr, _ = c.alloc_buffer(4096)
                base = c.buffer_get_base(ptr)
                a = g.tensor(GgmlType.F32, (256, 1), ptr, base)
                dst = g.tensor(GgmlType.IQ2_XXS, (256, 1), ptr, base + 1024)
                c.graph_compute(g.serialize([g.cpy(a, dst)]))
                assert connection_closed(c.sock)
            finally:
                c.close()
        lines = [r.getMessage() for r in caplog.records if "graph failed" in r.getMessage()]
        assert len(lines) == 1 and "CPY" in lines[0] and "IQ2_XXS" in lines[0], lines
        assert np.frombuffer(keeper.get_tensor(kept.rpc()), "<f4").tolist() == list(range(16))


def test_view_beyond_buffer_closes_only_its_connection(fleetd_server):
    ep = endpoint(fleetd_server(devices=["numpy"]))
    g = GraphBuilder()
    with RpcClient(ep) as keeper:
        c = RpcClient(ep).open()
        try:
            ptr, _ = c.alloc_buffer(256)
            base = c.buffer_get_base(ptr)
            a = g.tensor(GgmlType.F32, (16,), ptr, base)
            big = g.view_of(a, (64,), (4, 256, 256, 256), 0)  # 256 bytes from base+0: fits
            beyond = g.view_of(a, (64,), (4, 256, 256, 256), 64)  # 64 bytes past the end
            s = g.place(g.add(big, beyond), ptr, base)
            c.graph_compute(g.serialize([s]))
            assert connection_closed(c.sock)
        finally:
            c.close()
        assert keeper.device_count() == 1
