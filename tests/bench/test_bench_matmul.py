"""rknpu bench matmul / sustained: modeled figures beside the seed's, the rig gate, and end-to-end
runs on the simulator through the real engine (small sizes) producing JSON + Markdown + PNG."""

from __future__ import annotations

import json

import pytest

from ggml_rknpu.bench import matmul as mm
from ggml_rknpu.cli import bench as cli
from ggml_rknpu.cost.anchors import ANCHORS
from support.bench_support import RIGS, valid_png
from support.bench_support import run_bench_cli as run_cli


def test_modeled_prints_seed_figures_beside_modeled(tmp_path):
    out = tmp_path / "modeled"
    assert run_cli("matmul", "--modeled", "--out", str(out), "--rig-root", str(RIGS / "not_rk3588")) == 0
    data = json.loads((out / "matmul_modeled.json").read_text())
    assert data["rig"]["verdict"] == "SKIP"
    rows = data["raw"]["seed_comparison"]
    seed = [a for a in ANCHORS if a.source.startswith("prototype board log")]
    assert [(r["M"], r["K"], r["N"], r["dtype"]) for r in rows] == [(a.M, a.K, a.N, a.dtype) for a in seed]
    # the prototype's own board figures [docs/history.md §7], unchanged
    assert [r["seed_gflops_measured"] for r in rows[:5]] == [8.1, 9.0, 10.9, 442, 548]
    for r in rows:
        # three cores beat one; DRAM parked at 528 MHz costs the bandwidth-bound GEMV most
        assert r["ours_3c_gflops_modeled"] > 1.5 * r["ours_1c_gflops_modeled"] > 0
        assert r["ours_3c_dram528_gflops_modeled"] < r["ours_3c_gflops_modeled"]
        if r["M"] == 1:
            assert r["ours_3c_gflops_modeled"] / r["ours_3c_dram528_gflops_modeled"] > 2.5
        assert 0.5 < r["seed_path_gflops_modeled"] / r["seed_gflops_measured"] < 1.5
    md = (out / "matmul_modeled.md").read_text()
    assert "seed GFLOP/s (measured)" in md and "ours 3 cores GFLOP/s (modeled)" in md
    assert "| decode GEMV | 1 | 2048 | 2048 | fp16 | 8.1 |" in md
    plot = next(p for p in data["plots"] if p["file"] == "gflops_vs_m.png")
    labels = [s["label"] for s in plot["series"]]
    assert labels == ["fp16 1 core (modeled)", "fp16 3 cores (modeled)", "int8 1 core (modeled)",
                      "int8 3 cores (modeled)"]
    assert plot["series"][0]["x"] == [1, *mm.GEMM_MS]
    gemm = dict(zip(plot["series"][0]["x"], plot["series"][0]["y"]))
    assert gemm[512] > 20 * gemm[1]       # the prototype's ~60x GEMM/GEMV gap [docs/history.md §7], modeled
    for p in data["plots"]:
        assert valid_png(out / p["file"]) == (750, 450)


def test_failed_rig_refuses_unless_allowed(tmp_path):
    out = tmp_path / "refused"
    args = ("matmul", "--modeled", "--out", str(out), "--rig-root", str(RIGS / "throttled_dram"))
    assert run_cli(*args) == cli.REFUSED
    assert not out.exists()
    assert run_cli(*args, "--allow-throttled") == 0
    data = json.loads((out / "matmul_modeled.json").read_text())
    assert data["rig"]["verdict"] == "FAIL"
    assert "DRAM at 528 MHz of 2112" in (out / "matmul_modeled.md").read_text()


@pytest.mark.timeout(300)
def test_burst_reports_the_cores_the_envelope_allowed(tmp_path):
    out = tmp_path / "capped"
    assert run_cli("matmul", "--device", "sim-rknpu", "--shapes", "small", "--ms", "1", "--iters", "1",
                   "--warmup", "0", "--cores", "3", "--out", str(out), "--rig-root", str(RIGS / "not_rk3588")) == 0
    rows = json.loads((out / "matmul.json").read_text())["raw"]["rows"]
    assert rows and all(r["cores"] == 1 and r["cores_requested"] == 3 for r in rows if r["executed"])


