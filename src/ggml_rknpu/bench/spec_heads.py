"""Speculative heads in ``rknpu bench spec``: EAGLE-3 and MTP decode, *modeled* on the board.

A head reuses the target's hidden state: one decoder layer and an output head, so its pass
costs a fraction of a draft model's, while verifying n drafts (M = n + 1) costs nearly one
M = 1 step on the NPU. Decode = tau / (t_target(n + 1) + n * t_head(1) + t_head(n + 1)), tau
the acceptance length (tokens per target step); the last term is the head's pass over the
verified rows. Heads are priced on the NPU; the CPU is priced once the cost package has a CPU
model. tau comes from others' publications (``PUBLISHED``); the best draft length uses a chain
model with alpha = 1 - 1/tau, a lower bound (docs/speculative.md "Speculative heads").
"""

from __future__ import annotations

from dataclasses import dataclass

from ggml_rknpu.bench import report as rp
from ggml_rknpu.bench.spec_shapes import ModelShapes, dense_shapes, modeled_step_s

EAGLE3_DRAFT_VOCAB = 32000    # SpecForge's EAGLE-3 configs for Qwen targets [docs/speculative.md]
CPU_Q4_TOK_S = 28.3           # llama.cpp CPU-only, Gemma3-1B Q4_0, RK3588 4xA76 [docs/anchors.md A9]
GOAL_VS_RKLLM = 2.5
GOAL_VS_CPU = 1.5
DRAFT_NS = tuple(range(1, 9))
DEFAULT_N_DRAFT = 3           # llama.cpp's --spec-draft-n-max default (common.h, speculative.draft.n_max)


@dataclass(frozen=True)
class Published:
    """An acceptance length someone measured and published (never ours)."""

    head: str          # "eagle3" | "mtp"
    model: str
    tau: float         # tokens per target step, accepted drafts + 1
    conditions: str
    source: str


PUBLISHED = (
    Published("eagle3", "Qwen3-1.7B", 2.17, "vLLM, 1 GPU; mean of GSM8K, Alpaca, HumanEval, MT-bench (2.13-2.20)",
              "AngelSlim Eagle3 benchmarks [docs/speculative.md]"),
    Published("eagle3", "Qwen3-4B", 2.08, "vLLM, 1 GPU; mean of the same four (2.07-2.10)",
              "AngelSlim Eagle3 benchmarks [docs/speculative.md]"),
    Published("eagle3", "Llama-3.1-8B-Instruct", 2.77, "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, MT-bench, "
              "temperature 1, 7 draft tokens (chain); HumanEval 3.49, GSM8K 3.34",
              "nebius EAGLE3-Llama-3.3-70B model card [docs/speculative.md]"),
    Published("mtp", "Qwen3.5-397B-A17B", 3.28, "MTP head, SGLang, batch 1, MT-Bench; GSM8K 3.54, HumanEval 3.62",
              "AQ-MedAI Qwen3.5-397B-A17B-eagle3 model card [docs/speculative.md]"),
)


def eagle3_head(n_embd: int, n_ff: int, n_head: int, n_head_kv: int, head_dim: int, *, draft_vocab: int,
                name: str) -> ModelShapes:
    """EAGLE-3 as llama.cpp builds it (llama.cpp's models/eagle3.cpp): ``fc`` fuses 3 target layers
    (3h -> h), one layer whose q/k/v read [embedding; fused features] (2h wide), and an output
    head over the draft vocabulary (``d2t``)."""
    q, kv = n_head * head_dim, n_head_kv * head_dim
    weights = (((3 * n_embd, n_embd), 1), ((2 * n_embd, q), 1), ((2 * n_embd, kv), 2), ((q, n_embd), 1),
               ((n_embd, n_ff), 2), ((n_ff, n_embd), 1), ((n_embd, draft_vocab), 1))
    return ModelShapes(name, weights, "llama.cpp's eagle3 tensor shapes; n_ff as the target's and "
                                      f"draft vocab {draft_vocab} as in SpecForge's Qwen3 EAGLE-3 configs")


