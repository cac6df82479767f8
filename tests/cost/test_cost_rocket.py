"""Rocket jobs priced as mainline's scheduler runs them: one open file's jobs in turn on one
core, so a program from one file costs the sum of its cores' shares and one from a file per
core the slowest share; every job pays the domain switch, a labelled guess. Modeled figures."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggml_rknpu.compiler.matmul import compile_matmul
from ggml_rknpu.cost.model import (
    OWN_DRIVER,
    ROCKET_DOMAIN_SWITCH_S,
    TaskWork,
    Workload,
    rocket_files_time,
    rocket_time,
    task_seconds,
    vendor_style_workload,
)

MHZ = 200


def _share_s(work: Workload, core: int, streaming: int) -> float:
    """One core's tasks and its jobs' domain switches, as one file submits them."""
    tasks = [t for t in work.tasks if t.core == core]
    return (sum(task_seconds(t, npu_mhz=MHZ, cores_in_job=streaming) for t in tasks)
            + work.submits * ROCKET_DOMAIN_SWITCH_S)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 64), st.integers(1, 4096), st.integers(16, 20000), st.sampled_from(["fp16", "int8"]),
       st.integers(1, 3), st.integers(1, 3))
def test_a_job_is_never_below_the_sum_of_one_files_jobs(m, k, n, dtype, cores, submits):
    tasks = vendor_style_workload(m, k, n, dtype=dtype, cores=cores).tasks
    work = Workload(tasks, submits=submits)
    used = sorted({t.core for t in tasks})
    spread = rocket_time(work, files=len(used), npu_mhz=MHZ).total_s
    one = rocket_time(work, files=1, npu_mhz=MHZ).total_s
    for core in used:       # what the file submitting this core's share runs, one job after another
        assert spread >= _share_s(work, core, len(used)) - 1e-12
    assert one == pytest.approx(sum(_share_s(work, c, 1) for c in used) + submits * OWN_DRIVER.per_submit_s)
    assert spread == pytest.approx(max(_share_s(work, c, len(used)) for c in used)
                                   + submits * len(used) * OWN_DRIVER.per_submit_s)


def test_a_file_per_core_beats_one_file_on_a_weight_stream():
    program = compile_matmul(1, 2048, 6144, dtype="int8", out="int32", cores=3, abi="rocket", envelope="extended")
    one = rocket_time(program, files=1, npu_mhz=MHZ).total_s
    spread = rocket_time(program, files=3, npu_mhz=MHZ).total_s
    assert spread < one / 2


def test_every_job_pays_the_domain_switch():
    task = TaskWork(0, 1, 32, 16, "fp16", 4)
    one = rocket_time(Workload((task,), submits=1), files=1, npu_mhz=MHZ).total_s
    five = rocket_time(Workload((task,) * 5, submits=5), files=1, npu_mhz=MHZ).total_s
    assert five - 5 * one == pytest.approx(0, abs=1e-12)
    assert one == pytest.approx(task_seconds(task, npu_mhz=MHZ) + ROCKET_DOMAIN_SWITCH_S + OWN_DRIVER.per_submit_s)


def test_files_are_one_or_one_per_core_used():
    work = vendor_style_workload(16, 256, 96, cores=3)
    with pytest.raises(ValueError, match="one file per core"):
        rocket_time(work, files=2, npu_mhz=MHZ)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 64), st.integers(1, 4096), st.integers(16, 8192),
                          st.sampled_from(["fp16", "int8"]), st.integers(1, 3)), min_size=1, max_size=3))
def test_files_side_by_side_are_never_below_any_one_files_jobs(files):
    """Each file's work is its own one-core program (the engine's file per core): the files
    run side by side, never faster than any one file's jobs in turn, alone or sharing DRAM."""
    works = [Workload(vendor_style_workload(m, k, n, dtype=dtype, cores=1).tasks, submits=submits)
             for m, k, n, dtype, submits in files]
    together = rocket_files_time(works, npu_mhz=MHZ).total_s
    for work in works:
        in_turn = (sum(task_seconds(t, npu_mhz=MHZ, cores_in_job=len(works)) for t in work.tasks)
                   + work.submits * ROCKET_DOMAIN_SWITCH_S)
        assert together >= in_turn
        assert together >= rocket_files_time([work], npu_mhz=MHZ).total_s - 1e-15
        assert rocket_files_time([work], npu_mhz=MHZ).total_s == pytest.approx(
            rocket_time(work, files=1, npu_mhz=MHZ).total_s)
