"""Host MUL_MAT for operands that are not resident NPU weights (KQ, KQV, small or odd ones).

ggml semantics (ggml.c ``ggml_mul_mat``, ggml-cpu ``ggml_compute_forward_mul_mat``):
src0 ``[K, M, ne02, ne03]``, src1 ``[K, N, ne12, ne13]``, dst f32 ``[M, N, ne12, ne13]``,
``dst[m, n, i2, i3] = sum_k src0[k, m, i2 / r2, i3 / r3] * src1[k, n, i2, i3]`` with
``r2 = ne12/ne02``, ``r3 = ne13/ne03`` (each src0 matrix serves r2 consecutive src1 ones:
a repeat, not the modulo of the binary ops).  Any strides (permuted views).  src0 of any
type gguf can dequantize; src1 f32/f16/bf16.  Computed as float32 BLAS on contiguous
copies (numpy only reaches BLAS for contiguous inner matrices).  ggml-cpu first converts
src1 to src0's vec-dot type; for f16 and bf16 src0 (the KQ/KQV of an f16 KV cache) that
rounding is reproduced, for quantized src0 (src1 -> q8_0/q8_1/q8_K) it is not (within
test-backend-ops tolerance).
"""

from __future__ import annotations

import numpy as np

from ggml_rknpu.ggml.enums import GgmlOp, GgmlType
from ggml_rknpu.ggml.ops.convert import bf16_to_f32, f32_to_bf16, reader
from ggml_rknpu.ggml.ops.registry import Closure, OpNode, UnsupportedOp


# src1 rounding to the vec-dot type of src0 (ggml-cpu type traits: f16 -> f16, bf16 -> bf16)
_ROUND_TO = {
    GgmlType.F16: lambda b: b.astype(np.float16).astype(np.float32),
    GgmlType.BF16: lambda b: bf16_to_f32(f32_to_bf16(b)),
}


def plan_mul_mat(node: OpNode) -> Closure:
    a_ref, b_ref, dst = node.require(0), node.src(1), node.dst
    if a_ref is None or b_ref is None:
        raise node.unsupported("MUL_MAT needs two sources")
    if dst.type != GgmlType.F32:
        raise node.unsupported("MUL_MAT dst must be f32")
    if b_ref.type not in (GgmlType.F32, GgmlType.F16, GgmlType.BF16):
        raise node.unsupported("src1 must be f32, f16 or bf16")
    k, m, ne02, ne03 = a_ref.ne
    k1, n, ne12, ne13 = b_ref.ne
    if k != k1 or ne12 % ne02 or ne13 % ne03:
        raise node.unsupported(f"cannot multiply {a_ref.ne} by {b_ref.ne}")
    if dst.ne != (m, n, ne12, ne13):
        raise node.unsupported(f"dst {dst.ne} != {(m, n, ne12, ne13)}")
    try:
        read_a, read_b = reader(a_ref), reader(b_ref)
    except UnsupportedOp as exc:
        raise node.unsupported(exc.reason) from exc
    round_b = _ROUND_TO.get(a_ref.type)
    r2, r3 = ne12 // ne02, ne13 // ne03
    out = dst.as_array()                                   # (ne13, ne12, N, M)
    out_grouped = out.reshape(ne03, r3, ne02, r2, n, m) if out.flags.c_contiguous else None
    b_shape = (ne03, r3, ne02, r2 * n, k)

    def run() -> None:
        a = np.ascontiguousarray(read_a(), dtype=np.float32)       # (ne03, ne02, M, K)
        b = np.ascontiguousarray(read_b(), dtype=np.float32)       # (ne13, ne12, N, K)
        if round_b is not None:
            b = round_b(b)
        # group the r2 src1 matrices that share one src0 matrix into one GEMM
        b6 = b.reshape(ne03, r3, ne02, r2, n, k).reshape(b_shape)
        c = np.matmul(b6, a[:, None].swapaxes(-1, -2))              # (ne03, r3, ne02, r2*N, M)
        c = c.reshape(ne03, r3, ne02, r2, n, m)
        if out_grouped is not None:
            out_grouped[...] = c
        else:
            out[...] = c.reshape(ne13, ne12, n, m)
    return run


PLANNERS = {GgmlOp.MUL_MAT: plan_mul_mat}
