"""Block formats the host ops encode/decode themselves instead of through gguf: Q1_0 and
Q2_0 (new in this ggml, absent from gguf-py), Q8_0 encoding (gguf's rounding differs
from ggml-cpu's) and Q8_0 decoding (gguf's values, faster).  Layouts and formulas from
ggml-common.h / ggml-quants.c and ggml-cpu/arch/x86/quants.c (llama.cpp 0c1e570); rows are
uint8 ``(..., row_bytes)``.

* Q8_0 (32 values, 34 bytes): f16 ``d = amax/127``, int8 ``q = round_half_even(x*127/amax)``
  (the x86 ``quantize_row_q8_0`` that KV-cache writes use; gguf follows the ``_ref``
  variant, ``x*(1/d)`` with ties away from zero, which differs on exact ties).
* Q1_0 (128 values, 18 bytes): f16 ``d = sum|x| / 128`` (f32, summed in order), bit j of
  the 16 bytes (little-endian within a byte) set when ``x_j >= 0``; value ``bit ? d : -d``.
* Q2_0 (64 values, 18 bytes): f16 ``d = amax``, 2-bit ``q = clamp(roundf(x/d) + 1, 0, 3)``
  at bits ``2*(j%4)`` of byte ``j/4``; value ``(q - 1) * d``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ggml_rknpu.ggml.enums import GgmlType


def _blocks(x: np.ndarray, size: int) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).reshape(*x.shape[:-1], x.shape[-1] // size, size)


def _block_rows(rows: np.ndarray, block_bytes: int) -> np.ndarray:
    rows = np.ascontiguousarray(rows)
    return rows.reshape(*rows.shape[:-1], rows.shape[-1] // block_bytes, block_bytes)


def _scales(blocks: np.ndarray) -> np.ndarray:
    """f16 scale of each block (first two bytes) as f32, shape (..., n_blocks, 1)."""
    return blocks[..., :2].copy().view(np.float16).astype(np.float32)


def _pack(d: np.ndarray, payload: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    out = np.empty(payload.shape[:-1] + (2 + payload.shape[-1],), np.uint8)
    out[..., :2] = d.astype(np.float16).view(np.uint8)
    out[..., 2:] = payload
    return out.reshape(*shape[:-1], -1)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    b = _blocks(x, 32)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(b * inv).astype(np.int8)
    return _pack(amax / np.float32(127), q.view(np.uint8), x.shape)


def dequantize_q8_0(rows: np.ndarray) -> np.ndarray:
    """``d * q`` in float32, the values gguf's Q8_0 decoder gives, without its generic
    per-group machinery (8x faster on a 262k x 640 output head)."""
    blocks = _block_rows(rows, 34)
    return (_scales(blocks) * blocks[..., 2:].view(np.int8)).reshape(*rows.shape[:-1], -1)


def quantize_q1_0(x: np.ndarray) -> np.ndarray:
    b = _blocks(x, 128)
    d = np.cumsum(np.abs(b), axis=-1, dtype=np.float32)[..., -1:] / np.float32(128)
    bits = np.packbits(b >= 0, axis=-1, bitorder="little")
    return _pack(d, bits, x.shape)


def dequantize_q1_0(rows: np.ndarray) -> np.ndarray:
    blocks = _block_rows(rows, 18)
    d = _scales(blocks)
    bits = np.unpackbits(blocks[..., 2:], axis=-1, bitorder="little")
    values = np.where(bits == 1, d, -d)
    return values.reshape(*rows.shape[:-1], -1)


def quantize_q2_0(x: np.ndarray) -> np.ndarray:
    b = _blocks(x, 64)
    d = np.abs(b).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    v = (b * inv).astype(np.float64)                      # roundf: half away from zero
    q = np.clip(np.trunc(v + np.copysign(0.5, v)) + 1, 0, 3).astype(np.uint8)
    q = q.reshape(*q.shape[:-1], 16, 4)
    packed = q[..., 0] | (q[..., 1] << 2) | (q[..., 2] << 4) | (q[..., 3] << 6)
    return _pack(d, packed, x.shape)


def dequantize_q2_0(rows: np.ndarray) -> np.ndarray:
    blocks = _block_rows(rows, 18)
    d = _scales(blocks)
    qs = blocks[..., 2:, None] >> np.array([0, 2, 4, 6], np.uint8)
    q = (qs & 3).reshape(*qs.shape[:-2], 64).astype(np.float32)
    return ((q - 1) * d).reshape(*rows.shape[:-1], -1)


QUANTIZERS: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    GgmlType.Q8_0: quantize_q8_0, GgmlType.Q1_0: quantize_q1_0, GgmlType.Q2_0: quantize_q2_0,
}
DEQUANTIZERS: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    GgmlType.Q8_0: dequantize_q8_0, GgmlType.Q1_0: dequantize_q1_0, GgmlType.Q2_0: dequantize_q2_0,
}
