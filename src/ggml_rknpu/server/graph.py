"""GRAPH_COMPUTE payload -> a :class:`GraphPlan` built once, replayed per token
[docs/ggml-rpc.md §3.5, P8].

Invariants: planning checks every tensor and validates every computing node against its
rule (``ops.rules``) before any step exists; only nodes flagged ``GGML_TENSOR_FLAG_COMPUTE``
that are not views are checked and run, like ggml-cpu under the C++ server; a replay is a
loop over :class:`HostSegment`, :class:`NpuStep`, :class:`NpuGroup`, :class:`DeliveredRun`
and ``ExpertStep`` with no parsing and no decisions; index data is range-checked before the
segment that reads it; bytes a node writes can never be taken for a weight. What is checked
and why: docs/decisions.md "server/graph.py"."""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ggml_rknpu.engine.contract import EngineStep, MatmulEngine, stepping
from ggml_rknpu.server.activations import ActivationRounder, ActivationRounding
from ggml_rknpu.server.buffers import BufferTable
from ggml_rknpu.libggml.enums import GgmlOp, GgmlTensorFlag
from ggml_rknpu.server.expert_step import HOST_TENSORS, ExpertStep, HostExperts, expert_slots, npu_rows
from ggml_rknpu.server.ops.registry import VIEW_OPS, OpDataError, UnsupportedOp, op_name
from ggml_rknpu.server.ops.rules import check_node, signature
from ggml_rknpu.server.placement import HOST, NPU, OpCounter, ServerStats, experts_host_reason, matmul_host_reason
from ggml_rknpu.server.recovery import NpuRecovery, RecoveryStats
from ggml_rknpu.server.rpc.wire import GRAPH_HEAD, MAX_GRAPH_NODES, RPC_TENSOR_SIZE, U32, ProtocolError
from ggml_rknpu.server.tensor import CheckedTensor, RpcTensor, check_tensor, unbacked_reason
from ggml_rknpu.server.weights import WeightSlot, WeightStore
from ggml_rknpu.libggml.compute import HostCompute, HostContext, Threads
from ggml_rknpu.libggml.lib import Ggml

log = logging.getLogger(__name__)

PLANS_PER_DEVICE = 1024
# identical-graph cache: partial offload (-ot) sends ~90 splits per token [docs/ggml-rpc.md §5.1], and
# speculative decoding / parallel slots send each split at every batch size they alternate
# between (1..n_draft+1): 90 x 4 already overflowed 256 and re-planned every split every step.
# 1024 is also upstream's graph cache size in RPC protocol 8 (docs/architecture.md).


def computes(t: RpcTensor) -> bool:
    """Whether the backend runs this node: an op that is not a view, flagged COMPUTE by the client."""
    return t.op not in VIEW_OPS and bool(t.flags & GgmlTensorFlag.COMPUTE)


