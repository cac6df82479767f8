"""ggml's own builders through ctypes, for the validator's tests: a scratch no-alloc
context whose tensors read back as RpcTensor, and one node per admitted op family as
ggml itself makes it (tests/ops/test_ops_rules.py, tests/server/test_rpc_malformed.py)."""

from __future__ import annotations

import ctypes

from ggml_rknpu.ggml.enums import GgmlGluOp, GgmlType, GgmlUnaryOp
from ggml_rknpu.ggml.tensor import RpcTensor
from ggml_rknpu.hostggml import abi
from ggml_rknpu.hostggml.lib import TensorP

F32, F16, BF16, I32, I64, Q4_0, Q8_0 = (int(GgmlType[n]) for n in ("F32", "F16", "BF16", "I32", "I64", "Q4_0", "Q8_0"))
_VP, _I, _I64, _F, _B, _SZ = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_bool, ctypes.c_size_t

# builder name -> argtypes after the context (pinned ggml.h)
BUILDERS = {
    "ggml_add": [TensorP, TensorP], "ggml_mul": [TensorP, TensorP], "ggml_div": [TensorP, TensorP],
    "ggml_mul_mat": [TensorP, TensorP], "ggml_mul_mat_id": [TensorP, TensorP, TensorP],
    "ggml_get_rows": [TensorP, TensorP], "ggml_set_rows": [TensorP, TensorP, TensorP],
    "ggml_cpy": [TensorP, TensorP], "ggml_cont": [TensorP], "ggml_rms_norm": [TensorP, _F],
    "ggml_norm": [TensorP, _F], "ggml_scale": [TensorP, _F], "ggml_soft_max_ext": [TensorP, TensorP, _F, _F],
    "ggml_rope_ext": [TensorP, TensorP, TensorP, _I, _I, _I, _F, _F, _F, _F, _F, _F],
    "ggml_unary": [TensorP, _I], "ggml_glu_split": [TensorP, TensorP, _I], "ggml_glu": [TensorP, _I, _B],
    "ggml_argsort": [TensorP, _I], "ggml_top_k": [TensorP, _I], "ggml_concat": [TensorP, TensorP, _I],
    "ggml_sum_rows": [TensorP], "ggml_add_id": [TensorP, TensorP, TensorP], "ggml_ssm_conv": [TensorP, TensorP],
    "ggml_flash_attn_ext": [TensorP, TensorP, TensorP, TensorP, _F, _F, _F], "ggml_repeat": [TensorP, TensorP],
    "ggml_transpose": [TensorP], "ggml_permute": [TensorP, _I, _I, _I, _I], "ggml_cumsum": [TensorP],
    "ggml_pad": [TensorP, _I, _I, _I, _I], "ggml_argmax": [TensorP], "ggml_mean": [TensorP],
}
PREDICATES = ("ggml_is_contiguous", "ggml_is_contiguous_1", "ggml_is_contiguous_2", "ggml_is_contiguous_rows",
              "ggml_is_transposed", "ggml_nbytes")


class Scratch:
    """A no-alloc ggml context for builder calls; tensors read back as RpcTensor."""

    def __init__(self, g, n_tensors: int = 64):
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

    def rpc(self, t) -> RpcTensor:
        c = t.contents
        addr = ctypes.cast(t, ctypes.c_void_p).value
        return RpcTensor(id=addr, type=c.type, buffer=1, ne=tuple(c.ne), nb=tuple(c.nb), op=c.op,
                         op_params=tuple(c.op_params), flags=c.flags,
                         src=tuple(ctypes.cast(s, ctypes.c_void_p).value or 0 for s in c.src),
                         view_src=ctypes.cast(c.view_src, ctypes.c_void_p).value or 0, view_offs=c.view_offs,
                         data=0, name="", use_count=0)

    def node(self, t) -> tuple[RpcTensor, tuple]:
        c = t.contents
        return self.rpc(t), tuple(self.rpc(s) if s else None for s in c.src)

    def close(self):
        self.g.ggml_free(self.ctx)


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
