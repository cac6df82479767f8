"""--npu-memory: the engine stays within its cap, weights beyond it run on the host from their
ggml bytes with the same results, the stats say how many weights and bytes are where, and
GET_DEVICE_MEMORY keeps reporting what ALLOC_BUFFER accepts."""

from __future__ import annotations

import numpy as np
import pytest

import ggml_rknpu
from ggml_rknpu.libggml.enums import GgmlOp
from ggml_rknpu.server.rpc import report
from support.rpc_testkit import GIB, T, serve

pytestmark = pytest.mark.timeout(180)
MUL_MAT = int(GgmlOp.MUL_MAT)
K, N, M, N_WEIGHTS = 256, 256, 2, 4
W_BYTES = N * K * 4                       # f32 ggml bytes; staged as fp16: N * K * 2 on the NPU


def _run(cap_bytes):
    """Four independent x @ W_i^T in one graph, twice; (outputs, state, engine used bytes)."""
    npu = ggml_rknpu.open(device="sim-rknpu")
    npu.memory_cap = cap_bytes
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal((N, K)).astype(np.float32) for _ in range(N_WEIGHTS)]
    outs = []
    try:
        with serve(npu=npu) as st:
            with st.client() as c:
                wh, wb = c.alloc_base(N_WEIGHTS * W_BYTES)
                ch, cb = c.alloc_base(1 << 20)
                x = T(ne=(K, M, 1, 1), buffer=ch, data=cb, name="x")
                wt = [T(ne=(K, N, 1, 1), buffer=wh, data=wb + i * W_BYTES, name=f"blk.{i}.w") for i in range(N_WEIGHTS)]
                dst = [T(ne=(N, M, 1, 1), buffer=ch, data=cb + 4096 + i * N * M * 4, op=MUL_MAT,
                         src=(wt[i].id, x.id), name=f"out{i}") for i in range(N_WEIGHTS)]
                for t, w in zip(wt, ws):
                    c.set_array(t, w)
                for n_pass in range(2):
                    a = rng.standard_normal((M, K)).astype(np.float32)
                    c.set_array(x, a)
                    if n_pass == 0:
                        c.graph_compute(dst, [*wt, x, *dst])
                    else:
                        c.graph_recompute()
                    for d, w in zip(dst, ws):
                        got = c.get_array(d).reshape(M, N)
                        np.testing.assert_allclose(got, a @ w.T, rtol=2e-2, atol=5e-2)
                        outs.append(got)
                free, total = c.device_memory()
                stats = report.stats_dict(st.state)
                used = npu.memory_used()
        return outs, st.state, used, stats, (free, total)
    finally:
        npu.close()


def test_a_cap_below_the_weights_keeps_results_and_bounds_npu_memory():
    full, full_state, full_used, _, _ = _run(None)
    assert full_state.weight_stats.staged == 0 and full_state.weight_stats.peak_staged == N_WEIGHTS
    cap = full_used // 2
    capped, state, used, stats, (free, total) = _run(cap)
    for a, b in zip(full, capped):
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=5e-2)   # NPU fp16 vs host exact for some
    w = stats["weights"]                 # read while the client was connected
    assert w["staged"] >= 1 and w["host_now"] >= 1 and w["staged"] + w["host_now"] == N_WEIGHTS
    assert w["matmul_failures"] == 0     # refused at staging; no staged weight starved of scratch (the reserve)
    assert w["staged_bytes"] == w["staged"] * W_BYTES and w["host_bytes_now"] == w["host_now"] * W_BYTES
    assert state.weight_stats.host_now == 0      # the client left: nothing counted any more
    mem = stats["npu_memory"]
    assert used <= cap and (mem["used_bytes"], mem["cap_bytes"]) == (used, cap) and used <= mem["peak_bytes"] <= cap
    assert total == 4 * GIB - 4096 and free > N_WEIGHTS * W_BYTES   # buffers are still accepted beyond the cap
