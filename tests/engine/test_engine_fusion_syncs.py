"""The ioctls one replayed fusion costs, counted at the kernel boundary.

WHY: every MEM_SYNC and SUBMIT is a syscall plus the Python around it, per NPU submit, a few
hundred times per token. A replayed fusion must clean what the CPU wrote (A, and C holding the
canaries) and invalidate what the NPU wrote (C), and nothing else: the regcmd and the vendor
task array were cleaned once, when the fusion was planned."""

import numpy as np
import pytest

from ggml_rknpu.devices import open_simulated
from ggml_rknpu.engine.api import NpuEngine
from ggml_rknpu.kernel.rknpu.driver import RknpuDriver
from ggml_rknpu.kernel.trace import TimingSyscalls
from ggml_rknpu.sim.kernel import SimKernel


def _engine(kind: str) -> tuple[NpuEngine, TimingSyscalls]:
    kernel = TimingSyscalls(SimKernel(kind))
    return NpuEngine(open_simulated(kind, kernel=kernel)), kernel


@pytest.mark.parametrize("kind, chained_calls, single_calls", [
    ("rknpu", {"RKNPU_MEM_SYNC": 2, "RKNPU_SUBMIT": 1}, {"RKNPU_MEM_SYNC": 2, "RKNPU_SUBMIT": 1}),
    # rocket syncs whole BOs: FINI_BO before the device reads, PREP_BO (waits, syncs) before the CPU does
    ("rocket", {"ROCKET_FINI_BO": 1, "ROCKET_SUBMIT": 1, "ROCKET_PREP_BO": 1},
     {"ROCKET_FINI_BO": 1, "ROCKET_SUBMIT": 1, "ROCKET_PREP_BO": 1}),
])
def test_a_replayed_fusion_syncs_exactly_its_ranges(kind, chained_calls, single_calls):
    npu, kernel = _engine(kind)
    rng = np.random.default_rng(0)
    with npu:
        siblings = [npu.upload_weight(rng.standard_normal((n, 64)).astype(np.float32)) for n in (32, 16, 16)]
        alone = npu.upload_weight(rng.standard_normal((48, 32)).astype(np.float32))
        chained, single = npu.fuse(siblings), npu.fuse([alone])
        a, b = rng.standard_normal((1, 64)).astype(np.float32), rng.standard_normal((1, 32)).astype(np.float32)
        chained.run(a), single.run(b)   # planned: tables, task BOs, regcmd cleaned
        for _ in range(3):              # alternating, as a decode token's submits do
            kernel.clear()
            got = chained.run(a)
            # one clean of A and C (one buffer), one invalidate of C, the submit
            assert kernel.calls == chained_calls
            kernel.clear()
            one = single.run(b)[0]
            # the bucket's shared scratch buffer, A then C: one clean, one invalidate of C, the submit
            assert kernel.calls == single_calls
        for w, y in zip(siblings, got):
            np.testing.assert_array_equal(y, npu.matmul(a, w))
        np.testing.assert_array_equal(one, npu.matmul(b, alone))


def test_a_regcmd_rewritten_after_planning_is_cleaned_by_its_writer():
    """A program re-bound to a grown scratch buffer rewrites its regcmd words; the device
    cleans regcmd only when it builds a table, so the writer must (``write_words`` does):
    the simulator keeps CPU and NPU copies apart, so a missing clean gives stale results."""
    npu, _kernel = _engine("rknpu")
    rng = np.random.default_rng(1)
    with npu:
        small = npu.upload_weight(rng.standard_normal((16, 32)).astype(np.float32))
        a = rng.standard_normal((1, 32)).astype(np.float32)
        first = npu.matmul(a, small)
        big = npu.upload_weight(rng.standard_normal((512, 256)).astype(np.float32))
        npu.matmul(rng.standard_normal((1, 256)).astype(np.float32), big)   # grows the M=1 scratch
        assert npu.counters["scratch_grown"] >= 1
        np.testing.assert_array_equal(npu.matmul(a, small), first)


REBUILDS = 50   # fusions built, run and closed, as a fault recovery drops and rebuilds one per fault


def test_a_closed_fusion_leaves_no_packed_syncs_behind():
    """The vendor driver packs each MEM_SYNC once per object; object addresses are never
    reused, so the packed calls of a closed fusion's buffers must go with them, or a server
    rebuilding a fusion after every NPU fault keeps a few more per fault."""
    npu, _kernel = _engine("rknpu")
    rng = np.random.default_rng(2)
    with npu:
        siblings = [npu.upload_weight(rng.standard_normal((n, 64)).astype(np.float32)) for n in (32, 16)]
        a = rng.standard_normal((1, 64)).astype(np.float32)
        driver = npu.device.driver
        assert isinstance(driver, RknpuDriver)
        kept = []
        for _ in range(REBUILDS):
            fusion = npu.fuse(siblings)
            fusion.run(a)
            assert driver.packed_syncs() > 0
            fusion.close()
            kept.append(driver.packed_syncs())
        assert kept == [kept[0]] * REBUILDS, kept
