"""Cost model: reproduces the published/measured matmul figures it is calibrated on, scales
with the clocks the way a bandwidth- or compute-bound kernel must, and prices a program
from its register words. All figures here are *modeled*."""

from __future__ import annotations

import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggml_rknpu.compiler.matmul import compile_matmul
from ggml_rknpu.cost import model
from ggml_rknpu.cost.anchors import ANCHOR_TOLERANCE, ANCHORS
from ggml_rknpu.cost.model import (
    OWN_DRIVER,
    TaskWork,
    Workload,
    modeled_time,
    vendor_style_workload,
    workload_from_program,
)


def _modeled_gflops(anchor) -> float:
    work = vendor_style_workload(anchor.M, anchor.K, anchor.N, dtype=anchor.dtype, cores=anchor.cores)
    return modeled_time(work, profile=anchor.profile).gflops(anchor.flops)


@pytest.mark.parametrize("anchor", ANCHORS, ids=lambda a: f"{a.label}-{a.M}x{a.K}x{a.N}-{a.dtype}")
def test_model_reproduces_measured_anchor(anchor):
    modeled = _modeled_gflops(anchor)
    assert abs(modeled / anchor.measured_gflops - 1) <= ANCHOR_TOLERANCE, (
        f"modeled {modeled:.1f} GFLOP/s vs measured {anchor.measured_gflops} ({anchor.source})")


def test_overlap_penalty_is_the_fit_that_minimises_worst_error(monkeypatch):
    """The FIT constant is what its comment says: the best of the scanned grid."""
    worst = {}
    for penalty in (0.3, 0.4, 0.5, 0.6, 0.7):
        monkeypatch.setattr(model, "OVERLAP_PENALTY", penalty)
        worst[penalty] = max(abs(_modeled_gflops(a) / a.measured_gflops - 1) for a in ANCHORS)
    monkeypatch.undo()
    assert min(worst, key=worst.__getitem__) == model.OVERLAP_PENALTY
    assert worst[model.OVERLAP_PENALTY] == pytest.approx(0.25, abs=0.01)


def test_gemv_streams_at_the_published_weight_bandwidth():
    """Large GEMV is bandwidth-bound: 1 core 10.9 GB/s, 3 cores 30.9 GB/s [anchors.md §3.2]."""
    for cores, published in ((1, 10.9e9), (3, 30.9e9)):
        work = vendor_style_workload(1, 4096, 151936, dtype="fp16", cores=cores)
        t = modeled_time(work)
        rate = model.total_bytes(work.tasks) / t.total_s
        assert rate == pytest.approx(published, rel=0.2)
        assert t.memory_s > 3 * t.compute_s


def test_dram_clock_slows_bandwidth_bound_not_compute_bound():
    gemv = vendor_style_workload(1, 4096, 32000, dtype="fp16", cores=3)
    full, parked = modeled_time(gemv, dram_mhz=2112), modeled_time(gemv, dram_mhz=528)
    assert parked.total_s / full.total_s == pytest.approx(4.0, rel=0.1)
    gemm = vendor_style_workload(512, 4096, 4096, dtype="int8", cores=1)  # one core: per-core cap binds
    assert modeled_time(gemm, dram_mhz=1056).total_s == pytest.approx(modeled_time(gemm).total_s, rel=0.05)


def test_npu_clock_scales_compute():
    work = vendor_style_workload(64, 1024, 1024, dtype="int8", cores=1)
    slow, fast = modeled_time(work, npu_mhz=200), modeled_time(work, npu_mhz=1000)
    assert slow.compute_s == pytest.approx(5 * fast.compute_s)
    assert slow.total_s > 3 * fast.total_s


def test_int8_gemm_is_faster_than_fp16():
    fp16 = modeled_time(vendor_style_workload(512, 2048, 2048, dtype="fp16"))
    int8 = modeled_time(vendor_style_workload(512, 2048, 2048, dtype="int8"))
    assert 1.5 < fp16.total_s / int8.total_s < 3.0  # seed M8 measured 2.6x


def test_m_is_padded_to_16_per_task():
    one = TaskWork(0, 1, 1024, 1024, "fp16", 4)
    sixteen = TaskWork(0, 16, 1024, 1024, "fp16", 4)
    assert one.macs_padded() == sixteen.macs_padded() == 16 * 1024 * 1024


def test_three_cores_beat_one_on_a_large_gemm():
    one = modeled_time(vendor_style_workload(512, 4096, 4096, dtype="fp16", cores=1))
    three = modeled_time(vendor_style_workload(512, 4096, 4096, dtype="fp16", cores=3))
    assert 2.0 < one.total_s / three.total_s <= 3.0


def test_printed_as_modeled():
    t = modeled_time(vendor_style_workload(4, 64, 32))
    assert "modeled" in str(t) and t.label == "modeled"
    assert t.total_s >= max(t.compute_s, t.memory_s) + OWN_DRIVER.per_submit_s


@pytest.mark.parametrize("kwargs", [{"npu_mhz": 0}, {"dram_mhz": -1}])
def test_bad_clock_is_an_error(kwargs):
    with pytest.raises(ValueError, match="clocks must be positive"):
        modeled_time(vendor_style_workload(4, 64, 32), **kwargs)