@dataclass(eq=False)
class IndexCheck:
    """Indices that are data (GET_ROWS rows, MUL_MAT_ID experts, ...), checked before every run."""

    values: np.ndarray       # typed view of the index tensor's bytes (signed integers)
    bound: int               # valid values are [0, bound)
    what: str
    span: tuple[Any, int, int] = (None, 0, 0)   # (buffer, start, end) of those bytes
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

    ``checks``: the index checks that must run just before it (indices a node of the plan
    writes; the others run once per replay, :func:`_hoist_checks`). ``counts``: per op
    counter, (nodes, bytes) this segment adds to it per run (a plan's own segments have
    theirs added once per replay, by the plan)."""

    compute: HostCompute
    checks: list[IndexCheck]
    counts: list[tuple[OpCounter, int, int]]

    def run(self, stats: ServerStats) -> None:
        for c in self.checks:
            c.check()
        t0 = time.perf_counter()
        self.compute.run()
        stats.host_seconds += time.perf_counter() - t0
        stats.host_segments += 1
        _add_counts(self.counts)


def _add_counts(counts: list[tuple[OpCounter, int, int]]) -> None:
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
        self.host.run(stats)


def _count_npu(stats: ServerStats, members: tuple[NpuStep, ...], rows: int, seconds: float,
               timing: Any = None) -> None:
    """Counters of NPU MUL_MATs that ran (one call for a group: its seconds are shared)."""
    for member in members:
        counter = member.npu_counter
        counter.ops += 1
        counter.bytes += member.nbytes
    members[0].npu_counter.seconds += seconds
    stats.count_npu_matmuls(rows, len(members), timing)


GROUP_MAX_ROWS = 16
# grouped steps are the decode path (M = 1..16: one token, speculative drafts, a few
# slots), where a submit per matmul is a large share of the token. Prefill matmuls stream
# their weight for many rows per submit and their programs may need several chains, which
# a chained step cannot hold: they stay one NpuStep each.


@dataclass(eq=False)
class NpuGroup:
    """Consecutive NpuSteps reading one activation (Q/K/V after the attention norm,
    gate/up after the FFN norm): one engine step, i.e. one submit, per replay.

    The engine step chains the members' own resident weights (no extra NPU memory, results
    identical to the members run one by one). It is built from the handles the weight store
    holds now and rebuilt whenever one of them changed (a write over a member's bytes
    unstages it, the next run stages a new copy) or the engine closed it. A member that is
    not resident, an engine that refuses the step, or a fault in it: the members run one
    by one (their own fallbacks) for that replay."""

    members: tuple[NpuStep, ...]
    rows: int                          # activation rows M (fixed by the graph)
    outs: tuple[np.ndarray, ...]       # each member's dst as float32 [M, N], views in its buffer
    step: Any = None                   # the engine step (None: not built or dropped)
    handles: tuple[Any, ...] = ()      # the weights the step was built from
    refused: bool = False              # the engine cannot plan this group: members one by one
    deferred: frozenset[int] = frozenset()   # members whose result a Delivery writes later
    ran: bool = False                  # this replay ran as one step (the Deliveries copy its results)

    def run(self, stats: ServerStats, recovery: NpuRecovery) -> None:
        self.ran = False
        npu, weights = recovery.npu, recovery.weights
        handles = tuple(weights.weight(m.slot) for m in self.members)
        if npu is None or self.refused or any(h is None for h in handles):
            self._one_by_one(stats, recovery)
            return
        t0 = time.perf_counter()
        step = self._current_step(npu, handles)
        if step is None:
            self._one_by_one(stats, recovery)
            return
        first = self.members[0]
        try:
            run_step(step, npu_rows(first.a, first.a_type, first.slot.k, first.rounder), self.outs)
        except Exception as exc:  # a fault in the chained submit: reset, drop the step, one by one
            recovery.step_failed(self.names(), exc)
            self.drop()
            self._one_by_one(stats, recovery)
            return
        _count_npu(stats, self.members, self.rows, time.perf_counter() - t0, npu.last_timing)
        stats.npu_grouped_runs += 1
        self.ran = True

    def _current_step(self, npu: MatmulEngine, handles: tuple[Any, ...]) -> Any:
        """The engine step for ``handles``, (re)built when they or the step went stale."""
        stale = self.step is None or self.step.closed or len(handles) != len(self.handles) or any(
            h is not old for h, old in zip(handles, self.handles))
        if stale:
            self.drop()
            engine = stepping(npu)
            try:
                if engine is None:
                    raise ValueError(f"{npu.describe()} plans no grouped steps")
                self.step = engine.step(list(handles), self.rows)
            except Exception as exc:  # envelope limits, NPU memory for the chained buffers
                log.info("NPU matmuls %s stay one submit each: %s: %s", self.names(), type(exc).__name__, exc)
                self.refused = True
                return None
            self.handles = handles
        return self.step

    def _one_by_one(self, stats: ServerStats, recovery: NpuRecovery) -> None:
        """The members that run here, each behind the fault policy (a deferred one runs at its Delivery)."""
        for member in self.members:
            if member.node not in self.deferred:
                member.run(stats, recovery)

    def names(self) -> str:
        return "+".join(f"'{m.slot.name}'" for m in self.members)

    def drop(self) -> None:
        """Release the engine step (its chained buffers); the next run builds a new one."""
        if self.step is not None:
            self.step.close()
        self.step, self.handles = None, ()


def run_step(step: EngineStep, a: np.ndarray, outs: tuple[np.ndarray, ...]) -> None:
    """The grouped step's one NPU call (kept alone so that fault recovery can wrap it)."""
    step.run(a, outs=outs)


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
            np.copyto(self.dst, self.kept)
        else:
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
            if type(part) is HostSegment:
                part.run(stats)
            else:
                part.run(stats, recovery)


def _delivery_runs(runs: list[list[int]], npu: set[int]) -> list[int]:
    """Graph sizes of the DeliveredRuns a plan may make (``_merge_deliveries``): per stretch of
    host runs and delivery markers between NPU steps that holds a marker, its node count."""
    sizes, size, markers = [], 0, 0
    for run in [*runs, None]:
        if run is None or run[0] in npu:
            if markers:
                sizes.append(size)
            size, markers = 0, 0
            continue
        size += len(run)
        markers += run[0] < 0
    return sizes


