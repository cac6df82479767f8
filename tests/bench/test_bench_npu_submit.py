"""``rknpu bench npu-submit``: the per-phase split of one token's NPU submits (not a timing test:
it checks that each phase is measured and the simulator's time is kept apart)."""

import numpy as np

from ggml_rknpu.bench import npu_submit


def test_npu_submit_splits_every_submit_into_host_phases_and_simulator_time():
    shape = npu_submit.LayerShape(hidden=64, q=64, kv=32, ffn=128)
    rows = npu_submit.measure("sim-rknpu", "fp16", shape, layers=1, tokens=2, rng=np.random.default_rng(0))["rows"]
    assert [r["submit"] for r in rows] == ["q+k+v", "o", "gate+up", "down"]
    for r in rows:
        phases = [r[f"{p}_us_measured"] for p in npu_submit.PHASES]
        assert all(v > 0 for v in phases)
        assert r["npu_model_us_measured"] > 0 and r["sim_driver_us_measured"] > 0
        assert r["host_min_us_measured"] <= r["host_us_measured"]
    # every submit cleans one buffer holding A and C, and invalidates C
    assert {r["ioctls"] for r in rows} == {"2 RKNPU_MEM_SYNC, 1 RKNPU_SUBMIT"}
