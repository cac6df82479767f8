"""Concurrent sessions: every connection is served at once, a stalled or idle client costs the
others nothing, work on shared state takes FIFO turns, staged weights are shared by content
while their users live, and the per-connection limits (memory, count, timeouts) refuse with a
logged reason."""

from __future__ import annotations

import logging
import struct
import threading
import time

import numpy as np
import pytest

from ggml_rknpu.kernel.errors import NpuTimeout
from ggml_rknpu.libggml.enums import GgmlOp
from ggml_rknpu.server.rpc import wire
from ggml_rknpu.server.rpc.wire import Cmd
from ggml_rknpu.server.turns import Turns
from support.rpc_testkit import FakeNpu, FaultyNpu, RpcClient, T, serve, wait_until

pytestmark = pytest.mark.timeout(120)
K, N, M = 64, 48, 5
HAMMERED = 60            # computes two hammering clients make between them


def fp16(w: np.ndarray) -> np.ndarray:
    return w.astype(np.float16).astype(np.float32)


class Model:
    """One client's weight W (uploaded once) and graph out = x @ W^T, computed on demand."""

    def __init__(self, c: RpcClient, w: np.ndarray) -> None:
        self.c = c
        wh, wb = c.alloc_base(1 << 16)
        ch, cb = c.alloc_base(1 << 16)
        self.wt = T(ne=(K, N, 1, 1), buffer=wh, data=wb, name="blk.0.attn_q.weight")
        c.set_tensor(self.wt, w.tobytes())
        self.x = T(ne=(K, M, 1, 1), buffer=ch, data=cb, name="x")
        self.out = T(ne=(N, M, 1, 1), buffer=ch, data=cb + 8192, op=int(GgmlOp.MUL_MAT),
                     src=(self.wt.id, self.x.id), name="out")

    def compute(self, xv: np.ndarray) -> np.ndarray:
        self.c.set_array(self.x, xv)
        self.c.graph_compute([self.out], [self.wt, self.x, self.out])
        return self.c.get_array(self.out).reshape(M, N)


def _raw(port: int) -> RpcClient:
    return RpcClient(port, hello=False)


def _client_seconds(st, w: np.ndarray, xv: np.ndarray) -> float:
    """A whole short client (HELLO, upload, compute, read, close): its wall time, result checked."""
    t0 = time.perf_counter()
    with st.client() as c:
        got = Model(c, w).compute(xv)
    np.testing.assert_allclose(got, xv @ fp16(w).T, rtol=2e-3, atol=2e-2)
    return time.perf_counter() - t0


def test_stallers_mid_message_do_not_delay_another_client():
    """One connection with half a HELLO header, then 50 stopped inside a SET_TENSOR payload:
    a client next to them takes about its time alone (the stall timeout is 120 s)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((N, K)).astype(np.float32)
    xv = rng.standard_normal((M, K)).astype(np.float32)
    with serve(npu=FakeNpu()) as st:
        alone = min(_client_seconds(st, w, xv) for _ in range(3))
        half_hello = _raw(st.port)
        half_hello.sock.sendall(wire.pack_request(Cmd.HELLO)[:1])
        stallers = []
        for _ in range(50):
            c = RpcClient(st.port)
            h, b = c.alloc_base(4096)
            t = T(ne=(1024, 1, 1, 1), buffer=h, data=b, name="stalled")
            c.sock.sendall(wire.pack_request(Cmd.SET_TENSOR, t.pack() + struct.pack("<Q", 0) + bytes(4096))[:-1000])
            stallers.append(c)
        try:
            assert st.server.wait_idle(timeout=5, leave=51) and st.server.session_count == 51
            beside = sorted(_client_seconds(st, w, xv) for _ in range(3))
            # about its time alone (a loaded 2-core box: 5x or 2 s), and never near the 120 s stall timeout
            assert beside[1] < max(5 * alone, 2.0) and beside[-1] < 30, (alone, beside)
            assert st.server.wait_idle(timeout=5, leave=51)    # the three clients' sessions have closed ...
            assert st.server.session_count == 51 and st.state.sessions.stalled == 0   # ... the stallers' not
        finally:
            half_hello.close()
            for c in stallers:
                c.close()
        assert st.server.wait_idle(timeout=10)
        assert st.state.sessions.peak >= 52 and st.state.sessions.now == 0


def test_idle_timeout_is_off_by_default_and_closes_an_idle_client_when_set():
    with serve(stall_timeout_s=0.2) as st:
        with st.client() as idle:
            time.sleep(0.6)                              # idle between messages: no timeout by default
            assert idle.device_count() == 1
    with serve(idle_timeout_s=0.3) as st:
        with st.client() as idle:
            assert idle.is_closed_by_server(timeout=5)
        assert st.server.wait_idle(timeout=5)
        assert st.state.sessions.idle_closed == 1 and st.state.stats.rejected == 0


def test_connections_over_the_cap_are_refused_at_accept_and_the_others_keep_working(caplog):
    with serve(max_clients=3) as st:
        clients = [st.client() for _ in range(3)]
        try:
            extra = _raw(st.port)
            assert extra.is_closed_by_server(timeout=5)
            extra.close()
            assert st.state.sessions.refused_at_accept == 1
            assert "connections are being served (--max-clients)" in caplog.text
            assert [c.device_count() for c in clients] == [1, 1, 1]
        finally:
            for c in clients:
                c.close()
        assert st.alive()


def test_session_memory_limit_refuses_with_a_reason_and_reports_what_is_left(caplog):
    caplog.set_level(logging.WARNING, "ggml_rknpu.rpc")
    with serve(session_memory=1 << 20) as st:
        with st.client() as a, st.client() as b:
            assert a.alloc(600 << 10)[0] != 0
            assert a.device_memory()[0] == (1 << 20) - (600 << 10)
            assert a.alloc(600 << 10) == (0, 0)            # refused: over this connection's limit
            assert b.alloc(600 << 10)[0] != 0              # the other connection has its own
            assert st.state.sessions.over_session_memory == 1
        assert "--session-memory allows 1048576" in caplog.text
        assert st.alive() and st.state.memory.allocated == 0


def test_concurrent_sessions_share_staged_weights_by_content_until_the_last_leaves():
    """Two connections uploading the same bytes use one staged copy; it stays while either
    lives and is retired after the last (freed with --no-weight-reuse)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((N, K)).astype(np.float32)
    xv = rng.standard_normal((M, K)).astype(np.float32)
    for reuse in (True, False):
        npu = FakeNpu()
        with serve(npu=npu, weight_reuse=reuse) as st:
            live, ws = st.state.live, st.state.weight_stats
            a, b = st.client(), st.client()
            ma, mb = Model(a, w), Model(b, w)
            np.testing.assert_allclose(ma.compute(xv), xv @ fp16(w).T, rtol=2e-3, atol=2e-2)
            np.testing.assert_allclose(mb.compute(xv), xv @ fp16(w).T, rtol=2e-3, atol=2e-2)
            if reuse:
                assert (npu.uploads, live.copies, live.shared, ws.staged) == (1, 1, 1, 2)
            else:                                       # no content key: each its own copy
                assert (npu.uploads, live.copies, live.shared, ws.staged) == (2, 0, 0, 2)
            a.close()
            assert st.server.wait_idle(timeout=5, leave=1)
            np.testing.assert_allclose(mb.compute(xv), xv @ fp16(w).T, rtol=2e-3, atol=2e-2)
            assert npu.frees == (0 if reuse else 1) and ws.staged == 1
            b.close()
            assert st.server.wait_idle(timeout=5)
            assert (live.copies, ws.staged) == (0, 0)
            assert (ws.retired_now, npu.frees) == ((1, 0) if reuse else (0, 2))


