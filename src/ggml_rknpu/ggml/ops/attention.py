"""FLASH_ATTN_EXT: softmax(scale * q k^T (+ softcap, + slope*mask)) v, with GQA and sinks.

ggml-cpu/ops.cpp ``ggml_compute_forward_flash_attn_ext_f16_one_chunk`` (llama.cpp 0c1e570):

* q ``[DK, N, Hq, B]`` f32; k ``[DK, KV, Hk, B]`` and v ``[DV, KV, Hv, B]`` (f32, f16, bf16
  or a gguf-dequantizable quant type); head ``h`` reads kv head ``h / (Hq/Hk)``.
* mask (src3) f16/f32 ``[KV, >=N, m2, m3]`` broadcast as ``mask[i1, h % m2, b % m3]``; a key
  whose mask is -inf is skipped; sinks (src4) f32 per head join the softmax denominator.
* op_params f32 ``[scale, max_bias, logit_softcap]`` (+ int prec at [3], ignored: f32 here);
  with softcap ``s = softcap * tanh(s * scale / softcap)``; ALiBi slopes as SOFT_MAX.
* q is first converted to the K dot type; for f16 K that rounds q to f16, reproduced here.
* the result is written permuted: dst ``[DV, Hq, N, B]`` f32, row ``(b, i1, h)``.
  A row whose keys are all masked (and no sink) is 0 (``S == 0`` gives ``1/S = 0``).

Keys after the last one the mask lets any query see are not read at all (ggml skips -inf
keys), so the padded tail of a decode-time KV view costs nothing and may hold anything.
Masked keys inside that range are computed with weight 0, which equals ggml unless such
a cell holds inf/NaN (never-written cells only occur in the tail).
"""

from __future__ import annotations

import numpy as np

from ggml_rknpu.ggml.enums import GgmlOp, GgmlType
from ggml_rknpu.ggml.ops.convert import NON_BLOCK, can_dequantize, to_f32
from ggml_rknpu.ggml.ops.registry import Closure, OpNode
from ggml_rknpu.ggml.ops.softmax import alibi_slopes


