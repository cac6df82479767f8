"""What the real kernels answer to edge inputs, as a table: ``(ioctl, input, expected result,
upstream source)``, run against a live driver fd. The tests run every row against both
simulated kernels; ``rknpu selftest`` runs the harmless rows on a board and reports each row
where the real kernel disagrees (so a driver build that differs from the one read shows up).

A probe makes its own objects and frees them; an expected result is an errno (0: success) or
a string the driver reports. Sources: docs/npu-programming.md "What the drivers really do"."""

from __future__ import annotations

import ctypes
import errno
from collections.abc import Callable
from dataclasses import dataclass

from ggml_rknpu.kernel import drm
from ggml_rknpu.kernel.rknpu import uapi as rk
from ggml_rknpu.kernel.rocket import uapi as ro
from ggml_rknpu.kernel.syscalls import Syscalls

NO_SUCH_HANDLE = 0xFFFF   # a GEM handle no test process reaches (idr hands out the lowest free)
Result = int | str


@dataclass(frozen=True)
class Row:
    abi: str
    ioctl: str
    given: str            # the input, in words
    expect: Result        # errno (0: returns 0), or the string reported
    source: str           # upstream file and function
    harmless: bool        # safe on a board: no job hangs, no device state changes
    probe: Callable[[Syscalls, int], Result]
    version: tuple[int, int, int] | None = None   # the rknpu version the row holds for (None: all)


@dataclass(frozen=True)
class Disagreement:
    row: Row
    got: Result

    def describe(self) -> str:
        r = self.row
        return f"{r.abi} {r.ioctl} ({r.given}): expected {r.expect!r}, the kernel gave {self.got!r} [{r.source}]"


def _errno(syscalls: Syscalls, fd: int, request: int, struct: ctypes.Structure) -> int:
    try:
        syscalls.ioctl(fd, request, bytearray(bytes(struct)))
    except OSError as exc:
        return exc.errno or -1
    return 0


def _action(flags: int, value: int = 0) -> Callable[[Syscalls, int], Result]:
    return lambda s, fd: _errno(s, fd, rk.DRM_IOCTL_RKNPU_ACTION, rk.rknpu_action(flags=flags, value=value))


def _set_to_current(get: int, set_: int) -> Callable[[Syscalls, int], Result]:
    """SET_x with the value GET_x reports: no change whether the driver honours it or not."""
    def probe(s: Syscalls, fd: int) -> Result:
        arg = bytearray(bytes(rk.rknpu_action(flags=get)))
        s.ioctl(fd, rk.DRM_IOCTL_RKNPU_ACTION, arg)
        return _errno(s, fd, rk.DRM_IOCTL_RKNPU_ACTION, rk.rknpu_action(flags=set_,
                                                                       value=rk.rknpu_action.from_buffer(arg).value))
    return probe


def _with_rknpu_bo(use: Callable[[Syscalls, int, rk.rknpu_mem_create_v48], Result], destroy: bool = True,
                   flags: int = rk.DATA_BO_FLAGS) -> Callable[[Syscalls, int], Result]:
    """``use`` on a fresh one-page cacheable BO (48-byte MEM_CREATE: 0.9.8), destroyed after."""
    def probe(s: Syscalls, fd: int) -> Result:
        arg = bytearray(bytes(rk.rknpu_mem_create_v48(size=4096, flags=flags)))
        s.ioctl(fd, rk.DRM_IOCTL_RKNPU_MEM_CREATE_48, arg)
        bo = rk.rknpu_mem_create_v48.from_buffer_copy(arg)
        try:
            return use(s, fd, bo)
        finally:
            if destroy:
                drm.gem_close(s, fd, bo.handle)
    return probe


def _version_date(s: Syscalls, fd: int) -> Result:
    return drm.query_version(s, fd).date


def _rocket_submit(**fields: int) -> Callable[[Syscalls, int], Result]:
    """A SUBMIT of one all-zero job, ``fields`` overriding the drm_rocket_submit's."""
    def probe(s: Syscalls, fd: int) -> Result:
        job = (ro.drm_rocket_job * 1)()      # alive for the call: the kernel copies it from user memory
        base = {"jobs": ctypes.addressof(job), "job_count": 1, "job_struct_size": ctypes.sizeof(ro.drm_rocket_job)}
        return _errno(s, fd, ro.DRM_IOCTL_ROCKET_SUBMIT, ro.drm_rocket_submit(**{**base, **fields}))
    return probe


