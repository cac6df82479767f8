"""SimKernel answers the driver classes the way the real kernels do: one test per
validation rule (real errno + a message that says what to do), DRM's size handling,
the vendor PC programming sequence and completion rule, rocket's per-task sequence."""

from __future__ import annotations

import ctypes
import errno
import sys

import numpy as np
import pytest

from ggml_rknpu.hw.alignment import ceil_div
from ggml_rknpu.kernel import drm
from ggml_rknpu.kernel.errors import NpuError, NpuFault, NpuOutOfMemory, NpuTimeout
from ggml_rknpu.kernel.rknpu import uapi as rk
from ggml_rknpu.kernel.rknpu.ioctls import RknpuIoctls
from ggml_rknpu.kernel.rocket import uapi as ro
from ggml_rknpu.kernel.rocket.ioctls import RocketIoctls, RocketJobSpec
from ggml_rknpu.sim.kernel import SimKernel, fuzz_status, misuse
from support.kernel_fake_npu import attach, regcmd_words

pytestmark = pytest.mark.timeout(60)

VENDOR, ROCKET = "/dev/dri/renderD129", "/dev/accel/accel0"


def vendor(version=(0, 9, 8), **kw) -> tuple[SimKernel, RknpuIoctls]:
    k = SimKernel("rknpu", version, **kw)
    return k, RknpuIoctls(k, k.open(VENDOR))


def rocket(**kw) -> tuple[SimKernel, RocketIoctls]:
    k = SimKernel("rocket", **kw)
    return k, RocketIoctls(k, k.open(ROCKET))


def expect(code: int, *words: str):
    """pytest.raises for NpuError with this errno; the message must contain ``words``."""

    class _Check:
        def __enter__(self):
            self.ctx = pytest.raises(NpuError)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self.ctx.__exit__(*exc)
            assert self.info.value.errno == code, (self.info.value.errno, str(self.info.value))
            for w in words:
                assert w.lower() in str(self.info.value).lower(), (w, str(self.info.value))
            return handled

    return _Check()


def regcmd_bo(d: RknpuIoctls, k: SimKernel, words: np.ndarray, flags=rk.DATA_BO_FLAGS):
    m = d.mem_create(words.nbytes, flags)
    view = d.mmap(d.mem_map(m.handle), m.size)
    np.frombuffer(view, np.uint64, words.size)[:] = words
    if flags & rk.MemFlag.CACHEABLE:
        d.mem_sync(m.obj_addr, 0, m.size, rk.SyncFlag.TO_DEVICE)
    return m, view


def task_bo(d: RknpuIoctls, tasks: list[rk.rknpu_task], flags=rk.TASK_BO_FLAGS):
    m = d.mem_create(max(1, len(tasks)) * 40, flags)
    view = d.mmap(d.mem_map(m.handle), m.size)
    for i, t in enumerate(tasks):
        view[i * 40 : (i + 1) * 40] = bytes(t)
    return m, view


def one_task(addr: int, body: int = 10, int_mask: int = 0x300) -> rk.rknpu_task:
    return rk.rknpu_task(enable_mask=0xD, int_mask=int_mask, int_clear=0x1FFFF, regcfg_amount=body, regcmd_addr=addr)


# --------------------------------------------------------------------------- DRM core
def test_drm_version_names_and_versions():
    k, d = vendor((0, 8, 3))
    assert (d.drm.name, d.drm.desc, d.drm.date) == ("rknpu", "RKNPU driver", "20221110")
    assert d.version == (0, 8, 3) and d.submit_struct is rk.rknpu_submit_v080
    assert d.mem_create_struct is rk.rknpu_mem_create_v40
    k, d = vendor((0, 9, 6))
    assert d.drm.date == "20240322" and d.submit_struct is rk.rknpu_submit_v095
    k, r = rocket()
    assert (r.drm.name, r.drm.desc, r.version) == ("rocket", "rocket DRM", (0, 0, 0))


