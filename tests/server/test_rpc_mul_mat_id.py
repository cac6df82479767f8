"""MUL_MAT_ID (MoE experts) through the wire (server/expert_step.py): each expert slice of a
leaf 3-D weight resident on the (fake) NPU, rows routed by the ids at every replay, results
equal to ggml-cpu's own MUL_MAT_ID (a server with no engine); experts that are not resident
or whose matmul faults run on the host; a bad id fails the graph, the server keeps serving."""

from __future__ import annotations

import numpy as np
import pytest

from ggml_rknpu.kernel.errors import NpuOutOfMemory, NpuTimeout
from ggml_rknpu.libggml.enums import GgmlOp, GgmlType
from ggml_rknpu.server.memory_budget import for_server
from ggml_rknpu.server.placement import HOST, NPU
from ggml_rknpu.server.rpc import report
from support.rpc_testkit import FakeNpu, FaultyNpu, T, serve

pytestmark = pytest.mark.timeout(60)
MUL_MAT_ID = int(GgmlOp.MUL_MAT_ID)
F16, I32 = int(GgmlType.F16), int(GgmlType.I32)
K, N, E, USED, TOK = 64, 32, 4, 2, 3


def halves(rng, *shape) -> np.ndarray:
    """Random float32 values that fp16 holds exactly (both sides then round nothing)."""
    return rng.standard_normal(shape).astype(np.float16).astype(np.float32)


class ExpertsGraph:
    """``as`` [K, N, E] f16 in a weights buffer; b [K, ne11, TOK], ids [USED, TOK], dst [N, USED, TOK]."""

    def __init__(self, c, ne11: int, seed: int = 0) -> None:
        self.c, self.ne11 = c, ne11
        self.wh, wb = c.alloc_base(1 << 16)
        ch, cb = c.alloc_base(1 << 16)
        self.w = T(ne=(K, N, E, 1), buffer=self.wh, data=wb, type=F16, name="blk.0.ffn_up_exps.weight")
        self.b = T(ne=(K, ne11, TOK, 1), buffer=ch, data=cb, name="b")
        self.ids = T(ne=(USED, TOK, 1, 1), buffer=ch, data=cb + 8192, type=I32, name="ids")
        self.out = T(ne=(N, USED, TOK, 1), buffer=ch, data=cb + 12288, op=MUL_MAT_ID,
                     src=(self.w.id, self.b.id, self.ids.id), name="ffn_moe_up")
        rng = np.random.default_rng(seed)
        self.experts = halves(rng, E, N, K)
        c.set_array(self.w, self.experts.astype(np.float16))
        self.set_b(halves(rng, TOK, ne11, K))

    def set_b(self, b: np.ndarray) -> None:
        self.b_rows = b
        self.c.set_array(self.b, b)

    def compute(self, ids: np.ndarray, recompute: bool = False) -> np.ndarray:
        self.c.set_array(self.ids, ids.astype(np.int32))
        if recompute:
            self.c.graph_recompute()
        else:
            self.c.graph_compute([self.out], [self.w, self.b, self.ids, self.out])
        return np.frombuffer(self.c.get_tensor(self.out), np.float32).reshape(TOK, USED, N)

    def reference(self, ids: np.ndarray) -> np.ndarray:
        """ggml's definition: dst[t, s] = as[ids[t, s]] @ b[t, s % ne11]."""
        return np.stack([np.stack([self.experts[ids[t, s]] @ self.b_rows[t, s % self.ne11] for s in range(USED)])
                         for t in range(TOK)])


IDS = np.array([[2, 0], [0, 3], [2, 3]])          # [TOK, USED]: expert 1 unused, 0/2/3 twice each


def ggml_cpu(ne11: int, ids: np.ndarray) -> np.ndarray:
    """The same graph on a server with no engine: ggml-cpu's MUL_MAT_ID."""
    with serve(npu=None) as st, st.client() as c:
        return ExpertsGraph(c, ne11).compute(ids)


def npu_ops(st, engine: str) -> int:
    counter = st.state.stats.per_op.get(("MUL_MAT_ID", engine))
    return 0 if counter is None else counter.ops


@pytest.mark.parametrize("ne11", [1, USED], ids=["broadcast", "per-slot"])
def test_experts_on_npu_equal_ggml_cpu_and_follow_new_ids(ne11):
    npu = FakeNpu()
    with serve(npu=npu) as st:
        with st.client() as c:
            g = ExpertsGraph(c, ne11)
            got = g.compute(IDS)
            np.testing.assert_allclose(got, ggml_cpu(ne11, IDS), rtol=1e-5, atol=1e-4)
            np.testing.assert_allclose(got, g.reference(IDS), rtol=1e-5, atol=1e-4)
            stats, ws = st.state.stats, st.state.weight_stats
            assert (npu.uploads, ws.experts_staged, ws.experts_host) == (3, 3, 0)   # the routed ones: 0, 2, 3
            assert npu.matmuls == stats.expert_matmuls_npu == 3 and stats.expert_matmuls_host == 0
            assert stats.npu_matmuls_by_m == {2: 3}                         # each expert with M = its 2 rows
            assert (npu_ops(st, NPU), npu_ops(st, HOST)) == (1, 0)
            new_ids = np.array([[1, 1], [1, 1], [3, 1]])                    # M = 5 for expert 1
            np.testing.assert_allclose(g.compute(new_ids, recompute=True), g.reference(new_ids),
                                       rtol=1e-5, atol=1e-4)
            assert stats.plans_built == 1 and stats.npu_matmuls_by_m[5] == 1
            assert npu.uploads == ws.experts_staged == E                   # expert 1 staged at its first use
        ws = st.state.weight_stats
        assert st.server.wait_idle(timeout=5)                          # the session has retired its weights
        assert (ws.experts_staged, ws.retired_now) == (0, E)            # kept for the next client


