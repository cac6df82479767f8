"""Fused NPU jobs for the decode path: sibling weights as one resident weight, several
programs in one submit, and ``Fusion``, a submit planned once and replayed.

Invariants: a fused weight is exact (each output row is the same dot product; int8 scales
are per row and concatenate too); chained programs read one A and write disjoint regions
of one C; residency stays exact because the caller invalidates every fused copy built from
a sibling it invalidates (``FusedWeights.invalidate``), and freeing a member closes the
chained fusions using it. Why and the two ways: docs/decisions.md "engine/fusion.py"."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ggml_rknpu.compiler.chain import chain_image, image_words, member_offsets
from ggml_rknpu.compiler.layout import a_bytes, c_bytes
from ggml_rknpu.cost.model import Workload, modeled_time, workload_from_program
from ggml_rknpu.engine.canary import Canaries
from ggml_rknpu.engine.hostpath import ActivationPort, ResultPort
from ggml_rknpu.engine.memory import c_base
from ggml_rknpu.engine.timing import Timing, device_seconds
from ggml_rknpu.hw import limits
from ggml_rknpu.hw.alignment import align_up
from ggml_rknpu.kernel.buffer import Buffer
from ggml_rknpu.kernel.job import BufferRange, HwTask, Job

if TYPE_CHECKING:
    from ggml_rknpu.compiler.program import Program
    from ggml_rknpu.engine.bound_program import BoundProgram
    from ggml_rknpu.engine.npu_weight import FusedWeight, Weight
    from ggml_rknpu.engine.parts import EngineParts

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


class FusedWeights:
    """Fused copies keyed by their siblings' caller keys; exact invalidation by any sibling."""

    def __init__(self) -> None:
        self._by_keys: dict[tuple[Hashable, ...], FusedWeight] = {}

    def get(self, keys: Sequence[Hashable], load: Callable[[], FusedWeight]) -> FusedWeight:
        """The fused weight of siblings ``keys``; ``load()`` uploads it when absent."""
        keys = tuple(keys)
        fused = self._by_keys.get(keys)
        if fused is None or fused.freed:
            fused = load()
            self._by_keys[keys] = fused
        return fused

    def invalidate(self, key: Hashable) -> int:
        """Free every fused copy one of whose siblings is ``key``; how many were freed."""
        stale = [ks for ks in self._by_keys if key in ks]
        for ks in stale:
            self._by_keys.pop(ks).free()
        return len(stale)

    def clear(self) -> None:
        for fused in self._by_keys.values():
            fused.free()
        self._by_keys.clear()

    def __len__(self) -> int:
        return len(self._by_keys)


