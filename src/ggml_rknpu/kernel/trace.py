"""``TracingSyscalls``: every syscall of the NPU stack, decoded, one line each.

Because all open/ioctl/mmap/munmap/close calls go through one ``Syscalls`` object, a
wrapper sees the whole conversation with the kernel - on a board or on the simulator -
and can print it with the struct fields named (the role tinygrad's ``IOCTL=1`` sniffers
play [docs/anchors.md §1a]). ``ggml_rknpu.devices.open_device`` wraps its syscalls in this when the
environment variable ``RKNPU_TRACE`` is set (``1``/``stderr``: standard error; anything
else: a file path to append to).
"""

from __future__ import annotations

import ctypes
import os
import sys as _sys
import time
from collections.abc import Callable

from ggml_rknpu.kernel import drm
from ggml_rknpu.kernel.rknpu import uapi as rk
from ggml_rknpu.kernel.rocket import uapi as ro
from ggml_rknpu.kernel.syscalls import Syscalls

# request number -> (name, struct used to decode it). The vendor SUBMIT has one request number
# for both layouts (fields 32..55 differ, see rknpu.uapi): decoded with the one of the driver
# version the traced fd reported (ACTION GET_DRV_VERSION), that of 0.9.5 on until it has.
IOCTLS: dict[int, tuple[str, type[ctypes.Structure]]] = {
    drm.DRM_IOCTL_VERSION: ("DRM_IOCTL_VERSION", drm.drm_version),
    drm.DRM_IOCTL_GEM_CLOSE: ("DRM_IOCTL_GEM_CLOSE", drm.drm_gem_close),
    rk.DRM_IOCTL_RKNPU_ACTION: ("RKNPU_ACTION", rk.rknpu_action),
    rk.DRM_IOCTL_RKNPU_SUBMIT: ("RKNPU_SUBMIT", rk.rknpu_submit_v095),
    rk.DRM_IOCTL_RKNPU_MEM_CREATE_40: ("RKNPU_MEM_CREATE(40)", rk.rknpu_mem_create_v40),
    rk.DRM_IOCTL_RKNPU_MEM_CREATE_48: ("RKNPU_MEM_CREATE(48)", rk.rknpu_mem_create_v48),
    rk.DRM_IOCTL_RKNPU_MEM_MAP: ("RKNPU_MEM_MAP", rk.rknpu_mem_map),
    rk.DRM_IOCTL_RKNPU_MEM_DESTROY: ("RKNPU_MEM_DESTROY", rk.rknpu_mem_destroy),
    rk.DRM_IOCTL_RKNPU_MEM_SYNC: ("RKNPU_MEM_SYNC", rk.rknpu_mem_sync),
    ro.DRM_IOCTL_ROCKET_CREATE_BO: ("ROCKET_CREATE_BO", ro.drm_rocket_create_bo),
    ro.DRM_IOCTL_ROCKET_SUBMIT: ("ROCKET_SUBMIT", ro.drm_rocket_submit),
    ro.DRM_IOCTL_ROCKET_PREP_BO: ("ROCKET_PREP_BO", ro.drm_rocket_prep_bo),
    ro.DRM_IOCTL_ROCKET_FINI_BO: ("ROCKET_FINI_BO", ro.drm_rocket_fini_bo),
}


_HEX_FIELDS = ("flags", "mask", "addr", "offset")


def format_struct(s: ctypes.Structure) -> str:
    """``field=value`` pairs: bit sets, addresses and big numbers in hex, counts in decimal."""
    parts = []
    for name, *_ in s._fields_:
        value = getattr(s, name)
        if isinstance(value, ctypes.Array):
            items = [tuple(getattr(e, f) for f, *_ in e._fields_) if isinstance(e, ctypes.Structure) else e
                     for e in value]
            parts.append(f"{name}={items}")
        elif isinstance(value, int):
            as_hex = abs(value) >= 4096 or any(k in name for k in _HEX_FIELDS)
            parts.append(f"{name}={value:#x}" if as_hex else f"{name}={value}")
        else:
            parts.append(f"{name}={value}")
    return " ".join(parts)


