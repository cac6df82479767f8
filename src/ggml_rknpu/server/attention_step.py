"""Attention's matmuls on the NPU, per KV head with the query heads that share it stacked as
rows: the KV cache's f16 K (or V) of the pass staged as an engine weight (once a node, for
every block of rows), the rows run through ``MatmulEngine.matmul``, the staged copy freed after the pass.

``KvMatmulStep``: a MUL_MAT whose src0 is a KV-cache view (llama.cpp's KQ and KQV without
flash attention), ggml's broadcast (``i02 = i12 / r2``, ``i03 = i13 / r3``). ``FlashAttentionStep``:
FLASH_ATTN_EXT as S = Q.K^T on the NPU, the scale, softcap, mask, ALiBi and sinks and the
softmax in ggml-cpu (one SOFT_MAX_EXT node), O = P.V on the NPU, by blocks of rows. Invariants: an NPU fault
resets the NPU through ``NpuRecovery.pass_failed`` and the pass runs once more, then the node
runs in ggml-cpu (its own one-node graph), as does any other engine failure (and the node
stays there); the destination is written whole by whichever side ran last."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ggml_rknpu.engine.contract import EngineWeight, MatmulEngine
from ggml_rknpu.libggml.compute import HostCompute
from ggml_rknpu.libggml.lib import TensorP
from ggml_rknpu.server.plan_steps import HostSegment
from ggml_rknpu.server.recovery import NpuRecovery
from ggml_rknpu.server.stats import OpCounter, ServerStats

log = logging.getLogger("ggml_rknpu.rpc")


def _stage(npu: MatmulEngine, weight: np.ndarray) -> EngineWeight:
    """``weight`` [N, K] (a slice of the f16 KV cache) staged on the NPU as an fp16 weight."""
    return npu.upload_weight(np.asarray(weight, np.float32), "fp16")   # exact: the cache is f16


def _apply(npu: MatmulEngine, stats: ServerStats, handle: EngineWeight, rows: np.ndarray) -> np.ndarray:
    """``rows`` [..., K] (the heads sharing the weight first) @ the staged weight^T: [..., N]."""
    a = np.ascontiguousarray(rows, dtype=np.float32).reshape(-1, rows.shape[-1])
    c = npu.matmul(a, handle)
    stats.count_npu_matmuls(a.shape[0], 1, npu.last_timing)
    stats.attention_npu_by_m[a.shape[0]] = stats.attention_npu_by_m.get(a.shape[0], 0) + 1
    return c.reshape(*rows.shape[:-1], c.shape[1])


def _stacked(npu: MatmulEngine, stats: ServerStats, weight: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``rows`` @ ``weight`` [N, K]^T on the NPU, the weight staged for this call only."""
    handle = _stage(npu, weight)
    try:
        return _apply(npu, stats, handle, rows)
    finally:
        handle.free()


@dataclass(eq=False)
class NpuPass:
    """The fault policy of one attention node: its NPU pass, at most twice, else its host graph."""

    name: str
    engine: MatmulEngine
    recovery: NpuRecovery
    host: HostSegment          # the node as a one-node ggml graph
    counter: OpCounter         # (op, "npu")
    nbytes: int
    refused: bool = False      # the engine failed other than by a fault: the host from now on

    def run_with(self, stats: ServerStats, compute: Callable[[MatmulEngine], None]) -> None:
        recovery = self.recovery
        if not self.refused:
            t0 = time.perf_counter()
            for attempt in range(2):
                try:
                    compute(self.engine)
                except Exception as exc:
                    if not recovery.pass_failed(f"attention '{self.name}'", exc):
                        log.warning("attention '%s' stays on the host: the engine refused it (%s: %s)",
                                    self.name, type(exc).__name__, exc)
                        self.refused = True
                        break
                    if attempt == 0:
                        recovery.stats.retries += 1
                    continue
                if attempt:
                    recovery.stats.retried_ok += 1
                self.counter.ops += 1
                self.counter.bytes += self.nbytes
                self.counter.seconds += time.perf_counter() - t0
                return
            else:
                recovery.stats.host_fallbacks += 1
        stats.attention_host_runs += 1
        self.host.run(stats)


@dataclass(eq=False)
class KvMatmulStep:
    """dst = src1 @ src0^T with src0 a KV-cache view; numpy views (ne reversed) of its tensors."""

    npu_pass: NpuPass
    w: np.ndarray              # src0 (ne3, ne2, N, K) f16
    a: np.ndarray              # src1 (ne13, ne12, M, K) f32
    out: np.ndarray            # dst (ne13, ne12, M, N) f32

    def run(self, stats: ServerStats) -> None:
        self.npu_pass.run_with(stats, lambda npu: self._compute(npu, stats))

    def _compute(self, npu: MatmulEngine, stats: ServerStats) -> None:
        r3, r2 = self.a.shape[0] // self.w.shape[0], self.a.shape[1] // self.w.shape[1]
        result = np.empty(self.out.shape, np.float32)
        for i3 in range(self.w.shape[0]):
            for i2 in range(self.w.shape[1]):
                heads = slice(i2 * r2, (i2 + 1) * r2)
                result[i3 * r3:(i3 + 1) * r3, heads] = _stacked(
                    npu, stats, self.w[i3, i2], self.a[i3 * r3:(i3 + 1) * r3, heads])
        self.out[...] = result


