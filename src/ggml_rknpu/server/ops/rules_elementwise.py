"""Validator rules for the element-wise ops and the norms: binary (ADD, SUB, MUL, DIV, ADD1,
ADD_ID), unary (SQR ... COS, UNARY, GLU, SCALE, CLAMP, LEAKY_RELU, FILL), NORM, RMS_NORM,
L2_NORM, GROUP_NORM. The ``*_TYPES`` tables are the type combinations ggml-cpu's kernels
implement; each rule restates the builder's dst. Why rules as data: docs/decisions.md "server/ops/rules.py"."""

from __future__ import annotations

from ggml_rknpu.libggml.enums import GGML_GLU_OP_COUNT, GGML_UNARY_OP_COUNT, GgmlGluOp, GgmlOp
from ggml_rknpu.server.ops import geometry as geo
from ggml_rknpu.server.ops.rulekit import (
    ANY,
    BF16,
    DST,
    F16,
    F32,
    I32,
    Index,
    Node,
    Rule,
    dst_is,
    is_type,
    like,
    need,
    types_in,
    unit_strides,
)

# (src0, src1, dst) the binary kernels implement (ggml-cpu/binary-ops.cpp binary_op)
BINARY_TYPES = frozenset({(F32, F32, F32), (F16, F16, F16), (BF16, BF16, BF16), (BF16, F32, BF16),
                          (BF16, F32, F32), (F16, F32, F16), (F16, F32, F32)})
# (src0, dst) of the element-wise unary kernels (unary-ops.cpp unary_op and the ops.cpp GELU/SILU
# family implement f32, f16, bf16 each into its own type; the builders only make that)
UNARY_TYPES = frozenset({(F32, F32), (F16, F16), (BF16, BF16)})
HALF_UNARY_TYPES = frozenset({(F32, F32), (F16, F16)})       # CLAMP, LEAKY_RELU
# src0 types per GLU op (ops.cpp ggml_compute_forward_<glu>)
_GLU_ALL = frozenset({F32, F16, BF16})
GLU_TYPES = {GgmlGluOp.REGLU: _GLU_ALL, GgmlGluOp.GEGLU: _GLU_ALL, GgmlGluOp.SWIGLU: _GLU_ALL,
             GgmlGluOp.GEGLU_ERF: _GLU_ALL, GgmlGluOp.GEGLU_QUICK: _GLU_ALL,
             GgmlGluOp.SWIGLU_OAI: frozenset({F32}), GgmlGluOp.SWIGLU_CLAMP: frozenset({F32, F16})}


def binary(n: Node) -> None:
    a, b = n.s(0), n.s(1)
    types_in(n, BINARY_TYPES, 0, 1)
    need(geo.can_repeat(b, a), f"src1 {b.ne} does not repeat into src0 {a.ne}")
    like(n)


def unary_same(n: Node, table: frozenset = UNARY_TYPES) -> None:
    """SQR, SQRT, LOG, SIN, COS, CLAMP and the UNARY ops: dst = f(src0) row by row (contiguous rows)."""
    types_in(n, table, 0)
    like(n)


def unary(n: Node) -> None:
    need(0 <= n.i32(0) < GGML_UNARY_OP_COUNT, f"unary op id {n.i32(0)} out of range")
    unary_same(n)


