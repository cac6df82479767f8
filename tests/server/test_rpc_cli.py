"""``rknpu serve`` as a process: starts on loopback, answers HELLO, prints its counters on
SIGUSR1 and at exit; binding elsewhere warns loudly."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys

import pytest

from ggml_rknpu.server.buffers import DeviceMemory
from ggml_rknpu.server.rpc.server import RpcServer, ServerConfig, ServerState, is_loopback
from support.rpc_testkit import RpcClient, wait_for_line

pytestmark = pytest.mark.timeout(60)




def test_serve_process_answers_and_reports(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "ggml_rknpu.cli.main", "serve", "--port", "0",
                             "--device", "host", "--stats", "--stats-json", str(tmp_path / "stats.json")],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    try:
        port = int(wait_for_line(proc, r"on 127\.0\.0\.1:(\d+)", lines).group(1))
        with RpcClient(port) as c:
            assert c.device_count() == 1
            assert c.device_memory() == (4 << 30, 4 << 30)
        with RpcClient(port) as c:
            c.graph_compute([], [])                                   # an (empty) graph: worth a report
            assert c.device_count() == 1
        wait_for_line(proc, r"connections 2 \(rejected 0", lines)         # --stats after a computing client
        proc.send_signal(signal.SIGUSR1)
        wait_for_line(proc, r"connections 2", lines)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert proc.stderr is not None
        rest = proc.stderr.read()
        assert "connections 2" in rest, rest                          # printed at exit too
        stats = json.loads((tmp_path / "stats.json").read_text())
        assert stats["connections"] == 2 and stats["graph_runs"] == 1 and stats["rejected"] == 0 and stats["weights"]["uploads"] == 0
        assert stats["activations"] == {"mode": "fp16", "rounded_steps": {}}
    finally:
        proc.kill()
        proc.wait()


def test_non_loopback_bind_warns(caplog):
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.20")
    state = ServerState(npu=None, memory=DeviceMemory(lambda: (1, 1)), config=ServerConfig())
    with caplog.at_level(logging.WARNING, logger="ggml_rknpu.rpc"):
        server = RpcServer(state, "0.0.0.0", 0)
    for listener in server.listeners:
        listener.close()
    assert any("NO authentication" in r.message for r in caplog.records)


@pytest.mark.parametrize("flags,activations", [((), "activations fp16"),
                                               (("--activations", "ggml"), "activations rounded to ggml-cpu's")])
def test_serve_start_up_line_names_the_envelope(tmp_path, flags, activations):
    """A first-time board (no ladder record) serves in the proven envelope, one core, and says so;
    the line names the activation rounding too."""
    env = {**os.environ, "RKNPU_ENVELOPE_FILE": str(tmp_path / "none.json")}
    env.pop("RKNPU_ENVELOPE", None)
    proc = subprocess.Popen([sys.executable, "-m", "ggml_rknpu.cli.main", "serve", "--port", "0",
                             "--device", "sim-rknpu", *flags], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, env=env)
    lines: list[str] = []
    try:
        line = wait_for_line(proc, r"on 127\.0\.0\.1:\d+.*", lines).group(0)
        assert "envelope proven: 1 core(s)" in line and "rknpu selftest" in line and activations in line, line
    finally:
        proc.kill()
        proc.wait(timeout=20)


def test_serve_without_the_ggml_libraries_says_where_it_looked(tmp_path):
    """$RKNPU_GGML_LIB_DIR names a directory without them: exit 1, no build, the directory named."""
    env = {**os.environ, "RKNPU_GGML_LIB_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "ggml_rknpu.cli.main", "serve", "--port", "0", "--device", "host"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "cannot start the host backend" in proc.stderr and f"RKNPU_GGML_LIB_DIR={tmp_path}" in proc.stderr
