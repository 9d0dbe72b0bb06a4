"""Issue #17 item 2: the rule holes, one test each, and plan building's cost.

Every rule's check of what a kernel touches goes through rules.Touch (rows by nb1..nb3, or flat
rows at r * nb1, bytes per row) against the tensor's extent (ggml_nbytes from its data, which
fleetd checked against its buffer). Each test names what today's code (before this change) did
with the same graph; the over-the-wire ones put the result into a buffer another session owns,
filled with 0xAB, and read it back after the refusal.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import endpoint

from fleetd.client.graph import GraphBuilder, Tensor, f32_bits
from fleetd.client.rpc import RpcClient
from fleetd.compute.buffers import BufferRegistry
from fleetd.errors import PeerClosed, RemoteProtocolError, TransportError
from fleetd.wire import GgmlOp, GgmlType
from fleetd.wire.ggml import GluOp, UnaryOp

try:
    from fleetd.compute.ggml.device import load_device

    DEVICE = load_device()
except OSError as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"ggml libraries: {exc}", allow_module_level=True)

from fleetd.compute.ggml.rules import Refused, Touch, check_node, contiguous_from, row_extent


@pytest.fixture(scope="module", autouse=True)
def _close_device():
    """DEVICE starts a fork server at its first run: stop it with the module."""
    yield
    DEVICE.close()


F32, F16, I32, I64, Q8_0 = GgmlType.F32, GgmlType.F16, GgmlType.I32, GgmlType.I64, GgmlType.Q8_0
KIB = 1024
FILL = 0xAB


def tensor(type_, ne, nb=None, data=0x10000) -> Tensor:
    t = GraphBuilder().tensor(type_, ne, buffer=1, data=data)
    if nb is not None:
        t.nb = tuple(nb)
    return t


def node(op, type_, ne, srcs, params=(), nb=None, data=0x80000) -> Tensor:
    t = tensor(type_, ne, nb, data)
    t.op, t.src = op, list(srcs)
    for i, p in enumerate(params):
        t.op_params[i] = p
    return t


def check(n: Tensor):
    return check_node(n.rpc(), [s.rpc() for s in n.src], DEVICE.caps)


# -- the one description ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ne,nb", [((8, 3, 2, 2), None), ((8, 3, 2, 1), (4, 40, 200, 400)), ((64, 2, 1, 3), (34, 80, 160, 160))]
)
def test_the_default_touch_is_ggml_nbytes(ne, nb):
    """What fleetd validates against the buffer (nbytes) is the touch of a kernel that walks
    rows by dims, each row as ggml counts it: one computation."""
    t = tensor(Q8_0 if ne[0] == 64 else F32, ne, nb).rpc()
    assert Touch(t, row_extent(t)).extent() == t.nbytes


# -- 1. flat rows stepped by nb1 with ne1 == 1 ----------------------------------------------------

# ne1 == 1: ggml_is_contiguous takes any nb1, the kernel still steps row r at r * nb1
FLAT_NE, FLAT_NB = (2, 1, 4, 1), (4, 128 * KIB, 8, 32)


def flat_case(op):
    a = tensor(F32, FLAT_NE)
    params = {
        GgmlOp.SCALE: [f32_bits(2.0)],
        GgmlOp.CLAMP: [f32_bits(-1.0), f32_bits(1.0)],
        GgmlOp.ARGSORT: [0],
        GgmlOp.TOP_K: [],
        GgmlOp.LEAKY_RELU: [f32_bits(0.1)],
    }[op]
    out = I32 if op in (GgmlOp.ARGSORT, GgmlOp.TOP_K) else F32
    return node(op, out, FLAT_NE, [a], params, FLAT_NB)


@pytest.mark.parametrize(
    "op", [GgmlOp.SCALE, GgmlOp.CLAMP, GgmlOp.ARGSORT, GgmlOp.TOP_K, GgmlOp.LEAKY_RELU], ids=lambda o: o.name
)
def test_flat_row_kernels_are_checked_at_their_nb1_steps(op):
    """Today: SCALE/CLAMP pass (contiguous skips ne1 == 1), ARGSORT/TOP_K check packed rows
    only: all taken, rows 1..3 written 128-384 KiB past a 32-byte result. (LEAKY_RELU's own
    rows_ascending already refused this one; it now goes through the same Touch.)"""
    with pytest.raises(Refused, match="flat rows"):
        check(flat_case(op))
    # the same node with the packed nb1 computes
    ok = flat_case(op)
    ok.nb = (4, 8, 8, 32)
    check(ok)


# -- 2. flash attention copies nb1 bytes per output row ------------------------------------------


def flash_attn(nb1: int):
    q, k, v = tensor(F32, (64, 1, 1)), tensor(F16, (64, 32, 1)), tensor(F16, (64, 32, 1))
    return node(
        GgmlOp.FLASH_ATTN_EXT, F32, (64, 1, 1, 1), [q, k, v], [f32_bits(0.125), 0, 0, 0], (4, nb1, nb1, nb1)
    )


def test_flash_attn_result_rows_are_nb1_bytes_of_a_dv_row():
    """Today: ne = [DV, 1, 1, 1] is contiguous whatever nb1; the kernel memcpys nb1 bytes."""
    check(flash_attn(256))
    with pytest.raises(Refused, match="nb1"):
        check(flash_attn(256 + 3748))


# -- 4. quantizing copy scratch, 5. ROPE odd ne0, 6. pinned contiguity, MUL_MAT_ID strides --------


def test_quantizing_copy_rows_no_longer_than_the_results():
    """Today: f32 [64, 1] -> q8_0 [32, 2] is taken; each thread's scratch holds dst.ne0 = 32
    floats and dup_to_q fills it with src0.ne0 = 64: a heap overflow."""
    dst = tensor(Q8_0, (32, 2))
    bad = node(GgmlOp.CPY, Q8_0, (32, 2), [tensor(F32, (64, 1)), dst])
    with pytest.raises(Refused, match="scratch"):
        check(bad)
    check(node(GgmlOp.CPY, Q8_0, (64, 1), [tensor(F32, (32, 2)), tensor(Q8_0, (64, 1))]))


ROPE_PARAMS = [0, 4, 0, 0, 0, f32_bits(10000.0), f32_bits(1.0), 0, f32_bits(1.0), 0, 0]


@pytest.mark.parametrize("ne0,ok", [(5, False), (6, True)])
def test_rope_with_odd_ne0_would_write_past_each_row(ne0, ok):
    """Today: n_dims 4 <= ne0 5 is taken; the pass-through loop copies pairs up to ne0 + 1."""
    pos = tensor(I32, (3,))
    n = node(GgmlOp.ROPE, F32, (ne0, 2, 3), [tensor(F32, (ne0, 2, 3)), pos], ROPE_PARAMS)
    if ok:
        check(n)
    else:
        with pytest.raises(Refused, match="addresses its rows"):
            check(n)


@pytest.mark.parametrize(
    "ne,nb,n,pinned",
    [
        ((8, 1, 2, 1), (4, 0, 32, 64), 1, False),  # stride-0 size-1 dim 1 sets dim 2's stride: 0
        ((8, 1, 2, 1), (4, 1000, 32, 64), 1, False),
        ((8, 1, 2, 1), (4, 1000, 1000, 2000), 1, True),
        ((8, 1, 2, 1), (4, 1000, 32, 64), 0, True),  # above n, size-1 dims take any stride
        ((8, 3, 1, 1), (4, 64, 7, 9), 1, True),
        ((8, 3, 2, 1), (4, 0, 0, 0), 1, True),
    ],
)
def test_contiguous_n_is_the_pinned_ggml_is_contiguous_m_n(ne, nb, n, pinned):
    assert contiguous_from(tensor(F32, ne, nb).rpc(), n) is pinned


def test_glu_and_xielu_take_only_what_ggml_is_contiguous_1_takes():
    """Today: dims of size 1 below n were skipped, so src0 [16, 1, 2] with nb1 0 passed and
    the GLU kernel's GGML_ASSERT(ggml_is_contiguous_1(src0)) aborted the daemon."""
    a = tensor(F32, (16, 1, 2), (4, 0, 64, 128))
    glu = node(GgmlOp.GLU, F32, (8, 1, 2), [a], [GluOp.SWIGLU])
    with pytest.raises(Refused, match="rows are not packed"):
        check(glu)
    a2 = tensor(F32, (8, 1, 2), (4, 0, 32, 64))
    xielu = node(GgmlOp.UNARY, F32, (8, 1, 2), [a2], [UnaryOp.XIELU])
    with pytest.raises(Refused, match="row layout"):
        check(xielu)


