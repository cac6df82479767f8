"""--placement: host keeps every weight matmul in ggml-cpu from its ggml bytes (nothing
staged, no NPU memory, results exactly ggml-cpu's), npu stages every weight, auto follows
the board models per M bucket; the stats say per matmul kind and M where each went and
the two modeled times. MUL_MAT_ID experts too."""

from __future__ import annotations

import numpy as np
import pytest

from ggml_rknpu.cost import placement as pl
from ggml_rknpu.libggml.enums import GgmlOp, GgmlType
from ggml_rknpu.server.placement import HOST, NPU
from ggml_rknpu.server.placement_policy import HOST_REASON, Placer, matmul_kind
from ggml_rknpu.server.rpc import report
from support.rpc_testkit import FakeNpu, T, serve

pytestmark = pytest.mark.timeout(120)
MUL_MAT, MUL_MAT_ID = int(GgmlOp.MUL_MAT), int(GgmlOp.MUL_MAT_ID)
F32, F16, I32 = int(GgmlType.F32), int(GgmlType.F16), int(GgmlType.I32)
K = N = 1024
N_WEIGHTS = 2
W_BYTES = K * N * 4


def halves(rng, *shape) -> np.ndarray:
    """Random float32 values that fp16 holds exactly (the NPU side then rounds nothing)."""
    return rng.standard_normal(shape).astype(np.float16).astype(np.float32)


def _run(placement: str, M: int):
    """Two x @ W_i^T in one graph under ``placement``: (outputs, references, npu, state stats)."""
    npu = FakeNpu()
    rng = np.random.default_rng(M)
    ws = [halves(rng, N, K) for _ in range(N_WEIGHTS)]      # fp16-exact: the NPU side rounds nothing
    a = halves(rng, M, K)
    with serve(npu=npu, placement=placement) as st:
        with st.client() as c:
            wh, wb = c.alloc_base(N_WEIGHTS * W_BYTES)
            ch, cb = c.alloc_base(1 << 20)
            x = T(ne=(K, M, 1, 1), buffer=ch, data=cb, name="x")
            wt = [T(ne=(K, N, 1, 1), buffer=wh, data=wb + i * W_BYTES, name=f"blk.{i}.ffn_up.weight")
                  for i in range(N_WEIGHTS)]
            dst = [T(ne=(N, M, 1, 1), buffer=ch, data=cb + 65536 + i * N * M * 4, op=MUL_MAT,
                     src=(wt[i].id, x.id), name=f"out{i}") for i in range(N_WEIGHTS)]
            for t, w in zip(wt, ws):
                c.set_array(t, w)
            c.set_array(x, a)
            c.graph_compute(dst, [*wt, x, *dst])
            outs = [c.get_array(d).reshape(M, N) for d in dst]
            stats = report.stats_dict(st.state)
            stats["rendered"] = report.render_stats(st.state)
    return outs, [a @ w.T for w in ws], npu, stats


def _expected(M: int) -> pl.Choice:
    return pl.place_matmul(F32, pl.BUCKET_M[pl.bucket(M)], K, N, npu_dtype="fp16", cores=1, threads=4,
                           allow_split=False)


def test_host_placement_stages_nothing_and_is_ggml_cpu():
    outs, refs, npu, stats = _run("host", 4)
    for got, ref in zip(outs, refs):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-3)      # ggml-cpu's f32 matmul
    assert npu.uploads == 0 and npu.matmuls == 0 and stats["weights"]["staged"] == 0
    assert stats["host_matmul_reasons"] == {HOST_REASON: N_WEIGHTS}
    (rec,) = stats["placement"]["by_kind"]
    assert (rec["kind"], rec["M"], rec["type"], rec["where"], rec["planned"]) == ("ffn_up.weight", 4, "F32", HOST,
                                                                                 N_WEIGHTS)
    c = _expected(4)
    assert (rec["npu_s"], rec["host_s"], rec["basis"]) == (c.npu_s, c.host_s, "modeled")
    assert (f"ffn_up.weight (F32) M=4: host (NPU {c.npu_s * 1e6:.0f} µs, host {c.host_s * 1e6:.0f} µs, modeled), "
            f"{N_WEIGHTS} planned") in stats["rendered"]


def test_npu_placement_stages_every_weight():
    outs, refs, npu, stats = _run("npu", 1)
    assert npu.uploads == N_WEIGHTS and npu.matmuls == N_WEIGHTS
    assert stats["placement"]["by_kind"][0]["where"] == NPU
    for got, ref in zip(outs, refs):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-3)


def test_auto_follows_the_board_models_per_bucket():
    seen = set()
    for M in (1, 16):
        want = _expected(M).where
        seen.add(want)
        outs, refs, npu, stats = _run("auto", M)
        assert npu.uploads == (N_WEIGHTS if want == NPU else 0), (M, want)
        assert [r["where"] for r in stats["placement"]["by_kind"]] == [want]
        for got, ref in zip(outs, refs):
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-3)
    assert seen == {NPU, HOST}        # this shape goes to the host at M = 1 and to the NPU at 16


