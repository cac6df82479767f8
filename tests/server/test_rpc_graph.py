"""Graph plans and weight residency through the wire: plans built once and replayed,
MUL_MAT with a leaf weight on the (fake) NPU engine, every kind of write invalidating
the staged copy so a result never comes from stale weights."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from ggml_rknpu.libggml.enums import GgmlOp, GgmlType
from ggml_rknpu.server.placement import HOST, NPU
from support import rpc_testkit
from support.matmul_graph import K, M, MatmulGraph, N, f32, fp16_ref, rng_w
from support.rpc_testkit import FakeNpu, T, serve

pytestmark = pytest.mark.timeout(60)
MUL_MAT, ADD, VIEW = int(GgmlOp.MUL_MAT), int(GgmlOp.ADD), int(GgmlOp.VIEW)


@pytest.fixture
def env():
    npu = FakeNpu()
    with serve(npu=npu) as st:
        yield st, npu


def assert_host_matmul(actual: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    """A host (ggml-cpu) fp32 matmul equals ``x @ w.T`` within the fp32 summation bound
    K·eps·(|x| @ |w|.T): ggml-cpu sums each dot product in its own order (its SIMD width is
    the host CPU's), so a relative tolerance alone fails where the terms cancel."""
    bound = x.shape[-1] * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(w).T)
    err = np.abs(actual - x @ w.T)
    assert np.all(err <= bound), f"max error {err.max():.3g} over the bound at {np.unravel_index(np.argmax(err - bound), err.shape)}"


def host_runs(st, op: str | None = None) -> int:
    """Nodes executed on the host (ggml-cpu), of one op or all."""
    return sum(c.ops for (name, engine), c in st.state.stats.per_op.items()
               if engine == HOST and (op is None or name == op))


def test_weight_matmul_runs_on_npu_and_replays_without_replanning(env):
    st, npu = env
    with st.client() as c:
        g = MatmulGraph(c)
        w = rng_w()
        c.set_array(g.w, w)
        x = np.random.default_rng(1).standard_normal((M, K)).astype(np.float32)
        c.set_array(g.x, x)
        np.testing.assert_allclose(g.compute(), fp16_ref(x, w), rtol=1e-5, atol=1e-5)
        assert (npu.uploads, npu.matmuls) == (1, 1)
        for i in range(3):
            x2 = x + i
            c.set_array(g.x, x2)
            c.graph_recompute()
            np.testing.assert_allclose(c.get_array(g.out), fp16_ref(x2, w), rtol=1e-5, atol=1e-4)
        g.compute()                                          # identical bytes: the same plan
        stats = st.state.stats
        assert (npu.uploads, npu.matmuls) == (1, 5)
        assert stats.plans_built == 1 and stats.recomputes == 3 and stats.plan_cache_hits == 1
        assert host_runs(st) == 0                           # nothing ran on the host
        assert stats.per_op[("MUL_MAT", NPU)].ops == 5
        assert stats.per_op[("MUL_MAT", NPU)].bytes == 5 * (M * K + M * N) * 4   # activations only
        assert st.state.weight_stats.staged == 1
    assert st.alive()
    ws = st.state.weight_stats                                   # kept for the next client, not freed
    assert ws.staged == 0 and ws.retired_now == 1 and npu.frees == 0


@pytest.mark.parametrize("write", ["set_tensor", "set_partial", "copy_tensor", "memset", "buffer_clear"])
def test_every_write_to_a_staged_weight_invalidates_it(env, write):
    st, npu = env
    with st.client() as c:
        g = MatmulGraph(c)
        w = rng_w()
        c.set_array(g.w, w)
        x = np.ones((M, K), np.float32)
        c.set_array(g.x, x)
        before = g.compute()
        w_new = w.copy()
        if write == "set_tensor":
            w_new = rng_w(seed=5)
            c.set_array(g.w, w_new)
        elif write == "set_partial":                        # one row rewritten at an offset
            w_new[7] = 3.0
            c.set_tensor(g.w, np.full(K, 3.0, np.float32).tobytes(), offset=7 * K * 4)
        elif write == "copy_tensor":
            src = f32(g.ch, g.cb + 16384, K, N)
            w_new = rng_w(seed=6)
            c.set_array(src, w_new)
            assert c.copy_tensor(src, g.w) == 1
        elif write == "memset":
            c.memset(g.w, 0, K * 4, 0)                         # zero row 0
            w_new[0] = 0
        elif write == "buffer_clear":
            c.clear(g.wh, 0)
            w_new[:] = 0
        c.graph_recompute()
        after = c.get_array(g.out)
        np.testing.assert_allclose(after, fp16_ref(x, w_new), rtol=1e-5, atol=1e-4)
        assert not np.allclose(after, before)
        assert npu.uploads == 2 and st.state.weight_stats.invalidations == 1


