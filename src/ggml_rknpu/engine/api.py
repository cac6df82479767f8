"""The public matmul engine: resident weights, programs planned once and replayed.

    npu = ggml_rknpu.open()                       # or open(device="sim-rocket", cores=3)
    w = npu.upload_weight(b, dtype="fp16")        # b [N, K], ggml layout: one row per output
    c = npu.matmul(a, w)                          # a [M, K], any M -> c [M, N]

WHY this shape (ARCHITECTURE.md rules 6-7; seed Milestones 9-10 and 16): the seed lost to
the CPU because it converted and uploaded weights on every call; here a weight is converted
and packed into its native layout once, into a device buffer that stays resident, and each
(weight, M bucket) gets one compiled program whose register commands are bound to fixed
buffers once. A call then only packs A into the resident A buffer, submits, waits and
unpacks C.

Scratch memory: A and C are shared, one A and one C buffer per M bucket, grown to the
largest program of that bucket. Matmuls run strictly one after another (one thread, every
call waits for completion), so no two programs use them at once. Per-program buffers made
C (which grows with the K chunk count) scale with the number of cached programs: a 7B
prefill bucket alone overflowed the 4 GiB NPU window. When a shared buffer must grow, the
new one is allocated first, every program using it is re-bound (``Program.bind``) and the
old one freed, so regcmd words always point at live buffers; a shared buffer is freed
with the last program using it (eviction, ``Weight.free``). Regcmd buffers stay per
program. A job lists a ``_Window`` (the first bytes of a shared buffer that its program
uses) rather than the ``Buffer``, so a submit cleans/invalidates what that program uses,
not the whole shared buffer (deviation: ``Job.inputs/outputs`` get a duck-typed view
offering the ``Buffer`` members ``NpuDevice.submit`` uses).

Everything goes through ``NpuDevice.submit``: on the simulator that is ``SimKernel`` ->
``SimNpu``, the same submit path a board takes.

M buckets: 1, 2, 4, ..., ``BUCKET_POW2_MAX``, then multiples of ``BUCKET_POW2_MAX`` up to
``MAX_PROGRAM_M``; a larger M runs as several submits of the largest bucket. Rows beyond M
in a bucket are zero and their outputs discarded.

Timing (``last_timing``): host seconds for pack / submit / unpack are measured on this
host. ``submit_s`` is the whole ``NpuDevice.submit`` call: the cache clean of A, the
blocking submit (the driver waits for completion inside it) and the cache invalidate of C;
the engine adds no cache maintenance of its own (the device owns it). Device seconds are *measured* from
``Completion.hw_elapsed_ns`` on a board, else *modeled* by ``cost.model`` at the NPU clock
the driver reports (1 GHz on the simulator), else "unknown" (labelled in ``device_label``).
A bucket the compiler refuses (more tasks than one hardware run chains) halves the
weight's largest bucket, and the call is split along M.

Deviation from CONTRACT E (additive): ``open_engine(device, cores)`` also accepts an
already-open ``NpuDevice``; ``matmul`` takes ``out`` ("fp32" default, "fp16") for fp16
weights.
"""

from __future__ import annotations

import errno
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from ggml_rknpu.cost.model import ModeledTime, modeled_time
from ggml_rknpu.engine import stale_output
from ggml_rknpu.engine.weights import (
    ResidentWeight,
    StagedWeight,
    check_matrix,
    dequantize_output,
    stage_activation,
    stage_weight,
)
from ggml_rknpu.kernel.errors import NpuError, NpuOutOfMemory, NpuTimeout

BUCKET_POW2_MAX = 256
MAX_PROGRAM_M = 2048
OUT_FOR_WEIGHT = {"fp16": "fp32", "int8": "int32"}


