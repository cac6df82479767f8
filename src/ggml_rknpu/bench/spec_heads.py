"""Speculative heads in ``rknpu bench spec``: EAGLE-3 and MTP decode, *modeled* on the board
under the placement plans of ``bench.plans``.

One round with n drafts = the target's verification at M = n + 1, the head's n drafting passes
at M = 1 and its pass over the verified rows; decode = tau / round, tau the published acceptance
length (``PUBLISHED``). Each pass is priced by ``plans.pass_seconds`` (weight matmuls plus host
ops) under ``npu``, ``cpu`` (llama.cpp alone), ``auto`` (``cost.placement``'s argmin, as
``rknpu serve --placement auto``) and ``auto-split`` (modeled only). The best draft length
uses a chain model with alpha = 1 - 1/tau, a lower bound (docs/speculative.md "Speculative
heads").
"""

from __future__ import annotations

from dataclasses import dataclass

from ggml_rknpu.bench import plans
from ggml_rknpu.bench import report as rp
from ggml_rknpu.bench.decode import ModelShape
from ggml_rknpu.cost import cpu
from ggml_rknpu.cost.host_ops import LayerOps

EAGLE3_DRAFT_VOCAB = 32000    # SpecForge's EAGLE-3 configs for Qwen targets [docs/speculative.md]
CPU_Q4_TOK_S = 28.3           # llama.cpp CPU-only, Gemma3-1B Q4_0, RK3588 4xA76 [docs/anchors.md A9]
GOAL_VS_RKLLM = 2.5
GOAL_VS_CPU = 1.5
GOAL_CPU_QUANT = "Q4_0"       # the goal's CPU-only baseline: llama.cpp at Q4_0 on the same target
DRAFT_NS = tuple(range(1, 9))
DEFAULT_N_DRAFT = 3           # llama.cpp's --spec-draft-n-max default (common.h, speculative.draft.n_max)
SPEC_PLANS = ("npu", "cpu", "auto", "auto-split")
RUNNABLE = ("npu", "cpu", "auto")   # what a user can run today (splits are opt-in, their gain modeled only)
PLAIN = "cpu, no speculation"   # the baseline: llama.cpp alone decoding one token per pass


@dataclass(frozen=True)
class Published:
    """An acceptance length someone measured and published (never ours)."""

    head: str          # "eagle3" | "mtp"
    model: str
    tau: float         # tokens per target pass (one per round), accepted drafts + 1
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


@dataclass(frozen=True)
class HeadShape:
    """A head's weight matmuls in ``plans.ModelShape``'s form (one layer, its own output head)."""

    name: str
    hidden: int
    vocab: int
    matmuls: tuple[tuple[str, tuple[int, int]], ...]
    source: str
    host: tuple[LayerOps, ...]          # its one layer's host ops (``cost.host_ops``)
    layers: int = 1

    def matmuls_at(self, i: int) -> dict[str, tuple[int, int, int, int]]:
        return {name: (K, N, 1, 1) for name, (K, N) in self.matmuls}

    def host_layers(self) -> tuple[LayerOps, ...]:
        return self.host


def eagle3_head(n_embd: int, n_ff: int, n_head: int, n_head_kv: int, head_dim: int, *, draft_vocab: int,
                name: str) -> HeadShape:
    """EAGLE-3 as llama.cpp builds it (llama.cpp's models/eagle3.cpp): ``fc`` fuses 3 target layers
    (3h -> h), one layer whose q/k/v read [embedding; fused features] (2h wide), and an output
    head over the draft vocabulary (``d2t``)."""
    q, kv = n_head * head_dim, n_head_kv * head_dim
    return HeadShape(name, n_embd, draft_vocab, (
        ("fc", (3 * n_embd, n_embd)), ("q", (2 * n_embd, q)), ("k", (2 * n_embd, kv)), ("v", (2 * n_embd, kv)),
        ("o", (q, n_embd)), ("gate", (n_embd, n_ff)), ("up", (n_embd, n_ff)), ("down", (n_ff, n_embd))),
        f"llama.cpp's eagle3 tensor shapes; n_ff as the target's and draft vocab {draft_vocab} as in "
        "SpecForge's Qwen3 EAGLE-3 configs", (LayerOps(n_embd, n_ff, q, kv, n_head, n_head_kv, head_dim),))