def test_mul_mat_id_result_strides_ascend():
    """Today: no order check; the kernel GGML_ASSERTs nb0 <= nb1 <= nb2 <= nb3."""
    ids = tensor(I32, (2, 3))
    srcs = [tensor(F32, (8, 4, 3)), tensor(F32, (8, 1, 3)), ids]
    check(node(GgmlOp.MUL_MAT_ID, F32, (4, 2, 3), srcs))
    with pytest.raises(Refused, match="permuted"):
        check(node(GgmlOp.MUL_MAT_ID, F32, (4, 2, 3), srcs, nb=(4, 96, 16, 288)))


# -- 7. flash attention's own asserts, 8. CONT has no quantizing scratch --------------------------


def flash_attn_heads(nb=None, prec=0):
    q, k, v = tensor(F32, (64, 1, 4)), tensor(F16, (64, 32, 4)), tensor(F16, (64, 32, 4))
    return node(GgmlOp.FLASH_ATTN_EXT, F32, (64, 4, 1, 1), [q, k, v], [f32_bits(0.125), 0, 0, prec], nb)


@pytest.mark.parametrize("nb", [(4, 256, 2048, 1024), (4, 256, 1024, 0), (4, 256, 128, 1024)])
def test_flash_attn_result_strides_ascend(nb):
    """Today (fuzz 101303, 106595): ne2 = ne3 = 1 is contiguous whatever nb2/nb3, and no byte
    is addressed there; the kernel GGML_ASSERTs nb0 <= nb1 <= nb2 <= nb3: SIGABRT."""
    check(flash_attn_heads((4, 256, 1024, 1024)))
    with pytest.raises(Refused, match="do not ascend"):
        check(flash_attn_heads(nb))


