"""``rknpu serve`` on sim-rocket with three cores (extended envelope, as ``--device sim-rocket
--envelope extended`` opens it): MUL_MAT graphs computed right from a file per core, the
simulated kernel's record shows the jobs of three open files, and the board accounting counts
each weight's NPU copy once (its per-file slices add up to one copy)."""

from __future__ import annotations

import numpy as np
import pytest

import ggml_rknpu
from ggml_rknpu.engine import open_engine
from ggml_rknpu.engine.core_files import CoreFilesEngine
from ggml_rknpu.libggml.enums import GgmlOp
from ggml_rknpu.server.rpc import report
from ggml_rknpu.sim.kernel import SimRocketKernel
from support.rpc_testkit import T, serve

pytestmark = pytest.mark.timeout(180)
MUL_MAT = int(GgmlOp.MUL_MAT)
K, M = 128, 3
NS = (192, 96, 40)          # six, three and three fp16 kernel groups (40: the last one partial)


def test_mul_mat_graphs_from_three_files_and_one_npu_copy_each():
    npu = ggml_rknpu.open(device="sim-rocket", envelope="extended")
    assert isinstance(npu, CoreFilesEngine) and npu.cores == 3
    kernel = npu.device.syscalls
    assert isinstance(kernel, SimRocketKernel)
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal((n, K)).astype(np.float32) for n in NS]
    x = rng.standard_normal((M, K)).astype(np.float32)
    try:
        with serve(npu=npu) as st:
            with st.client() as c:
                wh, wb = c.alloc_base(sum(NS) * K * 4)
                ch, cb = c.alloc_base(1 << 16)
                offsets = np.cumsum((0, *NS))[:-1] * K * 4
                wt = [T(ne=(K, n, 1, 1), buffer=wh, data=wb + int(o), name=f"blk.0.w{i}")
                      for i, (n, o) in enumerate(zip(NS, offsets))]
                xt = T(ne=(K, M, 1, 1), buffer=ch, data=cb, name="x")
                outs = [T(ne=(n, M, 1, 1), buffer=ch, data=cb + 4096 * (4 + 2 * i), op=MUL_MAT, src=(w.id, xt.id),
                          name=f"out{i}") for i, (n, w) in enumerate(zip(NS, wt))]
                for t, w in zip(wt, ws):
                    c.set_array(t, w)
                c.set_array(xt, x)
                before = len(kernel.job_runs)
                c.graph_compute(outs, [*wt, xt, *outs])
                got = [c.get_array(t).reshape(M, n) for t, n in zip(outs, NS)]
                runs = kernel.job_runs[before:]
                board = report.stats_dict(st.state)["board_memory"]
                used = [f.memory_used() for f in npu.files]
                staged = npu.counters["weight_bytes_uploaded"]     # every file's slices
    finally:
        npu.close()
    for out, w in zip(got, ws):
        np.testing.assert_allclose(out, x @ w.T, rtol=2e-2, atol=5e-2)
    assert len({r.entity for r in runs}) == 3 and len({r.core for r in runs}) == 3
    assert board["npu"] == sum(used) and all(u > 0 for u in used)
    with open_engine("sim-rocket", cores=1) as one:
        assert staged == sum(one.upload_weight(w).packed_bytes for w in ws) > 0     # one copy over the files
