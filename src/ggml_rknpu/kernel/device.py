"""``NpuDevice``: the NPU as buffers and jobs over exactly one ``NpuDriver``.

The device knows nothing of boards or simulators: it is handed a ``Syscalls`` object and an
open fd, asks the node's DRM name and drives it with that driver's class from ``DRIVERS``;
choosing and opening a device by name is ``ggml_rknpu.devices``. Invariants: buffers are
CPU-cached; the driver makes a job's input ranges visible to the NPU before it runs and its
output ranges visible to the CPU after; a job's submit table and the driver's plan of it are
built once and replayed, and its regcmd is cleaned when the table is built, so a regcmd (or
weight) the CPU rewrites later needs ``Buffer.sync_to_device()`` [docs/npu-programming.md
§4-§5]. A buffer is in one IOMMU domain (NPU address space, ``alloc(domain=)``); a job's
buffers are all in its ``Job.domain``. One device per thread."""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ggml_rknpu.hw.limits import N_CORES
from ggml_rknpu.kernel.buffer import Buffer
from ggml_rknpu.kernel.driver import NpuDriver, SubmitTable
from ggml_rknpu.kernel.drm import query_version
from ggml_rknpu.kernel.errors import NpuError
from ggml_rknpu.kernel.job import BufferRange, Completion, HwTask, Job, check_cores
from ggml_rknpu.kernel.rknpu import uapi as rk
from ggml_rknpu.kernel.rknpu.driver import RknpuDriver
from ggml_rknpu.kernel.rocket import uapi as ro
from ggml_rknpu.kernel.rocket.driver import RocketDriver
from ggml_rknpu.kernel.syscalls import Syscalls

__all__ = ["DRIVERS", "Buffer", "BufferRange", "Completion", "DeviceInfo", "HwTask", "Job", "Launched", "NpuDevice",
           "discover", "open_node"]

DRIVERS: dict[str, Callable[[Syscalls, int], NpuDriver[Any, Any]]] = {rk.DRIVER_NAME: RknpuDriver, ro.DRIVER_NAME: RocketDriver}
NODE_PATTERNS = (("/dev/dri", "renderD", rk.DRIVER_NAME), ("/dev/accel", "accel", ro.DRIVER_NAME))
PURPOSES = ("data", "regcmd", "task")
# distinct Job.cores kept as submit tables. A table also goes when its regcmd buffer is freed
# (the engine's programs hold theirs), so this only bounds callers that never free them; it
# must stay above a model's live programs (a table rebuilt per submit would allocate a task BO)
MAX_CACHED_TABLES = 4096


@dataclass(frozen=True)
class DeviceInfo:
    kind: str
    simulated: bool
    path: str
    driver_name: str
    driver_version: str
    driver_date: str
    driver_desc: str
    n_cores: int
    hw_version: int | None
    npu_freq_hz: int | None
    npu_volt_uv: int | None
    iommu_enabled: bool | None
    sram_total_bytes: int | None
    sram_free_bytes: int | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def discover(syscalls: Syscalls, unopenable: list[str] | None = None) -> list[tuple[str, str]]:
    """(kind, path) of every NPU node: vendor render nodes first, then rocket accel nodes.
    Nodes that could not be opened are appended to ``unopenable`` (as "path: reason")."""
    found: list[tuple[str, str]] = []
    for directory, prefix, name in NODE_PATTERNS:
        for entry in syscalls.listdir(directory):
            if not entry.startswith(prefix):
                continue
            path = f"{directory}/{entry}"
            try:
                fd = syscalls.open(path)
            except OSError as exc:  # no permission or gone: not usable, keep looking
                if unopenable is not None:
                    unopenable.append(f"{path}: {exc.strerror}")
                continue
            try:
                if query_version(syscalls, fd).name == name:
                    found.append((name, path))
            except OSError:
                pass
            finally:
                syscalls.close(fd)
    return found


def open_node(syscalls: Syscalls, path: str, *, simulated: bool = False) -> NpuDevice:
    """Open the NPU node ``path`` through ``syscalls`` (``simulated`` only labels results)."""
    try:
        fd = syscalls.open(path)
    except OSError as exc:
        raise NpuError(f"cannot open {path}: {exc.strerror}; check it exists and that you may open it "
                       "(render/video group)", exc.errno) from exc
    try:
        return NpuDevice(syscalls, fd, path, simulated=simulated)
    except BaseException:
        syscalls.close(fd)
        raise


@dataclass(frozen=True, eq=False)
class _Replay:
    """A Job as its submits replay it: the ABI's table, the driver's plan of the job (what it
    submits, how it makes the ranges visible), every buffer it names (checked open per submit)."""

    job: Job
    table: SubmitTable
    planned: Any
    buffers: tuple[Buffer, ...]


