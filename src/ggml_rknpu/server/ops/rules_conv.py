"""Validator rules for the vision-tower ops: direct convolutions, pooling, upscaling, reflect padding.

Each rule restates, from the pinned ggml, the builder in ``ggml.c`` and the kernel in
``ggml-cpu/ops.cpp`` named in its docstring. Invariants: strides >= 1 (0 divides by zero in
the builder, a negative one walks the output backwards); paddings and dilations within
``PARAM_LIMIT`` so the output-size arithmetic cannot overflow; a dense dst for the kernels
that write densely; CONV_2D / CONV_3D only when one im2col patch fits the work buffer.
Why each: docs/decisions.md "server/ops/rules_conv.py"."""

from __future__ import annotations

import numpy as np

from ggml_rknpu.libggml import abi
from ggml_rknpu.libggml.enums import GgmlOp
from ggml_rknpu.server.ops import geometry as geo
from ggml_rknpu.server.ops.rulekit import (
    ANY,
    BF16,
    F16,
    F32,
    Node,
    Rule,
    conv_out,
    dst_is,
    is_type,
    need,
    unit_stride,
    unit_strides,
)

GGML_IM2COL_WORK_SIZE = 16 * 1024 * 1024      # ggml-cpu/ops.h: the cplan's work size for CONV_2D / CONV_3D
PARAM_LIMIT = 1 << 20                          # |padding|, dilation, stride: far beyond any model, far from overflow
POOL_OPS = frozenset({abi.GGML_OP_POOL_MAX, abi.GGML_OP_POOL_AVG})      # POOL_COUNT: GGML_ABORT in the kernels
KERNEL_TYPES = frozenset({F32, F16})           # conv kernels: f32 or f16 weights, f32 data
# ggml_interpolate_impl: mode in the low byte, flags above (ggml.h enum ggml_scale_flag)
SCALE_FLAGS = abi.GGML_SCALE_FLAG_ALIGN_CORNERS | abi.GGML_SCALE_FLAG_ANTIALIAS
# ggml_compute_forward_upscale_f32 maps dst index i to source index (int64)(i / (float)(ne / ne_src)):
# in float32 that stays below ne_src only while both sides are far below 2**23
UPSCALE_DIM_LIMIT = 1 << 20


def _conv_params(n: Node, strides: tuple[int, ...], pads: tuple[int, ...], dilations: tuple[int, ...]) -> None:
    for k in strides:
        need(1 <= n.i32(k) <= PARAM_LIMIT, f"stride op_params[{k}]={n.i32(k)} must be in [1, {PARAM_LIMIT}]")
    for k in (*pads, *dilations):
        need(abs(n.i32(k)) <= PARAM_LIMIT, f"op_params[{k}]={n.i32(k)} out of range")


def _patch_fits(knl_n: int, kernel_type_size: int, c_out: int) -> None:
    """ggml_compute_forward_conv_2d_impl / conv_3d_impl: one im2col patch plus its outputs fit."""
    need(knl_n * kernel_type_size + c_out * 4 <= GGML_IM2COL_WORK_SIZE,
         "conv kernel too large for ggml-cpu's im2col work buffer")


def conv_2d(n: Node) -> None:
    """ggml_conv_2d_direct: a [KW, KH, IC, OC] kernel over b [W, H, IC, N] -> [OW, OH, OC, N] of b's
    type. ggml_compute_forward_conv_2d_impl: the kernel contiguous f16/f32, b read as f32 through
    its strides (the cwhn cases pass a permuted b), dst written through its strides as f32."""
    a, b = n.s(0), n.s(1)
    is_type(a, KERNEL_TYPES, "conv_2d kernel")
    is_type(b, F32, "conv_2d input")
    need(geo.is_contiguous(a), "conv_2d needs a contiguous kernel (ggml-cpu supports_op)")
    need(a.ne[2] == b.ne[2], f"conv_2d channels differ: kernel {a.ne[2]}, input {b.ne[2]}")
    _conv_params(n, (0, 1), (2, 3), (4, 5))
    _patch_fits(a.ne[0] * a.ne[1] * a.ne[2], geo.type_size(a), a.ne[3])
    ow = conv_out(b.ne[0], a.ne[0], n.i32(0), n.i32(2), n.i32(4))
    oh = conv_out(b.ne[1], a.ne[1], n.i32(1), n.i32(3), n.i32(5))
    need(ow > 0 and oh > 0, "conv_2d input too small for the kernel")
    dst_is(n, b.type, (ow, oh, a.ne[3], b.ne[3]))


