"""``RknpuDriver``: the vendor ``rknpu`` DRM driver as a ``NpuDriver`` [docs/npu-programming.md §3-§4].

Invariants: one SUBMIT per job (one per core where the cores make a mask the driver does not
commit, ``core_groups``); each submit table owns its task BO (KERNEL_MAPPING, one page,
up to 102 tasks), written and cleaned once when the table is built, so a replay costs the
SUBMIT alone; a buffer lives in the IOMMU domain it was created in, and a job's SUBMIT names
the domain of its buffers (``RknpuSubmitTable.domain``); buffers are CPU-cached (flags 0x403, as the RKNN runtime allocates them) and
MEM_SYNC cleans (TO_DEVICE) or invalidates (FROM_DEVICE) exactly the requested range; a
job's SUBMIT and the MEM_SYNCs around it are packed once (``drm.PreparedIoctl``) and replayed. The task
array, core_mask/subcore_task and flags, with sources: docs/decisions.md "kernel/rknpu/driver.py"."""

from __future__ import annotations

import ctypes
import errno
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ggml_rknpu.hw.alignment import align_up
from ggml_rknpu.hw.limits import ADDRESS_WINDOW_BYTES, INT_CLEAR_ALL, PAGE_BYTES
from ggml_rknpu.kernel.buffer import Allocation, Buffer
from ggml_rknpu.kernel.driver import DriverFacts, Finished
from ggml_rknpu.kernel.errors import NpuError
from ggml_rknpu.kernel.job import BufferRange, Cores
from ggml_rknpu.kernel.rknpu import uapi as rk
from ggml_rknpu.kernel.rknpu.ioctls import RknpuIoctls
from ggml_rknpu.kernel.syscalls import Syscalls


def _nothing() -> None:
    """No sync needed."""


MAX_PACKED_SYNCS = 4096   # packed MEM_SYNC arguments kept per object (a model's jobs name a few hundred ranges)
_FACTS = (("hw_version", rk.Action.GET_HW_VERSION), ("npu_freq_hz", rk.Action.GET_FREQ),
          ("npu_volt_uv", rk.Action.GET_VOLT), ("iommu_enabled", rk.Action.GET_IOMMU_EN),
          ("sram_total_bytes", rk.Action.GET_TOTAL_SRAM_SIZE), ("sram_free_bytes", rk.Action.GET_FREE_SRAM_SIZE))


