"""Placement by cost: every decision equals the argmin of the two board models over NPU,
host and every aligned split (brute force), on a grid of shapes, types, M and cores; a
split never beats the shared DRAM's ceiling. All figures *modeled*."""

from __future__ import annotations

import itertools

import pytest

from ggml_rknpu.cost import cpu
from ggml_rknpu.cost import placement as pl
from ggml_rknpu.cost.model import IN_BYTES, dram_bandwidth

TYPES = ("F16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")
SHAPES = ((1152, 6912), (2048, 512), (896, 4864), (4096, 1024), (1536, 256))
MS = (1, 3, 16, 512)


def _brute(t: str, M: int, K: int, N: int, dtype: str, cores: int) -> dict[str, float]:
    bpw = cpu.bytes_per_weight(t)

    def split(nh: int) -> float:
        return max(pl.host_matmul_seconds(t, M, K, nh, 4), pl.npu_matmul_seconds(M, K, N - nh, dtype, cores),
                   K * (nh * bpw + (N - nh) * IN_BYTES[dtype]) / dram_bandwidth(cpu.DRAM_MHZ))

    return {pl.NPU: pl.npu_matmul_seconds(M, K, N, dtype, cores), pl.HOST: pl.host_matmul_seconds(t, M, K, N, 4),
            pl.SPLIT: min(split(nh) for nh in range(pl.SPLIT_ALIGN, N, pl.SPLIT_ALIGN))}


@pytest.mark.parametrize("t", TYPES)
def test_each_decision_is_the_argmin_of_the_models(t):
    seen = set()
    for M, (K, N), cores, dtype in itertools.product(MS, SHAPES, (1, 3), ("int8", "fp16")):
        c = pl.place_matmul(t, M, K, N, npu_dtype=dtype, cores=cores, threads=4)
        times = _brute(t, M, K, N, dtype, cores)
        assert c.where == min(times, key=lambda k: times[k]), (M, K, N, cores, dtype, c, times)
        assert c.npu_s == times[pl.NPU] and c.host_s == times[pl.HOST]
        if c.where == pl.SPLIT:
            assert c.split_s == pytest.approx(times[pl.SPLIT], rel=1e-12)
            assert 0 < c.host_rows < N and c.host_rows % pl.SPLIT_ALIGN == 0
        seen.add(c.where)
    assert pl.NPU in seen and pl.SPLIT in seen


def test_without_split_the_choice_is_the_faster_side():
    for t, M, (K, N) in itertools.product(TYPES, MS, SHAPES):
        c = pl.place_matmul(t, M, K, N, npu_dtype="int8", cores=3, threads=4, allow_split=False)
        assert c.split_s is None and c.where in (pl.NPU, pl.HOST)
        assert c.seconds == min(c.npu_s, c.host_s)
        assert c.host_rows == (N if c.where == pl.HOST else 0)


def test_split_is_floored_by_the_shared_dram():
    fast = lambda n: 0.0          # noqa: E731 -- two infinitely fast devices
    c = pl.choose(1024, lambda n: 1.0, lambda n: 1.0, lambda nh, nn: 1e9, dram_bytes_s=1e9)
    assert c.where == pl.NPU      # a split floored at 1 s ties: the NPU keeps it
    c = pl.choose(1024, fast, fast, lambda nh, nn: 2e9, dram_bytes_s=1e9)
    assert c.where == pl.NPU and c.split_s == 2.0


def test_ties_go_to_the_npu_and_buckets():
    c = pl.choose(128, lambda n: 1.0, lambda n: 1.0, allow_split=False)
    assert c.where == pl.NPU
    assert [pl.bucket(m) for m in (1, 2, 4, 5, 16, 17, 512)] == ["1", "2-4", "2-4", "5-16", "5-16",
                                                                   "prefill", "prefill"]
    assert all(pl.bucket(pl.BUCKET_M[b]) == b for b in pl.BUCKETS)
    with pytest.raises(ValueError):
        pl.bucket(0)


def test_experts_are_priced_per_expert_on_the_npu():
    one = pl.place_matmul("Q8_0", 8, 2048, 1024, npu_dtype="int8", cores=3, threads=4, experts=1)
    eight = pl.place_matmul("Q8_0", 8, 2048, 1024, npu_dtype="int8", cores=3, threads=4, experts=8)
    assert eight.npu_s == pytest.approx(8 * pl.npu_matmul_seconds(1, 2048, 1024, "int8", 3))
    assert eight.host_s > one.host_s
