"""The time of a forward pass's host ops in ggml-cpu on the A76 cluster: everything but the
weight matmuls (norms, RoPE, the GLU, residual adds, activation quantization, the KV-cache
store, attention, a gated delta-net's recurrence): a *modeled* figure.

Per layer and pass: a fixed dispatch cost, the element-wise bytes every row moves at the
cluster's copy rate, attention as ggml-cpu's FLASH_ATTN_EXT runs it (a 64 x 64 tiled f32 GEMM
for 64 rows or more, skipping fully masked tiles; one row at a time below that), a gated
delta-net layer's GATED_DELTA_NET and short conv (``DeltaNet``): each the longer of its
multiply-accumulates at a kernel's rate and its bytes at the read or copy rate. The cache's
fill level before the pass (``past``) is an input. Rates, fits: docs/placement.md "Host ops"."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ggml_rknpu.cost import cpu
from ggml_rknpu.hw.alignment import ceil_div

HOST_FIXED_S_PER_LAYER = 0.256e-3
# FIT: the rest of a published tg128 token beyond its matmuls, element-wise bytes and
# attention, per layer: the geometric mean of modeled / published over the fourteen RK3588
# tg128 rows is 1 (docs/anchors.md §6.1). GUESS: independent of the thread count, the rows
# and the layer's kind.
COPY_BYTES_S_CLUSTER = 23.0e9
# measured STREAM triad on 4 A76 (docs/anchors.md §3.2); GUESS: fewer threads scale it as
# the read rate scales (``cpu.read_bytes_s``), another board's as its cluster read rate.
ROW_BYTES_PER_LAYER = {"hidden": 89, "q": 25, "kv": 28, "ff": 25}
# GUESS, counted from llama.cpp's layer graph in f32 (4-byte) reads and writes per row:
# hidden: two RMS norms with their weight multiply (16 + 16), two residual adds (12 + 12),
# the activation quantization of q/k/v, gate/up (5 each), the o and down outputs (4 + 4);
# q: its output, RoPE, the attention read and write, o's quantization; kv: k and v outputs,
# k's RoPE, the cache store (f32 -> f16); ff: gate/up outputs, the GLU (read 2, write 1),
# down's quantization. A short-conv layer counts its 3h in_proj output as q, a gated delta-net
# layer its qkv and z outputs, a gated attention layer its q and gate output.
FA_TILE = 64   # GGML_FA_TILE_Q = GGML_FA_TILE_KV in the pinned ggml-cpu (common.h)
KV_MAC_KERNEL = {"F16": "F16", "F32": "F16", "Q8_0": "Q8_0"}
# GUESS: the tiled f32 GEMM of flash attention (and its row-at-a-time vec_dot for decode)
# runs at the fitted rate of the matmul kernel of the KV type (F16 for an f16 cache).
KV_BYTES = {"F16": 2, "F32": 4, "Q8_0": 34 / 32}
GDN_STATE_PASSES = 4
# the pinned ggml-cpu's GATED_DELTA_NET (ops.cpp, the fused op llama.cpp builds for prefill and
# decode) walks a value head's head_dim x head_dim f32 state four times per token: the decay
# (vec_scale), S.k (vec_dot), the rank-1 update (vec_mad), S.q (vec_dot).
GDN_STATE_COPIES = 4
# state bytes a pass moves through DRAM per layer: the op reads the cached state and writes
# the new one, the graph's ggml_cpy reads that and writes it into the recurrent cache.
GDN_KERNEL = "F16"
# GUESS, as for flash attention: the f32 vec_dot/vec_mad and the short conv's scalar loop run
# at the fitted F16 matmul rate (no calibration row isolates them).
STATE_BYTES = 4   # the recurrent state and the conv state are f32


@dataclass(frozen=True)
class DeltaNet:
    """A gated delta-net (linear attention) layer's recurrent part (Qwen3-Next, Qwen3.5):
    ``k_heads`` query/key heads and ``v_heads`` value heads of ``head_dim``, each value head
    an f32 head_dim x head_dim state; a causal conv of ``conv_kernel`` taps over q, k and v."""

    k_heads: int
    v_heads: int
    head_dim: int
    conv_kernel: int

    @property
    def conv_channels(self) -> int:
        """The q, k and v channels the short conv runs over (the qkv projection's width)."""
        return (2 * self.k_heads + self.v_heads) * self.head_dim

    @property
    def value_dim(self) -> int:
        return self.v_heads * self.head_dim


@dataclass(frozen=True)
class LayerOps:
    """What a layer's host ops depend on. ``window``: 0 = full causal attention, > 0 a sliding
    window of that many positions, None = no attention (a short-conv or gated delta-net layer);
    ``delta``: a gated delta-net layer's recurrent part."""

    hidden: int
    ff: int
    q_dim: int
    kv_dim: int
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None = 0
    delta: DeltaNet | None = None


def copy_bytes_s(threads: int, board: cpu.CpuBoard = cpu.RK3588) -> float:
    """Element-wise copy rate of ``threads`` cores on ``board`` (module doc)."""
    return COPY_BYTES_S_CLUSTER * cpu.read_bytes_s(threads, board) / cpu.READ_BYTES_S_CLUSTER


def elementwise_bytes(layer: LayerOps, rows: int) -> float:
    """Bytes ``rows`` rows move through a layer's element-wise ops (``ROW_BYTES_PER_LAYER``)."""
    per_row = (ROW_BYTES_PER_LAYER["hidden"] * layer.hidden + ROW_BYTES_PER_LAYER["q"] * layer.q_dim
               + ROW_BYTES_PER_LAYER["kv"] * layer.kv_dim + ROW_BYTES_PER_LAYER["ff"] * layer.ff)
    return rows * per_row


def visible_positions(rows: int, past: int, window: int) -> int:
    """Key positions flash attention computes for ``rows`` new rows after ``past`` cached
    ones: per row its causal (and windowed) span; from ``FA_TILE`` rows up, whole tiles of
    ``FA_TILE`` rows by ``FA_TILE`` positions, a tile skipped only when all of it is masked."""
    def span(first: int, last: int) -> tuple[int, int]:   # [lo, hi) of positions rows first..last see
        hi = past + last + 1
        lo = max(0, past + first - window + 1) if window else 0
        return lo, hi

    if rows < FA_TILE:
        return sum(hi - lo for lo, hi in (span(r, r) for r in range(rows)))
    total = 0
    for first in range(0, rows, FA_TILE):
        lo, hi = span(first, min(rows, first + FA_TILE) - 1)
        tiles = ceil_div(hi, FA_TILE) - lo // FA_TILE
        total += tiles * FA_TILE * min(FA_TILE, rows - first)
    return total


@dataclass(frozen=True)
class AttentionTime:
    """Modeled seconds of one layer's attention or delta-net recurrence: ``total_s`` =
    max(compute, memory)."""

    total_s: float
    compute_s: float
    memory_s: float
    macs: float


def attention_time(layer: LayerOps, rows: int, past: int, *, threads: int = cpu.BIG_CORES,
                   kv_type: str = "F16", board: cpu.CpuBoard = cpu.RK3588) -> AttentionTime:
    """One layer's FLASH_ATTN_EXT over ``rows`` new rows with ``past`` positions cached:
    Q.K^T and P.V per head (head_dim MACs each per visible position), K and V read once per
    KV head and row tile (once per pass below ``FA_TILE`` rows; GUESS: the heads sharing a KV
    head and the rows of a small pass find it in cache)."""
    if layer.window is None:
        return AttentionTime(0.0, 0.0, 0.0, 0.0)
    positions = visible_positions(rows, past, layer.window)
    macs = positions * layer.heads * 2 * layer.head_dim
    per_pass = rows if rows < FA_TILE else FA_TILE
    kv_bytes = positions / per_pass * layer.kv_heads * 2 * layer.head_dim * KV_BYTES[kv_type]
    compute = macs / cpu.mac_s(KV_MAC_KERNEL[kv_type], threads)
    memory = kv_bytes / cpu.read_bytes_s(threads, board)
    return AttentionTime(max(compute, memory), compute, memory, macs)


def delta_net_time(delta: DeltaNet, rows: int, *, threads: int = cpu.BIG_CORES,
                   board: cpu.CpuBoard = cpu.RK3588) -> AttentionTime:
    """One gated delta-net layer's recurrence over ``rows`` rows: ``GDN_STATE_PASSES`` MACs
    per state element, token and value head, plus the short conv's ``conv_kernel`` per channel
    and token; its states (``GDN_STATE_COPIES`` times the recurrent state, the conv state read
    and written) at the copy rate. Independent of the fill level: the state is all it reads."""
    state = delta.v_heads * delta.head_dim ** 2 * STATE_BYTES
    conv_state = 2 * (delta.conv_kernel - 1) * delta.conv_channels * STATE_BYTES
    macs = rows * (GDN_STATE_PASSES * delta.v_heads * delta.head_dim ** 2 + delta.conv_kernel * delta.conv_channels)
    compute = macs / cpu.mac_s(GDN_KERNEL, threads)
    memory = (GDN_STATE_COPIES * state + conv_state) / copy_bytes_s(threads, board)
    return AttentionTime(max(compute, memory), compute, memory, macs)


def layer_seconds(layer: LayerOps, rows: int, past: int, *, threads: int = cpu.BIG_CORES,
                  kv_type: str = "F16", board: cpu.CpuBoard = cpu.RK3588) -> float:
    """Modeled host-op seconds of one layer for one pass of ``rows`` rows."""
    recurrent = delta_net_time(layer.delta, rows, threads=threads, board=board).total_s if layer.delta else 0.0
    return (HOST_FIXED_S_PER_LAYER + elementwise_bytes(layer, rows) / copy_bytes_s(threads, board)
            + attention_time(layer, rows, past, threads=threads, kv_type=kv_type, board=board).total_s + recurrent)


def host_ops_seconds(layers: Sequence[LayerOps], rows: int, past: int = 0, *, threads: int = cpu.BIG_CORES,
                     kv_type: str = "F16", board: cpu.CpuBoard = cpu.RK3588) -> float:
    """Modeled host-op seconds of one forward pass of ``rows`` rows after ``past`` cached
    positions: the same in every placement, since host ops always run in ggml-cpu."""
    if rows < 1 or past < 0:
        raise ValueError(f"a pass needs rows >= 1 and past >= 0, got rows={rows} past={past}")
    return sum(layer_seconds(layer, rows, past, threads=threads, kv_type=kv_type, board=board) for layer in layers)
