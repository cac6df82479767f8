"""Validator rules for the ops that reduce, reshape, move or select: SUM ... ARGMAX, REPEAT,
CONCAT, PAD, TRI, DIAG_MASK_*, ARANGE, TIMESTEP_EMBEDDING, ROLL, DIAG; GET_ROWS and SET_ROWS (whose
index sources are range-checked at run time: :class:`Index`), CPY, DUP, CONT; ARGSORT, TOP_K.
Enum-valued op_params are checked against the pinned ggml's tables. Why rules as data: docs/decisions.md "server/ops/rules.py"."""

from __future__ import annotations

import math

from ggml_rknpu.libggml import abi
from ggml_rknpu.libggml.enums import GgmlOp
from ggml_rknpu.server.ops import geometry as geo
from ggml_rknpu.server.ops.rulekit import (
    ANY,
    BF16,
    DST,
    F16,
    F32,
    FLOAT,
    I8,
    I16,
    I32,
    I64,
    OPERAND_ONLY,
    QUANTIZED,
    Index,
    Node,
    RpcTensor,
    Rule,
    dst_is,
    finite,
    is_type,
    like,
    need,
    unit_strides,
)
from ggml_rknpu.server.ops.vocabulary import type_name

# src0 types of GET_ROWS (ops.cpp ggml_compute_forward_get_rows): every quantized type with a to_float
GET_ROWS_TYPES = frozenset({F32, F16, BF16, I32} | (QUANTIZED - OPERAND_ONLY))
# float -> float conversions of the dup kernels (ops.cpp ggml_compute_forward_dup)
DUP_FLOAT = frozenset({(F16, F16), (F16, BF16), (F16, F32), (BF16, F16), (BF16, BF16), (BF16, F32),
                       (F32, F16), (F32, BF16), (F32, F32), (F32, I32), (I32, F32)})
# types whose concat kernel follows every stride (concat_f32 / concat_f16 / concat_i8); the rest: concat_any
CONCAT_STRIDED = frozenset({F32, I32, F16, BF16, I16, I8})
TRI_TYPES = frozenset({abi.GGML_TRI_TYPE_UPPER_DIAG, abi.GGML_TRI_TYPE_UPPER, abi.GGML_TRI_TYPE_LOWER_DIAG,
                       abi.GGML_TRI_TYPE_LOWER})
SORT_ORDERS = frozenset({abi.GGML_SORT_ORDER_ASC, abi.GGML_SORT_ORDER_DESC})


# --- reductions, shapes -------------------------------------------------------------------------
def sum_all(n: Node) -> None:
    is_type(n.s(0), FLOAT, "sum src0")
    dst_is(n, n.s(0).type, (1, 1, 1, 1))


def sum_rows(n: Node) -> None:
    a = n.s(0)
    is_type(a, F32, "sum_rows src0")
    dst_is(n, F32, (1, *a.ne[1:]), contiguous=False)


def mean(n: Node) -> None:
    a = n.s(0)
    is_type(a, F32, "mean src0")
    dst_is(n, F32, (1, *a.ne[1:]), contiguous=False)


def cumsum(n: Node) -> None:
    is_type(n.s(0), F32, "cumsum src0")
    like(n)


def argmax(n: Node) -> None:
    a = n.s(0)
    is_type(a, F32, "argmax src0")
    need(geo.is_matrix(a) and a.ne[0] < 1 << 31, "argmax takes a matrix")
    dst_is(n, I32, (a.ne[1], 1, 1, 1))


def count_equal(n: Node) -> None:
    a, b = n.s(0), n.s(1)
    is_type(a, I32, "count_equal src0")
    is_type(b, I32, "count_equal src1")
    need(geo.are_same_shape(a, b), "count_equal needs equal shapes")
    dst_is(n, I64, (1, 1, 1, 1))


def repeat(n: Node) -> None:
    a = n.s(0)
    is_type(a, frozenset({F16, BF16, I16, F32, I32}), "repeat src0")
    unit_strides(n, "repeat", 0, DST)           # ggml_compute_forward_repeat_* assert nb00, nb0
    need(geo.can_repeat(a, n.dst), f"src0 {a.ne} does not repeat into dst {n.dst.ne}")
    need(n.dst.type == a.type, "repeat keeps the type")


def concat(n: Node) -> None:
    a, b = n.s(0), n.s(1)
    dim = n.i32(0)
    need(0 <= dim < 4, f"concat dim {dim} out of range")
    need(a.type == b.type, "concat needs equal types")
    if a.type not in CONCAT_STRIDED:                     # concat_any copies whole rows of blocks
        need(geo.is_contiguous_rows(a) and geo.is_contiguous_rows(b), "concat of this type needs contiguous rows")
    ne = []
    for d in range(4):
        if d == dim:
            ne.append(a.ne[d] + b.ne[d])
        else:
            need(a.ne[d] == b.ne[d], f"concat shapes differ in dim {d}")
            ne.append(a.ne[d])
    dst_is(n, a.type, tuple(ne), contiguous=False)


