"""The one-MUL_MAT graph the RPC server tests share: a weight W [N, K] in a weights buffer,
x [M, K] and out [M, N] in a compute buffer, and its fp16 reference."""

from __future__ import annotations

import numpy as np

from ggml_rknpu.libggml.enums import GgmlOp, GgmlType
from support.rpc_testkit import T

MUL_MAT = int(GgmlOp.MUL_MAT)
K, N, M = 64, 32, 3


def f32(buffer, data, *ne, **kw) -> T:
    return T(ne=tuple(ne) + (1,) * (4 - len(ne)), buffer=buffer, data=data, **kw)


class MatmulGraph:
    """W [N,K] in a weights buffer, x [M,K] and out [M,N] in a compute buffer."""

    def __init__(self, c, w_type=int(GgmlType.F32), w_bytes=None):
        self.c = c
        self.wh, self.wb = c.alloc_base(1 << 16)
        self.ch, self.cb = c.alloc_base(1 << 16)
        self.w = T(ne=(K, N, 1, 1), buffer=self.wh, data=self.wb, type=w_type, name="blk.0.ffn_up.weight")
        self.x = f32(self.ch, self.cb, K, M, name="x")
        self.out = f32(self.ch, self.cb + 4096, N, M, op=MUL_MAT, src=(self.w.id, self.x.id), name="out")
        if w_bytes is not None:
            c.set_tensor(self.w, w_bytes)

    def compute(self):
        self.c.graph_compute([self.out], [self.w, self.x, self.out])
        return self.c.get_array(self.out)


def rng_w(seed=0):
    return np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)


def fp16_ref(x, w):
    return x @ w.astype(np.float16).astype(np.float32).T
