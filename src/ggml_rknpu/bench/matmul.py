"""Matmul benchmarks on the engine: GEMV and GEMM over the seed's and real models' shapes,
fp16 and int8, 1 and 3 cores, burst and sustained, with modeled figures beside the seed's.

Invariants: ``*_measured`` keys are clocks read on this machine, ``*_modeled`` come from
``cost.model`` (``bench.report``); the seed's figures come from ``cost.anchors.ANCHORS``,
never a second copy; rows of the ``ours`` and ``rknn`` engines sit side by side, and the
rknn engine's device time is always modeled. Why these modes: docs/decisions.md
"bench/matmul.py"."""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from ggml_rknpu.bench import report as rp
from ggml_rknpu.cost.anchors import ANCHORS
from ggml_rknpu.cost.model import OWN_DRIVER, RKNN_RUNTIME, modeled_time, vendor_style_workload
from ggml_rknpu.engine.contract import MatmulEngine


@dataclass(frozen=True)
class Shape:
    """A weight shape (K inputs, N outputs) with where it comes from."""

    label: str
    K: int
    N: int
    source: str


SEED_SHAPES = (
    Shape("seed attn 2048x2048", 2048, 2048, "docs/history.md §7 (K=2048, N=2048)"),
    Shape("seed ffn 2048x5504", 2048, 5504, "docs/history.md §7 (K=2048, N=5504)"),
    Shape("seed lm_head 2048x32000", 2048, 32000, "docs/history.md §7 (K=2048, N=32000)"),
)
MODEL_SHAPES = (
    Shape("qwen2.5-1.5b q/o 1536x1536", 1536, 1536, "docs/rknn-toolkit.md §4 (1x1536x1536)"),
    Shape("qwen2.5-1.5b ffn up 1536x8960", 1536, 8960, "docs/rknn-toolkit.md §4 (64x1536x8960)"),
    Shape("qwen2.5-1.5b ffn down 8960x1536", 8960, 1536, "docs/rknn-toolkit.md §4 (1x8960x1536)"),
    Shape("qwen lm_head 1536x151936", 1536, 151936, "the Qwen vocabulary (N=151936)"),
    Shape("llama-7b ffn 4096x11008", 4096, 11008, "llama-7b FFN (K=4096, N=11008)"),
)
SMALL_SHAPES = (
    Shape("small 64x64", 64, 64, "CI size"),
    Shape("small 256x128", 256, 128, "CI size"),
)
SHAPE_SETS = {"seed": SEED_SHAPES, "model": MODEL_SHAPES, "small": SMALL_SHAPES}
GEMM_MS = (16, 64, 256, 512, 1024, 2048)       # prefill batch sizes up to 2048
# our phase name -> engine.timing.Timing attribute (submit_s is the whole device submit: cache
# clean of A, the driver's blocking wait, cache invalidate of C [engine.api docstring])
HOST_PHASES = {"pack_a": "pack_s", "submit": "submit_s", "unpack_c": "unpack_s"}
ENGINES = ("ours", "rknn")


def flops(M: int, K: int, N: int) -> int:
    return 2 * M * K * N


MATMUL_COLUMNS = [
    rp.Column("engine", "engine"), rp.Column("shape", "shape"), rp.Column("dtype", "dtype"),
    rp.Column("cores", "cores"), rp.Column("M", "M"),
    rp.Column("ran_on", "ran on"), rp.Column("pack_a_ms_measured", "pack A ms", "{:.3f}", figure=True),
    rp.Column("submit_ms_measured", "submit ms", "{:.3f}", figure=True),
    rp.Column("unpack_c_ms_measured", "unpack C ms", "{:.3f}", figure=True),
    rp.Column("device_ms_modeled", "device ms", "{:.3f}", figure=True),
    rp.Column("device_ms_measured", "device ms", "{:.3f}", figure=True),
    rp.Column("gflops_modeled", "GFLOP/s", "{:.1f}", figure=True),
    rp.Column("gflops_measured", "GFLOP/s", "{:.1f}", figure=True),
    rp.Column("gflops_call_measured", "end-to-end GFLOP/s", "{:.1f}", figure=True),
]


