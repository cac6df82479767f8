"""Host MUL_MAT: ggml's src0 broadcast over dims 2/3 (each src0 matrix serves r2/r3
consecutive src1 matrices), permuted operands (KQ/KQV views), f16/bf16/quantized src0."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from support.ops_helpers import BF16, F16, F32, alloc, node, permuted, random, values

from ggml_rknpu.ggml.enums import GgmlOp, GgmlType
from ggml_rknpu.ggml.ops.convert import dequantize_rows, quantize_rows
from ggml_rknpu.ggml.ops.registry import UnsupportedOp, plan_op


def mul_mat_reference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a (ne03, ne02, M, K), b (ne13, ne12, N, K) -> (ne13, ne12, N, M), loop over batches."""
    ne13, ne12, n, _ = b.shape
    r3, r2 = ne13 // a.shape[0], ne12 // a.shape[1]
    out = np.zeros((ne13, ne12, n, a.shape[2]))
    for i3, i2 in itertools.product(range(ne13), range(ne12)):
        out[i3, i2] = b[i3, i2] @ a[i3 // r3, i2 // r2].T
    return out


def vec_dot_rounded(b: np.ndarray, a_type: int) -> np.ndarray:
    """ggml-cpu converts src1 to src0's vec-dot type first: f16 -> f16, bf16 -> bf16."""
    if a_type == F16:
        return b.astype(np.float16).astype(np.float64)
    if a_type == BF16:
        bits = b.astype(np.float32).view(np.uint32)
        return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    return b


@pytest.mark.parametrize("a_type", [F32, F16, BF16])
@pytest.mark.parametrize("bcast", [(1, 1), (2, 1), (1, 3), (4, 2)])
@pytest.mark.parametrize("n", [1, 5])
def test_mul_mat_broadcast(a_type, bcast, n):
    rng = np.random.default_rng(40)
    k, m, ne02, ne03 = 32, 7, 2, 1
    r2, r3 = bcast
    a = alloc(a_type, (k, m, ne02, ne03))
    b = alloc(F32, (k, n, ne02 * r2, ne03 * r3))
    av, bv = random(a, rng), random(b, rng)
    d = alloc(F32, (m, n, ne02 * r2, ne03 * r3))
    plan_op(node(GgmlOp.MUL_MAT, d, a, b))()
    np.testing.assert_allclose(values(d), mul_mat_reference(av, vec_dot_rounded(bv, a_type)), rtol=1e-5, atol=1e-5)


def test_mul_mat_permuted_kq_and_kqv_views():
    """KQ = k (permuted cache view, f16) x q (permuted); KQV with a transposed v view."""
    rng = np.random.default_rng(41)
    d_head, n_kv, n_tok, hk, hq = 16, 9, 3, 2, 4
    k = permuted(F16, (d_head, n_kv, hk, 1), (0, 2, 1, 3))
    q = permuted(F32, (d_head, n_tok, hq, 1), (0, 2, 1, 3))
    kv, qv = random(k, rng), random(q, rng)
    kq = alloc(F32, (n_kv, n_tok, hq, 1))
    plan_op(node(GgmlOp.MUL_MAT, kq, k, q))()
    np.testing.assert_allclose(values(kq), mul_mat_reference(kv, vec_dot_rounded(qv, F16)), rtol=1e-5, atol=1e-6)
    v = permuted(F16, (n_kv, d_head, hk, 1), (1, 0, 2, 3))
    vv = random(v, rng)
    kqv = permuted(F32, (d_head, n_tok, hq, 1), (0, 2, 1, 3))     # written through a permuted dst
    plan_op(node(GgmlOp.MUL_MAT, kqv, v, kq))()
    np.testing.assert_allclose(values(kqv), mul_mat_reference(vv, vec_dot_rounded(values(kq), F16)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qtype", [GgmlType.Q8_0, GgmlType.Q4_0, GgmlType.Q5_1])
def test_mul_mat_quantized_src0(qtype):
    rng = np.random.default_rng(42)
    a = alloc(qtype, (64, 6, 1, 1))
    a.as_array()[...] = quantize_rows(rng.uniform(-1, 1, (1, 1, 6, 64)), qtype)
    b = alloc(F32, (64, 3, 2, 1))
    bv = random(b, rng)
    d = alloc(F32, (6, 3, 2, 1))
    plan_op(node(GgmlOp.MUL_MAT, d, a, b))()
    av = dequantize_rows(a.as_array(), qtype).astype(np.float64)
    np.testing.assert_allclose(values(d), mul_mat_reference(av, bv), rtol=1e-5, atol=1e-5)


def test_mul_mat_rejects_bad_shapes():
    with pytest.raises(UnsupportedOp):
        plan_op(node(GgmlOp.MUL_MAT, alloc(F32, (4, 2)), alloc(F32, (8, 4)), alloc(F32, (7, 2))))
    with pytest.raises(UnsupportedOp):
        plan_op(node(GgmlOp.MUL_MAT, alloc(F32, (4, 2, 3)), alloc(F32, (8, 4, 2)), alloc(F32, (8, 2, 3))))
