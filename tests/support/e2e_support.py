"""Helpers for the end-to-end tests: start RPC servers, run llama.cpp's tools, parse output.

Tools come from the pinned client build unless a ``client`` from ``llamacpp.CLIENTS`` is named
(the ``client`` fixture parametrizes a test over every client build).

Every process started here is killed when its context exits (also on test failure), runs with
one thread (ggml-rpc.md P5: spinning OpenMP threads on the shared 2-core box cost 40x), and
writes its log to a file that assertion messages quote, so a failing test says what the server
said.
"""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import pytest

from ggml_rknpu.toolchain import launch, llamacpp
from ggml_rknpu.toolchain.launch import free_port, one_thread_env


def tool_or_skip(name: str, client: str = llamacpp.PINNED) -> Path:
    """Path of a llama.cpp tool of a client build; skips the test when scripts/build-llama-cpp
    has not built it."""
    try:
        return llamacpp.tool(name, client)
    except llamacpp.LlamaCppNotBuilt as exc:
        pytest.skip(str(exc))


def tool_env(**extra: str) -> dict[str, str]:
    return one_thread_env(**extra)


def log_tail(path: Path, n_chars: int = 3000) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return text[-n_chars:]


class Server:
    """A server subprocess on 127.0.0.1:port, killed on exit; ``endpoint`` is host:port."""

    def __init__(self, argv: list[str], port: int, log_path: Path, *, ready_timeout: float = 120.0):
        self.argv, self.port, self.log_path, self.ready_timeout = argv, port, log_path, ready_timeout
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return tool_env()

    def __enter__(self) -> Self:
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                     stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.argv}\n"
                                   f"{log_tail(self.log_path)}")
            if self.ready():
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not listen on {self.endpoint} within {self.ready_timeout} s\n"
                           f"{log_tail(self.log_path)}")

    def ready(self) -> bool:
        """The port accepts connections (subclasses may ask more)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0):
                return True
        except OSError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None:
            launch.stop(self.proc, timeout=30)   # under CI load the exit path (stats, frees) can take a while

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log(self) -> str:
        return log_tail(self.log_path)

    def wait_log(self, text: str, timeout: float = 10.0) -> bool:
        """Whether ``text`` appears in the log within ``timeout``: a session logs its end from its
        own thread, after the client has already gone."""
        deadline = time.monotonic() + timeout
        while True:
            if self.log_path.exists() and text in self.log_path.read_text(errors="replace"):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


class RknpuServer(Server):
    """``rknpu serve`` with its machine-readable counters (``--stats-json``)."""

    def __init__(self, argv: list[str], port: int, log_path: Path, stats_path: Path):
        super().__init__([*argv, "--stats-json", str(stats_path)], port, log_path)
        self.stats_path = stats_path

    def stats(self) -> dict:
        """The counters the server last wrote (after each client and at exit)."""
        if not self.stats_path.is_file():
            code = self.proc.returncode if self.proc is not None else None
            raise AssertionError(f"no --stats-json from the server (exit status {code}):\n{self.log()}")
        return json.loads(self.stats_path.read_text())

    def first_stats(self, timeout: float = 60.0) -> dict:
        """The counters the server writes once its first computing client has gone."""
        deadline = time.monotonic() + timeout
        while not self.stats_path.exists():
            assert time.monotonic() < deadline, f"no --stats-json after the first client\n{self.log()}"
            time.sleep(0.2)
        return self.stats()

    def nodes(self, op: str) -> int:
        return sum(r["nodes"] for r in self.stats()["per_op"] if r["op"] == op)

    def weight_uploads(self) -> int:
        """Weights uploaded to the NPU: proof that llama.cpp offloaded the model, not a CPU run."""
        return int(self.stats()["weights"]["uploads"])


def rknpu_server(tmp_path: Path, *, device: str = "sim-rknpu", extra: tuple[str, ...] = (),
                 name: str = "rknpu-serve") -> RknpuServer:
    """``rknpu serve`` of this checkout on a free loopback port (simulated NPU by default),
    every eligible weight on the NPU unless ``extra`` names a ``--placement`` (these tests
    check the NPU path; placement by cost has its own)."""
    port = free_port()
    placement = () if "--placement" in extra else ("--placement", "npu")
    argv = [sys.executable, "-m", "ggml_rknpu.cli.main", "serve", "--host", "127.0.0.1",
            "--port", str(port), "--device", device, *placement, *extra]
    return RknpuServer(argv, port, tmp_path / f"{name}-{port}.log", tmp_path / f"{name}-{port}.json")


def cpp_server(tmp_path: Path) -> Server:
    """llama.cpp's own ``ggml-rpc-server`` (the CPU reference device)."""
    port = free_port()
    argv = [str(llamacpp.tool("ggml-rpc-server")), "-H", "127.0.0.1", "-p", str(port), "-t", "1"]
    return Server(argv, port, tmp_path / f"ggml-rpc-server-{port}.log", ready_timeout=30.0)


