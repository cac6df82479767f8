"""Clients of another RPC protocol major get a log line naming both versions and what to do.

The HELLO request has the same layout in 7.x and 8.x and carries no version: the llama.cpp
client compares the major of our reply with its own and aborts on a mismatch. A protocol-8
client is therefore seen as a connection that closes right after HELLO, or, if it goes on,
by requests only protocol 8 has.
"""

from __future__ import annotations

import logging
import struct
import time

import pytest

from ggml_rknpu.server.rpc import wire
from ggml_rknpu.server.rpc.wire import Cmd
from support.rpc_testkit import RpcClient, serve

pytestmark = pytest.mark.timeout(60)
CLIENT_PROTO = (8, 0, 0)   # llama.cpp master from b11458 [anchors.md: llama.cpp RPC]


@pytest.fixture
def srv():
    with serve() as st:
        yield st


def _server_warnings(caplog, timeout: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = [r.getMessage() for r in caplog.records
                 if r.name == "ggml_rknpu.rpc" and r.levelno >= logging.WARNING]
        if lines:
            return lines
        time.sleep(0.02)
    return []


def _assert_names_both_versions_and_fix(line: str, client: str) -> None:
    assert "7.0.0" in line and client in line
    assert "rknpu serve --protocol 8" in line and "b11458" in line


def test_protocol8_client_refusing_our_hello_is_logged(srv, caplog):
    """What llama.cpp's negotiate_hello does: HELLO, compare the major, abort on a mismatch."""
    caplog.set_level(logging.WARNING, logger="ggml_rknpu.rpc")
    with RpcClient(srv.port, hello=False) as c:
        major, minor, patch = c.hello()
        assert (major, minor, patch) == wire.PROTO_VERSION
        assert major != CLIENT_PROTO[0]          # the client's check fails: it closes at once
    lines = _server_warnings(caplog)
    assert len(lines) == 1, lines
    _assert_names_both_versions_and_fix(lines[0], "8.0.0")
    assert "right after HELLO" in lines[0]
    assert srv.alive()


def test_a_served_client_is_not_mistaken_for_a_mismatch(srv, caplog):
    caplog.set_level(logging.WARNING, logger="ggml_rknpu.rpc")
    with srv.client() as c:
        assert c.device_count() == 1
    assert srv.server.wait_idle(timeout=5)          # the session has ended: it logged all it will
    assert [r for r in caplog.records if r.name == "ggml_rknpu.rpc" and r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize("request_, names", [
    (struct.pack("<BQ", 18, 0), "SET_TENSOR_2D"),
    (struct.pack("<BQIQ", Cmd.GRAPH_RECOMPUTE, 12, 0, 1), "graph uid"),
])
def test_protocol8_requests_are_refused_by_name(srv, caplog, request_, names):
    caplog.set_level(logging.WARNING, logger="ggml_rknpu.rpc")
    c = srv.client()
    c.sock.sendall(request_)
    assert c.is_closed_by_server()
    c.close()
    lines = _server_warnings(caplog)
    assert len(lines) == 1, lines
    _assert_names_both_versions_and_fix(lines[0], "8.x")
    assert names in lines[0]
    assert srv.alive() and srv.state.stats.rejected == 1


def test_hello_without_conn_caps_names_an_older_protocol(srv, caplog):
    caplog.set_level(logging.WARNING, logger="ggml_rknpu.rpc")
    c = srv.client(hello=False)
    c.sock.sendall(struct.pack("<BQ", Cmd.HELLO, 0))
    assert c.is_closed_by_server()
    c.close()
    lines = _server_warnings(caplog)
    assert "older than 7.0" in lines[0] and "7.0.0" in lines[0] and "scripts/build-llama-cpp" in lines[0]
    assert "--protocol 7" in lines[0] and "--protocol 8" in lines[0]
