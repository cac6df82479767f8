"""Whole-model forward-pass times under three placements, all *modeled* on the board: ``cpu``
(llama.cpp alone: every matmul in ggml-cpu, repacked where it repacks), ``npu`` (every
weight matmul on the NPU), ``auto`` (each weight where ``cost.placement`` puts it, no
split, host weights from repacked copies: what ``rknpu serve --placement auto`` does) and
``auto-split`` (splits allowed: ``--placement-split``, opt-in, its gain modeled only).

Invariants: host ops cost the same in every plan (``cost.host_ops``, by rows and the cache's
fill level); a prompt runs in ubatches of ``UBATCH`` rows and computes the output head for its
last row only (llama.cpp's defaults); the weight types of a preset follow llama.cpp's
quantizer (``QUANT_MIXES``), a GGUF's are read from it. Figures: docs/placement.md."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ggml_rknpu.cost import cpu
from ggml_rknpu.cost import host_ops as ho
from ggml_rknpu.cost import placement as pl
from ggml_rknpu.cost.model import VENDOR_NPU_MHZ
from ggml_rknpu.cost.residency import JOB_ANSWER, JOB_PROMPT


class ModelShape(Protocol):
    """What a plan needs of a model's shape (``bench.decode.ModelShape``; read-only, as its
    frozen dataclasses have it)."""

    @property
    def name(self) -> str: ...
    @property
    def hidden(self) -> int: ...
    @property
    def layers(self) -> int: ...
    @property
    def vocab(self) -> int: ...

    def matmuls_at(self, i: int) -> dict[str, tuple[int, int, int, int]]: ...

    def host_layers(self) -> tuple[ho.LayerOps, ...]: ...


PLANS = ("cpu", "npu", "auto", "auto-split")
UBATCH = 512   # llama.cpp's default n_ubatch: a longer prompt runs as passes of this many rows
DECODE_PAST = JOB_PROMPT + JOB_ANSWER // 2   # the cache's mean fill over a job's decode passes


@dataclass(frozen=True)
class Weight:
    """One weight matmul of a model: [N, K] of ``type``, ``count`` times per pass; a
    MUL_MAT_ID holds ``experts`` such slices, each row multiplying ``used`` of them."""

    name: str
    K: int
    N: int
    type: str
    count: int
    experts: int = 1
    used: int = 1

    def rows_and_experts(self, M: int) -> tuple[int, int]:
        """(rows multiplied, distinct experts read) for M rows: every expert once for a
        MUL_MAT; for a MUL_MAT_ID, M x used rows over the expected distinct experts of
        uniform routing (GUESS: E (1 - (1 - used/E)^M))."""
        if self.experts == 1:
            return M, 1
        distinct = self.experts * (1 - (1 - self.used / self.experts) ** M)
        return M * self.used, max(self.used, min(self.experts, round(distinct)))


def _more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp's use_more_bits(i_layer, n_layers) (the pinned llama.cpp)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}   # llama-quant.cpp tensor_type_fallback


def _fits(t: str, K: int) -> str:
    """A row length the type's block does not divide falls back as llama-quant.cpp does."""
    return _FALLBACK.get(t, t) if K % GGML_QUANT_SIZES[GGMLQuantizationType[t]][0] else t


def _quant_type(ftype: str, name: str, K: int, layer: int, layers: int) -> str:
    """The type llama.cpp's quantizer gives a tensor of a model quantized as ``ftype``
    (llama_tensor_get_type in llama-quant.cpp: the output head Q6_K unless the model is
    Q8_0/F16; Q4_K_M/Q5_K_M: attn_v and ffn_down Q6_K in the use_more_bits layers, attn_v
    counted over the attention layers, a delta-net layer's qkv among them; the MoE router stays F32)."""
    base = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}.get(ftype, ftype)
    if name == "router":
        return "F32"
    if name == "output":
        return _fits(ftype if ftype in ("Q8_0", "F16") else "Q6_K", K)
    if ftype in ("Q4_K_M", "Q5_K_M") and name in ("v", "qkv", "down", "down_exps") and _more_bits(layer, layers):
        return _fits("Q6_K", K)
    return _fits(base, K)


QUANT_MIXES = ("F16", "Q8_0", "Q6_K", "Q4_0", "Q4_K_M", "Q5_K_M")