def test_both_mem_create_sizes_work_on_both_driver_versions():
    """DRM copies the user's size in, zero-fills to the driver's and copies the user's size out."""
    for version in ((0, 8, 3), (0, 9, 6), (0, 9, 8)):
        k, d = vendor(version)
        for struct, request in ((rk.rknpu_mem_create_v40, rk.DRM_IOCTL_RKNPU_MEM_CREATE_40),
                                (rk.rknpu_mem_create_v48, rk.DRM_IOCTL_RKNPU_MEM_CREATE_48)):
            arg = bytearray(bytes(struct(size=440, flags=int(rk.TASK_BO_FLAGS))))
            assert k.ioctl(d.fd, request, arg) == 0
            out = struct.from_buffer(arg)
            assert len(arg) == ctypes.sizeof(struct)
            assert out.size == 4096 and out.handle > 0 and out.dma_addr % 4096 == 0 and out.obj_addr


def test_iova_allocation_is_top_down_like_the_capture():
    """[capture pw_c256_h14] consecutive objects sit just below each other (0xfff9f000, 0xfff5c000)."""
    k, d = vendor()
    a = d.mem_create(440, rk.TASK_BO_FLAGS)
    b = d.mem_create(271296, rk.DATA_BO_FLAGS)
    assert b.size == 274432 and b.dma_addr == a.dma_addr - b.size
    assert d.mem_map(a.handle) == 0x100000000 and d.mem_map(b.handle) == 0x100001000


def test_unknown_fd_is_ebadf():
    k = SimKernel("rknpu")
    with pytest.raises(OSError) as e:
        k.ioctl(12345, rk.DRM_IOCTL_RKNPU_ACTION, bytearray(8))
    assert e.value.errno == errno.EBADF


def test_non_drm_request_is_enotty_and_unknown_nr_einval():
    k, d = vendor()
    with pytest.raises(OSError) as e:
        k.ioctl(d.fd, drm._IOWR(ord("r"), 0, 8), bytearray(8))
    assert e.value.errno == errno.ENOTTY
    with pytest.raises(OSError) as e:
        k.ioctl(d.fd, drm._IOWR(drm.DRM_IOCTL_BASE, 0x4F, 8), bytearray(8))
    assert e.value.errno == errno.EINVAL and "not implemented" in str(e.value)


def test_short_argument_buffer_is_efault():
    k, d = vendor()
    with pytest.raises(OSError) as e:
        k.ioctl(d.fd, rk.DRM_IOCTL_RKNPU_ACTION, bytearray(4))
    assert e.value.errno == errno.EFAULT


def test_open_unknown_path_is_enoent():
    with pytest.raises(OSError) as e:
        SimKernel("rknpu").open("/dev/accel/accel0")
    assert e.value.errno == errno.ENOENT and "renderD129" in str(e.value)


# --------------------------------------------------------------------------- ACTION
def test_actions_report_documented_values():
    k, d = vendor()
    assert d.action(rk.Action.GET_DRV_VERSION) == 908  # 0*10000 + 9*100 + 8
    assert d.action(rk.Action.GET_HW_VERSION) == 0x46495245
    assert d.action(rk.Action.GET_FREQ) == 1_000_000_000
    assert d.action(rk.Action.GET_IOMMU_EN) == 1


def test_unknown_action_is_einval():
    k, d = vendor()
    with expect(errno.EINVAL, "not a known RKNPU action"):
        d.action(99)


# --------------------------------------------------------------------------- memory rules
def test_mem_create_size_zero_is_einval():
    k, d = vendor()
    with expect(errno.EINVAL, "size must be > 0"):
        d.mem_create(0, rk.DATA_BO_FLAGS)


def test_mem_sync_requires_cacheable():
    k, d = vendor()
    m = d.mem_create(4096, rk.MemFlag.WRITE_COMBINE)
    with expect(errno.EINVAL, "CACHEABLE", "need no sync"):
        d.mem_sync(m.obj_addr, 0, 4096, rk.SyncFlag.TO_DEVICE)


def test_mem_sync_of_destroyed_buffer_is_efault():
    k, d = vendor()
    m = d.mem_create(4096, rk.DATA_BO_FLAGS)
    d.mem_destroy(m.handle, m.obj_addr)
    with expect(errno.EFAULT, "not a live buffer"):
        d.mem_sync(m.obj_addr, 0, 4096, rk.SyncFlag.TO_DEVICE)
    # a board dereferences the stale pointer: the simulator refuses it and records the misuse
    assert [m.ioctl for m in misuse.drain()] == ["MEM_SYNC"]


