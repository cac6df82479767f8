"""ROPE against a per-element loop written from ggml's definition (rope_yarn, rotate_pairs,
mrope sections), covering NORMAL/NEOX/MROPE/IMROPE/VISION, YaRN, freq_factors, n_offs,
partial rotation, f16, views and ROPE_BACK."""

from __future__ import annotations

import math

import numpy as np
import pytest
from support.ops_helpers import F16, F32, I32, alloc, fill, node, padded, params, random, values

from ggml_rknpu.ggml.enums import GgmlOp
from ggml_rknpu.ggml.ops.registry import UnsupportedOp, plan_op

NORMAL, NEOX, MROPE, VISION, IMROPE = 0, 2, 8, 24, 40


def corr_dims(n_dims, n_ctx_orig, base, beta_fast, beta_slow):
    def dim(n_rot):
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))
    return max(0.0, math.floor(dim(beta_fast))), min(n_dims - 1.0, math.ceil(dim(beta_slow)))


def pair_angles(p_streams, mode, n_dims, ne0, base, fscale, ext, attn, bfast, bslow, n_ctx, ff, sections):
    """cos/sin per pair index k (ggml_rope_cache_init / ggml_mrope_cache_init)."""
    theta_scale = np.float32(np.float32(base) ** np.float32(-2.0 / n_dims))
    low, high = corr_dims(n_dims, n_ctx, base, bfast, bslow)
    thetas = [np.float32(p) for p in p_streams]
    out = []
    sect_dims = sum(sections)
    s0, s1, s2, _ = sections
    for k in range(ne0 // 2):
        if mode & MROPE:
            sector = k % sect_dims
            if mode == VISION:
                for i, start in enumerate((0, s0, s0 + s1, s0 + s1 + s2)):
                    if sector == start:
                        thetas[i] = np.float32(p_streams[i])
            if mode == IMROPE:
                pick = 1 if sector % 3 == 1 and sector < 3 * s1 else 2 if sector % 3 == 2 and sector < 3 * s2 \
                    else 0 if sector % 3 == 0 and sector < 3 * s0 else 3
            else:
                pick = 1 if s0 <= sector < s0 + s1 else 2 if s0 + s1 <= sector < s0 + s1 + s2 \
                    else 3 if sector >= s0 + s1 + s2 else 0
            theta = thetas[pick]
        else:
            theta = thetas[0]
        extrap = float(theta) / (ff[k] if ff is not None else 1.0)
        interp = fscale * extrap
        mscale = attn
        if ext != 0.0:
            y = (k - low) / max(0.001, high - low)
            mix = (1 - min(1.0, max(0.0, y))) * ext
            interp = interp * (1 - mix) + extrap * mix
            mscale *= 1.0 + 0.1 * math.log(1.0 / fscale)
        out.append((math.cos(interp) * mscale, math.sin(interp) * mscale))
        thetas = [np.float32(t * theta_scale) for t in thetas]
    return out


def rope_reference(x, pos, mode, n_dims, base, fscale, ext, attn, bfast, bslow, n_ctx, ff, sections,
                   n_offs=0, back=False):
    ne3, ne2, ne1, ne0 = x.shape
    out = x.copy()
    for i2 in range(ne2):
        streams = [pos[i2 + s * ne2] for s in range(4)] if mode & MROPE else [pos[i2]]
        cs = pair_angles(streams, mode, n_dims, ne0, base, fscale, ext, attn, bfast, bslow, n_ctx, ff, sections)
        for i3 in range(ne3):
            for i1 in range(ne1):
                row = x[i3, i2, i1]
                n_pairs = ne0 // 2 if mode == VISION else n_dims // 2
                for k in range(n_pairs):
                    c, s = cs[k]
                    if back:
                        s = -s
                    if mode == NORMAL:
                        a, b = n_offs + 2 * k, n_offs + 2 * k + 1
                    elif mode == VISION:
                        a, b = k, k + n_dims
                    else:
                        a, b = n_offs + k, n_offs + k + n_dims // 2
                    out[i3, i2, i1, a] = row[a] * c - row[b] * s
                    out[i3, i2, i1, b] = row[a] * s + row[b] * c
    return out


def run_rope(type_, ne, mode, n_dims, *, fscale=1.0, ext=0.0, attn=1.0, base=10000.0, use_ff=False,
             sections=(0, 0, 0, 0), n_offs=0, view=False, back=False, seed=0):
    rng = np.random.default_rng(seed)
    x = padded(type_, ne) if view else alloc(type_, ne)
    xv = random(x, rng)
    n_pos = ne[2] * (4 if mode & MROPE else 1)
    pos = alloc(I32, (n_pos,))
    pos.as_array()[...] = rng.integers(0, 60, n_pos)
    ff = None
    srcs = [x, pos]
    if use_ff:
        ffr = alloc(F32, (ne[0] // 2,))
        ff = random(ffr, rng, 0.8, 1.6).reshape(-1)
        srcs.append(ffr)
    d = alloc(type_, ne)
    p = params(0, n_dims, mode, 0, 512, base, fscale, ext, attn, 32.0, 1.0, *sections, n_offs)
    plan_op(node(GgmlOp.ROPE_BACK if back else GgmlOp.ROPE, d, *srcs, op_params=p))()
    want = rope_reference(xv, pos.as_array().reshape(-1), mode, n_dims, base, fscale, ext, attn, 32.0, 1.0,
                          512, ff, sections, n_offs, back)
    return values(d), want


@pytest.mark.parametrize("mode", [NORMAL, NEOX])
@pytest.mark.parametrize("n_dims", [32, 20])
@pytest.mark.parametrize("yarn", [(1.0, 0.0, 1.0), (0.25, 1.0, 1.0), (1.4245, 0.7465, 1.4245)])
@pytest.mark.parametrize("use_ff", [False, True])
def test_rope_norm_neox_yarn_freq_factors(mode, n_dims, yarn, use_ff):
    fscale, ext, attn = yarn
    got, want = run_rope(F32, (32, 3, 4, 2), mode, n_dims, fscale=fscale, ext=ext, attn=attn, use_ff=use_ff)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)  # f32 angles up to ~60 rad carry ~4e-6 rounding


@pytest.mark.parametrize("mode", [NORMAL, NEOX])
def test_rope_f16_view_and_back(mode):
    got, want = run_rope(F16, (16, 2, 5, 1), mode, 16, view=True, back=True, ext=0.5, fscale=0.5)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)
    got, want = run_rope(F32, (16, 2, 5, 1), mode, 16, view=True, back=True)
    np.testing.assert_allclose(got, want, atol=1e-5)  # f32 angles up to ~60 rad carry ~4e-6 rounding


@pytest.mark.parametrize("mode", [NORMAL, NEOX])
def test_rope_n_offs_keeps_other_channels(mode):
    got, want = run_rope(F32, (24, 2, 3, 1), mode, 8, n_offs=6)
    np.testing.assert_allclose(got, want, atol=1e-5)  # f32 angles up to ~60 rad carry ~4e-6 rounding


@pytest.mark.parametrize("mode,n_dims,ne0,sections", [
    (MROPE, 24, 32, (4, 4, 4, 0)), (IMROPE, 24, 32, (4, 4, 4, 0)), (MROPE, 32, 32, (6, 5, 5, 0)),
    (IMROPE, 32, 32, (4, 6, 6, 0)), (VISION, 16, 32, (4, 4, 0, 0))])
def test_rope_multi_section(mode, n_dims, ne0, sections):
    got, want = run_rope(F32, (ne0, 3, 2, 1), mode, n_dims, sections=sections, ext=0.5, fscale=0.5)
    np.testing.assert_allclose(got, want, atol=1e-5)  # f32 angles up to ~60 rad carry ~4e-6 rounding


def test_rope_rotates_in_place():
    rng = np.random.default_rng(9)
    x = alloc(F32, (8, 2, 3))
    xv = random(x, rng)
    pos = alloc(I32, (3,))
    fill(pos, np.array([0, 5, 9]))
    plan_op(node(GgmlOp.ROPE, x, x, pos, op_params=params(0, 8, NEOX, 0, 512, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)))()
    want = rope_reference(xv, [0, 5, 9], NEOX, 8, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0, 512, None, (0, 0, 0, 0))
    np.testing.assert_allclose(values(x), want, atol=1e-5)  # f32 angles up to ~60 rad carry ~4e-6 rounding


def test_rope_bad_params_are_unsupported():
    x, pos = alloc(F32, (8, 2, 3)), alloc(I32, (3,))
    with pytest.raises(UnsupportedOp, match="mode=2"):
        plan_op(node(GgmlOp.ROPE, alloc(F32, (8, 2, 3)), x, pos, op_params=params(0, 10, NEOX)))
    with pytest.raises(UnsupportedOp):
        plan_op(node(GgmlOp.ROPE, alloc(F32, (8, 2, 3)), x, alloc(I32, (2,)), op_params=params(0, 8, NEOX)))


def test_shared_angle_cache_never_mixes_inputs():
    """Nodes sharing positions share angles; a change of positions, freq_factors or params is
    a different entry (replays read the new positions)."""
    rng = np.random.default_rng(14)
    x = alloc(F32, (16, 2, 3))
    xv = random(x, rng)
    pos = alloc(I32, (3,))
    ff1, ff2 = alloc(F32, (8,)), alloc(F32, (8,))
    f1, f2 = random(ff1, rng, 0.5, 2).reshape(-1), random(ff2, rng, 0.5, 2).reshape(-1)
    d1, d2, d3 = alloc(F32, (16, 2, 3)), alloc(F32, (16, 2, 3)), alloc(F32, (16, 2, 3))
    p = params(0, 16, NEOX, 0, 512, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
    p_scaled = params(0, 16, NEOX, 0, 512, 10000.0, 0.5, 0.0, 1.0, 32.0, 1.0)
    runs = [plan_op(node(GgmlOp.ROPE, d1, x, pos, ff1, op_params=p)),
            plan_op(node(GgmlOp.ROPE, d2, x, pos, ff2, op_params=p)),
            plan_op(node(GgmlOp.ROPE, d3, x, pos, ff1, op_params=p_scaled))]
    for positions in ([1, 2, 3], [7, 8, 9]):
        pos.as_array()[...] = positions
        for fn in runs:
            fn()
        for d, ff, fscale in ((d1, f1, 1.0), (d2, f2, 1.0), (d3, f1, 0.5)):
            want = rope_reference(xv, positions, NEOX, 16, 10000.0, fscale, 0.0, 1.0, 32.0, 1.0, 512, ff, (0, 0, 0, 0))
            np.testing.assert_allclose(values(d), want, atol=1e-5)
