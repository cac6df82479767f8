"""Random and mutated requests never crash or wedge the server: after each one it either
answered, ignored, or closed that connection, and a fresh client still gets HELLO."""

from __future__ import annotations

import os
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
SLOW_EXAMPLES = int(os.environ.get("RKNPU_FUZZ_SLOW_EXAMPLES", "3000"))


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


# --- protocol 8.0.0: the five new commands and the graph uid paths -----------------------------
@pytest.fixture(scope="module")
def srv8():
    st_ = ServerThread(npu=FakeNpu(), stall_timeout_s=0.5, protocol=8)
    yield st_
    st_.stop()


def _valid_protocol8_requests(c) -> dict[str, bytes]:
    """One valid request of every command 8.0.0 adds or changes, for this connection."""
    h, base = c.alloc_base(4096)
    a, b = T(ne=(8, 4, 1, 1), buffer=h, data=base), T(ne=(8, 4, 1, 1), buffer=h, data=base + 128)
    out = T(ne=(8, 4, 1, 1), buffer=h, data=base + 256, op=int(GgmlOp.ADD), src=(a.id, b.id))
    rows = struct.pack("<QQQQ", 16, 8, 3, 32)                    # offset, size, n_copies, stride
    return {
        "graph": wire.pack_request(Cmd.GRAPH_COMPUTE, graph_payload([out], [a, b, out], uid=11)),
        "recompute": wire.pack_request(Cmd.GRAPH_RECOMPUTE, struct.pack("<IQ", 0, 11)),
        "set_2d": wire.pack_request(Cmd.SET_TENSOR_2D, a.pack() + rows + bytes(24)),
        "get_2d": wire.pack_request(Cmd.GET_TENSOR_2D, a.pack() + rows),
        "comm_init": wire.pack_request(Cmd.COMM_INIT, struct.pack("<IIII64s", 0, 0, 2, 1, b"")),
        "allreduce": wire.pack_request(Cmd.COMM_ALLREDUCE, struct.pack("<I", 0) + out.pack()),
        "comm_free": wire.pack_request(Cmd.COMM_FREE, struct.pack("<I", 0)),
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cmd=st.integers(0, 30), size=st.integers(0, 800), data=st.binary(max_size=800))
def test_random_protocol8_requests(srv8, cmd, size, data):
    c = srv8.client()
    c.sock.sendall(struct.pack("<BQ", cmd, size) + data[:size])
    _finish(srv8, c)


_PROTOCOL8_MUTATION = {
    "which": st.sampled_from(["graph", "recompute", "set_2d", "get_2d", "comm_init", "allreduce", "comm_free"]),
    "flips": st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6),
    "resize": st.integers(-3, 3),
}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**_PROTOCOL8_MUTATION)
def test_mutated_protocol8_requests(srv8, which, flips, resize):
    _send_mutated_protocol8(srv8, which, flips, resize)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@settings(max_examples=SLOW_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**_PROTOCOL8_MUTATION)
def test_mutated_protocol8_requests_slow(srv8, which, flips, resize):
    """The same mutations as the CI subset, many more of them."""
    _send_mutated_protocol8(srv8, which, flips, resize)


def _send_mutated_protocol8(srv8, which: str, flips: list[tuple[int, int]], resize: int) -> None:
    """Send one mutated 8.0.0 request after a valid uid graph, then DEVICE_COUNT: the server
    either still answers in order or closes this connection, and serves the next client."""
    c = srv8.client()
    reqs = _valid_protocol8_requests(c)
    c.sock.sendall(reqs["graph"])                           # uid 11 stored, so "recompute" is valid
    req = bytearray(reqs[which])
    for pos, value in flips:
        req[9 + pos % (len(req) - 9)] = value
    if resize:                                              # a size field that disagrees with the payload
        struct.pack_into("<Q", req, 1, max(0, len(req) - 9 + resize))
    c.sock.sendall(bytes(req))
    c.sock.sendall(wire.pack_request(Cmd.DEVICE_COUNT))
    try:
        while True:                                         # replies of the mutated request, then ours
            if c.reply() == struct.pack("<I", 1):
                break
    except (ServerClosed, ConnectionResetError, TimeoutError, AssertionError):
        pass
    _finish(srv8, c)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(st.sampled_from(["compute", "recompute", "free"]), st.integers(0, 5)),
                      min_size=1, max_size=25))
def test_uid_sequences_follow_the_clients_rule(srv8, steps):
    """A client that follows upstream's rule (recompute only uids it sent since the last
    FREE_BUFFER-free point; 0 never) is served to the end with correct results; the first uid it
    never sent closes the connection."""
    c = srv8.client()
    h, base = c.alloc_base(4096)
    a, b = T(ne=(8, 1, 1, 1), buffer=h, data=base), T(ne=(8, 1, 1, 1), buffer=h, data=base + 64)
    out = T(ne=(8, 1, 1, 1), buffer=h, data=base + 128, op=int(GgmlOp.ADD), src=(a.id, b.id))
    c.set_tensor(b, struct.pack("<8f", *range(8)))
    sent: set[int] = set()
    for i, (op, uid) in enumerate(steps):
        c.set_tensor(a, struct.pack("<8f", *([float(i)] * 8)))
        if op == "free":
            spare, _ = c.alloc(64)
            c.free(spare)                                   # the server drops its graphs, not the uids
            sent.clear()                                    # a rule-abiding client rebuilds them
            continue
        if op == "recompute" and uid in sent:
            c.graph_recompute(uid=uid)
        else:
            c.graph_compute([out], [a, b, out], uid=uid)
            if uid:
                sent.add(uid)
        assert struct.unpack("<8f", c.get_tensor(out)) == tuple(float(i + k) for k in range(8))
    c.graph_recompute(uid=99)
    assert c.is_closed_by_server()
    c.close()
    assert srv8.alive()
