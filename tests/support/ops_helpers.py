"""Builders for host-op tests: ggml tensors in uint8 buffers (as the RPC server holds
them), ggml-style views (permute, padded rows), op_params packing, and independent
readers of ggml types into float64 for reference computations."""

from __future__ import annotations

import numpy as np

from ggml_rknpu.ggml.enums import GgmlType
from ggml_rknpu.ggml.ops.registry import OpNode, TensorRef, contiguous_strides, tensor_span

F32, F16, BF16, I32, I64 = GgmlType.F32, GgmlType.F16, GgmlType.BF16, GgmlType.I32, GgmlType.I64


def alloc(type_: int, ne: tuple[int, ...], nb: tuple[int, ...] | None = None,
          offset: int = 16) -> TensorRef:
    """A tensor at ``offset`` of its own buffer (guard bytes before and after)."""
    ne4 = tuple(ne) + (1,) * (4 - len(ne))
    nb4 = tuple(nb) if nb is not None else contiguous_strides(type_, ne4)
    buf = np.full(offset + tensor_span(type_, ne4, nb4) + 64, 0xAB, np.uint8)
    return TensorRef.in_buffer(buf, offset, type_, ne4, nb4)


def padded(type_: int, ne: tuple[int, ...], pad_rows: int = 3) -> TensorRef:
    """Rows further apart than their length: non-contiguous in dims 1..3."""
    ne4 = tuple(ne) + (1,) * (4 - len(ne))
    item = contiguous_strides(type_, ne4)[0]
    nb1 = (ne4[0] + pad_rows) * item
    nb = (item, nb1, nb1 * ne4[1] + 8 * item, (nb1 * ne4[1] + 8 * item) * ne4[2])
    return alloc(type_, ne4, nb)


def permute(ref: TensorRef, axes: tuple[int, int, int, int]) -> TensorRef:
    """ggml_permute: source dim i becomes dim axes[i]."""
    ne = [0] * 4
    nb = [0] * 4
    for i, a in enumerate(axes):
        ne[a] = ref.ne[i]
        nb[a] = ref.nb[i]
    return TensorRef(ref.type, tuple(ne), tuple(nb), ref.raw)


def permuted(type_: int, ne: tuple[int, ...], axes: tuple[int, int, int, int]) -> TensorRef:
    """A tensor of logical shape ``ne`` that is a permutation of a contiguous one."""
    ne4 = tuple(ne) + (1,) * (4 - len(ne))
    storage = [0] * 4
    for i, a in enumerate(axes):
        storage[i] = ne4[a]
    return permute(alloc(type_, tuple(storage)), axes)


def fill(ref: TensorRef, values: np.ndarray) -> None:
    """Store float values (logical shape ne[::-1]) with the tensor's type."""
    view = ref.as_array()
    values = np.broadcast_to(np.asarray(values, np.float64), view.shape)
    if ref.type == BF16:
        bits = np.asarray(values, np.float32).view(np.uint32)
        view[...] = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    else:
        view[...] = values.astype(view.dtype)


def random(ref: TensorRef, rng: np.random.Generator, lo: float = -1.0, hi: float = 1.0) -> np.ndarray:
    """Fill with uniform values and return them as float64 exactly as stored."""
    fill(ref, rng.uniform(lo, hi, ref.ne[::-1]))
    return values(ref)


def values(ref: TensorRef) -> np.ndarray:
    """Read a plain-typed tensor into float64 (logical shape)."""
    view = ref.as_array()
    if ref.type == BF16:
        return (view.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return view.astype(np.float64)


def params(*items: int | float) -> np.ndarray:
    """op_params int32[16]: ints stored as int32, floats bit-cast from f32."""
    out = np.zeros(16, np.int32)
    for i, item in enumerate(items):
        if isinstance(item, float):
            out[i] = np.array([item], np.float32).view(np.int32)[0]
        else:
            out[i] = item
    return out


def node(op: int, dst: TensorRef, *srcs: TensorRef | None, op_params: np.ndarray | None = None) -> OpNode:
    return OpNode(int(op), op_params if op_params is not None else params(), dst, tuple(srcs), "t")
