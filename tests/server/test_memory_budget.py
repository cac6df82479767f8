"""The memory budget (server/memory_budget.py): a weight whose NPU copy does not fit in the
board bytes left runs in ggml-cpu for good, its result ggml-cpu's, and the stats name it;
the default follows /proc/meminfo with the stated reserve."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ggml_rknpu.cost import placement as pl
from ggml_rknpu.devices import open_device
from ggml_rknpu.engine import open_engine
from ggml_rknpu.libggml.enums import GgmlOp
from ggml_rknpu.server.buffers import DeviceBudget
from ggml_rknpu.server.memory_budget import MIN_RESERVE, OVER_BUDGET, default_budget, for_server
from ggml_rknpu.server.rpc import report
from support.matmul_graph import K as KG
from support.matmul_graph import M as MG
from support.matmul_graph import MatmulGraph, fp16_ref, rng_w
from support.rpc_testkit import FakeNpu, T, serve, wait_until

pytestmark = pytest.mark.timeout(120)
MUL_MAT = int(GgmlOp.MUL_MAT)
K, N, M = 64, 32, 2
FP16_BYTES = N * K * 2          # one weight's NPU copy (fp16)


def _two_weights(budget_left: int, ns: tuple[int, int] = (N, N),
                 saved=None) -> tuple[list[np.ndarray], list[np.ndarray], dict, FakeNpu]:
    """Two weights of ``ns`` rows read by one graph, the budget ``budget_left`` bytes above what
    the board holds when the graph is planned; ``saved``: the placer's seconds saved on the NPU
    by (K, N) in place of its models: (outs, weights, stats, engine)."""
    npu = FakeNpu()
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal((n, K)).astype(np.float32) for n in ns]
    x = rng.standard_normal((M, K)).astype(np.float32)
    with serve(npu=npu) as st:
        state = st.state
        state.budget, said = for_server(state, 1)
        assert state.budget is not None and said == "memory budget 1 MiB of board memory (--memory-budget)"
        if saved is not None:
            assert state.placer is not None
            state.placer.choice = lambda type_, m, k, n, experts=1: (    # type: ignore[method-assign, assignment]
                pl.Choice(pl.NPU, 0.0, saved(k, n)), "modeled")
        with st.client() as c:
            wh, wb = c.alloc_base(1 << 16)
            ch, cb = c.alloc_base(1 << 16)
            wt = [T(ne=(K, ns[i], 1, 1), buffer=wh, data=wb + i * N * K * 4 * 2, name=f"blk.{i}.ffn_up.weight")
                  for i in range(2)]
            xt = T(ne=(K, M, 1, 1), buffer=ch, data=cb, name="x")
            dst = [T(ne=(ns[i], M, 1, 1), buffer=ch, data=cb + 4096 + i * N * M * 4 * 2, op=MUL_MAT,
                     src=(wt[i].id, xt.id), name=f"out{i}") for i in range(2)]
            for t, w in zip(wt, ws):
                c.set_array(t, w)
            c.set_array(xt, x)
            state.budget.bytes = state.board.now(state).total + budget_left
            c.graph_compute(dst, [*wt, xt, *dst])
            outs = [c.get_array(d).reshape(M, n) for d, n in zip(dst, ns)]
            c.graph_compute(dst, [*wt, xt, *dst])          # a second plan keeps the choice
            again = [c.get_array(d).reshape(M, n) for d, n in zip(dst, ns)]
            stats = report.stats_dict(state)
        for a, b in zip(outs, again):
            np.testing.assert_array_equal(a, b)
        return outs, [x @ w.T for w in ws], stats, npu


def test_a_budget_for_one_npu_copy_keeps_the_other_weight_on_the_host():
    outs, refs, stats, npu = _two_weights(FP16_BYTES)
    assert npu.uploads == 1
    assert stats["memory_budget"]["host_only"] == {"blk.1.ffn_up.weight": FP16_BYTES}
    assert stats["host_matmul_reasons"][OVER_BUDGET] == 1
    np.testing.assert_allclose(outs[0], refs[0], rtol=2e-2, atol=2e-2)       # the NPU's fp16 weight
    np.testing.assert_allclose(outs[1], refs[1], rtol=1e-5, atol=1e-5)       # ggml-cpu, f32


def test_the_copy_saving_the_most_time_per_byte_is_admitted_first():
    """Room for the larger weight's copy alone: it saves more modeled time per byte, so it goes
    first, though the graph reads the other one first."""
    ns = (N, N + 16)
    outs, refs, stats, npu = _two_weights((N + 16) * K * 2, ns, saved=lambda k, n: float(n * n))
    assert npu.uploads == 1 and stats["memory_budget"]["host_only"] == {"blk.0.ffn_up.weight": N * K * 2}
    np.testing.assert_allclose(outs[0], refs[0], rtol=1e-5, atol=1e-5)       # ggml-cpu, f32
    np.testing.assert_allclose(outs[1], refs[1], rtol=2e-2, atol=2e-2)       # the NPU's fp16 weight


def test_no_room_runs_every_weight_on_the_host_and_room_stages_both():
    outs, refs, stats, npu = _two_weights(0)
    assert npu.uploads == 0 and sorted(stats["memory_budget"]["host_only"]) == ["blk.0.ffn_up.weight",
                                                                                  "blk.1.ffn_up.weight"]
    for o, r in zip(outs, refs):
        np.testing.assert_allclose(o, r, rtol=1e-5, atol=1e-5)
    _, _, stats, npu = _two_weights(2 * FP16_BYTES)
    assert npu.uploads == 2 and stats["memory_budget"]["host_only"] == {}


def test_the_default_is_mem_available_less_the_reserve(tmp_path: Path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        8000000 kB\nMemFree:  100 kB\nMemAvailable:    6000000 kB\n")
    reserve = max(MIN_RESERVE, 8000000 * 1024 // 8)
    assert default_budget(100 << 20, meminfo) == 6000000 * 1024 - reserve + (100 << 20)
    meminfo.write_text("MemTotal:        8000000 kB\n")
    assert default_budget(0, meminfo) is None


def test_the_budget_lifts_the_buffer_bound_above_the_npu_window():
    """A model larger than the NPU's address space loads under a budget that holds it (its
    weights beyond the window run on the host); without a budget the window bounds buffers."""
    memory = DeviceBudget(lambda: (1 << 20, 4 << 20))            # an NPU window of 4 MiB, 1 MiB free
    assert not memory.reserve(6 << 20) and memory.report() == (1 << 20, 4 << 20)
    memory.host_bytes = 16 << 20
    assert memory.reserve(6 << 20) and memory.report() == (10 << 20, 16 << 20)
    assert not memory.reserve(11 << 20)
    memory.host_bytes = 2 << 20                                  # a budget below the window lifts nothing
    memory.release(6 << 20)
    assert memory.report() == (1 << 20, 4 << 20) and memory.reserve(4 << 20) and not memory.reserve(1)


def test_board_accounting_lists_programs_and_plans_on_their_own_lines():
    """On the simulated NPU the cached programs are a line of the NPU memory, the sessions'
    plans (ggml contexts, work buffers) a line of their own in the total, gone with the session."""
    npu = open_engine(open_device("sim-rknpu"))
    try:
        with serve(npu=npu) as st:
            state = st.state
            with st.client() as c:
                g = MatmulGraph(c)
                w = rng_w()
                c.set_array(g.w, w)
                c.set_array(g.x, np.ones((MG, KG), np.float32))
                np.testing.assert_allclose(g.compute(), fp16_ref(np.ones((MG, KG), np.float32), w), rtol=2e-2, atol=2e-2)
                board = state.board.now(state)
                assert board.host_caches == state.stats.plan_bytes > 0
                assert board.programs == npu.program_bytes() > 0 and board.npu == npu.memory_used()
                assert board.total == (board.client_buffers + board.repacked_host_copies + board.npu
                                       + board.host_caches + board.server_at_start)
                assert "programs" in board.render() and "host caches (plans)" in board.render()
            assert wait_until(lambda: state.stats.plan_bytes == 0)
    finally:
        npu.close()
