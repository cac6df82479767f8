"""rknpu bench model: real llama-bench on a tiny GGUF, CPU-only, through rknpu serve on the
simulator and (when built) on Mesa's software Vulkan device, every row from llama-bench's own
JSON, the quant note, the Vulkan side's device and greedy text, and the plot."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from PIL import Image

from ggml_rknpu.bench import model as mb
from ggml_rknpu.bench import vulkan
from ggml_rknpu.cli import bench as cli
from ggml_rknpu.toolchain import llamacpp
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
                   "--kl-divergence", "--no-vulkan", "--out", str(out), "--rig-root", str(RIGS / "not_rk3588")) == 0
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
    assert "Vulkan side absent: left out (--no-vulkan)" in md and data["raw"]["vulkan"] is None
    plot = data["plots"][0]
    assert [s["label"] for s in plot["series"]] == ["CPU (measured)", f"{mb.SIDES[1]} (measured, simulator)"]
    assert plot["series"][0]["x"] == ["pp8", "tg2"] and all(y > 0 for s in plot["series"] for y in s["y"])
    with Image.open(out / "cpu_vs_npu.png") as img:
        assert img.format == "PNG" and img.size == (750, 450)
    assert (out / "rknpu-serve.log").is_file()


def test_no_vulkan_build_is_a_clear_reason(tmp_path, monkeypatch):
    """With no Vulkan build in the cache the Vulkan side is absent, and says what to run."""
    monkeypatch.setenv("RKNPU_CACHE", str(tmp_path))
    reason = vulkan.find_device(threads=1, timeout=60)
    assert isinstance(reason, str)
    assert reason.startswith("no Vulkan build") and "scripts/build-llama-cpp --vulkan" in reason


def _lavapipe_only(monkeypatch) -> None:
    """Only Mesa's software Vulkan driver visible to the loader, whatever GPUs this machine has."""
    from support.e2e_support import tool_or_skip

    tool_or_skip("llama-bench", llamacpp.VULKAN)
    icds = sorted(Path("/usr/share/vulkan/icd.d").glob("lvp_icd.*.json"))
    if not icds:
        pytest.skip("Mesa's lavapipe is not installed (Debian: mesa-vulkan-drivers)")
    monkeypatch.setenv("VK_ICD_FILENAMES", str(icds[0]))


@pytest.mark.llama
@pytest.mark.timeout(600)
def test_no_vulkan_device_is_a_clear_reason(tmp_path, monkeypatch):
    from support.e2e_support import tool_or_skip

    tool_or_skip("llama-bench", llamacpp.VULKAN)
    monkeypatch.setenv("VK_ICD_FILENAMES", str(tmp_path / "no-driver.json"))
    reason = vulkan.find_device(threads=1, timeout=120)
    assert isinstance(reason, str) and reason.startswith("no Vulkan device")


@pytest.mark.llama
@pytest.mark.timeout(900)
def test_bench_model_vulkan_side_on_lavapipe(tmp_path, monkeypatch):
    """The Vulkan side on Mesa's lavapipe: llama-bench rows from the Vulkan build on the llvmpipe
    device, labelled software, and the same greedy text as the CPU build."""
    _lavapipe_only(monkeypatch)
    model = write_tiny_gguf(tmp_path / "tiny-llama-f16.gguf", "llama", "f16", config=TinyConfig(n_layer=1))
    out = tmp_path / "model"
    assert run_cli("model", str(model), "-p", "8", "-n", "8", "-r", "1", "--device", "sim-rknpu",
                   "--out", str(out), "--rig-root", str(RIGS / "not_rk3588")) == 0
    data = json.loads((out / "model.json").read_text())
    rows = [r for r in data["raw"]["rows"] if r["side"] == vulkan.SIDE]
    assert [r["test"] for r in rows] == ["pp8", "tg8"]
    assert all(r["tok_s_measured"] > 0 and r["n_gpu_layers"] == 99 and "Vulkan" in r["backends"] for r in rows)
    vk = data["raw"]["vulkan"]
    assert vk["device"] == "Vulkan0" and vk["description"].startswith("llvmpipe") and vk["software"]
    assert vk["env"] == {vulkan.VISIBLE_ENV: "0", vulkan.SOFTWARE_THREADS_ENV: "1"}
    assert all(r["device"].startswith("llvmpipe") and "software Vulkan" in r["device"] for r in rows)
    # lavapipe is deterministic and the tiny model's argmax margins are wide: the CPU's greedy text
    assert vk["decode_runs"] > 0 and vk["text"] and vk["text"] == vk["cpu_text"] and vk["text_matches_cpu"]
    md = (out / "model.md").read_text()
    assert "Vulkan device" in md and "software Vulkan device" in md and "is the CPU's" in md
    plot = data["plots"][0]
    assert plot["series"][2]["label"].startswith(f"{vulkan.SIDE}: llvmpipe") and "(measured, software)" in \
        plot["series"][2]["label"]
    assert all(y > 0 for y in plot["series"][2]["y"])
