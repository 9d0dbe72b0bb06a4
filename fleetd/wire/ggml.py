"""ggml enums and type traits as the pinned llama.cpp (ggml 0.25.3, RPC protocol 7) defines them.

Values are wire values: they travel in `rpc_tensor.type`, `rpc_tensor.op` and `op_params`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class GgmlType(enum.IntEnum):
    """`ggml_type` values (`rpc_tensor.type`); the removed values are left out."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41
    Q2_0 = 42


GGML_TYPE_COUNT = 43


@dataclass(frozen=True, slots=True)
class TypeTraits:
    """A type's block: `blck_size` elements stored in `type_size` bytes."""

    blck_size: int  # elements per block
    type_size: int  # bytes per block


# (blck_size, type_size) per type; the removed values 4, 5, 31-33, 36-38 are absent (block size 0).
TYPE_TRAITS: dict[int, TypeTraits] = {
    t: TypeTraits(b, s)
    for t, b, s in [
        (0, 1, 4),
        (1, 1, 2),
        (2, 32, 18),
        (3, 32, 20),
        (6, 32, 22),
        (7, 32, 24),
        (8, 32, 34),
        (9, 32, 36),
        (10, 256, 84),
        (11, 256, 110),
        (12, 256, 144),
        (13, 256, 176),
        (14, 256, 210),
        (15, 256, 292),
        (16, 256, 66),
        (17, 256, 74),
        (18, 256, 98),
        (19, 256, 50),
        (20, 32, 18),
        (21, 256, 110),
        (22, 256, 82),
        (23, 256, 136),
        (24, 1, 1),
        (25, 1, 2),
        (26, 1, 4),
        (27, 1, 8),
        (28, 1, 8),
        (29, 256, 56),
        (30, 1, 2),
        (34, 256, 54),
        (35, 256, 66),
        (39, 32, 17),
        (40, 64, 36),
        (41, 128, 18),
        (42, 64, 18),
    ]
}


def type_name(t: int) -> str:
    try:
        return GgmlType(t).name
    except ValueError:
        return f"type {t}"


def op_name(op: int) -> str:
    """A wire op number's GgmlOp name, or "op N" past the enum."""
    try:
        return GgmlOp(op).name
    except ValueError:
        return f"op {op}"


class GgmlOp(enum.IntEnum):
    """`ggml_op` values (`rpc_tensor.op`), in header order up to GGML_OP_COUNT."""

    NONE = 0
    DUP = 1
    ADD = 2
    ADD_ID = 3
    ADD1 = 4
    ACC = 5
    SUB = 6
    MUL = 7
    DIV = 8
    SQR = 9
    SQRT = 10
    LOG = 11
    SIN = 12
    COS = 13
    SUM = 14
    SUM_ROWS = 15
    CUMSUM = 16
    MEAN = 17
    ARGMAX = 18
    COUNT_EQUAL = 19
    REPEAT = 20
    REPEAT_BACK = 21
    CONCAT = 22
    SILU_BACK = 23
    NORM = 24
    RMS_NORM = 25
    RMS_NORM_BACK = 26
    GROUP_NORM = 27
    L2_NORM = 28
    MUL_MAT = 29
    MUL_MAT_ID = 30
    OUT_PROD = 31
    SCALE = 32
    SET = 33
    CPY = 34
    CONT = 35
    RESHAPE = 36
    VIEW = 37
    PERMUTE = 38
    TRANSPOSE = 39
    GET_ROWS = 40
    GET_ROWS_BACK = 41
    SET_ROWS = 42
    DIAG = 43
    DIAG_MASK_INF = 44
    DIAG_MASK_ZERO = 45
    SOFT_MAX = 46
    SOFT_MAX_BACK = 47
    ROPE = 48
    ROPE_BACK = 49
    CLAMP = 50
    CONV_TRANSPOSE_1D = 51
    IM2COL = 52
    IM2COL_BACK = 53
    IM2COL_3D = 54
    COL2IM_1D = 55
    CONV_2D = 56
    CONV_3D = 57
    CONV_2D_DW = 58
    CONV_TRANSPOSE_2D = 59
    POOL_1D = 60
    POOL_2D = 61
    POOL_2D_BACK = 62
    UPSCALE = 63
    PAD = 64
    PAD_REFLECT_1D = 65
    ROLL = 66
    ARANGE = 67
    TIMESTEP_EMBEDDING = 68
    ARGSORT = 69
    TOP_K = 70
    LEAKY_RELU = 71
    TRI = 72
    FILL = 73
    FLASH_ATTN_EXT = 74
    FLASH_ATTN_BACK = 75
    SSM_CONV = 76
    SSM_SCAN = 77
    WIN_PART = 78
    WIN_UNPART = 79
    GET_REL_POS = 80
    ADD_REL_POS = 81
    RWKV_WKV6 = 82
    GATED_LINEAR_ATTN = 83
    RWKV_WKV7 = 84
    SOLVE_TRI = 85
    GATED_DELTA_NET = 86
    LIGHTNING_INDEXER = 87
    DSV4_HC_COMB = 88
    DSV4_HC_PRE = 89
    DSV4_HC_POST = 90
    UNARY = 91
    MAP_CUSTOM1 = 92
    MAP_CUSTOM2 = 93
    MAP_CUSTOM3 = 94
    CUSTOM = 95
    CROSS_ENTROPY_LOSS = 96
    CROSS_ENTROPY_LOSS_BACK = 97
    OPT_STEP_ADAMW = 98
    OPT_STEP_SGD = 99
    GLU = 100


