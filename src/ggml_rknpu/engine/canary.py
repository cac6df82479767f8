"""Canaries: detect NPU output that was never written, so a fault costs time, never a wrong
result.

Invariants: before a submit, the last output row of every task, in every output plane it
writes, holds a value the NPU cannot produce (int32: INT32_MIN; fp32/fp16: a
signalling-NaN payload); after it, any such value left raises ``StaleOutput`` (an
``NpuFault``). Which atoms is read from each task's own words, so it holds whatever the
tiling does. Why, the cost and why the values are impossible: docs/decisions.md
"engine/canary.py" and docs/envelope.md."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from ggml_rknpu.hw import limits
from ggml_rknpu.hw.alignment import ceil_div
from ggml_rknpu.hw.envelope import decode_task
from ggml_rknpu.kernel.errors import NpuError, NpuFault

if TYPE_CHECKING:
    from ggml_rknpu.compiler.program import Program
    from ggml_rknpu.engine.contract import EngineWeight

_ATOM = limits.ATOM_BYTES
# canary element, as the unsigned integer of the output element's width
PATTERN: dict[str, np.generic] = {"int32": np.uint32(0x8000_0000), "fp32": np.uint32(0x7FBA_DBAD), "fp16": np.uint16(0x7DBA)}


class StaleOutput(NpuFault):
    """The submits reported success but a canary survived: a task never wrote its output.

    The engine resets the NPU before raising this; ``lost`` is what that reset returned (the
    weights it destroyed), or None when the engine did not reset and the caller must."""

    def __init__(self, message: str, lost: Sequence[EngineWeight] | None = None) -> None:
        super().__init__(message)
        self.lost = lost


def raise_stale(counters: dict[str, int], reset: Callable[[], Sequence[EngineWeight] | None], what: str) -> NoReturn:
    """A submit left canaries unwritten: count the fault, reset where the driver lets us (rocket
    resets a core itself after a job timeout) and raise StaleOutput carrying what the reset
    destroyed, so the caller computes on the host and does not reset a second time."""
    counters["npu_faults"] += 1
    try:
        lost = reset()
    except NpuError:
        lost = None
    raise StaleOutput(f"{what}; " + ("the NPU was reset, compute it on the host" if lost is not None
                                     else "resetting the NPU failed"), lost=lost)


@dataclass(frozen=True, eq=False)
class Canaries:
    """The output elements one program's canaries occupy: the first element of each canary
    atom, as indices into the C buffer viewed as unsigned integers of the output width."""

    elements: np.ndarray   # int64 element indices
    pattern: np.generic    # np.uint32 or np.uint16

    @classmethod
    def for_program(cls, program: Program) -> Canaries:
        atoms = []
        out = None
        for task in program.tasks:
            t = decode_task(program.words[task.word_offset: task.word_offset + task.body_words])
            out = t.out_dtype
            plane_atoms = t.plane_rows * max(t.width, 1)
            first = t.c_offset // _ATOM + (t.rows * max(t.width, 1) - 1)
            planes = ceil_div(t.kernels, limits.c2(t.out_dtype))
            atoms.append(first + plane_atoms * np.arange(planes, dtype=np.int64))
        if out not in PATTERN:
            raise ValueError(f"no canary value for output precision {out!r}")
        pattern = PATTERN[out]
        return cls(np.concatenate(atoms) * (_ATOM // pattern.itemsize), pattern)

    def at(self, byte_offset: int) -> Canaries:
        """The same canaries for a C region that starts ``byte_offset`` bytes into a larger
        buffer (a chained fusion's members share one)."""
        width = self.pattern.itemsize
        if byte_offset % width:
            raise ValueError(f"a C region offset must be a multiple of {width} bytes, got {byte_offset}")
        return Canaries(self.elements + byte_offset // width, self.pattern)

    @classmethod
    def combined(cls, parts: list[Canaries]) -> Canaries:
        """The canaries of several programs over one buffer, armed and checked as one."""
        patterns = {(p.pattern.dtype, int(p.pattern)) for p in parts}
        if len(patterns) != 1:
            raise ValueError("combined canaries need one output precision")
        return cls(np.concatenate([p.elements for p in parts]), parts[0].pattern)

    def over(self, c_bytes: np.ndarray) -> CanaryCells:
        """These canaries bound to the bytes of one C buffer (views made once)."""
        return CanaryCells(self, c_bytes)

    def cells(self, c_bytes: np.ndarray) -> np.ndarray:
        """The C buffer's bytes as atoms of the canary's precision, the canaries' index space."""
        flat = c_bytes.reshape(-1)
        width = self.pattern.itemsize
        return flat[: flat.size // width * width].view(self.pattern.dtype)

    def arm(self, c_bytes: np.ndarray) -> None:
        """Write the canaries into the (CPU view of the) C buffer before a submit."""
        self.cells(c_bytes)[self.elements] = self.pattern

    def unwritten(self, c_bytes: np.ndarray) -> int:
        """How many canary atoms the NPU left untouched (0: every task finished)."""
        return int(np.count_nonzero(self.cells(c_bytes)[self.elements] == self.pattern))


class CanaryCells:
    """Canaries bound to one buffer's bytes: ``arm`` and ``unwritten`` are one vectorised
    store and one vectorised compare over views made once (per bound buffer, not per call)."""

    __slots__ = ("canaries", "_cells", "_elements", "_pattern")

    def __init__(self, canaries: Canaries, c_bytes: np.ndarray) -> None:
        self.canaries = canaries
        self._cells = canaries.cells(c_bytes)
        if canaries.elements.size and int(canaries.elements.max()) >= self._cells.size:
            raise ValueError("the canaries lie beyond the buffer they are bound to")
        self._elements, self._pattern = canaries.elements, canaries.pattern

    def arm(self) -> None:
        """Write the canaries into the (CPU view of the) buffer before a submit."""
        self._cells[self._elements] = self._pattern

    def unwritten(self) -> int:
        """How many canary atoms the NPU left untouched (0: every task finished)."""
        return int(np.count_nonzero(self._cells[self._elements] == self._pattern))