# --- modeled figures (no device needed) -----------------------------------------------

def modeled_program_time(M: int, K: int, N: int, dtype: str, cores: int, *, dram_mhz: float = 2112,
                         npu_mhz: float = 1000) -> float:
    """Modeled seconds of the program our compiler emits for this matmul (own submit path)
    on ``cores`` cores, in the envelope of a board that passed the whole bring-up ladder
    (the proven envelope alone allows one core; docs/engine.md prices the difference)."""
    from ggml_rknpu.compiler.matmul import compile_matmul
    from ggml_rknpu.engine.envelope_record import RUNGS, envelope_for_rungs

    out = "int32" if dtype == "int8" else "fp32"
    program = compile_matmul(M, K, N, dtype=dtype, out=out, cores=cores,
                             envelope=envelope_for_rungs(list(RUNGS), "rknpu"))
    return modeled_time(program, npu_mhz=npu_mhz, dram_mhz=dram_mhz, profile=OWN_DRIVER).total_s


THROTTLED_DRAM_MHZ = 528   # the DMC governor's parked step [docs/history.md §15; docs/anchors.md §3.2]


def modeled_engine_time(engine: str, M: int, K: int, N: int, dtype: str, cores: int) -> float:
    """Modeled seconds of one call on ``engine``: our compiled program (own submit path), or
    librknnrt's documented tiling with its submit cost (``cost.model.RKNN_RUNTIME``)."""
    if engine == "rknn":
        return modeled_time(vendor_style_workload(M, K, N, dtype=dtype, cores=cores), profile=RKNN_RUNTIME).total_s
    return modeled_program_time(M, K, N, dtype, cores)


def seed_comparison(*, dram_mhz: float = 2112) -> list[dict]:
    """The seed's measured figures ([docs/history.md §7, §8], via ``cost.anchors``) beside
    two modeled figures: the seed's own path (librknnrt, vendor tiling) and our compiled
    program on 1 and 3 cores."""
    rows = []
    for a in (a for a in ANCHORS if a.source.startswith("prototype board log")):
        seed_path = modeled_time(vendor_style_workload(a.M, a.K, a.N, dtype=a.dtype, cores=a.cores),
                                 profile=a.profile, dram_mhz=dram_mhz).total_s
        row = {"label": a.label, "M": a.M, "K": a.K, "N": a.N, "dtype": a.dtype, "source": a.source,
               "seed_gflops_measured": a.measured_gflops,
               "seed_path_gflops_modeled": a.flops / seed_path / 1e9}
        for cores in (1, 3):
            t = modeled_program_time(a.M, a.K, a.N, a.dtype, cores, dram_mhz=dram_mhz)
            row[f"ours_{cores}c_gflops_modeled"] = a.flops / t / 1e9
        parked = modeled_program_time(a.M, a.K, a.N, a.dtype, 3, dram_mhz=THROTTLED_DRAM_MHZ)
        row["ours_3c_dram528_gflops_modeled"] = a.flops / parked / 1e9
        rows.append(row)
    return rows


def modeled_sweep(shapes: Iterable[Shape], dtypes: Iterable[str], cores: Iterable[int],
                  ms: Iterable[int]) -> list[dict]:
    rows = []
    for shape in shapes:
        for dtype in dtypes:
            for c in cores:
                for m in ms:
                    t = modeled_program_time(m, shape.K, shape.N, dtype, c)
                    rows.append({"shape": shape.label, "M": m, "K": shape.K, "N": shape.N, "dtype": dtype,
                                 "cores": c, "device_ms_modeled": t * 1e3,
                                 "gflops_modeled": flops(m, shape.K, shape.N) / t / 1e9})
    return rows


# --- engine runs ----------------------------------------------------------------------