class Fusion:
    """One submit of the decode path: one weight (plain or fused) or several chained,
    all reading one activation [rows <= m, K]. Planned once; ``run`` writes A through
    precomputed views, submits, and reads every output through precomputed views.

    ``run`` returns one array per output (a fused weight gives one per sibling), rows
    ``[:rows]`` of arrays the fusion owns: they are overwritten by its next run (copy them to
    keep them), or pass ``outs`` to receive the results in your own arrays."""

    def __init__(self, parts: EngineParts, weights: Sequence[Weight], m: int, out: str) -> None:
        """``weights``: checked by the engine (``Npu.fuse``); ``m``: its M bucket for the rows this
        fusion takes (``programs.m_bucket``); ``out``: the output type."""
        ks = {(w.shape[1], w.dtype) for w in weights}
        if len(ks) != 1:
            raise ValueError(f"the weights of one fusion must share K and dtype; got {sorted(ks)}")
        self.parts = parts
        self.weights = tuple(weights)
        self.K = weights[0].shape[1]
        self.dtype = weights[0].dtype
        self.m = m
        self.out = out
        self.closed = False
        scaled = self.dtype == "int8"
        self._result_dtype = np.float32 if scaled or self.out == "fp32" else (
            np.float16 if self.out == "fp16" else np.int32)
        # results: one array per weight; a fused weight's siblings are column views of it
        self._results = [np.empty((self.m, w.shape[0]), self._result_dtype) for w in self.weights]
        self.outputs: list[tuple[int, int, int]] = []      # (weight index, n0, n1)
        for i, w in enumerate(self.weights):
            for n0, n1 in getattr(w, "splits", ((0, w.shape[0]),)):
                self.outputs.append((i, n0, n1))
        self._views = [self._results[i][:, n0:n1] for i, n0, n1 in self.outputs]
        self.timing: tuple[float, float, float] = (0.0, 0.0, 0.0)   # pack, submit, unpack (measured)
        self.canary_s = 0.0   # of the submit: arming and checking the canaries (measured)
        self._chain = _Chain(parts, self) if len(self.weights) > 1 else None
        self._label = f"fusion {self!r}"   # what a timeout names (formatted once)
        self.modeled = self._chain.modeled if self._chain else None

    # -- single weight: the engine's cached plan, re-fetched each run (it may be evicted)
    def _single(self) -> tuple[ActivationPort, list[ResultPort], BoundProgram]:
        w = self.weights[0]
        programs = self.parts.programs
        bound = programs.bound(w, self.m, self.out)
        a_port, c_port = programs.ports(bound, w, self.out)
        self.modeled = bound.modeled
        return a_port, [c_port], bound

    def rehearse(self, a: np.ndarray) -> float:
        """The host side of ``run`` alone (A written, C read through the views, scales
        applied) without submitting: seconds on this host. For benchmarks of the host path
        apart from the device (a simulator's execution also evicts the CPU caches)."""
        if self.closed:
            raise ValueError("this fusion was closed (one of its weights was freed); plan it again")
        t0 = time.perf_counter()
        a_port, r_ports = self._chain.ports() if self._chain else self._single()[:2]
        act_scales = a_port.write(a)
        for port, result in zip(r_ports, self._results):
            port.read(result, a.shape[0], act_scales)
        return time.perf_counter() - t0

    def run(self, a: np.ndarray, outs: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        if self.closed:
            raise ValueError("this fusion was closed (one of its weights was freed); plan it again")
        t0 = time.perf_counter()
        submitter = self.parts.submitter
        if self._chain:   # one chained job over private buffers, its members' canaries checked
            a_port, r_ports = self._chain.ports()
            act_scales = a_port.write(a)
            t1 = time.perf_counter()
            jobs: tuple[Job, ...] = (self._chain.job,)
            completion, hw_ns = submitter.run(jobs, self._chain.canaries, self._label)
        else:   # the engine's bound program: its chains in order, canaries checked
            a_port, r_ports, bound = self._single()
            act_scales = a_port.write(a)
            t1 = time.perf_counter()
            jobs = bound.jobs
            completion, hw_ns = submitter.run_bound(bound)
        self.canary_s = submitter.last_canary_s
        submits = len(jobs)
        t2 = time.perf_counter()
        rows = a.shape[0]
        if outs is not None and len(outs) != len(self._views):
            raise ValueError(f"this fusion has {len(self._views)} outputs, got {len(outs)} arrays")
        if outs is not None and self._direct(outs, rows):
            # each output is one weight's whole result: read C straight into the caller's rows
            for port, dst in zip(r_ports, outs):
                port.read(dst, rows, act_scales)
            results = [o[:rows] for o in outs]
        else:
            for port, result in zip(r_ports, self._results):
                port.read(result, rows, act_scales)
            if outs is None:
                results = [v[:rows] for v in self._views]
            else:
                for dst, v in zip(outs, self._views):
                    np.copyto(dst[:rows], v[:rows], casting="same_kind")
                results = [o[:rows] for o in outs]
        t3 = time.perf_counter()
        self.timing = (t1 - t0, t2 - t1, t3 - t2)
        dev, label = device_seconds(self.modeled, completion, hw_ns)
        self.parts.last_timing = Timing(*self.timing, device_s=dev, device_label=label, submits=submits)
        c = self.parts.counters
        c["matmuls"] += len(self.weights)
        c["fusion_runs"] += 1
        if self._chain:
            c["chained_submits"] += 1
        return results

    def _direct(self, outs: Sequence[np.ndarray], rows: int) -> bool:
        """Whether ``outs`` can take the results straight from C: one output per weight (no
        fused siblings), each of the result's type and width with C-contiguous rows."""
        if len(outs) != len(self.weights):
            return False
        for dst, w in zip(outs, self.weights):
            if (dst.dtype != self._result_dtype or dst.ndim != 2 or dst.shape[0] < rows
                    or dst.shape[1] != w.shape[0] or not dst.flags.c_contiguous):
                return False
        return True

    def close(self) -> None:
        """Release the fusion (a chained fusion's private buffers); idempotent."""
        if not self.closed:
            self.closed = True
            self.parts.fusions.discard(self)
            if self._chain:
                self._chain.close()

    def __repr__(self) -> str:
        shapes = "+".join(f"{w.shape[0]}" for w in self.weights)
        return f"Fusion(M<={self.m}, K={self.K}, N={shapes}, {self.dtype}{', chained' if len(self.weights) > 1 else ''})"


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

    def __init__(self, parts: EngineParts, fusion: Fusion) -> None:
        self.parts = parts
        cache = parts.programs
        programs = [cache.program_for(w, fusion.m, fusion.out) for w in fusion.weights]
        self.programs = programs
        _check_chainable(programs, parts)
        self.modeled = (None if cache.npu_mhz is None
                        else modeled_time(fusion_workload(programs), npu_mhz=cache.npu_mhz))
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
                       outputs=(BufferRange(self.data, c_start, pos - c_start),))
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
            port = ResultPort(p, w.scales, fusion._result_dtype)
            port.bind(c_raw[co: co + c_bytes(p.shape, p.k_splits)])
            r_ports.append(port)
        assert a_bytes(programs[0].shape) == programs[0].a_bytes
        self._ports = (a_port, r_ports)
        # each member's canaries in its own C region, as the engine's own submits
        # (engine.canary): a task that never wrote its output is a fault, not a result
        # checked as one set over the shared buffer: one store before, one compare after
        self.canaries = Canaries.combined([Canaries.for_program(p).at(co) for p, co in zip(programs, c_offsets)]
                                          ).over(c_raw)

    def _alloc(self, size: int, purpose: str, what: str) -> Buffer:
        buf = self.parts.memory.alloc(align_up(max(size, 1), limits.REGCMD_TASK_ALIGN), purpose, what,
                              resident=True)   # not evictable: leaves the programs' reserve under memory_cap
        self.buffers.append(buf)
        return buf

    def ports(self) -> tuple[ActivationPort, list[ResultPort]]:
        return self._ports

    def close(self) -> None:
        for buf in self.buffers:
            buf.close()
        self.buffers.clear()
