"""The engine on sim-rocket with three cores (extended envelope): a file per core, each holding
its rows of every weight; results equal to the one-file engine's bit for bit, the three
cores' jobs from three files side by side, a canary left by any file is stale output, and the
modeled time never below the sum of the jobs one file submitted."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggml_rknpu.cost.model import ROCKET_DOMAIN_SWITCH_S, task_seconds, workload_from_program
from ggml_rknpu.engine import NpuEngine, open_engine, open_npu
from ggml_rknpu.engine.canary import StaleOutput
from ggml_rknpu.engine.core_files import CoreFilesEngine, row_slices
from ggml_rknpu.hw.alignment import ceil_div
from ggml_rknpu.hw.limits import PAGE_BYTES
from ggml_rknpu.sim.kernel import SimRocketKernel


@pytest.fixture
def npu():
    engine = open_npu("sim-rocket", envelope="extended")
    assert isinstance(engine, CoreFilesEngine) and engine.cores == 3
    yield engine
    engine.close()


def _kernel(npu: CoreFilesEngine) -> SimRocketKernel:
    kernel = npu.device.syscalls
    assert isinstance(kernel, SimRocketKernel)
    return kernel


def test_open_npu_opens_a_file_per_core_on_rocket_only():
    with open_npu("sim-rknpu", envelope="extended") as vendor:
        assert isinstance(vendor, NpuEngine) and vendor.cores == 3       # the vendor driver commits masks itself
    with open_npu("sim-rocket") as proven:
        assert isinstance(proven, NpuEngine) and proven.cores == 1       # the proven envelope: one core
    with open_npu("sim-rocket", cores=1, envelope="extended") as one:
        assert isinstance(one, NpuEngine)
    with open_npu("sim-rocket", cores=2, envelope="extended") as two:
        assert isinstance(two, CoreFilesEngine) and len({f.device.fd for f in two.files}) == 2


@pytest.mark.parametrize("n,k,dtype", [(96, 256, "int8"), (1000, 512, "fp16"), (16, 64, "fp16"), (70, 64, "int8")])
def test_rows_are_sliced_by_whole_kernel_groups_once(n, k, dtype):
    slices = row_slices(n, k, dtype, 3)
    group = {"fp16": 16, "int8": 32}[dtype]
    assert slices[0][0] == 0 and slices[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))           # every row once
    assert all(n0 % group == 0 for n0, _ in slices) and len(slices) == min(3, ceil_div(n, group))


@pytest.mark.parametrize("dtype", ["fp16", "int8"])
@pytest.mark.parametrize("m,k,n", [(1, 256, 96), (7, 512, 1000), (300, 64, 200), (2, 64, 16)])
def test_results_equal_the_one_file_engine_and_come_from_three_files(npu, dtype, m, k, n):
    rng = np.random.default_rng(m * n)
    b = rng.standard_normal((n, k)).astype(np.float32)
    a = rng.standard_normal((m, k)).astype(np.float32)
    kernel = _kernel(npu)
    w = npu.upload_weight(b, dtype)
    before = len(kernel.job_runs)
    got = npu.matmul(a, w)
    runs = kernel.job_runs[before:]
    with open_engine("sim-rocket", cores=1) as one:
        want = one.matmul(a, one.upload_weight(b, dtype))
    np.testing.assert_array_equal(got, want)
    assert np.abs(got - a @ b.T).max() < (0.1 if dtype == "fp16" else 2.0)
    files = len(w.slices)
    assert files == min(3, len(row_slices(n, k, dtype, 3)))
    assert len({r.entity for r in runs}) == files and len({r.core for r in runs}) == files
    assert w.packed_bytes == one_copy_bytes(b, dtype)


def one_copy_bytes(b: np.ndarray, dtype: str) -> int:
    with open_engine("sim-rocket", cores=1) as one:
        return one.upload_weight(b, dtype).packed_bytes


def test_int8_is_exact_and_the_three_files_run_side_by_side(npu):
    rng = np.random.default_rng(1)
    b = rng.integers(-128, 128, (3 * 1024, 512), dtype=np.int8)
    a = rng.integers(-128, 128, (16, 512), dtype=np.int8)
    kernel = _kernel(npu)
    w = npu.upload_weight(b, "int8")
    before = len(kernel.job_runs)
    got = npu.matmul(a, w)
    np.testing.assert_array_equal(got, a.astype(np.int64) @ b.astype(np.int64).T)
    runs = kernel.job_runs[before:]
    assert sorted(r.entity for r in runs) == sorted({r.entity for r in runs}) and len(runs) == 3
    latest_start, earliest_end = max(r.start for r in runs), min(r.end for r in runs)
    assert latest_start < earliest_end            # all three cores busy at once


def test_a_fused_weight_and_a_chain_run_from_every_file(npu):
    rng = np.random.default_rng(2)
    siblings = [rng.standard_normal((n, 128)).astype(np.float32) for n in (64, 96, 64)]
    other = rng.standard_normal((100, 128)).astype(np.float32)
    fused = npu.upload_fused_weight(siblings, "fp16")
    plain = npu.upload_weight(other, "fp16")
    x = rng.standard_normal((4, 128)).astype(np.float32)
    fusion = npu.fuse([fused, plain], 4)
    outs = [o.copy() for o in fusion.run(x)]
    with open_engine("sim-rocket", cores=1) as one:
        want = [one.matmul(x, one.upload_weight(w, "fp16")) for w in (*siblings, other)]
    assert [o.shape for o in outs] == [(4, 64), (4, 96), (4, 64), (4, 100)]
    for got, expected in zip(outs, want):
        np.testing.assert_array_equal(got, expected)
    assert npu.counters["chained_submits"] == 1 and npu.counters["weights_uploaded"] == 2
    assert fusion.timing[1] > 0 and npu.last_timing is not None and npu.last_timing.submits == 3
    submits = npu.counters["submits"]
    again = [np.full_like(w, np.nan) for w in want]
    assert fusion.rehearse(x, again) > 0 and npu.counters["submits"] == submits   # C still holds this input's
    for got, expected in zip(again, want):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("fault", ["stale", "timeout"])
def test_a_job_that_never_completes_in_any_file_is_stale_output(npu, fault):
    """A dropped task, or a job hung until rocket's timeout kills it (no error, outputs stale)."""
    rng = np.random.default_rng(3)
    w = npu.upload_weight(rng.standard_normal((96, 64)).astype(np.float32))
    a = rng.standard_normal((1, 64)).astype(np.float32)
    good = npu.matmul(a, w)
    _kernel(npu).inject = fault              # the next job (the first file's)
    with pytest.raises(StaleOutput, match="3 files") as caught:
        npu.matmul(a, w)
    assert caught.value.lost == [] and npu.counters["npu_faults"] == 1 and npu.counters["resets"] == 1
    np.testing.assert_array_equal(npu.matmul(a, w), good)


