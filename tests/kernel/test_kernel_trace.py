"""RKNPU_TRACE: every syscall of a device's life, decoded, through the Syscalls seam."""

from __future__ import annotations

import errno

import pytest

from ggml_rknpu.devices import open_device
from ggml_rknpu.kernel.errors import NpuError
from ggml_rknpu.kernel.rknpu import uapi as rk
from ggml_rknpu.kernel.rknpu.ioctls import RknpuIoctls
from ggml_rknpu.kernel.trace import TracingSyscalls
from ggml_rknpu.sim.kernel import SimKernel


def test_trace_decodes_struct_fields_and_errors():
    lines: list[str] = []
    sys = TracingSyscalls(SimKernel("rknpu"), lines.append)
    d = RknpuIoctls(sys, sys.open("/dev/dri/renderD129"))
    m = d.mem_create(440, rk.TASK_BO_FLAGS)
    with pytest.raises(NpuError):
        d.mem_sync(0, 0, 4096, rk.SyncFlag.TO_DEVICE)   # obj_addr 0: the driver's NULL check
    text = "\n".join(lines)
    assert "open(/dev/dri/renderD129) -> fd" in text
    assert "DRM_IOCTL_VERSION" in text and "RKNPU_ACTION" in text
    assert "RKNPU_MEM_CREATE(48)(fd 100) in:  handle=0 flags=0x40b size=440" in text
    assert f"out: handle=1 flags=0x40b size=0x1000 obj_addr={m.obj_addr:#x} dma_addr={m.dma_addr:#x}" in text
    assert f"RKNPU_MEM_SYNC(fd 100) -> errno {errno.EINVAL}" in text


def test_trace_file_from_environment(tmp_path, monkeypatch):
    log = tmp_path / "trace.log"
    monkeypatch.setenv("RKNPU_TRACE", str(log))
    with open_device("sim-rocket") as dev:
        with dev.alloc(4096) as buf:
            buf.sync_to_device()
        tracer = dev.syscalls
        assert isinstance(tracer, TracingSyscalls)
        assert tracer.stats()["objects"] == 0  # simulator extras reachable through the wrapper
    text = log.read_text()
    for expected in ("ROCKET_CREATE_BO", "mmap(fd", "ROCKET_FINI_BO", "munmap(4096 bytes)", "DRM_IOCTL_GEM_CLOSE",
                     "close("):
        assert expected in text


@pytest.mark.parametrize("version, fields, absent", [
    ((0, 8, 3), "regcfg_obj_addr=0x0 task_base_addr=0x0 user_data=", "hw_elapse_time"),
    ((0, 9, 6), "iommu_domain_id=0 reserved=0 task_base_addr=0x0 hw_elapse_time=", "user_data")])
def test_trace_decodes_submit_in_the_layout_of_the_driver_version(version, fields, absent):
    """SUBMIT has one request number for both layouts: the trace names fields 32..55 as the
    version the fd reported (GET_DRV_VERSION) lays them out."""
    lines: list[str] = []
    sys = TracingSyscalls(SimKernel("rknpu", version), lines.append)
    d = RknpuIoctls(sys, sys.open("/dev/dri/renderD129"))
    with pytest.raises(NpuError):
        d.submit(task_obj_addr=0, task_number=1)     # obj_addr 0: EINVAL, decoded all the same
    submits = [line for line in lines if line.startswith("RKNPU_SUBMIT") and " in: " in line]
    assert submits and all(fields in line and absent not in line for line in submits)
