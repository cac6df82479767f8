"""Misuses a real kernel lets pass: the simulated kernels answer as the real driver does and
record each one here, process-wide, because on a board it corrupts memory or loses a job in
silence (a MEM_SYNC past its buffer, a stale ``obj_addr`` the vendor driver dereferences, a
malformed rocket job dropped with SUBMIT returning 0). The tests fail on any record
(tests/conftest.py); a test that provokes one on purpose takes it with ``drain``."""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Misuse:
    """One call a real kernel accepts that a board would pay for."""

    abi: str
    ioctl: str
    what: str
    on_a_board: str  # what the real driver does with it

    def describe(self) -> str:
        return f"{self.abi} {self.ioctl}: {self.what} (on a board: {self.on_a_board})"


_LOCK = threading.Lock()
_RECORDED: list[Misuse] = []


def record(misuse: Misuse) -> None:
    with _LOCK:
        _RECORDED.append(misuse)


def drain() -> list[Misuse]:
    """Every misuse recorded since the last drain, oldest first; the record is then empty."""
    with _LOCK:
        out = list(_RECORDED)
        _RECORDED.clear()
    return out
