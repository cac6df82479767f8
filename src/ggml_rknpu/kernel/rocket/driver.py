"""``RocketDriver``: the mainline ``rocket`` accel driver as a ``NpuDriver`` [docs/npu-programming.md §5].

Submit: one ``drm_rocket_job`` per non-empty core, tasks ``{regcmd, body_words + 4}``
(rocket counts the tail); the inputs and regcmd buffers are the job's in-BOs, the outputs
its out-BOs; PREP_BO on each output waits for the job. Buffers are shmem (CPU-cached),
synced whole: FINI_BO on each input before the device reads, PREP_BO before the CPU does. No reset or
power ioctl: rocket resets a core after a job timeout and powers cores per job.
"""

from __future__ import annotations

import errno
import time
from dataclasses import dataclass

from ggml_rknpu.hw.alignment import align_up
from ggml_rknpu.hw.limits import ADDRESS_WINDOW_BYTES, PAGE_BYTES
from ggml_rknpu.hw.regcmd import TAIL_WORDS
from ggml_rknpu.kernel.buffer import Allocation, Buffer
from ggml_rknpu.kernel.driver import DriverFacts, Finished
from ggml_rknpu.kernel.errors import NpuError
from ggml_rknpu.kernel.job import BufferRange, Cores
from ggml_rknpu.kernel.rocket import uapi as ro
from ggml_rknpu.kernel.rocket.ioctls import RocketIoctls, RocketJobSpec, RocketSubmit
from ggml_rknpu.kernel.syscalls import Syscalls


@dataclass(frozen=True, eq=False)
class RocketSubmitTable:
    """A ``Job.cores`` as rocket's SUBMIT takes it."""

    regcmd_buffers: tuple[Buffer, ...]
    n_tasks: int
    jobs: tuple[tuple[tuple[int, int], ...], ...]  # per used core: (regcmd address, body + tail words)


@dataclass(frozen=True, eq=False)
class RocketJob:
    """A job as rocket replays it: its SUBMIT packed once (one ``drm_rocket_job`` per used
    core), the BOs to FINI before it (one per input range) and to PREP after it (one per
    output range)."""

    table: RocketSubmitTable
    submit: RocketSubmit
    cleans: tuple[int, ...]
    outputs: tuple[int, ...]