def core_groups(cores: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The SUBMITs that run task lists on ``cores``: one for a mask rknpu_job_commit commits,
    otherwise one per core (cores 0+2 or 1+2, e.g. after core 0 failed: the driver would log
    "Unknown core mask" and run nothing) [docs/npu-programming.md §4]."""
    if sum(1 << c for c in cores) in rk.COMMITTED_CORE_MASKS:
        return (cores,)
    return tuple((c,) for c in cores)


@dataclass(frozen=True)
class CoreSubmit:
    """One SUBMIT of a table: its core mask and subcore_task[0..4]."""

    core_mask: int
    subcore: tuple[tuple[int, int], ...]
    n_tasks: int


@dataclass(frozen=True, eq=False)
class RknpuSubmitTable:
    """A ``Job.cores`` as the vendor SUBMIT takes it: one SUBMIT, or one per core (``core_groups``)."""

    regcmd_buffers: tuple[Buffer, ...]
    n_tasks: int
    task_array: bytes  # the rknpu_task array, core-major
    groups: tuple[CoreSubmit, ...]
    task_bo: Allocation   # this table's own task BO, holding task_array (cleaned once)
    domain: int           # the IOMMU domain of its regcmd buffers, its task BO and its SUBMITs
    submits: dict = field(default_factory=dict)   # timeout_ms -> the packed SUBMITs, in order


@dataclass(frozen=True, eq=False)
class RknpuJob:
    """A job as the vendor driver replays it: its table, the packed MEM_SYNCs that clean its
    inputs before the SUBMIT and invalidate its outputs after it."""

    table: RknpuSubmitTable
    cleans: tuple[Callable[[], Any], ...]
    invalidates: tuple[Callable[[], Any], ...]


class RknpuDriver:
    name = rk.DRIVER_NAME

    def __init__(self, syscalls: Syscalls, fd: int) -> None:
        self.ioctls = RknpuIoctls(syscalls, fd)
        self.drm, self.version = self.ioctls.drm, self.ioctls.version
        # 0.9.5 on name a domain in MEM_CREATE and SUBMIT; older ABIs have domain 0 only
        self.max_domains = rk.MAX_IOMMU_DOMAINS if self.version >= rk.ABI_DOMAINS_VERSION else 1
        self._live: dict[int, tuple[int, int]] = {}  # handle -> (capacity, domain) of every object we hold
        self._tables: set[RknpuSubmitTable] = set()   # live tables: each owns its task BO
        # obj_addr -> (offset, size, flag) -> the packed MEM_SYNC (a job's ranges are few and fixed);
        # an object's entries go with it (``free``): object addresses are never reused, so
        # entries kept for freed ones would pile up with every buffer a fault recovery rebuilds
        self._syncs: dict[int, dict[tuple[int, int, int], Callable[[], Any]]] = {}

    # ------------------------------------------------------------------ memory
    def alloc(self, size: int, purpose: str, domain: int = 0) -> Allocation:
        """A buffer of ``size`` bytes mapped in IOMMU domain ``domain`` (MEM_CREATE switches the
        device to it first, waiting for the live domain's jobs) [docs/npu-programming.md §4]."""
        if not 0 <= domain < self.max_domains:
            raise NpuError(f"IOMMU domain {domain}: driver {'.'.join(map(str, self.version))} offers domains "
                           f"0..{self.max_domains - 1}", errno.EINVAL)
        flags = rk.TASK_BO_FLAGS if purpose == "task" else rk.DATA_BO_FLAGS
        mem = self.ioctls.mem_create(size, flags, domain)
        try:
            view = self.ioctls.mmap(self.ioctls.mem_map(mem.handle), mem.size)
        except (NpuError, OSError):
            self.ioctls.mem_destroy(mem.handle, mem.obj_addr)
            raise
        self._live[mem.handle] = (mem.size, domain)
        return Allocation(mem.handle, mem.dma_addr, mem.size, bool(flags & rk.MemFlag.CACHEABLE), view, mem.obj_addr,
                          domain)

    def free(self, allocation: Allocation) -> None:
        self._live.pop(allocation.handle, None)
        self._syncs.pop(allocation.obj_addr, None)
        self.ioctls.syscalls.munmap(allocation.view)
        self.ioctls.mem_destroy(allocation.handle, allocation.obj_addr)

    def sync(self, allocation: Allocation, offset: int, size: int, *, to_device: bool) -> None:
        """MEM_SYNC of the range: TO_DEVICE cleans, FROM_DEVICE invalidates."""
        self._packed_sync(allocation, offset, size, to_device=to_device)()

    def _packed_sync(self, allocation: Allocation, offset: int, size: int, *, to_device: bool) -> Callable[[], Any]:
        """The MEM_SYNC of one range, packed once (an uncached buffer or an empty range needs none)."""
        if not (allocation.cached and size):
            return _nothing
        syncs = self._syncs.setdefault(allocation.obj_addr, {})
        key = (offset, size, 1 if to_device else 2)
        call = syncs.get(key)
        if call is None:
            if len(syncs) >= MAX_PACKED_SYNCS:
                syncs.clear()
            flag = rk.SyncFlag.TO_DEVICE if to_device else rk.SyncFlag.FROM_DEVICE
            call = syncs[key] = self.ioctls.mem_sync_call(allocation.obj_addr, offset, size, flag)
        return call

    def packed_syncs(self) -> int:
        """MEM_SYNC arguments kept packed, over every live object."""
        return sum(len(syncs) for syncs in self._syncs.values())

    def iova_budget(self, domain: int = 0) -> tuple[int, int]:
        """``domain``'s 32-bit window (less the never-mapped page 0) minus our own objects in it;
        other processes' objects share the domain but are not visible from here."""
        total = ADDRESS_WINDOW_BYTES - PAGE_BYTES
        return total - sum(size for size, d in self._live.values() if d == domain), total

    # ------------------------------------------------------------------ submit
    def submit_table(self, cores: Cores, regcmd_buffers: tuple[Buffer, ...]) -> RknpuSubmitTable:
        used = [(i, tasks) for i, tasks in enumerate(cores) if tasks]
        starts: dict[int, tuple[int, int]] = {}
        records: list[rk.rknpu_task] = []
        for core, tasks in used:
            starts[core] = (len(records), len(tasks))
            records.extend(rk.rknpu_task(
                flags=0, op_idx=1, enable_mask=t.enable_mask, int_mask=t.int_mask, int_clear=INT_CLEAR_ALL,
                int_status=0, regcfg_amount=t.body_words, regcfg_offset=0, regcmd_addr=t.regcmd_addr,
            ) for t in tasks)
        task_array = b"".join(bytes(r) for r in records)
        domain = regcmd_buffers[0].domain if regcmd_buffers else 0
        # whole pages; written and cleaned once: the kernel reads it at every submit of the table
        bo = self.alloc(align_up(len(task_array), PAGE_BYTES), "task", domain)
        try:
            np.frombuffer(bo.view, np.uint8)[: len(task_array)] = np.frombuffer(task_array, np.uint8)
            self.sync(bo, 0, len(task_array), to_device=True)
        except BaseException:
            self.free(bo)
            raise
        groups = []
        for group in core_groups(tuple(starts)):
            slot = 2 if len(group) == 3 else 0  # 3 cores: subcore_task[i+2]; 1-2 cores: subcore_task[i]
            subcore = [(0, 0)] * rk.N_SUBCORE_TASKS
            for core in group:
                subcore[core + slot] = starts[core]
            groups.append(CoreSubmit(sum(1 << c for c in group), tuple(subcore), sum(starts[c][1] for c in group)))
        table = RknpuSubmitTable(regcmd_buffers=regcmd_buffers, n_tasks=len(records), task_array=task_array,
                                 groups=tuple(groups), task_bo=bo, domain=domain)
        self._tables.add(table)
        return table

    def table_bytes(self, cores: Cores) -> int:
        """The task BO ``submit_table(cores)`` allocates: whole pages of rknpu_task records."""
        n = sum(len(tasks) for tasks in cores)
        return align_up(n * ctypes.sizeof(rk.rknpu_task), PAGE_BYTES)

    def release_table(self, table: RknpuSubmitTable) -> None:
        """The device no longer replays ``table``: free its task BO."""
        if table in self._tables:
            self._tables.discard(table)
            self.free(table.task_bo)

    def prepare(self, table: RknpuSubmitTable, inputs: tuple[BufferRange, ...],
                outputs: tuple[BufferRange, ...]) -> RknpuJob:
        """The job's MEM_SYNCs packed once: a clean per input range, an invalidate per output range."""
        return RknpuJob(table, tuple(self._packed_sync(r.buffer.allocation, r.offset, r.size, to_device=True)
                                     for r in inputs),
                        tuple(self._packed_sync(r.buffer.allocation, r.offset, r.size, to_device=False)
                              for r in outputs))

    def submit(self, job: RknpuJob, timeout_ms: int) -> Finished:
        table = job.table
        submits = table.submits.get(timeout_ms)
        if submits is None:
            submits = table.submits[timeout_ms] = [self.ioctls.submit_call(
                task_obj_addr=table.task_bo.obj_addr, task_number=g.n_tasks,
                flags=rk.JobFlag.PC | rk.JobFlag.PINGPONG, timeout_ms=timeout_ms, core_mask=g.core_mask,
                subcore_tasks=g.subcore, iommu_domain_id=table.domain) for g in table.groups]
        for clean in job.cleans:
            clean()
        results = []
        for submit in submits:   # a loop, not a comprehension: no extra frame on the way to the ioctl
            results.append(self.ioctls.submit_result(submit()))
        for invalidate in job.invalidates:
            invalidate()
        # hw_elapse_time [VEND rknpu_job_done: ktime_sub(now, hw_commit_time), ns]: absent on the
        # ABI before 0.9.5; 0 means no clock (no job completes in 0 ns), so it is not a measurement
        elapsed = [r.hw_elapse_time or 0 for r in results]
        return Finished(hw_elapsed_ns=sum(elapsed) if all(elapsed) else None,
                        task_counter=sum(r.task_counter for r in results))

    # ------------------------------------------------------------------ control
    def reset(self) -> None:
        self.ioctls.action(rk.Action.ACT_RESET)

    def power(self, on: bool) -> None:
        """The 0.9.x driver performs POWER_ON/OFF and then returns EINVAL anyway
        [capture pw_c256_h14: ret=-1 for both], so that EINVAL is not an error."""
        try:
            self.ioctls.action(rk.Action.POWER_ON if on else rk.Action.POWER_OFF)
        except NpuError as exc:
            if exc.errno != errno.EINVAL:
                raise

    def facts(self) -> DriverFacts:
        values: dict[str, int | None] = {}
        for key, action in _FACTS:
            try:
                values[key] = self.ioctls.action(action)
            except NpuError:
                values[key] = None  # not supported by this kernel build
        iommu = values.pop("iommu_enabled")
        return DriverFacts(iommu_enabled=None if iommu is None else bool(iommu), **values)

    def close(self) -> None:
        for table in list(self._tables):
            self.release_table(table)
