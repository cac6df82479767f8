"""A GRAPH_COMPUTE payload parsed [docs/ggml-rpc.md §3.5] and checked as a structure.

Invariants: the payload's size is exact; every node and source id is a tensor of the
payload; nodes read only earlier nodes (no cycles); view chains are acyclic and sit at their
parent's address; every tensor a computing node uses has its bytes on this server. What is
checked and why: docs/decisions.md "server/planner.py"."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggml_rknpu.libggml.enums import GgmlTensorFlag
from ggml_rknpu.server.node_order import order_error
from ggml_rknpu.server.ops.vocabulary import VIEW_OPS, op_name
from ggml_rknpu.server.rpc.wire import GRAPH_HEAD, MAX_GRAPH_NODES, RPC_TENSOR_SIZE, U32, ProtocolError
from ggml_rknpu.server.tensor import CheckedTensor, RpcTensor, unbacked_reason


def computes(t: RpcTensor) -> bool:
    """Whether the backend runs this node: an op that is not a view, flagged COMPUTE by the client."""
    return t.op not in VIEW_OPS and bool(t.flags & GgmlTensorFlag.COMPUTE)


@dataclass
class ParsedGraph:
    """The payload: its device, node ids in the client's order, every tensor by id."""

    dev: int
    node_ids: list[int]
    tensors: dict[int, RpcTensor]


def parse_graph(payload: bytes | memoryview) -> ParsedGraph:
    """dev u32 | n_nodes u32 | u64 ids[n_nodes] | n_tensors u32 | rpc_tensor[n_tensors], exact size."""
    size = len(payload)
    dev, n_nodes = GRAPH_HEAD.unpack_from(payload, 0)
    if n_nodes > MAX_GRAPH_NODES:
        raise ProtocolError(f"GRAPH_COMPUTE: absurd node count {n_nodes} (limit {MAX_GRAPH_NODES})")
    pos = GRAPH_HEAD.size + 8 * n_nodes
    if pos + 4 > size:
        raise ProtocolError(f"GRAPH_COMPUTE: {n_nodes} node ids do not fit a {size}-byte payload")
    node_ids = list(np.frombuffer(payload, dtype="<u8", count=n_nodes, offset=GRAPH_HEAD.size).tolist())
    (n_tensors,) = U32.unpack_from(payload, pos)
    pos += 4
    if size != pos + n_tensors * RPC_TENSOR_SIZE:
        raise ProtocolError(
            f"GRAPH_COMPUTE: payload is {size} bytes, {n_nodes} nodes and {n_tensors} tensors need "
            f"{pos + n_tensors * RPC_TENSOR_SIZE}"
        )
    tensors: dict[int, RpcTensor] = {}
    for i in range(n_tensors):
        t = RpcTensor.unpack_from(payload, pos + i * RPC_TENSOR_SIZE)
        if t.id == 0:
            raise ProtocolError(f"GRAPH_COMPUTE: tensor #{i} '{t.name}' has id 0")
        if t.id in tensors:
            raise ProtocolError(f"GRAPH_COMPUTE: tensor id {t.id:#x} appears twice")
        tensors[t.id] = t
    return ParsedGraph(dev, node_ids, tensors)


def check_structure(g: ParsedGraph) -> dict[int, int]:
    """Node positions; ProtocolError for unknown ids, duplicate nodes, cycles, bad views."""
    position: dict[int, int] = {}
    for p, nid in enumerate(g.node_ids):
        if nid not in g.tensors:
            raise ProtocolError(f"GRAPH_COMPUTE: node #{p} id {nid:#x} is not in the tensor list")
        if nid in position:
            raise ProtocolError(f"GRAPH_COMPUTE: node id {nid:#x} listed twice")
        position[nid] = p
    for t in g.tensors.values():
        for s in t.src:
            if s and s not in g.tensors:
                raise ProtocolError(f"GRAPH_COMPUTE: tensor '{t.name}' has unknown src id {s:#x}")
        if t.view_src and t.view_src not in g.tensors:
            raise ProtocolError(f"GRAPH_COMPUTE: tensor '{t.name}' has unknown view_src id {t.view_src:#x}")
    for nid, p in position.items():
        if (why := order_error(g.tensors[nid], p, position, g.tensors)) is not None:
            raise ProtocolError(f"GRAPH_COMPUTE: {why}")
    # view chains: acyclic (memoised walk), same buffer, address = parent + view_offs
    settled: set[int] = set()
    for tid in g.tensors:
        path: list[int] = []
        on_path: set[int] = set()
        cur = tid
        while cur and cur not in settled:
            if cur in on_path:
                raise ProtocolError(f"GRAPH_COMPUTE: view_src cycle through '{g.tensors[cur].name}'")
            path.append(cur)
            on_path.add(cur)
            cur = g.tensors[cur].view_src
        settled.update(path)
    for t in g.tensors.values():
        if t.view_src and (t.buffer or g.tensors[t.view_src].buffer):   # views on other backends: not ours
            parent = g.tensors[t.view_src]
            if parent.buffer != t.buffer or parent.data + t.view_offs != t.data:
                raise ProtocolError(
                    f"GRAPH_COMPUTE: view '{t.name}' at {t.data:#x} in buffer {t.buffer:#x} is not "
                    f"'{parent.name}' ({parent.data:#x} in {parent.buffer:#x}) + {t.view_offs}"
                )
    return position


def check_backed(g: ParsedGraph, checked: dict[int, CheckedTensor]) -> None:
    """Every tensor a computing node reads or writes must have its bytes on this server."""
    for nid in g.node_ids:
        t = g.tensors[nid]
        if not computes(t):
            continue
        for tid in (nid, *t.src):
            if tid and not checked[tid].usable:
                u = g.tensors[tid]
                raise ProtocolError(f"GRAPH_COMPUTE: node '{t.name}' ({op_name(t.op)}) uses '{u.name}', "
                                    f"which has {unbacked_reason(u)}")
