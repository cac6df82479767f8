"""Validator rules for the recurrent and state-space ops: SSM_CONV, SSM_SCAN (its ids
range-checked at run time), GATED_DELTA_NET, RWKV_WKV6, RWKV_WKV7, GATED_LINEAR_ATTN, SOLVE_TRI.
Each restates the shapes and types the ggml-cpu kernel assumes. Why rules as data: docs/decisions.md "server/ops/rules.py"."""

from __future__ import annotations

from ggml_rknpu.libggml.enums import GgmlOp
from ggml_rknpu.server.ops import geometry as geo
from ggml_rknpu.server.ops.rulekit import (
    F32,
    I32,
    Index,
    Node,
    RpcTensor,
    Rule,
    dst_is,
    is_type,
    need,
)


def ssm_conv(n: Node) -> None:
    sx, c = n.s(0), n.s(1)
    for t, w in ((sx, "sx"), (c, "conv weight")):
        is_type(t, F32, f"ssm_conv {w}")
    need(geo.is_3d(sx) and geo.is_matrix(c), "ssm_conv ranks")
    d_conv, d_inner = c.ne[0], c.ne[1]
    n_t = sx.ne[0] - d_conv + 1
    need(n_t >= 0 and sx.ne[1] == d_inner and sx.nb[1] == sx.ne[0] * 4, "ssm_conv shapes do not fit")
    dst_is(n, F32, (d_inner, n_t, sx.ne[2], 1), contiguous=False)


def ssm_scan(n: Node) -> list[Index]:
    s, x, dt, A, B, C, ids = (n.s(i) for i in range(7))
    for t, w in ((s, "s"), (x, "x"), (dt, "dt"), (A, "A"), (B, "B"), (C, "C")):
        is_type(t, F32, f"ssm_scan {w}")
    is_type(ids, I32, "ssm_scan ids")
    K = n.i32(0)
    need(K >= 1, "ssm_scan K >= 1")
    need(geo.is_contiguous(s) and geo.is_contiguous(dt) and geo.is_contiguous(A), "ssm_scan contiguity")
    for t in (x, B, C):
        need(t.nb[1] == t.ne[0] * t.nb[0], "ssm_scan x/B/C rows contiguous")
    need(geo.are_same_shape(B, C), "ssm_scan B and C differ")
    d_state, head_dim, n_head, n_tok, n_seqs = s.ne[0], x.ne[0], x.ne[1], x.ne[2], x.ne[3]
    need(dt.ne[:3] == (n_head, n_tok, n_seqs) and geo.is_3d(dt) and s.ne[1] == head_dim and s.ne[2] == n_head
         and B.ne[0] == d_state and B.ne[2] == n_tok and B.ne[3] == n_seqs and ids.ne[0] == n_seqs
         and geo.is_vector(ids) and A.ne[1] == n_head and geo.is_matrix(A) and B.ne[1] >= 1
         and n_head % B.ne[1] == 0, "ssm_scan shapes do not fit")
    if A.ne[0] != 1:
        need(A.ne[0] == d_state and K == 1, "mamba-1 A and K")
    dst_is(n, F32, (geo.nelements(x) + K * d_state * head_dim * n_head * ids.ne[0], 1, 1, 1))
    return [(6, s.ne[3])]


def gated_delta_net(n: Node) -> None:
    q, k, v, g, beta, state = (n.s(i) for i in range(6))
    for t, w in ((q, "q"), (k, "k"), (v, "v"), (g, "g"), (beta, "beta"), (state, "state")):
        is_type(t, F32, f"gated_delta_net {w}")
    need(all(geo.is_contiguous_rows(t) for t in (q, k, v))
         and all(geo.is_contiguous(t) for t in (g, beta, state)), "gated_delta_net contiguity")
    S_v, H, T, B = v.ne
    K = n.i32(0)
    need(g.ne[0] in (1, S_v) and beta.ne[0] == 1 and state.ne == (S_v, S_v, H, B) and K >= 1,
         "gated_delta_net shapes do not fit")
    need(q.ne[0] == k.ne[0] == S_v and q.ne[1:] == k.ne[1:] and q.ne[2:] == (T, B) and H % q.ne[1] == 0
         and g.ne[1:] == (H, T, B) and beta.ne[1:] == (H, T, B), "gated_delta_net q/k/g/beta shapes")
    dst_is(n, F32, (S_v * H, T * B + K * S_v * B, 1, 1))


def _wkv_common(n: Node, ins: tuple[RpcTensor, ...], state: RpcTensor) -> None:
    for t in (*ins, state):
        is_type(t, F32, "rwkv/gla input")
        need(geo.is_contiguous(t), "rwkv/gla inputs are contiguous")
    S, H, T = ins[0].ne[0], ins[0].ne[1], ins[0].ne[2]
    n_seqs = state.ne[1]
    need(geo.nelements(state) == S * S * H * n_seqs, "rwkv/gla state size")
    dst_is(n, F32, (S * H, T + S * n_seqs, 1, 1))


def rwkv_wkv6(n: Node) -> None:
    k, v, r, tf, td, state = (n.s(i) for i in range(6))
    S, H, T = k.ne[0], k.ne[1], k.ne[2]
    need(all(t.ne[:3] == (S, H, T) for t in (v, r, td)) and geo.nelements(tf) == S * H, "wkv6 shapes")
    _wkv_common(n, (k, v, r, tf, td), state)


def rwkv_wkv7(n: Node) -> None:
    r, w, k, v, a, b, state = (n.s(i) for i in range(7))
    S, H, T = k.ne[0], k.ne[1], k.ne[2]
    # the SIMD kernel loads GGML_F32_STEP floats at a time (64 with AVX-512, simd-mappings.h) and has
    # no tail loop (ops.cpp rwkv_wkv7_f32): smaller or ragged heads read past their rows
    need(S % 64 == 0, f"wkv7 head size {S} is not a multiple of 64")
    need(all(t.ne[:3] == (S, H, T) for t in (r, w, v, a, b)), "wkv7 shapes")
    _wkv_common(n, (k, r, w, v, a, b), state)


def gated_linear_attn(n: Node) -> None:
    k, v, q, g, state = (n.s(i) for i in range(5))
    S, H, T = k.ne[0], k.ne[1], k.ne[2]
    need(all(t.ne[:3] == (S, H, T) for t in (v, q, g)), "gla shapes")
    _wkv_common(n, (k, v, q, g), state)


def solve_tri(n: Node) -> None:
    a, b = n.s(0), n.s(1)
    is_type(a, F32, "solve_tri A")
    is_type(b, F32, "solve_tri B")
    need(a.ne[0] == a.ne[1] == b.ne[1] and a.ne[2:] == b.ne[2:] and geo.is_contiguous(a) and geo.is_contiguous(b),
         "solve_tri shapes")
    dst_is(n, F32, b.ne)


RULES: dict[int, Rule] = {
    GgmlOp.SSM_CONV: Rule(2, ssm_conv), GgmlOp.SSM_SCAN: Rule(7, ssm_scan),
    GgmlOp.GATED_DELTA_NET: Rule(6, gated_delta_net),
    GgmlOp.RWKV_WKV6: Rule(6, rwkv_wkv6), GgmlOp.RWKV_WKV7: Rule(7, rwkv_wkv7),
    GgmlOp.GATED_LINEAR_ATTN: Rule(5, gated_linear_attn), GgmlOp.SOLVE_TRI: Rule(2, solve_tri),
}
