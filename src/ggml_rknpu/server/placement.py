"""Where each op runs (NPU engine or the host's ggml-cpu): the reasons a MUL_MAT or a
MUL_MAT_ID stays on the host.

Policy: a MUL_MAT whose src0 is a staged weight runs on the NPU engine; everything else
runs on the host. What each placement cost is counted in ``server/stats.py``. Why no other
op moves to the NPU: docs/decisions.md "server/placement.py"."""

from __future__ import annotations

from ggml_rknpu.libggml.enums import TYPE_TRAITS, GgmlType
from ggml_rknpu.server.tensor import RpcTensor

NPU = "npu"
HOST = "host"

FLAG_INPUT = 1                     # GGML_TENSOR_FLAG_INPUT [docs/ggml-rpc.md §3.3]
_FLOAT_ACTIVATIONS = frozenset(int(t) for t in (GgmlType.F32, GgmlType.F16, GgmlType.BF16))


def _contiguous_2d(t: RpcTensor) -> bool:
    block, type_size = TYPE_TRAITS[GgmlType(t.type)]
    return t.ne[2] == 1 and t.ne[3] == 1 and t.nb[0] == type_size and t.nb[1] == t.ne[0] // block * type_size


def _contiguous_3d(t: RpcTensor) -> bool:
    """[K, N, n_expert] with each expert's [K, N] slice right after the previous one."""
    block, type_size = TYPE_TRAITS[GgmlType(t.type)]
    row = t.ne[0] // block * type_size
    return t.ne[3] == 1 and t.nb[0] == type_size and t.nb[1] == row and t.nb[2] == row * t.ne[1]


def _leaf_weight_reason(dst: RpcTensor, w: RpcTensor, *, engine: bool, w_computed: bool,
                        w_backed: bool) -> str | None:
    """What rules src0 out as a resident weight whatever its shape (MUL_MAT and MUL_MAT_ID alike)."""
    if not engine:
        return "no NPU engine"
    if 0 in dst.ne or 0 in w.ne:
        return "empty"
    if w.view_src:                 # checked first: KV cache views are (no-op) nodes of the graph too
        return "src0 is a view (KV cache)"
    if w_computed:
        return "src0 computed by the graph"
    if w.flags & FLAG_INPUT:
        return "src0 is a graph input"
    if not w_backed:
        return "src0 not on this server"
    return None


def matmul_host_reason(dst: RpcTensor, w: RpcTensor, a: RpcTensor, *, engine: bool, w_computed: bool,
                       w_backed: bool, w_graph_written: bool) -> str | None:
    """Why this MUL_MAT (dst = a @ w^T) runs on the host, or None: its src0 is a weight for the NPU.

    A weight is a leaf (not computed by the graph), not a view (the KV cache is reached
    through views), not a graph input, 2-D and contiguous, never written by a graph node,
    and the activations are float with matching shapes.
    """
    reason = _leaf_weight_reason(dst, w, engine=engine, w_computed=w_computed, w_backed=w_backed)
    if reason is not None:
        return reason
    if not _contiguous_2d(w):
        return "src0 not 2-D contiguous"
    if w_graph_written:
        return "src0 written by a graph"
    if a.type not in _FLOAT_ACTIVATIONS or dst.type != GgmlType.F32:
        return "activation/output type"
    if a.ne[0] != w.ne[0] or dst.ne[0] != w.ne[1] or dst.ne[1:] != a.ne[1:]:
        return "broadcast shapes"
    return None


def experts_host_reason(dst: RpcTensor, w: RpcTensor, b: RpcTensor, *, engine: bool, w_computed: bool,
                        w_backed: bool, w_graph_written: bool) -> str | None:
    """Why this MUL_MAT_ID keeps all its experts on the host, or None: each expert slice
    of src0 ``[K, N, n_expert]`` can be a resident weight (same rules as a MUL_MAT's src0,
    3-D contiguous; shapes were checked by the validator rule)."""
    reason = _leaf_weight_reason(dst, w, engine=engine, w_computed=w_computed, w_backed=w_backed)
    if reason is not None:
        return reason
    if not _contiguous_3d(w):
        return "src0 not 3-D contiguous"
    if w_graph_written:
        return "src0 written by a graph"
    if b.type not in _FLOAT_ACTIVATIONS or dst.type != GgmlType.F32:
        return "activation/output type"
    return None


def host_weight(dst: RpcTensor, w: RpcTensor, a: RpcTensor, *, w_computed: bool, w_backed: bool,
                w_graph_written: bool) -> bool:
    """Whether this MUL_MAT's src0 is a weight a repacked host copy may stand for
    (``server/host_copies.py``): a weight by the NPU's rules, f32 activations, and the shapes
    ggml-cpu's repacked kernel asserts (no fourth dimension, dst rows of contiguous floats)."""
    return (matmul_host_reason(dst, w, a, engine=True, w_computed=w_computed, w_backed=w_backed,
                               w_graph_written=w_graph_written) is None
            and a.type == GgmlType.F32 and a.ne[3] == 1 and dst.ne[3] == 1
            and dst.nb[0] == 4 and dst.nb[0] <= dst.nb[1] <= dst.nb[2] <= dst.nb[3])
