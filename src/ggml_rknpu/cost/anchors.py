"""Measured matmul throughputs on RK3588 boards that the cost model is calibrated on.

Invariants: these are other people's *measured* figures, copied from docs/anchors.md and
the seed log (the product never reads reference files at run time); what our model says
about the same shapes is *modeled*. How the seed's rows are read (one core, N=2048,
DRAM clock): docs/decisions.md "cost/anchors.py"."""

from __future__ import annotations

from dataclasses import dataclass

from ggml_rknpu.cost.model import OWN_DRIVER, RKNN_RUNTIME, SubmitProfile


@dataclass(frozen=True)
class Anchor:
    label: str
    M: int
    K: int
    N: int
    dtype: str
    cores: int
    measured_gflops: float
    profile: SubmitProfile
    source: str

    @property
    def flops(self) -> int:
        return 2 * self.M * self.K * self.N


_M7 = "prototype board log, docs/history.md §7 (rknn_matmul_api, fp16, weight pre-loaded, K=2048)"
_M8 = "prototype board log, docs/history.md §8 (rknn_matmul_api, rknpu_bench_q.c)"

ANCHORS: tuple[Anchor, ...] = (
    Anchor("decode GEMV", 1, 2048, 2048, "fp16", 1, 8.1, RKNN_RUNTIME, _M7),
    Anchor("decode GEMV (ffn)", 1, 2048, 5504, "fp16", 1, 9.0, RKNN_RUNTIME, _M7),
    Anchor("decode GEMV (lm_head)", 1, 2048, 32000, "fp16", 1, 10.9, RKNN_RUNTIME, _M7),
    Anchor("prefill GEMM", 256, 2048, 2048, "fp16", 1, 442, RKNN_RUNTIME, _M7),
    Anchor("prefill GEMM", 512, 2048, 2048, "fp16", 1, 548, RKNN_RUNTIME, _M7),
    Anchor("fp16 GEMV", 1, 2048, 2048, "fp16", 1, 7.7, RKNN_RUNTIME, _M8),
    Anchor("fp16 GEMM", 512, 2048, 2048, "fp16", 1, 534, RKNN_RUNTIME, _M8),
    Anchor("int8 GEMV", 1, 2048, 2048, "int8", 1, 12.6, RKNN_RUNTIME, _M8),
    Anchor("int8 GEMM", 512, 2048, 2048, "int8", 1, 1391, RKNN_RUNTIME, _M8),
    Anchor("best fp16 GEMM, 3 cores", 64, 1024, 3 * 8192, "fp16", 3, 1739, OWN_DRIVER,
           "docs/anchors.md A7 (allbilly/qwen3.c own regcmd kernels, submit interval only)"),
)

ANCHOR_TOLERANCE = 0.30
# The model reproduces every anchor's GFLOP/s within +-30% (worst: the 3-core GEMM, -25%).
