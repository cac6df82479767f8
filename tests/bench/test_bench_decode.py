"""``rknpu bench decode``: the submit plan per token, its modeled time recomputed independently
from the compiler and cost model, GGUF shape reading, and the report (labels, host figure)."""

from __future__ import annotations

import json

import pytest

from ggml_rknpu.bench import decode as dec
from ggml_rknpu.compiler.matmul import compile_matmul
from ggml_rknpu.cost.model import OWN_DRIVER, modeled_time

pytestmark = pytest.mark.timeout(600)


def test_fused_plan_is_four_submits_per_layer_plus_head():
    model = dec.PRESETS["Qwen2.5-1.5B"]
    submits = dec.decode_submits(model, fused=True)
    assert [s.names for s in submits] == [("q", "k", "v"), ("o",), ("gate", "up"), ("down",), ("output",)]
    row = dec.forecast(model, "int8", 1, cores=3)
    assert row["submits_per_token"] == 4 * 28 + 1 and row["submits_per_layer"] == 4
    unfused = dec.forecast(model, "int8", 1, cores=3, fused=False)
    assert unfused["submits_per_token"] == 7 * 28 + 1
    assert row["weight_mb"] == pytest.approx(unfused["weight_mb"])       # same bytes streamed
    assert row["npu_ms_per_pass_modeled"] < unfused["npu_ms_per_pass_modeled"]


def test_forecast_is_the_sum_of_the_compiled_programs():
    """Recomputed here from compile_matmul + modeled_time: one program per fused submit
    (N = sum of siblings), one submit each."""
    model = dec.PRESETS["Qwen3-0.6B"]
    h, ff, q, kv, L = model.hidden, model.ff, model.q_dim, model.kv_dim, model.layers
    shapes = [(h, q + 2 * kv, L), (q, h, L), (h, 2 * ff, L), (ff, h, L), (h, model.vocab, 1)]
    for dtype, out in (("fp16", "fp32"), ("int8", "int32")):
        for m in (1, 3):
            bucket = 4 if m == 3 else m
            want = sum(modeled_time(compile_matmul(bucket, K, N, dtype=dtype, out=out, cores=3,
                                                   envelope=dec.laddered_envelope())).total_s * n
                       for K, N, n in shapes)
            got = dec.forecast(model, dtype, m, cores=3)
            assert got["npu_ms_per_pass_modeled"] == pytest.approx(want * 1e3, rel=1e-12)
            assert got["tok_s_modeled"] == pytest.approx(m / want)
    b = 2
    bytes_per_token = sum(K * N * n for K, N, n in shapes) * b
    row = dec.forecast(model, "fp16", 1, cores=3)
    assert row["stream_gb_s_modeled"] == pytest.approx(bytes_per_token / (row["npu_ms_per_pass_modeled"] / 1e3) / 1e9)
    assert row["submit_ms_modeled"] == pytest.approx(113 * OWN_DRIVER.per_submit_s * 1e3)


def test_every_fused_decode_submit_streams_near_the_model_ceiling():
    """Per submit, excluding the submit itself, every fused decode matmul of the three target models
    at M = 1..16 streams within 10% of what the cost model allows one job on 3 cores (the
    DRAM stream, less the share of compute the model does not overlap)."""
    from ggml_rknpu.cost import model as cm

    per_core_bw = min(cm.CORE_STREAM_BYTES_PER_CYCLE * 1e9, cm.dram_bandwidth(2112) / 3)
    for name in ("Qwen2.5-1.5B", "Qwen3-0.6B", "Llama-3.2-1B"):
        for dtype in ("int8", "fp16"):
            b = 1 if dtype == "int8" else 2
            compute_per_byte = cm.M_ATOM / cm.MACS_PER_CYCLE_PER_CORE[dtype] / 1e9 / b
            ceiling = 3 * per_core_bw / (1 + cm.OVERLAP_PENALTY * compute_per_byte * per_core_bw)
            for sub in dec.decode_submits(dec.PRESETS[name]):
                for m in (1, 8):
                    seconds = dec.modeled_submit_s(sub, m, dtype, cores=3) - OWN_DRIVER.per_submit_s
                    stream = sub.K * sum(sub.Ns) * b / seconds
                    assert stream > 0.9 * ceiling, (name, dtype, sub.names, m, stream / 1e9)


@pytest.mark.parametrize("name,dtype,at_ceiling,at_bound", [
    # docs/decode.md, the goals' arithmetic: 113 submits x 79 us on top of the weights' stream
    ("Qwen2.5-1.5B", "int8", 16.98, 15.90), ("Qwen3-0.6B", "fp16", 21.05, 19.76), ("Qwen3-0.6B", "int8", 35.44, 33.59)])
def test_goal_bounds_are_the_weights_at_the_ceiling_plus_the_submits(name, dtype, at_ceiling, at_bound):
    from ggml_rknpu.cost import model as cm

    row = dec.forecast(dec.PRESETS[name], dtype, 1, cores=3)
    seconds = row["submits_per_token"] * OWN_DRIVER.per_submit_s
    assert row["tok_s_at_ceiling_modeled"] == pytest.approx(1 / (row["weight_mb"] * 1e6 / cm.dram_bandwidth(2112) + seconds))
    assert dec.stream_bound(dtype, 3) / 1e9 == pytest.approx(28.60, abs=0.005)
    assert (round(row["tok_s_at_ceiling_modeled"], 2), round(row["tok_s_at_bound_modeled"], 2)) == (at_ceiling, at_bound)
    assert row["tok_s_modeled"] <= row["tok_s_at_bound_modeled"] < row["tok_s_at_ceiling_modeled"]


