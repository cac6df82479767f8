"""ADD, SUB, MUL, DIV with ggml broadcasting.

ggml-cpu/binary-ops.cpp: ``dst[i] = op(f32(src0[i]), f32(src1[i % ne1]))`` per dim (src1
repeats over src0/dst, ``ggml_can_repeat``), converted to the dst type.  Type sets as in
``binary_op``: all f32, all f16, all bf16, bf16+f32->bf16|f32, f16+f32->f16|f32.
numpy's half arithmetic is "convert to float, op, round", which is exactly ggml's f16 path.
"""

from __future__ import annotations

import numpy as np

from ggml_rknpu.ggml.enums import GgmlOp, GgmlType
from ggml_rknpu.ggml.ops.convert import bf16_to_f32, f32_to_bf16, split_repeat
from ggml_rknpu.ggml.ops.registry import Closure, OpNode

F32, F16, BF16 = GgmlType.F32, GgmlType.F16, GgmlType.BF16

_UFUNCS = {GgmlOp.ADD: np.add, GgmlOp.SUB: np.subtract, GgmlOp.MUL: np.multiply, GgmlOp.DIV: np.divide}

# (src0, src1, dst) type combinations ggml-cpu implements
_TYPES = {
    (F32, F32, F32), (F16, F16, F16), (BF16, BF16, BF16),
    (BF16, F32, BF16), (BF16, F32, F32), (F16, F32, F16), (F16, F32, F32),
}


def plan_binary(node: OpNode) -> Closure:
    src0, src1, dst = node.require(0), node.require(1), node.dst
    if (src0.type, src1.type, dst.type) not in _TYPES:
        raise node.unsupported("type combination not implemented by ggml-cpu")
    if src0.ne != dst.ne:
        raise node.unsupported(f"src0 shape {src0.ne} != dst shape {dst.ne}")
    ufunc = _UFUNCS[node.op]
    (a, d), b = split_repeat((src0.as_array(), dst.as_array()), src1.as_array())
    if BF16 not in (src0.type, src1.type, dst.type):
        def run() -> None:
            ufunc(a, b, out=d, casting="unsafe")
        return run

    a_f32 = (lambda: bf16_to_f32(a)) if src0.type == BF16 else (lambda: a)
    b_f32 = (lambda: bf16_to_f32(b)) if src1.type == BF16 else (lambda: b)
    if dst.type == BF16:
        def run_bf16() -> None:
            d[...] = f32_to_bf16(ufunc(a_f32(), b_f32()))
        return run_bf16

    def run_to_f32() -> None:
        ufunc(a_f32(), b_f32(), out=d)
    return run_to_f32


PLANNERS = {op: plan_binary for op in _UFUNCS}
