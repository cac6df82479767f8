"""The host cache budget: the default from the machine's memory, retired weights kept
least-recently-retired first within their share (evictions counted), the engine's bound
programs within theirs, the simulator's decoded weights of freed memory dropped at once, and
the C heap's free pages given back."""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

import numpy as np
import pytest

from ggml_rknpu.engine import open_engine
from ggml_rknpu.server.host_budget import MIN_BYTES, HostBudget, default_budget, return_free_heap
from ggml_rknpu.server.weight_store import RetiredWeights, WeightStats
from ggml_rknpu.sim.kernel import SimKernel
from ggml_rknpu.sim.npu import SimNpu
from support.proc_status import status_bytes

pytestmark = pytest.mark.timeout(300)
GiB, MiB = 1 << 30, 1 << 20


def test_default_budget_follows_the_machine_memory():
    assert default_budget(8 * GiB) == 512 * MiB        # an 8 GB board keeps at most 512 MiB
    assert default_budget(4 * GiB) == 256 * MiB
    assert default_budget(24 * GiB) == GiB             # capped
    assert default_budget(1 * GiB) == MIN_BYTES        # floored
    assert default_budget(None) == MIN_BYTES
    with pytest.raises(ValueError, match="at least"):
        HostBudget(MIN_BYTES - 1)
    b = HostBudget(512 * MiB)
    assert b.share("retired_weights") == 512 * MiB and b.share("programs") == 128 * MiB
    sim = HostBudget(GiB, simulated=True)                  # a retired NPU byte costs ~4 host bytes there
    assert sim.share("retired_weights") == 256 * MiB and sim.share("sim_decoded") == 2 * GiB


class _Handle:
    def __init__(self, nbytes: int) -> None:
        self.packed_bytes, self.shape, self.dtype, self.freed = nbytes, (1, 1), "fp16", False

    def free(self) -> None:
        assert not self.freed, "freed twice"
        self.freed = True


def test_retired_weights_stay_within_the_budget_oldest_first():
    stats = WeightStats()
    lru = RetiredWeights(stats, budget_bytes=300)
    h = [_Handle(n) for n in (100, 150, 100, 301)]
    assert lru.retire(("a",), h[0], 100, "a") and lru.retire(("b",), h[1], 150, "b")
    assert stats.retired_bytes == 250 and stats.evicted_budget == 0
    assert lru.retire(("c",), h[2], 100, "c")                       # 350 > 300: "a" goes
    assert h[0].freed and not h[1].freed and not h[2].freed
    assert (stats.retired_now, stats.retired_bytes, stats.evicted_budget) == (2, 250, 1)
    assert lru.take(("a",)) is None and lru.take(("b",)) is h[1]       # the survivor is still reusable
    assert not lru.retire(("d",), h[3], 301, "d")                   # alone over the budget: caller frees it
    assert stats.evicted_budget == 2 and stats.retired_bytes == 100 and stats.evicted == 0
    lru.clear()
    assert h[2].freed and stats.retired_now == 0 and stats.retired_bytes == 0


def test_program_cache_stays_within_its_budget_and_results_stay_exact():
    rng = np.random.default_rng(3)
    with open_engine("sim-rknpu") as npu:
        bs = [rng.integers(-128, 128, (64, 128), dtype=np.int8) for _ in range(4)]
        ws = [npu.upload_weight(b, "int8") for b in bs]
        a = rng.integers(-128, 128, (4, 128), dtype=np.int8)
        for w in ws:
            npu.matmul(a, w)
        cache = npu.parts.programs
        one = cache.bytes // 4
        assert one > 0 and npu.counters["programs_evicted_budget"] == 0
        npu.program_budget = 2 * one                             # trims at once to the two newest
        assert cache.bytes <= 2 * one and npu.counters["programs_evicted_budget"] == 2
        assert not ws[0].programs and not ws[1].programs and ws[3].programs
        for w, b in zip(ws, bs):                                 # evicted programs are rebuilt, exactly
            np.testing.assert_array_equal(npu.matmul(a, w), a.astype(np.int32) @ b.astype(np.int32).T)
            assert cache.bytes <= 2 * one
        for w in ws:
            w.free()
        assert cache.bytes == 0


