"""The check behind every test (tests/conftest.py): no kernel misuse (``sim.kernel.misuse``)
since the last check, made in the test process or in any process it started (servers,
tools), which append theirs to the session's log (``misuse.LOG_ENV``)."""

from __future__ import annotations

import os
from pathlib import Path

from ggml_rknpu.sim.kernel import misuse

_log_read = 0   # how far the session's misuse log has been checked


def assert_no_misuse() -> None:
    """Fail on any kernel misuse recorded since the last check: in this process (the record is
    then empty) or in a subprocess, from the session's misuse log (read up to its end)."""
    global _log_read
    left = [m.describe() for m in misuse.drain()]
    path = os.environ.get(misuse.LOG_ENV)
    if path:
        logged, _log_read = misuse.logged(Path(path), _log_read)
        left += [f"{m.misuse.describe()} [subprocess {m.pid}]" for m in logged if m.pid != os.getpid()]
    assert not left, "kernel misuse a board would pay for:\n" + "\n".join(left)