def test_unknown_handle_is_enoent_for_mem_map_and_fini_bo():
    k, d = vendor()
    with expect(errno.ENOENT, "handle 7 is not open"):  # drm_gem_dumb_map_offset
        d.mem_map(7)
    k, r = rocket()
    with expect(errno.ENOENT, "handle 7 is not open"):
        r.fini_bo(7)
    with expect(errno.EINVAL, "GEM_CLOSE"):
        r.gem_close(7)


def test_cached_buffers_need_sync_uncached_do_not():
    """CPU writes reach the NPU's view only after MEM_SYNC TO_DEVICE (cached BOs)."""
    k, d = vendor()
    m = d.mem_create(4096, rk.DATA_BO_FLAGS)
    view = d.mmap(d.mem_map(m.handle), 4096)
    view[:4] = b"\x01\x02\x03\x04"
    assert bytes(k.mmu.view(m.dma_addr, 4)) == b"\0\0\0\0"
    d.mem_sync(m.obj_addr, 0, 4096, rk.SyncFlag.TO_DEVICE)
    assert bytes(k.mmu.view(m.dma_addr, 4)) == b"\x01\x02\x03\x04"
    k.mmu.view(m.dma_addr, 4)[:] = 9  # the NPU writes
    assert view[0] == 1
    d.mem_sync(m.obj_addr, 0, 4096, rk.SyncFlag.FROM_DEVICE)
    assert view[0] == 9
    wc = d.mem_create(4096, rk.MemFlag.WRITE_COMBINE)
    wview = d.mmap(d.mem_map(wc.handle), 4096)
    wview[0] = 7
    assert k.mmu.view(wc.dma_addr, 1)[0] == 7


def test_mmap_rules():
    k, d = vendor()
    m = d.mem_create(4096, rk.DATA_BO_FLAGS)
    off = d.mem_map(m.handle)
    with pytest.raises(OSError) as e:
        k.mmap(d.fd, 8192, off)
    assert e.value.errno == errno.EINVAL and "outside" in str(e.value)
    with pytest.raises(OSError) as e:
        k.mmap(d.fd, 4096, off + 4096 * 50)
    assert e.value.errno == errno.EINVAL and "fake offset" in str(e.value)
    other = k.open(VENDOR)
    with pytest.raises(OSError) as e:
        k.mmap(other, 4096, off)
    assert e.value.errno == errno.EACCES


def test_dma_outside_every_buffer_faults():
    from ggml_rknpu.sim.memory import DmaFault

    k, d = vendor()
    m = d.mem_create(4096, rk.DATA_BO_FLAGS)
    assert k.mmu.view(m.dma_addr + 4000, 96).size == 96
    with pytest.raises(DmaFault) as e:
        k.mmu.view(m.dma_addr + 4000, 97)
    assert e.value.iova == m.dma_addr + 4000 and e.value.nbytes == 97 and "past the end" in str(e.value)
    with pytest.raises(DmaFault):
        k.mmu.view(0, 4)


# --------------------------------------------------------------------------- vendor submit rules
def test_submit_without_npu_model_is_enodev(monkeypatch):
    monkeypatch.setitem(sys.modules, "ggml_rknpu.sim.npu", None)  # import fails
    k, d = vendor()
    rc, _ = regcmd_bo(d, k, regcmd_words(10))
    t, _ = task_bo(d, [one_task(rc.dma_addr)])
    with expect(errno.ENODEV, "no NPU model"):
        d.submit(task_obj_addr=t.obj_addr, task_number=1, core_mask=1, subcore_tasks=((0, 1),))


def test_submit_requires_job_pc():
    k, d = vendor()
    attach(k)
    t, _ = task_bo(d, [one_task(0x1000)])
    with expect(errno.EINVAL, "RKNPU_JOB_PC"):
        d.submit(task_obj_addr=t.obj_addr, task_number=1, flags=rk.JobFlag.PINGPONG)


