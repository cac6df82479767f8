"""The validator: every op the server admits has a rule, checked at plan time.

Invariants: a node reaches ggml-cpu only when its rule admits it (ggml-cpu trusts its
graph: a bad shape or index aborts the process); a rule states, from the pinned ggml, the
source arity, the types the CPU kernel implements (as data, the ``*_TYPES`` tables), the
dst the op's builder would make, the strides the kernel assumes, enum-valued op_params in
range, and which sources hold indices (:class:`IndexCheck`); every tensor's checked span
covers its dense size. Anything else raises :class:`UnsupportedOp`. :data:`RULES` is the
one table of every admitted op, with the families of ``rules_conv``, ``rules_training``
and ``rules_dsv4`` merged in. Why rules as data: docs/decisions.md "server/ops/rules.py"."""

from __future__ import annotations

import math

from ggml_rknpu.libggml.enums import GGML_GLU_OP_COUNT, GGML_UNARY_OP_COUNT, GgmlGluOp, GgmlOp, GgmlUnaryOp
from ggml_rknpu.server.ops import geometry as geo
from ggml_rknpu.server.ops.registry import UnsupportedOp, op_name, type_name
from ggml_rknpu.server.ops.rulekit import (ANY, BF16, DST, F16, F32, FLOAT, I8, I16, I32, I64, OPERAND_ONLY, QUANTIZED,
                                         Index, Node,
                                         Refused, Rule, RpcTensor, conv_out, dst_is, finite, is_type, like, need,
                                         types_in, unit_stride)
from ggml_rknpu.server.ops.rules_conv import RULES as CONV_RULES
from ggml_rknpu.server.ops.rules_dsv4 import RULES as DSV4_RULES
from ggml_rknpu.server.ops.rules_training import RULES as TRAINING_RULES
from ggml_rknpu.libggml import abi


# (src0, src1, dst) the binary kernels implement (ggml-cpu/binary-ops.cpp binary_op)
BINARY_TYPES = frozenset({(F32, F32, F32), (F16, F16, F16), (BF16, BF16, BF16), (BF16, F32, BF16),
                          (BF16, F32, F32), (F16, F32, F16), (F16, F32, F32)})
# (src0, dst) of the element-wise unary kernels (unary-ops.cpp unary_op and the ops.cpp GELU/SILU
# family implement f32, f16, bf16 each into its own type; the builders only make that)
UNARY_TYPES = frozenset({(F32, F32), (F16, F16), (BF16, BF16)})
HALF_UNARY_TYPES = frozenset({(F32, F32), (F16, F16)})       # CLAMP, LEAKY_RELU
# src0 types of GET_ROWS (ops.cpp ggml_compute_forward_get_rows): every quantized type with a to_float
GET_ROWS_TYPES = frozenset({F32, F16, BF16, I32} | (QUANTIZED - OPERAND_ONLY))
# src0 (weight) types of MUL_MAT / MUL_MAT_ID: the types with a ggml-cpu vec_dot
MATMUL_WEIGHT_TYPES = frozenset(FLOAT | (QUANTIZED - OPERAND_ONLY))
# float -> float conversions of the dup kernels (ops.cpp ggml_compute_forward_dup)
DUP_FLOAT = frozenset({(F16, F16), (F16, BF16), (F16, F32), (BF16, F16), (BF16, BF16), (BF16, F32),
                       (F32, F16), (F32, BF16), (F32, F32), (F32, I32), (I32, F32)})
# types whose concat kernel follows every stride (concat_f32 / concat_f16 / concat_i8); the rest: concat_any
CONCAT_STRIDED = frozenset({F32, I32, F16, BF16, I16, I8})
ROPE_MODES = frozenset({abi.GGML_ROPE_TYPE_NORMAL, abi.GGML_ROPE_TYPE_NEOX, abi.GGML_ROPE_TYPE_MROPE,
                        abi.GGML_ROPE_TYPE_VISION, abi.GGML_ROPE_TYPE_IMROPE})
