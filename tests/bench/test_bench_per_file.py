"""A three-core program on the simulated mainline rocket driver, run from a file per core
(``bench.per_file``): exact against numpy, the three cores' jobs from three files' entities,
the weight mapped once over the files, and no job's modeled end before the sum of the jobs its
file submitted."""

from __future__ import annotations

import dataclasses
import errno

import numpy as np
import pytest

from ggml_rknpu.bench import ladder as ld
from ggml_rknpu.bench.per_file import core_shares
from ggml_rknpu.compiler.matmul import compile_matmul
from ggml_rknpu.devices import open_device
from ggml_rknpu.engine.envelope_record import RUNGS
from ggml_rknpu.sim.kernel import SimRocketKernel

CASES = [(96, 256, 96, "int8", "int32"), (5, 512, 3 * 1024, "int8", "int32"), (64, 256, 96, "fp16", "fp32")]


def _operands(m, k, n, dtype, rng):
    if dtype == "int8":
        return rng.integers(-128, 128, (m, k), dtype=np.int8), rng.integers(-128, 128, (n, k), dtype=np.int8)
    return (rng.standard_normal((m, k)).astype(np.float16), rng.standard_normal((n, k)).astype(np.float16))


@pytest.mark.parametrize("m,k,n,dtype,out", CASES)
def test_three_cores_from_three_files(m, k, n, dtype, out):
    program = compile_matmul(m, k, n, dtype=dtype, out=out, cores=3, abi="rocket", envelope="extended")
    assert program.cores_used == 3
    shares = core_shares(program)
    assert sum(hi - lo for s in shares for lo, hi in [s.ranges["B"]]) == program.b_bytes   # each weight row once
    a, b = _operands(m, k, n, dtype, np.random.default_rng(7))
    with open_device("sim-rocket") as dev:
        kernel = dev.syscalls
        assert isinstance(kernel, SimRocketKernel)
        c = ld.run_program(dev, program, a, b)
        runs = kernel.job_runs
    want = a.astype(np.int64) @ b.astype(np.int64).T if dtype == "int8" else a.astype(np.float32) @ b.astype(np.float32).T
    if dtype == "int8":
        np.testing.assert_array_equal(c, want)
    else:
        np.testing.assert_allclose(c, want, rtol=2e-2, atol=0.1)
    assert len({r.entity for r in runs}) == 3, runs
    assert sorted({r.core for r in runs}) == [0, 1, 2]
    by_file: dict[int, list] = {}
    for r in runs:
        by_file.setdefault(r.entity, []).append(r)
    for jobs in by_file.values():      # one file's jobs: one core, one after another
        assert len({j.core for j in jobs}) == 1
        assert jobs[-1].end >= jobs[0].start + sum(j.end - j.start for j in jobs) - 1e-12
    assert max(r.end for r in runs) < sum(r.end - r.start for r in runs)      # side by side


def test_the_ladders_three_core_rung_runs_a_file_per_core_on_rocket(monkeypatch):
    opened = []
    real = ld.run_program

    def spy(dev, program, a, b):
        opened.append(dev.syscalls)
        return real(dev, program, a, b)

    monkeypatch.setattr(ld, "run_program", spy)
    rung = dataclasses.replace(next(r for r in ld.LADDER if r.name == "three_cores"))
    result = ld.run_rung(rung, "sim-rocket", list(RUNGS[: RUNGS.index("three_cores")]))
    assert result.status == "pass", (result.symptom, result.detail)
    [kernel] = set(opened)
    runs = kernel.job_runs
    assert len(runs) == 3 * len(result.cases) == 6      # a job per core and case, each from its own file
    assert all(len({r.entity for r in runs[i:i + 3]}) == 3 for i in range(0, len(runs), 3))
    assert all(c["ok"] for c in result.cases)


def test_only_rocket_launches_without_waiting():
    from ggml_rknpu.kernel.errors import NpuError
    from ggml_rknpu.kernel.job import Job

    with open_device("sim-rknpu") as dev, pytest.raises(NpuError, match="only rocket") as info:
        dev.launch(Job(cores=((), (), ())))
    assert info.value.errno == errno.EOPNOTSUPP