def test_submit_task_number_zero_is_einval():
    k, d = vendor()
    t, _ = task_bo(d, [one_task(0x1000)])
    with expect(errno.EINVAL, "task number"):
        d.submit(task_obj_addr=t.obj_addr, task_number=0)


def test_task_bo_requires_kernel_mapping():
    k, d = vendor()
    t, _ = task_bo(d, [one_task(0x1000)], flags=rk.DATA_BO_FLAGS)
    with expect(errno.EINVAL, "KERNEL_MAPPING", "0x40b"):
        d.submit(task_obj_addr=t.obj_addr, task_number=1, subcore_tasks=((0, 1),))


def test_selected_core_without_subcore_tasks_is_einval():
    k, d = vendor()
    t, _ = task_bo(d, [one_task(0x1000)])
    with expect(errno.EINVAL, "core 1", "subcore_task"):
        d.submit(task_obj_addr=t.obj_addr, task_number=1, core_mask=0b11, subcore_tasks=((0, 1), (0, 0)))


def test_core_mask_beyond_the_cores_is_einval():
    k, d = vendor()
    t, _ = task_bo(d, [one_task(0x1000)])
    with expect(errno.EINVAL, "core_mask"):
        d.submit(task_obj_addr=t.obj_addr, task_number=1, core_mask=0b1001, subcore_tasks=((0, 1),))


def test_more_than_4095_tasks_per_core_is_einval_before_095():
    k, d = vendor((0, 9, 4))
    t, _ = task_bo(d, [one_task(0x1000)] * 4096)
    with expect(errno.EINVAL, "4095", "split"):
        d.submit(task_obj_addr=t.obj_addr, task_number=4096, core_mask=1, subcore_tasks=((0, 4096),))


def test_driver_098_reissues_long_task_lists_in_4095_task_chunks():
    """[npu-programming.md §4] max_submit_number = 4095: longer lists go in several runs."""
    k, d = vendor((0, 9, 8))
    npu = attach(k)
    rc, _ = regcmd_bo(d, k, regcmd_words(10))
    t, _ = task_bo(d, [one_task(rc.dma_addr)] * 4097)
    res = d.submit(task_obj_addr=t.obj_addr, task_number=4097, core_mask=1, subcore_tasks=((0, 4097),))
    assert res.task_counter == 4097
    assert [v for _, o, v in npu.writes if o == 0x30] == [(0x6 << 12) | 4095, (0x6 << 12) | 2]


def test_task_range_past_the_task_bo_is_einval():
    k, d = vendor()
    t, _ = task_bo(d, [one_task(0x1000)])
    with expect(errno.EINVAL, "rknpu_task slots"):
        d.submit(task_obj_addr=t.obj_addr, task_number=200, core_mask=1, subcore_tasks=((0, 200),))


def test_nonblock_and_fences_are_refused():
    k, d = vendor()
    t, _ = task_bo(d, [one_task(0x1000)])
    with expect(errno.EINVAL, "NONBLOCK"):
        d.submit(task_obj_addr=t.obj_addr, task_number=1, flags=rk.JobFlag.PC | rk.JobFlag.NONBLOCK,
                 subcore_tasks=((0, 1),))


def test_vendor_pc_sequence_for_three_cores_uses_subcore_task_i_plus_2():
    """npu-programming.md §3 steps 1-9 per core; 3 cores: subcore_task[i+2] [§4]."""
    k, d = vendor()
    npu = attach(k)
    rc, _ = regcmd_bo(d, k, regcmd_words(10))
    tasks = [one_task(rc.dma_addr, 10) for _ in range(3)]
    t, tview = task_bo(d, tasks)
    res = d.submit(task_obj_addr=t.obj_addr, task_number=3, core_mask=0b111,
                   flags=rk.JobFlag.PC | rk.JobFlag.PINGPONG, task_base_addr=0,
                   subcore_tasks=((9, 9), (9, 9), (0, 1), (1, 1), (2, 1)))
    assert res.task_counter == 3 and res.hw_elapse_time == 0
    for core in range(3):
        writes = [(o, v) for c, o, v in npu.writes if c == core]
        pointer = 0xE + 0x10000000 * core
        assert writes[:11] == [
            (0x10, 1), (0x1004, pointer), (0x3004, pointer), (0x10, rc.dma_addr),
            (0x14, ceil_div(10 + 4, 2) - 1), (0x20, 0x300), (0x24, 0x300),
            (0x30, (0x7 << 12) | 1), (0x34, 0), (0x08, 1), (0x08, 0),
        ]
        assert npu.executed_tasks(core) == 1
    # the first core's int_status, written into the last task committed (core 2's), through
    # the kernel mapping
    assert rk.rknpu_task.from_buffer_copy(tview[80:120]).int_status == 0x100
    assert rk.rknpu_task.from_buffer_copy(tview[0:40]).int_status == 0


