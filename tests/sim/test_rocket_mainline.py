"""Mainline rocket as it really behaves, in the simulator (sim/kernel/rocket.py module doc, citing
drivers/accel/rocket/*.c): a job over the 500 ms timeout returns stale output with no
error, which the engine's canaries catch (the call fails over, the next call works); the
envelope's job-split rule makes the same matmul complete; IOVA 0 for a file's first
buffer; PREP_BO and FINI_BO keep CPU writes and never copy untouched lines over DRAM."""

from __future__ import annotations

import numpy as np
import pytest

from ggml_rknpu.engine import NpuEngine
from ggml_rknpu.hw.envelope import PROVEN
from ggml_rknpu.kernel.device import NpuDevice
from ggml_rknpu.kernel.errors import NpuFault
from ggml_rknpu.kernel.rocket.ioctls import RocketIoctls
from ggml_rknpu.sim.kernel import SimKernel

SLOW_CLOCK_MHZ = 20   # a 10x slower simulated NPU, so a small matmul overruns the timeout
M, K, N = 1024, 1024, 4096      # ~640 ms modeled in one job at 20 MHz; ~64 ms at the real 200


def rocket_device(**kw) -> tuple[NpuDevice, SimKernel]:
    k = SimKernel("rocket", **kw)
    path = k._device_paths()[-1]
    return NpuDevice(k, k.open(path), path, simulated=True), k


def operands():
    rng = np.random.default_rng(3)
    a = rng.integers(-2, 3, (M, K)).astype(np.float32)
    b = rng.integers(-2, 3, (N, K)).astype(np.float32)
    return a, b, a.astype(np.float64) @ b.astype(np.float64).T


def test_a_job_over_the_timeout_is_caught_by_the_canaries_and_the_split_rule_completes_it():
    dev, k = rocket_device(rocket_mhz=SLOW_CLOCK_MHZ)
    a, b, ref = operands()
    one_job = PROVEN.widen("no-split", max_job_ms=1e9, job_model_mhz=SLOW_CLOCK_MHZ)
    npu = NpuEngine(dev, envelope=one_job)
    w = npu.upload_weight(b)
    with pytest.raises(NpuFault, match="canar"):
        npu.matmul(a, w)                                       # stale output, no driver error
    assert any("NPU job timed out" in line for line in k.dmesg)
    assert npu.counters["npu_faults"] == 1
    plan = next(iter(w.programs.values()))
    assert plan.program.n_submits == 1
    # the device keeps working: a small matmul on the same engine is right
    small = npu.upload_weight(b[:64, :64].copy())
    np.testing.assert_array_equal(npu.matmul(a[:8, :64], small), a[:8, :64] @ b[:64, :64].T)
    npu.close()

    dev, k = rocket_device(rocket_mhz=SLOW_CLOCK_MHZ)
    split = PROVEN.widen("split", job_model_mhz=SLOW_CLOCK_MHZ)       # jobs <= 250 ms at 20 MHz
    npu = NpuEngine(dev, envelope=split)
    w = npu.upload_weight(b)
    np.testing.assert_array_equal(npu.matmul(a, w), ref)
    assert next(iter(w.programs.values())).program.n_submits >= 3
    assert not any("timed out" in line for line in k.dmesg)
    npu.close()


def test_the_first_buffer_of_a_rocket_file_is_at_iova_0_and_the_device_uses_it():
    dev, k = rocket_device()
    first = dev.alloc(4096, purpose="regcmd")
    assert first.dma_addr == 0
    second = dev.alloc(8192)
    assert second.dma_addr == 4096                       # drm_mm from the aperture start, upwards
    first.close()
    dev.close()
    # the engine's first buffer (a weight) lands at 0 too, and every program still runs
    dev, _ = rocket_device()
    npu = NpuEngine(dev)
    w = npu.upload_weight(np.eye(64, dtype=np.float32))
    assert w.buffer.dma_addr == 0
    a = np.arange(3 * 64, dtype=np.float32).reshape(3, 64) / 64
    np.testing.assert_allclose(npu.matmul(a, w), a, rtol=1e-3)
    npu.close()


def test_best_fit_picks_the_smallest_hole():
    k = SimKernel("rocket")
    r = RocketIoctls(k, k.open("/dev/accel/accel0"))
    bos = [r.create_bo(n * 4096) for n in (4, 1, 2, 1)]   # at 0, 4, 5, 7 pages
    assert [b.dma_address // 4096 for b in bos] == [0, 4, 5, 7]
    for i in (0, 2):                                      # holes of 4 pages at 0 and 2 pages at 5
        r.gem_close(bos[i].handle)
    assert r.create_bo(2 * 4096).dma_address == 5 * 4096   # the 2-page hole, not the first


def test_prep_bo_keeps_cpu_writes_and_fini_bo_keeps_npu_writes():
    k = SimKernel("rocket")
    r = RocketIoctls(k, k.open("/dev/accel/accel0"))
    bo = r.create_bo(8192)
    cpu = np.frombuffer(r.mmap(bo.offset, 8192), np.uint8)
    space = k.address_space(r.fd)
    obj = space.lookup(bo.dma_address)
    assert obj is not None

    def npu_writes(offset: int, n: int, value: int) -> None:     # as the NPU model writes
        space.device_write_view(bo.dma_address + offset, n)[:] = value
        space.note_device_write(bo.dma_address + offset, n)

    r.prep_bo(bo.handle)                        # CPU owns it; nothing written yet
    cpu[:100] = 7                               # CPU writes, never flushed
    npu_writes(4096, 104, 9)                    # the NPU writes elsewhere
    r.prep_bo(bo.handle)
    assert (cpu[:100] == 7).all()               # the CPU's writes survive PREP_BO ...
    assert (obj.dram[:100] == 7).all()          # ... (dirty lines written back)
    assert (cpu[4096:4200] == 9).all()          # and the CPU now sees the NPU's bytes
    npu_writes(6000, 100, 5)                    # the NPU writes again, the CPU does not touch it
    r.fini_bo(bo.handle)
    assert (obj.dram[6000:6100] == 5).all()     # FINI_BO copies only lines the CPU wrote


def test_loud_mode_still_names_the_failure_at_prep_bo():
    dev, k = rocket_device(rocket_mhz=SLOW_CLOCK_MHZ, rocket_errors="loud")
    a, b, _ = operands()
    npu = NpuEngine(dev, envelope=PROVEN.widen("no-split", max_job_ms=1e9, job_model_mhz=SLOW_CLOCK_MHZ))
    w = npu.upload_weight(b)
    with pytest.raises(Exception, match="timed out"):
        npu.matmul(a, w)
    npu.close()
