"""Type conversion shared by the op families: ggml types <-> float32 numpy arrays.

ggml's CPU ops convert every element to f32, compute in f32 and convert the result to
the destination type (``type_conversion_table`` in ggml-cpu).  These helpers plan that
once per tensor: f32 views are used as they are; f16 goes through numpy's IEEE half
(round-to-nearest-even, as F16C does); bf16 is rebuilt from its upper 16 bits and
rounded back with ggml's rule (ggml-impl.h ``ggml_compute_fp32_to_bf16``); block-quantized
types go through ``gguf.quants`` (dequantize for reading, quantize for writing where gguf
implements it), except the formats :mod:`quants` codes itself (Q1_0, Q2_0, and Q8_0
targets quantized exactly as ggml-cpu does).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from ggml_rknpu.ggml.enums import GgmlType
from ggml_rknpu.ggml.ops.quants import DEQUANTIZERS, QUANTIZERS
from ggml_rknpu.ggml.ops.registry import TensorRef, UnsupportedOp

Reader = Callable[[], np.ndarray]

FLOAT_TYPES = frozenset({GgmlType.F32, GgmlType.F16, GgmlType.BF16})
INT_TYPES = frozenset({GgmlType.I8, GgmlType.I16, GgmlType.I32, GgmlType.I64})
NON_BLOCK = FLOAT_TYPES | INT_TYPES | {GgmlType.F64}   # one element per "block"


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """ggml_compute_fp32_to_bf16: round to nearest even; NaN kept quiet."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    out = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    if nan.any():
        out[nan] = ((u[nan] >> 16) | 64).astype(np.uint16)
    return out


def gguf_qtype(type_: int) -> GGMLQuantizationType:
    return GGMLQuantizationType(int(type_))


# gguf has no public "which types can you (de)quantize" query: its per-type classes live in
# ``quants._type_traits``, and only some of them define ``quantize_blocks``.
def can_dequantize(type_: int) -> bool:
    if type_ in DEQUANTIZERS:
        return True
    try:
        qt = gguf_qtype(type_)
    except ValueError:
        return False
    return qt in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) or qt in gguf_quants._type_traits


def can_quantize(type_: int) -> bool:
    if type_ in QUANTIZERS:
        return True
    try:
        qt = gguf_qtype(type_)
    except ValueError:
        return False
    cls = gguf_quants._type_traits.get(qt)
    return cls is not None and "quantize_blocks" in vars(cls)


def dequantize_rows(rows: np.ndarray, type_: int) -> np.ndarray:
    """uint8 rows (..., row_bytes) -> float32 (..., ne0)."""
    own = DEQUANTIZERS.get(type_)
    if own is not None:
        return own(rows)
    return gguf_quants.dequantize(np.ascontiguousarray(rows), gguf_qtype(type_)).astype(np.float32, copy=False)


def quantize_rows(x: np.ndarray, type_: int) -> np.ndarray:
    """float32 (..., ne0) -> uint8 rows (..., row_bytes)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    own = QUANTIZERS.get(type_)
    return own(x) if own is not None else gguf_quants.quantize(x, gguf_qtype(type_))


def to_f32(arr: np.ndarray, type_: int) -> np.ndarray:
    """A typed view (as_array) -> float32 values (the view itself for f32)."""
    if type_ == GgmlType.F32:
        return arr
    if type_ == GgmlType.BF16:
        return bf16_to_f32(arr)
    if type_ in NON_BLOCK:
        return arr.astype(np.float32)
    return dequantize_rows(arr, type_)



def reader(ref: TensorRef) -> Reader:
    """Plan reading a tensor as float32 in its logical shape ``ne[::-1]``."""
    view = ref.as_array()
    t = ref.type
    if t == GgmlType.F32:
        return lambda: view
    if t == GgmlType.BF16:
        return lambda: bf16_to_f32(view)
    if t in NON_BLOCK:
        return lambda: view.astype(np.float32)
    if not can_dequantize(t):
        raise UnsupportedOp(f"dequantize {t}", "gguf cannot dequantize this type")
    return lambda: dequantize_rows(view, t)


def split_repeat(bigs: tuple[np.ndarray, ...], small: np.ndarray) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """ggml's "src1 repeats over src0" broadcast (index ``i % ne1`` in every dim) as numpy
    broadcasting: each dim of size n where the small tensor has size m (1 < m < n, m | n)
    becomes (n//m, m) in the big views and (1, m) in the small one. Views only, no copies.
    ``bigs`` share one shape; raises ValueError when a dim does not divide."""
    shape_big: list[int] = []
    shape_small: list[int] = []
    strides_big: list[list[int]] = [[] for _ in bigs]
    strides_small: list[int] = []
    for axis, (n, m) in enumerate(zip(bigs[0].shape, small.shape)):
        if m == n or m == 1:
            shape_big.append(n)
            shape_small.append(m)
            for sb, b in zip(strides_big, bigs):
                sb.append(b.strides[axis])
            strides_small.append(small.strides[axis] if m > 1 else 0)
        elif m > 0 and n % m == 0:
            shape_big += [n // m, m]
            shape_small += [1, m]
            for sb, b in zip(strides_big, bigs):
                sb += [b.strides[axis] * m, b.strides[axis]]
            strides_small += [0, small.strides[axis]]
        else:
            raise ValueError(f"cannot repeat size {m} over {n} (axis {axis})")
    as_strided = np.lib.stride_tricks.as_strided
    big_views = tuple(as_strided(b, shape_big, sb) for b, sb in zip(bigs, strides_big))
    return big_views, as_strided(small, shape_small, strides_small)
