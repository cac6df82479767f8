"""--sim-faults: the SPEC grammar, each fault kind as the engine sees it through the real
submit path on both simulated drivers (rocket as mainline ends a failed job: silently, the
canaries catch it; and "loud"), determinism, and stale output caught by the canary."""

from __future__ import annotations

import errno

import numpy as np
import pytest

from ggml_rknpu.devices import open_device
from ggml_rknpu.engine import open_engine
from ggml_rknpu.engine.canary import StaleOutput
from ggml_rknpu.kernel.errors import NpuError, NpuFault, NpuTimeout
from ggml_rknpu.sim.faults import FaultSpec, FaultSpecError, inject_faults

pytestmark = pytest.mark.timeout(120)
N, K = 48, 96


def test_spec_parses_rates_schedule_and_seed():
    spec = FaultSpec.parse("timeout:0.02, stale@5,core@9 ,dma:0.5,seed=7")
    assert spec.rates == (("timeout", 0.02), ("dma", 0.5))
    assert spec.schedule == ((5, "stale"), (9, "core"))
    assert spec.seed == 7
    assert "stale at submit 5" in spec.describe()


@pytest.mark.parametrize("text, words", [
    ("hang:0.1", "unknown fault kind"), ("timeout:2", "0..1"), ("timeout@0", "numbered from 1"),
    ("stale@3,dma@3", "scheduled twice"), ("timeout:0.6,dma:0.6", "add up"), ("timeout", "KIND:RATE"),
])
def test_bad_specs_are_refused_with_the_grammar(text, words):
    with pytest.raises(FaultSpecError, match=words):
        FaultSpec.parse(text)


def _engine(kind: str, spec: str, **kernel_options):
    injector = inject_faults(kind, spec, **kernel_options)
    npu = open_engine(open_device(f"sim-{kind}", syscalls=injector))
    b = np.random.default_rng(0).standard_normal((N, K)).astype(np.float32)
    return npu, injector, npu.upload_weight(b), b