def conv_3d(n: Node) -> None:
    """ggml_conv_3d_direct: kernel [KW, KH, KD, IC*OC], b [W, H, D, IC*N] -> f32 [OW, OH, OD, OC*N];
    op_params 9-11 are IC, N, OC. ggml_compute_forward_conv_3d_impl as conv_2d."""
    a, b = n.s(0), n.s(1)
    is_type(a, KERNEL_TYPES, "conv_3d kernel")
    is_type(b, F32, "conv_3d input")
    need(geo.is_contiguous(a), "conv_3d needs a contiguous kernel")
    c, batch, oc = n.i32(9), n.i32(10), n.i32(11)
    need(c >= 1 and batch >= 1 and oc >= 1 and a.ne[3] == c * oc and b.ne[3] == c * batch,
         "conv_3d channels (op_params IC, N, OC) do not fit the kernel and input")
    _conv_params(n, (0, 1, 2), (3, 4, 5), (6, 7, 8))
    _patch_fits(a.ne[0] * a.ne[1] * a.ne[2] * c, geo.type_size(a), oc)
    out = [conv_out(b.ne[d], a.ne[d], n.i32(d), n.i32(3 + d), n.i32(6 + d)) for d in range(3)]
    need(all(o > 0 for o in out), "conv_3d input too small for the kernel")
    dst_is(n, F32, (*out, oc * batch))


def conv_2d_dw(n: Node) -> None:
    """ggml_conv_2d_dw_direct: a [KW, KH, 1, C] per-channel kernel over b [W, H, C, N] -> b's type,
    in b's layout: WHCN (b contiguous) or CWHN (ggml_is_contiguous_channels(b): the builder
    permutes dst's strides). ggml_compute_forward_conv_2d_dw: f32/f16 kernel, f32 data, any other
    layout GGML_ABORTs; the CWHN path asserts the kernel is CWHN too."""
    a, b = n.s(0), n.s(1)
    is_type(a, KERNEL_TYPES, "conv_2d_dw kernel")
    is_type(b, F32, "conv_2d_dw input")
    need(a.ne[2] == 1 and a.ne[3] == b.ne[2], "conv_2d_dw kernel must be [KW, KH, 1, channels]")
    _conv_params(n, (0, 1), (2, 3), (4, 5))
    ow = conv_out(b.ne[0], a.ne[0], n.i32(0), n.i32(2), n.i32(4))
    oh = conv_out(b.ne[1], a.ne[1], n.i32(1), n.i32(3), n.i32(5))
    need(ow > 0 and oh > 0, "conv_2d_dw input too small for the kernel")
    cwhn = _contiguous_channels(b)
    need(geo.is_contiguous(b) or cwhn, "conv_2d_dw input is neither WHCN nor CWHN contiguous")
    if not geo.is_contiguous(b):
        need(a.nb[0] >= a.nb[2] and a.nb[1] >= a.nb[0], "conv_2d_dw CWHN input needs a CWHN kernel")
    ne = (ow, oh, b.ne[2], b.ne[3])
    dst_is(n, b.type, ne, contiguous=False)
    nb = geo.contiguous_nb(b.type, ne)
    if cwhn:                                            # the builder's permuted dst
        ts = geo.type_size(b)
        nb = (ne[2] * ts, ne[0] * ne[2] * ts, ts, nb[3])
    need(tuple(n.dst.nb) == nb, f"conv_2d_dw dst strides {n.dst.nb}, ggml makes {nb}")


def _contiguous_channels(t) -> bool:
    """ggml_is_contiguous_channels (ggml.c)."""
    return t.nb[0] > t.nb[2] and t.nb[1] > t.nb[0] and t.nb[2] == geo.type_size(t)