def test_a_reset_in_one_session_restages_the_weights_of_the_other():
    """An NPU reset destroys every staged copy: the session that saw the fault and the one
    next to it both stage again (no stale handle, no demotion, the right result)."""
    rng = np.random.default_rng(2)
    w1, w2 = (rng.standard_normal((N, K)).astype(np.float32) for _ in range(2))
    xv = rng.standard_normal((M, K)).astype(np.float32)
    npu = FaultyNpu(reset_loses_weights=True)
    with serve(npu=npu) as st:
        with st.client() as a, st.client() as b:
            ma, mb = Model(a, w1), Model(b, w2)
            ma.compute(xv)
            mb.compute(xv)
            assert npu.uploads == 2
            npu.faults.append(NpuTimeout("injected"))
            np.testing.assert_allclose(ma.compute(xv), xv @ fp16(w1).T, rtol=2e-3, atol=2e-2)
            np.testing.assert_allclose(mb.compute(xv), xv @ fp16(w2).T, rtol=2e-3, atol=2e-2)
            assert npu.resets == 1 and npu.uploads == 4
            assert st.state.recovery.restaged == 2 and st.state.weight_stats.failures == 0


class SlowNpu(FakeNpu):
    """A FakeNpu whose matmul takes 5 ms of device time (a sleep: the GIL is free, the turn held)."""

    def matmul(self, a, w, *, out=None):
        time.sleep(0.005)
        return super().matmul(a, w, out=out)


def _hammer(st, w, xv, stop, done, i, errors) -> None:
    """Compute back to back until ``stop``; count into ``done[i]``; failures into ``errors``."""
    want = xv @ fp16(w).T
    try:
        with st.client() as c:
            m = Model(c, w)
            while not stop.is_set():
                np.testing.assert_allclose(m.compute(xv), want, rtol=2e-3, atol=2e-2)
                done[i] += 1
    except BaseException as exc:   # reported by the test, in its own thread
        errors.append(exc)


def test_two_sessions_hammering_compute_both_make_progress():
    """Two clients computing back to back until they have made HAMMERED computes between them:
    FIFO turns give each a fair share."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((N, K)).astype(np.float32)
    xv = rng.standard_normal((M, K)).astype(np.float32)
    with serve(npu=SlowNpu()) as st:
        done = [0, 0]
        stop = threading.Event()
        errors: list[BaseException] = []
        threads = [threading.Thread(target=_hammer, args=(st, w, xv, stop, done, i, errors)) for i in range(2)]
        for t in threads:
            t.start()
        finished = wait_until(lambda: sum(done) >= HAMMERED or bool(errors), timeout=60)
        stop.set()
        for t in threads:
            t.join(timeout=30)
        assert not errors, errors
        assert finished and min(done) >= 0.3 * sum(done), done
        assert st.state.turns.waited > 0                   # they did contend for turns


def test_turns_are_granted_in_the_order_they_were_asked_for():
    turns = Turns()
    order: list[int] = []
    turns.__enter__()
    threads = []
    for i in range(8):
        def take(i: int = i) -> None:
            with turns:
                order.append(i)
        t = threading.Thread(target=take)
        t.start()
        deadline = time.monotonic() + 5
        while turns.waited < i + 1 and time.monotonic() < deadline:   # queued before the next starts
            time.sleep(0.001)
        threads.append(t)
    turns.__exit__(None, None, None)
    for t in threads:
        t.join(timeout=5)
    assert order == list(range(8))
    assert (turns.granted, turns.waited) == (9, 8)
