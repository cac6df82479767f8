"""Validator rules for the ops of ggml's backward pass and optimizer: ACC, SET, OUT_PROD, the *_BACK
ops, CROSS_ENTROPY_LOSS(_BACK), OPT_STEP_ADAMW / OPT_STEP_SGD.

Invariants: ACC and SET's strided view of src0 (op_params nb1, nb2, nb3, offset) lies
wholly inside src0, every byte of its last element included (ggml's own assert checks only
where that element starts), with element-aligned strides; kernels that walk rows by
``nb[1]`` alone get ``ggml_is_contiguous_1`` sources (their debug-only asserts vanish in a
release build). Each rule names the builder and kernel it restates."""

from __future__ import annotations

from ggml_rknpu.libggml.enums import GgmlOp, GgmlType
from ggml_rknpu.server.ops import geometry as geo
from ggml_rknpu.server.ops.rulekit import (F16, F32, I32, Index, Node, Rule, dst_is, finite, is_type, like, need,
                                         unit_stride)

# src0 types of ggml_compute_forward_out_prod_q_f32 (the dispatch in ggml_compute_forward_out_prod)
OUT_PROD_QUANTIZED = frozenset(int(GgmlType[n]) for n in (
    "Q1_0", "Q2_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "NVFP4", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
    "Q6_K", "TQ1_0", "TQ2_0", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ2_S"))
ADAMW_PARAMS, SGD_PARAMS = 7, 2          # ggml_opt_step_adamw / _sgd: alpha, beta1, beta2, eps, wd, beta1h, beta2h


def _view_into(n: Node, what: str) -> None:
    """ACC / SET: src1 written (added) into the view of src0 that op_params 0-3 describe."""
    a, b = n.s(0), n.s(1)
    need(geo.is_contiguous(a), f"{what} needs a contiguous src0")
    unit_stride(b, f"{what} src1")
    nb1, nb2, nb3, offset, inplace = (n.i32(k) for k in range(5))
    ts = geo.type_size(a)
    need(all(x >= 0 and x % ts == 0 for x in (nb1, nb2, nb3, offset)),
         f"{what} view strides and offset must be non-negative multiples of the element size")
    need(inplace in (0, 1), f"{what} 'inplace' must be 0 or 1")
    need(geo.nelements(b) <= geo.nelements(a), f"{what} src1 has more elements than src0")
    if not geo.is_empty(b):
        end = offset + (b.ne[1] - 1) * nb1 + (b.ne[2] - 1) * nb2 + (b.ne[3] - 1) * nb3 + b.ne[0] * ts
        need(end <= geo.nelements(a) * ts, f"{what} view ends at byte {end}, past src0's {geo.nelements(a) * ts}")
    like(n, contiguous=True)
    if inplace:                     # the kernel then skips copying src0 into dst: dst must be src0's bytes
        need((n.dst.buffer, n.dst.data) == (a.buffer, a.data), f"inplace {what} must write src0 itself")


def acc(n: Node) -> None:
    """ggml_acc_impl (f32 only, a contiguous, nelements(b) <= nelements(a); dst = dup/view of a);
    ggml_compute_forward_acc_f32 asserts dst and src0 contiguous and nb10 = 4."""
    is_type(n.s(0), F32, "acc src0")
    is_type(n.s(1), F32, "acc src1")
    _view_into(n, "acc")


def set_(n: Node) -> None:
    """ggml_set_impl (dst = dup/view of a, offset < 2**30); ggml_compute_forward_set_f32 / _i32: src0
    f32 or i32, contiguous like dst, src1 rows of the same type copied with ggml_vec_cpy."""
    a, b = n.s(0), n.s(1)
    is_type(a, frozenset({F32, I32}), "set src0")
    need(b.type == a.type, "set src1 must have src0's type")
    need(n.i32(3) < 1 << 30, "set offset must be below 2**30")
    _view_into(n, "set")


def out_prod(n: Node) -> None:
    """ggml_out_prod: a [m, k, ...] x b [n, k, ...] -> f32 [m, n, b2, b3], a broadcast over dims 2-3,
    a not transposed. ggml_compute_forward_out_prod: f32 src0 (or f16 / the quantized types of
    out_prod_q_f32, then without broadcast: ggml-cpu supports_op), f32 src1 read through its
    strides, nb00 the element size, dst zeroed densely."""
    a, b = n.s(0), n.s(1)
    is_type(a, frozenset({F32, F16}) | OUT_PROD_QUANTIZED, "out_prod src0")
    is_type(b, F32, "out_prod src1")
    need(a.ne[1] == b.ne[1] and b.ne[2] % a.ne[2] == 0 and b.ne[3] % a.ne[3] == 0,
         f"out_prod shapes {a.ne} x {b.ne} do not fit")
    need(not geo.is_transposed(a), "out_prod src0 is transposed")
    unit_stride(a, "out_prod src0")
    if a.type != F32:
        need(a.ne[2] == b.ne[2] and a.ne[3] == b.ne[3], "out_prod of f16/quantized src0 does not broadcast")
        need(a.ne[0] % geo.block_size(a) == 0, "out_prod src0 rows are not whole blocks")
    dst_is(n, F32, (a.ne[0], b.ne[0], b.ne[2], b.ne[3]))


def get_rows_back(n: Node) -> list[Index]:
    """ggml_get_rows_back(a grads [n, r], b i32 rows, c: only its shape) -> f32 [n, c.ne1].
    ggml_compute_forward_get_rows_back: f32/f16 grads, one grad row read per index
    (nelements(b) of them), the indices read as a dense i32 array, dst contiguous."""
    a, b = n.s(0), n.s(1)
    is_type(a, frozenset({F32, F16}), "get_rows_back grads")
    is_type(b, I32, "get_rows_back indices")
    need(geo.is_matrix(a) and geo.is_vector(b) and geo.is_contiguous(b), "get_rows_back takes a matrix and an index vector")
    need(geo.nelements(b) <= a.ne[1], "get_rows_back has more indices than grad rows")
    unit_stride(a, "get_rows_back grads")
    need(geo.is_matrix(n.dst), "get_rows_back makes a matrix")
    dst_is(n, F32, (a.ne[0], n.dst.ne[1], 1, 1))
    return [(1, n.dst.ne[1])]


def repeat_back(n: Node) -> None:
    """ggml_repeat_back: f32 a summed into a dst of b's shape (b is no source), can_repeat(dst, a).
    ggml_compute_forward_repeat_back_f32 asserts nb0 = nb00 = 4, follows the other strides."""
    a = n.s(0)
    is_type(a, F32, "repeat_back src0")
    need(geo.can_repeat(n.dst, a), f"dst {n.dst.ne} does not repeat into src0 {a.ne}")
    unit_stride(a, "repeat_back src0")
    dst_is(n, F32, n.dst.ne)


def silu_back(n: Node) -> None:
    """ggml_silu_back(grad, x) -> dup(grad). ggml_compute_forward_silu_back_f32 / _f16: rows by nb1
    over ggml_nrows (its asserts: contiguous_1 and equal shapes, debug-only)."""
    g, x = n.s(0), n.s(1)
    is_type(g, frozenset({F32, F16}), "silu_back grad")
    need(x.type == g.type, "silu_back x must have grad's type")
    need(geo.are_same_shape(g, x), "silu_back grad and x differ in shape")
    need(all(geo.is_contiguous_1(t) for t in (g, x, n.dst)), "silu_back needs dense rows (contiguous_1)")
    like(n)


def _f32_pair(n: Node, what: str, first: str, second: str) -> tuple:
    """src0 and src1 f32 of one shape, nb0 the element size (the *_BACK and loss kernels)."""
    a, b = n.s(0), n.s(1)
    is_type(a, F32, f"{what} {first}")
    is_type(b, F32, f"{what} {second}")
    need(geo.are_same_shape(a, b), f"{what} {first} and {second} differ in shape")
    unit_stride(a, f"{what} {first}")
    unit_stride(b, f"{what} {second}")
    return a, b


def rms_norm_back(n: Node) -> None:
    """ggml_rms_norm_back(grad, x, eps) -> dup(grad); ggml_compute_forward_rms_norm_back_f32: f32,
    equal shapes, nb0 = 4, other strides followed."""
    _f32_pair(n, "rms_norm_back", "grad", "x")
    eps = n.f32(0)
    finite(eps, "rms_norm_back eps")
    need(eps >= 0.0, f"eps {eps} must be >= 0")
    like(n)


def soft_max_back(n: Node) -> None:
    """ggml_soft_max_ext_back(grad, y, scale, max_bias) -> dup/view of grad.
    ggml_compute_forward_soft_max_ext_back_f32: f32, all contiguous, equal shapes, max_bias == 0."""
    g, y = _f32_pair(n, "soft_max_back", "grad", "y")
    need(geo.is_contiguous(g) and geo.is_contiguous(y), "soft_max_back needs contiguous sources")
    need(n.f32(1) == 0.0, "soft_max_back takes max_bias = 0 (ggml-cpu supports_op)")
    like(n, contiguous=True)


def cross_entropy_loss(n: Node) -> None:
    """ggml_cross_entropy_loss(logits, labels) -> f32 scalar; the kernel walks ggml_nrows rows by nb1."""
    a, b = _f32_pair(n, "cross_entropy_loss", "logits", "labels")
    need(geo.is_contiguous_1(a) and geo.is_contiguous_1(b), "cross_entropy_loss needs dense rows")
    dst_is(n, F32, (1, 1, 1, 1))


def cross_entropy_loss_back(n: Node) -> None:
    """ggml_cross_entropy_loss_back(grad scalar, logits, labels) -> dup(logits); the kernel asserts
    every tensor contiguous and the shapes equal, and reads grad[0]."""
    g, a, b = n.s(0), n.s(1), n.s(2)
    for t, w in ((g, "grad"), (a, "logits"), (b, "labels")):
        is_type(t, F32, f"cross_entropy_loss_back {w}")
        need(geo.is_contiguous(t), f"cross_entropy_loss_back {w} must be contiguous")
    need(geo.is_scalar(g) and geo.are_same_shape(a, b), "cross_entropy_loss_back shapes do not fit")
    like(n, 1, contiguous=True)


def _opt_step(n: Node, what: str, state: tuple[int, ...], hyper: int, count: int) -> None:
    """OPT_STEP_*: dst is a view of the f32 parameter src0 (ggml_view_tensor), updated in place; the
    kernel reads the gradient (and AdamW's m, v) at src0's byte offsets, so they share its layout.
    (The builder's GGML_TENSOR_FLAG_PARAM assert on src0 is autodiff bookkeeping, not memory: not
    asked.)"""
    w = n.s(0)
    is_type(w, F32, f"{what} parameter")
    unit_stride(w, f"{what} parameter")
    for i in state:
        t = n.s(i)
        is_type(t, F32, f"{what} src{i}")
        need(geo.are_same_shape(t, w) and tuple(t.nb) == tuple(w.nb), f"{what} src{i} must have src0's shape and strides")
    p = n.s(hyper)
    is_type(p, F32, f"{what} hyper-parameters")
    need(geo.nelements(p) == count and geo.is_contiguous(p), f"{what} takes {count} contiguous f32 hyper-parameters")
    d = n.dst
    need(d.type == w.type and tuple(d.ne) == tuple(w.ne) and tuple(d.nb) == tuple(w.nb)
         and (d.buffer, d.data) == (w.buffer, w.data), f"{what} dst must be a view of src0")


def opt_step_adamw(n: Node) -> None:
    """ggml_opt_step_adamw(a, grad, m, v, params[7]); ggml_compute_forward_opt_step_adamw_f32."""
    _opt_step(n, "opt_step_adamw", (1, 2, 3), 4, ADAMW_PARAMS)


def opt_step_sgd(n: Node) -> None:
    """ggml_opt_step_sgd(a, grad, params[2]); ggml_compute_forward_opt_step_sgd_f32."""
    _opt_step(n, "opt_step_sgd", (1,), 2, SGD_PARAMS)


_SRC1 = frozenset({1})
RULES: dict[int, Rule] = {
    GgmlOp.ACC: Rule(2, acc), GgmlOp.SET: Rule(2, set_),
    GgmlOp.OUT_PROD: Rule(2, out_prod, strided=_SRC1), GgmlOp.GET_ROWS_BACK: Rule(2, get_rows_back),
    GgmlOp.REPEAT_BACK: Rule(1, repeat_back), GgmlOp.SILU_BACK: Rule(2, silu_back),
    GgmlOp.RMS_NORM_BACK: Rule(2, rms_norm_back), GgmlOp.SOFT_MAX_BACK: Rule(2, soft_max_back),
    GgmlOp.CROSS_ENTROPY_LOSS: Rule(2, cross_entropy_loss),
    GgmlOp.CROSS_ENTROPY_LOSS_BACK: Rule(3, cross_entropy_loss_back),
    GgmlOp.OPT_STEP_ADAMW: Rule(5, opt_step_adamw), GgmlOp.OPT_STEP_SGD: Rule(3, opt_step_sgd),
}
