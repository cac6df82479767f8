"""The llama-server the serving benchmarks drive (``bench soak``, ``bench concurrent``): started
with ``--rpc`` to an ``rknpu serve``, asked chat questions at temperature 0, its answer read."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

from ggml_rknpu.toolchain import launch, llamacpp

QUESTIONS = ("What is the capital of France?", "Name a primary colour.", "What is two plus two?",
             "Which planet is closest to the Sun?", "What do bees make?", "How many legs has a spider?",
             "What is frozen water called?", "Which ocean is the largest?")


def post(port: int, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


def chat_body(question: str, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "seed": 1}


def start(model: Path, rpc_port: int | None, slots: int, log: IO[Any],
          context: int = 256) -> tuple[subprocess.Popen, int]:
    """llama-server ready for requests: ``context`` tokens per slot, through ``--rpc`` to
    ``rpc_port`` (None: llama.cpp alone, on its CPU)."""
    port = launch.free_port()
    rpc = ["--rpc", f"127.0.0.1:{rpc_port}", "-ngl", "99"] if rpc_port is not None else []
    argv = [str(llamacpp.tool("llama-server")), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-t", "1", "-c", str(context * slots), "-np", str(slots), *rpc]
    proc = subprocess.Popen(argv, env=launch.tool_env("llama-server"), stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}; see {log.name}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2.0) as reply:
                if reply.status == 200:
                    return proc, port
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    launch.stop(proc)
    raise RuntimeError(f"llama-server not ready within 900 s; see {log.name}")


def answer_text(reply: dict) -> str:
    return reply["choices"][0]["message"]["content"]


def ask(port: int, question: str, max_tokens: int, timeout: float) -> str:
    """One chat question, answered greedily: the answer's text."""
    return answer_text(post(port, chat_body(question, max_tokens), timeout))
