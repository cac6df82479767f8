"""The backward-pass, optimizer (ops/rules_training.py) and DeepSeek-V4 (ops/rules_dsv4.py) rules,
with values: ggml's builders' nodes are admitted with the dst the builder computed; each builder or
kernel precondition, broken on its own, is refused with its reason."""

from __future__ import annotations

import dataclasses

import pytest

from ggml_rknpu.libggml.enums import GgmlOp, GgmlType
from ggml_rknpu.server.ops.rules import check_node
from ggml_rknpu.server.ops.vocabulary import UnsupportedOp
from support.ggml_builders import F16, F32, I32, Q8_0, assert_refused, with_params, with_src

Q8_1, Q8_K = int(GgmlType.Q8_1), int(GgmlType.Q8_K)

# label -> (op, dst shape the builder made, index checks)
BUILT = {
    "acc": (GgmlOp.ACC, (64, 7, 3, 2), []),
    "set i32": (GgmlOp.SET, (12, 5, 4, 3), []),
    "out_prod": (GgmlOp.OUT_PROD, (64, 8, 2, 3), []),
    "out_prod q8_0": (GgmlOp.OUT_PROD, (64, 8, 2, 3), []),
    "out_prod transposed b": (GgmlOp.OUT_PROD, (64, 8, 1, 1), []),
    "get_rows_back": (GgmlOp.GET_ROWS_BACK, (64, 9, 1, 1), [(1, 9)]),
    "repeat_back": (GgmlOp.REPEAT_BACK, (64, 1, 3, 1), []),
    "silu_back": (GgmlOp.SILU_BACK, (64, 7, 3, 2), []),
    "rms_norm_back": (GgmlOp.RMS_NORM_BACK, (64, 7, 3, 2), []),
    "soft_max_back": (GgmlOp.SOFT_MAX_BACK, (16, 5, 4, 1), []),
    "rope_ext_back": (GgmlOp.ROPE_BACK, (64, 4, 3, 1), []),
    "cross_entropy_loss": (GgmlOp.CROSS_ENTROPY_LOSS, (1, 1, 1, 1), []),
    "cross_entropy_loss_back": (GgmlOp.CROSS_ENTROPY_LOSS_BACK, (10, 5, 4, 3), []),
    "opt_step_adamw": (GgmlOp.OPT_STEP_ADAMW, (10, 5, 4, 3), []),
    "opt_step_sgd": (GgmlOp.OPT_STEP_SGD, (10, 5, 4, 3), []),
    "lightning_indexer f16 K": (GgmlOp.LIGHTNING_INDEXER, (16, 5, 1, 2), []),
    "lightning_indexer q4_0 K": (GgmlOp.LIGHTNING_INDEXER, (16, 5, 1, 2), []),
    "dsv4_hc_comb": (GgmlOp.DSV4_HC_COMB, (4, 4, 5, 1), []),
    "dsv4_hc_pre": (GgmlOp.DSV4_HC_PRE, (64, 5, 1, 1), []),
    "dsv4_hc_pre gated": (GgmlOp.DSV4_HC_PRE, (64, 5, 1, 1), []),
    "dsv4_hc_post": (GgmlOp.DSV4_HC_POST, (64, 4, 5, 1), []),
    "dsv4_hc_post no comb": (GgmlOp.DSV4_HC_POST, (64, 4, 5, 1), []),
}


def test_builder_nodes_are_admitted_with_ggmls_dst(built):
    for label, (op, ne, index) in BUILT.items():
        node, srcs = built[label]
        assert (node.op, node.ne) == (op, ne), label
        assert check_node(node, srcs) == index, label


def _dst(n, **change):
    return dataclasses.replace(n, **change)


