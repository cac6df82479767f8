"""The board owner's kit: probe, check-rig, the bring-up ladder (bench/ladder.py), a
correctness sweep against numpy, a timing sweep, and one archive (JSON + Markdown) to
attach to an issue.

Invariants: the ladder runs first and the sweeps only if every rung passed, inside the
envelope it recorded; int8 results must equal numpy exactly, fp16 ones lie within
``FP16_RTOL * (|A| @ |B|^T) + FP16_ATOL`` of numpy's float64 product of the fp16-rounded
inputs; on the simulator device times are modeled and the report says so. Why and the
tolerance's derivation: docs/decisions.md "bench/selftest.py"."""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path

import numpy as np

from ggml_rknpu.bench import matmul as mm
from ggml_rknpu.bench import report as rp
from ggml_rknpu.bench.rig import RigReport, check_rig
from ggml_rknpu.bench.verdict import FP16_ATOL, FP16_RTOL, compare, corrupt_one  # noqa: F401 (st.compare)
from ggml_rknpu.kernel.behaviour import run_table

CORRUPT_ENV = "RKNPU_SELFTEST_CORRUPT"

# (M, K, N): GEMV, unaligned K and N, several M tiles, a K beyond one task's budget on a board.
SIM_SWEEP = ((1, 64, 16), (3, 100, 1001), (64, 256, 128), (196, 256, 512), (5, 1024, 48))
BOARD_SWEEP = SIM_SWEEP + ((1, 4096, 4096), (513, 1024, 1001), (64, 11008, 256), (4, 8192, 4096),
                           (1, 1536, 151936))


@dataclass
class CaseResult:
    M: int
    K: int
    N: int
    dtype: str
    cores: int
    ok: bool
    max_abs_err: float
    mismatches: int
    first_mismatch: dict | None = None
    device_ms: float | None = None
    device_basis: str | None = None
    error: str | None = None


@dataclass
class SelftestResult:
    passed: bool
    simulated: bool
    probe: dict
    rig: RigReport
    cases: list[CaseResult] = field(default_factory=list)
    timing: list[dict] = field(default_factory=list)
    corrupted: bool = False
    failures: list[str] = field(default_factory=list)
    ladder: list = field(default_factory=list)          # bench.ladder.RungResult
    envelope: str = "proven"
    envelope_record: str = ""


def _plain(obj) -> dict:
    if is_dataclass(obj) and not isinstance(obj, type):
        return {k: _plain_value(v) for k, v in asdict(obj).items()}
    return {k: _plain_value(v) for k, v in vars(obj).items() if not k.startswith("_")}


def _plain_value(v):
    return v if isinstance(v, (str, int, float, bool, type(None), list, dict, tuple)) else str(v)


def probe(device: str | None) -> dict:
    """Open the device, read its facts and do a buffer round trip (what ``rknpu probe`` does)."""
    from ggml_rknpu.devices import open_device

    pattern = (np.arange(4096, dtype=np.uint32) * 2654435761 & 0xFF).astype(np.uint8)
    with open_device(device) as dev:
        info = _plain(dev.info())
        # the harmless rows of the kernel-behaviour table: where this kernel answers otherwise
        n_rows, disagreements = run_table(dev.syscalls, dev.fd, dev.kind, dev.driver.version, harmless_only=True)
        with dev.alloc(4096) as buf:
            buf.array(np.uint8)[:] = pattern
            buf.sync_to_device()
            buf.sync_from_device()
            round_trip = bool(np.array_equal(buf.array(np.uint8)[:4096], pattern))
            dma = buf.dma_addr
        return {"kind": dev.kind, "simulated": bool(dev.simulated), "n_cores": dev.n_cores, "info": info,
                "buffer_round_trip": round_trip, "dma_addr": hex(dma), "iova_budget": list(dev.iova_budget()),
                "kernel_behaviour": {"rows": n_rows, "disagreements": [d.describe() for d in disagreements]}}


