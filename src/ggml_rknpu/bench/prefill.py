"""Prefill forecast: time to first token and prompt tokens/s at 128 to 8192 prompt tokens,
*modeled* on the board, for the presets and any config or GGUF, under the plans cpu
(llama.cpp alone), npu, auto (``rknpu serve --placement auto``) and auto with attention's
matmuls on the NPU (``rknpu serve --npu-attention auto``, staging K and V included).

Invariants: every host op is priced (``cost.host_ops``: element-wise work by rows, attention
by rows, context, heads and head dim); a prompt runs in ubatches of 512 rows, each after the
ones before (``plans.prompt_seconds``); published figures stand beside the rows, never fitted
(docs/anchors.md §6.3). Figures and the goals' arithmetic: docs/decode.md "Prefill"."""

from __future__ import annotations

import argparse

from rich.console import Console

from ggml_rknpu.bench import plans
from ggml_rknpu.bench import report as rp
from ggml_rknpu.bench.decode import model_weights, named_envelope, named_models
from ggml_rknpu.bench.rig import npu_clock
from ggml_rknpu.bench.shapes import ModelShape
from ggml_rknpu.cost import host_ops as ho
from ggml_rknpu.cost.model import VENDOR_NPU_MHZ
from ggml_rknpu.cost.npu_attention import npu_attention_seconds

PROMPTS = (128, 512, 2048, 4096, 8192)
MODELS = ("Qwen3-1.7B", "Qwen2.5-1.5B", "Gemma3-1B", "Qwen3-0.6B")
QUANT = "Q4_K_M"
ATTN_NPU = "auto, attention on NPU"
PLAN_NAMES = ("cpu", "npu", "auto", ATTN_NPU)
GOAL = 5.0          # TTFT at most 1/5 of the cpu plan's [the goal, docs/decode.md "Prefill"]
GOAL_PROMPTS = (512, 4096)
ENVELOPES = ("laddered", "proven")
# Published prompt figures on the board (docs/anchors.md §6.3): (model, prompt) -> (TTFT s, by)
PUBLISHED = {
    ("Qwen3-0.6B", 128): (0.1991, "RKLLM w8a8 v1.3.0"),
    ("Qwen2.5-1.5B", 128): (0.3783, "RKLLM w8a8 v1.3.0"),
    **{("Qwen3-0.6B", n): (n / rate, "qwen3.c fp16, attention on the CPU")
       for n, rate in ((1024, 241.1), (2048, 163.8), (4096, 90.1))},
}


def attention_split(host: tuple[ho.LayerOps, ...], prompt: int, cores: int,
                    npu_mhz: float = VENDOR_NPU_MHZ) -> tuple[float, float]:
    """(host seconds, best-of-host-and-NPU seconds) of a prompt's attention over its ubatches:
    each layer's attention where it is faster (``cost.npu_attention`` against ``cost.host_ops``)."""
    on_host = best = 0.0
    for start in range(0, prompt, plans.UBATCH):
        rows = min(plans.UBATCH, prompt - start)
        for layer in host:
            h = ho.attention_time(layer, rows, start).total_s
            on_host += h
            best += min(h, npu_attention_seconds(layer, rows, start, cores=cores, npu_mhz=npu_mhz))
    return on_host, best


def prompt_rows(model: ModelShape, quant: str, weights: list[plans.Weight], envelope: str, cores: int,
                npu_dtype: str, prompts: tuple[int, ...], npu_mhz: float = VENDOR_NPU_MHZ) -> list[dict]:
    """One row per plan and prompt length: TTFT, tok/s, attention's share, against cpu; the
    NPU at ``npu_mhz``."""
    host = model.host_layers()
    kw: dict = dict(npu_dtype=npu_dtype, cores=cores, npu_mhz=npu_mhz)
    rows: list[dict] = []
    for n in prompts:
        attn_host, attn_best = attention_split(host, n, cores, npu_mhz)
        ttft = {p: plans.prompt_seconds(weights, host, p, n, **kw) for p in ("cpu", "npu", "auto")}
        ttft[ATTN_NPU] = ttft["auto"] - attn_host + attn_best
        for plan in PLAN_NAMES:
            attn = attn_best if plan == ATTN_NPU else attn_host
            published = PUBLISHED.get((model.name, n)) if plan == "npu" else None
            rows.append({"model": model.name, "quant": quant, "envelope": f"{envelope}, {cores} core(s)",
                         "plan": plan, "prompt": n, "ttft_s_modeled": ttft[plan],
                         "prefill_tok_s_modeled": n / ttft[plan], "attention_share_modeled": attn / ttft[plan],
                         "ttft_vs_cpu_modeled": ttft["cpu"] / ttft[plan],
                         "published": f"{published[0] * 1e3:.0f} ms ({published[1]})" if published else ""})
    return rows


def goal_rows(rows: list[dict]) -> list[dict]:
    """The goals: TTFT at 512 and 4096 tokens at most 1/5 of the cpu plan's, auto (512) and
    auto with attention on the NPU (4096), and what bounds it when out of reach."""
    out = []
    for (model, envelope) in dict.fromkeys((r["model"], r["envelope"]) for r in rows):
        at = {(r["plan"], r["prompt"]): r for r in rows if (r["model"], r["envelope"]) == (model, envelope)}
        for n, plan in ((512, "auto"), (4096, "auto"), (4096, ATTN_NPU)):
            if (plan, n) not in at:
                continue
            r, cpu_row = at[(plan, n)], at[("cpu", n)]
            out.append({"model": model, "envelope": envelope, "prompt": n, "plan": plan,
                        "cpu_ttft_s_modeled": cpu_row["ttft_s_modeled"], "ttft_s_modeled": r["ttft_s_modeled"],
                        "goal_ttft_s_modeled": cpu_row["ttft_s_modeled"] / GOAL,
                        "ttft_vs_cpu_modeled": r["ttft_vs_cpu_modeled"],
                        "goal": "met" if r["ttft_vs_cpu_modeled"] >= GOAL else "not met"})
    return out


