"""Element-wise one-input ops: UNARY (op_params[0] picks the function), SQR, SQRT, LOG, SIN,
COS, CLAMP, LEAKY_RELU, and GLU (gated: act(x) * g, fused or split, swapped)."""

from __future__ import annotations

import math

from fleetd.compute.dequant import roundf
from fleetd.compute.ops import register
from fleetd.compute.ops.common import (
    FLOAT_TYPES,
    as_f32,
    f32_param,
    i32_param,
    quiet,
    require_types,
    round_f16,
    store,
    unsupported,
)
from fleetd.wire import GgmlOp, GluOp, UnaryOp

SQRT_2_OVER_PI = 0.7978845608028654
GELU_COEF_A = 0.044715
GELU_QUICK_COEF = -1.702


def erf(xp, x):
    """erf to ~1e-7 absolute (Abramowitz & Stegun 7.1.26); numpy has no erf of its own."""
    sign = xp.sign(x)
    a = xp.abs(x).astype(xp.float64)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return (sign * (1.0 - poly * xp.exp(-a * a))).astype(xp.float32)


def sigmoid(xp, x):
    return 1.0 / (1.0 + xp.exp(-x))


def gelu_exact(xp, x):
    return 0.5 * x * (1.0 + xp.tanh(SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)))


def gelu(xp, x):
    # The f32 CPU kernel reads a 64K-entry table of fp16(gelu(h)) at fp16(x), clamped at +-10.
    table = round_f16(xp, gelu_exact(xp, round_f16(xp, x)))
    return xp.where(x <= -10.0, 0.0, xp.where(x >= 10.0, x, table)).astype(xp.float32)


def gelu_quick(xp, x):
    # Same fp16 table trick as GELU, without the clamp.
    h = round_f16(xp, x)
    return round_f16(xp, h * (1.0 / (1.0 + xp.exp(GELU_QUICK_COEF * h))))


def gelu_erf(xp, x):
    return 0.5 * x * (1.0 + erf(xp, x * (1.0 / math.sqrt(2.0))))


def xielu(xp, x, node):
    alpha_n, alpha_p, beta, eps = (f32_param(node, i) for i in (1, 2, 3, 4))
    pos = alpha_p * x * x + beta * x
    neg = (xp.expm1(xp.minimum(x, eps)) - x) * alpha_n + beta * x
    return xp.where(x > 0, pos, neg)


# f(xp, x, node) -> f32 array, per ggml_unary_op value.
UNARY_FNS = {
    UnaryOp.ABS: lambda xp, x, n: xp.abs(x),
    UnaryOp.SGN: lambda xp, x, n: xp.sign(x),
    UnaryOp.NEG: lambda xp, x, n: -x,
    UnaryOp.STEP: lambda xp, x, n: (x > 0).astype(xp.float32),
    UnaryOp.TANH: lambda xp, x, n: xp.tanh(x),
    UnaryOp.ELU: lambda xp, x, n: xp.where(x > 0, x, xp.expm1(x)),
    UnaryOp.RELU: lambda xp, x, n: xp.maximum(x, 0),
    UnaryOp.SIGMOID: lambda xp, x, n: sigmoid(xp, x),
    UnaryOp.GELU: lambda xp, x, n: gelu(xp, x),
    UnaryOp.GELU_QUICK: lambda xp, x, n: gelu_quick(xp, x),
    UnaryOp.SILU: lambda xp, x, n: x * sigmoid(xp, x),
    UnaryOp.HARDSWISH: lambda xp, x, n: x * xp.clip((x + 3.0) / 6.0, 0.0, 1.0),
    UnaryOp.HARDSIGMOID: lambda xp, x, n: xp.clip((x + 3.0) / 6.0, 0.0, 1.0),
    UnaryOp.EXP: lambda xp, x, n: xp.exp(x),
    UnaryOp.EXPM1: lambda xp, x, n: xp.exp(x) - 1.0,
    UnaryOp.SOFTPLUS: lambda xp, x, n: xp.where(x > 20.0, x, xp.log1p(xp.exp(xp.minimum(x, 20.0)))),
    UnaryOp.GELU_ERF: lambda xp, x, n: gelu_erf(xp, x),
    UnaryOp.XIELU: xielu,
    UnaryOp.FLOOR: lambda xp, x, n: xp.floor(x),
    UnaryOp.CEIL: lambda xp, x, n: xp.ceil(x),
    UnaryOp.ROUND: lambda xp, x, n: roundf(xp, x),
    UnaryOp.TRUNC: lambda xp, x, n: xp.trunc(x),
}


