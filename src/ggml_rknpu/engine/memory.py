"""``NpuMemory``: the engine's NPU allocations under an optional cap, with eviction.

Invariants: every engine allocation and every job's submit tables go through here; when
memory (or the cap) runs out, least-recently-used programs are evicted first (``evict``);
resident memory (weights, chained fusions) leaves ``reserve_bytes`` free under the cap, so
staged weights never starve the matmul programs; a weight goes to the first IOMMU domain with
room for it and its programs (``alloc_resident``). Why: docs/decisions.md "engine/api.py"."""

from __future__ import annotations

import errno
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from ggml_rknpu.hw.alignment import align_up
from ggml_rknpu.hw.limits import PAGE_BYTES
from ggml_rknpu.kernel.buffer import Buffer
from ggml_rknpu.kernel.device import NpuDevice
from ggml_rknpu.kernel.errors import NpuOutOfMemory
from ggml_rknpu.kernel.job import Job

C_ALIGN = 64   # C starts this far into a bucket's scratch buffer: no cache line holds A and C bytes


def c_base(a_cap: int) -> int:
    """Where C starts in a scratch buffer whose A region holds ``a_cap`` bytes."""
    return align_up(a_cap, C_ALIGN)


def pages(size: int) -> int:
    """What an allocation of ``size`` bytes takes: whole pages [hw.limits.PAGE_BYTES]."""
    return align_up(max(size, 1), PAGE_BYTES)


@dataclass(frozen=True)
class Headroom:
    """NPU bytes a program of one weight at ``RESERVE_ROWS`` rows needs beside the weight: its
    A and C in the bucket's shared scratch buffer, and its own register commands and submit
    tables (``own``). ``NpuMemory.reserve_bytes`` adds them up over the resident weights."""

    a: int
    c: int
    own: int


