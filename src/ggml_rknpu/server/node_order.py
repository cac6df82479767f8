"""The order rule of a GRAPH_COMPUTE graph: which tensors a node needs computed before it runs.

Invariants: every source a node reads, and its view_src, is a leaf or a node listed before
it; a CPY's src1 is its destination, not a read (``ggml_cpy`` makes the node a view of it),
and may also be the node itself, as ``ggml_cast`` builds it (pinned ggml.c:
``result->src[1] = result``). llama.cpp casts K and V to f16 that way for flash attention
outside the KV cache (encoders, embedding models); the C++ server links the self-reference
and ggml-cpu copies src0 into dst. Any other self-reference or later source is refused.
Why: docs/decisions.md "server/planner.py".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ggml_rknpu.libggml.enums import GgmlOp
from ggml_rknpu.server.tensor import RpcTensor

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