def plan_flash_attn_ext(node: OpNode) -> Closure:
    q_ref, k_ref, v_ref = node.require(0), node.src(1), node.src(2)
    mask_ref, sinks_ref, dst = node.src(3), node.src(4), node.dst
    if q_ref is None or k_ref is None or v_ref is None:
        raise node.unsupported("FLASH_ATTN_EXT needs q, k and v")
    if q_ref.type != GgmlType.F32 or dst.type != GgmlType.F32:
        raise node.unsupported("q and dst must be f32")
    dk, n_q, hq, nb = q_ref.ne
    dv, n_kv, hk, kb = v_ref.ne
    if k_ref.ne[0] != dk or k_ref.ne[1] != n_kv or v_ref.ne[2] == 0 or hk == 0:
        raise node.unsupported(f"k {k_ref.ne} / v {v_ref.ne} do not match q {q_ref.ne}")
    if hq % k_ref.ne[2] or hq % hk or nb % k_ref.ne[3] or nb % kb:
        raise node.unsupported("q heads/batches are not a multiple of the kv heads/batches")
    if dst.ne != (dv, hq, n_q, nb):
        raise node.unsupported(f"dst {dst.ne} != (DV, Hq, N, B) = {(dv, hq, n_q, nb)}")
    if mask_ref is not None:
        if mask_ref.type not in (GgmlType.F16, GgmlType.F32) or mask_ref.ne[0] < n_kv or mask_ref.ne[1] < n_q:
            raise node.unsupported(f"mask {mask_ref.ne} must be f16 or f32 and cover [KV, N]")
        if hq % mask_ref.ne[2] or nb % mask_ref.ne[3]:
            raise node.unsupported("mask heads/batches do not divide q's")
    if sinks_ref is not None and (sinks_ref.type != GgmlType.F32 or sinks_ref.ne[0] < hq):
        raise node.unsupported("sinks must be f32 with one entry per head")
    for ref in (k_ref, v_ref):
        if ref.type not in NON_BLOCK and not can_dequantize(ref.type):
            raise node.unsupported("gguf cannot dequantize the K/V type")

    scale = node.param_f32(0)
    max_bias = node.param_f32(1)
    softcap = node.param_f32(2)
    if softcap != 0.0:
        scale /= softcap
    scale32 = np.float32(scale)
    softcap32 = np.float32(softcap)
    q_f16 = k_ref.type == GgmlType.F16

    q_view = q_ref.as_array()                       # (B, Hq, N, DK)
    k_view, v_view = k_ref.as_array(), v_ref.as_array()   # (B, H, KV, D | row bytes)
    k_type, v_type = k_ref.type, v_ref.type
    out = dst.as_array()                            # (B, N, Hq, DV)
    bk = nb // k_ref.ne[3]
    bv = nb // kb
    slopes = alibi_slopes(hq, max_bias).reshape(1, hq, 1, 1)
    use_slope = max_bias > 0.0
    mask = None
    mask_index: tuple = (slice(None), slice(None))   # one mask head/batch: plain broadcast
    if mask_ref is not None:
        mask = mask_ref.as_array()[:, :, :n_q, :n_kv]  # (m3, m2, N, KV)
        m3, m2 = mask.shape[:2]
        if m2 > 1 or m3 > 1:                            # ggml: mask[.., h % m2, b % m3]
            mask_index = ((np.arange(nb) % m3)[:, None], (np.arange(hq) % m2)[None, :])
    sinks = sinks_ref.as_array()[0, 0, 0, :hq].reshape(1, hq, 1, 1) if sinks_ref is not None else None

    def grouped(x: np.ndarray, heads: int) -> np.ndarray:
        """(B, Hq, rows, d) -> (B, heads, Hq/heads*rows, d): q heads h*g .. h*g+g-1 share
        kv head h (ggml's ``ik2 = iq2 / rk2``) so one batched matmul serves the group."""
        b, h, rows, width = x.shape
        return x.reshape(b, heads, h // heads * rows, width)

    def used_cells() -> int:
        """Keys past the last one any query may see are never read by ggml (a -inf mask
        skips the key): the cache tail llama.cpp pads n_kv with costs nothing here either."""
        if mask is None:
            return n_kv
        seen = np.flatnonzero(np.isfinite(mask).any(axis=(0, 1, 2)))
        return int(seen[-1]) + 1 if seen.size else 0

    def run() -> None:
        kv = used_cells()
        if kv == 0:                                      # every key masked: S = 0, output 0
            out[...] = 0
            return
        q = q_view.astype(np.float16).astype(np.float32) if q_f16 else q_view
        k = to_f32(k_view[:, :, :kv], k_type)            # (Bk, Hk, kv, DK)
        v = to_f32(v_view[:, :, :kv], v_type)            # (Bv, Hv, kv, DV)
        if bk > 1:
            k = np.repeat(k, bk, axis=0)
        if bv > 1:
            v = np.repeat(v, bv, axis=0)
        s = np.matmul(grouped(np.ascontiguousarray(q), k.shape[1]), k.swapaxes(-1, -2))
        s = s.reshape(nb, hq, n_q, kv)
        s *= scale32
        if softcap32 != 0:
            np.tanh(s, out=s)
            s *= softcap32
        if mask is not None:
            mv = mask[..., :kv][mask_index]
            s += slopes * mv if use_slope else mv
        s_max = s.max(axis=-1, keepdims=True)
        if sinks is not None:
            s_max = np.maximum(s_max, sinks)
        s_max[~np.isfinite(s_max)] = 0
        s -= s_max
        np.exp(s, out=s)
        total = s.sum(axis=-1, keepdims=True)
        if sinks is not None:
            total += np.exp(sinks - s_max)
        o = np.matmul(grouped(s, v.shape[1]), v).reshape(nb, hq, n_q, dv)
        inv = np.divide(np.float32(1), total, out=np.zeros_like(total), where=total > 0)
        o *= inv
        out[...] = o.transpose(0, 2, 1, 3)
    return run


PLANNERS = {GgmlOp.FLASH_ATTN_EXT: plan_flash_attn_ext}
