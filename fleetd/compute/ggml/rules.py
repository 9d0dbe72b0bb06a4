"""What ggml's graph-building functions would have checked, checked before ggml's CPU kernels run.

A node from the wire reaches the kernel without `ggml_mul_mat()` & co. having looked at it. The
kernels then either stop the process (`GGML_ASSERT`, `GGML_ABORT` on a type they lack) or, worse,
trust the shapes (MUL_MAT with src0.ne0 != src1.ne0 reads past its input). One rule per op, next
to the op, mirrors the builder's asserts and the kernel's own; a node whose op has no rule is
refused. What each kernel addresses is one description, `Touch`: per tensor its rows, at
i1*nb1 + i2*nb2 + i3*nb3 or (FLAT, e.g. SCALE, CLAMP, ARGSORT, TOP_K, GLU, flash attention's
result) as one flat list at r * nb1 over all ne1*ne2*ne3 rows, size-1 dims included, and the
bytes addressed per row. check_node refuses a node when any touch ends past the tensor's
ggml_nbytes, the extent the device checked against the tensor's buffer; a rule names a touch
where its kernel differs from the default (ROPE's pairs, flash attention's nb1-byte rows).

Index tensors (GET_ROWS, SET_ROWS, MUL_MAT_ID) are the one data-dependent case: the kernels assert
every index is in range. A rule names them with `needs_indices`; the device checks their values
on the private copy the kernel reads, before every compute, unless an ARGSORT/TOP_K of this
graph wrote every byte of them (`made_by`: that packed tensor or a view on its element grid).
A kernel that reads past a view and uses only the view's part (ROPE's freq factors) names it
with `PaddedRead`: the device hands it a padded private copy.

Where a kernel computes a case right, the rule takes it even when ggml's builder never makes it
(test-backend-ops compares with those kernels); where ggml's own assert lets a kernel write past
a view (SET's last element), the rule is the stricter one.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fleetd.errors import UnsupportedOp
from fleetd.wire import TYPE_TRAITS, GgmlOp, GgmlType, RpcTensor
from fleetd.wire.ggml import GluOp, UnaryOp, contiguous_strides, op_name, row_size, type_name

F32, F16, BF16, I32, I64 = GgmlType.F32, GgmlType.F16, GgmlType.BF16, GgmlType.I32, GgmlType.I64
FLOATS = frozenset({F32, F16, BF16})
MAX_ELEMENTS = 1 << 40


@dataclass(frozen=True, slots=True)
class TypeCaps:
    """What libggml-cpu can do with each type, read from the loaded library's type traits."""

    vec_dot: frozenset[int]  # types MUL_MAT takes as src0
    vec_dot_type: dict[int, int]  # the type src1 is converted to for that dot product
    from_float: frozenset[int]  # types CPY/SET_ROWS can write from f32
    to_float: frozenset[int]  # types GET_ROWS / flash attention can read back


@dataclass(frozen=True, slots=True)
class IndexUse:
    """`index` holds row numbers that the kernel asserts are in [0, bound)."""

    index: RpcTensor
    bound: int


@dataclass(frozen=True, slots=True)
class PaddedRead:
    """The kernel reads `nbytes` from `tensor`'s start, more than its view holds, and uses only
    the view's part: it gets a private copy of the view padded to that size."""

    tensor: RpcTensor
    nbytes: int


@dataclass(frozen=True, slots=True)
class Touch:
    """The bytes a kernel addresses in `tensor`, as offsets from its data: in each row,
    `row_bytes` from the row's start; rows at i1*nb1 + i2*nb2 + i3*nb3 over every (i1, i2, i3)
    (`stride` None), or, for kernels that walk rows as one flat list, row r < ne1*ne2*ne3 at
    r * `stride` (nb1, or another tensor's nb1 where the kernel uses that). Dims of size 1 count:
    a flat walk steps by nb1 whatever ne1 is. `extent` of the default touch is ggml_nbytes."""

    tensor: RpcTensor
    row_bytes: int
    stride: int | None = None

    def extent(self) -> int:
        """One past the last byte addressed, from the tensor's data (0 for an empty tensor)."""
        ne, nb = self.tensor.ne, self.tensor.nb
        if min(ne) <= 0:
            return 0
        if self.stride is None:
            last_row = (ne[1] - 1) * nb[1] + (ne[2] - 1) * nb[2] + (ne[3] - 1) * nb[3]
        else:
            last_row = (ne[1] * ne[2] * ne[3] - 1) * self.stride
        return last_row + self.row_bytes


def rows_disjoint(touch: Touch) -> bool:
    """No byte of a flat touch (rows at r * stride) belongs to two of its rows (False for
    rows by dims, of more than one row: not decided here)."""
    t = touch.tensor
    rows = t.ne[1] * t.ne[2] * t.ne[3]
    return rows <= 1 or touch.stride is not None and touch.stride >= touch.row_bytes


def overlaps(a: RpcTensor, b: RpcTensor) -> bool:
    """The extents (ggml_nbytes from data) of two tensors share a byte."""
    return (
        a.buffer == b.buffer
        and a.data < b.data + b.nbytes
        and b.data < a.data + a.nbytes
        and a.nbytes > 0
        and b.nbytes > 0
    )


class Refused(UnsupportedOp):
    """A node the ggml device will not hand to ggml's kernels: the message says what it breaks."""


Rule = Callable[[RpcTensor, list, TypeCaps], "list[IndexUse | PaddedRead | Touch] | None"]
RULES: dict[int, Rule] = {}
# Tensors of a node (-1: the result, i: src i) that its kernel addresses element by element
# through nb0. Every other tensor must have packed rows (nb0 == type size), as kernels assert.
STRIDED: dict[int, tuple[int, ...]] = {}
# Tensors of a node that its kernel walks as one flat list of rows (row r at r * nb1, see Touch);
# every other tensor is addressed row by row at nb1..nb3.
FLAT: dict[int, tuple[int, ...]] = {}
ANY_STRIDES = tuple(range(-1, 10))


