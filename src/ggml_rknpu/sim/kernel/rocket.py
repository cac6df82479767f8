"""Mainline ``rocket`` (Linux accel driver) in software: CREATE_BO, PREP_BO / FINI_BO and SUBMIT,
answering as ``rocket_gem.c``, ``rocket_job.c`` and ``rocket_drv.c`` do [docs/npu-programming.md
§5]; an IOMMU domain and a drm_mm address space per open file. ``rocket_errors="mainline"``
(the default) keeps mainline's silent job failures; ``"loud"`` reports them at PREP_BO.
Sources: docs/decisions.md "sim/kernel", docs/envelope.md."""

from __future__ import annotations

import ctypes
import errno
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ggml_rknpu.hw.alignment import align_up, ceil_div
from ggml_rknpu.hw.envelope import ROCKET_BOOT_MHZ, ROCKET_JOB_TIMEOUT_MS, decode_task
from ggml_rknpu.hw.limits import INT_CLEAR_ALL
from ggml_rknpu.kernel.rocket import uapi as ro
from ggml_rknpu.sim.kernel.common import (
    CNA_S_POINTER,
    CORE_S_POINTER,
    PC_BASE_ADDRESS,
    PC_INTERRUPT_CLEAR,
    PC_INTERRUPT_MASK,
    PC_INTERRUPT_RAW_STATUS,
    PC_OPERATION_ENABLE,
    PC_REGISTER_AMOUNTS,
    PC_TASK_CON,
    PC_TASK_DMA_BASE_ADDR,
    RW,
    S_POINTER_CORE_BIT,
    S_POINTER_PP,
    DrmFile,
    Ioctl,
    IoctlTable,
    NpuModel,
    SimKernel,
    W,
    fail,
)
from ggml_rknpu.sim.memory import IOVA_END, PAGE, DmaFault, GemObject, IommuDomain, RangeAllocator

CACHE_LINE = 64  # arm64 Cortex-A76/A55 data cache line
ROCKET_ERRORS = ("mainline", "loud")
ROCKET_NODES = {"/dev/accel": ["accel0"]}  # [docs/npu-programming.md §5] char major 261
INT_DMA_READ_ERROR, INT_DMA_WRITE_ERROR = 1 << 12, 1 << 13
TASK_CON_RESERVED_14, TASK_CON_COUNT_CLEAR, TASK_CON_PP_EN = 1 << 14, 1 << 13, 1 << 12


@dataclass(frozen=True)
class RocketJobRun:
    """One job as the simulated scheduler ran it: the submitting file's entity (open files
    numbered from 0 in the order they were opened), the core, and its start and end on the
    modeled timeline (seconds)."""

    entity: int
    core: int
    start: float
    end: float


class _BestFit(RangeAllocator):
    """drm_mm DRM_MM_INSERT_BEST: the smallest free hole that fits, the node at its first
    page-aligned address, of exactly the length asked for (rocket_gem.c rocket_ioctl_create_bo:
    ``drm_mm_insert_node_generic(mm, node, size, PAGE_SIZE, 0, 0)`` with the unaligned size)."""

    def alloc(self, length: int) -> int | None:
        if length <= 0:
            raise ValueError("allocation length must be positive")
        g = self.granule
        fitting = [i for i, (s, e) in enumerate(self._free) if align_up(s, g) + length <= e]
        if not fitting:
            return None
        i = min(fitting, key=lambda j: (self._free[j][1] - self._free[j][0], self._free[j][0]))
        s, e = self._free[i]
        start = align_up(s, g)
        self._free[i:i + 1] = [r for r in ([s, start], [start + length, e]) if r[1] > r[0]]
        self._used[start] = length
        return start


class _FileDomain(IommuDomain):
    """A rocket file's address space: its drm_mm over the IOMMU aperture (module doc);
    ``before_write`` sees each object the NPU is about to write."""

    def __init__(self, base: int, end: int, before_write: Callable[[GemObject], None]) -> None:
        super().__init__(max(base, PAGE), end)   # (the base is replaced just below)
        self.iova = _BestFit(base, end, PAGE)
        self.before_write = before_write

    def device_write_view(self, iova: int, nbytes: int) -> np.ndarray:
        obj = self.lookup(iova)
        if obj is not None:
            self.before_write(obj)
        return super().device_write_view(iova, nbytes)


