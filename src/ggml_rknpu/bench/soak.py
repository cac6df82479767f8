"""Soak benchmark: ``llama-server --rpc`` with parallel slots, many concurrent chat requests,
NPU faults injected at a low rate: zero failed requests, zero wrong answers, latency and
RSS over time.

Invariants: every answer is compared with its prompt's reference, answered first one at a
time at temperature 0 by a fault-free ``rknpu serve``; latency is wall-clock per request,
*measured* on this host (off a board the matmuls ran on the simulator, which the report
says); RSS is sampled every second. Not a CI test. Why and the method:
docs/decisions.md "bench/soak.py"; use: docs/faults.md "Soak"."""

from __future__ import annotations

import json
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console

from ggml_rknpu.bench import gguf_run, llama_server
from ggml_rknpu.bench import report as rp
from ggml_rknpu.toolchain import launch

DEFAULT_FAULTS = "timeout:0.002,dma:0.002,stale:0.002,core:0.002,seed=1"


def add_arguments(p, common) -> None:
    common(p, "bench-out/soak")
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: gemma-3-270m Q4_K_M from PyPI)")
    p.add_argument("--requests", type=int, default=200, help="chat completions in the loop (default 200)")
    p.add_argument("--minutes", type=float, default=None,
                   help="run for this long instead of a number of requests (the RSS growth after warm-up is the figure)")
    p.add_argument("--concurrency", type=int, default=4, help="client threads = llama-server -np (default 4)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per answer (default 8)")
    p.add_argument("--sim-faults", default=DEFAULT_FAULTS, metavar="SPEC",
                   help=f"faults for rknpu serve (default {DEFAULT_FAULTS!r}); simulator only")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per request")


class _Rss:
    """Samples a process's resident set every ``period`` seconds (measured, /proc)."""

    def __init__(self, pid: int, period: float = 1.0) -> None:
        self.pid, self.period = pid, period
        self.samples: list[tuple[float, float]] = []   # (seconds since start, RSS MiB)
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with open(f"/proc/{self.pid}/status") as f:
                    kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
                self.samples.append((time.monotonic() - self._t0, kib / 1024))
            except (OSError, StopIteration):
                pass
            self._stop.wait(self.period)

    def stop(self) -> list[tuple[float, float]]:
        self._stop.set()
        self._thread.join()
        return self.samples


WARMUP = 0.2   # of the run after the first answer: allocator and caches settle (weights staged, plans built)
TAIL = 0.1     # of the samples: the window compared at each end (a median: one GC or compute peak does not count)