SORT_ORDERS = frozenset({abi.GGML_SORT_ORDER_ASC, abi.GGML_SORT_ORDER_DESC})
TRI_TYPES = frozenset({abi.GGML_TRI_TYPE_UPPER_DIAG, abi.GGML_TRI_TYPE_UPPER, abi.GGML_TRI_TYPE_LOWER_DIAG,
                       abi.GGML_TRI_TYPE_LOWER})
# src0 types per GLU op (ops.cpp ggml_compute_forward_<glu>)
_GLU_ALL = frozenset({F32, F16, BF16})
GLU_TYPES = {GgmlGluOp.REGLU: _GLU_ALL, GgmlGluOp.GEGLU: _GLU_ALL, GgmlGluOp.SWIGLU: _GLU_ALL,
             GgmlGluOp.GEGLU_ERF: _GLU_ALL, GgmlGluOp.GEGLU_QUICK: _GLU_ALL,
             GgmlGluOp.SWIGLU_OAI: frozenset({F32}), GgmlGluOp.SWIGLU_CLAMP: frozenset({F32, F16})}

def _unit_strides(n: Node, what: str, *tensors: int) -> None:
    """Sources (by index) or the dst (DST) whose nb0 the kernel GGML_ASSERTs to be the element size."""
    for i in tensors:
        unit_stride(n.dst if i == DST else n.s(i), f"{what} {'dst' if i == DST else f'src{i}'}")


# --- element-wise -------------------------------------------------------------------------------
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
    _unit_strides(n, "clamp", 0, DST)            # ggml_compute_forward_clamp_f32/_f16 assert nb00, nb0
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
    _unit_strides(n, "add_id", 1, DST)           # ggml_compute_forward_add_id_f32 asserts nb10, nb0
    need(a.ne[0] == b.ne[0] and a.ne[1] == ids.ne[0] and a.ne[2] == ids.ne[1], "add_id shapes do not fit")
    like(n)
    return [(2, b.ne[1])]


def add1(n: Node) -> None:
    a, b = n.s(0), n.s(1)
    need(geo.is_scalar(b) and geo.is_padded_1d(a), "add1 adds a scalar to a padded tensor")
    _unit_strides(n, "add1", DST)                # ggml_compute_forward_add1_* assert nb0
    need((a.type, b.type, n.dst.type) in {(F32, F32, F32), (F16, F32, F16), (F16, F16, F16), (BF16, F32, BF16)},
         "add1 types have no kernel")
    like(n)


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
    _unit_strides(n, "repeat", 0, DST)           # ggml_compute_forward_repeat_* assert nb00, nb0
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
    _unit_strides(n, "diag", 0, DST)             # ggml_compute_forward_diag_f32 asserts nb00, nb0
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


# --- matmul, attention --------------------------------------------------------------------------
def _matmul_dst_strides(n: Node) -> None:
    nb = n.dst.nb
    need(nb[0] == 4 and nb[0] <= nb[1] <= nb[2] <= nb[3], "matmul dst strides must be ordered f32")


def mul_mat(n: Node) -> None:
    a, b = n.s(0), n.s(1)
    need(a.ne[0] == b.ne[0] and b.ne[2] % a.ne[2] == 0 and b.ne[3] % a.ne[3] == 0,
         f"mul_mat shapes {a.ne} x {b.ne} do not fit")
    need(not geo.is_transposed(a), "mul_mat src0 is transposed")
    is_type(a, MATMUL_WEIGHT_TYPES, "mul_mat src0")
    need(n.i32(1) == abi.GGML_HINT_NONE, "mul_mat hints are not admitted")
    is_type(b, frozenset({F32, F16, BF16} | QUANTIZED), "mul_mat src1")
    dst_is(n, F32, (a.ne[1], b.ne[1], b.ne[2], b.ne[3]), contiguous=False)
    _matmul_dst_strides(n)