def preset_weights(model: ModelShape, ftype: str) -> list[Weight]:
    """The weight matmuls of ``model`` quantized as ``ftype`` (grouped by type per name)."""
    if ftype not in QUANT_MIXES:
        raise ValueError(f"quantization mix must be one of {QUANT_MIXES}, got {ftype!r}")
    per_layer = [model.matmuls_at(i) for i in range(model.layers)]
    attention = [i for i, mm in enumerate(per_layer) if "v" in mm or "qkv" in mm]   # llama-quant's attn_v-like
    counts: dict[tuple[str, int, int, str, int, int], int] = {}
    for i, matmuls in enumerate(per_layer):
        for name, (K, N, experts, used) in matmuls.items():
            at, of = (attention.index(i), len(attention)) if name in ("v", "qkv") else (i, model.layers)
            key = (name, K, N, _quant_type(ftype, name, K, at, of), experts, used)
            counts[key] = counts.get(key, 0) + 1
    counts[("output", model.hidden, model.vocab, _quant_type(ftype, "output", model.hidden, 0, 1), 1, 1)] = 1
    return [Weight(n, K, N, t, c, e, u) for (n, K, N, t, e, u), c in counts.items()]


def gguf_weights(path: Path) -> list[Weight]:
    """The weight matmuls of a llama/qwen-style GGUF (and Qwen3.5's delta-net projections)
    with their types as stored (the output head is the tied embedding when the file has no
    output.weight)."""
    from gguf import GGUFReader

    names = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
             "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down", "attn_qkv": "qkv", "attn_gate": "z",
             "ssm_beta": "beta", "ssm_alpha": "alpha", "ssm_out": "ssm_out"}
    reader = GGUFReader(str(path))
    by_name = {t.name: t for t in reader.tensors}
    counts: dict[tuple[str, int, int, str], int] = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in names and parts[3] == "weight":
            key = (names[parts[2]], int(t.shape[0]), int(t.shape[1]), t.tensor_type.name)
            counts[key] = counts.get(key, 0) + 1
    head = by_name.get("output.weight", by_name.get("token_embd.weight"))
    if not counts or head is None:
        raise ValueError(f"{path}: not a llama/qwen-style GGUF")
    counts[("output", int(head.shape[0]), int(head.shape[1]), head.tensor_type.name)] = 1
    return [Weight(n, K, N, t, c) for (n, K, N, t), c in counts.items()]


@dataclass(frozen=True)
class Placed:
    """One weight's modeled seconds per pass in a plan, and where it ran."""

    weight: Weight
    where: str
    seconds: float


def place(weights: list[Weight], plan: str, M: int, *, npu_dtype: str, cores: int,
          threads: int = cpu.BIG_CORES, board: cpu.CpuBoard = cpu.RK3588,
          npu_mhz: float = VENDOR_NPU_MHZ) -> list[Placed]:
    """Each weight's placement and modeled seconds (one matmul of M rows) under ``plan``;
    ``board``: the CPU and llama.cpp build the cpu plan runs on; ``npu_mhz``: the NPU clock."""
    out = []
    for w in weights:
        rows, experts = w.rows_and_experts(M)
        if plan == "cpu":
            out.append(Placed(w, pl.HOST, cpu.cpu_matmul_seconds(w.type, rows, w.K, w.N, threads=threads,
                                                                 experts=experts, board=board)))
            continue
        c = pl.place_matmul(w.type, rows, w.K, w.N, npu_dtype=npu_dtype, cores=cores, threads=threads,
                            allow_split=plan == "auto-split" and experts == 1, repacked=experts == 1,
                            experts=experts, npu_mhz=npu_mhz)
        if plan == "npu":
            out.append(Placed(w, pl.NPU, c.npu_s))
        elif plan in ("auto", "auto-split"):
            out.append(Placed(w, c.where, c.seconds))
        else:
            raise ValueError(f"plan must be one of {PLANS}, got {plan!r}")
    return out


def pass_seconds(weights: list[Weight], host: tuple[ho.LayerOps, ...], plan: str, M: int, *, npu_dtype: str,
                 cores: int, threads: int = cpu.BIG_CORES, head_rows: int | None = None, past: int = 0,
                 board: cpu.CpuBoard = cpu.RK3588, npu_mhz: float = VENDOR_NPU_MHZ) -> float:
    """Modeled seconds of one forward pass of M rows after ``past`` cached positions: every
    weight matmul (the head at ``head_rows`` rows: default M, 0 none) plus the host ops of
    the layers ``host`` (``cost.host_ops``)."""
    body = [w for w in weights if w.name != "output"]
    head = [w for w in weights if w.name == "output"]
    kw: dict = dict(npu_dtype=npu_dtype, cores=cores, threads=threads, board=board, npu_mhz=npu_mhz)
    t = sum(p.seconds * p.weight.count for p in place(body, plan, M, **kw))
    if head_rows != 0:
        t += sum(p.seconds for p in place(head, plan, head_rows or M, **kw))
    return t + ho.host_ops_seconds(host, M, past, threads=threads, board=board)


