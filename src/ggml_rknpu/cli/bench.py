"""Benchmarks: ``matmul`` (burst, or ``--modeled`` beside the prototype's board figures),
``sustained`` (per-second windows with clocks and temperatures), ``model`` (llama-bench
CPU-only vs through ``rknpu serve``), ``decode``, ``prefill``, ``rpc-overhead``, ``soak``, ``concurrent``, ``spec``,
``memory``, ``fit``, ``npu-submit`` and ``sim`` (each module's docstring says what it measures).

Every benchmark runs ``check-rig`` first and stamps its verdict into the report; a FAIL
(throttled DRAM, powersave CPU, hot board, no driver) refuses to benchmark unless
``--allow-throttled``. On a machine that is not an RK3588 board the benchmark runs on the
simulator and its device figures are *modeled*. Reports (JSON, Markdown, PNG) go to ``--out``.
``matmul --engines ours,rknn`` puts rows of our engine and of Rockchip's librknnrt side by
side (``engine`` column and plot series); ``--device`` applies to our engine only, the rknn
engine follows ``rknn.opener``'s rule and says "stand-in" when it runs the test stand-in.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from typing import Any

from rich.console import Console

from ggml_rknpu.bench import matmul as mm
from ggml_rknpu.bench import report as rp
from ggml_rknpu.bench.rig import RigReport, check_rig, snapshot
from ggml_rknpu.cli.check_rig import render as render_rig

REFUSED = 3


def _ints(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _dtypes(text: str) -> list[str]:
    vals = [t.strip() for t in text.split(",") if t.strip()]
    bad = [v for v in vals if v not in ("fp16", "int8")]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown dtype(s) {bad}: choose fp16, int8")
    return vals


def _engines(text: str) -> list[str]:
    vals = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    bad = [v for v in vals if v not in mm.ENGINES]
    if bad or not vals:
        raise argparse.ArgumentTypeError(f"unknown engine(s) {bad or text!r}: choose from {', '.join(mm.ENGINES)}")
    return vals


def _common(p: argparse.ArgumentParser, out: str) -> None:
    p.add_argument("--out", default=out, metavar="DIR", help=f"report directory (default {out})")
    p.add_argument("--allow-throttled", action="store_true",
                   help="benchmark even when check-rig FAILs (the report says so)")
    p.add_argument("--rig-root", default="/", metavar="DIR", help="filesystem root check-rig reads (default /)")
    p.add_argument("--device", default=None, help="rknpu | rocket | sim-rknpu | sim-rocket (default: auto)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    m = sub.add_parser("matmul", help="GEMV/GEMM burst benchmark per shape, dtype, cores")
    _common(m, "bench-out/matmul")
    m.add_argument("--modeled", action="store_true",
                   help="no device: modeled GFLOP/s for the prototype's board shapes [docs/history.md §7, §8] beside its measured figures")
    m.add_argument("--engines", type=_engines, default=["ours"],
                   help="comma list: ours (our register commands), rknn (Rockchip's librknnrt via $LIBRKNNRT_PATH "
                        "or the usual directories; --device does not apply to it). Default ours")
    m.add_argument("--shapes", default="seed", help="comma list of shape sets: seed, model, small (default seed)")
    m.add_argument("--dtypes", type=_dtypes, default=["fp16", "int8"])
    m.add_argument("--cores", type=_ints, default=[1, 3])
    m.add_argument("--ms", type=_ints, default=[1, *mm.GEMM_MS], help="M values (default 1,16,...,2048)")
    m.add_argument("--iters", type=int, default=5, help="timed calls per case (median reported)")
    m.add_argument("--warmup", type=int, default=1)
    m.add_argument("--max-sim-macs", type=float, default=2 ** 24,
                   help="off a board (simulator, rknn stand-in), cases above this many MACs are modeled only "
                        "(not executed)")
    s = sub.add_parser("sustained", help="back-to-back calls for a duration, per-second windows")
    _common(s, "bench-out/sustained")
    s.add_argument("--K", type=int, default=2048)
    s.add_argument("--N", type=int, default=2048)
    s.add_argument("--M", type=int, default=1)
    s.add_argument("--dtype", default="fp16", choices=("fp16", "int8"))
    s.add_argument("--cores", type=int, default=3, choices=(1, 2, 3))
    s.add_argument("--seconds", type=float, default=18.0, help="duration (the prototype's sustained board run: 18 s [docs/history.md §12])")
    s.add_argument("--window", type=float, default=1.0, help="window length in seconds")
    from ggml_rknpu.bench import model as model_bench
    model_bench.add_arguments(sub.add_parser("model", help="llama-bench CPU-only vs through rknpu serve"), _common)
    from ggml_rknpu.bench import decode as decode_bench
    decode_bench.add_arguments(sub.add_parser(
        "decode", help="decode forecast per model: modeled NPU time per token, measured host time per NPU submit"),
        _common)
    from ggml_rknpu.bench import prefill as prefill_bench
    prefill_bench.add_arguments(sub.add_parser(
        "prefill", help="time to first token by prompt length (128-8192) per plan, every host op priced (modeled)"),
        _common)
    from ggml_rknpu.bench import rpc_overhead
    rpc_overhead.add_arguments(sub.add_parser(
        "rpc-overhead", help="host time per graph node of rknpu serve (gemma3 decode) beside the C++ ggml-rpc-server"),
        _common)
    from ggml_rknpu.bench import rpc8_decode
    rpc8_decode.add_arguments(sub.add_parser(
        "rpc8-decode", help="llama.cpp b11739 (RPC 8.0.0) decoding gemma3 through rknpu serve --device host vs its C++ server"),
        _common)
    from ggml_rknpu.bench import host_placement
    host_placement.add_arguments(sub.add_parser(
        "host-placement", help="gemma3 decode through rknpu serve --placement host vs llama-completion CPU-only "
                               "(same threads, same greedy text)"), _common)
    from ggml_rknpu.bench import host_batches
    host_batches.add_arguments(sub.add_parser(
        "host-batches", help="llama-bench prompts of M = 1, 2, 4, 8 (one weight type) through rknpu serve "
                             "--placement host, repacked and not, vs llama.cpp alone"), _common)
    from ggml_rknpu.bench import calibrate
    calibrate.add_arguments(sub.add_parser(
        "calibrate-placement", help="time each weight shape of a GGUF on the NPU and in ggml-cpu per M bucket; "
                                    "on a board, rknpu serve --placement auto then decides by these times"), _common)
    from ggml_rknpu.bench import fit
    fit.add_arguments(sub.add_parser(
        "fit", help="which placements of a model fit a board's RAM (4, 8, 16, 32 GB): llama.cpp alone, RKLLM, "
                    "rknpu serve host only / NPU only / both / the fastest mix that fits (modeled)"), _common)
    from ggml_rknpu.bench import memory
    memory.add_arguments(sub.add_parser(
        "memory", help="anonymous memory of one llama-server completion through rknpu serve (the server's growth "
                       "+ the client) vs llama-server alone, one weight type"), _common)
    from ggml_rknpu.bench import soak
    soak.add_arguments(sub.add_parser(
        "soak", help="llama-server --rpc -np 4 under concurrent chat requests with injected NPU faults (simulator)"),
        _common)
    from ggml_rknpu.bench import concurrent
    concurrent.add_arguments(sub.add_parser(
        "concurrent", help="llama-server -np 4 through rknpu serve alone and beside 100 connections (50 stalled "
                           "mid-message), plus a second llama.cpp process; p50/p99 and their ratio"), _common)
    from ggml_rknpu.bench import spec
    spec.add_arguments(sub.add_parser(
        "spec", help="speculative decoding / parallel slots: modeled NPU pass time by M, measured acceptance"),
        _common)
    from ggml_rknpu.bench import npu_submit
    npu_submit.add_arguments(sub.add_parser(
        "npu-submit", help="host work per NPU decode submit by phase (pack, canaries, syncs+submit, unpack; simulator)"))
    from ggml_rknpu.bench import sim as sim_bench
    sim_bench.add_arguments(sub.add_parser(
        "sim", help="simulated matmul through the public API vs numpy on this host (simulator speed)"))


def rig_gate(args, console: Console) -> RigReport | None:
    """check-rig first; None (refuse) on FAIL unless --allow-throttled."""
    rig = check_rig(args.rig_root)
    render_rig(rig, console)
    if rig.failed and not args.allow_throttled:
        console.print("[bold red]refusing to benchmark a throttled rig[/]: apply the fixes above, "
                      "or pass --allow-throttled (the report will carry the FAIL)")
        return None
    if rig.failed:
        console.print("[yellow]--allow-throttled: benchmarking anyway; figures are from a FAILed rig[/]")
    return rig


def _open_engine(args, cores: int):
    import ggml_rknpu

    return ggml_rknpu.open(device=args.device, cores=cores)


def _device_meta(npu) -> dict:
    device = npu.device
    return {"device": f"{'sim-' if device.simulated else ''}{device.kind}", "simulated": bool(device.simulated),
            "host": mm.host_description()}


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def run_matmul_modeled(args, rig: RigReport) -> rp.Report:
    seed_rows = mm.seed_comparison()
    seed_table = rp.Table(
        "The prototype's board shapes (docs/history.md §7, §8): measured vs modeled", [
            rp.Column("label", "workload"), rp.Column("M", "M"), rp.Column("K", "K"), rp.Column("N", "N"),
            rp.Column("dtype", "dtype"),
            rp.Column("seed_gflops_measured", "seed GFLOP/s", "{:.1f}", figure=True),
            rp.Column("seed_path_gflops_modeled", "librknnrt path GFLOP/s", "{:.1f}", figure=True),
            rp.Column("ours_1c_gflops_modeled", "ours 1 core GFLOP/s", "{:.1f}", figure=True),
            rp.Column("ours_3c_gflops_modeled", "ours 3 cores GFLOP/s", "{:.1f}", figure=True),
            rp.Column("ours_3c_dram528_gflops_modeled", "ours 3 cores, DRAM 528 MHz", "{:.1f}", figure=True)],
        seed_rows,
        note="seed GFLOP/s: measured by the prototype through rknn_matmul_api [docs/history.md §7, §8]; "
             "other columns modeled by cost.model at NPU 1000 MHz, DRAM 2112 MHz: the seed's own path "
             "(librknnrt submit cost, vendor tiling) and our compiled program on 1 and 3 cores; the last column "
             "is our 3-core program with DRAM parked at 528 MHz [docs/history.md §15: the retraction].")
    sweep = mm.modeled_sweep(mm.SEED_SHAPES[:1], args.dtypes, args.cores, args.ms)
    sweep_table = rp.Table("Modeled GFLOP/s vs M (K=2048, N=2048)", [
        rp.Column("dtype", "dtype"), rp.Column("cores", "cores"), rp.Column("M", "M"),
        rp.Column("device_ms_modeled", "device ms", "{:.3f}", figure=True),
        rp.Column("gflops_modeled", "GFLOP/s", "{:.1f}", figure=True)], sweep)
    for r in sweep:
        r["series"] = f"{r['dtype']} {r['cores']} core{'s' if r['cores'] > 1 else ''}"
    plot = rp.Plot("gflops_vs_m.png", "GFLOP/s vs M, K=2048 N=2048 (modeled)", "M", "GFLOP/s",
                   rp.series_by(sweep, "series", "M", "gflops_modeled", "{} ({})"), log_x=True)
    bars = rp.Plot("seed_vs_modeled.png", "Prototype board log (docs/history.md §7, §8): measured vs modeled", "workload", "GFLOP/s",
                   [rp.Series("seed (measured)", [_bar_key(r) for r in seed_rows],
                              [r["seed_gflops_measured"] for r in seed_rows]),
                    rp.Series("librknnrt path (modeled)", [_bar_key(r) for r in seed_rows],
                              [r["seed_path_gflops_modeled"] for r in seed_rows]),
                    rp.Series("ours 3 cores (modeled)", [_bar_key(r) for r in seed_rows],
                              [r["ours_3c_gflops_modeled"] for r in seed_rows])], kind="bar", log_y=True)
    return rp.Report("matmul_modeled", "Matmul: modeled figures beside the seed's measured ones",
                     rig.to_dict(), meta={"mode": "modeled (no device used)", "npu_mhz": 1000, "dram_mhz": 2112},
                     tables=[seed_table, sweep_table], plots=[plot, bars],
                     raw={"seed_comparison": seed_rows, "sweep": sweep})


def _bar_key(row: dict) -> str:
    return f"{row['label']} M={row['M']}"


def _shape_sets(text: str) -> list[mm.Shape]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in mm.SHAPE_SETS]
    if bad:
        raise SystemExit(f"bench matmul: unknown shape set(s) {bad}: choose {', '.join(mm.SHAPE_SETS)}")
    return [s for n in names for s in mm.SHAPE_SETS[n]]


def _present(columns: list[rp.Column], rows: list[dict]) -> list[rp.Column]:
    return [c for c in columns if not c.figure or any(r.get(c.key) is not None for r in rows)]


def _gflops_plots(rows: list[dict], prefix: str = "gflops_vs_m", engines: bool = False) -> list[rp.Plot]:
    """One plot per shape, a series per (dtype, cores) and basis; with ``engines`` the series
    name the engine too (rows of several engines in one report)."""
    plots = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        sub = [{**r, "series": f"{r['engine'] + ' ' if engines else ''}{r['dtype']} {r['cores']}c"}
               for r in rows if r["shape"] == shape]
        series = []
        for key in ("gflops_measured", "gflops_modeled"):
            series += rp.series_by(sub, "series", "M", key, "{} ({})")
        # librknnrt has no device clock: on a board its only measured figure is the call's wall time
        series += rp.series_by([r for r in sub if r.get("engine") == "rknn"], "series", "M",
                               "gflops_call_measured", "{} end-to-end ({})")
        plots.append(rp.Plot(f"{prefix}_{_slug(shape)}.png", f"GFLOP/s vs M: {shape}", "M", "GFLOP/s",
                             series, log_x=True))
    return plots


def _engine_runs(args, console: Console) -> list[dict] | None:
    """Per engine: how to open it per core count, whether its wall times are board figures,
    what its rows' ``ran_on`` says, and its metadata. None (after a clear message) when the
    rknn engine cannot be opened here."""
    runs = []
    for engine in args.engines:
        if engine == "ours":
            probe = _open_engine(args, 1)
            try:
                meta = _device_meta(probe)
            finally:
                probe.close()
            runs.append({"engine": engine, "open": lambda cores: _open_engine(args, cores),
                         "on_board": not meta["simulated"], "ran_on": None, "meta": meta})
            continue
        from ggml_rknpu.rknn import RknnError, RknnUnavailable
        from ggml_rknpu.rknn.opener import RknnRefused, load, open_rknn

        try:
            loaded = load("auto")
        except (RknnUnavailable, RknnRefused, RknnError) as exc:
            console.print(f"[bold red]bench matmul: cannot open the rknn engine:[/] {exc}")
            return None
        setup = loaded[1]
        ran_on = "stand-in" if setup.standin else "board" if setup.on_board else "librknnrt, device not recognised"
        runs.append({"engine": engine, "open": lambda cores, loaded=loaded: open_rknn(cores=cores, loaded=loaded)[0],
                     "on_board": setup.on_board, "ran_on": ran_on,
                     "meta": {**setup.as_dict(), "describe": setup.describe(), "host": mm.host_description()}})
    return runs


def _engine_notes(runs: list[dict]) -> list[str]:
    notes = []
    for run in runs:
        meta = run["meta"]
        if run["engine"] == "ours" and meta["simulated"]:
            notes.append(f"simulator: device times are modeled; host columns (pack/submit/unpack) are "
                         f"measured on this host ({meta['host']}) running the simulator, not on a board")
        elif run["engine"] == "rknn":
            if meta["standin"]:
                notes.append(f"rknn rows ran on the TEST STAND-IN ({meta['library']}), not Rockchip's librknnrt: "
                             f"their host columns are wall time of host C code on this host ({meta['host']}) and say "
                             "nothing about the NPU; their device times are modeled (cost model, librknnrt profile)")
            elif not meta["on_board"]:
                notes.append(f"rknn rows: librknnrt at {meta['library']} without a recognised vendor rknpu node: "
                             "host columns measured on this host, device times modeled, no NPU figure")
            else:
                notes.append("rknn rows: librknnrt has no device clock; device times are modeled (librknnrt "
                             "profile), end-to-end GFLOP/s is measured wall time per call on the board")
    return notes


def run_matmul(args, rig: RigReport, console: Console) -> rp.Report | None:
    shapes = _shape_sets(args.shapes)
    runs = _engine_runs(args, console)
    if runs is None:
        return None
    rows: list[dict] = []
    n_cases = len(shapes) * len(args.dtypes) * len(args.cores) * len(args.ms) * len(runs)
    with rp.progress(console, "matmul", n_cases) as advance:
        for run in runs:
            cases = [mm.Case(s, m, d, c, run["engine"]) for s in shapes for d in args.dtypes for c in args.cores
                     for m in args.ms]
            rows += mm.burst(run["open"], cases, iters=args.iters, warmup=args.warmup, on_board=run["on_board"],
                             max_sim_macs=int(args.max_sim_macs), advance=advance, ran_on=run["ran_on"])
    notes = _engine_notes(runs)
    skipped = [r for r in rows if not r["executed"]]
    if skipped:
        notes.append(f"{len(skipped)} case(s) too large to run off a board were priced by the cost model only "
                     "(executed=false in the JSON)")
    table = rp.Table("Matmul burst (median per call)", _present(mm.MATMUL_COLUMNS, rows), rows)
    ours: dict[str, Any] = next((r["meta"] for r in runs if r["engine"] == "ours"), {})
    meta = {**ours, "engines": [r["engine"] for r in runs], "iters": args.iters, "warmup": args.warmup,
            "mode": "burst"}
    meta.update({r["engine"]: r["meta"] for r in runs if r["engine"] != "ours"})
    return rp.Report("matmul", "Matmul benchmark (burst)", rig.to_dict(), meta=meta, tables=[table],
                     plots=_gflops_plots(rows, engines=len(runs) > 1),
                     raw={"rows": rows, "shapes": [s.__dict__ for s in shapes]}, notes=notes)


def run_sustained(args, rig: RigReport, console: Console) -> rp.Report:
    shape = mm.Shape(f"{args.K}x{args.N}", args.K, args.N, "command line")
    case = mm.Case(shape, args.M, args.dtype, args.cores)
    npu = _open_engine(args, case.cores)
    try:
        meta = _device_meta(npu)
        n_windows = max(1, round(args.seconds / args.window))
        with rp.progress(console, "sustained", n_windows) as advance:
            windows = mm.sustained(npu, case, seconds=args.seconds, window_s=args.window,
                                   snapshot=lambda: snapshot(args.rig_root), on_board=not meta["simulated"],
                                   advance=advance)
    finally:
        npu.close()
    basis = "measured" if not meta["simulated"] else "modeled"
    trends = {"calls_per_s_measured": mm.trend(windows, "calls_per_s_measured"),
              f"gflops_{basis}": mm.trend(windows, f"gflops_{basis}")}
    columns = [rp.Column("window", "window"), rp.Column("t_s", "t s"), rp.Column("calls", "calls"),
               rp.Column("calls_per_s_measured", "calls/s", "{:.1f}", figure=True),
               rp.Column("call_ms_measured", "call ms", "{:.3f}", figure=True),
               rp.Column(f"device_ms_{basis}", "device ms", "{:.3f}", figure=True),
               rp.Column(f"gflops_{basis}", "GFLOP/s", "{:.1f}", figure=True),
               rp.Column("dram_mhz", "DRAM MHz", "{:.0f}"), rp.Column("npu_mhz", "NPU MHz", "{:.0f}"),
               rp.Column("max_temp_c", "max degC", "{:.1f}")]
    trend_text = ", ".join(f"{k} {v:+.1%}" for k, v in trends.items() if v is not None)
    notes = [f"trend first->last window: {trend_text}" if trend_text else "trend: fewer than two windows"]
    if meta["simulated"]:
        notes.append(f"simulator: calls/s and call ms are this host's ({meta['host']}) running the simulator; "
                     "device time is modeled and cannot drift with temperature")
    t = [w["t_s"] for w in windows]
    plots = [rp.Plot("sustained_rate.png", f"Sustained {case.dtype} M={case.M} {shape.label}, {case.cores} cores",
                     "time (s)", "calls/s",
                     [rp.Series(f"calls/s (measured{', simulator on this host' if meta['simulated'] else ''})", t,
                                [w["calls_per_s_measured"] for w in windows])]),
             rp.Plot("sustained_device.png", "Device GFLOP/s per window", "time (s)", "GFLOP/s",
                     [rp.Series(f"device GFLOP/s ({basis})", t, [w.get(f"gflops_{basis}") for w in windows])])]
    temp_series = []
    for zone in sorted({z for w in windows for z in w["temps_c"]}):
        temp_series.append(rp.Series(f"{zone} degC (measured)", t, [w["temps_c"].get(zone) for w in windows]))
    if temp_series:
        plots.append(rp.Plot("sustained_temps.png", "Temperatures per window", "time (s)", "degC", temp_series))
    meta.update(mode="sustained", seconds=args.seconds, window_s=args.window, M=case.M, K=shape.K, N=shape.N,
                dtype=case.dtype, cores=case.cores)
    return rp.Report("sustained", "Sustained matmul (per-window)", rig.to_dict(), meta=meta,
                     tables=[rp.Table("Windows", columns, windows)], plots=plots,
                     raw={"windows": windows, "trend": trends}, notes=notes)


def run(args: argparse.Namespace) -> int:
    console = Console()
    if args.bench == "sim":   # host-only: times the simulator, no rig to check
        from ggml_rknpu.bench import sim as sim_bench

        return sim_bench.run(args, console)
    if args.bench == "npu-submit":   # host-only, simulated device: no rig to check
        from ggml_rknpu.bench import npu_submit

        return npu_submit.run(args, console)
    try:
        rig = rig_gate(args, console)
    except FileNotFoundError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    if rig is None:
        return REFUSED
    if args.bench == "matmul":
        report = run_matmul_modeled(args, rig) if args.modeled else run_matmul(args, rig, console)
        if report is None:
            return 1
    elif args.bench == "sustained":
        report = run_sustained(args, rig, console)
    else:
        from ggml_rknpu.bench import (
            calibrate,
            concurrent,
            fit,
            host_batches,
            host_placement,
            memory,
            rpc8_decode,
            rpc_overhead,
            soak,
            spec,
        )
        from ggml_rknpu.bench import decode as decode_bench
        from ggml_rknpu.bench import model as model_bench
        from ggml_rknpu.bench import prefill as prefill_bench

        bench = {"model": model_bench, "spec": spec, "decode": decode_bench, "prefill": prefill_bench, "soak": soak,
                 "rpc8-decode": rpc8_decode, "host-placement": host_placement,
                 "calibrate-placement": calibrate, "host-batches": host_batches,
                 "concurrent": concurrent, "memory": memory, "fit": fit}.get(args.bench, rpc_overhead)
        try:
            report = bench.run(args, rig, console)
        except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as exc:
            console.print(f"[bold red]bench {args.bench} failed:[/] {exc}")
            return 1
        if report is None:
            return 1
    report.print(console)
    paths = report.write(args.out)
    console.print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0

