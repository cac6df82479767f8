"""``NpuDriver``: what ``NpuDevice`` needs from a kernel driver, one class per ABI.

``rknpu.driver.RknpuDriver`` (vendor DRM driver) and ``rocket.driver.RocketDriver`` (mainline accel
driver) implement it over a ``Syscalls`` object; a board and the simulator differ only in
that object. A third ABI is a third class plus one entry in ``device.DRIVERS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

from ggml_rknpu.kernel.buffer import Allocation, Buffer
from ggml_rknpu.kernel.drm import DrmVersion
from ggml_rknpu.kernel.job import BufferRange, Cores


@dataclass(frozen=True)
class DriverFacts:
    """What the driver reports about itself (None: not reported by this ABI or kernel build)."""

    hw_version: int | None = None
    npu_freq_hz: int | None = None
    npu_volt_uv: int | None = None
    iommu_enabled: bool | None = None
    sram_total_bytes: int | None = None
    sram_free_bytes: int | None = None


@dataclass(frozen=True)
class Finished:
    """A submit that completed: the driver's commit-to-IRQ time (None: not reported) and
    how many tasks it counted."""

    hw_elapsed_ns: int | None
    task_counter: int


class SubmitTable(Protocol):
    """A ``Job.cores`` in one ABI's submit form, built once per distinct ``cores``."""

    regcmd_buffers: tuple[Buffer, ...]
    n_tasks: int


TableT = TypeVar("TableT", bound=SubmitTable)
JobT = TypeVar("JobT")


class NpuDriver(Protocol[TableT, JobT]):
    """One kernel driver ABI; ``TableT`` is its submit table type, ``JobT`` its form of a job
    planned for replay (the table and how its ranges are made visible, ``prepare``).

    Cache maintenance is the driver's: ``sync`` makes one range visible to the NPU (after
    the CPU wrote it) or to the CPU (after the NPU did), and ``submit`` does both around a
    job, each ABI its own way (vendor: packed MEM_SYNCs; rocket: FINI_BO/PREP_BO)."""

    name: str  # the DRM driver name: "rknpu" | "rocket"
    drm: DrmVersion
    version: tuple[int, int, int]
    max_domains: int  # IOMMU domains one open file may allocate in and submit to (ids 0..max_domains-1)

    def alloc(self, size: int, purpose: str, domain: int = 0) -> Allocation: ...

    def free(self, allocation: Allocation) -> None: ...

    def sync(self, allocation: Allocation, offset: int, size: int, *, to_device: bool) -> None:
        """Make the range visible to the NPU (``to_device``: the CPU wrote it) or to the CPU."""
        ...

    def iova_budget(self, domain: int = 0) -> tuple[int, int]:
        """(free, total) bytes of ``domain``'s NPU address space as far as this process can tell."""
        ...

    def submit_table(self, cores: Cores, regcmd_buffers: tuple[Buffer, ...]) -> TableT: ...

    def table_bytes(self, cores: Cores) -> int:
        """NPU bytes ``submit_table(cores)`` allocates (the vendor task BO; 0 for rocket)."""
        ...

    def release_table(self, table: TableT) -> None:
        """The device dropped ``table`` (evicted, or rebuilt after a regcmd buffer closed)."""
        ...

    def prepare(self, table: TableT, inputs: tuple[BufferRange, ...], outputs: tuple[BufferRange, ...]) -> JobT:
        """``table`` with the ranges it reads and writes, planned once for ``submit`` (ranges
        checked open and inside their buffers by the device)."""
        ...

    def submit(self, job: JobT, timeout_ms: int) -> Finished:
        """Make the job's inputs visible to the NPU, run it, wait, make its outputs visible to the CPU."""
        ...

    def reset(self) -> None: ...

    def power(self, on: bool) -> None: ...

    def facts(self) -> DriverFacts: ...

    def close(self) -> None:
        """Free what the ABI allocated for itself (the vendor task BO)."""
        ...
