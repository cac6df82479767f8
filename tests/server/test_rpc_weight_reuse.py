"""Staged weights kept across connections (``RetiredWeights``): a later client uploading
the same bytes reuses the staged copy, any different byte converts again, retired copies
are evicted LRU-first when NPU memory runs out and count as free in GET_DEVICE_MEMORY,
and ``weight_reuse=False`` (``--no-weight-reuse``) frees them with the connection."""

from __future__ import annotations

import numpy as np
import pytest

from ggml_rknpu.kernel.errors import NpuOutOfMemory
from ggml_rknpu.libggml.enums import GgmlOp, GgmlType
from support.rpc_testkit import GIB, FakeNpu, FakeWeight, T, serve

pytestmark = pytest.mark.timeout(120)
K, N, M = 64, 48, 5
F32 = int(GgmlType.F32)


def fp16(w: np.ndarray) -> np.ndarray:
    return w.astype(np.float16).astype(np.float32)


def run_client(st, w: np.ndarray, xv: np.ndarray, name: str = "blk.0.attn_q.weight") -> np.ndarray:
    """One llama.cpp-like client: upload W, compute x @ W^T once, disconnect (and wait
    until the server has closed the session: it serves clients one after another)."""
    with st.client() as c:
        wh, wb = c.alloc_base(1 << 16)
        ch, cb = c.alloc_base(1 << 16)
        wt = T(ne=(K, N, 1, 1), buffer=wh, data=wb, type=F32, name=name)
        c.set_tensor(wt, w.tobytes())
        x = T(ne=(K, M, 1, 1), buffer=ch, data=cb, name="x")
        out = T(ne=(N, M, 1, 1), buffer=ch, data=cb + 8192, op=int(GgmlOp.MUL_MAT), src=(wt.id, x.id), name="out")
        c.set_array(x, xv)
        c.graph_compute([out], [wt, x, out])
        got = c.get_array(out)
    assert st.alive()
    return got


@pytest.fixture(scope="module")
def sim_npu():
    import ggml_rknpu

    npu = ggml_rknpu.open("sim-rknpu")
    yield npu
    npu.close()


def test_second_connection_reuses_the_staged_weight(sim_npu):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((N, K)).astype(np.float32)
    x1, x2 = (rng.standard_normal((M, K)).astype(np.float32) for _ in range(2))
    with serve(npu=sim_npu) as st:
        uploaded = sim_npu.counters["weights_uploaded"]
        np.testing.assert_allclose(run_client(st, w, x1), x1 @ fp16(w).T, rtol=2e-3, atol=2e-2)
        ws = st.state.weight_stats
        assert (ws.uploads, ws.reused, ws.retired, ws.retired_now) == (1, 0, 1, 1)
        np.testing.assert_allclose(run_client(st, w, x2), x2 @ fp16(w).T, rtol=2e-3, atol=2e-2)
        assert (ws.uploads, ws.reused, ws.retired, ws.retired_now) == (1, 1, 2, 1)
        assert sim_npu.counters["weights_uploaded"] == uploaded + 1      # the engine converted it once
        js = st.state.stats.as_dict(ws)["weights"]
        assert (js["reused"], js["retired"], js["evicted"]) == (1, 2, 0)
        assert "1 reused, 2 retired, 0 evicted" in st.state.stats.render(ws)


def test_one_different_byte_is_converted_again(sim_npu):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((N, K)).astype(np.float32)
    w2 = w.copy()
    w2.reshape(-1).view(np.uint8)[1234] ^= 0x40        # one byte (a high mantissa bit) differs
    assert not np.array_equal(fp16(w), fp16(w2))
    xv = rng.standard_normal((M, K)).astype(np.float32)
    with serve(npu=sim_npu) as st:
        run_client(st, w, xv)
        got = run_client(st, w2, xv)
        np.testing.assert_allclose(got, xv @ fp16(w2).T, rtol=2e-3, atol=2e-2)
        ws = st.state.weight_stats
        assert (ws.uploads, ws.reused, ws.retired_now) == (2, 0, 2)   # both versions kept, none reused
        np.testing.assert_allclose(run_client(st, w, xv), xv @ fp16(w).T, rtol=2e-3, atol=2e-2)
        assert (ws.uploads, ws.reused) == (2, 1)                      # the first version still matches


