"""The steps a ``GraphPlan`` replays, each run by its own ``run(stats, recovery)``: host
segments (one ggml_graph_compute), NPU matmuls, groups of sibling matmuls (one submit),
deliveries of a moved-up member's result, and runs of host segments merged across deliveries.

Invariants: a step makes no decision a plan did not make (a replay is a loop over them); an
NPU step behind ``NpuRecovery`` falls back to its host segment; index data is checked before
the segment reading it. Why: docs/decisions.md "server/planner.py"."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ggml_rknpu.engine.contract import EngineFusion, EngineWeight, MatmulEngine, MatmulTiming, fusing
from ggml_rknpu.libggml.compute import HostCompute
from ggml_rknpu.server.activations import ActivationRounder, npu_rows
from ggml_rknpu.server.buffers import DeviceBuffer
from ggml_rknpu.server.host_copies import HostCopy
from ggml_rknpu.server.ops.vocabulary import OpDataError, UnsupportedOp
from ggml_rknpu.server.recovery import NpuRecovery
from ggml_rknpu.server.stats import OpCounter, ServerStats
from ggml_rknpu.server.weight_store import WeightSlot

log = logging.getLogger(__name__)


class ReplayStep(Protocol):
    """One entry of a plan's replay: runs itself, counting into ``stats``, the NPU behind ``recovery``."""

    def run(self, stats: ServerStats, recovery: NpuRecovery) -> None: ...


@dataclass(eq=False)
class IndexCheck:
    """Indices that are data (GET_ROWS rows, MUL_MAT_ID experts, ...), checked before every run."""

    values: np.ndarray       # typed view of the index tensor's bytes (signed integers)
    bound: int               # valid values are [0, bound)
    what: str
    span: tuple[DeviceBuffer | None, int, int] = (None, 0, 0)   # (buffer, start, end) of those bytes
    unsigned: np.ndarray = field(init=False)   # the same bytes as unsigned: a negative index is huge

    def __post_init__(self) -> None:
        self.unsigned = self.values.view(self.values.dtype.str.replace("i", "u"))

    def check(self) -> None:
        # one reduction instead of min and max: as unsigned, every value outside [0, bound) is >= bound
        if self.unsigned.size and int(self.unsigned.max()) >= self.bound:
            v = self.values
            raise OpDataError(f"{self.what}: index outside [0, {self.bound}) "
                              f"(min {int(v.min())}, max {int(v.max())})")


@dataclass(eq=False)
class HostSegment:
    """A run of nodes between NPU steps: one ggml_graph_compute, prepared once.

    ``copies``: the repacked host copies its matmuls read (``server/host_copies.py``),
    repacked again first when their GGUF bytes changed. ``checks``: the index checks that must run just before it (indices a node of the plan
    writes; the others run once per replay, :func:`_hoist_checks`). ``counts``: per op
    counter, (nodes, bytes) this segment adds to it per run (a plan's own segments have
    theirs added once per replay, by the plan)."""

    compute: HostCompute
    checks: list[IndexCheck]
    counts: list[tuple[OpCounter, int, int]]
    copies: tuple[HostCopy, ...] = ()

    def run(self, stats: ServerStats, recovery: NpuRecovery | None = None) -> None:
        """The segment's checks, then its graph on ggml-cpu (``recovery``: unused, the host has no fault policy)."""
        for c in self.checks:
            c.check()
        for w in self.copies:
            w.ensure()
        t0 = time.perf_counter()
        self.compute.run()
        stats.host_seconds += time.perf_counter() - t0
        stats.host_segments += 1
        add_counts(self.counts)


def add_counts(counts: list[tuple[OpCounter, int, int]]) -> None:
    for counter, n, nbytes in counts:
        counter.ops += n
        counter.bytes += nbytes


