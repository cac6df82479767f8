"""Client churn against one server on the simulated NPU: clients that leave cleanly, in the
middle of a message, in the middle of SET_TENSOR of a large weight, or right after sending a
graph, leave nothing behind (buffers, plans, staged weights, NPU memory, RSS), and the next
client is served.

Margins (stated): after the last cycle, NPU memory and the simulated kernel's live objects
equal what they were after the first cycle exactly; host RSS grows by at most RSS_MARGIN.
The full counts of the issue run in CI (10 000 allocate/free cycles: ~1 s; 200 connections,
each kind of drop 50 times: ~6 s, measured on the 2-core x86 box).
"""

from __future__ import annotations

import logging
import struct

import numpy as np
import pytest

import ggml_rknpu
from ggml_rknpu.libggml.enums import GgmlOp
from ggml_rknpu.server.rpc import wire
from ggml_rknpu.server.rpc.wire import Cmd
from support.rpc_testkit import T, graph_payload, serve

MUL_MAT = int(GgmlOp.MUL_MAT)
RSS_MARGIN = 8 << 20
K, N, M = 512, 512, 2
W_BYTES = N * K * 4                        # a 1 MiB f32 weight


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.fixture
def sim_server():
    # pytest keeps every log record, and a "closing client: <exception>" record keeps the
    # exception's traceback - the dropped session's frames and buffers - alive: that would be
    # the test harness's RSS, not the server's. Warnings are not recorded here.
    logger = logging.getLogger("ggml_rknpu.rpc")
    level = logger.level
    logger.setLevel(logging.ERROR)
    npu = ggml_rknpu.open(device="sim-rknpu")
    try:
        with serve(npu=npu) as st:
            yield st, npu
    finally:
        npu.close()
        logger.setLevel(level)


def _footprint(st, npu, client=None) -> dict:
    """Everything that must not grow: server buffers, staged and retired weights, NPU memory, kernel
    objects. Synchronised by a reply on ``client``, or by a new connection (the previous session
    has then been torn down)."""
    assert client.device_count() == 1 if client is not None else st.alive()
    w = st.state.weight_stats
    kernel = npu.device.syscalls.stats()
    return {"buffer_bytes": st.state.memory.allocated, "staged": w.staged, "host_now": w.host_now,
            "retired_now": w.retired_now, "npu_used": npu.memory_used(), "objects": kernel["objects"],
            "handles": kernel["handles"], "mappings": kernel["mappings"]}


def _cycle(st, weight: np.ndarray, kind: int) -> None:
    """One client: upload a weight and run a matmul, or leave early in one of three ways."""
    c = st.client()
    try:
        wh, wb = c.alloc_base(W_BYTES)
        ch, cb = c.alloc_base(1 << 16)
        w = T(ne=(K, N, 1, 1), buffer=wh, data=wb, name="blk.0.w")
        x = T(ne=(K, M, 1, 1), buffer=ch, data=cb, name="x")
        out = T(ne=(N, M, 1, 1), buffer=ch, data=cb + 8192, op=MUL_MAT, src=(w.id, x.id), name="out")
        if kind == 1:                      # mid-SET_TENSOR of the large weight
            payload = w.pack() + struct.pack("<BQ", 0, 0) + weight.tobytes()
            c.sock.sendall(wire.pack_request(Cmd.SET_TENSOR, payload)[: len(payload) // 2])
            return
        c.set_array(w, weight)
        xs = np.ones((M, K), np.float32)
        c.set_array(x, xs)
        if kind == 2:                      # mid-message: half a request header
            c.sock.sendall(wire.pack_request(Cmd.GET_ALIGNMENT, struct.pack("<I", 0))[:5])
            return
        c.send(Cmd.GRAPH_COMPUTE, graph_payload([out], [w, x, out]))
        if kind == 3:                      # mid-graph: gone before reading anything back
            return
        got = c.get_array(out).reshape(M, N)
        np.testing.assert_allclose(got, xs @ weight.T, rtol=2e-2, atol=5e-2)
    finally:
        c.close()


def _churn(st, npu, n_cycles: int) -> tuple[dict, dict, int]:
    weight = np.random.default_rng(0).standard_normal((N, K)).astype(np.float32)
    for kind in range(4):                  # every path once before the first measurement
        _cycle(st, weight, kind)
    _cycle(st, weight, 0)
    first, rss_first = _footprint(st, npu), _rss()
    for i in range(1, n_cycles):
        _cycle(st, weight, i % 4)
    _cycle(st, weight, 0)                  # the last client is served normally
    return first, _footprint(st, npu), _rss() - rss_first


def _check(first: dict, last: dict, rss_growth: int) -> None:
    assert last == first, (first, last)
    assert first["buffer_bytes"] == 0 and first["staged"] == 0 and first["retired_now"] == 1
    assert rss_growth <= RSS_MARGIN, f"RSS grew by {rss_growth / 2**20:.1f} MiB"


@pytest.mark.timeout(600)
def test_two_hundred_clients_dropping_anywhere_leave_nothing_behind(sim_server):
    st, npu = sim_server
    _check(*_churn(st, npu, 200))
    assert st.state.stats.rejected >= 100         # the truncated messages were seen as such


@pytest.mark.timeout(300)
def test_ten_thousand_allocate_free_cycles_leave_nothing_behind(sim_server):
    st, npu = sim_server
    with st.client() as c:
        def cycle(size: int) -> None:
            handle, _ = c.alloc(size)
            c.free(handle)

        cycle(1 << 20)
        first, rss_first = _footprint(st, npu, c), _rss()
        for i in range(10_000):
            cycle(4096 + (i % 64) * 65536)          # 4 KiB .. 4 MiB
        last, rss_growth = _footprint(st, npu, c), _rss() - rss_first
    assert last == first and first["buffer_bytes"] == 0
    assert rss_growth <= RSS_MARGIN, f"RSS grew by {rss_growth / 2**20:.1f} MiB"
    assert st.state.stats.commands[Cmd.ALLOC_BUFFER] == 10_001 == st.state.stats.commands[Cmd.FREE_BUFFER]