def mtp_head(n_embd: int, n_ff: int, n_head: int, n_head_kv: int, head_dim: int, *, vocab: int,
             name: str) -> HeadShape:
    """An MTP (next-token) layer as llama.cpp builds it (llama.cpp's graph_mtp, e.g. models/qwen35.cpp):
    ``eh_proj`` (2h -> h) over [embedding; hidden], one decoder layer of the target's shape, and
    the target's full output head (shared)."""
    q, kv = n_head * head_dim, n_head_kv * head_dim
    return HeadShape(name, n_embd, vocab, (
        ("eh_proj", (2 * n_embd, n_embd)), ("q", (n_embd, q)), ("k", (n_embd, kv)), ("v", (n_embd, kv)),
        ("o", (q, n_embd)), ("gate", (n_embd, n_ff)), ("up", (n_embd, n_ff)), ("down", (n_ff, n_embd))),
        "llama.cpp graph_mtp (eh_proj, one target-shaped layer, the shared output head)",
        (LayerOps(n_embd, n_ff, q, kv, n_head, n_head_kv, head_dim),))


def heads_for(preset: dict, target: str) -> dict[str, HeadShape]:
    dims = {k: preset[k] for k in ("n_embd", "n_ff", "n_head", "n_head_kv", "head_dim")}
    return {"eagle3": eagle3_head(**dims, draft_vocab=EAGLE3_DRAFT_VOCAB, name=f"{target} EAGLE-3 head"),
            "mtp": mtp_head(**dims, vocab=preset["vocab"], name=f"{target} MTP layer")}


def target_for(preset: dict, name: str, source: str) -> ModelShape:
    return ModelShape(name, preset["n_embd"], preset["n_ff"], preset["n_layer"], preset["n_head"] * preset["head_dim"],
                      preset["n_head_kv"] * preset["head_dim"], preset["vocab"], source, preset["head_dim"])


@dataclass(frozen=True)
class Priced:
    """A model's weights in one quantization mix and its layers' host-op shapes."""

    name: str
    weights: tuple[plans.Weight, ...]
    host: tuple[LayerOps, ...]


def priced(shape: ModelShape | HeadShape, quant: str) -> Priced:
    return Priced(shape.name, tuple(plans.preset_weights(shape, quant)), shape.host_layers())


@dataclass(frozen=True)
class Board:
    """The conditions every pass is priced at: the NPU's weight format and cores, the A76 threads."""

    npu_dtype: str
    cores: int
    threads: int = cpu.BIG_CORES


def pass_s(model: Priced, plan: str, M: int, board: Board) -> float:
    """Modeled seconds of one pass of ``M`` rows under ``plan`` (matmuls and host ops), the
    cache at the job's mean fill (``plans.DECODE_PAST``)."""
    return plans.pass_seconds(list(model.weights), model.host, plan, M, npu_dtype=board.npu_dtype,
                              cores=board.cores, threads=board.threads, past=plans.DECODE_PAST)


def round_s(target: Priced, head: Priced, n: int, plan: str, board: Board) -> float:
    """Modeled seconds of one speculative round with ``n`` drafted tokens under ``plan``."""
    return pass_s(target, plan, n + 1, board) + n * pass_s(head, plan, 1, board) + pass_s(head, plan, n + 1, board)


def plain_tok_s(target: Priced, board: Board) -> float:
    """llama.cpp alone without speculation: one token per CPU pass."""
    return 1.0 / pass_s(target, "cpu", 1, board)


def placement_of(model: Priced, plan: str, M: int, board: Board) -> str:
    """Where a pass's matmuls run under ``plan``: "host", "npu", or the mix (weights by count)."""
    placed = plans.place(list(model.weights), plan, M, npu_dtype=board.npu_dtype, cores=board.cores,
                         threads=board.threads)
    counts: dict[str, int] = {}
    for p in placed:
        counts[p.where] = counts.get(p.where, 0) + p.weight.count
    return next(iter(counts)) if len(counts) == 1 else ", ".join(f"{w} {c}" for w, c in sorted(counts.items()))


def chain_tau(alpha: float, n: int) -> float:
    """Tokens per round of a chain of n drafts, each accepted with probability alpha after its predecessors."""
    return float(n + 1) if alpha >= 1.0 else (1.0 - alpha ** (n + 1)) / (1.0 - alpha)


