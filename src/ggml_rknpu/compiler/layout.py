"""Native NPU layouts of A, B and C, packed and unpacked with vectorised numpy
[docs/npu-programming.md §6].

* A [M, K]: NC1HWC2 with C2 = 16 / bytes: fp16 ``(Kp/8, M, 8)``, int8 ``(Kp/16, M, 16)``.
* B, ggml's [N, K]: fp16 ``(Np/16, Kc/32, 16, 32)``, int8 ``(Np/32, Kc/32, 32, 32)``, one
  contiguous block per K chunk (a task reads its weights as one run of WEIGHT_BYTES, §7).
* C: ``(k_splits, Np/C2, M, C2)``, C2 = 4 for fp32/int32, 8 for fp16; chunks summed here.

Invariant: padding channels (K -> Kp) and kernels (N -> Np) are zero [§6, §10]."""

from __future__ import annotations

import numpy as np

from ggml_rknpu.compiler.shape import MatmulShape
from ggml_rknpu.compiler.tiling import k_chunks
from ggml_rknpu.hw import limits
from ggml_rknpu.hw.envelope import PROVEN, Envelope

NUMPY_DTYPE = {"fp16": np.float16, "fp32": np.float32, "int8": np.int8, "int32": np.int32}


def partial_dtype(shape: MatmulShape, k_splits: int) -> str:
    """Precision the NPU writes C in. With a K split, fp16 output would round every
    partial sum; the chunks then write fp32 and the host rounds the total once."""
    if k_splits > 1 and shape.out == "fp16":
        return "fp32"
    return shape.out


def a_bytes(shape: MatmulShape) -> int:
    return shape.Kp * shape.M * shape.in_bytes


def b_bytes(shape: MatmulShape) -> int:
    return shape.Np * shape.Kp * shape.in_bytes


def c_bytes(shape: MatmulShape, k_splits: int) -> int:
    return k_splits * shape.Np * shape.M * limits.BYTES[partial_dtype(shape, k_splits)]


def _shape_of(program_or_shape, dtype: str, M: int | None, K: int, N: int | None) -> MatmulShape:
    if program_or_shape is None:
        out = "int32" if dtype == "int8" else "fp32"
        return MatmulShape(M or 1, K, N or 1, dtype, out)
    shape = getattr(program_or_shape, "shape", program_or_shape)
    if not isinstance(shape, MatmulShape):
        raise TypeError(f"expected a Program or MatmulShape, got {type(program_or_shape).__name__}")
    if shape.dtype != dtype:
        raise ValueError(f"dtype {dtype!r} does not match the program's {shape.dtype!r}")
    return shape


def _as_input(x: np.ndarray, dtype: str, what: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"{what} must be 2-D, got shape {x.shape}")
    if dtype == "fp16":
        if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
            raise ValueError(f"{what}: cannot convert {x.dtype} to fp16")
        return x.astype(np.float16, copy=False)
    if dtype == "int8":
        if x.dtype == np.int8:
            return x
        if not np.issubdtype(x.dtype, np.integer):
            raise ValueError(f"{what}: int8 matmul needs integer input, got {x.dtype} (quantize first)")
        if x.size and (x.min() < -128 or x.max() > 127):
            raise ValueError(f"{what}: values outside the int8 range [-128, 127]")
        return x.astype(np.int8)
    raise ValueError(f"unsupported input dtype {dtype!r}")


def _dest_bytes(out: np.ndarray | None, nbytes: int) -> np.ndarray:
    """The first ``nbytes`` of ``out`` (uint8, e.g. a mapped device buffer), or a new array."""
    if out is None:
        return np.empty(nbytes, np.uint8)
    if out.dtype != np.uint8 or out.size < nbytes:
        raise ValueError(f"out must be a uint8 array of >= {nbytes} bytes")
    return out.reshape(-1)[:nbytes]


