"""Malformed graphs never reach ggml-cpu: per admitted op family, a node built by ggml's own
builder is sent over the wire, computed, then sent again with a wrong shape, type, stride,
op_param, a missing source or an index out of range. Every bad graph closes the connection
with a logged reason, the server (ggml-cpu in this very process) survives, and a good graph
is computed afterwards.

Scope: this runs against the release build; a variant of the ggml libraries built with
AddressSanitizer (to see silent out-of-bounds reads too) is not part of the project yet.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggml_rknpu.ggml.enums import TYPE_TRAITS, GgmlOp, GgmlTensorFlag, GgmlType
from ggml_rknpu.ggml.ops import geometry as geo
from ggml_rknpu.ggml.ops.rules import RULES, check_node
from ggml_rknpu.ggml.tensor import RpcTensor
from support.rpc_testkit import FakeNpu, ServerThread, T
from support.ggml_builders import Scratch, _made_by_ggml

pytestmark = pytest.mark.timeout(300)
I32, I64 = int(GgmlType.I32), int(GgmlType.I64)


@pytest.fixture(scope="module")
def srv():
    s = ServerThread(npu=FakeNpu(), stall_timeout_s=1.0)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cases(host_ggml):
    """(label, node, sources, index sources) from ggml's builders (tests/ops/test_ops_rules.py)."""
    sc = Scratch(host_ggml)
    out = []
    for label, t in _made_by_ggml(sc):
        node, srcs = sc.node(t)
        if any(s is not None and s.view_src for s in srcs) or node.view_src:
            continue                    # a view source, or a node that is a view of its source (OPT_STEP_*):
                                        # this placement gives every tensor its own bytes; tests/ops covers them
        out.append((label, node, srcs, check_node(node, srcs)))
    sc.close()
    return out


def _send(srv, node: RpcTensor, srcs: tuple, index: dict[int, int], bad_index: int | None = None):
    """Lay the node and its sources out in one buffer, fill them, GRAPH_COMPUTE; the client."""
    c = srv.client()
    tensors = [s for s in srcs if s is not None]
    sizes = [max(geo.span(t), 1) for t in (*tensors, node)]
    h, base = c.alloc_base(sum(-(-n // 64) * 64 for n in sizes) + 64 * len(sizes) + (1 << 16))
    rng = np.random.default_rng(0)
    placed, addr = {}, base
    for t in (*tensors, node):
        if t.id in placed:
            continue
        placed[t.id] = T(ne=t.ne, nb=t.nb, type=t.type, buffer=h, data=addr, op=t.op if t is node else 0,
                         op_params=t.op_params,
                         src=t.src if t is node else (), id=t.id,
                         # a client's graph node carries COMPUTE (ggml_build_forward_expand); the
                         # builders' tensors were never in a graph
                         flags=t.flags | GgmlTensorFlag.COMPUTE if t is node else 0)
        addr += -(-max(geo.span(t), 1) // 64) * 64 + 64
    for i, s in enumerate(srcs):
        if s is None or s is node:
            continue
        n = geo.span(s)
        if i in index:
            values = rng.integers(0, index[i], geo.nelements(s))
            if bad_index is not None:
                values[rng.integers(0, len(values))] = bad_index
            raw = values.astype(np.int64 if s.type == I64 else np.int32).tobytes()
        elif TYPE_TRAITS[GgmlType(s.type)][0] > 1 or s.type in (I32, I64):
            raw = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        else:
            raw = (rng.standard_normal(n // TYPE_TRAITS[GgmlType(s.type)][1]).astype(
                np.float16 if TYPE_TRAITS[GgmlType(s.type)][1] == 2 else np.float32)).tobytes()
        c.set_tensor(placed[s.id], raw[:n])
    c.graph_compute([placed[node.id]], list(placed.values()))
    return c, placed[node.id]


def _computed(c, dst: T) -> bool:
    return len(c.get_tensor(dst, size=min(geo.span(dst), 64))) > 0


def test_every_builder_node_computes_over_the_wire(srv, cases):
    for label, node, srcs, index in cases:
        c, dst = _send(srv, node, srcs, dict(index))
        assert _computed(c, dst), label
        c.close()
    assert srv.alive()


# ops whose dst shape the client chooses (ggml_interpolate's ne; the shape tensor of get_rows_back and
# repeat_back, which is no source): a larger dst can be a valid node, computed
CLIENT_SHAPED = frozenset({GgmlOp.UPSCALE, GgmlOp.GET_ROWS_BACK, GgmlOp.REPEAT_BACK})
MUTATIONS = ("dst shape", "dst type", "missing src", "overlap", "op_params", "index high", "index negative")


def _mutate(node: RpcTensor, srcs: tuple, how: str, value: int):
    if how == "dst shape":
        return dataclasses.replace(node, ne=(node.ne[0], node.ne[1] + 1 + value % 3, *node.ne[2:])), srcs
    if how == "dst type":
        types = [int(t) for t in GgmlType if int(t) != node.type]
        return dataclasses.replace(node, type=types[value % len(types)]), srcs
    if how == "missing src":                     # a required one (optional sources may be absent)
        present = [i for i, s in enumerate(node.src) if s and i < RULES[node.op].arity] or [0]
        k = present[value % len(present)]
        return dataclasses.replace(node, src=tuple(0 if i == k else s for i, s in enumerate(node.src))), srcs
    if how == "overlap":
        wide = [d for d in range(4) if node.ne[d] > 1] or [0]
        nb = list(node.nb)
        nb[wide[-1]] = value % max(1, nb[wide[-1]])
        return dataclasses.replace(node, nb=tuple(nb)), srcs
    params = list(node.op_params)
    params[value % 4] = (value * 2654435761) % (1 << 31) - (1 << 30)
    return dataclasses.replace(node, op_params=tuple(params)), srcs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pick=st.integers(0, 10_000), how=st.sampled_from(MUTATIONS), value=st.integers(0, 1 << 20))
def test_malformed_graphs_close_the_connection_and_the_server_survives(srv, cases, caplog, pick, how, value):
    label, node, srcs, index = cases[pick % len(cases)]
    index = dict(index)
    bad_index = None
    if how.startswith("index"):
        if not index:
            return
        k = sorted(index)[value % len(index)]
        bad_index = index[k] + value % 7 if how == "index high" else -1 - value % 5
    else:
        node, srcs = _mutate(node, srcs, how, value)
    before = srv.state.stats.rejected + srv.state.stats.unsupported
    with caplog.at_level(logging.WARNING, logger="ggml_rknpu.rpc"):
        c, dst = _send(srv, node, srcs, index, bad_index)
        closed = c.is_closed_by_server(timeout=5)
        c.close()
    after = srv.state.stats.rejected + srv.state.stats.unsupported
    if not closed and (how == "op_params" or (how == "dst shape" and node.op in CLIENT_SHAPED)):
        pass                            # a different eps, scale, ... or client-chosen shape can be valid: computed
    else:
        assert closed, f"{label}: {how} ({value}) was computed"
        assert after > before and "closing" in caplog.text, f"{label}: {how}: no reason logged"
    assert srv.alive()
    c, dst = _send(srv, *cases[0][1:3], dict(cases[0][3]))     # and a good graph still computes
    assert _computed(c, dst)
    c.close()
