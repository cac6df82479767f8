"""``Submitter``: every submit of the engine, and the canaries around a bound program's.

Invariants: each job goes through ``NpuDevice.submit`` once, counted, its timeout named
after what it ran; a bound program's canaries are armed before its jobs and checked after
them, and output left unwritten resets the NPU and raises ``StaleOutput`` (the caller computes
those matmuls on the host). Why: docs/decisions.md "engine/canary.py"."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NoReturn

import numpy as np

from ggml_rknpu.engine.bound_program import BoundProgram
from ggml_rknpu.engine.canary import CanaryCells, StaleOutput
from ggml_rknpu.engine.contract import EngineWeight
from ggml_rknpu.kernel.device import NpuDevice
from ggml_rknpu.kernel.errors import NpuError, NpuTimeout
from ggml_rknpu.kernel.job import Completion, Job


class Submitter:
    """Submits of one engine; ``reset`` resets the NPU after a fault and returns what it destroyed."""

    def __init__(self, device: NpuDevice, counters: dict[str, int], reset: Callable[[], Sequence[EngineWeight]]) -> None:
        self.device, self.counters, self.reset = device, counters, reset
        self.last_canary_s = 0.0   # host seconds arming and checking the last bound program's canaries

    def submit(self, job: Job, what: str) -> Completion:
        """One job on the device: its completion; a timeout names ``what``."""
        try:
            completion = self.device.submit(job)
        except NpuTimeout as exc:
            raise NpuTimeout(f"{what} timed out on the NPU: {exc}", exc.errno) from exc
        self.counters["submits"] += 1
        return completion

    def run_bound(self, bound: BoundProgram) -> tuple[Completion, int | None]:
        """Run a bound program (``run`` of its jobs), its canaries bound to the current C scratch
        buffer (re-bound when the shared buffer was replaced by a larger one)."""
        assert bound.jobs and bound.canaries is not None and bound.c_buf is not None, "not bound yet"
        cells = bound.cells
        if cells is None or bound.cells_bound_to is not bound.c_buf.scratch.buf:
            cells = bound.cells = bound.canaries.over(bound.c_buf.array(np.uint8))
            bound.cells_bound_to = bound.c_buf.scratch.buf
        return self.run(bound.jobs, cells, bound.label)

    def run(self, jobs: tuple[Job, ...], cells: CanaryCells, what: str) -> tuple[Completion, int | None]:
        """``jobs`` in order with their canaries armed before and checked after (stale output ->
        reset + StaleOutput, an NpuFault): (last completion, summed hw_elapsed_ns or None)."""
        t0 = time.perf_counter()
        cells.arm()
        t1 = time.perf_counter()
        hw_ns: int | None = 0
        for job in jobs:
            completion = self.submit(job, what)
            hw_ns = None if completion.hw_elapsed_ns is None or hw_ns is None else hw_ns + completion.hw_elapsed_ns
        t2 = time.perf_counter()
        unwritten = cells.unwritten()
        self.last_canary_s = t1 - t0 + time.perf_counter() - t2
        if unwritten:
            self.stale_output(f"{what}: {unwritten} output canar{'y' if unwritten == 1 else 'ies'} left unwritten "
                              f"after {len(jobs)} submit(s): a task did not finish (rocket: job killed at its "
                              "500 ms timeout?)")
        return completion, hw_ns

    def stale_output(self, what: str) -> NoReturn:
        """A submit left canaries unwritten: reset where the driver lets us (rocket resets a core
        itself after a job timeout) and raise StaleOutput carrying what the reset destroyed, so
        the caller computes on the host and does not reset a second time."""
        self.counters["npu_faults"] += 1
        try:
            lost: Sequence[EngineWeight] | None = self.reset()
        except NpuError:
            lost = None
        raise StaleOutput(f"{what}; " + ("the NPU was reset, compute it on the host" if lost is not None
                                         else "resetting the NPU failed"), lost=lost)
