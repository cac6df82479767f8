"""``rknpu bench npu-step``: the per-phase split of one token's NPU steps (not a timing test:
it checks that each phase is measured and the simulator's time is kept apart)."""

import numpy as np

from ggml_rknpu.bench import npu_step


def test_npu_step_splits_every_step_into_host_phases_and_simulator_time():
    shape = npu_step.LayerShape(hidden=64, q=64, kv=32, ffn=128)
    rows = npu_step.measure("sim-rknpu", "fp16", shape, layers=1, tokens=2, rng=np.random.default_rng(0))["rows"]
    assert [r["step"] for r in rows] == ["q+k+v", "o", "gate+up", "down"]
    for r in rows:
        phases = [r[f"{p}_us_measured"] for p in npu_step.PHASES]
        assert all(v > 0 for v in phases)
        assert r["npu_model_us_measured"] > 0 and r["sim_driver_us_measured"] > 0
        assert r["host_min_us_measured"] <= r["host_us_measured"]
    # every step cleans one buffer holding A and C, and invalidates C
    assert {r["ioctls"] for r in rows} == {"2 RKNPU_MEM_SYNC, 1 RKNPU_SUBMIT"}
