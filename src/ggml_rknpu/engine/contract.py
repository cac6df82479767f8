"""``MatmulEngine``: what the server, the weight store and the graph planner may ask of an
engine. ``engine.NpuEngine`` (our compiler and driver), ``rknn.RknnEngine`` (the vendor runtime)
and the test fakes implement it.

Invariants: a weight handle is used only with the engine that returned it and until its
``free()``; NPU memory running out is ``OutOfMemory`` (the store frees and retries), every
other failure of a matmul is an ordinary exception (that weight falls back to the host);
every engine runs a step's weights as an ``EngineFusion`` (``plan_fusion``: its own, or one
matmul for an engine that cannot fuse).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from ggml_rknpu.kernel.errors import NpuOutOfMemory

OutOfMemory = NpuOutOfMemory


class EngineWeight(Protocol):
    """A weight resident for an engine: shape (N, K), its dtype and size, released by ``free``."""

    @property
    def shape(self) -> tuple[int, int]: ...

    @property
    def dtype(self) -> str: ...

    @property
    def packed_bytes(self) -> int:
        """NPU bytes the weight holds in its native layout."""
        ...

    def free(self) -> None: ...


class MatmulTiming(Protocol):
    """Device seconds of the last matmul and how they were obtained ("measured",
    "modeled" or "unknown"); None when no figure exists."""

    @property
    def device_s(self) -> float | None: ...

    @property
    def device_label(self) -> str: ...


class MatmulEngine(Protocol):
    counters: dict[str, int]

    @property
    def last_timing(self) -> MatmulTiming | None: ...

    def describe(self) -> str:
        """Which device runs the matmuls, for logs (e.g. "rknpu (simulated)")."""
        ...

    def upload_weight(self, b: np.ndarray, dtype: str = "fp16") -> EngineWeight:
        """Stage ``b`` [N, K] (float32) in ``dtype`` ("fp16" | "int8"); may raise OutOfMemory."""
        ...

    def matmul(self, a: np.ndarray, w: EngineWeight, *, out: str | None = None) -> np.ndarray:
        """``a`` [M, K] times ``w`` (a weight this engine's ``upload_weight`` returned: TypeError
        for any other) -> [M, N]."""
        ...

    def memory_budget(self) -> tuple[int, int]:
        """(free, total) bytes of NPU memory as far as this engine can tell."""
        ...

    def reset(self) -> Sequence[EngineWeight] | None:
        """Reset the NPU after a faulted run: the weights whose NPU copy the reset destroyed
        (re-stage them), or None when this engine has no reset (nothing was done)."""
        ...

    def close(self) -> None: ...


class EngineFusion(Protocol):
    """A fusion, planned once by ``FusingEngine.fuse``: several resident weights that
    read one activation, run as one submit. ``closed`` once one of its weights is freed."""

    closed: bool

    def run(self, a: np.ndarray, outs: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """``a`` [M, K] (M up to the planned rows) -> one [M, N_i] result per weight, written
        into ``outs`` (one float32 [M, N_i] array per weight) when given. Sets the engine's
        ``last_timing`` for the whole fusion, as ``matmul`` does for one call."""
        ...

    def close(self) -> None: ...


class FusingEngine(MatmulEngine, Protocol):
    """An engine that can run sibling matmuls as one submit (``engine.NpuEngine``; the vendor
    runtime cannot)."""

    def fuse(self, weights: Sequence[EngineWeight], m: int = 1, *, out: str | None = None) -> EngineFusion: ...


def fusing(engine: MatmulEngine | None) -> FusingEngine | None:
    """``engine`` if it can plan fusions, else None: the one capability check."""
    return engine if engine is not None and callable(getattr(engine, "fuse", None)) else None  # type: ignore[return-value]


class OneMatmul:
    """A one-weight ``EngineFusion`` over an engine that cannot fuse (the vendor runtime):
    ``run`` is its ``matmul``, the result copied into ``outs``."""

    def __init__(self, engine: MatmulEngine, weight: EngineWeight) -> None:
        self.engine, self.weight, self.closed = engine, weight, False

    def run(self, a: np.ndarray, outs: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        c = self.engine.matmul(a, self.weight)
        if outs is None:
            return [c]
        np.copyto(outs[0][: c.shape[0]], c, casting="same_kind")
        return [outs[0][: c.shape[0]]]

    def close(self) -> None:
        self.closed = True


def plan_fusion(engine: MatmulEngine, weights: Sequence[EngineWeight], rows: int) -> EngineFusion:
    """``weights`` applied to one activation of up to ``rows`` rows, as ``engine`` runs them:
    its own fusion, or (one weight, an engine that cannot fuse) its ``matmul``."""
    fuser = fusing(engine)
    if fuser is not None:
        return fuser.fuse(weights, rows)
    if len(weights) != 1:
        raise ValueError(f"{engine.describe()} plans no fusions")
    return OneMatmul(engine, weights[0])