class LlamaServer(Server):
    """llama.cpp's ``llama-server`` (OpenAI-style HTTP API); ready once /health answers 200."""

    def env(self) -> dict[str, str]:
        return tool_env(**llamacpp.tool_preload("llama-server"))

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=2.0) as reply:
                return reply.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        request = urllib.request.Request(f"http://{self.endpoint}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return json.loads(reply.read())


def llama_server(tmp_path: Path, model: Path, *, rpc: str | None, extra: tuple[str, ...] = ()) -> LlamaServer:
    port = free_port()
    argv = [str(llamacpp.tool("llama-server")), "-m", str(model), "--host", "127.0.0.1",
            "--port", str(port), "-t", "1", "-c", "512", "-np", "1", *extra]
    if rpc:
        argv += ["--rpc", rpc, "-ngl", "99"]
    return LlamaServer(argv, port, tmp_path / f"llama-server-{port}.log", ready_timeout=600.0)


def run_tool(name: str, args: list[str], *, timeout: float, env: dict[str, str] | None = None,
             client: str = llamacpp.PINNED) -> subprocess.CompletedProcess[str]:
    """Run a llama.cpp tool to completion, capturing output losslessly (byte tokens of a
    random model are not valid UTF-8; surrogateescape keeps them distinguishable)."""
    env = {**(env or tool_env()), **llamacpp.tool_preload(name, client)}
    return subprocess.run([str(llamacpp.tool(name, client)), *args], capture_output=True, encoding="utf-8",
                          errors="surrogateescape", timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL)


# --- test-backend-ops -------------------------------------------------------------------------

@dataclass(frozen=True)
class BackendOpsResult:
    passed: int
    total: int
    backend_ok: bool
    failures: tuple[str, ...]
    output: str
    returncode: int | None = None

    def summary(self) -> str:
        if self.total == 0:
            return (f"no 'tests passed' line (exit {self.returncode}): the client aborted, e.g. the "
                    "server closed the connection, or no case matched the filter")
        return f"{self.passed}/{self.total} passed; failures: {list(self.failures[:20])}"


_PASSED = re.compile(r"^\s*(\d+)/(\d+) tests passed", re.M)
_BACKEND = re.compile(r"^\s*Backend RPC0\S*: (OK|FAIL)", re.M)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_backend_ops(output: str) -> BackendOpsResult:
    """Counts from test-backend-ops' "N/M tests passed" line of the RPC0 backend and its verdict."""
    output = _ANSI.sub("", output)
    counts = _PASSED.findall(output)
    verdict = _BACKEND.findall(output)
    failures = tuple(line.strip() for line in output.splitlines()
                     if "FAIL" in line and not line.lstrip().startswith("Backend"))
    passed = sum(int(p) for p, _ in counts)
    total = sum(int(t) for _, t in counts)
    return BackendOpsResult(passed, total, bool(verdict) and all(v == "OK" for v in verdict),
                            failures, output)


def run_backend_ops(endpoint: str, op: str, pattern: str | None = None, *, timeout: float,
                    client: str = llamacpp.PINNED) -> BackendOpsResult:
    """``test-backend-ops test -b RPC0 -o op [-p pattern]`` against ``endpoint`` via our plugin."""
    args = ["test", "-b", "RPC0", "-o", op]
    if pattern:
        args += ["-p", pattern]
    env = tool_env(GGML_BACKEND_PATH=str(llamacpp.plugin_path(client)), GGML_RPC_ENDPOINT=endpoint)
    proc = run_tool("test-backend-ops", args, timeout=timeout, env=env, client=client)
    return dataclasses.replace(parse_backend_ops(proc.stdout + proc.stderr), returncode=proc.returncode)


# --- llama-completion -------------------------------------------------------------------------

# The pinned tools print through an asynchronous logger that is never joined at exit (it is
# leaked on purpose, log.cpp), so on a busy machine the tail of the output was lost; run_tool
# preloads the logger drain (tools/log_drain.cpp) that joins it. The logger is one FIFO: the
# last line common_perf_print always prints ("graphs reused", after the generated text and the
# timings) shows that stdout and the timing lines are complete.
_COMPLETE_MARK = "graphs reused ="


def completion(model: Path, prompt: str, *, n_predict: int = 12, rpc: str | None = None,
               extra: tuple[str, ...] = (), timeout: float = 300.0,
               client: str = llamacpp.PINNED) -> tuple[str, subprocess.CompletedProcess[str]]:
    """Greedy text of exactly ``n_predict`` tokens from ``llama-completion`` (CPU-only, or fully
    offloaded to the ``rpc`` servers). The text is returned without the tool's closing blank line."""
    args = ["-m", str(model), "-p", prompt, "-n", str(n_predict), "--temp", "0", "-no-cnv",
            "-t", "1", "-c", "256", "--no-display-prompt", "--seed", "1", "--ignore-eos"]
    if rpc:
        args = ["--rpc", rpc, *args, "-ngl", "99"]
    args += list(extra)
    proc = run_tool("llama-completion", args, timeout=timeout, client=client)
    if proc.returncode == 0 and _COMPLETE_MARK not in proc.stderr:
        raise AssertionError(f"llama-completion output incomplete despite the logger drain:\n{proc.stderr[-2000:]}")
    text = proc.stdout[:-2] if proc.stdout.endswith("\n\n") else proc.stdout
    return text, proc
