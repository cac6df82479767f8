"""Attention's two matmuls on the NPU, priced as ``rknpu serve --npu-attention`` runs them: per KV head,
S = Q.K^T with the group's query heads stacked as rows (M = rows x heads per KV head,
K = head dim, N = the key span) and O = P.V (K = the span, N = head dim), fp16, each its own
submit, a block of rows at a time (``row_block``: the scores of every head within
``SCORES_BLOCK_BYTES``), K and V staged into the NPU's layout once a pass (``staging_seconds``);
the mask and softmax stay in ggml-cpu. A *modeled* figure; the server's ``auto`` decides by it.

Invariants: the NPU computes the whole rectangle of rows by key span (no causal skipping);
the softmax moves rows x heads x span f32 scores three times (read, mask, write) at the host's
copy rate (``cost.host_ops``). Why and the arithmetic: docs/decode.md "Prefill"."""

from __future__ import annotations

from ggml_rknpu.cost import cpu
from ggml_rknpu.cost import host_ops as ho
from ggml_rknpu.cost.model import VENDOR_NPU_MHZ
from ggml_rknpu.cost.placement import npu_matmul_seconds

SOFTMAX_PASSES = 3   # GUESS: the scores are read, masked and written once each, f32
SCORES_BLOCK_BYTES = 64 << 20
# the f32 scores of every head a split FLASH_ATTN_EXT holds at once: its rows run in blocks
# that fit (at least one row), so a long key span's scratch stays bounded (docs/placement.md
# "Attention on the NPU"); a prompt's pass of 512 rows over 2048 positions with 16 heads fits.
STAGE_BYTES = 40
# GUESS, counted from the server's staging of one f16 K or V element (server/attention_step.py,
# engine.staging.to_fp16, compiler.layout.pack_b): widened to f32 (read 2, write 4), checked
# and narrowed to fp16 (finite 4 + 1, all 1, abs 4 + 4, max 4, narrow 4 + 2), packed into the
# NPU's layout (zero padding 2, copy 2 + 2, the chunk transpose 2 + 2); at one A76's copy rate
# (``cost.host_ops.copy_bytes_s``), the server staging in its one thread.
STAGE_THREADS = 1


def staging_seconds(layer: ho.LayerOps, span: int) -> float:
    """Modeled seconds to stage one layer's K and V over ``span`` positions (every KV head) once."""
    return 2 * layer.kv_heads * span * layer.head_dim * STAGE_BYTES / ho.copy_bytes_s(STAGE_THREADS)


def row_block(rows: int, heads: int, span: int) -> int:
    """Rows per block of a split FLASH_ATTN_EXT over ``heads`` query heads (times the batch's
    sequences) and ``span`` key positions: its scores within ``SCORES_BLOCK_BYTES``."""
    return max(1, min(rows, SCORES_BLOCK_BYTES // (4 * heads * span)))


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
    block = row_block(rows, layer.heads, span)
    full, rest = divmod(rows, block)
    per_kv_head = sum(n * (npu_matmul_seconds(r * group, layer.head_dim, span, "fp16", cores, npu_mhz=npu_mhz)
                           + npu_matmul_seconds(r * group, span, layer.head_dim, "fp16", cores, npu_mhz=npu_mhz))
                      for r, n in ((block, full), (rest, 1)) if r)
    softmax = SOFTMAX_PASSES * 4 * rows * layer.heads * span / ho.copy_bytes_s(threads)
    return layer.kv_heads * per_kv_head + softmax + staging_seconds(layer, span)
