"""Attention's matmuls on the NPU as priced if built (cost/npu_attention.py): per KV head two
NPU matmuls over the whole key span (the group's query heads stacked as rows) plus the
host's softmax and the staging of K and V; a window caps the span; a short-conv layer has no
attention. *Modeled*."""

from __future__ import annotations

import pytest

from ggml_rknpu.bench.shapes import PRESETS
from ggml_rknpu.cost import host_ops as ho
from ggml_rknpu.cost import npu_attention as na
from ggml_rknpu.cost.placement import npu_matmul_seconds


def test_two_matmuls_per_kv_head_and_the_softmax():
    layer = PRESETS["Qwen3-1.7B"].host_layers()[0]           # 16 heads over 8 KV heads, head dim 128
    span = na.key_span(layer, 512, 1536)
    assert span == 2048
    m = 512 * 2
    want = 8 * (npu_matmul_seconds(m, 128, span, "fp16", 3) + npu_matmul_seconds(m, span, 128, "fp16", 3))
    want += na.SOFTMAX_PASSES * 4 * 512 * 16 * span / ho.copy_bytes_s(4)
    want += 2 * 8 * span * 128 * na.STAGE_BYTES / ho.copy_bytes_s(1)     # K and V staged once, one thread
    assert na.npu_attention_seconds(layer, 512, 1536, cores=3) == pytest.approx(want)


def test_a_window_caps_the_span_and_a_conv_layer_costs_nothing():
    gemma = PRESETS["Gemma3-1B"].host_layers()
    assert na.key_span(gemma[0], 512, 3584) == 512 + 511 and na.key_span(gemma[5], 512, 3584) == 4096
    assert na.npu_attention_seconds(gemma[0], 512, 3584, cores=3) < na.npu_attention_seconds(gemma[5], 512, 3584,
                                                                                             cores=3)
    conv = PRESETS["LFM2-350M"].host_layers()[0]
    assert na.npu_attention_seconds(conv, 512, 0, cores=3) == 0


def test_rows_run_in_blocks_of_bounded_scores():
    """A block's scores (f32, every head) fit ``SCORES_BLOCK_BYTES``, at least one row a block;
    the price is each block's two submits per KV head."""
    assert na.row_block(512, 16, 2048) == 512                       # 64 MiB: one block
    block = na.row_block(512, 24, 16384)
    assert 4 * 24 * 16384 * block <= na.SCORES_BLOCK_BYTES < 4 * 24 * 16384 * (block + 1)
    assert na.row_block(1, 64, 1 << 24) == 1
    layer = PRESETS["Qwen3-1.7B"].host_layers()[0]
    span = na.key_span(layer, 512, 3584)
    assert na.row_block(512, 16, span) == 256
    want = 8 * 2 * (npu_matmul_seconds(256 * 2, 128, span, "fp16", 3) + npu_matmul_seconds(256 * 2, span, 128, "fp16", 3))
    want += na.SOFTMAX_PASSES * 4 * 512 * 16 * span / ho.copy_bytes_s(4) + na.staging_seconds(layer, span)
    assert na.npu_attention_seconds(layer, 512, 3584, cores=3) == pytest.approx(want)


def test_staging_k_and_v_can_keep_a_short_pass_on_the_host():
    """64 rows over 1000 cached positions (Qwen3-1.7B, 3 cores, 4 threads): the matmuls and the
    softmax alone beat the host's flash attention, staging K and V does not."""
    layer = PRESETS["Qwen3-1.7B"].host_layers()[0]
    npu = na.npu_attention_seconds(layer, 64, 1000, cores=3, threads=4)
    host = ho.attention_time(layer, 64, 1000, threads=4).total_s
    assert npu - na.staging_seconds(layer, 1064) < host < npu