def _calls(npu, w, b, n: int, seed: int = 1) -> list[str]:
    """n matmuls with fresh activations: 'ok', or the exception's class name (a wrong result fails)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a = rng.standard_normal((2, K)).astype(np.float32)
        try:
            c = npu.matmul(a, w)
        except (NpuTimeout, NpuFault, StaleOutput) as exc:
            out.append(type(exc).__name__)
            continue
        np.testing.assert_allclose(c, a @ b.astype(np.float16).astype(np.float32).T, rtol=2e-2, atol=2e-2)
        out.append("ok")
    return out


@pytest.mark.parametrize("abi, rocket_errors, dma_error", [
    ("rknpu", None, "NpuTimeout"), ("rocket", "mainline", "StaleOutput"), ("rocket", "loud", "NpuTimeout")])
def test_one_shot_faults_fail_one_submit(abi, rocket_errors, dma_error):
    for spec, error in (("dma@2", dma_error), ("stale@2", "StaleOutput")):
        options = {"rocket_errors": rocket_errors} if rocket_errors else {}   # a rocket-only option
        npu, injector, w, b = _engine(abi, spec, **options)
        with npu:
            assert _calls(npu, w, b, 3) == ["ok", error, "ok"], spec
            assert injector.counts[spec[:-2]] == 1 and injector.submits == 3


def test_a_vendor_dma_fault_is_a_job_timeout_and_the_driver_resets_itself():
    """The vendor driver knows only timeouts: an injected DMA fault is ETIMEDOUT from SUBMIT
    (never EFAULT), the page fault shows only in dmesg, and the next job runs without a reset."""
    npu, injector, w, b = _engine("rknpu", "dma@1")
    with npu:
        with pytest.raises(NpuTimeout, match="timed out|timeout") as e:
            npu.matmul(np.ones((2, K), np.float32), w)
        assert isinstance(e.value, NpuError) and e.value.errno == errno.ETIMEDOUT
        assert any("Page fault at" in line for line in injector.dmesg)
        assert _calls(npu, w, b, 2) == ["ok", "ok"] and injector.resets == 0


def test_vendor_hang_and_dead_core_last_until_reset():
    for spec in ("timeout@2", "core@2"):
        npu, injector, w, b = _engine("rknpu", spec)
        with npu:
            assert _calls(npu, w, b, 3) == ["ok", "NpuTimeout", "NpuTimeout"], spec
            assert npu.reset() == [] and injector.resets == 1
            assert _calls(npu, w, b, 2) == ["ok", "ok"], spec


@pytest.mark.parametrize("rocket_errors, error", [("mainline", "StaleOutput"), ("loud", "NpuTimeout")])
def test_rocket_resets_a_hung_core_itself(rocket_errors, error):
    npu, injector, w, b = _engine("rocket", "core@1", rocket_errors=rocket_errors)
    with npu:
        assert _calls(npu, w, b, 2) == [error, "ok"]
        assert npu.reset() == []          # no reset ioctl on rocket: nothing to do, no error


def test_a_stale_job_leaves_the_armed_canaries_in_c():
    """The stale kind writes nothing: every canary armed before the submit is still there."""
    npu, injector, w, b = _engine("rknpu", "stale@1")
    with npu:
        with pytest.raises(StaleOutput, match="canar"):
            npu.matmul(np.ones((2, K), np.float32), w)
        assert injector.counts["stale"] == 1 and npu.counters["npu_faults"] == 1
        bound = next(iter(w.programs.values()))
        assert bound.canaries.unwritten(bound.c_buf.array(np.uint8)) == bound.canaries.elements.size


def test_rates_are_deterministic_for_a_seed():
    runs = []
    for seed in (3, 3, 4):
        npu, injector, w, b = _engine("rknpu", f"dma:0.3,stale:0.3,seed={seed}")
        with npu:
            runs.append((_calls(npu, w, b, 12), dict(injector.counts)))
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert runs[0][1]["dma"] and runs[0][1]["stale"]


def test_no_spec_injects_nothing():
    npu, injector, w, b = _engine("rknpu", "")
    with npu:
        assert _calls(npu, w, b, 3) == ["ok"] * 3
        assert sum(injector.counts.values()) == 0


@pytest.mark.parametrize("argv, code, words", [
    (["--device", "rknpu", "--sim-faults", "stale:0.1"], 1, "refused on a real device"),
    (["--device", "sim-rknpu", "--sim-faults", "hang:0.1"], 1, "unknown fault kind"),
    (["--device", "host", "--sim-faults", "stale:0.1"], 2, "needs our engine on the NPU simulator"),
])
def test_serve_refuses_sim_faults_off_the_simulator(argv, code, words, caplog):
    import argparse

    from ggml_rknpu.cli import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    assert serve.run(parser.parse_args(["--port", "0", *argv])) == code
    assert words in caplog.text


def test_a_stale_chained_fusion_is_a_fault_not_a_result():
    """A chained fusion (Q/K/V as one submit, engine.fusion) checks every member's
    canaries too: a job that wrote nothing raises StaleOutput, and the next run is exact."""
    npu, injector, w, b = _engine("rknpu", "stale@1")
    with npu:
        b2 = np.random.default_rng(5).standard_normal((N, K)).astype(np.float32)
        fusion = npu.fuse([w, npu.upload_weight(b2)], 1)
        a = np.ones((1, K), np.float32)
        with pytest.raises(StaleOutput, match="chained"):
            fusion.run(a)
        assert injector.counts["stale"] == 1 and npu.counters["npu_faults"] == 1
        for got, ref in zip(fusion.run(a), (b, b2)):
            np.testing.assert_allclose(got, a @ ref.astype(np.float16).astype(np.float32).T, rtol=2e-2, atol=2e-2)