def _merge_deliveries(steps: list[Any], host: HostContext, ptrs: dict[int, Any]) -> list[Any]:
    """Each stretch of HostSegments and Deliveries of grouped members (``DeliveredRun``),
    when its segments have no index check left (those run between parts)."""
    out: list[Any] = []
    stretch: list[Any] = []

    def flush() -> None:
        deliveries = [p for p in stretch if type(p) is Delivery]
        if deliveries and all(d.group is not None for d in deliveries) and \
                all(not p.checks for p in stretch if type(p) is HostSegment):
            nodes = []
            for part in stretch:
                if type(part) is HostSegment:
                    nodes += part.compute.nodes
                else:
                    nodes.append(host.copy_node(ptrs[part.node], part.kept, f"delivered {part.member.slot.name}"))
            merged = HostSegment(host.segment(nodes), [], [])
            groups = tuple({id(d.group): d.group for d in deliveries}.values())
            out.append(DeliveredRun(merged, list(stretch), groups))
        else:
            out.extend(stretch)
        stretch.clear()

    for step in steps:
        if type(step) in (HostSegment, Delivery):
            stretch.append(step)
        else:
            flush()
            out.append(step)
    flush()
    return out


def group_npu_steps(steps: list[HostSegment | NpuStep | Delivery]) -> list[HostSegment | NpuStep | NpuGroup | Delivery]:
    """Runs of consecutive NpuSteps that read the same activation tensor become NpuGroups.

    Same src1 tensor means same view, type and K; one weight store means one weight
    format; the same rounder, one activation rounding (``server/activations.py``). Members must
    write float32 destinations that are plain [M, N] views. A member with a Delivery (moved
    up by ``_gather_siblings``) writes its result there; if it ends up in no group it runs
    there, not where it was moved."""
    deliveries = {d.node: d for d in steps if type(d) is Delivery}
    out: list[HostSegment | NpuStep | NpuGroup | Delivery] = []
    i = 0
    while i < len(steps):
        step = steps[i]
        j = i + 1
        if type(step) is NpuStep:
            while j < len(steps) and type(nxt := steps[j]) is NpuStep and nxt.a_id == step.a_id \
                    and nxt.rounder is step.rounder:
                j += 1
        run = steps[i:j]
        group = _group(run, deliveries) if len(run) > 1 else None
        if group is not None:
            out.append(group)
        else:
            for member in run:
                if type(member) is NpuStep and member.node in deliveries:
                    deliveries[member.node].member = member      # runs at its own place
                else:
                    out.append(member)
        i = j
    return out


def _group(run: list[Any], deliveries: dict[int, Delivery]) -> NpuGroup | None:
    first = run[0]
    rows = first.a.size // first.slot.k
    if not 1 <= rows <= GROUP_MAX_ROWS:
        return None
    outs = []
    for member in run:
        if member.out.dtype != np.float32 or not member.out.flags.c_contiguous \
                or member.out.size != rows * member.slot.n:
            return None
        outs.append(member.out.reshape(rows, member.slot.n))   # a view: contiguous
    group = NpuGroup(tuple(run), rows, tuple(outs))
    kept = list(outs)
    for index, member in enumerate(run):
        d = deliveries.get(member.node)
        if d is not None:
            d.member, d.group, d.dst = member, group, outs[index]
            d.kept = kept[index] = np.empty_like(outs[index])
    group.outs = tuple(kept)
    group.deferred = frozenset(d.node for d in deliveries.values() if d.group is group)
    return group


@dataclass(eq=False)
class GraphPlan:
    """A received graph, ready to replay: host segments and NPU steps in the client's order.

    Owns the ggml context its segments point into (``host``); ``close`` frees it, and the
    plan is closed whenever the graphs of its connection are dropped (FREE_BUFFER, disconnect)."""

    dev: int
    digest: bytes
    steps: list[HostSegment | NpuStep | NpuGroup | Delivery]
    host: HostContext
    recovery: NpuRecovery     # the engine and the weights, behind the fault policy
    n_nodes: int
    n_views: int
    checks: list[IndexCheck] = field(default_factory=list)   # indices no node of the plan writes
    counts: list[tuple[OpCounter, int, int]] = field(default_factory=list)   # its segments', per replay
    runs: int = 0

    def execute(self, stats: ServerStats) -> None:
        start = time.perf_counter()
        recovery = self.recovery
        for check in self.checks:
            check.check()
        for step in self.steps:
            if type(step) is HostSegment:
                step.run(stats)
            else:
                step.run(stats, recovery)
        _add_counts(self.counts)
        self.runs += 1
        stats.execute_seconds += time.perf_counter() - start
        stats.graph_runs += 1
        stats.view_nodes += self.n_views

    def close(self) -> None:
        for step in self.steps:
            if type(step) is NpuGroup:
                step.drop()
        self.steps = []
        self.host.close()

