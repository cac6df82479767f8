"""Model shapes from Hugging Face config.json files (written here, small): the same shape as
the preset of the same model, experts, LFM2's short-conv layers and FFN rounding, Gemma 3's
sliding-window layers inside a multimodal config, Qwen3.5's gated delta-net layers, clear
errors; sliding windows and delta-net layers read from tiny GGUF files (written here with
``gguf``); and bench decode prices a config like a preset."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from gguf import GGUFWriter

from ggml_rknpu.bench import decode as dec
from ggml_rknpu.bench import plans
from ggml_rknpu.bench.shapes import PRESETS, load_config_shape, load_gguf_shape, resolve
from ggml_rknpu.cost import host_ops as ho


def _write(tmp_path, name: str, cfg: dict):
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    return path


QWEN3_17B = {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "model_type": "qwen3"}


def test_a_config_gives_the_presets_shape_and_its_price(tmp_path):
    shape = resolve(str(_write(tmp_path, "Qwen3-1.7B", QWEN3_17B).parent))
    preset = PRESETS["Qwen3-1.7B"]
    assert dataclasses.replace(shape, source=preset.source) == preset
    kw: dict = dict(npu_dtype="int8", cores=3)
    priced = [plans.prefill_tok_s(plans.preset_weights(m, "Q4_K_M"), m.host_layers(), "auto", 512, **kw)
              for m in (shape, preset)]
    assert priced[0] == priced[1]


def test_experts_and_short_conv_layers(tmp_path):
    cfg = {"hidden_size": 2048, "intermediate_size": 7168, "moe_intermediate_size": 1792, "num_hidden_layers": 6,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 65536, "num_experts": 32,
           "num_experts_per_tok": 4, "num_dense_layers": 2,
           "layer_types": ["conv", "conv", "full_attention", "conv", "conv", "full_attention"]}
    shape = load_config_shape(_write(tmp_path, "moe", cfg))
    assert (shape.experts, shape.experts_used, shape.expert_ff, shape.dense_layers) == (32, 4, 1792, 2)
    assert shape.conv_layers == (0, 1, 3, 4) and shape.head_dim == 64
    assert set(shape.matmuls_at(0)) == {"in_proj", "out_proj", "gate", "up", "down"}
    assert shape.matmuls_at(5)["gate_exps"] == (2048, 1792, 32, 4) and "q" in shape.matmuls_at(5)
    weights = {w.name: w for w in plans.preset_weights(shape, "Q4_0")}
    assert weights["router"].type == "F32" and weights["up_exps"].count == 4
    rows, experts = weights["up_exps"].rows_and_experts(512)
    assert rows == 512 * 4 and experts == 32                     # a prompt reads every expert
    assert weights["up_exps"].rows_and_experts(1) == (4, 4)     # one token reads its four
    host = shape.host_layers()
    assert host[0].window is None and host[5].ff == 4 * 1792


def test_lfm2_ffn_rounding_and_gemma3_windows_in_a_text_config(tmp_path):
    lfm2 = {"hidden_size": 1536, "block_ff_dim": 10240, "block_auto_adjust_ff_dim": True, "block_multiple_of": 256,
            "block_ffn_dim_multiplier": 1.0, "num_hidden_layers": 16, "num_attention_heads": 24,
            "num_key_value_heads": 8, "vocab_size": 65536, "full_attn_idxs": [2, 5, 8, 10, 12, 14]}
    shape = load_config_shape(_write(tmp_path, "LFM2-700M", lfm2))
    assert dataclasses.replace(shape, source="") == dataclasses.replace(PRESETS["LFM2-700M"], source="")
    gemma = {"model_type": "gemma3", "text_config": {
        "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144, "sliding_window": 512,
        "sliding_window_pattern": 6}}
    shape = load_config_shape(_write(tmp_path, "Gemma3-1B", gemma))
    assert dataclasses.replace(shape, source="") == dataclasses.replace(PRESETS["Gemma3-1B"], source="")


# Qwen/Qwen3.5-9B config.json's text_config (the keys a shape reads; docs/anchors.md §6.1)
QWEN35_TEXT: dict = {
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 248320, "attn_output_gate": True,
    "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 8}
QWEN35_9B = {"model_type": "qwen3_5", "text_config": QWEN35_TEXT}


def test_qwen35_gated_delta_net_layers_from_its_config(tmp_path):
    """Three of four layers are gated delta-net ones: qkv (2 x 16 key heads + 32 value heads of
    128), z, beta, alpha and ssm_out projections; the full-attention layers' q also yields the
    output gate. Weights 8.95 B with the untied head, as llama-bench reports the model."""
    shape = load_config_shape(_write(tmp_path, "Qwen3.5-9B", QWEN35_9B))
    preset = PRESETS["Qwen3.5-9B"]
    assert dataclasses.replace(shape, source="") == dataclasses.replace(preset, source="")
    assert preset.delta_layers == tuple(i for i in range(32) if i % 4 != 3)
    assert preset.matmuls_at(0) == {"qkv": (4096, 8192, 1, 1), "z": (4096, 4096, 1, 1), "beta": (4096, 32, 1, 1),
                                    "alpha": (4096, 32, 1, 1), "ssm_out": (4096, 4096, 1, 1),
                                    "gate": (4096, 12288, 1, 1), "up": (4096, 12288, 1, 1),
                                    "down": (12288, 4096, 1, 1)}
    assert preset.matmuls_at(3)["q"] == (4096, 2 * 16 * 256, 1, 1)
    params = sum(K * N for i in range(32) for K, N, _, _ in preset.matmuls_at(i).values()) + 2 * 4096 * 248320
    assert params / 1e9 == pytest.approx(8.95, abs=0.005)
    host = preset.host_layers()
    assert host[0].window is None and host[0].delta == preset.delta and host[0].heads == 0
    assert (host[3].delta, host[3].window, host[3].heads, host[3].kv_heads, host[3].q_dim) == (None, 0, 16, 4, 8192)
    q4 = {(w.name, w.type): w.count for w in plans.preset_weights(preset, "Q4_K_M")}
    # llama-quant: qkv is attn_v-like, Q6_K in 16 of the 32 (use_more_bits: 0-3, 28-31, 6, 9, ..., 27)
    assert (q4[("qkv", "Q6_K")], q4[("v", "Q6_K")], q4[("qkv", "Q4_K")], q4[("v", "Q4_K")]) == (12, 4, 12, 4)
    text = dict(QWEN35_TEXT, linear_value_head_dim=64)
    with pytest.raises(ValueError, match="key head dim 128 != value head dim 64"):
        load_config_shape(_write(tmp_path, "bad", {"text_config": text}))
    text = {k: v for k, v in QWEN35_TEXT.items() if k != "layer_types"}
    assert load_config_shape(_write(tmp_path, "no-types", text)).delta_layers == preset.delta_layers


@pytest.mark.parametrize("cfg, match", [
    ({"hidden_size": 512}, "none of num_hidden_layers"),
    ({**QWEN3_17B, "layer_types": ["mamba"] * 28}, "have no price"),
    ({**QWEN3_17B, "layer_types": ["conv"]}, "1 layer_types for 28 layers"),
    ([1, 2], "not a config.json object"),
])
def test_bad_configs_are_clear_errors(tmp_path, cfg, match):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        load_config_shape(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a readable config.json"):
        load_config_shape(path)


def test_bench_decode_prices_a_config_in_the_quant_mix(tmp_path):
    from ggml_rknpu.cli.main import main

    path = _write(tmp_path, "Qwen3-1.7B", QWEN3_17B)
    assert [m.name for m in dec.named_models([str(path)])] == ["Qwen3-1.7B"]
    out = tmp_path / "report"
    rc = main(["bench", "decode", str(path), "--weights", "int8", "--ms", "1", "--host-reps", "0", "--quant",
               "Q8_0", "--allow-throttled", "--out", str(out)])
    assert rc == 0
    rows = json.loads((out / "decode.json").read_text())["raw"]["plans"]
    assert {r["quant"] for r in rows} == {"Q8_0"} and {r["model"] for r in rows} == {"Qwen3-1.7B"}


_ATTENTION = {"attn_q": (64, 64), "attn_k": (32, 64), "attn_v": (32, 64), "attn_output": (64, 64)}
_FFN = {"ffn_gate": (128, 64), "ffn_up": (128, 64), "ffn_down": (64, 128)}


def _gguf(path, arch: str, layers: int, tensors: dict | None = None, meta: dict | None = None):
    """A GGUF of zero f32 tensors, by default with a gemma-like layer shape: hidden 64, 2 heads
    and 1 KV head of 32, FFN 128, vocabulary 32; ``tensors``: layer -> name -> numpy shape
    [N, K] instead; ``meta``: ``{arch}.<key>`` integers or arrays."""
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_head_count(2)
    writer.add_key_length(32)
    for key, value in (meta or {}).items():
        if isinstance(value, list):
            writer.add_array(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((32, 64), np.float32))
    for i in range(layers):
        for name, (n, k) in (tensors or {}).get(i, {**_ATTENTION, **_FFN}).items():
            writer.add_tensor(f"blk.{i}.{name}.weight", np.zeros((n, k), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_gives_gemma3s_sliding_window_and_attention_is_priced_over_it(tmp_path):
    """gemma3.attention.sliding_window and llama.cpp's gemma3 pattern (every sixth layer
    global): a decode token at 4096 cached positions attends 512 on the sliding layers."""
    shape = load_gguf_shape(_gguf(tmp_path / "gemma3.gguf", "gemma3", 12, meta={"attention.sliding_window": 512}))
    assert (shape.window, shape.window_layers) == (512, (0, 1, 2, 3, 4, 6, 7, 8, 9, 10))
    assert (shape.hidden, shape.q_dim, shape.kv_dim, shape.head_dim, shape.vocab) == (64, 64, 32, 32, 32)
    host = shape.host_layers()
    local, glob = ho.attention_time(host[0], 1, 4095), ho.attention_time(host[5], 1, 4095)
    assert (host[0].window, host[5].window) == (512, 0)
    assert glob.macs == 8 * local.macs == 4096 * 2 * 2 * 32
    assert ho.host_ops_seconds(host, 1, 4095) < ho.host_ops_seconds(
        tuple(dataclasses.replace(h, window=0) for h in host), 1, 4095)


def test_a_ggufs_own_pattern_wins_and_a_window_without_one_is_not_priced(tmp_path):
    def swa(name: str, arch: str, layers: int, window: int, pattern: int | list | None = None):
        meta: dict = {"attention.sliding_window": window}
        if pattern is not None:
            meta["attention.sliding_window_pattern"] = pattern
        return load_gguf_shape(_gguf(tmp_path / name, arch, layers, meta=meta))

    every4 = swa("n.gguf", "gemma3", 8, 256, 4)
    assert (every4.window, every4.window_layers) == (256, (0, 1, 2, 4, 5, 6))
    assert swa("a.gguf", "gemma2", 4, 128, [True, False, True, False]).window_layers == (0, 2)
    plain = swa("l.gguf", "llama", 4, 128)
    assert (plain.window, plain.window_layers) == (0, ())
    with pytest.raises(ValueError, match="2 sliding-window flags for 4 layers"):
        swa("b.gguf", "gemma2", 4, 128, [True, False])


def test_a_qwen35_gguf_gives_its_delta_net_layers_and_weights(tmp_path):
    """Three delta-net layers (qkv of 2 x 2 key heads + 4 value heads of 16, z, beta, alpha,
    ssm_out, conv) then one gated-attention layer (q twice its heads' width): the shape and the
    weights a GGUF gives match the config-style shape of the same model."""
    delta = {"attn_qkv": (128, 64), "attn_gate": (64, 64), "ssm_beta": (4, 64), "ssm_alpha": (4, 64),
             "ssm_out": (64, 64), "ssm_conv1d": (128, 4), **_FFN}
    gated = {**_ATTENTION, "attn_q": (128, 64), **_FFN}
    meta = {"ssm.group_count": 2, "ssm.time_step_rank": 4, "ssm.state_size": 16, "ssm.conv_kernel": 4}
    path = _gguf(tmp_path / "tiny-qwen35.gguf", "qwen35", 4, {0: delta, 1: delta, 2: delta, 3: gated}, meta)
    shape = load_gguf_shape(path)
    assert (shape.delta_layers, shape.delta, shape.attn_gate) == ((0, 1, 2), ho.DeltaNet(2, 4, 16, 4), True)
    assert (shape.q_dim, shape.kv_dim, shape.head_dim, shape.ff) == (64, 32, 32, 128)
    stored = sorted((w.name, w.K, w.N, w.count) for w in plans.gguf_weights(path))
    expected: dict[tuple[str, int, int], int] = {}
    for i in range(4):
        for name, (K, N, _, _) in shape.matmuls_at(i).items():
            expected[name, K, N] = expected.get((name, K, N), 0) + 1
    assert stored == sorted([(n, K, N, c) for (n, K, N), c in expected.items()] + [("output", 64, 32, 1)])
    bad = _gguf(tmp_path / "bad.gguf", "qwen35", 4, {0: delta, 1: delta, 2: delta, 3: gated},
                {**meta, "ssm.state_size": 8})
    with pytest.raises(ValueError, match="attn_qkv is not"):
        load_gguf_shape(bad)
    mamba = _gguf(tmp_path / "mamba.gguf", "jamba", 2, {0: {"ssm_in": (128, 64), **_FFN}, 1: {**_ATTENTION, **_FFN}})
    with pytest.raises(ValueError, match=r"layers \[0\] are neither attention nor gated delta-net"):
        load_gguf_shape(mamba)