def test_graph_writing_a_weight_demotes_it_to_the_host(env):
    st, npu = env
    with st.client() as c:
        g = MatmulGraph(c)
        w = rng_w()
        c.set_array(g.w, w)
        x = np.ones((M, K), np.float32)
        c.set_array(g.x, x)
        g.compute()
        assert npu.uploads == 1
        # a second graph whose ADD writes into the weight's bytes
        d = f32(g.ch, g.cb + 32768, K, N)
        c.set_array(d, np.ones((N, K), np.float32))
        wv = f32(g.wh, g.wb, K, N, op=ADD, src=(g.w.id, d.id), name="w+=1")
        wv.id = g.w.id                                            # in-place: dst is the weight tensor
        wv.src = (d.id, d.id)
        c.graph_compute([wv], [d, wv])                            # weight := 2
        c.graph_recompute()                                       # replay of the writer: still 2
        g.compute()                                               # back to the matmul graph (cached plan)
        np.testing.assert_allclose(c.get_array(g.out), x @ np.full((N, K), 2, np.float32).T, rtol=1e-6)
        assert st.state.weight_stats.demoted == 1
        assert st.state.stats.per_op[("MUL_MAT", HOST)].ops >= 1


def test_rewritten_src0_is_demoted_after_repeated_invalidation(env):
    st, npu = env
    with st.client() as c:
        g = MatmulGraph(c)
        x = np.ones((M, K), np.float32)
        c.set_array(g.x, x)
        for i in range(5):
            w = rng_w(seed=i)
            c.set_array(g.w, w)
            c.graph_recompute() if i else g.compute()
            np.testing.assert_allclose(c.get_array(g.out), fp16_ref(x, w) if npu.uploads > i else x @ w.T,
                                       rtol=1e-5, atol=1e-4)
        assert npu.uploads == 2                                 # staged twice, then host for good
        assert st.state.weight_stats.demoted == 1


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q5_1", "Q4_K", "Q6_K", "F16", "BF16"])
def test_quantized_weights_are_dequantized_once(qtype):
    npu = FakeNpu()
    gq = GGMLQuantizationType[qtype]
    k = 256
    rng = np.random.default_rng(2)
    if qtype in ("Q4_K", "Q6_K"):             # gguf has no K-quant encoder: random blocks, sane scales
        block = {"Q4_K": 144, "Q6_K": 210}[qtype]
        wq = rng.integers(0, 256, (N, k // 256, block), dtype=np.uint8)
        d = np.full(1, 0.01, np.float16).view(np.uint8)
        fields = (0, 2) if qtype == "Q4_K" else (208,)      # d, dmin (Q4_K) / d at the block end (Q6_K)
        for f in fields:
            wq[..., f:f + 2] = d
        wq = wq.reshape(N, -1)
    else:
        wq = quantize(rng.standard_normal((N, k)).astype(np.float32), gq)
    w_deq = dequantize(wq, gq).astype(np.float32)
    with serve(npu=npu) as st:
        with st.client() as c:
            wh, wb = c.alloc_base(1 << 16)
            ch, cb = c.alloc_base(1 << 16)
            wt = T(ne=(k, N, 1, 1), buffer=wh, data=wb, type=int(GgmlType[qtype]))
            c.set_tensor(wt, wq.tobytes())
            x = f32(ch, cb, k, M)
            out = f32(ch, cb + 8192, N, M, op=MUL_MAT, src=(wt.id, x.id))
            xv = np.random.default_rng(3).standard_normal((M, k)).astype(np.float32)
            c.set_array(x, xv)
            c.graph_compute([out], [wt, x, out])
            np.testing.assert_allclose(c.get_array(out), fp16_ref(xv, w_deq), rtol=1e-4, atol=1e-3)
            assert npu.uploads == 1


def test_non_weight_matmuls_stay_on_the_host(env):
    st, npu = env
    with st.client() as c:
        h, b = c.alloc_base(1 << 16)
        a = f32(h, b, K, N, name="a")
        one = f32(h, b + 16384, K, N, name="one")
        a1 = f32(h, b + 32768, K, N, op=ADD, src=(a.id, one.id), name="a1")  # computed src0
        x = f32(h, b + 49152, K, M, name="x")
        kq = f32(h, b + 57344, N, M, op=MUL_MAT, src=(a1.id, x.id), name="kq")
        view = f32(h, b, K, N, op=VIEW, view_src=a.id, name="a_view")            # view src0 (KV cache)
        kq2 = f32(h, b + 61440, N, M, op=MUL_MAT, src=(view.id, x.id), name="kq2")
        av = np.random.default_rng(4).standard_normal((N, K)).astype(np.float32)
        xv = np.ones((M, K), np.float32)
        c.set_array(a, av)
        c.set_array(one, np.ones((N, K), np.float32))
        c.set_array(x, xv)
        c.graph_compute([a1, kq, view, kq2], [a, one, a1, x, kq, view, kq2])
        assert_host_matmul(c.get_array(kq), xv, av + 1)
        assert_host_matmul(c.get_array(kq2), xv, av)
        assert npu.uploads == 0 and host_runs(st, "MUL_MAT") == 2
        assert st.state.stats.view_nodes == 1
        assert st.state.stats.host_matmul_reasons == {"src0 computed by the graph": 1,
                                                       "src0 is a view (KV cache)": 1}


def test_input_flagged_src0_is_not_a_weight(env):
    st, npu = env
    with st.client() as c:
        g = MatmulGraph(c)
        g.w.flags = 1                                            # GGML_TENSOR_FLAG_INPUT
        c.set_array(g.w, rng_w())
        c.set_array(g.x, np.ones((M, K), np.float32))
        g.compute()
        assert npu.uploads == 0
        assert st.state.stats.host_matmul_reasons == {"src0 is a graph input": 1}


def test_free_buffer_drops_graphs_and_staged_weights(env):
    st, npu = env
    c = st.client()
    g = MatmulGraph(c, w_bytes=rng_w().tobytes())
    c.set_array(g.x, np.ones((M, K), np.float32))
    g.compute()
    assert st.state.weight_stats.staged == 1
    c.free(g.wh)
    assert c.device_count() == 1                                  # sync
    assert st.state.weight_stats.staged == 0 and st.state.weight_stats.retired_now == 1 and npu.frees == 0
    c.graph_recompute()                                           # no stored graph any more
    assert c.is_closed_by_server()
    c.close()
    assert st.alive()


def test_npu_failure_falls_back_to_host(env):
    st, npu = env
    with st.client() as c:
        g = MatmulGraph(c)
        w = rng_w()
        c.set_array(g.w, w)
        x = np.ones((M, K), np.float32)
        c.set_array(g.x, x)
        npu.fail_matmul = True
        assert_host_matmul(g.compute(), x, w)
        assert st.state.weight_stats.failures == 1 and host_runs(st, "MUL_MAT") == 1


def test_npu_failure_is_not_retried_and_frees_the_weight(env):
    st, npu = env
    with st.client() as c:
        g = MatmulGraph(c)
        w = rng_w()
        c.set_array(g.w, w)
        x = np.ones((M, K), np.float32)
        c.set_array(g.x, x)
        npu.fail_matmul = True
        g.compute()
        npu.fail_matmul = False                                  # even once the engine works again
        for _ in range(2):
            c.graph_recompute()
            assert_host_matmul(c.get_array(g.out), x, w)
        assert st.state.weight_stats.failures == 1 and npu.matmuls == 0
        assert st.state.weight_stats.staged == 0 and npu.frees == 1


def test_int8_format_is_passed_to_the_engine():
    seen = []

    class Int8Npu(FakeNpu):
        def upload_weight(self, b, dtype="fp16"):
            seen.append(dtype)
            return super().upload_weight(b, dtype)

    with serve(npu=Int8Npu(), weight_format="int8") as st:
        with st.client() as c:
            g = MatmulGraph(c, w_bytes=rng_w().tobytes())
            c.set_array(g.x, np.ones((M, K), np.float32))
            g.compute()
    assert seen == ["int8"]


def test_stats_render_reports_engines_and_weights(env):
    st, npu = env
    with st.client() as c:
        g = MatmulGraph(c, w_bytes=rng_w().tobytes())
        c.set_array(g.x, np.ones((M, K), np.float32))
        g.compute()
        c.graph_recompute()
        c.device_count()
        text = st.state.stats.render(st.state.weight_stats)
    assert "MUL_MAT" in text and "npu" in text
    assert "1 staged" in text and "GRAPH_RECOMPUTE replays 1" in text
    assert "NPU device time of the matmuls: 2.0 ms (modeled)" in text
    assert "GRAPH_COMPUTE 1, GET_TENSOR 0" not in text and "GRAPH_COMPUTE 1" in text and "GRAPH_RECOMPUTE 1" in text
    as_json = st.state.stats.as_dict(st.state.weight_stats)
    assert as_json["commands"]["GRAPH_COMPUTE"] == 1 and as_json["commands"]["HELLO"] == 1


def test_host_only_server_runs_weight_matmuls_on_host():
    with serve(npu=None) as st:
        with st.client() as c:
            g = MatmulGraph(c)
            w = rng_w()
            c.set_array(g.w, w)
            x = np.ones((M, K), np.float32)
            c.set_array(g.x, x)
            assert_host_matmul(g.compute(), x, w)
        assert host_runs(st, "MUL_MAT") == 1


@pytest.mark.parametrize("qtype", ["Q8_0", "F16", "F32", "Q4_0", "BF16"])
def test_weight_conversion_matches_gguf_exactly(qtype, monkeypatch):
    from ggml_rknpu.server import weight_store as weights

    monkeypatch.setattr(weights, "CONVERT_ROWS", 7)              # several chunks, a ragged last one
    gq = GGMLQuantizationType[qtype]
    rng = np.random.default_rng(9)
    w = (rng.standard_normal((20, 64)) * 3).astype(np.float32)
    wq = quantize(w, gq) if qtype not in ("F32", "F16") else w.astype(np.float16 if qtype == "F16" else np.float32)
    raw = np.frombuffer(wq.tobytes(), dtype=np.uint8)
    got = weights.to_float_rows(raw, int(GgmlType[qtype]), 20, 64)
    ref = dequantize(raw.reshape(20, -1), gq).astype(np.float32)
    assert got.dtype == np.float32 and np.array_equal(got, ref)


def test_engine_error_while_freeing_weights_does_not_stop_the_server(env, monkeypatch):
    st, npu = env

    def broken_free(self):
        raise RuntimeError("injected: NPU buffer release failed")

    monkeypatch.setattr(rpc_testkit.FakeWeight, "free", broken_free)   # hit when the session closes
    with st.client() as c:
        g = MatmulGraph(c, w_bytes=rng_w().tobytes())
        c.set_array(g.x, np.ones((M, K), np.float32))
        g.compute()
    assert st.alive()
    assert st.state.memory.allocated == 0                   # every buffer released all the same
    assert st.state.weight_stats.staged == 0


def test_empty_batch_matmul_does_not_touch_the_engine(env):
    st, npu = env
    with st.client() as c:
        g = MatmulGraph(c, w_bytes=rng_w().tobytes())
        x0 = f32(g.ch, g.cb, K, 0)
        out0 = T(ne=(N, 0, 1, 1), buffer=g.ch, data=g.cb + 4096, op=MUL_MAT, src=(g.w.id, x0.id))
        c.graph_compute([out0], [g.w, x0, out0])
        assert c.device_count() == 1
        assert npu.uploads == 0 and st.state.weight_stats.failures == 0


@pytest.mark.parametrize("act", ["F16", "BF16"])
def test_half_precision_activations_on_the_npu_path(env, act):
    st, npu = env
    with st.client() as c:
        g = MatmulGraph(c)
        w = rng_w()
        c.set_array(g.w, w)
        x = np.random.default_rng(8).standard_normal((M, K)).astype(np.float32)
        x16 = x.astype(np.float16) if act == "F16" else (x.view(np.uint32) >> 16).astype(np.uint16)
        x_ref = x16.astype(np.float32) if act == "F16" else (x16.astype(np.uint32) << 16).view(np.float32)
        g.x = T(ne=(K, M, 1, 1), buffer=g.ch, data=g.cb, type=int(GgmlType[act]))
        g.out.src = (g.w.id, g.x.id)
        c.set_array(g.x, x16)
        np.testing.assert_allclose(g.compute(), fp16_ref(x_ref, w), rtol=1e-5, atol=1e-4)
        assert npu.matmuls == 1 and host_runs(st) == 0