def rule(*ops: GgmlOp, strided: tuple[int, ...] = (), flat: tuple[int, ...] = ()):
    def register(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = fn
            STRIDED[op] = strided
            FLAT[op] = flat
        return fn

    return register


def describe(node: RpcTensor, srcs: list) -> str:
    parts = [f"{op_name(node.op)} {node.describe()}"]
    parts += [f"src{i} {type_name(s.type)} ne={list(s.ne)}" for i, s in enumerate(srcs) if s]
    return ", ".join(parts)


def refuse(node: RpcTensor, srcs: list, why: str) -> Refused:
    return Refused(f"{describe(node, srcs)}: {why} (refused on the ggml device)")


def need(cond: bool, node: RpcTensor, srcs: list, why: str) -> None:
    if not cond:
        raise refuse(node, srcs, why)


def src(node: RpcTensor, srcs: list, i: int) -> RpcTensor:
    if i >= len(srcs) or srcs[i] is None:
        raise refuse(node, srcs, f"src{i} missing")
    return srcs[i]


def opt_src(srcs: list, i: int) -> RpcTensor | None:
    return srcs[i] if i < len(srcs) else None


# -- shape predicates, as ggml.c spells them ------------------------------------------------------


def nelements(t: RpcTensor) -> int:
    return t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3]


def same_shape(a: RpcTensor, b: RpcTensor) -> bool:
    return tuple(a.ne) == tuple(b.ne)


def can_repeat(small: RpcTensor, big: RpcTensor) -> bool:
    return all(s > 0 and b % s == 0 for s, b in zip(small.ne, big.ne))


def contiguous_from(t: RpcTensor, n: int) -> bool:
    """ggml_is_contiguous_n as pinned (ggml_is_contiguous_m_n(t, n, 4)): dims above n packed
    (a dim of size 1 there takes any stride), each dim up to n sets the next one's stride from
    its own, whatever its size."""
    tr = TYPE_TRAITS[t.type]
    next_nb = tr.type_size
    if t.ne[0] != tr.blck_size and t.nb[0] != next_nb:
        return False
    next_nb *= t.ne[0] // tr.blck_size
    for i in range(1, 4):
        if i > n:
            if t.ne[i] != 1 and t.nb[i] != next_nb:
                return False
            next_nb *= t.ne[i]
        else:
            next_nb = t.ne[i] * t.nb[i]
    return True


def row_extent(t: RpcTensor) -> int:
    """The bytes of one row from its start, as ggml_nbytes counts them."""
    tr = TYPE_TRAITS[t.type]
    if tr.blck_size == 1:
        return (t.ne[0] - 1) * t.nb[0] + tr.type_size
    return t.ne[0] * t.nb[0] // tr.blck_size


def packed(t: RpcTensor) -> bool:
    """Every stride the packed one, size-1 dims included: flat rows and rows by dims are the
    same bytes, and a kernel writing all its rows writes every byte of the extent."""
    return tuple(t.nb) == contiguous_strides(t.type, tuple(t.ne))


def contiguous(t: RpcTensor) -> bool:
    return contiguous_from(t, 0)


def rows_packed(t: RpcTensor) -> bool:
    """ggml_is_contiguous_rows: each row's elements are adjacent."""
    return t.ne[0] == TYPE_TRAITS[t.type].blck_size or t.nb[0] == TYPE_TRAITS[t.type].type_size


def transposed(t: RpcTensor) -> bool:
    return t.nb[0] > t.nb[1]


def op_param_f32(node: RpcTensor, slot: int) -> float:
    """Word `slot` of the wire op_params read as f32 (the op table's f32_param reads the value
    its plan decoded once)."""
    return struct.unpack("<f", struct.pack("<i", node.op_params[slot]))[0]


def check_types(node, srcs, dst_types, *src_types) -> None:
    need(node.type in dst_types, node, srcs, f"result type {type_name(node.type)} not taken")
    for i, types in enumerate(src_types):
        s = src(node, srcs, i)
        need(s.type in types, node, srcs, f"src{i} type {type_name(s.type)} not taken")


def check_rows_packed(node, srcs, *tensors) -> None:
    for t in tensors:
        if not rows_packed(t):
            raise refuse(node, srcs, f"{t.describe()} rows are not packed (nb0={t.nb[0]})")


# -- the rules ------------------------------------------------------------------------------------


@rule(GgmlOp.NONE, GgmlOp.RESHAPE, GgmlOp.VIEW, GgmlOp.PERMUTE, GgmlOp.TRANSPOSE)
def metadata(node, srcs, caps):
    return None  # the CPU backend skips them: nothing is read or written


@rule(GgmlOp.ADD, GgmlOp.SUB, GgmlOp.MUL, GgmlOp.DIV, strided=(1,))
def binary(node, srcs, caps):
    # ggml_add_impl & co: b repeats into a, the result has a's shape; binary-ops.cpp takes
    # f32/f16/bf16 with packed rows for dst and src0, and src1 of dst's type or f32.
    a, b = src(node, srcs, 0), src(node, srcs, 1)
    need(same_shape(node, a), node, srcs, "result shape differs from src0")
    need(can_repeat(b, a), node, srcs, "src1 does not repeat into src0")
    need(a.type == node.type and node.type in FLOATS, node, srcs, "src0/result types not taken")
    need(b.type in (node.type, F32), node, srcs, "src1 type not taken")
    check_rows_packed(node, srcs, node, a)  # src1 may be strided: walked element by element


@rule(GgmlOp.SCALE, flat=(-1, 0))
def scale(node, srcs, caps):
    # ops/scale: row i1 < nrows at i1*nb1 of the result and i1*nb01 of src0 (with a bias, src0
    # at the result's i1*nb1 too)
    a = src(node, srcs, 0)
    need(node.type == a.type and a.type in (F32, BF16), node, srcs, "types not taken")
    need(same_shape(node, a), node, srcs, "result shape differs from src0")
    need(contiguous(a) and contiguous(node), node, srcs, "src0 and result must be contiguous")
    if op_param_f32(node, 1) != 0.0:
        return [Touch(a, row_extent(a), node.nb[1])]
    return None


