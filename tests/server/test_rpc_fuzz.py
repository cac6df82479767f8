"""Random and mutated requests never crash or wedge the server: after each one it either
answered, ignored, or closed that connection, and a fresh client still gets HELLO."""

from __future__ import annotations

import socket
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggml_rknpu.libggml.enums import GgmlOp
from ggml_rknpu.server.rpc import wire
from ggml_rknpu.server.rpc.wire import Cmd
from support.rpc_testkit import FakeNpu, ServerClosed, ServerThread, T, graph_payload

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def srv():
    st_ = ServerThread(npu=FakeNpu(), stall_timeout_s=0.5)
    yield st_
    st_.stop()


def _valid_graph_session(c) -> tuple[bytes, bytes]:
    """A valid SET_TENSOR and GRAPH_COMPUTE for this connection, to be mutated."""
    h, base = c.alloc_base(4096)
    a, b = T(ne=(8, 1, 1, 1), buffer=h, data=base), T(ne=(8, 1, 1, 1), buffer=h, data=base + 64)
    out = T(ne=(8, 1, 1, 1), buffer=h, data=base + 128, op=int(GgmlOp.ADD), src=(a.id, b.id))
    set_req = wire.pack_request(Cmd.SET_TENSOR, a.pack() + struct.pack("<BQ", 0, 0) + bytes(32))
    graph_req = wire.pack_request(Cmd.GRAPH_COMPUTE, graph_payload([out], [a, b, out]))
    return set_req, graph_req


def _finish(srv, c) -> None:
    c.sock.settimeout(5)
    try:
        c.sock.shutdown(socket.SHUT_WR)        # EOF: the server must finish this client either way
        while c.sock.recv(65536):
            pass
    except OSError:
        pass
    c.close()
    assert srv.alive()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cmd=st.integers(0, 255), size=st.integers(0, 4000), data=st.binary(max_size=4000))
def test_random_requests(srv, cmd, size, data):
    c = srv.client()
    c.sock.sendall(struct.pack("<BQ", cmd, size) + data[:size])
    _finish(srv, c)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(["set", "graph"]), flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)),
                                                              min_size=1, max_size=6))
def test_mutated_valid_requests(srv, which, flips):
    c = srv.client()
    set_req, graph_req = _valid_graph_session(c)
    req = bytearray(set_req if which == "set" else graph_req)
    for pos, value in flips:
        req[9 + pos % (len(req) - 9)] = value           # keep the header, corrupt the payload
    c.sock.sendall(bytes(req))
    c.sock.sendall(wire.pack_request(Cmd.DEVICE_COUNT))
    try:                                                # either it still answers in order, or it closed
        assert c.reply(expect=4) == struct.pack("<I", 1)
    except (ServerClosed, ConnectionResetError):
        pass
    _finish(srv, c)
