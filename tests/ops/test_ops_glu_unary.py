"""UNARY ops and GLU (fused and split, swapped, f32/f16/bf16) against scalar references,
including ggml's f16 GELU lookup table numerics."""

from __future__ import annotations

import math

import numpy as np
import pytest
from support.ops_helpers import BF16, F16, F32, alloc, fill, node, padded, params, random, values

from ggml_rknpu.ggml.enums import GgmlGluOp, GgmlOp, GgmlUnaryOp
from ggml_rknpu.ggml.ops.registry import plan_op


def gelu_tanh(x: float) -> float:
    return 0.5 * x * (1 + math.tanh(math.sqrt(2 / math.pi) * x * (1 + 0.044715 * x * x)))


def gelu_quick(x: float) -> float:
    return x / (1 + math.exp(-1.702 * x))


def gelu_tanh_f32(x: float) -> float:
    """ggml_gelu_f32 in f32 arithmetic, as the table is built (cancels like ggml's for x < -3)."""
    f = np.float32
    x = f(x)
    return float(f(0.5) * x * (f(1) + np.tanh(f(0.7978845608) * x * (f(1) + f(0.044715) * x * x))))


def gelu_quick_f32(x: float) -> float:
    f = np.float32
    x = f(x)
    return float(x * (f(1) / (f(1) + np.exp(f(-1.702) * x))))


def via_f16_table(fn, x: float, clamp: bool) -> float:
    """ggml's f32 GELU: round x to f16, look up fn(x16) rounded to f16."""
    if clamp and x <= -10:
        return 0.0
    if clamp and x >= 10:
        return x
    return float(np.float16(fn(float(np.float16(x)))))


SCALAR = {
    GgmlUnaryOp.ABS: abs, GgmlUnaryOp.NEG: lambda x: -x,
    GgmlUnaryOp.SGN: lambda x: float(np.sign(x)), GgmlUnaryOp.STEP: lambda x: 1.0 if x > 0 else 0.0,
    GgmlUnaryOp.TANH: math.tanh, GgmlUnaryOp.ELU: lambda x: x if x > 0 else math.expm1(x),
    GgmlUnaryOp.RELU: lambda x: max(x, 0.0), GgmlUnaryOp.SIGMOID: lambda x: 1 / (1 + math.exp(-x)),
    GgmlUnaryOp.SILU: lambda x: x / (1 + math.exp(-x)),
    GgmlUnaryOp.HARDSWISH: lambda x: x * min(1.0, max(0.0, (x + 3) / 6)),
    GgmlUnaryOp.HARDSIGMOID: lambda x: min(1.0, max(0.0, (x + 3) / 6)),
    GgmlUnaryOp.EXP: math.exp, GgmlUnaryOp.EXPM1: math.expm1,
    GgmlUnaryOp.SOFTPLUS: lambda x: x if x > 20 else math.log1p(math.exp(x)),
    GgmlUnaryOp.GELU_ERF: lambda x: 0.5 * x * (1 + math.erf(x / math.sqrt(2))),
    GgmlUnaryOp.FLOOR: math.floor, GgmlUnaryOp.CEIL: math.ceil,
    GgmlUnaryOp.ROUND: lambda x: math.copysign(math.floor(abs(x) + 0.5), x), GgmlUnaryOp.TRUNC: math.trunc,
}


def rounded(x: np.ndarray, t: int) -> np.ndarray:
    if t == F16:
        return x.astype(np.float16).astype(np.float64)
    if t == BF16:
        bits = x.astype(np.float32).view(np.uint32)
        return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    return x


TOL = {F32: dict(rtol=2e-6, atol=2e-7), F16: dict(rtol=1e-3, atol=1e-4), BF16: dict(rtol=8e-3, atol=1e-3)}


@pytest.mark.parametrize("t", [F32, F16, BF16])
@pytest.mark.parametrize("op", list(SCALAR))
def test_unary_ops(t, op):
    rng = np.random.default_rng(20)
    ne = (5, 7, 3, 2)
    x, d = padded(t, ne), alloc(t, ne)
    xv = random(x, rng, -4, 4)
    xv.flat[:4] = [0.5, -0.5, 2.5, -1.5]                     # ROUND ties go away from zero
    fill(x, xv)
    xv = values(x)
    plan_op(node(GgmlOp.UNARY, d, x, op_params=params(int(op))))()
    want = rounded(np.vectorize(SCALAR[op])(xv), t)
    np.testing.assert_allclose(values(d), want, **TOL[t])