@pytest.mark.parametrize("bad", [E, -1])
def test_out_of_range_id_fails_the_graph_and_the_server_keeps_serving(bad):
    with serve(npu=FakeNpu()) as st:
        c = st.client()
        g = ExpertsGraph(c, 1)
        g.compute(IDS)
        ids = IDS.copy()
        ids[1, 1] = bad
        c.set_array(g.ids, ids.astype(np.int32))
        c.graph_recompute()
        assert c.is_closed_by_server(), "an expert id out of range was computed"
        c.close()
        assert st.state.stats.rejected == 1
        with st.client() as c2:                                             # the next client is served
            g2 = ExpertsGraph(c2, 1)
            np.testing.assert_allclose(g2.compute(IDS), g2.reference(IDS), rtol=1e-5, atol=1e-4)


class TightNpu(FakeNpu):
    """NPU memory for ``room`` weights: later uploads are out of memory."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room

    def upload_weight(self, b, dtype="fp16"):
        if self.uploads >= self.room:
            raise NpuOutOfMemory("no room for another expert (test)")
        return super().upload_weight(b, dtype)


def test_experts_that_do_not_fit_run_on_the_host():
    npu = TightNpu(room=2)
    with serve(npu=npu) as st:
        with st.client() as c:
            g = ExpertsGraph(c, USED)
            np.testing.assert_allclose(g.compute(IDS), g.reference(IDS), rtol=1e-5, atol=1e-4)
            stats, ws = st.state.stats, st.state.weight_stats
            assert (ws.experts_staged, ws.experts_host) == (2, 1)          # 0, 2 resident; 3 on the host
            assert stats.expert_matmuls_npu == 2 and stats.expert_matmuls_host == 1   # 1 is never routed
            assert (npu_ops(st, NPU), npu_ops(st, HOST)) == (1, 1)


def test_a_memory_budget_for_two_experts_keeps_the_others_on_the_host():
    """Expert copies are board bytes like 2-D weights' (server/memory_budget.py): with expert 0
    staged, room for one more stages the next routed (2), the third (3) runs in ggml-cpu for
    good and the stats name it."""
    npu = FakeNpu()
    with serve(npu=npu) as st:
        state = st.state
        state.budget, _ = for_server(state, 1)
        assert state.budget is not None
        with st.client() as c:
            g = ExpertsGraph(c, USED)
            first = np.zeros_like(IDS)                  # the plan (board bytes too) and expert 0's copy, with room
            state.budget.bytes = 1 << 40
            np.testing.assert_allclose(g.compute(first), g.reference(first), rtol=1e-5, atol=1e-4)
            state.budget.bytes = state.board.now(state).total + N * K * 2 + N * K   # one more fp16 copy and a half
            np.testing.assert_allclose(g.compute(IDS), g.reference(IDS), rtol=1e-5, atol=1e-4)
            ids = IDS[::-1].copy()                                        # a replay: the same three experts
            np.testing.assert_allclose(g.compute(ids, recompute=True), g.reference(ids), rtol=1e-5, atol=1e-4)
            ws, stats = state.weight_stats, report.stats_dict(state)
            assert (ws.experts_staged, ws.experts_host) == (2, 1) and npu.uploads == 2
        assert stats["memory_budget"]["host_only"] == {"blk.0.ffn_up_exps.weight[3]": N * K * 2}
        assert stats["board_memory"]["total"] <= state.budget.bytes
        assert state.stats.expert_matmuls_host == 2                       # expert 3's rows, both runs after the first


def test_rewriting_one_expert_restages_that_expert_only():
    npu = FakeNpu()
    with serve(npu=npu) as st:
        with st.client() as c:
            g = ExpertsGraph(c, 1)
            g.compute(IDS)
            g.experts[2] = halves(np.random.default_rng(9), N, K)
            c.set_tensor(g.w, g.experts[2].astype(np.float16).tobytes(), offset=2 * N * K * 2)
            np.testing.assert_allclose(g.compute(IDS, recompute=True), g.reference(IDS), rtol=1e-5, atol=1e-4)
            assert npu.uploads == 3 + 1 and st.state.weight_stats.invalidations == 1   # 0, 2, 3; 2 again


def test_same_experts_reused_by_the_next_client():
    npu = FakeNpu()
    with serve(npu=npu) as st:
        for _ in range(2):
            with st.client() as c:
                g = ExpertsGraph(c, 1)
                np.testing.assert_allclose(g.compute(IDS), g.reference(IDS), rtol=1e-5, atol=1e-4)
            assert st.alive()         # the first session has ended (and retired its experts)
        assert npu.uploads == st.state.weight_stats.reused == 3       # the routed experts 0, 2, 3


def test_faulted_expert_matmul_reruns_on_the_host():
    """Two timeouts in a row on one expert: reset, retry, then that expert's rows on ggml-cpu."""
    npu = FaultyNpu(faults=[NpuTimeout("injected"), NpuTimeout("injected")])
    with serve(npu=npu) as st:
        with st.client() as c:
            g = ExpertsGraph(c, USED)
            np.testing.assert_allclose(g.compute(IDS), g.reference(IDS), rtol=1e-5, atol=1e-4)
            stats = st.state.stats
            assert stats.expert_matmuls_npu == 2 and stats.expert_matmuls_host == 1
            assert npu.resets == 2 and st.state.recovery.host_fallbacks == 1
            np.testing.assert_allclose(g.compute(IDS, recompute=True), g.reference(IDS), rtol=1e-5, atol=1e-4)
            assert stats.expert_matmuls_npu == 5                            # the NPU again next run
