"""SOFT_MAX (scale, mask f32/f16 with broadcast, ALiBi, sinks) and FLASH_ATTN_EXT (GQA,
mask, softcap, ALiBi, sinks, quantized K/V, permuted output) against loop references."""

from __future__ import annotations

import math

import numpy as np
import pytest
from support.ops_helpers import F16, F32, alloc, node, params, permuted, random, values

from ggml_rknpu.ggml.enums import GgmlOp, GgmlType
from ggml_rknpu.ggml.ops.convert import dequantize_rows, quantize_rows
from ggml_rknpu.ggml.ops.registry import UnsupportedOp, plan_op


def slope(h: int, n_head: int, max_bias: float) -> float:
    if max_bias <= 0:
        return 1.0
    n_log2 = 2 ** int(math.floor(math.log2(n_head)))
    m0 = 2 ** (-max_bias / n_log2)
    m1 = 2 ** (-(max_bias / 2) / n_log2)
    return m0 ** (h + 1) if h < n_log2 else m1 ** (2 * (h - n_log2) + 1)


def softmax_row(w: np.ndarray, sink: float | None) -> np.ndarray:
    m = max(w.max(), sink) if sink is not None else w.max()
    e = np.exp(w - m)
    total = e.sum() + (math.exp(sink - m) if sink is not None else 0.0)
    return e / total


CASES = [(None, 1, 0.0, s) for s in (False, True)] + [
    (m, heads, bias, s) for m in (F32, F16) for heads in (1, 2) for bias in (0.0, 8.0) for s in (False, True)]


@pytest.mark.parametrize("mask_type,mask_heads,max_bias,sinks", CASES)
def test_soft_max(mask_type, mask_heads, max_bias, sinks):
    rng = np.random.default_rng(10)
    ne = (12, 5, 4, 2)
    x, d = alloc(F32, ne), alloc(F32, ne)
    xv = random(x, rng, -4, 4)
    srcs = [x, None, None]
    mv = None
    if mask_type is not None:
        mask = alloc(mask_type, (12, 7, mask_heads, 1))     # more rows than needed: only the first 5 are read
        mv = random(mask, rng, -2, 2)
        mv[..., 0, 0, 3] = -np.inf
        mask.as_array()[0, 0, 0, 3] = -np.inf
        srcs[1] = mask
    sv = None
    if sinks:
        sk = alloc(F32, (4,))
        sv = random(sk, rng).reshape(-1)
        srcs[2] = sk
    plan_op(node(GgmlOp.SOFT_MAX, d, *srcs, op_params=params(0.7, max_bias)))()
    got = values(d)
    for i3 in range(2):
        for h in range(4):
            for r in range(5):
                w = xv[i3, h, r] * np.float32(0.7)
                if mv is not None:
                    w = w + slope(h, 4, max_bias) * mv[0, h % mask_heads, r]
                want = softmax_row(w, sv[h] if sv is not None else None)
                np.testing.assert_allclose(got[i3, h, r], want, rtol=2e-6, atol=1e-7)


def attention_reference(q, k, v, mask, scale, max_bias, softcap, sinks):
    """q (B,Hq,N,D) k (B,Hk,KV,D) v (B,Hv,KV,DV) -> (B, N, Hq, DV), one query at a time."""
    b_, hq, n, _ = q.shape
    out = np.zeros((b_, n, hq, v.shape[-1]))
    for b in range(b_):
        for h in range(hq):
            kh, vh = h // (hq // k.shape[1]), h // (hq // v.shape[1])
            for i in range(n):
                s = k[b, kh] @ q[b, h, i] * scale
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                if mask is not None:
                    s = s + slope(h, hq, max_bias) * mask[b % mask.shape[0], h % mask.shape[1], i, :k.shape[2]]
                keep = np.isfinite(s)
                if not keep.any() and sinks is None:
                    continue
                p = softmax_row(np.where(keep, s, -np.inf), sinks[h] if sinks is not None else None)
                out[b, i, h] = p @ v[b, vh]
    return out


@pytest.mark.parametrize("kv_type", [F16, F32, GgmlType.Q8_0])
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("softcap,max_bias,sinks", [(0.0, 0.0, False), (10.0, 0.0, False),
                                                   (0.0, 8.0, True), (0.0, 0.0, True)])
