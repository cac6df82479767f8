"""The calibration set of the CPU and host-op model (``cost.cpu``, ``cost.host_ops``):
published llama-bench rows of ggml-cpu on four Cortex-A76 cores, each with the board and
the llama.cpp build it was taken on. Other people's *measured* figures, copied from
docs/anchors.md §6 (the product never reads reference files at run time).

Invariants: the model is fitted to these rows only, each constant to two or more of them;
``CPU_ANCHOR_TOLERANCE`` is what the cpu plan must reproduce every row within
(tests/cost/test_cost_cpu.py). Which build each row is read as: docs/anchors.md §6."""

from __future__ import annotations

from dataclasses import dataclass

from ggml_rknpu.cost.cpu import BIG_CORES, PINNED_REPACKS, READ_BYTES_S_CLUSTER, READ_BYTES_S_ONE_CORE, RK3588, CpuBoard

PI5_READ_BYTES_S = 15.1e9
# FIT: the Raspberry Pi 5's cluster read rate, the constant its eight tg128 rows fix
# (geometric mean of modeled / published 1; its LPDDR4X is 32 bits wide, the RK3588's 64). GUESS: one core reads the same share of
# it as one RK3588 A76 does of the RK3588's.
_PI5_ONE_CORE = PI5_READ_BYTES_S * READ_BYTES_S_ONE_CORE / READ_BYTES_S_CLUSTER

RK3588_FORK_BUILD = CpuBoard("RK3588 4xA76, rk-llama.cpp's older build (Q4_0 repack only)", READ_BYTES_S_ONE_CORE,
                             READ_BYTES_S_CLUSTER, RK3588.ceiling, frozenset({"Q4_0"}))
RK3588_NO_REPACK_BUILD = CpuBoard("RK3588 4xA76, rk-llama.cpp's Qwen3.5 build (no weight repacked)",
                                  READ_BYTES_S_ONE_CORE, READ_BYTES_S_CLUSTER, RK3588.ceiling, frozenset())
# the Qwen3.5 9B rows: a build new enough to run qwen35 graphs (llama.cpp PR 19597) that
# repacked nothing, the Q4_0 prompt below Q8_0's at plain Q8_0's rate (docs/anchors.md §6.1)
PI5_REPACK_OFF = CpuBoard("Raspberry Pi 5 4xA76, CPU repack off", _PI5_ONE_CORE, PI5_READ_BYTES_S,
                          PI5_READ_BYTES_S, frozenset())
PI5_REPACK_ON = CpuBoard("Raspberry Pi 5 4xA76, CPU repack on", _PI5_ONE_CORE, PI5_READ_BYTES_S,
                         PI5_READ_BYTES_S, PINNED_REPACKS)

TG_PAST = 64   # tg128 decodes from an empty cache: its 128 passes see 64 cached positions on average
CPU_ANCHOR_TOLERANCE = 0.20


@dataclass(frozen=True)
class CpuAnchor:
    """A published llama-bench figure (``-t 4`` on four A76 cores)."""

    model: str          # a ``bench.shapes`` preset
    quant: str          # the model's quantization mix (llama.cpp's quantizer, ``bench.plans``)
    test: str           # "pp512" (prompt tokens/s) or "tg128" (decode tokens/s)
    tok_s: float
    board: CpuBoard
    source: str

    @property
    def threads(self) -> int:
        return BIG_CORES


_RK_LLAMA = ("docs/anchors.md §6.1: the CPU rows of invisiofficial/rk-llama.cpp's ggml-rknpu2 README "
             "(taskset -c 4-7 llama-bench -t 4), also in llama.cpp PR #24972")
_PI5 = "docs/anchors.md §6.2: Raspberry Pi 5 rows of llama.cpp PRs 19356 (Q5_K) and 19360 (Q6_K), repack off / on"


def _rows(model: str, board: CpuBoard, source: str, table: tuple[tuple[str, float, float], ...]) -> list[CpuAnchor]:
    return [CpuAnchor(model, q, test, v, board, source) for q, pp, tg in table for test, v in (("pp512", pp), ("tg128", tg))]


CPU_ANCHORS: tuple[CpuAnchor, ...] = tuple(
    _rows("Gemma3-1B", RK3588_FORK_BUILD, _RK_LLAMA, (
        ("F16", 68.5, 11.1), ("Q8_0", 73.3, 19.5), ("Q6_K", 51.9, 18.7), ("Q4_0", 164.7, 28.3)))
    + _rows("Granite-4.0-350M", RK3588_FORK_BUILD, _RK_LLAMA, (
        ("F16", 154.1, 25.8), ("Q8_0", 163.4, 40.6), ("Q6_K", 78.7, 42.5), ("Q4_0", 340.4, 55.2)))
    + _rows("LFM2-8B-A1B", RK3588_FORK_BUILD, _RK_LLAMA, (
        ("F16", 31.1, 6.8), ("Q8_0", 31.7, 12.9), ("Q6_K", 16.4, 12.9), ("Q4_0", 62.2, 22.7)))
    + _rows("LFM2-350M", PI5_REPACK_OFF, _PI5, (("Q5_K_M", 100.89, 44.45), ("Q6_K", 86.21, 39.45)))
    + _rows("LFM2-700M", PI5_REPACK_OFF, _PI5, (("Q5_K_M", 47.06, 21.57), ("Q6_K", 39.93, 19.08)))
    + _rows("LFM2-350M", PI5_REPACK_ON, _PI5, (("Q5_K_M", 187.35, 43.00), ("Q6_K", 224.06, 38.51)))
    + _rows("LFM2-700M", PI5_REPACK_ON, _PI5, (("Q5_K_M", 89.73, 21.33), ("Q6_K", 105.82, 17.83)))
    + _rows("Qwen3.5-9B", RK3588_NO_REPACK_BUILD, _RK_LLAMA, (("Q8_0", 7.2, 2.5), ("Q4_0", 6.5, 3.6))))