def m_bucket(m: int) -> int:
    """The program size used for ``m`` rows (m <= MAX_PROGRAM_M)."""
    if not 1 <= m <= MAX_PROGRAM_M:
        raise ValueError(f"m must be in 1..{MAX_PROGRAM_M}, got {m}")
    if m <= BUCKET_POW2_MAX:
        return 1 << (m - 1).bit_length()
    return -(-m // BUCKET_POW2_MAX) * BUCKET_POW2_MAX


@dataclass(frozen=True)
class Timing:
    """One matmul call. Host figures are measured here; ``device_s`` is ``device_label``
    ("measured" from the board's hw_elapsed_ns, "modeled" by the cost model, or "unknown")."""

    pack_s: float
    submit_s: float
    unpack_s: float
    device_s: float | None
    device_label: str
    submits: int

    @property
    def host_s(self) -> float:
        return self.pack_s + self.submit_s + self.unpack_s


class _Scratch:
    """One shared A or C buffer of an M bucket and the plans bound to it."""

    def __init__(self, pool: dict[tuple[str, int], "_Scratch"], key: tuple[str, int], buf: Any) -> None:
        self.pool, self.key, self.buf = pool, key, buf
        self.users: set[_Plan] = set()
        pool[key] = self

    def leave(self, plan: "_Plan") -> None:
        """``plan`` no longer uses this buffer; the last user frees it."""
        self.users.discard(plan)
        if not self.users and self.pool.get(self.key) is self:
            del self.pool[self.key]
            self.buf.close()


class _Window:
    """The first ``size`` bytes of a shared scratch buffer, as a job's input or output.
    ``NpuDevice.submit`` checks, cleans and invalidates through it, so a call syncs what
    its program uses, not the whole shared buffer. It follows the scratch buffer when that
    is replaced by a larger one."""

    __slots__ = ("scratch", "size")

    def __init__(self, scratch: _Scratch, size: int) -> None:
        self.scratch, self.size = scratch, size

    @property
    def closed(self) -> bool:
        return self.scratch.buf.closed

    @property
    def device(self) -> Any:
        return self.scratch.buf.device

    @property
    def handle(self) -> int:
        return self.scratch.buf.handle

    @property
    def dma_addr(self) -> int:
        return self.scratch.buf.dma_addr

    def array(self, dtype: Any = np.uint8) -> np.ndarray:
        return self.scratch.buf.array(dtype)[: self.size // np.dtype(dtype).itemsize]

    def sync_to_device(self, offset: int = 0, size: int | None = None) -> None:
        self.scratch.buf.sync_to_device(offset, self.size - offset if size is None else size)

    def sync_from_device(self, offset: int = 0, size: int | None = None) -> None:
        self.scratch.buf.sync_from_device(offset, self.size - offset if size is None else size)


@dataclass(eq=False)
class _Plan:
    """A compiled program bound to windows of its bucket's shared A and C buffers, its own
    regcmd buffer and the weight's B."""

    program: Any
    m: int
    b_addr: int
    modeled: ModeledTime | None
    a_buf: _Window | None = None
    c_buf: _Window | None = None
    regcmd_buf: Any = None
    job: Any = None

    def write_words(self) -> None:
        """Bind the register commands to the current buffers and make them visible to the NPU."""
        words = self.program.bind(a=self.a_buf.dma_addr, b=self.b_addr, c=self.c_buf.dma_addr,
                                  regcmd=self.regcmd_buf.dma_addr)
        self.regcmd_buf.array(np.uint64)[: len(words)] = words
        self.regcmd_buf.sync_to_device(0, words.nbytes)

    def close(self) -> None:
        for window in (self.a_buf, self.c_buf):
            if window is not None:
                window.scratch.leave(self)
        if self.regcmd_buf is not None:
            self.regcmd_buf.close()


class Weight(ResidentWeight):
    """A weight resident in NPU memory in its native layout. ``shape`` is (N, K)."""

    def __init__(self, npu: "Npu", staged: StagedWeight, buffer: Any, packed_bytes: int) -> None:
        self._npu = npu
        self.staged = staged
        self.buffer = buffer
        self.packed_bytes = packed_bytes
        self.plans: dict[tuple[int, str], _Plan] = {}
        self.max_program_m = MAX_PROGRAM_M   # lowered if the compiler refuses a bucket
        self.compile_errors: list[str] = []
        self.freed = False

    def free(self) -> None:
        """Release the weight and every program compiled for it (idempotent)."""
        if self.freed:
            return
        self._npu._forget(self)
        for plan in self.plans.values():
            plan.close()
        self.plans.clear()
        self.buffer.close()
        self.freed = True

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"{len(self.plans)} programs"
        return f"Weight(N={self.shape[0]}, K={self.shape[1]}, {self.dtype}, {state})"


class Npu:
    """The engine over one ``NpuDevice``; see the module docstring."""

    def __init__(self, device: Any, cores: int = 3) -> None:
        if not 1 <= cores <= device.n_cores:
            raise ValueError(f"cores must be in 1..{device.n_cores}, got {cores}")
        self.device = device
        self.cores = cores
        self.abi = device.kind
        self.npu_mhz = _npu_mhz(device)
        self.counters: dict[str, int] = dict.fromkeys((
            "weights_uploaded", "weight_bytes_uploaded", "weights_freed", "programs_compiled",
            "program_cache_hits", "program_cache_misses", "programs_evicted", "scratch_grown", "matmuls",
            "submits", "resets"), 0)
        self.last_timing: Timing | None = None
        # At most this many bytes of NPU memory (None: whatever the driver gives). Boards share
        # DRAM between CPU and NPU; a server caps what it stages (``rknpu serve --npu-memory``).
        self.memory_cap: int | None = None
        self._weights: list[Weight] = []
        self._lru: OrderedDict[tuple[int, int, str], Weight] = OrderedDict()
        self._scratch: dict[tuple[str, int], _Scratch] = {}    # ("A" | "C", M bucket)
        self._closed = False

    # -- weights ---------------------------------------------------------------------
    def upload_weight(self, b: np.ndarray, dtype: str = "fp16") -> Weight:
        """Convert ``b`` [N, K] to ``dtype`` ("fp16" | "int8"), pack it into the native
        layout and stage it once in NPU memory; it stays there until ``free()``."""
        self._check_open()
        staged = stage_weight(b, dtype)
        N, K = staged.shape
        nbytes = _b_bytes(staged)
        buffer = self._alloc(nbytes, "data", f"weight {N}x{K} {dtype}")
        try:
            _pack_b(staged, buffer.array(np.uint8))          # straight into the mapped buffer
            buffer.sync_to_device(0, nbytes)
        except BaseException:
            buffer.close()
            raise
        weight = Weight(self, staged.without_data(), buffer, nbytes)
        self._weights.append(weight)
        self.counters["weights_uploaded"] += 1
        self.counters["weight_bytes_uploaded"] += nbytes
        return weight

    # -- matmul ----------------------------------------------------------------------
    def matmul(self, a: np.ndarray, w: Weight, *, out: str | None = None) -> np.ndarray:
        """``a`` [M, K] times the resident weight -> [M, N]. fp16 weight: float32 (or
        float16 with ``out="fp16"``); int8 weight and int8 ``a``: int32, exact; int8 weight
        and float ``a``: ``a`` quantised per row, float32 out."""
        self._check_open()
        if not isinstance(w, Weight) or w._npu is not self:
            raise TypeError("w must be a Weight returned by this Npu's upload_weight")
        if w.freed:
            raise ValueError(f"{w!r} was freed; upload it again")
        check_matrix(a, "a")
        N, K = w.shape
        if a.shape[1] != K:
            raise ValueError(f"shape mismatch: a is {a.shape[0]}x{a.shape[1]} but the weight "
                             f"is N={N} x K={K}; a must have K={K} columns")
        out = self._out_dtype(w, out)
        act = stage_activation(a, w.staged)
        M = a.shape[0]
        result = np.empty((M, N), dtype=np.float16 if out == "fp16" else
                          (np.int32 if out == "int32" else np.float32))
        totals = [0.0] * 3
        device_s: float | None = 0.0
        labels = set()
        submits = 0
        m0 = 0
        while m0 < M:
            rows = min(w.max_program_m, M - m0)
            plan = self._plan_or_shrink(w, rows, out)
            if plan is None:
                continue
            part, times, dev, label = self._run(plan, act.data[m0: m0 + rows])
            result[m0: m0 + rows] = part
            totals = [t + x for t, x in zip(totals, times)]
            labels.add(label)
            device_s = None if dev is None or device_s is None else device_s + dev
            submits += 1
            m0 += rows
        t0 = time.perf_counter()
        final = dequantize_output(result, act, w.staged)
        totals[2] += time.perf_counter() - t0
        self.counters["matmuls"] += 1
        label = labels.pop() if len(labels) == 1 else "unknown"
        self.last_timing = Timing(*totals, device_s=device_s, device_label=label, submits=submits)
        return final

    def _out_dtype(self, w: Weight, out: str | None) -> str:
        if out is None:
            return OUT_FOR_WEIGHT[w.dtype]
        allowed = ("fp32", "fp16") if w.dtype == "fp16" else ("int32",)
        if out not in allowed:
            raise ValueError(f"out={out!r} is not available for a {w.dtype} weight; use one of {allowed}")
        return out

    def _plan_or_shrink(self, w: Weight, rows: int, out: str) -> _Plan | None:
        """The plan for ``rows``; None after lowering ``w.max_program_m`` when the compiler
        refuses the bucket (too many tasks for one hardware run: split along M)."""
        bucket = m_bucket(rows)
        try:
            return self._plan(w, bucket, out)
        except ValueError as exc:
            if bucket == 1:
                raise
            w.max_program_m = 1 << ((bucket - 1).bit_length() - 1)
            w.compile_errors.append(str(exc))
            return None

    def _plan(self, w: Weight, m: int, out: str) -> _Plan:
        plan = w.plans.get((m, out))
        if plan is not None:
            self.counters["program_cache_hits"] += 1
            self._lru.move_to_end((id(w), m, out))
            return plan
        self.counters["program_cache_misses"] += 1
        N, K = w.shape
        program = _compile(m, K, N, w.dtype, out, self.cores, self.abi)
        self.counters["programs_compiled"] += 1
        if program.b_bytes > w.packed_bytes:
            raise NpuError(f"compiler wants {program.b_bytes} weight bytes for M={m} but the "
                           f"weight was packed into {w.packed_bytes}; the B layout must not depend on M")
        plan = self._bind(program, m, w)
        w.plans[(m, out)] = plan
        self._lru[(id(w), m, out)] = w
        return plan

    def _bind(self, program: Any, m: int, w: Weight) -> _Plan:
        from ggml_rknpu.kernel.device import HwTask, Job

        what = f"program M={m} for {w!r}"
        modeled = None if self.npu_mhz is None else modeled_time(program, npu_mhz=self.npu_mhz)
        plan = _Plan(program, m, w.buffer.dma_addr, modeled)
        try:
            # Each step may evict other programs; the plan already counts as a user of the
            # shared buffers it joined, so they stay alive.
            plan.a_buf = self._join_scratch(plan, "A", program.a_bytes, what)
            plan.c_buf = self._join_scratch(plan, "C", program.c_bytes, what)
            plan.regcmd_buf = self._alloc(program.words.nbytes, "regcmd", what)
            plan.write_words()
        except BaseException:
            plan.close()
            raise
        regcmd_buf = plan.regcmd_buf
        per_core: list[list[Any]] = [[] for _ in range(self.device.n_cores)]
        for task in program.tasks:
            per_core[task.core].append(HwTask(
                regcmd_addr=regcmd_buf.dma_addr + task.word_offset * 8, body_words=task.body_words,
                int_mask=task.int_mask, enable_mask=task.enable_mask))
        # The device cleans a job's inputs before every submit; the weight was cleaned once in
        # upload_weight and the CPU never writes it again, so it is not an input (listing it cost
        # a cache clean of the whole weight per call). Rocket orders jobs by implicit fences on
        # the in/out BOs [npu-programming.md §5]; no job writes a weight, so none is needed.
        plan.job = Job(cores=tuple(tuple(t) for t in per_core), inputs=(plan.a_buf,), outputs=(plan.c_buf,))
        return plan

    def _join_scratch(self, plan: _Plan, role: str, nbytes: int, what: str) -> _Window:
        """A window of ``nbytes`` on the bucket's shared ``role`` buffer, growing it if needed:
        the larger buffer is allocated first, the programs on the old one re-bound to it,
        then the old one freed (so no program ever points at freed memory)."""
        key = (role, plan.m)
        scratch = self._scratch.get(key)
        if scratch is None or scratch.buf.size < nbytes:
            buf = self._alloc(nbytes, "data", what)
            scratch = self._scratch.get(key)            # the allocation may have evicted its users
            if scratch is None:
                scratch = _Scratch(self._scratch, key, buf)
            else:
                old, scratch.buf = scratch.buf, buf
                for user in scratch.users:
                    user.write_words()
                old.close()
                self.counters["scratch_grown"] += 1
        scratch.users.add(plan)
        return _Window(scratch, nbytes)

    def scratch_bytes(self) -> int:
        """NPU bytes held by the shared A and C buffers."""
        return sum(s.buf.capacity for s in self._scratch.values())

    def _run(self, plan: _Plan, a_rows: np.ndarray) -> tuple[np.ndarray, list[float], float | None, str]:
        t0 = time.perf_counter()
        rows = a_rows.shape[0]
        _pack_a(a_rows, plan.program, plan.a_buf.array(np.uint8))   # missing bucket rows are zeroed
        stale_output.arm(plan.c_buf, plan.program)
        t1 = time.perf_counter()
        try:
            completion = self.device.submit(plan.job)
        except NpuTimeout as exc:
            raise NpuTimeout(f"matmul {plan.program.shape} timed out on the NPU: {exc}", exc.errno) from exc
        self.counters["submits"] += 1
        stale_output.check(plan.c_buf, plan.program)
        t2 = time.perf_counter()
        c = _unpack_c(plan.c_buf.array(np.uint8), plan.program, rows)
        t3 = time.perf_counter()
        if completion.hw_elapsed_ns is not None and not completion.simulated:
            dev, label = completion.hw_elapsed_ns * 1e-9, "measured"
        elif plan.modeled is not None:
            dev, label = plan.modeled.total_s, "modeled"
        else:
            dev, label = None, "unknown"
        return c, [t1 - t0, t2 - t1, t3 - t2], dev, label

    # -- memory ----------------------------------------------------------------------
    def memory_budget(self) -> tuple[int, int]:
        """(free, total) bytes of NPU address space (the device's; ``memory_cap`` aside)."""
        return self.device.iova_budget()

    def memory_used(self) -> int:
        """NPU bytes in use: weights, programs, scratch (what ``memory_cap`` bounds)."""
        free, total = self.device.iova_budget()
        return total - free

    def _alloc(self, size: int, purpose: str, what: str) -> Any:
        """Allocate, evicting least-recently-used programs when NPU memory (or the cap) runs out."""
        while True:
            try:
                if self.memory_cap is not None and self.memory_used() + _pages(size) > self.memory_cap:
                    raise NpuOutOfMemory(f"{size} more bytes would exceed the NPU memory cap of "
                                         f"{self.memory_cap} bytes", errno.ENOMEM)
                buf = self.device.alloc(max(size, 1), purpose=purpose)
                break
            except NpuOutOfMemory as exc:
                if not self._evict_one():
                    free, total = self.device.iova_budget()
                    if self.memory_cap is not None:
                        free, total = max(0, self.memory_cap - self.memory_used()), self.memory_cap
                    raise NpuOutOfMemory(
                        f"out of NPU memory allocating {size} bytes for {what} "
                        f"({free} of {total} bytes free{' under the cap' if self.memory_cap else ''}, no cached "
                        "program left to evict); free weights you no longer need", exc.errno) from exc
        return buf

    def _evict_one(self) -> bool:
        if not self._lru:
            return False
        (_wid, m, out), weight = self._lru.popitem(last=False)
        weight.plans.pop((m, out)).close()
        self.counters["programs_evicted"] += 1
        return True

    def _forget(self, w: Weight) -> None:
        for key in [k for k, weight in self._lru.items() if weight is w]:
            del self._lru[key]
        self._weights.remove(w)
        self.counters["weights_freed"] += 1

    # -- faults ----------------------------------------------------------------------
    def reset(self) -> list[Weight]:
        """Reset the NPU after a faulted job; the weights whose NPU copy the reset destroyed.

        Vendor: ACT_RESET (a core that stopped responding needs it). Rocket has no reset
        ioctl and resets a timed-out core itself. Neither reset frees GEM objects (the soft
        reset is of the NPU's blocks, the buffers belong to the open file), so the list is
        empty with both drivers; a caller still re-stages whatever it names."""
        self._check_open()
        try:
            self.device.reset()
        except NpuError as exc:
            if exc.errno != errno.EOPNOTSUPP:   # rocket: the driver already reset the core
                raise
        self.counters["resets"] += 1
        return [w for w in self._weights if w.buffer.closed]

    # -- lifecycle -------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this Npu is closed")

    def close(self) -> None:
        """Free every weight and program and close the device (idempotent)."""
        if self._closed:
            return
        for w in list(self._weights):
            w.free()
        self.device.close()
        self._closed = True

    def __enter__(self) -> "Npu":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pages(size: int) -> int:
    """What an allocation of ``size`` bytes takes: whole pages [kernel.device.PAGE]."""
    from ggml_rknpu.kernel.device import PAGE

    return -(-max(size, 1) // PAGE) * PAGE


def _npu_mhz(device: Any) -> float | None:
    """NPU clock for modeled device time: the driver's figure where it reports one, the
    vendor driver's 1 GHz on the simulator [anchors.md §3.1], None (no model) otherwise
    (rocket boots at 200 MHz and is often patched to 600: unknown without a query)."""
    freq = device.info().npu_freq_hz if hasattr(device, "info") else None
    if freq:
        return freq / 1e6
    return 1000.0 if device.simulated else None


def open_engine(device: Any = None, cores: int = 3) -> Npu:
    """Open the engine on ``device``: "rknpu" | "rocket" | "sim-rknpu" | "sim-rocket" | None
    (auto; ``RKNPU_DEVICE`` overrides), or an open ``NpuDevice``."""
    if device is None or isinstance(device, str):
        from ggml_rknpu.kernel.device import NpuDevice

        dev = NpuDevice.open(device)
        try:
            return Npu(dev, cores)
        except BaseException:
            dev.close()
            raise
    return Npu(device, cores)


# --- the compiler seam (CONTRACT D) ---------------------------------------------------
def _compile(m: int, k: int, n: int, dtype: str, out: str, cores: int, abi: str) -> Any:
    from ggml_rknpu.compiler.matmul import compile_matmul

    return compile_matmul(m, k, n, dtype=dtype, out=out, cores=cores, abi=abi)


def _b_bytes(staged: StagedWeight) -> int:
    """Native B bytes of a weight; independent of M (K chunking depends on K and dtype)."""
    from ggml_rknpu.compiler.layout import b_bytes
    from ggml_rknpu.compiler.shape import MatmulShape

    N, K = staged.shape
    return b_bytes(MatmulShape(1, K, N, staged.dtype, OUT_FOR_WEIGHT[staged.dtype]))


def _pack_b(staged: StagedWeight, out: np.ndarray) -> None:
    from ggml_rknpu.compiler.layout import pack_b

    pack_b(staged.data, staged.dtype, out=out)


def _pack_a(a: np.ndarray, program: Any, out: np.ndarray) -> None:
    from ggml_rknpu.compiler.layout import pack_a

    pack_a(a, program.shape.dtype, program, out=out)


def _unpack_c(buf: np.ndarray, program: Any, rows: int) -> np.ndarray:
    from ggml_rknpu.compiler.layout import unpack_c

    return unpack_c(buf, program, rows)