def mtp_head(n_embd: int, n_ff: int, n_head: int, n_head_kv: int, head_dim: int, *, vocab: int,
             name: str) -> ModelShapes:
    """An MTP (next-token) layer as llama.cpp builds it (llama.cpp's graph_mtp, e.g. models/qwen35.cpp):
    ``eh_proj`` (2h -> h) over [embedding; hidden], one decoder layer of the target's shape, and
    the target's full output head (shared)."""
    layer = dense_shapes(n_layer=1, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
                         head_dim=head_dim, vocab=vocab)
    return ModelShapes(name, (((2 * n_embd, n_embd), 1), *layer),
                       "llama.cpp graph_mtp (eh_proj, one target-shaped layer, the shared output head)")


def heads_for(preset: dict, target: str) -> dict[str, ModelShapes]:
    dims = {k: preset[k] for k in ("n_embd", "n_ff", "n_head", "n_head_kv", "head_dim")}
    return {"eagle3": eagle3_head(**dims, draft_vocab=EAGLE3_DRAFT_VOCAB, name=f"{target} EAGLE-3 head"),
            "mtp": mtp_head(**dims, vocab=preset["vocab"], name=f"{target} MTP layer")}


def step_s(target: ModelShapes, head: ModelShapes, n: int, *, dtype: str, cores: int) -> float:
    """Modeled seconds of one speculative step with ``n`` drafted tokens: the target's
    verification at M = n + 1, the head's n drafting passes at M = 1 and its pass over the
    verified rows at M = n + 1."""
    return (modeled_step_s(target, n + 1, dtype=dtype, cores=cores)
            + n * modeled_step_s(head, 1, dtype=dtype, cores=cores)
            + modeled_step_s(head, n + 1, dtype=dtype, cores=cores))


def chain_tau(alpha: float, n: int) -> float:
    """Tokens per step of a chain of n drafts, each accepted with probability alpha after its predecessors."""
    return float(n + 1) if alpha >= 1.0 else (1.0 - alpha ** (n + 1)) / (1.0 - alpha)


def alpha_from_tau(tau: float) -> float:
    """The smallest per-draft acceptance that reaches ``tau`` (with an unbounded chain)."""
    return 1.0 - 1.0 / tau


def step_rows(target: ModelShapes, heads: dict[str, ModelShapes], *, dtype: str, cores: int) -> list[dict]:
    rows = []
    for kind, head in heads.items():
        t1 = modeled_step_s(head, 1, dtype=dtype, cores=cores)
        for n in DRAFT_NS:
            verify = modeled_step_s(target, n + 1, dtype=dtype, cores=cores)
            total = step_s(target, head, n, dtype=dtype, cores=cores)
            rows.append({"head": kind, "n_draft": n, "M": n + 1, "verify_ms_modeled": verify * 1e3,
                         "head_pass_ms_modeled": t1 * 1e3, "step_ms_modeled": total * 1e3,
                         "ceiling_tok_s_modeled": (n + 1) / total})
    return rows


def published_rows(target: ModelShapes, heads: dict[str, ModelShapes], *, dtype: str, cores: int,
                   rkllm: float | None) -> list[dict]:
    """For every published tau: the best draft length under the chain model, its modeled decode,
    and the tau the goals (2.5x RKLLM, 1.5x the CPU) would need at that length."""
    rows = []
    for pub in PUBLISHED:
        head = heads[pub.head]
        alpha = alpha_from_tau(pub.tau)
        options = [(chain_tau(alpha, n) / step_s(target, head, n, dtype=dtype, cores=cores), n) for n in DRAFT_NS]
        tok_s, best = max(options)
        cost = step_s(target, head, best, dtype=dtype, cores=cores)
        goals = [g for g in (GOAL_VS_RKLLM * rkllm if rkllm else None, GOAL_VS_CPU * CPU_Q4_TOK_S) if g]
        at_default = pub.tau / step_s(target, head, DEFAULT_N_DRAFT, dtype=dtype, cores=cores)
        rows.append({"head": pub.head, "model": pub.model, "tau_published_measured": pub.tau,
                     "tok_s_at_default_n_modeled": at_default,
                     "alpha_modeled": alpha, "best_n_draft": best, "tau_at_best_modeled": chain_tau(alpha, best),
                     "tok_s_modeled": tok_s, "vs_rkllm_modeled": tok_s / rkllm if rkllm else None,
                     "vs_cpu_q4_modeled": tok_s / CPU_Q4_TOK_S,
                     "tau_needed_for_goals_modeled": max(goals) * cost,
                     "conditions": pub.conditions, "source": pub.source})
    return rows


