"""``RknpuAbi``: the vendor ``rknpu`` DRM driver as a ``DriverAbi`` [docs/npu-programming.md §3-§4].

Submit: one SUBMIT per job. The task BO (KERNEL_MAPPING, owned here, reused while the tasks
fit its pages) holds the ``rknpu_task`` array core-major; ``core_mask`` has a bit per used
core; core i's range goes in ``subcore_task[i]`` when 1-2 cores are used and
``subcore_task[i+2]`` when 3 are [VEND rknpu_job_commit_pc]. Flags are PC|PINGPONG like
the RKNN runtime's (0x5) [capture pw_c256_h14]. Later tasks of a core are reached through
the regcmd tails, so only the first task's regcmd and amount and the int_mask of the first
and last matter to the kernel. Buffers are CPU-cached (flags 0x403, as the RKNN runtime
allocates them) and synced with MEM_SYNC.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

import numpy as np

from ggml_rknpu.hw.limits import ADDRESS_WINDOW_BYTES, INT_CLEAR_ALL, PAGE_BYTES
from ggml_rknpu.kernel import rknpu_abi as rk
from ggml_rknpu.kernel.abi import DriverFacts, Finished
from ggml_rknpu.kernel.buffer import Allocation, Buffer
from ggml_rknpu.kernel.errors import NpuError
from ggml_rknpu.kernel.job import BufferRange, Cores
from ggml_rknpu.kernel.rknpu_driver import RknpuDriver
from ggml_rknpu.kernel.syscalls import Syscalls
_FACTS = (("hw_version", rk.Action.GET_HW_VERSION), ("npu_freq_hz", rk.Action.GET_FREQ),
          ("npu_volt_uv", rk.Action.GET_VOLT), ("iommu_enabled", rk.Action.GET_IOMMU_EN),
          ("sram_total_bytes", rk.Action.GET_TOTAL_SRAM_SIZE), ("sram_free_bytes", rk.Action.GET_FREE_SRAM_SIZE))


@dataclass(frozen=True, eq=False)
class RknpuSubmitTable:
    """A ``Job.cores`` as the vendor SUBMIT takes it."""

    regcmd_buffers: tuple[Buffer, ...]
    n_tasks: int
    task_array: bytes  # the rknpu_task array, core-major
    core_mask: int
    subcore: tuple[tuple[int, int], ...]  # subcore_task[0..4]


class RknpuAbi:
    name = rk.DRIVER_NAME

    def __init__(self, syscalls: Syscalls, fd: int) -> None:
        self.driver = RknpuDriver(syscalls, fd)
        self.drm, self.version = self.driver.drm, self.driver.version
        self._live: dict[int, int] = {}  # handle -> capacity of every object we hold
        self.task_bo: Allocation | None = None
        self._task_bo_table: RknpuSubmitTable | None = None  # whose task array the task BO holds

    # ------------------------------------------------------------------ memory
    def alloc(self, size: int, purpose: str) -> Allocation:
        flags = rk.TASK_BO_FLAGS if purpose == "task" else rk.DATA_BO_FLAGS
        mem = self.driver.mem_create(size, flags)
        try:
            view = self.driver.mmap(self.driver.mem_map(mem.handle), mem.size)
        except (NpuError, OSError):
            self.driver.mem_destroy(mem.handle, mem.obj_addr)
            raise
        self._live[mem.handle] = mem.size
        return Allocation(mem.handle, mem.dma_addr, mem.size, bool(flags & rk.MemFlag.CACHEABLE), view, mem.obj_addr)

    def free(self, allocation: Allocation) -> None:
        self._live.pop(allocation.handle, None)
        self.driver.syscalls.munmap(allocation.view)
        self.driver.mem_destroy(allocation.handle, allocation.obj_addr)

    def sync(self, allocation: Allocation, offset: int, size: int, *, to_device: bool) -> None:
        if allocation.cached and size:
            flag = rk.SyncFlag.TO_DEVICE if to_device else rk.SyncFlag.FROM_DEVICE
            self.driver.mem_sync(allocation.obj_addr, offset, size, flag)

    def iova_budget(self) -> tuple[int, int]:
        """The 32-bit window (less the never-mapped page 0) minus our own objects; other
        processes' objects share the domain but are not visible from here."""
        total = ADDRESS_WINDOW_BYTES - PAGE_BYTES
        return total - sum(self._live.values()), total

    # ------------------------------------------------------------------ submit
    def submit_table(self, cores: Cores, regcmd_buffers: tuple[Buffer, ...]) -> RknpuSubmitTable:
        used = [(i, tasks) for i, tasks in enumerate(cores) if tasks]
        slot = 2 if len(used) == 3 else 0  # 3 cores: subcore_task[i+2]; 1-2 cores: subcore_task[i]
        subcore = [(0, 0)] * rk.N_SUBCORE_TASKS
        records: list[rk.rknpu_task] = []
        for core, tasks in used:
            subcore[core + slot] = (len(records), len(tasks))
            records.extend(rk.rknpu_task(
                flags=0, op_idx=1, enable_mask=t.enable_mask, int_mask=t.int_mask, int_clear=INT_CLEAR_ALL,
                int_status=0, regcfg_amount=t.body_words, regcfg_offset=0, regcmd_addr=t.regcmd_addr,
            ) for t in tasks)
        return RknpuSubmitTable(regcmd_buffers=regcmd_buffers, n_tasks=len(records),
                                task_array=b"".join(bytes(r) for r in records),
                                core_mask=sum(1 << core for core, _ in used), subcore=tuple(subcore))

    def _load_task_array(self, table: RknpuSubmitTable) -> Allocation:
        """The task BO holding ``table``'s task array (a replayed table finds it in place)."""
        task_bytes = len(table.task_array)
        bo = self.task_bo
        if bo is None or bo.capacity < task_bytes:
            if bo is not None:
                self.free(bo)
            # whole pages, so the BO is reused until a submit needs more than fits in them
            bo = self.task_bo = self.alloc(-(-task_bytes // PAGE_BYTES) * PAGE_BYTES, "task")
            self._task_bo_table = None
        if self._task_bo_table is not table:
            np.frombuffer(bo.view, np.uint8)[:task_bytes] = np.frombuffer(table.task_array, np.uint8)
            self.sync(bo, 0, task_bytes, to_device=True)
            self._task_bo_table = table
        return bo

    def submit(self, table: RknpuSubmitTable, inputs: tuple[BufferRange, ...], outputs: tuple[BufferRange, ...],
               timeout_ms: int) -> Finished:
        bo = self._load_task_array(table)
        result = self.driver.submit(
            task_obj_addr=bo.obj_addr, task_number=table.n_tasks, flags=rk.JobFlag.PC | rk.JobFlag.PINGPONG,
            timeout_ms=timeout_ms, core_mask=table.core_mask, subcore_tasks=table.subcore,
        )
        for r in outputs:
            r.buffer.sync_from_device(r.offset, r.size)
        # hw_elapse_time [VEND rknpu_job_done: ktime_sub(now, hw_commit_time), ns]: absent on the
        # 0.9.6 ABI; 0 means no clock (no job completes in 0 ns), so it is not a measurement
        return Finished(hw_elapsed_ns=result.hw_elapse_time or None, task_counter=result.task_counter)

    # ------------------------------------------------------------------ control
    def reset(self) -> None:
        self.driver.action(rk.Action.ACT_RESET)

    def power(self, on: bool) -> None:
        """The 0.9.x driver performs POWER_ON/OFF and then returns EINVAL anyway
        [capture pw_c256_h14: ret=-1 for both], so that EINVAL is not an error."""
        try:
            self.driver.action(rk.Action.POWER_ON if on else rk.Action.POWER_OFF)
        except NpuError as exc:
            if exc.errno != errno.EINVAL:
                raise

    def facts(self) -> DriverFacts:
        values: dict[str, int | None] = {}
        for key, action in _FACTS:
            try:
                values[key] = self.driver.action(action)
            except NpuError:
                values[key] = None  # not supported by this kernel build
        iommu = values.pop("iommu_enabled")
        return DriverFacts(iommu_enabled=None if iommu is None else bool(iommu), **values)

    def close(self) -> None:
        if self.task_bo is not None:
            self.free(self.task_bo)
            self.task_bo = None
