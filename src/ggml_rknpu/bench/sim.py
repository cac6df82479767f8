"""``rknpu bench sim``: how fast the simulator runs a matmul, against numpy on the same host.

WHY: off a board the simulator is the NPU (CI, the demo, a newcomer's first run), so its
speed is the product's speed there. This times ``ggml_rknpu.open(device="sim-...")``,
``upload_weight`` and ``matmul`` through the public API, and a plain float32 numpy matmul
of the same shape, in one process, and prints the ratio (goal: <= 3x numpy).
Every figure is wall time *measured* on this host; nothing here says how fast an NPU is.
The ``sim share`` column is the part of the call spent inside the NPU model
(``SimKernel.simulation_seconds``); the rest is the engine's host path (pack, submit,
unpack) and the simulated kernel.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import numpy as np
from rich.console import Console

from ggml_rknpu.bench import report as rp
from ggml_rknpu.bench.matmul import host_description

GOAL_RATIO = 3.0


@dataclass(frozen=True)
class SimShape:
    M: int
    K: int
    N: int
    kind: str     # "decode" | "prefill"


# Decode: one row against gemma3-270m-like widths (K=640, output projection N=262144) and a
# 1.5B-class FFN (K=2048, N=8960); prefill: 512 rows, K and N in 2048..8960.
SHAPES = (
    SimShape(1, 640, 262144, "decode"),
    SimShape(1, 640, 65536, "decode"),
    SimShape(1, 2048, 8960, "decode"),
    SimShape(1, 8960, 2048, "decode"),
    SimShape(512, 2048, 2048, "prefill"),
    SimShape(512, 2048, 8960, "prefill"),
    SimShape(512, 8960, 2048, "prefill"),
)

COLUMNS = [
    rp.Column("kind", "kind"), rp.Column("M", "M"), rp.Column("K", "K"), rp.Column("N", "N"),
    rp.Column("dtype", "dtype"),
    rp.Column("sim_ms_measured", "sim matmul ms", "{:.2f}", figure=True),
    rp.Column("numpy_ms_measured", "numpy ms", "{:.2f}", figure=True),
    rp.Column("ratio_measured", "sim / numpy", "{:.2f}", figure=True),
    rp.Column("sim_share_measured", "in NPU model", "{:.0%}", figure=True),
    rp.Column("verdict", f"<= {GOAL_RATIO:g}x"),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="bench-out/sim", metavar="DIR", help="report directory (default bench-out/sim)")
    p.add_argument("--device", default="sim-rknpu", choices=("sim-rknpu", "sim-rocket"))
    p.add_argument("--dtype", default="fp16", choices=("fp16", "int8"))
    p.add_argument("--cores", type=int, default=3, choices=(1, 2, 3))
    p.add_argument("--iters", type=int, default=5, help="timed calls per shape (median reported)")
    p.add_argument("--kinds", default="decode,prefill", help="comma list: decode, prefill")


def _median_s(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(npu, shape: SimShape, dtype: str, iters: int, rng: np.random.Generator) -> dict:
    """One shape: median wall time of ``npu.matmul`` (after one warm-up call, which compiles
    and decodes) and of ``a @ b.T`` in float32 numpy."""
    b = rng.standard_normal((shape.N, shape.K), dtype=np.float32)
    a = rng.standard_normal((shape.M, shape.K), dtype=np.float32)
    w = npu.upload_weight(b, dtype)
    try:
        npu.matmul(a, w)
        kernel = npu.device.syscalls
        busy0 = getattr(kernel, "simulation_seconds", None)
        t0 = time.perf_counter()
        sim_s = _median_s(lambda: npu.matmul(a, w), iters)
        wall = time.perf_counter() - t0
        busy1 = getattr(kernel, "simulation_seconds", None)
    finally:
        w.free()
    numpy_s = _median_s(lambda: a @ b.T, iters)
    ratio = sim_s / numpy_s
    share = None if busy0 is None or busy1 is None else (busy1 - busy0) / wall
    return {"kind": shape.kind, "M": shape.M, "K": shape.K, "N": shape.N, "dtype": dtype,
            "sim_ms_measured": sim_s * 1e3, "numpy_ms_measured": numpy_s * 1e3, "ratio_measured": ratio,
            "sim_share_measured": share, "verdict": "ok" if ratio <= GOAL_RATIO else "SLOW"}


def run(args: argparse.Namespace, console: Console) -> int:
    import ggml_rknpu

    kinds = {k.strip() for k in args.kinds.split(",") if k.strip()}
    shapes = [s for s in SHAPES if s.kind in kinds]
    if not shapes:
        console.print(f"[bold red]bench sim:[/] no shapes for kinds {sorted(kinds)}: choose decode, prefill")
        return 2
    rng = np.random.default_rng(0)
    rows = []
    npu = ggml_rknpu.open(device=args.device, cores=args.cores)
    try:
        with rp.progress(console, "sim", len(shapes)) as advance:
            for shape in shapes:
                rows.append(measure(npu, shape, args.dtype, args.iters, rng))
                advance()
    finally:
        npu.close()
    slow = [r for r in rows if r["verdict"] != "ok"]
    meta = {"device": args.device, "dtype": args.dtype, "cores": args.cores, "iters": args.iters,
            "host": host_description()}
    notes = [f"wall times measured on this host ({meta['host']}), median of {args.iters} calls after a warm-up; "
             "the simulator's speed, not an NPU's",
             "numpy: a @ b.T in float32 with the same a and b; set OPENBLAS_NUM_THREADS=1 for a single-threaded "
             "comparison",
             f"{len(rows) - len(slow)}/{len(rows)} shapes within {GOAL_RATIO:g}x numpy"]
    report = rp.Report("sim", f"Simulator matmul speed ({args.device}) against numpy", rig={}, meta=meta,
                       tables=[rp.Table("Simulated matmul vs numpy (median per call)", COLUMNS, rows)],
                       raw={"rows": rows}, notes=notes)
    report.print(console)
    paths = report.write(args.out)
    console.print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
