"""Decode forecast: per token, the modeled NPU time of the programs and submits a decode
pass runs, the host time per NPU submit measured here, and the published figures beside it.

Invariants: NPU time is *modeled* (``cost.model``) from the engine's own programs at its M
bucket, per decode pass (fused by default: 4 submits per layer plus the head; unfused: one
per matmul), each a submit (``OWN_DRIVER``), host ops not in it (the plan rows price them,
``bench.plans``); the host time is *measured* on this host, on the lean path
(``engine.fusion.Fusion``), the submit itself excluded. Shapes: ``bench.shapes``.
Why: docs/decisions.md "bench/decode.py";
figures: docs/decode.md."""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console

from ggml_rknpu.bench import report as rp
from ggml_rknpu.bench.plans import QUANT_MIXES
from ggml_rknpu.bench.rig import npu_clock
from ggml_rknpu.bench.shapes import BENCH_MODELS, PRESETS, ModelShape, is_config, resolve
from ggml_rknpu.cost.model import (
    OWN_DRIVER,
    ROCKET_DOMAIN_SWITCH_S,
    VENDOR_NPU_MHZ,
    dram_bandwidth,
    modeled_time,
    rocket_time,
)
from ggml_rknpu.hw.envelope import ROCKET_BOOT_MHZ

MS = (1, 2, 4, 8, 16)
HOST_ALONE_REPS = 100    # rehearsals are cheap (no submit): enough for a stable median
DRAM_MHZ = 2112      # max DRAM clock [docs/anchors.md A3]; the NPU's: check-rig's reading, else the vendor's
ROCKET_MHZ = (ROCKET_BOOT_MHZ, 600)  # mainline's boot clock; the out-of-tree patch's [docs/npu-programming.md §5]


# Published board figures, decode tokens/s on RK3588 (docs/decode.md cites them).
SOURCES = {   # the public sources are listed in docs/anchors.md and docs/decode.md
    "RKLLM w8a8": "docs/anchors.md A4: airockchip/rknn-llm's benchmark table (RKLLM w8a8, RK3588, max clocks)",
    "qwen3.c fp16": "docs/anchors.md A6: allbilly/qwen3.c's FP16 roofline notes (open FP16 regcmd engine, vendor "
                    "driver, 1 GHz; stock RKLLM FP16 19.18 tok/s in the same write-up)",
    "librknnrt Q8_0": "docs/decode.md: invisiofficial/rk-llama.cpp's ggml-rknpu2 notes (librknnrt matmul backend, "
                      "Gemma3-1B Q8_0 tg; the 4xA76 CPU alone 19.5, docs/anchors.md A9)",
}
ANCHORS: dict[tuple[str, str], tuple[float, str]] = {
    ("Qwen2.5-1.5B", "int8"): (16.69, "RKLLM w8a8"),
    ("Qwen3-0.6B", "int8"): (32.91, "RKLLM w8a8"),
    ("Qwen3-0.6B", "fp16"): (20.85, "qwen3.c fp16"),
    ("Gemma3-1B", "int8"): (16.5, "librknnrt Q8_0"),
}


@dataclass(frozen=True)
class DecodeSubmit:
    """One submit of a decode token: matmuls reading one activation [M, K]."""

    names: tuple[str, ...]
    K: int
    Ns: tuple[int, ...]
    fused: bool            # one fused weight (sum N) rather than one program per weight
    count: int = 1         # how many times per token (the layers)


def decode_submits(model: ModelShape, fused: bool = True) -> list[DecodeSubmit]:
    """The NPU submits of one decode token, as the server plans them (module doc)."""
    mm = model.layer_matmuls()
    groups = [("q", "k", "v"), ("o",), ("gate", "up"), ("down",)] if fused else [(n,) for n in mm]
    submits = [DecodeSubmit(g, mm[g[0]][0], tuple(mm[n][1] for n in g), fused and len(g) > 1, model.layers)
             for g in groups]
    submits.append(DecodeSubmit(("output",), model.hidden, (model.vocab,), False, 1))
    return submits


def laddered_envelope():
    """The envelope of a board that passed the whole bring-up ladder (what
    ``bench matmul --modeled`` prices too); the proven envelope alone allows one core."""
    from ggml_rknpu.engine.envelope_record import RUNGS, envelope_for_rungs

    return envelope_for_rungs(list(RUNGS), "rknpu")