def test_narrow_weights_go_to_the_files_holding_least(npu):
    rng = np.random.default_rng(6)
    narrow = [npu.upload_weight(rng.standard_normal((16, 64)).astype(np.float32)) for _ in range(3)]
    assert sorted(w.slices[0].file for w in narrow) == [0, 1, 2]


def test_memory_is_the_files_added_and_freeing_releases_every_slice(npu):
    rng = np.random.default_rng(4)
    w = npu.upload_weight(rng.standard_normal((384, 256)).astype(np.float32))
    npu.matmul(rng.standard_normal((2, 256)).astype(np.float32), w)
    used = [f.memory_used() for f in npu.files]
    assert all(u > 0 for u in used) and npu.memory_used() == sum(used)
    assert npu.scratch_bytes() == sum(f.scratch_bytes() for f in npu.files) > 0
    w.free()
    assert npu.counters["weights_freed"] == 1 and all(s.weight.freed for s in w.slices)
    with pytest.raises(ValueError, match="freed"):
        npu.matmul(np.ones((1, 256), np.float32), w)


@pytest.mark.parametrize("m,k,n", [(1, 2048, 3 * 1024), (16, 512, 1000)])
def test_the_modeled_time_is_never_below_one_files_jobs(npu, m, k, n):
    """The engine's modeled time of a run covers every file's tasks in turn (at the DRAM share
    of three streaming cores) and its jobs' domain switches; the simulated timeline runs each
    file's jobs one after another on one core."""
    rng = np.random.default_rng(5)
    kernel = _kernel(npu)
    w = npu.upload_weight(rng.standard_normal((n, k)).astype(np.float32), "int8")
    before = len(kernel.job_runs)
    npu.matmul(rng.standard_normal((m, k)).astype(np.float32), w)
    timing = npu.last_timing
    assert timing is not None and timing.device_label == "modeled" and timing.device_s is not None
    assert npu.npu_mhz is not None
    for s in w.slices:
        engine = npu.files[s.file]
        program = engine.parts.programs.program_for(s.weight, 1 << (m - 1).bit_length(), "int32")
        work = workload_from_program(program)
        one_file = (sum(task_seconds(t, npu_mhz=npu.npu_mhz, cores_in_job=len(w.slices)) for t in work.tasks)
                    + work.submits * ROCKET_DOMAIN_SWITCH_S)
        assert timing.device_s >= one_file
    runs = kernel.job_runs[before:]
    for entity in {r.entity for r in runs}:
        mine = sorted((r for r in runs if r.entity == entity), key=lambda r: r.start)
        assert len({r.core for r in mine}) == 1
        assert all(a.end <= b.start for a, b in zip(mine, mine[1:]))       # in turn
        assert max(r.end for r in mine) - min(r.start for r in mine) >= sum(r.end - r.start for r in mine) - 1e-15


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(16, 600), st.sampled_from([64, 320])), min_size=1, max_size=3))
def test_on_the_simulated_timeline_no_file_runs_two_jobs_at_once(npu, calls):
    """Any sequence of matmuls: each file's jobs one after another on one core, and a call's
    span on the timeline never below the jobs one file submitted for it."""
    kernel = _kernel(npu)
    rng = np.random.default_rng(len(calls))
    for m, n, k in calls:
        w = npu.upload_weight(rng.standard_normal((n, k)).astype(np.float32))
        before = len(kernel.job_runs)
        npu.matmul(rng.standard_normal((m, k)).astype(np.float32), w)
        runs = kernel.job_runs[before:]
        span = max(r.end for r in runs) - min(r.start for r in runs)
        for entity in {r.entity for r in runs}:
            mine = sorted((r for r in runs if r.entity == entity), key=lambda r: r.start)
            assert len({r.core for r in mine}) == 1 and all(a.end <= b.start for a, b in zip(mine, mine[1:]))
            assert span >= sum(r.end - r.start for r in mine) - 1e-15
        assert len({r.entity for r in runs}) == len(w.slices)
        w.free()


