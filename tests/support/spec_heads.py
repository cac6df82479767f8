"""Tiny targets and the four speculative heads of the pinned llama.cpp (EAGLE-3, MTP, DFlash,
DSpark), written with ``gguf``, whose drafts the target actually accepts.

Why this construction: a head trained on nothing agrees with a random target by luck only, so
acceptance would prove nothing. Here the target is *bigram-dominated*: its layers add a small
perturbation (``TargetConfig.layer_scale``) to the token embedding in the residual stream, so
its next token is, most of the time, B(current token) = argmax H . rmsnorm(E[token]) * w_out
(H the output head, E the embedding table, w_out the final norm). Every head is built from the
target's own E, w_out and H so that it computes that same B:

- EAGLE-3 (one decoder layer reading the target's layers 0, 1, 2): Q = K = s * the token's
  normalized embedding, so each position attends to itself (and to earlier copies of its own
  token), V passes the embedding through, ``wo`` scales it, and the inherited output head
  turns it into B(token). The fused target features enter through ``fc`` and a residual
  scaled to ``FEATURE_GAIN``: they perturb, they do not decide. Chained drafts follow B, so
  several per pass are accepted. With ``d2t`` the head's vocabulary is the image of B plus a
  few other tokens and its output head the target's rows for them.
- MTP (the target's own next-token layer, ``blk.N.nextn.*``, hy_v3): ``eh_proj`` keeps the
  normalized token half of [token; hidden], the block adds a small perturbation, and the shared
  head gives B(token).
- DFlash (block diffusion: [anchor, MASK...] attends non-causally over itself and the injected
  target features): one embedding dimension (``FLAG``) is +1 for every real token and -1 for
  MASK; the layer's Q and K read only that dimension (the slowest RoPE pair, so positions
  hardly rotate it), so every MASK row attends to the anchor and predicts B(anchor). The
  injected features have a zero FLAG component (``enc.output_norm``), so they score 0 against
  a MASK query and get no weight. Only the first draft of a block follows B: acceptance is
  one token per pass unless B repeats.
- DSpark (DFlash plus a Markov head): the Markov head is B itself, exactly: ``markov_w1[t]``
  = rmsnorm(E[t]) * w_out and ``markov_w2`` = H, so its bias is the target's bigram logits,
  chained through the block by argmax; the backbone's logits are scaled down
  (``DSPARK_BACKBONE_GAIN``). Whole blocks follow B.

Shapes: numpy arrays are [rows = outputs, cols = inputs], ggml ``ne`` reversed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType

from support.gguf_models import tiny_vocab

HEADS = ("eagle3", "mtp", "dflash", "dspark")
FLAG = 0                      # the embedding dimension that tells a real token (+1) from MASK (-1)
TARGET_LAYERS = (0, 1, 2)     # the target layer inputs EAGLE-3 and DFlash read (layer 0 input = embeddings)
SELF_ATTN_SCALE = 2.5         # EAGLE-3 Q = K = s * x: own token scores ~8 s^2 = 50, others ~s^2 = 6 (std)
FLAG_NORM = 3.0               # DFlash q/k norm weight: MASK query . anchor key = 8 * 3 * 3 = 72 after kq_scale
PASS_GAIN = 4.0               # wo = gain * I: the attended embedding dominates the residual stream
FEATURE_GAIN = 0.05           # EAGLE-3 hidden_norm weight: the target features' share of the residual
DSPARK_BACKBONE_GAIN = 1e-3   # DSpark: the backbone's logits, scaled under the Markov head's
BLOCK_SIZE = 8                # DFlash / DSpark trained block (drafts <= 7 / 8)


@dataclass(frozen=True)
class TargetConfig:
    n_layer: int = 3
    n_embd: int = 256
    n_head: int = 4
    n_head_kv: int = 4
    n_ff: int = 512
    n_ctx: int = 1024
    rms_eps: float = 1e-5
    rope_base: float = 10000.0
    weight_scale: float = 0.08
    head_scale: float = 0.5
    layer_scale: float = 0.1   # wo and ffn_down of every layer, relative to weight_scale: the non-bigram part

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


@dataclass(frozen=True)
class Target:
    """A written target and the arrays its heads are derived from."""

    path: Path
    arch: str
    config: TargetConfig
    embd: np.ndarray        # [n_vocab, n_embd]
    out_norm: np.ndarray    # [n_embd]
    output: np.ndarray      # [n_vocab, n_embd]
    mask_id: int

    def normed_embd(self) -> np.ndarray:
        """rmsnorm(E[t]) * w_out for every token t: the hidden state whose head output is B(t)."""
        e = self.embd.astype(np.float32)
        rms = np.sqrt((e * e).mean(axis=1, keepdims=True) + self.config.rms_eps)
        return e / rms * self.out_norm

    def bigram(self) -> np.ndarray:
        """B(t) for every token t (fp32 numpy; the device's rounding may differ at near-ties)."""
        return (self.normed_embd() @ self.output.astype(np.float32).T).argmax(axis=1)


def spec_vocab() -> tuple[list[str], list[float], list[int], int]:
    """The tiny SentencePiece vocabulary plus a <mask> control token (DFlash's MASK)."""
    tokens, scores, types = tiny_vocab()
    mask_id = len(tokens)
    return [*tokens, "<mask>"], [*scores, 0.0], [*types, int(TokenType.CONTROL)], mask_id


def _add_vocab(writer: GGUFWriter, *, mask: bool) -> int:
    tokens, scores, types, mask_id = spec_vocab()
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if mask:
        writer.add_mask_token_id(mask_id)
    return mask_id


def _f16(writer: GGUFWriter, name: str, array: np.ndarray) -> None:
    writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float16))