def alpha_from_tau(tau: float) -> float:
    """The smallest per-draft acceptance that reaches ``tau`` (with an unbounded chain)."""
    return 1.0 - 1.0 / tau


def round_rows(target: Priced, heads: dict[str, Priced], board: Board) -> list[dict]:
    rows = []
    for kind, head in heads.items():
        for n in DRAFT_NS:
            for plan in SPEC_PLANS:
                total = round_s(target, head, n, plan, board)
                rows.append({"head": kind, "n_draft": n, "M": n + 1, "plan": plan,
                             "verify_ms_modeled": pass_s(target, plan, n + 1, board) * 1e3,
                             "head_pass_ms_modeled": pass_s(head, plan, 1, board) * 1e3,
                             "head_on": placement_of(head, plan, 1, board),
                             "round_ms_modeled": total * 1e3, "ceiling_tok_s_modeled": (n + 1) / total})
    return rows


def goals(target: Priced, q4_0: Priced, board: Board, rkllm: float | None) -> dict[str, float]:
    """Goal name -> tokens/s: 2.5x RKLLM, 1.5x llama.cpp CPU-only Q4_0 of this target (modeled) and
    1.5x the published Gemma3-1B Q4_0 figure."""
    out = {f"{GOAL_VS_RKLLM}x RKLLM": GOAL_VS_RKLLM * rkllm} if rkllm else {}
    out[f"{GOAL_VS_CPU}x CPU Q4_0 (this target, modeled)"] = GOAL_VS_CPU * plain_tok_s(q4_0, board)
    out[f"{GOAL_VS_CPU}x CPU Q4_0 {CPU_Q4_TOK_S} (Gemma3-1B, published)"] = GOAL_VS_CPU * CPU_Q4_TOK_S
    return out


def best_n(target: Priced, head: Priced, tau: float, plan: str, board: Board) -> tuple[float, int]:
    """(tok/s, n) at the best draft length under the chain model with alpha = 1 - 1/tau."""
    alpha = alpha_from_tau(tau)
    return max((chain_tau(alpha, n) / round_s(target, head, n, plan, board), n) for n in DRAFT_NS)


def published_rows(target: Priced, heads: dict[str, Priced], board: Board, *, rkllm: float | None,
                   q4_0: Priced) -> list[dict]:
    """For every published tau and plan: decode at n = 3 and at the best draft length, against
    RKLLM and llama.cpp's plain CPU decode, and the tau every goal would need at that length."""
    plain = plain_tok_s(target, board)
    cpu_q4 = plain_tok_s(q4_0, board)
    need = max(goals(target, q4_0, board, rkllm).values())
    rows = []
    for pub in PUBLISHED:
        head = heads[pub.head]
        for plan in SPEC_PLANS:
            tok_s, n = best_n(target, head, pub.tau, plan, board)
            rows.append({"head": pub.head, "model": pub.model, "tau_published_measured": pub.tau, "plan": plan,
                         "tok_s_at_default_n_modeled": pub.tau / round_s(target, head, DEFAULT_N_DRAFT, plan, board),
                         "alpha_modeled": alpha_from_tau(pub.tau), "best_n_draft": n,
                         "tau_at_best_modeled": chain_tau(alpha_from_tau(pub.tau), n), "tok_s_modeled": tok_s,
                         "vs_rkllm_modeled": tok_s / rkllm if rkllm else None,
                         "vs_cpu_plain_modeled": tok_s / plain, "vs_cpu_q4_0_modeled": tok_s / cpu_q4,
                         "tau_needed_for_goals_modeled": need * round_s(target, head, n, plan, board),
                         "conditions": pub.conditions, "source": pub.source})
    return rows


def needed_rows(target: Priced, heads: dict[str, Priced], board: Board, *, rkllm: float | None,
                q4_0: Priced) -> list[dict]:
    """The acceptance length each goal needs per plan, at the draft length where it is smallest
    (tau <= n + 1); ``best_plan``: "best" on the runnable plan (``RUNNABLE``) that needs the least."""
    rows = []
    for kind, head in heads.items():
        for goal, tok_s in goals(target, q4_0, board, rkllm).items():
            group: list[dict] = []
            for plan in SPEC_PLANS:
                feasible = [(tok_s * round_s(target, head, n, plan, board), n) for n in DRAFT_NS]
                feasible = [(tau, n) for tau, n in feasible if tau <= n + 1]
                tau, n = min(feasible) if feasible else (None, None)
                group.append({"head": kind, "goal": goal, "goal_tok_s": tok_s, "plan": plan,
                              "tau_needed_modeled": tau, "n_draft": n,
                              "alpha_needed_modeled": _alpha_for(tau, n) if tau is not None and n is not None
                              else None, "best_plan": ""})
            reachable = [r for r in group if r["tau_needed_modeled"] is not None and r["plan"] in RUNNABLE]
            if reachable:
                min(reachable, key=lambda r: r["tau_needed_modeled"])["best_plan"] = "best"
            rows += group
    return rows


