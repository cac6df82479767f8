"""``EngineParts``: what one ``NpuEngine`` is made of, and all that a fusion
(``engine.fusion.Fusion``) may use of it: the device, memory, bound programs, the reset,
counters, the last run's timing.

Invariants: one set of parts per engine, shared by the engine and its fusions; a fusion never
reaches into the engine itself. Why: docs/decisions.md "engine/api.py"."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ggml_rknpu.engine.memory import NpuMemory
from ggml_rknpu.engine.programs import ProgramCache
from ggml_rknpu.engine.timing import Timing
from ggml_rknpu.kernel.device import NpuDevice

if TYPE_CHECKING:
    from ggml_rknpu.engine.npu_weight import Weight


@dataclass(eq=False)
class EngineParts:
    """The device, the memory, the program cache, the reset and the counters of one ``NpuEngine``.

    ``reset`` resets the NPU after a fault and returns the weights it destroyed."""

    device: NpuDevice
    memory: NpuMemory
    programs: ProgramCache
    reset: Callable[[], Sequence[Weight]]
    counters: dict[str, int]
    last_timing: Timing | None = None      # of the last fusion run (``NpuEngine.matmul``'s too)
