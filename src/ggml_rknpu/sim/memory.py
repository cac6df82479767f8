"""Simulated NPU memory: GEM objects in host memory, IOVA address spaces, the NPU's MMU.

Invariants: allocation is a real first-fit, page-granular allocator that can fragment and
run out; a CPU-cached object's CPU copy and device copy meet only through MEM_SYNC /
FINI_BO / PREP_BO, so a missing sync shows as stale data; a cached object's content token
changes whenever its device bytes do, and an uncached one has none; an NPU access not
wholly inside one mapped object is a ``DmaFault``; the kernel attaches the submitting
file's domain before a job runs. Why and the allocation order observed on a board:
docs/decisions.md "sim/memory.py"."""

from __future__ import annotations

import bisect
import itertools
import mmap
import os
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ggml_rknpu.hw.alignment import align_up, ceil_div
from ggml_rknpu.hw.limits import ADDRESS_WINDOW_BYTES, PAGE_BYTES

PAGE = PAGE_BYTES
# 32-bit NPU window [docs/npu-programming.md §4: all regcmd address fields are 32-bit, all
# observed IOVAs < 4 GiB]. Page 0 is kept out so that DMA address 0 always faults.
IOVA_BASE = PAGE
IOVA_END = ADDRESS_WINDOW_BYTES
MMAP_OFFSET_BASE = 1 << 32  # [capture pw_c256_h14: first MEM_MAP offset 0x100000000]
# The simulator's knob that shrinks every IOMMU domain's window of the simulated vendor driver
# to this many bytes (from IOVA_BASE), so that tests cross it with small models.
WINDOW_ENV = "RKNPU_SIM_IOVA_BYTES"


def window_end_from_environment() -> int | None:
    """The end of a shrunk window, IOVA_BASE + $RKNPU_SIM_IOVA_BYTES (None: not set)."""
    value = os.environ.get(WINDOW_ENV, "")
    if not value:
        return None
    try:
        size = int(value, 0)
    except ValueError:
        raise ValueError(f"{WINDOW_ENV}={value!r} is not a whole number of bytes") from None
    if not PAGE <= size <= IOVA_END - IOVA_BASE or size % PAGE:
        raise ValueError(f"{WINDOW_ENV}={size}: a whole number of {PAGE}-byte pages, at most "
                         f"{IOVA_END - IOVA_BASE}")
    return IOVA_BASE + size


# A cached object at least this large keeps its CPU-cache view as a copy-on-write mapping of
# its DRAM (``GemObject``): a page costs host memory twice only while the two views differ.
# Smaller ones (activations, programs, task arrays: synced every job) keep two plain arrays.
SHARED_VIEW_MIN_BYTES = 1 << 20
SYNC_CHUNK_BYTES = 64 << 20   # a sync copies and drops at most this much at a time


def page_align(n: int) -> int:
    return align_up(n, PAGE)


class DmaFault(Exception):
    """The NPU touched [iova, iova+nbytes) which is not inside one mapped object."""

    def __init__(self, iova: int, nbytes: int, detail: str = "") -> None:
        self.iova, self.nbytes = iova, nbytes
        msg = f"NPU DMA fault: {nbytes} bytes at IOVA {iova:#x} are not inside one mapped buffer"
        super().__init__(f"{msg} ({detail})" if detail else msg)


class DeviceMemory(Protocol):
    """What the NPU model needs: ``view`` (required). A memory may also offer
    ``content_token(iova, nbytes)`` (hashable, or None when unknown) and
    ``note_device_write(iova, nbytes)`` (which must change the token of what was written)
    and ``device_write_view(iova, nbytes)`` (the view for a write); the model uses them
    through the functions of those names below, which treat a memory without them as
    untracked."""

    def view(self, iova: int, nbytes: int) -> np.ndarray: ...


def content_token(memory: DeviceMemory, iova: int, nbytes: int) -> object | None:
    """A token equal across two calls only if the bytes cannot have changed in between;
    None when the memory cannot tell (then nothing may be kept across hardware runs)."""
    method = getattr(memory, "content_token", None)
    return method(iova, nbytes) if method is not None else None


def device_write_view(memory: DeviceMemory, iova: int, nbytes: int) -> np.ndarray:
    """The view the NPU writes [iova, iova+nbytes) through: ``memory.device_write_view``
    when it has one (it keeps CPU-cached copies apart from the write), else ``view``."""
    method = getattr(memory, "device_write_view", None)
    return method(iova, nbytes) if method is not None else memory.view(iova, nbytes)