def _alpha_for(tau: float, n: int) -> float:
    """Per-draft acceptance whose chain of n drafts averages ``tau`` tokens per round (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chain_tau(mid, n) < tau else (lo, mid)
    return (lo + hi) / 2


def tau_curve(target: Priced, head: Priced, n: int, plan: str, board: Board) -> tuple[list, list]:
    """Modeled tok/s against tau (1 .. n + 1) at draft length n: the plot's line for that n and plan."""
    cost = round_s(target, head, n, plan, board)
    taus = [1.0 + 0.25 * i for i in range(4 * n + 1)]
    return taus, [t / cost for t in taus]


def _round_table(title: str, rounds: list[dict], note: str) -> rp.Table:
    return rp.Table(title, [
        rp.Column("head", "head"), rp.Column("n_draft", "n drafted"), rp.Column("M", "verify M"),
        rp.Column("plan", "plan"),
        rp.Column("verify_ms_modeled", "target verify ms", "{:.1f}", figure=True),
        rp.Column("head_pass_ms_modeled", "head pass ms (M=1)", "{:.2f}", figure=True),
        rp.Column("head_on", "head (M=1) on"),
        rp.Column("round_ms_modeled", "round ms", "{:.1f}", figure=True),
        rp.Column("ceiling_tok_s_modeled", "tok/s if all accepted", "{:.1f}", figure=True),
    ], rounds, note=note)


