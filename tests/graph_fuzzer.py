"""A structure-aware GRAPH_COMPUTE fuzzer over every op that has a rule (issue #17 item 5).

One case is one seed. The seed picks the op (FUZZ_OPS[seed % len(FUZZ_OPS)]), builds a
plausible graph for it (shapes, types and op_params as ggml's builders make them), then mutates
it "a little off": a shape one off, an odd ne0, a strided/padded/stride-0/reversed/permuted
layout, a big nb on a size-1 dim, another type, an op_param word, a src dropped or added, the
result flush with its buffer's end or in place over its input, row ids out of range or made in
the graph by ARGSORT/TOP_K (also views into a strided ARGSORT result whose padding holds junk).

The run, against a real `python -m fleetd.server` subprocess, through fleetd's own client:

    victim session V: allocates Y_hi               (mmap: the next mapping lands just below it)
    fuzzed session F: allocates X                  (its end touches Y_hi's start)
    victim session V: allocates Y_lo               (just below X)
    X, Y_hi, Y_lo filled with a canary; F writes its inputs into X; F sends the graph
    F: a round trip; X read back whole; V: Y_hi and Y_lo read back whole

Outcomes: computed | refused (F closed, the daemon logged a refusal for F's port) |
worker_death (F closed without a refusal line, or the log says the graph failed) | hang (no
answer within READ_S) | daemon_death (the process exited or a fresh HELLO fails; it is restarted).
A corruption: a byte of X outside the extents the graph's computed nodes may write differs from
what was there before the compute, or any byte of Y_hi/Y_lo differs from the canary.

    from graph_fuzzer import Daemon, run_cases
    with Daemon() as d:
        results = run_cases(d, seeds=range(1000), seconds=60)
    run_case(d, 4242)          # replay one case: same graph, same bytes
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from fleetd.client.graph import GraphBuilder, Tensor, f32_bits
from fleetd.client.rpc import RpcClient
from fleetd.errors import FleetdError
from fleetd.fleet.procs import process_tree
from fleetd.transport.tcp import Timeout
from fleetd.wire import METADATA_OPS, TYPE_TRAITS, GgmlOp, GgmlType, RpcTensor, contiguous_strides, nbytes
from fleetd.wire.ggml import GluOp, UnaryOp

REPO = Path(__file__).resolve().parent.parent
F32, F16, BF16, I32, I64 = GgmlType.F32, GgmlType.F16, GgmlType.BF16, GgmlType.I32, GgmlType.I64
Q8_0, Q4_0, Q4_K, Q6_K = GgmlType.Q8_0, GgmlType.Q4_0, GgmlType.Q4_K, GgmlType.Q6_K
OP = GgmlOp

# Every op with a rule in fleetd/compute/ggml/rules.py, in a fixed order: a seed names its op
# through this tuple, so adding an op at the end keeps every older seed's case.
FUZZ_OPS: tuple[GgmlOp, ...] = (
    OP.ADD,
    OP.SUB,
    OP.MUL,
    OP.DIV,
    OP.SCALE,
    OP.RMS_NORM,
    OP.NORM,
    OP.L2_NORM,
    OP.UNARY,
    OP.GLU,
    OP.MUL_MAT,
    OP.MUL_MAT_ID,
    OP.GET_ROWS,
    OP.SET_ROWS,
    OP.CPY,
    OP.DUP,
    OP.CONT,
    OP.ROPE,
    OP.ROPE_BACK,
    OP.SOFT_MAX,
    OP.FLASH_ATTN_EXT,
    OP.CLAMP,
    OP.MEAN,
    OP.ARGMAX,
    OP.CONCAT,
    OP.PAD,
    OP.ADD_ID,
    OP.ARGSORT,
    OP.TOP_K,
    OP.SUM_ROWS,
    OP.SQR,
    OP.SQRT,
    OP.LOG,
    OP.SIN,
    OP.COS,
    OP.LEAKY_RELU,
    OP.SUM,
    OP.CUMSUM,
    OP.REPEAT,
    OP.FILL,
    OP.ARANGE,
    OP.SET,
    OP.ACC,
    OP.GROUP_NORM,
    OP.NONE,
    OP.RESHAPE,
    OP.VIEW,
    OP.PERMUTE,
    OP.TRANSPOSE,
)

READ_S = 20.0  # every socket read of a case: a compute of these sizes takes milliseconds
LOG_WAIT_S = 2.0  # how long a closed session's log line may lag behind the close
MAX_BUFFER = 8 << 20  # X never grows past this: a bigger layout is clipped (and refused)
VICTIM_SIZE = 64 << 10
PAGE = 4096
OUTCOMES = ("computed", "refused", "worker_death", "hang", "daemon_death")

# A "graph failed" line (ComputeError) is a refusal when its reason is one of the rule checks
# (rules.Refused is a ComputeError); a kernel or worker failure otherwise.
REFUSAL_MARKERS = (
    "refused",
    "no safety rule",
    "past the op enum",
    "reads past its end",
    "was sorted",
    "overwrites the row ids",
)


def op_of(seed: int) -> GgmlOp:
    return FUZZ_OPS[seed % len(FUZZ_OPS)]


def seeds_for(ops, start: int, count: int):
    """`count` consecutive-ish seeds from `start` whose op is in `ops` (all ops: every seed)."""
    wanted = {FUZZ_OPS.index(o) for o in ops}
    s, n = start, 0
    while n < count:
        if s % len(FUZZ_OPS) in wanted:
            yield s
            n += 1
        s += 1


# -- the graph of one case --------------------------------------------------------------------------


def ne4(ne) -> tuple[int, int, int, int]:
    return tuple(ne) + (1,) * (4 - len(ne))  # type: ignore[return-value]


@dataclass
class Fill:
    kind: str  # normal | ids | junk_ids | bytes
    bound: int = 0
    oob: bool = False


class Gen:
    """Tensors of one case: leaves (client-written), nodes (computed), views of either."""

    def __init__(self, rng: random.Random):
        self.rng, self.g = rng, GraphBuilder()
        self.roots: list[Tensor] = []  # placed tensors, in placement order
        self.fills: dict[int, Fill] = {}  # tensor id -> what the client writes there
        self.nodes: list[Tensor] = []
        self.views: list[Tensor] = []  # data = root.data + view_offs once placed
        self.notes: list[str] = []

    def t(self, type_, ne) -> Tensor:
        ne = ne4(ne)
        return Tensor(int(type_), ne, contiguous_strides(type_, ne))

    def leaf(self, type_, ne, fill: Fill | None = None) -> Tensor:
        t = self.t(type_, ne)
        self.roots.append(t)
        self.fills[t.id] = fill or Fill("normal")
        return t

    def node(self, op, type_, ne, srcs, params=()) -> Tensor:
        t = self.t(type_, ne)
        t.op, t.src = int(op), list(srcs)
        for i, p in enumerate(params):
            t.op_params[i] = p
        self.roots.append(t)
        self.nodes.append(t)
        return t

    def view(self, of: Tensor, ne, nb, offs: int = 0, op=OP.VIEW, node: bool = False) -> Tensor:
        root = of.view_src or of
        t = Tensor(
            root.type if of is root else of.type,
            ne4(ne),
            tuple(nb),
            op=int(op),
            src=[of],
            view_src=root,
            view_offs=(of.view_offs if of.view_src else 0) + offs,
        )
        if op == OP.VIEW:
            t.op_params[0], t.op_params[1] = offs & 0xFFFFFFFF, offs >> 32
        self.views.append(t)
        if node:
            self.nodes.append(t)
        return t

    # -- row ids: client-written (in range or not) or made here by ARGSORT/TOP_K ------------

    def ids(self, bound: int, ne, type_=I32) -> Tensor:
        ne = ne4(ne)
        r = self.rng.random()
        if r < 0.35 or type_ != I32 or bound <= 0:
            oob = self.rng.random() < 0.3
            self.notes.append(f"ids client {'out-of-range' if oob else 'in-range'}")
            return self.leaf(type_, ne, Fill("ids", bound, oob))
        k = max(1, ne[0])
        scores = self.leaf(F32, (bound, *ne[1:]))
        if r < 0.55 and k <= bound:
            self.notes.append("ids by TOP_K")
            return self.node(OP.TOP_K, I32, (k, *ne[1:]), [scores], [k])
        order = self.node(OP.ARGSORT, I32, (bound, *ne[1:]), [scores], [self.rng.choice((0, 1))])
        if r < 0.8:
            self.notes.append("ids view of ARGSORT")
        else:  # a strided ARGSORT result whose padding holds junk row ids
            pad = self.rng.choice((4, 8, 64, 4 * bound))
            nb1 = order.nb[1] + pad
            order.nb = (4, nb1, nb1 * ne[1], nb1 * ne[1] * ne[2])
            self.fills[order.id] = Fill("junk_ids", bound)
            self.notes.append(f"ids view of strided ARGSORT (+{pad} B rows)")
        nb = list(order.nb)
        offs = 0
        if self.rng.random() < 0.3:  # a view "a little off" the sorted rows
            which = self.rng.randrange(3)
            if which == 0:
                nb[1] += self.rng.choice((4, -4, 8))
            elif which == 1:
                offs = 4 * self.rng.randint(1, 3)
            else:
                nb[1] = 4 * k
            self.notes.append(f"ids view off: nb={nb} offs={offs}")
        return self.view(order, (k, *ne[1:]), [max(0, x) for x in nb], offs)


def floats(rng) -> int:
    return rng.choice((F32, F32, F32, F16, BF16))


def small(rng, lo=1, hi=8) -> int:
    return rng.randint(lo, hi)


def dim0(rng) -> int:
    return rng.choice((1, 2, 3, 4, 5, 7, 8, 16, 31, 32, 33, 64, 96, 128))


def shape(rng, n0=None) -> tuple[int, int, int, int]:
    return (n0 or dim0(rng), rng.choice((1, 1, 2, 3, 4, 5)), rng.choice((1, 1, 2, 3)), rng.choice((1, 1, 2)))


# -- plausible graphs, one builder per op family ---------------------------------------------------


def gen_binary(G: Gen, op):
    r = G.rng
    t, ne = floats(r), shape(r)
    small_ne = tuple(n if r.random() < 0.6 else 1 for n in ne)
    b = G.leaf(r.choice((t, F32)), small_ne)
    a = G.leaf(t, ne)
    G.node(op, t, ne, [a, b])


def gen_same(op, types=(F32,), params=lambda r: ()):
    def gen(G: Gen, _op):
        r = G.rng
        t, ne = r.choice(types), shape(r)
        a = G.leaf(t, ne)
        G.node(op, t, ne, [a], params(r))

    return gen


def fparams(*choices):
    return lambda r: [f32_bits(r.choice(c)) if isinstance(c, tuple) else c for c in choices]


EPS = (1e-6, 1e-5, 0.0, -1.0, float("nan"))


def gen_unary(G: Gen, op):
    r = G.rng
    u = r.randrange(len(UnaryOp))
    t = r.choice((F32, F16, BF16))
    out = t if r.random() < 0.8 else F32
    ne = shape(r)
    a = G.leaf(t, ne)
    G.node(OP.UNARY, out, ne, [a], [u])


def gen_glu(G: Gen, op):
    r = G.rng
    g = r.randrange(len(GluOp))
    t = r.choice((F32, F16))
    ne = shape(r, r.choice((2, 4, 8, 16, 32, 64)))
    params = [g, r.choice((0, 1)), f32_bits(1.702), f32_bits(7.0)]
    if r.random() < 0.5:
        a = G.leaf(t, ne)
        G.node(OP.GLU, t, (ne[0] // 2, *ne[1:]), [a], params)
    else:
        a, b = G.leaf(t, ne), G.leaf(t, ne)
        G.node(OP.GLU, t, ne, [a, b], params)


QUANTS = (F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K)


def gen_mul_mat(G: Gen, op):
    r = G.rng
    wt = r.choice(QUANTS)
    k = (
        256
        if TYPE_TRAITS[wt].blck_size == 256
        else r.choice((32, 64, 96))
        if TYPE_TRAITS[wt].blck_size > 1
        else dim0(r)
    )
    m, n, h, rep, b = small(r, 1, 6), small(r, 1, 5), r.choice((1, 2)), r.choice((1, 2)), r.choice((1, 1, 2))
    w = G.leaf(wt, (k, m, h, b))
    x = G.leaf(r.choice((F32, F32, F16)), (k, n, h * rep, b))
    G.node(OP.MUL_MAT, F32, (m, n, h * rep, b), [w, x], [0, 1 if r.random() < 0.05 else 0])


def gen_mul_mat_id(G: Gen, op):
    r = G.rng
    wt = r.choice((F32, F16, Q8_0, Q4_0))
    k = r.choice((32, 64)) if TYPE_TRAITS[wt].blck_size > 1 else dim0(r)
    m, n_as, n_used, tokens = small(r, 1, 5), small(r, 1, 6), small(r, 1, 3), small(r, 1, 4)
    n_used = min(n_used, n_as)
    a = G.leaf(wt, (k, m, n_as))
    b = G.leaf(F32, (k, r.choice((1, n_used)), tokens))
    ids = G.ids(n_as, (n_used, tokens))
    G.node(OP.MUL_MAT_ID, F32, (m, n_used, tokens), [a, b, ids])


def gen_get_rows(G: Gen, op):
    r = G.rng
    t = r.choice((F32, F16, BF16, Q8_0, Q4_0, I32))
    n = r.choice((32, 64)) if TYPE_TRAITS[t].blck_size > 1 else dim0(r)
    rows, k, ne2, ne3 = small(r, 1, 8), small(r, 1, 6), r.choice((1, 1, 2)), 1
    a = G.leaf(t, (n, rows, ne2, ne3))
    ids = G.ids(rows, (k, ne2, ne3))
    G.node(OP.GET_ROWS, I32 if t == I32 else F32, (n, k, ne2, ne3), [a, ids])


def gen_set_rows(G: Gen, op):
    r = G.rng
    dt = r.choice((F32, F16, BF16, Q8_0, Q4_0))
    n = r.choice((32, 64)) if TYPE_TRAITS[dt].blck_size > 1 else dim0(r)
    rows, k, ne2 = small(r, 1, 8), small(r, 1, 6), r.choice((1, 1, 2))
    dst = G.leaf(dt, (n, rows, ne2))
    b = G.leaf(r.choice((F32, F32, F16)), (n, k, ne2))
    it = I64 if r.random() < 0.4 else I32
    ids = G.ids(rows, (k, r.choice((1, ne2)) if ne2 > 1 else 1), it)
    node = G.view(dst, dst.ne, dst.nb, 0, op=OP.SET_ROWS, node=True)
    node.src = [b, ids]


def gen_copy(G: Gen, op):
    r = G.rng
    st_ = r.choice((F32, F32, F16, BF16, Q8_0, I32))
    dt = r.choice((F32, F16, BF16, Q8_0, Q4_0, Q4_K, I32)) if r.random() < 0.6 else st_
    ne = shape(r, r.choice((32, 64, 256)) if r.random() < 0.6 else None)
    a = G.leaf(st_, ne)
    n = ne[0] * ne[1] * ne[2] * ne[3]
    dne = ne
    if r.random() < 0.4:  # a reshape: same count, another row length (src0.ne0 > dst.ne0 or less)
        for d0 in (ne[0] // 2, ne[0] * 2, 32, 16, 8):
            if d0 and n % d0 == 0:
                dne = (d0, n // d0, 1, 1)
                break
    if op == OP.CPY:
        dst = G.leaf(dt, dne, Fill("normal"))
        node = G.view(dst, dst.ne, dst.nb, 0, op=OP.CPY, node=True)
        node.src = [a, dst]
    else:
        G.node(op, dt if op == OP.CONT and r.random() < 0.2 else st_, dne, [a])


def gen_rope(G: Gen, op):
    r = G.rng
    d = r.choice((8, 16, 32, 64, 128))
    heads, tokens = small(r, 1, 4), small(r, 1, 5)
    mode = r.choice((0, 0, 2, 2, 8, 24, 40))
    t = r.choice((F32, F16))
    a = G.leaf(t, (d, heads, tokens))
    npos = tokens * (4 if mode & 8 else 1)
    pos = G.leaf(I32, (npos,), Fill("ids", 4096))
    srcs = [a, pos]
    n_dims = d // 2 if mode == 24 else r.choice((d, d, d // 2))
    if r.random() < 0.3:
        srcs.append(G.leaf(F32, (max(1, n_dims // 2),)))
    p = [0] * 16
    p[1], p[2], p[4] = n_dims, mode, 4096
    for i, v in zip(range(5, 11), (10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)):
        p[i] = f32_bits(v)
    if mode & 8:
        p[11:15] = [max(1, n_dims // 8)] * 3 + [0]
    G.node(op, t, (d, heads, tokens), srcs, p)


def gen_soft_max(G: Gen, op):
    r = G.rng
    ne = shape(r)
    a = G.leaf(F32, ne)
    srcs = [a]
    if r.random() < 0.6:
        srcs.append(G.leaf(r.choice((F16, F32)), (ne[0], ne[1] + r.choice((0, 0, 3)), 1, 1)))
        if r.random() < 0.3:
            srcs.append(G.leaf(F32, (ne[2],)))
    G.node(OP.SOFT_MAX, F32, ne, srcs, [f32_bits(r.choice((1.0, 0.125))), f32_bits(r.choice((0.0, 8.0)))])


def gen_flash_attn(G: Gen, op):
    r = G.rng
    d, dv = r.choice((32, 64, 128)), None
    dv = d if r.random() < 0.8 else r.choice((32, 64))
    nq, nkv, h, hkv = r.choice((1, 1, 2, 3, 7)), r.choice((1, 4, 16, 33)), r.choice((1, 2, 4)), 1
    hkv = r.choice([x for x in (1, 2, 4) if h % x == 0])
    kt = r.choice((F16, F16, F32, Q8_0))
    q = G.leaf(F32, (d, nq, h, 1))
    k = G.leaf(kt, (d, nkv, hkv, 1))
    v = G.leaf(r.choice((F16, F32)) if kt != Q8_0 else kt, (dv, nkv, hkv, 1))
    srcs = [q, k, v]
    if r.random() < 0.7:
        srcs.append(G.leaf(F16, (nkv, nq + r.choice((0, 0, 5)), 1, 1)))
        if r.random() < 0.3:
            srcs.append(G.leaf(F32, (h,)))
    G.node(
        OP.FLASH_ATTN_EXT,
        F32,
        (dv, h, nq, 1),
        srcs,
        [f32_bits(d**-0.5), f32_bits(0.0), f32_bits(r.choice((0.0, 30.0))), r.choice((0, 10))],
    )


def gen_reduce(G: Gen, op):
    r = G.rng
    ne = shape(r)
    a = G.leaf(F32, ne)
    if op == OP.ARGMAX:
        a.ne, a.nb = (ne[0], ne[1], 1, 1), contiguous_strides(F32, (ne[0], ne[1], 1, 1))
        G.node(op, I32, (ne[1],), [a])
    elif op == OP.SUM:
        t = r.choice((F32, F16, BF16))
        a.type, a.nb = t, contiguous_strides(t, ne)
        G.node(op, t, (1,), [a])
    elif op == OP.CUMSUM:
        G.node(op, F32, ne, [a])
    else:
        G.node(op, F32, (1, *ne[1:]), [a])


def gen_sort(G: Gen, op):
    r = G.rng
    ne = shape(r)
    a = G.leaf(F32, ne)
    if op == OP.ARGSORT:
        G.node(op, I32, ne, [a], [r.choice((0, 1))])
    else:
        k = r.randint(1, ne[0])
        G.node(op, I32, (k, *ne[1:]), [a], [k])


def gen_concat(G: Gen, op):
    r = G.rng
    t = r.choice((F32, F16, I32, Q8_0))
    dim = r.randrange(4)
    ne = list(shape(r, 32 if TYPE_TRAITS[t].blck_size > 1 else None))
    ne2 = list(ne)
    ne2[dim] = r.choice((1, 2, 3)) * (32 if dim == 0 and TYPE_TRAITS[t].blck_size > 1 else 1)
    a, b = G.leaf(t, ne), G.leaf(t, ne2)
    out = [ne[i] + ne2[i] if i == dim else ne[i] for i in range(4)]
    G.node(op, t, out, [a, b], [dim])


def gen_pad(G: Gen, op):
    r = G.rng
    ne = shape(r)
    pads = [r.choice((0, 0, 1, 2)) for _ in range(8)]
    a = G.leaf(F32, ne)
    G.node(
        op, F32, [ne[i] + pads[2 * i] + pads[2 * i + 1] for i in range(4)], [a], pads + [r.choice((0, 0, 1))]
    )


def gen_add_id(G: Gen, op):
    r = G.rng
    n, n_used, tokens, n_exp = dim0(r), small(r, 1, 3), small(r, 1, 4), small(r, 1, 6)
    a = G.leaf(F32, (n, n_used, tokens))
    b = G.leaf(F32, (n, n_exp))
    ids = G.ids(n_exp, (n_used, tokens))
    G.node(op, F32, (n, n_used, tokens), [a, b, ids])


def gen_repeat(G: Gen, op):
    r = G.rng
    t = r.choice((F32, F16, I32))
    ne = shape(r)
    big = [n * r.choice((1, 1, 2, 3)) for n in ne]
    a = G.leaf(t, ne)
    G.node(op, t, big, [a])


def gen_arange(G: Gen, op):
    r = G.rng
    start, step = r.choice((0.0, 1.0, -3.0)), r.choice((1.0, 0.5, 2.0))
    n = small(r, 1, 64)
    G.node(op, F32, (n,), [], [f32_bits(start), f32_bits(start + n * step), f32_bits(step)])


def gen_set_acc(G: Gen, op):
    r = G.rng
    t = F32 if op == OP.ACC else r.choice((F32, I32))
    ne = shape(r)
    a = G.leaf(t, ne)
    bne = [max(1, n - r.choice((0, 1))) for n in ne]
    b = G.leaf(t, bne)
    nb = contiguous_strides(t, ne4(ne))
    offs = r.choice((0, 4, nb[1]))
    G.node(op, t, ne, [a, b], [nb[1], nb[2], nb[3], offs, r.choice((0, 1))])


def gen_group_norm(G: Gen, op):
    r = G.rng
    ne = shape(r)
    a = G.leaf(F32, ne)
    G.node(op, F32, ne, [a], [r.choice((1, 2, 4, 32)), f32_bits(1e-6)])


def gen_metadata(G: Gen, op):
    # a view of a leaf, then a node that reads it (CONT walks any strides)
    r = G.rng
    ne = shape(r)
    a = G.leaf(F32, ne)
    if op == OP.TRANSPOSE:
        v = G.view(a, (ne[1], ne[0], ne[2], ne[3]), (a.nb[1], a.nb[0], a.nb[2], a.nb[3]), 0, op)
    elif op == OP.PERMUTE:
        perm = r.sample(range(4), 4)
        v = G.view(a, [ne[p] for p in perm], [a.nb[p] for p in perm], 0, op)
    else:
        v = G.view(a, a.ne, a.nb, 0, op)
    G.nodes.append(v)
    G.node(OP.CONT, F32, v.ne, [v])


GENERATORS = {
    **{o: gen_binary for o in (OP.ADD, OP.SUB, OP.MUL, OP.DIV)},
    OP.SCALE: gen_same(OP.SCALE, (F32, BF16), fparams((0.5, 2.0, -1.0), (0.0, 1.0))),
    OP.RMS_NORM: gen_same(OP.RMS_NORM, (F32,), fparams(EPS)),
    OP.NORM: gen_same(OP.NORM, (F32,), fparams(EPS)),
    OP.L2_NORM: gen_same(OP.L2_NORM, (F32,), fparams(EPS)),
    OP.UNARY: gen_unary,
    OP.GLU: gen_glu,
    OP.MUL_MAT: gen_mul_mat,
    OP.MUL_MAT_ID: gen_mul_mat_id,
    OP.GET_ROWS: gen_get_rows,
    OP.SET_ROWS: gen_set_rows,
    **{o: gen_copy for o in (OP.CPY, OP.DUP, OP.CONT)},
    OP.ROPE: gen_rope,
    OP.ROPE_BACK: gen_rope,
    OP.SOFT_MAX: gen_soft_max,
    OP.FLASH_ATTN_EXT: gen_flash_attn,
    OP.CLAMP: gen_same(OP.CLAMP, (F32, F16), fparams((-1.0, 0.0), (1.0, 6.0))),
    **{o: gen_reduce for o in (OP.MEAN, OP.ARGMAX, OP.SUM_ROWS, OP.SUM, OP.CUMSUM)},
    OP.CONCAT: gen_concat,
    OP.PAD: gen_pad,
    OP.ADD_ID: gen_add_id,
    OP.ARGSORT: gen_sort,
    OP.TOP_K: gen_sort,
    **{o: gen_same(o, (F32, F16, BF16)) for o in (OP.SQR, OP.SQRT, OP.LOG, OP.SIN, OP.COS)},
    OP.LEAKY_RELU: gen_same(OP.LEAKY_RELU, (F32, F16), fparams((0.01, 0.1))),
    OP.REPEAT: gen_repeat,
    OP.FILL: gen_same(OP.FILL, (F32, F16), fparams((0.0, 1.5))),
    OP.ARANGE: gen_arange,
    OP.SET: gen_set_acc,
    OP.ACC: gen_set_acc,
    OP.GROUP_NORM: gen_group_norm,
    **{o: gen_metadata for o in (OP.NONE, OP.RESHAPE, OP.VIEW, OP.PERMUTE, OP.TRANSPOSE)},
}


# -- mutations "a little off" ---------------------------------------------------------------------


def all_tensors(G: Gen) -> list[Tensor]:
    seen, out = set(), []
    for t in [*G.roots, *G.views, *G.nodes]:
        if t.id not in seen:
            seen.add(t.id)
            out.append(t)
    return out


def restride(t: Tensor) -> None:
    t.nb = contiguous_strides(t.type, t.ne)


def m_shape(G: Gen, t: Tensor) -> str:
    r = G.rng
    ne = list(t.ne)
    i = r.randrange(4)
    how = r.randrange(4)
    if how == 0:
        ne[i] = max(0 if r.random() < 0.1 else 1, ne[i] + r.choice((-1, 1)))
    elif how == 1:
        ne[0] = ne[0] | 1  # odd ne0
    elif how == 2:
        ne[i] = 1
    else:
        ne[i] = ne[i] * 2
    t.ne = tuple(ne)
    restride(t)
    return f"shape {list(t.ne)}"


def m_coherent(G: Gen, t: Tensor) -> str:
    """One dim changed on every tensor of the node's shape at once (odd ne0, one more row, a
    size-1 dim): the graph stays plausible, only "a little off"."""
    r = G.rng
    i = r.choice((0, 0, 1, 2, 3))
    old = t.ne
    new = list(old)
    new[i] = r.choice((old[i] | 1, old[i] + 1, max(1, old[i] - 1), 1, old[i] * 2))
    n = 0
    for u in all_tensors(G):
        if u.ne == old:
            u.ne = tuple(new)
            if u.view_src is None or u.op in (OP.CPY, OP.SET_ROWS):
                restride(u)
            n += 1
    return f"ne {list(old)} -> {new} on {n} tensors"


def m_layout(G: Gen, t: Tensor) -> str:
    r = G.rng
    ne, nb = list(t.ne), list(t.nb)
    how = r.randrange(7)
    if how == 0:  # padded rows
        extra = r.choice((4, 8, 32, 64, 256))
        nb[1] += extra
        nb[2] = max(nb[2], nb[1] * ne[1])
        nb[3] = max(nb[3], nb[2] * ne[2])
        return _set(t, nb, f"padded rows nb={nb}")
    if how == 1:  # a big stride on a size-1 dim (the extent ignores it)
        i = r.choice([j for j in (1, 2, 3) if ne[j] == 1] or [1])
        if ne[i] != 1:
            ne[i] = 1
            t.ne = tuple(ne)
            nb = list(contiguous_strides(t.type, t.ne))
        nb[i] = r.choice((1 << 16, 1 << 20, 1 << 24, nb[i] * 64 + 4, 0x7FFFFFFF))
        return _set(t, nb, f"ne={ne} big nb[{i}]={nb[i]}")
    if how == 2:  # stride 0 (broadcast) on one dim
        i = 1 if r.random() < 0.5 else r.randrange(2, 4) if r.random() < 0.8 else 0
        nb[i] = 0
        return _set(t, nb, f"stride 0 nb={nb}")
    if how == 3:  # reversed strides: dims walked outermost-first
        full = contiguous_strides(t.type, tuple(reversed(ne)))
        return _set(t, list(reversed(full)), f"reversed nb={list(reversed(full))}")
    if how == 4:  # permuted: two dims swap strides
        i, j = r.sample(range(4), 2)
        nb[i], nb[j] = nb[j], nb[i]
        return _set(t, nb, f"permuted nb={nb}")
    if how == 5:  # nb[1] on a size-1 dim with ne[2] > 1 (rows flattened by a kernel)
        if ne[1] != 1 or ne[2] * ne[3] == 1:
            ne = [ne[0], 1, max(2, ne[1]), min(ne[2] * ne[3], 4)]
            t.ne = tuple(ne)
            nb = list(contiguous_strides(t.type, t.ne))
        nb[1] = r.choice((nb[1] * 2, nb[1] * 16, 1 << 20, 0x10000000))
        return _set(t, nb, f"ne={ne} nb[1]={nb[1]} on a size-1 dim")
    nb[0] = r.choice((nb[0] * 2, 0, nb[0] + 1))  # element stride off
    return _set(t, nb, f"nb0={nb[0]}")


def _set(t: Tensor, nb, note: str) -> str:
    t.nb = tuple(int(max(0, min(x, 0xFFFFFFFF))) for x in nb)
    return note


TYPES = (F32, F16, BF16, I32, I64, Q8_0, Q4_0, Q4_K, GgmlType.I8, GgmlType.F64)


def m_type(G: Gen, t: Tensor) -> str:
    t.type = int(G.rng.choice(TYPES))
    if G.rng.random() < 0.7:
        restride(t)
    return f"type {GgmlType(t.type).name}"


def m_params(G: Gen, t: Tensor) -> str:
    r = G.rng
    i = r.randrange(16) if r.random() < 0.3 else r.randrange(4)
    t.op_params[i] = r.choice(
        (
            0,
            1,
            -1,
            2,
            3,
            7,
            64,
            1 << 30,
            -(1 << 31),
            f32_bits(float("nan")),
            f32_bits(-0.0),
            f32_bits(1e30),
            t.op_params[i] + 1,
            t.op_params[i] ^ 1,
        )
    )
    return f"op_params[{i}]={t.op_params[i]}"


def m_srcs(G: Gen, t: Tensor) -> str:
    r = G.rng
    if t.src and r.random() < 0.5:
        t.src = t.src[:-1]
        return f"dropped src{len(t.src)}"
    extra = G.leaf(r.choice((F32, F16, I32)), shape(r))
    t.src = list(t.src) + [extra]
    return f"added src{len(t.src) - 1}"


def m_flags(G: Gen, t: Tensor) -> str:
    t.flags = G.rng.choice((0, 2, 16 | 2))  # serialize() adds COMPUTE to nodes
    return f"flags {t.flags}"


MUTATIONS = (
    (m_shape, 2),
    (m_coherent, 2),
    (m_layout, 5),
    (m_type, 1),
    (m_params, 2),
    (m_srcs, 1),
    (m_flags, 0.3),
)


def mutate(G: Gen) -> list[str]:
    r = G.rng
    n = r.choice((0, 1, 1, 1, 2, 2, 3))
    notes = []
    fns, weights = zip(*MUTATIONS)
    for _ in range(n):
        fn = r.choices(fns, weights)[0]
        pool = G.nodes if r.random() < 0.5 else all_tensors(G)
        t = r.choice(pool)
        notes.append(f"{fn.__name__[2:]} {'node' if t in G.nodes else 'tensor'} {OP(t.op).name}: " + fn(G, t))
    return notes


# -- the case: layout in a buffer, bytes, the wire graph ----------------------------------------


@dataclass
class Case:
    seed: int
    op: str
    notes: list[str]
    size: int  # X's size
    gen: Gen
    placement: str = ""


def build_case(seed: int) -> Case:
    rng = random.Random(seed)
    op = op_of(seed)
    G = Gen(rng)
    GENERATORS[op](G, op)
    notes = list(G.notes) + mutate(G)
    # ids from the case alone (GraphBuilder's counter is process-wide): replays match log lines
    fills = {}
    for i, t in enumerate(all_tensors(G)):
        if t.id in G.fills:
            fills[0x1000 + 0x40 * i] = G.fills[t.id]
        t.id = 0x1000 + 0x40 * i
    G.fills = fills
    # placement: packed one after another (32-aligned); one tensor flush with the end; sometimes
    # a node in place over its src0
    offsets: dict[int, int] = {}
    end = 0
    flush = None
    if rng.random() < 0.6:
        flush = rng.choice(G.nodes if rng.random() < 0.7 else G.roots)
        flush = flush.view_src or flush
    inplace = rng.random() < 0.1
    for t in G.roots:
        if t is flush:
            continue
        if inplace and t in G.nodes and t.src and t.src[0].view_src is None and t.src[0].id in offsets:
            offsets[t.id] = offsets[t.src[0].id]
            notes.append(f"{OP(t.op).name} in place over src0")
            inplace = False
            continue
        offsets[t.id] = end
        end += (max(nbytes(t.type, t.ne, t.nb), 1) + 31) // 32 * 32
    fsize = max(nbytes(flush.type, flush.ne, flush.nb), 0) if flush is not None else 0
    size = (end + fsize + PAGE - 1) // PAGE * PAGE or PAGE
    size = min(size, MAX_BUFFER)
    if flush is not None:
        offsets[flush.id] = max(0, size - fsize)
        notes.append(f"{OP(flush.op).name} flush with the buffer's end")
    case = Case(seed, op.name, notes, size, G)
    case.offsets = offsets  # type: ignore[attr-defined]
    return case


def place(case: Case, handle: int, base: int) -> None:
    G = case.gen
    for t in G.roots:
        t.buffer, t.data = handle, base + case.offsets[t.id]  # type: ignore[attr-defined]
    for v in G.views:
        v.buffer, v.data = handle, v.view_src.data + v.view_offs


def fill_bytes(rng: np.random.Generator, t: Tensor, fill: Fill, n: int) -> bytes:
    if t.type in (I32, I64) and fill.kind in ("ids", "junk_ids"):
        dt = np.int32 if t.type == I32 else np.int64
        hi = max(fill.bound, 1)
        v = rng.integers(0, hi, n // np.dtype(dt).itemsize + 1).astype(dt)
        if fill.kind == "junk_ids" or fill.oob:
            k = max(1, len(v) // 8) if fill.oob else len(v)
            idx = rng.integers(0, len(v), k)
            v[idx] = rng.choice(np.array([hi, hi + 1, -1, 1 << 20, -(1 << 30)], dt), k)
        return v.tobytes()[:n]
    if t.type == F32:
        return rng.standard_normal(n // 4 + 1).astype(np.float32).tobytes()[:n]
    if t.type == F16:
        return rng.standard_normal(n // 2 + 1).astype(np.float16).tobytes()[:n]
    if t.type == BF16:
        f = rng.standard_normal(n // 2 + 1).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).tobytes()[:n]
    if t.type in (I32, I64, GgmlType.I8, GgmlType.I16):
        return rng.integers(0, 8, n, dtype=np.uint8).tobytes()
    if t.type in (Q8_0, Q4_0):  # blocks with a sane f16 scale in front
        tr = TYPE_TRAITS[t.type]
        raw = bytearray(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
        for off in range(0, n - 1, tr.type_size):
            raw[off : off + 2] = np.float16(rng.uniform(0.001, 0.1)).tobytes()
        return bytes(raw)
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


def write_plan(case: Case, base: int, again: bool = False) -> list[tuple[int, bytes]]:
    """(offset in X, bytes) the client writes before the compute: every leaf's footprint, and
    junk in the strided ARGSORT results' padding. `again`: other bytes for the same leaves,
    before a GRAPH_RECOMPUTE, with row ids out of range in half the cases (the worker checks
    them again, in C, on every run)."""
    rng = np.random.default_rng(case.seed ^ 0x5EED if again else case.seed)
    hostile = again and case.seed % 2 == 1
    out = []
    for t in case.gen.roots:
        fill = case.gen.fills.get(t.id)
        if fill is None:
            continue
        if hostile and fill.kind == "ids":
            fill = dataclasses.replace(fill, oob=True)
        off = t.data - base
        n = min(nbytes(t.type, t.ne, t.nb), case.size - off)
        if n > 0:
            out.append((off, fill_bytes(rng, t, fill, n)))
    return out


def computed_extents(case: Case, base: int) -> list[tuple[int, int]]:
    """[lo, hi) offsets in X each computed node may write: ggml_nbytes from its data."""
    out = []
    for t in case.gen.nodes:
        if t.op in METADATA_OPS:
            continue
        if not (t.flags & 16):
            continue
        n = nbytes(t.type, t.ne, t.nb) if t.type in TYPE_TRAITS else 0
        if n > 0:
            out.append((t.data - base, t.data - base + n))
    return out


def canary(seed: int, n: int) -> bytes:
    pat = bytes(np.random.default_rng(seed ^ 0xC0FFEE).integers(1, 255, 16, dtype=np.uint8))
    return (pat * (n // 16 + 1))[:n]


# -- the daemon -------------------------------------------------------------------------------------


class Daemon:
    """`python -m fleetd.server` on a free loopback port, stderr into a log file we tail."""

    def __init__(self, log_dir: Path | None = None, threads: int = 2, python: str | None = None):
        self.log_dir = Path(log_dir or os.environ.get("TMPDIR", "/tmp"))
        self.threads, self.python = threads, python or sys.executable
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.starts = 0
        self.log_path: Path | None = None
        self._log_pos = 0

    def start(self) -> None:
        from fleetd.transport import free_port, wait_listening

        self.port = free_port()
        self.starts += 1
        self.log_path = self.log_dir / f"fleetd-graph-fuzz-{os.getpid()}-{self.port}.log"
        # GGML_NO_BACKTRACE: an abort exits at once instead of attaching gdb for a backtrace
        # (which can take longer than READ_S on a loaded machine and look like a hang)
        env = dict(
            os.environ,
            PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            GGML_NO_BACKTRACE="1",
        )
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    self.python,
                    "-m",
                    "fleetd.server",
                    "-H",
                    "127.0.0.1",
                    "-p",
                    str(self.port),
                    "-d",
                    "cpu",
                    "--control-port",
                    "0",
                    "-t",
                    str(self.threads),
                    "--log-level",
                    "info",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(REPO),
            )
        self._log_pos = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fleetd exited at start: {self.log_tail()}")
            try:
                wait_listening(self.port, timeout=1.0)
                break
            except Exception:
                continue
        else:
            raise RuntimeError(f"fleetd did not listen within 60s: {self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> Daemon:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def alive(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            with RpcClient(self.endpoint, Timeout(connect=5.0, read=5.0)) as c:
                c.device_count()
            return True
        except (FleetdError, OSError):
            return False

    def exit_status(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def new_log(self) -> str:
        """Log text written since the last call."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_pos)
                data = f.read()
        except OSError:
            return ""
        self._log_pos += len(data)
        return data.decode(errors="replace")


