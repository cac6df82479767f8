"""Simulated NPU memory: the IOVA allocator (first fit, page granular, coalescing,
fragmentation, exhaustion and recovery) and leak freedom over 10 000 buffer lifetimes,
through the driver classes on both ABIs."""

from __future__ import annotations

import errno
import random

import pytest

from ggml_rknpu.kernel.errors import NpuOutOfMemory
from ggml_rknpu.kernel.rknpu import uapi as rk
from ggml_rknpu.kernel.rknpu.ioctls import RknpuIoctls
from ggml_rknpu.kernel.rocket.ioctls import RocketIoctls
from ggml_rknpu.sim.kernel import SimKernel
from ggml_rknpu.sim.memory import PAGE, RangeAllocator

pytestmark = pytest.mark.timeout(120)

EMPTY = {"objects": 0, "mappings": 0, "handles": 0, "iova_used": 0, "mmap_offsets_used": 0, "allocated_bytes": 0}


def test_allocator_first_fit_and_coalescing():
    a = RangeAllocator(0x1000, 0x11000, PAGE)  # 16 pages, bottom-up
    starts = [s for s in (a.alloc(PAGE) for _ in range(16)) if s is not None]
    assert starts == [0x1000 + i * PAGE for i in range(16)] and a.alloc(1) is None
    for s in starts[1::2]:
        a.free(s)
    assert a.free_bytes == 8 * PAGE and a.largest_free == PAGE and a.n_free_ranges == 8
    assert a.alloc(2 * PAGE) is None  # fragmented: enough bytes, no hole
    assert a.alloc(100) == starts[1]  # first fit, rounded to a page
    for s in starts[0::2]:
        a.free(s)
    a.free(starts[1])
    assert a.n_free_ranges == 1 and a.largest_free == 16 * PAGE  # fully coalesced
    assert a.alloc(16 * PAGE) == 0x1000


def test_allocator_top_down_and_double_free():
    a = RangeAllocator(0x1000, 0x9000, PAGE, top_down=True)
    assert a.alloc(PAGE) == 0x8000 and a.alloc(2 * PAGE) == 0x6000
    a.free(0x8000)
    with pytest.raises(ValueError):
        a.free(0x8000)


def test_allocator_random_workload_keeps_invariants():
    rng = random.Random(7)
    a = RangeAllocator(0, 256 * PAGE, PAGE, top_down=True)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            freed = rng.choice(list(live))
            a.free(freed)
            del live[freed]
        else:
            n = rng.randint(1, 9) * PAGE
            start = a.alloc(n)
            if start is None:
                assert a.largest_free < n
                continue
            assert all(start + n <= s or s + m <= start for s, m in live.items())  # no overlap
            live[start] = n
        assert a.free_bytes + sum(live.values()) == a.total
    for start in list(live):
        a.free(start)
    assert a.n_free_ranges == 1 and a.free_bytes == a.total


@pytest.mark.parametrize("abi", ["rknpu", "rocket"])
def test_ten_thousand_lifetimes_leave_nothing_behind(abi):
    k = SimKernel(abi)
    fd = k.open(k._device_paths()[-1])
    d = RknpuIoctls(k, fd) if abi == "rknpu" else RocketIoctls(k, fd)
    keep: list = []  # a few long-lived buffers interleaved, so frees happen in the middle too
    for i in range(10_000):
        size = 4096 * (1 + i % 5) - 100
        if isinstance(d, RknpuIoctls):
            m = d.mem_create(size, rk.DATA_BO_FLAGS)
            view = d.mmap(d.mem_map(m.handle), m.size)
            view[0] = i & 0xFF
            d.mem_sync(m.obj_addr, 0, m.size, rk.SyncFlag.TO_DEVICE)
            k.munmap(view)
            if i % 1000 == 0:
                keep.append(m)
            else:
                d.mem_destroy(m.handle, m.obj_addr)
        else:
            b = d.create_bo(size)
            view = d.mmap(b.offset, size)
            view[0] = i & 0xFF
            d.fini_bo(b.handle)
            k.munmap(view)
            if i % 1000 == 0:
                keep.append(b)
            else:
                d.gem_close(b.handle)
    assert k.stats()["objects"] == len(keep) == 10
    for m in keep:
        d.mem_destroy(m.handle, m.obj_addr) if isinstance(d, RknpuIoctls) else d.gem_close(m.handle)
    assert k.stats() == EMPTY
    free, total = k.iova_budget(fd)
    assert free == total
    k.close(fd)
    assert k.stats() == EMPTY


def test_mapping_keeps_the_object_alive_until_munmap():
    """GEM semantics: destroying the handle of a mapped buffer frees it at munmap."""
    k = SimKernel("rknpu")
    d = RknpuIoctls(k, k.open("/dev/dri/renderD129"))
    m = d.mem_create(4096, rk.DATA_BO_FLAGS)
    view = d.mmap(d.mem_map(m.handle), 4096)
    d.mem_destroy(m.handle, m.obj_addr)
    assert k.stats()["objects"] == 1 and k.stats()["handles"] == 0
    k.munmap(view)
    assert k.stats() == EMPTY
    with pytest.raises(OSError) as e:
        k.munmap(view)
    assert e.value.errno == errno.EINVAL


def test_closing_the_fd_releases_its_handles():
    k = SimKernel("rocket")
    fd = k.open("/dev/accel/accel0")
    r = RocketIoctls(k, fd)
    for _ in range(5):
        r.create_bo(8192)
    k.close(fd)
    assert k.stats() == EMPTY


def test_fragmentation_and_exhaustion_give_enomem_then_recover():
    k = SimKernel("rknpu", iova_window=(PAGE, 65 * PAGE))  # 64 pages of NPU address space
    d = RknpuIoctls(k, k.open("/dev/dri/renderD129"))
    bufs = [d.mem_create(PAGE, rk.DATA_BO_FLAGS) for _ in range(64)]
    with pytest.raises(NpuOutOfMemory) as e:
        d.mem_create(PAGE, rk.DATA_BO_FLAGS)
    assert e.value.errno == errno.ENOMEM and "address space exhausted" in str(e.value)
    for m in bufs[::2]:
        d.mem_destroy(m.handle, m.obj_addr)
    with pytest.raises(NpuOutOfMemory) as e:  # 32 pages free, but no two adjacent
        d.mem_create(2 * PAGE, rk.DATA_BO_FLAGS)
    assert "in 32 pieces" in str(e.value) and "largest 4096" in str(e.value)
    assert d.mem_create(PAGE, rk.DATA_BO_FLAGS).size == PAGE  # a single page still fits
    for m in bufs[1::2]:
        d.mem_destroy(m.handle, m.obj_addr)
    big = d.mem_create(60 * PAGE, rk.DATA_BO_FLAGS)  # coalesced again
    assert big.size == 60 * PAGE


def test_host_memory_limit_is_enomem():
    k = SimKernel("rknpu", memory_limit=1 << 20)
    d = RknpuIoctls(k, k.open("/dev/dri/renderD129"))
    d.mem_create(1 << 20, rk.DATA_BO_FLAGS)
    with pytest.raises(NpuOutOfMemory) as e:
        d.mem_create(PAGE, rk.DATA_BO_FLAGS)
    assert "out of memory" in str(e.value) and "free buffers" in str(e.value)
