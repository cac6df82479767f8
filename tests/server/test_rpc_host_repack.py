"""Repacked host copies: a host-placed Q4_0 matmul runs ggml-cpu's repacked kernel from a
CPU_REPACK copy, bit-for-bit what ggml-cpu computes from its own repack buffer, within
test-backend-ops' MUL_MAT bound of the plain kernel; rewriting the weight's bytes (a
command, or a node of another graph) repacks the copy before the next use; a type ggml does
not repack keeps the plain path."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from ggml_rknpu.libggml import lib, repack
from ggml_rknpu.libggml.enums import GgmlOp, GgmlType
from ggml_rknpu.server.rpc import report
from support.host_matmul import ggml_cpu_matmul
from support.rpc_testkit import FakeNpu, T, serve

pytestmark = pytest.mark.timeout(120)
MUL_MAT, CPY = int(GgmlOp.MUL_MAT), int(GgmlOp.CPY)
F32, Q4_0 = int(GgmlType.F32), int(GgmlType.Q4_0)
K, N = 256, 64
MAX_NMSE = 5e-4            # test-backend-ops' bound for MUL_MAT (test_mul_mat::max_nmse_err)
Q4_ROW = K // 32 * 18


def nmse(got: np.ndarray, ref: np.ndarray) -> float:
    return float(((got - ref) ** 2).sum() / (ref ** 2).sum())


def q4_0(rng, n: int = N) -> bytes:
    return quants.quantize(rng.standard_normal((n, K)).astype(np.float32), GGMLQuantizationType.Q4_0).tobytes()


def ggml_cpu(wq: bytes, a: np.ndarray, *, repacked: bool, n: int = N) -> np.ndarray:
    """dst = a @ W^T in ggml-cpu in-process: W from the GGUF bytes, or from ggml's own CPU_REPACK buffer."""
    assert len(wq) == n * Q4_ROW
    return ggml_cpu_matmul(Q4_0, K, wq, a, repacked=repacked)


def test_ggml_repacks_q4_0_here_and_not_f32():
    g = lib.load()
    rng = np.random.default_rng(0)
    copy = repack.repack(g, Q4_0, K, N, np.frombuffer(q4_0(rng), dtype=np.uint8).copy(), "w")
    assert copy is not None and copy.tensor.contents.extra and copy.nbytes == N * Q4_ROW
    copy.close()
    assert repack.repack(g, F32, K, N, np.zeros(K * N * 4, dtype=np.uint8), "f32") is None


@pytest.mark.parametrize("M", [1, 4])
def test_host_matmul_runs_the_repacked_kernel(M, caplog):
    caplog.set_level("INFO", logger="ggml_rknpu.server.host_copies")
    rng = np.random.default_rng(M)
    wq = [q4_0(rng), q4_0(rng)]
    a = rng.standard_normal((M, K)).astype(np.float32)
    outs = {}
    for repacked in (True, False):
        with serve(npu=FakeNpu(), placement="host", host_repack=repacked) as st:
            with st.client() as c:
                wh, wb = c.alloc_base(2 * N * Q4_ROW)
                ch, cb = c.alloc_base(1 << 20)
                x = T(ne=(K, M, 1, 1), buffer=ch, data=cb, name="x")
                wt = [T(ne=(K, N, 1, 1), buffer=wh, data=wb + i * N * Q4_ROW, type=Q4_0, name=f"blk.{i}.ffn_up.weight")
                      for i in range(2)]
                dst = [T(ne=(N, M, 1, 1), buffer=ch, data=cb + 65536 + i * N * M * 4, op=MUL_MAT,
                         src=(wt[i].id, x.id), name=f"out{i}") for i in range(2)]
                for t, w in zip(wt, wq):
                    c.set_tensor(t, w)
                c.set_array(x, a)
                c.graph_compute(dst, [*wt, x, *dst])
                outs[repacked] = [c.get_array(d).reshape(M, N) for d in dst]
                stats = report.stats_dict(st.state)
            assert stats["host_repacked"] == (2 if repacked else 0)
            said = [r.getMessage() for r in caplog.records if r.name == "ggml_rknpu.server.host_copies"]
            assert said == ([f"repacked host copies: 2 weights, {2 * N * Q4_ROW / 2**20:.1f} MiB in ggml-cpu's "
                             "CPU_REPACK layout beside their GGUF bytes"] if repacked else [])
            caplog.clear()
            assert stats["host_repacked_bytes"] == (2 * N * Q4_ROW if repacked else 0)
    for i, w in enumerate(wq):
        np.testing.assert_array_equal(outs[True][i], ggml_cpu(w, a, repacked=True))     # ggml's repacked kernel
        np.testing.assert_array_equal(outs[False][i], ggml_cpu(w, a, repacked=False))   # ggml's plain kernel
        assert nmse(outs[True][i], outs[False][i]) < MAX_NMSE


def test_rewritten_weight_is_repacked_before_its_next_use():
    rng = np.random.default_rng(7)
    old, new, fill = q4_0(rng), q4_0(rng), rng.standard_normal((N, K)).astype(np.float32)
    a = rng.standard_normal((4, K)).astype(np.float32)
    with serve(npu=FakeNpu(), placement="host", host_repack=True) as st:
        with st.client() as c:
            wh, wb = c.alloc_base(N * Q4_ROW)
            ch, cb = c.alloc_base(1 << 20)
            w = T(ne=(K, N, 1, 1), buffer=wh, data=wb, type=Q4_0, name="blk.0.ffn_up.weight")
            x = T(ne=(K, 4, 1, 1), buffer=ch, data=cb, name="x")
            d = T(ne=(N, 4, 1, 1), buffer=ch, data=cb + 65536, op=MUL_MAT, src=(w.id, x.id), name="out")
            c.set_tensor(w, old)
            c.set_array(x, a)
            c.graph_compute([d], [w, x, d])
            first = c.get_array(d).reshape(4, N)
            c.set_tensor(w, new)                                # a command rewrites the weight
            c.graph_compute([d], [w, x, d])                     # the same graph: replayed
            second = c.get_array(d).reshape(4, N)
            # a node of another graph writes the weight's bytes (quantizing f32 into them)
            f = T(ne=(K, N, 1, 1), buffer=ch, data=cb + 131072, name="fill")
            c.set_array(f, fill)
            cpy = T(ne=(K, N, 1, 1), buffer=wh, data=wb, type=Q4_0, op=CPY, src=(f.id, w.id), view_src=w.id,
                    name="overwrite")
            c.graph_compute([cpy], [f, w, cpy])
            c.graph_compute([d], [w, x, d])                     # replayed again: reads the graph's bytes
            third = c.get_array(d).reshape(4, N)
            written = c.get_tensor(w)
            stats = report.stats_dict(st.state)
    np.testing.assert_array_equal(first, ggml_cpu(old, a, repacked=True))
    np.testing.assert_array_equal(second, ggml_cpu(new, a, repacked=True))
    np.testing.assert_array_equal(third, ggml_cpu(written, a, repacked=True))
    assert written == quants.quantize(fill, GGMLQuantizationType.Q4_0).tobytes()
    assert stats["host_repacked"] == 1 and stats["host_repack_refreshes"] >= 2
