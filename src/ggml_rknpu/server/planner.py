"""GRAPH_COMPUTE payload -> a :class:`GraphPlan`, built once and replayed per token
[docs/ggml-rpc.md §3.5, P8].

Invariants: planning checks every tensor and validates every computing node against its
rule (``ops.rules``) before any step exists; only nodes flagged ``GGML_TENSOR_FLAG_COMPUTE``
that are not views are checked and run, like ggml-cpu under the C++ server; index data is
range-checked before the segment that reads it; bytes a node writes can never be taken for
a weight. What is checked and why: docs/decisions.md "server/planner.py"."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from ggml_rknpu.engine.contract import MatmulEngine, fusing
from ggml_rknpu.libggml import abi
from ggml_rknpu.libggml.compute import HostContext, Threads
from ggml_rknpu.libggml.enums import GgmlOp
from ggml_rknpu.libggml.lib import Ggml, TensorP
from ggml_rknpu.server.activations import ActivationRounding
from ggml_rknpu.server.attention_plan import (
    SOFTMAX_GRAPHS,
    SOFTMAX_TENSORS,
    AttentionPolicy,
    AttentionStep,
    attention_step,
    plan_nodes,
)
from ggml_rknpu.server.buffers import BufferTable
from ggml_rknpu.server.expert_step import HOST_TENSORS, ExpertStep, HostExperts, expert_slots
from ggml_rknpu.server.grouping import PlannedStep, delivery_runs, group_npu_steps, merge_deliveries
from ggml_rknpu.server.host_copies import HostCopies, HostCopy
from ggml_rknpu.server.memory_budget import OVER_BUDGET
from ggml_rknpu.server.ops.rules import check_node, signature
from ggml_rknpu.server.ops.vocabulary import VIEW_OPS, UnsupportedOp, op_name
from ggml_rknpu.server.parsed_graph import ParsedGraph, check_backed, check_structure, computes, parse_graph
from ggml_rknpu.server.placement import HOST, NPU, experts_host_reason, host_weight, matmul_host_reason
from ggml_rknpu.server.placement_policy import HOST_REASON, Placer
from ggml_rknpu.server.plan import GraphPlan
from ggml_rknpu.server.plan_steps import Delivery, HostSegment, IndexCheck, NpuGroup, NpuStep, SplitStep, StepFusion
from ggml_rknpu.server.recovery import NpuRecovery, RecoveryStats
from ggml_rknpu.server.residency import HOST as HOST_ONLY
from ggml_rknpu.server.residency import NPU as NPU_ONLY
from ggml_rknpu.server.residency import Candidate, Residency, repacks
from ggml_rknpu.server.sibling_order import DeliveryMark, Node, gather_siblings, node_id, overlap
from ggml_rknpu.server.stats import OpCounter, ServerStats
from ggml_rknpu.server.tensor import CheckedTensor, RpcTensor, check_tensor
from ggml_rknpu.server.weight_store import WeightSlot, WeightStore


class GraphPlanner:
    """Turns GRAPH_COMPUTE payloads into plans for one connection."""

    def __init__(self, buffers: BufferTable, weights: WeightStore, npu: MatmulEngine | None, stats: ServerStats,
                 host: Ggml, threads: Threads, recovery: NpuRecovery | None = None, group: bool = True,
                 activations: ActivationRounding | None = None, placer: Placer | None = None,
                 host_repack: bool = False, npu_attention: str = "off") -> None:
        self.buffers = buffers
        self.host_copies = HostCopies(host, stats, host_repack)   # repacked weights of host matmuls
        self._splits: dict[int, int] = {}                         # the plan being built: split node -> host rows
        self.placer = placer                                 # None: every eligible weight on the NPU
        self.residency = Residency(placer, weights.budget, weights.fmt)   # each weight's copies
        self.group = group and fusing(npu) is not None    # NPU matmuls of one activation as one submit
        self.weights = weights
        self.npu = npu
        self.stats = stats
        self.ggml = host
        self.threads = threads
        self.recovery = recovery or NpuRecovery(npu, weights, RecoveryStats())
        self.activations = activations or ActivationRounding(host)
        self.attention = AttentionPolicy(npu_attention, *((placer.cores, placer.threads) if placer else ()))

    def build(self, payload: bytes | memoryview, digest: bytes) -> GraphPlan:
        t0 = time.perf_counter()
        g = parse_graph(payload)
        position = check_structure(g)
        checked: dict[int, CheckedTensor] = {
            tid: check_tensor(t, self.buffers, "GRAPH_COMPUTE tensor", allow_unbacked=True)
            for tid, t in g.tensors.items()
        }
        check_backed(g, checked)
        computing = [nid for nid in g.node_ids                # unflagged: a branch the client did not select
                     if computes(g.tensors[nid]) and checked[nid].end > checked[nid].start]
        indices = {nid: check_node(g.tensors[nid], tuple(g.tensors[s] if s else None for s in g.tensors[nid].src))
                   for nid in computing}                  # UnsupportedOp before anything is touched
        for nid in computing:                            # bytes written by nodes are never weights
            c = checked[nid]
            assert c.buffer is not None, "a computing node has bytes (end > start)"
            c.buffer.graph_written.add(c.start, c.end)
            self.weights.mark_graph_written(c.buffer, c.start, c.end)
            self.host_copies.mark_graph_written(c.buffer, c.start, c.end)
        self._splits = {}
        reasons = {nid: self._weight_reason(g.tensors[nid], g, position, checked)
                   for nid in computing if g.tensors[nid].op == GgmlOp.MUL_MAT}
        self.residency.decide(self._candidates(reasons, g, checked))
        slots = {nid: self._weight_slot(g.tensors[nid], g, checked, reason) for nid, reason in reasons.items()}
        self._within_budget(slots)
        experts = {nid: e for nid in computing if g.tensors[nid].op == GgmlOp.MUL_MAT_ID
                   and (e := self._expert_slots(g.tensors[nid], g, position, checked)) is not None}
        attention = plan_nodes(self.attention, g.tensors, computing, position, self.npu is not None)
        unsplit = {nid: s for nid, s in slots.items() if nid not in self._splits}   # a split is never grouped
        order: list[Node] = gather_siblings(computing, g, unsplit, checked) if self.group else list(computing)

        # segments: maximal runs of host nodes; a node whose index bytes a node of the current
        # run writes starts a new one (its indices are checked before that run computes): the
        # node that computes them, or any node whose dst overlaps them
        runs: list[list[Node]] = []
        current: list[Node] = []
        written: list[CheckedTensor] = []
        for entry in order:
            if isinstance(entry, DeliveryMark) or slots.get(entry) is not None or entry in experts \
                    or entry in attention:   # its own step
                runs += [current, [entry]] if current else [[entry]]
                current, written = [], []
                continue
            if overlap([checked[g.tensors[entry].src[src]] for src, _ in indices[entry]], written):
                runs.append(current)
                current, written = [], []
            current.append(entry)
            if checked[entry].buffer is not None:
                written.append(checked[entry])
        if current:
            runs.append(current)

        npu_steps = {nid for nid in computing if slots.get(nid) is not None or nid in experts or nid in attention}
        flash = sum(1 for nid in attention if g.tensors[nid].op == GgmlOp.FLASH_ATTN_EXT)
        merges = delivery_runs(runs, npu_steps) if self.group else []
        n_markers = sum(1 for nid in order if isinstance(nid, DeliveryMark))
        host = HostContext(self.ggml, self.threads, len(g.tensors) + 2 * n_markers + HOST_TENSORS * len(experts)
                           + 4 * len(self._splits) + SOFTMAX_TENSORS * flash,
                           tuple(len(r) for r in runs) + tuple(merges)
                           + (1,) * (len(experts) + 2 * len(self._splits) + SOFTMAX_GRAPHS * flash))
        try:
            ptrs = self._ggml_tensors(g, checked, host)
            cpu_ok = {nid: self.ggml.supports_op(ptrs[nid]) for nid in computing}
            for nid in computing:
                if not cpu_ok[nid] and slots.get(nid) is None:
                    t = g.tensors[nid]
                    raise UnsupportedOp(signature(t, tuple(g.tensors[s] if s else None for s in t.src)),
                                        "ggml-cpu does not support this combination")
            copies = self._repacked(g, position, checked, ptrs, slots, computing)
            steps: list[PlannedStep] = [
                self._expert_step(g.tensors[run[0]], experts[run[0]], checked, ptrs, host, indices)
                if run[0] in experts else self._attention_step(g.tensors[node_id(run[0])], g, checked, ptrs, host, indices)
                if run[0] in attention else self._step(run, g, checked, ptrs, host, indices, slots, cpu_ok, copies)
                for run in runs]
            checks = hoist_checks(steps, runs, checked)
            planned: list[PlannedStep] = group_npu_steps(steps) if self.group else steps
            counts = take_counts(planned)
            if self.group:
                planned = merge_deliveries(planned, host, ptrs)
            host.finish()
        except BaseException:
            host.close()
            raise
        # experts are staged when a run first routes to them (ExpertStep.run), not here
        self.weights.stage_all(s for s in slots.values() if s is not None)   # timed in the weight stats
        if self.placer is not None:
            self.placer.log_new_buckets()
        self.host_copies.log_made()
        self.stats.plans_built += 1
        self.stats.plan_seconds += time.perf_counter() - t0
        views = sum(1 for nid in g.node_ids if g.tensors[nid].op in VIEW_OPS)
        groups = [s for s in planned if isinstance(s, NpuGroup)]
        self.stats.npu_groups_planned += len(groups)
        return GraphPlan(g.dev, digest, tuple(planned), host, len(g.node_ids), views,
                         checks=checks, counts=counts, groups=groups, stats=self.stats)

    @staticmethod
    def _ggml_tensors(g: ParsedGraph, checked: dict[int, CheckedTensor], host: HostContext) -> dict[int, TensorP]:
        """One ggml tensor per graph tensor, data in the server's buffers, then sources and views."""
        ptrs: dict[int, TensorP] = {}
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

    def _step(self, run: list[Node], g: ParsedGraph, checked: dict[int, CheckedTensor], ptrs: dict[int, TensorP],
              host: HostContext, indices: dict[int, list[tuple[int, int]]],
              slots: dict[int, WeightSlot | None], cpu_ok: dict[int, bool],
              copies: dict[int, HostCopy]) -> HostSegment | NpuStep | SplitStep | Delivery:
        first = run[0]
        if isinstance(first, DeliveryMark):
            return Delivery(first.node)
        nodes = [node_id(n) for n in run]   # a host run or one MUL_MAT: tensor ids
        slot = slots.get(first)
        if slot is None:
            return self._segment(nodes, g, checked, ptrs, host, indices, copies)
        t = g.tensors[first]
        if t.id in self._splits:
            return self._split_step(t, slot, self._splits[t.id], checked, ptrs, host)
        segment = self._segment(nodes, g, checked, ptrs, host, indices) if cpu_ok[t.id] else None
        a, a_type = checked[t.src[1]].ref().as_array(), g.tensors[t.src[1]].type
        return NpuStep(slot=slot, a=a, a_type=a_type,
                       out=checked[t.id].ref().as_array(), host=segment,
                       nbytes=self._span(t, checked) - slot.nbytes,
                       npu_counter=self.stats.counter("MUL_MAT", NPU), fused=self._fused(slot, a),
                       recovery=self.recovery, a_id=t.src[1], node=t.id,
                       rounder=self.activations.for_step(slot.type, a_type, a.size))

    def _fused(self, slot: WeightSlot, a: np.ndarray) -> StepFusion:
        """The engine fusion of an NPU step over ``slot``'s weight reading activations ``a``."""
        assert self.npu is not None, "a weight slot means an engine"
        return StepFusion(self.npu, self.weights, (slot,), a.size // slot.k)

    def _expert_step(self, t: RpcTensor, slots: tuple[WeightSlot | None, ...], checked: dict[int, CheckedTensor],
                     ptrs: dict[int, TensorP], host: HostContext, indices: dict[int, list[tuple[int, int]]]) -> ExpertStep:
        """A MUL_MAT_ID with resident experts (``server/expert_step.py``); its ids checked as the rule says."""
        (src, bound), = indices[t.id]
        ids = checked[t.src[src]]
        check = IndexCheck(ids.ref().as_array(), bound, f"MUL_MAT_ID '{t.name}' src{src} '{ids.rpc.name}'")
        w = checked[t.src[0]].rpc
        on_host = HostExperts.plan(host, ptrs[w.id], w.ne[0], w.ne[1], t.ne[1] * t.ne[2], t.name)
        rounder = self.activations.for_step(w.type, checked[t.src[1]].rpc.type, w.ne[0] * t.ne[1] * t.ne[2])
        assert self.npu is not None, "expert slots mean an engine"
        return ExpertStep.plan(t.name, slots, check, checked[t.src[1]], checked[t.id], on_host, self.stats,
                               self.npu, self.weights, self.recovery, rounder)

    def _attention_step(self, t: RpcTensor, g: ParsedGraph, checked: dict[int, CheckedTensor], ptrs: dict[int, TensorP],
                        host: HostContext, indices: dict[int, list[tuple[int, int]]]) -> AttentionStep:
        """An attention node whose matmuls run on the NPU (``server/attention_plan.py``)."""
        assert self.npu is not None, "plan_nodes chooses attention nodes only with an engine"
        return attention_step(t, checked, ptrs, host, self.npu, self.recovery,
                              self._segment([t.id], g, checked, ptrs, host, indices), self.stats)

    def _segment(self, run: list[int], g: ParsedGraph, checked: dict[int, CheckedTensor], ptrs: dict[int, TensorP],
                 host: HostContext, indices: dict[int, list[tuple[int, int]]],
                 copies: dict[int, HostCopy] | None = None) -> HostSegment:
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
                           [(c, n, b) for c, n, b in per_counter.values()],
                           tuple(copies[nid] for nid in run if copies and nid in copies))

    def _repacked(self, g: ParsedGraph, position: dict[int, int], checked: dict[int, CheckedTensor],
                  ptrs: dict[int, TensorP], slots: dict[int, WeightSlot | None], computing: list[int]) -> dict[int, HostCopy]:
        """Host MUL_MATs of a weight ggml-cpu repacks, pointed at its repacked copy: node -> copy.

        A candidate is a weight by the NPU's rules (``placement.host_weight``) whose matmul runs
        here (no slot); it keeps the copy only when ggml-cpu's own ``supports_op`` admits the
        node with it (f32 activations) and the repacked kernel's shape asserts hold."""
        out: dict[int, HostCopy] = {}
        if not self.host_copies.enabled:
            return out
        for nid in computing:
            t = g.tensors[nid]
            if t.op != GgmlOp.MUL_MAT or slots.get(nid) is not None:
                continue
            s0 = t.src[0]
            c0 = checked[s0]
            if not host_weight(t, g.tensors[s0], g.tensors[t.src[1]], w_computed=s0 in position,
                               w_backed=c0.buffer is not None,
                               w_graph_written=c0.buffer is not None and c0.buffer.graph_written.overlaps(c0.start, c0.end)):
                continue
            key = _key(c0)
            if self.residency.side(key) == NPU_ONLY:
                continue                 # no repacked copy: the plain kernel reads the weight pages
            copy = self.host_copies.copy_for(c0)
            self.residency.made(key, HOST_ONLY)
            if copy is None:
                continue
            node = ptrs[nid].contents
            plain, node.src[0] = node.src[0], copy.weight.tensor
            if self.ggml.supports_op(ptrs[nid]):
                out[nid] = copy
            else:
                node.src[0] = plain
        return out

    def _weight_reason(self, t: RpcTensor, g: ParsedGraph, position: dict[int, int],
                       checked: dict[int, CheckedTensor]) -> str | None:
        """Why this MUL_MAT's src0 is not a weight for the NPU whatever the placement, or None."""
        s0 = t.src[0]
        c0 = checked[s0]
        return matmul_host_reason(
            t, g.tensors[s0], g.tensors[t.src[1]], engine=self.npu is not None, w_computed=s0 in position,
            w_backed=c0.buffer is not None,
            w_graph_written=c0.buffer is not None and c0.buffer.graph_written.overlaps(c0.start, c0.end))

    def _candidates(self, reasons: dict[int, str | None], g: ParsedGraph,
                    checked: dict[int, CheckedTensor]) -> list[Candidate]:
        """The weights of this plan that could have an NPU copy, for ``Residency.decide``."""
        out = []
        for nid, reason in reasons.items():
            t = g.tensors[nid]
            w, c0 = g.tensors[t.src[0]], checked[t.src[0]]
            if reason is not None or w.type not in self.weights.types:
                continue
            host = self.host_copies.enabled and host_weight(t, w, g.tensors[t.src[1]], w_computed=False,
                                                             w_backed=True, w_graph_written=False)
            out.append(Candidate(_key(c0), w.name, w.type, w.ne[0], w.ne[1], c0.end - c0.start,
                                 host and repacks(w.type, w.ne[1])))
        return out

    def _weight_slot(self, t: RpcTensor, g: ParsedGraph, checked: dict[int, CheckedTensor],
                     reason: str | None) -> WeightSlot | None:
        """The staged-weight slot for this MUL_MAT's src0, or None when it runs on the host: its
        weight's residency, then (copies on both sides) the placement at this M decide."""
        s0, s1 = t.src[0], t.src[1]
        c0 = checked[s0]
        w = g.tensors[s0]
        side = self.residency.side(_key(c0))
        if reason is None and self.placer is not None and not self.placer.on_npu(
                w.name, w.type, t.ne[1] * t.ne[2] * t.ne[3], w.ne[0], w.ne[1], c0.end - c0.start,
                npu_only=side == NPU_ONLY):
            reason = HOST_REASON
        if reason is None and side == HOST_ONLY:
            reason = OVER_BUDGET if self.weights.budget is not None else HOST_REASON
        host_rows = 0
        if reason is None and side != NPU_ONLY and self.placer is not None and self.placer.split and host_weight(
                t, w, g.tensors[s1], w_computed=False, w_backed=True, w_graph_written=False):
            host_rows = self.placer.host_rows(w.type, t.ne[1] * t.ne[2] * t.ne[3], w.ne[0], w.ne[1])
        slot = self.weights.slot_for(_rows(c0, 0, w.ne[1] - host_rows)) if reason is None else None
        if reason is None and slot is None:
            reason = "weight type or engine refused it"
        if reason is not None:
            self.stats.host_matmul_reasons[reason] = self.stats.host_matmul_reasons.get(reason, 0) + 1
        elif host_rows:
            self._splits[t.id] = host_rows
            self.residency.made(_key(c0), NPU_ONLY)    # its NPU rows are admitted on their own
        return slot

    def _within_budget(self, slots: dict[int, WeightSlot | None]) -> None:
        """Admit the NPU copies this plan would stage under the memory budget: a copy its
        residency holds bytes for takes them; any other (a copy staged again after an
        invalidation, a split's rows) is admitted if it fits, else its weight runs on the host
        (``slots[nid]`` None, from a repacked copy where ggml repacks it)."""
        budget = self.weights.budget
        if budget is None:
            return
        verdict: dict[int, bool] = {}                  # id(slot) -> admitted (a weight read by two nodes)
        for nid, slot in slots.items():
            if slot is None or slot.handle is not None:
                continue
            if id(slot) not in verdict:
                held = self.residency.made((slot.buffer.handle, slot.start, slot.end, slot.type, slot.k, slot.n),
                                           NPU_ONLY)
                budget.promised += held
                verdict[id(slot)] = bool(held) or self.weights.admit(slot)
            if verdict[id(slot)]:
                continue
            slots[nid] = None
            self._splits.pop(nid, None)
            self.stats.host_matmul_reasons[OVER_BUDGET] = self.stats.host_matmul_reasons.get(OVER_BUDGET, 0) + 1

    def _split_step(self, t: RpcTensor, slot: WeightSlot, host_rows: int, checked: dict[int, CheckedTensor],
                    ptrs: dict[int, TensorP], host: HostContext) -> SplitStep:
        """A split MUL_MAT: the NPU over the weight's first rows into those columns of dst, a
        one-node ggml graph over the last ``host_rows`` rows (from a repacked copy where ggml
        repacks them) into the others, and a one-node graph of the NPU's rows as its fallback."""
        w, d, a = checked[t.src[0]], checked[t.id], checked[t.src[1]]
        n = w.rpc.ne[1]
        n_npu = n - host_rows
        w_buffer, d_buffer = w.buffer, d.buffer
        assert w_buffer is not None and d_buffer is not None, "a split weight and its dst are backed"

        def part(first: int, rows: int, repacked: bool) -> HostSegment:
            piece = _rows(w, first, rows)
            copy = self.host_copies.copy_for(piece) if repacked else None
            weight = copy.weight.tensor if copy is not None else host.tensor(
                w.rpc.type, piece.rpc.ne, piece.rpc.nb, 0, (), 0, f"{w.rpc.name} rows {first}+{rows}",
                (w_buffer.array, piece.start))
            dn = d.rpc
            node = host.tensor(dn.type, (rows, *dn.ne[1:]), dn.nb, int(GgmlOp.MUL_MAT), (),
                               abi.GGML_TENSOR_FLAG_COMPUTE, f"{dn.name} rows {first}+{rows}",
                               (d_buffer.array, d.start + first * dn.nb[0]))
            host.link(node, [weight, ptrs[t.src[1]]], None, 0)
            nbytes = piece.end - piece.start + (a.end - a.start) + rows * (d.end - d.start) // n
            return HostSegment(host.segment([node]), [], [(self.stats.counter("MUL_MAT", HOST), 1, nbytes)],
                               (copy,) if copy is not None else ())

        out = d.ref().as_array().reshape(-1, n)[:, :n_npu]
        a_array = a.ref().as_array()
        npu_part = NpuStep(slot=slot, a=a_array, a_type=a.rpc.type, out=out, host=part(0, n_npu, False),
                           nbytes=(a.end - a.start) + n_npu * (d.end - d.start) // n,
                           npu_counter=self.stats.counter("MUL_MAT", NPU), fused=self._fused(slot, a_array),
                           recovery=self.recovery, a_id=t.src[1], node=t.id,
                           rounder=self.activations.for_step(slot.type, a.rpc.type, a_array.size))
        return SplitStep(npu_part, part(n_npu, host_rows, self.host_copies.enabled), host_rows)

    def _expert_slots(self, t: RpcTensor, g: ParsedGraph, position: dict[int, int],
                      checked: dict[int, CheckedTensor]) -> tuple[WeightSlot | None, ...] | None:
        """The staged-weight slots of this MUL_MAT_ID's experts, or None when it runs on the host."""
        s0 = t.src[0]
        c0 = checked[s0]
        reason = experts_host_reason(
            t, g.tensors[s0], g.tensors[t.src[1]], engine=self.npu is not None, w_computed=s0 in position,
            w_backed=c0.buffer is not None,
            w_graph_written=c0.buffer is not None and c0.buffer.graph_written.overlaps(c0.start, c0.end))
        w = g.tensors[s0]
        if reason is None and self.placer is not None and not self.placer.on_npu(
                w.name, w.type, t.ne[1] * t.ne[2], w.ne[0], w.ne[1], c0.end - c0.start,
                experts=min(w.ne[2], t.ne[1] * t.ne[2])):
            reason = HOST_REASON
        slots = expert_slots(c0, self.weights) if reason is None else None
        if slots is not None and all(s is None for s in slots):
            slots, reason = None, "weight type or engine refused it"
        if reason is not None:
            key = f"MUL_MAT_ID: {reason}"
            self.stats.host_matmul_reasons[key] = self.stats.host_matmul_reasons.get(key, 0) + 1
        return slots


