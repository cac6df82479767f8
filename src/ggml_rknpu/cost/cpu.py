"""The time a MUL_MAT or MUL_MAT_ID would take in ggml-cpu on the RK3588's Cortex-A76
cluster: a *modeled* figure, calibrated only on published board figures (docs/anchors.md
§6, the arithmetic in docs/placement.md "The CPU model").

A matmul is a roofline: the weight bytes (ggml's block sizes, ``gguf.GGML_QUANT_SIZES``)
over the cores' DRAM read rate, or the multiply-accumulates over the kernel's MAC rate,
whichever is longer. Which kernel runs is ggml-cpu's choice: the repacked ARM kernels
(``repack.cpp``) where llama.cpp repacks a type on a dotprod core, the plain ``vec_dot``
on the GGUF bytes otherwise. Host ops (norms, RoPE, attention, the GLU) cost a fixed time
per layer and forward pass (``host_ops_seconds``). Why a roofline and which figures fixed which
constant: docs/placement.md."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ggml_rknpu.cost.model import dram_bandwidth

# --- the board's CPU --------------------------------------------------------------------
BIG_CORES = 4            # 4x Cortex-A76 (+ 4x A55, not modeled) [docs/anchors.md §3.1]
A76_HZ = 2.4e9           # A76 clock, up to 2.4 GHz [docs/anchors.md §3.1]
READ_BYTES_S_ONE_CORE = 17.6e9   # measured CPU read, 1 A76 [docs/anchors.md §3.2]
READ_BYTES_S_CLUSTER = 26.7e9    # measured CPU read, 4 A76 [docs/anchors.md §3.2]
DRAM_MHZ = 2112          # the DRAM clock the NPU model prices at [cost/model.py, docs/anchors.md A3]

# --- ggml-cpu's kernels: multiply-accumulates per cycle per A76 core ------------------
# FIT (docs/placement.md "The CPU model"): each rate makes the model reproduce one
# published Gemma3-1B pp512 figure (llama-bench -t 4, docs/anchors.md §6) with
# ``HOST_OPS_S_PER_LAYER``; the tg128 figures of the same rows are then predicted.
MAC_PER_CYCLE = {
    "F16": 5.00,         # FIT: Gemma3-1B F16 pp512 68.5
    "Q8_0": 5.35,        # FIT: Gemma3-1B Q8_0 pp512 73.3
    "Q6_K": 2.41,        # FIT: Gemma3-1B Q6_K pp512 51.9 (its K = 1152 tensors are Q8_0)
    "Q4_0/repacked": 12.06,   # FIT: Gemma3-1B Q4_0 pp512 164.7 (ggml repacks Q4_0 on dotprod: q4_0_4x4)
}
HOST_OPS_S_PER_LAYER = 0.47e-3
# FIT: the rest of a published tg128 token beyond its matmuls, per layer (median of the
# four Gemma3-1B rows: 0.33, 0.44, 0.50, 0.58 ms; docs/placement.md). GUESS: independent
# of the thread count and of M.

# GUESS (no published RK3588 figure): a kernel without a calibrated rate takes the rate of
# the calibrated one of its family -- 32-blocks with Q8_0/Q8_1 activations the Q8_0 plain
# rate, k-quants (Q8_K activations) the Q6_K plain rate, float weights the F16 rate. A
# repacked kernel without a published figure is priced at its plain rate (no credit for an
# unmeasured kernel).
_FAMILY = {
    **{t: "Q8_0" for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "IQ4_NL", "MXFP4")},
    **{t: "Q6_K" for t in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")},
    **{t: "F16" for t in ("F16", "BF16", "F32")},
}
# ggml-cpu's repack choice on a NEON + dotprod core without i8mm (the A76): type -> the
# row multiple it needs (ggml_repack_get_optimal_repack_type in ggml-cpu/repack.cpp of the
# pinned llama.cpp: q4_0_4x4, q8_0_4x4, q4_K/q5_K/q6_K_8x4).
REPACKED_ROWS = {"Q4_0": 4, "Q8_0": 4, "Q4_K": 8, "Q5_K": 8, "Q6_K": 8}


@dataclass(frozen=True)
class CpuAnchor:
    """A published llama-bench figure of ggml-cpu on the board (``-t 4`` on the A76s)."""

    model: str          # a ``bench.decode`` preset
    quant: str          # the model's quantization mix (llama.cpp's quantizer, ``bench.plans``)
    test: str           # "pp512" (prompt tokens/s) or "tg128" (decode tokens/s)
    tok_s: float
    source: str


_RK_LLAMA = ("docs/anchors.md §6: the CPU rows of invisiofficial/rk-llama.cpp's ggml-rknpu2 README "
             "(taskset -c 4-7 llama-bench -t 4), also in llama.cpp PR #24972")
CPU_ANCHORS = tuple(CpuAnchor("Gemma3-1B", q, test, v, _RK_LLAMA) for q, test, v in (
    ("F16", "pp512", 68.5), ("F16", "tg128", 11.1), ("Q8_0", "pp512", 73.3), ("Q8_0", "tg128", 19.5),
    ("Q6_K", "pp512", 51.9), ("Q6_K", "tg128", 18.7), ("Q4_0", "pp512", 164.7), ("Q4_0", "tg128", 28.3)))
CPU_ANCHOR_TOLERANCE = 0.25


def type_name(weight_type: int | str) -> str:
    """ggml's name of a weight type given as its id (``GgmlType``) or name."""
    return weight_type if isinstance(weight_type, str) else GGMLQuantizationType(int(weight_type)).name