@pytest.mark.parametrize("prec", [1, 20, 1 << 30, 0x7FC00000, -1])
def test_flash_attn_takes_only_the_precisions_its_kernel_switches_on(prec):
    """Today (fuzz 104194, 106987): op_params[3] unchecked; ggml_compute_forward_flash_attn_ext
    switches on it and GGML_ABORTs past GGML_PREC_DEFAULT (0) and GGML_PREC_F32 (10)."""
    check(flash_attn_heads(prec=0))
    check(flash_attn_heads(prec=10))  # what llama.cpp sets (ggml_flash_attn_ext_set_prec)
    with pytest.raises(Refused, match="precision"):
        check(flash_attn_heads(prec=prec))


@pytest.mark.parametrize(
    "src_type,dst_type,ne",
    [
        (F32, GgmlType.Q4_K, (256, 2, 1, 1)),
        (F32, GgmlType.Q4_0, (128, 4, 1, 2)),
        (F16, Q8_0, (256, 2, 3, 1)),
        (F32, GgmlType.Q4_K, (256, 1, 2, 2)),
    ],
)
def test_cont_into_a_quantized_type_is_refused(src_type, dst_type, ne):
    """Today (fuzz 103994, 105786, 106150, 109041): taken like a quantizing CPY; dup_to_q
    converts rows into a per-thread f32 scratch in the work buffer, which ggml_graph_plan sizes
    for CPY and DUP only: a CONT writes through a NULL work buffer (SIGSEGV)."""
    a = tensor(src_type, ne)
    with pytest.raises(Refused, match="no scratch"):
        check(node(GgmlOp.CONT, dst_type, ne, [a]))
    # the same conversion as a CPY (the plan sizes its scratch), and CONT keeping the type
    check(node(GgmlOp.CPY, dst_type, ne, [a, tensor(dst_type, ne, data=0x80000)]))
    check(node(GgmlOp.DUP, dst_type, ne, [a]))
    check(node(GgmlOp.CONT, dst_type, ne, [tensor(dst_type, ne)]))
    check(node(GgmlOp.CONT, F32 if src_type == F16 else F16, ne, [a]))


@pytest.mark.parametrize(
    "nb,src_data",
    [((4, 0, 264, 792), 0x10000), ((4, 128, 264, 792), 0x10000), ((4, 132, 264, 792), 0x80000 - 1000)],
)
def test_argsort_sorts_in_rows_nothing_else_touches(nb, src_data):
    """Today (fuzz 208816): result nb1 0 is taken (12 flat rows, all at byte 0, inside the
    extent); two threads std::sort the same row at once and one walks off it: SIGSEGV. The
    same holds for rows 4 bytes too close, and for a result over src0's floats."""
    shape = (33, 2, 3, 2)
    ok = node(GgmlOp.ARGSORT, I32, shape, [tensor(F32, shape)], [0])
    check(ok)
    with pytest.raises(Refused, match="overlap"):
        check(node(GgmlOp.ARGSORT, I32, shape, [tensor(F32, shape, data=src_data)], [0], nb))


