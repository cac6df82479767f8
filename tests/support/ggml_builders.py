"""ggml's own builders through ctypes, for the validator's tests: a scratch no-alloc
context whose tensors read back as RpcTensor, and one node per admitted op family as
ggml itself makes it (tests/server/ops/test_ops_rules.py, tests/server/test_rpc_malformed.py)."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest

from ggml_rknpu.libggml import abi
from ggml_rknpu.libggml.enums import GgmlGluOp, GgmlOp, GgmlType, GgmlUnaryOp
from ggml_rknpu.libggml.lib import TensorP
from ggml_rknpu.server.ops import geometry as geo
from ggml_rknpu.server.ops.rules import check_node
from ggml_rknpu.server.ops.vocabulary import UnsupportedOp
from ggml_rknpu.server.tensor import RpcTensor

F32, F16, BF16, I32, I64, Q4_0, Q8_0 = (int(GgmlType[n]) for n in ("F32", "F16", "BF16", "I32", "I64", "Q4_0", "Q8_0"))
_VP, _I, _I64, _F, _B, _SZ = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_bool, ctypes.c_size_t

# builder name -> argtypes after the context (pinned ggml.h)
BUILDERS: dict[str, list[type[ctypes._CData]]] = {
    "ggml_add": [TensorP, TensorP], "ggml_mul": [TensorP, TensorP], "ggml_div": [TensorP, TensorP],
    "ggml_mul_mat": [TensorP, TensorP], "ggml_mul_mat_id": [TensorP, TensorP, TensorP],
    "ggml_get_rows": [TensorP, TensorP], "ggml_set_rows": [TensorP, TensorP, TensorP],
    "ggml_cpy": [TensorP, TensorP], "ggml_cast": [TensorP, _I], "ggml_cont": [TensorP], "ggml_rms_norm": [TensorP, _F],
    "ggml_norm": [TensorP, _F], "ggml_scale": [TensorP, _F], "ggml_soft_max_ext": [TensorP, TensorP, _F, _F],
    "ggml_rope_ext": [TensorP, TensorP, TensorP, _I, _I, _I, _F, _F, _F, _F, _F, _F],
    "ggml_unary": [TensorP, _I], "ggml_glu_split": [TensorP, TensorP, _I], "ggml_glu": [TensorP, _I, _B],
    "ggml_argsort": [TensorP, _I], "ggml_top_k": [TensorP, _I], "ggml_concat": [TensorP, TensorP, _I],
    "ggml_sum_rows": [TensorP], "ggml_add_id": [TensorP, TensorP, TensorP], "ggml_ssm_conv": [TensorP, TensorP],
    "ggml_flash_attn_ext": [TensorP, TensorP, TensorP, TensorP, _F, _F, _F], "ggml_repeat": [TensorP, TensorP],
    "ggml_transpose": [TensorP], "ggml_permute": [TensorP, _I, _I, _I, _I], "ggml_cumsum": [TensorP],
    "ggml_pad": [TensorP, _I, _I, _I, _I], "ggml_argmax": [TensorP], "ggml_mean": [TensorP],
    # vision towers (ops/rules_conv.py)
    "ggml_conv_2d_direct": [TensorP, TensorP, *[_I] * 6], "ggml_conv_2d_dw_direct": [TensorP, TensorP, *[_I] * 6],
    "ggml_conv_3d_direct": [TensorP, TensorP, *[_I] * 12], "ggml_conv_transpose_1d": [TensorP, TensorP, _I, _I, _I],
    "ggml_conv_transpose_2d_p0": [TensorP, TensorP, _I], "ggml_im2col_3d": [TensorP, TensorP, _I64, *[_I] * 9, _I],
    "ggml_col2im_1d": [TensorP, _I, _I, _I], "ggml_pool_1d": [TensorP, _I, _I, _I, _I],
    "ggml_pool_2d": [TensorP, _I, _I, _I, _I, _I, _F, _F], "ggml_interpolate": [TensorP, *[_I64] * 4, ctypes.c_uint32],
    "ggml_pad_reflect_1d": [TensorP, _I, _I],
    # backward pass and optimizer (ops/rules_training.py)
    "ggml_acc": [TensorP, TensorP, _SZ, _SZ, _SZ, _SZ], "ggml_set": [TensorP, TensorP, _SZ, _SZ, _SZ, _SZ],
    "ggml_out_prod": [TensorP, TensorP], "ggml_get_rows_back": [TensorP, TensorP, TensorP],
    "ggml_repeat_back": [TensorP, TensorP], "ggml_silu_back": [TensorP, TensorP],
    "ggml_rms_norm_back": [TensorP, TensorP, _F], "ggml_soft_max_ext_back": [TensorP, TensorP, _F, _F],
    "ggml_rope_ext_back": [TensorP, TensorP, TensorP, _I, _I, _I, _F, _F, _F, _F, _F, _F],
    "ggml_cross_entropy_loss": [TensorP, TensorP], "ggml_cross_entropy_loss_back": [TensorP, TensorP, TensorP],
    "ggml_opt_step_adamw": [TensorP] * 5, "ggml_opt_step_sgd": [TensorP] * 3,
    # DeepSeek-V4 (ops/rules_dsv4.py)
    "ggml_lightning_indexer": [TensorP] * 4, "ggml_dsv4_hc_comb": [TensorP, TensorP, TensorP, _F, _I],
    "ggml_dsv4_hc_pre": [TensorP, TensorP], "ggml_dsv4_hc_pre_gated": [TensorP, TensorP, _F],
    "ggml_dsv4_hc_post": [TensorP] * 4,
}
PREDICATES = ("ggml_is_contiguous", "ggml_is_contiguous_1", "ggml_is_contiguous_2", "ggml_is_contiguous_rows",
              "ggml_is_transposed", "ggml_nbytes")


class Scratch:
    """A no-alloc ggml context for builder calls; tensors read back as RpcTensor."""

    def __init__(self, g, n_tensors: int = 320):       # every node of _made_by_ggml fits
        self.g = g
        self.ctx = g.context(n_tensors, ())
        self._ids: dict[int, int] = {}

    def fn(self, name: str):
        f = getattr(self.g.base, name)
        if name in BUILDERS:
            f.restype, f.argtypes = TensorP, [_VP, *BUILDERS[name]]
        return f

    def new(self, type_: int, *ne: int) -> TensorP:
        return self.g.new_tensor(self.ctx, type_, tuple(ne) + (1,) * (4 - len(ne)))

    def call(self, name: str, *args) -> TensorP:
        return self.fn(name)(self.ctx, *args)

    def rpc(self, t: TensorP) -> RpcTensor:
        c = t.contents
        addr = ctypes.cast(t, ctypes.c_void_p).value or 0
        return RpcTensor(id=addr, type=c.type, buffer=1, ne=tuple(c.ne), nb=tuple(c.nb), op=c.op,
                         op_params=tuple(c.op_params), flags=c.flags,
                         src=tuple(ctypes.cast(s, ctypes.c_void_p).value or 0 for s in c.src),
                         view_src=ctypes.cast(c.view_src, ctypes.c_void_p).value or 0, view_offs=c.view_offs,
                         data=0, name="", use_count=0)

    def node(self, t) -> tuple[RpcTensor, tuple]:
        """(node, sources); a source that is the node itself (ggml_cast's src1) is the node object."""
        node = self.rpc(t)
        return node, tuple(None if not s else node if ctypes.cast(s, ctypes.c_void_p).value == node.id
                           else self.rpc(s) for s in t.contents.src)

    def close(self):
        self.g.ggml_free(self.ctx)


def assert_refused(node: RpcTensor, srcs: tuple, reason: str) -> None:
    """check_node refuses the node with a reason matching ``reason``, under the node's op name."""
    with pytest.raises(UnsupportedOp, match=reason) as err:
        check_node(node, srcs)
    assert GgmlOp(node.op).name in err.value.signature


def with_params(node: RpcTensor, **at: int) -> RpcTensor:
    """node with op_params changed, e.g. ``with_params(n, p0=2)`` (int32 values, as on the wire)."""
    p = list(node.op_params)
    for k, v in at.items():
        p[int(k[1:])] = v & 0xFFFFFFFF
    return dataclasses.replace(node, op_params=tuple(p))


def with_src(srcs: tuple, i: int, **change) -> tuple:
    """srcs with source i changed (a new shape gets contiguous strides unless they are given)."""
    if "ne" in change and "nb" not in change:
        change["nb"] = geo.contiguous_nb(change.get("type", srcs[i].type), change["ne"])
    out = list(srcs)
    out[i] = dataclasses.replace(srcs[i], **change)
    return tuple(out)


def _made_by_ggml(sc: Scratch):
    """(label, builder result) for one representative node per admitted op family."""
    new, call = sc.new, sc.call
    a, b = new(F32, 64, 7, 3, 2), new(F32, 64, 1, 3, 1)
    w, wq = new(F16, 64, 32, 1, 1), new(Q4_0, 64, 32, 1, 1)
    x = new(F32, 64, 5, 1, 1)
    rows = new(F32, 64, 9, 1, 1)
    idx = new(I32, 4, 1, 1, 1)
    kv = new(F16, 64, 16, 1, 1)
    kv_idx = new(I64, 5, 1, 1, 1)
    experts, ids = new(F16, 64, 32, 8, 1), new(I32, 2, 5, 1, 1)
    bx = new(F32, 64, 2, 5, 1)
    q, k, v, mask = new(F32, 64, 5, 4, 1), new(F16, 64, 16, 2, 1), new(F16, 64, 16, 2, 1), new(F16, 16, 5, 1, 1)
    pos, ff = new(I32, 3, 1, 1, 1), new(F32, 32, 1, 1, 1)
    yield "add", call("ggml_add", a, b)
    yield "mul (broadcast)", call("ggml_mul", a, b)
    yield "div", call("ggml_div", a, a)
    yield "mul_mat f16", call("ggml_mul_mat", w, x)
    yield "mul_mat q4_0", call("ggml_mul_mat", wq, x)
    yield "mul_mat permuted KQ", call("ggml_mul_mat", call("ggml_permute", kv, 0, 1, 2, 3), x)
    yield "mul_mat_id", call("ggml_mul_mat_id", experts, bx, ids)
    yield "get_rows", call("ggml_get_rows", rows, idx)
    yield "get_rows q4_0", call("ggml_get_rows", wq, idx)
    yield "set_rows", call("ggml_set_rows", kv, x, kv_idx)
    yield "cpy f32->f16", call("ggml_cpy", x, new(F16, 64, 5, 1, 1))
    yield "cpy f32->q8_0", call("ggml_cpy", x, new(Q8_0, 64, 5, 1, 1))
    yield "cast f32->f16", call("ggml_cast", x, F16)          # a CPY whose src1 is the node itself
    yield "cont of transpose", call("ggml_cont", call("ggml_transpose", x))
    yield "rms_norm", call("ggml_rms_norm", a, 1e-6)
    yield "norm", call("ggml_norm", a, 1e-5)
    yield "scale", call("ggml_scale", a, 0.5)
    yield "soft_max_ext", call("ggml_soft_max_ext", new(F32, 16, 5, 4, 1), mask, 0.125, 0.0)
    yield "rope_ext neox", call("ggml_rope_ext", new(F32, 64, 4, 3, 1), pos, ff, 64, 2, 4096,
                                10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
    yield "unary silu", call("ggml_unary", a, int(GgmlUnaryOp.SILU))
    yield "glu swiglu split", call("ggml_glu_split", a, a, int(GgmlGluOp.SWIGLU))
    yield "glu geglu fused", call("ggml_glu", a, int(GgmlGluOp.GEGLU), False)
    yield "argsort", call("ggml_argsort", a, abi.GGML_SORT_ORDER_DESC)
    yield "top_k", call("ggml_top_k", a, 4)
    yield "concat", call("ggml_concat", a, a, 1)
    yield "sum_rows", call("ggml_sum_rows", a)
    yield "mean", call("ggml_mean", a)
    yield "argmax", call("ggml_argmax", new(F32, 10, 3, 1, 1))
    yield "cumsum", call("ggml_cumsum", a)
    yield "pad", call("ggml_pad", a, 2, 1, 0, 0)
    yield "repeat", call("ggml_repeat", b, a)
    yield "add_id", call("ggml_add_id", new(F32, 64, 2, 5, 1), new(F32, 64, 8, 1, 1), ids)
    yield "ssm_conv", call("ggml_ssm_conv", new(F32, 7, 16, 2, 1), new(F32, 4, 16, 1, 1))
    yield "flash_attn_ext", call("ggml_flash_attn_ext", q, k, v, mask, 0.125, 0.0, 0.0)
    yield from _vision(sc)
    yield from _training(sc)
    yield from _dsv4(sc)


def _vision(sc: Scratch):
    """The vision-tower ops (ops/rules_conv.py), with strides, padding and dilation other than 1/0/1."""
    new, call = sc.new, sc.call
    img, img3 = new(F32, 9, 8, 3, 2), new(F32, 7, 6, 5, 6)             # [W, H, C, N]; [W, H, D, C*N]
    yield "conv_2d f16 kernel", call("ggml_conv_2d_direct", new(F16, 3, 3, 3, 4), img, 2, 1, 1, 0, 1, 2)
    yield "conv_2d_dw", call("ggml_conv_2d_dw_direct", new(F32, 3, 3, 1, 3), img, 1, 2, 1, 1, 1, 1)
    yield "conv_3d", call("ggml_conv_3d_direct", new(F32, 2, 3, 2, 3 * 4), img3, 1, 2, 1, 0, 1, 1, 1, 1, 2, 3, 2, 4)
    yield "conv_transpose_1d", call("ggml_conv_transpose_1d", new(F32, 3, 4, 5, 1), new(F32, 10, 5, 1, 1), 2, 0, 1)
    yield "conv_transpose_2d", call("ggml_conv_transpose_2d_p0", new(F16, 3, 3, 4, 3), img, 2)
    yield "im2col_3d", call("ggml_im2col_3d", new(F16, 2, 3, 2, 3 * 4), img3, 3, 1, 2, 1, 0, 1, 1, 1, 1, 2, F16)
    yield "col2im_1d", call("ggml_col2im_1d", new(F32, 4 * 3, 7, 1, 1), 2, 3, 1)
    yield "pool_1d", call("ggml_pool_1d", img, abi.GGML_OP_POOL_MAX, 3, 2, 1)
    yield "pool_2d", call("ggml_pool_2d", img, abi.GGML_OP_POOL_AVG, 3, 2, 2, 1, 1.0, 0.0)
    yield "upscale bilinear", call("ggml_interpolate", img, 17, 5, 3, 2,
                                   abi.GGML_SCALE_MODE_BILINEAR | abi.GGML_SCALE_FLAG_ALIGN_CORNERS)
    yield "pad_reflect_1d", call("ggml_pad_reflect_1d", img, 2, 3)


def _training(sc: Scratch):
    """The backward-pass and optimizer ops (ops/rules_training.py)."""
    new, call = sc.new, sc.call
    a, b = new(F32, 64, 7, 3, 2), new(F32, 32, 5, 3, 2)
    nb = a.contents.nb
    yield "acc", call("ggml_acc", a, b, nb[1], nb[2], nb[3], 8 * 4 + nb[1])
    ai = new(I32, 12, 5, 4, 3)
    yield "set i32", call("ggml_set", ai, new(I32, 6, 5, 4, 3), *ai.contents.nb[1:], 3 * 4)
    yield "out_prod", call("ggml_out_prod", new(F32, 64, 16, 2, 1), new(F32, 8, 16, 2, 3))
    yield "out_prod q8_0", call("ggml_out_prod", new(Q8_0, 64, 16, 2, 3), new(F32, 8, 16, 2, 3))
    yield "out_prod transposed b", call("ggml_out_prod", new(F32, 64, 16, 1, 1),
                                        call("ggml_transpose", new(F32, 16, 8, 1, 1)))
    yield "get_rows_back", call("ggml_get_rows_back", new(F16, 64, 4), new(I32, 4), new(F32, 64, 9))
    yield "repeat_back", call("ggml_repeat_back", a, new(F32, 64, 1, 3, 1))
    yield "silu_back", call("ggml_silu_back", a, a)
    yield "rms_norm_back", call("ggml_rms_norm_back", a, a, 1e-6)
    yield "soft_max_back", call("ggml_soft_max_ext_back", new(F32, 16, 5, 4, 1), new(F32, 16, 5, 4, 1), 0.5, 0.0)
    yield "rope_ext_back", call("ggml_rope_ext_back", new(F32, 64, 4, 3, 1), new(I32, 3), None, 64, 2, 4096,
                                10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
    logits = new(F32, 10, 5, 4, 3)
    yield "cross_entropy_loss", call("ggml_cross_entropy_loss", logits, new(F32, 10, 5, 4, 3))
    yield "cross_entropy_loss_back", call("ggml_cross_entropy_loss_back", new(F32, 1), logits, new(F32, 10, 5, 4, 3))
    w = new(F32, 10, 5, 4, 3)
    set_param = sc.g.base.ggml_set_param
    set_param.restype, set_param.argtypes = None, [TensorP]
    set_param(w)
    yield "opt_step_adamw", call("ggml_opt_step_adamw", w, new(F32, 10, 5, 4, 3), new(F32, 10, 5, 4, 3),
                                 new(F32, 10, 5, 4, 3), new(F32, 7))
    yield "opt_step_sgd", call("ggml_opt_step_sgd", w, new(F32, 10, 5, 4, 3), new(F32, 2))


def _dsv4(sc: Scratch):
    """The DeepSeek-V4 ops (ops/rules_dsv4.py)."""
    new, call = sc.new, sc.call
    q, w, mask = new(F32, 128, 8, 5, 2), new(F32, 8, 5, 1, 2), new(F16, 16, 5, 1, 1)
    yield "lightning_indexer f16 K", call("ggml_lightning_indexer", q, new(F16, 128, 1, 16, 2), w, mask)
    yield "lightning_indexer q4_0 K", call("ggml_lightning_indexer", q, new(Q4_0, 128, 1, 16, 2), w, mask)
    yield "dsv4_hc_comb", call("ggml_dsv4_hc_comb", new(F32, 24, 5), new(F32, 3), new(F32, 24), 1e-6, 3)
    x = new(F32, 64, 4, 5)
    yield "dsv4_hc_pre", call("ggml_dsv4_hc_pre", x, new(F32, 4, 5))
    yield "dsv4_hc_pre gated", call("ggml_dsv4_hc_pre_gated", x, new(F32, 64, 4, 5), 0.5)
    res, post = new(F32, 64, 4, 5), new(F32, 4, 5)
    yield "dsv4_hc_post", call("ggml_dsv4_hc_post", new(F32, 64, 5), res, post, new(F32, 4, 4, 5))
    yield "dsv4_hc_post no comb", call("ggml_dsv4_hc_post", new(F32, 64, 5), res, post, None)
