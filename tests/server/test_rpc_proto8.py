"""Protocol 8.0.0 connections: graphs by uid exactly as the client keeps them, strided tensor
I/O, COMM_* answered without a communicator; every bad request closes only its connection.
Layouts and rules: docs/ggml-rpc.md §4."""

from __future__ import annotations

import logging
import socket
import struct

import numpy as np
import pytest

from ggml_rknpu.libggml.enums import GgmlOp
from ggml_rknpu.server.rpc import proto8
from ggml_rknpu.server.rpc.wire import Cmd
from support.matmul_graph import f32
from support.rpc_testkit import FakeNpu, RpcClient, serve, wait_until

pytestmark = pytest.mark.timeout(60)
ADD = int(GgmlOp.ADD)


@pytest.fixture
def srv():
    with serve(npu=FakeNpu(), protocol=8) as st:
        yield st


def expect_closed(srv, c: RpcClient) -> None:
    assert c.is_closed_by_server(), "server kept the connection open after a bad request"
    c.close()
    assert srv.alive(), "server does not answer a new client after rejecting one"


def _add_graph(c: RpcClient):
    h, base = c.alloc_base(1 << 12)
    a, b = f32(h, base, 8, 2), f32(h, base + 64, 8, 2)
    out = f32(h, base + 128, 8, 2, op=ADD, src=(a.id, b.id))
    c.set_array(a, np.ones(16, np.float32))
    c.set_array(b, np.arange(16, dtype=np.float32))
    return h, a, b, out


def test_hello_answers_8_0_0_and_graphs_replay_by_uid(srv):
    with srv.client() as c:                           # RpcClient checks HELLO == (8, 0, 0)
        assert c.device_count() == 1
        _, a, b, out = _add_graph(c)
        c.graph_compute([out], [a, b, out], uid=7)
        assert np.array_equal(c.get_array(out).ravel(), 1 + np.arange(16))
        c.set_array(a, np.full(16, 10, np.float32))
        c.graph_recompute(uid=7)
        assert np.array_equal(c.get_array(out).ravel(), 10 + np.arange(16))
        assert srv.state.stats.recomputes == 1 and srv.state.stats.plans_built == 1
    assert srv.alive() and srv.state.stats.rejected == 0


def test_uid_zero_is_never_stored(srv):
    c = srv.client()
    _, a, b, out = _add_graph(c)
    c.graph_compute([out], [a, b, out], uid=0)
    assert np.array_equal(c.get_array(out).ravel(), 1 + np.arange(16))
    c.graph_recompute(uid=0)
    expect_closed(srv, c)


def test_unknown_uid_ends_only_that_connection(srv, caplog):
    caplog.set_level(logging.WARNING, logger="ggml_rknpu.rpc")
    c = srv.client()
    _, a, b, out = _add_graph(c)
    c.graph_compute([out], [a, b, out], uid=5)
    c.graph_recompute(uid=6)
    expect_closed(srv, c)
    assert any("graph with uid 6 not found" in r.getMessage() for r in caplog.records)


def test_cache_clears_at_1024_uids_like_the_client(srv):
    """The client clears its uid set when it holds GRAPH_CACHE_MAX uids, before inserting the
    next: uids sent before that point are gone on both sides, later ones replay."""
    c = srv.client()
    _, a, b, out = _add_graph(c)
    for uid in range(1, proto8.GRAPH_CACHE_MAX + 1):
        c.graph_compute([out], [a, b, out], uid=uid)
    c.graph_recompute(uid=1)                           # 1024 stored: all still there
    c.graph_compute([out], [a, b, out], uid=5000)      # the 1025th: clear, then store
    c.graph_recompute(uid=5000)
    assert np.array_equal(c.get_array(out).ravel(), 1 + np.arange(16))
    assert srv.state.stats.plans_built == 1            # identical payloads share one plan
    c.graph_recompute(uid=1)
    expect_closed(srv, c)


def test_free_buffer_drops_cached_graphs(srv):
    c = srv.client()
    _, a, b, out = _add_graph(c)
    c.graph_compute([out], [a, b, out], uid=9)
    other, _ = c.alloc(256)
    c.free(other)                                      # any FREE_BUFFER: graphs may point into it
    c.graph_recompute(uid=9)
    expect_closed(srv, c)


def test_a_bad_graph_with_a_uid_closes_the_connection(srv):
    c = srv.client()
    _, a, b, out = _add_graph(c)
    bad = f32(out.buffer, out.data, 8, 2, op=ADD, src=(a.id, 0xDEAD))
    c.graph_compute([bad], [a, bad], uid=3)
    expect_closed(srv, c)


