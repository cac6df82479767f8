"""What an NPU matmul step does when its NPU run fails: reset, retry once, else the host.

Invariants: a step's NPU run goes through ``NpuRecovery.run`` (or its inlined copy in
``plan_steps.NpuStep.run``), which hands a failure to ``failed``, and this module holds the
whole policy; a *fault* (timeout, EFAULT, or
``engine.canary.StaleOutput``, whose reset the engine has already done, so it is not done
twice) resets the NPU and re-stages what the reset destroyed, retries once, and then
computes the step on the host, so the graph completes with the right result; a weight is
demoted for good only after ``DEMOTE_AFTER`` faulted attempts in a row; anything that is
not a fault keeps ``WeightStore.matmul_failed``'s policy. How: docs/faults.md "Recovery";
why: docs/decisions.md "server/recovery.py"."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from ggml_rknpu.engine.canary import StaleOutput
from ggml_rknpu.engine.contract import MatmulEngine
from ggml_rknpu.kernel.errors import NpuFault, NpuTimeout
from ggml_rknpu.server.weight_store import WeightSlot, WeightStore

log = logging.getLogger("ggml_rknpu.rpc")

# Faulted NPU attempts in a row on one weight (four steps that each failed twice). At 4, random
# faults at 0.2 per submit demoted a weight of a tiny model within 8 tokens (tests/e2e/test_e2e_faults.py);
# 0.2^8 makes that negligible while a weight that always faults costs four steps' resets.
DEMOTE_AFTER = 8
# By what the kernel and the engine report: a job timeout (ETIMEDOUT: a hang, a dead core, and on
# both drivers a DMA fault too, which they know only as a timeout), output a job left unwritten
# (the canaries), and any other NpuFault (EFAULT: a bad address the kernel refused).
FAULT_KINDS = ((StaleOutput, "stale"), (NpuTimeout, "timeout"), (NpuFault, "fault"))


def fault_kind(exc: BaseException) -> str | None:
    """"timeout" | "fault" | "stale" for an NPU fault, None for any other failure."""
    for cls, kind in FAULT_KINDS:
        if isinstance(exc, cls):
            return kind
    return None


@dataclass
class RecoveryStats:
    """Server-wide counters (``--stats-json`` "recovery")."""

    faults: dict[str, int] = field(default_factory=lambda: {kind: 0 for _, kind in FAULT_KINDS})
    resets: int = 0                  # NPU resets after faults (one per fault: the engine's own after stale output)
    retries: int = 0                 # second NPU attempts
    retried_ok: int = 0              # ... that succeeded
    host_fallbacks: int = 0          # steps computed on the host after two faulted attempts
    restaged: int = 0                # weights re-staged after a reset destroyed them
    demoted: int = 0                 # weights sent to the host for good after repeated faults

    def as_dict(self) -> dict:
        return asdict(self)

    def render(self) -> str:
        faults = ", ".join(f"{k} {n}" for k, n in self.faults.items())
        return (f"NPU faults: {faults}; resets {self.resets}, retries {self.retries} ({self.retried_ok} ok), "
                f"host fallbacks {self.host_fallbacks}, re-staged {self.restaged}, demoted {self.demoted}")


class NpuRecovery:
    """The fault policy for one connection's NPU matmul steps (stats shared server-wide):
    ``engine`` is only reset here, ``weights`` re-staged or demoted."""

    def __init__(self, engine: MatmulEngine | None, weights: WeightStore, stats: RecoveryStats) -> None:
        self._engine = engine
        self._weights = weights
        self.stats = stats
        self._streak: weakref.WeakKeyDictionary[WeightSlot, int] = weakref.WeakKeyDictionary()

    def run(self, slot: WeightSlot, attempt: Callable[[], bool]) -> bool:
        """``attempt()`` (one NPU run of ``slot``'s weight: False when it is not resident, so
        nothing ran) behind the policy: True once a run succeeded, False: the caller runs
        the step on the host."""
        try:
            ran = attempt()
        except Exception as exc:
            return self.failed(slot, exc, attempt)
        if ran:
            self.succeeded(slot)
        return ran

    def succeeded(self, slot: WeightSlot) -> None:
        """An NPU run of ``slot`` succeeded: its fault streak ends."""
        if self._streak:   # a fault streak to end (WeakKeyDictionary.pop costs ~0.6 us a step)
            self._streak.pop(slot, None)

    def failed(self, slot: WeightSlot, exc: BaseException, attempt: Callable[[], bool]) -> bool:
        """An NPU run of ``slot`` raised ``exc``: a fault is counted, the NPU reset and what it
        destroyed re-staged, and ``attempt`` retried once; anything else keeps
        ``WeightStore.matmul_failed``'s policy. True when the retry succeeded, False: the
        caller runs the step on the host."""
        kind = fault_kind(exc)
        if kind is None:
            self._weights.matmul_failed(slot, exc)
            return False
        if not self._recover(slot, kind, exc) or self._weights.weight(slot) is None:
            return False
        self.stats.retries += 1
        try:
            ran = attempt()
        except Exception as again:
            kind = fault_kind(again)
            if kind is None:
                self._weights.matmul_failed(slot, again)
            elif self._recover(slot, kind, again):
                self.stats.host_fallbacks += 1
            return False
        if ran:
            self.succeeded(slot)
            self.stats.retried_ok += 1
        return ran

    def group_failed(self, what: str, exc: BaseException) -> None:
        """A grouped step (several matmuls in one submit, ``plan_steps.NpuGroup``) failed; its
        members run one by one next, each behind ``run``. A fault is counted and the NPU
        reset as for a matmul, so the members' attempts start fresh; anything else is logged."""
        if not self.pass_failed(f"the grouped step {what} (its matmuls run one by one this time)", exc):
            log.warning("grouped NPU step %s failed (%s: %s); its matmuls run one by one this time",
                        what, type(exc).__name__, exc)

    def pass_failed(self, what: str, exc: BaseException) -> bool:
        """An NPU run of ``what`` failed: True for a fault (counted, the NPU reset, so a retry
        starts fresh), False for anything else (nothing done: the caller's policy)."""
        kind = fault_kind(exc)
        if kind is None:
            return False
        self.stats.faults[kind] += 1
        log.warning("NPU %s in %s: %s", kind, what, exc)
        self._reset(exc)
        return True

    def _recover(self, slot: WeightSlot, kind: str, exc: BaseException) -> bool:
        """Count, reset, re-stage; False once the weight is demoted for good."""
        self.stats.faults[kind] += 1
        streak = self._streak.get(slot, 0) + 1
        self._streak[slot] = streak
        log.warning("NPU %s in a matmul with '%s' (%d in a row): %s", kind, slot.name, streak, exc)
        self._reset(exc)
        if streak >= DEMOTE_AFTER:
            self._streak.pop(slot, None)
            self.stats.demoted += 1
            self._weights.demote(slot, f"{streak} NPU faults in a row, a reset in between each (last: {kind}: {exc})")
            return False
        return True

    def _reset(self, exc: BaseException) -> None:
        """The NPU reset after ``exc``: the engine's own (stale output) or one done here."""
        lost = exc.lost if isinstance(exc, StaleOutput) else None
        if lost is None:
            if self._engine is None:
                return
            try:
                lost = self._engine.reset()
            except Exception as err:   # the reset itself failed: the retry will tell whether the NPU is back
                log.error("NPU reset failed: %s", err)
                return
            if lost is None:       # this engine has no reset
                return
        self.stats.resets += 1
        lost_ids = {id(h) for h in lost or ()}
        if lost_ids:
            self.stats.restaged += self._weights.restage(lambda handle: id(handle) in lost_ids)
