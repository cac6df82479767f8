"""ADD/SUB/MUL/DIV broadcasting, SCALE, RMS_NORM and NORM against loop references."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from support.ops_helpers import BF16, F16, F32, alloc, node, padded, params, permuted, random, values

from ggml_rknpu.ggml.enums import GgmlOp
from ggml_rknpu.ggml.ops.registry import UnsupportedOp, plan_op

OPS = {GgmlOp.ADD: lambda a, b: a + b, GgmlOp.SUB: lambda a, b: a - b,
       GgmlOp.MUL: lambda a, b: a * b, GgmlOp.DIV: lambda a, b: a / b}


def repeat_reference(fn, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """dst[i3,i2,i1,i0] = fn(a[...], b[i3%n3, i2%n2, i1%n1, i0%n0]) element by element."""
    out = np.empty_like(a)
    for idx in itertools.product(*(range(n) for n in a.shape)):
        bidx = tuple(i % n for i, n in zip(idx, b.shape))
        out[idx] = fn(a[idx], b[bidx])
    return out


def rounded(x: np.ndarray, type_: int) -> np.ndarray:
    if type_ == F16:
        return x.astype(np.float16).astype(np.float64)
    if type_ == BF16:
        bits = x.astype(np.float32).view(np.uint32)
        return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    return x.astype(np.float32).astype(np.float64)


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("ne,nr", [((10, 5, 4, 3), (1, 1, 1, 1)), ((10, 5, 4, 3), (2, 1, 1, 1)),
                                   ((10, 5, 4, 3), (1, 2, 2, 2)), ((1, 1, 8, 1), (1, 1, 1, 1)),
                                   ((16, 1, 1, 1), (1, 3, 2, 2)), ((4, 5, 1, 2), (2, 2, 3, 1))])
def test_binary_repeat_f32(op, ne, nr):
    rng = np.random.default_rng(1)
    big = tuple(n * r for n, r in zip(ne, nr))
    a, b, d = alloc(F32, big), alloc(F32, ne), alloc(F32, big)
    av, bv = random(a, rng, 0.5, 2.0), random(b, rng, 0.5, 2.0)
    plan_op(node(op, d, a, b))()
    np.testing.assert_allclose(values(d), rounded(repeat_reference(OPS[op], av, bv), F32), rtol=1e-6)


@pytest.mark.parametrize("types", [(F16, F16, F16), (BF16, BF16, BF16), (F16, F32, F16),
                                   (F16, F32, F32), (BF16, F32, BF16), (BF16, F32, F32)])
def test_binary_mixed_types_round_once(types):
    rng = np.random.default_rng(2)
    t0, t1, td = types
    a, b, d = alloc(t0, (8, 3, 2, 2)), alloc(t1, (8, 1, 2, 1)), alloc(td, (8, 3, 2, 2))
    av, bv = random(a, rng), random(b, rng)
    plan_op(node(GgmlOp.MUL, d, a, b))()
    want = rounded(repeat_reference(lambda x, y: np.float32(x) * np.float32(y), av, bv), td)
    np.testing.assert_array_equal(values(d), want)


def test_binary_permuted_src1_and_padded_src0():
    rng = np.random.default_rng(3)
    a = padded(F32, (6, 4, 3, 2))
    b = permuted(F32, (6, 4, 3, 2), (1, 0, 2, 3))
    d = alloc(F32, (6, 4, 3, 2))
    av, bv = random(a, rng), random(b, rng)
    plan_op(node(GgmlOp.ADD, d, a, b))()
    np.testing.assert_allclose(values(d), av + bv, rtol=1e-6)


def test_binary_in_place_and_replay_reads_new_data():
    rng = np.random.default_rng(4)
    a, b = alloc(F32, (5, 4)), alloc(F32, (5, 1))
    av, bv = random(a, rng), random(b, rng)
    fn = plan_op(node(GgmlOp.ADD, a, a, b))
    fn()
    np.testing.assert_allclose(values(a), av + bv, rtol=1e-6)
    fn()
    np.testing.assert_allclose(values(a), av + 2 * bv, rtol=1e-5)


def test_binary_rejects_unimplemented_types():
    with pytest.raises(UnsupportedOp):
        plan_op(node(GgmlOp.ADD, alloc(F32, (4,)), alloc(F32, (4,)), alloc(F16, (4,))))


@pytest.mark.parametrize("type_,s,b", [(F32, 2.0, 0.0), (F32, 0.5, 1.25), (BF16, 2.0, 1.0)])
def test_scale(type_, s, b):
    rng = np.random.default_rng(5)
    x, d = padded(type_, (10, 3, 2)), alloc(type_, (10, 3, 2))
    xv = random(x, rng)
    plan_op(node(GgmlOp.SCALE, d, x, op_params=params(s, b)))()
    np.testing.assert_allclose(values(d), rounded(xv * s + b, type_), rtol=1e-6 if type_ == F32 else 8e-3)


@pytest.mark.parametrize("eps", [0.0, 1e-6, 0.1, 10.0])
@pytest.mark.parametrize("padded_src", [False, True])
def test_rms_norm_and_norm(eps, padded_src):
    rng = np.random.default_rng(6)
    shape = (64, 5, 4, 3)
    x = padded(F32, shape) if padded_src else alloc(F32, shape)
    xv = random(x, rng, -3, 3)
    d1, d2 = alloc(F32, shape), alloc(F32, shape)
    plan_op(node(GgmlOp.RMS_NORM, d1, x, op_params=params(eps)))()
    plan_op(node(GgmlOp.NORM, d2, x, op_params=params(eps)))()
    for i in itertools.product(range(3), range(4), range(5)):
        row = xv[i]
        rms = row / np.sqrt(np.mean(row * row) + np.float32(eps))
        np.testing.assert_allclose(values(d1)[i], rms, rtol=2e-6, atol=1e-7)
        c = row - row.mean()
        np.testing.assert_allclose(values(d2)[i], c / np.sqrt(np.mean(c * c) + np.float32(eps)), rtol=2e-6, atol=1e-7)


def test_norm_rejects_negative_eps_and_f16():
    with pytest.raises(UnsupportedOp):
        plan_op(node(GgmlOp.RMS_NORM, alloc(F32, (4,)), alloc(F32, (4,)), op_params=params(-1.0)))
    with pytest.raises(UnsupportedOp):
        plan_op(node(GgmlOp.NORM, alloc(F16, (4,)), alloc(F16, (4,)), op_params=params(1e-5)))
