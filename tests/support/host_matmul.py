"""The reference of the host-placement tests: ``dst = a @ W^T`` computed by ggml-cpu in this
process, from a weight's GGUF bytes or from ggml's own CPU_REPACK copy of them."""

from __future__ import annotations

import numpy as np

from ggml_rknpu.libggml import abi, lib, repack
from ggml_rknpu.libggml.compute import HostContext, Threads, default_threads
from ggml_rknpu.libggml.enums import TYPE_TRAITS, GgmlOp, GgmlType

F32, MUL_MAT = int(GgmlType.F32), int(GgmlOp.MUL_MAT)


def ggml_cpu_matmul(type_: int, k: int, wq: bytes, a: np.ndarray, *, repacked: bool) -> np.ndarray:
    """``a`` [M, k] (f32) times the weight rows ``wq`` ([N, k] of ``type_``): [M, N] f32."""
    g = lib.load()
    block, block_bytes = TYPE_TRAITS[GgmlType(type_)]
    row = k // block * block_bytes
    n = len(wq) // row
    x = np.ascontiguousarray(a, dtype=np.float32)
    threads = Threads(g, default_threads())
    host = HostContext(g, threads, 4, (1,))
    w_bytes = np.frombuffer(wq, dtype=np.uint8).copy()
    out = np.zeros((x.shape[0], n), dtype=np.float32)
    copy = repack.repack(g, type_, k, n, w_bytes, "w") if repacked else None
    try:
        w = copy.tensor if copy is not None else host.tensor(
            type_, (k, n, 1, 1), (block_bytes, row, row * n, row * n), 0, (), 0, "w", (w_bytes, 0))
        xt = host.new_tensor_contiguous(F32, (k, x.shape[0], 1, 1), "a", x)
        d = host.new_tensor_contiguous(F32, (n, x.shape[0], 1, 1), "d", out)
        d.contents.op, d.contents.flags = MUL_MAT, abi.GGML_TENSOR_FLAG_COMPUTE
        host.link(d, [w, xt], None, 0)
        seg = host.segment([d])
        host.finish()
        seg.run()
    finally:
        host.close()
        threads.close()
        if copy is not None:
            copy.close()
    return out
