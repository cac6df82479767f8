"""The simulated kernels behave like rknpu 0.9.8 and mainline rocket where they used to be kinder
(docs/npu-programming.md §4-§5, "What the drivers really do"), and the drivers depend on
neither: masks the vendor driver commits, rocket jobs validated before SUBMIT. Where the real
kernel lets a misuse pass, the simulator answers as it does and records the misuse
(sim.kernel.misuse), which fails any test that does not take it on purpose."""

from __future__ import annotations

import ctypes
import errno
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggml_rknpu.kernel.buffer import Buffer
from ggml_rknpu.kernel.device import NpuDevice
from ggml_rknpu.kernel.errors import NpuError
from ggml_rknpu.kernel.job import HwTask, Job
from ggml_rknpu.kernel.rknpu import uapi as rk
from ggml_rknpu.kernel.rknpu.driver import core_groups
from ggml_rknpu.kernel.rknpu.ioctls import RknpuIoctls, RknpuMem
from ggml_rknpu.kernel.rocket.driver import RocketDriver
from ggml_rknpu.kernel.rocket.ioctls import RocketIoctls, RocketJobSpec
from ggml_rknpu.sim.kernel import SimKernel, misuse
from ggml_rknpu.sim.memory import PAGE
from support.kernel_fake_npu import FakeNpu, attach, regcmd_words
from support.misuse_check import assert_no_misuse

pytestmark = pytest.mark.timeout(120)

VENDOR, ROCKET = "/dev/dri/renderD129", "/dev/accel/accel0"


def vendor(version=(0, 9, 8)) -> tuple[SimKernel, RknpuIoctls]:
    k = SimKernel("rknpu", version)
    return k, RknpuIoctls(k, k.open(VENDOR))


def rocket(**kw) -> tuple[SimKernel, RocketIoctls]:
    k = SimKernel("rocket", **kw)
    return k, RocketIoctls(k, k.open(ROCKET))


def errno_of(call) -> int:
    try:
        call()
    except NpuError as exc:
        return -1 if exc.errno is None else exc.errno
    return 0


def task_bo(d: RknpuIoctls, n: int, addr: int) -> RknpuMem:
    m = d.mem_create(max(1, n) * 40, rk.TASK_BO_FLAGS)
    view = d.mmap(d.mem_map(m.handle), m.size)
    task = rk.rknpu_task(enable_mask=0xD, int_mask=0x300, int_clear=0x1FFFF, regcfg_amount=10, regcmd_addr=addr)
    for i in range(n):
        view[i * 40:(i + 1) * 40] = bytes(task)
    d.mem_sync(m.obj_addr, 0, m.size, rk.SyncFlag.TO_DEVICE)
    return m


def regcmd(d: RknpuIoctls) -> RknpuMem:
    words = regcmd_words(10)
    m = d.mem_create(words.nbytes, rk.DATA_BO_FLAGS)
    np.frombuffer(d.mmap(d.mem_map(m.handle), m.size), np.uint64, words.size)[:] = words
    d.mem_sync(m.obj_addr, 0, m.size, rk.SyncFlag.TO_DEVICE)
    return m


# ----------------------------------------------------------------------- 1. core masks
@pytest.mark.parametrize("mask", [0b101, 0b110])
def test_masks_the_vendor_driver_does_not_commit_run_nothing_and_are_einval(mask):
    k, d = vendor()
    npu = attach(k)
    t = task_bo(d, 2, regcmd(d).dma_addr)
    assert errno_of(lambda: d.submit(task_obj_addr=t.obj_addr, task_number=2, core_mask=mask,
                                     subcore_tasks=((0, 1), (1, 1), (1, 1)))) == errno.EINVAL
    assert npu.writes == [] and f"RKNPU: Unknown core mask: {mask}" in k.dmesg


def test_core_groups_keep_committed_masks_and_split_the_others():
    assert core_groups((0, 1, 2)) == ((0, 1, 2),) and core_groups((0, 1)) == ((0, 1),)
    assert core_groups((1, 2)) == ((1,), (2,)) and core_groups((0, 2)) == ((0,), (2,))


