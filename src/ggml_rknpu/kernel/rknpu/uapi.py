"""The vendor ``rknpu`` DRM driver's UAPI: structs, flags, actions, request numbers.

Field order and widths follow the vendor ``rknpu_ioctl.h`` as tabulated in
docs/npu-programming.md §4 [VEND]; sizes and offsets are asserted in tests against that table.
Two ABI generations, split where the driver gained IOMMU domains (``ABI_DOMAINS_VERSION``):
``rknpu_submit`` with ``u64 regcfg_obj_addr`` at 32 and ``u64 user_data`` at 48, then with
``u32 iommu_domain_id; u32 reserved`` and ``s64 hw_elapse_time`` there (both 104 bytes: one
request number); ``rknpu_mem_create`` of 40 bytes, then 48 (``s32 iommu_domain_id`` and a last
word: ``reserved`` up to 0.9.7, ``core_mask`` in 0.9.8), two request numbers, DRM zero-filling
or truncating the difference. Which header says what: docs/npu-programming.md "What the
drivers really do" (UAPI layouts).
"""

from __future__ import annotations

import ctypes
from enum import IntEnum, IntFlag

from ggml_rknpu.kernel.drm import DRM_COMMAND_BASE, DRM_IOWR

u32, s32, u64, s64 = ctypes.c_uint32, ctypes.c_int32, ctypes.c_uint64, ctypes.c_int64

DRIVER_NAME = "rknpu"  # [VEND rknpu_drv.h] DRM_IOCTL_VERSION name


class MemFlag(IntFlag):
    """RKNPU_MEM_* [VEND rknpu_ioctl.h; docs/npu-programming.md §4]. CONTIGUOUS is the value 0."""

    NON_CONTIGUOUS = 1 << 0
    CACHEABLE = 1 << 1
    WRITE_COMBINE = 1 << 2
    KERNEL_MAPPING = 1 << 3
    IOMMU = 1 << 4
    ZEROING = 1 << 5
    SECURE = 1 << 6
    DMA32 = 1 << 7  # 0.9.x meaning; the older header calls this bit NON_DMA32
    TRY_ALLOC_SRAM = 1 << 8
    TRY_ALLOC_NBUF = 1 << 9
    IOMMU_LIMIT_IOVA_ALIGNMENT = 1 << 10


# What the RKNN runtime 2.3.0 on driver 0.9.8 asks for [capture pw_c256_h14 ioctl log:
# task BO flags=0x40b, every other BO flags=0x403].
TASK_BO_FLAGS = MemFlag.NON_CONTIGUOUS | MemFlag.CACHEABLE | MemFlag.KERNEL_MAPPING | MemFlag.IOMMU_LIMIT_IOVA_ALIGNMENT
DATA_BO_FLAGS = MemFlag.NON_CONTIGUOUS | MemFlag.CACHEABLE | MemFlag.IOMMU_LIMIT_IOVA_ALIGNMENT


class SyncFlag(IntFlag):
    """RKNPU_MEM_SYNC_* [VEND]."""

    TO_DEVICE = 1
    FROM_DEVICE = 2


class JobFlag(IntFlag):
    """RKNPU_JOB_* [VEND]; BLOCK/SLAVE is the value 0."""

    PC = 1
    NONBLOCK = 2
    PINGPONG = 4
    FENCE_IN = 8
    FENCE_OUT = 16


class Action(IntEnum):
    """RKNPU_GET_*/SET_*/ACT_* action codes [VEND rknpu_ioctl.h; docs/npu-programming.md §4].
    (AB's Python uses ACT_RESET=1, which is wrong.)"""

    GET_HW_VERSION = 0
    GET_DRV_VERSION = 1
    GET_FREQ = 2
    SET_FREQ = 3
    GET_VOLT = 4
    SET_VOLT = 5
    ACT_RESET = 6
    GET_BW_PRIORITY = 7
    SET_BW_PRIORITY = 8
    GET_BW_EXPECT = 9
    SET_BW_EXPECT = 10
    GET_BW_TW = 11
    SET_BW_TW = 12
    ACT_CLR_TOTAL_RW_AMOUNT = 13
    GET_DT_WR_AMOUNT = 14
    GET_DT_RD_AMOUNT = 15
    GET_WT_RD_AMOUNT = 16
    GET_TOTAL_RW_AMOUNT = 17
    GET_IOMMU_EN = 18
    SET_PROC_NICE = 19
    POWER_ON = 20
    POWER_OFF = 21
    GET_TOTAL_SRAM_SIZE = 22
    GET_FREE_SRAM_SIZE = 23
    GET_IOMMU_DOMAIN_ID = 24
    SET_IOMMU_DOMAIN_ID = 25


