"""``NpuDevice``: the NPU as buffers and jobs, over whichever kernel interface is present.

Discovery (``NpuDevice.open(None)``, or ``RKNPU_DEVICE`` when set): every
``/dev/dri/renderD*`` whose DRM_IOCTL_VERSION name is ``rknpu`` (vendor driver), then every
``/dev/accel/accel*`` named ``rocket`` (mainline), else the simulator (``sim-rknpu``).
Explicit choices: ``rknpu``, ``rocket``, ``sim-rknpu``, ``sim-rocket`` or a device path.
``RKNPU_TRACE=1`` prints every syscall, decoded (``kernel/trace.py``).

Submitting a ``Job`` [CONTRACT A; npu-programming.md §3-§5]:

- vendor: one SUBMIT. The task BO (KERNEL_MAPPING) holds the ``rknpu_task`` array core-major;
  ``core_mask`` has a bit per used core; core i's range goes in ``subcore_task[i]`` when 1-2
  cores are used and ``subcore_task[i+2]`` when 3 are [VEND rknpu_job_commit_pc]. Flags are
  PC|PINGPONG like the RKNN runtime's (0x5) [capture pw_c256_h14]. Later tasks of a core
  are reached through the regcmd tails, so only the first task's regcmd and amount and
  the int_mask of the first and last matter to the kernel.
- rocket: one ``drm_rocket_job`` per non-empty core, tasks ``{regcmd, body_words + 4}``
  (rocket counts the tail), FINI_BO on the inputs before, PREP_BO on the outputs to wait.

CPU caches: buffers are CPU-cached (as the RKNN runtime allocates them: flags 0x403). The
device cleans every input and every buffer holding a task's regcmd before a submit and
invalidates the outputs after it; anything else written by the CPU needs
``Buffer.sync_to_device()`` (weights: once, after writing them).

Not thread-safe: use one device per thread (or serialise calls); the vendor task BO is
shared by all submits of a device.
"""

from __future__ import annotations

import errno
import os
import time
import warnings
from dataclasses import asdict, dataclass

import numpy as np

from ggml_rknpu.kernel import rknpu_abi as rk
from ggml_rknpu.kernel import rocket_abi as ro
from ggml_rknpu.kernel.drm import query_version
from ggml_rknpu.kernel.errors import NpuError
from ggml_rknpu.kernel.rknpu_driver import RknpuDriver
from ggml_rknpu.kernel.rocket_driver import RocketDriver, RocketJobSpec
from ggml_rknpu.kernel.syscalls import HostSyscalls, Syscalls
from ggml_rknpu.kernel.trace import from_environment

N_CORES_RK3588 = 3  # [npu-programming.md §1]
IOVA_WINDOW_BYTES = 1 << 32  # all NPU addresses are 32-bit [§4]
PAGE = 4096
RKNN_TASK_INT_CLEAR = 0x1FFFF  # what the RKNN runtime writes into rknpu_task.int_clear [capture h14 task BO]
DEVICE_CHOICES = ("rknpu", "rocket", "sim-rknpu", "sim-rocket")
PURPOSES = ("data", "regcmd", "task")
MAX_CACHED_PLANS = 256  # distinct Job.cores kept planned (a model has a few per layer shape)


@dataclass(frozen=True)
class HwTask:
    regcmd_addr: int  # DMA address of the task's first regcmd word (16-byte aligned)
    body_words: int  # regcmd words EXCLUDING the 4-word tail (vendor regcfg_amount)
    int_mask: int = 0x300  # DPU group0|group1 [npu-programming.md §3]
    enable_mask: int = 0x0D  # CNA|CORE|DPU


@dataclass(frozen=True)
class Job:
    cores: tuple[tuple[HwTask, ...], ...]  # cores[i]: tasks for core i in order; () = unused
    inputs: tuple["Buffer", ...] = ()
    outputs: tuple["Buffer", ...] = ()


