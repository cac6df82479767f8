"""What the simulated ``rknpu`` and ``rocket`` kernels share: the ``Syscalls`` surface (open,
ioctl dispatch the way ``drm_ioctl`` copies structs, mmap), GEM objects and handles, the DRM
core ioctls, and the NPU model behind the MMIO window.

``SimKernel(abi)`` makes the ABI's kernel (``sim/kernel/rknpu.py``, ``sim/kernel/rocket.py``).
Invariants and sources: the package doc, docs/decisions.md "sim/kernel"."""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

from ggml_rknpu.hw.registers import REGISTERS
from ggml_rknpu.kernel import drm
from ggml_rknpu.sim.kernel import misuse
from ggml_rknpu.sim.memory import (
    MMAP_OFFSET_BASE,
    PAGE,
    DmaFault,
    GemObject,
    IommuDomain,
    NpuMmu,
    RangeAllocator,
    page_align,
)

if TYPE_CHECKING:
    from ggml_rknpu.sim.operands import OperandCache

# register offsets the drivers' programming sequences write (hw/registers.py)
PC_OPERATION_ENABLE = REGISTERS["PC_OPERATION_ENABLE"].offset
PC_BASE_ADDRESS = REGISTERS["PC_BASE_ADDRESS"].offset
PC_REGISTER_AMOUNTS = REGISTERS["PC_REGISTER_AMOUNTS"].offset
PC_INTERRUPT_MASK = REGISTERS["PC_INTERRUPT_MASK"].offset
PC_INTERRUPT_CLEAR = REGISTERS["PC_INTERRUPT_CLEAR"].offset
PC_INTERRUPT_STATUS = REGISTERS["PC_INTERRUPT_STATUS"].offset
PC_INTERRUPT_RAW_STATUS = REGISTERS["PC_INTERRUPT_RAW_STATUS"].offset
PC_TASK_CON = REGISTERS["PC_TASK_CON"].offset
PC_TASK_DMA_BASE_ADDR = REGISTERS["PC_TASK_DMA_BASE_ADDR"].offset
PC_TASK_STATUS = REGISTERS["PC_TASK_STATUS"].offset
CNA_S_POINTER = REGISTERS["CNA_S_POINTER"].offset
CORE_S_POINTER = REGISTERS["CORE_S_POINTER"].offset
S_POINTER_PP = 0xE  # POINTER_PP_EN | EXECUTER_PP_EN | POINTER_PP_MODE [§2, §3]
S_POINTER_CORE_BIT = 0x10000000  # "0x10000000 * core", reserved in the TRM [§3]
DMESG_LINES = 4096
OBJ_ADDR_BASE = 0xFFFFFF8100000000  # looks like the captured kernel pointers (0xffffff8108551800)
OBJ_ADDR_STRIDE = 0x400

RW, W = drm.IOC_READ | drm.IOC_WRITE, drm.IOC_WRITE  # the drivers' declared _IOWR / _IOW


def fail(code: int, message: str) -> OSError:
    """The errno a handler's ioctl returns, with the simulator's explanation."""
    return OSError(code, message)


@dataclass
class DrmFile:
    """One open file description (a drm_file): its GEM handles and, for rocket, its domain."""

    path: str
    handles: dict[int, GemObject] = field(default_factory=dict)
    domain: IommuDomain | None = None
    # rocket: the file's drm_sched_entity: the core (scheduler) it is on and when, on the
    # modeled timeline, its last job ends
    entity_core: int = 0
    entity_done_at: float = 0.0


_S = TypeVar("_S", bound=ctypes.Structure)


@dataclass(frozen=True)
class Ioctl(Generic[_S]):
    """One ioctl of a driver: its handler takes the struct it declares (checked where each is made)."""

    handler: Callable[[DrmFile, _S], None]
    struct: type[_S]
    direction: int  # the driver's declared _IOC direction bits


# A driver's ioctl table: each entry pairs a handler with its own struct type, so the table's
# element type can only say "some struct" (Python has no existential types).
IoctlTable = dict[int, Ioctl[Any]]


