"""The vision-tower rules (ops/rules_conv.py), with values: what ggml's builders make is admitted with
the exact dst the builder computed (tests/server/ops/test_ops_rules.py covers the generic mutants); each
precondition of a builder or kernel, broken on its own, is refused with its reason."""

from __future__ import annotations

import dataclasses

import pytest

from ggml_rknpu.libggml import abi
from ggml_rknpu.libggml.enums import GgmlOp
from ggml_rknpu.server.ops import geometry as geo
from ggml_rknpu.server.ops.rules import check_node
from ggml_rknpu.server.ops.rules_conv import GGML_IM2COL_WORK_SIZE, UPSCALE_DIM_LIMIT
from ggml_rknpu.server.ops.vocabulary import UnsupportedOp
from support.ggml_builders import BF16, F16, F32, I32, Scratch, assert_refused, with_params, with_src

# the dst shapes ggml's builders made for the nodes of support.ggml_builders._vision
BUILT_SHAPES = {
    "conv_2d f16 kernel": (GgmlOp.CONV_2D, (5, 4, 4, 2)),
    "conv_2d_dw": (GgmlOp.CONV_2D_DW, (9, 4, 3, 2)),
    "conv_3d": (GgmlOp.CONV_3D, (6, 3, 5, 4 * 2)),
    "conv_transpose_1d": (GgmlOp.CONV_TRANSPOSE_1D, (21, 4, 1, 1)),
    "conv_transpose_2d": (GgmlOp.CONV_TRANSPOSE_2D, (19, 17, 4, 2)),
    "im2col_3d": (GgmlOp.IM2COL_3D, (2 * 3 * 2 * 3, 6, 3, 5 * 2)),
    "col2im_1d": (GgmlOp.COL2IM_1D, (14, 3, 1, 1)),
    "pool_1d": (GgmlOp.POOL_1D, (5, 8, 3, 2)),
    "pool_2d": (GgmlOp.POOL_2D, (5, 7, 3, 2)),
    "upscale bilinear": (GgmlOp.UPSCALE, (17, 5, 3, 2)),
    "pad_reflect_1d": (GgmlOp.PAD_REFLECT_1D, (14, 8, 3, 2)),
}


def test_builder_nodes_are_admitted_with_ggmls_dst(built):
    for label, (op, ne) in BUILT_SHAPES.items():
        node, srcs = built[label]
        assert (node.op, node.ne) == (op, ne), label
        assert check_node(node, srcs) == [], label


def _big_kernel(srcs):
    """A conv_2d kernel whose im2col patch alone overflows ggml-cpu's work buffer."""
    k = srcs[0]
    side = int((GGML_IM2COL_WORK_SIZE / (k.ne[2] * geo.type_size(k))) ** 0.5) + 1
    return with_src(srcs, 0, ne=(side, side, k.ne[2], k.ne[3]))