# -- one case over the wire ----------------------------------------------------------------------


@dataclass
class Result:
    seed: int
    op: str
    outcome: str
    corruptions: list[str] = field(default_factory=list)
    log: str = ""  # the daemon's line about this case's session (refusal, failure)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    step: str = ""  # a hang: the step that got no answer
    stacks: str = ""  # a hang: where each thread of the daemon and its workers waited

    @property
    def finding(self) -> bool:
        return self.outcome in ("worker_death", "hang", "daemon_death") or bool(self.corruptions)


def client(d: Daemon) -> RpcClient:
    return RpcClient(d.endpoint, Timeout(connect=5.0, read=READ_S))


def set_whole(c: RpcClient, handle: int, base: int, data: bytes) -> None:
    t = RpcTensor(
        id=1,
        type=GgmlType.I8,
        buffer=handle,
        ne=(len(data), 1, 1, 1),
        nb=(1, len(data), len(data), len(data)),
        op=0,
        op_params=(0,) * 16,
        flags=0,
        src=(0,) * 10,
        view_src=0,
        view_offs=0,
        data=base,
        name=b"",
        use_count=0,
    )
    c.set_tensor(t, data)


def get_whole(c: RpcClient, handle: int, base: int, size: int) -> bytes:
    t = RpcTensor(
        id=1,
        type=GgmlType.I8,
        buffer=handle,
        ne=(size, 1, 1, 1),
        nb=(1, size, size, size),
        op=0,
        op_params=(0,) * 16,
        flags=0,
        src=(0,) * 10,
        view_src=0,
        view_offs=0,
        data=base,
        name=b"",
        use_count=0,
    )
    return bytes(c.get_tensor(t, 0, size))