def _experts(npu, placement: str):
    """One MUL_MAT_ID: as [64, 32, 4 experts] f16, 3 tokens x 2 used experts; (dst, server state)."""
    Ke, Ne, E, USED, TOK = 64, 32, 4, 2, 3
    rng = np.random.default_rng(0)
    with serve(npu=npu, placement=placement) as st:
        with st.client() as c:
            wh, wb = c.alloc_base(1 << 16)
            ch, cb = c.alloc_base(1 << 16)
            w = T(ne=(Ke, Ne, E, 1), buffer=wh, data=wb, type=F16, name="blk.0.ffn_up_exps.weight")
            b = T(ne=(Ke, 1, TOK, 1), buffer=ch, data=cb, name="b")
            ids = T(ne=(USED, TOK, 1, 1), buffer=ch, data=cb + 8192, type=I32, name="ids")
            out = T(ne=(Ne, USED, TOK, 1), buffer=ch, data=cb + 12288, op=MUL_MAT_ID, src=(w.id, b.id, ids.id),
                    name="ffn_moe_up")
            c.set_array(w, halves(rng, E, Ne, Ke).astype(np.float16))
            c.set_array(b, halves(rng, TOK, 1, Ke))
            c.set_array(ids, np.array([[2, 0], [0, 3], [2, 3]], dtype=np.int32))
            c.graph_compute([out], [w, b, ids, out])
            return np.frombuffer(c.get_tensor(out), np.float32).copy(), st.state
    raise AssertionError("unreachable")


def test_host_placement_keeps_experts_on_ggml_cpu():
    npu = FakeNpu()
    got, state = _experts(npu, "host")
    assert npu.uploads == 0 and state.weight_stats.experts_staged == 0
    assert state.stats.per_op[("MUL_MAT_ID", HOST)].ops == 1 and ("MUL_MAT_ID", NPU) not in state.stats.per_op
    rec = state.placer.records[("ffn_up_exps.weight", 6, "F16")]
    assert rec.where == HOST and rec.planned == 1
    reference, _ = _experts(None, "host")         # no engine: ggml-cpu's MUL_MAT_ID
    np.testing.assert_array_equal(got, reference)


def test_policy_checks_and_kinds():
    with pytest.raises(ValueError):
        Placer("fastest")
    with pytest.raises(ValueError):
        Placer("auto", threads=8)
    assert matmul_kind("blk.12.attn_q.weight") == "attn_q.weight" and matmul_kind("output.weight") == "output.weight"


def test_host_weights_take_no_npu_memory():
    """On the simulated NPU: the same graph with every weight on the host leaves the engine's
    memory where it was; with the weights on the NPU it holds at least their fp16 copies."""
    import ggml_rknpu

    used = {}
    for placement in ("host", "npu"):
        npu = ggml_rknpu.open(device="sim-rknpu")
        try:
            before = npu.memory_used()
            rng = np.random.default_rng(0)
            w, a = halves(rng, 256, 512), halves(rng, 1, 512)
            with serve(npu=npu, placement=placement) as st:
                with st.client() as c:
                    wh, wb = c.alloc_base(w.nbytes)
                    ch, cb = c.alloc_base(1 << 16)
                    wt = T(ne=(512, 256, 1, 1), buffer=wh, data=wb, name="blk.0.attn_q.weight")
                    x = T(ne=(512, 1, 1, 1), buffer=ch, data=cb, name="x")
                    d = T(ne=(256, 1, 1, 1), buffer=ch, data=cb + 4096, op=MUL_MAT, src=(wt.id, x.id), name="q")
                    c.set_array(wt, w)
                    c.set_array(x, a)
                    c.graph_compute([d], [wt, x, d])
                    np.testing.assert_allclose(c.get_array(d).reshape(1, 256), a @ w.T, rtol=1e-3, atol=1e-2)
                    used[placement] = npu.memory_used() - before
        finally:
            npu.close()
    assert used["host"] == 0 and used["npu"] >= 256 * 512 * 2


@pytest.mark.parametrize("weight_type", ["Q4_0", "Q8_0", "Q4_K", "F16"])
@pytest.mark.parametrize("M", [1, 4, 16, 512])
@pytest.mark.parametrize("K,N", [(1152, 6912), (6912, 1152), (1152, 262144)])
def test_host_repack_prices_the_host_at_the_repacked_kernel(weight_type, M, K, N):
    """With repacked host copies the host side is priced at ggml-cpu's repacked kernel; the
    choice is still the argmin of the two times (MUL_MAT_ID experts stay plain: not repacked)."""
    placer = Placer("auto", "int8", 3, 4, host_repack=True)
    c, basis = placer.choice(weight_type, M, K, N)
    npu_s = pl.npu_matmul_seconds(pl.BUCKET_M[pl.bucket(M)], K, N, "int8", 3)
    host_s = pl.host_matmul_seconds(weight_type, pl.BUCKET_M[pl.bucket(M)], K, N, 4, repacked=True)
    assert basis == "modeled" and (c.npu_s, c.host_s) == (npu_s, host_s)
    assert c.where == (NPU if npu_s <= host_s else HOST)
    experts, _ = placer.choice(weight_type, M, K, N, experts=4)
    assert experts.host_s == pl.host_matmul_seconds(weight_type, pl.BUCKET_M[pl.bucket(M)], K, N, 4, experts=4)


def test_repacked_host_takes_q4_0_at_m4_from_the_npu():
    """Gemma3-1B's Q4_0 FFN at M = 4, NPU on 3 cores: the plain host kernel loses to the NPU
    (620 against 363 µs modeled), the repacked one wins (275 µs)."""
    plain, _ = Placer("auto", "int8", 3, 4).choice("Q4_0", 4, 1152, 6912)
    repacked, _ = Placer("auto", "int8", 3, 4, host_repack=True).choice("Q4_0", 4, 1152, 6912)
    assert (plain.where, repacked.where) == (NPU, HOST)
    assert repacked.host_s < repacked.npu_s < plain.host_s