def rss_growth_after_warmup(samples: list[tuple[float, float]], first_done: float) -> float | None:
    """Percent RSS growth from just after the warm-up to the end of the run (None: too few samples)."""
    after = [m for t, m in samples if t >= first_done]
    after = after[int(WARMUP * len(after)):]
    n = max(1, int(TAIL * len(after)))
    if len(after) < 2 * n or len(after) < 4:
        return None
    start, end = sorted(after[:n])[n // 2], sorted(after[-n:])[n // 2]
    return 100.0 * (end - start) / start


def run(args, rig, console: Console) -> rp.Report | None:
    prepared = gguf_run.prepare(args, console, "soak")
    if prepared is None:
        return None
    model, out = prepared
    device = args.device or "sim-rknpu"
    questions = llama_server.QUESTIONS
    distinct = list(questions[:min(len(questions), args.requests)] if args.minutes is None else questions)

    console.print(f"soak: fault-free reference answers for {len(distinct)} prompts ...")
    reference = {}
    with open(out / "reference-rknpu-serve.log", "w") as slog, open(out / "reference-llama-server.log", "w") as llog:
        rpc_port = launch.free_port()
        server = launch.start_rknpu_serve(rpc_port, device=device, log=slog,
                                          extra=("--no-progress", "--placement", "npu"))
        try:
            llama, port = llama_server.start(model, rpc_port, args.concurrency, llog)
            try:
                for q in distinct:
                    reference[q] = llama_server.ask(port, q, args.max_tokens, args.timeout)
            finally:
                launch.stop(llama)
        finally:
            launch.stop(server)

    amount = f"{args.minutes:g} minutes" if args.minutes is not None else f"{args.requests} requests"
    console.print(f"soak: {amount}, {args.concurrency} at a time, faults {args.sim_faults!r} ...")
    stats_path = Path(tempfile.mkdtemp(prefix="soak-")) / "stats.json"
    results: list[dict] = []
    with open(out / "rknpu-serve.log", "w") as slog, open(out / "llama-server.log", "w") as llog:
        rpc_port = launch.free_port()
        server = launch.start_rknpu_serve(rpc_port, device=device, log=slog, extra=(
            "--no-progress", "--placement", "npu", "--sim-faults", args.sim_faults, "--stats-json", str(stats_path)))
        rss = _Rss(server.pid)
        t_start = time.monotonic()
        try:
            llama, port = llama_server.start(model, rpc_port, args.concurrency, llog)
            try:
                def one(i: int) -> dict:
                    question = distinct[i % len(distinct)]
                    t0 = time.monotonic()
                    try:
                        text, error = llama_server.ask(port, question, args.max_tokens, args.timeout), None
                    except Exception as exc:      # counted as a failed request, never hidden
                        text, error = None, f"{type(exc).__name__}: {exc}"
                    t1 = time.monotonic()
                    return {"i": i, "start_s": t0 - t_start, "latency_s_measured": t1 - t0, "error": error,
                            "correct": text == reference[question]}

                def worker(first: int) -> list[dict]:   # --minutes: requests until the time is up
                    done, i = [], first
                    while time.monotonic() < t_end:
                        done.append(one(i))
                        i += args.concurrency
                    return done

                with ThreadPoolExecutor(args.concurrency) as pool:
                    if args.minutes is None:
                        results = list(pool.map(one, range(args.requests)))
                    else:
                        t_end = time.monotonic() + 60.0 * args.minutes
                        results = sorted((r for rs in pool.map(worker, range(args.concurrency)) for r in rs),
                                         key=lambda r: r["start_s"])
            finally:
                launch.stop(llama)
        finally:
            launch.stop(server)
            samples = rss.stop()
    stats = json.loads(stats_path.read_text()) if stats_path.is_file() else {}

    latencies = sorted(r["latency_s_measured"] for r in results)
    failed = sum(r["error"] is not None for r in results)
    wrong = sum(r["error"] is None and not r["correct"] for r in results)

    def pct(p: float) -> float:
        return latencies[min(len(latencies) - 1, int(p * len(latencies)))] if latencies else float("nan")

    # RSS once the model is loaded and the first answer is out (before that it grows with the upload),
    # until the last answer (after it the server frees the client's buffers as llama-server stops)
    first_done = min((r["start_s"] + r["latency_s_measured"] for r in results), default=0.0)
    last_done = max((r["start_s"] + r["latency_s_measured"] for r in results), default=float("inf"))
    samples = [(t, m) for t, m in samples if t <= last_done]
    warm = [m for t, m in samples if t >= first_done]
    growth = rss_growth_after_warmup(samples, first_done)
    row = {"requests": len(results), "failed": failed, "wrong": wrong,
           "p50_s_measured": pct(0.50), "p99_s_measured": pct(0.99),
           "rss_first_mib_measured": warm[0] if warm else None,
           "rss_last_mib_measured": samples[-1][1] if samples else None,
           "rss_max_mib_measured": max(s[1] for s in samples) if samples else None,
           "rss_growth_pct_measured": growth,
           "faults_injected": sum(v for k, v in stats.get("faults_injected", {}).items() if k != "submits"),
           "recoveries": stats.get("recovery", {}).get("resets")}
    table = rp.Table("Soak: concurrent chat completions through llama-server --rpc with injected NPU faults", [
        rp.Column("requests", "requests"), rp.Column("failed", "failed"), rp.Column("wrong", "wrong answers"),
        rp.Column("p50_s_measured", "latency p50 s", "{:.2f}", figure=True),
        rp.Column("p99_s_measured", "latency p99 s", "{:.2f}", figure=True),
        rp.Column("rss_first_mib_measured", "serve RSS after 1st answer MiB", "{:.1f}", figure=True),
        rp.Column("rss_last_mib_measured", "serve RSS last MiB", "{:.1f}", figure=True),
        rp.Column("rss_max_mib_measured", "serve RSS max MiB", "{:.1f}", figure=True),
        rp.Column("rss_growth_pct_measured", "RSS growth after warm-up %", "{:.2f}", figure=True),
        rp.Column("faults_injected", "faults injected"), rp.Column("recoveries", "NPU resets"),
    ], [row], note=f"-np {args.concurrency}, {args.concurrency} client threads, {args.max_tokens} tokens per answer, "
                   f"temperature 0, loopback")
    plots = [
        rp.Plot("latency.png", "Request latency over the run", "request start (s)", "latency (s)",
                [rp.Series("latency (measured)", [r["start_s"] for r in results],
                           [r["latency_s_measured"] for r in results])]),
        rp.Plot("rss.png", "rknpu serve resident memory over the run", "time (s)", "RSS (MiB)",
                [rp.Series("RSS (measured)", [s[0] for s in samples], [s[1] for s in samples])]),
    ]
    notes = [f"model {model}; device {device}; faults {args.sim_faults}",
             f"RSS growth after warm-up: the median of the last {TAIL:.0%} of the samples over the median of "
             f"the {TAIL:.0%} that follow the warm-up (the first answer, then {WARMUP:.0%} of the rest)",
             "a wrong answer is one whose text differs from the fault-free reference of the same prompt"]
    if device.startswith("sim"):
        notes.append("the matmuls ran on the NPU simulator on this host: latencies are the simulator's, not an NPU's")
    return rp.Report("soak", "Soak: llama-server --rpc under load with injected NPU faults", rig.to_dict(),
                     meta={"model": str(model), "device": device, "sim_faults": args.sim_faults},
                     tables=[table], plots=plots,
                     raw={"requests": results, "rss": samples, "rknpu_serve_stats": stats,
                          "reference": reference}, notes=notes)
