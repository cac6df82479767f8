"""ROPE / ROPE_BACK: rotary position embedding, all ggml modes, YaRN, freq_factors.

Facts from ggml-cpu/ops.cpp ``ggml_compute_forward_rope_flt`` and ggml.c
``ggml_rope_yarn_corr_dims`` (llama.cpp 0c1e570):

* op_params int32 ``[_, n_dims, mode, _, n_ctx_orig, freq_base, freq_scale, ext_factor,
  attn_factor, beta_fast, beta_slow, sections[4], n_offs]`` (floats bit-cast).
* src1: int32 positions, one per ``i2`` (4 per ``i2`` for the multi-section modes:
  t, h, w, e at ``i2 + k*ne2``); src2: optional f32 ``freq_factors[n_dims/2]``.
* per pair k (``i0 = 2k``): ``theta_k`` is the position times ``theta_scale^k`` built by
  repeated f32 multiplication (``theta *= theta_scale``; reproduced exactly here with a
  sequential ``multiply.accumulate``), ``theta_scale = freq_base^(-2/n_dims)``;
  ``rope_yarn``: ``theta = freq_scale*theta/ff`` mixed with the extrapolated angle by the
  ramp when ``ext_factor != 0``, which also scales the magnitude by
  ``1 + 0.1*ln(1/freq_scale)``; cos/sin are multiplied by ``attn_factor``.
* NORMAL rotates (x[2k], x[2k+1]); NEOX / MROPE / IMROPE rotate (x[k], x[k+n_dims/2]);
  both from offset ``n_offs``; VISION rotates (x[k], x[k+n_dims]) over all ne0 with
  per-section restarts.  Channels outside the rotated range are copied.
* ROPE_BACK is the same with sin negated (the inverse rotation).
"""

from __future__ import annotations

import math

import numpy as np

from ggml_rknpu.ggml.enums import GgmlOp, GgmlType
from ggml_rknpu.ggml.ops.registry import Closure, OpNode

MODE_NORMAL = 0  # ggml.h GGML_ROPE_TYPE_NORMAL
MODE_NEOX = 2    # GGML_ROPE_TYPE_NEOX
MODE_MROPE = 8   # GGML_ROPE_TYPE_MROPE
MODE_VISION = 24  # GGML_ROPE_TYPE_VISION
MODE_IMROPE = 40  # GGML_ROPE_TYPE_IMROPE
_MODES = (MODE_NORMAL, MODE_NEOX, MODE_MROPE, MODE_VISION, MODE_IMROPE)