def conv_transpose_1d(n: Node) -> None:
    """ggml_conv_transpose_1d: kernel a [K, OC, IC], input b [L, IC] (a matrix) -> f32 [(L-1)*s0 + K,
    OC]; p0 = 0 and d0 = 1 asserted. ggml_compute_forward_conv_transpose_1d: f16/f32 kernel, f32
    input (nb00, nb10 = element size), dst written densely by rows of nb1."""
    a, b = n.s(0), n.s(1)
    is_type(a, KERNEL_TYPES, "conv_transpose_1d kernel")
    is_type(b, F32, "conv_transpose_1d input")
    need(geo.is_matrix(b) and a.ne[2] == b.ne[1] and a.ne[3] == 1, "conv_transpose_1d shapes do not fit")
    unit_stride(a, "conv_transpose_1d kernel")
    unit_stride(b, "conv_transpose_1d input")
    s0 = n.i32(0)
    need(1 <= s0 <= PARAM_LIMIT and n.i32(1) == 0 and n.i32(2) == 1,
         "conv_transpose_1d takes s0 >= 1, p0 = 0, d0 = 1")
    dst_is(n, F32, ((b.ne[0] - 1) * s0 + a.ne[0], a.ne[1], 1, 1))


def conv_transpose_2d(n: Node) -> None:
    """ggml_conv_transpose_2d_p0: kernel a [KW, KH, OC, IC], input b [W, H, IC, N] -> f32
    [(W-1)*s + KW, (H-1)*s + KH, OC, N]. ggml_compute_forward_conv_transpose_2d_impl reads the
    kernel rows as one plane (src[i01 * ne00 + i00]) and writes dst planes densely."""
    a, b = n.s(0), n.s(1)
    is_type(a, KERNEL_TYPES, "conv_transpose_2d kernel")
    is_type(b, F32, "conv_transpose_2d input")
    need(geo.is_contiguous(a), "conv_transpose_2d needs a contiguous kernel")
    unit_stride(a, "conv_transpose_2d kernel")
    unit_stride(b, "conv_transpose_2d input")
    need(a.ne[3] == b.ne[2], f"conv_transpose_2d channels differ: kernel {a.ne[3]}, input {b.ne[2]}")
    s = n.i32(0)
    need(1 <= s <= PARAM_LIMIT, f"conv_transpose_2d stride {s} must be in [1, {PARAM_LIMIT}]")
    dst_is(n, F32, ((b.ne[0] - 1) * s + a.ne[0], (b.ne[1] - 1) * s + a.ne[1], a.ne[2], b.ne[3]))


