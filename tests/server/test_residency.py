"""Per-weight residency (server/residency.py): a budget with room for the NPU copies but not for
their repacked host copies as well keeps a weight NPU-only (no repacked copy, in either order
of prompt and decode plans), the other with both; every result is ggml-cpu's or the NPU's,
GET_TENSOR returns the uploaded bytes, and NPU faults still give the right result (re-staged
from the weight pages, or ggml-cpu's plain kernel on them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from ggml_rknpu.cost import placement as pl
from ggml_rknpu.cost import residency as rs
from ggml_rknpu.kernel.errors import NpuTimeout
from ggml_rknpu.libggml.enums import GgmlOp, GgmlType
from ggml_rknpu.server.memory_budget import for_server
from ggml_rknpu.server.rpc import report
from ggml_rknpu.server.weight_pages import WeightPages, filesystem_type
from support.host_matmul import ggml_cpu_matmul
from support.rpc_testkit import FaultyNpu, T, serve

pytestmark = pytest.mark.timeout(120)
MUL_MAT, Q4_0 = int(GgmlOp.MUL_MAT), int(GgmlType.Q4_0)
K, N, PROMPT_M = 256, 64, 32
Q4_BYTES = N * K // 32 * 18        # one weight's GGUF bytes, and its repacked copy's
FP16_BYTES = N * K * 2             # its NPU copy
MAX_NMSE = 5e-4                    # test-backend-ops' bound for MUL_MAT (test_mul_mat::max_nmse_err)
NAMES = ("blk.0.ffn_up.weight", "blk.1.ffn_up.weight")


def nmse(got: np.ndarray, ref: np.ndarray) -> float:
    return float(((got - ref) ** 2).sum() / (ref ** 2).sum())


def board_choice(type_, M: int, K: int, N: int, experts: int = 1) -> tuple[pl.Choice, str]:
    """Placement times in place of the board's models: decode (M <= 4) faster on the host,
    the prompt on the NPU, so the placement wants both copies of every weight."""
    if M <= 4:
        return pl.Choice(pl.HOST, 2e-4, 1e-4, host_rows=N), "modeled"
    return pl.Choice(pl.NPU, 1e-3, 1e-1), "modeled"


@pytest.fixture
def pages(tmp_path: Path) -> WeightPages:
    if filesystem_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip(f"the test's temporary directory {tmp_path} is on tmpfs: its pages cannot be dropped")
    return WeightPages(tmp_path / "pages")


def test_the_rule_gives_up_the_repacked_copy_that_costs_the_least_job_time():
    cost = rs.WeightCost(Q4_BYTES, FP16_BYTES, (1e-4, 1e-1), (2e-4, 1e-3))
    both = cost.bytes(rs.BOTH)
    assert rs.fastest_within([cost], [rs.BOTH], None, None, lambda h, n: h + n) == [rs.BOTH]
    assert rs.fastest_within([cost], [rs.BOTH], FP16_BYTES, None, lambda h, n: h + n) == [rs.NPU]
    assert rs.fastest_within([cost], [rs.BOTH], Q4_BYTES, None, lambda h, n: h + n) == [rs.HOST]
    assert rs.fastest_within([cost, cost], [rs.BOTH] * 2, sum(both) + FP16_BYTES, None,
                             lambda h, n: h + n) == [rs.BOTH, rs.NPU]     # a tie: the later weight gives up
    assert rs.fastest_within([cost], [rs.BOTH], Q4_BYTES - 1, None, lambda h, n: h + n) is None


@pytest.mark.parametrize("decode_first", [False, True])
def test_room_for_npu_copies_but_not_repacked_ones_keeps_a_weight_npu_only(pages: WeightPages, decode_first: bool,
                                                                          caplog):
    caplog.set_level("INFO", logger="ggml_rknpu.rpc")
    rng = np.random.default_rng(int(decode_first))
    wq = [quants.quantize(rng.standard_normal((N, K)).astype(np.float32), GGMLQuantizationType.Q4_0).tobytes()
          for _ in NAMES]
    npu = FaultyNpu(reset_loses_weights=True)
    with serve(npu=npu, placement="auto", host_repack=True, pages=pages) as st:
        state = st.state
        state.budget, _ = for_server(state, 1)
        assert state.budget is not None and state.placer is not None
        state.placer.choice = board_choice         # type: ignore[method-assign, assignment]
        with st.client() as c:
            wh, wb = c.alloc_base(2 * Q4_BYTES)
            ch, cb = c.alloc_base(1 << 20)
            wt = [T(ne=(K, N, 1, 1), buffer=wh, data=wb + i * Q4_BYTES, type=Q4_0, name=name)
                  for i, name in enumerate(NAMES)]
            for t, w in zip(wt, wq):
                c.set_tensor(t, w)

            def compute(m: int, a: np.ndarray) -> list[np.ndarray]:
                x = T(ne=(K, m, 1, 1), buffer=ch, data=cb, name="x")
                dst = [T(ne=(N, m, 1, 1), buffer=ch, data=cb + 65536 + i * N * PROMPT_M * 4, op=MUL_MAT,
                         src=(wt[i].id, x.id), name=f"out{i}") for i in range(2)]
                c.set_array(x, a)
                c.graph_compute(dst, [*wt, x, *dst])
                return [c.get_array(d).reshape(m, N) for d in dst]

            # room for both NPU copies and one repacked copy, not for two
            state.budget.bytes = state.board.now(state).total + 2 * FP16_BYTES + Q4_BYTES + Q4_BYTES // 2
            prompt = rng.standard_normal((PROMPT_M, K)).astype(np.float32)
            decode = rng.standard_normal((1, K)).astype(np.float32)
            runs = [(1, decode), (PROMPT_M, prompt)] if decode_first else [(PROMPT_M, prompt), (1, decode)]
            outs = {m: compute(m, a) for m, a in runs}
            stats, text = report.stats_dict(state), report.render_stats(state)
            assert stats["board_memory"]["total"] <= state.budget.bytes
            assert [c.get_tensor(t) for t in wt] == wq                       # GET_TENSOR: the uploaded bytes

            npu.faults += [NpuTimeout("hang", 110)] * 2   # faulted twice: ggml-cpu's plain kernel on the pages
            faulted = compute(1, decode)
            npu.faults.append(NpuTimeout("hang", 110))    # faulted once: re-staged from the pages, the NPU again
            restaged = compute(1, decode)
            assert [c.get_tensor(t) for t in wt] == wq
        r = state.recovery
        assert (r.resets, r.host_fallbacks, r.retried_ok) == (3, 1, 1)
        assert state.weight_stats.uploads == 2 + 3            # two stagings, then blk.1's again after each reset
    assert stats["memory_budget"]["npu_only"] == {NAMES[1]: Q4_BYTES} and stats["memory_budget"]["host_only"] == {}
    assert stats["placement"]["residency"] == {"host": 0, "npu": 1, "both": 1}
    assert "weight copies: 0 host-only, 1 NPU-only, 1 both" in text
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("residency of")]
    assert said == [f"residency of 2 new weights: 0 host-only, 1 NPU-only, 1 both (memory budget "
                    f"{state.budget.bytes / 2**20:.0f} MiB of board memory); NPU-only for the budget: {NAMES[1]}"]
    assert f"1 weights kept NPU-only, their repacked host copies ({Q4_BYTES / 2**20:.1f} MiB) given up: {NAMES[1]}" in text
    assert stats["host_repacked"] == 1 and stats["host_repacked_bytes"] == Q4_BYTES   # blk.0's, for decode
    assert stats["weights"]["uploads"] == 2
    for i, w in enumerate(wq):                           # the prompt on the NPU: its weights in f32
        assert nmse(outs[PROMPT_M][i], ggml_cpu_matmul(Q4_0, K, w, prompt, repacked=False)) < MAX_NMSE
    np.testing.assert_array_equal(outs[1][0], ggml_cpu_matmul(Q4_0, K, wq[0], decode, repacked=True))
    assert nmse(outs[1][1], ggml_cpu_matmul(Q4_0, K, wq[1], decode, repacked=False)) < MAX_NMSE   # NPU-only
    np.testing.assert_array_equal(faulted[1], ggml_cpu_matmul(Q4_0, K, wq[1], decode, repacked=False))
    np.testing.assert_array_equal(restaged[1], outs[1][1])
    for run in (faulted, restaged):
        np.testing.assert_array_equal(run[0], outs[1][0])