def diff_spans(
    got: bytes, want: bytes, allowed: list[tuple[int, int]], limit: int = 4
) -> list[tuple[int, int]]:
    a = np.frombuffer(got, np.uint8)
    b = np.frombuffer(want, np.uint8)
    bad = a != b
    for lo, hi in allowed:
        bad[max(0, lo) : max(0, hi)] = False
    idx = np.flatnonzero(bad)
    if not len(idx):
        return []
    spans, start, prev = [], int(idx[0]), int(idx[0])
    for i in idx[1:]:
        i = int(i)
        if i != prev + 1:
            spans.append((start, prev + 1))
            start = i
        prev = i
    spans.append((start, prev + 1))
    return spans[:limit] + ([(-1, len(spans))] if len(spans) > limit else [])


def fmt_spans(where: str, spans, size: int) -> str:
    parts = [f"[{lo:#x},{hi:#x})" if lo >= 0 else f"... {hi} spans" for lo, hi in spans]
    return f"{where} (size {size:#x}) changed at " + " ".join(parts)


def session_line(text: str, port: int) -> str:
    pat = re.compile(rf"session \d+ 127\.0\.0\.1:{port}: (.*)")
    lines = [m.group(1) for m in pat.finditer(text) if "accepted" not in m.group(1)]
    return lines[-1] if lines else ""