def _rocket_bo(use: Callable[[Syscalls, int, int], Result]) -> Callable[[Syscalls, int], Result]:
    def probe(s: Syscalls, fd: int) -> Result:
        arg = bytearray(bytes(ro.drm_rocket_create_bo(size=4096)))
        s.ioctl(fd, ro.DRM_IOCTL_ROCKET_CREATE_BO, arg)
        handle = ro.drm_rocket_create_bo.from_buffer_copy(arg).handle
        try:
            return use(s, fd, handle)
        finally:
            drm.gem_close(s, fd, handle)
    return probe


_DRV, _JOB, _GEM = "rknpu 0.9.8 rknpu_drv.c", "rknpu 0.9.8 rknpu_job.c", "rknpu 0.9.8 rknpu_gem.c"
_RJOB, _RGEM = "Linux 6.18 drivers/accel/rocket/rocket_job.c", "Linux 6.18 drivers/accel/rocket/rocket_gem.c"
A = rk.Action

TABLE: tuple[Row, ...] = (
    Row("rknpu", "DRM_IOCTL_VERSION", "date", "20240828", "rknpu 0.9.8 rknpu_drv.h DRIVER_DATE", True,
        _version_date, version=(0, 9, 8)),
    Row("rknpu", "ACTION", "POWER_ON", errno.EINVAL, f"{_DRV} rknpu_action: no case", True, _action(A.POWER_ON)),
    Row("rknpu", "ACTION", "POWER_OFF", errno.EINVAL, f"{_DRV} rknpu_action: no case", False, _action(A.POWER_OFF)),
    Row("rknpu", "ACTION", "SET_FREQ to the current clock", errno.EINVAL, f"{_DRV} rknpu_action: break, ret -EINVAL",
        True, _set_to_current(A.GET_FREQ, A.SET_FREQ)),
    Row("rknpu", "ACTION", "SET_VOLT to the current voltage", errno.EINVAL,
        f"{_DRV} rknpu_action: break, ret -EINVAL", True, _set_to_current(A.GET_VOLT, A.SET_VOLT)),
    Row("rknpu", "ACTION", "GET_BW_PRIORITY", errno.EINVAL, f"{_JOB} rknpu_get_bw_priority: no block on RK3588",
        True, _action(A.GET_BW_PRIORITY)),
    Row("rknpu", "ACTION", "SET_BW_TW 0", errno.EINVAL, f"{_JOB} rknpu_set_bw_priority: no block on RK3588",
        True, _action(A.SET_BW_TW)),
    Row("rknpu", "MEM_MAP", "a handle never created", errno.ENOENT, "drm_gem.c drm_gem_dumb_map_offset", True,
        lambda s, fd: _errno(s, fd, rk.DRM_IOCTL_RKNPU_MEM_MAP, rk.rknpu_mem_map(handle=NO_SUCH_HANDLE))),
    Row("rknpu", "MEM_DESTROY", "the right handle, a wrong obj_addr", 0, f"{_GEM} rknpu_gem_destroy_ioctl", True,
        _with_rknpu_bo(lambda s, fd, bo: _errno(s, fd, rk.DRM_IOCTL_RKNPU_MEM_DESTROY,
                                                rk.rknpu_mem_destroy(handle=bo.handle, obj_addr=1)), destroy=False)),
    Row("rknpu", "MEM_SYNC", "obj_addr 0", errno.EINVAL, f"{_GEM} rknpu_gem_sync_ioctl", True,
        lambda s, fd: _errno(s, fd, rk.DRM_IOCTL_RKNPU_MEM_SYNC, rk.rknpu_mem_sync(flags=1, obj_addr=0, size=64))),
    Row("rknpu", "MEM_SYNC", "flags TO_DEVICE | 0x4", 0, f"{_GEM} rknpu_gem_sync_ioctl: other bits ignored", True,
        _with_rknpu_bo(lambda s, fd, bo: _errno(s, fd, rk.DRM_IOCTL_RKNPU_MEM_SYNC, rk.rknpu_mem_sync(
            flags=rk.SyncFlag.TO_DEVICE | 0x4, obj_addr=bo.obj_addr, size=4096)))),
    Row("rknpu", "SUBMIT", "task_number 0", errno.EINVAL, f"{_JOB} rknpu_submit", True,
        lambda s, fd: _errno(s, fd, rk.DRM_IOCTL_RKNPU_SUBMIT, rk.rknpu_submit_v095(flags=rk.JobFlag.PC))),
    Row("rknpu", "SUBMIT", "core_mask 0b101", errno.EINVAL, f"{_JOB} rknpu_job_commit: Unknown core mask", False,
        _with_rknpu_bo(lambda s, fd, bo: _errno(s, fd, rk.DRM_IOCTL_RKNPU_SUBMIT, rk.rknpu_submit_v095(
            flags=rk.JobFlag.PC, timeout=100, task_number=2, task_obj_addr=bo.obj_addr, core_mask=0b101)),
                       flags=rk.TASK_BO_FLAGS)),
    Row("rknpu", "GEM_CLOSE", "a handle never created", errno.EINVAL, "drm_gem.c drm_gem_close_ioctl", True,
        lambda s, fd: _errno(s, fd, drm.DRM_IOCTL_GEM_CLOSE, drm.drm_gem_close(handle=NO_SUCH_HANDLE))),
    Row("rocket", "SUBMIT", "job_count 0", 0, f"{_RJOB} rocket_ioctl_submit", True, _rocket_submit(job_count=0)),
    Row("rocket", "SUBMIT", "job_struct_size 8", errno.EINVAL, f"{_RJOB} rocket_ioctl_submit", True,
        _rocket_submit(job_struct_size=8)),
    Row("rocket", "SUBMIT", "reserved 1", errno.EINVAL, f"{_RJOB} rocket_ioctl_submit", True,
        _rocket_submit(reserved=1)),
    Row("rocket", "PREP_BO", "a handle never created", errno.ENOENT, f"{_RGEM} rocket_ioctl_prep_bo", True,
        lambda s, fd: _errno(s, fd, ro.DRM_IOCTL_ROCKET_PREP_BO, ro.drm_rocket_prep_bo(handle=NO_SUCH_HANDLE))),
    Row("rocket", "PREP_BO", "reserved 1", errno.EINVAL, f"{_RGEM} rocket_ioctl_prep_bo", True,
        _rocket_bo(lambda s, fd, h: _errno(s, fd, ro.DRM_IOCTL_ROCKET_PREP_BO,
                                           ro.drm_rocket_prep_bo(handle=h, reserved=1)))),
    Row("rocket", "PREP_BO", "an idle BO, deadline already passed", 0, f"{_RGEM} rocket_ioctl_prep_bo", True,
        _rocket_bo(lambda s, fd, h: _errno(s, fd, ro.DRM_IOCTL_ROCKET_PREP_BO,
                                           ro.drm_rocket_prep_bo(handle=h, timeout_ns=0)))),
    Row("rocket", "FINI_BO", "a handle never created", errno.ENOENT, f"{_RGEM} rocket_ioctl_fini_bo", True,
        lambda s, fd: _errno(s, fd, ro.DRM_IOCTL_ROCKET_FINI_BO, ro.drm_rocket_fini_bo(handle=NO_SUCH_HANDLE))),
)


def run_table(syscalls: Syscalls, fd: int, abi: str, version: tuple[int, int, int], *,
              harmless_only: bool) -> tuple[int, list[Disagreement]]:
    """Run the rows for ``abi`` (and ``version``) on the open driver ``fd``: (rows run, every
    row where the kernel's answer differs from the table's)."""
    rows = [r for r in TABLE if r.abi == abi and (r.version in (None, version)) and (r.harmless or not harmless_only)]
    disagreements = []
    for row in rows:
        got = row.probe(syscalls, fd)
        if got != row.expect:
            disagreements.append(Disagreement(row, got))
    return len(rows), disagreements
