"""Many short mutated sessions against one server on the simulated NPU leave nothing behind
that grows (the sessions: ``support/session_churn.py``, run as a process of its own so that
RSS is the server's, not the test runner's).

What must hold: the retired copies stay within their budget, only sessions that ended with a
goodbye at a message boundary retire their weights (a hostile client cannot fill the cache),
the kernel saw no misuse, and RSS after the last session is within 10% of RSS after the
warm-up (the first tenth, at most the first thousand: the retired copies reach their budget
there). No malloc_trim: the server does not do it either. The short version runs in CI
(~10 s on the 2-core x86 box); the long one (20 000 sessions, ``RKNPU_SESSIONS_SLOW``) is slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
CHURN = TESTS / "support" / "session_churn.py"
BUDGET = 512 << 10                           # retired copies (128 KiB each): full within the warm-up
GROWTH_MAX = 4 << 20                         # one-off growth allowed after the warm-up (see below)


def _run(n: int, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(TESTS), os.environ.get("PYTHONPATH"))))}
    res = subprocess.run([sys.executable, str(CHURN), str(n), str(BUDGET)], env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.splitlines()[-1])


def _check(out: dict, n: int) -> None:
    w = out["weights"]
    assert out["alive_warm"] and out["alive_last"]
    assert not out["misuse"], out["misuse"]
    assert 0 < w["retired_bytes"] <= BUDGET and w["evicted_budget"] + w["evicted_staging"] > 0
    assert n // 3 <= w["retired"] <= n - n // 3            # the truncated sessions retired nothing
    assert w["staged"] == 0 and out["allocated"] == 0
    warm, last = out["rss_warm"], out["rss_last"]
    print(f"RSS after the warm-up {warm / 2**20:.1f} MiB, after {n} sessions {last / 2**20:.1f} MiB")
    assert last <= warm * 1.10, f"RSS {warm >> 20} -> {last >> 20} MiB over {n} sessions"


@pytest.mark.timeout(600)
def test_short_mutated_sessions_keep_memory_flat():
    n = int(os.environ.get("RKNPU_SESSIONS_SHORT", "300"))
    out = _run(n, 500)
    _check(out, n)
    # tighter than the 10% rule for this short run. A weight copy kept per session (128 KiB in
    # fp16, twice that in the simulator's two views) would add 35-70 MiB over the 270 sessions
    # after the warm-up; allocator noise in a process of its own: up and down by 1-2 MiB over
    # 3000 sessions, no trend (measured on the 2-core x86 box).
    assert out["rss_last"] - out["rss_warm"] <= GROWTH_MAX, f"RSS grew {(out['rss_last'] - out['rss_warm']) >> 10} KiB"


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_twenty_thousand_mutated_sessions_keep_memory_flat():
    n = int(os.environ.get("RKNPU_SESSIONS_SLOW", "20000"))
    _check(_run(n, 7000), n)