def classify_close(line: str) -> str:
    if not line:
        return "worker_death"
    if "graph failed" in line:
        return "refused" if any(m in line for m in REFUSAL_MARKERS) else "worker_death"
    if "internal error" in line:
        return "worker_death"
    return "refused" if ("closed" in line or "refused" in line) else "worker_death"


def run_case(d: Daemon, seed: int) -> Result:
    t0 = time.monotonic()
    case = build_case(seed)
    res = Result(seed, case.op, "computed", notes=case.notes)
    d.new_log()
    victim = fuzzed = None
    step = "set-up"
    try:
        victim = client(d).open()
        hi_h, _ = victim.alloc_buffer(VICTIM_SIZE)
        fuzzed = client(d).open()
        port = fuzzed.sock.getsockname()[1]
        x_h, x_size = fuzzed.alloc_buffer(case.size)
        lo_h, _ = victim.alloc_buffer(VICTIM_SIZE)
        if not (x_h and hi_h and lo_h):
            raise RuntimeError(f"ALLOC_BUFFER failed ({case.size} bytes)")
        hi_b, lo_b = victim.buffer_get_base(hi_h), victim.buffer_get_base(lo_h)
        x_b = fuzzed.buffer_get_base(x_h)
        vcanary = canary(seed + 1, VICTIM_SIZE)
        set_whole(victim, hi_h, hi_b, vcanary)
        set_whole(victim, lo_h, lo_b, vcanary)
        victim.sync()
        place(case, x_h, x_b)
        image = bytearray(canary(seed, case.size))
        for off, data in write_plan(case, x_b):
            image[off : off + len(data)] = data
        set_whole(fuzzed, x_h, x_b, bytes(image))
        graph = case.gen.g.serialize(case.gen.nodes)
        step = "GRAPH_COMPUTE"
        fuzzed.graph_compute(graph)
        got = _computed(res, fuzzed, case, x_h, x_b, bytes(image), "")
        if res.outcome == "computed" and got is not None:
            # the stored graph again over new input bytes: the worker's C loop runs it
            image = bytearray(got)
            for off, data in write_plan(case, x_b, again=True):
                image[off : off + len(data)] = data
            step = "SET_TENSOR before GRAPH_RECOMPUTE"
            set_whole(fuzzed, x_h, x_b, bytes(image))
            step = "GRAPH_RECOMPUTE"
            fuzzed.graph_recompute(0)
            _computed(res, fuzzed, case, x_h, x_b, bytes(image), " (recompute)")
        if res.outcome == "hang":
            res.step, res.stacks = step, process_stacks(d)
        if res.outcome == "hang" and d.proc is not None:
            try:  # a daemon dying slowly is a death, not a hang
                d.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        if res.outcome in ("closed", "hang"):
            if d.exit_status() is not None or not d.alive():
                res.outcome = "daemon_death"
                res.log = death_log(d)
            elif res.outcome == "closed":
                deadline = time.monotonic() + LOG_WAIT_S
                text = ""
                while True:
                    text += d.new_log()
                    line = session_line(text, port)
                    if line or time.monotonic() > deadline:
                        break
                    time.sleep(0.02)
                res.log = line
                res.outcome = classify_close(line)
        if res.outcome != "daemon_death":
            for name, h, b in (
                ("other session's buffer after X", hi_h, hi_b),
                ("other session's buffer before X", lo_h, lo_b),
            ):
                got = get_whole(victim, h, b, VICTIM_SIZE)
                spans = diff_spans(got, vcanary, [])
                if spans:
                    res.corruptions.append(fmt_spans(name, spans, VICTIM_SIZE))
    except (FleetdError, OSError, RuntimeError) as exc:
        if d.exit_status() is not None or not d.alive():
            res.outcome = "daemon_death"
            res.log = death_log(d)
        else:
            res.outcome = "hang" if "timed out" in str(exc) else "worker_death"
            res.log = f"harness: {type(exc).__name__}: {exc}"
            if res.outcome == "hang":
                res.step, res.stacks = step, process_stacks(d)
    finally:
        for c in (fuzzed, victim):
            if c is not None:
                c.close()
    if res.outcome == "hang" and not res.log:
        res.log = f"no answer within {READ_S:g}s; log: {last_lines(d.new_log())}"
    if res.outcome in ("daemon_death", "hang"):  # a hung compute holds the execution lock
        d.restart()
    res.seconds = round(time.monotonic() - t0, 3)
    return res