def test_auto_core_mask_takes_subcore_task_0_on_core_0():
    k, d = vendor()
    npu = attach(k)
    rc, _ = regcmd_bo(d, k, regcmd_words(10))
    t, _ = task_bo(d, [one_task(rc.dma_addr)] * 3)
    d.submit(task_obj_addr=t.obj_addr, task_number=3, core_mask=0, subcore_tasks=((0, 1), (0, 1), (0, 1)))
    assert {c for c, _, _ in npu.writes} == {0}
    assert (0, 0x30, (0x6 << 12) | 1) in npu.writes  # no PINGPONG flag -> pp_en 0


def test_int_mask_must_be_a_whole_bit_pair():
    """The IRQ handler fuzzes INT_STATUS to whole pairs and requires == int_mask [VEND]."""
    assert fuzz_status(0x100) == 0x300 and fuzz_status(0x900) == 0xF00
    k, d = vendor()
    npu = attach(k, raise_bits=0x100)
    rc, _ = regcmd_bo(d, k, regcmd_words(10))
    t, _ = task_bo(d, [one_task(rc.dma_addr, int_mask=0x100)])
    with expect(errno.ETIMEDOUT, "invalid irq status", "whole bit pair"):
        d.submit(task_obj_addr=t.obj_addr, task_number=1, core_mask=1, subcore_tasks=((0, 1),))
    assert any("invalid irq status: 0x100" in line and "require mask: 0x100" in line for line in k.dmesg)
    assert npu.resets == [None]


def test_hang_times_out_at_once_resets_and_reports_task_counter():
    k, d = vendor()
    npu = attach(k, hang=True)
    first = regcmd_words(10)
    rc, _ = regcmd_bo(d, k, np.concatenate([first, first]))
    t, _ = task_bo(d, [one_task(rc.dma_addr), one_task(rc.dma_addr + first.nbytes)])
    arg = bytearray(bytes(rk.rknpu_submit_v095(
        flags=1, timeout=6000, task_number=2, task_obj_addr=t.obj_addr, core_mask=1,
        subcore_task=(rk.rknpu_subcore_task * 5)(rk.rknpu_subcore_task(0, 2)))))
    with pytest.raises(OSError) as e:
        k.ioctl(d.fd, rk.DRM_IOCTL_RKNPU_SUBMIT, arg)
    assert e.value.errno == errno.ETIMEDOUT and "simulated time" in str(e.value)
    assert "fake: core 0 executed" in str(e.value)  # SimNpu.diagnostics in the message
    assert rk.rknpu_submit_v095.from_buffer(arg).task_counter == 1  # copied out on error, like DRM
    assert npu.resets == [None] and any("soft reset" in line for line in k.dmesg)


def test_npu_dma_outside_buffers_is_a_timeout_naming_the_fault():
    """The vendor driver knows only timeouts: an IOMMU page fault ends as ETIMEDOUT."""
    k, d = vendor()
    attach(k)
    t, _ = task_bo(d, [one_task(0x10000)])
    with expect(errno.ETIMEDOUT, "DMA fault", "0x10000"):
        d.submit(task_obj_addr=t.obj_addr, task_number=1, core_mask=1, subcore_tasks=((0, 1),))
    assert isinstance(NpuError.from_oserror("x", OSError(errno.EFAULT, "f")), NpuFault)


def test_errno_maps_to_specific_errors():
    assert isinstance(NpuError.from_oserror("x", OSError(errno.ETIMEDOUT, "t")), NpuTimeout)
    assert isinstance(NpuError.from_oserror("x", OSError(errno.ENOMEM, "m")), NpuOutOfMemory)


