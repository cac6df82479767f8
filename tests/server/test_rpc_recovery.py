"""Recovery with nothing lost (server/recovery.py): a faulted NPU matmul step resets, retries
once, else runs on the host for this run; repeated faults demote the weight for good;
weights a reset destroyed are re-staged; the counters say what happened. Against a fake
engine (exact fault sequences) and the simulated NPU behind --sim-faults."""

from __future__ import annotations

import numpy as np
import pytest

from ggml_rknpu.devices import open_device
from ggml_rknpu.engine import open_engine, open_npu
from ggml_rknpu.engine.canary import StaleOutput
from ggml_rknpu.engine.core_files import CoreFilesEngine
from ggml_rknpu.kernel.errors import NpuFault, NpuTimeout
from ggml_rknpu.server.placement import HOST, NPU
from ggml_rknpu.server.recovery import DEMOTE_AFTER
from ggml_rknpu.sim.faults import inject_faults
from support.matmul_graph import K, M, MatmulGraph, fp16_ref, rng_w
from support.rpc_testkit import FaultyNpu, serve

pytestmark = pytest.mark.timeout(120)


def _ops(state, engine: str) -> int:
    """MUL_MAT nodes run on ``engine`` (NPU or HOST, i.e. ggml-cpu)."""
    counter = state.stats.per_op.get(("MUL_MAT", engine))
    return 0 if counter is None else counter.ops


def _run(npu, passes=1):
    """Compute the graph ``passes`` times with fresh activations; every result checked."""
    with serve(npu=npu) as st:
        with st.client() as c:
            g = MatmulGraph(c)
            w = rng_w()
            c.set_array(g.w, w)
            for i in range(passes):
                x = np.random.default_rng(i).standard_normal((M, K)).astype(np.float32)
                c.set_array(g.x, x)
                if i == 0:
                    out = g.compute()
                else:
                    c.graph_recompute()
                    out = c.get_array(g.out)
                np.testing.assert_allclose(out, x @ w.T, rtol=2e-2, atol=2e-2)   # NPU: fp16 W; host: exact
            assert c.device_count() == 1
        return st.state


@pytest.mark.parametrize("fault", [NpuTimeout("hang", 110), NpuFault("bad address", 14), StaleOutput("stale")])
def test_one_fault_costs_a_reset_and_a_retry_on_the_npu(fault):
    npu = FaultyNpu([fault])
    state = _run(npu)
    r = state.recovery
    kind = {NpuTimeout: "timeout", NpuFault: "fault", StaleOutput: "stale"}[type(fault)]
    assert r.faults[kind] == 1 and sum(r.faults.values()) == 1
    assert (r.resets, r.retries, r.retried_ok, r.host_fallbacks, r.demoted) == (1, 1, 1, 0, 0)
    assert npu.resets == 1 and npu.matmuls == 1 and _ops(state, HOST) == 0
    assert state.stats.per_op[("MUL_MAT", NPU)].ops == 1


def test_two_faults_run_the_pass_on_the_host_and_the_next_pass_on_the_npu_again():
    npu = FaultyNpu([NpuTimeout("hang", 110), NpuTimeout("hang", 110)])
    state = _run(npu, passes=2)
    r = state.recovery
    assert (r.faults["timeout"], r.resets, r.retries, r.retried_ok, r.host_fallbacks) == (2, 2, 1, 0, 1)
    assert npu.matmuls == 1                               # pass 2 back on the NPU
    # pass 1 on the host (ggml-cpu), pass 2 on the NPU
    assert state.stats.per_op[("MUL_MAT", HOST)].ops == 1 and state.stats.per_op[("MUL_MAT", NPU)].ops == 1
    assert state.weight_stats.failures == 0


def test_repeated_faults_demote_the_weight_for_good(caplog):
    npu = FaultyNpu([NpuFault("bad address", 14)] * DEMOTE_AFTER)
    passes = DEMOTE_AFTER // 2 + 1                      # two faulted attempts a pass, then one on the host
    state = _run(npu, passes=passes)
    r = state.recovery
    assert r.demoted == 1 and r.faults["fault"] == DEMOTE_AFTER and r.host_fallbacks == DEMOTE_AFTER // 2 - 1
    assert state.weight_stats.failures == 1 and npu.matmuls == 0 and npu.frees == 1
    assert state.stats.per_op[("MUL_MAT", HOST)].ops == passes
    assert any(f"{DEMOTE_AFTER} NPU faults in a row" in rec.getMessage() for rec in caplog.records)


