"""``Fusion``: the engine's one route from activations to results, planned once and replayed:
one weight (plain, or siblings fused into one) or several chained in one submit.

Invariants: every NPU run of an ``NpuEngine`` is a ``Fusion.run`` (``NpuEngine.matmul`` is a
one-weight fusion; ``engine.core_files`` launches its files' staged jobs itself): A written
through views, canaries armed, the jobs submitted in order, canaries checked (output left
unwritten resets the NPU and raises ``StaleOutput``), C read through views straight into the
caller's arrays, the timing kept. A fused weight is exact (each
output row is the same dot product; int8 scales are per row and concatenate too); chained
programs read one A and write disjoint regions of one C; freeing a weight closes the
fusions using it. Why and the two ways: docs/decisions.md "engine/fusion.py"."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ggml_rknpu.compiler.chain import chain_image, image_words, member_offsets
from ggml_rknpu.compiler.layout import a_bytes, c_bytes
from ggml_rknpu.cost.model import Workload, driver_time, workload_from_program
from ggml_rknpu.engine.canary import Canaries, CanaryCells, raise_stale
from ggml_rknpu.engine.hostpath import ActivationPort, ResultPort
from ggml_rknpu.engine.memory import c_base
from ggml_rknpu.engine.programs import m_bucket
from ggml_rknpu.engine.timing import Timing, device_seconds
from ggml_rknpu.hw import limits
from ggml_rknpu.hw.alignment import align_up
from ggml_rknpu.kernel.buffer import Buffer
from ggml_rknpu.kernel.errors import NpuTimeout
from ggml_rknpu.kernel.job import BufferRange, HwTask, Job

if TYPE_CHECKING:
    from ggml_rknpu.compiler.program import Program
    from ggml_rknpu.cost.model import ModeledTime
    from ggml_rknpu.engine.npu_weight import Weight
    from ggml_rknpu.engine.parts import EngineParts

# one run of A through programs: (rows, A port, C ports, jobs, canaries, what a timeout names, modeled
# time, the work the cost model prices)
Piece = tuple[int, ActivationPort, Sequence[ResultPort], tuple[Job, ...], CanaryCells, str, "ModeledTime | None",
              Workload]


@dataclass(frozen=True, eq=False)
class Staged:
    """One piece of a run with its rows of A written: ``jobs`` are ready to submit once
    ``cells`` (the canaries) are armed; ``Fusion.read`` takes C after they ran."""

    rows: int
    act_scales: np.ndarray | None
    ports: Sequence[ResultPort]
    jobs: tuple[Job, ...]
    cells: CanaryCells
    label: str
    modeled: ModeledTime | None
    workload: Workload

def concat_rows(parts: Sequence[np.ndarray]) -> tuple[np.ndarray, tuple[tuple[int, int], ...]]:
    """Sibling weights [N_i, K] -> one [sum N_i, K] array and each sibling's row range."""
    if len(parts) < 2:
        raise ValueError(f"a fused weight needs at least 2 siblings, got {len(parts)}")
    for i, p in enumerate(parts):
        if not isinstance(p, np.ndarray) or p.ndim != 2 or 0 in p.shape:
            raise ValueError(f"sibling {i} must be a non-empty 2-D numpy array")
    ks = {p.shape[1] for p in parts}
    if len(ks) != 1:
        raise ValueError(f"siblings must share K (their input width); got K = {sorted(ks)}")
    kinds = {p.dtype == np.int8 for p in parts}
    if len(kinds) != 1:
        raise ValueError("siblings must all be int8 or all be float")
    splits, n0 = [], 0
    for p in parts:
        splits.append((n0, n0 + p.shape[0]))
        n0 += p.shape[0]
    return np.concatenate(parts, axis=0), tuple(splits)


def fusion_workload(programs: Sequence[Program]) -> Workload:
    """What the cost model prices for one fusion running ``programs``: every task of every
    member; one submit when chained (members of one chain each), else the one program's
    submits (an envelope may cut it into several chains)."""
    submits = 1 if len(programs) > 1 else workload_from_program(programs[0]).submits
    return Workload(tuple(t for p in programs for t in workload_from_program(p).tasks), submits=submits)