# (parameters, positions, freq_factors) -> (cos, sin); cleared when full. The arrays are
# never written after creation, so sharing them between nodes is safe.
_ANGLE_CACHE: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
_ANGLE_CACHE_SIZE = 16


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float,
                   beta_slow: float) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims, in f32 as ggml computes it. Like C's logf, log(0) is -inf
    (n_ctx_orig = 0 occurs, e.g. in test-backend-ops), giving dims (0, -inf), not an error."""
    def corr_dim(n_rot: float) -> np.float32:
        f = np.float32
        with np.errstate(divide="ignore"):
            return f(n_dims) * np.log(f(n_ctx_orig) / (f(n_rot) * f(2) * f(math.pi))) / (f(2) * np.log(f(freq_base)))
    start = np.floor(corr_dim(beta_fast))
    end = np.ceil(corr_dim(beta_slow))
    return float(max(np.float32(0), start)), float(min(np.float32(n_dims - 1), end))


def _section_sources(mode: int, sections: list[int], n_cols: int) -> tuple[np.ndarray, np.ndarray]:
    """For each pair column: which position stream (t=0, h=1, w=2, e=3) drives it and
    how many theta_scale steps its angle has taken (ggml_mrope_cache_init)."""
    s0, s1, s2, s3 = sections
    sect_dims = s0 + s1 + s2 + s3
    sec_w = s0 + s1
    sec_e = sec_w + s2
    is_imrope = mode == MODE_IMROPE
    indep = mode == MODE_VISION
    source = np.zeros(n_cols, np.intp)
    steps = np.arange(n_cols, dtype=np.intp)
    restart = [0, 0, 0, 0]
    for k in range(n_cols):
        sector = k % sect_dims
        if indep:
            for stream, start in enumerate((0, s0, sec_w, sec_e)):
                if sector == start:
                    restart[stream] = k
        if is_imrope:
            if sector % 3 == 1 and sector < 3 * s1:
                src = 1
            elif sector % 3 == 2 and sector < 3 * s2:
                src = 2
            elif sector % 3 == 0 and sector < 3 * s0:
                src = 0
            else:
                src = 3
        elif s0 <= sector < sec_w:
            src = 1
        elif sec_w <= sector < sec_w + s2:
            src = 2
        elif sector >= sec_w + s2:
            src = 3
        else:
            src = 0
        source[k] = src
        steps[k] = k - restart[src]
    return source, steps


def plan_rope(node: OpNode) -> Closure:
    src, pos_ref, dst = node.require(0), node.src(1), node.dst
    ff_ref = node.src(2)
    mode = node.param_i32(2)
    extra = f"mode={mode}"
    if src is None or pos_ref is None or pos_ref.type != GgmlType.I32:
        raise node.unsupported("ROPE needs src0 and int32 positions", extra)
    if src.type not in (GgmlType.F32, GgmlType.F16) or dst.type != src.type:
        raise node.unsupported("ROPE runs on f32/f16 with dst of the same type", extra)
    if mode not in _MODES:
        raise node.unsupported("unknown rope mode", extra)
    if src.ne != dst.ne:
        raise node.unsupported(f"src shape {src.ne} != dst shape {dst.ne}", extra)
    ne0, _, ne2, _ = src.ne
    n_dims = node.param_i32(1)
    n_ctx_orig = node.param_i32(4)
    freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow = (
        node.param_f32(i) for i in range(5, 11))
    sections = [node.param_i32(i) for i in range(11, 15)]
    n_offs = node.param_i32(15)
    if not (0 < n_dims <= ne0 and n_dims % 2 == 0 and n_offs >= 0 and n_offs % 2 == 0
            and n_offs + n_dims <= ne0):
        raise node.unsupported(f"bad n_dims={n_dims} n_offs={n_offs} for ne0={ne0}", extra)
    multi = bool(mode & MODE_MROPE)
    vision = mode == MODE_VISION
    if multi and not any(s > 0 for s in sections[:3]):
        raise node.unsupported("multi-section rope without sections", extra)
    if multi and sum(sections) > ne0:
        raise node.unsupported("sections exceed ne0", extra)
    if vision and (n_dims != ne0 // 2 or n_offs != 0):
        raise node.unsupported("vision rope needs n_dims == ne0/2 and n_offs == 0", extra)
    n_streams = 4 if multi else 1
    if pos_ref.ne[0] < ne2 * n_streams:
        raise node.unsupported(f"{pos_ref.ne[0]} positions for ne2={ne2}", extra)
    n_cols = ne0 // 2 if vision else n_dims // 2
    if ff_ref is not None and (ff_ref.type != GgmlType.F32 or ff_ref.ne[0] < n_dims // 2):
        raise node.unsupported("freq_factors must be f32 with >= n_dims/2 entries", extra)

    f32 = np.float32
    theta_scale = f32(f32(freq_base) ** f32(-2.0 / n_dims))
    sin_sign = f32(-1.0 if node.op == GgmlOp.ROPE_BACK else 1.0)
    freq_scale_f = f32(freq_scale)
    mscale = f32(attn_factor)
    ramp_mix = None
    if ext_factor != 0.0:
        low, high = yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
        k = np.arange(n_cols, dtype=np.float32)
        y = (k - f32(low)) / f32(max(0.001, high - low))
        ramp_mix = ((f32(1) - np.minimum(f32(1), np.maximum(f32(0), y))) * f32(ext_factor)).astype(np.float32)
        mscale = f32(mscale * f32(f32(1.0) + f32(0.1) * f32(math.log(1.0 / freq_scale))))

    positions = pos_ref.as_array()[0, 0, 0]  # a view: read at every run
    freq_factors = ff_ref.as_array()[0, 0, 0, :n_cols] if ff_ref is not None else None
    if vision and freq_factors is not None and freq_factors.size < n_cols:
        raise node.unsupported("vision rope freq_factors shorter than ne0/2", extra)
    steps_matrix = np.full((n_streams, ne2, n_cols), theta_scale, dtype=np.float32)
    if multi:
        source, steps = _section_sources(mode, sections, n_cols)
    else:
        source = steps = None

    # every layer's q and k ROPE of one token has the same positions and parameters: the
    # angles are computed once and shared through a small cache keyed by all their inputs
    static_key = (mode, n_dims, ne2, n_cols, n_streams, float(theta_scale), float(freq_scale_f),
                  float(mscale), float(sin_sign), None if ramp_mix is None else ramp_mix.tobytes(),
                  tuple(sections))

    def cached_angles() -> tuple[np.ndarray, np.ndarray]:
        key = (static_key, positions[:ne2 * n_streams].tobytes(),
               None if freq_factors is None else freq_factors.tobytes())
        hit = _ANGLE_CACHE.get(key)
        if hit is None:
            if len(_ANGLE_CACHE) >= _ANGLE_CACHE_SIZE:
                _ANGLE_CACHE.clear()
            hit = _ANGLE_CACHE[key] = angles()
        return hit

    def angles() -> tuple[np.ndarray, np.ndarray]:
        """cos and sin, shape (ne2, n_cols), for the current positions."""
        m = steps_matrix.copy()
        m[:, :, 0] = positions[:ne2 * n_streams].reshape(n_streams, ne2)
        powers = np.multiply.accumulate(m, axis=2, dtype=np.float32)
        theta = powers[0] if source is None else powers[source, :, steps].T
        if freq_factors is not None:
            theta = theta / freq_factors
        interp = freq_scale_f * theta
        if ramp_mix is not None:
            interp = interp * (f32(1) - ramp_mix) + theta * ramp_mix
        return np.cos(interp) * mscale, np.sin(interp) * (mscale * sin_sign)

    x, d = src.as_array(), dst.as_array()
    if mode == MODE_NORMAL:
        x0, x1 = x[..., n_offs:n_offs + n_dims:2], x[..., n_offs + 1:n_offs + n_dims:2]
        d0, d1 = d[..., n_offs:n_offs + n_dims:2], d[..., n_offs + 1:n_offs + n_dims:2]
    elif vision:
        x0, x1 = x[..., :n_dims], x[..., n_dims:2 * n_dims]
        d0, d1 = d[..., :n_dims], d[..., n_dims:2 * n_dims]
    else:
        half = n_dims // 2
        x0, x1 = x[..., n_offs:n_offs + half], x[..., n_offs + half:n_offs + n_dims]
        d0, d1 = d[..., n_offs:n_offs + half], d[..., n_offs + half:n_offs + n_dims]
    copies = []
    if not vision:
        if n_offs > 0:
            copies.append((d[..., :n_offs], x[..., :n_offs]))
        if n_offs + n_dims < ne0:
            copies.append((d[..., n_offs + n_dims:], x[..., n_offs + n_dims:]))
    same_memory = np.shares_memory(x, d)

    def run() -> None:
        cos, sin = cached_angles()
        cos = cos[None, :, None, :]
        sin = sin[None, :, None, :]
        a = x0.astype(np.float32, copy=False)
        b = x1.astype(np.float32, copy=False)
        r0 = a * cos - b * sin
        r1 = a * sin + b * cos
        np.copyto(d0, r0, casting="unsafe")
        np.copyto(d1, r1, casting="unsafe")
        if not same_memory:
            for dst_part, src_part in copies:
                np.copyto(dst_part, src_part)
    return run


PLANNERS = {GgmlOp.ROPE: plan_rope, GgmlOp.ROPE_BACK: plan_rope}