def test_simulator_drops_decoded_weights_of_freed_memory():
    rng = np.random.default_rng(4)
    with open_engine("sim-rknpu") as npu:
        kernel = npu.device.syscalls
        assert isinstance(kernel, SimKernel)
        model = kernel._npu_model()
        assert isinstance(model, SimNpu)
        decoded = model.operands._weights
        b = rng.integers(-128, 128, (256, 256), dtype=np.int8)
        w = npu.upload_weight(b, "int8")
        for _ in range(2):                            # kept from the second read on
            npu.matmul(rng.integers(-128, 128, (2, 256), dtype=np.int8), w)
        assert decoded._bytes > 0
        w.free()
        assert decoded._bytes == 0 and not decoded._entries
        kernel.limit_decode_cache(1)                  # the cap applies to what comes next
        w = npu.upload_weight(b, "int8")
        np.testing.assert_array_equal(npu.matmul(np.ones((1, 256), np.int8), w),
                                      np.ones((1, 256), np.int32) @ b.astype(np.int32).T)
        assert len(decoded._entries) <= 1


_HEAP_PROBE = """
import sys
import numpy as np
from ggml_rknpu.server.host_budget import fix_malloc_threshold
if sys.argv[1] == "fixed":
    assert fix_malloc_threshold()
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))
big = np.ones(24 << 20, np.uint8)       # mapped; freeing it raises the dynamic threshold to 24 MiB
del big
base = rss()
slices = [np.ones(8 << 20, np.uint8) for _ in range(24)]   # expert slices: 192 MiB
keep = slices[-1]                        # the last one stays (a retired copy, a live buffer)
del slices
print(rss() - base)
"""


@pytest.mark.skipif(not __import__("ctypes").util.find_library("c"), reason="no C library to ask")
def test_pinned_mmap_threshold_gives_freed_slices_back():
    """Without the pinned threshold the freed 8 MiB slices stay resident under the live one;
    with it each is its own mapping and goes back to the system when freed."""
    import subprocess
    import sys

    def held(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _HEAP_PROBE, mode], capture_output=True, text=True, check=True)
        return int(out.stdout)

    if held("dynamic") < 100 * MiB:
        pytest.skip("this C library gives freed heap back on its own (not glibc's dynamic threshold)")
    assert held("fixed") < 20 * MiB


def test_simulated_kernel_log_keeps_its_last_lines():
    from ggml_rknpu.sim.kernel import DMESG_LINES, SimKernel

    k = SimKernel("rknpu")
    for i in range(3 * DMESG_LINES):
        k.log_line(f"line {i}")
    assert DMESG_LINES // 2 <= len(k.dmesg) <= DMESG_LINES and k.dmesg[-1] == f"line {3 * DMESG_LINES - 1}"


def test_retired_weights_make_room_for_live_ones_oldest_first():
    stats = WeightStats()
    lru = RetiredWeights(stats, budget_bytes=300)
    h = [_Handle(100) for _ in range(3)]
    for i, handle in enumerate(h):
        assert lru.retire((i,), handle, 100, str(i))
    lru.make_room(0)                                   # nothing live: all three fit
    assert stats.retired_now == 3 and stats.evicted_staging == 0
    lru.make_room(150)                                 # 150 live bytes: the two oldest go
    assert [x.freed for x in h] == [True, True, False]
    assert (stats.retired_bytes, stats.evicted_staging, stats.evicted_budget) == (100, 2, 0)
    lru.make_room(1000)                                # more than the budget: nothing is left
    assert h[2].freed and stats.retired_now == 0 and stats.evicted_staging == 3
    unbounded = RetiredWeights(WeightStats())           # bounded by NPU memory only: never
    kept = _Handle(100)
    unbounded.retire(("k",), kept, 100, "k")
    unbounded.make_room(1 << 40)
    assert not kept.freed and unbounded.take(("k",)) is kept


def _rss_bytes() -> int:
    rss = status_bytes("VmRSS")
    assert rss is not None
    return rss


@pytest.mark.skipif(ctypes.util.find_library("c") is None or not hasattr(ctypes.CDLL(ctypes.util.find_library("c")),
                                                                         "malloc_trim"),
                    reason="needs glibc (malloc_trim)")
def test_return_free_heap_gives_a_thread_arena_back():
    """A session thread's arena keeps what it freed below a live block; the trim returns it."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.argtypes, libc.malloc.restype = (ctypes.c_size_t,), ctypes.c_void_p
    libc.free.argtypes, libc.free.restype = (ctypes.c_void_p,), None
    block, count = 32 << 10, 4096                       # 128 MiB in blocks far below any mmap threshold
    rss: dict[str, int] = {}

    def session() -> None:
        blocks = [libc.malloc(block) for _ in range(count)]
        assert all(blocks)
        for b in blocks:
            ctypes.memset(b, 1, block)                  # resident
        for b in blocks[:-1]:
            libc.free(b)                                # the last one stays: the heap's top is live
        rss["freed"] = _rss_bytes()
        assert return_free_heap()
        rss["trimmed"] = _rss_bytes()
        libc.free(blocks[-1])

    t = threading.Thread(target=session)
    t.start()
    t.join()
    assert rss["freed"] - rss["trimmed"] >= (count // 2) * block, rss
