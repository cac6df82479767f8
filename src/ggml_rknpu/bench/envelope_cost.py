"""The modeled cost of staying inside the proven envelope, per model shape: every matmul of
one transformer layer (and the LM head) of Qwen2.5-1.5B, Qwen3-0.6B and Llama-3.2-1B,
compiled in each envelope and priced by ``cost.model`` (1 GHz NPU, 2112 MHz DRAM, our
driver's per-submit cost). All figures are MODELED, never measured.

    python -m ggml_rknpu.bench.envelope_cost          # the Markdown table in docs/engine.md

WHY: the proven envelope trades speed for the guarantee that nothing the compiler emits
goes beyond what has run on silicon; the board owner deciding whether to run the ladder,
and we deciding what to test first on a board, need to know what that costs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ggml_rknpu.compiler.matmul import compile_matmul
from ggml_rknpu.cost.model import modeled_time
from ggml_rknpu.engine.envelope_record import RUNGS, envelope_for_rungs
from ggml_rknpu.hw.envelope import EXTENDED, PROVEN, Envelope


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    matmuls: tuple[tuple[str, int, int], ...]     # (name, K, N) per layer
    vocab: int
    hidden: int


def _layer(hidden: int, q: int, kv: int, ffn: int) -> tuple[tuple[str, int, int], ...]:
    return (("q", hidden, q), ("k", hidden, kv), ("v", hidden, kv), ("o", q, hidden),
            ("gate", hidden, ffn), ("up", hidden, ffn), ("down", ffn, hidden))


# Hugging Face config.json of each model: hidden_size, heads x head_dim, kv heads x head_dim,
# intermediate_size, num_hidden_layers, vocab_size.
MODELS = (
    ModelShape("Qwen2.5-1.5B", 28, _layer(1536, 12 * 128, 2 * 128, 8960), 151936, 1536),
    ModelShape("Qwen3-0.6B", 28, _layer(1024, 16 * 128, 8 * 128, 3072), 151936, 1024),
    ModelShape("Llama-3.2-1B", 16, _layer(2048, 32 * 64, 8 * 64, 8192), 128256, 2048),
)
ENVELOPES: tuple[tuple[str, Envelope, int], ...] = (
    ("extended, 3 cores (former default)", EXTENDED, 3),
    ("proven, 1 core (new default)", PROVEN, 1),
    ("proven + full ladder, 3 cores", envelope_for_rungs(list(RUNGS), "rknpu"), 3),
)


def pass_ms(model: ModelShape, M: int, dtype: str, env: Envelope, cores: int) -> tuple[float, int]:
    """(modeled ms, submits) of one forward pass of M rows: all layers' matmuls and the LM head."""
    out = "int32" if dtype == "int8" else "fp32"
    total, submits = 0.0, 0
    shapes = [(K, N, model.layers) for _, K, N in model.matmuls] + [(model.hidden, model.vocab, 1)]
    for K, N, count in shapes:
        p = compile_matmul(M, K, N, dtype=dtype, out=out, cores=cores, envelope=env)
        total += modeled_time(p).total_s * count
        submits += p.n_submits * count
    return total * 1e3, submits


def table(passes=(("prefill 512", 512), ("decode", 1)), dtypes=("fp16", "int8")) -> str:
    head = "| model | pass | dtype | " + " | ".join(name for name, _, _ in ENVELOPES) + " |"
    lines = [head, "|" + "---|" * (3 + len(ENVELOPES))]
    for model in MODELS:
        for pass_name, M in passes:
            for dtype in dtypes:
                cells = []
                base = None
                for _, env, cores in ENVELOPES:
                    ms, submits = pass_ms(model, M, dtype, env, cores)
                    base = base or ms
                    cells.append(f"{ms:.1f} ms, {submits} submits ({ms / base:.2f}x)")
                lines.append(f"| {model.name} | {pass_name} | {dtype} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
