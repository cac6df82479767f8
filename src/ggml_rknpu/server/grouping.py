"""Grouping of a plan's steps: consecutive NPU matmuls reading one activation become one
``NpuGroup`` (one submit), and host segments that only deliveries separate one ``DeliveredRun``.

Invariants: a group's results are the members' run one by one; a delivered result is
written where its node was in the client's order; a merged run is the same nodes in the
same order as its parts. Why: docs/decisions.md "server/planner.py"."""

from __future__ import annotations

from typing import Any

import numpy as np

from ggml_rknpu.libggml.compute import HostContext
from ggml_rknpu.server.attention_step import FlashAttentionStep, KvMatmulStep
from ggml_rknpu.server.expert_step import ExpertStep
from ggml_rknpu.server.plan_steps import DeliveredRun, Delivery, HostSegment, NpuGroup, NpuStep, SplitStep
from ggml_rknpu.server.sibling_order import DeliveryMark, Node

PlannedStep = (HostSegment | NpuStep | NpuGroup | Delivery | DeliveredRun | ExpertStep | SplitStep
               | KvMatmulStep | FlashAttentionStep)

GROUP_MAX_ROWS = 16
# grouped steps are the decode path (M = 1..16: one token, speculative drafts, a few
# slots), where a submit per matmul is a large share of the token. Prefill matmuls stream
# their weight for many rows per submit and their programs may need several chains, which
# a chained step cannot hold: they stay one NpuStep each.


def delivery_runs(runs: list[list[Node]], npu: set[int]) -> list[int]:
    """Graph sizes of the DeliveredRuns a plan may make (``merge_deliveries``): per stretch of
    host runs and delivery marks between NPU steps that holds a mark, its node count."""
    sizes, size, markers = [], 0, 0
    for run in [*runs, None]:
        if run is None or (not isinstance(run[0], DeliveryMark) and run[0] in npu):
            if markers:
                sizes.append(size)
            size, markers = 0, 0
            continue
        size += len(run)
        markers += isinstance(run[0], DeliveryMark)
    return sizes


def merge_deliveries(steps: list[PlannedStep], host: HostContext, ptrs: dict[int, Any]) -> list[PlannedStep]:
    """Each stretch of HostSegments and Deliveries of grouped members (``DeliveredRun``),
    when its segments have no index check left (those run between parts)."""
    out: list[PlannedStep] = []
    stretch: list[HostSegment | Delivery] = []

    def flush() -> None:
        deliveries = [p for p in stretch if isinstance(p, Delivery)]
        if deliveries and all(d.group is not None for d in deliveries) and \
                all(not p.checks for p in stretch if isinstance(p, HostSegment)):
            nodes: list[Any] = []
            for part in stretch:
                if isinstance(part, HostSegment):
                    nodes += part.compute.nodes
                else:
                    assert part.kept is not None and part.member is not None, "a grouped delivery"
                    nodes.append(host.copy_node(ptrs[part.node], part.kept, f"delivered {part.member.slot.name}"))
            copies = tuple(c for p in stretch if isinstance(p, HostSegment) for c in p.copies)
            merged = HostSegment(host.segment(nodes), [], [], copies)
            groups = tuple({id(d.group): d.group for d in deliveries if d.group is not None}.values())
            out.append(DeliveredRun(merged, list(stretch), groups))
        else:
            out.extend(stretch)
        stretch.clear()

    for step in steps:
        if isinstance(step, (HostSegment, Delivery)):
            stretch.append(step)
        else:
            flush()
            out.append(step)
    flush()
    return out


def group_npu_steps(steps: list[PlannedStep]) -> list[PlannedStep]:
    """Runs of consecutive NpuSteps that read the same activation tensor become NpuGroups.

    Same src1 tensor means same view, type and K; one weight store means one weight
    format; the same rounder, one activation rounding (``server/activations.py``). Members must
    write float32 destinations that are plain [M, N] views. A member with a Delivery (moved
    up by ``sibling_order.gather_siblings``) writes its result there; if it ends up in no group it runs
    there, not where it was moved."""
    deliveries = {d.node: d for d in steps if isinstance(d, Delivery)}
    out: list[PlannedStep] = []
    i = 0
    while i < len(steps):
        step = steps[i]
        j = i + 1
        if isinstance(step, NpuStep):
            while j < len(steps) and isinstance(nxt := steps[j], NpuStep) and nxt.a_id == step.a_id \
                    and nxt.rounder is step.rounder:
                j += 1
        run = steps[i:j]
        group = _group([s for s in run if isinstance(s, NpuStep)], deliveries) if len(run) > 1 else None
        if group is not None:
            out.append(group)
        else:
            for member in run:
                if isinstance(member, NpuStep) and member.node in deliveries:
                    deliveries[member.node].member = member      # runs at its own place
                else:
                    out.append(member)
        i = j
    return out


def _group(run: list[NpuStep], deliveries: dict[int, Delivery]) -> NpuGroup | None:
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