# --------------------------------------------------------------------------- rocket rules
def rocket_submit_raw(k: SimKernel, fd: int, **fields) -> None:
    k.ioctl(fd, ro.DRM_IOCTL_ROCKET_SUBMIT, bytearray(bytes(ro.drm_rocket_submit(**fields))))


def test_rocket_reserved_must_be_zero():
    k, r = rocket()
    jobs = (ro.drm_rocket_job * 1)()
    with pytest.raises(OSError) as e:
        rocket_submit_raw(k, r.fd, jobs=ctypes.addressof(jobs), job_count=1, job_struct_size=40, reserved=1)
    assert e.value.errno == errno.EINVAL and "reserved" in str(e.value)
    b = r.create_bo(4096)
    with pytest.raises(OSError) as e:
        k.ioctl(r.fd, ro.DRM_IOCTL_ROCKET_PREP_BO, bytearray(bytes(ro.drm_rocket_prep_bo(handle=b.handle, reserved=3))))
    assert e.value.errno == errno.EINVAL


def test_rocket_job_struct_size_too_small_is_einval():
    k, r = rocket()
    jobs = (ro.drm_rocket_job * 1)()
    with pytest.raises(OSError) as e:
        rocket_submit_raw(k, r.fd, jobs=ctypes.addressof(jobs), job_count=1, job_struct_size=32)
    assert e.value.errno == errno.EINVAL and "job_struct_size" in str(e.value)


def test_rocket_null_jobs_pointer_is_efault():
    k, r = rocket()
    with pytest.raises(OSError) as e:
        rocket_submit_raw(k, r.fd, jobs=0, job_count=1, job_struct_size=40)
    assert e.value.errno == errno.EFAULT


def test_rocket_regcmd_count_zero_is_einval_when_loud():
    k, r = rocket(rocket_errors="loud")
    with expect(errno.EINVAL, "regcmd_count"):
        r.submit([RocketJobSpec(tasks=((0x1000, 0),))])


def test_rocket_unknown_bo_handle_is_enoent_when_loud():
    k, r = rocket(rocket_errors="loud")
    attach(k)
    with expect(errno.ENOENT, "out_bo_handles"):
        r.submit([RocketJobSpec(tasks=((0x1000, 14),), out_handles=(42,))])


def test_rocket_per_task_sequence_and_dpu_only_completion():
    k, r = rocket()
    npu = attach(k, raise_bits=0x400)  # a PPU interrupt: rocket does not accept it
    words = regcmd_words(10)
    rc = r.create_bo(words.nbytes)
    np.frombuffer(r.mmap(rc.offset, 4096), np.uint64, words.size)[:] = words
    r.fini_bo(rc.handle)
    out = r.create_bo(4096)
    r.submit([RocketJobSpec(tasks=((rc.dma_address, 14),), in_handles=(rc.handle,), out_handles=(out.handle,))])
    writes = [(o, v) for c, o, v in npu.writes if c == 0]
    assert writes[:10] == [
        (0x10, 1), (0x1004, 0xE), (0x3004, 0xE), (0x10, rc.dma_address), (0x14, ceil_div(14, 2) - 1),
        (0x20, 0x300), (0x24, 0x300), (0x30, 0x7001), (0x34, 0), (0x08, 1),
    ]
    r.prep_bo(out.handle)  # mainline: the job times out and PREP_BO still returns 0
    assert any("no DPU interrupt" in line and "0x400" in line for line in k.dmesg)
    npu.raise_bits = 0x100
    r.submit([RocketJobSpec(tasks=((rc.dma_address, 14),) * 2, out_handles=(out.handle,))])
    r.prep_bo(out.handle)  # completed
    assert npu.executed_tasks(0) == 3 and npu.executed_tasks(1) == 0  # the file's entity: one core


def test_rocket_files_have_separate_address_spaces():
    k = SimKernel("rocket")
    a, b = RocketIoctls(k, k.open(ROCKET)), RocketIoctls(k, k.open(ROCKET))
    assert a.create_bo(4096).dma_address == b.create_bo(4096).dma_address