def _device(abi: str, **fake) -> tuple[NpuDevice, SimKernel, FakeNpu]:
    k = SimKernel(abi)
    npu = attach(k, **fake)
    path = k._device_paths()[-1]
    return NpuDevice(k, k.open(path), path, simulated=True), k, npu


def _submitted_masks(k: SimKernel) -> list[int]:
    """Wrap ``k.ioctl`` to record every vendor SUBMIT's core_mask."""
    masks: list[int] = []
    real = k.ioctl

    def ioctl(fd: int, request: int, arg: bytearray) -> int:
        if request == rk.DRM_IOCTL_RKNPU_SUBMIT:
            masks.append(rk.rknpu_submit_v095.from_buffer_copy(bytes(arg)).core_mask)
        return real(fd, request, arg)

    k.ioctl = ioctl  # type: ignore[method-assign]
    return masks


def _task_and_output(dev: NpuDevice) -> tuple[HwTask, Buffer]:
    """One 10-word register-command task in a regcmd buffer made visible to the device, and an
    output buffer for the job."""
    buf, out = dev.alloc(4096, purpose="regcmd"), dev.alloc(4096)
    words = regcmd_words(10)
    buf.array()[: words.nbytes] = words.view(np.uint8)
    buf.sync_to_device()
    return HwTask(buf.dma_addr, 10), out


def test_a_job_on_cores_1_and_2_runs_as_two_single_core_submits():
    """e.g. after core 0 is marked dead: mask 6 would never be committed."""
    dev, k, npu = _device("rknpu")
    masks = _submitted_masks(k)
    t, out = _task_and_output(dev)
    done = dev.submit(Job(cores=((), (t,), (t, t)), outputs=(out,)))
    assert masks == [0b010, 0b100] and done.task_counter == 3
    assert npu.executed == [0, 1, 1] and k.dmesg == []   # one hardware run on each


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=3, max_size=3).filter(any))
def test_no_submit_with_core_mask_5_or_6_can_be_built(per_core):
    """Every vendor SUBMIT goes through ``RknpuDriver.submit_table``: over any split of tasks
    onto the three cores (the engine's chains, the ladder's rungs, recovery's rebuilt jobs are
    all such splits), the masks sent are ones rknpu_job_commit commits."""
    dev, k, npu = _device("rknpu")
    masks = _submitted_masks(k)
    t, out = _task_and_output(dev)
    done = dev.submit(Job(cores=tuple((t,) * n for n in per_core), outputs=(out,)))
    assert set(masks) <= set(rk.COMMITTED_CORE_MASKS) and 0b101 not in masks and 0b110 not in masks
    assert done.task_counter == sum(per_core) and npu.executed == [int(n > 0) for n in per_core]
    dev.close()


# ----------------------------------------------------------------------- 2. > 4095 tasks
def test_driver_096_chunks_a_long_task_list_as_098_does():
    k, d = vendor((0, 9, 6))
    npu = attach(k)
    t = task_bo(d, 4097, regcmd(d).dma_addr)
    res = d.submit(task_obj_addr=t.obj_addr, task_number=4097, core_mask=1, subcore_tasks=((0, 4097),))
    assert res.task_counter == 4097
    assert [v for _, o, v in npu.writes if o == 0x30] == [(0x6 << 12) | 4095, (0x6 << 12) | 2]


# ------------------------------------------------------------- the submit layout by version
class _ElapsedClock:
    """The simulated kernel, plus what a board's driver writes after a job: ``hw_elapse_time``
    (ns, s64 at offset 48 of rknpu_submit from 0.9.5 on; the simulator has no clock)."""

    def __init__(self, kernel: SimKernel, ns: int) -> None:
        self.kernel, self.ns = kernel, ns

    def __getattr__(self, name: str):
        return getattr(self.kernel, name)

    def ioctl(self, fd: int, request: int, arg: bytearray) -> int:
        ret = self.kernel.ioctl(fd, request, arg)
        if request == rk.DRM_IOCTL_RKNPU_SUBMIT:
            arg[48:56] = self.ns.to_bytes(8, "little", signed=True)
        return ret