def bytes_per_weight(weight_type: int | str) -> float:
    """ggml's bytes per weight of a type: block bytes over block size (gguf's table)."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name(weight_type)]]
    return size / block


def kernel(weight_type: int | str, N: int, repacked: bool) -> str:
    """The kernel whose rate prices this weight: ``"<type>/repacked"`` when ggml-cpu
    repacks it (``repacked``: the weight sits in ggml-cpu's repack buffer, as in llama.cpp
    alone) and a rate for that kernel was calibrated, else its family's plain kernel."""
    name = type_name(weight_type)
    if name not in _FAMILY:
        raise ValueError(f"no CPU rate for weight type {name}")
    rows = REPACKED_ROWS.get(name)
    if repacked and rows is not None and N % rows == 0 and f"{name}/repacked" in MAC_PER_CYCLE:
        return f"{name}/repacked"
    return _FAMILY[name]


def read_bytes_s(threads: int) -> float:
    """DRAM read rate of ``threads`` A76 cores: one core's measured rate per thread up to
    the cluster's measured rate (GUESS: linear between the two published points), never
    above the DRAM ceiling the NPU model uses (one DRAM serves both)."""
    if not 1 <= threads <= BIG_CORES:
        raise ValueError(f"threads must be 1..{BIG_CORES} (the A76 cluster), got {threads}")
    return min(threads * READ_BYTES_S_ONE_CORE, READ_BYTES_S_CLUSTER, dram_bandwidth(DRAM_MHZ))


@dataclass(frozen=True)
class CpuTime:
    """Modeled seconds of one matmul in ggml-cpu: ``total_s`` = max(memory, compute)."""

    total_s: float
    memory_s: float
    compute_s: float
    weight_bytes: float
    kernel: str
    label: str = "modeled"


def cpu_matmul_time(weight_type: int | str, M: int, K: int, N: int, *, threads: int = BIG_CORES,
                    repacked: bool = True, experts: int = 1) -> CpuTime:
    """Modeled ggml-cpu time of ``dst[M, N] = a[M, K] @ w[N, K]^T`` on the A76 cluster.

    ``experts``: a MUL_MAT_ID reading that many distinct experts' [N, K] slices, ``M`` rows
    in all (each row multiplies one expert). ``repacked``: llama.cpp alone (weights in
    ggml-cpu's repack buffer) vs the GGUF bytes as uploaded. The public entry point for
    other models (speculative heads, placement)."""
    if min(M, K, N, experts) < 1:
        raise ValueError(f"bad matmul shape M={M} K={K} N={N} experts={experts}")
    k = kernel(weight_type, N, repacked)
    weight_bytes = K * N * experts * bytes_per_weight(weight_type)
    memory = weight_bytes / read_bytes_s(threads)
    compute = M * K * N / (MAC_PER_CYCLE[k] * threads * A76_HZ)
    return CpuTime(max(memory, compute), memory, compute, weight_bytes, k)


def cpu_matmul_seconds(weight_type: int | str, M: int, K: int, N: int, *, threads: int = BIG_CORES,
                       repacked: bool = True, experts: int = 1) -> float:
    """``cpu_matmul_time(...).total_s``."""
    return cpu_matmul_time(weight_type, M, K, N, threads=threads, repacked=repacked, experts=experts).total_s


def host_ops_seconds(layers: int) -> float:
    """Modeled host-op time of one forward pass (a decode pass or a prompt batch) of a ``layers``-deep
    model: the same in every placement, since host ops always run in ggml-cpu."""
    return layers * HOST_OPS_S_PER_LAYER
