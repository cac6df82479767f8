"""SCALE: ``dst = src * s + b`` (op_params f32 [s, b]).

ggml-cpu/ops.cpp ``ggml_compute_forward_scale_f32`` (f32, an FMA when b != 0) and
``_bf16`` (computed in f32, rounded to bf16).  Here b != 0 is a multiply then an add: at
most one f32 ulp away from the fused result.
"""

from __future__ import annotations

import numpy as np

from ggml_rknpu.ggml.enums import GgmlOp, GgmlType
from ggml_rknpu.ggml.ops.convert import bf16_to_f32, f32_to_bf16
from ggml_rknpu.ggml.ops.registry import Closure, OpNode


def plan_scale(node: OpNode) -> Closure:
    src, dst = node.require(0), node.dst
    if src.type != dst.type or src.type not in (GgmlType.F32, GgmlType.BF16):
        raise node.unsupported("SCALE runs on f32 or bf16 with dst of the same type")
    if src.ne != dst.ne:
        raise node.unsupported(f"src shape {src.ne} != dst shape {dst.ne}")
    s = np.float32(node.param_f32(0))
    b = np.float32(node.param_f32(1))
    x, d = src.as_array(), dst.as_array()
    if src.type == GgmlType.BF16:
        def run_bf16() -> None:
            d[...] = f32_to_bf16(bf16_to_f32(x) * s + b)
        return run_bf16
    if b == 0:
        def run() -> None:
            np.multiply(x, s, out=d)
        return run

    def run_bias() -> None:
        np.multiply(x, s, out=d)
        np.add(d, b, out=d)
    return run_bias


PLANNERS = {GgmlOp.SCALE: plan_scale}
