"""Tiny random-weight llama / qwen2 / qwen3 (and qwen3moe, mamba, jamba) GGUF files for end-to-end tests.

Why: the end-to-end tests need models that unmodified llama.cpp loads and runs in a second,
whose graphs carry each family's op set (ggml-rpc.md §5.2: qwen2 adds q/k/v biases and NEOX
rope, qwen3 adds q/k RMS norms), and that no download provides. Weights are random but seeded,
so a file is reproducible. The vocabulary is a SentencePiece-style ("llama") one with byte
fallback, so any prompt tokenizes.

Weight scale: a random model's next-token distribution is nearly flat, and greedy decoding of a
flat distribution turns on near-ties that any rounding difference flips. The output head is
therefore drawn larger (``head_scale``) than the layer weights, which makes the argmax margins
wide enough that an fp16 device reproduces the CPU's greedy tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize

ARCHES = ("llama", "qwen2", "qwen3")
# beyond the dense transformers: a MoE (MUL_MAT_ID, ARGSORT/TOP_K, GET_ROWS of expert weights),
# an SSM (SSM_CONV, SSM_SCAN, recurrent state rows) and a hybrid of both with attention and MoE
MORE_ARCHES = ("qwen3moe", "mamba", "jamba")
WEIGHT_TYPES = {"f16": GGMLQuantizationType.F16, "q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0,
                "f32": GGMLQuantizationType.F32}

_WORDS = ("the", "of", "and", "to", "in", "is", "capital", "France", "Paris", "city", "it",
          "was", "for", "on", "that", "with", "as", "by", "at", "from", "this", "be", "are")


@dataclass(frozen=True)
class TinyConfig:
    n_layer: int = 2
    n_embd: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 512
    n_ctx: int = 512
    rms_eps: float = 1e-5
    rope_base: float = 10000.0
    weight_scale: float = 0.08
    head_scale: float = 0.5
    n_expert: int = 4
    n_expert_used: int = 2
    n_ff_exp: int = 128
    ssm_d_conv: int = 4
    ssm_d_inner: int = 512
    ssm_d_state: int = 16
    ssm_dt_rank: int = 16

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def tiny_vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types): <unk> <s> </s>, 256 byte tokens, then letters and whole words."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    scores = [0.0, 0.0, 0.0]
    for byte in range(256):
        tokens.append(f"<0x{byte:02X}>")
        types.append(TokenType.BYTE)
        scores.append(0.0)
    pieces = ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += ["\u2581" + chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += ["\u2581" + w for w in _WORDS] + [",", "."]
    for rank, piece in enumerate(pieces):
        tokens.append(piece)
        types.append(TokenType.NORMAL)
        # longer pieces score higher so SPM prefers whole words
        scores.append(-1000.0 + 10.0 * len(piece) - rank * 0.001)
    return tokens, scores, [int(t) for t in types]


def _add_weight(writer: GGUFWriter, name: str, array: np.ndarray, wtype: str) -> None:
    qtype = WEIGHT_TYPES[wtype]
    if qtype == GGMLQuantizationType.F16:
        writer.add_tensor(name, array.astype(np.float16))
    elif qtype == GGMLQuantizationType.F32:
        writer.add_tensor(name, array.astype(np.float32))
    else:
        writer.add_tensor(name, quantize(array.astype(np.float32), qtype), raw_dtype=qtype)


def write_tiny_gguf(path: Path, arch: str, wtype: str = "f16", *, seed: int = 0,
                    config: TinyConfig = TinyConfig()) -> Path:
    """Write a tiny random ``arch`` model with ``wtype`` matmul weights (norms stay f32)."""
    if arch not in ARCHES + MORE_ARCHES:
        raise ValueError(f"arch must be one of {ARCHES + MORE_ARCHES}, not {arch!r}")
    if wtype not in WEIGHT_TYPES:
        raise ValueError(f"wtype must be one of {sorted(WEIGHT_TYPES)}, not {wtype!r}")
    rng = np.random.default_rng(seed)
    c = config
    tokens, scores, types = tiny_vocab()
    n_vocab = len(tokens)

    def rand(*shape: int, scale: float = c.weight_scale) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm_weight(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    path = Path(path)
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}-{wtype}")
    writer.add_context_length(c.n_ctx)
    writer.add_embedding_length(c.n_embd)
    writer.add_block_count(c.n_layer)
    writer.add_feed_forward_length(c.n_ff)
    ssm_layers = _ssm_layers(arch, c)
    writer.add_head_count(c.n_head if arch != "mamba" else 0)
    writer.add_head_count_kv(c.n_head_kv if arch not in ("mamba", "jamba")
                             else [0 if i in ssm_layers else c.n_head_kv for i in range(c.n_layer)])
    if arch in ("qwen3moe", "jamba"):
        writer.add_expert_count(c.n_expert)
        writer.add_expert_used_count(c.n_expert_used)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(c.n_ff_exp)
    if ssm_layers:
        writer.add_ssm_conv_kernel(c.ssm_d_conv)
        writer.add_ssm_inner_size(c.ssm_d_inner)
        writer.add_ssm_state_size(c.ssm_d_state)
        writer.add_ssm_time_step_rank(c.ssm_dt_rank)
    writer.add_layer_norm_rms_eps(c.rms_eps)
    writer.add_rope_freq_base(c.rope_base)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(1 if wtype == "f16" else 7 if wtype == "q8_0" else 0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)

    q_dim, kv_dim = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    # numpy shapes are ggml ne reversed: [rows = outputs, cols = inputs]
    _add_weight(writer, "token_embd.weight", rand(n_vocab, c.n_embd, scale=1.0), wtype)
    writer.add_tensor("output_norm.weight", norm_weight(c.n_embd))
    _add_weight(writer, "output.weight", rand(n_vocab, c.n_embd, scale=c.head_scale), wtype)
    for i in range(c.n_layer):
        blk = f"blk.{i}"
        writer.add_tensor(f"{blk}.attn_norm.weight", norm_weight(c.n_embd))
        if i in ssm_layers:
            _add_mamba_layer(writer, blk, c, rand, norm_weight, wtype, jamba=arch == "jamba")
        else:
            _add_weight(writer, f"{blk}.attn_q.weight", rand(q_dim, c.n_embd), wtype)
            _add_weight(writer, f"{blk}.attn_k.weight", rand(kv_dim, c.n_embd), wtype)
            _add_weight(writer, f"{blk}.attn_v.weight", rand(kv_dim, c.n_embd), wtype)
            _add_weight(writer, f"{blk}.attn_output.weight", rand(c.n_embd, q_dim), wtype)
        if arch == "qwen2":
            writer.add_tensor(f"{blk}.attn_q.bias", rand(q_dim, scale=0.1))
            writer.add_tensor(f"{blk}.attn_k.bias", rand(kv_dim, scale=0.1))
            writer.add_tensor(f"{blk}.attn_v.bias", rand(kv_dim, scale=0.1))
        if arch in ("qwen3", "qwen3moe"):
            writer.add_tensor(f"{blk}.attn_q_norm.weight", norm_weight(c.head_dim))
            writer.add_tensor(f"{blk}.attn_k_norm.weight", norm_weight(c.head_dim))
        if arch == "mamba":
            continue                                   # a mamba block is the SSM alone
        writer.add_tensor(f"{blk}.ffn_norm.weight", norm_weight(c.n_embd))
        if arch == "qwen3moe" or (arch == "jamba" and i % 2 == 1):
            n_ff = c.n_ff_exp if arch == "qwen3moe" else c.n_ff
            writer.add_tensor(f"{blk}.ffn_gate_inp.weight", rand(c.n_expert, c.n_embd, scale=0.5))
            _add_weight(writer, f"{blk}.ffn_gate_exps.weight", rand(c.n_expert, n_ff, c.n_embd), wtype)
            _add_weight(writer, f"{blk}.ffn_up_exps.weight", rand(c.n_expert, n_ff, c.n_embd), wtype)
            _add_weight(writer, f"{blk}.ffn_down_exps.weight", rand(c.n_expert, c.n_embd, n_ff), wtype)
        else:
            _add_weight(writer, f"{blk}.ffn_gate.weight", rand(c.n_ff, c.n_embd), wtype)
            _add_weight(writer, f"{blk}.ffn_up.weight", rand(c.n_ff, c.n_embd), wtype)
            _add_weight(writer, f"{blk}.ffn_down.weight", rand(c.n_embd, c.n_ff), wtype)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _ssm_layers(arch: str, c: TinyConfig) -> set[int]:
    """Layers that are mamba blocks: all of a mamba model, every other one of jamba (from layer 0)."""
    if arch == "mamba":
        return set(range(c.n_layer))
    if arch == "jamba":
        return set(range(0, c.n_layer, 2))
    return set()


def _add_mamba_layer(writer: GGUFWriter, blk: str, c: TinyConfig, rand, norm_weight, wtype: str, *,
                     jamba: bool) -> None:
    """A mamba-1 block (llama.cpp models/mamba.cpp, models/jamba.cpp): in-projection, causal conv,
    x/dt projections, the selective scan's A and D, out-projection (jamba: plus dt/B/C norms)."""
    d_inner, d_state, dt_rank, d_conv = c.ssm_d_inner, c.ssm_d_state, c.ssm_dt_rank, c.ssm_d_conv
    _add_weight(writer, f"{blk}.ssm_in.weight", rand(2 * d_inner, c.n_embd), wtype)
    writer.add_tensor(f"{blk}.ssm_conv1d.weight", rand(d_inner, d_conv, scale=0.3))
    writer.add_tensor(f"{blk}.ssm_conv1d.bias", rand(d_inner, scale=0.1))
    _add_weight(writer, f"{blk}.ssm_x.weight", rand(dt_rank + 2 * d_state, d_inner), wtype)
    _add_weight(writer, f"{blk}.ssm_dt.weight", rand(d_inner, dt_rank, scale=0.3), wtype)
    writer.add_tensor(f"{blk}.ssm_dt.bias", rand(d_inner, scale=0.1))
    # A = -exp(A_log) as stored by convert_hf_to_gguf; negative, so the scan decays
    writer.add_tensor(f"{blk}.ssm_a", -np.exp(rand(d_inner, d_state, scale=0.5)))
    writer.add_tensor(f"{blk}.ssm_d", norm_weight(d_inner))
    _add_weight(writer, f"{blk}.ssm_out.weight", rand(c.n_embd, d_inner), wtype)
    if jamba:
        writer.add_tensor(f"{blk}.ssm_dt_norm.weight", norm_weight(dt_rank))
        writer.add_tensor(f"{blk}.ssm_b_norm.weight", norm_weight(d_state))
        writer.add_tensor(f"{blk}.ssm_c_norm.weight", norm_weight(d_state))
