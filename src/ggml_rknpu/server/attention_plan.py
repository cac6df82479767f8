"""Which attention matmuls of a graph run on the NPU (``rknpu serve --npu-attention``), and
their steps: FLASH_ATTN_EXT split into NPU matmuls and a ggml-cpu softmax, and the MUL_MATs
of the unfused form (KQ = K.Q, KQV = V.softmax(KQ)) whose src0 is a KV-cache view.

Invariants: only f16 K/V (the cache's type; ggml-cpu rounds Q and P to f16 for it too) with
f32 queries and results qualify; ``auto`` decides each node by the board's models
(``cost.npu_attention`` against ``cost.host_ops`` for FLASH_ATTN_EXT, ``cost.placement``'s two
matmul prices for a MUL_MAT), so decode rows stay on the host; ``on`` takes every node that
qualifies (tests), ``off`` none. Every step keeps its node as a one-node ggml graph for the
fault policy. Why: docs/placement.md "Attention on the NPU"."""

from __future__ import annotations

import struct
from collections.abc import Collection
from dataclasses import dataclass

from ggml_rknpu.cost import cpu
from ggml_rknpu.cost import host_ops as ho
from ggml_rknpu.cost.npu_attention import npu_attention_seconds, row_block
from ggml_rknpu.cost.placement import host_matmul_seconds, npu_matmul_seconds
from ggml_rknpu.engine.contract import MatmulEngine
from ggml_rknpu.libggml import abi
from ggml_rknpu.libggml.compute import HostContext
from ggml_rknpu.libggml.enums import GgmlOp, GgmlType
from ggml_rknpu.libggml.lib import TensorP
from ggml_rknpu.server.attention_step import FlashAttentionStep, KvMatmulStep, NpuPass, Softmax, SoftmaxGraph
from ggml_rknpu.server.placement import NPU
from ggml_rknpu.server.plan_steps import HostSegment
from ggml_rknpu.server.recovery import NpuRecovery
from ggml_rknpu.server.stats import ServerStats
from ggml_rknpu.server.tensor import CheckedTensor, RpcTensor

MODES = ("off", "auto", "on")
F16, F32 = int(GgmlType.F16), int(GgmlType.F32)
SOFTMAX_GRAPHS = 2      # one-node graphs a split FLASH_ATTN_EXT adds to a plan (a full block of rows, the last)
SOFTMAX_TENSORS = 3 * SOFTMAX_GRAPHS   # ggml tensors they add to its context (scores, mask, probs each)
AttentionStep = FlashAttentionStep | KvMatmulStep


def _f32(t: RpcTensor, i: int) -> float:
    return float(struct.unpack("<f", struct.pack("<i", t.op_params[i]))[0])


def _bits(x: float) -> int:
    return int(struct.unpack("<i", struct.pack("<f", x))[0])


@dataclass
class AttentionPolicy:
    """``mode`` and the board the ``auto`` decisions price (the NPU's cores, ggml-cpu's A76 threads)."""

    mode: str = "auto"
    cores: int = 1
    threads: int = cpu.BIG_CORES

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"npu-attention must be one of {MODES}, not {self.mode!r}")

    def matmul_wins(self, m: int, k: int, n: int) -> bool:
        """A KQ or KQV MUL_MAT of ``m`` stacked rows per KV head: NPU fp16 against ggml-cpu's f16 kernel."""
        if self.mode != "auto":
            return self.mode == "on"
        return npu_matmul_seconds(m, k, n, "fp16", self.cores) < host_matmul_seconds("F16", m, k, n, self.threads)

    def flash_wins(self, rows: int, span: int, heads: int, kv_heads: int, head_dim: int) -> bool:
        """A FLASH_ATTN_EXT of ``rows`` rows over ``span`` cached positions (the last ``rows`` new)."""
        if self.mode != "auto":
            return self.mode == "on"
        layer = ho.LayerOps(0, 0, heads * head_dim, kv_heads * head_dim, heads, kv_heads, head_dim, window=0)
        past = max(0, span - rows)
        npu_s = npu_attention_seconds(layer, rows, past, cores=self.cores, threads=self.threads)
        return npu_s < ho.attention_time(layer, rows, past, threads=self.threads).total_s


def kv_matmul_ok(t: RpcTensor, w: RpcTensor, a: RpcTensor) -> bool:
    """A MUL_MAT (dst = a @ w^T, broadcast over w's heads) this module can run: f16 src0 that
    is not a weight, f32 src1 and dst, ggml's broadcast shapes, unit element strides."""
    return (t.op == GgmlOp.MUL_MAT and w.type == F16 and a.type == F32 and t.type == F32
            and 0 not in t.ne and a.ne[2] % w.ne[2] == 0 and a.ne[3] % w.ne[3] == 0
            and w.nb[0] == 2 and a.nb[0] == 4 and t.nb[0] == 4 and a.ne[0] == w.ne[0])


def flash_ok(t: RpcTensor, src: tuple[RpcTensor | None, ...]) -> bool:
    """A FLASH_ATTN_EXT with f32 Q, f16 K and V (the rule checked the rest of its shapes)."""
    q, k, v = src[0], src[1], src[2]
    return (q is not None and k is not None and v is not None and q.type == F32 and k.type == F16
            and v.type == F16 and k.nb[0] == 2 and v.nb[0] == 2 and 0 not in t.ne)


def kv_matmul_step(t: RpcTensor, checked: dict[int, CheckedTensor], engine: MatmulEngine, recovery: NpuRecovery,
                   host: HostSegment, stats: ServerStats) -> KvMatmulStep:
    w, a, d = checked[t.src[0]], checked[t.src[1]], checked[t.id]
    npu_pass = NpuPass(t.name, engine, recovery, host, stats.counter("MUL_MAT", NPU),
                       (w.end - w.start) + (a.end - a.start) + (d.end - d.start))
    return KvMatmulStep(npu_pass, w.ref().as_array(), a.ref().as_array(), d.ref().as_array())


