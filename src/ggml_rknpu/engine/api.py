"""The public matmul engine: resident weights, programs compiled and bound once, then replayed.

    npu = ggml_rknpu.open()                       # or open(device="sim-rocket", cores=3)
    w = npu.upload_weight(b, dtype="fp16")        # b [N, K], ggml layout: one row per output
    c = npu.matmul(a, w)                          # a [M, K], any M -> c [M, N]

Invariants: a weight is converted and packed once into a resident buffer; each (weight, M
bucket) has one program bound to fixed buffers; regcmd words only ever point at live
buffers (a shared scratch that grows re-binds its programs first); every call goes through
``NpuDevice.submit`` and checks its canaries, so an unfinished task raises ``StaleOutput``
after a reset; programs stay inside ``envelope``. Why, and scratch, buckets, timing:
docs/decisions.md "engine/api.py"."""

from __future__ import annotations

import errno
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from ggml_rknpu.cost.model import ModeledTime, modeled_time
from ggml_rknpu.engine.canary import Canaries, StaleOutput
from ggml_rknpu.engine.weights import (
    ResidentWeight,
    StagedWeight,
    check_matrix,
    dequantize_output,
    stage_activation,
    stage_weight,
)
from ggml_rknpu.hw.envelope import Envelope, by_name
from ggml_rknpu.hw.limits import PAGE_BYTES
from ggml_rknpu.kernel.device import NpuDevice
from ggml_rknpu.kernel.errors import NpuError, NpuOutOfMemory, NpuTimeout
from ggml_rknpu.kernel.job import BufferRange, HwTask, Job

BUCKET_POW2_MAX = 256
MAX_PROGRAM_M = 2048
OUT_FOR_WEIGHT = {"fp16": "fp32", "int8": "int32"}
# Under ``memory_cap``, resident memory (weights, chained steps) leaves room for the programs of
# every resident weight at this many rows: the decode path (server.grouping.GROUP_MAX_ROWS: one token,
# drafts, a few slots). A larger bucket that finds no memory splits its call along M.
RESERVE_ROWS = 16


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


C_ALIGN = 64   # C starts this far into a bucket's scratch buffer: no cache line holds A and C bytes