def named_envelope(name):
    from ggml_rknpu.hw.envelope import by_name

    return laddered_envelope() if name in (None, "laddered") else by_name(name)


def submit_programs(sub: DecodeSubmit, m: int, dtype: str, cores: int, abi: str = "rknpu", envelope=None) -> list:
    """The programs the engine compiles for ``sub`` at ``m`` rows (its M bucket) in
    ``envelope`` (default: the fully laddered board's)."""
    from ggml_rknpu.compiler.matmul import compile_matmul
    from ggml_rknpu.engine.programs import OUT_FOR_WEIGHT, m_bucket

    env = named_envelope(envelope)
    out = OUT_FOR_WEIGHT[dtype]
    Ns = (sum(sub.Ns),) if sub.fused else sub.Ns
    return [compile_matmul(m_bucket(m), sub.K, n, dtype=dtype, out=out, cores=min(cores, env.max_cores), abi=abi,
                           envelope=env) for n in Ns]


def submit_workload_for(sub: DecodeSubmit, m: int, dtype: str, cores: int, envelope=None):
    from ggml_rknpu.engine.fusion import fusion_workload

    return fusion_workload(submit_programs(sub, m, dtype, cores, envelope=envelope))


def modeled_submit_s(sub: DecodeSubmit, m: int, dtype: str, cores: int, envelope=None,
                     npu_mhz: float = VENDOR_NPU_MHZ) -> float:
    return modeled_time(submit_workload_for(sub, m, dtype, cores, envelope),
                        npu_mhz=npu_mhz, dram_mhz=DRAM_MHZ, profile=OWN_DRIVER).total_s


def stream_bound(dtype: str, cores: int, npu_mhz: float = VENDOR_NPU_MHZ) -> float:
    """Bytes/s the cost model lets one job of decode rows (M <= 16) stream on ``cores``:
    each core's share of the DRAM stream, its compute on 16 padded rows overlapped but for
    ``OVERLAP_PENALTY`` of it (docs/decode.md, the goals' arithmetic)."""
    from ggml_rknpu.cost import model as cm

    per_core = min(cm.CORE_STREAM_BYTES_PER_CYCLE * npu_mhz * 1e6, dram_bandwidth(DRAM_MHZ) / cores)
    compute_per_byte = cm.M_ATOM / cm.MACS_PER_CYCLE_PER_CORE[dtype] / (npu_mhz * 1e6) / cm.IN_BYTES[dtype]
    return cores * per_core / (1 + cm.OVERLAP_PENALTY * compute_per_byte * per_core)


def forecast(model: ModelShape, dtype: str, m: int, cores: int, fused: bool = True, envelope=None,
             npu_mhz: float = VENDOR_NPU_MHZ) -> dict:
    """Modeled NPU figures of one decode pass of ``m`` sequences, the NPU at ``npu_mhz``."""
    b = 1 if dtype == "int8" else 2
    submits = decode_submits(model, fused)
    seconds = sum(modeled_submit_s(s, m, dtype, cores, envelope, npu_mhz) * s.count for s in submits)
    weight_bytes = sum(sub.K * n * b * sub.count for sub in submits for n in sub.Ns)
    submits = sum(submit_workload_for(s, m, dtype, cores, envelope).submits * s.count for s in submits)
    return {
        "model": model.name, "weights": dtype, "M": m, "plan": "fused" if fused else "unfused",
        "submits_per_token": submits, "submits_per_layer": (submits - 1) / model.layers,
        "npu_ms_per_pass_modeled": seconds * 1e3,
        "tok_s_modeled": m / seconds,
        "stream_gb_s_modeled": weight_bytes / seconds / 1e9,
        "submit_ms_modeled": submits * OWN_DRIVER.per_submit_s * 1e3,
        "weight_mb": weight_bytes / 1e6,
        # the most these submits allow: the weights at the DRAM ceiling, or at the model's bound
        "tok_s_at_ceiling_modeled": m / (weight_bytes / dram_bandwidth(DRAM_MHZ) + submits * OWN_DRIVER.per_submit_s),
        "tok_s_at_bound_modeled": m / (weight_bytes / stream_bound(dtype, cores, npu_mhz)
                                       + submits * OWN_DRIVER.per_submit_s),
    }