def pack_a(a: np.ndarray, dtype: str, program_or_shape=None, *, out: np.ndarray | None = None) -> np.ndarray:
    """A [rows, K] -> native bytes (uint8, ``a_bytes``): ``(Kp/C2, M, C2)``.

    ``rows`` may be fewer than the program's M (an M-bucketed program): the missing rows
    are zero. ``out`` (uint8, >= ``a_bytes``), e.g. a mapped device buffer, is written in
    place instead of allocating."""
    x = _as_input(a, dtype, "A")
    shape = _shape_of(program_or_shape, dtype, x.shape[0], x.shape[1], None)
    rows = x.shape[0]
    if x.shape[1] != shape.K or rows > shape.M:
        raise ValueError(f"A has shape {x.shape}, the program expects at most ({shape.M}, {shape.K})")
    c2 = shape.c2_in
    nbytes = a_bytes(shape)
    dest_bytes = _dest_bytes(out, nbytes)
    dest = dest_bytes.view(x.dtype).reshape(shape.Kp // c2, shape.M, c2)
    full = shape.K // c2
    dest[:full, :rows] = x[:, : full * c2].reshape(rows, full, c2).transpose(1, 0, 2)
    rest = shape.K - full * c2
    if rest:
        dest[full, :rows, :rest] = x[:, full * c2:]
        dest[full, :rows, rest:] = 0
    dest[full + (1 if rest else 0):, :rows] = 0
    dest[:, rows:] = 0
    return dest_bytes


def pack_b(b_nk: np.ndarray, dtype: str, program_or_shape=None, *, out: np.ndarray | None = None,
           envelope: Envelope | str = PROVEN) -> np.ndarray:
    """B in ggml's [N, K] layout -> native bytes (uint8, ``b_bytes``), chunk by chunk
    ``(Np/g, Kc/32, g, 32)``: a Program's own K chunks, else those of ``envelope``.
    Independent of M. ``out`` (uint8, >= ``b_bytes``) is written in place, e.g. straight
    into a mapped device buffer."""
    x = _as_input(b_nk, dtype, "B")
    shape = _shape_of(program_or_shape, dtype, None, x.shape[1], x.shape[0])
    if x.shape != (shape.N, shape.K):
        raise ValueError(f"B has shape {x.shape}, the program expects [N, K] = ({shape.N}, {shape.K})")
    g, atom = shape.kernel_group, limits.K_ALIGN
    nbytes = b_bytes(shape)
    dest_bytes = _dest_bytes(out, nbytes)
    dest = dest_bytes.view(x.dtype)
    for chunk in getattr(program_or_shape, "k_chunks", ()) or k_chunks(shape.K, dtype, envelope):
        padded = np.zeros((shape.Np, chunk.size), dtype=x.dtype)
        real = x[:, chunk.k0: chunk.k0 + chunk.size]
        padded[: shape.N, : real.shape[1]] = real
        block = dest[shape.Np * chunk.k0: shape.Np * (chunk.k0 + chunk.size)]
        native = block.reshape(shape.Np // g, chunk.size // atom, g, atom)     # (n/g, k/32, n%g, k%32)
        native.transpose(0, 2, 1, 3)[...] = padded.reshape(shape.Np // g, g, chunk.size // atom, atom)
    return dest_bytes


def unpack_c(buf: np.ndarray, program, rows: int | None = None) -> np.ndarray:
    """Native C bytes -> [rows or M, N] (partials of a K split summed): float32 for fp32
    out, float16 for fp16 out, int32 for int32 out."""
    shape: MatmulShape = program.shape
    k_splits = program.k_splits
    rows = shape.M if rows is None else rows
    if not 0 <= rows <= shape.M:
        raise ValueError(f"rows must be 0..{shape.M}, got {rows}")
    pdt = partial_dtype(shape, k_splits)
    nbytes = c_bytes(shape, k_splits)
    raw = np.asarray(buf).reshape(-1).view(np.uint8)
    if raw.size < nbytes:
        raise ValueError(f"C buffer holds {raw.size} bytes, the program writes {nbytes}")
    c2 = limits.c2(pdt)
    vals = raw[:nbytes].view(NUMPY_DTYPE[pdt]).reshape(k_splits, shape.Np // c2, shape.M, c2)[:, :, :rows]
    # Partials are summed in the native layout and transposed once: the host touches each
    # partial once instead of copying all of them through a transpose (long K has 4-11).
    if k_splits == 1:
        total = vals[0]
    elif pdt == "int32":
        total = vals.sum(axis=0, dtype=np.int64).astype(np.int32)
    else:
        total = vals.sum(axis=0, dtype=np.float32)
    out = total.transpose(1, 0, 2).reshape(rows, shape.Np)[:, : shape.N]
    return np.ascontiguousarray(out, dtype=NUMPY_DTYPE[shape.out])
