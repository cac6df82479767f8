"""RMS_NORM and NORM over ne0 (op_params f32 [eps]), f32 only as in ggml-cpu.

ggml-cpu/ops.cpp ``ggml_compute_forward_rms_norm_f32``: squares in f32 summed in double,
``scale = 1/sqrtf(mean + eps)``, ``y = x * scale``.  ``ggml_compute_forward_norm_f32``:
``y = (x - mean) / sqrtf(var + eps)`` with the population variance.
"""

from __future__ import annotations

import numpy as np

from ggml_rknpu.ggml.enums import GgmlOp, GgmlType
from ggml_rknpu.ggml.ops.registry import Closure, OpNode


def _check(node: OpNode) -> tuple[np.ndarray, np.ndarray, np.float32]:
    src, dst = node.require(0), node.dst
    if src.type != GgmlType.F32 or dst.type != GgmlType.F32:
        raise node.unsupported("norms run on f32 only (as ggml-cpu)")
    if src.ne != dst.ne:
        raise node.unsupported(f"src shape {src.ne} != dst shape {dst.ne}")
    eps = node.param_f32(0)
    if not eps >= 0.0:
        raise node.unsupported(f"eps {eps} < 0")
    return src.as_array(), dst.as_array(), np.float32(eps)


def plan_rms_norm(node: OpNode) -> Closure:
    x, d, eps = _check(node)
    n = x.shape[-1]

    def run() -> None:
        mean = (np.add.reduce(np.square(x), axis=-1, dtype=np.float64) / n).astype(np.float32)
        scale = np.float32(1.0) / np.sqrt(mean + eps)
        np.multiply(x, scale[..., None], out=d)
    return run


def plan_norm(node: OpNode) -> Closure:
    x, d, eps = _check(node)

    def run() -> None:
        x64 = x.astype(np.float64)
        centred = x64 - x64.mean(axis=-1, keepdims=True)
        var = np.mean(centred * centred, axis=-1, keepdims=True)
        np.multiply(centred, 1.0 / np.sqrt(var + float(eps)), out=d, casting="unsafe")
    return run


PLANNERS = {GgmlOp.RMS_NORM: plan_rms_norm, GgmlOp.NORM: plan_norm}
