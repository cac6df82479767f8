"""Validator rules for the DeepSeek-V4 ops: LIGHTNING_INDEXER (sparse-attention key scores) and the
hyper-connection ops DSV4_HC_COMB / DSV4_HC_PRE / DSV4_HC_POST.

From the pinned ``ggml.c`` builders (llama.cpp 0c1e570: ggml_lightning_indexer, ggml_dsv4_hc_comb,
ggml_dsv4_hc_pre_impl, ggml_dsv4_hc_post) and ``ggml-cpu/ops.cpp`` kernels of the same names: all
f32 but the indexer's keys and mask; the hyper-connection kernels follow every stride of every
tensor (``*(float *)(data + i0*nb0 + ...)``), the indexer asserts nb0 the element size.
"""

from __future__ import annotations

from ggml_rknpu.libggml.enums import GgmlOp
from ggml_rknpu.server.ops import geometry as geo
from ggml_rknpu.server.ops.rulekit import (ANY, BF16, F16, F32, OPERAND_ONLY, QUANTIZED, Node, Rule, dst_is, is_type,
                                         need, unit_stride)

# K types of the indexer: f32 read as is, or a type whose ggml type traits have to_float
# (ggml.c type_traits: every quantized type but the operand-only Q8_1 and Q8_K)
INDEXER_K_TYPES = frozenset({F32, F16, BF16}) | (QUANTIZED - OPERAND_ONLY)
HC = 4                                  # ggml_dsv4_hc_comb: GGML_ASSERT(hc == 4), the kernel's constexpr
HC_MIX_DIM = (2 + HC) * HC
# Sinkhorn iterations of DSV4_HC_COMB: the builder only asks > 0; DeepSeek-V4 uses 20 (its GGUF's
# sinkhorn_iters). Bounded so that a malformed n_iter (2**30) cannot hold the server for minutes.
HC_MAX_ITER = 1024


def lightning_indexer(n: Node) -> None:
    """ggml_lightning_indexer(q [d, heads, tokens, streams] f32, k [d, 1, kv, streams], weights
    [heads, tokens, 1, streams] f32, mask [kv, tokens, 1, m] f16, streams % m == 0) -> f32
    [kv, tokens, 1, streams]. ggml_compute_forward_lightning_indexer converts each K row with
    to_float (so a whole number of blocks) and asserts nb0 = element size everywhere."""
    q, k, w, m = (n.s(i) for i in range(4))
    is_type(q, F32, "lightning_indexer q")
    is_type(k, INDEXER_K_TYPES, "lightning_indexer k")
    is_type(w, F32, "lightning_indexer weights")
    is_type(m, F16, "lightning_indexer mask")
    need(q.ne[0] == k.ne[0] and k.ne[0] % geo.block_size(k) == 0 and m.ne[0] == k.ne[2] and q.ne[1] == w.ne[0]
         and k.ne[1] == 1 and m.ne[1] == q.ne[2] and q.ne[2] == w.ne[1] and w.ne[2] == 1 and m.ne[2] == 1
         and q.ne[3] == k.ne[3] == w.ne[3] and m.ne[3] >= 1 and w.ne[3] % m.ne[3] == 0,
         "lightning_indexer shapes do not fit")
    for t, what in ((q, "q"), (k, "k"), (w, "weights"), (m, "mask"), (n.dst, "dst")):
        unit_stride(t, f"lightning_indexer {what}")
    dst_is(n, F32, (k.ne[2], q.ne[2], 1, q.ne[3]))


def dsv4_hc_comb(n: Node) -> None:
    """ggml_dsv4_hc_comb(mixes [24, tokens] f32, scale [>= 3] f32, base [24] f32, eps, n_iter > 0) ->
    f32 [4, 4, tokens] (hc = 4: (2 + hc) * hc mix values per token)."""
    mixes, scale, base = n.s(0), n.s(1), n.s(2)
    for t, what in ((mixes, "mixes"), (scale, "scale"), (base, "base")):
        is_type(t, F32, f"dsv4_hc_comb {what}")
    need(mixes.ne[0] == HC_MIX_DIM and geo.is_matrix(mixes), f"dsv4_hc_comb mixes must be [{HC_MIX_DIM}, tokens]")
    need(scale.ne[0] >= 3 and geo.is_vector(scale), "dsv4_hc_comb scale must be a vector of >= 3")
    need(base.ne[0] == HC_MIX_DIM and geo.is_vector(base), f"dsv4_hc_comb base must be a vector of {HC_MIX_DIM}")
    need(0 < n.i32(1) <= HC_MAX_ITER, f"dsv4_hc_comb n_iter {n.i32(1)} must be in [1, {HC_MAX_ITER}]")
    dst_is(n, F32, (HC, HC, mixes.ne[1], 1))


def dsv4_hc_pre(n: Node) -> None:
    """ggml_dsv4_hc_pre_impl(x [embd, hc, tokens] f32, weights f32: [hc, tokens] or, gated
    (op_params[1] = 1), [embd, hc, tokens]) -> f32 [embd, tokens]."""
    x, w = n.s(0), n.s(1)
    is_type(x, F32, "dsv4_hc_pre x")
    is_type(w, F32, "dsv4_hc_pre weights")
    gated = n.i32(1)
    need(gated in (0, 1), "dsv4_hc_pre 'gated' must be 0 or 1")
    embd, hc, tokens = x.ne[0], x.ne[1], x.ne[2]
    need(hc > 0 and x.ne[3] == 1, "dsv4_hc_pre x must be [embd, hc > 0, tokens]")
    want = (embd, hc, tokens, 1) if gated else (hc, tokens, 1, 1)
    need(tuple(w.ne) == want, f"dsv4_hc_pre weights {w.ne}, ggml takes {want}")
    dst_is(n, F32, (embd, tokens, 1, 1))


def dsv4_hc_post(n: Node) -> None:
    """ggml_dsv4_hc_post(x [embd, tokens] f32, residual [embd, hc, tokens] f32, post [hc, tokens]
    f32, optional comb [hc, hc, tokens] f32) -> f32 [embd, hc, tokens]."""
    x, res, post, comb = n.s(0), n.s(1), n.s(2), n.src[3]
    for t, what in ((x, "x"), (res, "residual"), (post, "post")):
        is_type(t, F32, f"dsv4_hc_post {what}")
    embd, tokens, hc = x.ne[0], x.ne[1], res.ne[1]
    need(hc > 0 and geo.is_matrix(x) and tuple(res.ne) == (embd, hc, tokens, 1)
         and tuple(post.ne) == (hc, tokens, 1, 1), "dsv4_hc_post shapes do not fit")
    if comb is not None:
        is_type(comb, F32, "dsv4_hc_post comb")
        need(tuple(comb.ne) == (hc, hc, tokens, 1), f"dsv4_hc_post comb must be [{hc}, {hc}, {tokens}]")
    dst_is(n, F32, (embd, hc, tokens, 1))


RULES: dict[int, Rule] = {
    GgmlOp.LIGHTNING_INDEXER: Rule(4, lightning_indexer),
    GgmlOp.DSV4_HC_COMB: Rule(3, dsv4_hc_comb, strided=ANY), GgmlOp.DSV4_HC_PRE: Rule(2, dsv4_hc_pre, strided=ANY),
    GgmlOp.DSV4_HC_POST: Rule(3, dsv4_hc_post, optional=1, strided=ANY),
}