def rocket_forecast(model: ModelShape, dtype: str, cores: int, npu_mhz: float, envelope=None) -> dict:
    """Modeled NPU ms of one fused decode pass (M=1) under mainline rocket: the programs'
    jobs from one open file (run in turn on one core) and from one file per core used (side
    by side); every job pays the domain switch, a guess (``cost.model.ROCKET_DOMAIN_SWITCH_S``)."""
    from ggml_rknpu.engine.fusion import fusion_workload

    row: dict = {"model": model.name, "weights": dtype, "npu_mhz": npu_mhz, "cores": cores}
    for key, per_core in (("one_file", False), ("file_per_core", True)):
        seconds = jobs = 0.0
        for sub in decode_submits(model, True):
            work = fusion_workload(submit_programs(sub, 1, dtype, cores, abi="rocket", envelope=envelope))
            files = len({t.core for t in work.tasks}) if per_core else 1
            seconds += rocket_time(work, files=files, npu_mhz=npu_mhz, dram_mhz=DRAM_MHZ).total_s * sub.count
            jobs += work.submits * len({t.core for t in work.tasks}) * sub.count
        row[f"{key}_ms_modeled"] = seconds * 1e3
        row[f"{key}_tok_s_modeled"] = 1 / seconds
        row["domain_switch_ms_modeled"] = jobs * ROCKET_DOMAIN_SWITCH_S * 1e3
    return row


def measure_host_submit(npu, sub: DecodeSubmit, m: int, dtype: str, reps: int,
                      rng: np.random.Generator) -> tuple[float, float]:
    """Median host seconds of the lean path around one submit of ``sub`` on this host,
    the submit itself excluded: (alone: ``Fusion.rehearse``, A written and C read with no
    submit between; after a simulated submit: the same phases of ``Fusion.run``, whose
    simulation has just evicted the CPU caches)."""
    parts = [rng.standard_normal((n, sub.K), dtype=np.float32) * 0.05 for n in sub.Ns]
    if sub.fused:
        weights = [npu.upload_fused_weight(parts, dtype=dtype)]
    else:
        weights = [npu.upload_weight(p, dtype=dtype) for p in parts]
    del parts
    try:
        planned = npu.fuse(weights, m=m)
        a = rng.standard_normal((m, sub.K), dtype=np.float32)
        planned.run(a)                       # warm-up: compile, bind, first touch
        after_submit = []
        for _ in range(reps):
            planned.run(a)
            pack_s, _submit_s, unpack_s = planned.timing
            after_submit.append(pack_s + unpack_s)
        alone = [planned.rehearse(a) for _ in range(max(reps, HOST_ALONE_REPS))]
        return statistics.median(alone), statistics.median(after_submit)
    finally:
        for w in weights:
            w.free()


def add_arguments(p: argparse.ArgumentParser, common) -> None:
    common(p, "bench-out/decode")
    p.add_argument("model", nargs="*", default=[],
                   help=f"presets ({', '.join(PRESETS)}), Hugging Face config.json files (or directories holding one) "
                        f"and/or GGUF files; default: {', '.join(BENCH_MODELS)}")
    p.add_argument("--weights", default="int8,fp16", help="comma list of weight formats (default int8,fp16)")
    p.add_argument("--ms", default=",".join(map(str, MS)), help="rows per pass (default 1,2,4,8,16)")
    p.add_argument("--cores", type=int, default=3, choices=(1, 2, 3), help="NPU cores the programs use (default 3)")
    p.add_argument("--host-reps", type=int, default=5, help="timed runs per submit for the host figure (0: skip)")
    p.add_argument("--quant", default=None, choices=QUANT_MIXES,
                   help="quantization mix the presets' plan rows are priced in (default: Gemma3-1B Q4_0, "
                        "Qwen3-0.6B Q8_0, the others Q4_K_M); a GGUF's types are read from it")
    p.add_argument("--plan-weights", default="int8", choices=("int8", "fp16"),
                   help="NPU weight format of the npu/auto plan rows (default int8)")
    p.add_argument("--envelope", default="laddered", choices=("laddered", "proven", "extended"),
                   help="envelope the programs are compiled in (default laddered: a board that passed the whole "
                        "bring-up ladder; proven: what hardware-run streams cover, 1 core)")


def named_models(names: list[str]) -> list[ModelShape]:
    """The shapes the model arguments name: presets, Hugging Face configs, GGUF files (every
    preset when none is named)."""
    return [resolve(name) for name in names or BENCH_MODELS]