def _softmax_graph(ctx: HostContext, name: str, shape: tuple[int, int, int, int], mask: CheckedTensor | None,
                   sinks: TensorP | None, params: tuple[int, int]) -> SoftmaxGraph:
    """SOFT_MAX_EXT in place over scores of ``shape`` (n_kv, block rows, heads, ne3), unbound."""
    n_kv, rows, heads, _ = shape
    nb = (4, 4 * n_kv, 4 * n_kv * rows, 4 * n_kv * rows * heads)
    s_t = ctx.tensor(F32, shape, nb, 0, (), 0, f"{name}.scores", None)
    mask_t = None if mask is None else ctx.tensor(mask.rpc.type, (n_kv, rows, *mask.rpc.ne[2:]), mask.rpc.nb, 0, (),
                                                  0, f"{name}.mask", None)
    p_t = ctx.tensor(F32, shape, nb, int(GgmlOp.SOFT_MAX), params, abi.GGML_TENSOR_FLAG_COMPUTE,
                     f"{name}.softmax", None)
    ctx.link(p_t, [s_t, mask_t, sinks], s_t, 0)      # in place, as ggml_soft_max_ext_inplace builds it
    return SoftmaxGraph(ctx.segment([p_t]), s_t, p_t, mask_t)


def flash_step(t: RpcTensor, checked: dict[int, CheckedTensor], ptrs: dict[int, TensorP], ctx: HostContext,
               engine: MatmulEngine, recovery: NpuRecovery, host: HostSegment, stats: ServerStats) -> FlashAttentionStep:
    """The split FLASH_ATTN_EXT: its softmax one-node SOFT_MAX_EXT graphs (a full block of rows,
    and the last block where it is shorter) over scores that exist only while the step runs:
    a cached plan holds their metadata only."""
    q, k, v, d = (checked[i] for i in (t.src[0], t.src[1], t.src[2], t.id))
    n_kv, rows, heads, ne3 = k.rpc.ne[1], q.rpc.ne[1], q.rpc.ne[2], q.rpc.ne[3]
    scale, max_bias, softcap = _f32(t, 0), _f32(t, 1), _f32(t, 2)
    mask = checked[t.src[3]] if len(t.src) > 3 and t.src[3] else None
    mask_rows = None
    if mask is not None:
        assert mask.buffer is not None, "a computing node's sources are backed (check_backed)"
        mask_rows = (mask.buffer.array, mask.start, mask.rpc.nb[1])
    sinks_t = ptrs[t.src[4]] if len(t.src) > 4 and t.src[4] else None
    # softcap: s = softcap * tanh(s * scale / softcap) before the mask (ggml-cpu's flash
    # attention), done on the scores; the softmax then scales by 1
    params = (_bits(1.0 if softcap else scale), _bits(max_bias))
    block = row_block(rows, heads * ne3, n_kv)
    graphs = {r: _softmax_graph(ctx, t.name, (n_kv, r, heads, ne3), mask, sinks_t, params)
              for r in {block, rows % block} if r}
    softmax = Softmax(graphs, mask_rows, scale if softcap else 1.0, softcap)
    nbytes = sum(c.end - c.start for c in (q, k, v, d))
    npu_pass = NpuPass(t.name, engine, recovery, host, stats.counter("FLASH_ATTN_EXT", NPU), nbytes)
    return FlashAttentionStep(npu_pass, q.ref().as_array(), k.ref().as_array(), v.ref().as_array(),
                              d.ref().as_array(), softmax, block)


def attention_step(t: RpcTensor, checked: dict[int, CheckedTensor], ptrs: dict[int, TensorP], ctx: HostContext,
                   engine: MatmulEngine, recovery: NpuRecovery, host: HostSegment, stats: ServerStats) -> AttentionStep:
    """The step of a node ``plan_nodes`` chose; ``host``: the node as a one-node ggml graph."""
    if t.op == GgmlOp.FLASH_ATTN_EXT:
        return flash_step(t, checked, ptrs, ctx, engine, recovery, host, stats)
    return kv_matmul_step(t, checked, engine, recovery, host, stats)


def plan_nodes(policy: AttentionPolicy, tensors: dict[int, RpcTensor], computing: list[int],
               computed: Collection[int], npu_ready: bool) -> set[int]:
    """The computing nodes whose attention matmuls run on the NPU (``npu_ready``: an engine
    exists). A MUL_MAT qualifies only when its src0 is no weight: a view (the KV cache) or
    ``computed`` by the graph."""
    if policy.mode == "off" or not npu_ready:
        return set()
    chosen = set()
    for nid in computing:
        t = tensors[nid]
        src = tuple(tensors[s] if s else None for s in t.src)
        if (t.op == GgmlOp.MUL_MAT and src[0] is not None and src[1] is not None
                and (src[0].view_src or src[0].id in computed) and kv_matmul_ok(t, src[0], src[1])):
            w, a = src[0], src[1]
            if policy.matmul_wins(a.ne[1] * (a.ne[2] // w.ne[2]), w.ne[0], w.ne[1]):
                chosen.add(nid)
        elif t.op == GgmlOp.FLASH_ATTN_EXT and flash_ok(t, src):
            q, k = src[0], src[1]
            assert q is not None and k is not None, "flash_ok checked them"
            if policy.flash_wins(q.ne[1], k.ne[1], q.ne[2], k.ne[2], q.ne[0]):
                chosen.add(nid)
    return chosen
