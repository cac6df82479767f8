"""Device buffers behind the RPC handles: a fake, stable device address space over host memory.

Invariants: llama.cpp never dereferences a device address, it computes ``base + offset``
and sends it back [docs/ggml-rpc.md §3.4]; so each buffer gets its own range in a 64-bit
fake address space that is never reused, with an unmapped guard gap between buffers, and
every access goes through ``RpcBuffer.span``, the one bounds check. Memory is zeroed
pages committed on first touch (so llama.cpp's large compute buffer costs only what a graph
writes), a mapping of its own where weight pages may move to a file (``weight_pages``),
bounded by ``DeviceBudget``, which GET_DEVICE_MEMORY reports."""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ggml_rknpu.hw.alignment import ceil_div
from ggml_rknpu.server.rpc.wire import ProtocolError
from ggml_rknpu.server.weight_pages import PAGE, BufferPages, WeightPages, anonymous_buffer

log = logging.getLogger("ggml_rknpu.rpc")

ADDRESS_SPACE_START = 0x1_0000_0000  # above 4 GiB so a truncated (u32) address can never validate
BUFFER_ALIGNMENT = 64                # GET_ALIGNMENT: cache line; ggml's CPU backend uses 32
_BASE_GRANULE = 1 << 16              # bases 64 KiB aligned, plus one granule of guard gap


class IntervalSet:
    """Disjoint half-open byte ranges, merged on insert; used for 'bytes a graph writes'."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, start: int, end: int) -> None:
        if end <= start:
            return
        i = bisect.bisect_left(self._ends, start)        # first range that ends at/after start
        j = bisect.bisect_right(self._starts, end)       # ranges starting at/before end
        if i < j:
            start = min(start, self._starts[i])
            end = max(end, self._ends[j - 1])
        self._starts[i:j] = [start]
        self._ends[i:j] = [end]

    def overlaps(self, start: int, end: int) -> bool:
        if end <= start:
            return False
        i = bisect.bisect_right(self._ends, start)       # first range ending after start
        return i < len(self._starts) and self._starts[i] < end

    def __len__(self) -> int:
        return len(self._starts)


@dataclass(eq=False)
class RpcBuffer:
    """One ALLOC_BUFFER: handle, fake base address, host bytes."""

    handle: int
    base: int
    size: int
    array: np.ndarray                                      # uint8[size]
    graph_written: IntervalSet = field(default_factory=IntervalSet)  # offsets written by graph nodes
    pages: BufferPages | None = None                       # its weight pages on disk (None: all anonymous)

    def keep_in_file(self, start: int, end: int) -> int:
        """Bytes [start, end) are a weight no host kernel reads: their whole pages become
        file-backed (``weight_pages``); the bytes moved (0 where this buffer cannot)."""
        return self.pages.keep(start, end) if self.pages is not None else 0

    def span(self, addr: int, nbytes: int, what: str) -> tuple[int, int]:
        """(start, end) offsets of [addr, addr+nbytes) inside this buffer, or ProtocolError."""
        if nbytes < 0 or addr < self.base or addr + nbytes > self.base + self.size:
            raise ProtocolError(
                f"{what}: bytes [{addr:#x}, +{nbytes}) fall outside buffer {self.handle:#x} "
                f"[{self.base:#x}, +{self.size})"
            )
        start = addr - self.base
        return start, start + nbytes


class DeviceBudget:
    """The device budget shared by all connections of one server.

    ``npu_budget`` is the engine's ``memory_budget()`` (free, total bytes of NPU
    address space). Buffers are host memory, so allocation is bounded by
    ``total - allocated``; staged weights use NPU address space, so the free figure
    reported is the smaller of the two constraints. ``reclaimable`` is NPU memory held
    by retired weights (kept for reuse by a later client, freed on demand), so it
    counts as free: llama.cpp's ``-fit`` must not shrink its offload because of them.
    ``host_bytes`` (the server's memory budget, when it has one) lifts the bound on buffers
    above the NPU's address space: a model larger than the NPU window still loads, its weights
    beyond it on the host (NPU out of memory: ``weight_store``), as llama.cpp alone would.
    """

    def __init__(self, npu_budget: Callable[[], tuple[int, int]], pages: WeightPages | None = None) -> None:
        self._npu_budget = npu_budget
        self.pages = pages            # where weight pages go (None: buffers stay anonymous)
        self.host_bytes: int | None = None   # buffers may take this much (None: the NPU's total)
        self.allocated = 0
        self.reclaimable: Callable[[], int] = lambda: 0

    def report(self) -> tuple[int, int]:
        npu_free, total = self._npu_budget()
        if self.host_bytes is not None and self.host_bytes > total:
            return max(0, self.host_bytes - self.allocated), self.host_bytes
        npu_free = min(total, npu_free + self.reclaimable())
        return max(0, min(npu_free, total - self.allocated)), total

    def max_buffer(self) -> int:
        return self._npu_budget()[1]

    def reserve(self, size: int) -> bool:
        _, total = self._npu_budget()
        if self.allocated + size > max(total, self.host_bytes or 0):
            return False
        self.allocated += size
        return True

    def release(self, size: int) -> None:
        self.allocated -= size


class BufferTable:
    """The buffers of one connection (C++ ggml-rpc-server frees them when the client leaves)."""

    def __init__(self, memory: DeviceBudget, on_free: Callable[[RpcBuffer], None] | None = None) -> None:
        self._memory = memory
        self._on_free = on_free
        self._by_handle: dict[int, RpcBuffer] = {}
        self._next_handle = 1
        self._next_base = ADDRESS_SPACE_START

    def alloc(self, size: int) -> RpcBuffer | None:
        """A new zeroed buffer, or None when the budget or the host cannot hold it (client sees OOM)."""
        if not self._memory.reserve(size):
            log.warning("ALLOC_BUFFER of %d bytes refused: device budget exhausted (%d allocated)",
                        size, self._memory.allocated)
            return None
        store = self._memory.pages
        try:
            if store is not None and size >= PAGE:
                array = np.frombuffer(anonymous_buffer(size), dtype=np.uint8)
            else:
                array = np.zeros(size, dtype=np.uint8)
        except (MemoryError, OSError):
            self._memory.release(size)
            log.warning("ALLOC_BUFFER of %d bytes refused: host out of memory", size)
            return None
        handle = (0xB0F << 40) | self._next_handle   # recognisable, never 0, never an address
        self._next_handle += 1
        base = self._next_base
        granules = ceil_div(max(size, 1), _BASE_GRANULE) + 1
        self._next_base += granules * _BASE_GRANULE
        buf = RpcBuffer(handle=handle, base=base, size=size, array=array)
        if store is not None and size >= PAGE:
            buf.pages = BufferPages(store, array.ctypes.data, size)
        self._by_handle[handle] = buf
        return buf

    def get(self, handle: int, what: str) -> RpcBuffer:
        buf = self._by_handle.get(handle)
        if buf is None:
            raise ProtocolError(f"{what}: unknown buffer handle {handle:#x}")
        return buf

    def find(self, handle: int) -> RpcBuffer | None:
        return self._by_handle.get(handle)

    def free(self, handle: int) -> None:
        buf = self.get(handle, "FREE_BUFFER")
        del self._by_handle[handle]
        self._memory.release(buf.size)
        if buf.pages is not None:
            buf.pages.close()
        if self._on_free is not None:
            self._on_free(buf)

    def close(self) -> None:
        """Free everything (connection closed)."""
        for handle in list(self._by_handle):
            self.free(handle)

    def __len__(self) -> int:
        return len(self._by_handle)
