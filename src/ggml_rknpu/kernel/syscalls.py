"""The one interface every open/ioctl/mmap/munmap/close goes through.

On a board it is ``HostSyscalls`` (os, fcntl, mmap); off it, ``sim.kernel.SimKernel``
answers the same calls with the same request numbers and struct bytes. Tests and the
simulator plug in here - at the kernel boundary - so the driver classes above are the
code that runs on the board [docs/anchors.md §1a: route every syscall through one object].
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from pathlib import Path
from typing import Protocol, runtime_checkable


@runtime_checkable
class Syscalls(Protocol):
    def open(self, path: str, flags: int = os.O_RDWR) -> int: ...

    def close(self, fd: int) -> None: ...

    def ioctl(self, fd: int, request: int, arg: bytearray) -> int:
        """``arg`` holds the struct bytes and is updated in place; raises OSError(errno, msg)."""
        ...

    def mmap(self, fd: int, length: int, offset: int) -> memoryview:
        """A writable shared mapping of ``length`` bytes at the (fake) ``offset``."""
        ...

    def munmap(self, view: memoryview) -> None: ...

    def listdir(self, path: str) -> list[str]: ...

    def exists(self, path: str) -> bool: ...

    def read_text(self, path: str) -> str: ...


class HostSyscalls:
    """The real thing: os, fcntl and mmap on the running kernel."""

    def __init__(self) -> None:
        self._maps: dict[int, mmap.mmap] = {}

    def open(self, path: str, flags: int = os.O_RDWR) -> int:
        return os.open(path, flags | os.O_CLOEXEC)

    def close(self, fd: int) -> None:
        os.close(fd)

    def ioctl(self, fd: int, request: int, arg: bytearray) -> int:
        # mutate_flag=True: the kernel's writes land in ``arg`` (no 1024-byte copy limit
        # for a mutable buffer).
        return fcntl.ioctl(fd, request, arg, True)

    def mmap(self, fd: int, length: int, offset: int) -> memoryview:
        try:
            m = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
        except ValueError as exc:  # Python's own argument checks; the kernel would say EINVAL
            raise OSError(errno.EINVAL, f"mmap of {length} bytes at {offset:#x}: {exc}") from exc
        view = memoryview(m)
        self._maps[id(view)] = m
        return view

    def munmap(self, view: memoryview) -> None:
        m = self._maps.pop(id(view), None)
        if m is None:
            raise OSError(errno.EINVAL, "munmap: this view was not returned by HostSyscalls.mmap")
        try:
            view.release()
            m.close()
        except BufferError:
            # numpy arrays still reference the mapping; the kernel keeps the pages (and
            # the GEM object) alive until the last of them is garbage-collected, exactly
            # like a C program that munmaps late. Nothing leaks: the mmap object unmaps
            # itself when its last exporter dies.
            pass

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def read_text(self, path: str) -> str:
        return Path(path).read_text()