def decode_tok_s(weights: list[Weight], host: tuple[ho.LayerOps, ...], plan: str, M: int, **kw) -> float:
    """Tokens/s of M sequences decoding one token per pass (``past``: the cache's fill)."""
    return M / pass_seconds(weights, host, plan, M, **kw)


def prompt_seconds(weights: list[Weight], host: tuple[ho.LayerOps, ...], plan: str, prompt: int, **kw) -> float:
    """Modeled seconds of one prompt of ``prompt`` tokens from an empty cache: passes of
    ``UBATCH`` rows, each after the ones before, the head for the last row only."""
    if prompt < 1:
        raise ValueError(f"a prompt needs at least one token, got {prompt}")
    starts = range(0, prompt, UBATCH)
    return sum(pass_seconds(weights, host, plan, min(UBATCH, prompt - s), past=s,
                            head_rows=1 if s == starts[-1] else 0, **kw) for s in starts)


def prefill_tok_s(weights: list[Weight], host: tuple[ho.LayerOps, ...], plan: str, prompt: int, **kw) -> float:
    """Tokens/s of one prompt of ``prompt`` tokens (``prompt_seconds``)."""
    return prompt / prompt_seconds(weights, host, plan, prompt, **kw)


def job_seconds(weights: list[Weight], host: tuple[ho.LayerOps, ...], plan: str, **kw) -> float:
    """A whole job: a ``JOB_PROMPT``-token prompt, then ``JOB_ANSWER`` decode passes of one
    row, priced at their mean fill level."""
    return (prompt_seconds(weights, host, plan, JOB_PROMPT, **kw)
            + JOB_ANSWER / decode_tok_s(weights, host, plan, 1, past=DECODE_PAST, **kw))


# The quantization mix a preset is priced in when none is given: the mixes the goals name
# (docs/placement.md); a preset not listed is Q4_K_M.
DEFAULT_QUANT = {"Gemma3-1B": "Q4_0", "Qwen2.5-1.5B": "Q4_K_M", "Qwen3-0.6B": "Q8_0", "Llama-3.2-1B": "Q4_K_M"}
PLAN_MS = (1, 4, 16)
PLAN_PROMPTS = (128, 512)


def plan_rows(model: str, quant: str, weights: list[Weight], host: tuple[ho.LayerOps, ...], envelope: str,
              cores: int, npu_dtype: str, published: dict[str, float],
              npu_mhz: float = VENDOR_NPU_MHZ) -> list[dict]:
    """One row per plan: decode tok/s at ``PLAN_MS`` (at the job's mean fill,
    ``DECODE_PAST``), prefill tok/s at ``PLAN_PROMPTS``, the whole job, each against the cpu
    plan; ``published``: the board's llama-bench figures for this model and mix
    (``pp512``/``tg128``), shown beside the cpu plan; the NPU at ``npu_mhz``."""
    kw: dict = dict(npu_dtype=npu_dtype, cores=cores, npu_mhz=npu_mhz)
    rows = []
    for plan in PLANS:
        row: dict = {"model": model, "quant": quant, "envelope": f"{envelope}, {cores} core(s)", "plan": plan,
                     "npu_weights": npu_dtype}
        for m in PLAN_MS:
            row[f"decode_m{m}_tok_s_modeled"] = decode_tok_s(weights, host, plan, m, past=DECODE_PAST, **kw)
        for n in PLAN_PROMPTS:
            row[f"prefill{n}_tok_s_modeled"] = prefill_tok_s(weights, host, plan, n, **kw)
        row["job_s_modeled"] = job_seconds(weights, host, plan, **kw)
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["decode_m1_vs_cpu_modeled"] = row["decode_m1_tok_s_modeled"] / base["decode_m1_tok_s_modeled"]
        row["prefill512_vs_cpu_modeled"] = row["prefill512_tok_s_modeled"] / base["prefill512_tok_s_modeled"]
        row["job_vs_cpu_modeled"] = row["job_s_modeled"] / base["job_s_modeled"]
        row["published"] = (" / ".join(f"{k} {v:g}" for k, v in sorted(published.items()))
                            if row["plan"] == "cpu" and published else "")
    return rows
