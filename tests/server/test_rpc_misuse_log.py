"""A subprocess server's kernel misuses fail the test that ran it: every process of the test
session appends its simulated kernels' misuses to the session's log (``sim.kernel.misuse``
``LOG_ENV``, set in tests/conftest.py), which the autouse check reads at each test's end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ggml_rknpu.sim.kernel import misuse
from support.matmul_graph import MatmulGraph, rng_w
from support.misuse_check import assert_no_misuse
from support.rpc_testkit import RpcClient, wait_for_line

pytestmark = pytest.mark.timeout(120)
DRIVER = Path(__file__).resolve().parents[1] / "support" / "serve_misusing.py"


def _serve_one_matmul(argv: list[str]) -> None:
    """Start ``argv`` (an rknpu serve on sim-rknpu), run one NPU matmul through it, stop it."""
    proc = subprocess.Popen([*argv, "--port", "0", "--device", "sim-rknpu", "--placement", "npu"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    try:
        port = int(wait_for_line(proc, r"on 127\.0\.0\.1:(\d+)", lines).group(1))
        with RpcClient(port) as c:
            g = MatmulGraph(c)
            w = rng_w()
            c.set_array(g.w, w)
            c.set_array(g.x, np.ones((3, 64), np.float32))
            np.testing.assert_allclose(g.compute(), np.ones((3, 64), np.float32) @ w.T, rtol=2e-2, atol=2e-2)
        proc.terminate()
        assert proc.wait(timeout=30) == 0, "".join(lines)
    finally:
        proc.kill()
        proc.wait()


def test_a_misuse_in_a_subprocess_server_fails_the_check():
    _serve_one_matmul([sys.executable, str(DRIVER), "serve"])
    with pytest.raises(AssertionError, match=r"MEM_SYNC: range .* runs past .* \[subprocess \d+\]"):
        assert_no_misuse()
    assert_no_misuse()          # read: the next test starts clean


def test_the_same_server_without_the_misuse_passes_the_check():
    _serve_one_matmul([sys.executable, "-m", "ggml_rknpu.cli.main", "serve"])
    assert_no_misuse()


def test_the_log_holds_every_process_with_its_pid(tmp_path, monkeypatch):
    log = tmp_path / "misuse.log"
    monkeypatch.setenv(misuse.LOG_ENV, str(log))
    m = misuse.Misuse("rknpu", "MEM_SYNC", "range past the end", "clamped")
    misuse.record(m)
    assert misuse.drain() == [m]
    with open(log, "a") as f:
        f.write('{"pid": 1, "abi": "rocket"')              # a line another process is still writing
    got, end = misuse.logged(log)
    assert [(x.pid, x.misuse) for x in got] == [(os.getpid(), m)] and end < log.stat().st_size
    with open(log, "a") as f:
        f.write(', "ioctl": "SUBMIT", "what": "job 0 dropped", "on_a_board": "never runs"}\n')
    more, _ = misuse.logged(log, end)
    assert [(x.pid, x.misuse.abi, x.misuse.ioctl) for x in more] == [(1, "rocket", "SUBMIT")]
    assert misuse.logged(tmp_path / "absent.log") == ([], 0)