def _computed(res: Result, fuzzed: RpcClient, case: Case, x_h: int, x_b: int, image: bytes, phase: str):
    """After a compute: X read back and compared with `image` outside the computed extents (its
    bytes), or res.outcome set to hang / closed (None)."""
    try:
        fuzzed.sync()
        got = get_whole(fuzzed, x_h, x_b, case.size)
    except TimeoutError:
        res.outcome = "hang"
        return None
    except (FleetdError, OSError) as exc:
        timed_out = isinstance(exc.__cause__, socket.timeout) or "timed out" in str(exc)
        res.outcome = "hang" if timed_out else "closed"
        return None
    spans = diff_spans(got, image, computed_extents(case, x_b))
    if spans:
        res.corruptions.append(fmt_spans(f"own buffer outside the nodes' extents{phase}", spans, case.size))
    return got


def process_stacks(d: Daemon) -> str:
    """Where every thread of the daemon and of its children (fork server, workers) waits: a
    hang's evidence, read from /proc before the harness closes anything."""
    if d.proc is None:
        return ""
    out, tree = [], process_tree(d.proc.pid)
    for pid in tree:
        for task in sorted(Path(f"/proc/{pid}/task").glob("*"), key=lambda p: int(p.name)):
            try:
                comm = (task / "comm").read_text().strip()
                state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                wchan = (task / "wchan").read_text().strip() or "-"
                syscall = (task / "syscall").read_text().split()[0]
            except (OSError, IndexError):
                continue
            out.append(f"{pid}/{task.name} {comm} {state} {wchan} syscall={syscall}")
    # and their Python stacks: fleetd and its workers dump them on SIGUSR1 (faulthandler)
    size = d.log_path.stat().st_size if d.log_path and d.log_path.exists() else 0
    for pid in tree:
        try:
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            pass
    time.sleep(0.5)
    try:
        with open(d.log_path, "rb") as f:
            f.seek(size)
            dumps = f.read(20000).decode(errors="replace")
    except (OSError, TypeError):
        dumps = ""
    return " | ".join(out) + "\n" + dumps


