"""The seam between the RPC server's graph plans and the host ops (docs/decisions.md contract G).

A graph node arrives as an :class:`OpNode` whose tensors are :class:`TensorRef` s: the
ggml geometry (type, ``ne``, ``nb``) plus a uint8 view of the bytes the tensor spans
inside its server buffer.  :func:`plan_op` decides everything once (views, dtypes,
broadcast shapes, parameters decoded from ``op_params``) and returns a closure that only
does the numpy work into the destination view; the server replays the closure for every
GRAPH_RECOMPUTE (about 470 nodes per decoded token), so planning cost is paid once.

Semantics follow the pinned ggml (llama.cpp 0c1e570, ggml-cpu/ops.cpp); each op family
lives in its own module and cites what it reproduces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ggml_rknpu.ggml.enums import TYPE_NAMES, TYPE_TRAITS, GgmlOp, GgmlType

Closure = Callable[[], None]

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


class UnsupportedOp(Exception):
    """The node cannot be run by the host ops; ``signature`` is what the server logs,
    e.g. ``ROPE(f32,i32)->f32 mode=8``."""

    def __init__(self, signature: str, reason: str = "") -> None:
        self.signature = signature
        self.reason = reason
        super().__init__(f"unsupported op {signature}" + (f": {reason}" if reason else ""))


class OpDataError(ValueError):
    """Raised by a planned closure when the data itself is invalid (e.g. a row index out
    of range); ggml would abort, the server logs it and closes the connection instead."""


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
    type: int
    ne: tuple[int, int, int, int]
    nb: tuple[int, int, int, int]
    raw: np.ndarray  # uint8 view of [data, data + span) inside its buffer

    @classmethod
    def in_buffer(cls, buf: np.ndarray, offset: int, type_: int, ne: tuple[int, ...],
                  nb: tuple[int, ...] | None = None) -> "TensorRef":
        """A tensor at ``offset`` of a uint8 buffer; ``nb`` defaults to contiguous."""
        ne4 = tuple(ne) + (1,) * (4 - len(ne))
        if nb is None:
            nb = contiguous_strides(type_, ne4)
        nb4 = tuple(nb)
        span = tensor_span(type_, ne4, nb4)
        if offset < 0 or offset + span > buf.size:
            raise ValueError(f"tensor [{offset}, {offset + span}) outside buffer of {buf.size} bytes")
        return cls(type_, ne4, nb4, buf[offset:offset + span])

    @property
    def quantized(self) -> bool:
        return self.type not in NUMPY_DTYPES

    @property
    def nelements(self) -> int:
        return int(np.prod(self.ne))

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


def contiguous_strides(type_: int, ne: tuple[int, ...]) -> tuple[int, int, int, int]:
    block, size = TYPE_TRAITS[GgmlType(type_)]
    nb0 = size
    nb1 = nb0 * (ne[0] // block)
    nb2 = nb1 * ne[1]
    nb3 = nb2 * ne[2]
    return (nb0, nb1, nb2, nb3)


@dataclass
class OpNode:
    op: int
    op_params: np.ndarray  # int32[16] raw
    dst: TensorRef
    srcs: tuple[TensorRef | None, ...]
    name: str = ""

    def src(self, i: int) -> TensorRef | None:
        return self.srcs[i] if i < len(self.srcs) else None

    def require(self, i: int) -> TensorRef:
        """Source i, which the op cannot do without (a malformed graph is unsupported)."""
        src = self.src(i)
        if src is None:
            raise self.unsupported(f"missing source {i}")
        return src

    def param_i32(self, i: int) -> int:
        return int(self.op_params[i])

    def param_f32(self, i: int) -> float:
        return float(np.asarray(self.op_params[i:i + 1], dtype=np.int32).view(np.float32)[0])

    def signature(self, extra: str = "") -> str:
        name = op_name(self.op)
        if self.op in (GgmlOp.UNARY, GgmlOp.GLU):
            from ggml_rknpu.ggml.enums import GgmlGluOp, GgmlUnaryOp
            enum = GgmlUnaryOp if self.op == GgmlOp.UNARY else GgmlGluOp
            sub = self.param_i32(0)
            try:
                name += ":" + enum(sub).name
            except ValueError:
                name += f":{sub}"
        srcs = ",".join(type_name(s.type) if s is not None else "-" for s in self.srcs)
        sig = f"{name}({srcs.rstrip(',-')})->{type_name(self.dst.type)}"
        return f"{sig} {extra}" if extra else sig

    def unsupported(self, reason: str, extra: str = "") -> UnsupportedOp:
        return UnsupportedOp(self.signature(extra), reason)


def noop() -> None:
    """View ops (and empty tensors) need no compute: their bytes are their source's."""


VIEW_OPS = frozenset({GgmlOp.NONE, GgmlOp.RESHAPE, GgmlOp.VIEW, GgmlOp.PERMUTE, GgmlOp.TRANSPOSE})

_PLANNERS: dict[int, Callable[[OpNode], Closure]] = {}


def _planners() -> dict[int, Callable[[OpNode], Closure]]:
    if not _PLANNERS:
        from ggml_rknpu.ggml.ops import (attention, binary, copy, glu, matmul, norm, rope, rows,
                                         scale, shape, softmax, unary)
        for module in (attention, binary, copy, glu, matmul, norm, rope, rows, scale, shape,
                       softmax, unary):
            _PLANNERS.update(module.PLANNERS)
    return _PLANNERS


def plan_op(node: OpNode) -> Closure:
    """Plan one node; raises :class:`UnsupportedOp` (with its signature) when the op, its
    types or its parameters are outside what the host ops implement."""
    if node.op in VIEW_OPS:
        return noop
    planner = _planners().get(node.op)
    if planner is None:
        raise node.unsupported("no host implementation of this op")
    if node.dst.nelements == 0:
        return noop
    try:
        return planner(node)
    except UnsupportedOp:
        raise
    except (ValueError, IndexError, KeyError, TypeError, NotImplementedError) as exc:
        raise node.unsupported(f"{type(exc).__name__}: {exc}") from exc
