"""Placement prices the NPU side at the engine's NPU clock and its start-up line says which:
mainline rocket's 200 MHz boot clock moves a matmul the vendor driver's 1 GHz keeps on the NPU
to the host."""

from __future__ import annotations

from ggml_rknpu.cost.model import VENDOR_CLOCK, NpuClock
from ggml_rknpu.engine import open_engine
from ggml_rknpu.server.placement_policy import Placer, placer_for

ROCKET_BOOT = NpuClock(200, "the simulated rocket kernel's clock")


def test_the_npu_side_is_priced_at_the_clock_given():
    args = ("Q4_0", 16, 2048, 8192)
    fast = Placer("auto", "int8", 3, 4, host_repack=True).choice(*args)[0]
    slow = Placer("auto", "int8", 3, 4, host_repack=True, npu_clock=ROCKET_BOOT).choice(*args)[0]
    assert fast.where == "npu" and slow.where == "host"
    assert slow.npu_s > 4 * fast.npu_s and slow.host_s == fast.host_s


def test_the_plan_line_names_the_engine_s_clock():
    with open_engine("sim-rocket") as npu:
        placer = placer_for(npu, "auto", "fp16", None)
    assert placer.npu_clock == ROCKET_BOOT
    assert f"core(s) at {ROCKET_BOOT}, " in placer.describe()
    assert placer.as_dict()["npu_clock"] == "200 MHz (the simulated rocket kernel's clock)"
    assert placer_for(object(), "auto", "fp16", None).npu_clock == VENDOR_CLOCK   # an engine that knows none