# [VEND rk3588_rknpu_config; docs/npu-programming.md §4]
MAX_SUBMIT_TASKS = 4095  # pc_task_number_bits = 12
PC_TASK_NUMBER_MASK = 0xFFF
PC_DATA_AMOUNT_SCALE = 2
PC_DATA_EXTRA_AMOUNT = 4  # RKNPU_PC_DATA_EXTRA_AMOUNT: the 4-word tail the kernel adds
CORE_MASK_ALL = 0x7
# the masks rknpu_job_commit commits; any other logs "Unknown core mask" and the job never
# runs (rknpu_job_wait: EINVAL after the timeout) [VEND rknpu_job.c rknpu_job_commit]
COMMITTED_CORE_MASKS = (0b001, 0b010, 0b100, 0b011, 0b111)
N_SUBCORE_TASKS = 5
# IOMMU domains the driver keeps, ids 0..15, each its own 32-bit window; a MEM_CREATE, MEM_SYNC,
# MEM_DESTROY or SUBMIT naming another domain than the live one first waits for the live one's
# jobs, then switches [VEND 0.9.8 rknpu_drv.h, rknpu_iommu.c; docs/npu-programming.md §4 "IOMMU domains"]
MAX_IOMMU_DOMAINS = 16


class rknpu_action(ctypes.Structure):
    _fields_ = [("flags", u32), ("value", u32)]


class rknpu_subcore_task(ctypes.Structure):
    _fields_ = [("task_start", u32), ("task_number", u32)]


class rknpu_submit_v080(ctypes.Structure):
    """The submit of drivers without IOMMU domains (0.8.x; up to 0.9.4 here)
    [VEND rknpu_ioctl.h beside the 40-byte mem_create; docs/npu-programming.md "What the drivers
    really do" (UAPI layouts)]."""

    _fields_ = [
        ("flags", u32), ("timeout", u32), ("task_start", u32), ("task_number", u32),
        ("task_counter", u32), ("priority", s32), ("task_obj_addr", u64),
        ("regcfg_obj_addr", u64), ("task_base_addr", u64), ("user_data", u64),
        ("core_mask", u32), ("fence_fd", s32),
        ("subcore_task", rknpu_subcore_task * N_SUBCORE_TASKS),
    ]


class rknpu_submit_v095(ctypes.Structure):
    """The submit from 0.9.5 on: the IOMMU domain id and the hardware elapsed time
    [VEND 0.9.6, 0.9.7 and 0.9.8 rknpu_ioctl.h]."""

    _fields_ = [
        ("flags", u32), ("timeout", u32), ("task_start", u32), ("task_number", u32),
        ("task_counter", u32), ("priority", s32), ("task_obj_addr", u64),
        ("iommu_domain_id", u32), ("reserved", u32), ("task_base_addr", u64),
        ("hw_elapse_time", s64), ("core_mask", u32), ("fence_fd", s32),
        ("subcore_task", rknpu_subcore_task * N_SUBCORE_TASKS),
    ]


class rknpu_mem_create_v40(ctypes.Structure):
    """40-byte mem_create (older callers; MESA's intercept.c matches 0xc0286442)."""

    _fields_ = [
        ("handle", u32), ("flags", u32), ("size", u64), ("obj_addr", u64),
        ("dma_addr", u64), ("sram_size", u64),
    ]


class rknpu_mem_create_v48(ctypes.Structure):
    """48-byte mem_create with the iommu_domain_id (0.9.5 on); the last word is ``reserved`` up
    to 0.9.7 and ``core_mask`` (placing NBUF allocations) in 0.9.8 [VEND rknpu_ioctl.h]; 0 here."""

    _fields_ = [
        ("handle", u32), ("flags", u32), ("size", u64), ("obj_addr", u64),
        ("dma_addr", u64), ("sram_size", u64), ("iommu_domain_id", s32), ("core_mask", u32),
    ]


class rknpu_mem_map(ctypes.Structure):
    _fields_ = [("handle", u32), ("reserved", u32), ("offset", u64)]


