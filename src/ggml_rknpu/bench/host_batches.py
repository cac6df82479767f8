"""Host placement at small batches against llama.cpp alone: ``llama-bench`` prompt rates of
M = 1, 2, 4, 8 tokens for one weight type (the demo's gemma-3-270m requantized, every 2-D
weight ``--quant``), CPU-only (repacked weights, its default, and ``--repack 0``) and through
``rknpu serve --placement host`` (repacked host copies, its default, and ``--no-host-repack``).

Invariants: the same pinned llama-bench, GGUF, thread count and sizes on every side, the
served sides only adding ``--rpc -ngl 99``; the sides alternate for ``--rounds`` rounds (a
shared box's load shifts) and each rate is the median over the rounds of llama-bench's own
mean (``*_measured``, this host). What it shows: whether ggml-cpu served through our RPC
server keeps pace with llama.cpp alone at the M where the repacked kernels pay; not the board."""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

from rich.console import Console

from ggml_rknpu.bench import gguf_run
from ggml_rknpu.bench import report as rp
from ggml_rknpu.toolchain import launch, llamacpp, models

GOAL = 0.85                    # the goal: served / CPU-only at least this
ALONE = "llama.cpp alone (repacked)"
SIDES = (ALONE, "llama.cpp alone, --repack 0", "rknpu serve --placement host (repacked copies)",
         "rknpu serve --placement host --no-host-repack")


def add_arguments(p, common) -> None:
    common(p, "bench-out/host-batches")
    p.add_argument("--model", type=Path, default=None,
                   help="GGUF to requantize (default: gemma-3-270m Q4_K_M from PyPI)")
    p.add_argument("--quant", default="Q4_0", help="weight type of every 2-D weight (default Q4_0)")
    p.add_argument("-p", "--prompt-sizes", default="1,2,4,8", help="batch sizes M (llama-bench -p)")
    p.add_argument("-t", "--threads", type=int, default=1, help="threads on every side (default 1)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="llama-bench -r per run (default 5)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of the four sides (default 3)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per llama-bench run")


def bench_rates(stdout: str) -> dict[int, float]:
    """llama-bench ``-o json``: prompt size -> its mean tokens/s (generation tests skipped)."""
    return {int(r["n_prompt"]): float(r["avg_ts"]) for r in json.loads(stdout) if int(r["n_gen"]) == 0}


def _bench(model: Path, args, extra: list[str]) -> dict[int, float]:
    cmd = [str(llamacpp.tool("llama-bench")), "-m", str(model), "-t", str(args.threads), "-p", args.prompt_sizes,
           "-n", "0", "-r", str(args.repetitions), "-o", "json", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, stdin=subprocess.DEVNULL,
                          env=launch.tool_env("llama-bench"))
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return bench_rates(proc.stdout)


def run(args, rig, console: Console) -> rp.Report | None:
    if args.threads < 1 or args.repetitions < 1 or args.rounds < 1:
        raise ValueError("--threads, --repetitions and --rounds must be >= 1")
    sizes = [int(s) for s in args.prompt_sizes.split(",")]
    prepared = gguf_run.prepare(args, console, "host-batches")
    if prepared is None:
        return None
    source, out = prepared
    console.print(f"requantizing {source.name} to {args.quant} (once; gguf's quantizer) ...")
    model = models.requantized(source, args.quant)
    rates: dict[str, dict[int, list[float]]] = {side: {m: [] for m in sizes} for side in SIDES}
    with open(out / "rknpu-serve.log", "w") as log:
        ports = [launch.free_port(), launch.free_port()]
        servers = [launch.start_rknpu_serve(port, device=args.device or None, log=log, extra=(
            "--placement", "host", "-t", str(args.threads), "--no-progress", *flag))
            for port, flag in zip(ports, ((), ("--no-host-repack",)))]
        try:
            extras = (["-ngl", "0"], ["-ngl", "0", "--repack", "0"],
                      ["--rpc", f"127.0.0.1:{ports[0]}", "-ngl", "99"], ["--rpc", f"127.0.0.1:{ports[1]}", "-ngl", "99"])
            for _ in range(args.rounds):
                for side, extra in zip(SIDES, extras):
                    for m, v in _bench(model, args, extra).items():
                        rates[side][m].append(v)
        finally:
            for server in servers:
                launch.stop(server)
    median = {side: {m: statistics.median(v) for m, v in by_m.items()} for side, by_m in rates.items()}
    rows = [{"M": m, "side": side, "tok_s_measured": median[side][m], "runs": len(rates[side][m]),
             "vs_alone_measured": median[side][m] / median[ALONE][m], "all_tok_s": rates[side][m]}
            for m in sizes for side in SIDES]
    table = rp.Table(f"Prompt of M tokens, every weight {args.quant}: served vs llama.cpp alone (measured on this host)", [
        rp.Column("M", "M"), rp.Column("side", "side"),
        rp.Column("tok_s_measured", "tok/s (median)", "{:.1f}", figure=True), rp.Column("runs", "rounds"),
        rp.Column("vs_alone_measured", "÷ alone (repacked)", "{:.3f}", figure=True)],
        rows, note=f"llama-bench -p {args.prompt_sizes} -n 0 -t {args.threads} -r {args.repetitions}, sides "
                   f"alternating for {args.rounds} round(s); goal: served >= {GOAL} x alone")
    for m in sizes:
        console.print(f"M={m}: served (repacked copies) / alone {median[SIDES[2]][m] / median[ALONE][m]:.3f}, "
                      f"without repack {median[SIDES[3]][m] / median[ALONE][m]:.3f} (goal >= {GOAL})")
    return rp.Report("host_batches", f"Host placement at small M vs llama.cpp alone ({args.quant})", rig.to_dict(),
                     meta={"model": str(model), "quant": args.quant, "threads": args.threads, "sizes": sizes,
                           "repetitions": args.repetitions, "rounds": args.rounds, "goal": GOAL},
                     tables=[table], raw={"rows": rows},
                     notes=["every rate measured on this host (not a board): llama-bench's prompt rate, RPC "
                            "round trips included on the served sides"])
