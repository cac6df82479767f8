"""The time a MUL_MAT or MUL_MAT_ID would take in ggml-cpu on a cluster of Cortex-A76 cores
(the RK3588's, by default): a *modeled* figure, calibrated only on the published A76 rows of
docs/anchors.md §6 (the arithmetic in docs/placement.md "The CPU model").

A matmul is a roofline with partial overlap: the longer of the weight bytes (ggml's block
sizes, ``gguf.GGML_QUANT_SIZES``) over the cores' DRAM read rate and the multiply-accumulates
over the kernel's MAC rate, plus a fitted share of the shorter (``UNHIDDEN_SHARE``). Which kernel runs is ggml-cpu's choice: a repacked ARM kernel
(``repack.cpp``) where the build has that repack and the weight sits in its repack buffer,
the plain ``vec_dot`` on the GGUF bytes otherwise (``CpuBoard.repacks``: which a build has).
Host ops (norms, RoPE, attention, the GLU): ``cost.host_ops``."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ggml_rknpu.cost.model import dram_bandwidth

# --- the board's CPU --------------------------------------------------------------------
BIG_CORES = 4            # 4x Cortex-A76 (+ 4x A55, not modeled) [docs/anchors.md §3.1]
A76_HZ = 2.4e9           # A76 clock, up to 2.4 GHz [docs/anchors.md §3.1]; the Pi 5's too [§6.2]
READ_BYTES_S_ONE_CORE = 17.6e9   # measured CPU read, 1 A76 [docs/anchors.md §3.2]
READ_BYTES_S_CLUSTER = 26.7e9    # measured CPU read, 4 A76 [docs/anchors.md §3.2]
DRAM_MHZ = 2112          # the DRAM clock the NPU model prices at [cost/model.py, docs/anchors.md A3]

# --- ggml-cpu's kernels: multiply-accumulates per cycle per A76 core ------------------
# FIT (docs/placement.md "The CPU model", docs/anchors.md §6): each rate makes the geometric
# mean of modeled / published over the prompt rows of its kernel 1 (two or more rows each,
# never one), given the host-op model (cost.host_ops) and the other rates, all solved together
# (tests/cost/test_cost_cpu.py re-runs the fit).
MAC_PER_CYCLE = {
    "F16": 4.81,             # FIT: Gemma3-1B, Granite-4.0-350M F16 pp512 [§6.1]
    "Q8_0": 5.04,            # FIT: Gemma3-1B, Granite-4.0-350M, Qwen3.5-9B Q8_0 pp512 [§6.1], plain (read as
                             # pre-18096); Qwen3.5-9B Q4_0 pp512 (read as no repack: the plain Q8_0 family kernel)
    "Q6_K": 2.52,            # FIT: Gemma3-1B, Granite Q6_K pp512 [§6.1]; LFM2 350M/700M repack off [§6.2]
    "Q5_K": 3.34,            # FIT: LFM2 350M/700M Q5_K pp512, repack off [§6.2]
    "Q4_0/repacked": 11.3,   # FIT: Gemma3-1B, Granite, LFM2-8B-A1B Q4_0 pp512 [§6.1] (q4_0_4x4)
    "Q5_K/repacked": 6.07,   # FIT: LFM2 350M/700M Q5_K pp512, repack on (q5_K_8x4, PR 19356) [§6.2]
    "Q6_K/repacked": 7.51,   # FIT: LFM2 350M/700M Q6_K pp512, repack on (q6_K_8x4, PR 19360) [§6.2]
}
# GUESS (no row of the calibration set runs them): the repacked Q8_0 kernel (q8_0_4x4, PR
# 18096) at the repacked Q4_0 rate (the same int8 dot products without the nibble unpack), the
# repacked Q4_K kernel (q4_K_8x4, PR 17494) at the repacked Q5_K rate (Q5_K's layout plus a
# high-bit plane), plain Q4_K at plain Q5_K's. Each a lower bound of its kernel's rate.
MAC_PER_CYCLE["Q8_0/repacked"] = MAC_PER_CYCLE["Q4_0/repacked"]
MAC_PER_CYCLE["Q4_K/repacked"] = MAC_PER_CYCLE["Q5_K/repacked"]
MAC_PER_CYCLE["Q4_K"] = MAC_PER_CYCLE["Q5_K"]

UNHIDDEN_SHARE = 0.29
# FIT: the share of the shorter of a matmul's compute and memory times not hidden under the
# longer (0: a pure roofline, max(); 1: no overlap, their sum). The value that minimizes the
# squared log error over all 44 rows of the set, every other constant refitted at each trial
# value. The 22 tg128 rows fix it (at M = 1 the shorter side is 25-93% of the longer; at 512
# rows under 1%, so the prompt rows hardly feel it). Fitted without the four Qwen3.5 9B rows
# it is 0.19 (docs/anchors.md §6.1). GUESS: the same share for every kernel and M.

# GUESS (no published A76 figure): a type without a rate of its own takes its family's
# plain rate -- 32-blocks with Q8_0/Q8_1 activations the Q8_0 rate, the low k-quants
# Q6_K's (the slowest calibrated k-quant), float weights F16's.
_FAMILY = {
    **{t: "Q8_0" for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "IQ4_NL", "MXFP4")},
    **{t: "Q6_K" for t in ("Q2_K", "Q3_K", "Q6_K", "IQ4_XS")},
    "Q4_K": "Q4_K", "Q5_K": "Q5_K",
    **{t: "F16" for t in ("F16", "BF16", "F32")},
}
# ggml-cpu's repack choice on a NEON + dotprod core without i8mm (the A76): type -> the
# row multiple it needs (ggml_repack_get_optimal_repack_type in ggml-cpu/repack.cpp of the
# pinned llama.cpp: q4_0_4x4, q8_0_4x4, q4_K/q5_K/q6_K_8x4).
REPACKED_ROWS = {"Q4_0": 4, "Q8_0": 4, "Q4_K": 8, "Q5_K": 8, "Q6_K": 8}
PINNED_REPACKS = frozenset(REPACKED_ROWS)   # the pinned build has all five (PRs 17494, 18096, 19356, 19360)


@dataclass(frozen=True)
class CpuBoard:
    """A cluster of A76 cores and the llama.cpp build on it: its DRAM read rates and which
    weight types that build repacks."""

    name: str
    read_one_core: float
    read_cluster: float
    ceiling: float                      # the DRAM's ceiling for every reader together
    repacks: frozenset[str] = PINNED_REPACKS


RK3588 = CpuBoard("RK3588 4xA76, the pinned llama.cpp", READ_BYTES_S_ONE_CORE, READ_BYTES_S_CLUSTER,
                  dram_bandwidth(DRAM_MHZ))


def type_name(weight_type: int | str) -> str:
    """ggml's name of a weight type given as its id (``GgmlType``) or name."""
    return weight_type if isinstance(weight_type, str) else GGMLQuantizationType(int(weight_type)).name