@rule(GgmlOp.RMS_NORM)
@rule(GgmlOp.NORM, GgmlOp.L2_NORM, strided=(-1, 0))  # ops/norm: these two walk nb0
def norm(node, srcs, caps):
    a = src(node, srcs, 0)
    check_types(node, srcs, {F32}, {F32})
    need(same_shape(node, a), node, srcs, "result shape differs from src0")
    if node.op == GgmlOp.RMS_NORM:  # asserts packed rows
        check_rows_packed(node, srcs, node, a)
    eps = op_param_f32(node, 0)
    need(eps >= 0.0, node, srcs, f"eps {eps} (the kernel asserts eps >= 0)")  # False for NaN


# ops.cpp's own gelu/silu kernels: f32, f16 or bf16 in and the same out
SAME_TYPE_UNARY = frozenset({UnaryOp.GELU, UnaryOp.GELU_ERF, UnaryOp.GELU_QUICK, UnaryOp.SILU})


@rule(GgmlOp.UNARY)
def unary(node, srcs, caps):
    a = src(node, srcs, 0)
    op = node.op_params[0]
    need(0 <= op < len(UnaryOp), node, srcs, f"unary op {op}")
    if op in SAME_TYPE_UNARY:
        need(node.type == a.type and a.type in FLOATS, node, srcs, "types not taken")
    else:  # unary-ops.cpp
        need((a.type, node.type) in UNARY_TYPES, node, srcs, "types not taken")
    need(same_shape(node, a), node, srcs, "result shape differs from src0")
    # rows at each side's strides, elements packed (check_node); xielu asserts contiguous_1
    if op == UnaryOp.XIELU:
        need(contiguous_from(a, 1) and contiguous_from(node, 1), node, srcs, "row layout not taken")


# the kernels each GLU op has (the rest: f32, f16)
GLU_TYPES = {
    GluOp.SWIGLU_OAI: (F32,),
    **{
        op: (F32, F16, BF16)
        for op in (GluOp.REGLU, GluOp.GEGLU, GluOp.SWIGLU, GluOp.GEGLU_ERF, GluOp.GEGLU_QUICK)
    },
}