@dataclass(eq=False)
class NpuStep:
    """One MUL_MAT with a resident weight: ``out[.., M, N] = a[.., M, K] @ W[N, K]^T`` on the engine.

    The engine is used only through ``NpuRecovery.matmul`` (``server/recovery.py``: the weight's
    handle, ``npu.matmul``, and the policy when the NPU faults); ``host`` is the same node as
    a one-node ggml graph, run when the weight is demoted, the engine fails or the NPU faulted
    twice (None when ggml-cpu has no kernel for the combination, e.g. f32 weights with f16
    activations: then an engine failure ends the connection)."""

    slot: WeightSlot
    a: np.ndarray            # the activations' typed view in its buffer
    a_type: int
    out: np.ndarray          # the destination's view
    host: HostSegment | None
    nbytes: int              # activations in + out (the weight is resident)
    npu_counter: OpCounter
    a_id: int = 0            # the activation tensor's id (NpuSteps reading one id may be grouped)
    node: int = 0            # the MUL_MAT's tensor id
    rounder: ActivationRounder | None = None   # ggml-cpu's activation rounding for this weight type

    def run(self, stats: ServerStats, recovery: NpuRecovery) -> None:
        t0 = time.perf_counter()
        npu = recovery.npu
        c = recovery.matmul(self.slot, lambda: npu_rows(self.a, self.a_type, self.slot.k, self.rounder))
        if c is not None and npu is not None:
            self.out[...] = c.reshape(self.out.shape)
            _count_npu(stats, (self,), c.shape[0], time.perf_counter() - t0, npu.last_timing)
            return
        if self.host is None:
            raise UnsupportedOp(f"MUL_MAT '{self.slot.name}' on the host",
                                "the NPU refused it and ggml-cpu has no kernel for these types")
        self.host.run(stats, recovery)


# the host part of split matmuls: one worker, so at most one ggml_graph_compute at a time
# beside the main thread's NPU submit (the plan's segments share one threadpool and work buffer)
_SPLIT_HOST = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rknpu-split-host")


@dataclass(eq=False)
class SplitStep:
    """One MUL_MAT with its N output rows split: ``npu`` (an NpuStep over the weight's first
    rows, its ``out`` those columns of dst) on the engine while ``host`` (a one-node ggml graph
    over the last ``host_rows`` rows, writing the other columns) runs in ggml-cpu on a worker
    thread, joined before the next step. The two write disjoint bytes and only read the
    activations. When the NPU side falls back (demoted weight, fault), its own host segment
    runs after the host part has finished."""

    npu: NpuStep
    host: HostSegment
    host_rows: int

    def run(self, stats: ServerStats, recovery: NpuRecovery) -> None:
        t0 = time.perf_counter()
        part = self.npu
        future = _SPLIT_HOST.submit(self.host.run, stats)
        try:
            c = recovery.matmul(part.slot, lambda: npu_rows(part.a, part.a_type, part.slot.k, part.rounder))
        finally:
            future.result()
        npu = recovery.npu
        if c is not None and npu is not None:
            part.out[...] = c.reshape(part.out.shape)
            _count_npu(stats, (part,), c.shape[0], time.perf_counter() - t0, npu.last_timing)
            stats.split_matmuls += 1
            return
        if part.host is None:
            raise UnsupportedOp(f"MUL_MAT '{part.slot.name}' on the host",
                                "the NPU refused it and ggml-cpu has no kernel for these types")
        part.host.run(stats, recovery)


def _count_npu(stats: ServerStats, members: tuple[NpuStep, ...], rows: int, seconds: float,
               timing: MatmulTiming | None = None) -> None:
    """Counters of NPU MUL_MATs that ran (one call for a group: its seconds are shared)."""
    for member in members:
        counter = member.npu_counter
        counter.ops += 1
        counter.bytes += member.nbytes
    members[0].npu_counter.seconds += seconds
    stats.count_npu_matmuls(rows, len(members), timing)


