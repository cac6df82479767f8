"""``rknpu serve`` as a process: starts on loopback, answers HELLO, prints its counters on
SIGUSR1 and at exit; binding elsewhere warns loudly."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from ggml_rknpu.cli import serve
from ggml_rknpu.server.buffers import DeviceBudget
from ggml_rknpu.server.rpc import wire
from ggml_rknpu.server.rpc.config import ServerConfig
from ggml_rknpu.server.rpc.listener import RpcServer, is_loopback
from ggml_rknpu.server.rpc.state import ServerState
from ggml_rknpu.server.rpc.wire import Cmd
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


def test_serve_min_rate_sets_the_deadline_of_a_message(tmp_path):
    """``--stall-timeout 0.5 --min-rate 0.0234375`` (24 B/s): a HELLO payload trickled a byte
    every 0.1 s is cut 0.5 s + 24 bytes / 24 B/s = 1.5 s after its first byte (the default rate
    would cut it at ~0.5 s), and the drop is counted in the JSON stats."""
    stall_s, rate_kib_s = 0.5, wire.HELLO_REQ.size / 1024
    deadline_s = stall_s + 1.0
    proc = subprocess.Popen([sys.executable, "-m", "ggml_rknpu.cli.main", "serve", "--port", "0",
                             "--device", "host", "--stall-timeout", str(stall_s), "--min-rate", str(rate_kib_s),
                             "--stats-json", str(tmp_path / "stats.json")],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    try:
        port = int(wait_for_line(proc, r"on 127\.0\.0\.1:(\d+)", lines).group(1))
        request = wire.pack_request(Cmd.HELLO, bytes(wire.HELLO_REQ.size))
        with RpcClient(port, hello=False) as c:
            t0 = time.monotonic()
            c.sock.sendall(request[:wire.REQUEST_HEADER.size])
            for i in range(wire.REQUEST_HEADER.size, len(request)):
                c.sock.sendall(request[i:i + 1])
                if c.is_closed_by_server(timeout=0.1):
                    break
            closed_s = time.monotonic() - t0
        assert i < len(request) - 1 and deadline_s - 0.05 <= closed_s <= deadline_s + 1.0, closed_s
        wait_for_line(proc, r"not complete within 1\.5 s \(--stall-timeout 0\.5 s \+ 24 bytes at --min-rate", lines)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert json.loads((tmp_path / "stats.json").read_text())["sessions"]["too_slow"] == 1
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("flag", ["--min-rate", "--stall-timeout"])
def test_serve_refuses_a_rate_or_stall_timeout_of_zero(flag, caplog):
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    assert serve.run(parser.parse_args(["--port", "0", "--device", "host", flag, "0"])) == 2
    assert "--min-rate and --stall-timeout must be above 0" in caplog.text


def test_non_loopback_bind_warns(caplog):
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.20")
    state = ServerState(npu=None, memory=DeviceBudget(lambda: (1, 1)), config=ServerConfig())
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
