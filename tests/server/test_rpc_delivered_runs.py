"""Host segments that only grouped members' Deliveries separate run as one ggml graph
(``plan_steps.DeliveredRun``: each delivery a CPY node from the group's kept result), with the
results of the ungrouped plan, and as their parts when the group cannot run."""

from __future__ import annotations

import numpy as np
import pytest

from ggml_rknpu.libggml.enums import GgmlOp
from support.rpc_testkit import FusingFakeNpu, T, serve

pytestmark = pytest.mark.timeout(120)
MUL_MAT, ADD = int(GgmlOp.MUL_MAT), int(GgmlOp.ADD)
K, N, M = 64, 32, 1


def f32(buffer, data, *ne, **kw) -> T:
    return T(ne=tuple(ne) + (1,) * (4 - len(ne)), buffer=buffer, data=data, **kw)


def run(npu, group: bool) -> tuple[list[dict[str, np.ndarray]], dict]:
    """a = x + x; q, v, k = W a (one group once gathered); r = q + q; v over q's bytes;
    s = a + a; k over s's bytes; o = W_o r. Gathered: [a] [q v k] [r, deliver v, s, deliver k] [o],
    the middle stretch one graph. Two runs, the second with new x."""
    with serve(npu=npu, group_matmuls=group) as st:
        with st.client() as c:
            wh, wb = c.alloc_base(1 << 16)
            ch, cb = c.alloc_base(1 << 16)
            rng = np.random.default_rng(3)
            w = {}
            for i, (name, k_in, n_out) in enumerate((("q", K, N), ("v", K, N), ("k", K, N), ("o", N, K))):
                w[name] = f32(wh, wb + i * N * K * 4, k_in, n_out, name=f"blk.0.attn_{name}.weight")
                c.set_array(w[name], rng.standard_normal((n_out, k_in)).astype(np.float32))
            x = f32(ch, cb, K, M, name="x")
            a = f32(ch, cb + 1024, K, M, op=ADD, src=(x.id, x.id), name="a")
            q = f32(ch, cb + 2048, N, M, op=MUL_MAT, src=(w["q"].id, a.id), name="q")
            r = f32(ch, cb + 3072, N, M, op=ADD, src=(q.id, q.id), name="r")
            v = f32(ch, q.data, N, M, op=MUL_MAT, src=(w["v"].id, a.id), name="v")
            s = f32(ch, cb + 4096, K, M, op=ADD, src=(a.id, a.id), name="s")
            k = f32(ch, s.data, N, M, op=MUL_MAT, src=(w["k"].id, a.id), name="k")
            o = f32(ch, cb + 5120, K, M, op=MUL_MAT, src=(w["o"].id, r.id), name="o")
            nodes = [a, q, r, v, s, k, o]
            results = []
            for n_pass in range(2):
                c.set_array(x, rng.standard_normal((M, K)).astype(np.float32))
                if n_pass == 0:
                    c.graph_compute(nodes, [x, *w.values(), *nodes])
                else:
                    c.graph_recompute()
                results.append({t.name: c.get_array(t) for t in (r, v, k, o)})
            return results, st.state.stats.as_dict(engine=npu.counters)
    raise AssertionError("unreachable")


@pytest.mark.parametrize("trouble", [None, "fault", "refused"])
def test_deliveries_between_host_nodes_run_in_one_graph(trouble):
    npu = FusingFakeNpu()
    npu.fail_fusion = trouble == "fault"
    npu.refuse_fusions = trouble == "refused"
    results, stats = run(npu, group=True)
    reference, ref_stats = run(FusingFakeNpu(), group=False)
    for got, want in zip(results, reference):
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert ref_stats["host_segments"] == 2 * 3                 # ungrouped, per run: [a] q [r] v [s] k
    if trouble is None:
        assert stats["npu_grouped_runs"] == 2
        assert stats["host_segments"] == 2 * 2                 # [a] and [r, v, s, k] as one graph
    else:
        assert stats["npu_grouped_runs"] == 0
        assert stats["host_segments"] == 2 * 3                 # the parts: [a] [r] [s]
