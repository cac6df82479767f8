"""The byte model of ``bench fit``: a weight's GGUF and NPU bytes, what else a board holds
beside the weights (KV cache, compute buffers, the processes), RAM a board leaves usable,
RKLLM's published footprints, and the model shapes ``bench fit`` adds to ``bench decode``'s.

Invariants: weights and KV cache are arithmetic on shapes and ggml's block sizes; the other
sizes are guesses measured on the x86 development box (each named here and in docs/memory.md
"Fitting a board"); the usable RAM follows the server's memory-budget reserve."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ggml_rknpu.bench import plans
from ggml_rknpu.bench.shapes import ModelShape
from ggml_rknpu.hw.limits import ADDRESS_WINDOW_BYTES, BYTES
from ggml_rknpu.server.memory_budget import MIN_RESERVE, RESERVE_FRACTION

MIB = 2**20
NPU_DOMAIN_BYTES = ADDRESS_WINDOW_BYTES     # one IOMMU domain maps a 32-bit window [docs/decisions.md "Interfaces between the layers": 32-bit NPU addresses]
INT8_SCALE_BYTES = 4                        # per output row of an int8 NPU weight (an fp32 scale)
KV_BYTES = 2                                # f16 K and V, llama.cpp's default cache type
STATE_BYTES = 4                             # f32 conv and recurrent states, llama.cpp's default type_r / type_s
UBATCH = 512                                # llama.cpp's default physical batch
MEMTOTAL_FRACTION = 0.96                    # guess: MemTotal of an N GB board (the kernel's reserved memory aside)
# Guesses, measured here on x86 (docs/memory.md "Fitting a board"): resident sizes without weights.
LLAMA_PROCESS = 64 * MIB                    # llama.cpp's process (llama-server), alone or as the client
SERVER_PROCESS = 100 * MIB                  # rknpu serve before its first client (Python, numpy, ggml)
NPU_FIXED = 64 * MIB                        # programs and scratch of the NPU (guess)
COMPUTE_FLOATS_PER_ROW = 4                  # guess: compute buffer = 4 B x UBATCH x this x (hidden + ff)

# hidden_size, intermediate_size, num_hidden_layers, num_attention_heads x head_dim,
# num_key_value_heads x head_dim, vocab_size, head_dim, from each model's config.json.
SHAPES: dict[str, ModelShape] = {m.name: m for m in (
    ModelShape("Qwen3-4B", 2560, 9728, 36, 32 * 128, 8 * 128, 151936, "huggingface.co/Qwen/Qwen3-4B (its config)",
               head_dim=128),
    ModelShape("Llama-3.1-8B", 4096, 14336, 32, 32 * 128, 8 * 128, 128256,
               "huggingface.co/meta-llama/Llama-3.1-8B (its config)", head_dim=128),
)}
UNTIED = frozenset({"Llama-3.1-8B"})        # tie_word_embeddings false: the embedding is a tensor of its own

# RKLLM's memory on RK3588 (w8a8, seqlen 128, 64 new tokens), MB, for the models bench fit knows
# by name [docs/anchors.md A10].
RKLLM_MB = {"Qwen3-0.6B": 791.11, "Qwen2.5-1.5B": 1689.21}


def gguf_bytes(w: plans.Weight) -> int:
    """One matrix's bytes in its ggml type (its repacked host copy is as large)."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[w.type]]
    return w.N * w.K // block * size


def npu_bytes(w: plans.Weight, dtype: str) -> int:
    """One matrix's NPU copy: an element per weight in ``dtype``, int8 with a scale per row."""
    return w.N * w.K * BYTES[dtype] + (w.N * INT8_SCALE_BYTES if dtype == "int8" else 0)


def usable(ram_gb: int) -> int:
    """What a board of ``ram_gb`` GB leaves the model: MemTotal less the memory-budget reserve."""
    total = int(ram_gb * 2**30 * MEMTOTAL_FRACTION)
    return total - max(MIN_RESERVE, total // RESERVE_FRACTION)


@dataclass(frozen=True)
class Footprint:
    """What a board holds beside the weight copies, for one model and context."""

    shape: ModelShape
    context: int
    embedding: int        # the token embedding's bytes: the head's (the same tensor when tied; an
                          # untied one is of a type no larger in llama.cpp's mixes)

    @property
    def kv(self) -> int:
        """K and V of the attention layers: the whole context on full-attention layers, the
        window plus a batch on sliding ones (llama.cpp's SWA cache without ``--swa-full``:
        ``size_swa`` in src/llama-kv-cache-iswa.cpp, before padding); none on short-conv and
        delta-net layers (their state is ``recurrent``)."""
        s = self.shape
        cells = sum(min(self.context, s.window + UBATCH) if i in s.window_layers else self.context
                    for i in range(s.layers) if i not in s.conv_layers and i not in s.delta_layers)
        return 2 * s.kv_dim * cells * KV_BYTES

    @property
    def recurrent(self) -> int:
        """The delta-net layers' states for one sequence (llama.cpp's recurrent memory,
        src/llama-memory-recurrent.cpp): the conv's last ``conv_kernel - 1`` inputs of its
        channels and a head_dim x head_dim state per value head. (A short-conv layer's state,
        two rows of the hidden size, is left out: kilobytes.)"""
        d = self.shape.delta
        if d is None:
            return 0
        per_layer = ((d.conv_kernel - 1) * d.conv_channels + d.head_dim * d.value_dim) * STATE_BYTES
        return len(self.shape.delta_layers) * per_layer

    @property
    def compute(self) -> int:
        return 4 * UBATCH * COMPUTE_FLOATS_PER_ROW * (self.shape.hidden + self.shape.ff)

    def alone(self, weight_bytes: int) -> int:
        """llama.cpp alone: its process, every weight (repacked or page cache), KV, compute;
        an untied embedding beside the head."""
        extra = self.embedding if self.shape.name in UNTIED else 0
        return LLAMA_PROCESS + weight_bytes + extra + self.kv + self.recurrent + self.compute

    def served(self, host: int, npu: int) -> int:
        """llama.cpp through rknpu serve: the client's process (the token embedding it keeps is
        its GGUF mmap, a row read per token: page cache the kernel may drop, not counted), the
        server, the host and NPU copies, KV and compute buffers (the client allocates them on the
        server), the NPU's programs and scratch."""
        return (LLAMA_PROCESS + SERVER_PROCESS + host + npu + self.kv + self.recurrent + self.compute
                + (NPU_FIXED if npu else 0))
