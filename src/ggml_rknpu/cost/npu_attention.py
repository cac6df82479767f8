"""Attention's two matmuls on the NPU, priced as ``rknpu serve --npu-attention`` runs them: per KV head,
S = Q.K^T with the group's query heads stacked as rows (M = rows x heads per KV head,
K = head dim, N = the key span) and O = P.V (K = the span, N = head dim), fp16, each its own
submit; the mask and softmax stay in ggml-cpu. A *modeled* figure (staging K and V per pass
is not priced); the server's ``auto`` decides by it (``server/attention_plan.py``).

Invariants: the NPU computes the whole rectangle of rows by key span (no causal skipping);
the softmax moves rows x heads x span f32 scores three times (read, mask, write) at the host's
copy rate (``cost.host_ops``). Why and the arithmetic: docs/decode.md "Prefill"."""

from __future__ import annotations

from ggml_rknpu.cost import cpu
from ggml_rknpu.cost import host_ops as ho
from ggml_rknpu.cost.model import VENDOR_NPU_MHZ
from ggml_rknpu.cost.placement import npu_matmul_seconds

SOFTMAX_PASSES = 3   # GUESS: the scores are read, masked and written once each, f32


def key_span(layer: ho.LayerOps, rows: int, past: int) -> int:
    """Key positions any of ``rows`` rows after ``past`` sees: all of them, or the window's."""
    end = past + rows
    return min(end, layer.window + rows - 1) if layer.window else end


def npu_attention_seconds(layer: ho.LayerOps, rows: int, past: int, *, cores: int, threads: int = cpu.BIG_CORES,
                          npu_mhz: float = VENDOR_NPU_MHZ) -> float:
    """Modeled seconds of one layer's attention with its matmuls on the NPU at ``npu_mhz``
    (module doc); 0 for a layer without attention."""
    if layer.window is None:
        return 0.0
    span = key_span(layer, rows, past)
    group = layer.heads // layer.kv_heads
    m = rows * group
    per_kv_head = (npu_matmul_seconds(m, layer.head_dim, span, "fp16", cores, npu_mhz=npu_mhz)
                   + npu_matmul_seconds(m, span, layer.head_dim, "fp16", cores, npu_mhz=npu_mhz))
    softmax = SOFTMAX_PASSES * 4 * rows * layer.heads * span / ho.copy_bytes_s(threads)
    return layer.kv_heads * per_kv_head + softmax
