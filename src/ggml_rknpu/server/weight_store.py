"""Weight residency: MUL_MAT weights converted once, staged on the NPU, invalidated on any write.

Invariants: a slot is the bytes ``[start, end)`` of one buffer, converted by ggml's own
dequantizer and uploaded in the server's weight format; any later write to those bytes (a
SET/COPY/MEMSET of them, BUFFER_CLEAR, or a graph node's output overlapping them) frees
the staged copy, so a result never comes from stale weights; a slot invalidated more than
``VOLATILE_AFTER`` times goes to the host for good; staged weights outlive their connection
in a server-wide LRU keyed by the exact bytes' SHA-256 and layout (``RetiredWeights``),
so a weight with any different byte never matches; within the host cache budget those
copies keep only the room the live sessions' staged weights leave.
Why: docs/server.md "Weight residency", docs/memory.md "What outlives connections"."""

from __future__ import annotations

import hashlib
import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from ggml_rknpu.engine.contract import EngineWeight, MatmulEngine
from ggml_rknpu.hw.limits import BYTES
from ggml_rknpu.kernel.errors import NpuOutOfMemory
from ggml_rknpu.libggml import lib as libggml
from ggml_rknpu.libggml.enums import GgmlType
from ggml_rknpu.server.buffers import RpcBuffer
from ggml_rknpu.server.live_weights import LiveWeights
from ggml_rknpu.server.memory_budget import OVER_BUDGET, MemoryBudget
from ggml_rknpu.server.tensor import CheckedTensor

log = logging.getLogger("ggml_rknpu.rpc")

def _weight_types() -> frozenset[int]:
    """The ggml types the server converts into NPU weights: F32 and every type ggml can
    dequantize (its ``to_float`` exists in the loaded build). Anything else runs on the host."""
    g = libggml.load()
    return frozenset({int(GgmlType.F32)} | {int(t) for t in GgmlType if g.to_float(t) is not None})


WEIGHT_FORMATS = ("fp16", "int8")
VOLATILE_AFTER = 2
PROGRESS_MIN_SLOTS = 4   # a bar for a model load, not for one test tensor


CONVERT_ROWS = 8192      # rows per conversion chunk: bounds the temporaries of a 262k-row output head


def to_float_rows(raw: np.ndarray, type_id: int, n_rows: int, k: int) -> np.ndarray:
    """ggml bytes of a contiguous [n_rows, k] tensor -> float32 [n_rows, k].

    ggml's own ``to_float`` of the type (F32 is a view), converted in row chunks straight
    into one preallocated array."""
    out = np.empty((n_rows, k), dtype=np.float32)
    if type_id == GgmlType.F32:
        out[...] = np.ascontiguousarray(raw).view(np.float32).reshape(n_rows, k)
        return out
    to_float = libggml.load().to_float(type_id)
    if to_float is None:
        raise ValueError(f"ggml has no dequantizer for type {type_id}")
    rows = np.ascontiguousarray(raw).reshape(n_rows, -1)
    for r0 in range(0, n_rows, CONVERT_ROWS):
        r1 = min(n_rows, r0 + CONVERT_ROWS)
        to_float(rows[r0:r1].ctypes.data, out[r0:r1].ctypes.data, (r1 - r0) * k)
    return out


