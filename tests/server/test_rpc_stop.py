"""Stopping ``rknpu serve`` with SIGTERM / SIGINT never frees a ggml context twice.

CPython runs a Python signal handler in the main thread as the ctypes call that was running
when the signal came returns. The server once raised SystemExit from its SIGTERM handler;
landing right after the ``ggml_free`` of a plan's context (a FREE_BUFFER or a disconnect
closes the plans), it left the handle set, the unwinding session closed the plan again and
glibc aborted the server with "double free or corruption (!prev)" (seen once in CI, in the
e2e tests, which SIGTERM the server as soon as their client is done). The first signal now
hangs up on the client and lets the session end on its own path; a second one exits at once,
and every native handle is taken from its owner before it is freed (libggml.compute).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ggml_rknpu.libggml.enums import GgmlOp
from support.matmul_graph import f32
from support.rpc_testkit import RpcClient, wait_for_line

pytestmark = pytest.mark.timeout(120)
DRIVER = Path(__file__).resolve().parents[1] / "support" / "serve_signal_in_free.py"
ADD = int(GgmlOp.ADD)


def _computed_then_freed(port: int) -> RpcClient:
    """A client that ran one ADD graph (a plan with its ggml context), checked it, then freed
    the buffer: the FREE_BUFFER closes the plan, whose ggml_free gets the signal."""
    c = RpcClient(port)
    h, b = c.alloc_base(3 * 4096)
    x = f32(h, b, 256, 4, name="x")
    y = f32(h, b + 4096, 256, 4, name="y")
    out = f32(h, b + 8192, 256, 4, op=ADD, src=(x.id, y.id), name="x+y")
    xv = np.arange(1024, dtype=np.float32).reshape(4, 256)
    c.set_array(x, xv)
    c.set_array(y, np.ones_like(xv))
    c.graph_compute([out], [x, y, out])
    np.testing.assert_array_equal(c.get_array(out).reshape(4, 256), xv + 1)
    c.free(h)
    return c


@pytest.mark.parametrize("signame,count", [("SIGTERM", 1), ("SIGINT", 1), ("SIGTERM", 2)])
def test_a_stop_signal_during_a_plan_free_frees_it_once(tmp_path: Path, signame: str, count: int) -> None:
    """The signal lands as the plan's ggml_free returns, with the client still connected: the
    context is freed once, the server exits 0 with its counters written; one signal hangs up
    on the client and says so, two exit at once (still freeing nothing twice)."""
    stats_path = tmp_path / "stats.json"
    proc = subprocess.Popen([sys.executable, str(DRIVER), signame, str(count), "serve", "--port", "0",
                             "--device", "host", "--stats-json", str(stats_path)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    try:
        port = int(wait_for_line(proc, r"on 127\.0\.0\.1:(\d+)", lines).group(1))
        assert proc.stderr is not None
        c = _computed_then_freed(port)
        try:
            assert proc.wait(timeout=60) == 0, "".join(lines) + proc.stderr.read()
            assert c.is_closed_by_server()
        finally:
            c.close()
        log = "".join(lines) + proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
    freed = re.findall(r"^ggml_free (0x[0-9a-f]+)$", log, re.M)
    assert freed and "double ggml_free" not in log, log
    assert len(freed) == len(set(freed)), log
    if count == 1:
        assert "ended the connection of" in log and "the server is stopping" in log, log
        assert f"stopped by signal {int(getattr(signal, signame))}" in log, log
    stats = json.loads(stats_path.read_text())
    assert stats["graph_runs"] == 1 and stats["rejected"] == 0, stats


def test_a_stop_signal_hangs_up_on_an_idle_client(tmp_path: Path) -> None:
    """A client that holds its connection between requests (llama-server does) does not keep
    a stopping server alive: SIGTERM ends its connection and the server exits 0."""
    proc = subprocess.Popen([sys.executable, "-m", "ggml_rknpu.cli.main", "serve", "--port", "0",
                             "--device", "host"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    try:
        port = int(wait_for_line(proc, r"on 127\.0\.0\.1:(\d+)", lines).group(1))
        with RpcClient(port) as c:
            assert c.device_count() == 1
            proc.send_signal(signal.SIGTERM)
            assert c.is_closed_by_server(timeout=20)
            assert proc.wait(timeout=20) == 0
        wait_for_line(proc, r"stopped by signal 15", lines)
    finally:
        proc.kill()
        proc.wait()