class Fusion:
    """One weight (plain or fused) or several chained, all reading one activation [rows, K]:
    planned once, ``run`` replays it. A chain takes up to the ``rows`` it was planned for, in
    one submit; a single weight any rows, through its bound programs of each M bucket (more
    rows than its largest program are several runs of it).

    ``run`` writes one result per output (a fused weight gives one per sibling) into ``outs``
    when given (straight from C when each is one weight's whole float result with C-contiguous
    rows), else returns rows ``[:rows]`` of arrays the fusion owns: they are overwritten by its
    next run (copy them to keep them)."""

    def __init__(self, parts: EngineParts, weights: Sequence[Weight], rows: int | None, out: str, *,
                 siblings: bool = True) -> None:
        """``weights``: checked by the engine (``NpuEngine.fuse``); ``rows``: the most a run takes
        (a chain runs its M bucket, ``programs.m_bucket``; None: any, one weight only);
        ``out``: the output type; ``siblings``: a fused weight gives one output per sibling
        (False: one, the whole weight)."""
        ks = {(w.shape[1], w.dtype) for w in weights}
        if len(ks) != 1:
            raise ValueError(f"the weights of one fusion must share K and dtype; got {sorted(ks)}")
        self.parts = parts
        self.weights = tuple(weights)
        self.K = weights[0].shape[1]
        self.dtype = weights[0].dtype
        self.rows = rows
        self.out = out
        self.closed = False
        scaled = self.dtype == "int8"
        self.result_dtype: type = np.float32 if scaled or self.out == "fp32" else (
            np.float16 if self.out == "fp16" else np.int32)
        # what C may be read straight into: the result type, or int32 sums (int8 activations, unscaled)
        self._direct_dtypes = (np.dtype(self.result_dtype), *((np.dtype(np.int32),) if scaled else ()))
        self.outputs: list[tuple[int, int, int]] = []      # (weight index, n0, n1)
        for i, w in enumerate(self.weights):
            splits = getattr(w, "splits", ()) if siblings else ()
            for n0, n1 in splits or ((0, w.shape[0]),):
                self.outputs.append((i, n0, n1))
        self._results: list[np.ndarray] = []   # own results, one per weight (grown to the rows of a run)
        self.timing: tuple[float, float, float] = (0.0, 0.0, 0.0)   # pack, submit, unpack (measured)
        self.canary_s = 0.0   # of the submit: arming and checking the canaries (measured)
        if rows is None and len(self.weights) > 1:
            raise ValueError("a chained fusion is planned for a number of rows")
        self._chain = _Chain(parts, self, m_bucket(rows)) if rows is not None and len(self.weights) > 1 else None
        self.modeled = self._chain.modeled if self._chain else None
        for w in self.weights:
            w.fusions.add(self)

    def _piece(self, rows: int) -> Piece | None:
        """What runs the next ``rows`` (at most): the chain, or the single weight's bound
        program of their M bucket (re-fetched per run: it may be evicted); None after the
        weight's largest bucket was lowered (``ProgramCache.bound_or_shrink``): ask again."""
        if self._chain:
            return self._chain.piece(rows)
        w = self.weights[0]
        programs = self.parts.programs
        n = min(w.max_program_m, rows)
        bound = programs.bound_or_shrink(w, n, self.out)
        if bound is None:
            return None
        a_port, c_port = programs.ports(bound, w, self.out)
        self.modeled = bound.modeled
        return n, a_port, (c_port,), bound.jobs, bound.canary_cells(), bound.label, bound.modeled, bound.workload

    def stage(self, a: np.ndarray, m0: int, rows: int) -> Staged | None:
        """The piece for rows ``[m0, m0 + rows)`` of ``a`` (at most: ``Staged.rows``) with its
        rows of A written; None when the weight's largest bucket was just lowered: ask again."""
        piece = self._piece(rows)
        if piece is None:
            return None
        n, a_port, r_ports, jobs, cells, what, modeled, work = piece
        act_scales = a_port.write(a if n == a.shape[0] else a[m0: m0 + n])
        return Staged(n, act_scales, r_ports, jobs, cells, what, modeled, work)

    @staticmethod
    def read(staged: Staged, dsts: Sequence[np.ndarray], m0: int, rows: int) -> None:
        """Rows ``[m0, m0 + rows)`` of each weight's result from C into ``dsts`` (one per
        weight, any strides), once the staged jobs ran and their canaries were checked."""
        for port, dst in zip(staged.ports, dsts):
            port.read(dst[m0:] if m0 else dst, rows, staged.act_scales)

    def rehearse(self, a: np.ndarray, outs: Sequence[np.ndarray] | None = None) -> float:
        """The host side of ``run`` alone (A written, C read through the views, scales
        applied) without submitting, the results into ``outs`` when given: seconds on this
        host. For benchmarks of the host path apart from the device (a simulator's execution
        also evicts the CPU caches)."""
        self._check_open()
        t0 = time.perf_counter()
        rows = a.shape[0]
        staged = self.stage(a, 0, rows)
        if staged is None or staged.rows < rows:
            raise ValueError(f"rehearse takes the rows of one program; {rows} need several")
        results = self._own_results(rows)
        self.read(staged, results, 0, rows)
        seconds = time.perf_counter() - t0
        for dst, (i, n0, n1) in zip(outs or (), self.outputs):
            np.copyto(dst[:rows], results[i][:rows, n0:n1], casting="same_kind")
        return seconds

    def run(self, a: np.ndarray, outs: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """``a`` [rows, K] -> one [rows, N_i] result per output (see the class docstring).
        Timing: pack is everything up to A written (checks, the program's lookup), submit the
        canaries and the submits, unpack the rest."""
        t0 = time.perf_counter()
        self._check_open()
        rows = a.shape[0]
        if self.rows is not None and rows > self.rows:
            raise ValueError(f"activation has shape {a.shape}; this fusion takes [1..{self.rows}, {self.K}]")
        if outs is not None and len(outs) != len(self.outputs):
            raise ValueError(f"this fusion has {len(self.outputs)} outputs, got {len(outs)} arrays")
        direct = outs is not None and self._direct(outs, rows)
        dsts = outs if direct and outs is not None else self._own_results(rows)
        parts = self.parts
        device = parts.device
        pack_s = submit_s = unpack_s = canary_s = 0.0
        device_s: float | None = 0.0
        labels = set()
        submits = 0
        m0 = 0
        while m0 < rows:
            staged = self.stage(a, m0, rows - m0)
            if staged is None:
                continue
            n, jobs, cells, what, modeled = staged.rows, staged.jobs, staged.cells, staged.label, staged.modeled
            t1 = time.perf_counter()
            cells.arm()
            t2 = time.perf_counter()
            hw_ns: int | None = 0
            try:
                for job in jobs:
                    done = device.submit(job)
                    hw_ns = None if done.hw_elapsed_ns is None or hw_ns is None else hw_ns + done.hw_elapsed_ns
            except NpuTimeout as exc:
                raise NpuTimeout(f"{what} timed out on the NPU: {exc}", exc.errno) from exc
            t3 = time.perf_counter()
            parts.counters["submits"] += len(jobs)
            unwritten = cells.unwritten()
            t4 = time.perf_counter()
            if unwritten:
                raise_stale(self.parts.counters, self.parts.reset,
                            f"{what}: {unwritten} output canar{'y' if unwritten == 1 else 'ies'} left unwritten "
                            f"after {len(jobs)} submit(s): a task did not finish (rocket: job killed at its "
                            "500 ms timeout?)")
            self.read(staged, dsts, m0, n)
            t5 = time.perf_counter()
            dev, label = device_seconds(modeled, done, hw_ns)
            pack_s, submit_s, unpack_s = pack_s + t1 - t0, submit_s + t4 - t1, unpack_s + t5 - t4
            canary_s += t2 - t1 + t4 - t3
            device_s = None if dev is None or device_s is None else device_s + dev
            labels.add(label)
            submits += len(jobs)
            m0 += n
            t0 = t5
        if direct and outs is not None:
            results = [o[:rows] for o in outs]
        else:
            views = [self._results[i][:rows, n0:n1] for i, n0, n1 in self.outputs]
            if outs is None:
                results = views
            else:
                for dst, v in zip(outs, views):
                    np.copyto(dst[:rows], v, casting="same_kind")
                results = [o[:rows] for o in outs]
        unpack_s += time.perf_counter() - t0
        self.timing, self.canary_s = (pack_s, submit_s, unpack_s), canary_s
        parts.last_timing = Timing(pack_s, submit_s, unpack_s, device_s=device_s,
                                   device_label=labels.pop() if len(labels) == 1 else "unknown", submits=submits)
        c = parts.counters
        c["matmuls"] += len(self.weights)
        c["fusion_runs"] += 1
        if self._chain:
            c["chained_submits"] += 1
        return results

    def _own_results(self, rows: int) -> list[np.ndarray]:
        """The fusion's own result arrays, one per weight, of at least ``rows`` rows."""
        if not self._results or self._results[0].shape[0] < rows:
            self._results = [np.empty((rows, w.shape[0]), self.result_dtype) for w in self.weights]
        return self._results

    def _direct(self, outs: Sequence[np.ndarray], rows: int) -> bool:
        """Whether ``outs`` can take the results straight from C: one output per weight (no
        fused siblings), each of the result's type (int32 too for an int8 weight) and width with
        C-contiguous rows."""
        if len(outs) != len(self.weights):
            return False
        for dst, w in zip(outs, self.weights):
            if (dst.dtype not in self._direct_dtypes or dst.ndim != 2 or dst.shape[0] < rows
                    or dst.shape[1] != w.shape[0] or not dst.flags.c_contiguous):
                return False
        return True

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("this fusion was closed (one of its weights was freed); plan it again")

    def close(self) -> None:
        """Release the fusion (a chained fusion's private buffers); idempotent."""
        if not self.closed:
            self.closed = True
            for w in self.weights:
                w.fusions.discard(self)
            if self._chain:
                self._chain.close()

    def __repr__(self) -> str:
        shapes = "+".join(f"{w.shape[0]}" for w in self.weights)
        return f"Fusion(M<={self.rows}, K={self.K}, N={shapes}, {self.dtype}{', chained' if len(self.weights) > 1 else ''})"


def _check_chainable(programs: Sequence[Program], parts: EngineParts) -> None:
    """Chained members must each be one chain, and the chained image must stay inside the
    engine's envelope (``hw.envelope``: tasks per vendor PC chain); else ValueError."""
    if any(p.n_submits > 1 for p in programs):
        raise ValueError("a member program already needs several chains in this envelope; "
                         "run the siblings as a fused weight or as separate fusions")
    per_core: dict[int, int] = {}
    for p in programs:
        for t in p.tasks:
            per_core[t.core] = per_core.get(t.core, 0) + 1
    envelope = parts.programs.envelope
    limit = envelope.max_chain_tasks[programs[0].shape.dtype]
    if parts.programs.abi == "rknpu" and max(per_core.values()) > limit:
        raise ValueError(f"chaining these programs puts {max(per_core.values())} tasks in one PC chain, more "
                         f"than the {envelope.name} envelope's {limit}; use a fused weight or separate fusions")


class _Chain:
    """Private buffers of a chained fusion (fixed for its life): one holding A and the members'
    C regions (one clean covers what the CPU wrote, one invalidate what the NPU wrote) and
    the chained regcmd image (cleaned once, here)."""

    def __init__(self, parts: EngineParts, fusion: Fusion, m: int) -> None:
        self.parts = parts
        self.m = m
        cache = parts.programs
        if len({w.domain for w in fusion.weights}) > 1:
            raise ValueError("the weights are resident in different IOMMU domains and one submit reaches one; "
                             "run them as separate fusions")
        self.domain = fusion.weights[0].domain
        programs = [cache.program_for(w, m, fusion.out) for w in fusion.weights]
        self.programs = programs
        _check_chainable(programs, parts)
        self.workload = fusion_workload(programs)
        self.modeled = (None if cache.npu_mhz is None
                        else driver_time(self.workload, abi=cache.abi, npu_mhz=cache.npu_mhz))
        what = repr(fusion)
        # A and the members' C regions share one buffer, C from a cache-line boundary after A:
        # the CPU writes A and the canaries in C, so one clean of [0, C end) covers both, then
        # one invalidate of C; no cache line holds both A bytes and C bytes
        c_start = c_base(programs[0].a_bytes)
        c_offsets, pos = [], c_start
        for p in programs:
            c_offsets.append(pos)
            pos += c_base(p.c_bytes)   # member C regions start memory.C_ALIGN apart: no shared cache line
        self.buffers: list[Buffer] = []
        try:
            self.data = self._alloc(pos, "data", what)
            self.regcmd = self._alloc(image_words(programs) * 8, "regcmd", what)
        except BaseException:
            self.close()
            raise
        offsets = member_offsets(programs)
        bound = [p.bind(a=self.data.dma_addr, b=w.buffer.dma_addr, c=self.data.dma_addr + co,
                        regcmd=self.regcmd.dma_addr + ro * 8)
                 for p, w, co, ro in zip(programs, fusion.weights, c_offsets, offsets)]
        image, per_core = chain_image(programs, bound, self.regcmd.dma_addr)
        self.regcmd.array(np.uint64)[: image.size] = image
        self.regcmd.sync_to_device(0, image.nbytes)
        cores = [tuple(HwTask(regcmd_addr=self.regcmd.dma_addr + t.word_offset * 8, body_words=t.body_words,
                              int_mask=t.int_mask, enable_mask=t.enable_mask) for t in tasks)
                 for tasks in per_core]
        cores += [()] * (cache.device.n_cores - len(cores))
        # C is an input too, as in the engine's own jobs (bound_program.with_ranges): the CPU wrote its canaries
        self.job = Job(cores=tuple(cores), inputs=(BufferRange(self.data, 0, pos),),
                       outputs=(BufferRange(self.data, c_start, pos - c_start),), domain=self.domain)
        try:
            parts.memory.prepare_jobs((self.job,), what)
        except BaseException:
            self.close()
            raise
        a_port = ActivationPort(programs[0].shape, quantize=fusion.dtype == "int8")
        raw = self.data.array(np.uint8)
        a_port.bind(raw[: programs[0].a_bytes])
        c_raw = raw
        r_ports = []
        for p, w, co in zip(programs, fusion.weights, c_offsets):
            port = ResultPort(p, w.scales, fusion.result_dtype)
            port.bind(c_raw[co: co + c_bytes(p.shape, p.k_splits)])
            r_ports.append(port)
        assert a_bytes(programs[0].shape) == programs[0].a_bytes
        self._ports = (a_port, r_ports)
        # each member's canaries in its own C region, as the engine's own submits
        # (engine.canary): a task that never wrote its output is a fault, not a result
        # checked as one set over the shared buffer: one store before, one compare after
        self.canaries = Canaries.combined([Canaries.for_program(p).at(co) for p, co in zip(programs, c_offsets)]
                                          ).over(c_raw)
        self.label = f"fusion {what}"

    def _alloc(self, size: int, purpose: str, what: str) -> Buffer:
        buf = self.parts.memory.alloc(align_up(max(size, 1), limits.REGCMD_TASK_ALIGN), purpose, what,
                                      resident=True, domain=self.domain)   # not evictable: leaves the programs' reserve under memory_cap
        self.buffers.append(buf)
        return buf

    def piece(self, rows: int) -> Piece:
        """The chained job for ``rows`` (at most its M bucket)."""
        a_port, r_ports = self._ports
        return rows, a_port, r_ports, (self.job,), self.canaries, self.label, self.modeled, self.workload

    def close(self) -> None:
        for buf in self.buffers:
            buf.close()
        self.buffers.clear()