@dataclass(eq=False)
class SoftmaxGraph:
    """One SOFT_MAX_EXT node over a block of rows' scores (every head), in place; its tensors
    point at a run's arrays only while it runs (``HostCompute.bound``)."""

    compute: HostCompute
    scores: TensorP            # src0 (n_kv, block rows, heads, ne3) f32
    probs: TensorP             # its dst, a view of src0
    mask: TensorP | None       # the block's rows of the node's mask


@dataclass(eq=False)
class Softmax:
    """A split FLASH_ATTN_EXT's softmax: SOFT_MAX_EXT(scores, mask, scale, max_bias, sinks) in
    ggml-cpu, in place (each row is read whole before it is written), a block of rows at a
    time; ``softcap`` (0: none) applied to the scores first."""

    graphs: dict[int, SoftmaxGraph]   # by block rows: the full block's, the last block's
    mask: tuple[np.ndarray, int, int] | None   # the mask's buffer (uint8), byte offset, row stride
    scale: float               # applied before the softcap (1: the softmax node scales)
    softcap: float

    def run(self, stats: ServerStats, scores: np.ndarray, row0: int) -> np.ndarray:
        """``scores`` (ne3, heads, block rows, n_kv) f32 of the rows from ``row0`` on,
        overwritten by their probabilities."""
        t0 = time.perf_counter()
        graph = self.graphs[scores.shape[2]]
        if self.softcap:
            np.multiply(scores, self.scale / self.softcap, out=scores)
            np.tanh(scores, out=scores)
            np.multiply(scores, self.softcap, out=scores)
        bindings = [(graph.scores, scores), (graph.probs, scores)]
        if graph.mask is not None and self.mask is not None:
            buffer, start, row_bytes = self.mask
            bindings.append((graph.mask, buffer[start + row0 * row_bytes:]))
        with graph.compute.bound(*bindings):
            graph.compute.run()
        # a row masked whole has no softmax (0/0); flash attention's output for it is 0
        np.nan_to_num(scores, copy=False, nan=0.0)
        stats.host_seconds += time.perf_counter() - t0
        stats.host_segments += 1
        return scores


@dataclass(eq=False)
class FlashAttentionStep:
    """FLASH_ATTN_EXT split: S and O on the NPU per KV head, the softmax in ggml-cpu, a block
    of ``block`` rows at a time; the scores and the result are allocated per run, so a
    cached step holds no scratch."""

    npu_pass: NpuPass
    q: np.ndarray              # (ne3, heads, rows, D) f32
    k: np.ndarray              # (ne3, kv_heads, n_kv, D) f16
    v: np.ndarray              # (ne3, kv_heads, n_kv, DV) f16
    out: np.ndarray            # dst (ne3, rows, heads, DV) f32
    softmax: Softmax
    block: int                 # rows per block (cost.npu_attention.row_block)

    def run(self, stats: ServerStats) -> None:
        self.npu_pass.run_with(stats, lambda npu: self._compute(npu, stats))

    def _compute(self, npu: MatmulEngine, stats: ServerStats) -> None:
        staged: list[EngineWeight] = []

        def stage(weight: np.ndarray) -> EngineWeight:
            staged.append(_stage(npu, weight))
            return staged[-1]

        try:   # each KV head's K and V^T staged once for every block, freed after the pass
            keys = [[stage(k) for k in k3] for k3 in self.k]
            values = [[stage(v.T) for v in v3] for v3 in self.v]
            result = np.empty(self.out.shape, np.float32)
            for row0 in range(0, self.q.shape[2], self.block):
                self._block(npu, stats, row0, min(row0 + self.block, self.q.shape[2]), keys, values, result)
        finally:
            for handle in staged:
                handle.free()
        self.out[...] = result

    def _block(self, npu: MatmulEngine, stats: ServerStats, row0: int, row1: int, keys: list[list[EngineWeight]],
               values: list[list[EngineWeight]], result: np.ndarray) -> None:
        r3, g = self.q.shape[0] // self.k.shape[0], self.q.shape[1] // self.k.shape[1]
        scores = np.empty((*self.q.shape[:2], row1 - row0, self.k.shape[2]), np.float32)   # every head written
        for i3 in range(self.q.shape[0]):
            for h in range(self.k.shape[1]):
                heads = slice(h * g, (h + 1) * g)
                scores[i3, heads] = _apply(npu, stats, keys[i3 // r3][h], self.q[i3, heads, row0:row1])
        probs = self.softmax.run(stats, scores, row0)
        for i3 in range(self.q.shape[0]):
            for h in range(self.k.shape[1]):
                heads = slice(h * g, (h + 1) * g)
                o = _apply(npu, stats, values[i3 // r3][h], probs[i3, heads])   # (g, block rows, DV)
                result[i3, row0:row1, heads] = o.transpose(1, 0, 2)
