"""What the graph planner and the validator share: names, the two errors, tensor views.

The host ops themselves are ggml-cpu's (``libggml``); what stays here is the vocabulary
around them: op and type names for signatures, :class:`UnsupportedOp` (a node no rule
admits: the connection is closed with its signature), :class:`OpDataError` (data that
would make ggml abort, e.g. a row index out of range, found before the segment runs), and
:class:`TensorRef`, the typed numpy view of a tensor's bytes that NPU steps and index
checks read through.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggml_rknpu.libggml.enums import TYPE_NAMES, TYPE_TRAITS, GgmlOp, GgmlType

# numpy storage dtype per non-block ggml type; bf16 is stored (and viewed) as raw uint16.
NUMPY_DTYPES: dict[int, type[np.generic]] = {
    GgmlType.F32: np.float32,
    GgmlType.F16: np.float16,
    GgmlType.BF16: np.uint16,
    GgmlType.F64: np.float64,
    GgmlType.I8: np.int8,
    GgmlType.I16: np.int16,
    GgmlType.I32: np.int32,
    GgmlType.I64: np.int64,
}

# Ops that compute nothing: their bytes are their source's (ggml_op_is_empty)
VIEW_OPS = frozenset({GgmlOp.NONE, GgmlOp.RESHAPE, GgmlOp.VIEW, GgmlOp.PERMUTE, GgmlOp.TRANSPOSE})


class UnsupportedOp(Exception):
    """No rule admits the node; ``signature`` is what the server logs, e.g. ``ROPE(f32,i32)->f32``."""

    def __init__(self, signature: str, reason: str = "") -> None:
        self.signature = signature
        self.reason = reason
        super().__init__(f"unsupported op {signature}" + (f": {reason}" if reason else ""))


class OpDataError(ValueError):
    """The data itself is invalid (e.g. a row index out of range): ggml would abort, the
    server logs it and closes the connection instead."""


def op_name(op: int) -> str:
    try:
        return GgmlOp(op).name
    except ValueError:
        return f"op{op}"


def type_name(t: int) -> str:
    try:
        return TYPE_NAMES[GgmlType(t)]
    except ValueError:
        return f"type{t}"


def tensor_span(type_: int, ne: tuple[int, ...], nb: tuple[int, ...]) -> int:
    """Bytes a tensor touches from its data pointer (ggml_nbytes); 0 for empty tensors."""
    if any(n <= 0 for n in ne):
        return 0
    block, size = TYPE_TRAITS[GgmlType(type_)]
    if block == 1:
        span = size
        for n, b in zip(ne, nb):
            span += (n - 1) * b
        return span
    span = ne[0] * nb[0] // block
    for n, b in zip(ne[1:], nb[1:]):
        span += (n - 1) * b
    return span


@dataclass
class TensorRef:
    """A tensor's geometry and a uint8 view of [data, data + span) inside its buffer."""

    type: int
    ne: tuple[int, int, int, int]
    nb: tuple[int, int, int, int]
    raw: np.ndarray

    @property
    def quantized(self) -> bool:
        return self.type not in NUMPY_DTYPES

    def row_bytes(self) -> int:
        block, size = TYPE_TRAITS[GgmlType(self.type)]
        return self.ne[0] // block * size

    def as_array(self) -> np.ndarray:
        """Typed strided view, shape ``ne[::-1]`` and strides ``nb[::-1]`` (bf16 as uint16).
        Block-quantized types: the raw rows, shape ``(ne3, ne2, ne1, row_bytes)``."""
        if self.quantized:
            shape = (self.ne[3], self.ne[2], self.ne[1], self.row_bytes())
            strides = (self.nb[3], self.nb[2], self.nb[1], 1)
            dtype: type[np.generic] = np.uint8
        else:
            shape, strides, dtype = self.ne[::-1], self.nb[::-1], NUMPY_DTYPES[self.type]
        if self.raw.size == 0 or 0 in shape:
            return np.zeros(shape, dtype)
        # np.ndarray(buffer=...) checks that the strided extent lies inside raw
        return np.ndarray(shape, dtype, buffer=self.raw, offset=0, strides=strides)
