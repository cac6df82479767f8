"""The steps a ``GraphPlan`` replays, each run by its own ``run(stats)``: host segments (one
ggml_graph_compute), NPU matmuls, groups of sibling matmuls (one submit), deliveries of a
moved-up member's result, and runs of host segments merged across deliveries.

Invariants: a step makes no decision a plan did not make (a replay is a loop over them); an
NPU step owns the engine fusion of its weights (``StepFusion``), which writes the results in
place, runs it behind its fault policy (``NpuRecovery``) and falls back to its host segment;
index data is checked before the segment reading it. Why: docs/decisions.md "server/planner.py"."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ggml_rknpu.engine.contract import EngineFusion, EngineWeight, MatmulEngine, MatmulTiming, plan_fusion
from ggml_rknpu.libggml.compute import HostCompute
from ggml_rknpu.server.activations import ActivationRounder, npu_rows
from ggml_rknpu.server.buffers import RpcBuffer
from ggml_rknpu.server.host_copies import HostCopy
from ggml_rknpu.server.ops.vocabulary import OpDataError, UnsupportedOp
from ggml_rknpu.server.recovery import NpuRecovery
from ggml_rknpu.server.stats import OpCounter, ServerStats
from ggml_rknpu.server.weight_store import WeightSlot, WeightStore

log = logging.getLogger(__name__)


class ReplayStep(Protocol):
    """One entry of a plan's replay: runs itself, counting into ``stats``."""

    def run(self, stats: ServerStats) -> None: ...


@dataclass(eq=False)
class IndexCheck:
    """Indices that are data (GET_ROWS rows, MUL_MAT_ID experts, ...), checked before every run."""

    values: np.ndarray       # typed view of the index tensor's bytes (signed integers)
    bound: int               # valid values are [0, bound)
    what: str
    span: tuple[RpcBuffer | None, int, int] = (None, 0, 0)   # (buffer, start, end) of those bytes
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

    def run(self, stats: ServerStats) -> None:
        """The segment's checks, then its graph on ggml-cpu."""
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
class StepFusion:
    """The engine fusion an NPU step owns (``engine.contract.plan_fusion``; one weight: a
    one-member fusion): planned from the handles the weight store holds now, planned again
    whenever one of them changed (a write over a weight's bytes unstages it, a reset may
    re-stage it) or the engine closed it."""

    engine: MatmulEngine
    weights: WeightStore
    slots: tuple[WeightSlot, ...]
    rows: int                                  # activation rows M (fixed by the graph)
    fusion: EngineFusion | None = None         # None: not planned yet, or dropped
    handles: tuple[EngineWeight, ...] = ()     # the weights it was planned from

    def current(self) -> EngineFusion | None:
        """The fusion of the weights resident now (None: one of them is not: the host runs the
        step); raises what planning it raises."""
        weights = self.weights
        handles = tuple(weights.weight(s) for s in self.slots) if len(self.slots) > 1 else (
            weights.weight(self.slots[0]),)
        fusion = self.fusion
        if fusion is not None and not fusion.closed and handles == self.handles:
            return fusion
        if any(h is None for h in handles):
            return None
        self.drop()
        self.fusion = fusion = plan_fusion(self.engine, handles, self.rows)   # type: ignore[arg-type]
        self.handles = handles                                                # type: ignore[assignment]
        return fusion

    def drop(self) -> None:
        """Release the fusion (a chained one's buffers); the next ``current`` plans a new one."""
        if self.fusion is not None:
            self.fusion.close()
        self.fusion, self.handles = None, ()


@dataclass(eq=False)
class NpuStep:
    """One MUL_MAT with a resident weight: ``out[.., M, N] = a[.., M, K] @ W[N, K]^T`` on the engine.

    ``fused`` is its one-weight fusion, run into ``out`` behind ``recovery`` (the retry, reset
    and host-fallback policy); ``host`` is the same node as a one-node ggml graph, run when the
    weight is demoted, the engine fails or the NPU faulted twice (None when ggml-cpu has no
    kernel for the combination, e.g. f32 weights with f16 activations: then an engine failure
    ends the connection)."""

    slot: WeightSlot
    a: np.ndarray            # the activations' typed view in its buffer
    a_type: int
    out: np.ndarray          # the destination's view
    host: HostSegment | None
    nbytes: int              # activations in + out (the weight is resident)
    npu_counter: OpCounter
    fused: StepFusion
    recovery: NpuRecovery
    a_id: int = 0            # the activation tensor's id (NpuSteps reading one id may be grouped)
    node: int = 0            # the MUL_MAT's tensor id
    rounder: ActivationRounder | None = None   # ggml-cpu's activation rounding for this weight type
    outs: tuple[np.ndarray, ...] = field(init=False)   # out as the fusion's [M, N] result (a view)

    def __post_init__(self) -> None:
        self.outs = (rows_view(self.out, self.fused.rows, self.slot.n),)

    def run(self, stats: ServerStats) -> None:
        # NpuRecovery.run inlined: one frame less on every NPU step (docs/decode-walk.md)
        t0 = time.perf_counter()
        try:
            fusion = self.fused.current()
            ran = fusion is not None
            if fusion is not None:
                fusion.run(npu_rows(self.a, self.a_type, self.slot.k, self.rounder), self.outs)
        except Exception as exc:
            ran = self.recovery.failed(self.slot, exc, self.attempt)
        else:
            if ran:
                self.recovery.succeeded(self.slot)
        if not ran:
            self.on_host(stats)
            return
        _count_npu(stats, (self,), self.fused.rows, time.perf_counter() - t0, self.fused.engine.last_timing)

    def attempt(self) -> bool:
        """One NPU run into ``out``, no policy; False when the weight is not resident."""
        fusion = self.fused.current()
        if fusion is None:
            return False
        fusion.run(npu_rows(self.a, self.a_type, self.slot.k, self.rounder), self.outs)
        return True

    def on_host(self, stats: ServerStats) -> None:
        """The step on ggml-cpu: the one fallback of every NPU matmul step."""
        if self.host is None:
            raise UnsupportedOp(f"MUL_MAT '{self.slot.name}' on the host",
                                "the NPU refused it and ggml-cpu has no kernel for these types")
        self.host.run(stats)