def pad(n: Node) -> None:
    a = n.s(0)
    is_type(a, F32, "pad src0")
    lp = [n.i32(2 * d) for d in range(4)]
    rp = [n.i32(2 * d + 1) for d in range(4)]
    need(all(x >= 0 for x in lp + rp), "pad amounts must be >= 0")
    circular = n.i32(8)
    need(circular in (0, 1), "pad 'circular' must be 0 or 1")
    if circular:
        need(all(lp[d] <= a.ne[d] and rp[d] <= a.ne[d] for d in range(4)), "circular pad wider than the tensor")
    dst_is(n, F32, tuple(a.ne[d] + lp[d] + rp[d] for d in range(4)))


def tri(n: Node) -> None:
    a = n.s(0)
    is_type(a, F32, "tri src0")
    need(n.i32(0) in TRI_TYPES, "tri type out of range")
    need(geo.is_contiguous(a) and a.ne[0] == a.ne[1], "tri takes contiguous square matrices")
    like(n, contiguous=True)


def diag_mask(n: Node) -> None:
    a = n.s(0)
    is_type(a, F32, "diag_mask src0")
    need(n.i32(0) >= 0, "diag_mask n_past must be >= 0")
    need(geo.is_contiguous(a), "diag_mask needs a contiguous src0")
    like(n, contiguous=True)


def arange(n: Node) -> None:
    start, stop, step = n.f32(0), n.f32(1), n.f32(2)
    for x, w in ((start, "start"), (stop, "stop"), (step, "step")):
        finite(x, f"arange {w}")
    need(stop > start and step > 0, "arange needs stop > start and step > 0")
    steps = math.ceil((stop - start) / step)
    dst_is(n, F32, (steps, 1, 1, 1))


def timestep_embedding(n: Node) -> None:
    a = n.s(0)
    is_type(a, F32, "timestep_embedding src0")
    need(geo.is_vector(a), "timesteps are a vector")
    dim = n.i32(0)
    need(dim >= 1, "timestep_embedding dim >= 1")
    dst_is(n, F32, (dim + dim % 2, a.ne[0], 1, 1))


def roll(n: Node) -> None:
    a = n.s(0)
    is_type(a, F32, "roll src0")
    need(all(abs(n.i32(d)) < a.ne[d] for d in range(4)), "roll shifts must be smaller than the dims")
    like(n)                                  # ggml_wrap_index wraps once: |shift| < ne is what keeps it inside


def diag(n: Node) -> None:
    a = n.s(0)
    is_type(a, F32, "diag src0")
    need(a.ne[1] == 1, "diag takes a row vector")
    unit_strides(n, "diag", 0, DST)             # ggml_compute_forward_diag_f32 asserts nb00, nb0
    dst_is(n, F32, (a.ne[0], a.ne[0], a.ne[2], a.ne[3]), contiguous=False)


# --- rows, copies -------------------------------------------------------------------------------
def get_rows(n: Node) -> list[Index]:
    a, b = n.s(0), n.s(1)
    is_type(a, GET_ROWS_TYPES, "get_rows src0")
    is_type(b, I32, "get_rows indices")
    need(a.ne[2] == b.ne[1] and a.ne[3] == b.ne[2] and b.ne[3] == 1, "get_rows shapes do not fit")
    out = I32 if a.type == I32 else F32
    if a.type in (F16, BF16) and n.dst.type == a.type:
        out = a.type                                  # the f16/bf16 kernels also write their own type
    dst_is(n, out, (a.ne[0], b.ne[0], b.ne[1], b.ne[2]), contiguous=False)
    return [(1, a.ne[1])]


def set_rows(n: Node) -> list[Index]:
    b, c, a = n.s(0), n.s(1), n.s(2)             # ggml_set_rows: src0 = rows, src1 = indices, src2 = target
    is_type(b, frozenset({F32, F16}), "set_rows rows")
    is_type(c, frozenset({I64, I32}), "set_rows indices")
    need(a.ne[0] == b.ne[0] and a.ne[2] == b.ne[2] and a.ne[3] == b.ne[3] and b.ne[1] == c.ne[0]
         and c.ne[1] >= 1 and c.ne[2] >= 1 and b.ne[2] % c.ne[1] == 0 and b.ne[3] % c.ne[2] == 0 and c.ne[3] == 1,
         "set_rows shapes do not fit")
    need(geo.is_contiguous_rows(a) and geo.is_contiguous_rows(b), "set_rows needs contiguous rows")
    _view_of(n, a)
    if n.dst.type in QUANTIZED:
        need(b.ne[0] % geo.block_size(n.dst) == 0, "set_rows rows are not whole blocks")
    return [(1, a.ne[1])]


def _view_of(n: Node, target: RpcTensor) -> None:
    d = n.dst
    need(d.type == target.type and tuple(d.ne) == tuple(target.ne) and tuple(d.nb) == tuple(target.nb),
         "dst must be a view of its target (same type, shape and strides)")