def report_parts(dims: dict, name: str, source: str, *, quant: str, dtype: str, cores: int,
                 rkllm: float | None) -> tuple[list[rp.Table], rp.Plot, dict, list[str]]:
    """The heads' tables, plot, raw rows and notes for ``rknpu bench spec``."""
    board = Board(dtype, cores)
    target = priced(target_for(dims, name, source), quant)
    q4_0 = priced(target_for(dims, name, source), GOAL_CPU_QUANT)
    shapes = heads_for(dims, name)
    heads = {kind: priced(shape, quant) for kind, shape in shapes.items()}
    rounds = round_rows(target, heads, board)
    published = published_rows(target, heads, board, rkllm=rkllm, q4_0=q4_0)
    needed = needed_rows(target, heads, board, rkllm=rkllm, q4_0=q4_0)
    plain = plain_tok_s(target, board)
    rk = f"x RKLLM {rkllm}" if rkllm else "x RKLLM"
    where = f"{name} {quant} (NPU {dtype}, {cores} cores; CPU {board.threads} A76 threads)"
    tables = [
        _round_table(f"{where}: one round with a head drafting n tokens, by plan", rounds,
                    "round = verify at M = n + 1 + n head passes at M = 1 + one head pass over the verified rows; "
                    "each pass = its weight matmuls under the plan + its host ops (cost.host_ops by rows, the cache at "
                    f"{plans.DECODE_PAST} positions, every plan); npu: every matmul on the NPU; cpu: llama.cpp alone (ggml-cpu, repacked); "
                    "auto: each matmul at the argmin of cost.placement (rknpu serve --placement auto; its host "
                    "path runs repacked host copies); auto-split: splits allowed (--placement-split, opt-in, "
                    "its gain modeled only); RPC, "
                    "pack/unpack and the sampler not priced; "
                    + "; ".join(f"{s.name}: {s.source}" for s in shapes.values())),
        rp.Table(f"{where}: decode at published acceptance lengths (chain model, best n)", [
            rp.Column("head", "head"), rp.Column("model", "published for"),
            rp.Column("tau_published_measured", "tau", "{:.2f}", figure=True), rp.Column("plan", "plan"),
            rp.Column("tok_s_at_default_n_modeled", f"tok/s at tau, n={DEFAULT_N_DRAFT}", "{:.1f}", figure=True),
            rp.Column("best_n_draft", "best --spec-draft-n-max"),
            rp.Column("tau_at_best_modeled", "tau at best n", "{:.2f}", figure=True),
            rp.Column("tok_s_modeled", "tok/s", "{:.1f}", figure=True),
            rp.Column("vs_rkllm_modeled", rk, "{:.2f}", figure=True),
            rp.Column("vs_cpu_plain_modeled", f"x CPU {quant} plain {plain:.1f}", "{:.2f}", figure=True),
            rp.Column("vs_cpu_q4_0_modeled", "x CPU Q4_0 plain", "{:.2f}", figure=True),
            rp.Column("tau_needed_for_goals_modeled", "tau for every goal at that n", "{:.2f}", figure=True),
            rp.Column("source", "source"),
        ], published, note=f"{PLAIN} ({quant}): {plain:.1f} tok/s modeled; tau published by others on GPUs "
                           "(conditions in the raw rows and docs/speculative.md), applied to this target: an "
                           "assumption; alpha = 1 - 1/tau, the smallest per-draft acceptance with that tau (a "
                           "lower bound on the gain)"),
        rp.Table(f"{where}: acceptance length the goals need, by plan", [
            rp.Column("head", "head"), rp.Column("goal", "goal"), rp.Column("goal_tok_s", "tok/s", "{:.1f}"),
            rp.Column("plan", "plan"), rp.Column("best_plan", "least of npu/cpu/auto"),
            rp.Column("tau_needed_modeled", "tau needed", "{:.2f}", figure=True),
            rp.Column("n_draft", "at n"), rp.Column("alpha_needed_modeled", "alpha needed", "{:.3f}", figure=True),
        ], needed, note=f"goals: {GOAL_VS_RKLLM}x RKLLM w8a8 on this model (published); {GOAL_VS_CPU}x llama.cpp "
                        f"CPU-only {GOAL_CPU_QUANT} decode of this target (cost.cpu, modeled) and of Gemma3-1B "
                        f"({CPU_Q4_TOK_S} tok/s, published, docs/anchors.md A9); an empty tau: not reachable with "
                        f"n <= {max(DRAFT_NS)}"),
    ]
    series = []
    for kind, plan, ns in (("eagle3", "auto", (1, 3, 5, 7)), ("eagle3", "npu", (DEFAULT_N_DRAFT,)),
                           ("eagle3", "cpu", (DEFAULT_N_DRAFT,)), ("mtp", "auto", (DEFAULT_N_DRAFT,))):
        for n in ns:
            xs, ys = tau_curve(target, heads[kind], n, plan, board)
            series.append(rp.Series(f"{kind} {plan}, n={n} (modeled)", xs, ys))
    top = float(max(DRAFT_NS) + 1)
    if rkllm:
        series.append(rp.Series(f"RKLLM {rkllm} tok/s (measured, published)", [1.0, top], [rkllm, rkllm]))
    for goal, tok_s in goals(target, q4_0, board, rkllm).items():
        series.append(rp.Series(f"goal {goal}" + ("" if "modeled" in goal else " (from measured)"),
                                [1.0, top], [tok_s] * 2))
    series.append(rp.Series(f"{PLAIN}, {quant} (modeled)", [1.0, top], [plain] * 2))
    for row in published:   # on its head's auto n = 3 line
        if row["plan"] == "auto":
            series.append(rp.Series(f"{row['head']} {row['model']}: published tau {row['tau_published_measured']} "
                                    "(measured)", [row["tau_published_measured"]], [row["tok_s_at_default_n_modeled"]]))
    plot = rp.Plot("tok_s_vs_tau.png", f"{name} {quant} with a head: tokens/s vs acceptance length",
                   "tau: tokens per target pass", "tokens/s (modeled)", series)
    notes = [f"heads priced under the plans npu / cpu / auto / auto-split at {quant} (llama.cpp's quantizer mix, "
             f"bench.plans); the CPU by cost.cpu ({board.threads} A76 threads), the NPU by cost.model; the head's "
             "placement at M = 1 under auto is the argmin of the two per matmul (cost.placement.place_matmul)"]
    raw = {"head_rounds": rounds, "head_published": published, "head_needed": needed,
           "cpu_plain_tok_s_modeled": plain, "cpu_q4_0_plain_tok_s_modeled": plain_tok_s(q4_0, board)}
    return tables, plot, raw, notes
