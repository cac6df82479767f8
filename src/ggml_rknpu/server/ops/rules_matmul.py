"""Validator rules for matmul and attention: MUL_MAT, MUL_MAT_ID (its expert ids range-checked
at run time), FLASH_ATTN_EXT, SOFT_MAX, ROPE and ROPE_BACK. Weight types are those with a
ggml-cpu vec_dot (``MATMUL_WEIGHT_TYPES``); the dst strides are the builder's. Why rules as data: docs/decisions.md "server/ops/rules.py"."""

from __future__ import annotations

from ggml_rknpu.libggml import abi
from ggml_rknpu.libggml.enums import GgmlOp
from ggml_rknpu.server.ops import geometry as geo
from ggml_rknpu.server.ops.rulekit import (
    BF16,
    DST,
    F16,
    F32,
    FLOAT,
    I32,
    OPERAND_ONLY,
    QUANTIZED,
    Index,
    Node,
    Rule,
    dst_is,
    is_type,
    like,
    need,
    unit_strides,
)
from ggml_rknpu.server.ops.vocabulary import type_name

# src0 (weight) types of MUL_MAT / MUL_MAT_ID: the types with a ggml-cpu vec_dot
MATMUL_WEIGHT_TYPES = frozenset(FLOAT | (QUANTIZED - OPERAND_ONLY))
ROPE_MODES = frozenset({abi.GGML_ROPE_TYPE_NORMAL, abi.GGML_ROPE_TYPE_NEOX, abi.GGML_ROPE_TYPE_MROPE,
                        abi.GGML_ROPE_TYPE_VISION, abi.GGML_ROPE_TYPE_IMROPE})


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
    unit_strides(n, "rope", DST)                # ggml_compute_forward_rope_flt asserts nb0
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


RULES: dict[int, Rule] = {
    GgmlOp.MUL_MAT: Rule(2, mul_mat), GgmlOp.MUL_MAT_ID: Rule(3, mul_mat_id),
    GgmlOp.FLASH_ATTN_EXT: Rule(3, flash_attn_ext, optional=2),
    GgmlOp.SOFT_MAX: Rule(1, soft_max, optional=2), GgmlOp.ROPE: Rule(2, rope, optional=1),
    # ggml_rope_ext_back / ggml_rope_multi_back: a ROPE node renamed (rope_flt run backwards)
    GgmlOp.ROPE_BACK: Rule(2, rope, optional=1),
}
