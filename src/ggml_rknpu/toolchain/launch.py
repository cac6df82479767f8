"""Start and stop the processes of a llama.cpp session: ``rknpu serve`` and the pinned tools.

Used by ``rknpu demo`` and the RPC-overhead benchmark, which both run a server and a client on
this machine. Every process gets one thread (docs/ggml-rpc.md P5: spinning OpenMP/BLAS threads on a
loaded 2-core box cost 40x) and listens on loopback only.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from ggml_rknpu.toolchain import llamacpp

ONE_THREAD_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
REPO_ROOT = Path(__file__).resolve().parents[3]


def one_thread_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(ONE_THREAD_ENV)
    env.update(extra)
    return env


def tool_env(name: str, client: str = llamacpp.PINNED, **extra: str) -> dict[str, str]:
    """The environment for running llama.cpp tool ``name``: one thread, and its logger drained at
    exit (llamacpp.tool_preload) so that its text and timings are complete."""
    return one_thread_env(**llamacpp.tool_preload(name, client), **extra)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _located_or_built(locate: Callable[[], Path], script_name: str, announce: str, *, quiet: bool,
                      may_build: bool = True) -> Path:
    """``locate()``; when it finds nothing and this is a checkout, run ``scripts/<script_name>``
    once (``announce`` on stderr first) and locate again."""
    try:
        return locate()
    except llamacpp.LlamaCppNotBuilt:
        script = REPO_ROOT / "scripts" / script_name
        if not may_build or not script.is_file():
            raise
    print(announce, file=sys.stderr)
    subprocess.run([str(script)], check=True, stdout=subprocess.DEVNULL if quiet else sys.stderr)
    return locate()


def ensure_built(quiet: bool = False, needs: str | None = None) -> Path:
    """The pinned tools' directory, building them first (scripts/build-llama-cpp) in a checkout;
    with ``needs``, only that tool must be there (a caller that runs one tool)."""
    locate = (lambda: llamacpp.tool(needs).parent) if needs else llamacpp.tools_dir
    return _located_or_built(locate, "build-llama-cpp",
                             "building the pinned llama.cpp (first run only; several minutes)...", quiet=quiet)


def ensure_ggml_built() -> Path:
    """The directory ``rknpu serve`` loads libggml-base/libggml-cpu from, building just those two
    first (scripts/build-ggml) when none is found and this is a checkout. Never builds when
    ``$RKNPU_GGML_LIB_DIR`` names a directory: the user chose that build."""
    return _located_or_built(
        llamacpp.ggml_library_dir, "build-ggml",
        "building libggml-base and libggml-cpu of the pinned llama.cpp (first run only; a few minutes)...",
        quiet=True, may_build=not os.environ.get(llamacpp.GGML_LIB_DIR_ENV))


def wait_for_port(proc: subprocess.Popen, port: int, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} before listening on port {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f} s")


def start_rknpu_serve(port: int, *, device: str | None = None, weights: str | None = None,
                      extra: tuple[str, ...] = (), log: IO | int | None = None,
                      timeout: float = 120.0, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``rknpu serve`` of this installation on 127.0.0.1:port, ready for connections. ``log``: where
    its output goes (a file, ``subprocess.PIPE``; None: this process's stderr); ``env``: added to
    the environment."""
    argv = [sys.executable, "-m", "ggml_rknpu.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port)]
    if device:
        argv += ["--device", device]
    if weights:
        argv += ["--weights", weights]
    proc = subprocess.Popen([*argv, *extra], env=one_thread_env(**(env or {})), stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT if log else None)
    try:
        wait_for_port(proc, port, timeout, "rknpu serve")
    except BaseException:
        stop(proc)
        raise
    return proc


def start_cpp_rpc_server(port: int, *, log: IO | None = None) -> subprocess.Popen:
    """llama.cpp's own ``ggml-rpc-server`` (CPU) on 127.0.0.1:port, one thread."""
    argv = [str(llamacpp.tool("ggml-rpc-server")), "-H", "127.0.0.1", "-p", str(port), "-t", "1"]
    proc = subprocess.Popen(argv, env=one_thread_env(), stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT if log else None)
    try:
        wait_for_port(proc, port, 30.0, "ggml-rpc-server")
    except BaseException:
        stop(proc)
        raise
    return proc


def stop(proc: subprocess.Popen, timeout: float = 15.0) -> int | None:
    """SIGTERM (the server prints its counters on the way out), then SIGKILL."""
    if proc.poll() is not None:
        return proc.returncode
    for send in (proc.terminate, proc.kill):
        send()
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            continue
    return proc.poll()