def test_a_success_between_faults_resets_the_streak():
    npu = FaultyNpu()
    with serve(npu=npu) as st:
        with st.client() as c:
            g = MatmulGraph(c)
            w = rng_w()
            c.set_array(g.w, w)
            c.set_array(g.x, np.ones((M, K), np.float32))
            g.compute()
            ones = np.ones((M, K), np.float32)
            for _ in range(DEMOTE_AFTER):            # a pass faulting twice (host), then a good one
                npu.faults = [StaleOutput("stale")] * 2
                c.graph_recompute()
                np.testing.assert_allclose(c.get_array(g.out), ones @ w.T, rtol=1e-5, atol=1e-5)
                c.graph_recompute()
                np.testing.assert_allclose(c.get_array(g.out), fp16_ref(ones, w), rtol=1e-5, atol=1e-5)
            assert c.device_count() == 1
        r = st.state.recovery
        assert r.faults["stale"] == 2 * DEMOTE_AFTER and r.host_fallbacks == DEMOTE_AFTER
        assert r.demoted == 0 and st.state.weight_stats.failures == 0


def test_weights_a_reset_destroyed_are_restaged():
    npu = FaultyNpu([NpuTimeout("hang", 110)], reset_loses_weights=True)
    state = _run(npu, passes=2)
    assert state.recovery.restaged == 1 and npu.uploads == 2 and state.recovery.retried_ok == 1
    assert state.weight_stats.staged == 0          # the client left: nothing staged any more


def test_other_engine_errors_keep_the_old_policy():
    npu = FaultyNpu([RuntimeError("engine refused the shape")])
    state = _run(npu, passes=2)
    assert state.recovery.resets == 0 and state.weight_stats.failures == 1
    assert _ops(state, HOST) == 2 and _ops(state, NPU) == 0


@pytest.mark.parametrize("spec", ["timeout@2,dma@5", "stale@2,stale@3", "core@3"])
def test_simulated_faults_through_the_server_lose_nothing(spec):
    injector = inject_faults("rknpu", spec)
    npu = open_engine(open_device("sim-rknpu", syscalls=injector))
    try:
        state = _run(npu, passes=4)
        engine_resets = npu.counters["resets"]
    finally:
        npu.close()
    r = state.recovery
    assert sum(injector.counts.values()) == len(spec.split(","))
    assert sum(r.faults.values()) >= 1 and r.resets == sum(r.faults.values())
    # one NPU reset per fault, at the ioctl and in both counters: for stale output the engine's
    # own reset (before it raises StaleOutput) is the one, recovery does not reset again
    assert injector.resets == engine_resets == r.resets
    assert r.demoted == 0


def test_a_vendor_dma_fault_is_recovered_as_the_job_timeout_a_board_reports():
    """rknpu reports a DMA fault as ETIMEDOUT (the page fault only in dmesg): recovery counts a
    timeout, resets once and the retry succeeds on the NPU."""
    injector = inject_faults("rknpu", "dma@2")
    npu = open_engine(open_device("sim-rknpu", syscalls=injector))
    try:
        state = _run(npu, passes=3)
    finally:
        npu.close()
    r = state.recovery
    assert injector.counts["dma"] == 1
    assert r.faults == {"stale": 0, "timeout": 1, "fault": 0}
    assert (r.resets, r.retries, r.retried_ok, r.host_fallbacks) == (1, 1, 1, 0) and injector.resets == 1


def test_simulated_rocket_faults_end_stale_and_lose_nothing():
    """Mainline rocket ends every faulted job silently (PREP_BO returns 0): the canaries see
    each one as stale output, and the step is retried like any fault."""
    injector = inject_faults("rocket", "timeout@2,dma@4,core@6")
    npu = open_engine(open_device("sim-rocket", syscalls=injector))
    try:
        state = _run(npu, passes=4)
    finally:
        npu.close()
    r = state.recovery
    assert sum(injector.counts.values()) == 3
    assert r.faults == {"stale": 3, "timeout": 0, "fault": 0} and r.resets == 3
    assert r.retried_ok + r.host_fallbacks == r.retries and r.demoted == 0


def test_rocket_faults_with_a_file_per_core_end_stale_and_lose_nothing():
    """The same faults under a file per core (three cores, extended envelope; the graph's
    weight has two kernel groups, so two files): whichever file's job faults, the run is stale
    output, one reset, and the step is retried like any fault."""
    injector = inject_faults("rocket", "timeout@2,dma@5,core@9")
    npu = open_npu(open_device("sim-rocket", syscalls=injector), envelope="extended")
    assert isinstance(npu, CoreFilesEngine)
    try:
        state = _run(npu, passes=6)
    finally:
        npu.close()
    r = state.recovery
    assert sum(injector.counts.values()) == 3
    assert r.faults == {"stale": 3, "timeout": 0, "fault": 0} and r.resets == 3
    assert r.retried_ok + r.host_fallbacks == r.retries and r.demoted == 0
