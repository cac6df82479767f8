"""Struct sizes, field offsets and ioctl request numbers of both kernel ABIs, against
the reference tables (npu-programming.md §4 for rknpu, §5 for rocket)."""

from __future__ import annotations

import ctypes

import pytest

from ggml_rknpu.kernel import drm
from ggml_rknpu.kernel.rknpu import uapi as rk
from ggml_rknpu.kernel.rocket import uapi as ro


def offsets(struct: type[ctypes.Structure]) -> dict[str, int]:
    return {name: getattr(struct, name).offset for name, *_ in struct._fields_}


# npu-programming.md §4 "rknpu_mem_create" table
MEM_CREATE_48 = {"handle": 0, "flags": 4, "size": 8, "obj_addr": 16, "dma_addr": 24, "sram_size": 32,
                 "iommu_domain_id": 40, "core_mask": 44}
# §4 "rknpu_task, packed, 40 B"
TASK = {"flags": 0, "op_idx": 4, "enable_mask": 8, "int_mask": 12, "int_clear": 16, "int_status": 20,
        "regcfg_amount": 24, "regcfg_offset": 28, "regcmd_addr": 32}
# §4 "rknpu_submit, 104 B" (0.9.5 on) and the layout before the IOMMU domains ("UAPI layouts")
SUBMIT_095 = {"flags": 0, "timeout": 4, "task_start": 8, "task_number": 12, "task_counter": 16, "priority": 20,
              "task_obj_addr": 24, "iommu_domain_id": 32, "reserved": 36, "task_base_addr": 40,
              "hw_elapse_time": 48, "core_mask": 56, "fence_fd": 60, "subcore_task": 64}
SUBMIT_080 = {"flags": 0, "timeout": 4, "task_start": 8, "task_number": 12, "task_counter": 16, "priority": 20,
              "task_obj_addr": 24, "regcfg_obj_addr": 32, "task_base_addr": 40, "user_data": 48,
              "core_mask": 56, "fence_fd": 60, "subcore_task": 64}