@rule(GgmlOp.GLU, flat=(-1, 0, 1))  # row i1 at i1*nb1 of each
def glu(node, srcs, caps):
    """GLU: a GLU op the kernels have, for the types they take, over packed rows of matching shapes."""
    # ggml_glu_impl: one src split in halves (swapped or not), or two srcs of one shape.
    a, b = src(node, srcs, 0), opt_src(srcs, 1)
    need(0 <= node.op_params[0] < len(GluOp), node, srcs, f"glu op {node.op_params[0]}")
    types = GLU_TYPES.get(node.op_params[0], (F32, F16))
    need(node.type == a.type and a.type in types, node, srcs, "types not taken")
    need(contiguous_from(a, 1) and contiguous_from(node, 1), node, srcs, "rows are not packed")
    if b is not None:
        need(same_shape(a, b) and b.type == a.type, node, srcs, "src1 differs from src0")
        need(contiguous_from(b, 1), node, srcs, "src1 rows are not packed")
        need(same_shape(node, a), node, srcs, "result shape differs from src0")
    else:
        want = (a.ne[0] // 2, *a.ne[1:])
        need(tuple(node.ne) == want, node, srcs, f"result shape is not {list(want)}")


HINT_SRC0_IS_HADAMARD = 1  # op_params[1] of MUL_MAT (ggml_mul_mat_set_hint)


@rule(GgmlOp.MUL_MAT)
def mul_mat(node, srcs, caps):
    """MUL_MAT: ggml_mul_mat's shapes, packed rows, and a src0 type with a CPU dot product that
    takes src1's type (or the Hadamard hint's own case)."""
    # ggml_mul_mat: ggml_can_mul_mat(a, b), !transposed(a), result [a.ne1, b.ne1, b.ne2, b.ne3]
    # f32; the kernel: packed rows, src0 with a vec_dot, src1 f32, that dot's own type, or f16/bf16
    # widened into the f32 work buffer when the dot is f32's own.
    a, b = src(node, srcs, 0), src(node, srcs, 1)
    need(a.ne[0] == b.ne[0], node, srcs, "src0.ne0 != src1.ne0")
    need(b.ne[2] % a.ne[2] == 0 and b.ne[3] % a.ne[3] == 0, node, srcs, "src0 does not broadcast")
    need(not transposed(a), node, srcs, "src0 is transposed")
    want = (a.ne[1], b.ne[1], b.ne[2], b.ne[3])
    need(tuple(node.ne) == want, node, srcs, f"result shape is not {list(want)}")
    need(node.type == F32, node, srcs, "result must be f32")
    check_rows_packed(node, srcs, node, a, b)
    need(node.nb[0] <= node.nb[1] <= node.nb[2] <= node.nb[3], node, srcs, "result is permuted")
    if node.op_params[1] == HINT_SRC0_IS_HADAMARD:
        # The kernel skips src0 and runs a fast Walsh-Hadamard transform of each src1 row into
        # the result row: ne10 floats per row, so the result rows must be that long.
        need(a.type == F32 and b.type in (F32, F16), node, srcs, "hadamard: src0 f32, src1 f32/f16")
        need(a.ne[1] == a.ne[0], node, srcs, "hadamard: src0 is not square")
        n = b.ne[0]
        need(n & (n - 1) == 0, node, srcs, f"hadamard: {n} is not a power of 2 (the kernel asserts)")
        return
    need(a.type in caps.vec_dot, node, srcs, f"no CPU dot product for {type_name(a.type)}")
    dot = caps.vec_dot_type[a.type]
    widened = b.type in (F16, BF16) and dot == F32
    need(b.type in (F32, dot) or widened, node, srcs, "src1 type not taken")
    if b.type == GgmlType.Q8_K:
        # the tiled K-quant kernel walks pre-quantized src1 rows as one flat list (r * nb1)
        need(contiguous(b), node, srcs, "q8_K src1 must be contiguous")


@rule(GgmlOp.MUL_MAT_ID)
def mul_mat_id(node, srcs, caps):
    """MUL_MAT_ID: ggml_mul_mat_id's shapes and types; the expert ids are checked against n_expert."""
    # ggml_mul_mat_id: as [k, m, n_as], b [k, n_used or 1, n_tokens], ids i32 [n_used, n_tokens]
    a, b, ids = src(node, srcs, 0), src(node, srcs, 1), src(node, srcs, 2)
    need(ids.type == I32, node, srcs, "ids must be i32")
    need(a.ne[3] == 1 and b.ne[3] == 1, node, srcs, "src0/src1 must be 3-d")
    need(ids.ne[2] == 1 and ids.ne[3] == 1, node, srcs, "ids must be 2-d")
    need(ids.ne[1] == b.ne[2], node, srcs, "ids.ne1 != src1.ne2 (tokens)")
    need(a.ne[0] == b.ne[0], node, srcs, "src0.ne0 != src1.ne0")
    need(b.ne[1] > 0 and ids.ne[0] % b.ne[1] == 0, node, srcs, "src1 does not broadcast to ids")
    need(not transposed(a), node, srcs, "src0 is transposed")
    want = (a.ne[1], ids.ne[0], b.ne[2], 1)
    need(tuple(node.ne) == want, node, srcs, f"result shape is not {list(want)}")
    need(node.type == F32, node, srcs, "result must be f32")
    need(node.nb[0] <= node.nb[1] <= node.nb[2] <= node.nb[3], node, srcs, "result is permuted")
    need(a.type in caps.vec_dot, node, srcs, f"no CPU dot product for {type_name(a.type)}")
    need(b.type in (F32, caps.vec_dot_type[a.type]), node, srcs, "src1 type not taken")
    if b.type == GgmlType.Q8_K:  # the tiled kernel reads pre-quantized rows at (i11 + i12*ne11)*nb11
        need(contiguous(b), node, srcs, "q8_K src1 must be contiguous")
    check_rows_packed(node, srcs, node, a, b, ids)
    return [IndexUse(ids, a.ne[2])]


@rule(GgmlOp.GET_ROWS, strided=(1,))  # row ids are read one by one
def get_rows(node, srcs, caps):
    # ggml_get_rows: a [n, rows, ne2, ne3], b i32 [k, ne2, ne3] -> [n, k, ne2, ne3] f32 (i32 a: i32)
    a, b = src(node, srcs, 0), src(node, srcs, 1)
    need(b.type == I32, node, srcs, "row ids must be i32")
    need(a.ne[2] == b.ne[1] and a.ne[3] == b.ne[2] and b.ne[3] == 1, node, srcs, "ids do not match")
    want = (a.ne[0], b.ne[0], b.ne[1], b.ne[2])
    need(tuple(node.ne) == want, node, srcs, f"result shape is not {list(want)}")
    need(node.type == (I32 if a.type == I32 else F32), node, srcs, "result type not taken")
    need(a.type in FLOATS or a.type == I32 or a.type in caps.to_float, node, srcs, "src0 type")
    check_rows_packed(node, srcs, node, a)
    return [IndexUse(b, a.ne[1])]


@rule(GgmlOp.SET_ROWS, strided=(1,))
def set_rows(node, srcs, caps):
    """SET_ROWS: row ids that broadcast over src0, f32/f16 rows, a result type the CPU can write;
    the ids are checked against the result's rows."""
    # ggml_set_rows(a, b, c): the node is a view of a; b f32/f16 rows, c i64/i32 row numbers.
    b, c = src(node, srcs, 0), src(node, srcs, 1)
    need(
        node.ne[0] == b.ne[0] and node.ne[2] == b.ne[2] and node.ne[3] == b.ne[3],
        node,
        srcs,
        "src0 does not match the destination",
    )
    need(b.ne[1] == c.ne[0], node, srcs, "src0.ne1 != number of row ids")
    need(
        c.ne[1] > 0 and c.ne[2] > 0 and b.ne[2] % c.ne[1] == 0 and b.ne[3] % c.ne[2] == 0,
        node,
        srcs,
        "row ids do not broadcast",
    )
    need(c.ne[3] == 1, node, srcs, "row ids must be 3-d")
    need(b.type in (F32, F16), node, srcs, "src0 must be f32 or f16")
    need(c.type in (I64, I32), node, srcs, "row ids must be i64 or i32")
    need(node.type in FLOATS or node.type in caps.from_float, node, srcs, "result type not taken")
    check_rows_packed(node, srcs, node, b)
    return [IndexUse(c, node.ne[1])]


@rule(GgmlOp.CPY, GgmlOp.DUP, GgmlOp.CONT, strided=ANY_STRIDES)  # ops/dup walks any strides
def copy(node, srcs, caps):
    """CPY, DUP, CONT: equal element counts and a conversion ops/dup has, at strides its path for
    those types can walk."""
    # ggml_cpy/ggml_cont: same element count; ops/dup: float <-> float at any strides, same type
    # bytes (below), f32 -> a quantized type into packed rows, quantized -> f32 (below).
    a = src(node, srcs, 0)
    need(nelements(a) == nelements(node), node, srcs, "element counts differ")
    if node.op == GgmlOp.CONT:
        need(contiguous(node), node, srcs, "result is not contiguous")
    quant_a, quant_d = a.type not in TYPE_NOT_QUANT, node.type not in TYPE_NOT_QUANT
    if not quant_a and not quant_d:
        need(
            a.type == node.type
            or (a.type in FLOATS and node.type in FLOATS)
            or (a.type, node.type) in ((F32, I32), (I32, F32)),
            node,
            srcs,
            "conversion not taken",
        )
    elif a.type == node.type:
        # dup_bytes copies whole blocks (check_node: packed, whole): both contiguous in one
        # memcpy, one shape row by row at each side's strides, a strided result block by block.
        # What is left, a strided src0 of another shape into a contiguous result, copies
        # ne00 * type_size bytes per row: blck_size times a row, past both tensors.
        need(
            contiguous(a) or same_shape(a, node) or not contiguous(node),
            node,
            srcs,
            "a strided quantized src0 of another shape into a contiguous result",
        )
    elif quant_d:
        # dup_to_q converts each src0 row into a per-thread f32 scratch in the work buffer,
        # which ggml_graph_plan sizes (ne0 floats a thread) for CPY and DUP only: a CONT that
        # quantizes (never built: ggml_cont keeps src0's type) writes through a NULL or another
        # node's work buffer.
        need(
            node.op != GgmlOp.CONT,
            node,
            srcs,
            "CONT into another, quantized type (the plan gives CONT no scratch)",
        )
        need(contiguous(node) and rows_packed(a), node, srcs, "quantized copy needs packed rows")
        need(a.type in FLOATS and node.type in caps.from_float, node, srcs, "conversion not taken")
        need(a.ne[0] % TYPE_TRAITS[node.type].blck_size == 0, node, srcs, "rows split a block")
        # each thread converts a src0 row into its scratch, sized from the result's ne0
        need(a.ne[0] <= node.ne[0], node, srcs, "src0 rows longer than the result's (scratch)")
    else:
        # dup_from_q: each block of src0 at its strides, dequantized into qk floats that run on
        # from its element of the result: inside a row, or a contiguous result. It takes the
        # result's shape and strides from src1 (ggml_cpy's b, which the result views): CONT or
        # DUP have none (a NULL read).
        target = opt_src(srcs, 1)
        need(
            target is not None and tuple(target.ne) == tuple(node.ne) and tuple(target.nb) == tuple(node.nb),
            node,
            srcs,
            "dequantizing copy needs src1 of the result's shape and strides",
        )
        need(node.type == F32 and a.type in caps.to_float, node, srcs, "conversion not taken")
        need(node.nb[0] == TYPE_TRAITS[F32].type_size, node, srcs, "result rows are not packed")
        need(
            node.ne[0] % TYPE_TRAITS[a.type].blck_size == 0 or contiguous(node),
            node,
            srcs,
            "result rows split a block and are not contiguous",
        )


TYPE_NOT_QUANT = frozenset({F32, F16, BF16, I32, I64, GgmlType.I8, GgmlType.I16, GgmlType.F64})


@rule(GgmlOp.ROPE, GgmlOp.ROPE_BACK)  # one kernel, run backwards for ROPE_BACK
def rope(node, srcs, caps):
    """ROPE, ROPE_BACK: a known mode, n_dims and offset within ne0, positions per token, f32/f16;
    the touches cover the pairs past odd rows, a short freq-factor list is padded."""
    # ggml_rope_impl / ggml_rope_multi: positions i32, one per token (4 for the mrope modes);
    # n_dims <= ne0; freq factors f32, n_dims/2 of them.
    a, pos, freq = src(node, srcs, 0), src(node, srcs, 1), opt_src(srcs, 2)
    n_dims, mode, n_offs = node.op_params[1], node.op_params[2], node.op_params[15]
    need(mode in ROPE_MODES, node, srcs, f"rope mode {mode}")
    need(0 < n_dims <= a.ne[0] and n_dims % 2 == 0, node, srcs, f"n_dims {n_dims}")
    need(0 <= n_offs and n_offs % 2 == 0 and n_offs + n_dims <= a.ne[0], node, srcs, f"n_offs {n_offs}")
    need(pos.type == I32 and pos.ne[1:] == (1, 1, 1), node, srcs, "positions must be i32 vector")
    if mode & ROPE_MROPE:
        need(pos.ne[0] >= 4 * a.ne[2], node, srcs, "four positions per token (4 * src0.ne2)")
        sections = node.op_params[11:15]
        # the cache takes i0/2 modulo their sum: a zero sum divides by zero
        need(min(sections) >= 0 and 0 < sum(sections) <= a.ne[0], node, srcs, f"sections {list(sections)}")
        if mode == ROPE_VISION:
            need(2 * n_dims == a.ne[0] and n_offs == 0, node, srcs, "vision: n_dims = ne0/2, no offset")
    else:
        need(pos.ne[0] == a.ne[2], node, srcs, "one position per token (src0.ne2)")
    need(a.type in (F32, F16) and node.type == a.type, node, srcs, "types not taken")
    need(same_shape(node, a), node, srcs, "result shape differs from src0")
    check_rows_packed(node, srcs, node, a, pos)
    # the channels past the rotated ones are copied in pairs: an odd ne0 reads and writes one
    # element past each row
    pairs = (a.ne[0] + 1) // 2 * 2 * TYPE_TRAITS[a.type].type_size
    touches = [Touch(node, pairs), Touch(a, pairs)]
    if freq is not None:
        need(freq.type == F32 and freq.ne[0] >= n_dims // 2, node, srcs, "freq factors")
        # the rope cache reads a factor for every pair of ne0, of which only the first n_dims/2
        # are used: the kernel gets a copy padded to ne0/2 factors
        wanted = (a.ne[0] + 1) // 2 * 4
        if freq.nbytes < wanted:
            touches.append(PaddedRead(freq, wanted))
    return touches


ROPE_MROPE, ROPE_VISION = 8, 24
ROPE_MODES = (0, 2, ROPE_MROPE, ROPE_VISION, 40)  # normal, neox, mrope, vision, imrope


@rule(GgmlOp.SOFT_MAX)
def soft_max(node, srcs, caps):
    # ggml_soft_max_impl: a contiguous f32; mask f16/f32 contiguous, ne0 equal, ne1 >= a.ne1,
    # broadcast over ne2/ne3; sinks f32, one per head (a.ne2).
    a, mask, sinks = src(node, srcs, 0), opt_src(srcs, 1), opt_src(srcs, 2)
    check_types(node, srcs, {F32}, {F32})
    need(contiguous(a) and same_shape(node, a), node, srcs, "src0 contiguous, result of its shape")
    need(contiguous(node), node, srcs, "result is not contiguous")
    if mask is not None:
        need(mask.type in (F16, F32) and contiguous(mask), node, srcs, "mask f16/f32 contiguous")
        need(mask.ne[0] == a.ne[0] and mask.ne[1] >= a.ne[1], node, srcs, "mask shape")
        need(a.ne[2] % mask.ne[2] == 0 and a.ne[3] % mask.ne[3] == 0, node, srcs, "mask broadcast")
    if sinks is not None:
        need(sinks.type == F32 and sinks.ne[0] >= a.ne[2], node, srcs, "sinks: f32, one per head")


@rule(GgmlOp.FLASH_ATTN_EXT)
def flash_attn_ext(node, srcs, caps):
    """FLASH_ATTN_EXT: ggml_flash_attn_ext's shapes, types the CPU kernel can read, an f32 result
    whose strides ascend, a known precision."""
    # ggml_flash_attn_ext: q [d, n_q, h, b] f32, k [d, n_kv, h_kv, b], v [dv, n_kv, h_kv, b],
    # mask f16 contiguous [>= n_kv, >= n_q, ...] -> [dv, h, n_q, b] f32.
    q, k, v = src(node, srcs, 0), src(node, srcs, 1), src(node, srcs, 2)
    mask, sinks = opt_src(srcs, 3), opt_src(srcs, 4)
    need(q.type == F32, node, srcs, "q must be f32")
    need(k.ne[0] == q.ne[0], node, srcs, "k.ne0 != q.ne0")
    need(
        k.ne[2] > 0 and q.ne[2] % k.ne[2] == 0 and v.ne[2] > 0 and q.ne[2] % v.ne[2] == 0,
        node,
        srcs,
        "heads do not broadcast",
    )
    need(q.ne[3] == k.ne[3] == v.ne[3], node, srcs, "batch dims differ")
    need(v.ne[1] == k.ne[1], node, srcs, "k and v lengths differ")
    need(
        k.type in caps.vec_dot and caps.vec_dot_type[k.type] in caps.from_float,
        node,
        srcs,
        "k type not taken",
    )
    need(v.type in (F16, F32) or v.type in caps.to_float, node, srcs, "v type not taken")
    if mask is not None:
        need(mask.type == F16 and contiguous(mask), node, srcs, "mask must be contiguous f16")
        need(mask.ne[0] >= k.ne[1] and mask.ne[1] >= q.ne[1], node, srcs, "mask too small")
        need(q.ne[2] % mask.ne[2] == 0 and q.ne[3] % mask.ne[3] == 0, node, srcs, "mask broadcast")
    if sinks is not None:
        need(sinks.type == F32 and sinks.ne[0] >= q.ne[2], node, srcs, "sinks: f32, one per head")
    want = (v.ne[0], q.ne[2], q.ne[1], q.ne[3])
    need(tuple(node.ne) == want and node.type == F32, node, srcs, f"result is not f32 {list(want)}")
    need(contiguous(node), node, srcs, "result is not contiguous")
    # the kernel asserts nb0 <= nb1 <= nb2 <= nb3 of the result ("dst cannot be transposed or
    # permuted"), size-1 dims included, which ggml_is_contiguous lets take any stride
    need(
        node.nb[0] <= node.nb[1] <= node.nb[2] <= node.nb[3],
        node,
        srcs,
        f"result strides {list(node.nb)} do not ascend (the kernel asserts)",
    )
    # ggml_compute_forward_flash_attn_ext takes GGML_PREC_DEFAULT and GGML_PREC_F32 in
    # op_params[3] (ggml_flash_attn_ext_set_prec) and aborts on anything else
    need(
        node.op_params[3] in FLASH_ATTN_PRECS,
        node,
        srcs,
        f"precision {node.op_params[3]} (the kernel aborts: only 0 and 10)",
    )
    check_rows_packed(node, srcs, q, k, v)
    # each output row is copied from a DV-float scratch row, nb1 bytes, to flat row r at r*nb1
    row = row_size(node.type, node.ne[0])
    need(node.nb[1] == row, node, srcs, f"result nb1 {node.nb[1]} is not {row}")
    return [Touch(node, node.nb[1], node.nb[1])]


FLASH_ATTN_PRECS = (0, 10)  # GGML_PREC_DEFAULT, GGML_PREC_F32


@rule(GgmlOp.CLAMP, flat=(-1, 0))  # row j at j*nb1 / j*nb01
def clamp(node, srcs, caps):
    # ops/clamp walks src0's rows as one flat list and writes dst's at j*nb1: both contiguous;
    # f32 or f16 by src0's type, written as that type
    a = src(node, srcs, 0)
    need(node.type == a.type and a.type in (F32, F16), node, srcs, "types not taken")
    need(same_shape(node, a), node, srcs, "result shape differs from src0")
    need(contiguous(a) and contiguous(node), node, srcs, "src0 and result must be contiguous")


@rule(GgmlOp.MEAN)
def mean(node, srcs, caps):
    return sum_rows(node, srcs, caps)


@rule(GgmlOp.ARGMAX)
def argmax(node, srcs, caps):
    # ggml_argmax: a matrix f32 -> i32 [ne1]
    a = src(node, srcs, 0)
    check_types(node, srcs, {I32}, {F32})
    need(a.ne[2] == 1 and a.ne[3] == 1, node, srcs, "src0 must be a matrix")
    need(tuple(node.ne) == (a.ne[1], 1, 1, 1), node, srcs, "result shape is not [ne1]")


@rule(GgmlOp.CONCAT, strided=ANY_STRIDES)
def concat(node, srcs, caps):
    # ggml_concat: one type; dims equal except `dim`, which adds up. 1/2/4-byte elements are
    # copied one by one at any strides; any other type row by row (packed rows, whole blocks).
    a, b, dim = src(node, srcs, 0), src(node, srcs, 1), node.op_params[0]
    need(0 <= dim < 4, node, srcs, f"dim {dim}")
    need(a.type == b.type == node.type, node, srcs, "types differ")
    tr = TYPE_TRAITS[a.type]
    if tr.blck_size > 1 or tr.type_size not in (1, 2, 4):
        check_rows_packed(node, srcs, node, a, b)
    want = tuple(a.ne[i] + b.ne[i] if i == dim else a.ne[i] for i in range(4))
    need(all(a.ne[i] == b.ne[i] for i in range(4) if i != dim), node, srcs, "src shapes differ")
    need(tuple(node.ne) == want, node, srcs, f"result shape is not {list(want)}")


@rule(GgmlOp.PAD, strided=(0,))
def pad(node, srcs, caps):
    # ggml_pad_ext: f32, result = src0 + left/right pads per dim; the kernel writes it flat
    a = src(node, srcs, 0)
    check_types(node, srcs, {F32}, {F32})
    pads = node.op_params[:8]
    need(all(p >= 0 for p in pads), node, srcs, "negative padding")
    want = tuple(a.ne[i] + pads[2 * i] + pads[2 * i + 1] for i in range(4))
    need(tuple(node.ne) == want, node, srcs, f"result shape is not {list(want)}")
    need(contiguous(node), node, srcs, "result is not contiguous")
    need(node.op_params[8] in (0, 1), node, srcs, "circular flag")


@rule(GgmlOp.ADD_ID, strided=(2,))
def add_id(node, srcs, caps):
    # ggml_add_id: a [n, n_used, tokens] + b[:, ids] (b [n, n_experts]); ids i32 [n_used, tokens]
    a, b, ids = src(node, srcs, 0), src(node, srcs, 1), src(node, srcs, 2)
    check_types(node, srcs, {F32}, {F32}, {F32}, {I32})
    need(
        a.ne[0] == b.ne[0] and a.ne[1] == ids.ne[0] and a.ne[2] == ids.ne[1],
        node,
        srcs,
        "src shapes do not match ids",
    )
    need(same_shape(node, a), node, srcs, "result shape differs from src0")
    return [IndexUse(ids, b.ne[1])]


@rule(GgmlOp.ARGSORT, flat=(-1, 0))  # row i at i*nb1 / i*nb01
def argsort(node, srcs, caps):
    """ARGSORT: i32 result of src0's shape; result rows apart from each other and from src0, since
    the sort runs in place."""
    a = src(node, srcs, 0)
    need(node.op_params[0] in (0, 1), node, srcs, f"sort order {node.op_params[0]}")
    check_types(node, srcs, {I32}, {F32})
    need(same_shape(node, a), node, srcs, "result shape differs from src0")
    check_rows_packed(node, srcs, node, a)
    # std::sort runs in the result row itself (row i on thread i % nth), comparing src0's
    # floats: a row another thread sorts at the same time, or src0 bytes the sort overwrites,
    # change under it and its unguarded insertion sort walks off the row (SIGSEGV).
    need(
        rows_disjoint(Touch(node, row_extent(node), node.nb[1])),
        node,
        srcs,
        f"result rows overlap (nb1 {node.nb[1]}): the sort runs in them",
    )
    need(not overlaps(node, a), node, srcs, "the result overlaps src0: the sort runs in it")


@rule(GgmlOp.TOP_K, flat=(-1, 0))  # row i at i*nb1 / i*nb01
def top_k(node, srcs, caps):
    a = src(node, srcs, 0)
    check_types(node, srcs, {I32}, {F32})
    need(0 < node.ne[0] <= a.ne[0] and node.ne[1:] == a.ne[1:], node, srcs, "result shape")
    check_rows_packed(node, srcs, node, a)


@rule(GgmlOp.SUM_ROWS)
def sum_rows(node, srcs, caps):
    a = src(node, srcs, 0)
    check_types(node, srcs, {F32}, {F32})
    need(tuple(node.ne) == (1, *a.ne[1:]), node, srcs, "result shape is not [1, ne1, ne2, ne3]")
    check_rows_packed(node, srcs, node, a)


# unary-ops.cpp: same element type, or f16/bf16 in and f32 out
UNARY_TYPES = frozenset({(F32, F32), (F16, F16), (BF16, BF16), (BF16, F32), (F16, F32)})


@rule(GgmlOp.SQR, GgmlOp.SQRT, GgmlOp.LOG, GgmlOp.SIN, GgmlOp.COS)
def elementwise(node, srcs, caps):
    # rows at each side's strides, elements packed (check_node): any row layout
    a = src(node, srcs, 0)
    need((a.type, node.type) in UNARY_TYPES, node, srcs, "types not taken")
    need(same_shape(node, a), node, srcs, "result shape differs from src0")


@rule(GgmlOp.LEAKY_RELU, flat=(-1, 0))  # row i at i*nb1 of each
def leaky_relu(node, srcs, caps):
    a = src(node, srcs, 0)
    need(node.type == a.type and a.type in (F32, F16), node, srcs, "types not taken")
    need(same_shape(node, a), node, srcs, "result shape differs from src0")


@rule(GgmlOp.SUM, strided=(0,))
def sum_all(node, srcs, caps):
    # sums ne0 packed elements from each row's start whatever nb0 says (as the stock server):
    # inside the view while nb0 >= the element size
    a = src(node, srcs, 0)
    need(node.type == a.type and a.type in FLOATS, node, srcs, "types not taken")
    need(a.nb[0] >= TYPE_TRAITS[a.type].type_size, node, srcs, "src0 elements overlap")
    need(tuple(node.ne) == (1, 1, 1, 1), node, srcs, "result is not a scalar")


@rule(GgmlOp.CUMSUM)
def cumsum(node, srcs, caps):
    a = src(node, srcs, 0)
    check_types(node, srcs, {F32}, {F32})
    need(same_shape(node, a), node, srcs, "result shape differs from src0")


@rule(GgmlOp.REPEAT)
def repeat(node, srcs, caps):
    # ggml_repeat(a, b): a's type in b's shape; copied row by row at both sides' strides
    a = src(node, srcs, 0)
    need(
        node.type == a.type
        and TYPE_TRAITS[a.type].blck_size == 1
        and TYPE_TRAITS[a.type].type_size in (2, 4),
        node,
        srcs,
        "types not taken (2/4-byte)",
    )
    need(can_repeat(a, node), node, srcs, "src0 does not repeat into the result")


@rule(GgmlOp.FILL)
def fill(node, srcs, caps):
    # the kernel picks the element type from src0 and writes the result's rows with it
    a = src(node, srcs, 0)
    need(node.type == a.type and a.type in (F32, F16), node, srcs, "types not taken")
    need(same_shape(node, a), node, srcs, "result shape differs from src0")


@rule(GgmlOp.ARANGE)
def arange(node, srcs, caps):
    # writes element i at i * 4 for i < ceil((stop - start) / step), asserting that count
    need(node.type == F32 and contiguous(node), node, srcs, "result must be contiguous f32")
    start, stop, step = (np.float32(op_param_f32(node, i)) for i in range(3))
    with np.errstate(all="ignore"):
        steps = np.ceil((stop - start) / step)
    need(
        bool(np.isfinite(steps)) and steps == nelements(node),
        node,
        srcs,
        f"result has {nelements(node)} elements, arange makes {steps}",
    )


@rule(GgmlOp.SET, GgmlOp.ACC)
def set_acc(node, srcs, caps):
    """SET, ACC: contiguous tensors of one type, and a view of src1 whose last element ends inside
    the result."""
    # ggml_set/ggml_acc(a, b, nb1, nb2, nb3, offset): the result is a (copied unless inplace),
    # b written into (SET) or added to (ACC) the view of it the op_params describe.
    a, b = src(node, srcs, 0), src(node, srcs, 1)
    types = (F32,) if node.op == GgmlOp.ACC else (F32, I32)
    need(node.type == a.type == b.type and a.type in types, node, srcs, "types not taken")
    need(same_shape(node, a), node, srcs, "result shape differs from src0")
    need(contiguous(node) and contiguous(a), node, srcs, "src0 and result must be contiguous")
    *strides, offset = node.op_params[:4]
    need(min(*strides, offset) >= 0, node, srcs, "negative view strides or offset")
    # the last element of the view must end inside the result (the kernel's assert lets the
    # view's last element start at its end)
    size = TYPE_TRAITS[a.type].type_size
    last = offset + sum((n - 1) * st for n, st in zip(b.ne, (size, *strides)))
    need(last + size <= node.nbytes, node, srcs, "the view of src1 ends past the result")


@rule(GgmlOp.GROUP_NORM)
def group_norm(node, srcs, caps):
    a = src(node, srcs, 0)
    check_types(node, srcs, {F32}, {F32})
    need(same_shape(node, a), node, srcs, "result shape differs from src0")
    groups = node.op_params[0]
    # groups 0 divides by zero; the channel arithmetic is 32-bit
    need(0 < groups and groups + a.ne[2] < 1 << 31, node, srcs, f"{groups} groups")


def index_producers(op: int) -> bool:
    """Ops whose i32 results are indices into their src0's rows: in range by construction."""
    return op in (GgmlOp.ARGSORT, GgmlOp.TOP_K)


def made_by(index: RpcTensor, producer: RpcTensor) -> bool:
    """Every element of `index` is one an ARGSORT/TOP_K (`producer`) wrote: the producer writes
    its whole extent (packed: no gaps left holding client bytes), and `index` is that tensor or a
    view inside it on its element grid (ggml_argsort_top_k's view of the first k of each row)."""
    size = TYPE_TRAITS[producer.type].type_size
    return (
        index_producers(producer.op)
        and producer.type == index.type
        and packed(producer)
        and producer.buffer == index.buffer
        and producer.data <= index.data
        and index.data + index.nbytes <= producer.data + producer.nbytes
        and (index.data - producer.data) % size == 0
        and all(nb % size == 0 for n, nb in zip(index.ne, index.nb) if n > 1)
    )


def touches(node: RpcTensor, srcs: list, extra: list) -> list[Touch]:
    """What the node's kernel addresses: for each tensor its rows at nb1..nb3 or as a flat list
    (FLAT), each row as ggml_nbytes counts it, plus what the rule named (longer rows, another
    stride)."""
    flat = FLAT[node.op]
    out = []
    for i, t in enumerate((node, *srcs)):
        if t is not None:
            out.append(Touch(t, row_extent(t), t.nb[1] if i - 1 in flat else None))
    return out + [u for u in extra if isinstance(u, Touch)]


def check_node(node: RpcTensor, srcs: list, caps: TypeCaps) -> list[IndexUse | PaddedRead]:
    """Refuse a node whose op has no rule, breaks its op's rule, or whose kernel would address a
    byte outside a tensor's extent (ggml_nbytes from its data: what fleetd checked against the
    tensor's buffer); the index tensors it reads and the reads past a view it needs padded."""
    fn = RULES.get(node.op)
    if fn is None:
        raise Refused(f"{describe(node, srcs)}: op {node.op} has no safety rule on the ggml device")
    if 0 in node.ne:  # ggml_compute_forward returns at once for an empty result: nothing runs
        return []
    strided = STRIDED[node.op]
    for i, t in enumerate((node, *srcs)):
        if t is None:
            continue
        if i - 1 not in strided and t.nb[0] != TYPE_TRAITS[t.type].type_size:
            raise refuse(node, srcs, f"{t.describe()} nb0={t.nb[0]}: the kernels take packed rows")
        if nelements(t) > MAX_ELEMENTS:  # stride-0 shapes stay in bounds but overflow int64 math
            raise refuse(node, srcs, f"{t.describe()} has more than 2^40 elements")
        tr = TYPE_TRAITS[t.type]
        if tr.blck_size > 1 and (t.ne[0] % tr.blck_size or t.nb[0] != tr.type_size):
            raise refuse(node, srcs, f"{t.describe()} is not made of whole packed blocks")
    found = fn(node, srcs, caps) or []
    for touch in touches(node, srcs, found):
        if touch.extent() > touch.tensor.nbytes:
            how = "its rows" if touch.stride is None else f"flat rows at {touch.stride}-byte steps"
            raise refuse(
                node,
                srcs,
                f"{touch.tensor.describe()}: the kernel addresses {how} "
                f"{touch.extent()} bytes from its start, past its {touch.tensor.nbytes}",
            )
    return [u for u in found if not isinstance(u, Touch)]
