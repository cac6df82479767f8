"""REPEAT, CONCAT and the row reductions against numpy formulations of their definitions."""

from __future__ import annotations

import numpy as np
import pytest
from support.ops_helpers import F16, F32, I32, alloc, node, padded, params, permuted, random, values

from ggml_rknpu.ggml.enums import GgmlOp
from ggml_rknpu.ggml.ops.registry import UnsupportedOp, plan_op


@pytest.mark.parametrize("type_", [F32, F16, I32])
def test_repeat_tiles_in_every_dim(type_):
    rng = np.random.default_rng(50)
    src = permuted(type_, (3, 2, 1, 2), (1, 0, 2, 3))
    sv = random(src, rng, -9, 9)
    dst = alloc(type_, (6, 4, 3, 2))
    plan_op(node(GgmlOp.REPEAT, dst, src))()
    np.testing.assert_array_equal(values(dst), np.tile(sv, (1, 3, 2, 2)))


@pytest.mark.parametrize("dim", [0, 1, 2, 3])
def test_concat(dim):
    rng = np.random.default_rng(51)
    ne_a, ne_b = [4, 3, 2, 2], [4, 3, 2, 2]
    ne_b[dim] = 5
    a, b = padded(F32, tuple(ne_a)), alloc(F32, tuple(ne_b))
    av, bv = random(a, rng), random(b, rng)
    ne_d = list(ne_a)
    ne_d[dim] += 5
    d = alloc(F32, tuple(ne_d))
    plan_op(node(GgmlOp.CONCAT, d, a, b, op_params=params(dim)))()
    np.testing.assert_array_equal(values(d), np.concatenate([av, bv], axis=3 - dim))
    with pytest.raises(UnsupportedOp):
        plan_op(node(GgmlOp.CONCAT, d, a, b, op_params=params(4)))


def test_reductions():
    rng = np.random.default_rng(52)
    x = padded(F32, (7, 3, 2))
    xv = random(x, rng)
    rows, mean, total = alloc(F32, (1, 3, 2)), alloc(F32, (1, 3, 2)), alloc(F32, (1,))
    plan_op(node(GgmlOp.SUM_ROWS, rows, x))()
    plan_op(node(GgmlOp.MEAN, mean, x))()
    plan_op(node(GgmlOp.SUM, total, x))()
    np.testing.assert_allclose(values(rows), xv.sum(axis=-1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(values(mean), xv.mean(axis=-1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(values(total).reshape(-1), [xv.sum()], rtol=1e-6)
    m = alloc(F32, (7, 4))
    mv = random(m, rng)
    am = alloc(I32, (4,))
    plan_op(node(GgmlOp.ARGMAX, am, m))()
    np.testing.assert_array_equal(am.as_array().reshape(-1), mv[0, 0].argmax(axis=-1))


@pytest.mark.parametrize("dim", [0, 2])
def test_concat_quantized_joins_raw_blocks(dim):
    from ggml_rknpu.ggml.enums import GgmlType
    from ggml_rknpu.ggml.ops.convert import dequantize_rows, quantize_rows
    rng = np.random.default_rng(53)
    q4 = GgmlType.Q4_0
    ne_a, ne_b = [64, 3, 2, 1], [64, 3, 2, 1]
    ne_b[dim] = 32 if dim == 0 else 1
    a, b = alloc(q4, tuple(ne_a)), alloc(q4, tuple(ne_b))
    a.as_array()[...] = quantize_rows(rng.uniform(-1, 1, tuple(ne_a[::-1])), q4)
    b.as_array()[...] = quantize_rows(rng.uniform(-1, 1, tuple(ne_b[::-1])), q4)
    ne_d = list(ne_a)
    ne_d[dim] += ne_b[dim]
    d = alloc(q4, tuple(ne_d))
    plan_op(node(GgmlOp.CONCAT, d, a, b, op_params=params(dim)))()
    want = np.concatenate([dequantize_rows(a.as_array(), q4), dequantize_rows(b.as_array(), q4)], axis=3 - dim)
    np.testing.assert_array_equal(dequantize_rows(d.as_array(), q4), want)
