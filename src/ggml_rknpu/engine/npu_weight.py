"""``Weight`` and ``FusedWeight``: weights resident in NPU memory for one ``NpuEngine``, with the
programs bound for them and the fusions that run them.

Invariants: a weight's packed bytes are written once, at upload; ``free`` closes the fusions
using it and releases its programs and its buffer, once. Why: docs/decisions.md
"engine/api.py"."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ggml_rknpu.engine.memory import Headroom
from ggml_rknpu.engine.staging import ResidentWeight, StagedWeight
from ggml_rknpu.kernel.buffer import Buffer

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np

    from ggml_rknpu.engine.bound_program import BoundProgram

MAX_PROGRAM_M = 2048


class LiveFusion(Protocol):
    """A fusion running a weight (``engine.fusion.Fusion``), closed when the weight is freed."""

    def run(self, a: np.ndarray, outs: Sequence[np.ndarray] | None = None) -> list[np.ndarray]: ...

    def close(self) -> None: ...


class Weight(ResidentWeight):
    """A weight resident in NPU memory in its native layout. ``shape`` is (N, K)."""

    def __init__(self, owner: object, forget: Callable[[Weight], None], staged: StagedWeight, buffer: Buffer,
                 packed_bytes: int, headroom: Headroom | None) -> None:
        self.owner = owner            # the engine that uploaded it (its weights only work there)
        self._forget = forget
        self.staged = staged
        self.buffer = buffer
        self.packed_bytes = packed_bytes
        self.programs: dict[tuple[int, str], BoundProgram] = {}
        self.max_program_m = MAX_PROGRAM_M   # lowered if the compiler refuses a bucket
        self.compile_errors: list[str] = []
        self.headroom = headroom      # what its programs need (None: no cap and one domain at upload)
        self.fusions: weakref.WeakSet[LiveFusion] = weakref.WeakSet()   # the live fusions running it
        self.matmul_fusions: dict[str, LiveFusion] = {}   # ``NpuEngine.matmul``'s own, by output type
        self.freed = False

    def free(self) -> None:
        """Release the weight and every program compiled for it (idempotent)."""
        if self.freed:
            return
        for fusion in list(self.fusions):
            fusion.close()
        self.matmul_fusions.clear()
        self._forget(self)
        for bound in self.programs.values():
            bound.close()
        self.programs.clear()
        self.buffer.close()
        self.freed = True

    @property
    def domain(self) -> int:
        """The IOMMU domain it is resident in: its programs, scratch and jobs are there too."""
        return self.buffer.domain

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"{len(self.programs)} programs"
        return f"Weight(N={self.shape[0]}, K={self.shape[1]}, {self.dtype}, {state})"


class FusedWeight(Weight):
    """Sibling weights concatenated by rows into one resident weight (``NpuEngine.upload_fused_weight``);
    ``splits[i]`` = (n0, n1), sibling i's output columns."""

    splits: tuple[tuple[int, int], ...] = ()

    def __repr__(self) -> str:
        return "Fused" + super().__repr__()[:-1] + f", siblings N={[n1 - n0 for n0, n1 in self.splits]})"
