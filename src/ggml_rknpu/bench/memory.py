"""Host memory of one served completion against llama.cpp alone: llama-server with one slot, a
prompt of about 115 tokens, one greedy completion, ``-t 1``, a model requantized to one weight
type (the demo's gemma-3-270m, every 2-D weight ``--quant``); alone, and with ``--rpc`` to an
``rknpu serve`` (``--device host`` by default: ggml-cpu only, repacked copies as llama.cpp's).

Invariants: the figure is anonymous memory (``RssAnon``, what the kernel cannot drop; the GGUF
mmap and the weight pages are file-backed), *measured* on this host after the completion;
served = the server's growth from its start-up plus the client's, against llama-server alone.
The server's own board accounting (``--stats-json``, read at the same moment) is printed beside.
Why: docs/memory.md "One host copy per weight"."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from pathlib import Path

from rich.console import Console

from ggml_rknpu.bench import gguf_run, llama_server
from ggml_rknpu.bench import report as rp
from ggml_rknpu.toolchain import launch, models

GOAL = 1.15                   # served (server growth + client) / llama-server alone, at most
MIB = 2**20
PROMPT = ("Summarise the following note in one sentence. The north field was planted with barley in March and "
          "with clover after the harvest; the east field lay fallow for a year because its drainage had "
          "failed in the winter storms. The farm's two tractors were serviced in April, and the older one "
          "needed a new clutch, which arrived late. Rain in June delayed the hay, but the yield was still "
          "better than the year before, and the sheep were moved to the upper pasture in July. The well "
          "pump was replaced in August after it stopped twice in a week.")


def add_arguments(p, common) -> None:
    common(p, "bench-out/memory")
    p.add_argument("--model", type=Path, default=None, help="GGUF to requantize (default: gemma-3-270m Q4_K_M)")
    p.add_argument("--quant", default="Q4_0", help="weight type of every 2-D weight (default Q4_0)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens of the completion (default 16)")
    p.add_argument("--serve-args", default="", help="more rknpu serve flags, space-separated (e.g. --no-weight-pages)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the completion")


def anon_bytes(pid: int) -> int:
    """RssAnon of ``pid`` (measured, /proc)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def _complete(model: Path, rpc_port: int | None, args, log) -> tuple[int, str]:
    """llama-server (one slot), one completion of PROMPT: (its RssAnon after it, the text)."""
    llama, port = llama_server.start(model, rpc_port, 1, log, context=512)
    try:
        text = llama_server.ask(port, PROMPT, args.max_tokens, args.timeout)
        return anon_bytes(llama.pid), text
    finally:
        launch.stop(llama)


def stats_now(pid: int, path: Path, timeout: float = 60.0) -> dict:
    """The server's ``--stats-json`` as of now (SIGUSR1 rewrites it)."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_mtime_ns != before:
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError:     # being replaced
                pass
        time.sleep(0.05)
    raise RuntimeError(f"rknpu serve did not write {path} after SIGUSR1")


def run(args, rig, console: Console) -> rp.Report | None:
    prepared = gguf_run.prepare(args, console, "memory")
    if prepared is None:
        return None
    source, out = prepared
    model = models.requantized(source, args.quant)
    console.print(f"llama-server alone on {model.name} ...")
    with open(out / "llama-server-alone.log", "w") as log:
        alone, alone_text = _complete(model, None, args, log)
    stats_path = Path(tempfile.mkdtemp(prefix="bench-memory-")) / "stats.json"
    device = args.device or "host"
    with open(out / "rknpu-serve.log", "w") as slog, open(out / "llama-server-rpc.log", "w") as llog:
        rpc_port = launch.free_port()
        server = launch.start_rknpu_serve(rpc_port, device=device, log=slog, extra=(
            "-t", "1", "--no-progress", "--stats-json", str(stats_path), *args.serve_args.split()))
        try:
            server_start = anon_bytes(server.pid)
            llama, port = llama_server.start(model, rpc_port, 1, llog, context=512)
            try:
                served_text = llama_server.ask(port, PROMPT, args.max_tokens, args.timeout)
                client = anon_bytes(llama.pid)
                server_now = anon_bytes(server.pid)
                board = stats_now(server.pid, stats_path).get("board_memory", {})
            finally:
                launch.stop(llama)
        finally:
            launch.stop(server)
    growth = server_now - server_start
    ratio = (growth + client) / alone
    rows = [{"side": "llama-server alone", "anon_mib_measured": alone / MIB},
            {"side": f"rknpu serve --device {device}: the server's growth", "anon_mib_measured": growth / MIB},
            {"side": "... the client (llama-server --rpc)", "anon_mib_measured": client / MIB},
            {"side": "... both", "anon_mib_measured": (growth + client) / MIB, "vs_alone_measured": ratio}]
    table = rp.Table(f"Anonymous memory after one completion ({args.quant}; measured on this host)", [
        rp.Column("side", "side"), rp.Column("anon_mib_measured", "RssAnon MiB", "{:.1f}", figure=True),
        rp.Column("vs_alone_measured", "÷ alone", "{:.2f}", figure=True)], rows,
        note=f"prompt of about 115 tokens, {args.max_tokens} tokens generated, -t 1, one slot; goal <= {GOAL}x")
    console.print(f"served / alone: {ratio:.2f} (goal <= {GOAL}); the server's board accounting: "
                  + ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in board.items()))
    return rp.Report("memory", f"Host memory of a served completion vs llama-server alone ({args.quant})",
                     rig.to_dict(), meta={"model": str(model), "quant": args.quant, "device": device,
                                          "max_tokens": args.max_tokens, "goal": GOAL,
                                          "serve_args": args.serve_args},
                     tables=[table], raw={"rows": rows, "board_memory": board, "texts": {
                         "alone": alone_text, "served": served_text}},
                     notes=["RssAnon measured on this host (not a board); the texts are printed, not compared"])
