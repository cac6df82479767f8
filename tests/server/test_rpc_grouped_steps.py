"""NPU matmuls that read one activation (Q/K/V, gate/up) run as one engine fusion
(``plan_steps.NpuGroup``): same results as one submit each, one submit per replay, every write to
a member's weight seen by the next graph, and each member's own fallback when the group
cannot run (a member not resident, the engine refusing the fusion, a fault in its submit)."""

from __future__ import annotations

import numpy as np
import pytest

import ggml_rknpu
from ggml_rknpu.libggml.enums import GgmlOp
from support.rpc_testkit import FUSION_DEVICE_S, MATMUL_DEVICE_S, FusingFakeNpu, T, serve

pytestmark = pytest.mark.timeout(120)
MUL_MAT, ADD = int(GgmlOp.MUL_MAT), int(GgmlOp.ADD)
K, NQ, NK, M = 64, 64, 32, 2


def f32(buffer, data, *ne, **kw) -> T:
    return T(ne=tuple(ne) + (1,) * (4 - len(ne)), buffer=buffer, data=data, **kw)


class AttentionGraph:
    """a = x + x (host); q, k, v = W_q a, W_k a, W_v a (one group); o = W_o q (alone: reads q).

    ``llama_order``: the order and memory reuse of llama.cpp's attention: q, r = q + q
    (host, ROPE's place), then v written over q's bytes (free once r read them), then k;
    o = W_o r. Grouping moves v and k up to q and delivers v's result at its own place."""

    def __init__(self, c, seed: int = 0, llama_order: bool = False) -> None:
        self.c = c
        wh, wb = c.alloc_base(1 << 16)
        ch, cb = c.alloc_base(1 << 16)
        rng = np.random.default_rng(seed)
        self.w = {name: rng.standard_normal((n, K)).astype(np.float32)
                  for name, n in (("q", NQ), ("k", NK), ("v", NK), ("o", K))}
        self.wt = {}
        offset = 0
        for name, arr in self.w.items():
            self.wt[name] = f32(wh, wb + offset, K, arr.shape[0], name=f"blk.0.attn_{name}.weight")
            c.set_array(self.wt[name], arr)
            offset += arr.nbytes
        self.x = f32(ch, cb, K, M, name="x")
        self.a = f32(ch, cb + 1024, K, M, op=ADD, src=(self.x.id, self.x.id), name="attn_norm")
        self.out = {name: f32(ch, cb + 2048 * (i + 1), self.w[name].shape[0], M, op=MUL_MAT,
                              src=(self.wt[name].id, self.a.id), name=name)
                    for i, name in enumerate(("q", "k", "v"))}
        self.out["o"] = f32(ch, cb + 2048 * 4, K, M, op=MUL_MAT, src=(self.wt["o"].id, self.out["q"].id), name="o")
        self.order = [self.a, *self.out.values()]
        if llama_order:
            q = self.out["q"]
            r = f32(ch, cb + 2048 * 5, NQ, M, op=ADD, src=(q.id, q.id), name="r")
            self.out["v"] = f32(ch, q.data, NK, M, op=MUL_MAT, src=(self.wt["v"].id, self.a.id), name="v")
            self.out["o"] = f32(ch, cb + 2048 * 4, K, M, op=MUL_MAT, src=(self.wt["o"].id, r.id), name="o")
            self.out["r"] = r
            self.order = [self.a, q, r, self.out["v"], self.out["k"], self.out["o"]]
        c.set_array(self.x, np.random.default_rng(seed + 1).standard_normal((M, K)).astype(np.float32))

    def nodes(self) -> list[T]:
        return self.order

    def compute(self) -> dict[str, np.ndarray]:
        self.c.graph_compute(self.nodes(), [self.x, *self.wt.values(), *self.nodes()])
        return self.results()

    def recompute(self) -> dict[str, np.ndarray]:
        self.c.graph_recompute()
        return self.results()

    def results(self) -> dict[str, np.ndarray]:
        return {name: self.c.get_array(t).reshape(M, -1) for name, t in self.out.items()}


def run_graph(npu, group: bool, writes=(), llama_order: bool = False) -> tuple[list[dict[str, np.ndarray]], dict]:
    """Two graph runs (the second after ``writes``: (member, new weight)), results and stats."""
    with serve(npu=npu, group_matmuls=group) as st:
        with st.client() as c:
            g = AttentionGraph(c, llama_order=llama_order)
            first = g.compute()
            for name, arr in writes:
                c.set_array(g.wt[name], arr)
            second = g.recompute()
        return [first, second], st.state.stats.as_dict(engine=npu.counters)
    raise AssertionError("unreachable")