def im2col_3d(n: Node) -> None:
    """ggml_im2col_3d: kernel a [KW, KH, KD, IC*OC] (shape only), input b [W, H, D, IC*N] ->
    [KW*KH*KD*IC, OW, OH, OD*N] in the requested type; op_params: s0-2, p0-2, d0-2, IC.
    ggml_compute_forward_im2col_3d: f32 input (nb10 = 4, other strides followed), f16/f32 dst
    written densely."""
    a, b = n.s(0), n.s(1)
    is_type(b, F32, "im2col_3d input")
    unit_stride(b, "im2col_3d input")
    is_type(n.dst, KERNEL_TYPES, "im2col_3d dst")
    ic = n.i32(9)
    need(ic >= 1 and b.ne[3] % ic == 0, f"im2col_3d IC={ic} must divide the input's ne3 {b.ne[3]}")
    _conv_params(n, (0, 1, 2), (3, 4, 5), (6, 7, 8))
    out = [conv_out(b.ne[d], a.ne[d], n.i32(d), n.i32(3 + d), n.i32(6 + d)) for d in range(3)]
    need(all(o > 0 for o in out), "im2col_3d input too small for the kernel")
    dst_is(n, n.dst.type, (a.ne[0] * a.ne[1] * a.ne[2] * ic, out[0], out[1], out[2] * (b.ne[3] // ic)))


def col2im_1d(n: Node) -> None:
    """ggml_col2im_1d: columns a [K*OC, T_in] (contiguous f32/f16/bf16 matrix) -> [T_out, OC] of a's
    type, T_out = (T_in - 1)*s0 + K - 2*p0; op_params s0, OC, p0 (the builder's asserts)."""
    a = n.s(0)
    is_type(a, frozenset({F32, F16, BF16}), "col2im_1d input")
    need(geo.is_matrix(a) and geo.is_contiguous(a), "col2im_1d takes a contiguous matrix")
    s0, oc, p0 = n.i32(0), n.i32(1), n.i32(2)
    need(1 <= s0 <= PARAM_LIMIT and 1 <= oc and 0 <= p0 <= PARAM_LIMIT, "col2im_1d needs s0 > 0, OC > 0, p0 >= 0")
    k = a.ne[0] // oc
    t_out = (a.ne[1] - 1) * s0 + k - 2 * p0
    need(k > 0 and a.ne[0] == k * oc and t_out > 0, "col2im_1d: ne0 is not a whole number of OC blocks, or no output")
    dst_is(n, a.type, (t_out, oc, 1, 1))


def _pool_out(ins: int, k: int, s: int, p: int) -> int:
    """ggml_calc_pool_output_size: (ins + 2 * p - ks) / s + 1 in float (p is a float there), truncated."""
    f = np.float32
    return int((f(ins) + f(2) * f(p) - f(k)) / f(s) + f(1))


def _pool_params(n: Node, op: int, ks: tuple[int, ...], ss: tuple[int, ...], ps: tuple[int, ...]) -> None:
    need(op in POOL_OPS, f"pool op {op} is not MAX or AVG")
    for k in (*ks, *ss):
        need(1 <= n.i32(k) <= PARAM_LIMIT, f"pool kernel/stride op_params[{k}]={n.i32(k)} out of range")
    for k in ps:
        need(0 <= n.i32(k) <= PARAM_LIMIT, f"pool padding op_params[{k}]={n.i32(k)} out of range")


def pool_1d(n: Node) -> None:
    """ggml_pool_1d: f32 [OW, ne1, ne2, ne3]; op_params op, k0, s0, p0. ggml_compute_forward_pool_1d_ksp
    walks rows by nb1 only (f32/f16 source): the rows must be dense."""
    a = n.s(0)
    is_type(a, frozenset({F32, F16}), "pool_1d input")
    need(geo.is_padded_1d(a), "pool_1d reads rows by nb1 alone: rows must be dense")
    _pool_params(n, n.i32(0), (1,), (2,), (3,))
    ow = _pool_out(a.ne[0], n.i32(1), n.i32(2), n.i32(3))
    need(ow > 0, "pool_1d input too small for the kernel")
    dst_is(n, F32, (ow, *a.ne[1:]))


def pool_2d(n: Node) -> None:
    """ggml_pool_2d: f32 [OW, OH, ne2, ne3]; op_params op, k0, k1, s0, s1, p0, p1.
    ggml_compute_forward_pool_2d walks the source planes by nb2 up to ggml_nbytes and the dst planes
    densely: both contiguous, and the source with ggml_new_tensor's own strides: ggml_is_contiguous
    ignores the stride of a dim of size 1, and ``while (cdata < data_end) cdata += nb2`` with nb2 = 0
    never ends."""
    a = n.s(0)
    is_type(a, frozenset({F32, F16}), "pool_2d input")
    need(tuple(a.nb) == geo.contiguous_nb(a.type, a.ne), f"pool_2d input strides {a.nb} are not ggml's contiguous ones")
    _pool_params(n, n.i32(0), (1, 2), (3, 4), (5, 6))
    ow = _pool_out(a.ne[0], n.i32(1), n.i32(3), n.i32(5))
    oh = _pool_out(a.ne[1], n.i32(2), n.i32(4), n.i32(6))
    need(ow > 0 and oh > 0, "pool_2d input too small for the kernel")
    dst_is(n, F32, (ow, oh, a.ne[2], a.ne[3]))


def upscale(n: Node) -> None:
    """ggml_interpolate_impl: f32 in, f32 out of any shape the client asks; op_params[0] is the mode
    (nearest, bilinear, bicubic) with the align-corners and antialias (bilinear only) flags.
    ggml_compute_forward_upscale_f32 follows every stride."""
    a = n.s(0)
    is_type(a, F32, "upscale input")
    mode = n.i32(0)
    need(0 <= mode and (mode & 0xFF) < abi.GGML_SCALE_MODE_COUNT and not mode & ~(0xFF | SCALE_FLAGS),
         f"upscale mode {mode:#x} out of range")
    need(not mode & abi.GGML_SCALE_FLAG_ANTIALIAS or mode & 0xFF == abi.GGML_SCALE_MODE_BILINEAR,
         "upscale antialias is bilinear only")
    need(not geo.is_empty(a) or geo.is_empty(n.dst), "upscale of an empty tensor")
    need(all(x <= UPSCALE_DIM_LIMIT for x in (*a.ne, *n.dst.ne)),
         f"upscale dims above {UPSCALE_DIM_LIMIT} (ggml-cpu's float index mapping)")
    dst_is(n, F32, n.dst.ne)


def pad_reflect_1d(n: Node) -> None:
    """ggml_pad_reflect_1d: contiguous f32, 0 <= p0, p1 < ne0, dst [ne0 + p0 + p1, ...].
    ggml_compute_forward_pad_reflect_1d copies each row with ggml_vec_cpy_f32 (dense rows)."""
    a = n.s(0)
    is_type(a, F32, "pad_reflect_1d input")
    need(geo.is_contiguous(a), "pad_reflect_1d needs a contiguous input")
    p0, p1 = n.i32(0), n.i32(1)
    need(0 <= p0 < a.ne[0] and 0 <= p1 < a.ne[0], "pad_reflect_1d padding must be in [0, ne0)")
    dst_is(n, F32, (a.ne[0] + p0 + p1, *a.ne[1:]))


def im2col(n: Node) -> None:
    a, b = n.s(0), n.s(1)                       # a: the kernel (shape only), b: the input
    s0, s1, p0, p1, d0, d1, is_2d = (n.i32(k) for k in range(7))
    need(is_2d in (0, 1), "im2col is_2D must be 0 or 1")
    # strides divide (0 would be SIGFPE); padding and dilation only move reads the kernel bounds-checks
    need(s0 >= 1 and (s1 >= 1 or not is_2d), "im2col strides must be >= 1")
    need((n.dst.type, b.type) in {(F32, F32), (F16, F16), (F16, F32)}, "im2col types have no kernel")
    unit_strides(n, "im2col", 1)                # ggml_compute_forward_im2col_f32/_f16 assert nb10
    if is_2d:
        need(a.ne[2] == b.ne[2], "im2col channels differ")
        need(b.nb[1] == b.ne[0] * geo.type_size(b), "im2col reads each channel as one contiguous image")
    else:
        need(b.ne[1] == a.ne[1] and b.ne[3] == 1, "im2col 1-D shapes")
    oh = conv_out(b.ne[1], a.ne[1], s1, p1, d1) if is_2d else 0
    ow = conv_out(b.ne[0], a.ne[0], s0, p0, d0)
    need(ow > 0 and (not is_2d or oh > 0), "im2col input too small for the kernel")
    ne = (a.ne[2] * a.ne[1] * a.ne[0] if is_2d else a.ne[1] * a.ne[0], ow, oh if is_2d else b.ne[2],
          b.ne[3] if is_2d else 1)
    dst_is(n, n.dst.type, ne)


_SRC0, _SRC1 = frozenset({0}), frozenset({1})
RULES: dict[int, Rule] = {
    GgmlOp.CONV_2D: Rule(2, conv_2d, strided=_SRC1), GgmlOp.CONV_3D: Rule(2, conv_3d, strided=_SRC1),
    GgmlOp.CONV_2D_DW: Rule(2, conv_2d_dw, strided=ANY),
    GgmlOp.CONV_TRANSPOSE_1D: Rule(2, conv_transpose_1d), GgmlOp.CONV_TRANSPOSE_2D: Rule(2, conv_transpose_2d),
    GgmlOp.IM2COL: Rule(2, im2col, strided=_SRC0), GgmlOp.IM2COL_3D: Rule(2, im2col_3d, strided=_SRC0), GgmlOp.COL2IM_1D: Rule(1, col2im_1d),
    GgmlOp.POOL_1D: Rule(1, pool_1d), GgmlOp.POOL_2D: Rule(1, pool_2d),
    GgmlOp.UPSCALE: Rule(1, upscale, strided=_SRC0), GgmlOp.PAD_REFLECT_1D: Rule(1, pad_reflect_1d),
}