def death_log(d: Daemon) -> str:
    """Why the daemon died: its exit status and ggml's assert line (or the log's last lines)."""
    if d.proc is not None:
        try:
            d.proc.wait(5)  # let it finish writing its backtrace
        except subprocess.TimeoutExpired:
            pass
    text = d.new_log()
    why = [
        ln
        for ln in text.splitlines()
        if re.search(r"GGML_ASSERT|GGML_ABORT|ggml.*: error|Fatal|Segmentation", ln)
    ]
    return f"exit status {d.exit_status()}: " + (why[0].strip()[:400] if why else last_lines(text))


def last_lines(text: str, n: int = 3) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:])[-600:]


def run_cases(d: Daemon, seeds, seconds: float | None = None, on_result=None) -> list[Result]:
    """Run seeds in order until they or `seconds` run out (the seed list bounds the count)."""
    deadline = time.monotonic() + seconds if seconds else None
    out = []
    for seed in seeds:
        if deadline is not None and time.monotonic() > deadline:
            break
        r = run_case(d, seed)
        out.append(r)
        if on_result is not None:
            on_result(r)
    return out


# -- summaries -----------------------------------------------------------------------------------


COLUMNS = ("cases", "computed", "refused", "worker_death", "hang", "daemon_death", "corruptions")


