"""Tiny random GGUF models of many llama.cpp architectures, for the differential check
(tests/e2e/test_e2e_architectures.py): each one loads in the pinned llama.cpp and runs in a
second or two, and its graph carries its family's own ops.

Why one table of architectures: each entry is the tensors and hyperparameters the pinned
llama.cpp requires for it (its ``src/models/<arch>.cpp``: ``load_arch_hparams`` and
``load_arch_tensors``), written with the helpers of :class:`Tiny`; shapes are given as ggml
``ne`` (first dimension first), the order llama.cpp's ``create_tensor`` states them in.
Weights are random but seeded. The vocabulary is ``gguf_models.tiny_vocab`` (SentencePiece
style with byte fallback), so any prompt tokenizes; the output head is drawn larger than the
layers for wide greedy margins (``gguf_models`` says why).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from support.gguf_models import TinyConfig, tiny_vocab, write_tiny_gguf

# how a model is run: "text" and "encdec" generate through llama-completion, "embed" and
# "rank" pool through llama-server (--embeddings, --reranking)
KINDS = ("text", "encdec", "embed", "rank")

N_EMBD, N_HEAD, N_HEAD_KV, N_FF, N_LAYER, N_CTX = 64, 4, 2, 128, 2, 256
HEAD_DIM = N_EMBD // N_HEAD


class Tiny:
    """One model being written: the GGUF writer of ``arch`` with seeded random tensors."""

    def __init__(self, path: Path, arch: str, seed: int) -> None:
        self.arch = arch
        self.w = GGUFWriter(str(path), arch)
        self.rng = np.random.default_rng(seed)
        self.tokens, scores, types = tiny_vocab()
        self.n_vocab = len(self.tokens)
        # not the architecture's name: llama-vocab.cpp keys vocabulary fix-ups on the model name
        # (a "phi3" there looks up tokens this vocabulary does not have)
        self.w.add_name("tiny random model")
        self.w.add_tokenizer_model("llama")
        self.w.add_token_list(self.tokens)
        self.w.add_token_scores(scores)
        self.w.add_token_types(types)
        self.w.add_unk_token_id(0)
        self.w.add_bos_token_id(1)
        self.w.add_eos_token_id(2)
        self.w.add_add_bos_token(True)
        self.w.add_add_eos_token(False)
        self.w.add_file_type(1)

    # --- hyperparameters -----------------------------------------------------------------------
    def u32(self, key: str, value: int) -> None:
        self.w.add_uint32(f"{self.arch}.{key}", value)

    def f32(self, key: str, value: float) -> None:
        self.w.add_float32(f"{self.arch}.{key}", value)

    def flag(self, key: str, value: bool) -> None:
        self.w.add_bool(f"{self.arch}.{key}", value)

    def arr(self, key: str, values: list[int]) -> None:
        self.w.add_array(f"{self.arch}.{key}", values)

    def base(self, *, n_layer: int = N_LAYER, n_embd: int = N_EMBD, n_head: int = N_HEAD,
             n_head_kv: int | list[int] = N_HEAD_KV, n_ff: int | list[int] = N_FF, rms: bool = True,
             eps: float = 1e-5) -> None:
        """The hyperparameters every transformer states (llama-model.cpp ``load_hparams``)."""
        self.u32("context_length", N_CTX)
        self.u32("embedding_length", n_embd)
        self.u32("block_count", n_layer)
        if isinstance(n_ff, list):                       # per layer
            self.arr("feed_forward_length", n_ff)
        else:
            self.u32("feed_forward_length", n_ff)
        self.u32("attention.head_count", n_head)
        if isinstance(n_head_kv, list):                  # per layer (0: a recurrent layer)
            self.arr("attention.head_count_kv", n_head_kv)
        else:
            self.u32("attention.head_count_kv", n_head_kv)
        self.u32("vocab_size", self.n_vocab)
        self.f32("attention.layer_norm_rms_epsilon" if rms else "attention.layer_norm_epsilon", eps)

    # --- tensors (ne: ggml order) ------------------------------------------------------------
    def mat(self, name: str, *ne: int, scale: float = 0.08) -> None:
        """A matmul weight (f16)."""
        self.w.add_tensor(name, (self.rng.standard_normal(ne[::-1]) * scale).astype(np.float16))

    def vec(self, name: str, *ne: int, scale: float = 0.1, mean: float = 0.0) -> None:
        """A small f32 tensor: a bias (mean 0), a norm weight (mean 1), a per-channel constant."""
        self.w.add_tensor(name, (mean + scale * self.rng.standard_normal(ne[::-1])).astype(np.float32))

    def norm(self, name: str, n: int = N_EMBD, bias: bool = False) -> None:
        self.vec(f"{name}.weight", n, mean=1.0)
        if bias:
            self.vec(f"{name}.bias", n)

    def embeddings(self, n_embd: int = N_EMBD, output: bool = True, output_norm_bias: bool = False) -> None:
        self.mat("token_embd.weight", n_embd, self.n_vocab, scale=1.0)
        self.norm("output_norm", n_embd, bias=output_norm_bias)
        if output:
            self.mat("output.weight", n_embd, self.n_vocab, scale=0.5)

    def attention(self, blk: str, *, n_embd: int = N_EMBD, n_head: int = N_HEAD, n_head_kv: int = N_HEAD_KV,
                  head_dim: int = HEAD_DIM, bias: bool = False, out_bias: bool = False, fused: bool = False) -> None:
        q, kv = n_head * head_dim, n_head_kv * head_dim
        if fused:
            self.mat(f"{blk}.attn_qkv.weight", n_embd, q + 2 * kv)
            if bias:
                self.vec(f"{blk}.attn_qkv.bias", q + 2 * kv)
        else:
            for part, n in (("q", q), ("k", kv), ("v", kv)):
                self.mat(f"{blk}.attn_{part}.weight", n_embd, n)
                if bias:
                    self.vec(f"{blk}.attn_{part}.bias", n)
        self.mat(f"{blk}.attn_output.weight", q, n_embd)
        if out_bias:
            self.vec(f"{blk}.attn_output.bias", n_embd)

    def ffn(self, blk: str, *, n_embd: int = N_EMBD, n_ff: int = N_FF, gate: bool = True, bias: bool = False,
            prefix: str = "ffn") -> None:
        parts = (("gate", n_embd, n_ff), ("up", n_embd, n_ff), ("down", n_ff, n_embd)) if gate else \
            (("up", n_embd, n_ff), ("down", n_ff, n_embd))
        for part, n_in, n_out in parts:
            self.mat(f"{blk}.{prefix}_{part}.weight", n_in, n_out)
            if bias:
                self.vec(f"{blk}.{prefix}_{part}.bias", n_out)

    def experts(self, blk: str, n_expert: int, n_ff: int, *, n_embd: int = N_EMBD) -> None:
        self.mat(f"{blk}.ffn_gate_inp.weight", n_embd, n_expert, scale=0.5)
        self.mat(f"{blk}.ffn_gate_exps.weight", n_embd, n_ff, n_expert)
        self.mat(f"{blk}.ffn_up_exps.weight", n_embd, n_ff, n_expert)
        self.mat(f"{blk}.ffn_down_exps.weight", n_ff, n_embd, n_expert)

    def close(self) -> None:
        self.w.write_header_to_file()
        self.w.write_kv_data_to_file()
        self.w.write_tensors_to_file()
        self.w.close()


# --- architectures ---------------------------------------------------------------------------
def _t5(m: Tiny) -> None:
    """models/t5.cpp: an encoder and a decoder with cross-attention, relative position buckets."""
    m.base(n_head_kv=N_HEAD)                      # attn_o takes n_embd_v_gqa inputs: no GQA
    m.u32("attention.relative_buckets_count", 32)
    m.u32("attention.key_length", HEAD_DIM)
    m.u32("attention.value_length", HEAD_DIM)
    m.u32("decoder_start_token_id", 0)
    m.mat("token_embd.weight", N_EMBD, m.n_vocab, scale=1.0)
    m.norm("enc.output_norm")
    m.norm("dec.output_norm")
    m.mat("output.weight", N_EMBD, m.n_vocab, scale=0.5)
    q = kv = N_HEAD * HEAD_DIM
    for i in range(N_LAYER):
        for side in ("enc", "dec"):
            blk = f"{side}.blk.{i}"
            m.norm(f"{blk}.attn_norm")
            if i == 0:
                m.vec(f"{blk}.attn_rel_b.weight", N_HEAD, 32)
            for part, n in (("q", q), ("k", kv), ("v", kv)):
                m.mat(f"{blk}.attn_{part}.weight", N_EMBD, n)
            m.mat(f"{blk}.attn_o.weight", kv, N_EMBD)
            if side == "dec":
                m.norm(f"{blk}.cross_attn_norm")
                for part, n in (("q", q), ("k", kv), ("v", kv)):
                    m.mat(f"{blk}.cross_attn_{part}.weight", N_EMBD, n)
                m.mat(f"{blk}.cross_attn_o.weight", kv, N_EMBD)
            m.norm(f"{blk}.ffn_norm")
            m.ffn(blk)


def _bert_body(m: Tiny, *, pooling: int, n_cls_out: int = 0) -> None:
    """models/bert.cpp: learned positions, token types, post-norm layers with biases."""
    m.base(n_head_kv=N_HEAD, rms=False, eps=1e-12)
    m.u32("pooling_type", pooling)
    m.flag("attention.causal", False)
    m.w.add_uint32("tokenizer.ggml.token_type_count", 2)
    m.mat("token_embd.weight", N_EMBD, m.n_vocab, scale=1.0)
    m.vec("token_types.weight", N_EMBD, 2, scale=0.5)   # f32: added as a row view
    m.mat("position_embd.weight", N_EMBD, N_CTX, scale=0.5)
    m.norm("token_embd_norm", bias=True)
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.attention(blk, n_head_kv=N_HEAD, bias=True, out_bias=True)
        m.norm(f"{blk}.attn_output_norm", bias=True)
        m.ffn(blk, gate=False, bias=True)
        m.norm(f"{blk}.layer_output_norm", bias=True)
    if n_cls_out:
        m.mat("cls.weight", N_EMBD, N_EMBD)
        m.vec("cls.bias", N_EMBD)
        m.mat("cls.output.weight", N_EMBD, n_cls_out, scale=0.5)
        m.vec("cls.output.bias", n_cls_out)


POOLING_MEAN, POOLING_CLS, POOLING_RANK = 1, 2, 4


def _bert(m: Tiny) -> None:
    _bert_body(m, pooling=POOLING_MEAN)


def _gpt2(m: Tiny) -> None:
    """models/gpt2.cpp: learned positions, layer norms with biases, a fused QKV, GELU MLP."""
    m.base(n_head_kv=N_HEAD, rms=False)
    m.embeddings(output_norm_bias=True)
    m.mat("position_embd.weight", N_EMBD, N_CTX, scale=0.5)
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm", bias=True)
        m.attention(blk, n_head_kv=N_HEAD, fused=True, bias=True, out_bias=True)
        m.norm(f"{blk}.ffn_norm", bias=True)
        m.ffn(blk, gate=False, bias=True)


def _phi2(m: Tiny) -> None:
    """models/phi2.cpp: parallel attention and MLP off one layer norm, partial NEOX rope, an output bias."""
    m.base(n_head_kv=N_HEAD, rms=False)
    m.u32("rope.dimension_count", HEAD_DIM // 2)
    m.embeddings(output_norm_bias=True)
    m.vec("output.bias", m.n_vocab)
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm", bias=True)
        m.attention(blk, n_head_kv=N_HEAD, bias=True, out_bias=True)
        m.ffn(blk, gate=False, bias=True)


def _gemma2(m: Tiny) -> None:
    """models/gemma2.cpp: sliding-window layers, attention and final logit soft-capping, post-norms."""
    m.base()
    m.u32("attention.sliding_window", 4)
    m.f32("attn_logit_softcapping", 50.0)
    m.f32("final_logit_softcapping", 30.0)
    m.embeddings(output=False)
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        m.attention(blk)
        m.norm(f"{blk}.post_attention_norm")
        m.norm(f"{blk}.ffn_norm")
        m.ffn(blk)
        m.norm(f"{blk}.post_ffw_norm")


def _bloom(m: Tiny) -> None:
    """models/bloom.cpp: ALiBi instead of rope, an embedding layer norm, a fused QKV."""
    m.base(n_head_kv=N_HEAD, rms=False)
    m.embeddings(output_norm_bias=True)
    m.norm("token_embd_norm", bias=True)
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm", bias=True)
        m.attention(blk, n_head_kv=N_HEAD, fused=True, bias=True, out_bias=True)
        m.norm(f"{blk}.ffn_norm", bias=True)
        m.ffn(blk, gate=False, bias=True)


def _starcoder2(m: Tiny) -> None:
    """models/starcoder2.cpp: grouped-query attention with biases, layer norms, a GELU MLP."""
    m.base(rms=False)
    m.embeddings(output_norm_bias=True)
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm", bias=True)
        m.attention(blk, bias=True, out_bias=True)
        m.norm(f"{blk}.ffn_norm", bias=True)
        m.ffn(blk, gate=False, bias=True)


D_INNER, D_STATE, D_CONV = 2 * N_EMBD, 16, 4


def _mamba2_layer(m: Tiny, blk: str, n_heads: int = 8, n_group: int = 1) -> None:
    """A mamba-2 block (models/mamba2.cpp): heads of d_inner / n_heads, grouped B and C, a gated norm."""
    conv = D_INNER + 2 * n_group * D_STATE
    m.mat(f"{blk}.ssm_in.weight", N_EMBD, D_INNER + conv + n_heads)
    m.vec(f"{blk}.ssm_conv1d.weight", D_CONV, conv, scale=0.3)
    m.vec(f"{blk}.ssm_conv1d.bias", conv)
    m.vec(f"{blk}.ssm_dt.bias", n_heads)
    m.w.add_tensor(f"{blk}.ssm_a", -np.exp(m.rng.standard_normal((n_heads, 1)) * 0.5).astype(np.float32))
    m.vec(f"{blk}.ssm_d", 1, n_heads, mean=1.0)
    m.vec(f"{blk}.ssm_norm.weight", D_INNER // n_group, n_group, mean=1.0)
    m.mat(f"{blk}.ssm_out.weight", D_INNER, N_EMBD)


def _ssm_hparams(m: Tiny, n_heads: int = 8, n_group: int = 1) -> None:
    m.u32("ssm.conv_kernel", D_CONV)
    m.u32("ssm.inner_size", D_INNER)
    m.u32("ssm.state_size", D_STATE)
    m.u32("ssm.time_step_rank", n_heads)
    m.u32("ssm.group_count", n_group)


def _mamba2(m: Tiny) -> None:
    m.base(n_head=0, n_head_kv=0, n_ff=0)
    _ssm_hparams(m)
    m.embeddings()
    for i in range(N_LAYER):
        m.norm(f"blk.{i}.attn_norm")
        _mamba2_layer(m, f"blk.{i}")


def _rwkv6(m: Tiny) -> None:
    """models/rwkv6.cpp: time mixing (RWKV_WKV6, data-dependent decay) and channel mixing, no attention."""
    head, mix, decay = 16, 8, 8
    m.base(n_head=0, n_head_kv=0, rms=False)
    m.u32("wkv.head_size", head)
    m.u32("time_mix_extra_dim", mix)
    m.u32("time_decay_extra_dim", decay)
    m.u32("rescale_every_n_layers", 0)
    m.embeddings(output_norm_bias=True)
    m.norm("token_embd_norm", bias=True)
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm", bias=True)
        m.norm(f"{blk}.attn_norm_2", bias=True)
        m.mat(f"{blk}.time_mix_w1.weight", N_EMBD, mix * 5)
        m.mat(f"{blk}.time_mix_w2.weight", mix, N_EMBD, 5)
        m.vec(f"{blk}.time_mix_lerp_x.weight", N_EMBD, 1, 1, mean=0.5)
        m.vec(f"{blk}.time_mix_lerp_fused.weight", N_EMBD, 1, 1, 5, mean=0.5)
        m.vec(f"{blk}.time_mix_first.weight", head, N_EMBD // head)
        m.vec(f"{blk}.time_mix_decay.weight", N_EMBD, mean=-1.0)
        m.mat(f"{blk}.time_mix_decay_w1.weight", N_EMBD, decay)
        m.mat(f"{blk}.time_mix_decay_w2.weight", decay, N_EMBD)
        for part in ("key", "value", "receptance", "gate"):
            m.mat(f"{blk}.time_mix_{part}.weight", N_EMBD, N_EMBD)
        m.norm(f"{blk}.time_mix_ln", bias=True)
        m.mat(f"{blk}.time_mix_output.weight", N_EMBD, N_EMBD)
        m.vec(f"{blk}.channel_mix_lerp_k.weight", N_EMBD, 1, 1, mean=0.5)
        m.vec(f"{blk}.channel_mix_lerp_r.weight", N_EMBD, 1, 1, mean=0.5)
        m.mat(f"{blk}.channel_mix_key.weight", N_EMBD, N_FF)
        m.mat(f"{blk}.channel_mix_value.weight", N_FF, N_EMBD)
        m.mat(f"{blk}.channel_mix_receptance.weight", N_EMBD, N_EMBD)


def _deepseek2(m: Tiny) -> None:
    """models/deepseek2.cpp with MLA: low-rank Q, a compressed KV latent shared by all heads
    (K from wk_b, V from wv_b), a dense first layer, then routed and shared experts."""
    q_rank, kv_rank, rope, nope, v_dim, n_ff_exp = 32, 32, 8, 16, 16, 32
    m.base(n_head_kv=1)
    m.u32("attention.q_lora_rank", q_rank)
    m.u32("attention.kv_lora_rank", kv_rank)
    m.u32("attention.key_length", kv_rank + rope)
    m.u32("attention.value_length", kv_rank)
    m.u32("attention.key_length_mla", nope + rope)
    m.u32("attention.value_length_mla", v_dim)
    m.u32("rope.dimension_count", rope)
    m.u32("leading_dense_block_count", 1)
    m.u32("expert_count", 4)
    m.u32("expert_used_count", 2)
    m.u32("expert_shared_count", 1)
    m.u32("expert_feed_forward_length", n_ff_exp)
    m.f32("expert_weights_scale", 1.0)
    m.embeddings()
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        m.norm(f"{blk}.attn_q_a_norm", q_rank)
        m.norm(f"{blk}.attn_kv_a_norm", kv_rank)
        m.mat(f"{blk}.attn_q_a.weight", N_EMBD, q_rank)
        m.mat(f"{blk}.attn_q_b.weight", q_rank, N_HEAD * (nope + rope))
        m.mat(f"{blk}.attn_kv_a_mqa.weight", N_EMBD, kv_rank + rope)
        m.mat(f"{blk}.attn_k_b.weight", nope, kv_rank, N_HEAD)
        m.mat(f"{blk}.attn_v_b.weight", kv_rank, v_dim, N_HEAD)
        m.mat(f"{blk}.attn_output.weight", N_HEAD * v_dim, N_EMBD)
        m.norm(f"{blk}.ffn_norm")
        if i == 0:
            m.ffn(blk)
            continue
        m.experts(blk, 4, n_ff_exp)
        for part, n_in, n_out in (("gate", N_EMBD, n_ff_exp), ("up", N_EMBD, n_ff_exp), ("down", n_ff_exp, N_EMBD)):
            m.mat(f"{blk}.ffn_{part}_shexp.weight", n_in, n_out)


def _bert_rank(m: Tiny) -> None:
    """A bert reranker: the pooled first token through the classifier head (cls, cls.output)."""
    m.w.add_array(f"{m.arch}.classifier.output_labels", ["score"])
    _bert_body(m, pooling=POOLING_RANK, n_cls_out=1)


def _nomic_bert(m: Tiny) -> None:
    """models/nomic-bert.cpp: a bert with rope instead of learned positions and a SwiGLU MLP."""
    m.base(n_head_kv=N_HEAD, rms=False, eps=1e-12)
    m.u32("pooling_type", POOLING_MEAN)
    m.flag("attention.causal", False)
    m.w.add_uint32("tokenizer.ggml.token_type_count", 2)
    m.mat("token_embd.weight", N_EMBD, m.n_vocab, scale=1.0)
    m.vec("token_types.weight", N_EMBD, 2, scale=0.5)   # f32: added as a row view
    m.norm("token_embd_norm", bias=True)
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.attention(blk, n_head_kv=N_HEAD, fused=True)
        m.norm(f"{blk}.attn_output_norm", bias=True)
        m.ffn(blk)
        m.norm(f"{blk}.layer_output_norm", bias=True)


def _granitehybrid(m: Tiny) -> None:
    """models/granite-hybrid.cpp: mamba-2 layers (head_count_kv 0) and attention layers, muP scales."""
    m.base(n_head_kv=[0, N_HEAD_KV])
    _ssm_hparams(m)
    m.f32("logit_scale", 2.0)
    m.f32("residual_scale", 0.5)
    m.f32("embedding_scale", 2.0)
    m.f32("attention.scale", 1.0 / HEAD_DIM)
    m.embeddings()
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        if i == 0:
            _mamba2_layer(m, blk)
        else:
            m.attention(blk)
        m.norm(f"{blk}.ffn_norm")
        m.ffn(blk)


def _qwen2moe(m: Tiny) -> None:
    """models/qwen2moe.cpp: routed experts plus a shared expert behind its own sigmoid gate."""
    m.base()
    m.u32("expert_count", 4)
    m.u32("expert_used_count", 2)
    m.u32("expert_feed_forward_length", 32)
    m.u32("expert_shared_feed_forward_length", 64)
    m.embeddings()
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        m.attention(blk, bias=True)
        m.norm(f"{blk}.ffn_norm")
        m.experts(blk, 4, 32)
        m.mat(f"{blk}.ffn_gate_inp_shexp.weight", N_EMBD, scale=0.5)
        for part, n_in, n_out in (("gate", N_EMBD, 64), ("up", N_EMBD, 64), ("down", 64, N_EMBD)):
            m.mat(f"{blk}.ffn_{part}_shexp.weight", n_in, n_out)


def _falcon(m: Tiny) -> None:
    """models/falcon.cpp: multi-query attention from a fused QKV, attention and MLP in parallel."""
    m.base(n_head_kv=1, rms=False)
    m.embeddings(output_norm_bias=True)
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm", bias=True)
        m.mat(f"{blk}.attn_qkv.weight", N_EMBD, N_EMBD + 2 * HEAD_DIM)
        m.mat(f"{blk}.attn_output.weight", N_EMBD, N_EMBD)
        m.ffn(blk, gate=False)


def _gptneox(m: Tiny) -> None:
    """models/gptneox.cpp: parallel residual, partial NEOX rope, a fused QKV with biases."""
    m.base(n_head_kv=N_HEAD, rms=False)
    m.flag("use_parallel_residual", True)
    m.u32("rope.dimension_count", HEAD_DIM // 2)
    m.embeddings(output_norm_bias=True)
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm", bias=True)
        m.attention(blk, n_head_kv=N_HEAD, fused=True, bias=True, out_bias=True)
        m.norm(f"{blk}.ffn_norm", bias=True)
        m.ffn(blk, gate=False, bias=True)


def _olmoe(m: Tiny) -> None:
    """models/olmoe.cpp: q/k RMS norms over the whole projection, then routed experts only."""
    m.base(n_head_kv=N_HEAD, n_ff=32)
    m.u32("expert_count", 4)
    m.u32("expert_used_count", 2)
    m.embeddings()
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        m.attention(blk, n_head_kv=N_HEAD)
        m.norm(f"{blk}.attn_q_norm")
        m.norm(f"{blk}.attn_k_norm")
        m.norm(f"{blk}.ffn_norm")
        m.experts(blk, 4, 32)


def _gemma3(m: Tiny, *, sliding_window: int = 4, tied_output: bool = True) -> None:
    """models/gemma3.cpp: per-head q/k norms, sliding-window and global layers, post-norms, tied
    output (tests/support/mmproj_models.py writes one with a wide window and its own head)."""
    m.base()
    m.u32("attention.sliding_window", sliding_window)
    m.embeddings(output=not tied_output)
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        m.attention(blk)
        m.norm(f"{blk}.attn_q_norm", HEAD_DIM)
        m.norm(f"{blk}.attn_k_norm", HEAD_DIM)
        m.norm(f"{blk}.post_attention_norm")
        m.norm(f"{blk}.ffn_norm")
        m.ffn(blk)
        m.norm(f"{blk}.post_ffw_norm")


def _command_r(m: Tiny) -> None:
    """models/command-r.cpp: one layer norm feeding attention and MLP in parallel, a logit scale, tied output."""
    m.base(rms=False)
    m.f32("logit_scale", 0.5)
    m.embeddings(output=False)
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        m.attention(blk)
        m.ffn(blk)


def _stablelm(m: Tiny) -> None:
    """models/stablelm.cpp: layer norms with biases, partial NEOX rope, a SwiGLU MLP."""
    m.base(rms=False)
    m.u32("rope.dimension_count", HEAD_DIM // 4)
    m.embeddings(output_norm_bias=True)
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm", bias=True)
        m.attention(blk, bias=True)
        m.norm(f"{blk}.ffn_norm", bias=True)
        m.ffn(blk)


def _olmo2(m: Tiny) -> None:
    """models/olmo2.cpp: no pre-norms; q/k norms over the projections, norms after attention and MLP."""
    m.base()
    m.embeddings()
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.attention(blk)
        m.norm(f"{blk}.attn_q_norm")
        m.norm(f"{blk}.attn_k_norm", N_HEAD_KV * HEAD_DIM)
        m.norm(f"{blk}.post_attention_norm")
        m.ffn(blk)
        m.norm(f"{blk}.post_ffw_norm")


def _rwkv7(m: Tiny) -> None:
    """models/rwkv7.cpp: RWKV_WKV7 (in-context learning rate, value residual mix), low-rank w/a/v/g.
    One head of 64: ggml-cpu's SIMD wkv7 kernel steps GGML_F32_STEP floats (up to 64) with no
    tail loop, so smaller heads may read past their rows (the validator refuses them, server/ops/rules.py)."""
    head, rank = 64, 8
    m.base(n_head=0, n_head_kv=0, rms=False)
    m.u32("wkv.head_size", head)
    for key in ("decay", "iclr", "value_residual_mix", "gate"):
        m.u32(f"attention.{key}_lora_rank", rank)
    m.embeddings(output_norm_bias=True)
    m.norm("token_embd_norm", bias=True)
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm", bias=True)
        m.norm(f"{blk}.attn_norm_2", bias=True)
        for part in ("w", "a", "v"):
            m.vec(f"{blk}.time_mix_{part}0.weight", N_EMBD)
            m.mat(f"{blk}.time_mix_{part}1.weight", N_EMBD, rank)
            m.mat(f"{blk}.time_mix_{part}2.weight", rank, N_EMBD)
        m.mat(f"{blk}.time_mix_g1.weight", N_EMBD, rank)
        m.mat(f"{blk}.time_mix_g2.weight", rank, N_EMBD)
        m.vec(f"{blk}.time_mix_lerp_fused.weight", N_EMBD, 1, 1, 6, mean=0.5)
        for part in ("k_k", "k_a", "r_k"):
            m.vec(f"{blk}.time_mix_{part}.weight", N_EMBD, mean=0.5)
        for part in ("key", "value", "receptance"):
            m.mat(f"{blk}.time_mix_{part}.weight", N_EMBD, N_EMBD)
        m.norm(f"{blk}.time_mix_ln", bias=True)
        m.mat(f"{blk}.time_mix_output.weight", N_EMBD, N_EMBD)
        m.vec(f"{blk}.channel_mix_lerp_k.weight", N_EMBD, 1, 1, mean=0.5)
        m.mat(f"{blk}.channel_mix_key.weight", N_EMBD, N_FF)
        m.mat(f"{blk}.channel_mix_value.weight", N_FF, N_EMBD)


def _gpt_oss(m: Tiny) -> None:
    """models/openai-moe.cpp: attention sinks, alternating sliding-window layers, experts with
    biases (ADD_ID) and the clamped SwiGLU (SWIGLU_OAI)."""
    n_ff_exp = 32
    m.base()
    m.u32("expert_count", 4)
    m.u32("expert_used_count", 2)
    m.u32("expert_feed_forward_length", n_ff_exp)
    m.u32("attention.sliding_window", 4)
    m.u32("rope.dimension_count", HEAD_DIM)
    m.embeddings()
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        m.norm(f"{blk}.post_attention_norm")
        m.attention(blk, bias=True, out_bias=True)
        m.vec(f"{blk}.attn_sinks.weight", N_HEAD)
        m.experts(blk, 4, n_ff_exp)
        m.vec(f"{blk}.ffn_gate_inp.bias", 4)
        m.vec(f"{blk}.ffn_gate_exps.bias", n_ff_exp, 4)
        m.vec(f"{blk}.ffn_up_exps.bias", n_ff_exp, 4)
        m.vec(f"{blk}.ffn_down_exps.bias", N_EMBD, 4)


def _lfm2(m: Tiny) -> None:
    """models/lfm2.cpp: gated short-convolution layers (head_count_kv 0) and attention layers."""
    m.base(n_head_kv=[0, N_HEAD_KV])
    m.u32("shortconv.l_cache", 3)
    m.mat("token_embd.weight", N_EMBD, m.n_vocab, scale=1.0)
    m.norm("token_embd_norm")                     # lfm2's output norm (LLM_TENSOR_OUTPUT_NORM_LFM2)
    m.mat("output.weight", N_EMBD, m.n_vocab, scale=0.5)
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        if i == 0:
            m.vec(f"{blk}.shortconv.conv.weight", 3, N_EMBD, scale=0.3)
            m.mat(f"{blk}.shortconv.in_proj.weight", N_EMBD, 3 * N_EMBD)
            m.mat(f"{blk}.shortconv.out_proj.weight", N_EMBD, N_EMBD)
        else:
            m.norm(f"{blk}.attn_q_norm", HEAD_DIM)
            m.norm(f"{blk}.attn_k_norm", HEAD_DIM)
            m.attention(blk)
        m.norm(f"{blk}.ffn_norm")
        m.ffn(blk)


def _jina_bert_v2(m: Tiny) -> None:
    """models/jina-bert-v2.cpp: a bert with ALiBi instead of positions and a GEGLU MLP."""
    m.base(n_head_kv=N_HEAD, rms=False, eps=1e-12)
    m.u32("pooling_type", POOLING_MEAN)
    m.flag("attention.causal", False)
    m.w.add_uint32("tokenizer.ggml.token_type_count", 2)
    m.mat("token_embd.weight", N_EMBD, m.n_vocab, scale=1.0)
    m.vec("token_types.weight", N_EMBD, 2, scale=0.5)   # f32: added as a row view
    m.norm("token_embd_norm", bias=True)
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.attention(blk, n_head_kv=N_HEAD, bias=True, out_bias=True)
        m.norm(f"{blk}.attn_output_norm", bias=True)
        m.ffn(blk)
        m.vec(f"{blk}.ffn_down.bias", N_EMBD)
        m.norm(f"{blk}.layer_output_norm", bias=True)


def _modern_bert(m: Tiny) -> None:
    """models/modern-bert.cpp: symmetric sliding-window layers between global ones, a fused GEGLU
    (three layers: the first is global, then two local ones)."""
    m.base(n_layer=3, n_head_kv=N_HEAD, rms=False)
    m.u32("pooling_type", POOLING_MEAN)
    m.flag("attention.causal", False)
    m.u32("attention.sliding_window", 4)
    m.mat("token_embd.weight", N_EMBD, m.n_vocab, scale=1.0)
    m.norm("token_embd_norm")
    m.norm("output_norm")
    for i in range(3):
        blk = f"blk.{i}"
        if i:
            m.norm(f"{blk}.attn_norm")
        m.mat(f"{blk}.attn_qkv.weight", N_EMBD, 3 * N_EMBD)
        m.mat(f"{blk}.attn_output.weight", N_EMBD, N_EMBD)
        m.norm(f"{blk}.ffn_norm")
        m.mat(f"{blk}.ffn_up.weight", N_EMBD, 2 * N_FF)
        m.mat(f"{blk}.ffn_down.weight", N_FF, N_EMBD)


def _falcon_h1(m: Tiny) -> None:
    """models/falcon-h1.cpp: every layer runs a mamba-2 mixer and attention side by side."""
    m.base()
    _ssm_hparams(m)
    m.embeddings()
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        _mamba2_layer(m, blk)
        m.attention(blk)
        m.vec(f"{blk}.ffn_norm", N_EMBD, mean=1.0)        # no ".weight" (tn(LLM_TENSOR_FFN_NORM, i))
        m.ffn(blk)


def _qwen3next(m: Tiny) -> None:
    """models/qwen3next.cpp: gated delta-net linear attention (GATED_DELTA_NET) and gated full
    attention every second layer, routed and shared experts everywhere."""
    k_heads, v_heads, head = 2, 4, 16
    key, value = k_heads * head, v_heads * head
    m.base()
    m.u32("ssm.conv_kernel", D_CONV)
    m.u32("ssm.inner_size", value)
    m.u32("ssm.state_size", head)
    m.u32("ssm.time_step_rank", v_heads)
    m.u32("ssm.group_count", k_heads)
    m.u32("full_attention_interval", 2)
    m.u32("expert_count", 4)
    m.u32("expert_used_count", 2)
    m.u32("expert_feed_forward_length", 32)
    m.u32("expert_shared_feed_forward_length", 32)
    m.embeddings()
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        m.norm(f"{blk}.post_attention_norm")
        if i == 0:
            m.mat(f"{blk}.ssm_in.weight", N_EMBD, 2 * key + 2 * value)
            m.vec(f"{blk}.ssm_conv1d.weight", D_CONV, 2 * key + value, scale=0.3)
            m.vec(f"{blk}.ssm_dt.bias", v_heads)
            m.w.add_tensor(f"{blk}.ssm_a", -np.exp(m.rng.standard_normal(v_heads) * 0.5).astype(np.float32))
            m.mat(f"{blk}.ssm_ba.weight", N_EMBD, 2 * v_heads)
            m.norm(f"{blk}.ssm_norm", head)
            m.mat(f"{blk}.ssm_out.weight", value, N_EMBD)
        else:
            m.mat(f"{blk}.attn_q.weight", N_EMBD, 2 * N_HEAD * HEAD_DIM)
            m.mat(f"{blk}.attn_k.weight", N_EMBD, N_HEAD_KV * HEAD_DIM)
            m.mat(f"{blk}.attn_v.weight", N_EMBD, N_HEAD_KV * HEAD_DIM)
            m.mat(f"{blk}.attn_output.weight", N_HEAD * HEAD_DIM, N_EMBD)
            m.norm(f"{blk}.attn_q_norm", HEAD_DIM)
            m.norm(f"{blk}.attn_k_norm", HEAD_DIM)
        m.experts(blk, 4, 32)
        m.mat(f"{blk}.ffn_gate_inp_shexp.weight", N_EMBD, scale=0.5)
        for part, n_in, n_out in (("gate", N_EMBD, 32), ("up", N_EMBD, 32), ("down", 32, N_EMBD)):
            m.mat(f"{blk}.ffn_{part}_shexp.weight", n_in, n_out)


def _nemotron_h(m: Tiny) -> None:
    """models/nemotron-h.cpp: three kinds of layer, each alone: mamba-2 (no heads, no FFN),
    attention (no FFN) and a squared-ReLU MLP (no heads)."""
    m.base(n_layer=3, n_head_kv=[0, N_HEAD_KV, 0], n_ff=[0, 0, N_FF])
    m.f32("attention.layer_norm_epsilon", 1e-5)
    _ssm_hparams(m)
    m.embeddings()
    for i in range(3):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        if i == 0:
            _mamba2_layer(m, blk)
        elif i == 1:
            m.attention(blk)
        else:
            m.ffn(blk, gate=False)


def _llama4(m: Tiny) -> None:
    """models/llama4.cpp: chunked attention with a rope-free global layer every fourth, attention
    temperature, q/k L2 norms, MoE every second layer with a shared expert."""
    n_ff_exp = 32
    m.base(n_layer=4)
    m.u32("expert_count", 4)
    m.u32("expert_used_count", 1)
    m.u32("expert_feed_forward_length", n_ff_exp)
    m.u32("interleave_moe_layer_step", 2)
    m.embeddings()
    for i in range(4):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        m.attention(blk)
        m.norm(f"{blk}.ffn_norm")
        if i % 2:
            m.experts(blk, 4, n_ff_exp)
            for part, n_in, n_out in (("gate", N_EMBD, n_ff_exp), ("up", N_EMBD, n_ff_exp), ("down", n_ff_exp, N_EMBD)):
                m.mat(f"{blk}.ffn_{part}_shexp.weight", n_in, n_out)
        else:
            m.ffn(blk)


def _phi3(m: Tiny) -> None:
    """models/phi3.cpp: a fused QKV and a fused gate/up projection (one SWIGLU of two halves)."""
    m.base()
    m.embeddings()
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        m.attention(blk, fused=True)
        m.norm(f"{blk}.ffn_norm")
        m.mat(f"{blk}.ffn_up.weight", N_EMBD, 2 * N_FF)
        m.mat(f"{blk}.ffn_down.weight", N_FF, N_EMBD)


def _mpt(m: Tiny) -> None:
    """models/mpt.cpp: ALiBi, a clamped fused QKV, layer norms without biases."""
    m.base(n_head_kv=N_HEAD, rms=False)
    m.f32("attention.max_alibi_bias", 8.0)
    m.f32("attention.clamp_kqv", 8.0)
    m.embeddings()
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        m.attention(blk, n_head_kv=N_HEAD, fused=True)
        m.norm(f"{blk}.ffn_norm")
        m.ffn(blk, gate=False)


def _apertus(m: Tiny) -> None:
    """models/apertus.cpp: the xIELU activation (its per-model constants), q/k norms, no gate."""
    m.base()
    for key, value in (("alpha_n", 0.8), ("alpha_p", 0.8), ("beta", 0.5), ("eps", -1e-6)):
        m.w.add_float32(f"xielu.{key}", value)            # global keys (llama-arch.cpp LLM_KV_XIELU_*)
    m.embeddings()
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        m.attention(blk)
        m.norm(f"{blk}.attn_q_norm", HEAD_DIM)
        m.norm(f"{blk}.attn_k_norm", HEAD_DIM)
        m.norm(f"{blk}.ffn_norm")
        m.ffn(blk, gate=False)


def _granite(m: Tiny) -> None:
    """models/granite.cpp: a llama with muP scales (embedding, attention, residual, logits)."""
    m.base()
    m.f32("logit_scale", 2.0)
    m.f32("residual_scale", 0.5)
    m.f32("embedding_scale", 2.0)
    m.f32("attention.scale", 1.0 / HEAD_DIM)
    m.embeddings()
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        m.attention(blk)
        m.norm(f"{blk}.ffn_norm")
        m.ffn(blk)


def _cohere2(m: Tiny) -> None:
    """models/cohere2.cpp: command-r's parallel block with sliding-window layers (three in four)."""
    m.base(n_layer=4, rms=False)
    m.u32("attention.sliding_window", 4)
    m.f32("logit_scale", 0.5)
    m.embeddings(output=False)
    for i in range(4):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        m.attention(blk)
        m.ffn(blk)


