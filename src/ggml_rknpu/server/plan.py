"""``GraphPlan``: a received graph ready to replay, its steps in the client's order.

Invariants: a replay runs the index checks no node of the plan writes, then every step
through its own ``run``, with no parsing and no decisions; the plan owns the ggml context
its segments point into and frees it at ``close``. Why: docs/decisions.md "server/planner.py"."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ggml_rknpu.libggml.compute import HostContext
from ggml_rknpu.server.plan_steps import IndexCheck, NpuGroup, ReplayStep, add_counts
from ggml_rknpu.server.stats import OpCounter, ServerStats


@dataclass(eq=False)
class GraphPlan:
    """A received graph, ready to replay: host segments and NPU steps in the client's order.

    Owns the ggml context its segments point into (``host``); ``close`` frees it, and the
    plan is closed whenever the graphs of its connection are dropped (FREE_BUFFER, disconnect)."""

    dev: int
    digest: bytes
    steps: tuple[ReplayStep, ...]
    host: HostContext
    n_nodes: int
    n_views: int
    checks: list[IndexCheck] = field(default_factory=list)   # indices no node of the plan writes
    counts: list[tuple[OpCounter, int, int]] = field(default_factory=list)   # its segments', per replay
    groups: list[NpuGroup] = field(default_factory=list)   # the steps holding chained fusions (released at close)
    runs: int = 0
    stats: ServerStats | None = None     # counts ``nbytes`` in ``plan_bytes`` until the plan is closed
    nbytes: int = 0                      # host bytes of its ggml context and work buffer

    def __post_init__(self) -> None:
        if self.stats is not None:
            self.nbytes = self.host.nbytes
            self.stats.plan_bytes += self.nbytes

    def execute(self, stats: ServerStats) -> None:
        start = time.perf_counter()
        for check in self.checks:
            check.check()
        for step in self.steps:
            step.run(stats)
        add_counts(self.counts)
        self.runs += 1
        stats.execute_seconds += time.perf_counter() - start
        stats.graph_runs += 1
        stats.view_nodes += self.n_views

    def close(self) -> None:
        for group in self.groups:
            group.drop()
        self.groups = []
        self.steps = ()
        self.host.close()
        if self.stats is not None:
            self.stats.plan_bytes -= self.nbytes
        self.nbytes = 0