GGML_OP_COUNT = 101

# Ops that only describe memory another tensor owns: never computed.
METADATA_OPS = frozenset({GgmlOp.NONE, GgmlOp.RESHAPE, GgmlOp.VIEW, GgmlOp.PERMUTE, GgmlOp.TRANSPOSE})


class UnaryOp(enum.IntEnum):
    """`ggml_unary_op` values, in `op_params[0]` of a UNARY node."""

    ABS = 0
    SGN = 1
    NEG = 2
    STEP = 3
    TANH = 4
    ELU = 5
    RELU = 6
    SIGMOID = 7
    GELU = 8
    GELU_QUICK = 9
    SILU = 10
    HARDSWISH = 11
    HARDSIGMOID = 12
    EXP = 13
    EXPM1 = 14
    SOFTPLUS = 15
    GELU_ERF = 16
    XIELU = 17
    FLOOR = 18
    CEIL = 19
    ROUND = 20
    TRUNC = 21


class GluOp(enum.IntEnum):
    """`ggml_glu_op` values, in `op_params[0]` of a GLU node."""

    REGLU = 0
    GEGLU = 1
    SWIGLU = 2
    SWIGLU_OAI = 3
    GEGLU_ERF = 4
    GEGLU_QUICK = 5
    SWIGLU_CLAMP = 6


class TensorFlag(enum.IntFlag):
    """`rpc_tensor.flags` bits; a graph node without COMPUTE is not computed."""

    INPUT = 1
    OUTPUT = 2
    PARAM = 4
    LOSS = 8
    COMPUTE = 16


# ggml.h's limits, defined once: rpc_tensor's layout and ggml/lib.py's ctypes structs use them
GGML_MAX_DIMS = 4
GGML_MAX_SRC = 10
GGML_MAX_OP_PARAMS = 64
GGML_MAX_NAME = 64


def nbytes(type_: int, ne: tuple[int, ...], nb: tuple[int, ...]) -> int:
    """ggml_nbytes: the extent from the first to one past the last byte addressed."""
    # Straight-line arithmetic: every SET/GET_TENSOR computes this (generators cost 1 us).
    ne0, ne1, ne2, ne3 = ne
    if ne0 <= 0 or ne1 <= 0 or ne2 <= 0 or ne3 <= 0:
        return 0
    nb0, nb1, nb2, nb3 = nb
    rest = (ne1 - 1) * nb1 + (ne2 - 1) * nb2 + (ne3 - 1) * nb3
    tr = TYPE_TRAITS[type_]
    if tr.blck_size == 1:
        return tr.type_size + (ne0 - 1) * nb0 + rest
    return ne0 * nb0 // tr.blck_size + rest


def contiguous_strides(type_: int, ne: tuple[int, ...]) -> tuple[int, int, int, int]:
    tr = TYPE_TRAITS[type_]
    nb0 = tr.type_size
    nb1 = nb0 * (ne[0] // tr.blck_size)
    nb2 = nb1 * ne[1]
    return (nb0, nb1, nb2, nb2 * ne[2])


def row_size(type_: int, n: int) -> int:
    tr = TYPE_TRAITS[type_]
    return tr.type_size * n // tr.blck_size
