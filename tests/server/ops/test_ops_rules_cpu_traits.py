"""The validator's type tables agree with the loaded ggml: a type the rules admit as a matmul
weight has a ggml-cpu vec_dot, one they admit for GET_ROWS has a to_float (else the kernel
calls a NULL function pointer; the ASan fuzz found both with Q8_1)."""

from __future__ import annotations

from ggml_rknpu.libggml.enums import TYPE_TRAITS, GgmlType
from ggml_rknpu.server.ops.rulekit import FLOAT, OPERAND_ONLY
from ggml_rknpu.server.ops.rules_matmul import MATMUL_WEIGHT_TYPES
from ggml_rknpu.server.ops.rules_shapes import GET_ROWS_TYPES


def test_matmul_weight_types_have_a_vec_dot(host_ggml):
    for t in GgmlType:
        has_vec_dot = bool(host_ggml.ggml_get_type_traits_cpu(t).contents.vec_dot)
        assert (int(t) in MATMUL_WEIGHT_TYPES) == (has_vec_dot and (int(t) in FLOAT or TYPE_TRAITS[t][0] > 1)), t.name


def test_get_rows_types_have_a_to_float(host_ggml):
    for t in GET_ROWS_TYPES:
        assert t in (GgmlType.F32, GgmlType.I32) or host_ggml.ggml_get_type_traits(t).contents.to_float, GgmlType(t).name
    for t in OPERAND_ONLY:
        assert not host_ggml.ggml_get_type_traits(t).contents.to_float, GgmlType(t).name
