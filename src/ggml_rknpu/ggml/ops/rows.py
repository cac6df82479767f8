"""GET_ROWS and SET_ROWS.

ggml-cpu/ops.cpp (llama.cpp 0c1e570):

* GET_ROWS: src0 ``[ne00, ne01, ne02, ne03]`` of any type (f32/f16/bf16/i32 or a block
  quant, dequantized with gguf), src1 int32 ``[ne10, ne11, ne12]`` (ne11 == ne02,
  ne12 == ne03); ``dst[:, i10, i11, i12] = src0[:, src1[i10, i11, i12], i11, i12]``,
  dst f32 (i32 for i32 src0).
* SET_ROWS: dst is a view of the target ``[ne0, ne1, ne02, ne03]``, src0 f32/f16 rows
  ``[ne0, ne01, ne02, ne03]``, src1 int32/int64 ``[ne01, ne11, ne12]`` broadcast over
  ne02/ne03 (``i02 % ne11``, ``i03 % ne12``); ``dst[:, src1[i, i02%ne11, i03%ne12], i02, i03]
  = src0[:, i, i02, i03]`` converted with the dst type's from_float (block quants via
  gguf's quantizer where it has one).
An index outside [0, rows) raises :class:`OpDataError` (ggml asserts).
"""

from __future__ import annotations

import numpy as np

from ggml_rknpu.ggml.enums import GgmlOp, GgmlType
from ggml_rknpu.ggml.ops.convert import (NON_BLOCK, bf16_to_f32, can_dequantize,
                                         can_quantize, dequantize_rows, f32_to_bf16,
                                         quantize_rows)
from ggml_rknpu.ggml.ops.registry import Closure, OpDataError, OpNode, noop


def _check_range(idx: np.ndarray, n: int, what: str) -> None:
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise OpDataError(f"{what}: row index outside [0, {n})")


def plan_get_rows(node: OpNode) -> Closure:
    src, idx_ref, dst = node.require(0), node.src(1), node.dst
    if src is None or idx_ref is None or idx_ref.type != GgmlType.I32:
        raise node.unsupported("GET_ROWS needs src0 and int32 indices")
    ne00, ne01, ne02, ne03 = src.ne
    ne10, ne11, ne12, _ = idx_ref.ne
    if (ne11, ne12) != (ne02, ne03) or dst.ne != (ne00, ne10, ne11, ne12):
        raise node.unsupported(f"shapes src0 {src.ne} idx {idx_ref.ne} dst {dst.ne} do not fit")
    if src.type not in NON_BLOCK and not can_dequantize(src.type):
        raise node.unsupported("gguf cannot dequantize this type")
    if dst.type not in NON_BLOCK:
        raise node.unsupported("GET_ROWS dst must be a plain type")
    table = src.as_array()                     # (ne03, ne02, ne01, ne00 | row_bytes)
    idx = idx_ref.as_array()[0]                # (ne12, ne11, ne10)
    d = dst.as_array()                         # (ne12, ne11, ne10, ne00)
    i3 = np.arange(ne03)[:, None, None]
    i2 = np.arange(ne02)[None, :, None]
    t = src.type
    out_bf16 = dst.type == GgmlType.BF16

    def run() -> None:
        _check_range(idx, ne01, "GET_ROWS")
        rows = table[i3, i2, idx]
        if t == GgmlType.BF16:
            rows = bf16_to_f32(rows) if not out_bf16 else rows
        elif t not in NON_BLOCK:
            rows = dequantize_rows(rows, t)
        if out_bf16 and t != GgmlType.BF16:
            rows = f32_to_bf16(rows)
        np.copyto(d, rows, casting="unsafe")
    return run


def plan_set_rows(node: OpNode) -> Closure:
    src, idx_ref, dst = node.require(0), node.src(1), node.dst
    if src is None or idx_ref is None or idx_ref.type not in (GgmlType.I32, GgmlType.I64):
        raise node.unsupported("SET_ROWS needs src0 and int32/int64 indices")
    if src.type not in (GgmlType.F32, GgmlType.F16):
        raise node.unsupported("SET_ROWS source rows must be f32 or f16")
    ne00, ne01, ne02, ne03 = src.ne
    ne10, ne11, ne12, _ = idx_ref.ne
    ne0, ne1, ne2, ne3 = dst.ne
    if ne0 != ne00 or (ne2, ne3) != (ne02, ne03) or ne10 != ne01 or ne02 % ne11 or ne03 % ne12:
        raise node.unsupported(f"shapes src0 {src.ne} idx {idx_ref.ne} dst {dst.ne} do not fit")
    quantized = dst.type not in NON_BLOCK
    if quantized and not can_quantize(dst.type):
        raise node.unsupported("gguf cannot quantize to this type")
    if src.nelements == 0:
        return noop                             # no rows to set
    rows = src.as_array()                       # (ne03, ne02, ne01, ne00)
    idx_all = idx_ref.as_array()[0]             # (ne12, ne11, ne10)
    i3 = np.arange(ne03)[:, None, None]
    i2 = np.arange(ne02)[None, :, None]
    idx_rows = ((np.arange(ne03) % ne12)[:, None], (np.arange(ne02) % ne11)[None, :])
    d = dst.as_array()                          # (ne3, ne2, ne1, ne0 | row_bytes)
    t = dst.type

    if quantized:
        def convert(r: np.ndarray) -> np.ndarray:
            return quantize_rows(r, t)
    elif t == GgmlType.BF16:
        def convert(r: np.ndarray) -> np.ndarray:
            return f32_to_bf16(r.astype(np.float32, copy=False))
    else:
        def convert(r: np.ndarray) -> np.ndarray:
            return r if r.dtype == d.dtype else r.astype(d.dtype)

    if ne02 == 1 and ne03 == 1:                 # one plane (a KV-cache write): plain row scatter
        d_plane, rows_plane, idx_plane = d[0, 0], rows[0, 0], idx_all[0, 0]

        def run_plane() -> None:
            _check_range(idx_plane, ne1, "SET_ROWS")
            d_plane[idx_plane] = convert(rows_plane)
        return run_plane

    def run() -> None:
        idx = idx_all[idx_rows]                 # (ne03, ne02, ne01)
        _check_range(idx, ne1, "SET_ROWS")
        d[i3, i2, idx] = convert(rows)
    return run


PLANNERS = {GgmlOp.GET_ROWS: plan_get_rows, GgmlOp.SET_ROWS: plan_set_rows}