def table(results: list[Result]) -> dict[str, Counter]:
    rows: dict[str, Counter] = {}
    for r in results:
        row = rows.setdefault(r.op, Counter())
        row["cases"] += 1
        row[r.outcome] += 1
        row["corruptions"] += bool(r.corruptions)
    return rows


def format_table(results: list[Result]) -> str:
    rows = table(results)
    total = Counter()
    for row in rows.values():
        total.update(row)
    head = f"{'op':<16}" + "".join(f"{c:>13}" for c in COLUMNS)
    lines = [head, "-" * len(head)]
    for op in sorted(rows, key=lambda o: FUZZ_OPS.index(GgmlOp[o])):
        lines.append(f"{op:<16}" + "".join(f"{rows[op][c]:>13}" for c in COLUMNS))
    lines.append("-" * len(head))
    lines.append(f"{'total':<16}" + "".join(f"{total[c]:>13}" for c in COLUMNS))
    return "\n".join(lines)


def describe(r: Result) -> str:
    what = r.outcome if r.outcome != "computed" else "corruption"
    if r.corruptions and r.outcome != "computed":
        what += " + corruption"
    detail = "; ".join(r.corruptions) or r.log
    if r.step:
        detail += f"; no answer after {r.step}; threads: {r.stacks}"
    return f"seed {r.seed} {r.op}: {what}: {detail} [{'; '.join(r.notes)}]"


def to_json(results: list[Result]) -> dict:
    return {
        "ops": {op: dict(row) for op, row in table(results).items()},
        "findings": [asdict(r) for r in results if r.finding],
        "cases": len(results),
    }


def dump_json(results: list[Result], path: str) -> None:
    Path(path).write_text(json.dumps(to_json(results), indent=1))
