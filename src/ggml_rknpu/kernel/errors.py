"""Errors the NPU stack raises. Each carries the errno the kernel returned (when there
was one) and a message that says what to do about it, not just what went wrong."""

from __future__ import annotations

import errno as _errno
import os


class NpuError(Exception):
    """Something the NPU or its driver refused. ``errno`` is the kernel's (or None)."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno

    @classmethod
    def from_oserror(cls, what: str, exc: OSError) -> NpuError:
        """Wrap an OSError from an ioctl into the most specific NpuError subclass."""
        detail = exc.strerror or _errno.errorcode.get(exc.errno or 0, "unknown error")
        message = f"{what}: {detail}"
        kind = {
            _errno.ETIMEDOUT: NpuTimeout,
            _errno.ENOMEM: NpuOutOfMemory,
            _errno.ENOSPC: NpuOutOfMemory,
            _errno.EFAULT: NpuFault,
        }.get(exc.errno or 0, NpuError)
        return kind(message, exc.errno)


class NpuTimeout(NpuError):
    """The job did not complete in time (hung hardware, wrong int_mask, bad regcmd)."""


class NpuOutOfMemory(NpuError):
    """No memory or NPU address space left; free buffers or allocate smaller ones."""


class NpuFault(NpuError):
    """A bad address: user pointer, DMA address outside every buffer, or IOMMU fault."""


def ioctl_error(what: str, name: str, exc: OSError, hints: dict[tuple[str, int], str]) -> NpuError:
    """NpuError for a failed ioctl ``name``. A real kernel only gives strerror, so then the
    hint for (name, errno) says what to check; the simulator's own message is kept as is."""
    detail = exc.strerror or ""
    if detail.startswith(f"{name}: "):
        detail = detail[len(name) + 2 :]
    err = NpuError.from_oserror(what, OSError(exc.errno, detail))
    hint = hints.get((name, exc.errno or 0))
    if hint and exc.errno is not None and detail == os.strerror(exc.errno):
        err.args = (f"{err.args[0]} ({hint})",)
    return err