@dataclass
class ParsedGraph:
    dev: int
    node_ids: list[int]
    tensors: dict[int, RpcTensor]


def parse_graph(payload: bytes | memoryview) -> ParsedGraph:
    """dev u32 | n_nodes u32 | u64 ids[n_nodes] | n_tensors u32 | rpc_tensor[n_tensors], exact size."""
    size = len(payload)
    dev, n_nodes = GRAPH_HEAD.unpack_from(payload, 0)
    if n_nodes > MAX_GRAPH_NODES:
        raise ProtocolError(f"GRAPH_COMPUTE: absurd node count {n_nodes} (limit {MAX_GRAPH_NODES})")
    pos = GRAPH_HEAD.size + 8 * n_nodes
    if pos + 4 > size:
        raise ProtocolError(f"GRAPH_COMPUTE: {n_nodes} node ids do not fit a {size}-byte payload")
    node_ids = list(np.frombuffer(payload, dtype="<u8", count=n_nodes, offset=GRAPH_HEAD.size).tolist())
    (n_tensors,) = U32.unpack_from(payload, pos)
    pos += 4
    if size != pos + n_tensors * RPC_TENSOR_SIZE:
        raise ProtocolError(
            f"GRAPH_COMPUTE: payload is {size} bytes, {n_nodes} nodes and {n_tensors} tensors need "
            f"{pos + n_tensors * RPC_TENSOR_SIZE}"
        )
    tensors: dict[int, RpcTensor] = {}
    for i in range(n_tensors):
        t = RpcTensor.unpack_from(payload, pos + i * RPC_TENSOR_SIZE)
        if t.id == 0:
            raise ProtocolError(f"GRAPH_COMPUTE: tensor #{i} '{t.name}' has id 0")
        if t.id in tensors:
            raise ProtocolError(f"GRAPH_COMPUTE: tensor id {t.id:#x} appears twice")
        tensors[t.id] = t
    return ParsedGraph(dev, node_ids, tensors)


def _check_structure(g: ParsedGraph) -> dict[int, int]:
    """Node positions; ProtocolError for unknown ids, duplicate nodes, cycles, bad views."""
    position: dict[int, int] = {}
    for p, nid in enumerate(g.node_ids):
        if nid not in g.tensors:
            raise ProtocolError(f"GRAPH_COMPUTE: node #{p} id {nid:#x} is not in the tensor list")
        if nid in position:
            raise ProtocolError(f"GRAPH_COMPUTE: node id {nid:#x} listed twice")
        position[nid] = p
    for t in g.tensors.values():
        for s in t.src:
            if s and s not in g.tensors:
                raise ProtocolError(f"GRAPH_COMPUTE: tensor '{t.name}' has unknown src id {s:#x}")
        if t.view_src and t.view_src not in g.tensors:
            raise ProtocolError(f"GRAPH_COMPUTE: tensor '{t.name}' has unknown view_src id {t.view_src:#x}")
    for nid, p in position.items():
        t = g.tensors[nid]
        for s in (*t.src, t.view_src):
            if s and position.get(s, -1) >= p:
                raise ProtocolError(
                    f"GRAPH_COMPUTE: node #{p} '{t.name}' reads '{g.tensors[s].name}', which is computed "
                    f"at or after it (cycle or wrong order)"
                )
    # view chains: acyclic (memoised walk), same buffer, address = parent + view_offs
    settled: set[int] = set()
    for tid in g.tensors:
        path: list[int] = []
        on_path: set[int] = set()
        cur = tid
        while cur and cur not in settled:
            if cur in on_path:
                raise ProtocolError(f"GRAPH_COMPUTE: view_src cycle through '{g.tensors[cur].name}'")
            path.append(cur)
            on_path.add(cur)
            cur = g.tensors[cur].view_src
        settled.update(path)
    for t in g.tensors.values():
        if t.view_src and (t.buffer or g.tensors[t.view_src].buffer):   # views on other backends: not ours
            parent = g.tensors[t.view_src]
            if parent.buffer != t.buffer or parent.data + t.view_offs != t.data:
                raise ProtocolError(
                    f"GRAPH_COMPUTE: view '{t.name}' at {t.data:#x} in buffer {t.buffer:#x} is not "
                    f"'{parent.name}' ({parent.data:#x} in {parent.buffer:#x}) + {t.view_offs}"
                )
    return position