REFUSALS = [
    # ACC / SET: the view they write stays inside src0, element-aligned
    ("acc", lambda n, s: (with_params(n, p3=10752 - 4 * 32 + 4), s), "past src0"),
    ("acc", lambda n, s: (with_params(n, p3=2), s), "multiples of the element size"),
    ("acc", lambda n, s: (with_params(n, p0=-256), s), "non-negative"),
    ("acc", lambda n, s: (with_params(n, p4=2), s), "inplace"),
    ("acc", lambda n, s: (with_params(_dst(n, data=64), p4=1), s), "must write src0 itself"),
    ("acc", lambda n, s: (n, with_src(s, 0, type=F16, ne=s[0].ne)), "acc src0 type"),
    ("acc", lambda n, s: (n, with_src(s, 1, nb=(4, 256, 0, 0))), "overlap"),
    ("acc", lambda n, s: (n, with_src(s, 0, nb=(4, 256, 1792, 6000))), "contiguous src0"),
    ("set i32", lambda n, s: (n, with_src(s, 1, type=F32, ne=s[1].ne)), "src0's type"),
    ("set i32", lambda n, s: (with_params(n, p3=1 << 30), s), "2\\*\\*30"),
    ("set i32", lambda n, s: (n, with_src(s, 1, ne=(6, 5, 4, 30))), "more elements"),
    # OUT_PROD: types of the kernels, broadcast only for f32 src0
    ("out_prod", lambda n, s: (n, with_src(s, 1, type=F16, ne=s[1].ne)), "src1 type"),
    ("out_prod", lambda n, s: (n, with_src(s, 1, ne=(8, 15, 2, 3))), "do not fit"),
    ("out_prod q8_0", lambda n, s: (n, with_src(s, 0, type=Q8_1, ne=s[0].ne)), "src0 type"),
    ("out_prod q8_0", lambda n, s: (n, with_src(s, 0, ne=(64, 16, 1, 3))), "does not broadcast"),
    ("out_prod", lambda n, s: (_dst(n, type=I32), s), "dst type"),
    # index sources and client-shaped dsts
    ("get_rows_back", lambda n, s: (n, with_src(s, 1, ne=(5, 1, 1, 1))), "more indices"),
    ("get_rows_back", lambda n, s: (n, with_src(s, 1, type=F32, ne=s[1].ne)), "indices type"),
    ("get_rows_back", lambda n, s: (n, with_src(s, 0, type=Q8_0, ne=s[0].ne)), "grads type"),
    ("repeat_back", lambda n, s: (_dst(n, ne=(64, 1, 2, 1)), s), "does not repeat"),
    ("repeat_back", lambda n, s: (n, with_src(s, 0, type=F16, ne=s[0].ne)), "src0 type"),
    # element-wise backward ops
    ("silu_back", lambda n, s: (n, with_src(s, 1, nb=(4, 256, 2048, 6144))), "contiguous_1"),
    ("silu_back", lambda n, s: (n, with_src(s, 1, ne=(64, 7, 3, 1))), "differ in shape"),
    ("rms_norm_back", lambda n, s: (with_params(n, p0=0xBF800000), s), "eps"),
    ("soft_max_back", lambda n, s: (with_params(n, p1=0x3F800000), s), "max_bias"),
    ("soft_max_back", lambda n, s: (n, with_src(s, 0, nb=(4, 64, 400, 1600))), "contiguous"),
    ("rope_ext_back", lambda n, s: (with_params(n, p2=3), s), "rope mode"),
    ("cross_entropy_loss", lambda n, s: (n, with_src(s, 1, ne=(10, 5, 4, 2))), "differ in shape"),
    ("cross_entropy_loss", lambda n, s: (_dst(n, ne=(2, 1, 1, 1)), s), "dst shape"),
    ("cross_entropy_loss_back", lambda n, s: (n, with_src(s, 0, ne=(2, 1, 1, 1))), "shapes do not fit"),
    # optimizer steps update src0 in place, reading the state at src0's offsets
    ("opt_step_adamw", lambda n, s: (n, with_src(s, 2, nb=(4, 48, 240, 960))), "src0's shape and strides"),
    ("opt_step_adamw", lambda n, s: (n, with_src(s, 4, ne=(6, 1, 1, 1))), "7 contiguous"),
    ("opt_step_adamw", lambda n, s: (_dst(n, data=4096), s), "view of src0"),
    ("opt_step_sgd", lambda n, s: (n, with_src(s, 2, ne=(3, 1, 1, 1))), "2 contiguous"),
    ("opt_step_sgd", lambda n, s: (n, with_src(s, 1, type=F16, ne=s[1].ne)), "src1 type"),
    # DeepSeek-V4
    ("lightning_indexer f16 K", lambda n, s: (n, with_src(s, 1, type=Q8_K, ne=(256, 1, 16, 2))), "k type"),
    ("lightning_indexer f16 K", lambda n, s: (n, with_src(s, 3, type=F32, ne=s[3].ne)), "mask type"),
    ("lightning_indexer f16 K", lambda n, s: (n, with_src(s, 3, ne=(15, 5, 1, 1))), "do not fit"),
    ("lightning_indexer f16 K", lambda n, s: (n, with_src(s, 3, ne=(16, 5, 1, 3))), "do not fit"),
    ("lightning_indexer f16 K", lambda n, s: (n, with_src(s, 2, ne=(8, 5, 1, 1))), "do not fit"),
    ("dsv4_hc_comb", lambda n, s: (n, with_src(s, 0, ne=(15, 5, 1, 1))), "mixes must be"),
    ("dsv4_hc_comb", lambda n, s: (with_params(n, p1=0), s), "n_iter"),
    ("dsv4_hc_comb", lambda n, s: (with_params(n, p1=1 << 30), s), "n_iter"),       # minutes of compute
    ("dsv4_hc_comb", lambda n, s: (n, with_src(s, 1, ne=(2, 1, 1, 1))), "scale"),
    ("dsv4_hc_pre", lambda n, s: (with_params(n, p1=2), s), "gated"),
    ("dsv4_hc_pre", lambda n, s: (with_params(n, p1=1), s), "weights"),
    ("dsv4_hc_pre gated", lambda n, s: (n, with_src(s, 1, ne=(64, 4, 6, 1))), "weights"),
    ("dsv4_hc_post", lambda n, s: (n, with_src(s, 3, ne=(4, 4, 4, 1))), "comb must be"),
    ("dsv4_hc_post", lambda n, s: (n, with_src(s, 2, ne=(3, 5, 1, 1))), "shapes do not fit"),
    ("dsv4_hc_post no comb", lambda n, s: (n, with_src(s, 1, type=I32, ne=s[1].ne)), "residual type"),
]


@pytest.mark.parametrize("label, mutate, reason", REFUSALS)
def test_broken_preconditions_are_refused_with_their_reason(built, label, mutate, reason):
    node, srcs = mutate(*built[label])
    assert_refused(node, srcs, reason)


def test_acc_view_may_end_exactly_at_src0s_last_byte(built):
    """The bound is inclusive of the last element's bytes (ggml's own assert stops at its first byte)."""
    node, srcs = built["acc"]
    a, b = srcs[0], srcs[1]
    nb1, nb2, nb3 = a.nb[1], a.nb[2], a.nb[3]
    last_row_end = (b.ne[1] - 1) * nb1 + (b.ne[2] - 1) * nb2 + (b.ne[3] - 1) * nb3 + b.ne[0] * 4
    offset = a.nb[3] * a.ne[3] - last_row_end
    assert check_node(with_params(node, p3=offset), srcs) == []
    with pytest.raises(UnsupportedOp, match="past src0"):
        check_node(with_params(node, p3=offset + 4), srcs)
