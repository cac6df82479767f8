"""``ServerStats``: everything the server counts, for ``--stats`` and ``--stats-json``;
``OpCounter``: ops, bytes and seconds per (op, where it ran).

Counters are per (op, engine): nodes executed, bytes touched (NPU: the activations moved,
the weight being resident), host seconds per segment and around each NPU step; printed on
SIGUSR1, with ``--stats`` after each client, and at exit. One instance per server."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

from ggml_rknpu.server.placement import HOST
from ggml_rknpu.server.rpc.wire import N_COMMANDS, Cmd


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
    npu_grouped_runs: int = 0         # replays of a group that ran as one fusion
    expert_matmuls_npu: int = 0       # MUL_MAT_ID: one per selected expert run on the NPU (M = its rows)
    expert_matmuls_host: int = 0      # ... per selected expert whose rows ran on ggml-cpu
    bytes_out: int = 0
    host_repacked: int = 0            # weights given a repacked host copy (ggml-cpu's CPU_REPACK buffer)
    host_repacked_bytes: int = 0      # ... their host bytes now (beside the GGUF bytes in the buffers)
    host_repack_refreshes: int = 0    # copies repacked again (their GGUF bytes rewritten)
    split_matmuls: int = 0            # MUL_MATs run split, NPU and host at once (--placement-split)
    attention_npu_by_m: dict[int, int] = field(default_factory=dict)   # attention matmuls on the NPU by rows M
    attention_host_runs: int = 0      # attention nodes planned for the NPU that ran in ggml-cpu (faults, refusals)
    plan_bytes: int = 0               # host bytes of the plans held now (their ggml contexts and work buffers)
    heap_trims: int = 0               # malloc_trim calls after freed buffers (host_budget.return_free_heap)

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
        the engine's own counters (``submits``, ``fusion_runs``, ``chained_submits``, ...)."""
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
        if self.host_repacked:
            lines.append(f"repacked host copies (ggml-cpu CPU_REPACK): {self.host_repacked} made, "
                         f"{self.host_repacked_bytes / 2**20:.1f} MiB now, {self.host_repack_refreshes} repacked again")
        if self.npu_matmuls_by_m:
            lines.append("NPU matmuls by rows M: " + ", ".join(
                f"M={m} {n}" for m, n in sorted(self.npu_matmuls_by_m.items())))
        if self.attention_npu_by_m or self.attention_host_runs:
            lines.append("attention matmuls on the NPU by rows M: " + ", ".join(
                f"M={m} {n}" for m, n in sorted(self.attention_npu_by_m.items()))
                + f"; {self.attention_host_runs} attention nodes fell back to ggml-cpu")
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
                f"{weights.evicted} evicted for NPU memory, {weights.evicted_budget} for the host cache budget, "
                f"{weights.evicted_staging} for live weights; "
                f"{weights.retired_now} retired now "
                f"({weights.retired_bytes / 2**20:.1f} MiB NPU), digests {weights.digest_seconds:.2f} s"
            )
        return out.getvalue() + "\n".join(line for line in lines if line) + "\n"