def model_weights(arg: str, model: ModelShape, quant: str | None) -> tuple[str, list]:
    """(quantization mix, weight matmuls) a plan prices ``model`` (named ``arg``) in: a GGUF's
    types as stored, a preset's or a config's in ``quant`` (default: the goals' mix,
    ``plans.DEFAULT_QUANT``, else Q4_K_M)."""
    from ggml_rknpu.bench import plans

    if Path(arg).is_file() and not is_config(arg):
        return "as stored", plans.gguf_weights(Path(arg))
    mix = quant or plans.DEFAULT_QUANT.get(model.name, "Q4_K_M")
    return mix, plans.preset_weights(model, mix)


def run(args, rig, console: Console) -> rp.Report | None:
    models = named_models(args.model)
    dtypes = [d.strip() for d in args.weights.split(",") if d.strip()]
    if not dtypes or any(d not in ("fp16", "int8") for d in dtypes):
        raise ValueError(f"--weights takes fp16 and/or int8, got {args.weights!r}")
    ms = [int(x) for x in args.ms.split(",") if x.strip()]
    if not ms or any(not 1 <= m <= 16 for m in ms):
        raise ValueError(f"--ms takes decode row counts 1..16, got {args.ms!r}")
    clock = npu_clock(rig)
    rows: list[dict] = []
    # (K, Ns, fused, M, weights) -> measure_host_submit's (host alone, after a submit) seconds
    host_cache: dict[tuple[int, tuple[int, ...], bool, int, str], tuple[float, float]] = {}
    host_rows: list[dict] = []
    npu = None
    if args.host_reps > 0:
        import ggml_rknpu

        npu = ggml_rknpu.open(device=args.device or "sim-rknpu", cores=args.cores,
                              envelope=named_envelope(args.envelope))
    rng = np.random.default_rng(0)
    n_cases = len(models) * len(dtypes) * (len(ms) + 1)
    try:
        with rp.progress(console, "decode", n_cases) as advance:
            for model in models:
                for dtype in dtypes:
                    for fused, m_list in ((False, [1]), (True, ms)):
                        for m in m_list:
                            row = forecast(model, dtype, m, args.cores, fused, args.envelope, clock.mhz)
                            anchor = ANCHORS.get((model.name, dtype))
                            row["anchor_tok_s"] = f"{anchor[0]:g}" if anchor and m == 1 else "-"
                            row["anchor_source"] = anchor[1] if anchor and m == 1 else ""
                            if npu is not None and fused:
                                host = 0.0
                                for sub in decode_submits(model, fused):
                                    key = (sub.K, sub.Ns, sub.fused, m, dtype)
                                    if key not in host_cache:
                                        host_cache[key] = measure_host_submit(npu, sub, m, dtype, args.host_reps, rng)
                                        host_rows.append({
                                            "submit": "+".join(sub.names) + (" (fused)" if sub.fused else ""),
                                            "weights": dtype, "M": m, "K": sub.K, "N": "+".join(map(str, sub.Ns)),
                                            "host_us_measured": host_cache[key][0] * 1e6,
                                            "host_after_submit_us_measured": host_cache[key][1] * 1e6})
                                    host += host_cache[key][0] * sub.count
                                row["host_us_per_submit_measured"] = host / row["submits_per_token"] * 1e6
                                row["host_ms_per_pass_measured"] = host * 1e3
                            rows.append(row)
                            advance()
    finally:
        if npu is not None:
            npu.close()

    ceiling = dram_bandwidth(DRAM_MHZ) / 1e9
    columns = [
        rp.Column("model", "model"), rp.Column("weights", "weights"), rp.Column("plan", "plan"), rp.Column("M", "M"),
        rp.Column("submits_per_token", "submits/pass"),
        rp.Column("npu_ms_per_pass_modeled", "NPU ms/pass", "{:.1f}", figure=True),
        rp.Column("tok_s_modeled", "tok/s", "{:.1f}", figure=True),
        rp.Column("stream_gb_s_modeled", "weight stream GB/s", "{:.1f}", figure=True),
        rp.Column("submit_ms_modeled", "of which submits ms", "{:.1f}", figure=True),
        rp.Column("tok_s_at_ceiling_modeled", "tok/s at most: DRAM ceiling, same submits", "{:.2f}", figure=True),
        rp.Column("tok_s_at_bound_modeled", "tok/s at most: model's job bound, same submits", "{:.2f}", figure=True),
        rp.Column("host_us_per_submit_measured", "host µs per NPU submit", "{:.1f}", figure=True),
        rp.Column("host_ms_per_pass_measured", "host ms/pass", "{:.2f}", figure=True),
        rp.Column("anchor_tok_s", "published tok/s (board)"), rp.Column("anchor_source", "by"),
    ]
    note = (f"NPU figures modeled (cost.model: {args.cores} cores, NPU at {clock}, DRAM {DRAM_MHZ} MHz, "
            f"DRAM ceiling {ceiling:.1f} GB/s, {OWN_DRIVER.per_submit_s * 1e6:.0f} µs per submit); a pass decodes "
            "M sequences by one token. Host figures measured on this host (not the board): the engine's lean "
            "path around each submit, simulator execution excluded. Published figures: single-stream, on boards.")
    table = rp.Table("Decode per pass: modeled NPU time, measured host time, published figures", columns, rows, note)
    tables = [table]
    if host_rows:
        tables.append(rp.Table("Host time per NPU submit (measured on this host, not the board)", [
            rp.Column("submit", "submit"), rp.Column("weights", "weights"), rp.Column("M", "M"), rp.Column("K", "K"),
            rp.Column("N", "N"), rp.Column("host_us_measured", "host µs", "{:.1f}", figure=True),
            rp.Column("host_after_submit_us_measured", "host µs after a simulated submit", "{:.1f}", figure=True)],
            host_rows,
            note=f"engine.fusion.Fusion with float32 activations: writing A and reading C through the fusion's views, "
                 f"int8 scales included, the submit excluded. 'host µs': median of {HOST_ALONE_REPS} "
                 f"Fusion.rehearse calls (no submit between); 'after a simulated submit': median of "
                 f"{args.host_reps} Fusion.run calls, each right after the simulator ran its submit (cold CPU caches)"))
    rocket_rows = [rocket_forecast(model, dtype, args.cores, mhz, args.envelope)
                   for model in models for dtype in dtypes for mhz in ROCKET_MHZ]
    tables.append(rp.Table("Decode under mainline rocket, M=1 fused (modeled)", [
        rp.Column("model", "model"), rp.Column("weights", "weights"), rp.Column("npu_mhz", "NPU MHz"),
        rp.Column("cores", "cores"),
        rp.Column("one_file_tok_s_modeled", "tok/s, one file", "{:.1f}", figure=True),
        rp.Column("file_per_core_tok_s_modeled", "tok/s, a file per core", "{:.1f}", figure=True),
        rp.Column("domain_switch_ms_modeled", "of which domain switches ms (a guess)", "{:.2f}", figure=True)],
        rocket_rows,
        note=f"rocket runs one open file's jobs in turn on one core: 'one file' submits every core's share from "
             f"one file (they run one after another), 'a file per core' from one file each (side by side). "
             f"Every job attaches and detaches its file's IOMMU domain: priced at "
             f"{ROCKET_DOMAIN_SWITCH_S * 1e6:.0f} µs, a guess no board has measured; every file's submit at "
             f"{OWN_DRIVER.per_submit_s * 1e6:.0f} µs. docs/npu-programming.md \"What the drivers really do\""))
    plan_table, plan_plot, plan_rows = _plans(args, models, clock.mhz)
    tables.append(plan_table)
    fused_rows = [r for r in rows if r["plan"] == "fused"]
    plot = rp.Plot("decode_tok_s.png", "Decode tokens/s by rows per pass (fused plan)", "M (sequences per pass)",
                   "tokens/s", rp.series_by(fused_rows, "weights", "M", "tok_s_modeled", "{0} {1}")
                   if len(models) == 1 else
                   [s for d in dtypes for s in rp.series_by([r for r in fused_rows if r["weights"] == d], "model", "M",
                                                            "tok_s_modeled", f"{{0}} {d} {{1}}")],
                   log_x=True)
    host_meta = {"host": _host_line(), "conditions": "one process; the x86 box is shared (load average in meta)"}
    meta = {"cores": args.cores, "npu_mhz": clock.mhz, "npu_clock": str(clock), "dram_mhz": DRAM_MHZ,
            "submit_profile": OWN_DRIVER.name,
            "envelope": f"{args.envelope} ({named_envelope(args.envelope).name}, at most "
                        f"{named_envelope(args.envelope).max_cores} core(s))",
            "models": {m.name: m.source for m in models}, "load_average": _loadavg(), **host_meta}
    notes = ["fused = Q/K/V one fused weight, O, gate/up one fused weight, down (4 submits per layer) + "
             "the output head; unfused = one submit per matmul",
             "the forecast table prices the weight matmuls only; the plan rows price every host op too (cost.host_ops)",
             *(f"published figure '{k}': {v}" for k, v in SOURCES.items())]
    return rp.Report("decode", "Decode forecast (modeled NPU, measured host)", rig.to_dict(), meta=meta,
                     tables=tables, plots=[plot, plan_plot], raw={"rows": rows, "host_submits": host_rows, "plans": plan_rows,
                          "rocket": rocket_rows},
                     notes=notes)


