"""Malformed graphs never reach ggml-cpu: per admitted op family, a node built by ggml's own
builder is sent over the wire, computed, then sent again with a wrong shape, type, stride,
op_param, a missing source or an index out of range. Every bad graph closes the connection
with a logged reason, the server (ggml-cpu in this very process) survives, and a good graph
is computed afterwards.

This runs against the release build in this process; tests/server/test_rpc_fuzz_asan.py sends
the same graphs, and more mutations, to `rknpu serve` on ggml built with AddressSanitizer, which
also sees silent out-of-bounds reads.
"""

from __future__ import annotations

import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggml_rknpu.server.ops import geometry as geo
from ggml_rknpu.server.tensor import RpcTensor
from support.malformed import BAD, builder_cases, mutate, send
from support.rpc_testkit import FakeNpu, ServerThread, T

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def srv():
    s = ServerThread(npu=FakeNpu(), stall_timeout_s=1.0)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cases(host_ggml):
    """One case per builder node (support.malformed, tests/server/ops/test_ops_rules.py)."""
    return builder_cases(host_ggml)


def _computed(c, dst: T, node: RpcTensor) -> bool:
    """``dst``, ``node`` as ``send`` placed it, reads back (its geometry is ``node``'s)."""
    return len(c.get_tensor(dst, size=min(geo.span(node), 64))) > 0


def test_every_builder_node_computes_over_the_wire(srv, cases):
    for case in cases:
        c = srv.client()
        dst = send(c, case.node, case.srcs, case.index)
        assert _computed(c, dst, case.node), case.label
        c.close()
    assert srv.alive()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pick=st.integers(0, 10_000), how=st.sampled_from(BAD + ("op_params",)), value=st.integers(0, 1 << 20))
def test_malformed_graphs_close_the_connection_and_the_server_survives(srv, cases, caplog, pick, how, value):
    case = cases[pick % len(cases)]
    mutated = mutate(case, how, value)
    if mutated is None:
        return
    node, srcs, bad_index = mutated
    before = srv.state.stats.rejected + srv.state.stats.unsupported
    with caplog.at_level(logging.WARNING, logger="ggml_rknpu.rpc"):
        c = srv.client()
        send(c, node, srcs, case.index, bad_index)
        closed = c.is_closed_by_server(timeout=5)
        c.close()
    after = srv.state.stats.rejected + srv.state.stats.unsupported
    if how in ("op_params",) and not closed:
        pass                            # a different eps, scale, ... can be a valid node: computed
    else:
        assert closed, f"{case.label}: {how} ({value}) was computed"
        assert after > before and "closing" in caplog.text, f"{case.label}: {how}: no reason logged"
    assert srv.alive()
    c = srv.client()                    # and a good graph still computes
    dst = send(c, cases[0].node, cases[0].srcs, cases[0].index)
    assert _computed(c, dst, cases[0].node)
    c.close()