# -- 3. row ids: on the private copy unless an ARGSORT/TOP_K wrote them whole -------------------


class Graph:
    """Tensors in one buffer of a unit-level registry, for build_plan without a server."""

    def __init__(self, size: int = 1 << 16):
        self.registry = BufferRegistry()
        self.buf = self.registry.alloc(0, DEVICE, size, owner=1)
        self.g, self.next = GraphBuilder(), 0

    def place(self, t: Tensor, at: int | None = None) -> Tensor:
        if at is None:
            at, self.next = self.next, self.next + (t.nbytes + 63) // 64 * 64
        return self.g.place(t, self.buf.handle, self.buf.base + at)

    def leaf(self, type_, ne) -> Tensor:
        return self.place(self.g.tensor(type_, ne))

    def node(self, op, type_, ne, srcs, params=(), nb=None) -> Tensor:
        t = self.g.tensor(type_, ne)
        t.op, t.src = op, list(srcs)
        if nb is not None:
            t.nb = tuple(nb)
        for i, p in enumerate(params):
            t.op_params[i] = p
        return self.place(t)

    def plan(self, *nodes):
        return DEVICE.build_plan(self.g.serialize(list(nodes)), self.registry)


GAPPED = (4, 16, 64, 64)  # rows of 2 i32 16 bytes apart: 8-byte gaps an ARGSORT never writes


def strided_argsort(g: Graph):
    """ARGSORT of 4 rows of 2 into GAPPED rows (56 bytes)."""
    return g.node(GgmlOp.ARGSORT, I32, (2, 4), [g.leaf(F32, (2, 4))], [1], nb=GAPPED)


def consumers(g: Graph, ids: Tensor):
    """Each op with row ids, reading `ids` ([2, 3] i32)."""
    get_rows = g.node(
        GgmlOp.GET_ROWS,
        F32,
        (8, 2, 3),
        [g.leaf(F32, (8, 4, 3)), g.g.view_of(ids, (2, 3, 1), ids.nb, 0, GgmlOp.RESHAPE)],
    )
    dst = g.leaf(F32, (8, 4, 3))
    set_rows = g.g.view_of(dst, dst.ne, dst.nb, 0)
    set_rows.op, set_rows.src = (
        GgmlOp.SET_ROWS,
        [g.leaf(F32, (8, 2, 3)), g.g.view_of(ids, (2, 3, 1), ids.nb, 0, GgmlOp.RESHAPE), dst],
    )
    mmid = g.node(GgmlOp.MUL_MAT_ID, F32, (4, 2, 3), [g.leaf(F32, (8, 4, 3)), g.leaf(F32, (8, 1, 3)), ids])
    add_id = g.node(GgmlOp.ADD_ID, F32, (8, 2, 3), [g.leaf(F32, (8, 2, 3)), g.leaf(F32, (8, 4)), ids])
    return {"GET_ROWS": get_rows, "SET_ROWS": set_rows, "MUL_MAT_ID": mmid, "ADD_ID": add_id}


@pytest.mark.parametrize("op", ["GET_ROWS", "SET_ROWS", "MUL_MAT_ID", "ADD_ID"])
def test_ids_in_the_gaps_of_a_strided_argsort_are_checked_on_a_private_copy(op):
    """Today: a view inside the ARGSORT's [data, data + nbytes) counted as made here; at +8 it
    reads the gaps, which hold the client's bytes, unchecked (MUL_MAT_ID: heap writes at
    client-chosen offsets; the others: GGML_ASSERT, the daemon aborts). Now the view has a
    private copy checked before each run, so no ARGSORT of the graph may write it before."""
    g = Graph()
    order = strided_argsort(g)
    ids = g.g.view_of(order, (2, 3), GAPPED, 8)  # bytes [8, 48) of [0, 56)
    with pytest.raises(Refused, match="overwrites the row ids"):
        g.plan(order, consumers(g, ids)[op])