def rows_view(out: np.ndarray, rows: int, n: int) -> np.ndarray:
    """``out`` as [rows, n], a view (a MUL_MAT's dst is contiguous, a split's columns are 2-D)."""
    if out.ndim == 2 and out.shape == (rows, n):
        return out
    view = out.reshape(rows, n)
    if not np.shares_memory(view, out):
        raise ValueError(f"the destination {out.shape} has no [{rows}, {n}] view")
    return view


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

    def run(self, stats: ServerStats) -> None:
        t0 = time.perf_counter()
        part = self.npu
        future = _SPLIT_HOST.submit(self.host.run, stats)
        try:
            ran = part.recovery.run(part.slot, part.attempt)
        finally:
            future.result()
        if not ran:
            part.on_host(stats)
            return
        _count_npu(stats, (part,), part.fused.rows, time.perf_counter() - t0, part.fused.engine.last_timing)
        stats.split_matmuls += 1


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
    identical to the members run one by one), planned again whenever one of them changed
    (``StepFusion``). A member that is not resident, an engine that refuses the fusion, or
    a fault in it: the members run one by one (their own fallbacks) for that replay."""

    members: tuple[NpuStep, ...]
    rows: int                          # activation rows M (fixed by the graph)
    outs: tuple[np.ndarray, ...]       # each member's dst as float32 [M, N], views in its buffer
    fused: StepFusion = field(init=False)
    recovery: NpuRecovery = field(init=False)
    refused: bool = False              # the engine cannot plan this group: members one by one
    deferred: frozenset[int] = frozenset()   # members whose result a Delivery writes later
    ran: bool = False                  # this replay ran as one step (the Deliveries copy its results)

    def __post_init__(self) -> None:
        first = self.members[0]
        self.fused = StepFusion(first.fused.engine, first.fused.weights, tuple(m.slot for m in self.members),
                                self.rows)
        self.recovery = first.recovery

    def run(self, stats: ServerStats) -> None:
        self.ran = False
        if self.refused:
            self._one_by_one(stats)
            return
        t0 = time.perf_counter()
        try:
            fusion = self.fused.current()
        except Exception as exc:  # envelope limits, NPU memory for the chained buffers
            log.info("NPU matmuls %s stay one submit each: %s: %s", self.names(), type(exc).__name__, exc)
            self.refused = True
            fusion = None
        if fusion is None:
            self._one_by_one(stats)
            return
        first = self.members[0]
        try:
            fusion.run(npu_rows(first.a, first.a_type, first.slot.k, first.rounder), self.outs)
        except Exception as exc:  # a fault in the chained submit: reset, drop the fusion, one by one
            self.recovery.group_failed(self.names(), exc)
            self.fused.drop()
            self._one_by_one(stats)
            return
        _count_npu(stats, self.members, self.rows, time.perf_counter() - t0, self.fused.engine.last_timing)
        stats.npu_grouped_runs += 1
        self.ran = True

    def _one_by_one(self, stats: ServerStats) -> None:
        """The members that run here, each behind the fault policy (a deferred one runs at its Delivery)."""
        for member in self.members:
            if member.node not in self.deferred:
                member.run(stats)

    def names(self) -> str:
        return "+".join(f"'{m.slot.name}'" for m in self.members)

    def drop(self) -> None:
        """Release the fusion (its chained buffers); the next run plans a new one."""
        self.fused.drop()


@dataclass(eq=False)
class Delivery:
    """Where a grouped member that was moved up used to be: its result is written here
    (copied from the group's run, or the member runs here when the group did not)."""

    node: int                          # the member's tensor id
    member: NpuStep | None = None
    group: NpuGroup | None = None
    kept: np.ndarray | None = None     # the group's result for this member
    dst: np.ndarray | None = None      # the member's dst as [M, N]

    def run(self, stats: ServerStats) -> None:
        if self.group is not None and self.group.ran:
            assert self.dst is not None and self.kept is not None, "a grouped delivery has its arrays"
            np.copyto(self.dst, self.kept)
        else:
            assert self.member is not None, "planned with its member (grouping.group_npu_steps)"
            self.member.run(stats)


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

    def run(self, stats: ServerStats) -> None:
        if all(g.ran for g in self.groups):
            self.merged.run(stats)
            return
        for part in self.parts:
            part.run(stats)

