"""Shared scratch: one NPU buffer per M bucket holding A then C, used by every bound
program of that bucket.

Invariants: a program's register commands only ever point at a live scratch buffer (a
larger buffer is allocated first, every user re-bound to it, then the old one freed); the
last user frees it; a job syncs only the share its program uses. Why: docs/decisions.md
"engine/api.py"."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import numpy.typing as npt

from ggml_rknpu.engine.memory import NpuMemory, c_base
from ggml_rknpu.kernel.buffer import Buffer
from ggml_rknpu.kernel.job import BufferRange


class ScratchUser(Protocol):
    """A bound program on a scratch buffer: re-bound when the buffer is replaced."""

    def write_words(self) -> None: ...


class Scratch:
    """The shared scratch buffer of an M bucket, A then C, and the bound programs using it:
    A at 0 (``a_cap`` bytes, the largest A of its programs), C from ``c_base`` (``c_cap``
    bytes), so one clean covers what the CPU writes into both (A, the canaries in C)."""

    def __init__(self, pool: ScratchPool, key: tuple[int, int], buf: Buffer, a_cap: int, c_cap: int) -> None:
        self.pool, self.key, self.buf = pool, key, buf   # key: (IOMMU domain, M bucket)
        self.a_cap, self.c_cap = a_cap, c_cap
        self.users: set[ScratchUser] = set()
        pool.buckets[key] = self

    @property
    def c_base(self) -> int:
        return c_base(self.a_cap)

    def leave(self, bound: ScratchUser) -> None:
        """``bound`` no longer uses this buffer; the last user frees it."""
        self.users.discard(bound)
        if not self.users and self.pool.buckets.get(self.key) is self:
            del self.pool.buckets[self.key]
            self.buf.close()


class ScratchShare:
    """The first ``size`` bytes of a shared scratch buffer's A or C region that one program
    uses. It follows the scratch buffer when that is replaced by a larger one; ``range()``
    is what the program's job reads or writes, so a submit syncs that, not the whole buffer."""

    __slots__ = ("scratch", "role", "size")

    def __init__(self, scratch: Scratch, role: str, size: int) -> None:
        self.scratch, self.role, self.size = scratch, role, size

    @property
    def offset(self) -> int:
        return 0 if self.role == "A" else self.scratch.c_base

    @property
    def dma_addr(self) -> int:
        return self.scratch.buf.dma_addr + self.offset

    def array(self, dtype: npt.DTypeLike = np.uint8) -> np.ndarray:
        start, item = self.offset, np.dtype(dtype).itemsize
        return self.scratch.buf.array(np.uint8)[start: start + self.size // item * item].view(dtype)

    def range(self) -> BufferRange:
        return BufferRange(self.scratch.buf, self.offset, self.size)


class ScratchPool:
    """The scratch buffers of one engine, by IOMMU domain and M bucket (a job's buffers are all
    in one domain)."""

    def __init__(self, memory: NpuMemory, counters: dict[str, int]) -> None:
        self.memory = memory
        self.counters = counters
        self.buckets: dict[tuple[int, int], Scratch] = {}

    def join(self, bound: ScratchUser, m: int, a_bytes: int, c_bytes: int, what: str, domain: int = 0
             ) -> tuple[ScratchShare, ScratchShare]:
        """Shares of ``a_bytes`` (A) and ``c_bytes`` (C) of bucket ``m``'s scratch buffer in
        ``domain``, growing it if needed: the larger buffer is allocated first, the programs on
        the old one re-bound to it, then the old one freed (so no program ever points at freed memory)."""
        key = (domain, m)
        scratch = self.buckets.get(key)
        if scratch is None or scratch.a_cap < a_bytes or scratch.c_cap < c_bytes:
            a_cap = max(a_bytes, scratch.a_cap if scratch else 0)
            c_cap = max(c_bytes, scratch.c_cap if scratch else 0)
            buf = self.memory.alloc(c_base(a_cap) + c_cap, "data", what, domain=domain)
            scratch = self.buckets.get(key)          # the allocation may have evicted its users
            if scratch is None:
                scratch = Scratch(self, key, buf, a_cap, c_cap)
            else:
                old, scratch.buf, scratch.a_cap, scratch.c_cap = scratch.buf, buf, a_cap, c_cap
                for user in scratch.users:
                    user.write_words()
                old.close()
                self.counters["scratch_grown"] += 1
        scratch.users.add(bound)
        return ScratchShare(scratch, "A", a_bytes), ScratchShare(scratch, "C", c_bytes)

    def nbytes(self) -> int:
        """NPU bytes held by the shared A and C buffers."""
        return sum(s.buf.capacity for s in self.buckets.values())
