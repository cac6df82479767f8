"""The matmul weights one forward pass streams, and their modeled NPU time: the shape tables ``rknpu
bench spec`` prices (targets, draft models, speculative heads)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShapes:
    """The matmul weights one decode pass streams: (K, N) of each, with their counts."""

    name: str
    weights: tuple[tuple[tuple[int, int], int], ...]
    source: str

    @property
    def n_weights(self) -> int:
        return sum(n for _, n in self.weights)


def dense_shapes(*, n_layer: int, n_embd: int, n_ff: int, n_head: int, n_head_kv: int, head_dim: int,
                 vocab: int) -> tuple[tuple[tuple[int, int], int], ...]:
    """q, k, v, o, gate, up, down per layer and the output head (tied or not: one pass)."""
    q, kv = n_head * head_dim, n_head_kv * head_dim
    layer = [(n_embd, q), (n_embd, kv), (n_embd, kv), (q, n_embd), (n_embd, n_ff), (n_embd, n_ff), (n_ff, n_embd)]
    counts: Counter[tuple[int, int]] = Counter()
    for shape in layer:
        counts[shape] += n_layer
    counts[(n_embd, vocab)] += 1
    return tuple(counts.items())


def dense_transformer(name: str, *, n_layer: int, n_embd: int, n_ff: int, n_head: int, n_head_kv: int,
                      head_dim: int, vocab: int, source: str) -> ModelShapes:
    return ModelShapes(name, dense_shapes(n_layer=n_layer, n_embd=n_embd, n_ff=n_ff, n_head=n_head,
                                          n_head_kv=n_head_kv, head_dim=head_dim, vocab=vocab), source)


_QWEN_SOURCE = "Qwen/{} config.json on Hugging Face (hidden_size, intermediate_size, layers, heads, vocab)"
PRESET_DIMS = {
    "qwen2.5-1.5b": dict(n_layer=28, n_embd=1536, n_ff=8960, n_head=12, n_head_kv=2, head_dim=128, vocab=151936),
    "qwen2.5-0.5b": dict(n_layer=24, n_embd=896, n_ff=4864, n_head=14, n_head_kv=2, head_dim=64, vocab=151936),
}
_PRESET_REPO = {"qwen2.5-1.5b": "Qwen2.5-1.5B-Instruct", "qwen2.5-0.5b": "Qwen2.5-0.5B"}
PRESETS = {name: dense_transformer(name, **dims, source=_QWEN_SOURCE.format(_PRESET_REPO[name]))
           for name, dims in PRESET_DIMS.items()}
DRAFT_FOR = {"qwen2.5-1.5b": "qwen2.5-0.5b"}   # same tokenizer, the usual pairing


def modeled_pass_s(shapes: ModelShapes, m: int, *, dtype: str, cores: int) -> float:
    """Modeled NPU seconds of one pass with ``m`` rows: each weight once, at the engine's M bucket."""
    from ggml_rknpu.bench.matmul import modeled_program_time
    from ggml_rknpu.engine.programs import m_bucket

    bucket = m_bucket(m)
    return sum(n * modeled_program_time(bucket, k, width, dtype, cores) for (k, width), n in shapes.weights)
