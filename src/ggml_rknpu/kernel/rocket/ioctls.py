"""``RocketIoctls``: the mainline rocket accel driver as typed callables, one per ioctl.

Identical on a board and in tests; user pointers inside SUBMIT (the job array, each job's
task array and BO handle arrays) point at ctypes arrays kept alive as long as the packed
call (``RocketSubmit``), exactly what the kernel's copy_from_user reads [ROCKET
rocket_job.c; docs/npu-programming.md §5].
"""

from __future__ import annotations

import ctypes
import errno
from dataclasses import dataclass

from ggml_rknpu.kernel import drm
from ggml_rknpu.kernel.drm import DrmVersion, gem_close, query_version
from ggml_rknpu.kernel.errors import NpuError
from ggml_rknpu.kernel.rocket import uapi
from ggml_rknpu.kernel.syscalls import Syscalls

INT64_MAX = (1 << 63) - 1

_HINTS: dict[tuple[str, int], str] = {
    ("PREP_BO", errno.ETIMEDOUT): "the job writing this BO did not finish; rocket completes only on a "
    "DPU interrupt (int_mask 0x300), check the regcmd tail and dmesg",
    ("CREATE_BO", errno.ENOMEM): "NPU memory or IOVA space is exhausted; free buffers first",
}


@dataclass(frozen=True)
class RocketBo:
    handle: int
    size: int
    dma_address: int
    offset: int  # fake mmap offset


@dataclass(frozen=True)
class RocketJobSpec:
    """One drm_rocket_job: tasks run in order on one core chosen by the scheduler."""

    tasks: tuple[tuple[int, int], ...]  # (regcmd DMA address, regcmd_count incl. the 4-word tail)
    in_handles: tuple[int, ...] = ()
    out_handles: tuple[int, ...] = ()


@dataclass(frozen=True, eq=False)
class RocketSubmit:
    """A SUBMIT packed once (``ioctl``) and the user arrays its pointers name, alive with it."""

    ioctl: drm.PreparedIoctl
    arrays: tuple[ctypes.Array, ...]


class RocketIoctls:
    def __init__(self, syscalls: Syscalls, fd: int) -> None:
        self.syscalls, self.fd = syscalls, fd
        self.drm: DrmVersion = query_version(syscalls, fd)
        if self.drm.name != uapi.DRIVER_NAME:
            raise NpuError(f"DRM driver is {self.drm.name!r}, not {uapi.DRIVER_NAME!r}; open /dev/accel/accel*")
        self.version = (self.drm.major, self.drm.minor, self.drm.patch)

    def _call(self, name: str, request: int, struct: ctypes.Structure) -> ctypes.Structure:
        return drm.call(self.syscalls, self.fd, request, struct, f"ROCKET {name}", name, _HINTS)

    def create_bo(self, size: int) -> RocketBo:
        out = self._call("CREATE_BO", uapi.DRM_IOCTL_ROCKET_CREATE_BO, uapi.drm_rocket_create_bo(size=size))
        return RocketBo(out.handle, size, out.dma_address, out.offset)

    def submit(self, jobs: list[RocketJobSpec]) -> None:
        packed = self.submit_call(jobs)   # named: its arrays must outlive the call
        packed.ioctl()

    def submit_call(self, jobs: list[RocketJobSpec]) -> RocketSubmit:
        """SUBMIT of ``jobs`` packed once: replayed by ``ioctl()`` as often as the job runs."""
        keep: list[ctypes.Array] = []  # user memory the kernel reads during every call

        def u32_array(values: tuple[int, ...]) -> int:
            if not values:
                return 0
            arr = (ctypes.c_uint32 * len(values))(*values)
            keep.append(arr)
            return ctypes.addressof(arr)

        job_array = (uapi.drm_rocket_job * len(jobs))()
        for job, spec in zip(job_array, jobs):
            tasks = (uapi.drm_rocket_task * len(spec.tasks))(*(uapi.drm_rocket_task(a, n) for a, n in spec.tasks))
            keep.append(tasks)
            job.tasks = ctypes.addressof(tasks) if spec.tasks else 0
            job.task_count = len(spec.tasks)
            job.task_struct_size = ctypes.sizeof(uapi.drm_rocket_task)
            job.in_bo_handles, job.in_bo_handle_count = u32_array(spec.in_handles), len(spec.in_handles)
            job.out_bo_handles, job.out_bo_handle_count = u32_array(spec.out_handles), len(spec.out_handles)
        keep.append(job_array)
        req = uapi.drm_rocket_submit(
            jobs=ctypes.addressof(job_array), job_count=len(jobs), job_struct_size=ctypes.sizeof(uapi.drm_rocket_job)
        )
        return RocketSubmit(drm.PreparedIoctl(self.syscalls, self.fd, uapi.DRM_IOCTL_ROCKET_SUBMIT, req,
                                              "ROCKET SUBMIT", "SUBMIT", _HINTS), tuple(keep))

    def prep_bo(self, handle: int, timeout_ns: int = INT64_MAX) -> None:
        """Wait for the BO's write fences, then make it coherent for the CPU."""
        self._call("PREP_BO", uapi.DRM_IOCTL_ROCKET_PREP_BO, uapi.drm_rocket_prep_bo(handle=handle, timeout_ns=timeout_ns))

    def fini_bo(self, handle: int) -> None:
        """CPU access done: make the BO coherent for the device."""
        self._call("FINI_BO", uapi.DRM_IOCTL_ROCKET_FINI_BO, uapi.drm_rocket_fini_bo(handle=handle))

    def gem_close(self, handle: int) -> None:
        try:
            gem_close(self.syscalls, self.fd, handle)
        except OSError as exc:
            raise NpuError.from_oserror("DRM GEM_CLOSE", exc) from exc

    def mmap(self, offset: int, length: int) -> memoryview:
        return self.syscalls.mmap(self.fd, length, offset)
