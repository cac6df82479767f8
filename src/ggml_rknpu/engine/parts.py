"""``EngineParts``: what one ``Npu`` is made of, and all that a fusion
(``engine.fusion.Fusion``) may use of it: memory, bound programs, submits, counters.

Invariants: one set of parts per engine, shared by the engine and its fusions; a fusion never
reaches into the engine itself. Why: docs/decisions.md "engine/api.py"."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ggml_rknpu.engine.memory import NpuMemory
from ggml_rknpu.engine.programs import ProgramCache
from ggml_rknpu.engine.submission import Submitter
from ggml_rknpu.engine.timing import Timing

if TYPE_CHECKING:
    from ggml_rknpu.engine.npu_weight import Weight


class LiveFusion(Protocol):
    """A fusion holding resident weights (closed when one of them is freed)."""

    weights: tuple[Weight, ...]

    def close(self) -> None: ...


@dataclass(eq=False)
class EngineParts:
    """The memory, the program cache, the submitter and the counters of one ``Npu``."""

    memory: NpuMemory
    programs: ProgramCache
    submitter: Submitter
    counters: dict[str, int]
    fusions: set[LiveFusion] = field(default_factory=set)   # live fusions (engine.fusion)
    last_timing: Timing | None = None                    # of the last matmul or fusion run