class BoundedNpu(FakeNpu):
    """A fake engine with room for ``capacity`` live weights (then NpuOutOfMemory) and a
    memory budget that shrinks with every live weight, like the engine's IOVA budget."""

    def __init__(self, capacity: int) -> None:
        super().__init__(budget=(4 * GIB, 4 * GIB))
        self.capacity = capacity
        self.live: list[FakeWeight] = []

    def upload_weight(self, b: np.ndarray, dtype: str = "fp16") -> FakeWeight:
        self.live = [w for w in self.live if not w.freed]
        if len(self.live) >= self.capacity:
            raise NpuOutOfMemory("fake NPU full")
        w = super().upload_weight(b, dtype)
        w.packed_bytes = b.size * 2
        self.live.append(w)
        return w

    def memory_budget(self) -> tuple[int, int]:
        used = sum(w.packed_bytes for w in self.live if not w.freed)
        return 4 * GIB - used, 4 * GIB


def test_retired_weights_are_evicted_lru_when_the_npu_is_full():
    npu = BoundedNpu(capacity=2)
    rng = np.random.default_rng(2)
    ws_ = [rng.standard_normal((N, K)).astype(np.float32) for _ in range(3)]
    xv = rng.standard_normal((M, K)).astype(np.float32)
    with serve(npu=npu) as st:
        run_client(st, ws_[0], xv)
        run_client(st, ws_[1], xv)                     # two retired: the NPU is full
        ws = st.state.weight_stats
        assert (ws.retired_now, ws.evicted) == (2, 0)
        got = run_client(st, ws_[2], xv)              # needs room: the oldest (w0) goes
        np.testing.assert_allclose(got, xv @ fp16(ws_[2]).T, rtol=2e-3, atol=2e-2)
        assert (ws.evicted, ws.failures, ws.uploads) == (1, 0, 3)
        run_client(st, ws_[1], xv)                     # w1 survived the eviction
        assert (ws.reused, ws.uploads) == (1, 3)
        got = run_client(st, ws_[0], xv)              # w0 was evicted: converted again, correct
        np.testing.assert_allclose(got, xv @ fp16(ws_[0]).T, rtol=2e-3, atol=2e-2)
        assert (ws.reused, ws.uploads, ws.evicted) == (1, 4, 2)


class MatmulOomNpu(BoundedNpu):
    """Its next ``oom_matmuls`` matmuls run out of NPU memory (a program that does not fit)."""

    oom_matmuls = 0

    def matmul(self, a: np.ndarray, w: FakeWeight, *, out: str | None = None) -> np.ndarray:
        if self.oom_matmuls:
            self.oom_matmuls -= 1
            raise NpuOutOfMemory("fake: no room for the program")
        return super().matmul(a, w)


def test_matmul_out_of_memory_evicts_a_retired_weight_first():
    npu = MatmulOomNpu(capacity=4)
    rng = np.random.default_rng(6)
    w0, w1 = (rng.standard_normal((N, K)).astype(np.float32) for _ in range(2))
    xv = rng.standard_normal((M, K)).astype(np.float32)
    with serve(npu=npu) as st:
        run_client(st, w0, xv)
        npu.oom_matmuls = 1
        np.testing.assert_allclose(run_client(st, w1, xv), xv @ w1.T, rtol=1e-5, atol=1e-4)   # host fallback
        ws = st.state.weight_stats
        assert (ws.evicted, ws.failures, ws.retired_now) == (1, 0, 1)    # w0 evicted, w1 kept on the NPU
        np.testing.assert_allclose(run_client(st, w1, xv), xv @ fp16(w1).T, rtol=2e-3, atol=2e-2)
        assert (ws.reused, ws.failures) == (1, 0) and npu.matmuls == 2   # back on the NPU


