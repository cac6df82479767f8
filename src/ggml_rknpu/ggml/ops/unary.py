"""UNARY (op_params[0] = ggml_unary_op) plus the plain elementwise ops SQR, SQRT, LOG, SIN,
COS, CLAMP and LEAKY_RELU, on f32 / f16 / bf16.

Formulas from ggml-cpu/unary-ops.cpp and vec.h (llama.cpp 0c1e570); every op computes in
f32 and converts to the dst type.  Numerics that differ from the plain formula:

* GELU uses a 65536-entry f16 table (vec.h ``GGML_GELU_FP16``): f32 input -> f16 -> table
  -> f32, with ``x <= -10 -> 0`` and ``x >= 10 -> x``; f16 input indexes the table
  directly; bf16 uses the exact tanh formula.
* GELU_QUICK likewise uses its f16 table (``GGML_GELU_QUICK_FP16``), without the clamps.
* GELU_ERF needs erf, which numpy lacks: a Chebyshev erfc fit (relative error < 1.2e-7)
  used so that the negative tail keeps its relative accuracy.
* The f16 tables are evaluated with numpy's f32 tanh/exp; where ``1 + tanh`` cancels
  (x < -3) an entry can differ from one built with glibc's tanhf by an f16 ulp.
* ROUND is C ``roundf`` (half away from zero), not numpy's half-to-even.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ggml_rknpu.ggml.enums import GgmlOp, GgmlType, GgmlUnaryOp
from ggml_rknpu.ggml.ops.convert import bf16_to_f32, f32_to_bf16
from ggml_rknpu.ggml.ops.registry import Closure, OpNode

Fn = Callable[[np.ndarray], np.ndarray]
F32, F16, BF16 = GgmlType.F32, GgmlType.F16, GgmlType.BF16

GELU_COEF_A = np.float32(0.044715)          # vec.h
GELU_QUICK_COEF = np.float32(-1.702)        # vec.h
SQRT_2_OVER_PI = np.float32(0.79788456080286535587989211986876)
SQRT_2_INV = 0.70710678118654752440084436210484


def gelu_f32(x: np.ndarray) -> np.ndarray:
    """ggml_gelu_f32, evaluated in f32."""
    x = x.astype(np.float32, copy=False)
    one, half = np.float32(1), np.float32(0.5)
    return half * x * (one + np.tanh(SQRT_2_OVER_PI * x * (one + GELU_COEF_A * x * x)))


def gelu_quick_f32(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32, copy=False)
    return x * (np.float32(1) / (np.float32(1) + np.exp(GELU_QUICK_COEF * x)))


def _f16_table(fn: Fn) -> np.ndarray:
    """ggml_table_*_f16: fn over every f16 bit pattern, stored as f16 (ggml-cpu.c init)."""
    with np.errstate(all="ignore"):
        return fn(np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)).astype(np.float16)


GELU_TABLE = _f16_table(gelu_f32)
GELU_QUICK_TABLE = _f16_table(gelu_quick_f32)


def gelu_table_f32(x: np.ndarray) -> np.ndarray:
    """ggml_vec_gelu_f32 with GGML_GELU_FP16."""
    x = x.astype(np.float32, copy=False)
    y = GELU_TABLE.take(x.astype(np.float16).view(np.uint16)).astype(np.float32)
    if (np.abs(x) >= 10.0).any():          # rare: only then pay for the clamps
        y = np.where(x >= 10.0, x, np.where(x <= -10.0, np.float32(0), y))
    return y


def gelu_quick_table_f32(x: np.ndarray) -> np.ndarray:
    return GELU_QUICK_TABLE.take(x.astype(np.float16).view(np.uint16)).astype(np.float32)


def erfc_abs(z: np.ndarray) -> np.ndarray:
    """erfc(|z|) with fractional error < 1.2e-7 everywhere (Numerical Recipes ``erfcc``,
    a Chebyshev fit), float64: keeps relative accuracy in the tail where 1 + erf(x)
    cancels for negative x."""
    z = np.abs(z)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (
            -0.82215223 + t * 0.17087277))))))))
    return t * np.exp(-z * z + poly)


def gelu_erf(x: np.ndarray) -> np.ndarray:
    """0.5 x (1 + erf(x/sqrt 2)), with 1 + erf(u) = erfc(-u) for u < 0 and 2 - erfc(u) else."""
    x64 = np.asarray(x, dtype=np.float64)
    c = erfc_abs(x64 * SQRT_2_INV)
    one_plus_erf = np.where(x64 < 0, c, 2.0 - c)
    return (0.5 * x64 * one_plus_erf).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32, copy=False)
    return x / (np.float32(1) + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return np.float32(1) / (np.float32(1) + np.exp(-x))


def _round_half_away(x: np.ndarray) -> np.ndarray:
    t = np.trunc(x)
    return t + np.where(np.abs(x - t) >= 0.5, np.sign(x), np.float32(0)).astype(x.dtype)


def _hardsigmoid(x: np.ndarray) -> np.ndarray:
    return np.minimum(np.float32(1), np.maximum(np.float32(0), (x + np.float32(3)) / np.float32(6)))


def _softplus(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.where(x > 20.0, x, np.log(np.float32(1) + np.exp(x)))


_UNARY_F32: dict[int, Fn] = {
    GgmlUnaryOp.ABS: np.abs,
    GgmlUnaryOp.SGN: lambda x: np.sign(x).astype(np.float32),
    GgmlUnaryOp.NEG: np.negative,
    GgmlUnaryOp.STEP: lambda x: (x > 0).astype(np.float32),
    GgmlUnaryOp.TANH: np.tanh,
    GgmlUnaryOp.ELU: lambda x: np.where(x > 0, x, np.expm1(np.minimum(x, 0))),
    GgmlUnaryOp.RELU: lambda x: np.where(x > 0, x, np.float32(0)),
    GgmlUnaryOp.SIGMOID: sigmoid,
    GgmlUnaryOp.GELU: gelu_table_f32,
    GgmlUnaryOp.GELU_QUICK: gelu_quick_table_f32,
    GgmlUnaryOp.SILU: silu,
    GgmlUnaryOp.HARDSWISH: lambda x: x * _hardsigmoid(x),
    GgmlUnaryOp.HARDSIGMOID: _hardsigmoid,
    GgmlUnaryOp.EXP: np.exp,
    GgmlUnaryOp.EXPM1: lambda x: np.exp(x) - np.float32(1),
    GgmlUnaryOp.SOFTPLUS: _softplus,
    GgmlUnaryOp.GELU_ERF: gelu_erf,
    GgmlUnaryOp.FLOOR: np.floor,
    GgmlUnaryOp.CEIL: np.ceil,
    GgmlUnaryOp.ROUND: _round_half_away,
    GgmlUnaryOp.TRUNC: np.trunc,
}

# f16 inputs whose ggml path differs from "to f32, fn, to f16": direct table lookups
_UNARY_F16_TABLE = {GgmlUnaryOp.GELU: GELU_TABLE, GgmlUnaryOp.GELU_QUICK: GELU_QUICK_TABLE}
# bf16 inputs use the exact formulas (no tables)
_UNARY_BF16: dict[int, Fn] = {GgmlUnaryOp.GELU: gelu_f32, GgmlUnaryOp.GELU_QUICK: gelu_quick_f32}


def _xielu(node: OpNode) -> Fn:
    alpha_n, alpha_p, beta, eps = (np.float32(node.param_f32(i)) for i in range(1, 5))

    def fn(x: np.ndarray) -> np.ndarray:
        neg = (np.expm1(np.minimum(x, eps)) - x) * alpha_n + beta * x
        return np.where(x > 0, alpha_p * x * x + beta * x, neg)
    return fn


def plan_elementwise(node: OpNode, fn: Fn, f16_table: np.ndarray | None = None,
                     bf16_fn: Fn | None = None) -> Closure:
    """dst = fn(src) elementwise with ggml's f32 compute and dst conversion."""
    src, dst = node.require(0), node.dst
    if src.type not in (F32, F16, BF16) or dst.type != src.type:
        raise node.unsupported("elementwise ops run on f32/f16/bf16 with dst of the same type")
    if src.ne != dst.ne:
        raise node.unsupported(f"src shape {src.ne} != dst shape {dst.ne}")
    x, d = src.as_array(), dst.as_array()
    if src.type == F32:
        def run() -> None:
            with np.errstate(all="ignore"):
                np.copyto(d, fn(x), casting="unsafe")
        return run
    if src.type == F16:
        if f16_table is not None:
            def run_table() -> None:
                d[...] = f16_table[x.view(np.uint16)]
            return run_table

        def run_f16() -> None:
            with np.errstate(all="ignore"):
                np.copyto(d, fn(x.astype(np.float32)), casting="unsafe")
        return run_f16
    fn_bf16 = bf16_fn or fn

    def run_bf16() -> None:
        with np.errstate(all="ignore"):
            d[...] = f32_to_bf16(fn_bf16(bf16_to_f32(x)))
    return run_bf16