def _elementwise(fn):
    def kernel(xp, dst, srcs, node, src_tensors):
        require_types(node, src_tensors, FLOAT_TYPES, FLOAT_TYPES)
        x = as_f32(xp, srcs[0], src_tensors[0])
        with quiet(xp):
            store(xp, dst, node, fn(xp, x, node))

    return kernel


def bind_unary(xp, node, src_tensors):
    """UNARY's function and its kernel, picked once by op_params[0]."""
    fn = UNARY_FNS.get(i32_param(node, 0))
    return _elementwise(fn) if fn is not None else None


@register(GgmlOp.UNARY, bind=bind_unary)
def op_unary(xp, dst, srcs, node, src_tensors):
    kernel = node.bound or bind_unary(xp, node, src_tensors)
    if kernel is None:
        raise unsupported(node, src_tensors, f"unary op {i32_param(node, 0)}")
    kernel(xp, dst, srcs, node, src_tensors)


op_sqr = register(GgmlOp.SQR)(_elementwise(lambda xp, x, n: x * x))
op_sqrt = register(GgmlOp.SQRT)(_elementwise(lambda xp, x, n: xp.sqrt(x)))
op_log = register(GgmlOp.LOG)(_elementwise(lambda xp, x, n: xp.log(x)))
op_sin = register(GgmlOp.SIN)(_elementwise(lambda xp, x, n: xp.sin(x)))
op_cos = register(GgmlOp.COS)(_elementwise(lambda xp, x, n: xp.cos(x)))
op_clamp = register(GgmlOp.CLAMP)(
    _elementwise(lambda xp, x, n: xp.maximum(xp.minimum(x, f32_param(n, 1)), f32_param(n, 0)))
)
op_leaky_relu = register(GgmlOp.LEAKY_RELU)(
    _elementwise(lambda xp, x, n: xp.maximum(x, 0) + f32_param(n, 0) * xp.minimum(x, 0))
)


def _swiglu_oai(xp, x, g, node):
    alpha, limit = f32_param(node, 2), f32_param(node, 3)
    x = xp.minimum(x, limit)
    g = xp.clip(g, -limit, limit)
    return x / (1.0 + xp.exp(-alpha * x)) * (g + 1.0)


def _swiglu_clamp(xp, x, g, node):
    limit = f32_param(node, 3)
    x = xp.minimum(x, limit)
    return x * sigmoid(xp, x) * xp.clip(g, -limit, limit)


# f(xp, x, g, node) -> act(x) * g, per ggml_glu_op value.
GLU_FNS = {
    GluOp.REGLU: lambda xp, x, g, n: xp.where(x > 0, x * g, 0.0),
    GluOp.GEGLU: lambda xp, x, g, n: gelu(xp, x) * g,
    GluOp.SWIGLU: lambda xp, x, g, n: x * sigmoid(xp, x) * g,
    GluOp.SWIGLU_OAI: _swiglu_oai,
    GluOp.GEGLU_ERF: lambda xp, x, g, n: gelu_erf(xp, x) * g,
    GluOp.GEGLU_QUICK: lambda xp, x, g, n: gelu_quick(xp, x) * g,
    GluOp.SWIGLU_CLAMP: _swiglu_clamp,
}


@register(GgmlOp.GLU, bind=lambda xp, node, src_tensors: GLU_FNS.get(i32_param(node, 0)))
def op_glu(xp, dst, srcs, node, src_tensors):
    """GLU: act(x) * g, from two sources or the halves of one (swapped by op_params[1])."""
    fn = node.bound or GLU_FNS.get(i32_param(node, 0))
    if fn is None:
        raise unsupported(node, src_tensors, f"glu op {i32_param(node, 0)}")
    require_types(node, src_tensors, FLOAT_TYPES, *[FLOAT_TYPES] * len(src_tensors))
    a = as_f32(xp, srcs[0], src_tensors[0])
    if len(src_tensors) > 1:
        x, g = a, as_f32(xp, srcs[1], src_tensors[1])
    else:
        n = node.ne[0]
        x, g = a[..., :n], a[..., n : 2 * n]
        if i32_param(node, 1):
            x, g = g, x
    with quiet(xp):
        store(xp, dst, node, fn(xp, x, g, node))
