"""Attention's two matmuls on the NPU, priced as ``rknpu serve --npu-attention`` runs them: per KV head,
S = Q.K^T with the group's query heads stacked as rows (M = rows x heads per KV head,
K = head dim, N = the key span) and O = P.V (K = the span, N = head dim), fp16, each its own
submit, a block of rows at a time (``row_block``: the scores of every head within
``SCORES_BLOCK_BYTES``); the mask and softmax stay in ggml-cpu. A *modeled* figure (staging
K and V per pass is not priced); the server's ``auto`` decides by it (``server/attention_plan.py``).

Invariants: the NPU computes the whole rectangle of rows by key span (no causal skipping);
the softmax moves rows x heads x span f32 scores three times (read, mask, write) at the host's
copy rate (``cost.host_ops``). Why and the arithmetic: docs/decode.md "Prefill"."""

from __future__ import annotations

from ggml_rknpu.cost import cpu
from ggml_rknpu.cost import host_ops as ho
from ggml_rknpu.cost.placement import npu_matmul_seconds

SOFTMAX_PASSES = 3   # GUESS: the scores are read, masked and written once each, f32
SCORES_BLOCK_BYTES = 64 << 20
# the f32 scores of every head a split FLASH_ATTN_EXT holds at once: its rows run in blocks
# that fit (at least one row), so a long key span's scratch stays bounded (docs/placement.md
# "Attention on the NPU"); a prompt's pass of 512 rows over 2048 positions with 16 heads fits.


def row_block(rows: int, heads: int, span: int) -> int:
    """Rows per block of a split FLASH_ATTN_EXT over ``heads`` query heads (times the batch's
    sequences) and ``span`` key positions: its scores within ``SCORES_BLOCK_BYTES``."""
    return max(1, min(rows, SCORES_BLOCK_BYTES // (4 * heads * span)))


def key_span(layer: ho.LayerOps, rows: int, past: int) -> int:
    """Key positions any of ``rows`` rows after ``past`` sees: all of them, or the window's."""
    end = past + rows
    return min(end, layer.window + rows - 1) if layer.window else end


def npu_attention_seconds(layer: ho.LayerOps, rows: int, past: int, *, cores: int, threads: int = cpu.BIG_CORES) -> float:
    """Modeled seconds of one layer's attention with its matmuls on the NPU (module doc);
    0 for a layer without attention."""
    if layer.window is None:
        return 0.0
    span = key_span(layer, rows, past)
    group = layer.heads // layer.kv_heads
    block = row_block(rows, layer.heads, span)
    full, rest = divmod(rows, block)
    per_kv_head = sum(n * (npu_matmul_seconds(r * group, layer.head_dim, span, "fp16", cores)
                           + npu_matmul_seconds(r * group, span, layer.head_dim, "fp16", cores))
                      for r, n in ((block, full), (rest, 1)) if r)
    softmax = SOFTMAX_PASSES * 4 * rows * layer.heads * span / ho.copy_bytes_s(threads)
    return layer.kv_heads * per_kv_head + softmax
