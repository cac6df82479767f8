"""GLU: ``dst = act(a) * b`` (op_params int32 ``[glu_op, swapped]``, f32 ``[2] alpha,
[3] limit`` for SWIGLU_OAI / SWIGLU_CLAMP).

ggml-cpu/ops.cpp ``ggml_compute_forward_swiglu_f32`` and siblings (llama.cpp 0c1e570):
with one source the row holds both halves, ``a = x[:nc]``, ``b = x[nc:]`` (nc = ne0/2),
exchanged when ``swapped``; with two sources (``ggml_glu_split``) a = src0, b = src1.
Activations and their f16/bf16 numerics are those of :mod:`unary` (vec.h):
REGLU ``a > 0 ? a*b : 0``; GEGLU the f16 GELU table (f32: with the ±10 clamps; f16: direct;
bf16: exact formula); GEGLU_QUICK its table; GEGLU_ERF erf; SWIGLU ``a/(1+e^-a) * b``;
SWIGLU_OAI ``x = min(a, limit)``, ``y = clamp(b, ±limit)``, ``x/(1+e^(-alpha x)) * (y+1)``;
SWIGLU_CLAMP ``min(a, limit)`` silu'd times ``clamp(b, ±limit)``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ggml_rknpu.ggml.enums import GgmlGluOp, GgmlOp, GgmlType
from ggml_rknpu.ggml.ops.convert import bf16_to_f32, f32_to_bf16
from ggml_rknpu.ggml.ops.registry import Closure, OpNode
from ggml_rknpu.ggml.ops.unary import (GELU_QUICK_TABLE, GELU_TABLE, gelu_erf, gelu_f32,
                                        gelu_quick_f32, gelu_quick_table_f32, gelu_table_f32,
                                        silu)

Glu = Callable[[np.ndarray, np.ndarray], np.ndarray]
F32, F16, BF16 = GgmlType.F32, GgmlType.F16, GgmlType.BF16


def _act(fn: Callable[[np.ndarray], np.ndarray]) -> Glu:
    return lambda a, b: fn(a) * b


def _glu_fns(node: OpNode, op: int, type_: int) -> Glu:
    if op == GgmlGluOp.REGLU:
        return lambda a, b: np.where(a > 0, a * b, np.float32(0))
    if op == GgmlGluOp.GEGLU:
        return _act(gelu_f32 if type_ == BF16 else gelu_table_f32)
    if op == GgmlGluOp.GEGLU_QUICK:
        return _act(gelu_quick_f32 if type_ == BF16 else gelu_quick_table_f32)
    if op == GgmlGluOp.GEGLU_ERF:
        return _act(gelu_erf)
    if op == GgmlGluOp.SWIGLU:
        return _act(silu)
    limit = np.float32(node.param_f32(3))
    if op == GgmlGluOp.SWIGLU_OAI:
        alpha = np.float32(node.param_f32(2))

        def oai(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            x = np.minimum(a, limit)
            y = np.clip(b, -limit, limit)
            return x / (np.float32(1) + np.exp(alpha * -x)) * (y + np.float32(1))
        return oai
    if op == GgmlGluOp.SWIGLU_CLAMP:
        return lambda a, b: silu(np.minimum(a, limit)) * np.clip(b, -limit, limit)
    raise node.unsupported("unknown glu op")


# f16 paths that look the activation up directly in the f16 table
_F16_TABLES = {GgmlGluOp.GEGLU: GELU_TABLE, GgmlGluOp.GEGLU_QUICK: GELU_QUICK_TABLE}


def plan_glu(node: OpNode) -> Closure:
    src0, src1, dst = node.require(0), node.src(1), node.dst
    op = node.param_i32(0)
    swapped = node.param_i32(1) != 0
    t = src0.type
    if t not in (F32, F16, BF16) or dst.type != t or (src1 is not None and src1.type != t):
        raise node.unsupported("GLU runs on f32/f16/bf16 with all tensors of one type")
    if op in (GgmlGluOp.SWIGLU_OAI,) and t != F32:
        raise node.unsupported("SWIGLU_OAI is f32 only in ggml-cpu")
    x = src0.as_array()
    if src1 is None:
        nc = src0.ne[0] // 2
        a, b = x[..., :nc], x[..., nc:2 * nc]
        if swapped:
            a, b = b, a
    else:
        nc = src0.ne[0]
        a, b = x, src1.as_array()
        if src1.ne != src0.ne:
            raise node.unsupported(f"split GLU sources differ: {src0.ne} vs {src1.ne}")
    if dst.ne != (nc,) + src0.ne[1:]:
        raise node.unsupported(f"dst shape {dst.ne} != {(nc,) + src0.ne[1:]}")
    d = dst.as_array()
    fn = _glu_fns(node, op, t)
    table = _F16_TABLES.get(op) if t == F16 else None
    if t == F32:
        def run() -> None:
            with np.errstate(all="ignore"):
                np.copyto(d, fn(a, b), casting="unsafe")
        return run
    if t == F16:
        if table is not None:
            def run_table() -> None:
                np.multiply(table[a.view(np.uint16)], b, out=d, dtype=np.float32, casting="unsafe")
            return run_table

        def run_f16() -> None:
            with np.errstate(all="ignore"):
                np.copyto(d, fn(a.astype(np.float32), b.astype(np.float32)), casting="unsafe")
        return run_f16

    def run_bf16() -> None:
        with np.errstate(all="ignore"):
            d[...] = f32_to_bf16(fn(bf16_to_f32(a), bf16_to_f32(b)))
    return run_bf16


PLANNERS = {GgmlOp.GLU: plan_glu}