def bytes_per_weight(weight_type: int | str) -> float:
    """ggml's bytes per weight of a type: block bytes over block size (gguf's table)."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name(weight_type)]]
    return size / block


def kernel(weight_type: int | str, N: int, repacked: bool, repacks: frozenset[str] = PINNED_REPACKS) -> str:
    """The kernel whose rate prices this weight: ``"<type>/repacked"`` when ggml-cpu
    repacks it (``repacked``: the weight sits in ggml-cpu's repack buffer, as in llama.cpp
    alone; ``repacks``: the types the build repacks), else its family's plain kernel."""
    name = type_name(weight_type)
    if name not in _FAMILY:
        raise ValueError(f"no CPU rate for weight type {name}")
    rows = REPACKED_ROWS.get(name)
    if repacked and name in repacks and rows is not None and N % rows == 0:
        return f"{name}/repacked"
    return _FAMILY[name]


def read_bytes_s(threads: int, board: CpuBoard = RK3588) -> float:
    """DRAM read rate of ``threads`` A76 cores: one core's rate per thread up to the
    cluster's (GUESS: linear between the two points), never above the board's DRAM ceiling
    (on the RK3588 the one the NPU model uses: one DRAM serves both)."""
    if not 1 <= threads <= BIG_CORES:
        raise ValueError(f"threads must be 1..{BIG_CORES} (the A76 cluster), got {threads}")
    return min(threads * board.read_one_core, board.read_cluster, board.ceiling)


def mac_s(kernel_name: str, threads: int) -> float:
    """Multiply-accumulates per second of a kernel on ``threads`` A76 cores."""
    return MAC_PER_CYCLE[kernel_name] * threads * A76_HZ


@dataclass(frozen=True)
class CpuTime:
    """Modeled seconds of one matmul in ggml-cpu: ``total_s`` = max(memory, compute) plus
    ``UNHIDDEN_SHARE`` times the shorter of the two."""

    total_s: float
    memory_s: float
    compute_s: float
    weight_bytes: float
    kernel: str
    label: str = "modeled"


def cpu_matmul_time(weight_type: int | str, M: int, K: int, N: int, *, threads: int = BIG_CORES,
                    repacked: bool = True, experts: int = 1, board: CpuBoard = RK3588) -> CpuTime:
    """Modeled ggml-cpu time of ``dst[M, N] = a[M, K] @ w[N, K]^T`` on the A76 cluster.

    ``experts``: a MUL_MAT_ID reading that many distinct experts' [N, K] slices, ``M`` rows
    in all (each row multiplies one expert). ``repacked``: llama.cpp alone (weights in
    ggml-cpu's repack buffer) vs the GGUF bytes as uploaded. The public entry point for
    other models (speculative heads, placement)."""
    if min(M, K, N, experts) < 1:
        raise ValueError(f"bad matmul shape M={M} K={K} N={N} experts={experts}")
    k = kernel(weight_type, N, repacked, board.repacks)
    weight_bytes = K * N * experts * bytes_per_weight(weight_type)
    memory = weight_bytes / read_bytes_s(threads, board)
    compute = M * K * N / mac_s(k, threads)
    total = max(memory, compute) + UNHIDDEN_SHARE * min(memory, compute)
    return CpuTime(total, memory, compute, weight_bytes, k)


def cpu_matmul_seconds(weight_type: int | str, M: int, K: int, N: int, *, threads: int = BIG_CORES,
                       repacked: bool = True, experts: int = 1, board: CpuBoard = RK3588) -> float:
    """``cpu_matmul_time(...).total_s``."""
    return cpu_matmul_time(weight_type, M, K, N, threads=threads, repacked=repacked, experts=experts,
                           board=board).total_s