def _check_backed(g: ParsedGraph, checked: dict[int, CheckedTensor]) -> None:
    """Every tensor a computing node reads or writes must have its bytes on this server."""
    for nid in g.node_ids:
        t = g.tensors[nid]
        if not computes(t):
            continue
        for tid in (nid, *t.src):
            if tid and not checked[tid].usable:
                u = g.tensors[tid]
                raise ProtocolError(f"GRAPH_COMPUTE: node '{t.name}' ({op_name(t.op)}) uses '{u.name}', "
                                    f"which has {unbacked_reason(u)}")


def _touches(t: RpcTensor, checked: dict[int, CheckedTensor]) -> tuple[list[CheckedTensor], list[CheckedTensor]]:
    """(bytes a node writes, bytes it reads), as checked ranges."""
    reads = [checked[s] for s in t.src if s and checked[s].buffer is not None]
    dst = checked[t.id]
    return ([dst] if dst.buffer is not None else []), reads


def _overlap(a: list[CheckedTensor], b: list[CheckedTensor]) -> bool:
    return any(x.buffer is y.buffer and x.start < y.end and y.start < x.end for x in a for y in b)


def _movable(moved: RpcTensor, over: list[RpcTensor], checked: dict[int, CheckedTensor]) -> tuple[bool, bool]:
    """(``moved`` may run before the nodes ``over``, its result must then still be written
    at its own place). It may when none of them writes bytes it reads. If one of them
    reads or writes its destination's bytes (the client's allocator reuses memory by the
    original order: V's dst is often Q's, freed once ROPE(Q) read it), the result is
    kept aside and delivered where the node was."""
    mw, mr = _touches(moved, checked)
    deliver = False
    for node in over:
        ow, orr = _touches(node, checked)
        if _overlap(ow, mr):
            return False, False
        deliver = deliver or _overlap(mw, ow + orr)
    return True, deliver


def _gather_siblings(computing: list[int], g: ParsedGraph, slots: dict[int, WeightSlot | None],
                     checked: dict[int, CheckedTensor]) -> list[int]:
    """Node order with each NPU MUL_MAT moved up next to the previous NPU MUL_MAT reading the
    same activation (llama.cpp's attention builds Q, ROPE(Q), then K and V: this makes
    Q/K/V consecutive, one group). A moved node whose destination the passed nodes use
    leaves a marker, ``-id``, at its own place: its result is written there.

    An NPU MUL_MAT reads only a leaf weight and its activation, computed before the
    earlier sibling, so the move is safe once no passed node writes bytes it reads."""
    order: list[int] = []
    after_last: dict[int, int] = {}          # activation id -> index just after its last NPU reader
    for nid in computing:
        t = g.tensors[nid]
        if slots.get(nid) is None:
            order.append(nid)
            continue
        act = t.src[1]
        at = after_last.get(act)
        ok, deliver = (False, False) if at is None else _movable(
            t, [g.tensors[abs(o)] for o in order[at:]], checked)
        if not ok or at is None or at == len(order):
            order.append(nid)
            after_last[act] = len(order)
            continue
        order.insert(at, nid)
        for key, index in after_last.items():
            if index >= at:
                after_last[key] = index + 1
        after_last[act] = at + 1
        if deliver:
            order.append(-nid)
    return order