class RocketDriver:
    name = ro.DRIVER_NAME
    max_domains = 1

    def __init__(self, syscalls: Syscalls, fd: int) -> None:
        self.ioctls = RocketIoctls(syscalls, fd)
        self.drm, self.version = self.ioctls.drm, self.ioctls.version
        self._live: dict[int, int] = {}  # handle -> capacity

    # ------------------------------------------------------------------ memory
    def alloc(self, size: int, purpose: str, domain: int = 0) -> Allocation:
        if domain:
            raise NpuError(f"domain {domain}: one rocket file is one IOMMU domain", errno.EINVAL)
        if size >= ADDRESS_WINDOW_BYTES:
            raise NpuError(f"rocket buffers are limited to < 4 GiB (u32 size), got {size}", errno.EINVAL)
        bo = self.ioctls.create_bo(size)
        capacity = align_up(size, PAGE_BYTES)
        try:
            view = self.ioctls.mmap(bo.offset, capacity)
        except (NpuError, OSError):
            self.ioctls.gem_close(bo.handle)
            raise
        self._live[bo.handle] = capacity
        return Allocation(bo.handle, bo.dma_address, capacity, True, view)

    def free(self, allocation: Allocation) -> None:
        self._live.pop(allocation.handle, None)
        self.ioctls.syscalls.munmap(allocation.view)
        self.ioctls.gem_close(allocation.handle)

    def sync(self, allocation: Allocation, offset: int, size: int, *, to_device: bool) -> None:
        """FINI_BO (to the device) or PREP_BO (to the CPU) of the whole BO: rocket syncs whole BOs."""
        if to_device:
            self.ioctls.fini_bo(allocation.handle)
        else:
            self.ioctls.prep_bo(allocation.handle)

    def iova_budget(self, domain: int = 0) -> tuple[int, int]:
        """The 32-bit window (less page 0) minus our objects (rocket: one domain per open file)."""
        total = ADDRESS_WINDOW_BYTES - PAGE_BYTES
        return total - sum(self._live.values()), total

    # ------------------------------------------------------------------ submit
    def submit_table(self, cores: Cores, regcmd_buffers: tuple[Buffer, ...]) -> RocketSubmitTable:
        jobs = tuple(tuple((t.regcmd_addr, t.body_words + TAIL_WORDS) for t in tasks) for tasks in cores if tasks)
        return RocketSubmitTable(regcmd_buffers, sum(len(j) for j in jobs), jobs)

    def table_bytes(self, cores: Cores) -> int:
        """Nothing: a rocket table allocates no NPU memory."""
        return 0

    def release_table(self, table: RocketSubmitTable) -> None:
        """Nothing to free: a rocket table is plain data."""

    def prepare(self, table: RocketSubmitTable, inputs: tuple[BufferRange, ...],
                outputs: tuple[BufferRange, ...]) -> RocketJob:
        in_handles = tuple(b.handle for b in (*(r.buffer for r in inputs), *table.regcmd_buffers))
        out_handles = tuple(r.buffer.handle for r in outputs)
        jobs = [RocketJobSpec(tasks, in_handles, out_handles) for tasks in table.jobs]
        self.check_jobs(jobs)
        return RocketJob(table, self.ioctls.submit_call(jobs), tuple(r.buffer.handle for r in inputs), out_handles)

    def submit(self, job: RocketJob, timeout_ms: int) -> Finished:
        """``launch`` then ``wait``, the launch inline: the decode walk's frame count
        (docs/decode-walk.md) is measured at the SUBMIT ioctl."""
        for handle in job.cleans:
            self.ioctls.fini_bo(handle)
        job.submit.ioctl()
        return self.wait(job, time.monotonic_ns() + timeout_ms * 1_000_000)

    def launch(self, job: RocketJob) -> None:
        """FINI_BO each input, then SUBMIT: the job is queued on this file's entity and runs
        while the caller launches other files' jobs (``wait`` collects it)."""
        for handle in job.cleans:
            self.ioctls.fini_bo(handle)
        job.submit.ioctl()

    def wait(self, job: RocketJob, deadline_ns: int) -> Finished:
        """PREP_BO each output (it waits for the job writing it, up to the absolute
        ``deadline_ns`` on CLOCK_MONOTONIC)."""
        for handle in job.outputs:
            self.ioctls.prep_bo(handle, deadline_ns)
        return Finished(hw_elapsed_ns=None, task_counter=job.table.n_tasks)

    def check_jobs(self, jobs: list[RocketJobSpec]) -> None:
        """Everything rocket_ioctl_submit_job would refuse, refused here: mainline drops such a
        job and SUBMIT still returns 0 [docs/npu-programming.md §5], so nothing after the
        ioctl could tell. (A job that never completes leaves the outputs' canaries in place:
        the device reports it as stale output.)"""
        for i, job in enumerate(jobs):
            if not job.tasks:
                raise NpuError(f"rocket job {i} has no tasks (mainline would drop it silently)", errno.EINVAL)
            if any(count <= 0 or not 0 <= regcmd < ADDRESS_WINDOW_BYTES for regcmd, count in job.tasks):
                raise NpuError(f"rocket job {i} has a task with regcmd_count 0 or an address outside the "
                               "32-bit window (mainline would drop the job silently)", errno.EINVAL)
            unknown = [h for h in (*job.in_handles, *job.out_handles) if h not in self._live]
            if unknown:
                raise NpuError(f"rocket job {i} names BO handles {unknown} this driver does not hold "
                               "(mainline would drop the job silently)", errno.ENOENT)

    # ------------------------------------------------------------------ control
    def reset(self) -> None:
        raise NpuError("rocket has no reset ioctl; it resets a core itself after a job timeout", errno.EOPNOTSUPP)

    def power(self, on: bool) -> None:
        """Nothing to do: rocket powers cores per job through runtime PM."""

    def facts(self) -> DriverFacts:
        return DriverFacts()

    def close(self) -> None:
        """Rocket needs no objects of its own."""