def needed_rows(target: ModelShapes, heads: dict[str, ModelShapes], *, dtype: str, cores: int,
                rkllm: float | None) -> list[dict]:
    """The acceptance length each goal needs, at the draft length where it is smallest (tau <= n + 1)."""
    goals = {"2.5x RKLLM": GOAL_VS_RKLLM * rkllm if rkllm else None, "1.5x CPU Q4_0": GOAL_VS_CPU * CPU_Q4_TOK_S}
    rows = []
    for kind, head in heads.items():
        for goal, tok_s in goals.items():
            if tok_s is None:
                continue
            feasible = [(tok_s * step_s(target, head, n, dtype=dtype, cores=cores), n) for n in DRAFT_NS]
            feasible = [(tau, n) for tau, n in feasible if tau <= n + 1]
            tau, n = min(feasible) if feasible else (None, None)
            rows.append({"head": kind, "goal": goal, "goal_tok_s": tok_s, "tau_needed_modeled": tau, "n_draft": n,
                         "alpha_needed_modeled": _alpha_for(tau, n) if tau is not None and n is not None else None})
    return rows


def _alpha_for(tau: float, n: int) -> float:
    """Per-draft acceptance whose chain of n drafts averages ``tau`` tokens per step (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chain_tau(mid, n) < tau else (lo, mid)
    return (lo + hi) / 2


def tau_curve(target: ModelShapes, head: ModelShapes, n: int, *, dtype: str, cores: int) -> tuple[list, list]:
    """Modeled tok/s against tau (1 .. n + 1) at draft length n: the plot's line for that n."""
    cost = step_s(target, head, n, dtype=dtype, cores=cores)
    taus = [1.0 + 0.25 * i for i in range(4 * n + 1)]
    return taus, [t / cost for t in taus]