@dataclass(eq=False)
class NpuGroup:
    """Consecutive NpuSteps reading one activation (Q/K/V after the attention norm,
    gate/up after the FFN norm): one engine fusion, i.e. one submit, per replay.

    The fusion chains the members' own resident weights (no extra NPU memory, results
    identical to the members run one by one). It is built from the handles the weight store
    holds now and rebuilt whenever one of them changed (a write over a member's bytes
    unstages it, the next run stages a new copy) or the engine closed it. A member that is
    not resident, an engine that refuses the fusion, or a fault in it: the members run one
    by one (their own fallbacks) for that replay."""

    members: tuple[NpuStep, ...]
    rows: int                          # activation rows M (fixed by the graph)
    outs: tuple[np.ndarray, ...]       # each member's dst as float32 [M, N], views in its buffer
    fusion: EngineFusion | None = None   # the engine's fusion (None: not built or dropped)
    handles: tuple[EngineWeight, ...] = ()   # the weights the fusion was built from
    refused: bool = False              # the engine cannot plan this group: members one by one
    deferred: frozenset[int] = frozenset()   # members whose result a Delivery writes later
    ran: bool = False                  # this replay ran as one step (the Deliveries copy its results)

    def run(self, stats: ServerStats, recovery: NpuRecovery) -> None:
        self.ran = False
        npu, weights = recovery.npu, recovery.weights
        found = tuple(weights.weight(m.slot) for m in self.members)
        handles = tuple(h for h in found if h is not None)
        if npu is None or self.refused or len(handles) < len(found):
            self._one_by_one(stats, recovery)
            return
        t0 = time.perf_counter()
        fusion = self._current_fusion(npu, handles)
        if fusion is None:
            self._one_by_one(stats, recovery)
            return
        first = self.members[0]
        try:
            fusion.run(npu_rows(first.a, first.a_type, first.slot.k, first.rounder), outs=self.outs)
        except Exception as exc:  # a fault in the chained submit: reset, drop the fusion, one by one
            recovery.step_failed(self.names(), exc)
            self.drop()
            self._one_by_one(stats, recovery)
            return
        _count_npu(stats, self.members, self.rows, time.perf_counter() - t0, npu.last_timing)
        stats.npu_grouped_runs += 1
        self.ran = True

    def _current_fusion(self, npu: MatmulEngine, handles: tuple[EngineWeight, ...]) -> EngineFusion | None:
        """The engine's fusion for ``handles``, (re)built when they or the fusion went stale."""
        stale = self.fusion is None or self.fusion.closed or len(handles) != len(self.handles) or any(
            h is not old for h, old in zip(handles, self.handles))
        if stale:
            self.drop()
            engine = fusing(npu)
            try:
                if engine is None:
                    raise ValueError(f"{npu.describe()} plans no fusions")
                self.fusion = engine.fuse(list(handles), self.rows)
            except Exception as exc:  # envelope limits, NPU memory for the chained buffers
                log.info("NPU matmuls %s stay one submit each: %s: %s", self.names(), type(exc).__name__, exc)
                self.refused = True
                return None
            self.handles = handles
        return self.fusion

    def _one_by_one(self, stats: ServerStats, recovery: NpuRecovery) -> None:
        """The members that run here, each behind the fault policy (a deferred one runs at its Delivery)."""
        for member in self.members:
            if member.node not in self.deferred:
                member.run(stats, recovery)

    def names(self) -> str:
        return "+".join(f"'{m.slot.name}'" for m in self.members)

    def drop(self) -> None:
        """Release the fusion (its chained buffers); the next run builds a new one."""
        if self.fusion is not None:
            self.fusion.close()
        self.fusion, self.handles = None, ()


@dataclass(eq=False)
class Delivery:
    """Where a grouped member that was moved up used to be: its result is written here
    (copied from the group's run, or the member runs here when the group did not)."""

    node: int                          # the member's tensor id
    member: NpuStep | None = None
    group: NpuGroup | None = None
    kept: np.ndarray | None = None     # the group's result for this member
    dst: np.ndarray | None = None      # the member's dst as [M, N]

    def run(self, stats: ServerStats, recovery: NpuRecovery) -> None:
        if self.group is not None and self.group.ran:
            assert self.dst is not None and self.kept is not None, "a grouped delivery has its arrays"
            np.copyto(self.dst, self.kept)
        else:
            assert self.member is not None, "planned with its member (grouping.group_npu_steps)"
            self.member.run(stats, recovery)


@dataclass(eq=False)
class DeliveredRun:
    """Host segments that only Deliveries separate (ROPE(Q), then K's and V's results, then
    their own nodes), as one ggml graph with each delivery as a CPY node from the group's
    kept result: one host segment per replay instead of one per part.

    The merged graph is the same nodes in the same order, so its results are the parts'.
    It runs when every group it delivers from ran as one step this replay; otherwise (a
    member not resident, a refused or faulted group: its members run at their Deliveries)
    the parts run one by one, as they would have without the merge."""

    merged: HostSegment
    parts: list[HostSegment | Delivery]
    groups: tuple[NpuGroup, ...]

    def run(self, stats: ServerStats, recovery: NpuRecovery) -> None:
        if all(g.ran for g in self.groups):
            self.merged.run(stats)
            return
        for part in self.parts:
            part.run(stats, recovery)

