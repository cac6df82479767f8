"""``SimKernel``: the vendor ``rknpu`` or mainline ``rocket`` kernel driver, in software,
behind the ``Syscalls`` interface.

Invariants: it receives exactly what the real kernel receives (request numbers and struct
bytes) and answers the way the real drivers do [docs/npu-programming.md §3-§5]; cached
objects move data between CPU and device copies only through MEM_SYNC / FINI_BO / PREP_BO;
where a real driver would crash, corrupt or silently drop an error, the simulator refuses
with an errno and a message instead; ``hw_elapse_time`` stays 0 (no hardware clock);
``rocket_errors="mainline"`` (the default) reproduces mainline rocket's silent behaviour.
What is modelled and the sources: docs/decisions.md "sim/kernel.py", docs/envelope.md."""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import numpy as np

from ggml_rknpu.hw.alignment import align_up, ceil_div
from ggml_rknpu.hw.envelope import ROCKET_BOOT_MHZ, ROCKET_JOB_TIMEOUT_MS, decode_task
from ggml_rknpu.hw.limits import HW_VERSION, INT_CLEAR_ALL
from ggml_rknpu.hw.registers import REGISTERS
from ggml_rknpu.kernel import drm
from ggml_rknpu.kernel.rknpu import uapi as rk
from ggml_rknpu.kernel.rocket import uapi as ro
from ggml_rknpu.sim.memory import (
    IOVA_BASE,
    IOVA_END,
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
    from ggml_rknpu.sim.conv import OperandCache

CACHE_LINE = 64  # arm64 Cortex-A76/A55 data cache line
ROCKET_ERRORS = ("mainline", "loud")

# Device nodes the simulator pretends to have. The vendor render node number depends on
# the board's other DRM devices (the display is usually card0/renderD128); renderD129 is
# the usual place of rknpu on RK3588 images - a typical value, not a fixed one.
VENDOR_NODES = {"/dev/dri": ["card1", "renderD129"]}
ROCKET_NODES = {"/dev/accel": ["accel0"]}  # [docs/npu-programming.md §5] char major 261

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
# the flags the per-job ioctls test, as plain ints (an IntFlag operation costs a call)
_CACHEABLE = int(rk.MemFlag.CACHEABLE)
DMESG_LINES = 4096
_KERNEL_MAPPING = int(rk.MemFlag.KERNEL_MAPPING)
_TO_DEVICE, _FROM_DEVICE = int(rk.SyncFlag.TO_DEVICE), int(rk.SyncFlag.FROM_DEVICE)
_JOB_PC, _JOB_PINGPONG = int(rk.JobFlag.PC), int(rk.JobFlag.PINGPONG)
_JOB_UNMODELED = int(rk.JobFlag.NONBLOCK | rk.JobFlag.FENCE_IN | rk.JobFlag.FENCE_OUT)
CNA_S_POINTER = REGISTERS["CNA_S_POINTER"].offset
CORE_S_POINTER = REGISTERS["CORE_S_POINTER"].offset
S_POINTER_PP = 0xE  # POINTER_PP_EN | EXECUTER_PP_EN | POINTER_PP_MODE [§2, §3]
S_POINTER_CORE_BIT = 0x10000000  # "0x10000000 * core", reserved in the TRM [§3]
INT_DMA_READ_ERROR, INT_DMA_WRITE_ERROR = 1 << 12, 1 << 13
TASK_CON_RESERVED_14, TASK_CON_COUNT_CLEAR, TASK_CON_PP_EN = 1 << 14, 1 << 13, 1 << 12

# Values the ACTION ioctl reports. Sources per value; guesses say so.
NPU_FREQ_HZ = 1_000_000_000  # guess: the RKNN runtime's default "take 1000MHz" [capture pw_c256_h14]
NPU_VOLT_UV = 850_000  # placeholder, NOT a measured RK3588 value: the simulator has no regulator
DRIVER_DATES = {(0, 9, 6): "20240322"}  # [VEND rknpu_drv.h]; other versions: unknown
DEFAULT_VERSIONS = {
    "rknpu": (0, 9, 8),  # [capture: "RKNN Driver Information, version: 0.9.8"]
    "rocket": (0, 0, 0),  # [§5: "Initialized rocket 0.0.0 for rknn"]
}
OBJ_ADDR_BASE = 0xFFFFFF8100000000  # looks like the captured kernel pointers (0xffffff8108551800)
OBJ_ADDR_STRIDE = 0x400


_RW, _W = drm.IOC_READ | drm.IOC_WRITE, drm.IOC_WRITE  # the drivers' declared _IOWR / _IOW


def fuzz_status(status: int) -> int:
    """Widen every set interrupt bit to its whole group0/group1 pair [VEND rknpu_fuzz_status]."""
    out = 0
    for pair in (0x3, 0xC, 0x30, 0xC0, 0x300, 0xC00):
        if status & pair:
            out |= pair
    return out


def _fail(code: int, message: str) -> OSError:
    return OSError(code, message)


class _BestFit(RangeAllocator):
    """drm_mm DRM_MM_INSERT_BEST: the smallest free hole that fits, the node at its start
    (rocket_gem.c rocket_ioctl_create_bo)."""

    def alloc(self, length: int) -> int | None:
        length = align_up(length, self.granule)
        if length <= 0:
            raise ValueError("allocation length must be positive")
        fitting = [i for i, (s, e) in enumerate(self._free) if e - s >= length]
        if not fitting:
            return None
        i = min(fitting, key=lambda j: (self._free[j][1] - self._free[j][0], self._free[j][0]))
        start = self._free[i][0]
        self._free[i][0] += length
        if self._free[i][0] == self._free[i][1]:
            del self._free[i]
        self._used[start] = length
        return start


def _drm_mm_domain(base: int, end: int) -> IommuDomain:
    """A rocket file's address space: its drm_mm over the IOMMU aperture (module doc)."""
    domain = IommuDomain(max(base, PAGE), end)   # (the base is replaced just below)
    domain.iova = _BestFit(base, end, PAGE)
    return domain


@dataclass
class _File:
    """One open file description (a drm_file): its GEM handles and, for rocket, its domain."""

    path: str
    handles: dict[int, GemObject] = field(default_factory=dict)
    domain: IommuDomain | None = None


_S = TypeVar("_S", bound=ctypes.Structure)


@dataclass(frozen=True)
class _Ioctl(Generic[_S]):
    """One ioctl of a driver: its handler takes the struct it declares (checked where each is made)."""

    handler: Callable[[_File, _S], None]
    struct: type[_S]
    direction: int  # the driver's declared _IOC direction bits


# A driver's ioctl table: each entry pairs a handler with its own struct type, so the table's
# element type can only say "some struct" (Python has no existential types).
_IoctlTable = dict[int, _Ioctl[Any]]


class NpuModel(Protocol):
    """The NPU behind the kernel's MMIO window: ``sim.npu.SimNpu``, or a test's stand-in."""

    busy_seconds: float   # host seconds spent inside the model

    def mmio_write(self, core: int, offset: int, value: int) -> None: ...
    def mmio_read(self, core: int, offset: int) -> int: ...
    def soft_reset(self, core: int | None = None) -> None: ...
    def diagnostics(self, core: int) -> list[str]: ...


class SimKernel:
    """Implements ``Syscalls`` for one simulated NPU kernel driver."""

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
        rocket_mhz: float = ROCKET_BOOT_MHZ,
        rocket_errors: str = "mainline",
    ) -> None:
        if abi not in DEFAULT_VERSIONS:
            raise ValueError(f"abi must be 'rknpu' or 'rocket', not {abi!r}")
        if rocket_errors not in ROCKET_ERRORS:
            raise ValueError(f"rocket_errors must be one of {ROCKET_ERRORS}, not {rocket_errors!r}")
        self.abi = abi
        major, minor, patch = driver_version or DEFAULT_VERSIONS[abi]
        self.driver_version = (major, minor, patch)
        self.n_cores = n_cores
        # vendor: the IOMMU DMA window without page 0 (top-down); rocket: the whole aperture
        # from 0 (module doc)
        self.iova_window = iova_window or ((IOVA_BASE, IOVA_END) if abi == "rknpu" else (0, IOVA_END))
        self.rocket_mhz, self.rocket_errors = rocket_mhz, rocket_errors
        self._cpu_synced: dict[int, np.ndarray] = {}  # rocket: CPU bytes as of the last sync, per object
        self.memory_limit = memory_limit
        self.coherent = coherent
        self.dmesg: list[str] = []
        self.nodes = VENDOR_NODES if abi == "rknpu" else ROCKET_NODES
        self._files: dict[int, _File] = {}
        self._next_fd = 100
        self._objects: dict[int, GemObject] = {}  # obj_addr -> live object
        self._next_obj_addr = OBJ_ADDR_BASE
        self._offsets = RangeAllocator(MMAP_OFFSET_BASE, MMAP_OFFSET_BASE + (1 << 44), PAGE)
        self._by_offset: dict[int, GemObject] = {}
        self._maps: dict[int, tuple[memoryview, GemObject]] = {}
        self._allocated = 0
        self._shared_domain = IommuDomain(*self.iova_window) if abi == "rknpu" else None
        self.mmu = NpuMmu(self._shared_domain)
        self._npu = npu
        # A one-shot fault for the next submit, for the bring-up ladder's tests: "stale" drops
        # the last task of the first core's list (or job) silently; "timeout" hangs it
        # (vendor: ETIMEDOUT; rocket: killed by the job timeout, outputs stale, no error).
        self.inject: str | None = None
        self._next_core = 0
        self.powered = False
        self._power_refs = 0
        self.freq_hz, self.volt_uv = NPU_FREQ_HZ, NPU_VOLT_UV
        driver: _IoctlTable
        core: _IoctlTable = {0x00: _Ioctl(self._drm_version, drm.drm_version, _RW), 0x09: _Ioctl(self._gem_close, drm.drm_gem_close, _W)}
        if abi == "rknpu":
            driver = {
                rk.Nr.ACTION: _Ioctl(self._rk_action, rk.rknpu_action, _RW),
                rk.Nr.SUBMIT: _Ioctl(self._rk_submit, rk.submit_struct_for(self.driver_version), _RW),
                rk.Nr.MEM_CREATE: _Ioctl(self._rk_mem_create, rk.mem_create_struct_for(self.driver_version), _RW),
                rk.Nr.MEM_MAP: _Ioctl(self._rk_mem_map, rk.rknpu_mem_map, _RW),
                rk.Nr.MEM_DESTROY: _Ioctl(self._rk_mem_destroy, rk.rknpu_mem_destroy, _RW),
                rk.Nr.MEM_SYNC: _Ioctl(self._rk_mem_sync, rk.rknpu_mem_sync, _RW),
            }
        else:
            driver = {
                ro.Nr.CREATE_BO: _Ioctl(self._ro_create_bo, ro.drm_rocket_create_bo, _RW),
                ro.Nr.SUBMIT: _Ioctl(self._ro_submit, ro.drm_rocket_submit, _W),
                ro.Nr.PREP_BO: _Ioctl(self._ro_prep_bo, ro.drm_rocket_prep_bo, _W),
                ro.Nr.FINI_BO: _Ioctl(self._ro_fini_bo, ro.drm_rocket_fini_bo, _W),
            }
        self._ioctls = {**core, **{drm.DRM_COMMAND_BASE + int(nr): v for nr, v in driver.items()}}

    # ------------------------------------------------------------------ Syscalls
    def listdir(self, path: str) -> list[str]:
        return list(self.nodes.get(path.rstrip("/"), []))

    def exists(self, path: str) -> bool:
        return path in self._device_paths() or path.rstrip("/") in self.nodes

    def read_text(self, path: str) -> str:
        raise FileNotFoundError(errno.ENOENT, f"{path}: not present in the simulated {self.abi} system", path)

    def open(self, path: str, flags: int = os.O_RDWR) -> int:
        if path not in self._device_paths():
            raise _fail(errno.ENOENT, f"{path}: no such device in the simulated {self.abi} system "
                                      f"(it has {', '.join(self._device_paths())})")
        fd = self._next_fd
        self._next_fd += 1
        self._files[fd] = _File(path, domain=_drm_mm_domain(*self.iova_window) if self.abi == "rocket" else None)
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
            raise _fail(errno.ENOTTY, f"ioctl {request:#x} is not a DRM ioctl (type {req.type:#x}, expected 'd')")
        entry = self._ioctls.get(req.nr)
        if entry is None:
            raise _fail(errno.EINVAL, f"ioctl nr {req.nr:#x} is not implemented by the {self.abi} driver")
        if len(arg) < req.size:
            raise _fail(errno.EFAULT, f"ioctl {request:#x} says {req.size} bytes but the argument buffer has {len(arg)}")
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
            raise _fail(errno.EINVAL, f"mmap offset {offset:#x} is not a buffer's fake offset; use the offset "
                                      "MEM_MAP / CREATE_BO returned")
        if obj not in f.handles.values():
            raise _fail(errno.EACCES, "mmap of a buffer this file has no handle for")
        if length <= 0 or length > obj.size:
            raise _fail(errno.EINVAL, f"mmap length {length} is outside the {obj.size}-byte buffer")
        # numpy's stubs give ndarray its buffer protocol only on Python >= 3.12; it has one on every version
        view = memoryview(obj.cpu[:length])  # type: ignore[arg-type]
        obj.mappings += 1
        self._maps[id(view)] = (view, obj)
        return view

    def munmap(self, view: memoryview) -> None:
        entry = self._maps.pop(id(view), None)
        if entry is None:
            raise _fail(errno.EINVAL, "munmap of a view that is not a live mapping of this simulated device")
        obj = entry[1]
        obj.mappings -= 1
        self._maybe_free(obj)

    # ------------------------------------------------------------------ state for tests / tools
    def stats(self) -> dict[str, int]:
        """Live objects, mappings, handles and used address space (leak checks)."""
        domains = [self._shared_domain] if self._shared_domain else [f.domain for f in self._files.values()]
        return {
            "objects": len(self._objects),
            "mappings": len(self._maps),
            "handles": sum(len(f.handles) for f in self._files.values()),
            "iova_used": sum(d.iova.total - d.iova.free_bytes for d in domains if d),
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

    def _file(self, fd: int) -> _File:
        f = self._files.get(fd)
        if f is None:
            raise _fail(errno.EBADF, f"fd {fd} is not an open simulated {self.abi} device")
        return f

    def _domain(self, f: _File) -> IommuDomain:
        domain = self._shared_domain or f.domain
        assert domain is not None
        return domain

    def _log(self, line: str) -> None:
        self.log_line(f"{self.abi.upper()}: {line}")

    def log_line(self, line: str) -> None:
        """Append to ``dmesg``, which keeps the last ``DMESG_LINES`` lines like the kernel's ring
        buffer (a server injecting faults for days must not keep every line)."""
        self.dmesg.append(line)
        if len(self.dmesg) > DMESG_LINES:
            del self.dmesg[:len(self.dmesg) - DMESG_LINES // 2]

    def _new_object(self, f: _File, size: int, flags: int, cached: bool) -> tuple[int, GemObject]:
        if size <= 0:
            raise _fail(errno.EINVAL, f"buffer size must be > 0 (got {size})")
        aligned = page_align(size)
        if self._allocated + aligned > self.memory_limit:
            raise _fail(errno.ENOMEM, f"out of memory: {aligned} bytes requested, {self.memory_limit - self._allocated} "
                                      f"of {self.memory_limit} left; free buffers first")
        obj = GemObject(aligned, flags, self._next_obj_addr, cached and not self.coherent)
        domain = self._domain(f)
        if not domain.map(obj):
            it = domain.iova
            raise _fail(errno.ENOMEM, f"NPU address space exhausted: no free IOVA range of {aligned} bytes "
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
                raise _fail(errno.ENOMEM, "fake mmap offset space exhausted")
            obj.mmap_offset = start
            self._by_offset[start] = obj
        return obj.mmap_offset

    def _drop_handle(self, f: _File, handle: int) -> None:
        obj = f.handles.pop(handle)
        obj.handle_refs -= 1
        self._maybe_free(obj)

    def _maybe_free(self, obj: GemObject) -> None:
        if obj.alive or obj.obj_addr not in self._objects:
            return
        del self._objects[obj.obj_addr]
        self._cpu_synced.pop(obj.obj_addr, None)
        if obj.domain is not None:
            decoded = self._decoded()
            if decoded is not None:
                decoded.forget(obj.dma_addr, obj.size)
            obj.domain.unmap(obj)
        if obj.mmap_offset is not None:
            self._offsets.free(obj.mmap_offset)
            del self._by_offset[obj.mmap_offset]
        self._allocated -= obj.size

    def _lookup_handle(self, f: _File, handle: int, code: int, what: str) -> GemObject:
        obj = f.handles.get(handle)
        if obj is None:
            raise _fail(code, f"{what}: handle {handle} is not open on this fd (destroyed already, or from another fd?)")
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
                raise _fail(errno.ENODEV, f"no NPU model attached: ggml_rknpu.sim.npu is not available ({exc}); "
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
    def _drm_version(self, f: _File, v: drm.drm_version) -> None:
        major, minor, patch = self.driver_version
        v.version_major, v.version_minor, v.version_patchlevel = major, minor, patch
        name = self.abi
        desc = "RKNPU driver" if self.abi == "rknpu" else "rocket DRM"  # [VEND rknpu_drv.h; ROCKET rocket_drv.c]
        date = DRIVER_DATES.get(self.driver_version, "unknown") if self.abi == "rknpu" else "unknown"
        for field_name, text in (("name", name), ("date", date), ("desc", desc)):
            data = text.encode()
            capacity = getattr(v, f"{field_name}_len")
            pointer = getattr(v, field_name)
            if capacity and not pointer:
                raise _fail(errno.EFAULT, f"DRM_IOCTL_VERSION: {field_name}_len={capacity} but {field_name} is NULL")
            if capacity:
                ctypes.memmove(pointer, data, min(capacity, len(data)))  # copy_to_user
            setattr(v, f"{field_name}_len", len(data))

    def _gem_close(self, f: _File, c: drm.drm_gem_close) -> None:
        if c.handle not in f.handles:
            raise _fail(errno.EINVAL, f"GEM_CLOSE: handle {c.handle} is not open on this fd")
        self._drop_handle(f, c.handle)

    # ------------------------------------------------------------------ vendor rknpu
    def _rk_action(self, f: _File, a: rk.rknpu_action) -> None:
        try:
            action = rk.Action(a.flags)
        except ValueError:
            raise _fail(errno.EINVAL, f"ACTION {a.flags} is not a known RKNPU action (see kernel.rknpu.uapi.Action)") from None
        if action == rk.Action.POWER_ON:
            self._power_refs += 1
            self.powered = True
            # The 0.9.8 driver powers on and still returns EINVAL: its second switch has no
            # case for POWER_ON/OFF [capture pw_c256_h14: "ACTION flags=0x14 ret=-1"].
            raise _fail(errno.EINVAL, "POWER_ON done (driver 0.9.x reports EINVAL for POWER_ON/OFF)")
        if action == rk.Action.POWER_OFF:
            if self.powered and self._power_refs > 0:
                self._power_refs -= 1
                self.powered = self._power_refs > 0
            raise _fail(errno.EINVAL, "POWER_OFF done (driver 0.9.x reports EINVAL for POWER_ON/OFF)")
        self.powered = True  # [VEND rknpu_action] every other action powers the NPU on first
        getters = {
            rk.Action.GET_HW_VERSION: HW_VERSION,
            rk.Action.GET_DRV_VERSION: rk.encode_drv_version(*self.driver_version),
            rk.Action.GET_FREQ: self.freq_hz,
            rk.Action.GET_VOLT: self.volt_uv,
            rk.Action.GET_IOMMU_EN: 1,  # inference: captured dma addresses are IOVAs (0xfff9f000...)
            rk.Action.GET_TOTAL_SRAM_SIZE: 0,  # guess: no SRAM reserved for the NPU on common RK3588 DTs
            rk.Action.GET_FREE_SRAM_SIZE: 0,
            rk.Action.GET_IOMMU_DOMAIN_ID: 0,
        }
        if action in getters:
            a.value = getters[action]
        elif action == rk.Action.SET_FREQ:
            self.freq_hz = a.value
        elif action == rk.Action.SET_VOLT:
            self.volt_uv = a.value
        elif action == rk.Action.ACT_RESET:
            if self._npu is not None:
                self._npu.soft_reset(None)
            self._log("soft reset")
        elif action == rk.Action.SET_IOMMU_DOMAIN_ID:
            if a.value != 0:
                raise _fail(errno.EINVAL, "the simulator models IOMMU domain 0 only")
        elif action in (rk.Action.GET_BW_PRIORITY, rk.Action.GET_BW_EXPECT, rk.Action.GET_BW_TW,
                        rk.Action.GET_DT_WR_AMOUNT, rk.Action.GET_DT_RD_AMOUNT, rk.Action.GET_WT_RD_AMOUNT,
                        rk.Action.GET_TOTAL_RW_AMOUNT):
            a.value = 0  # bandwidth counters are not modelled
        # SET_PROC_NICE, SET_BW_*, ACT_CLR_TOTAL_RW_AMOUNT: accepted, nothing to model

    def _rk_mem_create(self, f: _File, m: ctypes.Structure) -> None:
        if getattr(m, "iommu_domain_id", 0) != 0:
            raise _fail(errno.EINVAL, "MEM_CREATE: the simulator models IOMMU domain 0 only")
        handle, obj = self._new_object(f, m.size, m.flags, cached=bool(m.flags & rk.MemFlag.CACHEABLE))
        m.handle, m.size, m.obj_addr, m.dma_addr, m.sram_size = handle, obj.size, obj.obj_addr, obj.dma_addr, 0

    def _rk_mem_map(self, f: _File, m: rk.rknpu_mem_map) -> None:
        m.offset = self._mmap_offset(self._lookup_handle(f, m.handle, errno.EINVAL, "MEM_MAP"))

    def _rk_mem_destroy(self, f: _File, m: rk.rknpu_mem_destroy) -> None:
        obj = self._lookup_handle(f, m.handle, errno.EINVAL, "MEM_DESTROY")
        if m.obj_addr != obj.obj_addr:
            raise _fail(errno.EINVAL, f"MEM_DESTROY: obj_addr {m.obj_addr:#x} is not handle {m.handle}'s "
                                      f"({obj.obj_addr:#x}); destroy with the handle+obj_addr MEM_CREATE returned")
        self._drop_handle(f, m.handle)

    def _rk_object(self, obj_addr: int, what: str) -> GemObject:
        obj = self._objects.get(obj_addr)
        if obj is None:
            # The real driver casts obj_addr to a kernel pointer; a stale one is a use-after-free.
            raise _fail(errno.EFAULT, f"{what}: obj_addr {obj_addr:#x} is not a live buffer (destroyed, or not "
                                      "the obj_addr MEM_CREATE returned)")
        return obj

    def _rk_mem_sync(self, f: _File, s: rk.rknpu_mem_sync) -> None:
        obj = self._rk_object(s.obj_addr, "MEM_SYNC")
        if not obj.flags & _CACHEABLE:
            raise _fail(errno.EINVAL, "MEM_SYNC on a buffer created without RKNPU_MEM_CACHEABLE: uncached buffers "
                                      "need no sync (the driver refuses it)")
        if s.offset + s.size > obj.size:
            raise _fail(errno.EINVAL, f"MEM_SYNC range [{s.offset}, {s.offset + s.size}) is outside the "
                                      f"{obj.size}-byte buffer")
        if s.flags & ~(_TO_DEVICE | _FROM_DEVICE):
            raise _fail(errno.EINVAL, f"MEM_SYNC flags {s.flags:#x}: only TO_DEVICE(1) | FROM_DEVICE(2) exist")
        if s.flags & _TO_DEVICE:
            obj.sync_for_device(s.offset, s.size)
        if s.flags & _FROM_DEVICE:
            obj.sync_for_cpu(s.offset, s.size)

    def _rk_core_ranges(self, s: ctypes.Structure) -> dict[int, tuple[int, int]]:
        """core -> (task_start, task_number) by the §4 core_mask/subcore_task rules."""
        mask = s.core_mask & rk.CORE_MASK_ALL
        if mask == 0:  # AUTO: the least-loaded core, use_core_num = 1; all idle here, so core 0
            cores = [0]
        else:
            cores = [i for i in range(self.n_cores) if mask >> i & 1]
        if s.core_mask & ~((1 << self.n_cores) - 1):
            raise _fail(errno.EINVAL, f"core_mask {s.core_mask:#x} selects cores this NPU does not have "
                                      f"({self.n_cores} cores: mask bits 0..{self.n_cores - 1})")
        slot = 2 if len(cores) == 3 else 0  # 3 cores: subcore_task[i+2]; 1-2 cores: subcore_task[i]
        return {c: (s.subcore_task[c + slot].task_start, s.subcore_task[c + slot].task_number) for c in cores}

    def _rk_commit(self, npu: NpuModel, core: int, tasks, start: int, number: int, pp_en: int,
                   task_base_addr: int) -> tuple[int, str | None]:
        """rknpu_job_commit_pc for one core and its IRQ handler: (INT_STATUS, failure or None)."""
        first, last = tasks[start], tasks[start + number - 1]
        amount = ceil_div(first.regcfg_amount + rk.PC_DATA_EXTRA_AMOUNT, rk.PC_DATA_AMOUNT_SCALE) - 1
        pointer = S_POINTER_PP + S_POINTER_CORE_BIT * core
        fault = self._run(npu, core, [
            (PC_BASE_ADDRESS, 1),
            (CNA_S_POINTER, pointer),
            (CORE_S_POINTER, pointer),
            (PC_BASE_ADDRESS, first.regcmd_addr),
            (PC_REGISTER_AMOUNTS, amount),
            (PC_INTERRUPT_MASK, last.int_mask),
            (PC_INTERRUPT_CLEAR, first.int_mask),
            (PC_TASK_CON, ((0x6 | pp_en) << 12) | number),
            (PC_TASK_DMA_BASE_ADDR, task_base_addr),
            (PC_OPERATION_ENABLE, 1),
            (PC_OPERATION_ENABLE, 0),
        ])
        if fault:
            return 0, fault
        status = npu.mmio_read(core, PC_INTERRUPT_STATUS)  # rknpu_irq_handler
        failure = None
        if status == 0:
            failure = "no interrupt (the task list did not finish)"
        elif fuzz_status(status) != last.int_mask:
            raw = npu.mmio_read(core, PC_INTERRUPT_RAW_STATUS)
            counter = npu.mmio_read(core, PC_TASK_STATUS) & rk.PC_TASK_NUMBER_MASK
            self._log(f"invalid irq status: {status:#x}, raw status: {raw:#x}, require mask: {last.int_mask:#x}, "
                      f"task counter: {counter:#x}")
            failure = (f"invalid irq status {status:#x} (fuzzed {fuzz_status(status):#x}) != last task's int_mask "
                       f"{last.int_mask:#x}; int_mask must be the whole bit pair of the block that finishes the "
                       "task, e.g. 0x300 for DPU, 0xc00 for PPU")
        npu.mmio_write(core, PC_INTERRUPT_CLEAR, INT_CLEAR_ALL)
        return status, failure

    def _rk_submit(self, f: _File, s: ctypes.Structure) -> None:
        if s.task_number == 0:
            raise _fail(errno.EINVAL, "SUBMIT: invalid rknpu task number 0")
        if not s.flags & _JOB_PC:
            raise _fail(errno.EINVAL, "SUBMIT: flags must include RKNPU_JOB_PC (1); only PC mode exists on RK3588")
        unsupported = s.flags & _JOB_UNMODELED
        if unsupported:
            raise _fail(errno.EINVAL, f"SUBMIT: flags {unsupported:#x} (NONBLOCK/FENCE_*) are not modelled by the "
                                      "simulator; submit blocking")
        if s.task_obj_addr == 0:
            raise _fail(errno.EINVAL, "SUBMIT: task_obj_addr is 0; pass the task BO's obj_addr")
        task_obj = self._rk_object(s.task_obj_addr, "SUBMIT task_obj_addr")
        if not task_obj.flags & _KERNEL_MAPPING:
            raise _fail(errno.EINVAL, "SUBMIT: the task BO was created without RKNPU_MEM_KERNEL_MAPPING, so the "
                                      "kernel cannot read the rknpu_task array (create it with flags 0x40b)")
        ranges = self._rk_core_ranges(s)
        n_slots = task_obj.size // ctypes.sizeof(rk.rknpu_task)
        for core, (start, number) in ranges.items():
            if number == 0:
                raise _fail(errno.EINVAL, f"SUBMIT: core {core} is selected but its subcore_task entry has "
                                          "task_number 0 (1-2 cores: subcore_task[i]; 3 cores: subcore_task[i+2])")
            if number > rk.MAX_SUBMIT_TASKS and self.driver_version < rk.NEW_ABI_VERSION:
                # the old commit ORs the count into TASK_CON, overflowing into the ping-pong bits
                raise _fail(errno.EINVAL, f"SUBMIT: {number} tasks on core {core}; driver "
                                          f"{'.'.join(map(str, self.driver_version))} puts at most "
                                          f"{rk.MAX_SUBMIT_TASKS} in TASK_CON per hardware run - split the job")
            if start + number > n_slots:
                raise _fail(errno.EINVAL, f"SUBMIT: tasks [{start}, {start + number}) of core {core} run past the "
                                          f"{n_slots} rknpu_task slots of the task BO")
        npu = self._npu_model()
        # the kernel mapping (numpy's stubs give ndarray its buffer protocol only on Python >= 3.12)
        tasks = (rk.rknpu_task * n_slots).from_buffer(task_obj.cpu)  # type: ignore[arg-type]
        pp_en = 1 if s.flags & _JOB_PINGPONG else 0
        self.powered = True
        first_core = min(ranges)
        int_status: dict[int, int] = {}
        failures: dict[int, str] = {}
        inject, self.inject = self.inject, None
        if inject == "timeout":
            failures[first_core] = "injected hang (simulator fault hook)"
        for core, (start, number) in ranges.items():
            if failures:
                break
            # 0.9.8 re-issues lists longer than max_submit_number in chunks from its IRQ path
            for chunk in range(start, start + number, rk.MAX_SUBMIT_TASKS):
                count = min(rk.MAX_SUBMIT_TASKS, start + number - chunk)
                if inject == "stale" and core == first_core and chunk + count == start + number:
                    count -= 1  # the chain's last task silently dropped (fault hook)
                    if count == 0:
                        continue
                status, failure = self._rk_commit(npu, core, tasks, chunk, count, pp_en, s.task_base_addr)
                int_status[core] = status
                if failure:
                    failures[core] = failure
                    break
        start, number = ranges[first_core]
        last_index = start + number - 1
        status = int_status.get(first_core, 0)
        tasks[last_index].int_status = status  # written through the kernel mapping (CPU side)
        task_obj.sync_for_device(last_index * ctypes.sizeof(rk.rknpu_task), ctypes.sizeof(rk.rknpu_task))
        if hasattr(s, "hw_elapse_time"):
            s.hw_elapse_time = 0  # no hardware clock in the simulator
        if not failures:
            s.task_counter = s.task_number
            return
        s.task_counter = npu.mmio_read(first_core, PC_TASK_STATUS) & rk.PC_TASK_NUMBER_MASK
        lines = []
        for core, why in failures.items():
            lines.append(f"core {core}: {why}")
            lines.extend(f"core {core}: {d}" for d in self._diagnostics(npu, core))
        for line in lines:
            self._log(line)
        npu.soft_reset(None)  # rknpu_job_abort -> rknpu_soft_reset (whole NPU)
        self._log("soft reset after failed job")
        dma = [c for c, why in failures.items() if why.startswith("NPU DMA fault")]
        code = errno.EFAULT if dma else errno.ETIMEDOUT
        head = ("SUBMIT: NPU DMA fault (a board reports this as an IOMMU page fault and a job timeout)" if dma else
                f"SUBMIT: job timeout after {s.timeout} ms (simulated time: no wall-clock wait)")
        raise _fail(code, f"{head}; task_counter={s.task_counter}; " + "; ".join(lines) + "; the NPU was soft-reset")

    # ------------------------------------------------------------------ mainline rocket
    def _ro_create_bo(self, f: _File, c: ro.drm_rocket_create_bo) -> None:
        handle, obj = self._new_object(f, c.size, 0, cached=True)  # shmem: always CPU-cached
        c.handle, c.dma_address, c.offset = handle, obj.dma_addr, self._mmap_offset(obj)

    def _ro_fini_bo(self, f: _File, c: ro.drm_rocket_fini_bo) -> None:
        if c.reserved:
            raise _fail(errno.EINVAL, "FINI_BO: reserved must be 0")
        obj = self._lookup_handle(f, c.handle, errno.ENOENT, "FINI_BO")
        self._write_back_dirty_lines(obj)  # dma_sync_sgtable_for_device: clean

    def _ro_prep_bo(self, f: _File, c: ro.drm_rocket_prep_bo) -> None:
        if c.reserved:
            raise _fail(errno.EINVAL, "PREP_BO: reserved must be 0")
        obj = self._lookup_handle(f, c.handle, errno.ENOENT, "PREP_BO")
        failed, obj.failed_job = obj.failed_job, None
        self._write_back_dirty_lines(obj)  # dma_sync_sgtable_for_cpu: dirty lines survive,
        obj.sync_for_cpu(0, obj.size)      # then the CPU sees what DRAM holds
        if obj.cached:
            self._cpu_synced[obj.obj_addr] = obj.cpu.copy()
        if failed and self.rocket_errors == "loud":
            raise _fail(errno.ETIMEDOUT, f"PREP_BO: the job writing this BO failed: {failed}")

    def _write_back_dirty_lines(self, obj: GemObject) -> None:
        """Copy to DRAM the 64-byte lines the CPU changed since the object's last sync."""
        if not obj.cached:
            return
        synced = self._cpu_synced.get(obj.obj_addr)
        if synced is None:           # never synced: every line may be dirty
            obj.sync_for_device(0, obj.size)
        else:
            changed = (obj.cpu != synced).reshape(-1, CACHE_LINE).any(axis=1)
            obj.write_back(np.repeat(changed, CACHE_LINE))
        self._cpu_synced[obj.obj_addr] = obj.cpu.copy()

    def _modeled_task_s(self, regcmd: int, count: int) -> float:
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
            raise _fail(errno.EFAULT, f"{what}: bad user pointer {address:#x}")
        return ctypes.string_at(address, nbytes)

    def _ro_submit(self, f: _File, s: ro.drm_rocket_submit) -> None:
        if s.job_count == 0:
            return
        if s.job_struct_size < ctypes.sizeof(ro.drm_rocket_job):
            raise _fail(errno.EINVAL, f"SUBMIT: job_struct_size {s.job_struct_size} is smaller than "
                                      f"sizeof(drm_rocket_job) = {ctypes.sizeof(ro.drm_rocket_job)}")
        if s.reserved:
            raise _fail(errno.EINVAL, "SUBMIT: the reserved field of drm_rocket_submit must be 0")
        jobs = [ro.drm_rocket_job.from_buffer_copy(self._copy_from_user(
            s.jobs + i * s.job_struct_size, ctypes.sizeof(ro.drm_rocket_job), "SUBMIT jobs")) for i in range(s.job_count)]
        parsed = [self._ro_parse_job(f, i, job) for i, job in enumerate(jobs)]
        npu = self._npu_model()
        self.mmu.attach(self._domain(f))  # rocket_job_run: attach the file's domain to the core
        inject, self.inject = self.inject, None
        for tasks, outs in parsed:
            if tasks:
                self._ro_run_job(npu, tasks, outs, inject)
                inject = None

    def _ro_parse_job(self, f: _File, index: int, job: ro.drm_rocket_job) -> tuple[list[tuple[int, int]], list[GemObject]]:
        if job.task_struct_size < ctypes.sizeof(ro.drm_rocket_task):
            raise _fail(errno.EINVAL, f"SUBMIT job {index}: task_struct_size {job.task_struct_size} < 8")
        tasks = []
        for t in range(job.task_count):
            task = ro.drm_rocket_task.from_buffer_copy(self._copy_from_user(
                job.tasks + t * job.task_struct_size, ctypes.sizeof(ro.drm_rocket_task), f"SUBMIT job {index} tasks"))
            if task.regcmd_count == 0:
                raise _fail(errno.EINVAL, f"SUBMIT job {index} task {t}: regcmd_count must be > 0 (it counts the "
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

    def _ro_run_job(self, npu: NpuModel, tasks: list[tuple[int, int]], outs: list[GemObject], inject: str | None = None) -> None:
        core = self._next_core  # the scheduler's choice; round robin here
        self._next_core = (self._next_core + 1) % self.n_cores
        pointer = S_POINTER_PP + S_POINTER_CORE_BIT * core
        elapsed_s, timeout_s = 0.0, ROCKET_JOB_TIMEOUT_MS / 1e3
        if inject == "stale":
            tasks = tasks[:-1]       # the job's last task silently dropped (fault hook)
        for i, (regcmd, count) in enumerate(tasks):  # rocket_job_hw_submit, one task per hardware run
            elapsed_s += timeout_s if inject == "timeout" else self._modeled_task_s(regcmd, count)
            if elapsed_s > timeout_s:  # rocket_job_timedout: the task in flight never finishes
                self._log(f"core {core}: NPU job timed out (task {i} of {len(tasks)}, {elapsed_s * 1e3:.0f} ms "
                          f"modeled at {self.rocket_mhz:g} MHz > JOB_TIMEOUT_MS {ROCKET_JOB_TIMEOUT_MS}); core reset")
                npu.soft_reset(core)
                for obj in outs:
                    obj.failed_job = f"job timed out after task {i - 1} ({elapsed_s * 1e3:.0f} ms modeled)"
                return
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
                return
            npu.mmio_write(core, PC_OPERATION_ENABLE, 0)  # the IRQ thread
            npu.mmio_write(core, PC_INTERRUPT_CLEAR, INT_CLEAR_ALL)