@dataclass(frozen=True)
class Completion:
    hw_elapsed_ns: int | None  # vendor 0.9.8 hw_elapse_time on a board; None where unknown
    task_counter: int
    simulated: bool


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

    def as_dict(self) -> dict:
        return asdict(self)


def discover(sys: Syscalls, unopenable: list[str] | None = None) -> list[tuple[str, str]]:
    """(kind, path) of every NPU node: vendor render nodes first, then rocket accel nodes.
    Nodes that could not be opened are appended to ``unopenable`` (as "path: reason")."""
    found: list[tuple[str, str]] = []
    for directory, prefix, name in (("/dev/dri", "renderD", rk.DRIVER_NAME), ("/dev/accel", "accel", ro.DRIVER_NAME)):
        for entry in sys.listdir(directory):
            if not entry.startswith(prefix):
                continue
            path = f"{directory}/{entry}"
            try:
                fd = sys.open(path)
            except OSError as exc:  # no permission or gone: not usable, keep looking
                if unopenable is not None:
                    unopenable.append(f"{path}: {exc.strerror}")
                continue
            try:
                if query_version(sys, fd).name == name:
                    found.append((name, path))
            except OSError:
                pass
            finally:
                sys.close(fd)
    return found


@dataclass(frozen=True, eq=False)
class _SubmitPlan:
    """What a ``Job.cores`` turns into for either ABI, validated once [module doc]."""

    regcmd_buffers: tuple["Buffer", ...]
    n_tasks: int
    task_array: bytes  # vendor: the rknpu_task array, core-major
    core_mask: int
    subcore: tuple[tuple[int, int], ...]  # vendor subcore_task[0..4]
    rocket_jobs: tuple[tuple[tuple[int, int], ...], ...]  # rocket: per used core, (regcmd, body + 4 tail)

    @classmethod
    def build(cls, cores: tuple[tuple[HwTask, ...], ...], n_cores: int, buffer_at) -> "_SubmitPlan":
        if len(cores) > n_cores:
            raise NpuError(f"job has task lists for {len(cores)} cores; this NPU has {n_cores}", errno.EINVAL)
        used = [(i, tasks) for i, tasks in enumerate(cores) if tasks]
        if not used:
            raise NpuError("job has no tasks", errno.EINVAL)
        regcmd: dict[int, Buffer] = {}
        records = []
        slot = 2 if len(used) == 3 else 0  # 3 cores: subcore_task[i+2]; 1-2 cores: subcore_task[i]
        subcore = [(0, 0)] * rk.N_SUBCORE_TASKS
        for core, tasks in used:
            if len(tasks) > rk.MAX_SUBMIT_TASKS:
                raise NpuError(f"core {core} has {len(tasks)} tasks; at most {rk.MAX_SUBMIT_TASKS} per submit "
                               "(TASK_CON.TASK_NUMBER is 12 bits): split the job", errno.EINVAL)
            subcore[core + slot] = (len(records), len(tasks))
            for t in tasks:
                # IOVA 0 is a real address: mainline rocket gives it to a file's first buffer
                if t.regcmd_addr % 16 or not 0 <= t.regcmd_addr < IOVA_WINDOW_BYTES:
                    raise NpuError(f"regcmd_addr {t.regcmd_addr:#x} must be a 16-byte aligned 32-bit NPU address",
                                   errno.EINVAL)
                if t.body_words <= 0:
                    raise NpuError(f"body_words must be > 0 (got {t.body_words})", errno.EINVAL)
                buf = buffer_at(t.regcmd_addr)
                if buf is None:
                    raise NpuError(f"regcmd_addr {t.regcmd_addr:#x} is not inside any buffer of this device",
                                   errno.EFAULT)
                regcmd[buf.handle] = buf
                records.append(rk.rknpu_task(
                    flags=0, op_idx=1, enable_mask=t.enable_mask, int_mask=t.int_mask,
                    int_clear=RKNN_TASK_INT_CLEAR, int_status=0, regcfg_amount=t.body_words, regcfg_offset=0,
                    regcmd_addr=t.regcmd_addr,
                ))
        return cls(
            regcmd_buffers=tuple(regcmd.values()),
            n_tasks=len(records),
            task_array=b"".join(bytes(r) for r in records),
            core_mask=sum(1 << core for core, _ in used),
            subcore=tuple(subcore),
            rocket_jobs=tuple(tuple((t.regcmd_addr, t.body_words + 4) for t in tasks) for _, tasks in used),
        )


