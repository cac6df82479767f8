"""Real-model benchmark: ``llama-bench`` on one GGUF, CPU-only, through ``rknpu serve`` and,
when built, on a Vulkan device (bench/vulkan.py: the board's Mali, or a software device here).

Invariants: every side runs the same GGUF and arguments, the CPU and NPU sides one pinned
binary, the NPU side only adding ``-ngl 99 --rpc``, the Vulkan side the pinned tree built with
ggml-vulkan and ``-ngl 99``; tokens/s are ``llama-bench``'s wall-clock rates (``*_measured``),
and off a board the NPU side ran on the simulator, which the report says. Why (the seed's
fair-fight rules): docs/decisions.md "bench/model.py"."""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from rich.console import Console

from ggml_rknpu.bench import report as rp
from ggml_rknpu.bench import vulkan
from ggml_rknpu.bench.rig import RigReport
from ggml_rknpu.toolchain import launch, llamacpp

BIG_CORES = "4-7"        # RK3588 A76 cluster [docs/history.md §16; docs/anchors.md §3.4]
BIG_CORE_THREADS = 4
SIDES = ("CPU", "NPU (rknpu serve)")
# A short public-domain-style text for a smoke KL figure; pass --kl-text for a real corpus.
KL_TEXT = " ".join(["The quick brown fox jumps over the lazy dog near the river bank while the sun sets.",
                    "Paris is the capital of France and a city of art, science and history."] * 40)


def add_arguments(p: argparse.ArgumentParser, common) -> None:
    common(p, "bench-out/model")
    p.add_argument("model", type=Path, help="GGUF file (the same file runs on both sides)")
    p.add_argument("-p", "--n-prompt", type=int, default=128, help="prompt tokens (pp); the prototype's board run used 128 [docs/history.md §13]")
    p.add_argument("-n", "--n-gen", type=int, default=32, help="generated tokens (tg); the prototype's board run used 32 [docs/history.md §13]")
    p.add_argument("-r", "--repetitions", type=int, default=3)
    p.add_argument("--threads", type=int, default=None,
                   help=f"llama-bench threads (default {BIG_CORE_THREADS} pinned to cpus {BIG_CORES} on a board, else 1)")
    p.add_argument("--server-device", default=None,
                   help="device for rknpu serve (default: --device, else sim-rknpu off a board; "
                        "'host' runs every op in numpy, no NPU)")
    p.add_argument("--server-weights", default="fp16", choices=("fp16", "int8"),
                   help="precision rknpu serve stages matmul weights in (its --weights)")
    p.add_argument("--kl-divergence", action="store_true", help="add a KL-divergence column (llama-perplexity)")
    p.add_argument("--kl-text", type=Path, default=None, help="text for --kl-divergence (default: a built-in snippet)")
    p.add_argument("--ctx", type=int, default=128, help="context for llama-perplexity chunks")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per llama.cpp tool run")
    p.add_argument("--no-vulkan", action="store_true",
                   help="leave out the Vulkan side (run by default when scripts/build-llama-cpp --vulkan was built)")
    p.add_argument("--text-prompt", default="The capital of France is",
                   help="prompt whose greedy text (-n tokens) the Vulkan side must reproduce from the CPU's")


def quant_summary(model: Path) -> dict:
    """Tensor type histogram of a GGUF (and of its matmul weights alone)."""
    from gguf import GGUFReader

    reader = GGUFReader(model)
    all_types = Counter(t.tensor_type.name for t in reader.tensors)
    matmul = Counter(t.tensor_type.name for t in reader.tensors
                     if t.name.endswith(".weight") and len(t.shape) == 2 and "norm" not in t.name
                     and "embd" not in t.name)
    return {"tensor_types": dict(all_types), "matmul_weight_types": dict(matmul)}


# GGUF tensor type -> the engine precision that computes it without changing the numbers
_GGUF_FOR_ENGINE = {"fp16": {"F16"}, "int8": set()}


def _same_precision(quants: dict, server_weights: str) -> bool:
    """True when every matmul weight in the GGUF is already what the server stages (e.g. F16 ->
    fp16). int8 staging re-quantizes per row, so it never matches a GGUF type exactly."""
    types = set(quants["matmul_weight_types"])
    return bool(types) and types <= _GGUF_FOR_ENGINE[server_weights]


