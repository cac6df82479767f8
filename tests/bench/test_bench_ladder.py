"""The bring-up ladder on the simulator: every rung passes and is recorded; a corrupted
result or a fault the simulator injects stops it at that rung with the right symptom; the
engine widens its envelope only to what the record says."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ggml_rknpu.bench import ladder as ld
from ggml_rknpu.engine import open_engine
from ggml_rknpu.engine.envelope_record import RUNGS, envelope_for_rungs, load, record_path, save_passed
from ggml_rknpu.hw.envelope import PROVEN
from support.bench_support import SMALL_GOLDEN


@pytest.fixture
def fast_ladder(monkeypatch):
    """The ladder with the cheap golden shapes only (the full one is the slow test below)."""
    rungs = tuple(dataclasses.replace(r, cases=SMALL_GOLDEN) if r.name == "golden" else r for r in ld.LADDER)
    monkeypatch.setattr(ld, "LADDER", rungs)
    monkeypatch.delenv(ld.CORRUPT_ENV, raising=False)
    monkeypatch.delenv(ld.FAULT_ENV, raising=False)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("device", ["sim-rknpu", "sim-rocket"])
def test_every_rung_passes_on_the_simulator_and_is_recorded(fast_ladder, device):
    results = ld.run_ladder(device, rungs=RUNGS[:-1])
    assert [r.name for r in results] == list(RUNGS[:-1])
    assert all(r.status == "pass" for r in results), [(r.name, r.symptom, r.detail) for r in results]
    assert all(c["ok"] for r in results for c in r.cases)
    key, path = ld.record(device, results)
    assert load(path)["boards"][key]["passed"] == list(RUNGS[:-1])
    npu = open_engine(device)
    assert npu.cores == 3 and npu.envelope.max_feature_grains == 1023 and "three_cores" in npu.envelope.name
    npu.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("device,hook,value,stops_at,symptom", [
    ("sim-rknpu", ld.FAULT_ENV, "chain_int8:stale", "chain_int8", "stale"),
    ("sim-rocket", ld.FAULT_ENV, "long_k:stale", "long_k", "stale"),
    ("sim-rknpu", ld.FAULT_ENV, "chain_fp16:timeout", "chain_fp16", "timeout"),
    ("sim-rocket", ld.FAULT_ENV, "chain_fp16:timeout", "chain_fp16", "stale"),   # mainline: no error
    ("sim-rknpu", ld.CORRUPT_ENV, "long_k", "long_k", "wrong values"),
    ("sim-rocket", ld.CORRUPT_ENV, "golden", "golden", "wrong values"),
])
def test_a_fault_stops_the_ladder_at_that_rung_with_its_symptom(fast_ladder, monkeypatch, device, hook, value,
                                                                 stops_at, symptom):
    monkeypatch.setenv(hook, value)
    results = ld.run_ladder(device, rungs=RUNGS[:5])
    assert results[-1].name == stops_at and results[-1].status == "FAIL" and results[-1].symptom == symptom
    assert all(r.status == "pass" for r in results[:-1])
    key, path = ld.record(device, results)
    assert load(path)["boards"][key]["passed"] == list(RUNGS[:RUNGS.index(stops_at)])


def test_envelope_widens_only_by_rungs_passed_from_the_bottom():
    assert envelope_for_rungs([]) == PROVEN
    assert envelope_for_rungs(["golden", "chain_fp16"]).max_cores == 1
    below = envelope_for_rungs(list(RUNGS[:6]))
    assert below.max_feature_grains == 1023 and below.max_cores == 1
    gap = envelope_for_rungs(["golden", "chain_fp16", "two_cores", "three_cores"])   # chain_int8 missing
    assert gap.max_cores == 1 and gap.max_chain_tasks["int8"] == 1
    everything = envelope_for_rungs(list(RUNGS), "rocket")
    assert everything.max_cores == 3 and everything.max_job_ms == 450
    assert envelope_for_rungs(list(RUNGS[:-1]), "rknpu").max_cores == 3        # rocket rung n/a on rknpu


def test_the_engine_reads_the_record_of_its_own_board_only(monkeypatch):
    npu = open_engine("sim-rknpu")
    assert npu.envelope == PROVEN and npu.cores == 1                 # first run: proven, one core
    from ggml_rknpu.engine.envelope_record import board_key

    key = board_key(npu.device)
    npu.close()
    save_passed("board:other:rknpu-0.9.8", list(RUNGS))
    assert open_engine("sim-rknpu").envelope == PROVEN
    save_passed(key, list(RUNGS[:7]))
    npu = open_engine("sim-rknpu")
    assert npu.cores == 2 and npu.envelope.max_cores == 2
    npu.close()
    monkeypatch.setenv("RKNPU_ENVELOPE", "extended")
    assert open_engine("sim-rknpu").cores == 3
    assert json.loads(record_path().read_text())["boards"][key]["passed"] == list(RUNGS[:7])


@pytest.mark.slow
@pytest.mark.parametrize("device", ["sim-rknpu", "sim-rocket"])
def test_the_full_ladder_passes_on_the_simulator(device):
    results = ld.run_ladder(device)
    assert all(r.status != "FAIL" for r in results), [(r.name, r.symptom, r.detail) for r in results]
    assert [r.status for r in results][-1] == ("pass" if device == "sim-rocket" else "skipped")


@pytest.mark.timeout(300)
def test_the_long_rocket_job_rung_passes_on_the_simulated_mainline_driver():
    rung = next(r for r in ld.LADDER if r.name == "long_rocket_job")
    result = ld.run_rung(rung, "sim-rocket", list(RUNGS[:-1]))
    assert result.status == "pass", (result.symptom, result.detail)
    assert ld.run_rung(rung, "sim-rknpu", list(RUNGS[:-1])).status == "skipped"


def test_the_golden_rung_submits_the_golden_streams_word_for_word(reference_dir):
    from ggml_rknpu.compiler.matmul import compile_matmul
    from support.golden import REGCMD, A, B, C, golden_cases, register_map

    rung = next(r for r in ld.LADDER if r.name == "golden")
    cases = {(c["M"], c["K"], c["N"], c["mode"]): c for c in golden_cases(reference_dir)}
    assert len(rung.cases) == len(cases) == 15
    for M, K, N, dtype, out in rung.cases:
        p = compile_matmul(M, K, N, dtype=dtype, out=out, envelope=envelope_for_rungs(["golden"]))
        words = p.bind(a=A, b=B, c=C, regcmd=REGCMD)
        golden = cases[(M, K, N, f"{dtype}_{out}")]
        assert register_map(words) == register_map(int(w, 16) for w in golden["words"])
