"""``Buffer``: one NPU buffer (a GEM object, its NPU address, its CPU mapping) and the
``Allocation`` a driver ABI returns for it.

Invariant: a buffer's device owns its sync and free; a closed buffer refuses every use.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ggml_rknpu.kernel.errors import NpuError


@dataclass(frozen=True)
class Allocation:
    """One GEM object as the driver returned it, mapped for the CPU."""

    handle: int
    dma_addr: int
    capacity: int  # whole pages
    cached: bool  # CPU-cached: needs explicit sync
    view: memoryview
    obj_addr: int = 0  # vendor: the kernel object id MEM_SYNC/MEM_DESTROY/SUBMIT take
    domain: int = 0  # the IOMMU domain (NPU address space) it is mapped in


class BufferOwner(Protocol):
    """What a buffer asks of the device it came from."""

    def sync_buffer(self, buf: Buffer, offset: int, size: int, *, to_device: bool) -> None:
        """Make ``[offset, offset + size)`` of ``buf`` visible to the NPU (``to_device``) or to the CPU."""
        ...

    def free_buffer(self, buf: Buffer) -> None:
        """``buf`` was closed: release its GEM object."""
        ...


class Buffer:
    """One NPU buffer: a GEM object, its NPU address and its CPU mapping."""

    def __init__(self, device: BufferOwner, size: int, allocation: Allocation, purpose: str) -> None:
        self.device, self.size, self.allocation, self.purpose = device, size, allocation, purpose
        self.capacity, self.dma_addr, self.handle = allocation.capacity, allocation.dma_addr, allocation.handle
        self.domain = allocation.domain
        self._view: memoryview | None = allocation.view

    @property
    def closed(self) -> bool:
        return self._view is None

    def array(self, dtype: Any = np.uint8) -> np.ndarray:
        """Writable view of the first ``size`` bytes of the CPU mapping."""
        if self._view is None:
            raise NpuError("buffer is closed; allocate a new one")
        dtype = np.dtype(dtype)
        return np.frombuffer(self._view, dtype=dtype, count=self.size // dtype.itemsize)

    def check_range(self, offset: int, size: int | None = None) -> tuple[int, int]:
        """(offset, size) of a range inside the buffer (``size`` None: to its end); NpuError outside it."""
        size = self.size - offset if size is None else size
        if offset < 0 or size < 0 or offset + size > self.capacity:
            raise NpuError(f"range [{offset}, {offset + size}) is outside the {self.capacity}-byte buffer",
                           errno.EINVAL)
        return offset, size

    def sync_to_device(self, offset: int = 0, size: int | None = None) -> None:
        """Make CPU writes visible to the NPU (clean the CPU cache)."""
        self.device.sync_buffer(self, *self.check_range(offset, size), to_device=True)

    def sync_from_device(self, offset: int = 0, size: int | None = None) -> None:
        """Make NPU writes visible to the CPU (invalidate; rocket: also waits for the writer)."""
        self.device.sync_buffer(self, *self.check_range(offset, size), to_device=False)

    def close(self) -> None:
        if self._view is not None:
            self._view = None
            self.device.free_buffer(self)

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"dma={self.dma_addr:#x}"
        return f"Buffer({self.purpose}, {self.size} B, {state})"
