"""Host placement against llama.cpp alone: the same greedy decode through ``rknpu serve
--placement host`` (every matmul in ggml-cpu in our process, from repacked host copies where
ggml repacks, its default) and CPU-only ``llama-completion`` with the same thread count,
repacked weights (its default: the served side's arithmetic) and ``--no-repack``, in one run.

Invariants: the same pinned binary, GGUF, prompt and arguments on every side, the served
side only adding ``--rpc -ngl 99``; the sides alternate for ``--repetitions`` rounds (a
shared box's load shifts between runs) and each rate is the median of its runs of
llama-completion's own decode ``eval time`` (``*_measured``, this host); texts compared
as printed. What it shows: the cost of serving ggml-cpu through our RPC server, not the
board."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

from rich.console import Console

from ggml_rknpu.bench import gguf_run
from ggml_rknpu.bench import report as rp
from ggml_rknpu.toolchain import launch, llamacpp

GOAL = 0.85                    # the goal: served decode / CPU-only decode at least this
PROMPT = "The capital of France is"
_EVAL = re.compile(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs")


def add_arguments(p, common) -> None:
    common(p, "bench-out/host-placement")
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: gemma-3-270m Q4_K_M from PyPI)")
    p.add_argument("-n", "--n-predict", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("-t", "--threads", type=int, default=1, help="threads on both sides (default 1)")
    p.add_argument("-p", "--prompt", default=PROMPT)
    p.add_argument("-r", "--repetitions", type=int, default=3, help="alternating rounds of the three sides")
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


SIDES = ("llama-completion, CPU only (repacked weights)", "llama-completion, CPU only, --no-repack",
         "llama-completion --rpc rknpu serve --placement host")


def run(args, rig, console: Console) -> rp.Report | None:
    if args.threads < 1 or args.n_predict < 2 or args.repetitions < 1:
        raise ValueError("--threads and --repetitions must be >= 1 and --n-predict >= 2")
    prepared = gguf_run.prepare(args, console, "host-placement")
    if prepared is None:
        return None
    model, out = prepared
    stats_path = Path(tempfile.mkdtemp(prefix="host-placement-")) / "stats.json"
    rates: dict[str, list[float]] = {side: [] for side in SIDES}
    texts: dict[str, set[str]] = {side: set() for side in SIDES}
    with open(out / "rknpu-serve.log", "w") as log:
        port = launch.free_port()
        server = launch.start_rknpu_serve(port, device=args.device or None, log=log, extra=(
            "--placement", "host", "-t", str(args.threads), "--no-progress", "--stats-json", str(stats_path)))
        try:
            for _ in range(args.repetitions):
                for side, extra in zip(SIDES, (["-ngl", "0"], ["-ngl", "0", "--no-repack"],
                                               ["--rpc", f"127.0.0.1:{port}", "-ngl", "99"])):
                    text, tok_s = _complete(model, args, extra)
                    rates[side].append(tok_s)
                    texts[side].add(text.strip())
        finally:
            launch.stop(server)
    stats = json.loads(stats_path.read_text())
    stats_path.unlink()
    stats_path.parent.rmdir()
    npu_nodes = sum(r["nodes"] for r in stats.get("per_op", []) if r["engine"] == "npu")
    median = {side: statistics.median(v) for side, v in rates.items()}
    served = SIDES[2]
    rows = [{"side": side, "decode_tok_s_measured": median[side], "runs": len(rates[side]),
             "served_vs_this_measured": median[served] / median[side],
             "same_text_as_served": texts[side] == texts[served], "text": " | ".join(sorted(texts[side]))}
            for side in SIDES]
    rows[2]["npu_nodes"] = npu_nodes
    table = rp.Table("Decode: rknpu serve --placement host vs llama.cpp alone (measured on this host)", [
        rp.Column("side", "side"), rp.Column("decode_tok_s_measured", "decode tok/s (median)", "{:.2f}", figure=True),
        rp.Column("runs", "runs"), rp.Column("served_vs_this_measured", "served / this", "{:.3f}", figure=True),
        rp.Column("same_text_as_served", "same greedy text as served"), rp.Column("npu_nodes", "nodes on the NPU")],
        rows, note=f"{args.threads} thread(s) on every side, greedy, {args.n_predict} tokens, loopback, sides "
                   f"alternating for {args.repetitions} round(s); goal: served >= {GOAL} x CPU only")
    for row in rows[:2]:
        console.print(f"served / {row['side']}: {row['served_vs_this_measured']:.3f} (goal >= {GOAL}); "
                      f"same greedy text: {row['same_text_as_served']}")
    return rp.Report("host_placement", "Host placement vs llama.cpp alone (gemma3 decode)", rig.to_dict(),
                     meta={"model": str(model), "threads": args.threads, "n_predict": args.n_predict,
                           "repetitions": args.repetitions, "goal": GOAL, "load_average": _loadavg()},
                     tables=[table], raw={"rows": rows, "rates": rates, "rknpu_serve_stats": stats},
                     notes=["every rate measured on this host (not a board): llama-completion's decode eval time",
                            "the served side runs every matmul in ggml-cpu inside rknpu serve, from repacked host "
                            "copies (CPU_REPACK) where ggml repacks the type, as llama.cpp alone does by default; "
                            "--no-repack is the plain kernels' arithmetic"])


def _loadavg() -> list[float] | None:
    import os

    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