def _c_base(a_cap: int) -> int:
    return -(-a_cap // C_ALIGN) * C_ALIGN


class _Scratch:
    """The shared scratch buffer of an M bucket, A then C, and the bound programs using it:
    A at 0 (``a_cap`` bytes, the largest A of its programs), C from ``c_base`` (``c_cap``
    bytes), so one clean covers what the CPU writes into both (A, the canaries in C)."""

    def __init__(self, pool: dict[tuple[str, int], "_Scratch"], key: tuple[str, int], buf: Any,
                 a_cap: int, c_cap: int) -> None:
        self.pool, self.key, self.buf = pool, key, buf
        self.a_cap, self.c_cap = a_cap, c_cap
        self.users: set[_BoundProgram] = set()
        pool[key] = self

    @property
    def c_base(self) -> int:
        return _c_base(self.a_cap)

    def leave(self, bound: "_BoundProgram") -> None:
        """``bound`` no longer uses this buffer; the last user frees it."""
        self.users.discard(bound)
        if not self.users and self.pool.get(self.key) is self:
            del self.pool[self.key]
            self.buf.close()


class _ScratchShare:
    """The first ``size`` bytes of a shared scratch buffer's A or C region that one program
    uses. It follows the scratch buffer when that is replaced by a larger one; ``range()``
    is what the program's job reads or writes, so a submit syncs that, not the whole buffer."""

    __slots__ = ("scratch", "role", "size")

    def __init__(self, scratch: _Scratch, role: str, size: int) -> None:
        self.scratch, self.role, self.size = scratch, role, size

    @property
    def offset(self) -> int:
        return 0 if self.role == "A" else self.scratch.c_base

    @property
    def dma_addr(self) -> int:
        return self.scratch.buf.dma_addr + self.offset

    def array(self, dtype: Any = np.uint8) -> np.ndarray:
        start, item = self.offset, np.dtype(dtype).itemsize
        return self.scratch.buf.array(np.uint8)[start: start + self.size // item * item].view(dtype)

    def range(self) -> BufferRange:
        return BufferRange(self.scratch.buf, self.offset, self.size)


@dataclass(eq=False)
class _BoundProgram:
    """A compiled program bound to shares of its bucket's shared A and C buffers, its own
    regcmd buffer and the weight's B."""

    program: Any
    m: int
    b_addr: int
    modeled: ModeledTime | None
    a_buf: _ScratchShare | None = None
    c_buf: _ScratchShare | None = None
    regcmd_buf: Any = None
    jobs: tuple[Job, ...] = ()   # one per chain of the program, submitted in order
    canaries: Canaries | None = None
    ports: Any = None            # (ActivationPort, ResultPort) of engine.hostpath
    ports_bound_to: Any = None   # the (A, C) scratch buffers the ports view
    label: str = ""              # what a timeout names (formatted once, not per submit)
    cells: Any = None            # the canaries bound to the C scratch buffer (engine.canary.CanaryCells)
    cells_bound_to: Any = None   # the C scratch buffer they view

    def write_words(self) -> None:
        """Bind the register commands to the current buffers and make them visible to the NPU;
        the job follows (its ranges name the current scratch buffers)."""
        assert self.a_buf is not None and self.c_buf is not None, "bound before joining its scratch buffers"
        words = self.program.bind(a=self.a_buf.dma_addr, b=self.b_addr, c=self.c_buf.dma_addr,
                                  regcmd=self.regcmd_buf.dma_addr)
        self.regcmd_buf.array(np.uint64)[: len(words)] = words
        self.regcmd_buf.sync_to_device(0, words.nbytes)
        if self.jobs:
            self.jobs = _with_ranges(self.jobs, self.a_buf.range(), self.c_buf.range())

    def close(self) -> None:
        for share in {id(s.scratch): s for s in (self.a_buf, self.c_buf) if s is not None}.values():
            share.scratch.leave(self)
        if self.regcmd_buf is not None:
            self.regcmd_buf.close()


@dataclass(frozen=True)
class Headroom:
    """NPU bytes a program of one weight at ``RESERVE_ROWS`` rows needs beside the weight: its
    A and C in the bucket's shared scratch buffer, and its own register commands and submit
    tables (``own``). ``Npu.reserve_bytes`` adds them up over the resident weights."""

    a: int
    c: int
    own: int


class Weight(ResidentWeight):
    """A weight resident in NPU memory in its native layout. ``shape`` is (N, K)."""

    def __init__(self, npu: "Npu", staged: StagedWeight, buffer: Any, packed_bytes: int) -> None:
        self._npu = npu
        self.staged = staged
        self.buffer = buffer
        self.packed_bytes = packed_bytes
        self.programs: dict[tuple[int, str], _BoundProgram] = {}
        self.max_program_m = MAX_PROGRAM_M   # lowered if the compiler refuses a bucket
        self.compile_errors: list[str] = []
        self.headroom: Headroom | None = None   # what its programs need under memory_cap (set at upload)
        self.freed = False

    def free(self) -> None:
        """Release the weight and every program compiled for it (idempotent)."""
        if self.freed:
            return
        self._npu._forget(self)
        for bound in self.programs.values():
            bound.close()
        self.programs.clear()
        self.buffer.close()
        self.freed = True

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"{len(self.programs)} programs"
        return f"Weight(N={self.shape[0]}, K={self.shape[1]}, {self.dtype}, {state})"


class FusedWeight(Weight):
    """Sibling weights concatenated by rows into one resident weight (``Npu.upload_fused_weight``);
    ``splits[i]`` = (n0, n1), sibling i's output columns."""

    splits: tuple[tuple[int, int], ...] = ()

    def __repr__(self) -> str:
        return "Fused" + super().__repr__()[:-1] + f", siblings N={[n1 - n0 for n0, n1 in self.splits]})"


class Npu:
    """The engine over one ``NpuDevice`` (a ``MatmulEngine``); see the module docstring."""

    def __init__(self, device: NpuDevice, cores: int | None = None, envelope: Envelope | str | None = None) -> None:
        if cores is not None and not 1 <= cores <= device.n_cores:
            raise ValueError(f"cores must be in 1..{device.n_cores}, got {cores}")
        if envelope is None:
            from ggml_rknpu.engine.envelope_record import recorded_envelope

            envelope = recorded_envelope(device)
        self.envelope = by_name(envelope)
        self.device = device
        # the envelope caps the cores: one until the board's ladder proved more
        self.cores = min(cores or device.n_cores, self.envelope.max_cores)
        self.abi = device.kind
        self.npu_mhz = _npu_mhz(device)
        self.counters: dict[str, int] = dict.fromkeys((
            "weights_uploaded", "weight_bytes_uploaded", "weights_freed", "programs_compiled",
            "program_cache_hits", "program_cache_misses", "programs_evicted", "scratch_grown", "matmuls",
            "submits", "npu_faults", "resets", "fused_weights_uploaded", "step_runs", "chained_submits",
            "memory_splits"), 0)
        self.last_timing: Timing | None = None
        self.last_canary_s = 0.0   # host seconds arming and checking the last submit's canaries
        # At most this many bytes of NPU memory (None: whatever the driver gives). Boards share
        # DRAM between CPU and NPU; a server caps what it stages (``rknpu serve --npu-memory``).
        self.memory_cap: int | None = None
        self.peak_memory = 0   # most NPU bytes in use at once, tracked while memory_cap is set
        self._weights: list[Weight] = []
        self._rooms: Headroom | None = Headroom(0, 0, 0)   # the resident weights' headrooms combined (None: stale)
        self._lru: OrderedDict[tuple[int, int, str], Weight] = OrderedDict()
        self._scratch: dict[tuple[str, int], _Scratch] = {}    # ("AC", M bucket)
        self._steps: set[Any] = set()                           # live Steps (engine.fusion)
        self._closed = False

    def describe(self) -> str:
        return f"{self.device.kind} (simulated)" if self.device.simulated else self.device.kind

    # -- weights ---------------------------------------------------------------------
    def upload_weight(self, b: np.ndarray, dtype: str = "fp16") -> Weight:
        """Convert ``b`` [N, K] to ``dtype`` ("fp16" | "int8"), pack it into the native
        layout and stage it once in NPU memory; it stays there until ``free()``."""
        return self._upload(b, dtype, Weight)

    def upload_fused_weight(self, parts: "list[np.ndarray]", dtype: str = "fp16") -> "FusedWeight":
        """Sibling weights [N_i, K] (Q/K/V, gate/up: the same input) as one resident weight
        [sum N_i, K]; ``splits`` gives each sibling's output columns, and ``step([fused])``
        returns one result per sibling. See ``engine.fusion``."""
        from ggml_rknpu.engine.fusion import concat_rows

        b, splits = concat_rows(parts)
        fused = self._upload(b, dtype, FusedWeight)
        fused.splits = splits
        self.counters["fused_weights_uploaded"] += 1
        return fused

    def step(self, weights: "list[Weight]", m: int = 1, *, out: str | None = None) -> Any:
        """A decode step planned once: ``weights`` (one plain or fused weight, or several
        sharing K and dtype, chained in one submit) applied to one activation of up to ``m``
        rows. ``step.run(a)`` -> one array per output. See ``engine.fusion.Step``."""
        from ggml_rknpu.engine.fusion import Step

        self._check_open()
        step = Step(self, list(weights), m_bucket(m), out)
        self._steps.add(step)
        return step

    def _upload(self, b: np.ndarray, dtype: str, cls: type) -> Any:
        self._check_open()
        staged = stage_weight(b, dtype)
        N, K = staged.shape
        nbytes = _b_bytes(staged)
        headroom = self._headroom(N, K, dtype) if self.memory_cap is not None else None
        buffer = self._alloc(nbytes, "data", f"weight {N}x{K} {dtype}", resident=True, headroom=headroom)
        try:
            _pack_b(staged, buffer.array(np.uint8), self.envelope)   # straight into the mapped buffer
            buffer.sync_to_device(0, nbytes)
        except BaseException:
            buffer.close()
            raise
        weight = cls(self, staged.without_data(), buffer, nbytes)
        weight.headroom = headroom
        self._weights.append(weight)
        self._add_room(headroom)
        self.counters["weights_uploaded"] += 1
        self.counters["weight_bytes_uploaded"] += nbytes
        return weight

    # -- matmul ----------------------------------------------------------------------
    def matmul(self, a: np.ndarray, w: Weight, *, out: str | None = None) -> np.ndarray:
        """``a`` [M, K] times the resident weight -> [M, N]. fp16 weight: float32 (or
        float16 with ``out="fp16"``); int8 weight and int8 ``a``: int32, exact; int8 weight
        and float ``a``: ``a`` quantised per row, float32 out."""
        self._check_open()
        self._check_weight(w)
        check_matrix(a, "a")
        N, K = w.shape
        if a.shape[1] != K:
            raise ValueError(f"shape mismatch: a is {a.shape[0]}x{a.shape[1]} but the weight "
                             f"is N={N} x K={K}; a must have K={K} columns")
        out = self._out_dtype(w, out)
        M = a.shape[0]
        lean = a.dtype.kind == "f" or (a.dtype == np.int8 and w.dtype == "int8")
        if lean and M <= w.max_program_m:
            bound = self._bound_or_shrink(w, M, out)
            if bound is not None:
                return self._matmul_lean(bound, a, w, out)
        act = stage_activation(a, w.staged)
        result = np.empty((M, N), dtype=np.float16 if out == "fp16" else
                          (np.int32 if out == "int32" else np.float32))
        totals = [0.0] * 3
        device_s: float | None = 0.0
        labels = set()
        submits = 0
        m0 = 0
        while m0 < M:
            rows = min(w.max_program_m, M - m0)
            bound = self._bound_or_shrink(w, rows, out)
            if bound is None:
                continue
            part, times, dev, label = self._run(bound, act.data[m0: m0 + rows])
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
        self.last_timing = Timing(pack_s=totals[0], submit_s=totals[1], unpack_s=totals[2], device_s=device_s,
                                  device_label=label, submits=submits)
        return final

    def _check_weight(self, w: Any) -> None:
        if not isinstance(w, Weight) or w._npu is not self:
            raise TypeError("w must be a Weight returned by this Npu's upload_weight")
        if w.freed:
            raise ValueError(f"{w!r} was freed; upload it again")

    def _matmul_lean(self, bound: _BoundProgram, a: np.ndarray, w: Weight, out: str) -> np.ndarray:
        """One program, A written and C read through its views (``engine.hostpath``): the
        same bytes and arithmetic as ``stage_activation`` + ``pack_a`` / ``unpack_c`` +
        ``dequantize_output``, without their per-call conversions and copies."""
        assert bound.c_buf is not None, "not bound yet"
        t0 = time.perf_counter()
        a_port, c_port = self._ports(bound, w, out)
        act_scales = a_port.write(a)
        t1 = time.perf_counter()
        completion, hw_ns = self._submit_bound(bound, bound.c_buf.array(np.uint8))
        t2 = time.perf_counter()
        if out == "fp16":
            dtype: Any = np.float16
        elif w.dtype == "int8" and act_scales is None and w.scales is None:
            dtype = np.int32
        else:
            dtype = np.float32
        result = np.empty((a.shape[0], w.shape[0]), dtype)
        c_port.read(result, a.shape[0], act_scales)
        t3 = time.perf_counter()
        dev, label = self._device_time(bound, completion, hw_ns)
        self.counters["matmuls"] += 1
        self.last_timing = Timing(t1 - t0, t2 - t1, t3 - t2, device_s=dev, device_label=label,
                                  submits=len(bound.jobs))
        return result

    def _submit_job(self, job: Any, what: str) -> Any:
        """Every submit of the engine goes through here: the completion, a timeout named
        after ``what``, the ``submits`` counter."""
        try:
            completion = self.device.submit(job)
        except NpuTimeout as exc:
            raise NpuTimeout(f"{what} timed out on the NPU: {exc}", exc.errno) from exc
        self.counters["submits"] += 1
        return completion

    def _submit_bound(self, bound: _BoundProgram, c_bytes: np.ndarray) -> tuple[Any, int | None]:
        """Run a bound program: canaries armed in C, its jobs (one per chain) in order, the
        canaries checked (stale output -> reset + StaleOutput, an NpuFault). (last completion, summed
        hw_elapsed_ns or None)."""
        assert bound.jobs and bound.canaries is not None and bound.c_buf is not None, "not bound yet"
        t0 = time.perf_counter()
        cells = bound.cells
        if cells is None or bound.cells_bound_to is not bound.c_buf.scratch.buf:
            # (re)bound when the shared C buffer was replaced by a larger one
            cells = bound.cells = bound.canaries.over(c_bytes)
            bound.cells_bound_to = bound.c_buf.scratch.buf
        cells.arm()
        t1 = time.perf_counter()
        hw_ns: int | None = 0
        for job in bound.jobs:
            completion = self._submit_job(job, bound.label)
            hw_ns = None if completion.hw_elapsed_ns is None or hw_ns is None else hw_ns + completion.hw_elapsed_ns
        t2 = time.perf_counter()
        unwritten = cells.unwritten()
        self.last_canary_s = t1 - t0 + time.perf_counter() - t2
        if unwritten:
            self._npu_fault(bound, unwritten)
        return completion, hw_ns

    def _ports(self, bound: _BoundProgram, w: Weight, out: str) -> Any:
        """The program's host-path ports, (re)bound when a shared scratch buffer was replaced."""
        assert bound.a_buf is not None and bound.c_buf is not None, "not bound yet"
        bound_to = (bound.a_buf.scratch.buf, bound.c_buf.scratch.buf)
        if bound.ports is None or bound.ports_bound_to != bound_to:
            from ggml_rknpu.engine.hostpath import bind_ports

            bound.ports = bind_ports(bound.program, bound.a_buf.array(np.uint8), bound.c_buf.array(np.uint8),
                                     w.scales, out)
            bound.ports_bound_to = bound_to
        return bound.ports

    def _device_time(self, bound: _BoundProgram, completion: Any, hw_ns: int | None) -> tuple[float | None, str]:
        return self._device_seconds(bound.modeled, completion, hw_ns)

    @staticmethod
    def _device_seconds(modeled: Any, completion: Any, hw_ns: int | None) -> tuple[float | None, str]:
        """(seconds, label) of one call on the device: the board's summed hw_elapsed_ns
        ("measured"), else the cost model's figure for its programs ("modeled"), else unknown."""
        if hw_ns is not None and not completion.simulated:
            return hw_ns * 1e-9, "measured"
        if modeled is not None:
            return modeled.total_s, "modeled"
        return None, "unknown"

    def _record_step_timing(self, times: tuple[float, float, float], modeled: Any, completion: Any,
                            hw_ns: int | None, submits: int) -> None:
        """``last_timing`` of a decode step (``engine.fusion.Step.run``), as a matmul's."""
        dev, label = self._device_seconds(modeled, completion, hw_ns)
        self.last_timing = Timing(*times, device_s=dev, device_label=label, submits=submits)

    def _out_dtype(self, w: Weight, out: str | None) -> str:
        if out is None:
            return OUT_FOR_WEIGHT[w.dtype]
        allowed = ("fp32", "fp16") if w.dtype == "fp16" else ("int32",)
        if out not in allowed:
            raise ValueError(f"out={out!r} is not available for a {w.dtype} weight; use one of {allowed}")
        return out

    def _bound_or_shrink(self, w: Weight, rows: int, out: str) -> _BoundProgram | None:
        """The bound program for ``rows``; None after lowering ``w.max_program_m`` when the compiler
        refuses the bucket (too many tasks for one hardware run: split along M), or when a bucket
        above ``RESERVE_ROWS`` finds no NPU memory (the reserve covers the smaller ones)."""
        bucket = m_bucket(rows)
        try:
            return self._bound_program(w, bucket, out)
        except ValueError as exc:
            if bucket == 1:
                raise
            w.max_program_m = 1 << ((bucket - 1).bit_length() - 1)
            w.compile_errors.append(str(exc))
            return None
        except NpuOutOfMemory:
            if bucket <= m_bucket(RESERVE_ROWS):
                raise
            w.max_program_m = 1 << ((bucket - 1).bit_length() - 1)
            self.counters["memory_splits"] += 1
            return None

    def _bound_program(self, w: Weight, m: int, out: str) -> _BoundProgram:
        bound = w.programs.get((m, out))
        if bound is not None:
            self.counters["program_cache_hits"] += 1
            self._lru.move_to_end((id(w), m, out))
            return bound
        self.counters["program_cache_misses"] += 1
        bound = self._bind(self._program_for(w, m, out), m, w)
        w.programs[(m, out)] = bound
        self._lru[(id(w), m, out)] = w
        return bound

    def _program_for(self, w: Weight, m: int, out: str) -> Any:
        """The compiled program of ``w`` at M bucket ``m`` (compiler-cached), checked against
        the weight's packed layout."""
        N, K = w.shape
        program = _compile(m, K, N, w.dtype, out, self.cores, self.abi, self.envelope)
        self.counters["programs_compiled"] += 1
        if program.b_bytes > w.packed_bytes:
            raise NpuError(f"compiler wants {program.b_bytes} weight bytes for M={m} but the "
                           f"weight was packed into {w.packed_bytes}; the B layout must not depend on M")
        return program

    def _bind(self, program: Any, m: int, w: Weight) -> _BoundProgram:
        what = f"program M={m} for {w!r}"
        modeled = None if self.npu_mhz is None else modeled_time(program, npu_mhz=self.npu_mhz)
        bound = _BoundProgram(program, m, w.buffer.dma_addr, modeled, label=f"matmul {program.shape}")
        try:
            # Each step may evict other programs; this one already counts as a user of the
            # shared buffers it joined, so they stay alive.
            bound.a_buf, bound.c_buf = self._join_scratch(bound, program.a_bytes, program.c_bytes, what)
            bound.regcmd_buf = self._alloc(program.words.nbytes, "regcmd", what)
            bound.write_words()
        except BaseException:
            bound.close()
            raise
        # The device cleans a job's inputs before every submit; the weight was cleaned once in
        # upload_weight and the CPU never writes it again, so it is not an input (listing it cost
        # a cache clean of the whole weight per call). Rocket orders jobs by implicit fences on
        # the in/out BOs [docs/npu-programming.md §5]; no job writes a weight, so none is needed.
        bound.jobs = program_jobs(program, bound.regcmd_buf.dma_addr, self.device.n_cores,
                                  bound.a_buf.range(), bound.c_buf.range())
        bound.canaries = Canaries.for_program(program)
        try:
            self._prepare_jobs(bound.jobs, what)
        except BaseException:
            bound.close()
            raise
        return bound

    def _prepare_jobs(self, jobs: tuple[Job, ...], what: str) -> None:
        """Plan ``jobs`` on the device now: the memory its submit tables take (the vendor
        driver's task BO, a page per job) is allocated here, under ``memory_cap`` and with
        eviction like every other allocation, not at a later submit."""
        for job in jobs:
            while True:
                try:
                    need = self.device.table_bytes(job)
                    if need and self.memory_cap is not None and self.memory_used() + need > self.memory_cap:
                        raise NpuOutOfMemory(f"{need} more bytes would exceed the NPU memory cap of "
                                             f"{self.memory_cap} bytes", errno.ENOMEM)
                    self.device.prepare(job)
                    if need and self.memory_cap is not None:
                        self.peak_memory = max(self.peak_memory, self.memory_used())
                    break
                except NpuOutOfMemory as exc:
                    if not self._evict_one():
                        raise NpuOutOfMemory(f"out of NPU memory planning the submits of {what}; free weights "
                                             "you no longer need", exc.errno) from exc

    def _join_scratch(self, bound: _BoundProgram, a_bytes: int, c_bytes: int, what: str
                      ) -> tuple[_ScratchShare, _ScratchShare]:
        """Shares of ``a_bytes`` (A) and ``c_bytes`` (C) of the bucket's scratch buffer, growing
        it if needed: the larger buffer is allocated first, the programs on the old one
        re-bound to it, then the old one freed (so no program ever points at freed memory)."""
        key = ("AC", bound.m)
        scratch = self._scratch.get(key)
        if scratch is None or scratch.a_cap < a_bytes or scratch.c_cap < c_bytes:
            a_cap = max(a_bytes, scratch.a_cap if scratch else 0)
            c_cap = max(c_bytes, scratch.c_cap if scratch else 0)
            buf = self._alloc(_c_base(a_cap) + c_cap, "data", what)
            scratch = self._scratch.get(key)            # the allocation may have evicted its users
            if scratch is None:
                scratch = _Scratch(self._scratch, key, buf, a_cap, c_cap)
            else:
                old, scratch.buf, scratch.a_cap, scratch.c_cap = scratch.buf, buf, a_cap, c_cap
                for user in scratch.users:
                    user.write_words()
                old.close()
                self.counters["scratch_grown"] += 1
        scratch.users.add(bound)
        return _ScratchShare(scratch, "A", a_bytes), _ScratchShare(scratch, "C", c_bytes)

    def scratch_bytes(self) -> int:
        """NPU bytes held by the shared A and C buffers."""
        return sum(s.buf.capacity for s in self._scratch.values())

    def _run(self, bound: _BoundProgram, a_rows: np.ndarray) -> tuple[np.ndarray, list[float], float | None, str]:
        assert bound.jobs and bound.canaries is not None and bound.a_buf is not None and bound.c_buf is not None, "not bound yet"
        t0 = time.perf_counter()
        rows = a_rows.shape[0]
        _pack_a(a_rows, bound.program, bound.a_buf.array(np.uint8))   # missing bucket rows are zeroed
        c_bytes = bound.c_buf.array(np.uint8)
        t1 = time.perf_counter()
        completion, hw_ns = self._submit_bound(bound, c_bytes)
        t2 = time.perf_counter()
        c = _unpack_c(c_bytes, bound.program, rows)
        t3 = time.perf_counter()
        dev, label = self._device_time(bound, completion, hw_ns)
        return c, [t1 - t0, t2 - t1, t3 - t2], dev, label

    def _npu_fault(self, bound: _BoundProgram, unwritten: int) -> NoReturn:
        self.stale_output(f"matmul {bound.program.shape}: {unwritten} output canar{'y' if unwritten == 1 else 'ies'} "
                          f"left unwritten after {len(bound.jobs)} submit(s): a task did not finish (rocket: job "
                          "killed at its 500 ms timeout?)")

    def stale_output(self, what: str) -> NoReturn:
        """A submit left canaries unwritten: reset where the driver lets us (rocket resets a core
        itself after a job timeout) and raise StaleOutput carrying what the reset destroyed, so
        the caller runs the step on the host and does not reset a second time."""
        self.counters["npu_faults"] += 1
        try:
            lost: list | None = self.reset()
        except NpuError:
            lost = None
        raise StaleOutput(f"{what}; " + ("the NPU was reset, run this step on the host" if lost is not None
                                         else "resetting the NPU failed"), lost=lost)

    # -- memory ----------------------------------------------------------------------
    def memory_budget(self) -> tuple[int, int]:
        """(free, total) bytes of NPU address space (the device's; ``memory_cap`` aside)."""
        return self.device.iova_budget()

    def memory_used(self) -> int:
        """NPU bytes in use: weights, programs, scratch (what ``memory_cap`` bounds)."""
        free, total = self.device.iova_budget()
        return total - free

    def _alloc(self, size: int, purpose: str, what: str, *, resident: bool = False,
               headroom: Headroom | None = None) -> Any:
        """Allocate, evicting least-recently-used programs when NPU memory (or the cap) runs out.

        ``resident``: memory no eviction gives back (a weight, a chained step's buffers). Under
        ``memory_cap`` it must leave ``reserve_bytes(headroom)`` free, the room the programs of
        the resident weights (and ``headroom``, the weight being uploaded) need: staged weights
        never starve the matmuls. Programs and scratch may use the whole cap."""
        while True:
            try:
                if self.memory_cap is not None:
                    keep = self.reserve_bytes(headroom) if resident else 0
                    if self.memory_used() + _pages(size) + keep > self.memory_cap:
                        raise NpuOutOfMemory(
                            f"{size} more bytes would exceed the NPU memory cap of {self.memory_cap} bytes"
                            + (f" less the {keep} bytes kept for the matmul programs" if keep else ""), errno.ENOMEM)
                buf = self.device.alloc(max(size, 1), purpose=purpose)
                if self.memory_cap is not None:
                    self.peak_memory = max(self.peak_memory, self.memory_used())
                break
            except NpuOutOfMemory as exc:
                if not self._evict_one():
                    free, total = self.device.iova_budget()
                    if self.memory_cap is not None:
                        free, total = max(0, self.memory_cap - self.memory_used()), self.memory_cap
                    raise NpuOutOfMemory(
                        f"out of NPU memory allocating {size} bytes for {what} "
                        f"({free} of {total} bytes free{' under the cap' if self.memory_cap else ''}, no cached "
                        f"program left to evict: {exc}); free weights you no longer need", exc.errno) from exc
        return buf

    def reserve_bytes(self, extra: Headroom | None = None) -> int:
        """What resident memory leaves free under ``memory_cap``: one scratch buffer at
        ``RESERVE_ROWS`` holding the largest A and the largest C of the resident weights' (and
        ``extra``'s) programs, plus each one's own register commands and submit tables. With
        it, a matmul of a resident weight at up to ``RESERVE_ROWS`` rows always finds memory,
        and those of every weight at once fit side by side (no eviction per token)."""
        if self._rooms is None:   # after a free: summed again once (an upload adds its own in O(1))
            self._rooms = Headroom(0, 0, 0)
            for w in self._weights:
                self._add_room(w.headroom)
        a, c, own = self._rooms.a, self._rooms.c, self._rooms.own
        if extra is not None:
            a, c, own = max(a, extra.a), max(c, extra.c), own + extra.own
        return _pages(_c_base(a) + c) + own if a or c or own else 0

    def _add_room(self, room: Headroom | None) -> None:
        if room is not None and self._rooms is not None:
            r = self._rooms
            self._rooms = Headroom(max(r.a, room.a), max(r.c, room.c), r.own + room.own)

    def _headroom(self, n: int, k: int, dtype: str) -> Headroom:
        """``Headroom`` of an [n, k] weight: its program at ``RESERVE_ROWS`` compiled (the
        compiler caches it for the matmul that binds it) and measured; a bucket the compiler
        refuses halves, as ``_bound_or_shrink`` would."""
        m = m_bucket(RESERVE_ROWS)
        while True:
            try:
                program = _compile(m, k, n, dtype, OUT_FOR_WEIGHT[dtype], self.cores, self.abi, self.envelope)
                break
            except ValueError:
                if m == 1:
                    raise
                m //= 2
        tables = sum(self.device.table_bytes(Job(cores=cores))
                     for cores in program_cores(program, 0, self.device.n_cores))
        return Headroom(program.a_bytes, program.c_bytes, _pages(program.words.nbytes) + tables)

    def _evict_one(self) -> bool:
        if not self._lru:
            return False
        (_wid, m, out), weight = self._lru.popitem(last=False)
        weight.programs.pop((m, out)).close()
        self.counters["programs_evicted"] += 1
        return True

    def _forget(self, w: Weight) -> None:
        for step in [s for s in self._steps if w in s.weights]:
            step.close()
            self._steps.discard(step)
        for key in [k for k, weight in self._lru.items() if weight is w]:
            del self._lru[key]
        self._weights.remove(w)
        if w.headroom is not None:
            self._rooms = None
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
    """What an allocation of ``size`` bytes takes: whole pages [hw.limits.PAGE_BYTES]."""
    return -(-max(size, 1) // PAGE_BYTES) * PAGE_BYTES


def _npu_mhz(device: NpuDevice) -> float | None:
    """NPU clock for modeled device time: the driver's figure where it reports one, the
    vendor driver's 1 GHz on the simulator [docs/anchors.md §3.1], None (no model) otherwise
    (rocket boots at 200 MHz and is often patched to 600: unknown without a query)."""
    freq = device.info().npu_freq_hz
    if freq:
        return freq / 1e6
    return 1000.0 if device.simulated else None


def open_engine(device: str | NpuDevice | None = None, cores: int | None = None, envelope: Envelope | str | None = None) -> Npu:
    """Open the engine on ``device``: "rknpu" | "rocket" | "sim-rknpu" | "sim-rocket" | None
    (auto; ``RKNPU_DEVICE`` overrides), or an open ``NpuDevice``. ``cores`` None: as many
    as the envelope allows; ``envelope`` None: the recorded one (module doc)."""
    if device is None or isinstance(device, str):
        from ggml_rknpu.devices import open_device

        dev = open_device(device)
        try:
            return Npu(dev, cores, envelope)
        except BaseException:
            dev.close()
            raise
    return Npu(device, cores, envelope)


def program_jobs(program: Any, regcmd_addr: int, n_cores: int, a: BufferRange, c: BufferRange) -> tuple[Job, ...]:
    """The device Jobs that run ``program`` (its regcmd words at ``regcmd_addr``): one per
    chain, in order. A and C are inputs of the first (C holds the CPU's canaries)."""
    return _with_ranges(tuple(Job(cores=cores) for cores in program_cores(program, regcmd_addr, n_cores)), a, c)


def program_cores(program: Any, regcmd_addr: int, n_cores: int) -> list[tuple[tuple[HwTask, ...], ...]]:
    """Each chain's tasks per core, in order (the ``cores`` of ``program_jobs``' Jobs)."""
    chains: list[list[list[HwTask]]] = [[[] for _ in range(n_cores)] for _ in range(program.n_submits)]
    for task in program.tasks:
        chains[task.chain][task.core].append(HwTask(
            regcmd_addr=regcmd_addr + task.word_offset * 8, body_words=task.body_words,
            int_mask=task.int_mask, enable_mask=task.enable_mask))
    return [tuple(tuple(t) for t in per_core) for per_core in chains]


def _with_ranges(jobs: tuple[Job, ...], a: BufferRange, c: BufferRange) -> tuple[Job, ...]:
    """``jobs`` naming the scratch ranges ``a`` and ``c`` (again, after a scratch buffer grew).
    A and C in one buffer, A first: one input range from A to the end of C (one clean)."""
    if (isinstance(a, BufferRange) and isinstance(c, BufferRange) and a.buffer is c.buffer
            and a.offset + a.size <= c.offset):
        inputs: tuple[BufferRange, ...] = (BufferRange(a.buffer, a.offset, c.offset + c.size - a.offset),)
    else:
        inputs = (a, c)
    return tuple(Job(cores=job.cores, inputs=inputs if i == 0 else (), outputs=(c,))
                 for i, job in enumerate(jobs))


# --- the compiler seam (contract D [docs/decisions.md]) ---------------------------------------------------
def _compile(m: int, k: int, n: int, dtype: str, out: str, cores: int, abi: str, envelope: Envelope) -> Any:
    from ggml_rknpu.compiler.matmul import compile_matmul

    return compile_matmul(m, k, n, dtype=dtype, out=out, cores=cores, abi=abi, envelope=envelope)


def _b_bytes(staged: StagedWeight) -> int:
    """Native B bytes of a weight; independent of M (K chunking depends on K and dtype)."""
    from ggml_rknpu.compiler.layout import b_bytes
    from ggml_rknpu.compiler.shape import MatmulShape

    N, K = staged.shape
    return b_bytes(MatmulShape(1, K, N, staged.dtype, OUT_FOR_WEIGHT[staged.dtype]))


def _pack_b(staged: StagedWeight, out: np.ndarray, envelope: Envelope) -> None:
    from ggml_rknpu.compiler.layout import pack_b

    pack_b(staged.data, staged.dtype, out=out, envelope=envelope)


def _pack_a(a: np.ndarray, program: Any, out: np.ndarray) -> None:
    from ggml_rknpu.compiler.layout import pack_a

    pack_a(a, program.shape.dtype, program, out=out)


def _unpack_c(buf: np.ndarray, program: Any, rows: int) -> np.ndarray:
    from ggml_rknpu.compiler.layout import unpack_c

    return unpack_c(buf, program, rows)
