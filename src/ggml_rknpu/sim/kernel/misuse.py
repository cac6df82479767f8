"""Misuses a real kernel lets pass: the simulated kernels answer as the real driver does and
record each one here, process-wide, because on a board it corrupts memory or loses a job in
silence (a MEM_SYNC past its buffer, a stale ``obj_addr`` the vendor driver dereferences, a
malformed rocket job dropped with SUBMIT returning 0). The tests fail on any record
(tests/conftest.py); a test that provokes one on purpose takes it with ``drain``. A process
whose environment names a file in ``LOG_ENV`` also appends each record there, so a test
learns of the misuses of the servers it runs as subprocesses (``logged``)."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

LOG_ENV = "RKNPU_MISUSE_LOG"


@dataclass(frozen=True)
class Misuse:
    """One call a real kernel accepts that a board would pay for."""

    abi: str
    ioctl: str
    what: str
    on_a_board: str  # what the real driver does with it

    def describe(self) -> str:
        return f"{self.abi} {self.ioctl}: {self.what} (on a board: {self.on_a_board})"


@dataclass(frozen=True)
class LoggedMisuse:
    """A misuse as ``LOG_ENV``'s file holds it: the recording process and the record."""

    pid: int
    misuse: Misuse


_LOCK = threading.Lock()
_RECORDED: list[Misuse] = []


def record(misuse: Misuse) -> None:
    with _LOCK:
        _RECORDED.append(misuse)
        path = os.environ.get(LOG_ENV)
        if path:   # one line in append mode: lines of several processes never interleave
            with open(path, "a", encoding="utf-8") as log:
                log.write(json.dumps({"pid": os.getpid(), **dataclasses.asdict(misuse)}) + "\n")


def drain() -> list[Misuse]:
    """Every misuse recorded since the last drain, oldest first; the record is then empty."""
    with _LOCK:
        out = list(_RECORDED)
        _RECORDED.clear()
    return out


def logged(path: Path, start: int = 0) -> tuple[list[LoggedMisuse], int]:
    """The misuses the log at ``path`` holds from byte ``start`` on (every process's, this one's
    too), and the offset where it ends; an absent log holds none."""
    try:
        data = path.read_bytes()[start:]
    except FileNotFoundError:
        return [], start
    end = start + data.rfind(b"\n") + 1          # a line still being written waits for the next read
    out = []
    for line in data[:end - start].decode("utf-8").splitlines():
        fields = json.loads(line)
        pid = fields.pop("pid")
        out.append(LoggedMisuse(pid, Misuse(**fields)))
    return out, end
