"""Several IOMMU domains on the vendor driver (0.9.8): the simulated kernel keeps a window per
domain and switches the live one per call; the driver and the device allocate in a domain and
submit a job in the domain of its buffers [docs/npu-programming.md §4 "IOMMU domains"]."""

from __future__ import annotations

import errno

import numpy as np
import pytest

from ggml_rknpu.devices import open_device
from ggml_rknpu.kernel.device import HwTask, Job, NpuDevice
from ggml_rknpu.kernel.errors import NpuError, NpuOutOfMemory, NpuTimeout
from ggml_rknpu.kernel.rknpu import uapi as rk
from ggml_rknpu.kernel.rknpu.ioctls import RknpuIoctls
from ggml_rknpu.sim.kernel import SimRknpuKernel
from ggml_rknpu.sim.memory import PAGE, WINDOW_ENV
from support.kernel_fake_npu import attach, regcmd_words

PAGES = 8


def shrunk() -> tuple[SimRknpuKernel, RknpuIoctls]:
    k = SimRknpuKernel("rknpu", iova_window=(PAGE, (PAGES + 1) * PAGE))
    return k, RknpuIoctls(k, k.open("/dev/dri/renderD129"))


def test_each_domain_has_its_own_window_and_a_call_switches_the_live_one():
    k, d = shrunk()
    full = [d.mem_create(PAGE, rk.DATA_BO_FLAGS, 0) for _ in range(PAGES)]
    with pytest.raises(NpuOutOfMemory):
        d.mem_create(PAGE, rk.DATA_BO_FLAGS, 0)
    other = d.mem_create(PAGE, rk.DATA_BO_FLAGS, 1)
    assert other.dma_addr == full[0].dma_addr        # the same IOVA, another address space
    assert d.action(rk.Action.GET_IOMMU_DOMAIN_ID) == 1 and k.domain_switches == 1   # 0 -> 1
    d.mem_sync(full[0].obj_addr, 0, PAGE, rk.SyncFlag.TO_DEVICE)   # MEM_SYNC switches to the object's domain
    assert d.action(rk.Action.GET_IOMMU_DOMAIN_ID) == 0 and k.domain_switches == 2
    d.action(rk.Action.SET_IOMMU_DOMAIN_ID, 1)
    assert d.action(rk.Action.GET_IOMMU_DOMAIN_ID) == 1
    assert k.stats()["iova_used"] == (PAGES + 1) * PAGE


def test_a_domain_outside_0_to_15_is_einval():
    _, d = shrunk()
    for bad in (rk.MAX_IOMMU_DOMAINS, -1):
        with pytest.raises(NpuError) as e:
            d.mem_create(PAGE, rk.DATA_BO_FLAGS, bad)
        assert e.value.errno == errno.EINVAL and "0..15" in str(e.value)


def device(k: SimRknpuKernel) -> NpuDevice:
    attach(k)
    return NpuDevice(k, k.open("/dev/dri/renderD129"), "/dev/dri/renderD129", simulated=True)


def test_a_job_runs_in_the_domain_of_its_buffers():
    k, _ = shrunk()
    dev = device(k)
    assert dev.max_domains == rk.MAX_IOMMU_DOMAINS
    regcmd = dev.alloc(PAGE, purpose="regcmd", domain=1)
    regcmd.array()[: regcmd_words(10).nbytes] = regcmd_words(10).view(np.uint8)
    out = dev.alloc(PAGE, domain=1)
    done = dev.submit(Job(cores=((HwTask(regcmd.dma_addr, 10),),), outputs=(out,), domain=1))
    assert done.task_counter == 1 and k.iommu_domain_id == 1
    assert dev.iova_budget(1)[0] == dev.iova_budget(0)[0] - 3 * PAGE   # regcmd, out, task BO
    with pytest.raises(NpuError) as e:     # domain 0 has no buffer there (yet)
        dev.submit(Job(cores=((HwTask(regcmd.dma_addr, 10),),), domain=0))
    assert e.value.errno == errno.EFAULT
    mixed = dev.alloc(PAGE, domain=0)
    assert mixed.dma_addr == regcmd.dma_addr
    with pytest.raises(NpuError) as e:     # refused before the ioctl
        dev.submit(Job(cores=((HwTask(regcmd.dma_addr, 10),),), outputs=(mixed,), domain=1))
    assert e.value.errno == errno.EINVAL and "domain 0, the job in 1" in str(e.value)


def test_a_submit_in_another_domain_faults_as_a_board_does():
    k, d = shrunk()
    attach(k)
    regcmd = d.mem_create(PAGE, rk.DATA_BO_FLAGS, 1)
    task = d.mem_create(PAGE, rk.TASK_BO_FLAGS, 1)
    assert {k.address_space(fd).ident for fd in [d.fd]} == {1}   # the live one: the last MEM_CREATE's
    words = regcmd_words(10)
    k._objects[regcmd.obj_addr].dram[: words.nbytes] = words.view(np.uint8)
    record = rk.rknpu_task(op_idx=1, enable_mask=0x0D, int_mask=0x300, int_clear=0x1FFFF,
                           regcfg_amount=10, regcmd_addr=regcmd.dma_addr)
    k._objects[task.obj_addr].cpu[: len(bytes(record))] = np.frombuffer(bytes(record), np.uint8)
    assert d.submit(task_obj_addr=task.obj_addr, task_number=1, core_mask=1, subcore_tasks=((0, 1),),
                    iommu_domain_id=1).task_counter == 1
    with pytest.raises(NpuTimeout) as e:   # domain 0 maps nothing at that IOVA: an IOMMU page fault
        d.submit(task_obj_addr=task.obj_addr, task_number=1, core_mask=1, subcore_tasks=((0, 1),),
                 iommu_domain_id=0)
    assert "DMA fault" in str(e.value)


def test_the_window_knob_shrinks_each_domain(monkeypatch):
    monkeypatch.setenv(WINDOW_ENV, str(PAGES * PAGE))
    with open_device("sim-rknpu") as dev:
        assert dev.iova_budget(0) == dev.iova_budget(3)
        bufs = [dev.alloc(PAGE, domain=0) for _ in range(PAGES)]
        with pytest.raises(NpuOutOfMemory):
            dev.alloc(PAGE, domain=0)
        assert dev.alloc(PAGE, domain=1).dma_addr == bufs[0].dma_addr
    monkeypatch.setenv(WINDOW_ENV, "12345")
    with pytest.raises(ValueError, match="4096-byte pages"):
        open_device("sim-rknpu")
