"""NPU-submit host benchmark: the host work around each submit of single-stream decode, by phase
(pack, canaries, syncs + submit on our side, unpack), measured on this host.

Invariants: the submits are one token's as the server issues them, replayed on the simulated
device through ``kernel.trace.TimingSyscalls``; the time inside the simulated kernel's
ioctl handlers is shown apart and is *not* a host cost on a board. Why and the method:
docs/decisions.md "bench/npu_submit.py"."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

import numpy as np
from rich.console import Console

from ggml_rknpu.bench import report as rp
from ggml_rknpu.bench.matmul import host_description

PHASES = ("pack", "canaries", "syncs_submit", "unpack")


@dataclass(frozen=True)
class LayerShape:
    """The weight shapes of one decoder layer (gemma-3-270m by default)."""

    hidden: int = 640
    q: int = 1024
    kv: int = 256
    ffn: int = 2048

    def submits(self) -> list[tuple[str, int, list[int]]]:
        """(name, K, N of each chained member) of the 4 decode submits, as the server groups them."""
        return [("q+k+v", self.hidden, [self.q, self.kv, self.kv]), ("o", self.q, [self.hidden]),
                ("gate+up", self.hidden, [self.ffn, self.ffn]), ("down", self.ffn, [self.hidden])]


class _ServerSubmit:
    """One NPU submit as a ``server.plan_steps`` step issues it: ``NpuEngine.fuse(...).run(a,
    outs=...)``, several siblings chained, a lone weight as a one-weight fusion, results
    straight into the step's arrays. ``run`` -> (pack, submit, unpack, canaries) host seconds."""

    def __init__(self, npu, weights: list) -> None:
        self.fusion = npu.fuse(weights)

    def run(self, a: np.ndarray, outs: list[np.ndarray]) -> tuple[float, float, float, float]:
        self.fusion.run(a, outs=outs)
        return (*self.fusion.timing, self.fusion.canary_s)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="bench-out/npu-submit", metavar="DIR", help="report directory")
    p.add_argument("--device", default="sim-rknpu", choices=("sim-rknpu", "sim-rocket"))
    p.add_argument("--dtype", default="fp16", choices=("fp16", "int8"))
    p.add_argument("--layers", type=int, default=4, help="decoder layers replayed per token (default 4)")
    p.add_argument("--tokens", type=int, default=50, help="tokens replayed (default 50)")
    p.add_argument("--hidden", type=int, default=640)
    p.add_argument("--q", type=int, default=1024)
    p.add_argument("--kv", type=int, default=256)
    p.add_argument("--ffn", type=int, default=2048)


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def measure(device: str, dtype: str, shape: LayerShape, layers: int, tokens: int, rng: np.random.Generator) -> dict:
    """Per submit kind: per-phase µs (median and min over tokens), ioctls per submit, and the
    simulator's µs per submit (NPU model; simulated driver)."""
    from ggml_rknpu.devices import open_simulated
    from ggml_rknpu.engine.api import NpuEngine
    from ggml_rknpu.kernel.trace import TimingSyscalls
    from ggml_rknpu.sim.kernel import SimKernel

    kernel = TimingSyscalls(SimKernel(device.removeprefix("sim-")))  # type: ignore[arg-type]
    npu = NpuEngine(open_simulated(device.removeprefix("sim-"), kernel=kernel))
    try:
        plan = []
        for _ in range(layers):
            for name, k, ns in shape.submits():
                weights = [npu.upload_weight((rng.standard_normal((n, k)) * 0.05).astype(np.float32), dtype)
                           for n in ns]
                a = rng.standard_normal((1, k)).astype(np.float32)
                outs = [np.empty((1, n), np.float32) for n in ns]
                plan.append((name, _ServerSubmit(npu, weights), a, outs))
        for _name, sub, a, outs in plan:   # warm: programs compiled, tables built
            sub.run(a, outs)
        kinds = list(dict.fromkeys(name for name, *_ in plan))
        per_token: dict[str, dict[str, list[float]]] = {k: {p: [] for p in (*PHASES, "npu_model", "sim_driver")}
                                                        for k in kinds}
        calls: dict[str, dict[str, int]] = {k: {} for k in kinds}
        for _ in range(tokens):
            sums = {k: dict.fromkeys((*PHASES, "npu_model", "sim_driver"), 0.0) for k in kinds}
            for name, sub, a, outs in plan:
                kernel.clear()
                sim0 = kernel.simulation_seconds
                pack_s, submit_s, unpack_s, canary_s = sub.run(a, outs)
                model_s = kernel.simulation_seconds - sim0
                in_kernel_s = sum(kernel.ns.values()) * 1e-9
                s = sums[name]
                s["pack"] += pack_s
                s["canaries"] += canary_s
                s["syncs_submit"] += submit_s - canary_s - in_kernel_s
                s["unpack"] += unpack_s
                s["npu_model"] += model_s
                s["sim_driver"] += in_kernel_s - model_s
                for ioctl, n in kernel.calls.items():
                    calls[name][ioctl] = n
            for name in kinds:
                for phase, total in sums[name].items():
                    per_token[name][phase].append(total / layers * 1e6)
    finally:
        npu.close()
    rows = []
    for name in kinds:
        row: dict = {"submit": name, "K": next(k for n, k, _ in shape.submits() if n == name),
                     "N": "+".join(str(n) for n in next(ns for n, _, ns in shape.submits() if n == name)),
                     "ioctls": ", ".join(f"{n} {c}" for c, n in sorted(calls[name].items()))}
        for phase, values in per_token[name].items():
            row[f"{phase}_us_measured"] = statistics.median(values)
            row[f"{phase}_min_us_measured"] = min(values)
        host = [sum(per_token[name][p][i] for p in PHASES) for i in range(tokens)]
        row["host_us_measured"] = statistics.median(host)
        row["host_min_us_measured"] = min(host)
        rows.append(row)
    return {"rows": rows}