class rknpu_mem_destroy(ctypes.Structure):
    _fields_ = [("handle", u32), ("reserved", u32), ("obj_addr", u64)]


class rknpu_mem_sync(ctypes.Structure):
    _fields_ = [("flags", u32), ("reserved", u32), ("obj_addr", u64), ("offset", u64), ("size", u64)]


class rknpu_task(ctypes.Structure):
    """One task descriptor in the kernel-mapped task BO; ``__packed`` in the header, 40 B."""

    _pack_ = 1
    _fields_ = [
        ("flags", u32), ("op_idx", u32), ("enable_mask", u32), ("int_mask", u32),
        ("int_clear", u32), ("int_status", u32), ("regcfg_amount", u32),
        ("regcfg_offset", u32), ("regcmd_addr", u64),
    ]


class Nr(IntEnum):
    """Driver-private ioctl numbers (added to DRM_COMMAND_BASE) [VEND]."""

    ACTION = 0x00
    SUBMIT = 0x01
    MEM_CREATE = 0x02
    MEM_MAP = 0x03
    MEM_DESTROY = 0x04
    MEM_SYNC = 0x05


DRM_IOCTL_RKNPU_ACTION = DRM_IOWR(DRM_COMMAND_BASE + Nr.ACTION, rknpu_action)
DRM_IOCTL_RKNPU_SUBMIT = DRM_IOWR(DRM_COMMAND_BASE + Nr.SUBMIT, rknpu_submit_v095)
DRM_IOCTL_RKNPU_MEM_CREATE_40 = DRM_IOWR(DRM_COMMAND_BASE + Nr.MEM_CREATE, rknpu_mem_create_v40)
DRM_IOCTL_RKNPU_MEM_CREATE_48 = DRM_IOWR(DRM_COMMAND_BASE + Nr.MEM_CREATE, rknpu_mem_create_v48)
DRM_IOCTL_RKNPU_MEM_MAP = DRM_IOWR(DRM_COMMAND_BASE + Nr.MEM_MAP, rknpu_mem_map)
DRM_IOCTL_RKNPU_MEM_DESTROY = DRM_IOWR(DRM_COMMAND_BASE + Nr.MEM_DESTROY, rknpu_mem_destroy)
DRM_IOCTL_RKNPU_MEM_SYNC = DRM_IOWR(DRM_COMMAND_BASE + Nr.MEM_SYNC, rknpu_mem_sync)


def encode_drv_version(major: int, minor: int, patch: int) -> int:
    """GET_DRV_VERSION value: MAJOR*10000 + MINOR*100 + PATCH [docs/npu-programming.md §4]."""
    return major * 10000 + minor * 100 + patch


def decode_drv_version(value: int) -> tuple[int, int, int]:
    return value // 10000, (value // 100) % 100, value % 100


# The ABI generation boundary: the IOMMU domains arrived with iommu_domain_id in SUBMIT and
# MEM_CREATE and hw_elapse_time in SUBMIT. 0.8.3's rknpu_drv.h has no domain table, 0.9.6's has
# it and its rknpu_ioctl.h the new layout [VEND]; that 0.9.5 is the first is a review's reading
# of the tarballs; no 0.9.1-0.9.5 header was read [docs/npu-programming.md "What the drivers
# really do" (UAPI layouts)].
ABI_DOMAINS_VERSION = (0, 9, 5)
# From this version the driver re-issues a core's task list longer than max_submit_number
# (4095) in chunks from its IRQ path (rknpu_job_subcore_commit_pc's submit_index); earlier
# ones OR the count into TASK_CON [docs/npu-programming.md §4: 0.8.3's rknpu_config has no
# max_submit_number, 0.9.6's has; 0.9.5 is the review's reading, the chunking is in 0.9.8's rknpu_job.c]
CHUNKED_SUBMIT_VERSION = (0, 9, 5)


def submit_struct_for(version: tuple[int, int, int]) -> type[ctypes.Structure]:
    return rknpu_submit_v095 if version >= ABI_DOMAINS_VERSION else rknpu_submit_v080


def mem_create_struct_for(version: tuple[int, int, int]) -> type[ctypes.Structure]:
    return rknpu_mem_create_v48 if version >= ABI_DOMAINS_VERSION else rknpu_mem_create_v40
