"""The engine prices device time at the NPU clock the device runs at, and says which: the
vendor driver's GET_FREQ, or the simulated rocket kernel's own timeline clock (mainline
boots the NPU at 200 MHz), never an assumed 1 GHz where the device says otherwise."""

from __future__ import annotations

import numpy as np
import pytest

from ggml_rknpu.cost.model import OWN_DRIVER, ROCKET_DOMAIN_SWITCH_S, NpuClock
from ggml_rknpu.devices import open_device
from ggml_rknpu.engine import open_engine
from ggml_rknpu.sim.kernel import SimRocketKernel

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("mhz", [200, 600])
def test_sim_rocket_jobs_and_the_engine_s_pricing_use_the_same_clock(mhz):
    """One single-core job: the simulator's modeled run of it (its tasks at ``rocket_mhz``)
    equals the engine's modeled time of the program less what only the engine prices (the
    domain-switch guess and the submit path)."""
    kernel = SimRocketKernel(rocket_mhz=mhz)
    with open_engine(open_device("sim-rocket", syscalls=kernel), cores=1) as npu:
        assert npu.npu_clock == NpuClock(mhz, "the simulated rocket kernel's clock")
        b = np.random.default_rng(0).standard_normal((256, 512)).astype(np.float32)
        w = npu.upload_weight(b)
        before = len(kernel.job_runs)
        npu.matmul(np.ones((4, 512), np.float32), w)
        runs = kernel.job_runs[before:]
        bound = next(iter(w.programs.values()))
        assert len(runs) == 1 and bound.program.n_submits == 1
        simulated = runs[0].end - runs[0].start
        assert bound.modeled is not None
        priced = bound.modeled.total_s - ROCKET_DOMAIN_SWITCH_S - OWN_DRIVER.per_submit_s
        assert simulated > 0 and priced == pytest.approx(simulated, rel=1e-9)


def test_the_vendor_driver_s_reported_clock_is_the_one_priced():
    with open_engine("sim-rknpu") as npu:
        assert npu.npu_clock == NpuClock(1000, "reported by the simulated rknpu driver")
        assert npu.npu_mhz == 1000 and str(npu.npu_clock) == "1000 MHz (reported by the simulated rknpu driver)"


def test_a_clock_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        NpuClock(0, "nothing")
