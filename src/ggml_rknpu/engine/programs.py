"""``ProgramCache``: each (weight, M bucket, output type) compiled once, bound to fixed NPU
buffers (``BoundProgram``), cached and evicted least recently used; the M buckets.

Invariants: a program's B layout is the one its weight was packed in; programs stay inside
the engine's ``envelope``; a bucket the compiler refuses or that finds no memory (above
``RESERVE_ROWS``) lowers the weight's largest bucket, and the call splits along M. Why: docs/decisions.md "engine/api.py"."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ggml_rknpu.compiler.matmul import compile_matmul
from ggml_rknpu.compiler.program import Program
from ggml_rknpu.cost.model import driver_time, workload_from_program
from ggml_rknpu.engine.bound_program import BoundProgram, program_cores, program_jobs
from ggml_rknpu.engine.canary import Canaries
from ggml_rknpu.engine.hostpath import ActivationPort, ResultPort, bind_ports
from ggml_rknpu.engine.memory import Headroom, NpuMemory, pages
from ggml_rknpu.engine.npu_weight import MAX_PROGRAM_M, Weight
from ggml_rknpu.engine.scratch import ScratchPool
from ggml_rknpu.hw.alignment import align_up
from ggml_rknpu.hw.envelope import Envelope
from ggml_rknpu.kernel.device import NpuDevice
from ggml_rknpu.kernel.errors import NpuError, NpuOutOfMemory
from ggml_rknpu.kernel.job import Job

BUCKET_POW2_MAX = 256
OUT_FOR_WEIGHT = {"fp16": "fp32", "int8": "int32"}


def out_dtype(weight_dtype: str, out: str | None) -> str:
    """The result type of a matmul with a ``weight_dtype`` weight: ``out``, checked against what
    the compiler writes for that weight, or its default."""
    if out is None:
        return OUT_FOR_WEIGHT[weight_dtype]
    allowed = ("fp32", "fp16") if weight_dtype == "fp16" else ("int32",)
    if out not in allowed:
        raise ValueError(f"out={out!r} is not available for a {weight_dtype} weight; use one of {allowed}")
    return out
# Under ``memory_cap``, resident memory (weights, chained fusions) leaves room for the programs of
# every resident weight at this many rows: the decode path (server.grouping.GROUP_MAX_ROWS: one
# token, drafts, a few slots). A larger bucket that finds no memory splits its call along M.
RESERVE_ROWS = 16


def m_bucket(m: int) -> int:
    """The program size used for ``m`` rows (m <= MAX_PROGRAM_M)."""
    if not 1 <= m <= MAX_PROGRAM_M:
        raise ValueError(f"m must be in 1..{MAX_PROGRAM_M}, got {m}")
    if m <= BUCKET_POW2_MAX:
        return 1 << (m - 1).bit_length()
    return align_up(m, BUCKET_POW2_MAX)


class ProgramCache:
    """The bound programs of one engine, by (weight, M bucket, output type), least recently
    used first (``evict_one``, which ``NpuMemory`` calls when memory runs out), and at most
    ``max_bytes`` of them (register commands on the device and in host memory: on a board
    both are DRAM; ``rknpu serve --host-cache-budget``)."""

    def __init__(self, device: NpuDevice, memory: NpuMemory, scratch: ScratchPool, counters: dict[str, int],
                 cores: int, envelope: Envelope, npu_mhz: float | None) -> None:
        self.device, self.memory, self.scratch, self.counters = device, memory, scratch, counters
        self.cores, self.envelope, self.npu_mhz = cores, envelope, npu_mhz
        self.abi = device.kind
        self._lru: OrderedDict[tuple[int, int, str], Weight] = OrderedDict()
        self._sizes: dict[tuple[int, int, str], int] = {}
        self.bytes = 0                     # what the cached programs hold (``program_bytes``)
        self.max_bytes: int | None = None  # None: bounded by NPU memory only
        memory.evict = self.evict_one

    def compile(self, m: int, k: int, n: int, dtype: str, out: str) -> Program:
        """The compiler's (cached) program for an [m, k] x [n, k]^T matmul in this engine's cores and envelope."""
        return compile_matmul(m, k, n, dtype=dtype, out=out, cores=self.cores, abi=self.abi, envelope=self.envelope)

    def program_for(self, w: Weight, m: int, out: str) -> Program:
        """The compiled program of ``w`` at M bucket ``m`` (compiler-cached), checked against
        the weight's packed layout."""
        N, K = w.shape
        program = self.compile(m, K, N, w.dtype, out)
        self.counters["programs_compiled"] += 1
        if program.b_bytes > w.packed_bytes:
            raise NpuError(f"compiler wants {program.b_bytes} weight bytes for M={m} but the "
                           f"weight was packed into {w.packed_bytes}; the B layout must not depend on M")
        return program

    def headroom(self, n: int, k: int, dtype: str) -> Headroom:
        """``Headroom`` of an [n, k] weight: its program at ``RESERVE_ROWS`` compiled (the
        compiler caches it for the matmul that binds it) and measured; a bucket the compiler
        refuses halves, as ``bound_or_shrink`` would."""
        m = m_bucket(RESERVE_ROWS)
        while True:
            try:
                program = self.compile(m, k, n, dtype, OUT_FOR_WEIGHT[dtype])
                break
            except ValueError:
                if m == 1:
                    raise
                m //= 2
        tables = sum(self.device.table_bytes(Job(cores=cores))
                     for cores in program_cores(program, 0, self.device.n_cores))
        return Headroom(program.a_bytes, program.c_bytes, pages(program.words.nbytes) + tables)

    def bound_or_shrink(self, w: Weight, rows: int, out: str) -> BoundProgram | None:
        """The bound program for ``rows``; None after lowering ``w.max_program_m`` when the compiler
        refuses the bucket (too many tasks for one hardware run: split along M), or when a bucket
        above ``RESERVE_ROWS`` finds no NPU memory (the reserve covers the smaller ones)."""
        bucket = m_bucket(rows)
        try:
            return self.bound(w, bucket, out)
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

    def bound(self, w: Weight, m: int, out: str) -> BoundProgram:
        """``w``'s program at M bucket ``m``, bound (cached; compiled and bound on a miss)."""
        bound = w.programs.get((m, out))
        if bound is not None:
            self.counters["program_cache_hits"] += 1
            self._lru.move_to_end((id(w), m, out))
            return bound
        self.counters["program_cache_misses"] += 1
        bound = self._bind(self.program_for(w, m, out), m, w)
        w.programs[(m, out)] = bound
        key = (id(w), m, out)
        self._lru[key] = w
        self._sizes[key] = program_bytes(bound)
        self.bytes += self._sizes[key]
        self.trim()
        return bound

    def trim(self) -> None:
        """Evict least recently used programs beyond ``max_bytes`` (never the newest one)."""
        while self.max_bytes is not None and self.bytes > self.max_bytes and len(self._lru) > 1:
            self.evict_one()
            self.counters["programs_evicted_budget"] += 1

    def _bind(self, program: Program, m: int, w: Weight) -> BoundProgram:
        what = f"program M={m} for {w!r}"
        work = workload_from_program(program)
        modeled = None if self.npu_mhz is None else driver_time(work, abi=self.abi, npu_mhz=self.npu_mhz)
        bound = BoundProgram(program, m, w.buffer.dma_addr, modeled, work, label=f"matmul {program.shape}")
        try:
            # Each allocation may evict other programs; this one already counts as a user of the
            # shared buffers it joined, so they stay alive.
            bound.a_buf, bound.c_buf = self.scratch.join(bound, m, program.a_bytes, program.c_bytes, what,
                                                         w.domain)
            bound.regcmd_buf = self.memory.alloc(program.words.nbytes, "regcmd", what, domain=w.domain)
            bound.write_words()
        except BaseException:
            bound.close()
            raise
        # The driver cleans a job's inputs before every submit; the weight was cleaned once in
        # upload_weight and the CPU never writes it again, so it is not an input (listing it cost
        # a cache clean of the whole weight per call). Rocket orders jobs by implicit fences on
        # the in/out BOs [docs/npu-programming.md §5]; no job writes a weight, so none is needed.
        bound.jobs = program_jobs(program, bound.regcmd_buf.dma_addr, self.device.n_cores,
                                  bound.a_buf.range(), bound.c_buf.range(), w.domain)
        bound.canaries = Canaries.for_program(program)
        try:
            self.memory.prepare_jobs(bound.jobs, what)
        except BaseException:
            bound.close()
            raise
        return bound

    @staticmethod
    def ports(bound: BoundProgram, w: Weight, out: str) -> tuple[ActivationPort, ResultPort]:
        """The program's host-path ports, (re)bound when a shared scratch buffer was replaced."""
        assert bound.a_buf is not None and bound.c_buf is not None, "not bound yet"
        bound_to = (bound.a_buf.scratch.buf, bound.c_buf.scratch.buf)
        if bound.ports is None or bound.ports_bound_to != bound_to:
            bound.ports = bind_ports(bound.program, bound.a_buf.array(np.uint8), bound.c_buf.array(np.uint8),
                                     w.scales, out)
            bound.ports_bound_to = bound_to
        return bound.ports

    def evict_one(self) -> bool:
        """Free the least recently used program; False when none is cached."""
        if not self._lru:
            return False
        key, weight = self._lru.popitem(last=False)
        self.bytes -= self._sizes.pop(key)
        weight.programs.pop(key[1:]).close()
        self.counters["programs_evicted"] += 1
        return True

    def forget(self, w: Weight) -> None:
        """``w`` is being freed: its programs leave the eviction order (it closes them)."""
        for key in [k for k, weight in self._lru.items() if weight is w]:
            del self._lru[key]
            self.bytes -= self._sizes.pop(key)


def program_bytes(bound: BoundProgram) -> int:
    """What a cached program holds: its register commands on the device (whole pages) and
    in host memory (the compiled words)."""
    words = bound.program.words.nbytes
    return pages(words) + words