def note_device_write(memory: DeviceMemory, iova: int, nbytes: int) -> None:
    """The NPU wrote [iova, iova+nbytes): content tokens of what it touched change."""
    method = getattr(memory, "note_device_write", None)
    if method is not None:
        method(iova, nbytes)


class RangeAllocator:
    """First fit over a sorted list of free [start, end) ranges, ``granule`` aligned.

    ``top_down`` picks the highest fitting address (IOMMU DMA style); otherwise the lowest.
    """

    def __init__(self, base: int, end: int, granule: int = PAGE, top_down: bool = False) -> None:
        if base % granule or end % granule or end <= base:
            raise ValueError(f"allocator window [{base:#x}, {end:#x}) must be {granule}-aligned and non-empty")
        self.base, self.end, self.granule, self.top_down = base, end, granule, top_down
        self._free: list[list[int]] = [[base, end]]  # sorted, disjoint, never adjacent
        self._used: dict[int, int] = {}  # start -> length

    @property
    def total(self) -> int:
        return self.end - self.base

    @property
    def free_bytes(self) -> int:
        return sum(e - s for s, e in self._free)

    @property
    def largest_free(self) -> int:
        return max((e - s for s, e in self._free), default=0)

    @property
    def n_free_ranges(self) -> int:
        return len(self._free)

    @property
    def n_allocations(self) -> int:
        return len(self._used)

    def alloc(self, length: int) -> int | None:
        """Start of a fresh ``length``-byte range (rounded up to the granule), or None."""
        length = align_up(length, self.granule)
        if length <= 0:
            raise ValueError("allocation length must be positive")
        order = range(len(self._free) - 1, -1, -1) if self.top_down else range(len(self._free))
        for i in order:
            s, e = self._free[i]
            if e - s < length:
                continue
            if self.top_down:
                start = e - length
                self._free[i][1] = start
            else:
                start = s
                self._free[i][0] = s + length
            if self._free[i][0] == self._free[i][1]:
                del self._free[i]
            self._used[start] = length
            return start
        return None

    def free(self, start: int) -> None:
        length = self._used.pop(start, None)
        if length is None:
            raise ValueError(f"free of {start:#x}, which is not an allocated range start")
        end = start + length
        i = bisect.bisect_left(self._free, [start, end])
        merge_prev = i > 0 and self._free[i - 1][1] == start
        merge_next = i < len(self._free) and self._free[i][0] == end
        if merge_prev and merge_next:
            self._free[i - 1][1] = self._free[i][1]
            del self._free[i]
        elif merge_prev:
            self._free[i - 1][1] = end
        elif merge_next:
            self._free[i][0] = start
        else:
            self._free.insert(i, [start, end])


_SERIALS = itertools.count(1)