def correctness_sweep(device: str | None, shapes, dtypes, cores_list, *, corrupt: bool,
                      advance=lambda n=1: None, seed: int = 1234) -> list[CaseResult]:
    import ggml_rknpu

    rng = np.random.default_rng(seed)
    results = []
    corrupt_pending = corrupt
    for cores in cores_list:
        npu = ggml_rknpu.open(device=device, cores=cores)
        try:
            for (M, K, N) in shapes:
                for dtype in dtypes:
                    a, b = mm.make_operands(mm.Shape("selftest", K, N, "selftest"), M, dtype, rng)
                    try:
                        w = npu.upload_weight(b, dtype=dtype)
                        try:
                            c = np.array(npu.matmul(a, w))
                        finally:
                            w.free()
                    except Exception as exc:  # a failing case is a result, the sweep goes on
                        results.append(CaseResult(M, K, N, dtype, npu.cores, False, float("inf"), M * N,
                                                  error=f"{type(exc).__name__}: {exc}"))
                        advance(1)
                        continue
                    if corrupt_pending:
                        corrupt_one(c)
                        corrupt_pending = False
                    ok, max_err, n_bad, first = compare(c, a, b, dtype)
                    timing = mm.read_timing(npu.last_timing)
                    results.append(CaseResult(M, K, N, dtype, npu.cores, ok, max_err, n_bad, first,
                                              (timing["device_s"] or 0) * 1e3 or None, timing["device_basis"]))
                    advance(1)
        finally:
            npu.close()
    return results


def run_selftest(device: str | None = None, *, rig_root: str = "/", corrupt: bool | None = None,
                 console=None, shapes=None, timing_shapes=None, iters: int = 3,
                 ladder_rungs: tuple[str, ...] | None = None) -> SelftestResult:
    from ggml_rknpu.bench import ladder as ld

    corrupt = (os.environ.get(CORRUPT_ENV, "") in ("1", "true", "yes")) if corrupt is None else corrupt
    probe_info = probe(device)
    simulated = probe_info["simulated"]
    rig = check_rig(rig_root)
    shapes = shapes or (SIM_SWEEP if simulated else BOARD_SWEEP)
    dtypes = ("fp16", "int8")
    cores_list = (1, probe_info["n_cores"]) if probe_info["n_cores"] > 1 else (1,)
    timing_shapes = timing_shapes or (mm.SMALL_SHAPES if simulated else mm.SEED_SHAPES)
    timing_cases = [mm.Case(s, m, d, c) for s in timing_shapes for d in dtypes for c in cores_list
                    for m in ((1, 16) if simulated else (1, 64, 256))]
    total = len(shapes) * len(dtypes) * len(cores_list) + len(timing_cases)
    import ggml_rknpu

    n_rungs = len(ld.LADDER) if ladder_rungs is None else len(ladder_rungs)
    cases, timing = [], []
    with rp.progress(console, "selftest", total + n_rungs) as advance:
        ladder = ld.run_ladder(device, ladder_rungs, advance=advance)
        key, record_file = ld.record(device, ladder)
        failures = [f"ladder rung {r.name}: {r.symptom}: {r.detail}" for r in ladder if r.status == "FAIL"]
        if not failures:   # the sweeps run in the envelope the ladder just recorded
            cases = correctness_sweep(device, shapes, dtypes, cores_list, corrupt=corrupt, advance=advance)
            timing = mm.burst(lambda cores: ggml_rknpu.open(device=device, cores=cores), timing_cases,
                              iters=iters, warmup=1, on_board=not simulated, max_sim_macs=2 ** 22, advance=advance)
    failures += [f"{c.dtype} M={c.M} K={c.K} N={c.N} cores={c.cores}: "
                 + (c.error or f"{c.mismatches} mismatching element(s), first {c.first_mismatch}")
                 for c in cases if not c.ok]
    if not probe_info["buffer_round_trip"]:
        failures.insert(0, "probe: buffer round trip returned different bytes")
    from ggml_rknpu.engine.envelope_record import envelope_for_rungs

    envelope = envelope_for_rungs(ld.passed_rungs(ladder), probe_info["kind"]).describe()
    return SelftestResult(not failures, simulated, probe_info, rig, cases, timing, corrupt, failures, ladder,
                          envelope, f"{record_file} [{key}]")


