"""Host placement against llama.cpp alone: the same greedy decode through ``rknpu serve
--placement host`` (every matmul in ggml-cpu in our process, from the GGUF bytes) and
CPU-only ``llama-completion``, both with the same thread count, in one run.

Invariants: the same pinned binary, GGUF, prompt and arguments on both sides, the served
side only adding ``--rpc -ngl 99``; tokens/s are llama-completion's own ``eval time``
figures on this host (``*_measured``), decode only; the texts are compared as printed.
What it shows: the cost of serving ggml-cpu through our RPC server, not the board."""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from pathlib import Path

from rich.console import Console

from ggml_rknpu.bench import gguf_run
from ggml_rknpu.bench import report as rp
from ggml_rknpu.toolchain import launch, llamacpp

GOAL = 0.85                    # served decode / CPU-only decode the issue asks for
PROMPT = "The capital of France is"
_EVAL = re.compile(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs")


def add_arguments(p, common) -> None:
    common(p, "bench-out/host-placement")
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: gemma-3-270m Q4_K_M from PyPI)")
    p.add_argument("-n", "--n-predict", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("-t", "--threads", type=int, default=1, help="threads on both sides (default 1)")
    p.add_argument("-p", "--prompt", default=PROMPT)
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per llama-completion run")


def decode_tok_s(log: str) -> float:
    """llama-completion's decode rate: runs / eval time (the prompt's line excluded)."""
    for line in log.splitlines():
        if "prompt eval time" in line:
            continue
        m = _EVAL.search(line)
        if m and int(m.group(2)) > 0:
            return int(m.group(2)) / (float(m.group(1)) / 1e3)
    raise RuntimeError("llama-completion printed no eval time line:\n" + log[-2000:])


def _complete(model: Path, args, extra: list[str]) -> tuple[str, float]:
    cmd = [str(llamacpp.tool("llama-completion")), "-m", str(model), "-t", str(args.threads), "-c", "512",
           "--temp", "0", "-no-cnv", "-n", str(args.n_predict), "-p", args.prompt, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, stdin=subprocess.DEVNULL,
                          env=launch.tool_env("llama-completion"))
    if proc.returncode != 0:
        raise RuntimeError(f"llama-completion failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return proc.stdout, decode_tok_s(proc.stderr)


def run(args, rig, console: Console) -> rp.Report | None:
    if args.threads < 1 or args.n_predict < 2:
        raise ValueError("--threads must be >= 1 and --n-predict >= 2")
    prepared = gguf_run.prepare(args, console, "host-placement")
    if prepared is None:
        return None
    model, out = prepared
    cpu_text, cpu_tok_s = _complete(model, args, ["-ngl", "0"])
    stats_path = Path(tempfile.mkdtemp(prefix="host-placement-")) / "stats.json"
    with open(out / "rknpu-serve.log", "w") as log:
        port = launch.free_port()
        server = launch.start_rknpu_serve(port, device=args.device or None, log=log, extra=(
            "--placement", "host", "-t", str(args.threads), "--no-progress", "--stats-json", str(stats_path)))
        try:
            served_text, served_tok_s = _complete(model, args, ["--rpc", f"127.0.0.1:{port}", "-ngl", "99"])
        finally:
            launch.stop(server)
    stats = json.loads(stats_path.read_text())
    stats_path.unlink()
    stats_path.parent.rmdir()
    npu_matmuls = sum(r["nodes"] for r in stats.get("per_op", []) if r["engine"] == "npu")
    ratio = served_tok_s / cpu_tok_s
    rows = [
        {"side": "llama-completion, CPU only", "decode_tok_s_measured": cpu_tok_s, "text": cpu_text.strip()},
        {"side": "llama-completion --rpc rknpu serve --placement host", "decode_tok_s_measured": served_tok_s,
         "text": served_text.strip(), "npu_nodes": npu_matmuls},
    ]
    table = rp.Table("Decode: rknpu serve --placement host vs llama.cpp alone (measured on this host)", [
        rp.Column("side", "side"), rp.Column("decode_tok_s_measured", "decode tok/s", "{:.2f}", figure=True),
        rp.Column("npu_nodes", "nodes on the NPU")], rows,
        note=f"{args.threads} thread(s) on both sides, greedy, {args.n_predict} tokens, loopback; "
             f"served / CPU-only = {ratio:.3f} (goal >= {GOAL}); same text: {served_text == cpu_text}")
    console.print(f"served / CPU-only decode: {ratio:.3f} (goal >= {GOAL}); same greedy text: "
                  f"{served_text == cpu_text}")
    return rp.Report("host_placement", "Host placement vs llama.cpp alone (gemma3 decode)", rig.to_dict(),
                     meta={"model": str(model), "threads": args.threads, "n_predict": args.n_predict,
                           "ratio_measured": ratio, "goal": GOAL, "same_text": served_text == cpu_text},
                     tables=[table], raw={"rows": rows, "rknpu_serve_stats": stats},
                     notes=["both rates measured on this host (not a board): llama-completion's decode eval time",
                            "the served side runs every matmul in ggml-cpu inside rknpu serve; the NPU is opened "
                            "but no weight is staged"])
