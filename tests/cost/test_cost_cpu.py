"""CPU cost model: reproduces every published board figure it cites, prices bytes from
ggml's block sizes, is a roofline (bandwidth-bound at M = 1, compute-bound at prefill),
and never streams above the DRAM ceiling the NPU model uses. All figures *modeled*."""

from __future__ import annotations

import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ggml_rknpu.bench import plans
from ggml_rknpu.bench.decode import PRESETS
from ggml_rknpu.cost import cpu
from ggml_rknpu.cost.model import dram_bandwidth
from ggml_rknpu.libggml.enums import GgmlType


@pytest.mark.parametrize("anchor", cpu.CPU_ANCHORS, ids=lambda a: f"{a.model}-{a.quant}-{a.test}")
def test_reproduces_each_published_figure(anchor):
    model = PRESETS[anchor.model]
    weights = plans.preset_weights(model, anchor.quant)
    if anchor.test == "pp512":
        modeled = plans.prefill_tok_s(weights, model.layers, "cpu", 512, npu_dtype="int8", cores=3)
    else:
        modeled = plans.decode_tok_s(weights, model.layers, "cpu", 1, npu_dtype="int8", cores=3)
    assert abs(modeled / anchor.tok_s - 1) <= cpu.CPU_ANCHOR_TOLERANCE, (modeled, anchor.tok_s)


def test_decode_figures_are_predicted_not_fitted():
    """Only the prompt rates and one host-op constant are fitted; the four tg128 rows
    land within 10% (the worst, Q4_0, 9% under)."""
    model = PRESETS["Gemma3-1B"]
    for a in (a for a in cpu.CPU_ANCHORS if a.test == "tg128"):
        modeled = plans.decode_tok_s(plans.preset_weights(model, a.quant), model.layers, "cpu", 1,
                                     npu_dtype="int8", cores=3)
        assert abs(modeled / a.tok_s - 1) < 0.10, (a.quant, modeled)


@pytest.mark.parametrize("name", ["F16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K"])
def test_bytes_come_from_ggml_block_sizes(name):
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    t = cpu.cpu_matmul_time(name, 1, 4 * 256, 64)
    assert t.weight_bytes == 4 * 256 // block * size * 64
    assert cpu.bytes_per_weight(int(GgmlType[name])) == size / block    # by ggml type id too


def test_roofline_memory_bound_at_m1_compute_bound_at_prefill():
    for name in ("F16", "Q8_0", "Q4_0"):
        one = cpu.cpu_matmul_time(name, 1, 2048, 8192)
        big = cpu.cpu_matmul_time(name, 512, 2048, 8192)
        assert one.total_s == one.memory_s > one.compute_s
        assert big.total_s == big.compute_s > big.memory_s
        assert big.compute_s == pytest.approx(512 * one.compute_s)


def test_repacked_kernel_only_where_ggml_repacks():
    assert cpu.kernel("Q4_0", 4096, repacked=True) == "Q4_0/repacked"
    assert cpu.kernel("Q4_0", 4098, repacked=True) == "Q8_0"      # N not a multiple of 4: not repacked
    assert cpu.kernel("Q4_0", 4096, repacked=False) == "Q8_0"     # GGUF bytes as uploaded
    assert cpu.kernel("F16", 4096, repacked=True) == "F16"
    repacked = cpu.cpu_matmul_seconds("Q4_0", 512, 2048, 4096)
    plain = cpu.cpu_matmul_seconds("Q4_0", 512, 2048, 4096, repacked=False)
    assert plain / repacked == pytest.approx(cpu.MAC_PER_CYCLE["Q4_0/repacked"] / cpu.MAC_PER_CYCLE["Q8_0"])


def test_threads_scale_compute_and_bandwidth_stays_under_the_dram_ceiling():
    ceiling = dram_bandwidth(cpu.DRAM_MHZ)
    rates = [cpu.read_bytes_s(t) for t in range(1, cpu.BIG_CORES + 1)]
    assert rates == sorted(rates) and max(rates) <= ceiling
    assert rates[0] == cpu.READ_BYTES_S_ONE_CORE and rates[-1] == cpu.READ_BYTES_S_CLUSTER
    one, four = (cpu.cpu_matmul_time("Q8_0", 512, 2048, 2048, threads=t).compute_s for t in (1, 4))
    assert one == pytest.approx(4 * four)
    with pytest.raises(ValueError):
        cpu.read_bytes_s(5)
    with pytest.raises(ValueError):
        cpu.cpu_matmul_time("Q8_0", 0, 2048, 2048)


def test_mul_mat_id_streams_each_expert_it_reads():
    one = cpu.cpu_matmul_time("Q4_K", 8, 2048, 1024, experts=1)
    eight = cpu.cpu_matmul_time("Q4_K", 8, 2048, 1024, experts=8)
    assert eight.weight_bytes == 8 * one.weight_bytes
    assert eight.compute_s == one.compute_s       # the same rows, each times one expert
