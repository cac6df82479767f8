"""Mainline rocket's scheduling in the simulator: one drm_sched_entity per open file, so one
file's jobs run one after another on one core, and an idle file's next jobs go to the least
loaded core (docs/npu-programming.md "What the drivers really do"). Each task is priced at
10 ms here (``modeled_task_seconds`` replaced) so the modeled timeline is easy to read."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggml_rknpu.kernel.rocket.ioctls import RocketIoctls, RocketJobSpec
from ggml_rknpu.sim.kernel import SimKernel, SimRocketKernel
from support.kernel_fake_npu import FakeNpu, attach, regcmd_words

TASK_S = 0.010
ROCKET = "/dev/accel/accel0"


def kernel() -> tuple[SimRocketKernel, FakeNpu]:
    k = SimRocketKernel("rocket")
    npu = attach(k)
    k.modeled_task_seconds = lambda regcmd, count: TASK_S  # type: ignore[method-assign]
    return k, npu


class File:
    """One open file with a regcmd BO and an output BO: ``submit`` n one-task jobs."""

    def __init__(self, k: SimKernel) -> None:
        self.r = RocketIoctls(k, k.open(ROCKET))
        words = regcmd_words(10)
        self.rc = self.r.create_bo(words.nbytes)
        np.frombuffer(self.r.mmap(self.rc.offset, 4096), np.uint64, words.size)[:] = words
        self.r.fini_bo(self.rc.handle)
        self.out = self.r.create_bo(4096)

    def submit(self, n: int) -> None:
        job = RocketJobSpec(tasks=((self.rc.dma_address, 14),), in_handles=(self.rc.handle,),
                            out_handles=(self.out.handle,))
        self.r.submit([job] * n)

    def wait(self) -> None:
        self.r.prep_bo(self.out.handle)


def test_one_files_jobs_run_in_turn_on_one_core():
    k, npu = kernel()
    f = File(k)
    f.submit(3)
    f.wait()
    assert [npu.executed_tasks(c) for c in range(3)] == [3, 0, 0]
    assert k.modeled_now == pytest.approx(3 * TASK_S)        # the sum of the file's jobs


def test_three_files_submitting_before_waiting_use_three_cores():
    k, npu = kernel()
    files = [File(k) for _ in range(3)]
    for f in files:
        f.submit(1)
    for f in files:
        f.wait()
    assert [npu.executed_tasks(c) for c in range(3)] == [1, 1, 1]
    assert k.modeled_now == pytest.approx(TASK_S)             # side by side


def test_a_busy_file_stays_on_its_core_while_others_are_free():
    k, npu = kernel()
    a, b = File(k), File(k)
    a.submit(1)          # core 0
    b.submit(1)          # core 1 (core 0 is loaded)
    a.submit(1)          # a's entity still has an unfinished job: core 0 again, though core 2 is idle
    a.wait()
    b.wait()
    assert [npu.executed_tasks(c) for c in range(3)] == [2, 1, 0]
    assert k.modeled_now == pytest.approx(2 * TASK_S)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 3), st.booleans()), min_size=1, max_size=8))
def test_no_file_finishes_before_the_sum_of_its_jobs(steps):
    """Whatever the order of submits and waits over three files, the timeline never reaches a
    file's last output before the sum of the jobs that file submitted."""
    k, _ = kernel()
    files = [File(k) for _ in range(3)]
    submitted = [0, 0, 0]
    for which, n, wait in steps:
        files[which].submit(n)
        submitted[which] += n
        if wait:
            files[which].wait()
    for i, f in enumerate(files):
        f.wait()
        assert k.modeled_now >= submitted[i] * TASK_S - 1e-12


def test_the_record_names_each_jobs_file_and_core():
    k, _ = kernel()
    a, b = File(k), File(k)
    a.submit(2)
    b.submit(1)
    a.wait()
    b.wait()
    runs = k.job_runs
    assert [r.core for r in runs] == [0, 0, 1]
    assert runs[0].entity == runs[1].entity != runs[2].entity
    assert runs[1].start == pytest.approx(runs[0].end)                   # a's second job waits for its first
    assert runs[2].start == pytest.approx(0.0)                           # b's runs beside them
