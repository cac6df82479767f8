"""The order rule of a GRAPH_COMPUTE graph: which tensors a node needs computed before it runs.

Why a rule per source and not "every source comes earlier": a node reads its sources, so each
one it reads must be a leaf or a node listed before it (otherwise it reads bytes nothing has
written yet, or a cycle). But a CPY does not read its src1: that is its destination, and the
node is a view of it (``ggml_cpy``). ``ggml_cast`` copies into a new tensor and names the node
itself as that destination (pinned ggml.c ``ggml_cast``: ``result->src[1] = result``, "needed
by some backends for consistency with ggml_cpy_impl"). llama.cpp casts K and V to f16 for
flash attention when they do not come from the KV cache (encoders, embedding models,
``build_attn_mha``), so such graphs carry a node whose src1 is itself. The C++ server links
the self-reference (``create_node`` memoises ids) and ggml-cpu copies src0 into dst. A
destination may therefore be the node itself, a leaf, or an earlier node; every other
self-reference or later source stays refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ggml_rknpu.ggml.enums import GgmlOp
from ggml_rknpu.ggml.tensor import RpcTensor

# op -> the source that is the node's destination (written, not read)
DESTINATION_SRC: dict[int, int] = {GgmlOp.CPY: 1}


def order_error(t: RpcTensor, p: int, position: Mapping[int, int], names: Mapping[int, RpcTensor]) -> str | None:
    """Why node ``t`` at position ``p`` may not run there, or None: a source or view_src it
    needs is computed at or after it (a CPY's destination may be the node itself)."""
    dest = DESTINATION_SRC.get(t.op)
    needed: Sequence[tuple[int | None, int]] = [*enumerate(t.src), (None, t.view_src)]
    for i, s in needed:
        if not s:
            continue
        at = position.get(s, -1)
        if at < p or (i == dest and s == t.id):
            continue
        if s == t.id:
            return (f"node #{p} '{t.name}' reads itself (only a CPY's destination, src1, may be the "
                    f"node itself)")
        return (f"node #{p} '{t.name}' reads '{names[s].name}', which is computed at or after it "
                f"(cycle or wrong order)")
    return None