class NpuMemory:
    """Allocations of one engine on its device; ``cap``: at most this many bytes (None: what
    the driver gives). Boards share DRAM between CPU and NPU; a server caps what it stages
    (``rknpu serve --npu-memory``)."""

    def __init__(self, device: NpuDevice) -> None:
        self.device = device
        self.cap: int | None = None
        self.peak = 0   # most NPU bytes in use at once, tracked while cap is set
        self.evict: Callable[[], bool] = lambda: False   # frees one cached program; False when none is left
        self._headrooms: dict[Hashable, Headroom] = {}   # per resident weight
        self._room_domains: dict[Hashable, int] = {}     # the IOMMU domain of each resident weight
        self.domains: set[int] = {0}                     # the IOMMU domains allocated in
        self._rooms: Headroom | None = Headroom(0, 0, 0)   # the headrooms combined (None: stale)

    def used(self) -> int:
        """NPU bytes in use: weights, programs, scratch (what ``cap`` bounds)."""
        return sum(total - free for free, total in map(self.device.iova_budget, self.domains))

    def alloc_resident(self, size: int, what: str, headroom: Headroom | None) -> Buffer:
        """A weight's buffer in the first IOMMU domain (0, 1, ...) that holds it and then still
        the room the programs of its weights there need (``domain_reserve``, ``headroom``
        included: allocated once and freed, which is the one test of a window the driver
        cannot see); else ``alloc`` in domain 0, which evicts or fails as with one domain."""
        for domain in range(self.device.max_domains):
            try:
                buf = self.alloc(size, "data", what, resident=True, headroom=headroom, domain=domain, evict=False)
            except NpuOutOfMemory:
                continue
            try:
                if reserve := self.domain_reserve(domain, headroom):
                    self.device.alloc(reserve, domain=domain).close()
            except NpuOutOfMemory:
                buf.close()
                continue
            return buf
        return self.alloc(size, "data", what, resident=True, headroom=headroom)

    def domain_reserve(self, domain: int, extra: Headroom | None) -> int:
        """``reserve_bytes`` over the resident weights in ``domain`` and ``extra``."""
        rooms = [room for owner, room in self._headrooms.items() if self._room_domains.get(owner, 0) == domain]
        if extra is not None:
            rooms.append(extra)
        if not rooms:
            return 0
        a, c = max(r.a for r in rooms), max(r.c for r in rooms)
        return pages(c_base(a) + c) + sum(r.own for r in rooms)

    def _track_peak(self) -> None:
        if self.cap is not None:
            self.peak = max(self.peak, self.used())

    def alloc(self, size: int, purpose: str, what: str, *, resident: bool = False,
              headroom: Headroom | None = None, domain: int = 0, evict: bool = True) -> Buffer:
        """Allocate, evicting least-recently-used programs when NPU memory (or the cap) runs out.

        ``resident``: memory no eviction gives back (a weight, a chained fusion's buffers). Under
        ``cap`` it must leave ``reserve_bytes(headroom)`` free, the room the programs of the
        resident weights (and ``headroom``, the weight being uploaded) need. Programs and
        scratch may use the whole cap. ``domain``: the IOMMU domain; ``evict`` False: fail at once."""
        while True:
            try:
                if self.cap is not None:
                    keep = self.reserve_bytes(headroom) if resident else 0
                    if self.used() + pages(size) + keep > self.cap:
                        raise NpuOutOfMemory(
                            f"{size} more bytes would exceed the NPU memory cap of {self.cap} bytes"
                            + (f" less the {keep} bytes kept for the matmul programs" if keep else ""), errno.ENOMEM)
                buf = self.device.alloc(max(size, 1), purpose=purpose, domain=domain)
                self.domains.add(domain)
                self._track_peak()
                return buf
            except NpuOutOfMemory as exc:
                if not evict:
                    raise
                if not self.evict():
                    free, total = self.device.iova_budget(domain)
                    if self.cap is not None:
                        free, total = max(0, self.cap - self.used()), self.cap
                    raise NpuOutOfMemory(
                        f"out of NPU memory allocating {size} bytes for {what} "
                        f"({free} of {total} bytes free{' under the cap' if self.cap else ''}, no cached "
                        f"program left to evict: {exc}); free weights you no longer need", exc.errno) from exc

    def prepare_jobs(self, jobs: tuple[Job, ...], what: str) -> None:
        """Plan ``jobs`` on the device now: the memory its submit tables take (the vendor
        driver's task BO, a page per job) is allocated here, under ``cap`` and with eviction
        like every other allocation, not at a later submit."""
        for job in jobs:
            while True:
                try:
                    need = self.device.table_bytes(job)
                    if need and self.cap is not None and self.used() + need > self.cap:
                        raise NpuOutOfMemory(f"{need} more bytes would exceed the NPU memory cap of "
                                             f"{self.cap} bytes", errno.ENOMEM)
                    self.device.prepare(job)
                    if need:
                        self._track_peak()
                    break
                except NpuOutOfMemory as exc:
                    if not self.evict():
                        raise NpuOutOfMemory(f"out of NPU memory planning the submits of {what}; free weights "
                                             "you no longer need", exc.errno) from exc

    def reserve_bytes(self, extra: Headroom | None = None) -> int:
        """What resident memory leaves free under ``cap``: one scratch buffer at
        ``RESERVE_ROWS`` holding the largest A and the largest C of the resident weights' (and
        ``extra``'s) programs, plus each one's own register commands and submit tables. With
        it, a matmul of a resident weight at up to ``RESERVE_ROWS`` rows always finds memory,
        and those of every weight at once fit side by side (no eviction per token)."""
        if self._rooms is None:   # after a free: summed again once (an upload adds its own in O(1))
            self._rooms = Headroom(0, 0, 0)
            for room in self._headrooms.values():
                self._add(room)
        a, c, own = self._rooms.a, self._rooms.c, self._rooms.own
        if extra is not None:
            a, c, own = max(a, extra.a), max(c, extra.c), own + extra.own
        return pages(c_base(a) + c) + own if a or c or own else 0

    def keep_room(self, owner: Hashable, room: Headroom | None, domain: int = 0) -> None:
        """``owner`` (a resident weight in ``domain``) needs ``room`` for its programs from now on."""
        if room is not None:
            self._headrooms[owner] = room
            self._room_domains[owner] = domain
            self._add(room)

    def drop_room(self, owner: Hashable) -> None:
        self._room_domains.pop(owner, None)
        if self._headrooms.pop(owner, None) is not None:
            self._rooms = None

    def _add(self, room: Headroom) -> None:
        if self._rooms is not None:
            r = self._rooms
            self._rooms = Headroom(max(r.a, room.a), max(r.c, room.c), r.own + room.own)