@dataclass(frozen=True, eq=False)
class Launched:
    """A job its device launched and has not yet waited for."""

    device: NpuDevice
    planned: Any


class NpuDevice:
    def __init__(self, syscalls: Syscalls, fd: int, path: str, *, simulated: bool = False) -> None:
        name = self._driver_name(syscalls, fd, path)
        abi = DRIVERS.get(name)
        if abi is None:
            raise NpuError(f"{path} is driven by {name!r}, not {' or '.join(DRIVERS)}", errno.ENODEV)
        self.syscalls, self.fd, self.path, self.simulated = syscalls, fd, path, simulated
        self.driver: NpuDriver[Any, Any] = abi(syscalls, fd)
        self.kind = self.driver.name
        self.n_cores = N_CORES
        self._buffers: dict[int, Buffer] = {}
        # by (domain, cores): the same IOVAs name different buffers in different domains
        self._tables: dict[tuple[int, tuple[tuple[HwTask, ...], ...]], SubmitTable] = {}
        # Jobs replayed as the same object (the engine's): found without hashing their tasks
        self._replays: dict[int, _Replay] = {}
        self._live_tables: set[SubmitTable] = set()   # the tables in _tables (eq=False: by identity)
        self._closed = False

    @staticmethod
    def _driver_name(syscalls: Syscalls, fd: int, path: str) -> str:
        try:
            return query_version(syscalls, fd).name
        except OSError as exc:
            raise NpuError(f"{path} is not a DRM device ({exc.strerror})", exc.errno) from exc

    # ------------------------------------------------------------------ facts
    def info(self) -> DeviceInfo:
        d, facts = self.driver, self.driver.facts()
        return DeviceInfo(
            kind=self.kind, simulated=self.simulated, path=self.path, driver_name=d.drm.name,
            driver_version=".".join(map(str, d.version)), driver_date=d.drm.date, driver_desc=d.drm.desc,
            n_cores=self.n_cores, **asdict(facts),
        )

    def iova_budget(self, domain: int = 0) -> tuple[int, int]:
        """(free, total) bytes of ``domain``'s NPU address space, as the driver ABI can tell."""
        return self.driver.iova_budget(domain)

    @property
    def max_domains(self) -> int:
        """IOMMU domains this device's buffers may be placed in (ids 0..max_domains-1)."""
        return self.driver.max_domains

    # ------------------------------------------------------------------ buffers
    def alloc(self, size: int, *, purpose: str = "data", domain: int = 0) -> Buffer:
        if purpose not in PURPOSES:
            raise NpuError(f"purpose must be one of {PURPOSES}, not {purpose!r}", errno.EINVAL)
        if size <= 0:
            raise NpuError(f"buffer size must be > 0 (got {size})", errno.EINVAL)
        self._check_open()
        buf = Buffer(self, size, self.driver.alloc(size, purpose, domain), purpose)
        self._buffers[buf.handle] = buf
        return buf

    def sync_buffer(self, buf: Buffer, offset: int, size: int, *, to_device: bool) -> None:
        """The driver makes ``[offset, offset + size)`` of ``buf`` visible to the NPU or to the CPU."""
        if buf.closed:
            raise NpuError("buffer is closed", errno.EBADF)
        self.driver.sync(buf.allocation, offset, size, to_device=to_device)

    def free_buffer(self, buf: Buffer) -> None:
        """``buf`` was closed: the tables running it (a regcmd buffer) go, then its GEM object."""
        self._buffers.pop(buf.handle, None)
        if buf.purpose == "regcmd":   # the tables running it go with it (their task BOs too)
            for key in [k for k, t in self._tables.items() if any(b is buf for b in t.regcmd_buffers)]:
                self._drop_table(key)
            self._replays = {k: v for k, v in self._replays.items() if v.table in self._live_tables}
        self.driver.free(buf.allocation)

    def _buffer_at(self, dma_addr: int, domain: int) -> Buffer | None:
        for b in self._buffers.values():
            if b.domain == domain and b.dma_addr <= dma_addr < b.dma_addr + b.capacity:
                return b
        return None

    # ------------------------------------------------------------------ jobs
    def _submit_table(self, job: Job) -> SubmitTable:
        """The ABI's submit table for ``job.cores``: built and validated once (its regcmd
        buffers cleaned then), replayed after."""
        key = (job.domain, job.cores)
        table = self._tables.get(key)
        if table is None or any(b.closed for b in table.regcmd_buffers):
            if table is not None:
                self._drop_table(key)
            regcmd = check_cores(job.cores, self.n_cores, lambda addr: self._buffer_at(addr, job.domain))
            for b in regcmd:
                b.sync_to_device()
            table = self.driver.submit_table(job.cores, regcmd)
            if len(self._tables) >= MAX_CACHED_TABLES:
                self._drop_table(next(iter(self._tables)))
            self._tables[key] = table
            self._live_tables.add(table)
        return table

    def _drop_table(self, key: tuple[int, tuple[tuple[HwTask, ...], ...]]) -> None:
        table = self._tables.pop(key)
        self._live_tables.discard(table)
        self.driver.release_table(table)

    def _replay(self, job: Job) -> _Replay:
        """``job`` planned for replay: found by identity (no hashing of its tasks), else its
        table, its ranges checked and the driver's plan of it made once."""
        replay = self._replays.get(id(job))
        if replay is not None and replay.job is job and replay.table in self._live_tables:
            return replay
        table = self._submit_table(job)
        for r in (*job.inputs, *job.outputs):
            if r.buffer.closed or r.buffer.device is not self:
                raise NpuError(f"{r.buffer!r} is closed or belongs to another device", errno.EBADF)
            if r.buffer.domain != job.domain:
                raise NpuError(f"{r.buffer!r} is in IOMMU domain {r.buffer.domain}, the job in {job.domain}: "
                               "every buffer of a job must be in its domain", errno.EINVAL)
            r.buffer.check_range(r.offset, r.size)
        replay = _Replay(job, table, self.driver.prepare(table, job.inputs, job.outputs),
                         tuple(r.buffer for r in (*job.inputs, *job.outputs)))
        if len(self._replays) >= MAX_CACHED_TABLES:
            self._replays.pop(next(iter(self._replays)))
        self._replays[id(job)] = replay
        return replay

    def table_bytes(self, job: Job) -> int:
        """NPU bytes ``prepare(job)`` (or its first submit) would allocate for its submit table."""
        table = self._tables.get((job.domain, job.cores))
        if table is not None and not any(b.closed for b in table.regcmd_buffers):
            return 0
        return self.driver.table_bytes(job.cores)

    def prepare(self, job: Job) -> None:
        """Plan ``job`` for replay now (its table and whatever the ABI allocates for it), so
        that a caller bounding its NPU memory sees the allocation where it can account for it."""
        self._check_open()
        self._replay(job)

    def submit(self, job: Job, timeout_ms: int = 6000) -> Completion:
        """Run ``job`` and wait for it. Raises NpuTimeout (hang), NpuFault, NpuError."""
        self._check_open()
        replay = self._replay(job)
        for b in replay.buffers:
            if b.closed:
                raise NpuError(f"{b!r} is closed", errno.EBADF)
        done = self.driver.submit(replay.planned, timeout_ms)
        return Completion(hw_elapsed_ns=done.hw_elapsed_ns, task_counter=done.task_counter, simulated=self.simulated)

    def launch(self, job: Job) -> Launched:
        """Start ``job`` without waiting (rocket only: its SUBMIT queues the job on this open
        file's scheduler entity); ``wait`` collects it. Jobs of several devices (files) launched
        before any is waited for run side by side [docs/npu-programming.md "What the drivers
        really do"]."""
        self._check_open()
        if not isinstance(self.driver, RocketDriver):
            raise NpuError(f"{self.kind}'s SUBMIT waits for its job; only rocket launches without waiting",
                           errno.EOPNOTSUPP)
        replay = self._replay(job)
        self.driver.launch(replay.planned)
        return Launched(self, replay.planned)

    def wait(self, launched: Launched, timeout_ms: int = 6000) -> Completion:
        """Wait for a launched job and make its outputs visible to the CPU."""
        if launched.device is not self or not isinstance(self.driver, RocketDriver):
            raise NpuError("the job was launched on another device", errno.EINVAL)
        done = self.driver.wait(launched.planned, time.monotonic_ns() + timeout_ms * 1_000_000)
        return Completion(hw_elapsed_ns=done.hw_elapsed_ns, task_counter=done.task_counter, simulated=self.simulated)

    # ------------------------------------------------------------------ power and reset
    def reset(self) -> None:
        self.driver.reset()

    def power_on(self) -> None:
        self.driver.power(True)

    def power_off(self) -> None:
        self.driver.power(False)

    # ------------------------------------------------------------------ lifetime
    def _check_open(self) -> None:
        if self._closed:
            raise NpuError("device is closed", errno.EBADF)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True      # first: an exception landing mid-close must not close the fd twice
        self.driver.close()
        for buf in list(self._buffers.values()):
            buf.close()
        self.syscalls.close(self.fd)

    def __enter__(self) -> NpuDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NpuDevice({self.kind}{' simulated' if self.simulated else ''}, {self.path})"