def _exaone4(m: Tiny) -> None:
    """models/exaone4.cpp: post-norms only, q/k norms, sliding-window layers (three in four)."""
    m.base(n_layer=4)
    m.u32("attention.sliding_window", 4)
    m.embeddings()
    for i in range(4):
        blk = f"blk.{i}"
        m.attention(blk)
        m.norm(f"{blk}.post_attention_norm")
        m.norm(f"{blk}.attn_q_norm", HEAD_DIM)
        m.norm(f"{blk}.attn_k_norm", HEAD_DIM)
        m.ffn(blk)
        m.norm(f"{blk}.post_ffw_norm")


def _glm4(m: Tiny) -> None:
    """models/glm4.cpp: partial rope, a fused gate/up, norms after attention and MLP."""
    m.base()
    m.u32("rope.dimension_count", HEAD_DIM // 2)
    m.embeddings()
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        m.attention(blk, bias=True)
        m.norm(f"{blk}.post_attention_norm")
        m.norm(f"{blk}.ffn_norm")
        m.mat(f"{blk}.ffn_up.weight", N_EMBD, 2 * N_FF)
        m.mat(f"{blk}.ffn_down.weight", N_FF, N_EMBD)
        m.norm(f"{blk}.post_ffw_norm")


def _minicpm3(m: Tiny) -> None:
    """models/minicpm3.cpp: low-rank Q and a compressed KV expanded by one wkv_b (MLA without
    the absorbed form), rope on part of each head."""
    q_rank, kv_rank, rope, nope, v_dim = 32, 32, 8, 16, 16
    m.base(n_head_kv=N_HEAD)
    m.u32("attention.q_lora_rank", q_rank)
    m.u32("attention.kv_lora_rank", kv_rank)
    m.u32("attention.key_length", nope + rope)
    m.u32("attention.value_length", v_dim)
    m.u32("rope.dimension_count", rope)
    m.embeddings()
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        m.norm(f"{blk}.attn_q_a_norm", q_rank)
        m.norm(f"{blk}.attn_kv_a_norm", kv_rank)
        m.mat(f"{blk}.attn_q_a.weight", N_EMBD, q_rank)
        m.mat(f"{blk}.attn_q_b.weight", q_rank, N_HEAD * (nope + rope))
        m.mat(f"{blk}.attn_kv_a_mqa.weight", N_EMBD, kv_rank + rope)
        m.mat(f"{blk}.attn_kv_b.weight", kv_rank, N_HEAD * (nope + v_dim))
        m.mat(f"{blk}.attn_output.weight", N_HEAD * v_dim, N_EMBD)
        m.norm(f"{blk}.ffn_norm")
        m.ffn(blk)


def _dbrx(m: Tiny) -> None:
    """models/dbrx.cpp: a clamped fused QKV, layer norms, experts in every layer."""
    m.base(rms=False, n_ff=32)
    m.f32("attention.clamp_kqv", 8.0)
    m.u32("expert_count", 4)
    m.u32("expert_used_count", 2)
    m.embeddings()
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        m.attention(blk, fused=True)
        m.norm(f"{blk}.attn_output_norm")
        m.experts(blk, 4, 32)


def _starcoder(m: Tiny) -> None:
    """models/starcoder.cpp: learned positions, multi-query fused QKV with biases, a GELU MLP."""
    m.base(n_head_kv=1, rms=False)
    m.embeddings(output_norm_bias=True)
    m.mat("position_embd.weight", N_EMBD, N_CTX, scale=0.5)
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm", bias=True)
        m.mat(f"{blk}.attn_qkv.weight", N_EMBD, N_EMBD + 2 * HEAD_DIM)
        m.vec(f"{blk}.attn_qkv.bias", N_EMBD + 2 * HEAD_DIM)
        m.mat(f"{blk}.attn_output.weight", N_EMBD, N_EMBD)
        m.vec(f"{blk}.attn_output.bias", N_EMBD)
        m.norm(f"{blk}.ffn_norm", bias=True)
        m.ffn(blk, gate=False, bias=True)


def _qwen2vl(m: Tiny) -> None:
    """models/qwen2vl.cpp: multi-section rope (M-RoPE: time, height, width sections of each head)."""
    m.base()
    m.arr("rope.dimension_sections", [2, 3, 3, 0])
    m.embeddings()
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        m.attention(blk, bias=True)
        m.norm(f"{blk}.ffn_norm")
        m.ffn(blk)


def _olmo(m: Tiny) -> None:
    """models/olmo.cpp: layer norms without any weight (non-parametric), a clamped QKV."""
    m.base(rms=False)
    m.f32("attention.clamp_kqv", 8.0)
    m.mat("token_embd.weight", N_EMBD, m.n_vocab, scale=1.0)
    m.mat("output.weight", N_EMBD, m.n_vocab, scale=0.5)
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.attention(blk)
        m.ffn(blk)


def _arcee(m: Tiny) -> None:
    """models/arcee.cpp: a llama whose MLP is a squared ReLU of one up projection."""
    m.base()
    m.embeddings()
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        m.attention(blk)
        m.norm(f"{blk}.ffn_norm")
        m.ffn(blk, gate=False)


def _granitemoe(m: Tiny) -> None:
    """models/granite-moe.cpp: granite's muP scales around routed experts and a shared expert."""
    m.base(n_ff=32)
    m.f32("logit_scale", 2.0)
    m.f32("residual_scale", 0.5)
    m.f32("embedding_scale", 2.0)
    m.f32("attention.scale", 1.0 / HEAD_DIM)
    m.u32("expert_count", 4)
    m.u32("expert_used_count", 2)
    m.u32("expert_shared_feed_forward_length", 32)
    m.embeddings()
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        m.attention(blk)
        m.norm(f"{blk}.ffn_norm")
        m.experts(blk, 4, 32)
        for part, n_in, n_out in (("gate", N_EMBD, 32), ("up", N_EMBD, 32), ("down", 32, N_EMBD)):
            m.mat(f"{blk}.ffn_{part}_shexp.weight", n_in, n_out)


def _gemma(m: Tiny) -> None:
    """models/gemma.cpp: embeddings scaled by sqrt(n_embd), a GELU-gated MLP, tied output."""
    m.base()
    m.embeddings(output=False)
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        m.attention(blk)
        m.norm(f"{blk}.ffn_norm")
        m.ffn(blk)


def _refact(m: Tiny) -> None:
    """models/refact.cpp: a llama with ALiBi instead of rope."""
    m.base()
    m.embeddings()
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        m.attention(blk)
        m.norm(f"{blk}.ffn_norm")
        m.ffn(blk)


def _qwen(m: Tiny) -> None:
    """models/qwen.cpp: a fused QKV with bias, an MLP of half the stated width."""
    m.base(n_head_kv=N_HEAD)
    m.embeddings()
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        m.mat(f"{blk}.attn_qkv.weight", N_EMBD, 3 * N_EMBD)
        m.vec(f"{blk}.attn_qkv.bias", 3 * N_EMBD)
        m.mat(f"{blk}.attn_output.weight", N_EMBD, N_EMBD)
        m.norm(f"{blk}.ffn_norm")
        m.ffn(blk, n_ff=N_FF // 2)


def _glm4moe(m: Tiny) -> None:
    """models/glm4-moe.cpp: a dense first layer, then sigmoid-gated experts with a selection
    bias (exp_probs_b) and a shared expert."""
    n_ff_exp = 32
    m.base()
    m.u32("expert_count", 4)
    m.u32("expert_used_count", 2)
    m.u32("expert_shared_count", 1)
    m.u32("expert_feed_forward_length", n_ff_exp)
    m.u32("leading_dense_block_count", 1)
    m.flag("expert_weights_norm", True)
    m.embeddings()
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm")
        m.attention(blk, bias=True)
        m.norm(f"{blk}.post_attention_norm")
        if i == 0:
            m.ffn(blk)
            continue
        m.experts(blk, 4, n_ff_exp)
        m.vec(f"{blk}.exp_probs_b.bias", 4)
        for part, n_in, n_out in (("gate", N_EMBD, n_ff_exp), ("up", N_EMBD, n_ff_exp), ("down", n_ff_exp, N_EMBD)):
            m.mat(f"{blk}.ffn_{part}_shexp.weight", n_in, n_out)


def _nemotron(m: Tiny) -> None:
    """models/nemotron.cpp: layer norms with biases, partial rope, a squared-ReLU MLP."""
    m.base(rms=False)
    m.u32("rope.dimension_count", HEAD_DIM // 2)
    m.embeddings(output_norm_bias=True)
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm", bias=True)
        m.attention(blk)
        m.norm(f"{blk}.ffn_norm", bias=True)
        m.ffn(blk, gate=False)


def _jais(m: Tiny) -> None:
    """models/jais.cpp: ALiBi, a fused QKV and a SwiGLU MLP, all with biases."""
    m.base(n_head_kv=N_HEAD, rms=False)
    m.embeddings(output_norm_bias=True)
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm", bias=True)
        m.attention(blk, n_head_kv=N_HEAD, fused=True, bias=True, out_bias=True)
        m.norm(f"{blk}.ffn_norm", bias=True)
        m.ffn(blk, bias=True)


def _t5encoder(m: Tiny) -> None:
    """models/t5encoder.cpp: t5's encoder alone, pooled into an embedding."""
    m.base(n_head_kv=N_HEAD)
    m.u32("attention.relative_buckets_count", 32)
    m.u32("pooling_type", POOLING_MEAN)
    m.mat("token_embd.weight", N_EMBD, m.n_vocab, scale=1.0)
    m.norm("enc.output_norm")
    for i in range(N_LAYER):
        blk = f"enc.blk.{i}"
        m.norm(f"{blk}.attn_norm")
        if i == 0:
            m.vec(f"{blk}.attn_rel_b.weight", N_HEAD, 32)
        for part in ("q", "k", "v"):
            m.mat(f"{blk}.attn_{part}.weight", N_EMBD, N_EMBD)
        m.mat(f"{blk}.attn_o.weight", N_EMBD, N_EMBD)
        m.norm(f"{blk}.ffn_norm")
        m.ffn(blk)


def _llama_like(*, n_layer: int = N_LAYER, rms: bool = True, norm_bias: bool = False, fused: bool = False,
                bias: bool = False, out_bias: bool = False, gate: bool = True, ffn_bias: bool = False,
                post_attention_norm: bool = False) -> Callable[[Tiny], None]:
    """A writer for the architectures whose tensors are a llama's with some of these options."""
    def write(m: Tiny) -> None:
        m.base(n_layer=n_layer, rms=rms)
        m.embeddings(output_norm_bias=norm_bias)
        for i in range(n_layer):
            blk = f"blk.{i}"
            m.norm(f"{blk}.attn_norm", bias=norm_bias)
            m.attention(blk, fused=fused, bias=bias, out_bias=out_bias)
            if post_attention_norm:
                m.norm(f"{blk}.post_attention_norm")
            else:
                m.norm(f"{blk}.ffn_norm", bias=norm_bias)
            m.ffn(blk, gate=gate, bias=ffn_bias)
    return write


@dataclass(frozen=True)
class Arch:
    """One architecture of the check: the name llama.cpp knows it by, how it is run, its writer
    (None: ``gguf_models.write_tiny_gguf`` writes it), and the ops that prove its own path ran."""

    name: str
    kind: str
    write: Callable[[Tiny], None] | None
    ops: tuple[str, ...] = ()
    arch: str = ""        # the GGUF architecture when the case name differs (a reranking bert)

    @property
    def gguf_arch(self) -> str:
        return self.arch or self.name


ARCHITECTURES: tuple[Arch, ...] = (
    Arch("t5", "encdec", _t5, ("FLASH_ATTN_EXT",)),
    Arch("bert", "embed", _bert, ("NORM", "FLASH_ATTN_EXT")),
    Arch("llama", "text", None, ("ROPE",)),
    Arch("qwen2", "text", None, ("ROPE",)),
    Arch("qwen3", "text", None, ("RMS_NORM",)),
    Arch("qwen3moe", "text", None, ("MUL_MAT_ID", "ARGSORT")),
    Arch("mamba", "text", None, ("SSM_CONV", "SSM_SCAN")),
    Arch("jamba", "text", None, ("SSM_SCAN", "MUL_MAT_ID")),
    Arch("gpt2", "text", _gpt2, ("NORM", "UNARY")),
    Arch("phi2", "text", _phi2, ("ROPE",)),
    Arch("gemma2", "text", _gemma2, ("UNARY",)),
    Arch("bloom", "text", _bloom, ("NORM",)),
    Arch("starcoder2", "text", _starcoder2, ("NORM",)),
    Arch("mamba2", "text", _mamba2, ("SSM_CONV", "SSM_SCAN")),
    Arch("rwkv6", "text", _rwkv6, ("RWKV_WKV6",)),
    Arch("deepseek2", "text", _deepseek2, ("MUL_MAT_ID",)),
    Arch("bert-rank", "rank", _bert_rank, ("NORM",), arch="bert"),
    Arch("nomic-bert", "embed", _nomic_bert, ("ROPE",)),
    Arch("granitehybrid", "text", _granitehybrid, ("SSM_SCAN", "FLASH_ATTN_EXT")),
    Arch("qwen2moe", "text", _qwen2moe, ("MUL_MAT_ID",)),
    Arch("falcon", "text", _falcon, ("NORM",)),
    Arch("gptneox", "text", _gptneox, ("NORM",)),
    Arch("olmoe", "text", _olmoe, ("MUL_MAT_ID",)),
    Arch("gemma3", "text", _gemma3, ("RMS_NORM",)),
    Arch("command-r", "text", _command_r, ("NORM",)),
    Arch("stablelm", "text", _stablelm, ("NORM",)),
    Arch("olmo2", "text", _olmo2, ("RMS_NORM",)),
    Arch("rwkv7", "text", _rwkv7, ("RWKV_WKV7",)),
    Arch("gpt-oss", "text", _gpt_oss, ("ADD_ID", "GLU")),
    Arch("lfm2", "text", _lfm2, ("SSM_CONV",)),
    Arch("jina-bert-v2", "embed", _jina_bert_v2, ("NORM",)),
    Arch("modern-bert", "embed", _modern_bert, ("NORM",)),
    Arch("falcon-h1", "text", _falcon_h1, ("SSM_SCAN", "FLASH_ATTN_EXT")),
    Arch("qwen3next", "text", _qwen3next, ("GATED_DELTA_NET", "MUL_MAT_ID")),
    Arch("nemotron_h", "text", _nemotron_h, ("SSM_SCAN", "FLASH_ATTN_EXT")),
    Arch("llama4", "text", _llama4, ("MUL_MAT_ID", "RMS_NORM")),
    Arch("phi3", "text", _phi3, ("GLU",)),
    Arch("mpt", "text", _mpt, ("CLAMP",)),
    Arch("apertus", "text", _apertus, ("UNARY",)),
    Arch("granite", "text", _granite, ("SCALE",)),
    Arch("cohere2", "text", _cohere2, ("NORM",)),
    Arch("exaone4", "text", _exaone4, ("RMS_NORM",)),
    Arch("glm4", "text", _glm4, ("GLU",)),
    Arch("minicpm3", "text", _minicpm3, ("ROPE",)),
    Arch("dbrx", "text", _dbrx, ("MUL_MAT_ID", "CLAMP")),
    Arch("starcoder", "text", _starcoder, ("NORM", "UNARY")),
    Arch("qwen2vl", "text", _qwen2vl, ("ROPE",)),
    Arch("olmo", "text", _olmo, ("NORM", "CLAMP")),
    Arch("arcee", "text", _arcee, ("UNARY",)),
    Arch("granitemoe", "text", _granitemoe, ("MUL_MAT_ID", "SCALE")),
    Arch("gemma", "text", _gemma, ("GLU",)),
    Arch("refact", "text", _refact, ("FLASH_ATTN_EXT",)),
    Arch("qwen", "text", _qwen, ("ROPE",)),
    Arch("glm4moe", "text", _glm4moe, ("MUL_MAT_ID", "UNARY")),
    Arch("nemotron", "text", _nemotron, ("NORM", "UNARY")),
    Arch("jais", "text", _jais, ("GLU",)),
    Arch("t5encoder", "embed", _t5encoder, ("SOFT_MAX",)),
    # llama-like tensors, each through its own graph builder (models/<arch>.cpp)
    Arch("smollm3", "text", _llama_like(n_layer=4), ("ROPE",)),          # no rope in every fourth layer
    Arch("internlm2", "text", _llama_like(fused=True), ("ROPE",)),
    Arch("baichuan", "text", _llama_like(), ("FLASH_ATTN_EXT",)),     # not 7B: ALiBi, no rope
    Arch("orion", "text", _llama_like(rms=False, norm_bias=True), ("NORM",)),
    Arch("xverse", "text", _llama_like(), ("ROPE",)),
    Arch("exaone", "text", _llama_like(), ("ROPE",)),
    Arch("codeshell", "text", _llama_like(rms=False, norm_bias=True, bias=True, out_bias=True, gate=False,
                                          ffn_bias=True), ("NORM", "UNARY")),
    Arch("seed_oss", "text", _llama_like(post_attention_norm=True), ("ROPE",)),
)
BY_NAME = {a.name: a for a in ARCHITECTURES}


def write_arch_gguf(path: Path, name: str, *, seed: int = 0) -> Path:
    """Write the tiny model of architecture case ``name`` (``ARCHITECTURES``) to ``path``."""
    arch = BY_NAME[name]
    path = Path(path)
    if arch.write is None:
        small = TinyConfig(n_embd=N_EMBD, n_head=N_HEAD, n_head_kv=N_HEAD_KV, n_ff=N_FF, n_ff_exp=64,
                           ssm_d_inner=2 * N_EMBD, ssm_dt_rank=8)
        return write_tiny_gguf(path, arch.gguf_arch, "f16", seed=seed, config=small)
    m = Tiny(path, arch.gguf_arch, seed)
    arch.write(m)
    m.close()
    return path