@pytest.mark.parametrize(
    "struct,size,expected",
    [
        (rk.rknpu_action, 8, {"flags": 0, "value": 4}),
        (rk.rknpu_submit_v095, 104, SUBMIT_095),
        (rk.rknpu_submit_v080, 104, SUBMIT_080),
        (rk.rknpu_mem_create_v48, 48, MEM_CREATE_48),
        (rk.rknpu_mem_create_v40, 40, {k: v for k, v in MEM_CREATE_48.items() if v < 40}),
        (rk.rknpu_mem_map, 16, {"handle": 0, "reserved": 4, "offset": 8}),
        (rk.rknpu_mem_destroy, 16, {"handle": 0, "reserved": 4, "obj_addr": 8}),
        (rk.rknpu_mem_sync, 32, {"flags": 0, "reserved": 4, "obj_addr": 8, "offset": 16, "size": 24}),
        (rk.rknpu_task, 40, TASK),
        (rk.rknpu_subcore_task, 8, {"task_start": 0, "task_number": 4}),
        # §5 UAPI table and array element structs
        (ro.drm_rocket_create_bo, 24, {"size": 0, "handle": 4, "dma_address": 8, "offset": 16}),
        (ro.drm_rocket_submit, 24, {"jobs": 0, "job_count": 8, "job_struct_size": 12, "reserved": 16}),
        (ro.drm_rocket_prep_bo, 16, {"handle": 0, "reserved": 4, "timeout_ns": 8}),
        (ro.drm_rocket_fini_bo, 8, {"handle": 0, "reserved": 4}),
        (ro.drm_rocket_job, 40, {"tasks": 0, "in_bo_handles": 8, "out_bo_handles": 16, "task_count": 24,
                                 "task_struct_size": 28, "in_bo_handle_count": 32, "out_bo_handle_count": 36}),
        (ro.drm_rocket_task, 8, {"regcmd": 0, "regcmd_count": 4}),
        # drm.h, LP64
        (drm.drm_gem_close, 8, {"handle": 0, "pad": 4}),
        (drm.drm_version, 64, {"version_major": 0, "version_minor": 4, "version_patchlevel": 8, "name_len": 16,
                               "name": 24, "date_len": 32, "date": 40, "desc_len": 48, "desc": 56}),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_struct_layout(struct, size, expected):
    assert ctypes.sizeof(struct) == size
    assert offsets(struct) == expected


def test_subcore_task_array_is_five_entries():
    assert ctypes.sizeof(rk.rknpu_submit_v095) - rk.rknpu_submit_v095.subcore_task.offset == 5 * 8


# npu-programming.md §4 "Ioctls" table and §5 "UAPI" table
@pytest.mark.parametrize(
    "number,expected",
    [
        (rk.DRM_IOCTL_RKNPU_ACTION, 0xC0086440),
        (rk.DRM_IOCTL_RKNPU_SUBMIT, 0xC0686441),
        (rk.DRM_IOCTL_RKNPU_MEM_CREATE_40, 0xC0286442),
        (rk.DRM_IOCTL_RKNPU_MEM_CREATE_48, 0xC0306442),
        (rk.DRM_IOCTL_RKNPU_MEM_MAP, 0xC0106443),
        (rk.DRM_IOCTL_RKNPU_MEM_DESTROY, 0xC0106444),
        (rk.DRM_IOCTL_RKNPU_MEM_SYNC, 0xC0206445),
        (ro.DRM_IOCTL_ROCKET_CREATE_BO, 0xC0186440),
        (ro.DRM_IOCTL_ROCKET_SUBMIT, 0x40186441),
        (ro.DRM_IOCTL_ROCKET_PREP_BO, 0x40106442),
        (ro.DRM_IOCTL_ROCKET_FINI_BO, 0x40086443),
        # drm.h on LP64 (sizeof(drm_version) = 64, drm_gem_close = 8)
        (drm.DRM_IOCTL_VERSION, 0xC0406400),
        (drm.DRM_IOCTL_GEM_CLOSE, 0x40086409),
    ],
)
def test_request_numbers(number, expected):
    assert number == expected


def test_capture_submit_request_matches(reference_dir):
    """The RKNN runtime on driver 0.9.8 issued exactly our SUBMIT number with size 104."""
    log = next((reference_dir / "captures" / "raw").glob("*ioctl*readonly*.log")).read_text()
    assert f"cmd={rk.DRM_IOCTL_RKNPU_SUBMIT:#x} size={ctypes.sizeof(rk.rknpu_submit_v095)}" in log


def test_decode_request_round_trips():
    r = drm.decode_request(rk.DRM_IOCTL_RKNPU_MEM_CREATE_48)
    assert (r.direction, r.type, r.nr, r.size) == (3, 0x64, 0x42, 48)


def test_flag_and_action_values():
    # §4 flag tables; AB's ACT_RESET=1 is wrong, the vendor value is 6
    assert rk.Action.ACT_RESET == 6 and rk.Action.POWER_ON == 20 and rk.Action.GET_FREE_SRAM_SIZE == 23
    assert rk.MemFlag.KERNEL_MAPPING == 8 and rk.MemFlag.CACHEABLE == 2
    assert rk.JobFlag.PC == 1 and rk.JobFlag.PINGPONG == 4
    assert int(rk.TASK_BO_FLAGS) == 0x40B and int(rk.DATA_BO_FLAGS) == 0x403  # capture pw_c256_h14
    assert rk.decode_drv_version(rk.encode_drv_version(0, 9, 8)) == (0, 9, 8)


@pytest.mark.parametrize("version, submit, mem_create", [
    ((0, 8, 3), rk.rknpu_submit_v080, rk.rknpu_mem_create_v40),
    ((0, 9, 4), rk.rknpu_submit_v080, rk.rknpu_mem_create_v40),
    ((0, 9, 5), rk.rknpu_submit_v095, rk.rknpu_mem_create_v48),
    ((0, 9, 6), rk.rknpu_submit_v095, rk.rknpu_mem_create_v48),
    ((0, 9, 7), rk.rknpu_submit_v095, rk.rknpu_mem_create_v48),
    ((0, 9, 8), rk.rknpu_submit_v095, rk.rknpu_mem_create_v48)])
def test_the_layout_changes_where_the_iommu_domains_arrive(version, submit, mem_create):
    """0.9.6 and 0.9.7 headers already carry iommu_domain_id and hw_elapse_time (docs "UAPI layouts")."""
    assert rk.submit_struct_for(version) is submit and rk.mem_create_struct_for(version) is mem_create
