"""``ServerState``: what outlives a connection (the engine, the host backend, the device budget,
the shared weights, the counters), shared by every session under the device's turns; and
``SessionCounts``, the connection layer's own counters. Rendering them: ``report.py``."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from ggml_rknpu.engine.contract import MatmulEngine
from ggml_rknpu.libggml import lib as libggml
from ggml_rknpu.libggml.compute import Threads, default_threads
from ggml_rknpu.server.activations import ActivationRounding
from ggml_rknpu.server.board_memory import BoardMemory
from ggml_rknpu.server.buffers import DeviceBudget
from ggml_rknpu.server.live_weights import LiveWeights
from ggml_rknpu.server.memory_budget import MemoryBudget
from ggml_rknpu.server.placement_policy import Placer, placer_for
from ggml_rknpu.server.recovery import RecoveryStats
from ggml_rknpu.server.rpc.config import ServerConfig
from ggml_rknpu.server.stats import ServerStats
from ggml_rknpu.server.turns import Turns
from ggml_rknpu.server.weight_store import RetiredWeights, WeightStats


@dataclass
class SessionCounts:
    """Server-wide counts of the connection layer (``--stats-json`` "sessions")."""

    now: int = 0                      # connections being served
    peak: int = 0                     # most at once
    refused_at_accept: int = 0        # over --max-clients
    stalled: int = 0                  # dropped: no progress within a message (or a reply) for --stall-timeout
    too_slow: int = 0                 # dropped: a message (or a reply) past its deadline (--min-rate)
    idle_closed: int = 0              # dropped: idle between messages for --idle-timeout
    over_session_memory: int = 0      # ALLOC_BUFFERs refused by --session-memory


@dataclass
class ServerState:
    """What outlives a connection: the engine, the host backend, the device budget, the counters."""

    npu: MatmulEngine | None
    memory: DeviceBudget
    config: ServerConfig
    stats: ServerStats = field(default_factory=ServerStats)
    weight_stats: WeightStats = field(default_factory=WeightStats)
    retired: RetiredWeights | None = None
    host: libggml.Ggml = field(default_factory=libggml.load)   # loaded and ABI-checked at start
    board: BoardMemory = field(default_factory=BoardMemory)     # board accounting (after ggml is loaded)
    budget: MemoryBudget | None = None   # --memory-budget: NPU copies within the board bytes (None: unbounded)
    threads: Threads | None = None
    recovery: RecoveryStats = field(default_factory=RecoveryStats)
    faults: Any = None                # sim.faults.FaultInjector under --sim-faults (its counts are reported)
    activations: ActivationRounding | None = None   # shared by the sessions (used under a turn)
    placer: Placer | None = None      # the placement policy of the weight matmuls (None without an engine)
    turns: Turns = field(default_factory=Turns)     # the device's FIFO turns: all shared work below
    live: LiveWeights = field(default_factory=LiveWeights)   # staged copies in use, shared by content
    sessions: SessionCounts = field(default_factory=SessionCounts)
    counting: threading.Lock = field(default_factory=threading.Lock)   # the I/O counters, outside a turn
    stats_file: threading.Lock = field(default_factory=threading.Lock)   # --stats-json, written by any session

    def __post_init__(self) -> None:
        if self.config.weight_reuse and self.npu is not None and self.retired is None:
            retired = self.retired = RetiredWeights(self.weight_stats, self.config.retired_budget)
            self.memory.reclaimable = lambda: retired.npu_bytes
        if self.activations is None:
            self.activations = ActivationRounding(self.host, self.config.activations)
        if self.threads is None:
            self.threads = Threads(self.host, self.config.threads or default_threads())
        if self.placer is None and self.npu is not None:
            self.placer = placer_for(self.npu, self.config.placement, self.config.weight_format,
                                     self.config.host_threads or self.config.threads, self.config.host_repack,
                                     self.config.placement_split)

    def close(self) -> None:
        """Free the retired weights and the host threadpool (server exit)."""
        if self.retired is not None:
            self.retired.clear()
        if self.threads is not None:
            self.threads.close()