def mul_mat_id(n: Node) -> list[Index]:
    a, b, ids = n.s(0), n.s(1), n.s(2)
    is_type(ids, I32, "mul_mat_id ids")
    is_type(a, MATMUL_WEIGHT_TYPES, "mul_mat_id src0")
    need(not geo.is_transposed(a) and a.ne[3] == 1 and b.ne[3] == 1 and ids.ne[2] == 1 and ids.ne[3] == 1
         and ids.ne[1] == b.ne[2] and a.ne[0] == b.ne[0] and b.ne[1] >= 1 and ids.ne[0] % b.ne[1] == 0,
         "mul_mat_id shapes do not fit")
    # ggml-cpu.c mul_mat_id converts only f32 activations (GGML_ASSERT); a float type equal to the
    # experts' is their vec_dot type already and needs no conversion
    need(b.type == F32 or (b.type == a.type and a.type in FLOAT),
         f"mul_mat_id src1 type {type_name(b.type)} has no ggml-cpu path")
    dst_is(n, F32, (a.ne[1], ids.ne[0], b.ne[2], 1), contiguous=False)
    _matmul_dst_strides(n)
    return [(2, a.ne[2])]


def flash_attn_ext(n: Node) -> None:
    q, k, v, mask, sinks = n.s(0), n.s(1), n.s(2), n.src[3], n.src[4]
    is_type(q, F32, "flash_attn q")              # the kernel reads Q rows as f32 whatever its type (ops.cpp)
    need(n.i32(3) in (abi.GGML_PREC_DEFAULT, abi.GGML_PREC_F32), "flash_attn precision is default or f32")
    is_type(k, MATMUL_WEIGHT_TYPES, "flash_attn K")        # K rows go through its vec_dot, V rows its to_float
    is_type(v, MATMUL_WEIGHT_TYPES, "flash_attn V")
    need(q.ne[0] == k.ne[0] and q.ne[2] % k.ne[2] == 0 and q.ne[3] == k.ne[3] == v.ne[3]
         and q.ne[2] % v.ne[2] == 0 and v.ne[1] == k.ne[1], "flash_attn shapes do not fit")
    if mask is not None:
        is_type(mask, F16, "flash_attn mask")
        need(geo.is_contiguous(mask) and q.ne[2] % mask.ne[2] == 0 and q.ne[3] % mask.ne[3] == 0
             and mask.ne[1] >= q.ne[1] and mask.ne[0] >= k.ne[1], "flash_attn mask shape")
    elif n.f32(1) > 0:
        need(False, "flash_attn max_bias needs a mask")
    if sinks is not None:
        is_type(sinks, F32, "flash_attn sinks")
        need(sinks.ne[0] >= q.ne[2], "flash_attn sinks: one per head")
    dst_is(n, F32, (v.ne[0], q.ne[2], q.ne[1], q.ne[3]), contiguous=False)
    _matmul_dst_strides(n)


def soft_max(n: Node) -> None:
    a, mask, sinks = n.s(0), n.src[1], n.src[2]
    is_type(a, F32, "soft_max src0")
    need(geo.is_contiguous(a), "soft_max needs a contiguous src0")
    if mask is not None:
        is_type(mask, frozenset({F16, F32}), "soft_max mask")
        need(geo.is_contiguous(mask) and mask.ne[0] == a.ne[0] and mask.ne[1] >= a.ne[1]
             and a.ne[2] % mask.ne[2] == 0 and a.ne[3] % mask.ne[3] == 0, "soft_max mask shape")
    elif n.f32(1) > 0:
        need(False, "soft_max max_bias needs a mask")
    if sinks is not None:
        is_type(sinks, F32, "soft_max sinks")
        need(sinks.ne[0] >= a.ne[2], "soft_max sinks: one per head")
    like(n, contiguous=True)


