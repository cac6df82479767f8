"""The host cache budget (``rknpu serve --host-cache-budget``): how much memory the server may
keep for reuse that no client holds: staged weights of freed buffers (``RetiredWeights``), the
engine's bound programs, and, on the simulator, its decoded weights.

Invariants: the default follows the machine's memory (``BUDGET_RULE``), so an 8 GB board keeps
at most 512 MiB and leaves the rest to the model, llama.cpp and the system; a budget is never
below ``MIN_BYTES``. The shares are data (``SHARES``). Why: docs/memory.md."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from dataclasses import dataclass
from pathlib import Path

MIN_BYTES = 128 << 20
MAX_DEFAULT_BYTES = 1 << 30
MEMORY_FRACTION = 16          # the default is MemTotal / 16, clamped to [MIN_BYTES, MAX_DEFAULT_BYTES]
BUDGET_RULE = "MemTotal / 16, at least 128 MiB, at most 1 GiB"
SHARES = {"retired_weights": 1.0, "programs": 0.25}   # fractions of the budget, on a board
# On the simulator NPU memory is host memory twice (sim.memory: a cacheable object has a DRAM
# and a CPU-cache view) and each weight it multiplies is decoded to fp32 once more (sim.conv
# OperandCache): a retired NPU byte costs about four host bytes. The retired share shrinks to
# match; the decoded weights get twice the budget, so that gemma3-270m's (~1.1 GiB) fit at 1 GiB.
SIMULATED_SHARES = {"retired_weights": 0.25, "programs": 0.25, "sim_decoded": 2.0}


# glibc serves a request above its mmap threshold with its own mapping, returned to the system
# when freed; below it, from the heap, whose freed middle is never returned. The threshold
# starts at 128 KiB and rises to the size of each mapped block freed, up to 32 MiB, so after the
# first freed expert slice (MoE weights: 0.1-16 MiB each) every slice, conversion and simulated
# buffer below 32 MiB came from the heap, and one live block near its top kept gigabytes of
# freed ones resident. A fixed threshold ends the rise [mallopt(3): M_MMAP_THRESHOLD]; below it
# are the per-token temporaries, reused from the heap as before.
M_MMAP_THRESHOLD = -3           # glibc malloc.h
MMAP_THRESHOLD_BYTES = 4 << 20
# Each session is a thread, and glibc gives threads arenas of their own (heaps of 64 MiB mapped
# apart from the main one), which give memory back only from the top of each heap: after the
# small-expert MUL_MAT_ID cases one arena held 671 MB with 62 MB in use (malloc_stats(3)).
# malloc_trim(3) returns the free pages inside every arena; it runs once a session has freed
# this much since the last trim, and when a session ends.
TRIM_AFTER_FREED_BYTES = 64 << 20


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library, if it is glibc (it has ``mallopt`` and ``malloc_trim``), else None."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is None:
            return None
        libc.mallopt.argtypes, libc.mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def fix_malloc_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Pin glibc's mmap threshold (False where the C library is not glibc: nothing done)."""
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))


def return_free_heap() -> bool:
    """Give the free pages of every malloc arena back to the system (False where the C library
    is not glibc, or nothing could be returned)."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


def meminfo_bytes(name: str, meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """A /proc/meminfo figure (MemTotal, MemAvailable, ...) in bytes, or None where it does not say."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith(f"{name}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def mem_total_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The machine's MemTotal, or None where /proc/meminfo does not say."""
    return meminfo_bytes("MemTotal", meminfo)


def default_budget(mem_total: int | None) -> int:
    """``BUDGET_RULE`` for a machine with ``mem_total`` bytes (unknown: the minimum)."""
    if mem_total is None:
        return MIN_BYTES
    return max(MIN_BYTES, min(MAX_DEFAULT_BYTES, mem_total // MEMORY_FRACTION))


@dataclass(frozen=True)
class HostBudget:
    """One budget and what each cache may keep of it."""

    bytes: int
    simulated: bool = False

    def __post_init__(self) -> None:
        if self.bytes < MIN_BYTES:
            raise ValueError(f"the host cache budget must be at least {MIN_BYTES >> 20} MiB, got {self.bytes >> 20} MiB")

    def share(self, cache: str) -> int:
        return int(self.bytes * (SIMULATED_SHARES if self.simulated else SHARES)[cache])

    def describe(self) -> str:
        sim = f", the simulator's decoded weights {self.share('sim_decoded') >> 20} MiB" if self.simulated else ""
        return (f"host cache budget {self.bytes >> 20} MiB (retired weights {self.share('retired_weights') >> 20} MiB, "
                f"programs {self.share('programs') >> 20} MiB{sim})")