class GraphPlanner:
    """Turns GRAPH_COMPUTE payloads into plans for one connection."""

    def __init__(self, buffers: BufferTable, weights: WeightStore, npu: MatmulEngine | None, stats: ServerStats,
                 host: Ggml, threads: Threads, recovery: NpuRecovery | None = None, group: bool = True,
                 activations: ActivationRounding | None = None) -> None:
        self.buffers = buffers
        self.group = group and stepping(npu) is not None    # NPU matmuls of one activation as one submit
        self.weights = weights
        self.npu = npu
        self.stats = stats
        self.ggml = host
        self.threads = threads
        self.recovery = recovery or NpuRecovery(npu, weights, RecoveryStats())
        self.activations = activations or ActivationRounding(host)

    def build(self, payload: bytes | memoryview, digest: bytes) -> GraphPlan:
        t0 = time.perf_counter()
        g = parse_graph(payload)
        position = _check_structure(g)
        checked: dict[int, CheckedTensor] = {
            tid: check_tensor(t, self.buffers, "GRAPH_COMPUTE tensor", allow_unbacked=True)
            for tid, t in g.tensors.items()
        }
        _check_backed(g, checked)
        computing = [nid for nid in g.node_ids                # unflagged: a branch the client did not select
                     if computes(g.tensors[nid]) and checked[nid].end > checked[nid].start]
        indices = {nid: check_node(g.tensors[nid], tuple(g.tensors[s] if s else None for s in g.tensors[nid].src))
                   for nid in computing}                  # UnsupportedOp before anything is touched
        for nid in computing:                            # bytes written by nodes are never weights
            c = checked[nid]
            c.buffer.graph_written.add(c.start, c.end)
            self.weights.mark_graph_written(c.buffer, c.start, c.end)
        slots = {nid: self._weight_slot(g.tensors[nid], g, position, checked)
                 for nid in computing if g.tensors[nid].op == GgmlOp.MUL_MAT}
        experts = {nid: e for nid in computing if g.tensors[nid].op == GgmlOp.MUL_MAT_ID
                   and (e := self._expert_slots(g.tensors[nid], g, position, checked)) is not None}
        order = _gather_siblings(computing, g, slots, checked) if self.group else computing

        # segments: maximal runs of host nodes; a node whose index bytes a node of the current
        # run writes starts a new one (its indices are checked before that run computes): the
        # node that computes them, or any node whose dst overlaps them
        runs: list[list[int]] = []
        current: list[int] = []
        written: list[CheckedTensor] = []
        for nid in order:
            if nid < 0 or slots.get(nid) is not None or nid in experts:   # an NPU step or a delivery marker
                runs += [current, [nid]] if current else [[nid]]
                current, written = [], []
                continue
            if _overlap([checked[g.tensors[nid].src[src]] for src, _ in indices[nid]], written):
                runs.append(current)
                current, written = [], []
            current.append(nid)
            if checked[nid].buffer is not None:
                written.append(checked[nid])
        if current:
            runs.append(current)

        npu_steps = {nid for nid in order if slots.get(nid) is not None or nid in experts}
        merges = _delivery_runs(runs, npu_steps) if self.group else []
        n_markers = sum(1 for nid in order if nid < 0)
        host = HostContext(self.ggml, self.threads, len(g.tensors) + 2 * n_markers + HOST_TENSORS * len(experts),
                           tuple(len(r) for r in runs) + tuple(merges) + (1,) * len(experts))
        try:
            ptrs = self._ggml_tensors(g, checked, host)
            cpu_ok = {nid: self.ggml.supports_op(ptrs[nid]) for nid in computing}
            for nid in computing:
                if not cpu_ok[nid] and slots.get(nid) is None:
                    t = g.tensors[nid]
                    raise UnsupportedOp(signature(t, tuple(g.tensors[s] if s else None for s in t.src)),
                                        "ggml-cpu does not support this combination")
            steps = [self._expert_step(g.tensors[run[0]], experts[run[0]], checked, ptrs, host, indices)
                     if run[0] in experts else self._step(run, g, checked, ptrs, host, indices, slots, cpu_ok)
                     for run in runs]
            checks = _hoist_checks(steps, runs, checked)
            planned = group_npu_steps(steps) if self.group else steps
            counts = _take_counts(planned)
            if self.group:
                planned = _merge_deliveries(planned, host, ptrs)
            host.finish()
        except BaseException:
            host.close()
            raise
        staged = [*slots.values(), *(s for e in experts.values() for s in e)]
        self.weights.stage_all(s for s in staged if s is not None)   # timed in the weight stats
        self.stats.plans_built += 1
        self.stats.plan_seconds += time.perf_counter() - t0
        views = sum(1 for nid in g.node_ids if g.tensors[nid].op in VIEW_OPS)
        self.stats.npu_groups_planned += sum(1 for s in planned if type(s) is NpuGroup)
        return GraphPlan(g.dev, digest, planned, host, self.recovery, len(g.node_ids), views,
                         checks=checks, counts=counts)

    @staticmethod
    def _ggml_tensors(g: ParsedGraph, checked: dict[int, CheckedTensor], host: HostContext) -> dict[int, Any]:
        """One ggml tensor per graph tensor, data in the server's buffers, then sources and views."""
        ptrs = {}
        for tid, t in g.tensors.items():
            c = checked[tid]
            data = (c.buffer.array, c.start) if c.buffer is not None and c.end > c.start else None
            ptrs[tid] = host.tensor(t.type, t.ne, t.nb, t.op, t.op_params, t.flags, t.name, data)
        for tid, t in g.tensors.items():
            host.link(ptrs[tid], [ptrs[s] if s else None for s in t.src],
                      ptrs[t.view_src] if t.view_src else None, t.view_offs)
        return ptrs

    def _span(self, t: RpcTensor, checked: dict[int, CheckedTensor]) -> int:
        return sum(checked[s].end - checked[s].start for s in (t.id, *t.src) if s)

    def _step(self, run: list[int], g: ParsedGraph, checked: dict[int, CheckedTensor], ptrs: dict[int, Any],
              host: HostContext, indices: dict[int, list[tuple[int, int]]],
              slots: dict[int, WeightSlot | None], cpu_ok: dict[int, bool]) -> HostSegment | NpuStep | Delivery:
        if run[0] < 0:
            return Delivery(-run[0])
        slot = slots.get(run[0])
        if slot is None:
            return self._segment(run, g, checked, ptrs, host, indices)
        t = g.tensors[run[0]]
        segment = self._segment(run, g, checked, ptrs, host, indices) if cpu_ok[t.id] else None
        a, a_type = checked[t.src[1]].ref().as_array(), g.tensors[t.src[1]].type
        return NpuStep(slot=slot, a=a, a_type=a_type,
                       out=checked[t.id].ref().as_array(), host=segment,
                       nbytes=self._span(t, checked) - slot.nbytes,
                       npu_counter=self.stats.counter("MUL_MAT", NPU), a_id=t.src[1], node=t.id,
                       rounder=self.activations.for_step(slot.type, a_type, a.size))

    def _expert_step(self, t: RpcTensor, slots: tuple[WeightSlot | None, ...], checked: dict[int, CheckedTensor],
                     ptrs: dict[int, Any], host: HostContext, indices: dict[int, list[tuple[int, int]]]) -> ExpertStep:
        """A MUL_MAT_ID with resident experts (``server/expert_step.py``); its ids checked as the rule says."""
        (src, bound), = indices[t.id]
        ids = checked[t.src[src]]
        check = IndexCheck(ids.ref().as_array(), bound, f"MUL_MAT_ID '{t.name}' src{src} '{ids.rpc.name}'")
        w = checked[t.src[0]].rpc
        on_host = HostExperts.plan(host, ptrs[w.id], w.ne[0], w.ne[1], t.ne[1] * t.ne[2], t.name)
        rounder = self.activations.for_step(w.type, checked[t.src[1]].rpc.type, w.ne[0] * t.ne[1] * t.ne[2])
        return ExpertStep.plan(t.name, slots, check, checked[t.src[1]], checked[t.id], on_host, self.stats, rounder)

    def _segment(self, run: list[int], g: ParsedGraph, checked: dict[int, CheckedTensor], ptrs: dict[int, Any],
                 host: HostContext, indices: dict[int, list[tuple[int, int]]]) -> HostSegment:
        checks = []
        per_counter: dict[int, list] = {}
        for nid in run:
            t = g.tensors[nid]
            for src, bound in indices[nid]:
                s = g.tensors[t.src[src]]
                c = checked[s.id]
                checks.append(IndexCheck(c.ref().as_array(), bound, f"{op_name(t.op)} '{t.name}' src{src} '{s.name}'",
                                         (c.buffer, c.start, c.end)))
            counter = self.stats.counter(op_name(t.op), HOST)
            entry = per_counter.setdefault(id(counter), [counter, 0, 0])
            entry[1] += 1
            entry[2] += self._span(t, checked)
        return HostSegment(host.segment([ptrs[nid] for nid in run]), checks,
                           [(c, n, b) for c, n, b in per_counter.values()])

    def _weight_slot(self, t: RpcTensor, g: ParsedGraph, position: dict[int, int],
                     checked: dict[int, CheckedTensor]) -> WeightSlot | None:
        """The staged-weight slot for this MUL_MAT's src0, or None when it runs on the host."""
        s0, s1 = t.src[0], t.src[1]
        c0 = checked[s0]
        reason = matmul_host_reason(
            t, g.tensors[s0], g.tensors[s1], engine=self.npu is not None, w_computed=s0 in position,
            w_backed=c0.buffer is not None,
            w_graph_written=c0.buffer is not None and c0.buffer.graph_written.overlaps(c0.start, c0.end))
        slot = self.weights.slot_for(c0) if reason is None else None
        if reason is None and slot is None:
            reason = "weight type or engine refused it"
        if reason is not None:
            self.stats.host_matmul_reasons[reason] = self.stats.host_matmul_reasons.get(reason, 0) + 1
        return slot

    def _expert_slots(self, t: RpcTensor, g: ParsedGraph, position: dict[int, int],
                      checked: dict[int, CheckedTensor]) -> tuple[WeightSlot | None, ...] | None:
        """The staged-weight slots of this MUL_MAT_ID's experts, or None when it runs on the host."""
        s0 = t.src[0]
        c0 = checked[s0]
        reason = experts_host_reason(
            t, g.tensors[s0], g.tensors[t.src[1]], engine=self.npu is not None, w_computed=s0 in position,
            w_backed=c0.buffer is not None,
            w_graph_written=c0.buffer is not None and c0.buffer.graph_written.overlaps(c0.start, c0.end))
        slots = expert_slots(c0, self.weights) if reason is None else None
        if slots is not None and all(s is None for s in slots):
            slots, reason = None, "weight type or engine refused it"
        if reason is not None:
            key = f"MUL_MAT_ID: {reason}"
            self.stats.host_matmul_reasons[key] = self.stats.host_matmul_reasons.get(key, 0) + 1
        return slots