def report_parts(target: ModelShapes, dims: dict, *, dtype: str, cores: int,
                 rkllm: float | None) -> tuple[list[rp.Table], rp.Plot, dict, list[str]]:
    """The heads' tables, plot, raw rows and notes for ``rknpu bench spec``."""
    heads = heads_for(dims, target.name)
    steps = step_rows(target, heads, dtype=dtype, cores=cores)
    published = published_rows(target, heads, dtype=dtype, cores=cores, rkllm=rkllm)
    needed = needed_rows(target, heads, dtype=dtype, cores=cores, rkllm=rkllm)
    rk = f"x RKLLM {rkllm}" if rkllm else "x RKLLM"
    tables = [
        rp.Table(f"{target.name} {dtype}, {cores} cores: one step with a head drafting n tokens", [
            rp.Column("head", "head"), rp.Column("n_draft", "n drafted"), rp.Column("M", "verify M"),
            rp.Column("verify_ms_modeled", "target verify ms", "{:.1f}", figure=True),
            rp.Column("head_pass_ms_modeled", "head pass ms (M=1)", "{:.2f}", figure=True),
            rp.Column("step_ms_modeled", "step ms", "{:.1f}", figure=True),
            rp.Column("ceiling_tok_s_modeled", "tok/s if all accepted", "{:.1f}", figure=True),
        ], steps, note="step = verify at M = n + 1 + n head passes at M = 1 + one head pass over the verified "
                       "rows; every matmul on the NPU; host ops, RPC, pack/unpack not included; "
                       + "; ".join(f"{h.name}: {h.n_weights} weights, {h.source}" for h in heads.values())),
        rp.Table(f"{target.name}: decode at published acceptance lengths (chain model, best n)", [
            rp.Column("head", "head"), rp.Column("model", "published for"),
            rp.Column("tau_published_measured", "tau", "{:.2f}", figure=True),
            rp.Column("tok_s_at_default_n_modeled", f"tok/s at tau, n={DEFAULT_N_DRAFT}", "{:.1f}", figure=True),
            rp.Column("alpha_modeled", "alpha >=", "{:.3f}", figure=True),
            rp.Column("best_n_draft", "best --spec-draft-n-max"),
            rp.Column("tau_at_best_modeled", "tau at best n", "{:.2f}", figure=True),
            rp.Column("tok_s_modeled", "tok/s", "{:.1f}", figure=True),
            rp.Column("vs_rkllm_modeled", rk, "{:.2f}", figure=True),
            rp.Column("vs_cpu_q4_modeled", f"x CPU Q4_0 {CPU_Q4_TOK_S}", "{:.2f}", figure=True),
            rp.Column("tau_needed_for_goals_modeled", "tau for both goals at that n", "{:.2f}", figure=True),
            rp.Column("source", "source"),
        ], published, note="tau published by others on GPUs (conditions in the raw rows and docs/speculative.md), "
                           "applied to this target: an assumption; alpha = 1 - 1/tau, the smallest per-draft "
                           "acceptance with that tau (a lower bound on the gain)"),
        rp.Table(f"{target.name}: acceptance length the goals need", [
            rp.Column("head", "head"), rp.Column("goal", "goal"), rp.Column("goal_tok_s", "tok/s", "{:.1f}"),
            rp.Column("tau_needed_modeled", "tau needed", "{:.2f}", figure=True),
            rp.Column("n_draft", "at n"), rp.Column("alpha_needed_modeled", "alpha needed", "{:.3f}", figure=True),
        ], needed, note=f"goals: {GOAL_VS_RKLLM}x RKLLM w8a8 on this model, {GOAL_VS_CPU}x llama.cpp CPU-only "
                        f"Q4_0 ({CPU_Q4_TOK_S} tok/s, Gemma3-1B on RK3588, docs/anchors.md A9)"),
    ]
    series = []
    for kind, ns in (("eagle3", (1, 3, 5, 7)), ("mtp", (DEFAULT_N_DRAFT,))):
        for n in ns:
            xs, ys = tau_curve(target, heads[kind], n, dtype=dtype, cores=cores)
            series.append(rp.Series(f"{kind}, n={n} (modeled)", xs, ys))
    top = float(max(DRAFT_NS) + 1)
    if rkllm:
        series.append(rp.Series(f"RKLLM {rkllm} tok/s (measured, published)", [1.0, top], [rkllm, rkllm]))
        series.append(rp.Series(f"goal {GOAL_VS_RKLLM}x RKLLM (from measured)", [1.0, top],
                                [GOAL_VS_RKLLM * rkllm] * 2))
    series.append(rp.Series(f"CPU Q4_0 {CPU_Q4_TOK_S} tok/s (measured, published)", [1.0, top], [CPU_Q4_TOK_S] * 2))
    for row in published:   # on its head's n = 3 line
        series.append(rp.Series(f"{row['head']} {row['model']}: published tau {row['tau_published_measured']} "
                                "(measured)", [row["tau_published_measured"]], [row["tok_s_at_default_n_modeled"]]))
    plot = rp.Plot("tok_s_vs_tau.png", f"{target.name} {dtype} with a head: tokens/s vs acceptance length",
                   "tau: tokens per target step", "tokens/s (modeled)", series)
    notes = ["heads priced on the NPU; placing the head on the board's CPU (an M = 1 job) is priced once the CPU "
             "cost model lands in the cost package; the CPU-only figure here is llama.cpp's published Q4_0 decode, not a model"]
    return tables, plot, {"head_steps": steps, "head_published": published, "head_needed": needed}, notes
