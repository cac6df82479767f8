"""Placement calibration: each weight shape of a GGUF timed on this machine's NPU engine
and in ggml-cpu, per M bucket, and recorded beside the envelope record, so that
``rknpu serve --placement auto`` on this board decides by measurement, not the models.

Invariants: both sides are wall-clock medians of the call the server makes (the engine's
``matmul`` on a resident weight, ggml-cpu's MUL_MAT over its repacked host copy where ggml
repacks the type, else the GGUF bytes as uploaded) at
each bucket's M (``cost.placement.BUCKET_M``), measured here (``*_measured``); the models'
times for the same shapes sit beside them (``*_modeled``). A record is written by default
only on a board (the simulator's times are not a board's); ``--record-file`` writes one
anywhere. MUL_MAT_ID experts are not calibrated (the models price them). Why:
docs/placement.md "Calibration"."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
from rich.console import Console

from ggml_rknpu.bench import report as rp
from ggml_rknpu.cost import cpu
from ggml_rknpu.cost import placement as pl

NAMES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output", "token_embd")


def add_arguments(p, common) -> None:
    common(p, "bench-out/calibrate-placement")
    p.add_argument("model", type=Path, help="GGUF whose weight shapes are timed")
    p.add_argument("--weights", default="fp16", choices=("fp16", "int8"), help="NPU weight format (rknpu serve --weights)")
    p.add_argument("-t", "--threads", type=int, default=cpu.BIG_CORES, help="ggml-cpu threads (rknpu serve --host-threads)")
    p.add_argument("-r", "--reps", type=int, default=5, help="timed calls per side, shape and bucket (median)")
    p.add_argument("--buckets", default=",".join(pl.BUCKETS), help="M buckets to time (default all)")
    p.add_argument("--record-file", type=Path, default=None,
                   help="write the record here (default: beside the envelope record, on a board only)")


def shapes(path: Path) -> list[tuple[str, int, int, np.ndarray, str]]:
    """One (type name, K, N, raw bytes, tensor name) per distinct 2-D weight shape and type
    of a llama-style GGUF (the matmuls of NAMES; a tied head is its token embedding)."""
    from gguf import GGUFReader

    seen: dict[tuple[str, int, int], tuple[str, int, int, np.ndarray, str]] = {}
    for t in GGUFReader(str(path)).tensors:
        parts = t.name.split(".")
        base = parts[2] if t.name.startswith("blk.") and len(parts) == 4 else parts[0]
        if base not in NAMES or len(t.shape) != 2:
            continue
        key = (t.tensor_type.name, int(t.shape[0]), int(t.shape[1]))
        seen.setdefault(key, (*key, np.ascontiguousarray(t.data).view(np.uint8).reshape(-1), t.name))
    if not seen:
        raise ValueError(f"{path}: no llama-style 2-D weights")
    return list(seen.values())


def _median_s(fn, reps: int) -> float:
    fn()                                   # warm-up: plan, compile, first touch
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def host_seconds(g, threads, type_name: str, K: int, N: int, raw: np.ndarray, M: int, reps: int) -> float:
    """Median wall time of one ggml-cpu MUL_MAT of M rows as the server runs it: from a
    repacked copy where ggml repacks this type and shape (``libggml.repack``), else the GGUF bytes."""
    from ggml_rknpu.libggml import abi, repack
    from ggml_rknpu.libggml.compute import HostContext
    from ggml_rknpu.libggml.enums import GgmlOp, GgmlType

    t = int(GgmlType[type_name])
    row = raw.size // N
    type_size = row * int(g.ggml_get_type_traits(t).contents.blck_size) // K     # bytes per block
    a = np.random.default_rng(0).standard_normal((M, K)).astype(np.float32)
    out = np.zeros((M, N), np.float32)
    f32 = int(GgmlType.F32)
    ctx = HostContext(g, threads, 4, (1,))
    copy = repack.repack(g, t, K, N, np.ascontiguousarray(raw).view(np.uint8).reshape(-1), "w")
    try:
        w = copy.tensor if copy is not None else ctx.tensor(t, (K, N, 1, 1), (type_size, row, row * N, row * N),
                                                             0, (), 0, "w", (raw, 0))
        x = ctx.tensor(f32, (K, M, 1, 1), (4, 4 * K, 4 * K * M, 4 * K * M), 0, (), 0, "a", (a, 0))
        d = ctx.tensor(f32, (N, M, 1, 1), (4, 4 * N, 4 * N * M, 4 * N * M), int(GgmlOp.MUL_MAT), (),
                       abi.GGML_TENSOR_FLAG_COMPUTE, "d", (out, 0))
        ctx.link(d, [w, x], None, 0)
        seg = ctx.segment([d])
        ctx.finish()
        return _median_s(seg.run, reps)
    finally:
        ctx.close()
        if copy is not None:
            copy.close()


def npu_seconds(npu, type_name: str, K: int, N: int, raw: np.ndarray, M: int, reps: int, dtype: str) -> float:
    """Median wall time of the engine's matmul of M rows with the weight resident."""
    from ggml_rknpu.libggml.enums import GgmlType
    from ggml_rknpu.server.weight_store import to_float_rows

    w = npu.upload_weight(to_float_rows(raw, int(GgmlType[type_name]), N, K), dtype=dtype)
    try:
        a = np.random.default_rng(0).standard_normal((M, K)).astype(np.float32)
        return _median_s(lambda: npu.matmul(a, w), reps)
    finally:
        w.free()


