"""Speculative decoding and parallel slots send graphs that alternate between a few batch
sizes (M = 1 for a plain pass, M = 1 + drafted tokens for a verification, M = active slots).
The server must plan each shape once and replay it from then on, and count NPU matmuls by M."""

from __future__ import annotations

import numpy as np
import pytest

from ggml_rknpu.libggml.enums import GgmlOp
from ggml_rknpu.server.placement import NPU
from support.rpc_testkit import FakeNpu, T, serve

pytestmark = pytest.mark.timeout(60)
MUL_MAT = int(GgmlOp.MUL_MAT)
K, N = 64, 32


def test_alternating_batch_sizes_are_planned_once_and_counted_by_m():
    npu = FakeNpu()
    with serve(npu=npu) as st:
        with st.client() as c:
            wh, wb = c.alloc_base(1 << 16)
            ch, cb = c.alloc_base(1 << 16)
            w = T(ne=(K, N, 1, 1), buffer=wh, data=wb, name="blk.0.attn_q.weight")
            weight = np.random.default_rng(0).standard_normal((N, K)).astype(np.float32)
            c.set_array(w, weight)
            graphs = {}
            for m in (1, 4, 2):          # a plain pass, a 3-token draft verified, a 1-token draft
                x = T(ne=(K, m, 1, 1), buffer=ch, data=cb, name="x")
                out = T(ne=(N, m, 1, 1), buffer=ch, data=cb + 4096 * 4, op=MUL_MAT, src=(w.id, x.id), name="q")
                graphs[m] = (x, out)
            sequence = [1, 4, 1, 4, 2, 1, 4, 2, 1]
            rng = np.random.default_rng(1)
            for m in sequence:
                x, out = graphs[m]
                a = rng.standard_normal((m, K)).astype(np.float32)
                c.set_array(x, a)
                c.graph_compute([out], [w, x, out])
                np.testing.assert_allclose(c.get_array(out).reshape(m, N),
                                           a @ weight.astype(np.float16).astype(np.float32).T, rtol=1e-5, atol=1e-4)
            stats = st.state.stats
            assert stats.plans_built == 3                      # one per shape, then replays only
            assert stats.plan_cache_hits == len(sequence) - 3
            assert stats.npu_matmuls_by_m == {1: 4, 2: 2, 4: 3}
            assert stats.per_op[("MUL_MAT", NPU)].ops == len(sequence)
            assert npu.uploads == 1                            # one resident weight for every M
            assert stats.as_dict()["npu_matmuls_by_m"] == {1: 4, 2: 2, 4: 3}
            assert "NPU matmuls by rows M: M=1 4, M=2 2, M=4 3" in stats.render()



def test_partial_offload_splits_times_batch_sizes_fit_the_plan_cache():
    """-ot partial offload sends ~90 graph splits per pass [ggml-rpc.md §5.1]; a speculative
    session sends each split at every batch size it alternates between (here 1..4 rows). The
    second round must replay every plan: no split may be re-planned."""
    splits, sizes = 90, (1, 2, 3, 4)
    with serve(npu=FakeNpu()) as st:
        with st.client() as c:
            wh, wb = c.alloc_base(1 << 16)
            ch, cb = c.alloc_base(1 << 20)
            w = T(ne=(K, N, 1, 1), buffer=wh, data=wb, name="blk.0.ffn_up.weight")
            c.set_array(w, np.ones((N, K), np.float32))
            graphs = []
            for split in range(splits):
                for m in sizes:
                    x = T(ne=(K, m, 1, 1), buffer=ch, data=cb + split * 8192, name=f"x{split}")
                    out = T(ne=(N, m, 1, 1), buffer=ch, data=cb + split * 8192 + 4096, op=MUL_MAT,
                            src=(w.id, x.id), name=f"up{split}")
                    graphs.append((x, out))
                c.set_array(x, np.ones((max(sizes), K), np.float32))   # covers the smaller batches too
            for _round in range(2):
                for x, out in graphs:
                    c.graph_compute([out], [w, x, out])
            x, out = graphs[-1]
            assert (c.get_array(out) == K).all()               # a reply: the server has run every graph
            stats = st.state.stats
            assert stats.plans_built == splits * len(sizes)
            assert stats.plan_cache_hits == splits * len(sizes)