class ServeProcess:
    """``rknpu serve`` on a loopback port for the duration of a ``with`` block."""

    def __init__(self, device: str, weights: str, threads: int, log_path: Path, prefix: list[str],
                 ready_timeout: float = 120.0) -> None:
        self.port = launch.free_port()
        self.argv = [*prefix, sys.executable, "-m", "ggml_rknpu.cli.main", "serve", "--host", "127.0.0.1",
                     "--port", str(self.port), "--device", device, "--weights", weights, "-t", str(threads),
                     "--no-progress", "--stats", "--placement", "npu"]   # the NPU side: every eligible matmul there
        self.log_path = log_path
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> ServeProcess:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rknpu serve exited with {self.proc.returncode}; log: {self.log_path}\n"
                                   f"{self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1.0):
                    return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"rknpu serve did not listen on {self.endpoint} in {self.ready_timeout:.0f} s; "
                           f"log: {self.log_path}")

    def stop(self) -> None:
        if self.proc is not None:
            launch.stop(self.proc, timeout=10)

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"


def bench_args(model: Path, args, threads: int) -> list[str]:
    return ["-m", str(model), "-p", str(args.n_prompt), "-n", str(args.n_gen), "-r", str(args.repetitions),
            "-t", str(threads), "-o", "json"]


def run_llama_bench(tool: Path, argv: list[str], prefix: list[str], timeout: float,
                    client: str = llamacpp.PINNED, env: dict[str, str] | None = None) -> list[dict]:
    proc = subprocess.run([*prefix, str(tool), *argv], capture_output=True, text=True, timeout=timeout,
                          env=launch.tool_env(tool.name, client, **(env or {})))
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({proc.returncode}): {' '.join(argv)}\n{proc.stderr[-3000:]}")
    try:
        return json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise RuntimeError(f"llama-bench printed no JSON ({exc}):\n{proc.stdout[-2000:]}") from exc


def rows_from_llama_bench(side: str, results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        test = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
        rows.append({"side": side, "test": test, "tok_s_measured": float(r["avg_ts"]),
                     "stddev_tok_s_measured": float(r["stddev_ts"]), "backends": r.get("backends"),
                     "n_threads": r.get("n_threads"), "n_gpu_layers": r.get("n_gpu_layers"),
                     "model_type": r.get("model_type"), "build_commit": r.get("build_commit")})
    return rows


_PLACEMENT_RE = re.compile(r"MUL_MAT\s*│\s*(npu|host)\s*│\s*(\d+)")


def matmul_placement(server_log: str) -> dict[str, int] | None:
    """MUL_MAT nodes that ran on the NPU engine vs the host, from the last placement table
    ``rknpu serve --stats`` printed (None when the log has none). Proves the NPU side used the NPU."""
    last_table = server_log.rsplit("where ops ran", 1)[-1]
    found = {where: int(nodes) for where, nodes in _PLACEMENT_RE.findall(last_table)}
    # the table lists only the engines that ran a MUL_MAT: an absent engine ran none
    return {"npu": 0, "host": 0} | found if found else None


_KLD_RE = re.compile(r"Mean\s+KLD:\s+([-+0-9.eE]+)")


def kl_divergence(perplexity: Path, model: Path, text: Path, base: Path, endpoint: str, threads: int,
                  prefix: list[str], ctx: int, timeout: float) -> float:
    """Mean KL divergence of the NPU side's token distributions from the CPU's."""
    common = ["-m", str(model), "-f", str(text), "-c", str(ctx), "-t", str(threads), "-b", str(ctx)]
    runs = ([*common, "-ngl", "0", "--kl-divergence-base", str(base)],
            [*common, "-ngl", "99", "--rpc", endpoint, "--kl-divergence-base", str(base), "--kl-divergence"])
    out = ""
    for argv in runs:
        out = _run_perplexity([*prefix, str(perplexity), *argv], timeout)
    m = _KLD_RE.search(out)
    if not m:
        raise RuntimeError(f"no 'Mean KLD' in llama-perplexity output:\n{out[-2000:]}")
    return float(m.group(1))


def _run_perplexity(argv: list[str], timeout: float) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env=launch.tool_env("llama-perplexity"))
    if proc.returncode != 0:
        raise RuntimeError(f"llama-perplexity failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def vulkan_side(device: vulkan.VulkanDevice, args, common: list[str], threads: int,
                prefix: list[str]) -> tuple[list[dict], dict]:
    """The Vulkan side's llama-bench rows and its greedy text beside the CPU build's."""
    tool = llamacpp.tool("llama-bench", llamacpp.VULKAN)
    rows = rows_from_llama_bench(vulkan.SIDE, run_llama_bench(tool, [*common, "-ngl", "99"], prefix, args.timeout,
                                                              llamacpp.VULKAN, device.env))
    for row in rows:
        row["device"] = device.label
    texts = {client: vulkan.greedy_text(client, args.model, args.text_prompt, args.n_gen, threads, ["-ngl", ngl],
                                        env, prefix, args.timeout)
             for client, ngl, env in ((llamacpp.PINNED, "0", {}), (llamacpp.VULKAN, "99", device.env))}
    text, runs = texts[llamacpp.VULKAN]
    return rows, {"device": device.name, "description": device.description, "software": device.software,
                  "env": device.env, "prompt": args.text_prompt, "text": text, "decode_runs": runs,
                  "cpu_text": texts[llamacpp.PINNED][0], "text_matches_cpu": text == texts[llamacpp.PINNED][0]}


