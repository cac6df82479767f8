"""A process's memory figures from /proc/PID/status (measured, Linux), for the memory tests and
the test-backend-ops table."""

from __future__ import annotations


def status_bytes(field: str, pid: int | str = "self") -> int | None:
    """``field`` (VmRSS, VmHWM, RssAnon, ...) of ``pid`` in bytes, or None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{field}:"))
    except (OSError, StopIteration):
        return None