@pytest.mark.parametrize("version, elapsed", [((0, 9, 4), None), ((0, 9, 6), 12345), ((0, 9, 7), 12345),
                                              ((0, 9, 8), 12345)])
def test_hw_elapse_time_is_read_from_0_9_5_on(version, elapsed):
    """0.9.6 and 0.9.7 report the job's hardware time as 0.9.8 does; before 0.9.5 offset 48 is
    user_data, which is not a time."""
    k = SimKernel("rknpu", version)
    d = RknpuIoctls(_ElapsedClock(k, 12345), k.open(VENDOR))
    t = task_bo(d, 1, regcmd(d).dma_addr)
    attach(k)
    res = d.submit(task_obj_addr=t.obj_addr, task_number=1, core_mask=1, subcore_tasks=((0, 1),))
    assert res.task_counter == 1 and res.hw_elapse_time == elapsed


# ----------------------------------------------------------------------- 3-5. ACTION
def test_power_actions_are_einval_and_change_nothing():
    k, d = vendor()
    d.action(rk.Action.GET_HW_VERSION)
    assert k.powered
    for action in (rk.Action.POWER_OFF, rk.Action.POWER_ON, rk.Action.POWER_OFF):
        assert errno_of(lambda a=action: d.action(a)) == errno.EINVAL
    assert k.powered   # no case in rknpu_action: the driver's runtime PM decides


def test_set_freq_and_set_volt_are_einval_and_nothing_happens():
    k, d = vendor()
    freq, volt = d.action(rk.Action.GET_FREQ), d.action(rk.Action.GET_VOLT)
    assert errno_of(lambda: d.action(rk.Action.SET_FREQ, 300_000_000)) == errno.EINVAL
    assert errno_of(lambda: d.action(rk.Action.SET_VOLT, 700_000)) == errno.EINVAL
    assert (d.action(rk.Action.GET_FREQ), d.action(rk.Action.GET_VOLT)) == (freq, volt)


@pytest.mark.parametrize("action", ["GET_BW_PRIORITY", "SET_BW_PRIORITY", "GET_BW_EXPECT", "SET_BW_EXPECT",
                                    "GET_BW_TW", "SET_BW_TW"])
def test_every_bandwidth_action_is_einval_on_rk3588(action):
    k, d = vendor()
    assert errno_of(lambda: d.action(rk.Action[action], 1)) == errno.EINVAL


# ----------------------------------------------------------------------- 6-8. memory ioctls
def test_mem_map_of_a_bad_handle_is_enoent():
    k, d = vendor()
    assert errno_of(lambda: d.mem_map(9)) == errno.ENOENT


def test_mem_destroy_looks_up_the_handle_only():
    k, d = vendor()
    m = d.mem_create(4096, rk.DATA_BO_FLAGS)
    d.mem_destroy(m.handle, 0xDEAD000)          # a wrong obj_addr is ignored
    assert k.stats()["objects"] == 0


def test_mem_sync_clamps_a_range_past_the_buffer_and_records_the_misuse():
    k, d = vendor()
    m = d.mem_create(4096, rk.DATA_BO_FLAGS)
    d.mem_sync(m.obj_addr, 4000, 200, rk.SyncFlag.TO_DEVICE)       # 0, as the sg walk clamps it
    taken = misuse.drain()
    assert [(x.ioctl, "past the 4096-byte buffer" in x.what) for x in taken] == [("MEM_SYNC", True)]
    assert any("MISUSE" in line for line in k.dmesg)


def test_mem_sync_ignores_unknown_flag_bits_and_refuses_obj_addr_0():
    k, d = vendor()
    m = d.mem_create(4096, rk.DATA_BO_FLAGS)
    d.mem_sync(m.obj_addr, 0, 4096, rk.SyncFlag(0x5))   # bit 2 is no sync direction: ignored
    assert errno_of(lambda: d.mem_sync(0, 0, 4096, rk.SyncFlag.TO_DEVICE)) == errno.EINVAL


