"""GRAPH_COMPUTE payload → a plan of prepared steps, built once, replayed per token.

llama.cpp resends the same graph (or a 13-byte GRAPH_RECOMPUTE) every decode step
[ggml-rpc.md §3.5, P8]. Planning parses and checks every tensor, resolves views,
decides where each node runs and asks the op modules for a closure
(``ops.plan_op``) or builds an NPU matmul step around a staged weight. Replaying a
plan is a loop over closures: no parsing, no dictionary lookups, no decisions.
Identical payloads (same bytes → same blake2b digest) reuse their plan too, which
covers clients whose graph uid changes while the graph does not.

Checks made before any step exists: exact payload size, node count, unique
tensor ids, every src / view_src id known, nodes only read nodes that come earlier
(which also rules out cycles), view chains acyclic and consistent with their
parent's address, every tensor's bytes inside its buffer. Bytes written by a node
are recorded per buffer so they can never be mistaken for a weight.

Which nodes run: like ggml-cpu under the C++ ``ggml-rpc-server`` (``ggml_graph_compute_thread``),
only nodes whose ``flags`` carry ``GGML_TENSOR_FLAG_COMPUTE`` and whose op is not a view. The
client's ``ggml_build_forward_select`` puts every alternative branch into the graph and flags only
the chosen one; the others' inputs are never uploaded (their bytes are whatever the buffer held),
so running them reads garbage (llama.cpp b11434's mixed-batch embedding SET_ROWS, issue 16).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ggml_rknpu.ggml.buffers import BufferTable
from ggml_rknpu.ggml.enums import GgmlOp, GgmlTensorFlag, GgmlType
from ggml_rknpu.ggml.ops.convert import bf16_to_f32
from ggml_rknpu.ggml.ops.registry import VIEW_OPS, OpNode, op_name
from ggml_rknpu.ggml.ops.registry import plan_op as host_plan_op
from ggml_rknpu.ggml.placement import HOST, NPU, OpCounter, ServerStats, matmul_host_reason
from ggml_rknpu.ggml.rpc.wire import GRAPH_HEAD, MAX_GRAPH_NODES, RPC_TENSOR_SIZE, U32, ProtocolError
from ggml_rknpu.ggml.tensor import CheckedTensor, RpcTensor, check_tensor, unbacked_reason
from ggml_rknpu.ggml.weights import WeightSlot, WeightStore

PLANS_PER_DEVICE = 256             # identical-graph cache: partial offload (-ot) sends ~90 splits per token [ggml-rpc.md §5.1]


def _as_f32_rows(view: np.ndarray, type_id: int, k: int) -> np.ndarray:
    """src1 of a MUL_MAT as float32 [M, K] (bf16 arrives as its raw uint16 view)."""
    if type_id == GgmlType.BF16:
        return bf16_to_f32(view).reshape(-1, k)
    return np.ascontiguousarray(view, dtype=np.float32).reshape(-1, k)


def computes(t: RpcTensor) -> bool:
    """Whether the backend runs this node: an op that is not a view, flagged COMPUTE by the client."""
    return t.op not in VIEW_OPS and bool(t.flags & GgmlTensorFlag.COMPUTE)


def _unset() -> None:
    raise AssertionError("step closure not bound")


@dataclass
class Step:
    """One prepared node: the closure, and the counter its executions land in."""

    run: Callable[[], None]
    counter: OpCounter
    nbytes: int


@dataclass
class Plan:
    dev: int
    digest: bytes
    steps: list[Step]
    n_nodes: int
    n_views: int
    runs: int = 0

    def execute(self, stats: ServerStats) -> None:
        clock = time.perf_counter
        start = clock()
        for step in self.steps:
            t0 = clock()
            step.run()
            c = step.counter
            c.seconds += clock() - t0
            c.ops += 1
            c.bytes += step.nbytes
        self.runs += 1
        stats.execute_seconds += clock() - start
        stats.graph_runs += 1
        stats.view_nodes += self.n_views


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


class GraphPlanner:
    """Turns GRAPH_COMPUTE payloads into plans for one connection."""

    def __init__(self, buffers: BufferTable, weights: WeightStore, npu: Any, stats: ServerStats,
                 plan_op: Callable[[Any], Callable[[], None]] | None = None) -> None:
        self.buffers = buffers
        self.weights = weights
        self.npu = npu
        self.stats = stats
        self.plan_op = plan_op or host_plan_op

    def build(self, payload: bytes | memoryview, digest: bytes) -> Plan:
        t0 = time.perf_counter()
        g = parse_graph(payload)
        position = _check_structure(g)
        checked: dict[int, CheckedTensor] = {
            tid: check_tensor(t, self.buffers, "GRAPH_COMPUTE tensor", allow_unbacked=True)
            for tid, t in g.tensors.items()
        }
        _check_backed(g, checked)
        for nid in g.node_ids:                       # bytes written by nodes are never weights
            t = g.tensors[nid]
            c = checked[nid]
            if computes(t) and c.buffer is not None and c.end > c.start:
                c.buffer.graph_written.add(c.start, c.end)
                self.weights.mark_graph_written(c.buffer, c.start, c.end)

        refs: dict[int, Any] = {}

        def ref(tid: int) -> Any:
            r = refs.get(tid)
            if r is None:
                r = refs[tid] = checked[tid].ref()
            return r

        steps: list[Step] = []
        staged: list[WeightSlot] = []
        n_views = 0
        for nid in g.node_ids:
            t = g.tensors[nid]
            if t.op in VIEW_OPS:
                n_views += 1
                continue
            if not computes(t):                              # a branch the client did not select
                continue
            span = sum(checked[s].end - checked[s].start for s in t.src if s) + checked[nid].end - checked[nid].start
            slot = self._weight_slot(t, g, position, checked) if t.op == GgmlOp.MUL_MAT else None
            if slot is not None:                             # the weight is resident: only activations move
                staged.append(slot)
                step = Step(_unset, self.stats.counter("MUL_MAT", NPU), span - slot.nbytes)
                step.run = self._npu_matmul(t, slot, ref, lambda t=t: self._host_node(t, ref), step)
                steps.append(step)
            else:
                steps.append(Step(self._host_node(t, ref), self.stats.counter(op_name(t.op), HOST), span))
        t_stage = time.perf_counter()
        self.weights.stage_all(staged)                       # timed in the weight stats, not here
        self.stats.plans_built += 1
        self.stats.plan_seconds += t_stage - t0
        return Plan(g.dev, digest, steps, len(g.node_ids), n_views)

    def _host_node(self, t: RpcTensor, ref: Callable[[int], Any]) -> Callable[[], None]:
        node = OpNode(op=t.op, op_params=np.array(t.op_params, dtype=np.int32), dst=ref(t.id),
                      srcs=tuple(ref(s) if s else None for s in t.src), name=t.name)
        return self.plan_op(node)

    def _weight_slot(self, t: RpcTensor, g: ParsedGraph, position: dict[int, int],
                     checked: dict[int, CheckedTensor]) -> WeightSlot | None:
        """The staged-weight slot for this MUL_MAT's src0, or None when it runs on the host."""
        s0, s1 = t.src[0], t.src[1]
        if not s0 or not s1:
            return None
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

    def _npu_matmul(self, t: RpcTensor, slot: WeightSlot, ref: Callable[[int], Any],
                    host_plan: Callable[[], Callable[[], None]], step: Step) -> Callable[[], None]:
        """dst[.., M, N] = src1[.., M, K] @ W[N, K]^T with W resident; host when W is demoted.

        The step's counter follows where the work actually ran (NPU or the host fallback)."""
        npu, weights, stats = self.npu, self.weights, self.stats
        npu_counter, host_counter = step.counter, self.stats.counter("MUL_MAT", HOST)
        a_view = ref(t.src[1]).as_array()
        a_type = ref(t.src[1]).type
        d_view = ref(t.id).as_array()
        k = slot.k
        fallback: list[Callable[[], None]] = []

        def run() -> None:
            handle = weights.weight(slot)
            if handle is not None:
                a = _as_f32_rows(a_view, a_type, k)
                try:
                    c = npu.matmul(a, handle)
                except Exception as exc:  # NPU fault/timeout: this weight goes to the host for good
                    weights.matmul_failed(slot, exc)
                else:
                    d_view[...] = c.reshape(d_view.shape)
                    step.counter = npu_counter
                    timing = getattr(npu, "last_timing", None)
                    if timing is not None and timing.device_s is not None:
                        stats.npu_device_seconds += timing.device_s
                        stats.npu_device_label = timing.device_label
                    return
            step.counter = host_counter
            if not fallback:
                fallback.append(host_plan())
            fallback[0]()

        return run


@dataclass
class DeviceGraphs:
    """Per device: the last graph (GRAPH_RECOMPUTE) and recent plans by payload digest."""

    last: Plan | None = None
    by_digest: OrderedDict[bytes, Plan] = field(default_factory=OrderedDict)

    def lookup(self, digest: bytes) -> Plan | None:
        plan = self.by_digest.get(digest)
        if plan is not None:
            self.by_digest.move_to_end(digest)
        return plan

    def remember(self, plan: Plan) -> None:
        self.by_digest[plan.digest] = plan
        self.by_digest.move_to_end(plan.digest)
        while len(self.by_digest) > PLANS_PER_DEVICE:
            self.by_digest.popitem(last=False)
        self.last = plan

    def clear(self) -> None:
        self.last = None
        self.by_digest.clear()


def graph_digest(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()