def build_report(result: SelftestResult) -> rp.Report:
    where = "simulator (device times modeled)" if result.simulated else "board (device times measured)"
    rows = [{**asdict(c), "status": "ok" if c.ok else "FAIL",
             f"device_ms_{c.device_basis or 'modeled'}": c.device_ms} for c in result.cases]
    columns = [rp.Column("status", "status"), rp.Column("dtype", "dtype"), rp.Column("cores", "cores"),
               rp.Column("M", "M"), rp.Column("K", "K"), rp.Column("N", "N"),
               rp.Column("max_abs_err", "max |err|", "{:.3g}"), rp.Column("mismatches", "mismatches"),
               rp.Column("device_ms_modeled", "device ms", "{:.3f}", figure=True),
               rp.Column("device_ms_measured", "device ms", "{:.3f}", figure=True)]
    columns = [c for c in columns if not c.figure or any(r.get(c.key) is not None for r in rows)]
    timing_cols = [c for c in mm.MATMUL_COLUMNS if not c.figure or any(r.get(c.key) is not None
                                                                       for r in result.timing)]
    from ggml_rknpu.bench import ladder as ld

    notes = [f"ran on the {where}", f"correctness: int8 exact; fp16 within {FP16_RTOL} x (|A|@|B|^T) + {FP16_ATOL}",
             f"envelope recorded for this board and driver: {result.envelope} (in {result.envelope_record})"]
    behaviour = result.probe["kernel_behaviour"]
    notes.append(f"kernel behaviour table: {behaviour['rows']} harmless rows, "
                 f"{len(behaviour['disagreements'])} disagreement(s) (kernel/behaviour.py)")
    notes += [f"the kernel disagrees with the behaviour table: {d}" for d in behaviour["disagreements"]]
    if result.corrupted:
        notes.append(f"{CORRUPT_ENV} hook active: one output element was flipped after the NPU returned")
    notes += [f"FAIL: {f}" for f in result.failures]
    return rp.Report(
        "selftest", f"rknpu selftest: {'PASS' if result.passed else 'FAIL'}", result.rig.to_dict(),
        meta={"result": "PASS" if result.passed else "FAIL", "where": where,
              "device": f"{'sim-' if result.simulated else ''}{result.probe['kind']}",
              "host": mm.host_description(), "version": _version()},
        tables=[rp.Table("Probe", [rp.Column("k", "fact"), rp.Column("v", "value")],
                         [{"k": k, "v": v} for k, v in _flat(result.probe).items()]),
                rp.Table("Bring-up ladder (safest first; stops at the first failure)",
                         [rp.Column("rung", "rung"), rp.Column("status", "status"), rp.Column("what", "what"),
                          rp.Column("symptom", "symptom"), rp.Column("detail", "detail"),
                          rp.Column("seconds", "s", "{:.2f}")], ld.as_rows(result.ladder)),
                rp.Table("Symptoms", [rp.Column("symptom", "symptom"), rp.Column("meaning", "what it means")],
                         [{"symptom": k, "meaning": v} for k, v in ld.SYMPTOMS.items()]),
                rp.Table("Correctness vs numpy", columns, rows),
                rp.Table("Timing sweep (median per call)", timing_cols, result.timing)],
        raw={"probe": result.probe, "cases": [asdict(c) for c in result.cases], "timing": result.timing,
             "failures": result.failures, "corrupted": result.corrupted,
             "ladder": [asdict(r) for r in result.ladder], "envelope": result.envelope,
             "envelope_record": result.envelope_record},
        notes=notes)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _version() -> str:
    from ggml_rknpu import __version__

    return __version__


def write_archive(report: rp.Report, out_dir: Path) -> Path:
    """selftest.json + selftest.md into ``out_dir`` and one tar.gz of both to attach to an issue."""
    paths = report.write(out_dir)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    archive = Path(out_dir) / f"rknpu-selftest-{stamp}.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for key in ("json", "markdown"):
            tar.add(paths[key], arcname=paths[key].name)
        summary = json.dumps({"result": report.meta["result"], "files": [paths["json"].name,
                                                                         paths["markdown"].name]}).encode()
        info = tarfile.TarInfo("MANIFEST.json")
        info.size = len(summary)
        tar.addfile(info, io.BytesIO(summary))
    return archive