def rope(n: Node) -> None:
    a, pos, ff = n.s(0), n.s(1), n.src[2]
    is_type(a, frozenset({F32, F16}), "rope src0")
    is_type(pos, I32, "rope positions")
    _unit_strides(n, "rope", DST)                # ggml_compute_forward_rope_flt asserts nb0
    n_dims, mode, n_offs = n.i32(1), n.i32(2), n.i32(15)
    need(mode in ROPE_MODES, f"rope mode {mode} not implemented")
    need(geo.is_vector(pos), "rope positions are a vector")
    mrope = bool(mode & abi.GGML_ROPE_TYPE_MROPE)
    need(pos.ne[0] == (4 * a.ne[2] if mrope else a.ne[2]), "rope: one position per row (4 with mrope)")
    need(0 < n_dims <= a.ne[0] and n_dims % 2 == 0 and n_offs >= 0 and n_offs % 2 == 0
         and n_offs + n_dims <= a.ne[0], "rope n_dims / n_offs do not fit the row")
    if mrope:
        sections = [n.i32(11 + i) for i in range(abi.GGML_MROPE_SECTIONS)]
        need(any(s > 0 for s in sections[:3]) and all(s >= 0 for s in sections), "mrope sections")
    if mode == abi.GGML_ROPE_TYPE_VISION:
        need(n_dims == a.ne[0] // 2 and n_offs == 0, "vision rope takes n_dims = ne0/2")
    if ff is not None:
        is_type(ff, F32, "rope freq factors")
        need(ff.ne[0] >= n_dims // 2, "rope freq factors: one per dimension pair")
    like(n)


# --- convolution -----------------------------------------------------------------------------------
def im2col(n: Node) -> None:
    a, b = n.s(0), n.s(1)                       # a: the kernel (shape only), b: the input
    s0, s1, p0, p1, d0, d1, is_2d = (n.i32(k) for k in range(7))
    need(is_2d in (0, 1), "im2col is_2D must be 0 or 1")
    # strides divide (0 would be SIGFPE); padding and dilation only move reads the kernel bounds-checks
    need(s0 >= 1 and (s1 >= 1 or not is_2d), "im2col strides must be >= 1")
    need((n.dst.type, b.type) in {(F32, F32), (F16, F16), (F16, F32)}, "im2col types have no kernel")
    _unit_strides(n, "im2col", 1)                # ggml_compute_forward_im2col_f32/_f16 assert nb10
    if is_2d:
        need(a.ne[2] == b.ne[2], "im2col channels differ")
        need(b.nb[1] == b.ne[0] * geo.type_size(b), "im2col reads each channel as one contiguous image")
    else:
        need(b.ne[1] == a.ne[1] and b.ne[3] == 1, "im2col 1-D shapes")
    oh = conv_out(b.ne[1], a.ne[1], s1, p1, d1) if is_2d else 0
    ow = conv_out(b.ne[0], a.ne[0], s0, p0, d0)
    need(ow > 0 and (not is_2d or oh > 0), "im2col input too small for the kernel")
    ne = (a.ne[2] * a.ne[1] * a.ne[0] if is_2d else a.ne[1] * a.ne[0], ow, oh if is_2d else b.ne[2],
          b.ne[3] if is_2d else 1)
    dst_is(n, n.dst.type, ne)


# --- sort, select -------------------------------------------------------------------------------
def argsort(n: Node) -> None:
    a = n.s(0)
    is_type(a, F32, "argsort src0")
    need(n.i32(0) in SORT_ORDERS, "argsort order out of range")
    need(geo.is_contiguous_1(a) and geo.is_contiguous_1(n.dst), "argsort addresses row i at i*nb1 (ops.cpp)")
    need(a.ne[0] < 1 << 31, "argsort rows too long")
    _unit_strides(n, "argsort", DST)             # ggml_compute_forward_argsort_f32 asserts nb0
    dst_is(n, I32, a.ne, contiguous=False)


def top_k(n: Node) -> None:
    a = n.s(0)
    is_type(a, F32, "top_k src0")
    need(1 <= n.dst.ne[0] <= a.ne[0], "top_k k must be in [1, ne0]")
    _unit_strides(n, "top_k", DST)               # ggml_compute_forward_top_k_f32 asserts nb0
    need(geo.is_contiguous_1(a) and geo.is_contiguous_1(n.dst), "top_k addresses row i at i*nb1 (ops.cpp)")
    dst_is(n, I32, (n.dst.ne[0], *a.ne[1:]), contiguous=False)


# --- recurrent / state-space --------------------------------------------------------------------
def ssm_conv(n: Node) -> None:
    sx, c = n.s(0), n.s(1)
    for t, w in ((sx, "sx"), (c, "conv weight")):
        is_type(t, F32, f"ssm_conv {w}")
    need(geo.is_3d(sx) and geo.is_matrix(c), "ssm_conv ranks")
    d_conv, d_inner = c.ne[0], c.ne[1]
    n_t = sx.ne[0] - d_conv + 1
    need(n_t >= 0 and sx.ne[1] == d_inner and sx.nb[1] == sx.ne[0] * 4, "ssm_conv shapes do not fit")
    dst_is(n, F32, (d_inner, n_t, sx.ne[2], 1), contiguous=False)


def ssm_scan(n: Node) -> list[Index]:
    s, x, dt, A, B, C, ids = (n.s(i) for i in range(7))
    for t, w in ((s, "s"), (x, "x"), (dt, "dt"), (A, "A"), (B, "B"), (C, "C")):
        is_type(t, F32, f"ssm_scan {w}")
    is_type(ids, I32, "ssm_scan ids")
    K = n.i32(0)
    need(K >= 1, "ssm_scan K >= 1")
    need(geo.is_contiguous(s) and geo.is_contiguous(dt) and geo.is_contiguous(A), "ssm_scan contiguity")
    for t in (x, B, C):
        need(t.nb[1] == t.ne[0] * t.nb[0], "ssm_scan x/B/C rows contiguous")
    need(geo.are_same_shape(B, C), "ssm_scan B and C differ")
    d_state, head_dim, n_head, n_tok, n_seqs = s.ne[0], x.ne[0], x.ne[1], x.ne[2], x.ne[3]
    need(dt.ne[:3] == (n_head, n_tok, n_seqs) and geo.is_3d(dt) and s.ne[1] == head_dim and s.ne[2] == n_head
         and B.ne[0] == d_state and B.ne[2] == n_tok and B.ne[3] == n_seqs and ids.ne[0] == n_seqs
         and geo.is_vector(ids) and A.ne[1] == n_head and geo.is_matrix(A) and B.ne[1] >= 1
         and n_head % B.ne[1] == 0, "ssm_scan shapes do not fit")
    if A.ne[0] != 1:
        need(A.ne[0] == d_state and K == 1, "mamba-1 A and K")
    dst_is(n, F32, (geo.nelements(x) + K * d_state * head_dim * n_head * ids.ne[0], 1, 1, 1))
    return [(6, s.ne[3])]


def gated_delta_net(n: Node) -> None:
    q, k, v, g, beta, state = (n.s(i) for i in range(6))
    for t, w in ((q, "q"), (k, "k"), (v, "v"), (g, "g"), (beta, "beta"), (state, "state")):
        is_type(t, F32, f"gated_delta_net {w}")
    need(all(geo.is_contiguous_rows(t) for t in (q, k, v))
         and all(geo.is_contiguous(t) for t in (g, beta, state)), "gated_delta_net contiguity")
    S_v, H, T, B = v.ne
    K = n.i32(0)
    need(g.ne[0] in (1, S_v) and beta.ne[0] == 1 and state.ne == (S_v, S_v, H, B) and K >= 1,
         "gated_delta_net shapes do not fit")
    need(q.ne[0] == k.ne[0] == S_v and q.ne[1:] == k.ne[1:] and q.ne[2:] == (T, B) and H % q.ne[1] == 0
         and g.ne[1:] == (H, T, B) and beta.ne[1:] == (H, T, B), "gated_delta_net q/k/g/beta shapes")
    dst_is(n, F32, (S_v * H, T * B + K * S_v * B, 1, 1))


def _wkv_common(n: Node, ins: tuple[RpcTensor, ...], state: RpcTensor) -> None:
    for t in (*ins, state):
        is_type(t, F32, "rwkv/gla input")
        need(geo.is_contiguous(t), "rwkv/gla inputs are contiguous")
    S, H, T = ins[0].ne[0], ins[0].ne[1], ins[0].ne[2]
    n_seqs = state.ne[1]
    need(geo.nelements(state) == S * S * H * n_seqs, "rwkv/gla state size")
    dst_is(n, F32, (S * H, T + S * n_seqs, 1, 1))


def rwkv_wkv6(n: Node) -> None:
    k, v, r, tf, td, state = (n.s(i) for i in range(6))
    S, H, T = k.ne[0], k.ne[1], k.ne[2]
    need(all(t.ne[:3] == (S, H, T) for t in (v, r, td)) and geo.nelements(tf) == S * H, "wkv6 shapes")
    _wkv_common(n, (k, v, r, tf, td), state)


def rwkv_wkv7(n: Node) -> None:
    r, w, k, v, a, b, state = (n.s(i) for i in range(7))
    S, H, T = k.ne[0], k.ne[1], k.ne[2]
    # the SIMD kernel loads GGML_F32_STEP floats at a time (64 with AVX-512, simd-mappings.h) and has
    # no tail loop (ops.cpp rwkv_wkv7_f32): smaller or ragged heads read past their rows
    need(S % 64 == 0, f"wkv7 head size {S} is not a multiple of 64")
    need(all(t.ne[:3] == (S, H, T) for t in (r, w, v, a, b)), "wkv7 shapes")
    _wkv_common(n, (k, r, w, v, a, b), state)


def gated_linear_attn(n: Node) -> None:
    k, v, q, g, state = (n.s(i) for i in range(5))
    S, H, T = k.ne[0], k.ne[1], k.ne[2]
    need(all(t.ne[:3] == (S, H, T) for t in (v, q, g)), "gla shapes")
    _wkv_common(n, (k, v, q, g), state)


def solve_tri(n: Node) -> None:
    a, b = n.s(0), n.s(1)
    is_type(a, F32, "solve_tri A")
    is_type(b, F32, "solve_tri B")
    need(a.ne[0] == a.ne[1] == b.ne[1] and a.ne[2:] == b.ne[2:] and geo.is_contiguous(a) and geo.is_contiguous(b),
         "solve_tri shapes")
    dst_is(n, F32, b.ne)


_SRC0, _SRC1, _SRC01 = frozenset({0}), frozenset({1}), frozenset({0, 1})
RULES: dict[int, Rule] = {
    # every admitted op, in one table: the families split into their own modules, then the rest
    **CONV_RULES, **TRAINING_RULES, **DSV4_RULES,
    # element-wise
    GgmlOp.ADD: Rule(2, binary, strided=_SRC1), GgmlOp.SUB: Rule(2, binary, strided=_SRC1),
    GgmlOp.MUL: Rule(2, binary, strided=_SRC1), GgmlOp.DIV: Rule(2, binary, strided=_SRC1),
    GgmlOp.ADD1: Rule(2, add1), GgmlOp.ADD_ID: Rule(3, add_id),
    GgmlOp.SQR: Rule(1, unary_same), GgmlOp.SQRT: Rule(1, unary_same), GgmlOp.LOG: Rule(1, unary_same),
    GgmlOp.SIN: Rule(1, unary_same), GgmlOp.COS: Rule(1, unary_same), GgmlOp.LEAKY_RELU: Rule(1, leaky_relu),
    GgmlOp.UNARY: Rule(1, unary), GgmlOp.GLU: Rule(1, glu, optional=1),
    GgmlOp.SCALE: Rule(1, scale), GgmlOp.CLAMP: Rule(1, clamp), GgmlOp.FILL: Rule(1, fill),
    # norms, reductions, shapes
    GgmlOp.NORM: Rule(1, norm, strided=ANY), GgmlOp.L2_NORM: Rule(1, norm, strided=ANY),
    GgmlOp.RMS_NORM: Rule(1, norm, strided=frozenset({DST})), GgmlOp.GROUP_NORM: Rule(1, group_norm),
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
    # matmul, attention, convolution
    GgmlOp.MUL_MAT: Rule(2, mul_mat), GgmlOp.MUL_MAT_ID: Rule(3, mul_mat_id),
    GgmlOp.FLASH_ATTN_EXT: Rule(3, flash_attn_ext, optional=2),
    GgmlOp.SOFT_MAX: Rule(1, soft_max, optional=2), GgmlOp.ROPE: Rule(2, rope, optional=1),
    # ggml_rope_ext_back / ggml_rope_multi_back: a ROPE node renamed (rope_flt run backwards)
    GgmlOp.ROPE_BACK: Rule(2, rope, optional=1),
    GgmlOp.IM2COL: Rule(2, im2col, strided=_SRC0),
    # sort, select; recurrent and state-space
    GgmlOp.ARGSORT: Rule(1, argsort), GgmlOp.TOP_K: Rule(1, top_k),
    GgmlOp.SSM_CONV: Rule(2, ssm_conv), GgmlOp.SSM_SCAN: Rule(7, ssm_scan),
    GgmlOp.GATED_DELTA_NET: Rule(6, gated_delta_net),
    GgmlOp.RWKV_WKV6: Rule(6, rwkv_wkv6), GgmlOp.RWKV_WKV7: Rule(7, rwkv_wkv7),
    GgmlOp.GATED_LINEAR_ATTN: Rule(5, gated_linear_attn), GgmlOp.SOLVE_TRI: Rule(2, solve_tri),
}


def signature(t: RpcTensor, srcs: tuple[RpcTensor | None, ...]) -> str:
    """``OP[:SUB](src types)->dst type``, e.g. ``UNARY:SILU(f32)->f32`` (what the server logs)."""
    name = op_name(t.op)
    if t.op in (GgmlOp.UNARY, GgmlOp.GLU):
        enum = GgmlUnaryOp if t.op == GgmlOp.UNARY else GgmlGluOp
        sub = t.op_params[0]
        try:
            name += ":" + enum(sub).name
        except ValueError:
            name += f":{sub}"
    types = ",".join(type_name(s.type) if s is not None else "-" for s in srcs).rstrip(",-")
    return f"{name}({types})->{type_name(t.type)}"


def check_node(t: RpcTensor, srcs: tuple[RpcTensor | None, ...]) -> list[Index]:
    """The index checks the node needs, or :class:`UnsupportedOp` when no rule admits it."""
    rule = RULES.get(t.op)
    if rule is None:
        raise UnsupportedOp(signature(t, srcs), "no rule admits this op")
    srcs = tuple(srcs) + (None,) * (abi.GGML_MAX_SRC - len(srcs))
    try:
        for i in range(rule.arity):
            need(srcs[i] is not None, f"missing source {i}")
        for i in range(rule.arity + rule.optional, len(srcs)):
            need(srcs[i] is None, f"unexpected source {i}")
        for i, s in enumerate((t, *srcs)):
            if s is None:
                continue
            what = "dst" if i == 0 else f"src{i - 1}"
            need(geo.covers_dense(s) and (s.nb[0] >= geo.type_size(s) or geo.is_empty(s)),
                 f"{what} strides {s.nb} overlap its elements")
            if (i - 1) not in rule.strided:
                need(geo.is_contiguous_rows(s) or geo.is_empty(s), f"{what} nb0={s.nb[0]} is not the element size")
        return rule.check(Node(t, srcs)) or []
    except Refused as exc:
        raise UnsupportedOp(signature(t, srcs), str(exc)) from None
