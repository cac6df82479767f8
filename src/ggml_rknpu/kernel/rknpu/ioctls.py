"""``RknpuIoctls``: the vendor rknpu DRM driver as typed Python callables, one per ioctl.

Identical on a board (``HostSyscalls``) and in tests (``SimKernel``): it only packs
structs, calls ``syscalls.ioctl`` and unpacks. The struct generation (submit before or from 0.9.5,
40- vs 48-byte mem_create) is chosen from the driver version the device reports via
ACTION GET_DRV_VERSION [docs/npu-programming.md §4].
"""

from __future__ import annotations

import ctypes
import errno
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ggml_rknpu.kernel import drm
from ggml_rknpu.kernel.drm import DrmVersion, query_version
from ggml_rknpu.kernel.errors import NpuError
from ggml_rknpu.kernel.rknpu import uapi
from ggml_rknpu.kernel.syscalls import Syscalls

_HINTS: dict[tuple[str, int], str] = {
    ("SUBMIT", errno.ETIMEDOUT): "the NPU never raised the last task's int_mask; read dmesg "
    "('invalid irq status' / 'job timeout') and check int_mask pairs and the regcmd tails",
    ("SUBMIT", errno.EINVAL): "flags must include RKNPU_JOB_PC, task_number must be > 0 and the "
    "task BO must be a KERNEL_MAPPING object of this fd",
    ("MEM_CREATE", errno.ENOMEM): "NPU memory or IOVA space is exhausted; free buffers first",
    ("MEM_SYNC", errno.EINVAL): "MEM_SYNC only works on CACHEABLE buffers and inside the buffer",
}


@dataclass(frozen=True)
class RknpuMem:
    handle: int
    flags: int
    size: int  # page aligned, as returned by the kernel
    obj_addr: int  # kernel object pointer: the id SUBMIT/MEM_SYNC/MEM_DESTROY take
    dma_addr: int  # NPU IOVA
    sram_size: int


@dataclass(frozen=True)
class SubmitResult:
    task_counter: int
    hw_elapse_time: int | None  # ns from commit to IRQ [VEND rknpu_job_done ktime_sub]; None before 0.9.5