def add_arguments(p: argparse.ArgumentParser, common) -> None:
    common(p, "bench-out/prefill")
    p.add_argument("model", nargs="*", default=[],
                   help=f"presets, Hugging Face config.json files (or directories holding one) and/or GGUF files; "
                        f"default: {', '.join(MODELS)}")
    p.add_argument("--quant", default=QUANT, choices=plans.QUANT_MIXES,
                   help=f"quantization mix of presets and configs (default {QUANT}); a GGUF's types are read from it")
    p.add_argument("--prompts", default=",".join(map(str, PROMPTS)),
                   help=f"prompt lengths in tokens (default {','.join(map(str, PROMPTS))})")
    p.add_argument("--plan-weights", default="int8", choices=("int8", "fp16"),
                   help="NPU weight format of the npu/auto plans (default int8)")


def run(args, rig, console: Console) -> rp.Report:
    try:
        prompts = tuple(int(x) for x in args.prompts.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--prompts takes comma-separated token counts, got {args.prompts!r}") from None
    if not prompts or min(prompts) < 1:
        raise ValueError(f"--prompts takes positive token counts, got {args.prompts!r}")
    names = args.model or list(MODELS)
    models = named_models(names)
    clock = npu_clock(rig)
    rows: list[dict] = []
    with rp.progress(console, "prefill", len(models) * len(ENVELOPES)) as advance:
        for arg, model in zip(names, models):
            quant, weights = model_weights(arg, model, args.quant)
            for envelope in ENVELOPES:
                rows += prompt_rows(model, quant, weights, envelope, named_envelope(envelope).max_cores,
                                    args.plan_weights, prompts, clock.mhz)
                advance()
    columns = [rp.Column(k, k) for k in ("model", "quant", "envelope", "plan", "prompt")] + [
        rp.Column("ttft_s_modeled", "TTFT s", "{:.3f}", figure=True),
        rp.Column("prefill_tok_s_modeled", "prefill tok/s", "{:.1f}", figure=True),
        rp.Column("attention_share_modeled", "attention share", "{:.0%}", figure=True),
        rp.Column("ttft_vs_cpu_modeled", "cpu TTFT / this", "{:.2f}", figure=True),
        rp.Column("published", "published (board)")]
    note = (f"All modeled on the board (NPU {args.plan_weights} weights at {clock}, DRAM 2112 MHz; cost.cpu and "
            "cost.host_ops for the A76s, every host op priced: element-wise work by rows, flash attention by rows, "
            "context, heads and head dim). cpu = llama.cpp alone; npu = every weight matmul on the NPU; auto = "
            f"rknpu serve --placement auto; '{ATTN_NPU}' = auto with each layer's attention matmuls on the NPU "
            "where that is faster (rknpu serve --npu-attention auto; staging K and V priced). Prompts run "
            f"in ubatches of {plans.UBATCH}; the head for the last row only. Published figures: other engines "
            "on boards (docs/anchors.md §6.3), not fitted.")
    table = rp.Table("Prefill: time to first token by prompt length (modeled on the board)", columns, rows, note)
    goals = goal_rows(rows)
    goal_table = rp.Table(f"Goals: TTFT at most 1/{GOAL:g} of the cpu plan's (modeled)", [
        rp.Column("model", "model"), rp.Column("envelope", "envelope"), rp.Column("prompt", "prompt"),
        rp.Column("plan", "plan"), rp.Column("cpu_ttft_s_modeled", "cpu TTFT s", "{:.2f}", figure=True),
        rp.Column("goal_ttft_s_modeled", "goal TTFT s", "{:.2f}", figure=True),
        rp.Column("ttft_s_modeled", "TTFT s", "{:.2f}", figure=True),
        rp.Column("ttft_vs_cpu_modeled", "cpu / this", "{:.2f}", figure=True), rp.Column("goal", "goal")], goals,
        note="the arithmetic of the goals out of reach: docs/decode.md \"Prefill\"")
    plot_rows = [dict(r, series=f"{r['model']} {r['plan']} ({r['envelope']})") for r in rows
                 if r["envelope"].startswith("laddered")]
    plot = rp.Plot("prefill_ttft_s.png", "Time to first token by prompt length (laddered envelope)",
                   "prompt tokens", "TTFT s", rp.series_by(plot_rows, "series", "prompt", "ttft_s_modeled", "{0} {1}"),
                   log_x=True, log_y=True)
    meta = {"prompts": list(prompts), "npu_weights": args.plan_weights, "npu_clock": str(clock), "ubatch": plans.UBATCH,
            "envelopes": {e: f"{named_envelope(e).name}, at most {named_envelope(e).max_cores} core(s)" for e in ENVELOPES},
            "models": {m.name: m.source for m in models}}
    return rp.Report("prefill", "Prefill forecast (modeled on the board)", rig.to_dict(), meta=meta,
                     tables=[table, goal_table], plots=[plot], raw={"rows": rows, "goals": goals},
                     notes=[f"'{ATTN_NPU}' is a modeled figure of rknpu serve --npu-attention auto"])