def copy(n: Node) -> None:
    """CPY (into src1, a view) and DUP/CONT (a new tensor of src0's shape)."""
    a = n.s(0)
    if n.dst.op == GgmlOp.CPY:
        _view_of(n, n.s(1))
        need(geo.nelements(a) == geo.nelements(n.dst), "cpy needs equal element counts")
    elif n.dst.op == GgmlOp.CONT:                  # ggml_cont_4d: a new contiguous shape, same elements
        need(n.dst.type == a.type and geo.nelements(a) == geo.nelements(n.dst) and geo.is_contiguous(n.dst),
             "cont makes a contiguous tensor of src0's type and element count")
    else:
        like(n)
    src, dst = a.type, n.dst.type
    if src == dst:
        if src in QUANTIZED:
            # dup_bytes copies quantized rows whole (equal shapes, nb0 = block bytes), all at once
            # (both contiguous) or block by block (a strided dst). Its remaining branch, a contiguous
            # dst of another shape, sizes rows as ne00 * block bytes: it would write 32x past the
            # dst (q4_0), so that combination is refused.
            rows = geo.are_same_shape(a, n.dst) and a.nb[0] == geo.type_size(a) == n.dst.nb[0]
            need(rows or (geo.is_contiguous(a) and geo.is_contiguous(n.dst)) or not geo.is_contiguous(n.dst),
                 "quantized copy into a contiguous dst of another shape (ggml-cpu's dup_bytes over-writes)")
        return
    if dst in QUANTIZED:
        need(src in FLOAT and a.nb[0] == geo.type_size(a) and geo.is_contiguous(n.dst)
             and a.ne[0] % geo.block_size(n.dst) == 0, "quantizing copies take float rows into a contiguous dst")
        return
    if src in QUANTIZED:
        need(dst == F32 and geo.is_contiguous(n.dst) and n.dst.nb[0] == 4,   # dup_from_q asserts nb10
             "dequantizing copies write a contiguous f32 dst")
        return
    need((src, dst) in DUP_FLOAT, f"no ggml-cpu conversion {type_name(src)} -> {type_name(dst)}")


# --- sort, select -------------------------------------------------------------------------------
def argsort(n: Node) -> None:
    a = n.s(0)
    is_type(a, F32, "argsort src0")
    need(n.i32(0) in SORT_ORDERS, "argsort order out of range")
    need(geo.is_contiguous_1(a) and geo.is_contiguous_1(n.dst), "argsort addresses row i at i*nb1 (ops.cpp)")
    need(a.ne[0] < 1 << 31, "argsort rows too long")
    unit_strides(n, "argsort", DST)             # ggml_compute_forward_argsort_f32 asserts nb0
    dst_is(n, I32, a.ne, contiguous=False)


def top_k(n: Node) -> None:
    a = n.s(0)
    is_type(a, F32, "top_k src0")
    need(1 <= n.dst.ne[0] <= a.ne[0], "top_k k must be in [1, ne0]")
    unit_strides(n, "top_k", DST)               # ggml_compute_forward_top_k_f32 asserts nb0
    need(geo.is_contiguous_1(a) and geo.is_contiguous_1(n.dst), "top_k addresses row i at i*nb1 (ops.cpp)")
    dst_is(n, I32, (n.dst.ne[0], *a.ne[1:]), contiguous=False)


_SRC0, _SRC01 = frozenset({0}), frozenset({0, 1})
RULES: dict[int, Rule] = {
    # reductions, shapes
    GgmlOp.SUM: Rule(1, sum_all, strided=_SRC0), GgmlOp.SUM_ROWS: Rule(1, sum_rows), GgmlOp.MEAN: Rule(1, mean),
    GgmlOp.CUMSUM: Rule(1, cumsum), GgmlOp.ARGMAX: Rule(1, argmax), GgmlOp.COUNT_EQUAL: Rule(2, count_equal),
    GgmlOp.REPEAT: Rule(1, repeat), GgmlOp.CONCAT: Rule(2, concat, strided=ANY), GgmlOp.PAD: Rule(1, pad, strided=_SRC0),
    GgmlOp.TRI: Rule(1, tri), GgmlOp.DIAG_MASK_INF: Rule(1, diag_mask), GgmlOp.DIAG_MASK_ZERO: Rule(1, diag_mask),
    GgmlOp.ARANGE: Rule(0, arange), GgmlOp.TIMESTEP_EMBEDDING: Rule(1, timestep_embedding),
    GgmlOp.ROLL: Rule(1, roll), GgmlOp.DIAG: Rule(1, diag),
    # rows, copies
    GgmlOp.GET_ROWS: Rule(2, get_rows), GgmlOp.SET_ROWS: Rule(3, set_rows),
    GgmlOp.CPY: Rule(2, copy, strided=_SRC01), GgmlOp.DUP: Rule(1, copy, strided=_SRC0),
    GgmlOp.CONT: Rule(1, copy, strided=_SRC0),
    # sort, select
    GgmlOp.ARGSORT: Rule(1, argsort), GgmlOp.TOP_K: Rule(1, top_k),
}
