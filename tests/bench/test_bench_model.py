"""rknpu bench model: real llama-bench on a tiny GGUF, CPU-only and through rknpu serve on the
simulator, both rows from llama-bench's own JSON, the quant note and the CPU-vs-NPU plot."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from PIL import Image

from ggml_rknpu.bench import model as mb
from ggml_rknpu.cli import bench as cli
from support.gguf_models import TinyConfig, write_tiny_gguf

RIGS = Path(__file__).resolve().parents[1] / "fixtures" / "rigs"


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(list(argv)))


def test_quant_summary_and_fairness_note(tmp_path):
    f16 = write_tiny_gguf(tmp_path / "f16.gguf", "llama", "f16", config=TinyConfig(n_layer=1))
    q8 = write_tiny_gguf(tmp_path / "q8.gguf", "llama", "q8_0", config=TinyConfig(n_layer=1))
    assert set(mb.quant_summary(f16)["matmul_weight_types"]) == {"F16"}
    assert set(mb.quant_summary(q8)["matmul_weight_types"]) == {"Q8_0"}
    assert mb._same_precision(mb.quant_summary(f16), "fp16")
    assert not mb._same_precision(mb.quant_summary(q8), "fp16")
    assert not mb._same_precision(mb.quant_summary(f16), "int8")


def test_llama_bench_json_becomes_rows():
    results = [{"n_prompt": 16, "n_gen": 0, "avg_ts": 100.5, "stddev_ts": 1.5, "backends": "CPU", "n_threads": 1,
                "n_gpu_layers": 0, "model_type": "llama ?B F16", "build_commit": "0c1e570"},
               {"n_prompt": 0, "n_gen": 4, "avg_ts": 20.0, "stddev_ts": 0.0, "backends": "CPU", "n_threads": 1,
                "n_gpu_layers": 0, "model_type": "llama ?B F16", "build_commit": "0c1e570"}]
    rows = mb.rows_from_llama_bench("CPU", results)
    assert [(r["test"], r["tok_s_measured"]) for r in rows] == [("pp16", 100.5), ("tg4", 20.0)]


def test_missing_model_is_a_clear_error(tmp_path, capsys):
    assert run_cli("model", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "o"),
                   "--rig-root", str(RIGS / "not_rk3588")) == 1
    assert "GGUF not found" in capsys.readouterr().out


@pytest.mark.llama
@pytest.mark.timeout(600)
def test_bench_model_cpu_and_npu_rows_from_real_llama_bench(tmp_path):
    from support.e2e_support import tool_or_skip

    tool_or_skip("llama-bench")
    model = write_tiny_gguf(tmp_path / "tiny-llama-f16.gguf", "llama", "f16", config=TinyConfig(n_layer=1))
    out = tmp_path / "model"
    assert run_cli("model", str(model), "-p", "8", "-n", "2", "-r", "1", "--device", "sim-rknpu",
                   "--kl-divergence", "--out", str(out), "--rig-root", str(RIGS / "not_rk3588")) == 0
    data = json.loads((out / "model.json").read_text())
    rows = data["raw"]["rows"]
    assert [(r["side"], r["test"]) for r in rows] == [("CPU", "pp8"), ("CPU", "tg2"),
                                                      (mb.SIDES[1], "pp8"), (mb.SIDES[1], "tg2")]
    assert all(r["tok_s_measured"] > 0 and r["build_commit"] for r in rows)
    assert all(r["n_threads"] == 1 for r in rows)               # not a board: -t 1
    # fp16 weights on both sides: the NPU side's distributions are close to the CPU's, not identical
    kld = data["raw"]["kl_divergence"]
    assert 0 <= kld < 0.01 and rows[2]["kl_divergence_measured"] == kld and "kl_divergence_measured" not in rows[0]
    assert "RPC" in rows[2]["backends"] and "RPC" not in rows[0]["backends"]
    assert rows[0]["n_gpu_layers"] == 0 and rows[2]["n_gpu_layers"] == 99
    assert set(data["meta"]["matmul_weight_types"]) == {"F16"}
    assert data["meta"]["matmul_nodes"]["npu"] > 0 and data["meta"]["matmul_nodes"]["host"] == 0
    md = (out / "model.md").read_text()
    assert "t/s (measured)" in md and "same precision on both sides" in md and "simulator" in md
    plot = data["plots"][0]
    assert [s["label"] for s in plot["series"]] == ["CPU (measured)", f"{mb.SIDES[1]} (measured, simulator)"]
    assert plot["series"][0]["x"] == ["pp8", "tg2"] and all(y > 0 for s in plot["series"] for y in s["y"])
    with Image.open(out / "cpu_vs_npu.png") as img:
        assert img.format == "PNG" and img.size == (750, 450)
    assert (out / "rknpu-serve.log").is_file()
