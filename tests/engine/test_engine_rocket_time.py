"""A one-file engine's modeled device time under rocket (``open_engine``; ``open_npu`` opens a
file per core, tests/engine/test_engine_core_files.py): it submits a job from its one open
file, so mainline runs the cores' shares one after another, and the modeled time of a job is
never below the sum of the jobs that file submitted (``cost.model.driver_time``). Three cores,
extended envelope, on sim-rocket; the matmul itself exact against numpy."""

from __future__ import annotations

import numpy as np
import pytest

from ggml_rknpu.cost.model import modeled_time, rocket_time, task_seconds, workload_from_program
from ggml_rknpu.engine import open_engine
from ggml_rknpu.sim.kernel import SimRocketKernel


@pytest.mark.parametrize("m,k,n", [(1, 256, 96), (16, 512, 3 * 1024)])
def test_a_rocket_job_is_priced_as_its_files_jobs_in_turn(m, k, n):
    rng = np.random.default_rng(3)
    a = rng.integers(-128, 128, (m, k), dtype=np.int8)
    b = rng.integers(-128, 128, (n, k), dtype=np.int8)
    npu = open_engine("sim-rocket", cores=3, envelope="extended")
    try:
        w = npu.upload_weight(b, "int8")
        fusion = npu.fuse([w], m)
        [c] = fusion.run(a)
        np.testing.assert_array_equal(c, a.astype(np.int64) @ b.astype(np.int64).T)
        program = npu.parts.programs.program_for(w, fusion_rows := 1 << (m - 1).bit_length(), fusion.out)
        assert fusion_rows >= m and program.cores_used == 3 and fusion.modeled is not None
        assert npu.npu_mhz is not None
        work = workload_from_program(program)
        shares = [sum(task_seconds(t, npu_mhz=npu.npu_mhz) for t in work.tasks if t.core == core) for core in range(3)]
        assert fusion.modeled.total_s == pytest.approx(rocket_time(program, files=1, npu_mhz=npu.npu_mhz).total_s)
        assert fusion.modeled.total_s >= sum(shares)
        assert fusion.modeled.total_s > modeled_time(program, npu_mhz=npu.npu_mhz).total_s   # not side by side
        kernel = npu.device.syscalls
        assert isinstance(kernel, SimRocketKernel)
        [entity] = {r.entity for r in kernel.job_runs}       # the engine's one file
        assert kernel.modeled_now >= sum(r.end - r.start for r in kernel.job_runs) - 1e-12
    finally:
        npu.close()