@dataclass(eq=False)
class WeightSlot:
    """One weight tensor's bytes in one buffer, and its staged NPU copy (or None)."""

    buffer: RpcBuffer
    start: int
    end: int
    type: int
    n: int                           # rows (ne01): output features
    k: int                           # row length (ne00)
    name: str
    layout: tuple = ()               # (ne, nb) of the tensor: part of the content key
    handle: EngineWeight | None = None   # engine weight from npu.upload_weight, None = not staged
    invalidations: int = 0
    volatile: bool = False           # demoted for good: runs on the host
    failed: str | None = None        # why the engine refused it: runs on the host
    content_key: tuple | None = None  # RetiredWeights key of the staged copy (None: reuse off)
    expert: bool = False             # one expert's slice of a MUL_MAT_ID weight (counted apart)

    @property
    def on_npu(self) -> bool:
        return not self.volatile and self.failed is None

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class WeightStats:
    staged: int = 0                  # currently resident
    staged_bytes: int = 0            # ggml bytes of the resident weights
    peak_staged: int = 0             # most weights resident at once (a model's count)
    uploads: int = 0                 # total npu.upload_weight calls
    invalidations: int = 0
    demoted: int = 0
    failures: int = 0
    matmul_failures: int = 0         # ... of them sent to the host by a failed NPU matmul (not a fault), e.g. out of NPU memory
    upload_seconds: float = 0.0
    digest_seconds: float = 0.0      # hashing candidate bytes for the reuse key
    reused: int = 0                  # stagings served from a retired copy (no conversion)
    retired: int = 0                 # staged copies kept after their buffer was freed
    evicted: int = 0                 # retired copies freed for NPU memory
    evicted_budget: int = 0          # retired copies freed (or not kept) to stay within the host cache budget
    evicted_staging: int = 0         # retired copies freed to leave the budget to live staged weights
    retired_now: int = 0             # retired copies held now
    retired_bytes: int = 0           # NPU bytes of the retired copies held now
    host_now: int = 0                # weights of live buffers the engine refused or demoted: on the host
    host_bytes_now: int = 0          # ... their ggml bytes
    experts_staged: int = 0          # MUL_MAT_ID expert slices resident now (included in ``staged``)
    experts_host: int = 0            # expert slices of live buffers refused or demoted: on the host


def _free_handle(handle: EngineWeight, name: str) -> None:
    try:
        handle.free()
    except Exception as exc:   # the engine could not release it; nothing here can do better
        log.error("freeing the staged weight '%s' failed: %s", name, exc)


class RetiredWeights:
    """Server-wide LRU of staged weights whose buffers were freed, keyed by content.

    Bounded twice: by ``budget_bytes`` (``rknpu serve --host-cache-budget``; on a board NPU
    memory is the host's DRAM, so what is kept for a client that may never come back must
    leave room for everything else), the oldest copies freed at retirement; and by NPU
    memory, ``evict_one`` freeing the oldest copy when an upload runs out of it. The copies
    also give way to live ones (``make_room``): before a weight is staged fresh, the oldest
    are freed until they, the live sessions' distinct staged copies and the new one fit in
    the budget together, so a model being loaded is not resident beside a cache of copies
    nobody holds (the page cache's rule: reclaimable memory yields to memory in use); two
    models that fit in the budget together are both kept.
    ``npu_bytes`` is what GET_DEVICE_MEMORY adds back to the free figure (it can be
    reclaimed at any time)."""

    def __init__(self, stats: WeightStats, budget_bytes: int | None = None) -> None:
        self.stats = stats
        self.budget_bytes = budget_bytes     # None: bounded by NPU memory only
        self._lru: OrderedDict[tuple, tuple[EngineWeight, int, str]] = OrderedDict()

    @property
    def npu_bytes(self) -> int:
        return self.stats.retired_bytes

    def retire(self, key: tuple, handle: EngineWeight, nbytes: int, name: str) -> bool:
        """Keep ``handle`` under ``key``, freeing the oldest copies beyond the budget; False
        (caller frees it) if an equal copy is already kept or the copy alone exceeds the budget."""
        if key in self._lru:
            return False
        if self.budget_bytes is not None and nbytes > self.budget_bytes:
            self.stats.evicted_budget += 1
            return False
        self._lru[key] = (handle, nbytes, name)
        self.stats.retired += 1
        self.stats.retired_now += 1
        self.stats.retired_bytes += nbytes
        while self.budget_bytes is not None and self.stats.retired_bytes > self.budget_bytes:
            self._free_oldest()
            self.stats.evicted_budget += 1
        return True

    def take(self, key: tuple) -> EngineWeight | None:
        """The retired copy for ``key``, removed from the LRU, or None."""
        entry = self._lru.pop(key, None)
        if entry is None:
            return None
        self.stats.retired_now -= 1
        self.stats.retired_bytes -= entry[1]
        return entry[0]

    def make_room(self, in_use: int) -> None:
        """Free the oldest copies until they fit in the budget beside ``in_use`` bytes of live
        staged copies (or none is left)."""
        if self.budget_bytes is None:
            return
        while self._lru and self.stats.retired_bytes + in_use > self.budget_bytes:
            self._free_oldest()
            self.stats.evicted_staging += 1

    def evict_one(self) -> bool:
        """Free the oldest copy for NPU memory; False when none is kept."""
        if not self._lru:
            return False
        self._free_oldest()
        self.stats.evicted += 1
        return True

    def _free_oldest(self) -> None:
        _, (handle, nbytes, name) = self._lru.popitem(last=False)
        self.stats.retired_now -= 1
        self.stats.retired_bytes -= nbytes
        _free_handle(handle, name)

    def clear(self) -> None:
        while self._lru:
            self._free_oldest()