def run(args, rig, console: Console) -> rp.Report | None:
    import ggml_rknpu
    from ggml_rknpu.engine.envelope_record import board_key
    from ggml_rknpu.engine.placement_record import placement_path, save_times
    from ggml_rknpu.libggml import lib
    from ggml_rknpu.libggml.compute import Threads

    buckets = [b.strip() for b in args.buckets.split(",") if b.strip()]
    if not buckets or any(b not in pl.BUCKETS for b in buckets) or args.reps < 1:
        raise ValueError(f"--buckets takes {', '.join(pl.BUCKETS)} and --reps >= 1")
    if not 1 <= args.threads <= cpu.BIG_CORES:
        raise ValueError(f"--threads must be 1..{cpu.BIG_CORES}")
    weights = shapes(args.model)
    g = lib.load()
    threads = Threads(g, args.threads)
    npu = ggml_rknpu.open(device=args.device or None)
    rows: list[dict] = []
    try:
        with rp.progress(console, "calibrate", len(weights) * len(buckets)) as advance:
            for type_name, K, N, raw, name in weights:
                for b in buckets:
                    M = pl.BUCKET_M[b]
                    modeled = pl.place_matmul(type_name, M, K, N, npu_dtype=args.weights, cores=npu.cores,
                                              threads=args.threads, allow_split=False)
                    npu_s = npu_seconds(npu, type_name, K, N, raw, M, args.reps, args.weights)
                    host_s = host_seconds(g, threads, type_name, K, N, raw, M, args.reps)
                    rows.append({"tensor": name, "type": type_name, "K": K, "N": N, "experts": 1, "bucket": b,
                                 "M": M, "npu_s": npu_s, "host_s": host_s,
                                 "npu_ms_measured": npu_s * 1e3, "host_ms_measured": host_s * 1e3,
                                 "npu_ms_modeled": modeled.npu_s * 1e3, "host_ms_modeled": modeled.host_s * 1e3,
                                 "where": pl.NPU if npu_s <= host_s else pl.HOST, "model_says": modeled.where})
                    advance()
        key = board_key(npu.device)
        simulated = npu.device.simulated
        cores = npu.cores
    finally:
        npu.close()
        threads.close()
    record = args.record_file or (None if simulated else placement_path())
    times = [{k: r[k] for k in ("type", "K", "N", "experts", "bucket", "npu_s", "host_s")} for r in rows]
    written = save_times(key, args.weights, cores, args.threads, times, record) if record else None
    table = rp.Table("Placement calibration: measured on this machine, the models beside", [
        rp.Column(k, k) for k in ("tensor", "type", "K", "N", "bucket", "M")] + [
        rp.Column("npu_ms_measured", "NPU ms", "{:.3f}", figure=True),
        rp.Column("host_ms_measured", "host ms", "{:.3f}", figure=True),
        rp.Column("npu_ms_modeled", "NPU ms (board model)", "{:.3f}", figure=True),
        rp.Column("host_ms_modeled", "host ms (board model)", "{:.3f}", figure=True),
        rp.Column("where", "measured: faster"), rp.Column("model_says", "models: faster")], rows,
        note=f"{args.weights} NPU weights on {cores} core(s), ggml-cpu with {args.threads} thread(s), medians "
             f"of {args.reps}; record: {written or 'not written (simulated NPU: pass --record-file)'}")
    notes = ["measured: wall time of the engine's matmul (resident weight) and of ggml-cpu's MUL_MAT on the "
             "GGUF bytes, on this machine"]
    if simulated:
        notes.append("the NPU is simulated here: its times are the simulator's on this host, not a board's")
    return rp.Report("calibrate_placement", "Placement calibration", rig.to_dict(),
                     meta={"model": str(args.model), "board": key, "record": str(written) if written else None},
                     tables=[table], raw={"rows": [{k: v for k, v in r.items() if k != "raw"} for r in rows]},
                     notes=notes)
