"""The mainline ``rocket`` DRM accel driver's UAPI [ROCKET include/uapi/drm/rocket_accel.h;
docs/npu-programming.md §5]. Structs, request numbers; sizes asserted in tests."""

from __future__ import annotations

import ctypes
from enum import IntEnum

from ggml_rknpu.hw.limits import INT_MASK_DPU  # noqa: F401 - DPU_0 | DPU_1: the only completion rocket's IRQ accepts [§3]
from ggml_rknpu.kernel.drm import DRM_COMMAND_BASE, DRM_IOW, DRM_IOWR

u32, s64, u64 = ctypes.c_uint32, ctypes.c_int64, ctypes.c_uint64

DRIVER_NAME = "rocket"  # [ROCKET rocket_drv.c] DRM name
JOB_TIMEOUT_MS = 500  # [ROCKET rocket_job.c JOB_TIMEOUT_MS]


class drm_rocket_create_bo(ctypes.Structure):
    _fields_ = [("size", u32), ("handle", u32), ("dma_address", u64), ("offset", u64)]


class drm_rocket_task(ctypes.Structure):
    """``regcmd_count`` counts ALL qwords including the 4-word tail [§5]."""

    _fields_ = [("regcmd", u32), ("regcmd_count", u32)]


class drm_rocket_job(ctypes.Structure):
    _fields_ = [
        ("tasks", u64), ("in_bo_handles", u64), ("out_bo_handles", u64),
        ("task_count", u32), ("task_struct_size", u32),
        ("in_bo_handle_count", u32), ("out_bo_handle_count", u32),
    ]


class drm_rocket_submit(ctypes.Structure):
    _fields_ = [("jobs", u64), ("job_count", u32), ("job_struct_size", u32), ("reserved", u64)]


class drm_rocket_prep_bo(ctypes.Structure):
    """``timeout_ns`` is absolute (CLOCK_MONOTONIC); MESA passes INT64_MAX [§5]."""

    _fields_ = [("handle", u32), ("reserved", u32), ("timeout_ns", s64)]


class drm_rocket_fini_bo(ctypes.Structure):
    _fields_ = [("handle", u32), ("reserved", u32)]


class Nr(IntEnum):
    CREATE_BO = 0x00
    SUBMIT = 0x01
    PREP_BO = 0x02
    FINI_BO = 0x03


DRM_IOCTL_ROCKET_CREATE_BO = DRM_IOWR(DRM_COMMAND_BASE + Nr.CREATE_BO, drm_rocket_create_bo)
DRM_IOCTL_ROCKET_SUBMIT = DRM_IOW(DRM_COMMAND_BASE + Nr.SUBMIT, drm_rocket_submit)
DRM_IOCTL_ROCKET_PREP_BO = DRM_IOW(DRM_COMMAND_BASE + Nr.PREP_BO, drm_rocket_prep_bo)
DRM_IOCTL_ROCKET_FINI_BO = DRM_IOW(DRM_COMMAND_BASE + Nr.FINI_BO, drm_rocket_fini_bo)