def _hoist_checks(steps: list[Any], runs: list[list[int]], checked: dict[int, CheckedTensor]) -> list[IndexCheck]:
    """The index checks that may run once, at the start of every replay, taken out of the segments.

    ``steps[i]`` runs the nodes ``runs[i]`` (a negative id: a delivery, which writes that
    node's dst). A check may move to the start when no step before its segment writes bytes
    of its indices: inputs the client uploaded before the compute, such as the KV-cache
    slots every layer's SET_ROWS reads, until the allocator reuses their memory. Nothing
    changes them before the reader then, so checking them first checks what it will read.
    Identical views are checked once, against the smallest bound. Indices a node computes
    (ARGSORT -> GET_ROWS, MoE routing) stay in the segment before their reader."""
    written = [(i, checked[abs(nid)]) for i, run in enumerate(runs) for nid in run]
    written = [(i, c) for i, c in written if c.buffer is not None]
    position = np.array([i for i, _ in written], dtype=np.int64)
    buffer_ids = np.array([id(c.buffer) for _, c in written], dtype=np.int64)
    starts = np.array([c.start for _, c in written], dtype=np.int64)
    ends = np.array([c.end for _, c in written], dtype=np.int64)
    hoisted: dict[tuple, IndexCheck] = {}
    for i, step in enumerate(steps):
        if type(step) is not HostSegment:
            continue
        kept = []
        for c in step.checks:
            buffer, start, end = c.span
            earlier = (position < i) & (buffer_ids == id(buffer)) & (starts < end) & (start < ends)
            if buffer is None or bool(earlier.any()):
                kept.append(c)
                continue
            key = (id(buffer), start, end, c.values.dtype.str, c.values.shape, c.values.strides)
            if key not in hoisted or c.bound < hoisted[key].bound:
                hoisted[key] = c
        step.checks = kept
    return list(hoisted.values())