@pytest.mark.parametrize("op", ["GET_ROWS", "SET_ROWS", "MUL_MAT_ID", "ADD_ID"])
def test_ids_that_an_argsort_wrote_whole_need_no_copy(op):
    """ggml_argsort_top_k's view (the first k of each packed row) and the tensor itself are
    proved in range: no private copy, no check per run (llama.cpp's MoE graphs)."""
    g = Graph()
    order = g.node(GgmlOp.ARGSORT, I32, (3, 3), [g.leaf(F32, (3, 3))], [1])
    ids = g.g.view_of(order, (2, 3), order.nb, 0)
    plan = g.plan(order, consumers(g, ids)[op])
    assert plan.spec.index_checks == []


def test_a_leaf_of_ids_is_copied_and_checked_at_run():
    g = Graph()
    ids = g.leaf(I32, (2, 3))
    plan = g.plan(consumers(g, ids)["MUL_MAT_ID"])
    assert [c[0] for c in plan.spec.index_checks] == [ids.id]
    _, handle, offset, nbytes = plan.spec.index_checks[0][:4]
    plan.buffers[handle].array[offset : offset + nbytes] = np.array([0, 1, 2, 3, 0, 9], np.int32).view(
        np.uint8
    )
    with pytest.raises(RemoteProtocolError, match="outside"):
        plan.run()


@pytest.mark.parametrize("n", [6, 300])  # a list below SMALL_INDEX, numpy's reductions above
@pytest.mark.parametrize("bad", [None, -1, 4])
def test_row_ids_are_checked_whatever_their_count(n, bad):
    g = Graph(size=1 << 16)
    ids = g.leaf(I32, (n,))
    plan = g.plan(g.node(GgmlOp.GET_ROWS, F32, (8, n), [g.leaf(F32, (8, 4)), ids]))  # 4 rows
    _, handle, offset, nbytes = plan.spec.index_checks[0][:4]
    values = np.arange(n, dtype=np.int32) % 4
    if bad is not None:
        values[-1] = bad
    plan.buffers[handle].array[offset : offset + nbytes] = values.view(np.uint8)
    if bad is None:
        plan.run()
    else:
        with pytest.raises(RemoteProtocolError, match="outside"):
            plan.run()


# -- 7. plan building is n log n in index uses ----------------------------------------------------


def get_rows_graph(n: int):
    g = Graph(size=128 * n + 4096)
    table = g.leaf(F32, (4, 16))
    nodes = [g.node(GgmlOp.GET_ROWS, F32, (4, 2), [table, g.leaf(I32, (2,))]) for _ in range(n)]
    return g, nodes


def test_plan_building_work_grows_n_log_n_with_index_uses():
    """Today _writer_between scans every write per use (8,000 uses x 8,000 writes = 64M steps,
    6.1 s) and the producer search scans the nodes before each use. Here the WriteLog visits
    tree nodes: doubling the graph roughly doubles them (x2 plus a log factor)."""
    steps = {}
    for n in (4000, 8000):
        g, nodes = get_rows_graph(n)
        plan = g.plan(*nodes)
        assert len(plan.spec.index_checks) == n
        steps[n] = DEVICE.plan_steps
    assert steps[8000] < 2.4 * steps[4000], steps
    assert steps[8000] < 8000 * 100, steps  # ~2 * log2(32000) per write and per use


# -- over the wire: refused, closed, the daemon goes on, the victim's bytes unchanged -------------


class Session:
    def __init__(self, client: RpcClient, size: int = 1 << 20):
        self.c, self.g = client, GraphBuilder()
        self.handle, _ = client.alloc_buffer(size)
        self.base, self.next = client.buffer_get_base(self.handle), 0
        self.rng = np.random.default_rng(3)

    def leaf(self, type_, ne, values=None) -> Tensor:
        t = self.g.place(self.g.tensor(type_, ne), self.handle, self.base + self.next)
        self.next += (t.nbytes + 63) // 64 * 64
        if values is None:
            values = self.rng.standard_normal(int(np.prod(ne))).astype(
                np.float16 if type_ == F16 else np.float32
            )
        self.c.set_tensor(t.rpc(), np.ascontiguousarray(values).tobytes())
        return t