def test_burst_on_the_simulator_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("RKNPU_ENVELOPE", "extended")   # 3 cores: beyond the proven envelope (1 core)
    out = tmp_path / "burst"
    assert run_cli("matmul", "--device", "sim-rknpu", "--shapes", "small", "--ms", "1,16", "--iters", "2",
                   "--warmup", "0", "--max-sim-macs", str(16 * 256 * 128 - 1), "--out", str(out),
                   "--rig-root", str(RIGS / "not_rk3588")) == 0
    data = json.loads((out / "matmul.json").read_text())
    rows = data["raw"]["rows"]
    assert data["meta"]["simulated"] is True and len(rows) == 2 * 2 * 2 * 2
    executed = [r for r in rows if r["executed"]]
    skipped = [r for r in rows if not r["executed"]]
    # only M=16 on the 256x128 weight is above the budget: priced by the model, never run
    assert {(r["shape"], r["M"]) for r in skipped} == {("small 256x128", 16)}
    assert all(r["gflops_modeled"] > 0 and "gflops_measured" not in r for r in rows)
    for r in executed:
        assert r["calls"] == 2 and r["device_ms_modeled"] > 0
        assert all(r[f"{p}_ms_measured"] is not None for p in mm.HOST_PHASES)
    md = (out / "matmul.md").read_text()
    assert "device ms (modeled)" in md and "pack A ms (measured)" in md and "simulator" in md
    for p in data["plots"]:
        labels = {s["label"] for s in p["series"]}
        assert labels == {"fp16 1c (modeled)", "fp16 3c (modeled)", "int8 1c (modeled)", "int8 3c (modeled)"}
        valid_png(out / p["file"])
    assert len(data["plots"]) == 2


@pytest.mark.timeout(300)
def test_sustained_windows_on_the_simulator(tmp_path):
    out = tmp_path / "sustained"
    assert run_cli("sustained", "--device", "sim-rknpu", "--K", "64", "--N", "32", "--seconds", "1.5",
                   "--window", "0.5", "--cores", "1", "--out", str(out), "--rig-root", str(RIGS / "healthy")) == 0
    data = json.loads((out / "sustained.json").read_text())
    windows = data["raw"]["windows"]
    assert 2 <= len(windows) <= 4
    for i, w in enumerate(windows):
        assert w["window"] == i and w["calls"] >= 1 and w["calls_per_s_measured"] > 0
        assert w["device_ms_modeled"] > 0
        assert w["dram_mhz"] == 2112 and w["temps_c"]["npu-thermal"] == 47.0   # read from the rig root
    assert "calls_per_s_measured" in data["raw"]["trend"]
    files = {p["file"]: p for p in data["plots"]}
    assert set(files) == {"sustained_rate.png", "sustained_device.png", "sustained_temps.png"}
    assert "npu-thermal degC (measured)" in {s["label"] for s in files["sustained_temps.png"]["series"]}
    assert files["sustained_device.png"]["series"][0]["label"] == "device GFLOP/s (modeled)"
    assert files["sustained_rate.png"]["series"][0]["label"] == "calls/s (measured, simulator on this host)"
    for name in files:
        valid_png(out / name)
    assert "trend first->last window" in (out / "sustained.md").read_text()


def test_board_rows_carry_measured_and_modeled_side_by_side():
    """On a board the engine reports measured device time (hw_elapse_time); the row keeps it
    apart from the cost model's figure for the same program, each under its own label."""
    from ggml_rknpu.engine.timing import Timing

    case = mm.Case(mm.SEED_SHAPES[0], 1, "fp16", 3)
    calls = [(2e-3, mm.read_timing(Timing(1e-4, 1.2e-3, 2e-5, d, "measured", 1))) for d in (9e-4, 1e-3, 1.1e-3)]
    row = mm.summarize_calls(case, calls, on_board=True)
    assert row["ran_on"] == "board" and row["device_ms_measured"] == pytest.approx(1.0)
    assert row["gflops_measured"] == pytest.approx(case.flops / 1e-3 / 1e9)
    assert row["gflops_call_measured"] == pytest.approx(case.flops / 2e-3 / 1e9)
    assert row["device_ms_modeled"] == pytest.approx(mm.modeled_program_time(1, 2048, 2048, "fp16", 3) * 1e3)
    assert row["pack_a_ms_measured"] == pytest.approx(0.1) and row["submit_ms_measured"] == pytest.approx(1.2)
    unknown = mm.read_timing(Timing(1e-4, 1e-3, 2e-5, None, "unknown", 1))
    assert unknown["device_s"] is None and unknown["device_basis"] is None