@dataclass
class WeightStore:
    """The slots of one connection (freed with its buffers)."""

    npu: MatmulEngine | None
    fmt: str = "fp16"
    progress: bool = True
    stats: WeightStats = field(default_factory=WeightStats)
    retired: RetiredWeights | None = None   # None: no reuse across connections
    live: LiveWeights | None = None         # the live sessions' stores; shares copies by content with retired
    # False once the session ended in an error (a broken or hostile client): the weights of the
    # buffers freed from then on are freed, not retired, so no client fills the retired copies
    # with bytes nobody will ask for again
    retire_on_free: bool = True
    budget: MemoryBudget | None = None      # the server's memory budget (None: NPU memory bounds staging)
    _slots: dict[tuple, WeightSlot] = field(default_factory=dict)
    _by_buffer: dict[int, list[WeightSlot]] = field(default_factory=dict)
    types: frozenset[int] = field(default_factory=_weight_types)

    def __post_init__(self) -> None:
        if self.fmt not in WEIGHT_FORMATS:
            raise ValueError(f"weight format must be one of {WEIGHT_FORMATS}, not {self.fmt!r}")
        if self.live is not None:
            self.live.attach(self)

    def slot_for(self, t: CheckedTensor, expert: bool = False) -> WeightSlot | None:
        """The slot for a candidate weight, or None if it cannot be an NPU weight.

        ``expert``: ``t`` is one expert's [K, N] slice of a MUL_MAT_ID weight (``ggml.expert_step``);
        it is keyed, staged, invalidated and reused exactly like a 2-D weight, only counted apart."""
        r = t.rpc
        if self.npu is None or t.buffer is None or r.type not in self.types:
            return None
        key = (t.buffer.handle, t.start, t.end, r.type, r.ne[0], r.ne[1])
        slot = self._slots.get(key)
        if slot is None:
            slot = WeightSlot(buffer=t.buffer, start=t.start, end=t.end, type=r.type,
                              n=r.ne[1], k=r.ne[0], name=r.name, layout=(tuple(r.ne), tuple(r.nb)),
                              expert=expert)
            self._slots[key] = slot
            self._by_buffer.setdefault(t.buffer.handle, []).append(slot)
        return slot if slot.on_npu else None

    def weight(self, slot: WeightSlot) -> EngineWeight | None:
        """The staged engine weight, staging it first if needed (None: run on the host)."""
        if not slot.on_npu:
            return None
        if slot.handle is None:
            self._stage(slot)
        return slot.handle

    def matmul_failed(self, slot: WeightSlot, exc: BaseException) -> None:
        """The engine failed a matmul with this weight: host path for good, NPU copy freed.

        Out of NPU memory (programs and scratch are allocated at the first matmul of a
        size) while retired copies hold some: free the oldest instead; this run falls
        back to the host and the next one tries the NPU again."""
        if isinstance(exc, NpuOutOfMemory) and self.retired is not None and self.retired.evict_one():
            log.info("NPU out of memory in a matmul with '%s': evicted a retired weight", slot.name)
            return
        self.stats.matmul_failures += 1
        self.demote(slot, f"{type(exc).__name__}: {exc}")

    def demote(self, slot: WeightSlot, reason: str) -> None:
        """Host path for good for this weight (``reason`` is logged and kept); NPU copy freed."""
        self._to_host(slot, reason)
        log.error("NPU matmul with '%s' failed, host path from now on: %s", slot.name, reason)
        self._unstage(slot)

    def _to_host(self, slot: WeightSlot, reason: str) -> None:
        slot.failed = reason
        self.stats.failures += 1
        self.stats.host_now += 1
        self.stats.host_bytes_now += slot.nbytes
        self.stats.experts_host += slot.expert

    def _forget(self, slot: WeightSlot) -> None:
        """The slot's buffer is gone: its staged copy is retired (or freed), its host count dropped."""
        self._unstage(slot, retire=self.retire_on_free)
        if slot.failed is not None:
            self.stats.host_now -= 1
            self.stats.host_bytes_now -= slot.nbytes
            self.stats.experts_host -= slot.expert

    def restage(self, lost: Callable[[EngineWeight], bool]) -> int:
        """Forget the staged copies ``lost(handle)`` names (an NPU reset destroyed them), in
        every live session; the next use stages them again. Returns how many."""
        return self.live.restage(lost) if self.live is not None else self.restage_own(lost)

    def restage_own(self, lost: Callable[[EngineWeight], bool]) -> int:
        """``restage`` of this session's slots only."""
        n = 0
        for slots in self._by_buffer.values():
            for slot in slots:
                if slot.handle is not None and lost(slot.handle):
                    slot.handle = None
                    self.stats.staged -= 1
                    self.stats.staged_bytes -= slot.nbytes
                    self.stats.experts_staged -= slot.expert
                    n += 1
        return n

    def admit(self, slot: WeightSlot) -> bool:
        """Whether ``slot`` may be staged under the memory budget: a staged slot may; one the
        budget refuses stays on the host for good (``_to_host``; the budget names it)."""
        if (self.budget is None or slot.handle is not None
                or self.budget.admits(slot.name, slot.n * slot.k * BYTES[self.fmt])):
            return True
        self._to_host(slot, OVER_BUDGET)
        return False

    def stage_admitted(self, slots: Iterable[WeightSlot]) -> None:
        """Stage the slots the memory budget admits, first come (MUL_MAT_ID experts, staged when
        first routed to); the others run on the host for good (``admit``)."""
        self.stage_all([s for s in slots if self.admit(s)])

    def stage_all(self, slots: Iterable[WeightSlot]) -> None:
        """Stage every not-yet-resident slot, with a progress bar for a model-sized batch."""
        try:
            self._stage_all(slots)
        finally:
            if self.budget is not None:
                self.budget.settle()

    def _stage_all(self, slots: Iterable[WeightSlot]) -> None:
        todo = [s for s in dict.fromkeys(slots) if s.handle is None and s.on_npu]
        if not todo:
            return
        if not (self.progress and len(todo) >= PROGRESS_MIN_SLOTS):
            for slot in todo:
                self._stage(slot)
            return
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        total = sum(s.nbytes for s in todo)
        columns = (TextColumn("staging weights ({task.fields[fmt]})"), BarColumn(), DownloadColumn(),
                   TextColumn("{task.fields[name]}"), TimeRemainingColumn())
        with Progress(*columns, console=Console(file=sys.stderr), transient=False) as bar:
            line = bar.add_task("stage", total=total, fmt=self.fmt, name="")   # rich calls a bar's line a task
            for slot in todo:
                bar.update(line, name=slot.name)
                self._stage(slot)
                bar.advance(line, slot.nbytes)
        log.info("staged %d weights (%.1f MiB of ggml data) as %s", len(todo), total / 2**20, self.fmt)

    def _stage(self, slot: WeightSlot) -> None:
        t0 = time.perf_counter()
        raw = slot.buffer.array[slot.start:slot.end]
        slot.content_key = None
        if self.retired is not None:
            digest = hashlib.sha256(raw.data).digest()
            slot.content_key = (digest, slot.type, slot.layout, self.fmt)
            self.stats.digest_seconds += time.perf_counter() - t0
            shared = self.live.acquire(slot.content_key) if self.live is not None else None
            slot.handle = shared if shared is not None else self.retired.take(slot.content_key)
            if slot.handle is not None:
                self.stats.reused += shared is None
                self._staged(slot)
                if shared is None and self.live is not None:
                    self.live.add(slot.content_key, slot.handle)
                return
        try:
            rows = to_float_rows(raw, slot.type, slot.n, slot.k)
            if self.retired is not None:
                live = self.live.npu_bytes if self.live is not None else 0
                self.retired.make_room(live + rows.size * BYTES[self.fmt])
            slot.handle = self._upload(rows)
        except Exception as exc:  # engine limits / NPU out of memory: this weight stays on the host
            self._to_host(slot, f"{type(exc).__name__}: {exc}")
            log.warning("weight '%s' [%d x %d] stays on the host: %s", slot.name, slot.n, slot.k, slot.failed)
            return
        self.stats.uploads += 1
        self._staged(slot)
        if self.live is not None and slot.content_key is not None:
            self.live.add(slot.content_key, slot.handle)
        self.stats.upload_seconds += time.perf_counter() - t0

    def _upload(self, b: np.ndarray) -> EngineWeight:
        """``npu.upload_weight``, freeing retired copies LRU-first while NPU memory is short."""
        assert self.npu is not None, "weights are staged only with an engine"
        while True:
            try:
                return self.npu.upload_weight(b, dtype=self.fmt)
            except NpuOutOfMemory:
                if self.retired is None or not self.retired.evict_one():
                    raise

    def _staged(self, slot: WeightSlot) -> None:
        """Count a slot just staged; its GGUF bytes, needed now only to read back or stage
        again, go to the buffer's weight pages (``weight_pages``)."""
        slot.buffer.keep_in_file(slot.start, slot.end)
        self.stats.staged += 1
        self.stats.peak_staged = max(self.stats.peak_staged, self.stats.staged)
        self.stats.staged_bytes += slot.nbytes
        self.stats.experts_staged += slot.expert

    def _unstage(self, slot: WeightSlot, retire: bool = False) -> None:
        """Free the staged copy, or with ``retire`` hand it to the retired LRU (buffer freed)."""
        if slot.handle is None:
            return
        handle, slot.handle = slot.handle, None
        key, slot.content_key = slot.content_key, None
        self.stats.staged -= 1
        self.stats.staged_bytes -= slot.nbytes
        self.stats.experts_staged -= slot.expert
        if key is not None and self.live is not None and not self.live.release(key, handle):
            return                                   # another session still uses this copy
        if retire and key is not None and self.retired is not None:
            nbytes = handle.packed_bytes
            if self.retired.retire(key, handle, nbytes, slot.name):
                return
        _free_handle(handle, slot.name)

    def invalidate(self, buffer: RpcBuffer, start: int, end: int) -> None:
        """Bytes [start, end) of ``buffer`` were written: drop staged copies overlapping them."""
        for slot in self._by_buffer.get(buffer.handle, ()):
            if slot.start < end and start < slot.end and slot.handle is not None:
                self._unstage(slot)
                slot.invalidations += 1
                self.stats.invalidations += 1
                if slot.invalidations >= VOLATILE_AFTER and not slot.volatile:
                    slot.volatile = True
                    self.stats.demoted += 1
                    log.info("weight candidate '%s' is rewritten repeatedly: host path from now on", slot.name)

    def mark_graph_written(self, buffer: RpcBuffer, start: int, end: int) -> None:
        """A graph node writes [start, end): overlapping slots are activations, demoted for good.

        Plans are replayed without re-deciding, so a replayed write could never
        invalidate a copy staged in between; demoting at plan time is what keeps
        every replay correct.
        """
        for slot in self._by_buffer.get(buffer.handle, ()):
            if slot.start < end and start < slot.end:
                self._unstage(slot)
                if not slot.volatile:
                    slot.volatile = True
                    self.stats.demoted += 1

    def drop_buffer(self, buffer: RpcBuffer) -> None:
        """The buffer was freed: retire (or free) its staged weights and forget its slots."""
        for slot in self._by_buffer.pop(buffer.handle, ()):
            self._forget(slot)
        self._slots = {k: s for k, s in self._slots.items() if s.buffer is not buffer}

    def close(self) -> None:
        for slots in self._by_buffer.values():
            for slot in slots:
                self._forget(slot)
        self._by_buffer.clear()
        self._slots.clear()
        if self.live is not None:
            self.live.detach(self)