@dataclass(eq=False)
class GemObject:
    """One buffer object. ``dram`` is what the NPU sees; ``cpu`` what the CPU mapping sees.

    A cached object of ``SHARED_VIEW_MIN_BYTES`` or more holds its DRAM in a memfd mapped
    shared (``dram``) and privately (``cpu``): a page the CPU writes becomes the CPU's own
    (the host kernel's copy-on-write), a page a sync made equal on both sides is dropped
    from the private mapping and reads DRAM again (``madvise(MADV_DONTNEED)``), and before
    the NPU writes a range (``prepare_device_write``) every CPU page there that still reads
    DRAM is made the CPU's own, holding what it held. So the CPU sees exactly what two
    separate copies would show (stale data after a missing sync included), and a weight
    written once and synced costs its size once, not twice. Host memory of the simulator
    only: a board has one DRAM and a cache."""

    size: int  # page aligned
    flags: int
    obj_addr: int  # vendor: fake kernel pointer used as the object's id
    cached: bool  # CPU mapping is cached: dram and cpu are separate until a sync
    dram: np.ndarray = field(init=False, repr=False)
    cpu: np.ndarray = field(init=False, repr=False)
    dma_addr: int = 0
    domain: IommuDomain | None = None
    mmap_offset: int | None = None
    handle_refs: int = 0  # open handles (GEM handles hold references)
    mappings: int = 0  # live CPU mmaps (each holds a reference, like a VMA)
    failed_job: str | None = None  # rocket: why the last job writing this BO failed
    serial: int = field(init=False)  # unique for the process: never reused like id() or IOVAs
    generation: int = 0  # bumped whenever the dram bytes may have changed (cached objects)
    # shared views only: the private mapping, and which of its pages may still read DRAM
    _cpu_map: mmap.mmap | None = field(init=False, repr=False, default=None)
    _reads_dram: np.ndarray | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        self.serial = next(_SERIALS)
        if (self.cached and self.size >= SHARED_VIEW_MIN_BYTES and self.size % mmap.PAGESIZE == 0
                and hasattr(os, "memfd_create")):   # Linux; elsewhere two arrays, as below
            fd = os.memfd_create(f"sim-npu-bo-{self.serial}", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, self.size)
                shared = mmap.mmap(fd, self.size, mmap.MAP_SHARED)
                self._cpu_map = mmap.mmap(fd, self.size, mmap.MAP_PRIVATE)
            finally:
                os.close(fd)
            self.dram = np.frombuffer(shared, dtype=np.uint8)
            self.cpu = np.frombuffer(self._cpu_map, dtype=np.uint8)
            self._reads_dram = np.ones(self.size // mmap.PAGESIZE, dtype=bool)
            return
        self.dram = np.zeros(self.size, dtype=np.uint8)
        self.cpu = np.zeros(self.size, dtype=np.uint8) if self.cached else self.dram

    @property
    def content_token(self) -> tuple[int, int] | None:
        """(serial, generation) for cached objects; None for uncached ones, whose dram the
        CPU writes directly and untracked."""
        return (self.serial, self.generation) if self.cached else None

    @property
    def alive(self) -> bool:
        return self.handle_refs > 0 or self.mappings > 0

    @property
    def private_cpu_pages(self) -> int:
        """Pages of a shared view the CPU holds on its own (all of them for two arrays)."""
        if self._reads_dram is None:
            return self.size // mmap.PAGESIZE if self.cached else 0
        return int(np.count_nonzero(~self._reads_dram))

    def _read_dram(self, offset: int, size: int) -> None:
        """The CPU's pages wholly inside [offset, offset+size), equal to DRAM there, read
        DRAM again; the partial pages at the ends stay the CPU's own."""
        assert self._cpu_map is not None and self._reads_dram is not None
        first, last = ceil_div(offset, mmap.PAGESIZE), (offset + size) // mmap.PAGESIZE
        if last > first:
            self._cpu_map.madvise(mmap.MADV_DONTNEED, first * mmap.PAGESIZE, (last - first) * mmap.PAGESIZE)
            self._reads_dram[first:last] = True

    def sync_for_device(self, offset: int, size: int) -> None:
        if not self.cached:
            return
        if self._cpu_map is None:
            self.dram[offset : offset + size] = self.cpu[offset : offset + size]
        else:
            for start in range(offset, offset + size, SYNC_CHUNK_BYTES):
                end = min(start + SYNC_CHUNK_BYTES, offset + size)
                self.dram[start:end] = self.cpu[start:end]
                self._read_dram(start, end - start)
        self.generation += 1

    def write_back(self, dirty: np.ndarray) -> None:
        """Copy to dram the bytes ``dirty`` (a bool mask over the object) selects: a partial
        cache clean. The content token changes only if a byte may have changed."""
        if self.cached and dirty.any():
            self.prepare_device_write(0, self.size)
            self.dram[dirty] = self.cpu[dirty]
            self.generation += 1

    def sync_for_cpu(self, offset: int, size: int) -> None:
        if not self.cached:
            return
        if self._cpu_map is None:
            self.cpu[offset : offset + size] = self.dram[offset : offset + size]
            return
        first, last = align_up(offset, mmap.PAGESIZE), (offset + size) // mmap.PAGESIZE * mmap.PAGESIZE
        if last <= first:
            self.cpu[offset : offset + size] = self.dram[offset : offset + size]
            return
        self.cpu[offset:first] = self.dram[offset:first]
        self.cpu[last : offset + size] = self.dram[last : offset + size]
        self._read_dram(first, last - first)

    def prepare_device_write(self, offset: int, size: int) -> None:
        """The NPU (or a partial clean) is about to write DRAM in [offset, offset+size): CPU
        pages there that still read DRAM become the CPU's own first, holding what they hold."""
        if self._reads_dram is None or size <= 0:
            return
        first, last = offset // mmap.PAGESIZE, ceil_div(offset + size, mmap.PAGESIZE)
        pages = np.flatnonzero(self._reads_dram[first:last]) + first
        if pages.size:
            at = pages * mmap.PAGESIZE
            self.cpu[at] = self.cpu[at]     # a write faults the page in as the CPU's own copy
            self._reads_dram[pages] = False


class IommuDomain:
    """One NPU address space: an IOVA allocator plus the objects mapped into it; ``ident``:
    its id where a driver keeps several (the vendor driver's ``iommu_domain_id``)."""

    def __init__(self, base: int = IOVA_BASE, end: int = IOVA_END, ident: int = 0) -> None:
        self.ident = ident
        self.iova = RangeAllocator(base, end, PAGE, top_down=True)
        self._starts: list[int] = []  # sorted IOVAs of mapped objects
        self._objects: dict[int, GemObject] = {}

    def map(self, obj: GemObject, node_bytes: int | None = None) -> bool:
        """Give ``obj`` an IOVA (a node of ``node_bytes``, by default its size); False when the
        address space has no hole big enough."""
        start = self.iova.alloc(obj.size if node_bytes is None else node_bytes)
        if start is None:
            return False
        obj.dma_addr, obj.domain = start, self
        bisect.insort(self._starts, start)
        self._objects[start] = obj
        return True

    def unmap(self, obj: GemObject) -> None:
        self.iova.free(obj.dma_addr)
        self._starts.remove(obj.dma_addr)
        del self._objects[obj.dma_addr]
        obj.domain = None

    @property
    def objects(self) -> list[GemObject]:
        return list(self._objects.values())

    def lookup(self, iova: int) -> GemObject | None:
        i = bisect.bisect_right(self._starts, iova) - 1
        if i < 0:
            return None
        obj = self._objects[self._starts[i]]
        return obj if iova < obj.dma_addr + obj.size else None

    def _object(self, iova: int, nbytes: int) -> GemObject:
        """The one object holding [iova, iova+nbytes); DmaFault otherwise."""
        if nbytes < 0 or iova < 0:
            raise DmaFault(iova, nbytes, "negative address or length")
        obj = self.lookup(iova)
        if obj is None:
            raise DmaFault(iova, nbytes, "no buffer is mapped at this address")
        off = iova - obj.dma_addr
        if off + nbytes > obj.size:
            raise DmaFault(
                iova, nbytes,
                f"runs {off + nbytes - obj.size} bytes past the end of the {obj.size}-byte buffer at {obj.dma_addr:#x}",
            )
        return obj

    def view(self, iova: int, nbytes: int) -> np.ndarray:
        """uint8 writable view of the NPU-visible bytes; DmaFault unless inside one object."""
        obj = self._object(iova, nbytes)
        off = iova - obj.dma_addr
        return obj.dram[off : off + nbytes]

    def content_token(self, iova: int, nbytes: int) -> tuple[int, int, int] | None:
        """(serial, generation, offset) of the object holding the range; DmaFault as view."""
        obj = self._object(iova, nbytes)
        token = obj.content_token
        return None if token is None else (*token, iova - obj.dma_addr)

    def device_write_view(self, iova: int, nbytes: int) -> np.ndarray:
        """``view`` of bytes the NPU is about to write (the CPU's cached copy keeps its own)."""
        obj = self._object(iova, nbytes)
        off = iova - obj.dma_addr
        obj.prepare_device_write(off, nbytes)
        return obj.dram[off : off + nbytes]

    def note_device_write(self, iova: int, nbytes: int) -> None:
        obj = self.lookup(iova)
        if obj is not None:
            obj.generation += 1


class NpuMmu:
    """The ``DeviceMemory`` the NPU model uses: whichever domain the kernel attached."""

    def __init__(self, domain: IommuDomain | None = None) -> None:
        self.domain = domain

    def attach(self, domain: IommuDomain) -> None:
        self.domain = domain

    def _attached(self, iova: int, nbytes: int) -> IommuDomain:
        if self.domain is None:
            raise DmaFault(iova, nbytes, "no IOMMU domain attached to the NPU")
        return self.domain

    def view(self, iova: int, nbytes: int) -> np.ndarray:
        return self._attached(iova, nbytes).view(iova, nbytes)

    def content_token(self, iova: int, nbytes: int) -> tuple[int, int, int] | None:
        return self._attached(iova, nbytes).content_token(iova, nbytes)

    def device_write_view(self, iova: int, nbytes: int) -> np.ndarray:
        return self._attached(iova, nbytes).device_write_view(iova, nbytes)

    def note_device_write(self, iova: int, nbytes: int) -> None:
        self._attached(iova, nbytes).note_device_write(iova, nbytes)
