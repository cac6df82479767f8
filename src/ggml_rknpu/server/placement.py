"""Where each op runs (NPU engine or the host's ggml-cpu), and the counters that prove it.

Policy: a MUL_MAT whose src0 is a staged weight runs on the NPU engine; everything else
runs on the host. Counters are per (op, engine): nodes executed, bytes touched (NPU: the
activations moved, the weight being resident), host seconds per segment and around each
NPU step; printed on SIGUSR1, with ``--stats`` after each client, and at exit. Why no
other op moves to the NPU: docs/decisions.md "server/placement.py"."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

from ggml_rknpu.libggml.enums import TYPE_TRAITS, GgmlType
from ggml_rknpu.server.rpc.wire import N_COMMANDS, Cmd
from ggml_rknpu.server.tensor import RpcTensor

NPU = "npu"
HOST = "host"

FLAG_INPUT = 1                     # GGML_TENSOR_FLAG_INPUT [docs/ggml-rpc.md §3.3]
_FLOAT_ACTIVATIONS = frozenset(int(t) for t in (GgmlType.F32, GgmlType.F16, GgmlType.BF16))


def _contiguous_2d(t: RpcTensor) -> bool:
    block, type_size = TYPE_TRAITS[GgmlType(t.type)]
    return t.ne[2] == 1 and t.ne[3] == 1 and t.nb[0] == type_size and t.nb[1] == t.ne[0] // block * type_size


def _contiguous_3d(t: RpcTensor) -> bool:
    """[K, N, n_expert] with each expert's [K, N] slice right after the previous one."""
    block, type_size = TYPE_TRAITS[GgmlType(t.type)]
    row = t.ne[0] // block * type_size
    return t.ne[3] == 1 and t.nb[0] == type_size and t.nb[1] == row and t.nb[2] == row * t.ne[1]


def _leaf_weight_reason(dst: RpcTensor, w: RpcTensor, *, engine: bool, w_computed: bool,
                        w_backed: bool) -> str | None:
    """What rules src0 out as a resident weight whatever its shape (MUL_MAT and MUL_MAT_ID alike)."""
    if not engine:
        return "no NPU engine"
    if 0 in dst.ne or 0 in w.ne:
        return "empty"
    if w.view_src:                 # checked first: KV cache views are (no-op) nodes of the graph too
        return "src0 is a view (KV cache)"
    if w_computed:
        return "src0 computed by the graph"
    if w.flags & FLAG_INPUT:
        return "src0 is a graph input"
    if not w_backed:
        return "src0 not on this server"
    return None


def matmul_host_reason(dst: RpcTensor, w: RpcTensor, a: RpcTensor, *, engine: bool, w_computed: bool,
                       w_backed: bool, w_graph_written: bool) -> str | None:
    """Why this MUL_MAT (dst = a @ w^T) runs on the host, or None: its src0 is a weight for the NPU.

    A weight is a leaf (not computed by the graph), not a view (the KV cache is reached
    through views), not a graph input, 2-D and contiguous, never written by a graph node,
    and the activations are float with matching shapes.
    """
    reason = _leaf_weight_reason(dst, w, engine=engine, w_computed=w_computed, w_backed=w_backed)
    if reason is not None:
        return reason
    if not _contiguous_2d(w):
        return "src0 not 2-D contiguous"
    if w_graph_written:
        return "src0 written by a graph"
    if a.type not in _FLOAT_ACTIVATIONS or dst.type != GgmlType.F32:
        return "activation/output type"
    if a.ne[0] != w.ne[0] or dst.ne[0] != w.ne[1] or dst.ne[1:] != a.ne[1:]:
        return "broadcast shapes"
    return None


def experts_host_reason(dst: RpcTensor, w: RpcTensor, b: RpcTensor, *, engine: bool, w_computed: bool,
                        w_backed: bool, w_graph_written: bool) -> str | None:
    """Why this MUL_MAT_ID keeps all its experts on the host, or None: each expert slice
    of src0 ``[K, N, n_expert]`` can be a resident weight (same rules as a MUL_MAT's src0,
    3-D contiguous; shapes were checked by the validator rule)."""
    reason = _leaf_weight_reason(dst, w, engine=engine, w_computed=w_computed, w_backed=w_backed)
    if reason is not None:
        return reason
    if not _contiguous_3d(w):
        return "src0 not 3-D contiguous"
    if w_graph_written:
        return "src0 written by a graph"
    if b.type not in _FLOAT_ACTIVATIONS or dst.type != GgmlType.F32:
        return "activation/output type"
    return None


