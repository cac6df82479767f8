"""Cheap data-movement and reduction ops outside the four target model graphs, for other
graphs llama.cpp may send: REPEAT, CONCAT, SUM, SUM_ROWS, MEAN, ARGMAX.

ggml-cpu/ops.cpp (llama.cpp 0c1e570):
* REPEAT: ``dst[i] = src[i % ne_src]`` in every dim (plain types, bytes copied).
* CONCAT (op_params int32 [dim]): src0 then src1 along ``dim``, same type; block types are
  joined as raw rows (dim 0 joins row bytes: whole blocks, as ggml's ``ne0/blck`` offset).
* SUM_ROWS / MEAN: per row over ne0 (f32), dst ne0 = 1; SUM: everything into one f32.
* ARGMAX: f32 rows -> int32 index of the first maximum (dst ne = [ne1]).
"""

from __future__ import annotations

import numpy as np

from ggml_rknpu.ggml.enums import GgmlOp, GgmlType
from ggml_rknpu.ggml.ops.convert import NON_BLOCK, split_repeat
from ggml_rknpu.ggml.ops.registry import Closure, OpNode


def plan_repeat(node: OpNode) -> Closure:
    src, dst = node.require(0), node.dst
    if src.type != dst.type or src.type not in NON_BLOCK:
        raise node.unsupported("REPEAT copies plain types to the same type")
    (d,), s = split_repeat((dst.as_array(),), src.as_array())

    def run() -> None:
        d[...] = s
    return run


def plan_concat(node: OpNode) -> Closure:
    a_ref, b_ref, dst = node.require(0), node.src(1), node.dst
    if b_ref is None or not (a_ref.type == b_ref.type == dst.type):
        raise node.unsupported("CONCAT joins two tensors of the dst type")
    dim = node.param_i32(0)
    if not 0 <= dim < 4:
        raise node.unsupported(f"dim {dim} outside 0..3")
    axis = 3 - dim
    expect = list(a_ref.ne)
    expect[dim] += b_ref.ne[dim]
    if tuple(expect) != dst.ne or any(a_ref.ne[i] != b_ref.ne[i] for i in range(4) if i != dim):
        raise node.unsupported(f"shapes {a_ref.ne} + {b_ref.ne} -> {dst.ne} along {dim}")
    a, b, d = a_ref.as_array(), b_ref.as_array(), dst.as_array()
    split = a.shape[axis]
    d_a = d[(slice(None),) * axis + (slice(0, split),)]
    d_b = d[(slice(None),) * axis + (slice(split, None),)]

    def run() -> None:
        a_values, b_values = a.copy(), b.copy()   # dst may alias a source
        d_a[...] = a_values
        d_b[...] = b_values
    return run


def _reduce_f32(node: OpNode, expect: tuple[int, int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    src, dst = node.require(0), node.dst
    if src.type != GgmlType.F32 or dst.type != GgmlType.F32:
        raise node.unsupported("reductions run on f32")
    if dst.ne != expect:
        raise node.unsupported(f"dst {dst.ne} != {expect}")
    return src.as_array(), dst.as_array()


def plan_sum_rows(node: OpNode) -> Closure:
    x, d = _reduce_f32(node, (1,) + node.require(0).ne[1:])

    def run() -> None:
        np.copyto(d, x.sum(axis=-1, keepdims=True, dtype=np.float64), casting="unsafe")
    return run


def plan_mean(node: OpNode) -> Closure:
    x, d = _reduce_f32(node, (1,) + node.require(0).ne[1:])

    def run() -> None:
        np.copyto(d, x.mean(axis=-1, keepdims=True, dtype=np.float64), casting="unsafe")
    return run


def plan_sum(node: OpNode) -> Closure:
    x, d = _reduce_f32(node, (1, 1, 1, 1))

    def run() -> None:
        d[...] = x.sum(dtype=np.float64)
    return run


def plan_argmax(node: OpNode) -> Closure:
    src, dst = node.require(0), node.dst
    if src.type != GgmlType.F32 or dst.type != GgmlType.I32:
        raise node.unsupported("ARGMAX maps f32 rows to int32")
    if src.ne[2:] != (1, 1) or dst.ne != (src.ne[1], 1, 1, 1):
        raise node.unsupported(f"ARGMAX of a matrix: src {src.ne} dst {dst.ne}")
    x, d = src.as_array()[0, 0], dst.as_array()[0, 0, 0]

    def run() -> None:
        d[...] = x.argmax(axis=-1)
    return run


PLANNERS = {
    GgmlOp.REPEAT: plan_repeat, GgmlOp.CONCAT: plan_concat, GgmlOp.SUM_ROWS: plan_sum_rows,
    GgmlOp.MEAN: plan_mean, GgmlOp.SUM: plan_sum, GgmlOp.ARGMAX: plan_argmax,
}
