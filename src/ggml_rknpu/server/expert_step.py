"""MUL_MAT_ID (MoE experts) on the NPU: each expert a resident weight, routed at every replay.

``dst[:, s, t] = as[:, :, ids[s, t]] @ b[:, s % ne11, t]`` (ggml.c ``ggml_mul_mat_id``):
``as`` ``[K, N, n_expert]``, ``b`` ``[K, ne11, n_tokens]`` (``ne11`` 1 or ``n_used``), ``ids``
``[n_used, n_tokens]`` int32, dst ``[N, n_used, n_tokens]`` f32. Invariants: each expert's
slice is its own ``WeightSlot`` (invalidated by byte range, reused by content like a 2-D
weight), staged when a run first routes to it if the memory budget admits it (first come),
so experts no token uses cost no NPU memory (llama.cpp's warm-up routes every token to all
experts: src/llama-graph.cpp); ids are range-checked before use (a bad id fails the graph,
the server keeps serving); each selected expert's rows are one engine ``matmul`` behind
``NpuRecovery.run``; the rows of experts not resident or sent to the host run through
ggml-cpu's own MUL_MAT_ID in one call."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ggml_rknpu.engine.contract import MatmulEngine
from ggml_rknpu.libggml.abi import GGML_TENSOR_FLAG_COMPUTE
from ggml_rknpu.libggml.compute import HostCompute, HostContext
from ggml_rknpu.libggml.enums import GgmlOp, GgmlType
from ggml_rknpu.server.activations import ActivationRounder, as_f32_rows
from ggml_rknpu.server.placement import HOST, NPU
from ggml_rknpu.server.plan_steps import IndexCheck
from ggml_rknpu.server.recovery import NpuRecovery
from ggml_rknpu.server.stats import OpCounter, ServerStats
from ggml_rknpu.server.tensor import CheckedTensor
from ggml_rknpu.server.weight_store import WeightSlot, WeightStore

F32, I32 = int(GgmlType.F32), int(GgmlType.I32)
HOST_TENSORS = 3       # ggml tensors ``HostExperts`` adds to a plan's context (rows, ids, dst)


def expert_slots(w: CheckedTensor, weights: WeightStore) -> tuple[WeightSlot | None, ...]:
    """One slot per expert slice of a leaf 3-D weight (None: that slice cannot be an NPU weight)."""
    r = w.rpc
    step = r.nb[2]
    slots = []
    for e in range(r.ne[2]):
        start = w.start + e * step
        part = replace(r, ne=(r.ne[0], r.ne[1], 1, 1), nb=(r.nb[0], r.nb[1], step, step),
                       data=r.data + e * step, name=f"{r.name}[{e}]")
        slots.append(weights.slot_for(CheckedTensor(part, w.buffer, start, start + step), expert=True))
    return tuple(slots)


@dataclass(eq=False)
class HostExperts:
    """Rows routed to experts that are not on the NPU: one ggml-cpu MUL_MAT_ID over scratch.

    The node reads the real 3-D weight and scratch rows ``[K, 1, R]`` / ids ``[1, R]`` / dst
    ``[N, 1, R]``, ``R`` = every (token, slot) pair, planned once (its work buffer sized for R).
    A run fills the first ``r`` rows and sets the row count of the three scratch tensors to
    ``r`` (ggml-cpu reads shapes at compute time; fewer rows need less work memory), so the
    host computes exactly the rows it was given, bit for bit what the whole node would give them."""

    compute: HostCompute
    rows: np.ndarray           # f32 [R, K]
    ids: np.ndarray            # i32 [R]
    out: np.ndarray            # f32 [R, N]
    resize: tuple[tuple[Any, int], ...]   # (ggml tensor, dim holding the row count)

    @classmethod
    def plan(cls, host: HostContext, weight: Any, k: int, n: int, pairs: int, name: str) -> HostExperts:
        rows = np.zeros((pairs, k), np.float32)
        ids = np.zeros(pairs, np.int32)
        out = np.zeros((pairs, n), np.float32)
        t_rows = host.tensor(F32, (k, 1, pairs, 1), (4, 4 * k, 4 * k, 4 * k * pairs), 0, (), 0,
                             f"{name}.rows", (rows.view(np.uint8).reshape(-1), 0))
        t_ids = host.tensor(I32, (1, pairs, 1, 1), (4, 4, 4 * pairs, 4 * pairs), 0, (), 0,
                            f"{name}.ids", (ids.view(np.uint8), 0))
        t_out = host.tensor(F32, (n, 1, pairs, 1), (4, 4 * n, 4 * n, 4 * n * pairs), int(GgmlOp.MUL_MAT_ID),
                            (), GGML_TENSOR_FLAG_COMPUTE, f"{name}.host", (out.view(np.uint8).reshape(-1), 0))
        host.link(t_out, [weight, t_rows, t_ids], None, 0)
        return cls(host.segment([t_out]), rows, ids, out, ((t_rows, 2), (t_ids, 1), (t_out, 2)))

    def run(self, rows: np.ndarray, experts: np.ndarray) -> np.ndarray:
        """``rows[i] @ W[experts[i]]^T`` for each i, through ggml-cpu; a view of the scratch."""
        r = len(experts)
        self.rows[:r] = rows
        self.ids[:r] = experts
        for t, dim in self.resize:
            c = t.contents
            c.ne[dim] = r
            for d in range(dim + 1, 4):
                c.nb[d] = c.nb[d - 1] * c.ne[d - 1]
        self.compute.run()
        return self.out[:r]


@dataclass(eq=False)
class ExpertStep:
    """One MUL_MAT_ID whose experts are NPU weights (those that are resident run there)."""

    name: str
    slots: tuple[WeightSlot | None, ...]   # per expert
    ids: IndexCheck                      # values: the ids' typed view (1, 1, n_tokens, n_used)
    b: np.ndarray                          # src1 as (n_tokens, ne11, K), typed view in its buffer
    b_type: int
    out: np.ndarray                        # dst as (n_tokens, n_used, N), view in its buffer
    host: HostExperts
    nbytes: int                            # activations in + out (the experts are resident)
    npu_counter: OpCounter
    host_counter: OpCounter
    tok: np.ndarray                        # pair p = t * n_used + s -> t
    use: np.ndarray                        # ... -> s
    brow: np.ndarray                       # ... -> s % ne11, the src1 row of the pair
    engine: MatmulEngine
    weights: WeightStore                   # the experts' engine handles
    recovery: NpuRecovery                  # the fault policy each expert's matmul runs behind
    rounder: ActivationRounder | None = None   # ggml-cpu's activation rounding for the experts' type

    @classmethod
    def plan(cls, name: str, slots: tuple[WeightSlot | None, ...], ids: IndexCheck, b: CheckedTensor,
             out: CheckedTensor, host: HostExperts, stats: ServerStats, engine: MatmulEngine,
             weights: WeightStore, recovery: NpuRecovery, rounder: ActivationRounder | None = None) -> ExpertStep:
        b_view = b.ref().as_array()[0]
        out_view = out.ref().as_array()[0]
        n_tokens, n_used = out_view.shape[0], out_view.shape[1]
        pairs = np.arange(n_tokens * n_used)
        tok, use = np.divmod(pairs, n_used)
        return cls(name, slots, ids, b_view, b.rpc.type, out_view, host,
                   (b.end - b.start) + (out.end - out.start), stats.counter("MUL_MAT_ID", NPU),
                   stats.counter("MUL_MAT_ID", HOST), tok, use, use % b_view.shape[1], engine, weights,
                   recovery, rounder)

    def run(self, stats: ServerStats) -> None:
        self.ids.check()
        flat = self.ids.values.reshape(-1)                  # pair order (t, s): a copy when strided
        order = np.argsort(flat, kind="stable")
        chosen = flat[order]
        cuts = np.flatnonzero(chosen[1:] != chosen[:-1]) + 1
        # the routed experts not yet resident, staged together (all of a model's at its warm-up);
        # the check costs 1.3 us a step with 8 of 128 experts routed and resident
        fresh = [s for e in chosen[np.concatenate(((0,), cuts))].tolist()
                 if (s := self.slots[e]) is not None and s.handle is None and s.on_npu]
        if fresh:
            self.weights.stage_admitted(fresh)
        host_groups: list[np.ndarray] = []
        t0 = time.perf_counter()
        ran = 0
        for pairs in np.split(order, cuts):
            slot = self.slots[int(flat[pairs[0]])]
            if slot is None or not self.recovery.run(slot, self._attempt(slot, pairs)):
                host_groups.append(pairs)
                continue
            ran += 1
            stats.count_npu_matmuls(len(pairs), 1, self.engine.last_timing)
        if ran:
            stats.expert_matmuls_npu += ran
            self.npu_counter.ops += 1
            self.npu_counter.bytes += self.nbytes
            self.npu_counter.seconds += time.perf_counter() - t0
        if host_groups:
            self._on_host(np.concatenate(host_groups), flat, stats)
            stats.expert_matmuls_host += len(host_groups)

    def _attempt(self, slot: WeightSlot, pairs: np.ndarray) -> Callable[[], bool]:
        """One NPU run of the pairs routed to ``slot``'s expert into their rows of dst (False:
        the expert is not resident)."""
        def attempt() -> bool:
            handle = self.weights.weight(slot)
            if handle is None:
                return False
            self.out[self.tok[pairs], self.use[pairs]] = self.engine.matmul(self._npu_rows(pairs)(), handle)
            return True
        return attempt

    def _gatherer(self, pairs: np.ndarray) -> Callable[[], np.ndarray]:
        return lambda: as_f32_rows(self.b[self.tok[pairs], self.brow[pairs]], self.b_type)

    def _npu_rows(self, pairs: np.ndarray) -> Callable[[], np.ndarray]:
        """The pairs' rows for the NPU (rounded; the host's rows are not: ggml-cpu rounds them)."""
        gather, rounder = self._gatherer(pairs), self.rounder
        return gather if rounder is None else lambda: rounder(gather())

    def _on_host(self, pairs: np.ndarray, flat: np.ndarray, stats: ServerStats) -> None:
        t0 = time.perf_counter()
        c = self.host.run(self._gatherer(pairs)(), flat[pairs])
        self.out[self.tok[pairs], self.use[pairs]] = c
        stats.host_seconds += time.perf_counter() - t0
        self.host_counter.ops += 1
        self.host_counter.bytes += self.nbytes