class NpuModel(Protocol):
    """The NPU behind the kernel's MMIO window: ``sim.npu.SimNpu``, or a test's stand-in."""

    busy_seconds: float   # host seconds spent inside the model

    def mmio_write(self, core: int, offset: int, value: int) -> None: ...
    def mmio_read(self, core: int, offset: int) -> int: ...
    def soft_reset(self, core: int | None = None) -> None: ...
    def diagnostics(self, core: int) -> list[str]: ...


class SimKernel:
    """Implements ``Syscalls`` for one simulated NPU kernel driver. ``SimKernel(abi, ...)``
    makes that ABI's kernel; the subclasses add their driver's ioctls (``driver_ioctls``)."""

    abi: ClassVar[str]
    nodes: dict[str, list[str]]  # the device nodes it pretends to have
    default_version: ClassVar[tuple[int, int, int]]
    default_iova_window: ClassVar[tuple[int, int]]
    shared_domain: ClassVar[bool]  # one domain for every file (vendor) or one per file (rocket)
    page_aligned_nodes: ClassVar[bool]  # an IOVA node's size: page aligned, or the size asked for

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "abi" in cls.__dict__:          # an ABI's kernel, not a test's variant of one
            _KINDS[cls.abi] = cls

    def __new__(cls, abi: str = "rknpu", *args: Any, **kwargs: Any) -> SimKernel:
        if cls is SimKernel:
            if abi not in _KINDS:
                raise ValueError(f"abi must be one of {', '.join(_KINDS)}, not {abi!r}")
            cls = _KINDS[abi]
        return super().__new__(cls)

    def __init__(
        self,
        abi: str = "rknpu",
        driver_version: tuple[int, int, int] | None = None,
        *,
        npu: NpuModel | None = None,
        n_cores: int = 3,
        iova_window: tuple[int, int] | None = None,
        memory_limit: int = 4 << 30,
        coherent: bool = False,
        **abi_options: Any,
    ) -> None:
        """``abi_options``: the ABI's own (rocket: ``rocket_mhz``, ``rocket_errors``)."""
        if abi != self.abi:
            raise ValueError(f"a simulated {self.abi} kernel cannot be made with abi={abi!r}")
        if abi_options:
            raise TypeError(f"options the simulated {abi} kernel does not take: {', '.join(abi_options)}")
        major, minor, patch = driver_version or self.default_version
        self.driver_version = (major, minor, patch)
        self.n_cores = n_cores
        self.iova_window = iova_window or self.default_iova_window
        self.memory_limit = memory_limit
        self.coherent = coherent
        self.dmesg: list[str] = []
        self._files: dict[int, DrmFile] = {}
        self._next_fd = 100
        self._objects: dict[int, GemObject] = {}  # obj_addr -> live object
        self._next_obj_addr = OBJ_ADDR_BASE
        self._offsets = RangeAllocator(MMAP_OFFSET_BASE, MMAP_OFFSET_BASE + (1 << 44), PAGE)
        self._by_offset: dict[int, GemObject] = {}
        self._maps: dict[int, tuple[memoryview, GemObject]] = {}
        self._allocated = 0
        self._shared_domain = IommuDomain(*self.iova_window) if self.shared_domain else None
        self.mmu = NpuMmu(self._shared_domain)
        self._npu = npu
        # A one-shot fault for the next submit, for the bring-up ladder's tests: "stale" drops
        # the last task of the first core's list (or job) silently; "timeout" hangs it
        # (vendor: ETIMEDOUT; rocket: killed by the job timeout, outputs stale, no error).
        self.inject: str | None = None
        self.powered = False
        core: IoctlTable = {0x00: Ioctl(self._drm_version, drm.drm_version, RW),
                            0x09: Ioctl(self._gem_close, drm.drm_gem_close, W)}
        self._ioctls = {**core, **{drm.DRM_COMMAND_BASE + nr: v for nr, v in self.driver_ioctls().items()}}

    def driver_ioctls(self) -> IoctlTable:
        """The driver's own ioctls by number (from DRM_COMMAND_BASE)."""
        raise NotImplementedError

    def version_strings(self) -> tuple[str, str, str]:
        """DRM_IOCTL_VERSION's name, date and desc."""
        raise NotImplementedError

    def _new_file(self, path: str) -> DrmFile:
        return DrmFile(path)

    # ------------------------------------------------------------------ Syscalls
    def listdir(self, path: str) -> list[str]:
        return list(self.nodes.get(path.rstrip("/"), []))

    def exists(self, path: str) -> bool:
        return path in self._device_paths() or path.rstrip("/") in self.nodes

    def read_text(self, path: str) -> str:
        raise FileNotFoundError(errno.ENOENT, f"{path}: not present in the simulated {self.abi} system", path)

    def open(self, path: str, flags: int = os.O_RDWR) -> int:
        if path not in self._device_paths():
            raise fail(errno.ENOENT, f"{path}: no such device in the simulated {self.abi} system "
                                      f"(it has {', '.join(self._device_paths())})")
        fd = self._next_fd
        self._next_fd += 1
        self._files[fd] = self._new_file(path)
        return fd

    def close(self, fd: int) -> None:
        f = self._file(fd)
        for handle in list(f.handles):
            self._drop_handle(f, handle)
        del self._files[fd]

    def ioctl(self, fd: int, request: int, arg: bytearray) -> int:
        f = self._file(fd)
        req = drm.decode_request(request)
        if req.type != drm.DRM_IOCTL_BASE:
            raise fail(errno.ENOTTY, f"ioctl {request:#x} is not a DRM ioctl (type {req.type:#x}, expected 'd')")
        entry = self._ioctls.get(req.nr)
        if entry is None:
            raise fail(errno.EINVAL, f"ioctl nr {req.nr:#x} is not implemented by the {self.abi} driver")
        if len(arg) < req.size:
            raise fail(errno.EFAULT, f"ioctl {request:#x} says {req.size} bytes but the argument buffer has {len(arg)}")
        # [drm_ioctl] copy in the user's size, zero-fill to the driver's, copy out the user's size
        in_size = req.size if req.direction & entry.direction & drm.IOC_WRITE else 0
        out_size = req.size if req.direction & entry.direction & drm.IOC_READ else 0
        kdata = bytearray(max(in_size, out_size, ctypes.sizeof(entry.struct)))
        kdata[:in_size] = arg[:in_size]
        try:
            entry.handler(f, entry.struct.from_buffer(kdata))
        finally:
            arg[:out_size] = kdata[:out_size]
        return 0

    def mmap(self, fd: int, length: int, offset: int) -> memoryview:
        f = self._file(fd)
        obj = self._by_offset.get(offset)
        if obj is None:
            raise fail(errno.EINVAL, f"mmap offset {offset:#x} is not a buffer's fake offset; use the offset "
                                      "MEM_MAP / CREATE_BO returned")
        if obj not in f.handles.values():
            raise fail(errno.EACCES, "mmap of a buffer this file has no handle for")
        if length <= 0 or length > obj.size:
            raise fail(errno.EINVAL, f"mmap length {length} is outside the {obj.size}-byte buffer")
        # numpy's stubs give ndarray its buffer protocol only on Python >= 3.12; it has one on every version
        view = memoryview(obj.cpu[:length])  # type: ignore[arg-type]
        obj.mappings += 1
        self._maps[id(view)] = (view, obj)
        return view

    def munmap(self, view: memoryview) -> None:
        entry = self._maps.pop(id(view), None)
        if entry is None:
            raise fail(errno.EINVAL, "munmap of a view that is not a live mapping of this simulated device")
        obj = entry[1]
        obj.mappings -= 1
        self._maybe_free(obj)

    # ------------------------------------------------------------------ state for tests / tools
    def stats(self) -> dict[str, int]:
        """Live objects, mappings, handles and used address space (leak checks)."""
        domains = self._domains()
        return {
            "objects": len(self._objects),
            "mappings": len(self._maps),
            "handles": sum(len(f.handles) for f in self._files.values()),
            "iova_used": sum(d.iova.total - d.iova.free_bytes for d in domains),
            "mmap_offsets_used": self._offsets.total - self._offsets.free_bytes,
            "allocated_bytes": self._allocated,
        }

    @property
    def simulation_seconds(self) -> float:
        """Host seconds spent inside the NPU model so far (simulated hardware time is not
        a host cost on a board: subtract this to time the host path alone)."""
        return self._npu.busy_seconds if self._npu is not None else 0.0

    def address_space(self, fd: int) -> IommuDomain:
        """The NPU address space ``fd``'s buffers live in (its ``view`` is what the NPU sees)."""
        return self._domain(self._file(fd))

    def iova_budget(self, fd: int) -> tuple[int, int]:
        """(free, total) bytes of the NPU address space ``fd``'s buffers live in."""
        domain = self._domain(self._file(fd))
        return domain.iova.free_bytes, domain.iova.total

    # ------------------------------------------------------------------ helpers
    def _device_paths(self) -> list[str]:
        return [f"{d}/{n}" for d, names in self.nodes.items() for n in names]

    def _file(self, fd: int) -> DrmFile:
        f = self._files.get(fd)
        if f is None:
            raise fail(errno.EBADF, f"fd {fd} is not an open simulated {self.abi} device")
        return f

    def _domain(self, f: DrmFile) -> IommuDomain:
        """The domain ``f``'s next buffer is mapped into."""
        domain = self._shared_domain or f.domain
        assert domain is not None
        return domain

    def _domains(self) -> list[IommuDomain]:
        """Every NPU address space of this kernel."""
        if self._shared_domain is not None:
            return [self._shared_domain]
        return [f.domain for f in self._files.values() if f.domain is not None]

    @property
    def modeled_npu_mhz(self) -> float | None:
        """The NPU clock (MHz) of this kernel's modeled timeline, where it keeps one: what modeled
        device time above it is priced at (engine.api); rocket: its ``rocket_mhz``."""
        return None

    def _log(self, line: str) -> None:
        self.log_line(f"{self.abi.upper()}: {line}")

    def _misuse(self, ioctl: str, what: str, on_a_board: str) -> None:
        """Record a call the real driver lets pass but a board pays for (``misuse``)."""
        record = misuse.Misuse(self.abi, ioctl, what, on_a_board)
        misuse.record(record)
        self._log(f"MISUSE {record.describe()}")

    def log_line(self, line: str) -> None:
        """Append to ``dmesg``, which keeps the last ``DMESG_LINES`` lines like the kernel's ring
        buffer (a server injecting faults for days must not keep every line)."""
        self.dmesg.append(line)
        if len(self.dmesg) > DMESG_LINES:
            del self.dmesg[:len(self.dmesg) - DMESG_LINES // 2]

    def _new_object(self, f: DrmFile, size: int, flags: int, cached: bool) -> tuple[int, GemObject]:
        if size <= 0:
            raise fail(errno.EINVAL, f"buffer size must be > 0 (got {size})")
        aligned = page_align(size)
        if self._allocated + aligned > self.memory_limit:
            raise fail(errno.ENOMEM, f"out of memory: {aligned} bytes requested, {self.memory_limit - self._allocated} "
                                      f"of {self.memory_limit} left; free buffers first")
        obj = GemObject(aligned, flags, self._next_obj_addr, cached and not self.coherent)
        domain = self._domain(f)
        if not domain.map(obj, aligned if self.page_aligned_nodes else size):
            it = domain.iova
            raise fail(errno.ENOMEM, f"NPU address space exhausted: no free IOVA range of {aligned} bytes "
                                      f"({it.free_bytes} bytes free in {it.n_free_ranges} pieces, largest "
                                      f"{it.largest_free}); free buffers or allocate smaller ones")
        self._next_obj_addr += OBJ_ADDR_STRIDE
        self._objects[obj.obj_addr] = obj
        self._allocated += aligned
        handle = 1
        while handle in f.handles:  # idr: lowest free handle
            handle += 1
        f.handles[handle] = obj
        obj.handle_refs += 1
        return handle, obj

    def _mmap_offset(self, obj: GemObject) -> int:
        if obj.mmap_offset is None:
            start = self._offsets.alloc(obj.size)
            if start is None:
                raise fail(errno.ENOMEM, "fake mmap offset space exhausted")
            obj.mmap_offset = start
            self._by_offset[start] = obj
        return obj.mmap_offset

    def _drop_handle(self, f: DrmFile, handle: int) -> None:
        obj = f.handles.pop(handle)
        obj.handle_refs -= 1
        self._maybe_free(obj)

    def _maybe_free(self, obj: GemObject) -> None:
        if obj.alive or obj.obj_addr not in self._objects:
            return
        del self._objects[obj.obj_addr]
        if obj.domain is not None:
            decoded = self._decoded()
            if decoded is not None:
                decoded.forget(obj.dma_addr, obj.size)
            obj.domain.unmap(obj)
        if obj.mmap_offset is not None:
            self._offsets.free(obj.mmap_offset)
            del self._by_offset[obj.mmap_offset]
        self._allocated -= obj.size

    def _lookup_handle(self, f: DrmFile, handle: int, code: int, what: str) -> GemObject:
        obj = f.handles.get(handle)
        if obj is None:
            raise fail(code, f"{what}: handle {handle} is not open on this fd (destroyed already, or from another fd?)")
        return obj

    def limit_decode_cache(self, max_bytes: int) -> None:
        """Keep at most ``max_bytes`` of the simulator's decoded fp32 weights (host memory of
        the simulator, which a board does not spend; ``rknpu serve --host-cache-budget``)."""
        self._npu_model()
        decoded = self._decoded()
        if decoded is not None:
            decoded.limit_weights(max_bytes)

    def _decoded(self) -> OperandCache | None:
        """The simulated NPU's decoded operands (None before it exists, or for a test's stand-in,
        which decodes nothing)."""
        from ggml_rknpu.sim.npu import SimNpu

        return self._npu.operands if isinstance(self._npu, SimNpu) else None

    def _npu_model(self) -> NpuModel:
        if self._npu is None:
            try:
                from ggml_rknpu.sim.npu import SimNpu
            except ImportError as exc:
                raise fail(errno.ENODEV, f"no NPU model attached: ggml_rknpu.sim.npu is not available ({exc}); "
                                          "the simulated kernel cannot run jobs without it") from exc
            self._npu = SimNpu(self.mmu, n_cores=self.n_cores)
        return self._npu

    def _run(self, npu: NpuModel, core: int, writes: list[tuple[int, int]]) -> str | None:
        """Replay register writes on one core; returns a fault description instead of raising."""
        try:
            for offset, value in writes:
                npu.mmio_write(core, offset, value & 0xFFFFFFFF)
        except DmaFault as exc:
            return str(exc)
        return None

    def _diagnostics(self, npu: NpuModel, core: int) -> list[str]:
        try:
            return [str(line) for line in npu.diagnostics(core)]
        except Exception as exc:  # a diagnostics bug must not hide the real failure
            return [f"(diagnostics unavailable: {exc!r})"]

    # ------------------------------------------------------------------ DRM core
    def _drm_version(self, f: DrmFile, v: drm.drm_version) -> None:
        major, minor, patch = self.driver_version
        v.version_major, v.version_minor, v.version_patchlevel = major, minor, patch
        name, date, desc = self.version_strings()
        for field_name, text in (("name", name), ("date", date), ("desc", desc)):
            data = text.encode()
            capacity = getattr(v, f"{field_name}_len")
            pointer = getattr(v, field_name)
            if capacity and not pointer:
                raise fail(errno.EFAULT, f"DRM_IOCTL_VERSION: {field_name}_len={capacity} but {field_name} is NULL")
            if capacity:
                ctypes.memmove(pointer, data, min(capacity, len(data)))  # copy_to_user
            setattr(v, f"{field_name}_len", len(data))

    def _gem_close(self, f: DrmFile, c: drm.drm_gem_close) -> None:
        if c.handle not in f.handles:
            raise fail(errno.EINVAL, f"GEM_CLOSE: handle {c.handle} is not open on this fd")
        self._drop_handle(f, c.handle)


_KINDS: dict[str, type[SimKernel]] = {}  # abi -> its kernel (the package imports both)