COLUMNS = [
    rp.Column("submit", "submit"), rp.Column("K", "K"), rp.Column("N", "N"),
    rp.Column("pack_us_measured", "pack µs", "{:.1f}", figure=True),
    rp.Column("canaries_us_measured", "canaries µs", "{:.1f}", figure=True),
    rp.Column("syncs_submit_us_measured", "syncs+submit µs (ours)", "{:.1f}", figure=True),
    rp.Column("unpack_us_measured", "unpack µs", "{:.1f}", figure=True),
    rp.Column("host_us_measured", "host µs", "{:.1f}", figure=True),
    rp.Column("host_min_us_measured", "host µs (min)", "{:.1f}"),
    rp.Column("npu_model_us_measured", "sim: NPU model µs", "{:.0f}"),
    rp.Column("sim_driver_us_measured", "sim: driver µs", "{:.1f}"),
    rp.Column("ioctls", "ioctls per submit"),
]


def run(args: argparse.Namespace, console: Console) -> int:
    shape = LayerShape(args.hidden, args.q, args.kv, args.ffn)
    load0 = _loadavg()
    t0 = time.perf_counter()
    result = measure(args.device, args.dtype, shape, args.layers, args.tokens, np.random.default_rng(0))
    wall = time.perf_counter() - t0
    load1 = _loadavg()
    rows = result["rows"]
    per_submit = statistics.mean(r["host_us_measured"] for r in rows)
    meta = {"device": args.device, "dtype": args.dtype, "layers": args.layers, "tokens": args.tokens,
            "shape": {"hidden": shape.hidden, "q": shape.q, "kv": shape.kv, "ffn": shape.ffn}, "host": host_description(),
            "load_average": [load0, load1], "wall_s": wall}
    notes = [f"measured on this host ({meta['host']}), load average {load0} -> {load1}; not a board figure. "
             f"Median over {args.tokens} tokens of the per-submit mean ({args.layers} layers, M = 1, {args.dtype})",
             "host µs = pack + canaries + syncs+submit (ours: the device/ABI/driver wrappers, outside the "
             "kernel's ioctl handlers) + unpack",
             "sim columns: time inside the simulated kernel's ioctl handlers (the NPU model's execution; the "
             "simulated driver's checks and cache copies): not a host cost on a board",
             f"mean host µs per NPU submit over the 4 submit kinds: {per_submit:.1f}; per token at 4 submits per layer: "
             f"{per_submit * 4:.0f} µs per layer"]
    report = rp.Report("npu-submit", f"Host work per NPU decode submit ({args.device}, {args.dtype})", rig={},
                       meta=meta, tables=[rp.Table("Host µs per NPU submit, by phase (median over tokens)",
                                                   COLUMNS, rows)], raw=result, notes=notes)
    report.print(console)
    paths = report.write(args.out)
    console.print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