class _Wrapping:
    """A ``Syscalls`` around another one: every call passes through unless overridden."""

    def __init__(self, inner: Syscalls) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        # simulator extras (stats, dmesg, address_space, simulation_seconds...) stay reachable
        return getattr(self.inner, name)

    def open(self, path: str, flags: int = os.O_RDWR) -> int:
        return self.inner.open(path, flags)

    def close(self, fd: int) -> None:
        self.inner.close(fd)

    def ioctl(self, fd: int, request: int, arg: bytearray) -> int:
        return self.inner.ioctl(fd, request, arg)

    def mmap(self, fd: int, length: int, offset: int) -> memoryview:
        return self.inner.mmap(fd, length, offset)

    def munmap(self, view: memoryview) -> None:
        self.inner.munmap(view)

    def listdir(self, path: str) -> list[str]:
        return self.inner.listdir(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def read_text(self, path: str) -> str:
        return self.inner.read_text(path)


class TracingSyscalls(_Wrapping):
    """Wraps any ``Syscalls``; calls ``log`` with one decoded line per call."""

    def __init__(self, inner: Syscalls, log: Callable[[str], None]) -> None:
        super().__init__(inner)
        self.log = log
        self._submit_structs: dict[int, type[ctypes.Structure]] = {}   # fd -> its driver's rknpu_submit

    def open(self, path: str, flags: int = os.O_RDWR) -> int:
        try:
            fd = self.inner.open(path, flags)
        except OSError as exc:
            self.log(f"open({path}) -> errno {exc.errno} ({exc.strerror})")
            raise
        self.log(f"open({path}) -> fd {fd}")
        return fd

    def close(self, fd: int) -> None:
        self.log(f"close({fd})")
        self.inner.close(fd)

    def ioctl(self, fd: int, request: int, arg: bytearray) -> int:
        name, struct = IOCTLS.get(request, (f"ioctl {request:#x}", None))
        if request == rk.DRM_IOCTL_RKNPU_SUBMIT:
            struct = self._submit_structs.get(fd, struct)
        decode = struct if struct is not None and len(arg) >= ctypes.sizeof(struct) else None
        if decode is not None:
            self.log(f"{name}(fd {fd}) in:  {format_struct(decode.from_buffer_copy(arg))}")
        try:
            ret = self.inner.ioctl(fd, request, arg)
        except OSError as exc:
            self.log(f"{name}(fd {fd}) -> errno {exc.errno} ({exc.strerror})")
            raise
        out = f" out: {format_struct(decode.from_buffer_copy(arg))}" if decode is not None else ""
        self.log(f"{name}(fd {fd}) -> {ret}{out}")
        if request == rk.DRM_IOCTL_RKNPU_ACTION and decode is not None:
            action = rk.rknpu_action.from_buffer_copy(arg)
            if action.flags == rk.Action.GET_DRV_VERSION:
                self._submit_structs[fd] = rk.submit_struct_for(rk.decode_drv_version(action.value))
        return ret

    def mmap(self, fd: int, length: int, offset: int) -> memoryview:
        view = self.inner.mmap(fd, length, offset)
        self.log(f"mmap(fd {fd}, {length} bytes, offset {offset:#x})")
        return view

    def munmap(self, view: memoryview) -> None:
        self.log(f"munmap({view.nbytes} bytes)")
        self.inner.munmap(view)


class TimingSyscalls(_Wrapping):
    """Wraps any ``Syscalls``; counts ioctls by name and the wall time spent inside them.

    WHY: a per-submit host budget must tell our own work (packing, the driver wrappers) from
    the kernel's; off a board the "kernel" is the simulator, whose time is not a host cost
    of the board (``rknpu bench npu-submit``)."""

    def __init__(self, inner: Syscalls) -> None:
        super().__init__(inner)
        self.calls: dict[str, int] = {}
        self.ns: dict[str, int] = {}

    def ioctl(self, fd: int, request: int, arg: bytearray) -> int:
        t0 = time.perf_counter_ns()
        try:
            return self.inner.ioctl(fd, request, arg)
        finally:
            spent = time.perf_counter_ns() - t0
            name = IOCTLS.get(request, (f"ioctl {request:#x}", None))[0]
            self.calls[name] = self.calls.get(name, 0) + 1
            self.ns[name] = self.ns.get(name, 0) + spent

    def clear(self) -> None:
        """Start counting afresh."""
        self.calls.clear()
        self.ns.clear()


def from_environment(inner: Syscalls) -> Syscalls:
    """``inner`` wrapped for tracing when ``RKNPU_TRACE`` is set, else ``inner``."""
    target = os.environ.get("RKNPU_TRACE", "")
    if not target or target == "0":
        return inner
    if target in ("1", "stderr"):
        return TracingSyscalls(inner, lambda line: print(f"[rknpu] {line}", file=_sys.stderr))

    def append(line: str) -> None:
        with open(target, "a") as f:
            f.write(line + "\n")

    return TracingSyscalls(inner, append)