def test_set_and_get_tensor_2d_strided_rows(srv):
    with srv.client() as c:
        h, base = c.alloc_base(1 << 12)
        t = f32(h, base, 16, 4)                        # 4 rows of 64 bytes
        c.set_array(t, np.zeros(64, np.float32))
        rows = np.arange(2 * 4, dtype=np.float32) + 100    # 2 rows of 16 bytes, 64 apart, at +32
        c.set_tensor_2d(t, rows.tobytes(), offset=32, size=16, n_copies=2, stride=64)
        full = np.frombuffer(c.get_tensor(t), np.float32).reshape(4, 16)
        assert np.array_equal(full[0, 8:12], rows[:4]) and np.array_equal(full[1, 8:12], rows[4:])
        assert not full[0, :8].any() and not full[2:].any()
        got = c.get_tensor_2d(t, offset=32, size=16, n_copies=2, stride=64)
        assert np.array_equal(np.frombuffer(got, np.float32), rows)
        packed = c.get_tensor_2d(t, offset=0, size=64, n_copies=2, stride=64)
        assert packed == c.get_tensor(t)[:128]
        c.set_tensor_2d(t, np.full(32, 7, np.float32).tobytes(), offset=128, size=64, n_copies=2, stride=64)
        assert (np.frombuffer(c.get_tensor(t), np.float32)[32:] == 7).all()
    assert srv.state.stats.rejected == 0


@pytest.mark.parametrize("case", ["rows_past_tensor", "offset_past_tensor", "zero_rows", "zero_size",
                                  "payload_short", "payload_long", "amplified_read", "unknown_buffer"])
def test_bad_2d_requests_close_the_connection(srv, case):
    c = srv.client()
    h, base = c.alloc_base(1 << 12)
    t = f32(h, base, 16, 4)                            # 256 bytes
    offset, size, n, stride = 0, 64, 2, 64
    if case == "rows_past_tensor":
        n = 5
    elif case == "offset_past_tensor":
        offset = 1 << 62
    elif case == "zero_rows":
        n = 0
    elif case == "zero_size":
        size = 0
    elif case == "amplified_read":                     # stride 0: a tiny span, a huge reply
        size, n, stride = 256, 1 << 20, 0
    elif case == "unknown_buffer":
        t = f32(h + 0x1000, base, 16, 4)
    head = t.pack() + struct.pack("<QQQQ", offset, size, n, stride)
    if case in ("payload_short", "payload_long"):
        data = bytes(size * n + (-1 if case == "payload_short" else 1))
        c.send(Cmd.SET_TENSOR_2D, head + data)
    elif case == "amplified_read":
        c.send(Cmd.GET_TENSOR_2D, head)
    else:
        c.send(Cmd.SET_TENSOR_2D, head + bytes(size * n))
    expect_closed(srv, c)


def test_comm_init_that_cannot_pair_is_answered_0(srv):
    """Bad ranks or world, or no peer: answered 0 (the client falls back to copies), the
    connection goes on; COMM_FREE without a link is a no-op without a reply."""
    with socket.socket() as taken:                     # a port nobody accepts on
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
    with srv.client() as c:
        assert c.comm_init(rank=0, world=3, port=port) == 0
        assert c.comm_init(rank=2, world=2, port=port) == 0
        assert c.comm_init(rank=1, world=2, port=0, host="127.0.0.1") == 0
        assert c.comm_init(rank=1, world=2, port=port, host="127.0.0.1") == 0     # nobody listens
        c.send(Cmd.COMM_FREE, struct.pack("<I", 0))
        assert c.device_count() == 1
    assert srv.state.stats.rejected == 0


@pytest.mark.parametrize("request_", [
    struct.pack("<IIII64s", 1, 0, 2, 51000, b""),           # COMM_INIT on a device that does not exist
    "allreduce", struct.pack("<I", 3),                     # COMM_ALLREDUCE without COMM_INIT; COMM_FREE dev 3
])
def test_bad_comm_requests_close_the_connection(srv, request_):
    c = srv.client()
    if request_ == "allreduce":
        h, base = c.alloc_base(1 << 12)
        c.send(Cmd.COMM_ALLREDUCE, struct.pack("<I", 0) + f32(h, base, 16).pack())
    elif len(request_) == 80:
        c.send(Cmd.COMM_INIT, request_)
    else:
        c.send(Cmd.COMM_FREE, request_)
    expect_closed(srv, c)


@pytest.fixture
def auto_srv():
    with serve(protocol=None) as st:
        yield st


def test_auto_protocol_answers_each_major_on_its_own_port(auto_srv, caplog):
    caplog.set_level(logging.WARNING, logger="ggml_rknpu.rpc")
    p7, p8 = auto_srv.server.ports[7], auto_srv.server.ports[8]
    assert p7 != p8
    with RpcClient(p7) as c:                            # checks HELLO == 7.0.0
        assert c.device_count() == 1
    with RpcClient(p8, major=8) as c:                   # checks HELLO == 8.0.0
        _, a, b, out = _add_graph(c)
        c.graph_compute([out], [a, b, out], uid=4)
        c.graph_recompute(uid=4)
        assert np.array_equal(c.get_array(out).ravel(), 1 + np.arange(16))
    with RpcClient(p7, hello=False) as c:               # an 8.x client on the 7.0.0 port: HELLO, abort
        assert c.hello() == (7, 0, 0)
    assert wait_until(lambda: any("right after HELLO" in r.getMessage() for r in caplog.records))
    line = next(r.getMessage() for r in caplog.records if "right after HELLO" in r.getMessage())
    assert f"connect it to port {p8}" in line and "8.0.0" in line
    assert auto_srv.state.stats.rejected == 0