def _f32(writer: GGUFWriter, name: str, array: np.ndarray) -> None:
    writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))


def _finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _common_kv(writer: GGUFWriter, c: TargetConfig, *, n_layer: int, n_head_kv: int, n_ff: int) -> None:
    writer.add_context_length(c.n_ctx)
    writer.add_embedding_length(c.n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(c.n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_layer_norm_rms_eps(c.rms_eps)
    writer.add_rope_freq_base(c.rope_base)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)


def write_target(path: Path, *, mtp: bool = False, seed: int = 0, config: TargetConfig = TargetConfig()) -> Target:
    """A bigram-dominated target: llama, or with ``mtp`` hy_v3 with one next-token layer after
    its ``n_layer`` trunk layers (``nextn_predict_layers`` = 1, tensors ``blk.N.nextn.*``)."""
    rng = np.random.default_rng(seed)
    c = config
    arch = "hy_v3" if mtp else "llama"

    def rand(*shape: int, scale: float = c.weight_scale) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm_weight(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-bigram-{arch}")
    _common_kv(writer, c, n_layer=c.n_layer + (1 if mtp else 0), n_head_kv=c.n_head_kv, n_ff=c.n_ff)
    if mtp:
        writer.add_uint32(f"{arch}.nextn_predict_layers", 1)
        writer.add_uint32(f"{arch}.expert_feed_forward_length", c.n_ff)   # read by hy_v3 even without experts
    mask_id = _add_vocab(writer, mask=False)
    writer.add_vocab_size(mask_id + 1)
    writer.add_file_type(1)

    n_vocab = mask_id + 1
    embd = rand(n_vocab, c.n_embd, scale=1.0)
    embd[:, FLAG] = 1.0
    output = rand(n_vocab, c.n_embd, scale=c.head_scale)
    output[mask_id] = 0.0                      # the target never proposes MASK
    out_norm = norm_weight(c.n_embd)
    _f16(writer, "token_embd.weight", embd)
    _f32(writer, "output_norm.weight", out_norm)
    _f16(writer, "output.weight", output)
    embd, output = embd.astype(np.float16).astype(np.float32), output.astype(np.float16).astype(np.float32)
    q_dim, kv_dim = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    small = c.weight_scale * c.layer_scale
    for i in range(c.n_layer + (1 if mtp else 0)):
        blk = f"blk.{i}"
        _f32(writer, f"{blk}.attn_norm.weight", norm_weight(c.n_embd))
        _f16(writer, f"{blk}.attn_q.weight", rand(q_dim, c.n_embd))
        _f16(writer, f"{blk}.attn_k.weight", rand(kv_dim, c.n_embd))
        _f16(writer, f"{blk}.attn_v.weight", rand(kv_dim, c.n_embd))
        _f16(writer, f"{blk}.attn_output.weight", rand(c.n_embd, q_dim, scale=small))
        if mtp:
            _f32(writer, f"{blk}.attn_q_norm.weight", norm_weight(c.head_dim))
            _f32(writer, f"{blk}.attn_k_norm.weight", norm_weight(c.head_dim))
        _f32(writer, f"{blk}.ffn_norm.weight", norm_weight(c.n_embd))
        _f16(writer, f"{blk}.ffn_gate.weight", rand(c.n_ff, c.n_embd))
        _f16(writer, f"{blk}.ffn_up.weight", rand(c.n_ff, c.n_embd))
        _f16(writer, f"{blk}.ffn_down.weight", rand(c.n_embd, c.n_ff, scale=small))
        if mtp and i == c.n_layer:
            # [enorm(E[x]); hnorm(h)] -> the token half: the block's residual starts at rmsnorm(E[x])
            eh = np.zeros((c.n_embd, 2 * c.n_embd), np.float32)
            eh[:, :c.n_embd] = np.eye(c.n_embd)
            _f16(writer, f"{blk}.nextn.eh_proj.weight", eh)
            _f32(writer, f"{blk}.nextn.enorm.weight", np.ones(c.n_embd, np.float32))
            _f32(writer, f"{blk}.nextn.hnorm.weight", np.ones(c.n_embd, np.float32))
    _finish(writer)
    return Target(Path(path), arch, c, embd, out_norm, output, mask_id)


def _head_vocab_and_kv(writer: GGUFWriter, arch: str, target: Target, *, n_ff: int, mask: bool) -> None:
    c = target.config
    _common_kv(writer, c, n_layer=1, n_head_kv=c.n_head, n_ff=n_ff)
    writer.add_array(f"{arch}.target_layers", list(TARGET_LAYERS))
    _add_vocab(writer, mask=mask)
    writer.add_vocab_size(target.embd.shape[0])
    writer.add_file_type(1)


def _ffn(writer: GGUFWriter, rng: np.random.Generator, c: TargetConfig, n_ff: int) -> None:
    """A small SwiGLU FFN: it runs (its matmuls reach the device) and perturbs the residual a little."""
    _f32(writer, "blk.0.ffn_norm.weight", np.ones(c.n_embd, np.float32))
    _f16(writer, "blk.0.ffn_gate.weight", rng.standard_normal((n_ff, c.n_embd)) * c.weight_scale)
    _f16(writer, "blk.0.ffn_up.weight", rng.standard_normal((n_ff, c.n_embd)) * c.weight_scale)
    _f16(writer, "blk.0.ffn_down.weight", rng.standard_normal((c.n_embd, n_ff)) * c.weight_scale * c.layer_scale)


def draft_vocab(target: Target, extra: int = 32, seed: int = 0) -> np.ndarray:
    """EAGLE-3's reduced vocabulary: every token B can produce, plus ``extra`` others (sorted ids)."""
    image = set(int(t) for t in target.bigram())
    rest = np.array(sorted(set(range(target.embd.shape[0])) - image - {target.mask_id}))
    picked = np.random.default_rng(seed).choice(rest, size=min(extra, len(rest)), replace=False)
    return np.array(sorted(image | set(int(t) for t in picked)), dtype=np.int64)


def write_eagle3(path: Path, target: Target, *, d2t: bool = False, seed: int = 1) -> Path:
    """An EAGLE-3 head of ``target`` (arch ``eagle3``: ``fc``, one layer, ``d2t`` optional)."""
    rng = np.random.default_rng(seed)
    c = target.config
    n, n_ff = c.n_embd, c.n_ff
    writer = GGUFWriter(str(path), "eagle3")
    writer.add_name("tiny-eagle3-head")
    _head_vocab_and_kv(writer, "eagle3", target, n_ff=n_ff, mask=False)
    writer.add_uint32("eagle3.target_hidden_size", n)
    writer.add_bool("eagle3.norm_before_residual", True)

    _f16(writer, "fc.weight", rng.standard_normal((n, len(TARGET_LAYERS) * n)) * c.weight_scale)
    _f32(writer, "output_norm.weight", target.out_norm)
    _f16(writer, "token_embd.weight", target.embd)        # own copy (optional in eagle3), so with d2t nothing is shared
    if d2t:
        ids = draft_vocab(target)
        _f16(writer, "output.weight", target.output[ids])
        writer.add_tensor("d2t", ids, raw_dtype=GGMLQuantizationType.I64)
    # the layer reads [rmsnorm(E[x]); hidden_norm(g)] (2n wide); Q, K, V use the token half only
    token_half = np.zeros((n, 2 * n), np.float32)
    token_half[:, :n] = np.eye(n)
    _f32(writer, "blk.0.attn_norm.weight", np.ones(n, np.float32))
    _f32(writer, "blk.0.attn_norm_2.weight", np.full(n, FEATURE_GAIN, np.float32))
    _f16(writer, "blk.0.attn_q.weight", SELF_ATTN_SCALE * token_half)
    _f16(writer, "blk.0.attn_k.weight", SELF_ATTN_SCALE * token_half)
    _f16(writer, "blk.0.attn_v.weight", token_half)
    _f16(writer, "blk.0.attn_output.weight", PASS_GAIN * np.eye(n))
    _ffn(writer, rng, c, n_ff)
    _finish(writer)
    return Path(path)


def write_dflash(path: Path, target: Target, *, dspark: bool = False, seed: int = 2) -> Path:
    """A DFlash head of ``target`` (arch ``dflash``), with ``dspark`` the DSpark Markov head too."""
    rng = np.random.default_rng(seed)
    c = target.config
    n, n_ff, hd = c.n_embd, c.n_ff, c.head_dim
    writer = GGUFWriter(str(path), "dflash")
    writer.add_name("tiny-dspark-head" if dspark else "tiny-dflash-head")
    _head_vocab_and_kv(writer, "dflash", target, n_ff=n_ff, mask=True)
    writer.add_uint32("dflash.block_size", BLOCK_SIZE)

    embd = target.embd.copy()
    embd[target.mask_id] = 0.0
    embd[target.mask_id, FLAG] = -1.0
    _f16(writer, "token_embd.weight", embd)               # own embeddings (MASK), so own head too
    _f16(writer, "output.weight", target.output)
    _f16(writer, "fc.weight", rng.standard_normal((n, len(TARGET_LAYERS) * n)) * c.weight_scale)
    enc_norm = np.ones(n, np.float32)
    enc_norm[FLAG] = 0.0                                   # injected features: no FLAG, no key
    _f32(writer, "enc.output_norm.weight", enc_norm)
    _f32(writer, "output_norm.weight", target.out_norm * (DSPARK_BACKBONE_GAIN if dspark else 1.0))
    # Q and K: the FLAG dimension into the last dimension of every head (the slowest RoPE pair)
    flag_qk = np.zeros((n, n), np.float32)
    for h in range(c.n_head):
        flag_qk[h * hd + hd - 1, FLAG] = 1.0
    _f32(writer, "blk.0.attn_norm.weight", np.ones(n, np.float32))
    _f16(writer, "blk.0.attn_q.weight", flag_qk)
    _f16(writer, "blk.0.attn_k.weight", flag_qk)
    _f16(writer, "blk.0.attn_v.weight", np.eye(n))
    _f16(writer, "blk.0.attn_output.weight", PASS_GAIN * np.eye(n))
    _f32(writer, "blk.0.attn_q_norm.weight", np.full(hd, FLAG_NORM, np.float32))
    _f32(writer, "blk.0.attn_k_norm.weight", np.full(hd, -FLAG_NORM, np.float32))   # MASK (-) . real (+) > 0
    _ffn(writer, rng, c, n_ff)
    if dspark:
        _f32(writer, "markov_w1.weight", target.normed_embd())
        _f16(writer, "markov_w2.weight", target.output)
    _finish(writer)
    return Path(path)
