"""Split matmuls (``--placement-split``): where the board models price a split fastest, the
first rows of the weight run on the NPU and the rest in ggml-cpu at once, joined as one
MUL_MAT: the host columns bit-for-bit ggml-cpu's on those rows (repacked where ggml
repacks), the NPU columns within the fp16 bound; when the NPU side fails its rows run in
ggml-cpu's plain kernel, bit for bit, beside the host part's unchanged columns."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from ggml_rknpu.libggml.enums import TYPE_TRAITS, GgmlOp, GgmlType
from ggml_rknpu.server.placement_policy import Placer
from ggml_rknpu.server.rpc import report
from support.host_matmul import ggml_cpu_matmul
from support.rpc_testkit import FakeNpu, T, serve

pytestmark = pytest.mark.timeout(120)
MUL_MAT = int(GgmlOp.MUL_MAT)
F32 = int(GgmlType.F32)
K, N, M = 1024, 4096, 4


def row_bytes(type_: int) -> int:
    block, size = TYPE_TRAITS[GgmlType(type_)]
    return K // block * size


def ggml_cpu(type_: int, wq: bytes, a: np.ndarray, *, repacked: bool) -> np.ndarray:
    """dst = a @ W^T in ggml-cpu in-process (W: the given rows' GGUF bytes, or ggml's CPU_REPACK copy)."""
    return ggml_cpu_matmul(type_, K, wq, a, repacked=repacked)


def _serve(quant: str, fail: bool = False):
    type_ = int(GgmlType[quant])
    rng = np.random.default_rng(3)
    w = rng.standard_normal((N, K)).astype(np.float32)
    wq = quants.quantize(w, GGMLQuantizationType[quant]).tobytes()
    a = rng.standard_normal((M, K)).astype(np.float32)
    npu = FakeNpu()
    npu.fail_matmul = fail
    with serve(npu=npu, placement="auto", placement_split=True, host_repack=True) as st:
        with st.client() as c:
            wh, wb = c.alloc_base(len(wq))
            ch, cb = c.alloc_base(1 << 20)
            wt = T(ne=(K, N, 1, 1), buffer=wh, data=wb, type=type_, name="blk.0.ffn_up.weight")
            x = T(ne=(K, M, 1, 1), buffer=ch, data=cb, name="x")
            d = T(ne=(N, M, 1, 1), buffer=ch, data=cb + 65536, op=MUL_MAT, src=(wt.id, x.id), name="out")
            c.set_tensor(wt, wq)
            c.set_array(x, a)
            c.graph_compute([d], [wt, x, d])
            out = c.get_array(d).reshape(M, N)
            stats = report.stats_dict(st.state)
    return type_, wq, a, out, npu, stats


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_0"])
def test_split_matmul_joins_both_sides_exactly(quant):
    type_, wq, a, out, npu, stats = _serve(quant)
    choice, _ = Placer("auto", "fp16", 1, 4, host_repack=True, split=True).choice(quant, M, K, N)
    n_npu = N - choice.host_rows
    assert choice.where == "split" and 0 < n_npu < N
    assert stats["split_matmuls"] == 1 and npu.uploads == 1 and npu.matmuls == 1
    assert [r["where"] for r in stats["placement"]["by_kind"]] == ["split"]
    row = row_bytes(type_)
    host_rows = ggml_cpu(type_, wq[n_npu * row:], a, repacked=True)
    np.testing.assert_array_equal(out[:, n_npu:], host_rows)              # ggml-cpu's own arithmetic
    # the NPU side holds the weight in fp16 (activations as sent): each product off by at most
    # 2^-11 of |a||w| from the exact product of the GGUF weight, beside float32 summation
    w = quants.dequantize(np.frombuffer(wq, dtype=np.uint8).reshape(N, -1), GGMLQuantizationType[quant])
    exact = a.astype(np.float64) @ w[:n_npu].astype(np.float64).T
    bound = 2.0 ** -11 * (np.abs(a) @ np.abs(w[:n_npu]).T) + 1e-4
    err = np.abs(out[:, :n_npu] - exact)
    assert (err <= bound).all(), float((err / bound).max())
    assert not np.array_equal(out[:, :n_npu], ggml_cpu(type_, wq, a, repacked=False)[:, :n_npu])   # not ggml-cpu's


def test_split_npu_failure_runs_its_rows_on_the_host():
    type_, wq, a, out, npu, stats = _serve("Q8_0", fail=True)
    assert npu.matmuls == 0 and stats["split_matmuls"] == 0
    n_npu = N - Placer("auto", "fp16", 1, 4, host_repack=True, split=True).choice("Q8_0", M, K, N)[0].host_rows
    cut = n_npu * row_bytes(type_)
    np.testing.assert_array_equal(out[:, :n_npu], ggml_cpu(type_, wq[:cut], a, repacked=False))
    np.testing.assert_array_equal(out[:, n_npu:], ggml_cpu(type_, wq[cut:], a, repacked=True))   # (q8_0_4x4 on the A76)


def test_split_siblings_are_never_grouped():
    """Two split matmuls reading one activation on an engine that groups siblings: each runs
    split on its own (a group would write whole rows of dst), both exact on the host columns."""
    from support.rpc_testkit import FusingFakeNpu

    type_ = int(GgmlType.Q8_0)
    rng = np.random.default_rng(5)
    wq = [quants.quantize(rng.standard_normal((N, K)).astype(np.float32), GGMLQuantizationType.Q8_0).tobytes()
          for _ in range(2)]
    a = rng.standard_normal((M, K)).astype(np.float32)
    with serve(npu=FusingFakeNpu(), placement="auto", placement_split=True, host_repack=True) as st:
        with st.client() as c:
            wh, wb = c.alloc_base(2 * len(wq[0]))
            ch, cb = c.alloc_base(1 << 20)
            x = T(ne=(K, M, 1, 1), buffer=ch, data=cb, name="x")
            wt = [T(ne=(K, N, 1, 1), buffer=wh, data=wb + i * len(wq[0]), type=type_, name=f"blk.0.ffn_{g}.weight")
                  for i, g in enumerate(("gate", "up"))]
            dst = [T(ne=(N, M, 1, 1), buffer=ch, data=cb + 65536 + i * N * M * 4, op=MUL_MAT, src=(wt[i].id, x.id),
                     name=f"out{i}") for i in range(2)]
            for t, w in zip(wt, wq):
                c.set_tensor(t, w)
            c.set_array(x, a)
            c.graph_compute(dst, [*wt, x, *dst])
            outs = [c.get_array(d).reshape(M, N) for d in dst]
            stats = report.stats_dict(st.state)
    assert stats["split_matmuls"] == 2 and stats["npu_groups_planned"] == 0
    n_npu = N - Placer("auto", "fp16", 1, 4, host_repack=True, split=True).choice("Q8_0", M, K, N)[0].host_rows
    for out, w in zip(outs, wq):
        np.testing.assert_array_equal(out[:, n_npu:], ggml_cpu(type_, w[n_npu * row_bytes(type_):], a, repacked=True))