def test_gguf_shape_and_cli_report(tmp_path):
    from ggml_rknpu.bench.shapes import load_gguf_shape
    from ggml_rknpu.cli.main import main
    from support.gguf_models import TinyConfig, write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    shape = load_gguf_shape(path)
    c = TinyConfig()
    assert (shape.hidden, shape.ff, shape.layers) == (c.n_embd, c.n_ff, c.n_layer)
    assert (shape.q_dim, shape.kv_dim) == (c.n_head * c.head_dim, c.n_head_kv * c.head_dim)

    out = tmp_path / "report"
    rc = main(["bench", "decode", str(path), "--weights", "int8", "--ms", "1,2",
               "--host-reps", "1", "--allow-throttled", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "decode.json").read_text())
    rows = data["raw"]["rows"]
    tiny = [r for r in rows if r["model"] == "tiny" and r["plan"] == "fused"]
    assert [r["M"] for r in tiny] == [1, 2]
    assert all(r["host_us_per_submit_measured"] > 0 for r in tiny)
    md = (out / "decode.md").read_text()
    assert "(modeled)" in md and "(measured)" in md and "not the board" in md
    assert (out / "decode_tok_s.png").stat().st_size > 0
    submits = data["raw"]["host_submits"]
    assert {s["submit"] for s in submits if s["K"] == c.n_embd} >= {"q+k+v (fused)", "gate+up (fused)", "output"}
    assert all(s["host_us_measured"] > 0 and s["host_after_submit_us_measured"] > 0 for s in submits)

    # a preset, modeled only: the published figure sits beside it
    rc = main(["bench", "decode", "qwen3-0.6b", "--weights", "int8", "--ms", "1", "--host-reps", "0",
               "--allow-throttled", "--out", str(tmp_path / "preset")])
    assert rc == 0
    rows = json.loads((tmp_path / "preset" / "decode.json").read_text())["raw"]["rows"]
    qwen = next(r for r in rows if r["plan"] == "fused")
    assert qwen["anchor_tok_s"] == "32.91" and qwen["anchor_source"] == "RKLLM w8a8"
    assert "host_us_per_submit_measured" not in qwen
    rocket = json.loads((tmp_path / "preset" / "decode.json").read_text())["raw"]["rocket"]
    assert [r["npu_mhz"] for r in rocket] == list(dec.ROCKET_MHZ)
    assert "Decode under mainline rocket" in (tmp_path / "preset" / "decode.md").read_text()


def test_rocket_forecast_is_the_sum_of_its_submits_priced_per_file():
    """Each fused submit's programs priced by ``rocket_time`` (one file, or a file per core),
    times its count per token; every rocket job's domain switch is counted as a guess."""
    from ggml_rknpu.cost.model import ROCKET_DOMAIN_SWITCH_S, rocket_time
    from ggml_rknpu.engine.fusion import fusion_workload

    model = dec.resolve("Qwen3-0.6B")
    row = dec.rocket_forecast(model, "int8", 3, 200)
    spread = one = jobs = 0.0
    for sub in dec.decode_submits(model, True):
        work = fusion_workload(dec.submit_programs(sub, 1, "int8", 3, abi="rocket"))
        cores = len({t.core for t in work.tasks})
        spread += rocket_time(work, files=cores, npu_mhz=200).total_s * sub.count
        one += rocket_time(work, files=1, npu_mhz=200).total_s * sub.count
        jobs += work.submits * cores * sub.count
    assert row["file_per_core_ms_modeled"] == pytest.approx(spread * 1e3)
    assert row["one_file_ms_modeled"] == pytest.approx(one * 1e3)
    assert row["domain_switch_ms_modeled"] == pytest.approx(jobs * ROCKET_DOMAIN_SWITCH_S * 1e3)
    assert row["file_per_core_tok_s_modeled"] > 2 * row["one_file_tok_s_modeled"]


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ValueError, match="neither a preset"):
        dec.named_models(["no-such-model"])


def test_the_forecast_is_at_the_npu_clock_check_rig_reads_and_says_which(tmp_path):
    """Off a board the vendor driver's 1 GHz, assumed and said so; on a mainline board at
    rocket's 200 MHz boot clock (tests/fixtures/rigs/mainline_rocket) that clock."""
    from pathlib import Path

    from ggml_rknpu.cli.main import main

    rigs = Path(__file__).resolve().parents[1] / "fixtures" / "rigs"
    figures = {}
    for name in ("not_rk3588", "mainline_rocket"):
        out = tmp_path / name
        assert main(["bench", "decode", "qwen3-0.6b", "--weights", "int8", "--ms", "1", "--host-reps", "0",
                     "--allow-throttled", "--rig-root", str(rigs / name), "--out", str(out)]) == 0
        data = json.loads((out / "decode.json").read_text())
        fused = next(r for r in data["raw"]["rows"] if r["plan"] == "fused")
        figures[name] = (data["meta"]["npu_clock"], fused["tok_s_modeled"], (out / "decode.md").read_text())
    clock, tok_s, md = figures["not_rk3588"]
    assert clock == "1000 MHz (assumed: the vendor driver's clock)" and f"NPU at {clock}" in md
    clock, slow, md = figures["mainline_rocket"]
    assert clock == "200 MHz (check-rig: this board's NPU clock now)" and f"NPU at {clock}" in md
    assert slow < tok_s / 2
