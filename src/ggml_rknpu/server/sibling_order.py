"""The plan's node order: each NPU MUL_MAT moved up beside its earlier sibling (the
previous NPU MUL_MAT reading the same activation), so that siblings can run as one submit.

Invariants: a node moves only over nodes that write none of the bytes it reads; when a
passed node reads or writes its destination, a ``DeliveryMark`` stays at its own place and
its result is written there, so every node still sees the bytes it saw in the client's order."""

from __future__ import annotations

from dataclasses import dataclass

from ggml_rknpu.server.parsed_graph import ParsedGraph
from ggml_rknpu.server.tensor import CheckedTensor, RpcTensor
from ggml_rknpu.server.weight_store import WeightSlot


@dataclass(frozen=True)
class DeliveryMark:
    """Where a moved-up MUL_MAT used to be (``node``: its tensor id): its result is written here."""

    node: int


Node = int | DeliveryMark   # an entry of the plan's order: a tensor id to compute, or a delivery


def node_id(n: Node) -> int:
    """The tensor an order entry writes (a delivery writes its MUL_MAT's destination)."""
    return n.node if isinstance(n, DeliveryMark) else n


def _touches(t: RpcTensor, checked: dict[int, CheckedTensor]) -> tuple[list[CheckedTensor], list[CheckedTensor]]:
    """(bytes a node writes, bytes it reads), as checked ranges."""
    reads = [checked[s] for s in t.src if s and checked[s].buffer is not None]
    dst = checked[t.id]
    return ([dst] if dst.buffer is not None else []), reads


def overlap(a: list[CheckedTensor], b: list[CheckedTensor]) -> bool:
    return any(x.buffer is y.buffer and x.start < y.end and y.start < x.end for x in a for y in b)


def _movable(moved: RpcTensor, over: list[RpcTensor], checked: dict[int, CheckedTensor]) -> tuple[bool, bool]:
    """(``moved`` may run before the nodes ``over``, its result must then still be written
    at its own place). It may when none of them writes bytes it reads. If one of them
    reads or writes its destination's bytes (the client's allocator reuses memory by the
    original order: V's dst is often Q's, freed once ROPE(Q) read it), the result is
    kept aside and delivered where the node was."""
    mw, mr = _touches(moved, checked)
    deliver = False
    for node in over:
        ow, orr = _touches(node, checked)
        if overlap(ow, mr):
            return False, False
        deliver = deliver or overlap(mw, ow + orr)
    return True, deliver


def gather_siblings(computing: list[int], g: ParsedGraph, slots: dict[int, WeightSlot | None],
                     checked: dict[int, CheckedTensor]) -> list[Node]:
    """Node order with each NPU MUL_MAT moved up next to the previous NPU MUL_MAT reading the
    same activation (llama.cpp's attention builds Q, ROPE(Q), then K and V: this makes
    Q/K/V consecutive, one group). A moved node whose destination the passed nodes use
    leaves a ``DeliveryMark`` at its own place: its result is written there.

    An NPU MUL_MAT reads only a leaf weight and its activation, computed before the
    earlier sibling, so the move is safe once no passed node writes bytes it reads."""
    order: list[Node] = []
    after_last: dict[int, int] = {}          # activation id -> index just after its last NPU reader
    for nid in computing:
        t = g.tensors[nid]
        if slots.get(nid) is None:
            order.append(nid)
            continue
        act = t.src[1]
        at = after_last.get(act)
        ok, deliver = (False, False) if at is None else _movable(
            t, [g.tensors[node_id(o)] for o in order[at:]], checked)
        if not ok or at is None or at == len(order):
            order.append(nid)
            after_last[act] = len(order)
            continue
        order.insert(at, nid)
        for key, index in after_last.items():
            if index >= at:
                after_last[key] = index + 1
        after_last[act] = at + 1
        if deliver:
            order.append(DeliveryMark(nid))
    return order