def test_device_memory_counts_retired_weights_as_free():
    npu = BoundedNpu(capacity=4)
    w = np.random.default_rng(3).standard_normal((N, K)).astype(np.float32)
    with serve(npu=npu) as st:
        run_client(st, w, np.ones((M, K), np.float32))
        assert st.state.weight_stats.retired_now == 1
        npu_free, total = npu.memory_budget()
        assert npu_free == total - N * K * 2          # the retired copy still holds NPU memory
        with st.client() as c:
            assert c.device_memory() == (total, total)   # ... but it is reported free (reclaimable)


def test_no_weight_reuse_frees_with_the_connection():
    npu = BoundedNpu(capacity=4)
    w = np.random.default_rng(4).standard_normal((N, K)).astype(np.float32)
    xv = np.ones((M, K), np.float32)
    with serve(npu=npu, weight_reuse=False) as st:
        run_client(st, w, xv)
        assert npu.frees == 1
        np.testing.assert_allclose(run_client(st, w, xv), xv @ fp16(w).T, rtol=2e-3, atol=2e-2)
        ws = st.state.weight_stats
        assert (ws.uploads, ws.reused, ws.retired, ws.retired_now) == (2, 0, 0, 0)
        assert st.state.retired is None and ws.digest_seconds == 0.0


def test_server_close_frees_retired_weights():
    npu = BoundedNpu(capacity=4)
    w = np.random.default_rng(5).standard_normal((N, K)).astype(np.float32)
    with serve(npu=npu) as st:
        run_client(st, w, np.ones((M, K), np.float32))
        assert npu.frees == 0
    assert npu.frees == 1 and st.state.weight_stats.retired_now == 0


def test_retired_weights_keep_only_the_room_live_weights_leave():
    """Within the host cache budget, retired copies and the live sessions' staged copies fit
    together: two models that fit are both kept; a live client's fresh weight pushes the
    oldest retired copy out; a reuse pushes nothing."""
    npu = BoundedNpu(capacity=8)
    one = N * K * 2                                  # one weight's fp16 copy
    rng = np.random.default_rng(7)
    w = [rng.standard_normal((N, K)).astype(np.float32) for _ in range(4)]
    xv = rng.standard_normal((M, K)).astype(np.float32)
    with serve(npu=npu, retired_budget=2 * one) as st:
        ws = st.state.weight_stats
        run_client(st, w[0], xv)
        run_client(st, w[1], xv)                     # fresh, but both fit in the budget
        assert (ws.retired_now, ws.evicted_staging, ws.evicted_budget) == (2, 0, 0)
        with st.client() as live:                    # a session that keeps w[2] staged
            wh, wb = live.alloc_base(1 << 16)
            ch, cb = live.alloc_base(1 << 16)
            wt = T(ne=(K, N, 1, 1), buffer=wh, data=wb, type=F32, name="blk.0.ffn_up.weight")
            live.set_tensor(wt, w[2].tobytes())
            x = T(ne=(K, M, 1, 1), buffer=ch, data=cb, name="x")
            out = T(ne=(N, M, 1, 1), buffer=ch, data=cb + 8192, op=int(GgmlOp.MUL_MAT), src=(wt.id, x.id), name="out")
            live.set_array(x, xv)
            live.graph_compute([out], [wt, x, out])
            np.testing.assert_allclose(live.get_array(out), xv @ fp16(w[2]).T, rtol=2e-3, atol=2e-2)
            assert (ws.retired_now, ws.evicted_staging) == (1, 1)        # w[0], the oldest, made room
            assert st.state.live.npu_bytes == one
            got = run_client(st, w[1], xv)            # reused from the retired copies: no room taken
            np.testing.assert_allclose(got, xv @ fp16(w[1]).T, rtol=2e-3, atol=2e-2)
            assert (ws.reused, ws.evicted_staging) == (1, 1)
            run_client(st, w[3], xv)                  # fresh beside the live w[2]: w[1] goes
            assert ws.evicted_staging == 2 and ws.retired_now == 1       # w[3] retired, within the budget
        assert st.alive() and st.state.live.npu_bytes == 0              # the live session ended: w[2] retired
        run_client(st, w[0], xv)                      # evicted: converted again
        assert ws.uploads == 5