def same(a: dict, b: dict) -> None:
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_siblings_run_as_one_step_with_the_results_of_one_submit_each():
    npu = FusingFakeNpu()
    grouped, stats = run_graph(npu, group=True)
    assert npu.fusions_built == 1 and npu.counters["submits"] == 2          # Q/K/V once per graph run
    assert npu.matmuls == 2                                               # o alone, both runs
    assert stats["npu_groups_planned"] == 1 and stats["npu_grouped_runs"] == 2
    assert stats["npu_matmuls_by_m"] == {M: 8}
    # device time: each grouped run counts its fusion's figure once, like a lone matmul's
    assert stats["npu_device_seconds"] == pytest.approx(2 * FUSION_DEVICE_S + 2 * MATMUL_DEVICE_S, rel=1e-12)
    assert stats["npu_device_label"] == "modeled"
    ungrouped_npu = FusingFakeNpu()
    ungrouped, stats = run_graph(ungrouped_npu, group=False)
    assert ungrouped_npu.fusions_built == 0 and ungrouped_npu.matmuls == 8 and stats["npu_groups_planned"] == 0
    assert stats["npu_device_seconds"] == pytest.approx(8 * MATMUL_DEVICE_S, rel=1e-12)
    for a, b in zip(grouped, ungrouped):
        same(a, b)


@pytest.mark.parametrize("trouble", [None, "fault", "refused"])
def test_llama_order_siblings_are_gathered_and_a_reused_dst_is_written_at_its_place(trouble):
    npu = FusingFakeNpu()
    npu.fail_fusion = trouble == "fault"
    npu.refuse_fusions = trouble == "refused"
    grouped, stats = run_graph(npu, group=True, llama_order=True)
    reference, ref_stats = run_graph(FusingFakeNpu(), group=False, llama_order=True)
    for a, b in zip(grouped, reference):
        same(a, b)
    if trouble is None:
        assert stats["npu_groups_planned"] == 1 and stats["npu_grouped_runs"] == 2
        assert npu.counters["submits"] == 2 and npu.matmuls == 2                # q+v+k as one; o alone
    else:
        assert stats["npu_grouped_runs"] == 0 and npu.matmuls == 8


def test_a_write_to_one_member_rebuilds_the_fusion():
    npu = FusingFakeNpu()
    k_new = np.random.default_rng(9).standard_normal((NK, K)).astype(np.float32)
    (first, second), _ = run_graph(npu, group=True, writes=[("k", k_new)])
    assert npu.fusions_built == 2
    assert not np.allclose(first["k"], second["k"])
    reference, _ = run_graph(FusingFakeNpu(), group=False, writes=[("k", k_new)])
    same(second, reference[1])


@pytest.mark.parametrize("trouble", ["fault", "refused", "not_resident"])
def test_a_group_that_cannot_run_falls_back_to_its_members(trouble):
    class NpuEngine(FusingFakeNpu):
        refused_k = False

        def upload_weight(self, b, dtype="fp16"):
            if trouble == "not_resident" and b.shape[0] == NK and not self.refused_k:
                self.refused_k = True                      # the first NK-row weight: W_k
                raise RuntimeError("injected: the engine refuses this weight")
            return super().upload_weight(b, dtype)

    npu = NpuEngine()
    npu.fail_fusion = trouble == "fault"
    npu.refuse_fusions = trouble == "refused"
    results, stats = run_graph(npu, group=True)
    reference, _ = run_graph(FusingFakeNpu(), group=False)
    if trouble == "not_resident":       # K on the host (ggml-cpu, f32 weights: no fp16 rounding)
        for a, b in zip(results, reference):
            same({n: a[n] for n in "qvo"}, {n: b[n] for n in "qvo"})
            np.testing.assert_allclose(a["k"], b["k"], rtol=1e-2, atol=0.05)
        assert stats["npu_grouped_runs"] == 0 and npu.fusions_built == 0 and npu.matmuls == 6
    else:
        for a, b in zip(results, reference):
            same(a, b)
        assert stats["npu_grouped_runs"] == 0 and npu.matmuls == 8
        assert npu.fusions_built == (2 if trouble == "fault" else 0)          # a fault retries next run


def test_on_the_simulator_grouping_is_bit_identical_and_saves_submits():
    """The engine's chained fusion, Δsubmits from its counters; a SET_TENSOR of K between two graphs."""
    k_new = np.random.default_rng(9).standard_normal((NK, K)).astype(np.float32)
    figures = {}
    for group in (True, False):
        npu = ggml_rknpu.open("sim-rknpu")
        try:
            results, stats = run_graph(npu, group=group, writes=[("k", k_new)])
        finally:
            npu.close()
        figures[group] = (results, stats["engine"])
    (grouped, eg), (ungrouped, eu) = figures[True], figures[False]
    for a, b in zip(grouped, ungrouped):
        same(a, b)
    assert not np.allclose(grouped[0]["k"], grouped[1]["k"])
    # per run: QKV chained + o, a one-weight fusion (every NPU step is a fusion run)
    assert (eg["submits"], eg["chained_submits"], eg["fusion_runs"]) == (4, 2, 4)
    assert (eu["submits"], eu["chained_submits"], eu["fusion_runs"]) == (8, 0, 8)
