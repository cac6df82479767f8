"""CPY, DUP, CONT: copy src0's elements, in logical (row-major over ne) order, into dst
with its own shape, strides and type.

ggml-cpu/ops.cpp ``ggml_compute_forward_dup`` (llama.cpp 0c1e570): element counts match,
shapes need not (a CPY may reshape); values pass through f32 unless both types are the
same, in which case bytes are copied (same here: no float round trip for i32 or f16).
Block-quantized sources are dequantized and targets quantized with gguf (targets only where
gguf has a quantizer); a same-type quantized copy moves whole rows when ne0 agrees.
"""

from __future__ import annotations

import numpy as np

from ggml_rknpu.ggml.enums import GgmlOp, GgmlType
from ggml_rknpu.ggml.ops.convert import (NON_BLOCK, bf16_to_f32, can_dequantize, can_quantize,
                                         dequantize_rows, f32_to_bf16, quantize_rows)
from ggml_rknpu.ggml.ops.registry import Closure, OpNode


def plan_copy(node: OpNode) -> Closure:
    src, dst = node.require(0), node.dst
    if src.nelements != dst.nelements:
        raise node.unsupported(f"element counts differ: {src.ne} vs {dst.ne}")
    st, dt = src.type, dst.type
    s, d = src.as_array(), dst.as_array()
    d_shape = d.shape   # for block types: (ne3, ne2, ne1, row_bytes), rows move whole
    if st == dt and (st in NON_BLOCK or src.ne[0] == dst.ne[0]):
        if s.shape == d_shape:
            def run_same() -> None:
                np.copyto(d, s)
            return run_same

        def run_same_reshape() -> None:
            np.copyto(d, s.reshape(d_shape))
        return run_same_reshape

    if st == GgmlType.BF16:
        def read() -> np.ndarray:
            return bf16_to_f32(s)
    elif st in NON_BLOCK:
        def read() -> np.ndarray:
            return s
    elif can_dequantize(st):
        def read() -> np.ndarray:
            return dequantize_rows(s, st)
    else:
        raise node.unsupported("gguf cannot dequantize the source type")

    values_shape = dst.ne[::-1]
    if dt == GgmlType.BF16:
        def run_bf16() -> None:
            d[...] = f32_to_bf16(read().astype(np.float32, copy=False).reshape(values_shape))
        return run_bf16
    if dt in NON_BLOCK:
        def run() -> None:
            np.copyto(d, read().reshape(values_shape), casting="unsafe")
        return run
    if not can_quantize(dt):
        raise node.unsupported("gguf cannot quantize to the destination type")

    def run_quantize() -> None:
        d[...] = quantize_rows(read().astype(np.float32, copy=False).reshape(values_shape), dt)
    return run_quantize


PLANNERS = {GgmlOp.CPY: plan_copy, GgmlOp.DUP: plan_copy, GgmlOp.CONT: plan_copy}