class Victim:
    """Another session's buffer, every byte FILL."""

    SIZE = 1 << 20

    def __init__(self, client: RpcClient):
        self.c, self.g = client, GraphBuilder()
        self.handle, _ = client.alloc_buffer(self.SIZE)
        self.base = client.buffer_get_base(self.handle)
        self.whole = self.g.place(self.g.tensor(GgmlType.I8, (self.SIZE,)), self.handle, self.base)
        client.set_tensor(self.whole.rpc(), bytes([FILL]) * self.SIZE)

    def untouched(self) -> bool:
        return bool((np.frombuffer(self.c.get_tensor(self.whole.rpc()), np.uint8) == FILL).all())


def attack(ep: str, build) -> bool:
    """build(session, victim) -> nodes; True when computed, False when the server closed."""
    with RpcClient(ep).open() as vc, RpcClient(ep).open() as c:
        victim, s = Victim(vc), Session(c)
        nodes = build(s, victim)
        try:
            c.graph_compute(s.g.serialize(nodes))
            c.get_tensor(nodes[-1].rpc())
            computed = True
        except (PeerClosed, TransportError, ConnectionError):
            computed = False
        assert victim.untouched(), "bytes of another session's buffer changed"
        return computed


def served(ep: str) -> bool:
    with RpcClient(ep).open() as c:
        s = Session(c)
        a = s.leaf(F32, (8,))
        n = s.g.scale(a, 2.0)
        s.g.place(n, s.handle, s.base + 4096)
        c.graph_compute(s.g.serialize([n]))
        return np.allclose(
            np.frombuffer(c.get_tensor(n.rpc()), np.float32),
            2 * np.frombuffer(c.get_tensor(a.rpc()), np.float32),
        )


def into(victim: Victim, t: Tensor, nb=None) -> Tensor:
    if nb is not None:
        t.nb = tuple(nb)
    return victim.g.place(t, victim.handle, victim.base)


@pytest.mark.parametrize(
    "op", [GgmlOp.SCALE, GgmlOp.CLAMP, GgmlOp.ARGSORT, GgmlOp.TOP_K], ids=lambda o: o.name
)
def test_wire_flat_rows_do_not_reach_another_sessions_buffer(ggml_server, op):
    """Today: computed; rows 1..3 written at 128, 256, 384 KiB into the victim's buffer."""

    def build(s, victim):
        n = flat_case(op)
        n.src = [s.leaf(F32, FLAT_NE)]
        return [into(victim, n, FLAT_NB)]

    ep = endpoint(ggml_server)
    assert not attack(ep, build)
    assert served(ep)


def test_wire_flash_attn_writes_no_byte_past_its_row(ggml_server):
    """Today: computed, 3,748 bytes written past the 256-byte result."""

    def build(s, victim):
        n = flash_attn(256 + 3748)
        n.src = [s.leaf(F32, (64, 1, 1)), s.leaf(F16, (64, 32, 1)), s.leaf(F16, (64, 32, 1))]
        return [into(victim, n, n.nb)]

    ep = endpoint(ggml_server)
    assert not attack(ep, build)
    assert served(ep)


def test_wire_rope_odd_ne0(ggml_server):
    """Today: computed, one f32 written past the result's last row."""

    def build(s, victim):
        pos = s.leaf(I32, (3,), np.arange(3, dtype=np.int32))
        n = node(GgmlOp.ROPE, F32, (5, 2, 3), [s.leaf(F32, (5, 2, 3)), pos], ROPE_PARAMS)
        return [into(victim, n)]

    ep = endpoint(ggml_server)
    assert not attack(ep, build)
    assert served(ep)


def test_wire_mul_mat_id_ids_in_argsort_gaps(ggml_server):
    """Today: the ids view at +8 of a gapped ARGSORT counts as made here, its bytes are the
    client's (1000: a heap write 1000 experts on). Now: refused, the victim untouched."""

    def build(s, victim):
        probs = s.leaf(F32, (2, 4))
        gaps = s.leaf(I32, (16,), np.full(16, 1000, np.int32))  # where the ARGSORT will go
        order = s.g.tensor(I32, (2, 4))
        order.op, order.src, order.op_params[0] = GgmlOp.ARGSORT, [probs], 1
        order.nb = GAPPED
        s.g.place(order, s.handle, gaps.data)
        ids = s.g.view_of(order, (2, 3), GAPPED, 8)
        mm = node(GgmlOp.MUL_MAT_ID, F32, (4, 2, 3), [s.leaf(F32, (8, 4, 3)), s.leaf(F32, (8, 1, 3)), ids])
        return [order, into(victim, mm)]

    ep = endpoint(ggml_server)
    assert not attack(ep, build)
    assert served(ep)