def plan_unary(node: OpNode) -> Closure:
    op = node.param_i32(0)
    if op == GgmlUnaryOp.XIELU:
        return plan_elementwise(node, _xielu(node))
    fn = _UNARY_F32.get(op)
    if fn is None:
        raise node.unsupported("unknown unary op")
    return plan_elementwise(node, fn, _UNARY_F16_TABLE.get(op), _UNARY_BF16.get(op))


def _plan_simple(fn: Fn) -> Callable[[OpNode], Closure]:
    return lambda node: plan_elementwise(node, fn)


def _plan_clamp(node: OpNode) -> Closure:
    lo, hi = np.float32(node.param_f32(0)), np.float32(node.param_f32(1))
    return plan_elementwise(node, lambda x: np.minimum(np.maximum(x, lo), hi))


def _plan_leaky_relu(node: OpNode) -> Closure:
    slope = np.float32(node.param_f32(0))
    return plan_elementwise(node, lambda x: np.where(x > 0, x, slope * x))


PLANNERS = {
    GgmlOp.UNARY: plan_unary,
    GgmlOp.SQR: _plan_simple(np.square),
    GgmlOp.SQRT: _plan_simple(np.sqrt),
    GgmlOp.LOG: _plan_simple(np.log),
    GgmlOp.SIN: _plan_simple(np.sin),
    GgmlOp.COS: _plan_simple(np.cos),
    GgmlOp.CLAMP: _plan_clamp,
    GgmlOp.LEAKY_RELU: _plan_leaky_relu,
}
