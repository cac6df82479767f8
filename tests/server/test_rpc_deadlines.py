"""Message deadlines: inside a message (and a reply) every recv (send) makes progress within
``--stall-timeout``, and the whole completes within ``stall + bytes / --min-rate`` of its first
byte (a header within the stall timeout). A slow link above the rate is served; a staller, a
trickler, a slow header and a slow reader are dropped, each counted and logged with its reason,
while other clients are served."""

from __future__ import annotations

import logging
import struct
import time

import numpy as np
import pytest

from ggml_rknpu.server.rpc import report, wire
from ggml_rknpu.server.rpc.deadlines import KIB
from ggml_rknpu.server.rpc.wire import Cmd
from support.rpc_testkit import RpcClient, ServerClosed, T, serve

pytestmark = pytest.mark.timeout(60)
SLACK_S = 1.0            # a loaded 2-core box: how late a drop may be seen after its deadline
EARLY_S = 0.05           # socket timeouts round up, so a drop is never earlier than this before it
MIB = 1 << 20


def _closed_after(c: RpcClient, t0: float, timeout: float = 10.0) -> float:
    """Seconds from ``t0`` until the server closed ``c`` (AssertionError: still open)."""
    assert c.is_closed_by_server(timeout=timeout)
    return time.monotonic() - t0


def test_a_trickler_is_dropped_at_its_deadline_while_another_client_is_served(caplog):
    """One byte of a HELLO payload every 0.2 s: each within the 1 s stall timeout, so only the
    deadline (1 s + 24 bytes at 24 B/s = 2 s after the first byte) ends it."""
    caplog.set_level(logging.WARNING, "ggml_rknpu.rpc")
    stall_s, trickle_s = 1.0, 0.2
    request = wire.pack_request(Cmd.HELLO, bytes(wire.HELLO_REQ.size))
    header = wire.REQUEST_HEADER.size
    payload = len(request) - header
    rate_kib_s = payload / KIB / 1.0            # the payload buys 1 s beyond the stall timeout
    deadline_s = stall_s + 1.0
    with serve(stall_timeout_s=stall_s, min_rate_kib_s=rate_kib_s) as st:
        trickler = RpcClient(st.port, hello=False)
        t0 = time.monotonic()
        trickler.sock.sendall(request[:header])
        closed_s = other_done_s = None
        for i in range(payload):
            trickler.sock.sendall(request[header + i:header + i + 1])
            if i == 2:                           # meanwhile another client, served at once
                with st.client() as other:
                    assert other.device_count() == 1
                other_done_s = time.monotonic() - t0
            if trickler.is_closed_by_server(timeout=trickle_s):
                closed_s = time.monotonic() - t0
                break
        trickler.close()
        assert closed_s is not None and i < payload - 1, "the trickler's HELLO was never cut"
        assert deadline_s - EARLY_S <= closed_s <= deadline_s + SLACK_S, closed_s
        assert other_done_s is not None and other_done_s < deadline_s - 0.5, other_done_s
        assert st.server.wait_idle(timeout=5)
        c = st.state.sessions
        assert (c.too_slow, c.stalled, st.state.stats.rejected) == (1, 0, 1)
        assert report.stats_dict(st.state)["sessions"]["too_slow"] == 1
        assert "0 stalled, 1 too slow" in report.render_stats(st.state)
        assert (f"a HELLO message of {len(request)} bytes not complete within 2.0 s (--stall-timeout 1 s + "
                f"{payload} bytes at --min-rate {rate_kib_s:g} KiB/s)") in caplog.text


def _slow_upload(c: RpcClient, t: T, data: bytes, chunks: int, pause_s: float) -> bool:
    """A SET_TENSOR in ``chunks`` pieces, ``pause_s`` apart; False if the server cut it."""
    request = wire.pack_request(Cmd.SET_TENSOR, t.pack() + struct.pack("<BQ", 0, 0) + data)
    head = len(request) - len(data)
    piece = len(data) // chunks
    try:
        c.sock.sendall(request[:head + piece])
        for i in range(1, chunks):
            time.sleep(pause_s)
            c.sock.sendall(request[head + i * piece:head + (i + 1) * piece])
    except (BrokenPipeError, ConnectionResetError):
        return False
    return True