def _plans(args, models: list[ModelShape], npu_mhz: float) -> tuple[rp.Table, rp.Plot, list[dict]]:
    """The cpu / npu / auto / auto-split plan rows (bench.plans) of every model, in the
    laddered (3 cores) and proven (1 core) envelopes, all modeled on the board (its NPU at
    ``npu_mhz``)."""
    from ggml_rknpu.bench import plans
    from ggml_rknpu.cost.cpu_anchors import CPU_ANCHORS

    rows: list[dict] = []
    for arg, model in zip(args.model or BENCH_MODELS, models):
        quant, weights = model_weights(arg, model, args.quant)
        published = {a.test: a.tok_s for a in CPU_ANCHORS if (a.model, a.quant) == (model.name, quant)}
        for envelope in ("laddered", "proven"):
            rows += plans.plan_rows(model.name, quant, weights, model.host_layers(), envelope,
                                    named_envelope(envelope).max_cores, args.plan_weights, published, npu_mhz)
    columns = [rp.Column(k, k) for k in ("model", "quant", "envelope", "plan")] + [
        *(rp.Column(f"decode_m{m}_tok_s_modeled", f"decode M={m} tok/s", "{:.1f}", figure=True) for m in plans.PLAN_MS),
        *(rp.Column(f"prefill{n}_tok_s_modeled", f"prefill {n} tok/s", "{:.0f}", figure=True)
          for n in plans.PLAN_PROMPTS),
        rp.Column("job_s_modeled", f"job {plans.JOB_PROMPT}+{plans.JOB_ANSWER} s", "{:.2f}", figure=True),
        rp.Column("decode_m1_vs_cpu_modeled", "decode M=1 / cpu", "{:.2f}", figure=True),
        rp.Column("prefill512_vs_cpu_modeled", "prefill 512 / cpu", "{:.1f}", figure=True),
        rp.Column("job_vs_cpu_modeled", "job / cpu", "{:.2f}", figure=True),
        rp.Column("published", "published CPU (board, llama-bench -t 4)")]
    table = rp.Table("Plans: llama.cpp's CPU alone, the NPU, placement by cost (modeled on the board)", columns, rows,
                     note=f"cpu = every matmul in ggml-cpu on 4 A76 (cost.cpu, repacked where llama.cpp repacks); npu "
                          f"= every weight matmul on the NPU ({args.plan_weights}); auto = each weight where "
                          "cost.placement puts it, no split (rknpu serve --placement auto); auto-split = splits "
                          "allowed (rknpu serve --placement-split, opt-in; its gain modeled only). Host ops (cost.host_ops, by rows "
                          f"and the cache's fill: decode at {plans.DECODE_PAST} cached positions) priced alike in every "
                          f"plan; a prompt computes the head for its last row; job = {plans.JOB_PROMPT}-token prompt + "
                          f"{plans.JOB_ANSWER} decode passes. docs/placement.md")
    plot = rp.Plot("plans_job_s.png", f"Whole job ({plans.JOB_PROMPT}+{plans.JOB_ANSWER} tokens) by plan",
                   "model, envelope", "seconds",
                   rp.series_by([dict(r, at=f"{r['model']} {r['envelope']}") for r in rows], "plan", "at",
                                "job_s_modeled", "{0} {1}"), kind="bar")
    return table, plot, rows


def _host_line() -> str:
    import platform

    return f"{platform.machine()} {platform.processor() or ''} python {platform.python_version()}".strip()


def _loadavg() -> list[float] | None:
    try:
        import os

        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