def _vulkan_notes(vk: dict | None, absent: str) -> list[str]:
    if vk is None:
        return [f"Vulkan side absent: {absent}"]
    notes = [f"Vulkan side: {vk['device']} = {vk['description']}, the pinned llama.cpp built with ggml-vulkan "
             "(scripts/build-llama-cpp --vulkan), same llama-bench arguments with -ngl 99"]
    if vk["software"]:
        notes.append(f"Vulkan side ran on a software Vulkan device ({' '.join(f'{k}={v}' for k, v in vk['env'].items())}):"
                     " its tok/s measure this host's CPU running the shaders, not a GPU")
    notes.append(f"greedy text for {vk['prompt']!r} ({vk['decode_runs']} decode passes) on the Vulkan side is "
                 + ("the CPU's" if vk["text_matches_cpu"] else f"NOT the CPU's: {vk['text']!r} vs {vk['cpu_text']!r}"))
    return notes


def run(args, rig: RigReport, console: Console) -> rp.Report | None:
    if not args.model.is_file():
        console.print(f"[red]bench model: GGUF not found: {args.model}[/]")
        return None
    try:
        bench_tool = llamacpp.tool("llama-bench")
        perplexity = llamacpp.tool("llama-perplexity") if args.kl_divergence else None
    except llamacpp.LlamaCppNotBuilt as exc:
        console.print(f"[red]bench model: {exc}[/]")
        return None
    on_board = rig.on_board
    threads = args.threads or (BIG_CORE_THREADS if on_board else 1)
    prefix = ["taskset", "-c", BIG_CORES] if on_board else []
    device = args.server_device or args.device or ("auto" if on_board else "sim-rknpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    quants = quant_summary(args.model)
    common = bench_args(args.model, args, threads)
    rows: list[dict] = []
    kld = None
    found = "left out (--no-vulkan)" if args.no_vulkan else vulkan.find_device(threads, args.timeout)
    vk: dict | None = None
    with rp.progress(console, "llama-bench", 3 if isinstance(found, vulkan.VulkanDevice) else 2) as advance:
        rows += rows_from_llama_bench(SIDES[0], run_llama_bench(bench_tool, [*common, "-ngl", "0"], prefix,
                                                                args.timeout))
        advance(1)
        with ServeProcess(device, args.server_weights, threads, out / "rknpu-serve.log", prefix) as server:
            npu_argv = [*common, "-ngl", "99", "--rpc", server.endpoint]
            rows += rows_from_llama_bench(SIDES[1], run_llama_bench(bench_tool, npu_argv, prefix, args.timeout))
            advance(1)
            if perplexity is not None:
                text = args.kl_text or out / "kl_text.txt"
                if args.kl_text is None:
                    text.write_text(KL_TEXT)
                kld = kl_divergence(perplexity, args.model, text, out / "kl_base.bin", server.endpoint, threads,
                                    prefix, args.ctx, args.timeout)
        if isinstance(found, vulkan.VulkanDevice):
            vk_rows, vk = vulkan_side(found, args, common, threads, prefix)
            rows += vk_rows
            advance(1)
    placement = matmul_placement(server.log_tail(200_000))
    if kld is not None:
        for row in rows:
            if row["side"] == SIDES[1]:
                row["kl_divergence_measured"] = kld
    simulated = device.startswith("sim")
    cpu_w = ", ".join(f"{k}x{v}" for k, v in sorted(quants["matmul_weight_types"].items()))
    npu_w = "host numpy (no NPU)" if device == "host" else args.server_weights
    notes = [f"quant: CPU side computes the GGUF's matmul weights as stored ({cpu_w or 'none found'}); "
             f"NPU side: rknpu serve stages them as {npu_w} - "
             + ("same precision on both sides" if _same_precision(quants, args.server_weights) else
                "NOT the same precision: for a like-for-like fight compare with a CPU run of a GGUF in "
                f"{args.server_weights} [docs/history.md §15]"),
             f"same llama-bench binary and arguments on both sides: {' '.join(common)}; NPU side adds "
             "-ngl 99 --rpc <rknpu serve>; CPU side -ngl 0"]
    if on_board:
        notes.append(f"pinned: taskset -c {BIG_CORES} -t {threads} (big cores; docs/history.md §16)")
    else:
        notes.append("not a board: -t 1, unpinned")
    notes.append("MUL_MAT nodes on the NPU side: " + (
        f"{placement.get('npu', 0)} on the NPU engine, {placement.get('host', 0)} on the host (rknpu serve --stats)"
        if placement else "unknown (no placement table in rknpu-serve.log)"))
    if simulated:
        notes.append(f"NPU side ran on the simulator ({device}) on this host: its tok/s measures the simulator, "
                     "not the NPU")
    notes += _vulkan_notes(vk, "" if isinstance(found, vulkan.VulkanDevice) else found)
    columns = [rp.Column("side", "side"), rp.Column("test", "test"),
               rp.Column("tok_s_measured", "t/s", "{:.2f}", figure=True),
               rp.Column("stddev_tok_s_measured", "+-", "{:.2f}", figure=True),
               rp.Column("backends", "backends"), rp.Column("n_threads", "threads")]
    if kld is not None:
        columns.append(rp.Column("kl_divergence_measured", "KL divergence vs CPU", "{:.3g}", figure=True))
    if vk is not None:
        columns.append(rp.Column("device", "Vulkan device"))
    tests = list(dict.fromkeys(r["test"] for r in rows))
    labels = {SIDES[0]: f"{SIDES[0]} (measured)",
              SIDES[1]: f"{SIDES[1]} (measured{', simulator' if simulated else ''})"}
    if vk is not None:
        labels[vulkan.SIDE] = f"{vulkan.SIDE}: {vk['description']} (measured{', software' if vk['software'] else ''})"
    series = [rp.Series(label, tests,
                        [next((r["tok_s_measured"] for r in rows if r["side"] == side and r["test"] == t), 0.0)
                         for t in tests]) for side, label in labels.items()]
    plot = rp.Plot("cpu_vs_npu.png", f"llama-bench {args.model.name}: CPU vs NPU" + (" vs Vulkan" if vk else ""),
                   "test", "tokens/s", series, kind="bar")
    meta = {"model": str(args.model), "threads": threads, "server_weights": args.server_weights,
            "matmul_nodes": placement, "pinned": bool(prefix), "server_device": device,
            "llama_cpp": f"{llamacpp.LLAMA_CPP_COMMIT} (llama-cpp-python {llamacpp.LLAMA_CPP_PYTHON_VERSION})",
            "vulkan": vk or {"absent": found}, **quants}
    title = f"llama-bench: {args.model.name}, CPU vs rknpu serve" + (" vs Vulkan" if vk else "")
    return rp.Report("model", title, rig.to_dict(), meta=meta,
                     tables=[rp.Table("llama-bench", columns, rows)], plots=[plot],
                     raw={"rows": rows, "kl_divergence": kld, "vulkan": vk}, notes=notes)