@dataclass(slots=True)
class OpCounter:
    ops: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class ServerStats:
    """Everything the server counts; one instance per server (all connections)."""

    per_op: dict[tuple[str, str], OpCounter] = field(default_factory=dict)
    commands: list[int] = field(default_factory=lambda: [0] * N_COMMANDS)   # requests, by command id
    host_matmul_reasons: dict[str, int] = field(default_factory=dict)      # planned MUL_MATs kept on host
    connections: int = 0
    rejected: int = 0                 # connections closed for a protocol / validation error
    unsupported: int = 0              # connections closed for an op we cannot run
    plans_built: int = 0
    plan_cache_hits: int = 0          # identical GRAPH_COMPUTE bytes replayed
    recomputes: int = 0               # GRAPH_RECOMPUTE replays
    graph_runs: int = 0
    view_nodes: int = 0               # nodes that need no work (views)
    plan_seconds: float = 0.0
    execute_seconds: float = 0.0      # wall time of plan replays (steps + the replay loop itself)
    host_seconds: float = 0.0         # inside ggml_graph_compute of the host segments (host ops and host matmuls)
    host_segments: int = 0            # ggml_graph_compute calls (host segments run)
    bytes_in: int = 0
    npu_device_seconds: float = 0.0   # the engine's own device-time figure for NPU matmuls
    npu_device_label: str = "unknown"  # "measured" on a board, "modeled" on the simulator
    npu_matmuls_by_m: dict[int, int] = field(default_factory=dict)  # NPU MUL_MATs by rows M (batch, spec, slots)
    npu_groups_planned: int = 0       # NpuGroups in the plans built (sibling matmuls as one submit)
    npu_grouped_runs: int = 0         # replays of a group that ran as one engine step
    expert_matmuls_npu: int = 0       # MUL_MAT_ID: one per selected expert run on the NPU (M = its rows)
    expert_matmuls_host: int = 0      # ... per selected expert whose rows ran on ggml-cpu
    bytes_out: int = 0

    def count_npu_matmuls(self, rows: int, n: int, timing: Any = None) -> None:
        """``n`` NPU MUL_MATs of M = ``rows`` ran, and the engine's device time for them when its
        ``last_timing`` has one (every NPU step kind counts through here)."""
        self.npu_matmuls_by_m[rows] = self.npu_matmuls_by_m.get(rows, 0) + n
        if timing is not None and timing.device_s is not None:
            self.npu_device_seconds += timing.device_s
            self.npu_device_label = timing.device_label

    def counter(self, op: str, engine: str) -> OpCounter:
        key = (op, engine)
        c = self.per_op.get(key)
        if c is None:
            c = self.per_op[key] = OpCounter()
        return c

    def engine_totals(self) -> dict[str, OpCounter]:
        totals: dict[str, OpCounter] = {}
        for (_, engine), c in self.per_op.items():
            t = totals.setdefault(engine, OpCounter())
            t.ops += c.ops
            t.bytes += c.bytes
            t.seconds += c.seconds
        return totals

    def host_us_per_node(self) -> float | None:
        """Host compute time per executed host node, in µs (the per-token overhead figure).

        Host nodes run in segments (one ggml_graph_compute each), so the time is known per
        segment, not per op: this is ggml-cpu's time over every host node, host matmuls
        (KQ/KQV) included."""
        ops = sum(c.ops for (_, engine), c in self.per_op.items() if engine == HOST)
        return self.host_seconds / ops * 1e6 if ops else None

    def replay_overhead_us_per_node(self) -> float | None:
        """Replay time not spent computing (the step loop, index checks, counters), µs per node."""
        nodes = sum(c.ops for c in self.per_op.values())
        inside = self.host_seconds + sum(c.seconds for (_, engine), c in self.per_op.items() if engine != HOST)
        return (self.execute_seconds - inside) / nodes * 1e6 if nodes else None

    def as_dict(self, weights=None, engine: dict[str, int] | None = None) -> dict:
        """Machine-readable counters (``--stats-json``), for benchmarks and reports; ``engine``:
        the engine's own counters (``submits``, ``step_runs``, ``chained_submits``, ...)."""
        per_op = [{"op": op, "engine": engine, "nodes": c.ops, "bytes": c.bytes, "host_seconds": c.seconds}
                  for (op, engine), c in self.per_op.items() if c.ops]
        out = {k: v for k, v in vars(self).items() if k not in ("per_op", "commands")}
        out.update(per_op=per_op, commands={Cmd(i).name: n for i, n in enumerate(self.commands) if n}, host_us_per_non_matmul_node=self.host_us_per_node(),
                   replay_overhead_us_per_node=self.replay_overhead_us_per_node())
        if weights is not None:
            out["weights"] = dict(vars(weights))
        if engine is not None:
            out["engine"] = dict(engine)
        return out

    def render(self, weights=None) -> str:
        """A human table (rich), as text."""
        from rich.console import Console
        from rich.table import Table

        table = Table(title="rknpu serve: where ops ran (NPU step time measured; host time per segment, below)")
        for col in ("op", "engine", "nodes", "MiB", "host ms", "µs/node"):
            table.add_column(col, justify="right" if col not in ("op", "engine") else "left")
        for (op, engine), c in sorted(self.per_op.items(), key=lambda kv: -kv[1].seconds):
            if not c.ops:
                continue
            table.add_row(op, engine, str(c.ops), f"{c.bytes / 2**20:.1f}", f"{c.seconds * 1e3:.1f}",
                          f"{c.seconds / c.ops * 1e6:.1f}" if c.ops else "-")
        for engine, t in sorted(self.engine_totals().items()):
            table.add_row("[b]total[/b]", engine, str(t.ops), f"{t.bytes / 2**20:.1f}",
                          f"{t.seconds * 1e3:.1f}", f"{t.seconds / t.ops * 1e6:.1f}" if t.ops else "-")
        out = io.StringIO()
        console = Console(file=out, width=100, force_terminal=False)
        console.print(table)
        per_node = self.host_us_per_node()
        overhead = self.replay_overhead_us_per_node()
        lines = [
            f"connections {self.connections} (rejected {self.rejected}, unsupported op {self.unsupported})",
            f"graphs run {self.graph_runs}: plans built {self.plans_built} ({self.plan_seconds * 1e3:.1f} ms), "
            f"identical-graph replays {self.plan_cache_hits}, GRAPH_RECOMPUTE replays {self.recomputes}, "
            f"view nodes skipped {self.view_nodes}",
            f"host (ggml-cpu) time {self.host_seconds * 1e3:.1f} ms, {per_node:.2f} µs per host node, "
            f"{self.host_segments} host segments" if per_node is not None else "host time per node: -",
            f"replay overhead beyond the ops: {overhead:.2f} µs per node" if overhead is not None else "",
            f"socket: {self.bytes_in / 2**20:.1f} MiB in, {self.bytes_out / 2**20:.1f} MiB out; requests: "
            + (", ".join(f"{Cmd(i).name} {n}" for i, n in enumerate(self.commands) if n) or "none"),
        ]
        if self.host_matmul_reasons:
            lines.append("MUL_MATs planned on the host: " + ", ".join(
                f"{reason} {n}" for reason, n in sorted(self.host_matmul_reasons.items(), key=lambda kv: -kv[1])))
        if self.npu_matmuls_by_m:
            lines.append("NPU matmuls by rows M: " + ", ".join(
                f"M={m} {n}" for m, n in sorted(self.npu_matmuls_by_m.items())))
        if self.expert_matmuls_npu or self.expert_matmuls_host:
            lines.append(f"MUL_MAT_ID expert matmuls: {self.expert_matmuls_npu} on the NPU, "
                         f"{self.expert_matmuls_host} on the host")
        if self.npu_device_seconds:
            lines.append(f"NPU device time of the matmuls: {self.npu_device_seconds * 1e3:.1f} ms "
                         f"({self.npu_device_label})")
        if weights is not None:
            lines.append(
                f"weights: {weights.staged} staged now ({weights.staged_bytes / 2**20:.1f} MiB ggml data, "
                f"peak {weights.peak_staged}), "
                f"{weights.uploads} uploads ({weights.upload_seconds:.2f} s), {weights.invalidations} invalidated, "
                f"{weights.demoted} demoted to host, {weights.failures} refused by the engine"
            )
            if weights.experts_staged or weights.experts_host:
                lines.append(f"MoE experts: {weights.experts_staged} resident, {weights.experts_host} on the host")
            lines.append(
                f"weight reuse across clients: {weights.reused} reused, {weights.retired} retired, "
                f"{weights.evicted} evicted; {weights.retired_now} retired now "
                f"({weights.retired_bytes / 2**20:.1f} MiB NPU), digests {weights.digest_seconds:.2f} s"
            )
        return out.getvalue() + "\n".join(line for line in lines if line) + "\n"