def _key(t: CheckedTensor) -> tuple:
    """A 2-D weight's key, as ``WeightStore`` keys its slot: (buffer, start, end, type, K, N)."""
    assert t.buffer is not None, "a weight candidate is backed"
    return t.buffer.handle, t.start, t.end, t.rpc.type, t.rpc.ne[0], t.rpc.ne[1]


def _rows(t: CheckedTensor, first: int, rows: int) -> CheckedTensor:
    """Rows [first, first + rows) of a contiguous 2-D weight, as a tensor of its own."""
    r = t.rpc
    row = r.nb[1]
    piece = dataclasses.replace(r, ne=(r.ne[0], rows, 1, 1), nb=(r.nb[0], row, row * rows, row * rows))
    return CheckedTensor(piece, t.buffer, t.start + first * row, t.start + (first + rows) * row)


def hoist_checks(steps: list[PlannedStep], runs: list[list[Node]], checked: dict[int, CheckedTensor]) -> list[IndexCheck]:
    """The index checks that may run once, at the start of every replay, taken out of the segments.

    ``steps[i]`` runs the nodes ``runs[i]`` (a ``DeliveryMark`` writes its node's dst). A check may move to the start when no step before its segment writes bytes
    of its indices: inputs the client uploaded before the compute, such as the KV-cache
    slots every layer's SET_ROWS reads, until the allocator reuses their memory. Nothing
    changes them before the reader then, so checking them first checks what it will read.
    Identical views are checked once, against the smallest bound. Indices a node computes
    (ARGSORT -> GET_ROWS, MoE routing) stay in the segment before their reader."""
    written = [(i, checked[node_id(nid)]) for i, run in enumerate(runs) for nid in run]
    written = [(i, c) for i, c in written if c.buffer is not None]
    position = np.array([i for i, _ in written], dtype=np.int64)
    buffer_ids = np.array([id(c.buffer) for _, c in written], dtype=np.int64)
    starts = np.array([c.start for _, c in written], dtype=np.int64)
    ends = np.array([c.end for _, c in written], dtype=np.int64)
    hoisted: dict[tuple, IndexCheck] = {}
    for i, step in enumerate(steps):
        if not isinstance(step, HostSegment):
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


def take_counts(steps: list[PlannedStep]) -> list[tuple[OpCounter, int, int]]:
    """The plan's segments' counters, merged, to be added once per replay (the segments' cleared)."""
    merged: dict[int, list] = {}
    for step in steps:
        if not isinstance(step, HostSegment):
            continue
        for counter, n, nbytes in step.counts:
            entry = merged.setdefault(id(counter), [counter, 0, 0])
            entry[1] += n
            entry[2] += nbytes
        step.counts = []
    return [(c, n, b) for c, n, b in merged.values()]