def test_a_misuse_left_in_the_record_fails_the_test():
    """The check every test runs at teardown (tests/conftest.py)."""
    misuse.record(misuse.Misuse("rknpu", "MEM_SYNC", "range past the end", "clamped"))
    with pytest.raises(AssertionError, match="kernel misuse a board would pay for"):
        assert_no_misuse()
    assert_no_misuse()      # the record is empty again


# ----------------------------------------------------------------------- 15. DRM version
def test_drm_version_date_of_098():
    k, d = vendor()
    assert (d.drm.name, d.drm.date) == ("rknpu", "20240828")


# ----------------------------------------------------------------------- 11-14. rocket
def _rocket_bos(r: RocketIoctls) -> tuple:
    words = regcmd_words(10)
    rc = r.create_bo(words.nbytes)
    np.frombuffer(r.mmap(rc.offset, 4096), np.uint64, words.size)[:] = words
    r.fini_bo(rc.handle)
    return rc, r.create_bo(4096)


def test_rocket_drops_a_malformed_job_returns_0_and_runs_the_rest():
    k, r = rocket()
    npu = attach(k)
    rc, out = _rocket_bos(r)
    good = RocketJobSpec(tasks=((rc.dma_address, 14),), in_handles=(rc.handle,), out_handles=(out.handle,))
    r.submit([RocketJobSpec(tasks=((rc.dma_address, 14),), out_handles=(77,)),      # bad handle
              RocketJobSpec(tasks=((rc.dma_address, 0),)),                          # regcmd_count 0
              good])
    assert npu.executed_tasks(0) == 1                                                # only the good one
    assert [x.ioctl for x in misuse.drain()] == ["SUBMIT", "SUBMIT"]


def test_rocket_driver_validates_every_job_before_submit():
    k = SimKernel("rocket")
    npu = attach(k)
    drv = RocketDriver(k, k.open(ROCKET))
    a = drv.alloc(4096, "regcmd")
    with pytest.raises(NpuError) as e:
        drv.check_jobs([RocketJobSpec(tasks=((a.dma_addr, 14),), out_handles=(a.handle + 40,))])
    assert e.value.errno == errno.ENOENT
    for tasks in ((), ((a.dma_addr, 0),)):
        with pytest.raises(NpuError):
            drv.check_jobs([RocketJobSpec(tasks=tasks, in_handles=(a.handle,))])
    drv.check_jobs([RocketJobSpec(tasks=((a.dma_addr, 14),), in_handles=(a.handle,))])
    assert npu.writes == []


def test_rocket_runs_one_files_jobs_one_at_a_time_on_one_core():
    k, r = rocket()
    npu = attach(k)
    rc, out = _rocket_bos(r)
    job = RocketJobSpec(tasks=((rc.dma_address, 14),), in_handles=(rc.handle,), out_handles=(out.handle,))
    r.submit([job, job, job])
    r.submit([job])
    assert [npu.executed_tasks(c) for c in range(3)] == [4, 0, 0]


def test_rocket_iova_nodes_have_the_size_asked_for_at_page_aligned_starts():
    k, r = rocket()
    free0, total = k.iova_budget(r.fd)
    a = r.create_bo(PAGE + 1)
    assert k.iova_budget(r.fd) == (free0 - (PAGE + 1), total)
    b = r.create_bo(PAGE)
    assert b.dma_address == a.dma_address + 2 * PAGE


@pytest.mark.parametrize("deadline, code", [(0, errno.EBUSY), (None, errno.ETIMEDOUT)])
def test_rocket_prep_bo_of_a_busy_bo_past_its_deadline_is_ebusy(deadline, code):
    k, r = rocket(rocket_errors="loud")
    attach(k, hang=True)
    rc, out = _rocket_bos(r)
    r.submit([RocketJobSpec(tasks=((rc.dma_address, 14),), in_handles=(rc.handle,), out_handles=(out.handle,))])
    timeout_ns = time.monotonic_ns() + 10**9 if deadline is None else deadline
    assert errno_of(lambda: r.prep_bo(out.handle, timeout_ns)) == code


def test_mem_create_48_ends_with_core_mask():
    assert rk.rknpu_mem_create_v48.core_mask.offset == 44 and ctypes.sizeof(rk.rknpu_mem_create_v48) == 48