@pytest.mark.parametrize("t", [F32, F16, BF16])
@pytest.mark.parametrize("op", [GgmlUnaryOp.GELU, GgmlUnaryOp.GELU_QUICK])
def test_gelu_uses_ggml_f16_table(t, op):
    rng = np.random.default_rng(21)
    x, d = alloc(t, (64, 3)), alloc(t, (64, 3))
    xv = random(x, rng, -12, 12)
    plan_op(node(GgmlOp.UNARY, d, x, op_params=params(int(op))))()
    fn = gelu_tanh if op == GgmlUnaryOp.GELU else gelu_quick
    if t == BF16:       # bf16 uses the exact formula
        want = rounded(np.vectorize(fn)(xv), t)
        np.testing.assert_allclose(values(d), want, **TOL[t])
    else:
        clamp = op == GgmlUnaryOp.GELU and t == F32
        fn32 = gelu_tanh_f32 if op == GgmlUnaryOp.GELU else gelu_quick_f32
        want = np.vectorize(lambda v: via_f16_table(fn32, v, clamp))(xv)
        np.testing.assert_array_equal(values(d), rounded(want, t))
        # and the table is ggml's exact GELU to f16 precision
        exact = np.vectorize(lambda v: via_f16_table(fn, v, clamp))(xv)
        np.testing.assert_allclose(values(d), rounded(exact, t), rtol=1e-3, atol=1e-6)


def test_other_elementwise_ops():
    rng = np.random.default_rng(22)
    x, d = alloc(F32, (9, 4)), alloc(F32, (9, 4))
    xv = random(x, rng, 0.1, 3)
    for op, fn, p in [(GgmlOp.SQR, np.square, ()), (GgmlOp.SQRT, np.sqrt, ()), (GgmlOp.LOG, np.log, ()),
                      (GgmlOp.SIN, np.sin, ()), (GgmlOp.COS, np.cos, ()),
                      (GgmlOp.CLAMP, lambda v: np.clip(v, 0.5, 2.0), (0.5, 2.0))]:
        plan_op(node(op, d, x, op_params=params(*p)))()
        np.testing.assert_allclose(values(d), fn(xv), rtol=2e-6)


GLU_SCALAR = {
    GgmlGluOp.REGLU: lambda a, b: (a if a > 0 else 0.0) * b,
    GgmlGluOp.SWIGLU: lambda a, b: a / (1 + math.exp(-a)) * b,
    GgmlGluOp.GEGLU_ERF: lambda a, b: 0.5 * a * (1 + math.erf(a / math.sqrt(2))) * b,
}


@pytest.mark.parametrize("t", [F32, F16, BF16])
@pytest.mark.parametrize("op", [GgmlGluOp.REGLU, GgmlGluOp.SWIGLU, GgmlGluOp.GEGLU_ERF,
                                GgmlGluOp.GEGLU, GgmlGluOp.GEGLU_QUICK])
@pytest.mark.parametrize("form", ["fused", "swapped", "split"])
def test_glu(t, op, form):
    rng = np.random.default_rng(23)
    nc = 6
    if form == "split":
        a_ref, b_ref = padded(t, (nc, 3, 2)), alloc(t, (nc, 3, 2))
        av, bv = random(a_ref, rng, -3, 3), random(b_ref, rng, -3, 3)
        srcs = (a_ref, b_ref)
    else:
        x = padded(t, (2 * nc, 3, 2))
        xv = random(x, rng, -3, 3)
        av, bv = xv[..., :nc], xv[..., nc:]
        if form == "swapped":
            av, bv = bv, av
        srcs = (x,)
    d = alloc(t, (nc, 3, 2))
    plan_op(node(GgmlOp.GLU, d, *srcs, op_params=params(int(op), int(form == "swapped"))))()
    if op in GLU_SCALAR:
        fn = GLU_SCALAR[op]
    else:
        base = gelu_tanh if op == GgmlGluOp.GEGLU else gelu_quick
        if t != BF16:
            base = gelu_tanh_f32 if op == GgmlGluOp.GEGLU else gelu_quick_f32
        if t == BF16:
            def fn(a, b):
                return base(a) * b
        else:
            clamp = op == GgmlGluOp.GEGLU and t == F32

            def fn(a, b):
                return via_f16_table(base, a, clamp) * b
    want = rounded(np.vectorize(fn)(av, bv), t)
    np.testing.assert_allclose(values(d), want, **TOL[t])


@pytest.mark.parametrize("alpha,limit", [(1.702, 7.0), (0.5, 2.0)])
def test_swiglu_oai_and_clamp(alpha, limit):
    rng = np.random.default_rng(24)
    x, d = alloc(F32, (16, 3)), alloc(F32, (8, 3))
    xv = random(x, rng, -9, 9)
    a, b = xv[..., :8], xv[..., 8:]
    plan_op(node(GgmlOp.GLU, d, x, op_params=params(int(GgmlGluOp.SWIGLU_OAI), 0, alpha, limit)))()
    xa, yb = np.minimum(a, limit), np.clip(b, -limit, limit)
    np.testing.assert_allclose(values(d), xa / (1 + np.exp(-alpha * xa)) * (yb + 1), rtol=2e-6, atol=1e-6)
    plan_op(node(GgmlOp.GLU, d, x, op_params=params(int(GgmlGluOp.SWIGLU_CLAMP), 0, 0.0, limit)))()
    np.testing.assert_allclose(values(d), xa / (1 + np.exp(-xa)) * yb, rtol=2e-6, atol=1e-6)
