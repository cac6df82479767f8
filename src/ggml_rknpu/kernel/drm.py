"""Linux ioctl request encoding and the two generic DRM ioctls both NPU drivers share.

Request numbers are computed from (direction, type, nr, struct size) exactly like
``<asm-generic/ioctl.h>`` does on arm64 and x86-64 (8-bit nr, 8-bit type, 14-bit size,
2-bit direction), so a struct whose size changes changes its request number - which is
how the kernel tells the 40- and 48-byte ``rknpu_mem_create`` apart.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from ggml_rknpu.kernel.errors import ioctl_error
from ggml_rknpu.kernel.syscalls import Syscalls

# [asm-generic/ioctl.h] field widths and shifts
_IOC_NRBITS, _IOC_TYPEBITS, _IOC_SIZEBITS = 8, 8, 14
_IOC_NRSHIFT = 0
_IOC_TYPESHIFT = _IOC_NRSHIFT + _IOC_NRBITS
_IOC_SIZESHIFT = _IOC_TYPESHIFT + _IOC_TYPEBITS
_IOC_DIRSHIFT = _IOC_SIZESHIFT + _IOC_SIZEBITS
IOC_NONE, IOC_WRITE, IOC_READ = 0, 1, 2

DRM_IOCTL_BASE = ord("d")  # [drm.h] 0x64
DRM_COMMAND_BASE = 0x40  # [drm.h] first driver-private nr


def _IOC(direction: int, type_: int, nr: int, size: int) -> int:
    if not 0 <= size < (1 << _IOC_SIZEBITS):
        raise ValueError(f"ioctl struct size {size} does not fit the 14-bit size field")
    return (direction << _IOC_DIRSHIFT) | (size << _IOC_SIZESHIFT) | (type_ << _IOC_TYPESHIFT) | (nr << _IOC_NRSHIFT)


def _IOW(type_: int, nr: int, size: int) -> int:
    return _IOC(IOC_WRITE, type_, nr, size)


def _IOR(type_: int, nr: int, size: int) -> int:
    return _IOC(IOC_READ, type_, nr, size)


def _IOWR(type_: int, nr: int, size: int) -> int:
    return _IOC(IOC_READ | IOC_WRITE, type_, nr, size)


def DRM_IOWR(nr: int, struct: type[ctypes.Structure]) -> int:
    return _IOWR(DRM_IOCTL_BASE, nr, ctypes.sizeof(struct))


def DRM_IOW(nr: int, struct: type[ctypes.Structure]) -> int:
    return _IOW(DRM_IOCTL_BASE, nr, ctypes.sizeof(struct))


@dataclass(frozen=True)
class IoctlRequest:
    """A request number taken apart (what a kernel's dispatcher looks at)."""

    direction: int
    type: int
    nr: int
    size: int


def decode_request(request: int) -> IoctlRequest:
    return IoctlRequest(
        direction=(request >> _IOC_DIRSHIFT) & 0x3,
        type=(request >> _IOC_TYPESHIFT) & ((1 << _IOC_TYPEBITS) - 1),
        nr=(request >> _IOC_NRSHIFT) & ((1 << _IOC_NRBITS) - 1),
        size=(request >> _IOC_SIZESHIFT) & ((1 << _IOC_SIZEBITS) - 1),
    )


class drm_version(ctypes.Structure):
    """[drm.h] struct drm_version: the kernel copies name/date/desc into the user
    buffers (up to *_len bytes) and writes back the true lengths."""

    _fields_ = [
        ("version_major", ctypes.c_int),
        ("version_minor", ctypes.c_int),
        ("version_patchlevel", ctypes.c_int),
        ("name_len", ctypes.c_size_t),
        ("name", ctypes.c_void_p),
        ("date_len", ctypes.c_size_t),
        ("date", ctypes.c_void_p),
        ("desc_len", ctypes.c_size_t),
        ("desc", ctypes.c_void_p),
    ]


class drm_gem_close(ctypes.Structure):
    """[drm.h] struct drm_gem_close; rocket closes BOs with it [docs/npu-programming.md §5]."""

    _fields_ = [("handle", ctypes.c_uint32), ("pad", ctypes.c_uint32)]


DRM_IOCTL_VERSION = DRM_IOWR(0x00, drm_version)  # [drm.h] DRM_IOWR(0x00, struct drm_version)
DRM_IOCTL_GEM_CLOSE = DRM_IOW(0x09, drm_gem_close)  # [drm.h] DRM_IOW(0x09, struct drm_gem_close)


@dataclass(frozen=True)
class DrmVersion:
    """What DRM_IOCTL_VERSION reports: the way to tell ``rknpu`` from ``rocket``."""

    major: int
    minor: int
    patch: int
    name: str
    date: str
    desc: str


_STRING_CAPACITY = 128


def query_version(syscalls: Syscalls, fd: int) -> DrmVersion:
    """DRM_IOCTL_VERSION through ``syscalls`` with 128-byte string buffers owned by us.

    The kernel writes the strings through the user pointers in the struct (copy_to_user),
    so the buffers must stay alive for the duration of the call.
    """
    name = ctypes.create_string_buffer(_STRING_CAPACITY)
    date = ctypes.create_string_buffer(_STRING_CAPACITY)
    desc = ctypes.create_string_buffer(_STRING_CAPACITY)
    v = drm_version(
        name_len=_STRING_CAPACITY, name=ctypes.addressof(name),
        date_len=_STRING_CAPACITY, date=ctypes.addressof(date),
        desc_len=_STRING_CAPACITY, desc=ctypes.addressof(desc),
    )
    arg = bytearray(bytes(v))
    syscalls.ioctl(fd, DRM_IOCTL_VERSION, arg)
    out = drm_version.from_buffer(arg)

    def text(buf: ctypes.Array, length: int) -> str:
        return buf.raw[: min(length, _STRING_CAPACITY)].split(b"\0", 1)[0].decode(errors="replace")

    return DrmVersion(
        major=out.version_major, minor=out.version_minor, patch=out.version_patchlevel,
        name=text(name, out.name_len), date=text(date, out.date_len), desc=text(desc, out.desc_len),
    )


def gem_close(syscalls: Syscalls, fd: int, handle: int) -> None:
    syscalls.ioctl(fd, DRM_IOCTL_GEM_CLOSE, bytearray(bytes(drm_gem_close(handle=handle))))


class PreparedIoctl:
    """One ioctl whose argument bytes are packed once and replayed: the per-submit calls of a
    planned job (its MEM_SYNCs, its SUBMIT) skip building a ctypes struct each time. Each
    call passes a fresh copy of the bytes (the kernel may write into it) and returns that
    copy, or raises the NpuError ``call`` would."""

    __slots__ = ("syscalls", "fd", "request", "template", "what", "name", "hints")

    def __init__(self, syscalls: Syscalls, fd: int, request: int, struct: ctypes.Structure, what: str, name: str,
                 hints: dict[tuple[str, int], str]) -> None:
        self.syscalls, self.fd, self.request, self.template = syscalls, fd, request, bytes(struct)
        self.what, self.name, self.hints = what, name, hints

    def __call__(self) -> bytearray:
        arg = bytearray(self.template)
        try:
            self.syscalls.ioctl(self.fd, self.request, arg)
        except OSError as exc:
            raise ioctl_error(self.what, self.name, exc, self.hints) from exc
        return arg


def call(syscalls: Syscalls, fd: int, request: int, struct: ctypes.Structure, what: str, name: str,
         hints: dict[tuple[str, int], str]) -> ctypes.Structure:
    """One driver ioctl on a copy of ``struct``: the struct as the kernel wrote it back, or the
    NpuError ``ioctl_error`` builds (``what`` names the call, ``hints`` say what to check)."""
    arg = bytearray(bytes(struct))
    try:
        syscalls.ioctl(fd, request, arg)
    except OSError as exc:
        raise ioctl_error(what, name, exc, hints) from exc
    return type(struct).from_buffer_copy(arg)