def test_files_hold_no_more_npu_memory_than_one_file_and_an_a_per_extra_file(npu):
    """Each file's domain maps only the BOs that file created, so every file holds the whole A
    of each M bucket; its C, its weight rows and its programs are its slice's, no larger than
    the one-file engine's. Anything beyond that (scratch sized for the whole matmul in every
    file, a weight mapped twice) fails here."""
    rng = np.random.default_rng(9)
    shapes = [(1024, 2048), (2048, 512), (256, 128), (2880, 1000)]
    with open_engine("sim-rocket", cores=1, envelope="extended") as one:
        for k, n in shapes:
            b = rng.standard_normal((n, k)).astype(np.float32)
            pair = [(e, e.upload_weight(b, "fp16")) for e in (npu, one)]
            for m in (1, 5, 32, 128):
                a = rng.standard_normal((m, k)).astype(np.float32)
                for e, w in pair:
                    assert np.abs(e.matmul(a, w) - a @ b.T).max() < 0.1
        buckets = one.scratch.buckets.values()
        extra_a = (npu.cores - 1) * sum(s.a_cap for s in buckets)
        page_slack = npu.cores * len(buckets) * PAGE_BYTES        # each file rounds its buffers up
        assert npu.scratch_bytes() <= one.scratch_bytes() + extra_a + page_slack
        assert all(f.program_bytes() <= one.program_bytes() for f in npu.files)
        assert npu.memory_used() <= one.memory_used() + extra_a + page_slack + (npu.cores - 1) * one.program_bytes()


def test_cached_programs_keep_no_activation_sized_host_buffer(npu):
    """A bound program stays cached with its host ports in every file; what the engine's own
    code holds on the host after a 512-row matmul is far below one [512, K] float32, which
    a per-port conversion buffer would hold once per file."""
    m, k = 512, 4096
    rng = np.random.default_rng(3)
    w = npu.upload_weight(rng.standard_normal((96, k)).astype(np.float32), "fp16")
    a = rng.standard_normal((m, k)).astype(np.float32)
    engine_code = [tracemalloc.Filter(True, "*/ggml_rknpu/engine/*")]
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot().filter_traces(engine_code)
        assert npu.matmul(a, w).shape == (m, 96)
        held = tracemalloc.take_snapshot().filter_traces(engine_code).compare_to(before, "filename")
    finally:
        tracemalloc.stop()
    grown = sum(s.size_diff for s in held)
    assert len(w.slices) == 3 and grown < m * k * 4 // 4, f"{grown >> 10} KiB held by the engine"