def glu(n: Node) -> None:
    op = n.i32(0)
    need(0 <= op < GGML_GLU_OP_COUNT, f"glu op id {op} out of range")
    need(n.i32(1) in (0, 1), "glu 'swapped' must be 0 or 1")
    a, b = n.s(0), n.src[1]
    is_type(a, GLU_TYPES[GgmlGluOp(op)], "glu src0")
    need(geo.is_contiguous_1(a) and geo.is_contiguous_1(n.dst), "glu needs contiguous rows")
    if b is not None:
        need(geo.is_contiguous_1(b) and geo.are_same_shape(a, b) and a.type == b.type,
             "glu src1 must match src0 (shape, type, contiguous rows)")
        dst_is(n, a.type, a.ne, contiguous=False)
    else:                                       # ggml_glu_impl: ne0 / 2 (an odd last column is unused)
        dst_is(n, a.type, (a.ne[0] // 2, *a.ne[1:]), contiguous=False)


def scale(n: Node) -> None:
    a = n.s(0)
    is_type(a, frozenset({F32, BF16}), "scale src0")
    need(geo.is_contiguous(a), "scale needs a contiguous src0")
    like(n, contiguous=True)


def leaky_relu(n: Node) -> None:
    need(geo.is_contiguous_1(n.s(0)) and geo.is_contiguous_1(n.dst), "leaky_relu needs contiguous rows")
    unary_same(n, HALF_UNARY_TYPES)


def clamp(n: Node) -> None:
    unit_strides(n, "clamp", 0, DST)            # ggml_compute_forward_clamp_f32/_f16 assert nb00, nb0
    need(geo.is_contiguous_1(n.s(0)) and geo.is_contiguous_1(n.dst), "clamp addresses row i at i*nb1 (ops.cpp)")
    unary_same(n, HALF_UNARY_TYPES)     # any bounds (llama.cpp clamps to INFINITY): values, not sizes


def fill(n: Node) -> None:
    a = n.s(0)
    is_type(a, frozenset({F32, F16}), "fill src0")
    need(geo.is_contiguous(a), "fill needs a contiguous src0")
    like(n, contiguous=True)


def norm(n: Node) -> None:
    """NORM, RMS_NORM, L2_NORM: f32 rows, eps >= 0 (op_params[0])."""
    is_type(n.s(0), F32, "norm src0")
    eps = n.f32(0)
    need(eps >= 0.0 and eps != float("inf"), f"eps {eps} must be a finite value >= 0")
    like(n)


def group_norm(n: Node) -> None:
    is_type(n.s(0), F32, "group_norm src0")
    need(n.i32(0) >= 1, "group_norm needs n_groups >= 1")
    need(n.f32(1) >= 0.0, "group_norm eps must be >= 0")
    like(n)


def add_id(n: Node) -> list[Index]:
    a, b, ids = n.s(0), n.s(1), n.s(2)
    for t, w in ((a, "src0"), (b, "src1")):
        is_type(t, F32, f"add_id {w}")
    is_type(ids, I32, "add_id ids")
    unit_strides(n, "add_id", 1, DST)           # ggml_compute_forward_add_id_f32 asserts nb10, nb0
    need(a.ne[0] == b.ne[0] and a.ne[1] == ids.ne[0] and a.ne[2] == ids.ne[1], "add_id shapes do not fit")
    like(n)
    return [(2, b.ne[1])]


def add1(n: Node) -> None:
    a, b = n.s(0), n.s(1)
    need(geo.is_scalar(b) and geo.is_padded_1d(a), "add1 adds a scalar to a padded tensor")
    unit_strides(n, "add1", DST)                # ggml_compute_forward_add1_* assert nb0
    need((a.type, b.type, n.dst.type) in {(F32, F32, F32), (F16, F32, F16), (F16, F16, F16), (BF16, F32, BF16)},
         "add1 types have no kernel")
    like(n)


_SRC1 = frozenset({1})
RULES: dict[int, Rule] = {
    GgmlOp.ADD: Rule(2, binary, strided=_SRC1), GgmlOp.SUB: Rule(2, binary, strided=_SRC1),
    GgmlOp.MUL: Rule(2, binary, strided=_SRC1), GgmlOp.DIV: Rule(2, binary, strided=_SRC1),
    GgmlOp.ADD1: Rule(2, add1), GgmlOp.ADD_ID: Rule(3, add_id),
    GgmlOp.SQR: Rule(1, unary_same), GgmlOp.SQRT: Rule(1, unary_same), GgmlOp.LOG: Rule(1, unary_same),
    GgmlOp.SIN: Rule(1, unary_same), GgmlOp.COS: Rule(1, unary_same), GgmlOp.LEAKY_RELU: Rule(1, leaky_relu),
    GgmlOp.UNARY: Rule(1, unary), GgmlOp.GLU: Rule(1, glu, optional=1),
    GgmlOp.SCALE: Rule(1, scale), GgmlOp.CLAMP: Rule(1, clamp), GgmlOp.FILL: Rule(1, fill),
    GgmlOp.NORM: Rule(1, norm, strided=ANY), GgmlOp.L2_NORM: Rule(1, norm, strided=ANY),
    GgmlOp.RMS_NORM: Rule(1, norm, strided=frozenset({DST})), GgmlOp.GROUP_NORM: Rule(1, group_norm),
}