def read_timing(timing) -> dict:
    """The engine's ``last_timing`` (``engine.timing.Timing``) as a flat dict: host phases in
    seconds and the device time with its basis ('measured' from hw_elapse_time on a board,
    'modeled' by the cost model; None when the engine could give neither)."""
    out = {f"{phase}_s": getattr(timing, attr) for phase, attr in HOST_PHASES.items()}
    label = timing.device_label
    out["device_s"] = timing.device_s if label in rp.BASES else None
    out["device_basis"] = label if label in rp.BASES else None
    return out


def make_operands(shape: Shape, M: int, dtype: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A [M,K] and B [N,K] (ggml's weight layout) for ``dtype``: int8 exact, fp16 in [-1,1)."""
    if dtype == "int8":
        return (rng.integers(-128, 128, (M, shape.K), dtype=np.int8),
                rng.integers(-128, 128, (shape.N, shape.K), dtype=np.int8))
    return (rng.uniform(-1, 1, (M, shape.K)).astype(np.float32),
            rng.uniform(-1, 1, (shape.N, shape.K)).astype(np.float32))


@dataclass(frozen=True)
class Case:
    shape: Shape
    M: int
    dtype: str
    cores: int
    engine: str = "ours"

    @property
    def flops(self) -> int:
        return flops(self.M, self.shape.K, self.shape.N)


def summarize_calls(case: Case, calls: list[tuple[float, dict]], *, on_board: bool,
                    ran_on: str | None = None) -> dict:
    """Median per-call figures of one case. Host phases are measured on this host; device time
    keeps the basis the engine reported; GFLOP/s is derived from each. ``ran_on`` defaults to
    "board" / "simulator"."""
    row = {"engine": case.engine, "shape": case.shape.label, "M": case.M, "K": case.shape.K,
           "N": case.shape.N, "dtype": case.dtype, "cores": case.cores, "calls": len(calls), "executed": True,
           "ran_on": ran_on or ("board" if on_board else "simulator")}
    for phase in HOST_PHASES:
        vals = [t[f"{phase}_s"] for _, t in calls if t[f"{phase}_s"] is not None]
        row[f"{phase}_ms_measured"] = float(np.median(vals)) * 1e3 if vals else None
    wall = float(np.median([w for w, _ in calls]))
    row["call_ms_measured"] = wall * 1e3
    if on_board:
        row["gflops_call_measured"] = case.flops / wall / 1e9
    dev = [t["device_s"] for _, t in calls if t["device_s"]]
    basis = calls[0][1]["device_basis"] if calls else None
    if dev and basis:
        row[f"device_ms_{basis}"] = float(np.median(dev)) * 1e3
        row[f"gflops_{basis}"] = case.flops / float(np.median(dev)) / 1e9
    if basis != "modeled":
        # on a board, the cost model's figure beside the measured one (a check of the model)
        t = modeled_engine_time(case.engine, case.M, case.shape.K, case.shape.N, case.dtype, case.cores)
        row["device_ms_modeled"] = t * 1e3
        row["gflops_modeled"] = case.flops / t / 1e9
    return row


def run_case(npu, case: Case, *, iters: int, warmup: int, rng: np.random.Generator,
             on_board: bool, ran_on: str | None = None) -> dict:
    a, b = make_operands(case.shape, case.M, case.dtype, rng)
    w = npu.upload_weight(b, dtype=case.dtype)
    try:
        for _ in range(warmup):
            npu.matmul(a, w)
        calls = []
        for _ in range(iters):
            t0 = time.perf_counter()
            npu.matmul(a, w)
            calls.append((time.perf_counter() - t0, read_timing(npu.last_timing)))
    finally:
        w.free()
    return summarize_calls(case, calls, on_board=on_board, ran_on=ran_on)


def modeled_only_row(case: Case, reason: str) -> dict:
    t = modeled_engine_time(case.engine, case.M, case.shape.K, case.shape.N, case.dtype, case.cores)
    return {"engine": case.engine, "shape": case.shape.label, "M": case.M, "K": case.shape.K, "N": case.shape.N,
            "dtype": case.dtype, "cores": case.cores, "calls": 0, "executed": False, "ran_on": "model only", "skipped": reason,
            "device_ms_modeled": t * 1e3, "gflops_modeled": case.flops / t / 1e9}


def burst(open_npu: Callable[[int], MatmulEngine], cases: list[Case], *, iters: int, warmup: int, on_board: bool,
          max_sim_macs: int, advance: Callable[[int], None] = lambda n: None, seed: int = 0,
          ran_on: str | None = None) -> list[dict]:
    """Every case: executed through an engine opened with ``open_npu(cores)``, or (off a board,
    above ``max_sim_macs``) priced by the cost model only and marked not executed. ``ran_on``
    names where an off-board run happens (default "simulator")."""
    rng = np.random.default_rng(seed)
    rows: dict[Case, dict] = {}
    for cores in dict.fromkeys(c.cores for c in cases):
        group = [c for c in cases if c.cores == cores]
        runnable = [c for c in group if on_board or c.M * c.shape.K * c.shape.N <= max_sim_macs]
        for case in group:
            if case not in runnable:
                macs = case.M * case.shape.K * case.shape.N
                rows[case] = modeled_only_row(case, f"{macs:.2e} MACs exceed the {ran_on or 'simulator'} "
                                                    f"budget {max_sim_macs:.0e}")
                advance(1)
        if not runnable:
            continue
        npu = open_npu(cores)
        try:
            for case in runnable:
                rows[case] = run_case(npu, case, iters=iters, warmup=warmup, rng=rng, on_board=on_board,
                                      ran_on=ran_on)
                used = getattr(npu, "cores", cores)   # the engine's envelope may allow fewer
                if used != cores:
                    rows[case].update(cores=used, cores_requested=cores)
                advance(1)
        finally:
            npu.close()
    return [rows[c] for c in cases]


def sustained(npu, case: Case, *, seconds: float, window_s: float, snapshot: Callable[[], dict],
              on_board: bool, advance: Callable[[int], None] = lambda n: None, seed: int = 0) -> list[dict]:
    """Back-to-back calls for ``seconds``, summarized per ``window_s`` window with the clocks
    and temperatures at the end of each window [docs/history.md §12]."""
    rng = np.random.default_rng(seed)
    a, b = make_operands(case.shape, case.M, case.dtype, rng)
    w = npu.upload_weight(b, dtype=case.dtype)
    windows: list[dict] = []
    try:
        npu.matmul(a, w)
        start = time.perf_counter()
        while (now := time.perf_counter()) - start < seconds:
            calls: list[tuple[float, dict]] = []
            w_end = min(now + window_s, start + seconds)
            while time.perf_counter() < w_end or not calls:
                t0 = time.perf_counter()
                npu.matmul(a, w)
                calls.append((time.perf_counter() - t0, read_timing(npu.last_timing)))
            row = summarize_calls(case, calls, on_board=on_board)
            elapsed = time.perf_counter() - now
            row.update(window=len(windows), t_s=round(now - start, 3), window_s=elapsed,
                       calls_per_s_measured=len(calls) / elapsed, **_flat_snapshot(snapshot()))
            windows.append(row)
            advance(1)
    finally:
        w.free()
    return windows


def _flat_snapshot(snap: dict) -> dict:
    flat = {"dram_mhz": snap.get("dram_mhz"), "npu_mhz": snap.get("npu_mhz")}
    temps = [t for t in (snap.get("temps_c") or {}).values() if t is not None]
    flat["max_temp_c"] = max(temps) if temps else None
    flat["temps_c"] = snap.get("temps_c") or {}
    flat["cpu_mhz"] = snap.get("cpu_mhz") or {}
    return flat


def trend(windows: list[dict], key: str) -> float | None:
    """Relative change of ``key`` from the first to the last window (the prototype's board log: the NPU
    lost ~14% after 13 s [docs/history.md §12]). None when fewer than two windows carry it."""
    vals = [w[key] for w in windows if w.get(key)]
    return (vals[-1] - vals[0]) / vals[0] if len(vals) >= 2 else None


def host_description() -> str:
    return f"{platform.machine()} {platform.processor() or platform.system()}".strip()