def test_flash_attn_ext(kv_type, gqa, softcap, max_bias, sinks):
    rng = np.random.default_rng(11)
    dk, dv, n, n_kv, hk = 64, 64, 3, 40, 2
    hq = hk * gqa
    q = permuted(F32, (dk, n, hq, 1), (0, 2, 1, 3))           # ggml's permuted q view
    qv = random(q, rng)
    kf = rng.uniform(-1, 1, (1, hk, n_kv, dk))
    vf = rng.uniform(-1, 1, (1, hk, n_kv, dv))
    k, v = alloc(kv_type, (dk, n_kv, hk, 1)), alloc(kv_type, (dv, n_kv, hk, 1))
    if kv_type == GgmlType.Q8_0:
        k.as_array()[...] = quantize_rows(kf, kv_type)
        v.as_array()[...] = quantize_rows(vf, kv_type)
        kf, vf = dequantize_rows(k.as_array(), kv_type), dequantize_rows(v.as_array(), kv_type)
    else:
        k.as_array()[...] = kf
        v.as_array()[...] = vf
        kf, vf = values(k), values(v)
    mask = alloc(F16, (n_kv, 8, 1, 1))                          # rows padded past N
    mv = np.zeros((1, 1, 8, n_kv))
    mv[..., 30:] = -np.inf                                      # unused cache cells
    mv[..., 1, 5] = -np.inf
    mv[..., :, :30] += rng.uniform(-1, 0, (8, 30)).astype(np.float16)
    mask.as_array()[...] = mv
    mv = values(mask)
    srcs = [q, k, v, mask]
    sv = None
    if sinks:
        sk = alloc(F32, (hq,))
        sv = random(sk, rng).reshape(-1)
        srcs.append(sk)
    d = alloc(F32, (dv, hq, n, 1))
    scale = 1 / math.sqrt(dk)
    plan_op(node(GgmlOp.FLASH_ATTN_EXT, d, *srcs, op_params=params(scale, max_bias, softcap)))()
    qref = qv.astype(np.float16).astype(np.float64) if kv_type == F16 else qv
    want = attention_reference(qref, kf, vf, mv, scale, max_bias, softcap, sv)
    np.testing.assert_allclose(values(d), want, rtol=1e-5, atol=2e-6)


def test_flash_attn_fully_masked_row_is_zero():
    rng = np.random.default_rng(12)
    q, k, v = alloc(F32, (16, 2, 1, 1)), alloc(F16, (16, 4, 1, 1)), alloc(F16, (16, 4, 1, 1))
    for t in (q, k, v):
        random(t, rng)
    mask = alloc(F16, (4, 2, 1, 1))
    mask.as_array()[...] = 0
    mask.as_array()[0, 0, 1] = -np.inf
    d = alloc(F32, (16, 1, 2, 1))
    plan_op(node(GgmlOp.FLASH_ATTN_EXT, d, q, k, v, mask, op_params=params(0.25, 0.0, 0.0)))()
    assert np.all(values(d)[0, 1] == 0)
    assert np.all(np.isfinite(values(d)))


def test_flash_attn_rejects_mismatched_heads():
    with pytest.raises(UnsupportedOp):
        plan_op(node(GgmlOp.FLASH_ATTN_EXT, alloc(F32, (8, 3, 1, 1)), alloc(F32, (8, 1, 3, 1)),
                     alloc(F16, (8, 4, 2, 1)), alloc(F16, (8, 4, 2, 1)), op_params=params(1.0)))


@pytest.mark.parametrize("max_bias", [0.0, 8.0])
def test_flash_attn_mask_per_head_group(max_bias):
    """A mask with 2 heads for 4 q heads is read as mask[.., h % 2] (ALiBi slopes per q head)."""
    rng = np.random.default_rng(13)
    q, k, v = alloc(F32, (32, 2, 4, 1)), alloc(F16, (32, 6, 2, 1)), alloc(F16, (32, 6, 2, 1))
    qv, kv, vv = random(q, rng), random(k, rng), random(v, rng)
    mask = alloc(F16, (6, 2, 2, 1))
    mv = random(mask, rng, -2, 0)
    d = alloc(F32, (32, 4, 2, 1))
    plan_op(node(GgmlOp.FLASH_ATTN_EXT, d, q, k, v, mask, op_params=params(0.2, max_bias, 0.0)))()
    want = attention_reference(qv.astype(np.float16).astype(np.float64), kv, vv, mv, 0.2, max_bias, 0.0, None)
    np.testing.assert_allclose(values(d), want, rtol=1e-5, atol=2e-6)


def test_flash_attn_never_reads_the_masked_cache_tail():
    """Cells after the last visible key hold garbage (NaN): ggml skips them, so must we."""
    rng = np.random.default_rng(14)
    q, k, v = alloc(F32, (16, 1, 2, 1)), alloc(F16, (16, 8, 1, 1)), alloc(F16, (16, 8, 1, 1))
    qv, kv, vv = random(q, rng), random(k, rng), random(v, rng)
    k.as_array()[0, 0, 5:] = np.nan
    v.as_array()[0, 0, 5:] = np.nan
    mask = alloc(F16, (8, 1, 1, 1))
    mask.as_array()[...] = 0
    mask.as_array()[..., 5:] = -np.inf
    d = alloc(F32, (16, 2, 1, 1))
    plan_op(node(GgmlOp.FLASH_ATTN_EXT, d, q, k, v, mask, op_params=params(0.25, 0.0, 0.0)))()
    want = attention_reference(qv.astype(np.float16).astype(np.float64), kv[:, :, :5], vv[:, :, :5],
                               np.zeros((1, 1, 1, 5)), 0.25, 0.0, 0.0, None)
    np.testing.assert_allclose(values(d), want, rtol=1e-5, atol=2e-6)