class RknpuIoctls:
    def __init__(self, syscalls: Syscalls, fd: int) -> None:
        self.syscalls, self.fd = syscalls, fd
        self.drm: DrmVersion = query_version(syscalls, fd)
        if self.drm.name != uapi.DRIVER_NAME:
            raise NpuError(f"DRM driver is {self.drm.name!r}, not {uapi.DRIVER_NAME!r}; open the rknpu render node")
        self.version: tuple[int, int, int] = uapi.decode_drv_version(self.action(uapi.Action.GET_DRV_VERSION))
        self.submit_struct = uapi.submit_struct_for(self.version)
        self.mem_create_struct = uapi.mem_create_struct_for(self.version)
        self._mem_create_request = (
            uapi.DRM_IOCTL_RKNPU_MEM_CREATE_48
            if self.mem_create_struct is uapi.rknpu_mem_create_v48
            else uapi.DRM_IOCTL_RKNPU_MEM_CREATE_40
        )

    def _call(self, name: str, request: int, struct: ctypes.Structure) -> ctypes.Structure:
        return drm.call(self.syscalls, self.fd, request, struct, f"RKNPU {name}", name, _HINTS)

    def action(self, action: int, value: int = 0) -> int:   # a uapi.Action, or any u32 the driver refuses
        out = self._call("ACTION", uapi.DRM_IOCTL_RKNPU_ACTION, uapi.rknpu_action(flags=int(action), value=value & 0xFFFFFFFF))
        return out.value

    def mem_create(self, size: int, flags: int, iommu_domain_id: int = 0) -> RknpuMem:
        req = self.mem_create_struct(size=size, flags=int(flags))
        if hasattr(req, "iommu_domain_id"):
            req.iommu_domain_id = iommu_domain_id
        out = self._call("MEM_CREATE", self._mem_create_request, req)
        return RknpuMem(out.handle, int(flags), out.size, out.obj_addr, out.dma_addr, out.sram_size)

    def mem_map(self, handle: int) -> int:
        """The fake mmap offset of ``handle`` on this fd."""
        return self._call("MEM_MAP", uapi.DRM_IOCTL_RKNPU_MEM_MAP, uapi.rknpu_mem_map(handle=handle)).offset

    def mem_destroy(self, handle: int, obj_addr: int) -> None:
        self._call("MEM_DESTROY", uapi.DRM_IOCTL_RKNPU_MEM_DESTROY, uapi.rknpu_mem_destroy(handle=handle, obj_addr=obj_addr))

    def mem_sync(self, obj_addr: int, offset: int, size: int, flags: uapi.SyncFlag) -> None:
        self.mem_sync_call(obj_addr, offset, size, flags)()

    def mem_sync_call(self, obj_addr: int, offset: int, size: int, flags: uapi.SyncFlag) -> Callable[[], Any]:
        """MEM_SYNC of one range as a callable with its argument packed once (replayed per submit)."""
        return self._prepared("MEM_SYNC", uapi.DRM_IOCTL_RKNPU_MEM_SYNC,
                              uapi.rknpu_mem_sync(flags=int(flags), obj_addr=obj_addr, offset=offset, size=size))

    def _prepared(self, name: str, request: int, struct: ctypes.Structure) -> drm.PreparedIoctl:
        return drm.PreparedIoctl(self.syscalls, self.fd, request, struct, f"RKNPU {name}", name, _HINTS)

    def mmap(self, offset: int, length: int) -> memoryview:
        return self.syscalls.mmap(self.fd, length, offset)

    def submit(self, **fields: int | tuple[tuple[int, int], ...]) -> SubmitResult:
        """One blocking SUBMIT; the arguments of ``submit_call``."""
        return self.submit_result(self.submit_call(**fields)())  # type: ignore[arg-type]

    def submit_result(self, arg: bytearray) -> SubmitResult:
        """What a SUBMIT's argument holds after the call (``submit_call``'s ioctl returns it)."""
        out = self.submit_struct.from_buffer(arg)
        return SubmitResult(task_counter=out.task_counter, hw_elapse_time=getattr(out, "hw_elapse_time", None))

    def submit_call(
        self,
        *,
        task_obj_addr: int,
        task_number: int,
        flags: int = uapi.JobFlag.PC,
        timeout_ms: int = 6000,
        task_start: int = 0,
        core_mask: int = 0,
        subcore_tasks: tuple[tuple[int, int], ...] = (),
        task_base_addr: int = 0,
        priority: int = 0,
        iommu_domain_id: int = 0,
    ) -> drm.PreparedIoctl:
        """One blocking SUBMIT with its argument packed once (a job planned once replays the
        same bytes every time); the call returns the argument as the kernel left it
        (``submit_result`` reads it). ``subcore_tasks`` fills ``subcore_task[0..]`` as (start, number)."""
        s = self.submit_struct(
            flags=int(flags), timeout=timeout_ms, task_start=task_start, task_number=task_number,
            priority=priority, task_obj_addr=task_obj_addr, task_base_addr=task_base_addr,
            core_mask=core_mask, fence_fd=-1,
        )
        if hasattr(s, "iommu_domain_id"):
            s.iommu_domain_id = iommu_domain_id
        elif iommu_domain_id:
            raise NpuError(f"driver {'.'.join(map(str, self.version))} has no iommu_domain_id in SUBMIT", errno.EINVAL)
        if len(subcore_tasks) > uapi.N_SUBCORE_TASKS:
            raise ValueError(f"at most {uapi.N_SUBCORE_TASKS} subcore_task entries")
        for i, (start, number) in enumerate(subcore_tasks):
            s.subcore_task[i].task_start, s.subcore_task[i].task_number = start, number
        return self._prepared("SUBMIT", uapi.DRM_IOCTL_RKNPU_SUBMIT, s)
