"""Placement calibration (bench/calibrate.py, engine/placement_record.py): every weight
shape of a GGUF timed on both sides per bucket, the record written and read back for the
same weight format, cores and threads only, and a placer with measured times decides by
them, not by the models. Times here are the simulator's and this host's."""

from __future__ import annotations

import json

import pytest

from ggml_rknpu.cost import placement as pl
from ggml_rknpu.engine.placement_record import load_times, save_times
from ggml_rknpu.server.placement_policy import Placer


def test_record_round_trip_only_for_its_conditions(tmp_path):
    path = tmp_path / "placement.json"
    rows = [{"type": "Q4_0", "K": 256, "N": 512, "experts": 1, "bucket": "1", "npu_s": 2e-4, "host_s": 1e-4}]
    save_times("board:x", "fp16", 3, 4, rows, path)
    assert load_times("board:x", "fp16", 3, 4, path) == {("Q4_0", 256, 512, 1, "1"): (2e-4, 1e-4)}
    assert load_times("board:x", "int8", 3, 4, path) == {}     # another weight format
    assert load_times("board:x", "fp16", 1, 4, path) == {}     # another envelope
    assert load_times("board:y", "fp16", 3, 4, path) == {}
    assert load_times("board:x", "fp16", 3, 4, tmp_path / "missing.json") == {}


def test_measured_times_override_the_models():
    K, N = 2048, 8192
    modeled = pl.place_matmul("Q4_0", 1, K, N, npu_dtype="fp16", cores=3, threads=4, allow_split=False)
    flipped = (modeled.host_s / 2, modeled.host_s) if modeled.where == pl.HOST else (modeled.npu_s, modeled.npu_s / 2)
    placer = Placer("auto", "fp16", 3, 4, {("Q4_0", K, N, 1, "1"): flipped})
    choice, basis = placer.choice("Q4_0", 1, K, N)
    assert basis == "measured" and choice.where != modeled.where
    assert (choice.npu_s, choice.host_s) == flipped
    other, basis = placer.choice("Q4_0", 16, K, N)            # a bucket not measured: the models
    assert basis == "modeled" and other == pl.place_matmul("Q4_0", 16, K, N, npu_dtype="fp16", cores=3,
                                                             threads=4, allow_split=False)
    assert placer.on_npu("blk.0.ffn_up.weight", 2, 1, K, N, K * N) == (choice.where == pl.NPU)   # 2 = Q4_0
    assert placer.as_dict()["by_kind"][0]["basis"] == "measured"


@pytest.mark.timeout(600)
def test_calibrate_a_tiny_gguf_on_the_simulator(tmp_path):
    from ggml_rknpu.cli.main import main
    from support.gguf_models import write_tiny_gguf

    model = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", "q8_0")
    record = tmp_path / "placement.json"
    out = tmp_path / "report"
    rc = main(["bench", "calibrate-placement", str(model), "--device", "sim-rknpu", "-t", "1", "-r", "1",
               "--buckets", "1,5-16", "--record-file", str(record), "--allow-throttled", "--out", str(out)])
    assert rc == 0
    rows = json.loads((out / "calibrate_placement.json").read_text())["raw"]["rows"]
    assert {r["bucket"] for r in rows} == {"1", "5-16"} and all(r["npu_s"] > 0 and r["host_s"] > 0 for r in rows)
    assert {r["type"] for r in rows} >= {"Q8_0"}
    (entry,) = json.loads(record.read_text())["boards"].values()
    assert (entry["weights"], entry["cores"], entry["threads"]) == ("fp16", 1, 1)
    assert len(entry["times"]) == len(rows)
