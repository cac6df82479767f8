"""SOFT_MAX over ne0 with scale, optional mask, ALiBi and attention sinks.

ggml-cpu/ops.cpp ``ggml_compute_forward_soft_max_f32`` (llama.cpp 0c1e570):
``w = x*scale + slope(h)*mask[i01, i02 % ne12, i03 % ne13]`` (mask f32 or f16, its rows are
the query rows, so only its first ne01 rows are read); ``p = exp(w - max) / sum``; with
sinks (src2, f32 per head) ``max`` also covers ``sink[h]`` and the sum gains
``exp(sink[h] - max)``.  op_params f32 ``[scale, max_bias]``; ALiBi slopes as
``ggml_compute_forward_soft_max_f32``: ``m0 = 2^(-max_bias/n_head_log2)``,
``m1 = 2^(-max_bias/2/n_head_log2)``, ``slope(h) = m0^(h+1)`` for ``h < n_head_log2`` else
``m1^(2(h - n_head_log2) + 1)``, ``n_head_log2 = 2^floor(log2(n_head))``.
"""

from __future__ import annotations

import math

import numpy as np

from ggml_rknpu.ggml.enums import GgmlOp, GgmlType
from ggml_rknpu.ggml.ops.convert import split_repeat
from ggml_rknpu.ggml.ops.registry import Closure, OpNode


def alibi_slopes(n_head: int, max_bias: float) -> np.ndarray:
    """Per-head ALiBi slope (1 for every head when max_bias <= 0), f32 as ggml."""
    if max_bias <= 0.0:
        return np.ones(n_head, np.float32)
    f = np.float32
    n_head_log2 = 1 << int(math.floor(math.log2(n_head)))
    m0 = f(2.0) ** f(-max_bias / n_head_log2)
    m1 = f(2.0) ** f(-(max_bias / 2.0) / n_head_log2)
    return np.array([m0 ** f(h + 1) if h < n_head_log2 else m1 ** f(2 * (h - n_head_log2) + 1)
                     for h in range(n_head)], np.float32)


def plan_soft_max(node: OpNode) -> Closure:
    src, mask_ref, sinks_ref, dst = node.require(0), node.src(1), node.src(2), node.dst
    if src.type != GgmlType.F32 or dst.type != GgmlType.F32 or src.ne != dst.ne:
        raise node.unsupported("SOFT_MAX runs on f32 with dst of the same shape")
    if mask_ref is not None and mask_ref.type not in (GgmlType.F32, GgmlType.F16):
        raise node.unsupported("mask must be f32 or f16")
    if sinks_ref is not None and (sinks_ref.type != GgmlType.F32 or sinks_ref.ne[0] < src.ne[2]):
        raise node.unsupported("sinks must be f32 with one entry per head")
    scale = np.float32(node.param_f32(0))
    max_bias = node.param_f32(1)
    ne00, ne01, ne02, _ = src.ne
    x, d = src.as_array(), dst.as_array()
    if np.shares_memory(d, x) and not (d.__array_interface__ == x.__array_interface__):
        raise node.unsupported("dst partially overlaps src")
    use_slope = max_bias > 0.0
    mask = d_split = slope_split = None
    if mask_ref is not None:
        if mask_ref.ne[0] != ne00 or mask_ref.ne[1] < ne01:
            raise node.unsupported(f"mask shape {mask_ref.ne} does not cover {src.ne}")
        slope_full = np.broadcast_to(alibi_slopes(ne02, max_bias)[None, :, None, None], d.shape)
        # dst doubles as the work buffer: the mask is added into it in place
        (d_split, slope_split), mask = split_repeat((d, slope_full), mask_ref.as_array()[:, :, :ne01, :])
    sinks = sinks_ref.as_array()[0, 0, 0, :ne02][None, :, None, None] if sinks_ref is not None else None

    def run() -> None:
        np.multiply(x, scale, out=d)
        if mask is not None:
            np.add(d_split, slope_split * mask if use_slope else mask, out=d_split)
        w_max = d.max(axis=-1, keepdims=True)
        if sinks is not None:
            w_max = np.maximum(w_max, sinks)
        np.subtract(d, w_max, out=d)
        np.exp(d, out=d)
        total = d.sum(axis=-1, keepdims=True, dtype=np.float64)
        if sinks is not None:
            total += np.exp(sinks - w_max)
        np.multiply(d, (1.0 / total).astype(np.float32), out=d)
    return run


PLANNERS = {GgmlOp.SOFT_MAX: plan_soft_max}