def _take_counts(steps: list[Any]) -> list[tuple[OpCounter, int, int]]:
    """The plan's segments' counters, merged, to be added once per replay (the segments' cleared)."""
    merged: dict[int, list] = {}
    for step in steps:
        if type(step) is not HostSegment:
            continue
        for counter, n, nbytes in step.counts:
            entry = merged.setdefault(id(counter), [counter, 0, 0])
            entry[1] += n
            entry[2] += nbytes
        step.counts = []
    return [(c, n, b) for c, n, b in merged.values()]


@dataclass
class DeviceGraphs:
    """Per device: the last graph (GRAPH_RECOMPUTE) and recent plans by payload digest."""

    last: GraphPlan | None = None
    by_digest: OrderedDict[bytes, GraphPlan] = field(default_factory=OrderedDict)

    def lookup(self, digest: bytes) -> GraphPlan | None:
        plan = self.by_digest.get(digest)
        if plan is not None:
            self.by_digest.move_to_end(digest)
        return plan

    def remember(self, plan: GraphPlan) -> None:
        old = self.by_digest.get(plan.digest)
        if old is not None and old is not plan:
            old.close()
        self.by_digest[plan.digest] = plan
        self.by_digest.move_to_end(plan.digest)
        while len(self.by_digest) > PLANS_PER_DEVICE:
            _, evicted = self.by_digest.popitem(last=False)
            if evicted is not self.last:
                evicted.close()
        if self.last is not None and self.last is not plan and self.last.digest not in self.by_digest:
            self.last.close()
        self.last = plan

    def clear(self) -> None:
        """Free every plan (their ggml contexts point into buffers that may go away now)."""
        plans = {id(p): p for p in self.by_digest.values()}
        if self.last is not None:
            plans[id(self.last)] = self.last
        for plan in plans.values():
            plan.close()
        self.last = None
        self.by_digest.clear()


def graph_digest(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()