class SimRocketKernel(SimKernel):
    """Mainline rocket: shmem BOs (always CPU-cached), a domain per open file."""

    abi = "rocket"
    nodes = ROCKET_NODES
    default_version = (0, 0, 0)  # [§5: "Initialized rocket 0.0.0 for rknn"]
    default_iova_window = (0, IOVA_END)  # the whole IOMMU aperture from 0
    shared_domain = False
    page_aligned_nodes = False  # drm_mm nodes of the size asked for (rocket_ioctl_create_bo)

    def __init__(self, abi: str = "rocket", *args: Any, rocket_mhz: float = ROCKET_BOOT_MHZ,
                 rocket_errors: str = "mainline", **options: Any) -> None:
        if rocket_errors not in ROCKET_ERRORS:
            raise ValueError(f"rocket_errors must be one of {ROCKET_ERRORS}, not {rocket_errors!r}")
        super().__init__(abi, *args, **options)
        self.rocket_mhz, self.rocket_errors = rocket_mhz, rocket_errors
        # CPU bytes as of each object's last sync: a copy, or (an int) DRAM's bytes at that
        # generation, copied only before the NPU writes the object (a weight is never copied)
        self._cpu_synced: dict[int, np.ndarray | int] = {}
        # The modeled timeline (seconds at rocket_mhz): where the CPU is (a PREP_BO waits for the
        # BO's writer), when each core's queued jobs end, when each BO's last writer ends.
        self.modeled_now = 0.0
        self._core_ends: list[list[float]] = [[] for _ in range(self.n_cores)]
        self._bo_done: dict[int, float] = {}
        self.job_runs: list[RocketJobRun] = []   # every job run, in submit order
        self._entities: dict[int, int] = {}      # id(open file) -> its entity's number
        self._opened = 0                         # files opened so far

    @property
    def modeled_npu_mhz(self) -> float:
        """The clock this kernel's timeline runs at."""
        return self.rocket_mhz

    def driver_ioctls(self) -> IoctlTable:
        return {
            ro.Nr.CREATE_BO: Ioctl(self._ro_create_bo, ro.drm_rocket_create_bo, RW),
            ro.Nr.SUBMIT: Ioctl(self._ro_submit, ro.drm_rocket_submit, W),
            ro.Nr.PREP_BO: Ioctl(self._ro_prep_bo, ro.drm_rocket_prep_bo, W),
            ro.Nr.FINI_BO: Ioctl(self._ro_fini_bo, ro.drm_rocket_fini_bo, W),
        }

    def version_strings(self) -> tuple[str, str, str]:
        return "rocket", "unknown", "rocket DRM"  # [ROCKET rocket_drv.c]

    def _new_file(self, path: str) -> DrmFile:
        f = DrmFile(path, domain=_FileDomain(*self.iova_window, self._keep_synced_bytes))
        self._entities[id(f)], self._opened = self._opened, self._opened + 1   # (an id is reused once freed)
        return f

    def _maybe_free(self, obj: GemObject) -> None:
        super()._maybe_free(obj)
        if obj.obj_addr not in self._objects:
            self._cpu_synced.pop(obj.obj_addr, None)

    def _ro_create_bo(self, f: DrmFile, c: ro.drm_rocket_create_bo) -> None:
        handle, obj = self._new_object(f, c.size, 0, cached=True)  # shmem: always CPU-cached
        c.handle, c.dma_address, c.offset = handle, obj.dma_addr, self._mmap_offset(obj)

    def _ro_fini_bo(self, f: DrmFile, c: ro.drm_rocket_fini_bo) -> None:
        if c.reserved:
            raise fail(errno.EINVAL, "FINI_BO: reserved must be 0")
        obj = self._lookup_handle(f, c.handle, errno.ENOENT, "FINI_BO")
        self._write_back_dirty_lines(obj)  # dma_sync_sgtable_for_device: clean

    def _ro_prep_bo(self, f: DrmFile, c: ro.drm_rocket_prep_bo) -> None:
        if c.reserved:
            raise fail(errno.EINVAL, "PREP_BO: reserved must be 0")
        obj = self._lookup_handle(f, c.handle, errno.ENOENT, "PREP_BO")
        self.modeled_now = max(self.modeled_now, self._bo_done.pop(obj.obj_addr, 0.0))   # waits for the writer
        failed, obj.failed_job = obj.failed_job, None
        self._write_back_dirty_lines(obj)  # dma_sync_sgtable_for_cpu: dirty lines survive,
        obj.sync_for_cpu(0, obj.size)      # then the CPU sees what DRAM holds
        if obj.cached:
            self._cpu_synced[obj.obj_addr] = obj.generation
        if failed and self.rocket_errors == "loud":
            # the failed job's fence as still pending: dma_resv_wait_timeout gives 0, and
            # rocket_ioctl_prep_bo answers EBUSY for a deadline already passed (a zero timeout),
            # ETIMEDOUT for one that ran out waiting [ROCKET rocket_gem.c]
            code = errno.ETIMEDOUT if c.timeout_ns > time.monotonic_ns() else errno.EBUSY
            raise fail(code, f"PREP_BO: the job writing this BO failed: {failed}")

    def _write_back_dirty_lines(self, obj: GemObject) -> None:
        """Copy to DRAM the 64-byte lines the CPU changed since the object's last sync."""
        if not obj.cached:
            return
        synced = self._cpu_synced.get(obj.obj_addr)
        if synced is None:           # never synced: every line may be dirty
            obj.sync_for_device(0, obj.size)
        else:
            changed = (obj.cpu != self._synced_bytes(obj, synced)).reshape(-1, CACHE_LINE).any(axis=1)
            obj.write_back(np.repeat(changed, CACHE_LINE))
        # Every clean line equal to DRAM before (the last sync left DRAM equal to the CPU's
        # bytes and the NPU wrote nothing since) makes them all equal now: no copy needed.
        in_step = synced is None or isinstance(synced, int)
        self._cpu_synced[obj.obj_addr] = obj.generation if in_step else obj.cpu.copy()

    @staticmethod
    def _synced_bytes(obj: GemObject, synced: np.ndarray | int) -> np.ndarray:
        """The CPU's bytes as of ``obj``'s last sync (``_cpu_synced``)."""
        if isinstance(synced, int):
            if synced != obj.generation:
                raise AssertionError(f"BO {obj.obj_addr:#x}: DRAM changed after its last sync without an NPU write")
            return obj.dram
        return synced

    def _keep_synced_bytes(self, obj: GemObject) -> None:
        """The NPU is about to write ``obj``: DRAM's bytes stand for its last sync no longer, so
        they are copied now (once per job output between syncs)."""
        synced = self._cpu_synced.get(obj.obj_addr)
        if isinstance(synced, int):
            self._cpu_synced[obj.obj_addr] = self._synced_bytes(obj, synced).copy()

    def modeled_task_seconds(self, regcmd: int, count: int) -> float:
        """Modeled seconds of one task at ``rocket_mhz``, read from its words (0 if they do
        not describe a matmul/conv the cost model prices)."""
        from ggml_rknpu.cost.model import MACS_PER_CYCLE_PER_CORE, TaskWork, task_seconds

        try:
            t = decode_task(np.frombuffer(self.mmu.view(regcmd, count * 8).tobytes(), dtype=np.uint64))
        except DmaFault:
            return 0.0
        if t.dtype not in MACS_PER_CYCLE_PER_CORE or not (t.rows and t.chunk_k and t.kernels):
            return 0.0
        return task_seconds(TaskWork(0, t.rows * max(t.width, 1), t.chunk_k, t.kernels, t.dtype, 4),
                            npu_mhz=self.rocket_mhz)

    @staticmethod
    def _copy_from_user(address: int, nbytes: int, what: str) -> bytes:
        if nbytes == 0:
            return b""
        if address < PAGE:  # NULL (or near-NULL): the kernel's copy_from_user faults
            raise fail(errno.EFAULT, f"{what}: bad user pointer {address:#x}")
        return ctypes.string_at(address, nbytes)

    def _ro_submit(self, f: DrmFile, s: ro.drm_rocket_submit) -> None:
        if s.job_count == 0:
            return
        if s.job_struct_size < ctypes.sizeof(ro.drm_rocket_job):
            raise fail(errno.EINVAL, f"SUBMIT: job_struct_size {s.job_struct_size} is smaller than "
                                      f"sizeof(drm_rocket_job) = {ctypes.sizeof(ro.drm_rocket_job)}")
        if s.reserved:
            raise fail(errno.EINVAL, "SUBMIT: the reserved field of drm_rocket_submit must be 0")
        jobs = [ro.drm_rocket_job.from_buffer_copy(self._copy_from_user(
            s.jobs + i * s.job_struct_size, ctypes.sizeof(ro.drm_rocket_job), "SUBMIT jobs")) for i in range(s.job_count)]
        parsed = []
        for i, job in enumerate(jobs):
            try:
                parsed.append(self._ro_parse_job(f, i, job))
            except OSError as exc:
                # rocket_ioctl_submit drops rocket_ioctl_submit_job's return value: the job is
                # never queued and SUBMIT still returns 0 [ROCKET rocket_job.c]
                if self.rocket_errors == "loud":
                    raise
                self._misuse("SUBMIT", f"job {i} dropped: {exc.strerror}",
                             "the job never runs and SUBMIT returns 0; its outputs keep their old bytes")
        npu = self._npu_model()
        self.mmu.attach(self._domain(f))  # rocket_job_run: attach the file's domain to the core
        inject, self.inject = self.inject, None
        core = self._place(f)
        for tasks, outs in parsed:
            start = max([self.modeled_now, *self._core_ends[core]])
            end = start + self._ro_run_job(npu, core, tasks, outs, inject)
            inject = None
            self.job_runs.append(RocketJobRun(self._entities[id(f)], core, start, end))
            self._core_ends[core].append(end)
            f.entity_done_at = end
            for obj in outs:
                self._bo_done[obj.obj_addr] = end

    def _place(self, f: DrmFile) -> int:
        """The core a file's next jobs run on. Its one drm_sched_entity stays on its scheduler
        while it has queued or unfinished jobs (one core, one job after another); an idle one
        moves to the least loaded scheduler, the first on a tie [ROCKET rocket_job_open;
        drm_sched_entity_select_rq, drm_sched_pick_best]. Loads are the jobs not yet ended at
        ``modeled_now``; the jobs themselves run when submitted (the model is synchronous)."""
        now = self.modeled_now
        self._core_ends = [[end for end in ends if end > now] for ends in self._core_ends]
        if f.entity_done_at <= now:
            loads = [len(ends) for ends in self._core_ends]
            f.entity_core = loads.index(min(loads))
        return f.entity_core

    def _ro_parse_job(self, f: DrmFile, index: int, job: ro.drm_rocket_job) -> tuple[list[tuple[int, int]], list[GemObject]]:
        if job.task_count == 0:
            raise fail(errno.EINVAL, f"SUBMIT job {index}: task_count is 0")
        if job.task_struct_size < ctypes.sizeof(ro.drm_rocket_task):
            raise fail(errno.EINVAL, f"SUBMIT job {index}: task_struct_size {job.task_struct_size} < 8")
        tasks = []
        for t in range(job.task_count):
            task = ro.drm_rocket_task.from_buffer_copy(self._copy_from_user(
                job.tasks + t * job.task_struct_size, ctypes.sizeof(ro.drm_rocket_task), f"SUBMIT job {index} tasks"))
            if task.regcmd_count == 0:
                raise fail(errno.EINVAL, f"SUBMIT job {index} task {t}: regcmd_count must be > 0 (it counts the "
                                          "body plus the 4-word tail)")
            tasks.append((task.regcmd, task.regcmd_count))

        def handles(address: int, count: int, what: str) -> list[GemObject]:
            raw = self._copy_from_user(address, 4 * count, f"SUBMIT job {index} {what}")
            ids: ctypes.Array[ctypes.c_uint32] | list[int] = \
                (ctypes.c_uint32 * count).from_buffer_copy(raw) if count else []
            return [self._lookup_handle(f, h, errno.ENOENT, f"SUBMIT job {index} {what}") for h in ids]

        handles(job.in_bo_handles, job.in_bo_handle_count, "in_bo_handles")
        outs = handles(job.out_bo_handles, job.out_bo_handle_count, "out_bo_handles")
        return tasks, outs

    def _ro_run_job(self, npu: NpuModel, core: int, tasks: list[tuple[int, int]], outs: list[GemObject],
                    inject: str | None = None) -> float:
        """Run one job on ``core``; its modeled seconds (up to the job timeout)."""
        pointer = S_POINTER_PP + S_POINTER_CORE_BIT * core
        elapsed_s, timeout_s = 0.0, ROCKET_JOB_TIMEOUT_MS / 1e3
        if inject == "stale":
            tasks = tasks[:-1]       # the job's last task silently dropped (fault hook)
        for i, (regcmd, count) in enumerate(tasks):  # rocket_job_hw_submit, one task per hardware run
            hung = inject == "timeout" and i == len(tasks) - 1      # the job's last task hangs (fault hook)
            elapsed_s = timeout_s if hung else elapsed_s + self.modeled_task_seconds(regcmd, count)
            if hung or elapsed_s > timeout_s:  # rocket_job_timedout: the task in flight never finishes
                why = "hung (injected)" if hung else (f"{elapsed_s * 1e3:.0f} ms modeled at {self.rocket_mhz:g} MHz "
                                                      f"> JOB_TIMEOUT_MS {ROCKET_JOB_TIMEOUT_MS}")
                self._log(f"core {core}: NPU job timed out (task {i} of {len(tasks)}, {why}); core reset")
                npu.soft_reset(core)
                for obj in outs:
                    obj.failed_job = f"job timed out after task {i - 1} ({elapsed_s * 1e3:.0f} ms modeled)"
                return timeout_s
            fault = self._run(npu, core, [
                (PC_BASE_ADDRESS, 1),
                (CNA_S_POINTER, pointer),
                (CORE_S_POINTER, pointer),
                (PC_BASE_ADDRESS, regcmd),
                (PC_REGISTER_AMOUNTS, ceil_div(count, 2) - 1),
                (PC_INTERRUPT_MASK, ro.INT_MASK_DPU),
                (PC_INTERRUPT_CLEAR, ro.INT_MASK_DPU),
                (PC_TASK_CON, TASK_CON_RESERVED_14 | TASK_CON_COUNT_CLEAR | TASK_CON_PP_EN | 1),
                (PC_TASK_DMA_BASE_ADDR, 0),
                (PC_OPERATION_ENABLE, 1),
            ])
            raw = 0 if fault else npu.mmio_read(core, PC_INTERRUPT_RAW_STATUS)
            if raw & (INT_DMA_READ_ERROR | INT_DMA_WRITE_ERROR):
                self._log(f"WARNING: core {core}: DMA {'read' if raw & INT_DMA_READ_ERROR else 'write'} error, "
                          f"raw status {raw:#x}")
            if fault or not raw & ro.INT_MASK_DPU:
                why = fault or ("no interrupt at all: the task did not finish" if raw == 0 else
                                f"no DPU interrupt (raw status {raw:#x}); rocket completes a task only on "
                                "DPU_0/DPU_1, so the last block of every task must be the DPU")
                details = [f"core {core} task {i}: {why}"] + [f"core {core}: {d}" for d in self._diagnostics(npu, core)]
                for line in details:
                    self._log(line)
                npu.soft_reset(core)
                self._log(f"core {core}: job timeout ({ro.JOB_TIMEOUT_MS} ms, simulated), core reset")
                message = "; ".join(details)
                for obj in outs:
                    obj.failed_job = message
                return timeout_s   # no completion: the job ends at drm_sched's timeout
            npu.mmio_write(core, PC_OPERATION_ENABLE, 0)  # the IRQ thread
            npu.mmio_write(core, PC_INTERRUPT_CLEAR, INT_CLEAR_ALL)
        return elapsed_s