REFUSALS = [
    ("conv_2d f16 kernel", lambda n, s: (with_params(n, p0=0), s), "stride"),
    ("conv_2d f16 kernel", lambda n, s: (with_params(n, p1=-3), s), "stride"),
    ("conv_2d f16 kernel", lambda n, s: (with_params(n, p2=1 << 24), s), "out of range"),
    ("conv_2d f16 kernel", lambda n, s: (n, with_src(s, 0, type=BF16)), "kernel type"),
    ("conv_2d f16 kernel", lambda n, s: (n, with_src(s, 1, type=F16)), "input type"),
    ("conv_2d f16 kernel", lambda n, s: (n, with_src(s, 0, nb=(2, 6, 24, 18 * 4))), "contiguous kernel"),
    ("conv_2d f16 kernel", lambda n, s: (n, with_src(s, 1, ne=(9, 8, 4, 2))), "channels differ"),
    ("conv_2d f16 kernel", lambda n, s: (n, _big_kernel(s)), "work buffer"),
    ("conv_3d", lambda n, s: (with_params(n, p9=2), s), "channels"),
    ("conv_3d", lambda n, s: (with_params(n, p11=0), s), "channels"),
    ("conv_3d", lambda n, s: (with_params(n, p2=0), s), "stride"),
    ("conv_2d_dw", lambda n, s: (n, with_src(s, 0, ne=(3, 3, 1, 4), nb=geo.contiguous_nb(F32, (3, 3, 1, 4)))),
     "kernel must be"),
    ("conv_2d_dw", lambda n, s: (n, with_src(s, 1, nb=(4, 36, 0, 864))), "overlap"),
    ("conv_2d_dw", lambda n, s: (dataclasses.replace(n, nb=(12, 108, 4, 864)), s), "dst strides"),
    ("conv_transpose_1d", lambda n, s: (with_params(n, p1=1), s), "p0 = 0"),
    ("conv_transpose_1d", lambda n, s: (with_params(n, p0=-1), s), "s0 >= 1"),
    ("conv_transpose_1d", lambda n, s: (n, with_src(s, 1, ne=(10, 4, 1, 1))), "shapes do not fit"),
    ("conv_transpose_2d", lambda n, s: (with_params(n, p0=0), s), "stride"),
    ("conv_transpose_2d", lambda n, s: (n, with_src(s, 1, type=F16, ne=s[1].ne)), "input type"),
    ("im2col_3d", lambda n, s: (with_params(n, p9=0), s), "IC=0"),
    ("im2col_3d", lambda n, s: (with_params(n, p9=4), s), "must divide"),
    ("im2col_3d", lambda n, s: (dataclasses.replace(n, type=BF16), s), "dst type"),
    ("im2col_3d", lambda n, s: (with_params(n, p3=-1000), s), "too small"),
    ("col2im_1d", lambda n, s: (with_params(n, p1=5), s), "whole number"),
    ("col2im_1d", lambda n, s: (with_params(n, p2=-1), s), "p0 >= 0"),
    ("col2im_1d", lambda n, s: (with_params(n, p2=20), s), "no output"),
    ("pool_1d", lambda n, s: (with_params(n, p0=abi.GGML_OP_POOL_COUNT), s), "pool op"),
    ("pool_1d", lambda n, s: (with_params(n, p2=0), s), "out of range"),
    ("pool_1d", lambda n, s: (n, with_src(s, 0, nb=(4, 36, 400, 1200))), "dense"),
    ("pool_2d", lambda n, s: (with_params(n, p1=40), s), "too small"),
    ("pool_2d", lambda n, s: (n, with_src(s, 0, type=I32)), "input type"),
    # a size-1 dim with stride 0 is "contiguous" to ggml, and would make the plane loop spin forever
    ("pool_2d", lambda n, s: (n, with_src(s, 0, ne=(9, 8, 1, 2), nb=(4, 36, 0, 288))), "contiguous ones"),
    ("upscale bilinear", lambda n, s: (with_params(n, p0=abi.GGML_SCALE_MODE_COUNT), s), "mode"),
    ("upscale bilinear", lambda n, s: (with_params(n, p0=abi.GGML_SCALE_FLAG_ANTIALIAS), s), "antialias"),
    ("upscale bilinear", lambda n, s: (with_params(n, p0=1 << 12), s), "mode"),
    ("upscale bilinear", lambda n, s: (dataclasses.replace(
        n, ne=(UPSCALE_DIM_LIMIT + 1, 1, 1, 1), nb=geo.contiguous_nb(F32, (UPSCALE_DIM_LIMIT + 1, 1, 1, 1))), s),
     "dims above"),
    ("upscale bilinear", lambda n, s: (n, with_src(s, 0, ne=(9, 0, 3, 2))), "empty"),
    ("pad_reflect_1d", lambda n, s: (with_params(n, p0=9), s), "padding"),
    ("pad_reflect_1d", lambda n, s: (with_params(n, p1=-1), s), "padding"),
]


@pytest.mark.parametrize("label, mutate, reason", REFUSALS)
def test_broken_preconditions_are_refused_with_their_reason(built, label, mutate, reason):
    node, srcs = mutate(*built[label])
    assert_refused(node, srcs, reason)


def test_conv_2d_dw_cwhn_layout_is_admitted_with_the_builders_strides(host_ggml):
    """ggml_conv_2d_dw_direct on a CWHN (channels-contiguous) input permutes dst's strides; the
    kernel then needs a CWHN kernel too (ggml_compute_forward_conv_2d_dw's assert)."""
    sc = Scratch(host_ggml)
    try:
        img = sc.call("ggml_permute", sc.call("ggml_cont", sc.call("ggml_permute", sc.new(F32, 9, 8, 3, 2), 1, 2, 0, 3)),
                      2, 0, 1, 3)
        knl = sc.call("ggml_permute", sc.call("ggml_cont", sc.call("ggml_permute", sc.new(F32, 3, 3, 1, 3), 2, 3, 1, 0)),
                      3, 2, 0, 1)
        node, srcs = sc.node(sc.call("ggml_conv_2d_dw_direct", knl, img, 1, 1, 1, 1, 1, 1))
    finally:
        sc.close()
    assert node.nb == (12, 12 * 9, 4, 9 * 8 * 3 * 4)
    assert check_node(node, srcs) == []
    whcn_kernel = with_src(srcs, 0, nb=geo.contiguous_nb(F32, srcs[0].ne))
    with pytest.raises(UnsupportedOp, match="CWHN kernel"):
        check_node(node, whcn_kernel)
    with pytest.raises(UnsupportedOp, match="dst strides"):
        check_node(dataclasses.replace(node, nb=geo.contiguous_nb(F32, node.ne)), srcs)
