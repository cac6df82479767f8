"""Which placements of a model fit a board's RAM, all *modeled*: the board bytes of llama.cpp
alone, of RKLLM where its benchmark table has the model, and of ``rknpu serve`` under each
placement (host only, NPU only, both as ``auto`` places them, and the fastest per-weight
mix that fits), with each one's modeled prefill and decode, for 4, 8, 16 and 32 GB.

Invariants: shapes and weight types come from the functions ``bench decode`` prices with
(``bench.plans``); times are ``cost.placement``'s, host ops ``cost.host_ops``'; a plan fits
when its bytes stay within RAM less the server's memory-budget reserve; NPU copies beyond
one IOMMU domain's 4 GiB window are priced as they would be and marked as needing several
domains (built on the vendor driver, not on rocket). The byte model: docs/memory.md "Fitting a board"."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from ggml_rknpu.bench import plans, shapes
from ggml_rknpu.bench import report as rp
from ggml_rknpu.bench.fit_bytes import (
    MIB,
    NPU_DOMAIN_BYTES,
    RKLLM_MB,
    SHAPES,
    Footprint,
    gguf_bytes,
    npu_bytes,
    usable,
)
from ggml_rknpu.cost import cpu
from ggml_rknpu.cost import host_ops as ho
from ggml_rknpu.cost import placement as pl
from ggml_rknpu.cost import residency as rs
from ggml_rknpu.cost.residency import BOTH, HOST, NPU

RAM_GB = (4, 8, 16, 32)
DECODE_M, PREFILL_M = 1, plans.JOB_PROMPT


def add_arguments(p, common) -> None:
    common(p, "bench-out/fit")
    p.add_argument("model", nargs="+", help=f"GGUF files, Hugging Face configs and/or shapes ({', '.join([*SHAPES, *shapes.PRESETS])})")
    p.add_argument("--ram", default=",".join(map(str, RAM_GB)), help="board RAM sizes in GB (default 4,8,16,32)")
    p.add_argument("--quant", default=None, choices=plans.QUANT_MIXES,
                   help="quantization mix of a preset (as bench decode: default per model, else Q4_K_M)")
    p.add_argument("--context", type=int, default=4096, help="KV cache tokens (default 4096, f16)")
    p.add_argument("--plan-weights", default="int8", choices=("int8", "fp16"), help="NPU weight format (default int8)")
    p.add_argument("--cores", type=int, default=3, choices=(1, 2, 3), help="NPU cores (default 3: laddered)")


@dataclass(frozen=True)
class Unit:
    """One weight matmul (one layer's) and its copies' bytes and modeled seconds per pass."""

    weight: plans.Weight
    cost: rs.WeightCost


def units(weights: list[plans.Weight], npu_dtype: str, cores: int) -> list[Unit]:
    out = []
    for w in weights:
        prompt_rows = 1 if w.name == "output" else PREFILL_M        # the head: the prompt's last row only
        c = [pl.place_matmul(w.type, m, w.K, w.N, npu_dtype=npu_dtype, cores=cores, threads=cpu.BIG_CORES,
                             allow_split=False, repacked=True) for m in (DECODE_M, prompt_rows)]
        u = Unit(w, rs.WeightCost(gguf_bytes(w), npu_bytes(w, npu_dtype), (c[0].host_s, c[1].host_s),
                                  (c[0].npu_s, c[1].npu_s)))
        out += [u] * w.count
    return out


def auto_side(u: Unit) -> str:
    """Where ``rknpu serve --placement auto`` keeps a weight: a copy for each side a pass runs on."""
    c = u.cost
    return rs.wanted_side(pl.NPU if c.npu_s[i] < c.host_s[i] else pl.HOST for i in (0, 1))


def fastest_within(us: list[Unit], limit: int, npu_limit: int | None,
                   board: Callable[[int, int], int]) -> list[str] | None:
    """``cost.residency.fastest_within`` from where auto keeps each weight."""
    return rs.fastest_within([u.cost for u in us], [auto_side(u) for u in us], limit, npu_limit, board)


def _row(model: str, quant: str, plan: str, ram: int, board: int, npu_: int, times: tuple[float, float] | None,
         host_layers: tuple[ho.LayerOps, ...], note: str = "") -> dict:
    decode_s, prompt_s = times if times is not None else (None, None)
    # the same host ops in every plan: the prompt's pass from an empty cache, a decode row at the job's mean fill
    host_prompt = ho.host_ops_seconds(host_layers, PREFILL_M)
    host_decode = ho.host_ops_seconds(host_layers, DECODE_M, plans.DECODE_PAST)
    needs = "multi-domain NPU residency: the vendor driver's domains, or on rocket a file per core (a 4 GiB window per core)" if npu_ > NPU_DOMAIN_BYTES else ""
    return {"model": model, "quant": quant, "ram_gb": ram, "plan": plan,
            "board_gib_modeled": board / 2**30, "npu_gib_modeled": npu_ / 2**30,
            "fits": "yes" if board <= usable(ram) else "no",
            "prefill512_tok_s_modeled": PREFILL_M / (prompt_s + host_prompt) if prompt_s is not None else None,
            "decode_tok_s_modeled": 1 / (decode_s + host_decode) if decode_s is not None else None,
            "note": "; ".join(x for x in (needs, note) if x)}


def totals(us: list[Unit], sides: list[str]) -> tuple[int, int, tuple[float, float]]:
    host = sum(u.cost.bytes(s)[0] for u, s in zip(us, sides))
    npu_ = sum(u.cost.bytes(s)[1] for u, s in zip(us, sides))
    return host, npu_, (sum(u.cost.seconds(s)[0] for u, s in zip(us, sides)),
                        sum(u.cost.seconds(s)[1] for u, s in zip(us, sides)))


def model_rows(name: str, shape, quant: str, weights: list[plans.Weight], rams: list[int], args) -> list[dict]:
    us = units(weights, args.plan_weights, args.cores)
    fp = Footprint(shape, args.context, gguf_bytes(next(w for w in weights if w.name == "output")))
    cpu_d = sum(cpu.cpu_matmul_seconds(u.weight.type, DECODE_M, u.weight.K, u.weight.N) for u in us)
    cpu_p = sum(cpu.cpu_matmul_seconds(u.weight.type, 1 if u.weight.name == "output" else PREFILL_M, u.weight.K,
                                       u.weight.N) for u in us)
    weight_bytes = sum(u.cost.host_bytes for u in us)
    host_layers = shape.host_layers()
    rows = []
    for ram in rams:
        rows.append(_row(name, quant, "llama.cpp alone", ram, fp.alone(weight_bytes), 0, (cpu_d, cpu_p),
                         host_layers))
        rkllm = RKLLM_MB.get(name)
        if rkllm is not None:
            rows.append(_row(name, "w8a8", "RKLLM (published)", ram, int(rkllm * 1e6), 0, None, host_layers,
                             "its benchmark's memory at seqlen 128 (docs/anchors.md A10)"))
        for plan, sides in (("serve host only", [HOST] * len(us)), ("serve NPU only", [NPU] * len(us)),
                            ("serve auto (both)", [auto_side(u) for u in us])):
            host, npu_, t = totals(us, sides)
            rows.append(_row(name, quant, plan, ram, fp.served(host, npu_), npu_, t, host_layers))
        for plan, window in (("serve budget", None), ("serve budget, one domain", NPU_DOMAIN_BYTES)):
            chosen = fastest_within(us, usable(ram), window, fp.served)
            if chosen is None:
                rows.append(_row(name, quant, plan, ram, fp.served(weight_bytes, 0), 0, None, host_layers,
                                 "not even host-only fits"))
                continue
            host, npu_, t = totals(us, chosen)
            gave = sum(s != BOTH for s in chosen)
            rows.append(_row(name, quant, plan, ram, fp.served(host, npu_), npu_, t, host_layers,
                             f"{sum(s == HOST for s in chosen)} weights host only, {sum(s == NPU for s in chosen)} "
                             f"NPU only, {len(chosen) - gave} both"))
    return rows


def resolve(name: str):
    """(the shape, the GGUF path or None): bench fit's own shapes, else what bench decode
    resolves the name to (its presets, a Hugging Face config, a GGUF)."""
    shape = SHAPES.get(name) or shapes.resolve(name)
    return shape, (name if name not in SHAPES and Path(name).is_file() and not shapes.is_config(name) else None)


def run(args, rig, console: Console) -> rp.Report | None:
    rams = [int(x) for x in args.ram.split(",") if x.strip()]
    if not rams or min(rams) < 1 or args.context < 1:
        raise ValueError(f"--ram takes GB sizes >= 1 and --context tokens >= 1, got {args.ram!r}, {args.context}")
    rows: list[dict] = []
    for name in args.model:
        shape, path = resolve(name)
        if path is not None:
            quant, weights = "as stored", plans.gguf_weights(Path(path))
        else:
            quant = args.quant or plans.DEFAULT_QUANT.get(shape.name, "Q4_K_M")
            weights = plans.preset_weights(shape, quant)
        rows += model_rows(shape.name, shape, quant, weights, rams, args)
    columns = [rp.Column(k, t) for k, t in (("model", "model"), ("quant", "quant"), ("ram_gb", "RAM GB"),
                                            ("plan", "plan"), ("fits", "fits"))] + [
        rp.Column("board_gib_modeled", "board GiB", "{:.2f}", figure=True),
        rp.Column("npu_gib_modeled", "NPU GiB", "{:.2f}", figure=True),
        rp.Column("prefill512_tok_s_modeled", "prefill 512 tok/s", "{:.0f}", figure=True),
        rp.Column("decode_tok_s_modeled", "decode tok/s", "{:.1f}", figure=True), rp.Column("note", "note")]
    table = rp.Table("Board memory by plan and RAM (modeled on the board)", columns, rows,
                     note=f"fits: board bytes within RAM less the reserve (MemTotal / 8, at least 512 MiB); KV cache "
                          f"{args.context} tokens f16; NPU weights {args.plan_weights} on {args.cores} core(s); serve "
                          "budget = the fastest per-weight host / NPU / both mix that fits (modeled; rknpu serve "
                          "--memory-budget applies the same rule to each plan's new weights). docs/memory.md")
    for r in rows:
        if r["plan"] in ("serve budget", "llama.cpp alone") and r["fits"] == "yes":
            console.print(f"{r['model']} {r['quant']} on {r['ram_gb']} GB: {r['plan']} fits, "
                          f"{r['board_gib_modeled']:.2f} GiB, NPU {r['npu_gib_modeled']:.2f} GiB, prefill "
                          f"{r['prefill512_tok_s_modeled']:.0f} tok/s (modeled) {r['note']}")
    return rp.Report("fit", "Which placements fit a board's RAM (modeled)", rig.to_dict(),
                     meta={"models": args.model, "ram_gb": rams, "context": args.context,
                           "plan_weights": args.plan_weights, "cores": args.cores, "mib": MIB},
                     tables=[table], raw={"rows": rows},
                     notes=["every byte and time modeled for the board (no board has run it); bytes of llama.cpp's "
                            "and the server's own processes are guesses measured on x86 (docs/memory.md)"])
