"""Host-op model (cost/host_ops.py): element-wise work grows with the rows, attention with
rows x context x heads x head dim (causal, windowed, tiled as ggml-cpu's flash attention
runs it), decode attention with the cache's fill level; a short-conv layer has none; a gated
delta-net layer's recurrence grows with the rows alone. All figures *modeled*."""

from __future__ import annotations

import pytest

from ggml_rknpu.bench.shapes import PRESETS
from ggml_rknpu.cost import cpu
from ggml_rknpu.cost import host_ops as ho

QWEN3_17B = PRESETS["Qwen3-1.7B"].host_layers()[0]


def test_attention_flops_by_rows_context_heads_and_head_dim():
    """Qwen3-1.7B, one layer, a 512-token prompt from an empty cache: the causal half of
    512 x 512 positions in whole 64 x 64 tiles, 16 heads x 2 x 128 MACs each (about 1.2
    GFLOP); 8 x the rows in one pass: 1 + 2 + ... + 64 tiles against 1 + ... + 8."""
    t512 = ho.attention_time(QWEN3_17B, 512, 0)
    assert ho.visible_positions(512, 0, 0) == 64 * 64 * sum(range(1, 9))
    assert 2 * t512.macs == pytest.approx(1.208e9, rel=0.001)
    t4096 = ho.attention_time(QWEN3_17B, 4096, 0)
    assert t4096.macs / t512.macs == pytest.approx(sum(range(1, 65)) / sum(range(1, 9)))
    assert t512.total_s == t512.compute_s == pytest.approx(t512.macs / cpu.mac_s("F16", 4))


def test_decode_attention_grows_with_the_fill_level_and_reads_the_cache():
    one = ho.attention_time(QWEN3_17B, 1, 1023)
    four = ho.attention_time(QWEN3_17B, 1, 4095)
    assert ho.visible_positions(1, 4095, 0) == 4096
    assert four.macs == 4 * one.macs
    kv_bytes = 4096 * QWEN3_17B.kv_heads * 2 * QWEN3_17B.head_dim * 2       # f16 K and V of every KV head
    assert four.memory_s == pytest.approx(kv_bytes / cpu.read_bytes_s(4))
    assert four.total_s == max(four.memory_s, four.compute_s)


def test_a_sliding_window_caps_the_span_and_a_conv_layer_has_no_attention():
    gemma = PRESETS["Gemma3-1B"].host_layers()
    local, glob = gemma[0], gemma[5]
    assert (local.window, glob.window) == (512, 0)
    assert ho.visible_positions(1, 8191, 512) == 512
    assert ho.attention_time(local, 1, 8191).macs * 16 == ho.attention_time(glob, 1, 8191).macs
    conv = PRESETS["LFM2-350M"].host_layers()[0]
    assert conv.window is None and ho.attention_time(conv, 512, 0).total_s == 0


def test_elementwise_bytes_are_per_row_and_the_fixed_cost_per_layer():
    w = ho.ROW_BYTES_PER_LAYER
    per_row = w["hidden"] * 2048 + w["q"] * 2048 + w["kv"] * 1024 + w["ff"] * 6144
    assert ho.elementwise_bytes(QWEN3_17B, 512) == 512 * per_row
    layers = PRESETS["Qwen3-1.7B"].host_layers()
    one = ho.host_ops_seconds(layers, 1, 0)
    assert one > 28 * ho.HOST_FIXED_S_PER_LAYER
    assert ho.host_ops_seconds(layers, 512, 0) > 10 * one        # rows and attention, not a flat cost
    with pytest.raises(ValueError):
        ho.host_ops_seconds(layers, 0, 0)


def test_gated_delta_net_recurrence_by_rows_heads_and_state():
    """Qwen3.5-9B's delta-net layer: 32 value heads, each a 128 x 128 f32 state (64 KiB) that
    GATED_DELTA_NET walks four times per token; 2 MiB of state read and written twice per pass
    whatever the fill level. Decode moves the state, a prompt computes."""
    layers = PRESETS["Qwen3.5-9B"].host_layers()
    delta = layers[0].delta
    assert delta is not None and (delta.conv_channels, delta.value_dim) == (8192, 4096)
    one, ubatch = ho.delta_net_time(delta, 1), ho.delta_net_time(delta, 512)
    assert one.macs == 4 * 32 * 128 * 128 + 4 * 8192
    assert ubatch.macs == 512 * one.macs
    state = 32 * 128 * 128 * 4
    assert one.memory_s == ubatch.memory_s == pytest.approx((4 * state + 2 * 3 * 8192 * 4) / ho.copy_bytes_s(4))
    assert one.total_s == one.memory_s > one.compute_s
    assert ubatch.total_s == ubatch.compute_s == pytest.approx(ubatch.macs / cpu.mac_s("F16", 4))
    fixed = ho.HOST_FIXED_S_PER_LAYER + ho.elementwise_bytes(layers[0], 1) / ho.copy_bytes_s(4)
    assert ho.layer_seconds(layers[0], 1, 4095) == pytest.approx(fixed + one.total_s)   # no attention, no fill level
    assert ho.attention_time(layers[0], 512, 0).total_s == 0
