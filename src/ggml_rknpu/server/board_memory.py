"""Board accounting: the bytes a board's DRAM would hold for the server at this moment, by kind.

An RK3588's NPU has no memory of its own, so the client's buffers, the repacked host copies,
the NPU's weights, programs and scratch, the host caches and the server process itself all come
out of one DRAM. ``BoardMemory.now`` adds them up from the server's own counters (no estimate):
buffers at their allocated size (an upper bound: pages of a compute buffer no graph wrote are
not committed), the weight pages apart (file-backed, the kernel may drop them), the server at
its resident size when it started. Why: docs/memory.md "Board accounting"."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MIB = 2**20


def resident_bytes(field: str = "VmRSS", status: Path = Path("/proc/self/status")) -> int:
    """``field`` of this process's /proc status in bytes (0 where the system has no /proc)."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return 0


@dataclass(frozen=True)
class BoardBytes:
    """One reading. ``total`` is what DRAM holds; ``weight_pages`` are outside it (page cache)."""

    client_buffers: int     # ALLOC_BUFFER bytes held in anonymous memory (weight pages excluded)
    repacked_host_copies: int
    npu: int                # NPU memory: staged weights (live and retired), programs, scratch
    npu_retired: int        # ... of it, retired weights kept for a later client (a cache)
    npu_scratch: int        # ... of it, the shared activation and output buffers
    programs: int           # ... of it, the cached programs (their register commands; the engine's
                            # count adds their compiled words on the host, a page at most each)
    host_caches: int        # the plans the sessions hold (ggml contexts and work buffers)
    server_at_start: int    # the server's resident size before its first client
    weight_pages: int       # GGUF bytes of weights with another copy, file-backed and droppable

    @property
    def total(self) -> int:
        return self.client_buffers + self.repacked_host_copies + self.npu + self.host_caches + self.server_at_start

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}

    def render(self) -> str:
        return (f"board memory {self.total / MIB:.1f} MiB: client buffers {self.client_buffers / MIB:.1f}, repacked "
                f"host copies {self.repacked_host_copies / MIB:.1f}, NPU {self.npu / MIB:.1f} (retired "
                f"{self.npu_retired / MIB:.1f}, scratch {self.npu_scratch / MIB:.1f}, programs "
                f"{self.programs / MIB:.1f}), host caches (plans) {self.host_caches / MIB:.1f}, the server at start "
                f"{self.server_at_start / MIB:.1f}; weight pages on disk {self.weight_pages / MIB:.1f} MiB "
                "(droppable, not counted)")


class BoardMemory:
    """The server's board accounting; made when the server starts (its resident size then)."""

    def __init__(self) -> None:
        self.server_at_start = resident_bytes()

    def now(self, state: Any) -> BoardBytes:
        """A reading of a ``ServerState``: its device budget (``buffers.DeviceBudget``), repacked
        copies, engine (None: no NPU) and retired weights."""
        memory, npu = state.memory, state.npu
        paged = memory.pages.bytes if memory.pages is not None else 0
        on_npu = hasattr(npu, "memory_used")
        return BoardBytes(
            client_buffers=memory.allocated - paged, repacked_host_copies=state.stats.host_repacked_bytes,
            npu=npu.memory_used() if on_npu else 0,
            npu_retired=state.weight_stats.retired_bytes if on_npu else 0,
            npu_scratch=npu.scratch_bytes() if hasattr(npu, "scratch_bytes") else 0,
            programs=npu.program_bytes() if hasattr(npu, "program_bytes") else 0,
            host_caches=state.stats.plan_bytes,
            server_at_start=self.server_at_start, weight_pages=paged)
