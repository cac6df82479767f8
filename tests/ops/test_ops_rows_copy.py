"""GET_ROWS, SET_ROWS (incl. quantized src/dst, index broadcast, bad indices) and
CPY/DUP/CONT (type conversion, permutations, reshapes, strided dst, quantized)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from support.ops_helpers import (BF16, F16, F32, I32, I64, alloc, node, padded, permute, permuted,
                         random, values)

from ggml_rknpu.ggml.enums import GgmlOp, GgmlType
from ggml_rknpu.ggml.ops.convert import dequantize_rows, quantize_rows
from ggml_rknpu.ggml.ops.registry import OpDataError, UnsupportedOp, plan_op

Q4_0, Q8_0, Q4_K = GgmlType.Q4_0, GgmlType.Q8_0, GgmlType.Q4_K


@pytest.mark.parametrize("src_type", [F32, F16, BF16, I32, Q8_0, Q4_0, Q4_K])
def test_get_rows(src_type):
    rng = np.random.default_rng(30)
    ne00 = 256
    src = alloc(src_type, (ne00, 7, 2, 3))
    if src_type in (Q8_0, Q4_0):
        src.as_array()[...] = quantize_rows(rng.uniform(-1, 1, (3, 2, 7, ne00)), src_type)
        table = dequantize_rows(src.as_array(), src_type).astype(np.float64)
    elif src_type == Q4_K:                       # random blocks with small f16 d/dmin
        raw = src.as_array()
        raw[...] = rng.integers(0, 256, raw.shape, dtype=np.uint8)
        raw[..., 0:4] = np.frombuffer(np.array([0.01, 0.002], np.float16).tobytes(), np.uint8)
        table = dequantize_rows(raw, src_type).astype(np.float64)
    elif src_type == I32:
        src.as_array()[...] = rng.integers(-1000, 1000, src.as_array().shape)
        table = values(src)
    else:
        table = random(src, rng)
    idx = alloc(I32, (4, 2, 3))
    idx.as_array()[...] = rng.integers(0, 7, (1, 3, 2, 4))
    dst = alloc(I32 if src_type == I32 else F32, (ne00, 4, 2, 3))
    plan_op(node(GgmlOp.GET_ROWS, dst, src, idx))()
    got = values(dst)
    for i12, i11, i10 in itertools.product(range(3), range(2), range(4)):
        r = idx.as_array()[0, i12, i11, i10]
        np.testing.assert_array_equal(got[i12, i11, i10], table[i12, i11, r])


def test_get_rows_bad_index_raises_data_error():
    src, idx, dst = alloc(F32, (4, 3)), alloc(I32, (2,)), alloc(F32, (4, 2))
    fn = plan_op(node(GgmlOp.GET_ROWS, dst, src, idx))
    idx.as_array()[...] = [0, 3]
    with pytest.raises(OpDataError):
        fn()
    idx.as_array()[...] = [-1, 0]
    with pytest.raises(OpDataError):
        fn()


@pytest.mark.parametrize("dst_type", [F32, F16, BF16, Q8_0, Q4_0])
@pytest.mark.parametrize("idx_type", [I32, I64])
@pytest.mark.parametrize("src_type", [F32, F16])
@pytest.mark.parametrize("planes", [(4, 2), (1, 1)])
def test_set_rows_with_index_broadcast(dst_type, idx_type, src_type, planes):
    rng = np.random.default_rng(31)
    ne0, rows_in, n_dst = 64, 3, 9
    ne2, ne3 = planes
    idx_planes = min(ne2, 2)
    src = padded(src_type, (ne0, rows_in, ne2, ne3))
    sv = random(src, rng)
    idx = alloc(idx_type, (rows_in, idx_planes, 1))   # broadcast over ne2 (i2 % 2) and ne3 (i3 % 1)
    perm = [rng.permutation(n_dst)[:rows_in] for _ in range(idx_planes)]
    idx.as_array()[0, 0] = np.stack(perm)
    dst = alloc(dst_type, (ne0, n_dst, ne2, ne3))
    before = dst.as_array().copy()
    plan_op(node(GgmlOp.SET_ROWS, dst, src, idx))()
    after = dst.as_array()
    written = np.zeros(after.shape[:3], bool)
    for i3, i2, i in itertools.product(range(ne3), range(ne2), range(rows_in)):
        r = idx.as_array()[0, 0, i2 % idx_planes, i]
        written[i3, i2, r] = True
        row = sv[i3, i2, i]
        if dst_type in (Q8_0, Q4_0):
            np.testing.assert_array_equal(after[i3, i2, r], quantize_rows(row, dst_type))
        elif dst_type == BF16:
            np.testing.assert_allclose(values(dst)[i3, i2, r], row, rtol=4e-3)
        else:
            np.testing.assert_array_equal(values(dst)[i3, i2, r], row.astype(after.dtype).astype(np.float64))
    np.testing.assert_array_equal(after[~written], before[~written])   # other rows untouched


def test_set_rows_bad_index_raises_data_error():
    src, idx, dst = alloc(F32, (4, 1)), alloc(I64, (1,)), alloc(F16, (4, 3))
    idx.as_array()[...] = 3
    with pytest.raises(OpDataError):
        plan_op(node(GgmlOp.SET_ROWS, dst, src, idx))()


@pytest.mark.parametrize("src_type,dst_type", [(F32, F32), (F32, F16), (F16, F32), (F16, F16), (BF16, F32),
                                               (F32, BF16), (F32, I32), (I32, F32), (I32, I32)])
@pytest.mark.parametrize("layout", ["contiguous", "permuted_src", "permuted_dst", "reshape"])
def test_cpy_types_and_layouts(src_type, dst_type, layout):
    rng = np.random.default_rng(32)
    ne = (6, 4, 3, 2)
    src = permuted(src_type, ne, (0, 2, 1, 3)) if layout == "permuted_src" else alloc(src_type, ne)
    sv = random(src, rng, -50, 50)
    if layout == "permuted_dst":
        dst = permuted(dst_type, ne, (1, 0, 2, 3))
    elif layout == "reshape":
        dst = alloc(dst_type, (12, 12))
    else:
        dst = alloc(dst_type, ne)
    plan_op(node(GgmlOp.CPY, dst, src, dst))()
    want = sv.reshape(dst.ne[::-1])            # logical row-major order carries over
    got = values(dst)
    if dst_type == BF16:
        np.testing.assert_allclose(got, want, rtol=4e-3)
    else:
        np.testing.assert_array_equal(got, want.astype(dst.as_array().dtype).astype(np.float64))


def test_cont_of_transposed_view_and_dup_to_strided_dst():
    rng = np.random.default_rng(33)
    base = alloc(F32, (5, 3, 2))
    bv = random(base, rng)
    t = permute(base, (1, 0, 2, 3))            # ggml_transpose
    dst = alloc(F32, t.ne)
    plan_op(node(GgmlOp.CONT, dst, t))()
    np.testing.assert_array_equal(values(dst), bv.swapaxes(-1, -2))
    strided = padded(F32, (5, 3, 2))
    plan_op(node(GgmlOp.DUP, strided, base))()
    np.testing.assert_array_equal(values(strided), bv)


def test_cpy_quantized_both_ways_and_same_type_rows():
    rng = np.random.default_rng(34)
    x = alloc(F32, (64, 3, 2))
    xv = random(x, rng)
    q = alloc(Q8_0, (64, 3, 2))
    plan_op(node(GgmlOp.CPY, q, x, q))()
    np.testing.assert_array_equal(q.as_array(), quantize_rows(xv, Q8_0))
    back = alloc(F32, (64, 3, 2))
    plan_op(node(GgmlOp.CPY, back, q, back))()
    np.testing.assert_array_equal(values(back), dequantize_rows(q.as_array(), Q8_0))
    np.testing.assert_allclose(values(back), xv, atol=0.01)
    q2 = alloc(Q8_0, (64, 6))
    plan_op(node(GgmlOp.CPY, q2, q, q2))()
    np.testing.assert_array_equal(q2.as_array().reshape(-1), q.as_array().reshape(-1))


def test_cpy_rejects_count_mismatch_and_unquantizable_target():
    with pytest.raises(UnsupportedOp):
        plan_op(node(GgmlOp.CPY, alloc(F32, (5,)), alloc(F32, (4,))))
    with pytest.raises(UnsupportedOp):
        plan_op(node(GgmlOp.CPY, alloc(Q4_K, (256,)), alloc(F32, (256,))))


def test_set_rows_of_zero_rows_writes_nothing():
    dst = alloc(GgmlType.TQ2_0, (256, 4))
    before = dst.as_array().copy()
    src = alloc(F32, (256, 0, 1, 1))
    plan_op(node(GgmlOp.SET_ROWS, dst, src, alloc(I64, (0,))))()
    np.testing.assert_array_equal(dst.as_array(), before)


def test_q8_0_quantizer_rounds_ties_to_even_like_ggml_cpu():
    row = np.zeros(32, np.float32)
    row[0] = 127.0
    row[1:6] = [0.5, 1.5, 2.5, -0.5, -2.5]                  # exact ties at scale 1
    q = quantize_rows(row, Q8_0)
    assert np.frombuffer(q[:2].tobytes(), np.float16)[0] == 1.0
    np.testing.assert_array_equal(q[2:8].view(np.int8), [127, 0, 2, 2, 0, -2])
    np.testing.assert_array_equal(dequantize_rows(q, Q8_0)[:6], [127, 0, 2, 2, 0, -2])


def test_q1_0_and_q2_0_codecs_follow_ggml_reference():
    rng = np.random.default_rng(35)
    x = rng.uniform(-1, 1, (3, 128)).astype(np.float32)
    q1 = quantize_rows(x, GgmlType.Q1_0)
    assert q1.shape == (3, 18)
    d1 = np.abs(x).sum(axis=-1) / 128
    np.testing.assert_allclose(np.frombuffer(q1[:, :2].tobytes(), np.float16), d1, rtol=1e-3)
    back = dequantize_rows(q1, GgmlType.Q1_0)
    np.testing.assert_array_equal(back, np.where(x >= 0, 1, -1) * np.frombuffer(q1[:, :2].tobytes(), np.float16).astype(np.float32)[:, None])
    x2 = rng.uniform(-1, 1, (2, 128)).astype(np.float32)
    x2[0, :4] = [1.0, 0.5, -0.5, 0.25]                       # block amax 1: ties round away from zero
    q2 = quantize_rows(x2, GgmlType.Q2_0)
    assert q2.shape == (2, 36)
    v = dequantize_rows(q2, GgmlType.Q2_0)
    np.testing.assert_array_equal(v[0, :4], [1.0, 1.0, -1.0, 0.0])
    for r in range(2):
        for blk in range(2):
            seg = x2[r, blk * 64:(blk + 1) * 64]
            d = np.float16(np.abs(seg).max()).astype(np.float32)
            want = (np.clip([np.floor(abs(t) / np.abs(seg).max() + 0.5) * np.sign(t) for t in seg], -1, 2)) * d
            np.testing.assert_allclose(v[r, blk * 64:(blk + 1) * 64], want, rtol=1e-6)