@pytest.mark.parametrize("rate_kib_s,served", [(128.0, True), (1024.0, False)])
def test_a_slow_upload_is_served_above_the_minimum_rate_and_dropped_below(caplog, rate_kib_s, served):
    """256 KiB in 8 pieces 0.15 s apart (~1.05 s, ~240 KiB/s; each pause under the 0.5 s stall
    timeout, the whole above it): within 0.5 s + 256 KiB / 128 KiB/s = 2.5 s it is served and
    its bytes are right; against 1024 KiB/s (0.75 s) it is dropped as too slow."""
    caplog.set_level(logging.WARNING, "ggml_rknpu.rpc")
    stall_s, chunks, pause_s = 0.5, 8, 0.15
    data = np.random.default_rng(0).integers(0, 256, 256 * KIB, dtype=np.uint8).tobytes()
    deadline_s = stall_s + (wire.SET_TENSOR_HEADER_SIZE + len(data)) / (rate_kib_s * KIB)
    with serve(stall_timeout_s=stall_s, min_rate_kib_s=rate_kib_s) as st:
        with st.client() as c:
            h, b = c.alloc_base(len(data))
            t = T(ne=(len(data) // 4, 1, 1, 1), buffer=h, data=b, name="slow")
            t0 = time.monotonic()
            sent = _slow_upload(c, t, data, chunks, pause_s)
            took_s = time.monotonic() - t0
            if served:                           # slower than the stall timeout, inside the deadline
                assert sent and stall_s < took_s < deadline_s, (took_s, deadline_s)
                assert c.get_tensor(t) == data
            else:                                # the pace (7 pauses, 1.05 s) is past the deadline
                assert (chunks - 1) * pause_s > deadline_s and c.is_closed_by_server(timeout=10)
        assert st.server.wait_idle(timeout=5)
        assert (st.state.sessions.too_slow, st.state.sessions.stalled) == (0 if served else 1, 0)
        message = f"a SET_TENSOR message of {wire.REQUEST_HEADER.size + wire.SET_TENSOR_HEADER_SIZE + len(data)} bytes"
        assert (f"{message} not complete within {deadline_s:.1f} s" in caplog.text) != served


def test_a_header_has_the_stall_timeout_from_its_first_byte(caplog):
    """A header sent a byte every 0.3 s (each within the 1 s stall timeout) is dropped 1 s after
    its first byte as too slow; three header bytes and then nothing is a stall."""
    caplog.set_level(logging.WARNING, "ggml_rknpu.rpc")
    stall_s = 1.0
    header = wire.pack_request(Cmd.DEVICE_COUNT)
    with serve(stall_timeout_s=stall_s) as st:
        staller = RpcClient(st.port, hello=False)
        staller.sock.sendall(header[:3])
        t_staller = time.monotonic()
        slow = RpcClient(st.port, hello=False)
        t0 = time.monotonic()
        sent = 0
        for i in range(len(header)):
            slow.sock.sendall(header[i:i + 1])
            sent += 1
            if slow.is_closed_by_server(timeout=0.3):
                break
        closed_s = time.monotonic() - t0
        assert sent < len(header) and stall_s - EARLY_S <= closed_s <= stall_s + SLACK_S, (sent, closed_s)
        assert stall_s - EARLY_S <= _closed_after(staller, t_staller) <= stall_s + SLACK_S
        slow.close()
        staller.close()
        assert st.server.wait_idle(timeout=5)
        assert (st.state.sessions.too_slow, st.state.sessions.stalled, st.state.stats.rejected) == (1, 1, 2)
        assert "a message header (9 bytes) not complete within 1 s of its first byte (--stall-timeout)" in caplog.text
        assert "no progress for 1 s in a message header (9 bytes) (--stall-timeout)" in caplog.text


@pytest.mark.parametrize("rate_kib_s,served", [(4 * KIB, True), (32 * KIB, False)])
def test_a_reply_to_a_slow_reader_has_the_same_deadline(caplog, rate_kib_s, served):
    """A 16 MiB GET_TENSOR read 1 MiB every 0.15 s through a 64 KiB receive buffer (~2.4 s, each
    pause under the 0.5 s stall timeout): served within 0.5 s + 16 MiB / 4 MiB/s = 4.5 s (one
    sendall would have been cut at 0.5 s), dropped as too slow against 32 MiB/s (1 s)."""
    caplog.set_level(logging.WARNING, "ggml_rknpu.rpc")
    stall_s, n, piece, pause_s = 0.5, 16 * MIB, MIB, 0.15
    data = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8).tobytes()
    with serve(stall_timeout_s=stall_s, min_rate_kib_s=rate_kib_s) as st:
        with RpcClient(st.port, rcvbuf=64 * KIB) as c:
            h, b = c.alloc_base(n)
            t = T(ne=(n // 4, 1, 1, 1), buffer=h, data=b, name="big")
            c.set_tensor(t, data)
            c.send(Cmd.GET_TENSOR, t.pack() + struct.pack("<QQ", 0, n))
            got = bytearray()
            t0 = time.monotonic()
            try:
                assert struct.unpack("<Q", c.recv_exact(8))[0] == n
                while len(got) < n:
                    got += c.recv_exact(min(piece, n - len(got)))
                    time.sleep(pause_s)
            except (ServerClosed, ConnectionResetError):
                pass
            took_s = time.monotonic() - t0
        if served:
            assert bytes(got) == data and took_s > stall_s, took_s
        else:
            assert len(got) < n, len(got)
        assert st.server.wait_idle(timeout=5)
        assert (st.state.sessions.too_slow, st.state.sessions.stalled) == (0 if served else 1, 0)
        assert (f"a reply of {n + 8} bytes not complete within" in caplog.text) != served