class Buffer:
    """One NPU buffer: a GEM object, its NPU address and its CPU mapping."""

    def __init__(self, device: "NpuDevice", size: int, capacity: int, dma_addr: int, handle: int,
                 obj_addr: int, cached: bool, view: memoryview, purpose: str) -> None:
        self.device, self.size, self.capacity, self.dma_addr = device, size, capacity, dma_addr
        self.handle, self.obj_addr, self.cached, self.purpose = handle, obj_addr, cached, purpose
        self._view: memoryview | None = view

    @property
    def closed(self) -> bool:
        return self._view is None

    def array(self, dtype=np.uint8) -> np.ndarray:
        """Writable view of the first ``size`` bytes of the CPU mapping."""
        if self._view is None:
            raise NpuError("buffer is closed; allocate a new one")
        dtype = np.dtype(dtype)
        return np.frombuffer(self._view, dtype=dtype, count=self.size // dtype.itemsize)

    def _range(self, offset: int, size: int | None) -> tuple[int, int]:
        size = self.size - offset if size is None else size
        if offset < 0 or size < 0 or offset + size > self.capacity:
            raise NpuError(f"sync range [{offset}, {offset + size}) is outside the {self.capacity}-byte buffer",
                           errno.EINVAL)
        return offset, size

    def sync_to_device(self, offset: int = 0, size: int | None = None) -> None:
        """Make CPU writes visible to the NPU (clean the CPU cache)."""
        self.device._sync(self, *self._range(offset, size), to_device=True)

    def sync_from_device(self, offset: int = 0, size: int | None = None) -> None:
        """Make NPU writes visible to the CPU (invalidate; rocket: also waits for the writer)."""
        self.device._sync(self, *self._range(offset, size), to_device=False)

    def close(self) -> None:
        if self._view is not None:
            view, self._view = self._view, None
            self.device._free(self, view)

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"dma={self.dma_addr:#x}"
        return f"Buffer({self.purpose}, {self.size} B, {state})"


class NpuDevice:
    def __init__(self, sys: Syscalls, fd: int, path: str, kind: str, simulated: bool) -> None:
        self.sys, self.fd, self.path, self.kind, self.simulated = sys, fd, path, kind, simulated
        self.driver: RknpuDriver | RocketDriver = RknpuDriver(sys, fd) if kind == "rknpu" else RocketDriver(sys, fd)
        self.n_cores = int(getattr(sys, "n_cores", N_CORES_RK3588)) if simulated else N_CORES_RK3588
        self._buffers: dict[int, Buffer] = {}
        self._task_bo: Buffer | None = None
        self._task_bo_plan: _SubmitPlan | None = None  # whose task array the task BO holds
        self._plans: dict[tuple, _SubmitPlan] = {}
        self._closed = False

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, device: str | None = None, *, sys: Syscalls | None = None) -> "NpuDevice":
        """Open ``device`` (see module doc); ``sys`` replaces the host's syscalls (tests)."""
        device = device or os.environ.get("RKNPU_DEVICE") or None
        if device in ("sim-rknpu", "sim-rocket"):
            from ggml_rknpu.sim.kernel import SimKernel

            kind = device.removeprefix("sim-")
            sim = from_environment(SimKernel(kind))
            path = sim._device_paths()[-1]
            return cls(sim, sim.open(path), path, kind, simulated=True)
        host = from_environment(sys or HostSyscalls())
        if device is not None and device.startswith("/"):
            fd = cls._open_node(host, device)
            try:
                kind = query_version(host, fd).name
            except OSError as exc:
                host.close(fd)
                raise NpuError(f"{device} is not a DRM device ({exc.strerror})", exc.errno) from exc
            if kind not in ("rknpu", "rocket"):
                host.close(fd)
                raise NpuError(f"{device} is driven by {kind!r}, not rknpu or rocket", errno.ENODEV)
            return cls(host, fd, device, kind, simulated=False)
        if device not in (None, "rknpu", "rocket"):
            raise NpuError(f"unknown device {device!r}; choose one of {', '.join(DEVICE_CHOICES)} or a /dev path",
                           errno.EINVAL)
        unopenable: list[str] = []
        nodes = [n for n in discover(host, unopenable) if device is None or n[0] == device]
        if nodes:
            kind, path = nodes[0]
            return cls(host, cls._open_node(host, path), path, kind, simulated=False)
        if device is None:
            if unopenable:  # maybe an NPU we may not open: say so instead of simulating silently
                warnings.warn(f"using the NPU simulator; could not open {'; '.join(unopenable)} "
                              "(join the render/video group if one of them is the NPU)", RuntimeWarning, stacklevel=2)
            return cls.open("sim-rknpu")
        where = "/dev/dri/renderD* named 'rknpu'" if device == "rknpu" else "/dev/accel/accel* named 'rocket'"
        raise NpuError(f"no {where} found: is the {device} kernel driver loaded and are you in the render/video "
                       f"group? (--device sim-{device} runs the simulator)", errno.ENODEV)

    @staticmethod
    def _open_node(sys: Syscalls, path: str) -> int:
        try:
            return sys.open(path)
        except OSError as exc:
            raise NpuError(f"cannot open {path}: {exc.strerror}; check it exists and that you may open it "
                           "(render/video group)", exc.errno) from exc

    # ------------------------------------------------------------------ facts
    def info(self) -> DeviceInfo:
        d = self.driver
        values: dict[str, int | None] = dict.fromkeys(("hw", "freq", "volt", "iommu", "sram_total", "sram_free"))
        if isinstance(d, RknpuDriver):
            for key, action in (("hw", rk.Action.GET_HW_VERSION), ("freq", rk.Action.GET_FREQ),
                                ("volt", rk.Action.GET_VOLT), ("iommu", rk.Action.GET_IOMMU_EN),
                                ("sram_total", rk.Action.GET_TOTAL_SRAM_SIZE),
                                ("sram_free", rk.Action.GET_FREE_SRAM_SIZE)):
                try:
                    values[key] = d.action(action)
                except NpuError:
                    values[key] = None  # not supported by this kernel build
        return DeviceInfo(
            kind=self.kind, simulated=self.simulated, path=self.path, driver_name=d.drm.name,
            driver_version=".".join(map(str, d.version)), driver_date=d.drm.date, driver_desc=d.drm.desc,
            n_cores=self.n_cores, hw_version=values["hw"], npu_freq_hz=values["freq"], npu_volt_uv=values["volt"],
            iommu_enabled=None if values["iommu"] is None else bool(values["iommu"]),
            sram_total_bytes=values["sram_total"], sram_free_bytes=values["sram_free"],
        )

    def iova_budget(self) -> tuple[int, int]:
        """(free, total) bytes of NPU address space. On a board: the 4 GiB window minus our
        own buffers (other processes' buffers are not visible from here)."""
        if self.simulated:
            return self.sys.iova_budget(self.fd)  # type: ignore[attr-defined]
        used = sum(b.capacity for b in self._buffers.values())
        return IOVA_WINDOW_BYTES - PAGE - used, IOVA_WINDOW_BYTES - PAGE

    # ------------------------------------------------------------------ buffers
    def alloc(self, size: int, *, purpose: str = "data") -> Buffer:
        if purpose not in PURPOSES:
            raise NpuError(f"purpose must be one of {PURPOSES}, not {purpose!r}", errno.EINVAL)
        if size <= 0:
            raise NpuError(f"buffer size must be > 0 (got {size})", errno.EINVAL)
        self._check_open()
        if isinstance(self.driver, RknpuDriver):
            flags = rk.TASK_BO_FLAGS if purpose == "task" else rk.DATA_BO_FLAGS
            mem = self.driver.mem_create(size, flags)
            try:
                view = self.driver.mmap(self.driver.mem_map(mem.handle), mem.size)
            except (NpuError, OSError):
                self.driver.mem_destroy(mem.handle, mem.obj_addr)
                raise
            buf = Buffer(self, size, mem.size, mem.dma_addr, mem.handle, mem.obj_addr,
                         bool(flags & rk.MemFlag.CACHEABLE), view, purpose)
        else:
            if size >= 1 << 32:
                raise NpuError(f"rocket buffers are limited to < 4 GiB (u32 size), got {size}", errno.EINVAL)
            bo = self.driver.create_bo(size)
            capacity = (size + PAGE - 1) // PAGE * PAGE
            try:
                view = self.driver.mmap(bo.offset, capacity)
            except (NpuError, OSError):
                self.driver.gem_close(bo.handle)
                raise
            buf = Buffer(self, size, capacity, bo.dma_address, bo.handle, 0, True, view, purpose)
        self._buffers[buf.handle] = buf
        return buf

    def _sync(self, buf: Buffer, offset: int, size: int, *, to_device: bool) -> None:
        if buf.closed:
            raise NpuError("buffer is closed", errno.EBADF)
        if isinstance(self.driver, RknpuDriver):
            if buf.cached and size:
                flag = rk.SyncFlag.TO_DEVICE if to_device else rk.SyncFlag.FROM_DEVICE
                self.driver.mem_sync(buf.obj_addr, offset, size, flag)
        elif to_device:
            self.driver.fini_bo(buf.handle)  # rocket syncs whole BOs
        else:
            self.driver.prep_bo(buf.handle)

    def _free(self, buf: Buffer, view: memoryview) -> None:
        self._buffers.pop(buf.handle, None)
        self.sys.munmap(view)
        if isinstance(self.driver, RknpuDriver):
            self.driver.mem_destroy(buf.handle, buf.obj_addr)
        else:
            self.driver.gem_close(buf.handle)

    def _buffer_at(self, dma_addr: int) -> Buffer | None:
        for b in self._buffers.values():
            if b.dma_addr <= dma_addr < b.dma_addr + b.capacity:
                return b
        return None

    # ------------------------------------------------------------------ jobs
    def _plan(self, job: Job) -> "_SubmitPlan":
        """The submit plan for ``job.cores``: built and validated once, replayed after."""
        plan = self._plans.get(job.cores)
        if plan is not None and not any(b.closed for b in plan.regcmd_buffers):
            return plan
        plan = _SubmitPlan.build(job.cores, self.n_cores, self._buffer_at)
        if len(self._plans) >= MAX_CACHED_PLANS:
            self._plans.pop(next(iter(self._plans)))
        self._plans[job.cores] = plan
        return plan

    def submit(self, job: Job, timeout_ms: int = 6000) -> Completion:
        """Run ``job`` and wait for it. Raises NpuTimeout (hang), NpuFault, NpuError."""
        self._check_open()
        plan = self._plan(job)
        for b in (*job.inputs, *job.outputs):
            if b.closed or b.device is not self:
                raise NpuError(f"{b!r} is closed or belongs to another device", errno.EBADF)
        cleaned = {b.handle: b for b in (*job.inputs, *plan.regcmd_buffers)}
        for b in cleaned.values():
            b.sync_to_device()
        if isinstance(self.driver, RknpuDriver):
            completion = self._submit_vendor(plan, timeout_ms)
            for b in job.outputs:
                b.sync_from_device()
            return completion
        return self._submit_rocket(plan, job, timeout_ms)

    def _submit_vendor(self, plan: "_SubmitPlan", timeout_ms: int) -> Completion:
        assert isinstance(self.driver, RknpuDriver)
        task_bytes = len(plan.task_array)
        if self._task_bo is None or self._task_bo.size < task_bytes:
            if self._task_bo is not None:
                self._task_bo.close()
            # whole pages, so the BO is reused until a submit needs more than fits in them
            self._task_bo = self.alloc((task_bytes + PAGE - 1) // PAGE * PAGE, purpose="task")
            self._task_bo_plan = None
        if self._task_bo_plan is not plan:  # a replayed job finds its task array in place
            self._task_bo.array()[:task_bytes] = np.frombuffer(plan.task_array, np.uint8)
            self._task_bo.sync_to_device(0, task_bytes)
            self._task_bo_plan = plan
        result = self.driver.submit(
            task_obj_addr=self._task_bo.obj_addr, task_number=plan.n_tasks,
            flags=rk.JobFlag.PC | rk.JobFlag.PINGPONG, timeout_ms=timeout_ms,
            core_mask=plan.core_mask, subcore_tasks=plan.subcore,
        )
        # [VEND rknpu_job_done: ktime_sub(now, hw_commit_time), in ns, commit to IRQ]; 0.9.6 ABI: None
        elapsed = None if self.simulated else result.hw_elapse_time
        return Completion(hw_elapsed_ns=elapsed, task_counter=result.task_counter, simulated=self.simulated)

    def _submit_rocket(self, plan: "_SubmitPlan", job: Job, timeout_ms: int) -> Completion:
        assert isinstance(self.driver, RocketDriver)
        in_handles = tuple(b.handle for b in (*job.inputs, *plan.regcmd_buffers))
        out_handles = tuple(b.handle for b in job.outputs)
        self.driver.submit([RocketJobSpec(tasks, in_handles, out_handles) for tasks in plan.rocket_jobs])
        deadline = time.monotonic_ns() + timeout_ms * 1_000_000  # PREP_BO takes an absolute timeout
        for b in job.outputs:
            self.driver.prep_bo(b.handle, deadline)
        return Completion(hw_elapsed_ns=None, task_counter=plan.n_tasks, simulated=self.simulated)

    # ------------------------------------------------------------------ power and reset
    def reset(self) -> None:
        if isinstance(self.driver, RknpuDriver):
            self.driver.action(rk.Action.ACT_RESET)
        else:
            raise NpuError("rocket has no reset ioctl; it resets a core itself after a job timeout",
                           errno.EOPNOTSUPP)

    def power_on(self) -> None:
        self._power(rk.Action.POWER_ON)

    def power_off(self) -> None:
        self._power(rk.Action.POWER_OFF)

    def _power(self, action: rk.Action) -> None:
        """Vendor only; rocket powers cores per job through runtime PM, so nothing to do.
        The 0.9.x vendor driver performs POWER_ON/OFF and then returns EINVAL anyway
        [capture pw_c256_h14: ret=-1 for both], so that EINVAL is not an error."""
        if isinstance(self.driver, RknpuDriver):
            try:
                self.driver.action(action)
            except NpuError as exc:
                if exc.errno != errno.EINVAL:
                    raise

    # ------------------------------------------------------------------ lifetime
    def _check_open(self) -> None:
        if self._closed:
            raise NpuError("device is closed", errno.EBADF)

    def close(self) -> None:
        if self._closed:
            return
        if self._task_bo is not None:
            self._task_bo.close()
            self._task_bo = None
        for buf in list(self._buffers.values()):
            buf.close()
        self.sys.close(self.fd)
        self._closed = True

    def __enter__(self) -> "NpuDevice":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NpuDevice({self.kind}{' simulated' if self.simulated else ''}, {self.path})"