def test_empty_workload_is_an_error():
    with pytest.raises(ValueError, match="without tasks"):
        modeled_time(Workload(()))


def _fake_program(tasks):
    """A Program-shaped object whose words are written with ``hw`` (fields by name)."""
    from ggml_rknpu.hw.limits import CNA_PRECISION, DPU_PRECISION
    from ggml_rknpu.hw.regcmd import write_word
    from ggml_rknpu.hw.registers import REGISTERS as R

    words: list[int] = []
    table: list = []
    for core, m, kp, n, in_dtype, out_dtype in tasks:
        body = [
            write_word("CNA_CONV_CON1", R["CNA_CONV_CON1"].encode(
                IN_PRECISION=CNA_PRECISION[in_dtype], PROC_PRECISION=CNA_PRECISION[in_dtype])),
            write_word("CNA_DATA_SIZE0", R["CNA_DATA_SIZE0"].encode(DATAIN_WIDTH=1, DATAIN_HEIGHT=m)),
            write_word("CNA_DATA_SIZE1", R["CNA_DATA_SIZE1"].encode(DATAIN_CHANNEL=kp, DATAIN_CHANNEL_REAL=kp - 1)),
            write_word("CNA_WEIGHT_SIZE2", R["CNA_WEIGHT_SIZE2"].encode(WEIGHT_WIDTH=1, WEIGHT_HEIGHT=1, WEIGHT_KERNELS=n)),
            write_word("DPU_DATA_FORMAT", R["DPU_DATA_FORMAT"].encode(
                OUT_PRECISION=DPU_PRECISION[out_dtype], IN_PRECISION=DPU_PRECISION[in_dtype])),
        ]
        table.append(types.SimpleNamespace(core=core, word_offset=len(words), body_words=len(body)))
        words += body + [0, 0, 0, 0]
    return types.SimpleNamespace(words=np.array(words, dtype=np.uint64), tasks=tuple(table))


def test_program_words_are_decoded_into_task_shapes():
    prog = _fake_program([(0, 44, 4096, 512, "fp16", "fp32"), (2, 100, 128, 1000, "int8", "int32")])
    work = workload_from_program(prog)
    assert work.tasks == (TaskWork(0, 44, 4096, 512, "fp16", 4), TaskWork(2, 100, 128, 1000, "int8", 4))
    assert modeled_time(prog).total_s == modeled_time(work).total_s


def test_program_missing_a_shape_register_is_an_error():
    prog = _fake_program([(0, 4, 64, 32, "fp16", "fp16")])
    prog.tasks[0].body_words = 2
    with pytest.raises(ValueError, match="CNA_DATA_SIZE1"):
        workload_from_program(prog)


@pytest.mark.parametrize("anchor", ANCHORS, ids=lambda a: f"{a.label}-{a.M}x{a.K}x{a.N}-{a.dtype}")
def test_real_compiled_program_is_priced_within_the_anchor_tolerance(anchor):
    """The same anchors, priced from our own compiler's register words (decoded with hw)."""
    out = "fp32" if anchor.dtype == "fp16" else "int32"
    program = compile_matmul(anchor.M, anchor.K, anchor.N, dtype=anchor.dtype, out=out,
                                      cores=anchor.cores, envelope="extended")
    work = workload_from_program(program)
    assert {t.core for t in work.tasks} == set(range(anchor.cores))
    assert sum(t.m * t.n for t in work.tasks if t.core == 0) >= anchor.M * anchor.N // anchor.cores
    modeled = modeled_time(program, profile=anchor.profile).gflops(anchor.flops)
    assert abs(modeled / anchor.measured_gflops - 1) <= ANCHOR_TOLERANCE


@settings(max_examples=40, deadline=None)
@given(M=st.integers(1, 3000), K=st.integers(1, 12000), N=st.integers(1, 40000),
       dtype=st.sampled_from(("fp16", "int8")), cores=st.integers(1, 3))
def test_never_faster_than_the_mac_peak_or_the_dram_stream(M, K, N, dtype, cores):
    """Any compiled program: modeled time >= MACs / (cores x peak) and >= weight bytes / DRAM."""
    out = "fp32" if dtype == "fp16" else "int32"
    try:
        program = compile_matmul(M, K, N, dtype=dtype, out=out, cores=cores)
    except ValueError:
        return  # beyond one hardware run (the engine splits such calls along M)
    t = modeled_time(program)
    peak = cores * model.MACS_PER_CYCLE_PER_CORE[dtype] * 1e9
    assert t.total_s >= M * K * N / peak
    assert t.total_s >= K * N * model.IN_BYTES[dtype] / model.dram_bandwidth(2112)
    assert t.total_s >= max(t.compute_s, t.memory_s)


def test_guessed_task_overhead_barely_moves_the_anchors(monkeypatch):
    """The GUESS constant's comment: setting it to 0 moves no anchor by 1% or more."""
    base = [_modeled_gflops(a) for a in ANCHORS]
    monkeypatch.setattr(model, "TASK_OVERHEAD_CYCLES", 0)
    assert max(abs(_modeled_gflops(a) / b - 1) for a, b in zip(ANCHORS, base)) < 0.01
