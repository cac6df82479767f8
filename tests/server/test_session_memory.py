"""Many short mutated sessions against one server on the simulated NPU leave nothing behind
that grows: each uploads a weight of its own (fresh bytes: a mutated model), runs a matmul
and then ends cleanly, with a corrupted request, or in the middle of a message.

What must hold: the retired copies stay within their budget, only sessions that ended with a
goodbye at a message boundary retire their weights (a hostile client cannot fill the cache),
and RSS after the last session is within 10% of RSS after the warm-up (the first tenth, at
most the first thousand: the retired copies reach their budget there). No malloc_trim: the server does not do it either.
The short version runs in CI (~5 s on the 2-core x86 box); the long one (20 000 sessions,
``RKNPU_SESSIONS_SLOW``) is slow."""

from __future__ import annotations

import logging
import os
import struct

import numpy as np
import pytest

import ggml_rknpu
from ggml_rknpu.libggml.enums import GgmlOp
from ggml_rknpu.server.rpc import wire
from ggml_rknpu.server.rpc.wire import Cmd
from support.proc_status import status_bytes
from support.rpc_testkit import ServerClosed, T, graph_payload, serve

MUL_MAT = int(GgmlOp.MUL_MAT)
K, N, M = 256, 256, 2                        # a 256 KiB f32 weight per session
BUDGET = 512 << 10                           # retired copies (128 KiB each): full within the warm-up
GROWTH_MAX = 4 << 20                         # one-off growth allowed after the warm-up (see below)
ENDINGS = ("clean", "corrupt", "truncated")
WARMUP_MAX = 1000                            # sessions before the reference RSS, at most


def _rss() -> int:
    rss = status_bytes("VmRSS")
    assert rss is not None
    return rss


@pytest.fixture
def sim_server():
    logger = logging.getLogger("ggml_rknpu.rpc")   # pytest keeps records, and their tracebacks
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    npu = ggml_rknpu.open(device="sim-rknpu")
    try:
        with serve(npu=npu, retired_budget=BUDGET) as st:
            yield st
    finally:
        npu.close()
        logger.setLevel(level)


def _session(st, rng: np.random.Generator, ending: str) -> None:
    c = st.client()
    try:
        wh, wb = c.alloc_base(N * K * 4)
        ch, cb = c.alloc_base(1 << 14)          # x at 0 (2 KiB), out at 4 KiB (2 KiB)
        w = T(ne=(K, N, 1, 1), buffer=wh, data=wb, name="blk.0.ffn_up.weight")
        x = T(ne=(K, M, 1, 1), buffer=ch, data=cb, name="x")
        out = T(ne=(N, M, 1, 1), buffer=ch, data=cb + 4096, op=MUL_MAT, src=(w.id, x.id), name="out")
        weight = rng.standard_normal((N, K)).astype(np.float32)
        c.set_array(w, weight)
        c.set_array(x, np.ones((M, K), np.float32))
        graph = bytearray(wire.pack_request(Cmd.GRAPH_COMPUTE, graph_payload([out], [w, x, out])))
        c.sock.sendall(graph)
        if ending == "clean":
            np.testing.assert_allclose(c.get_array(out).reshape(M, N), np.ones((M, K)) @ weight.T, rtol=2e-2, atol=5e-2)
        elif ending == "corrupt":                    # the same graph with bytes flipped: refused or run
            for _ in range(4):
                graph[9 + int(rng.integers(len(graph) - 9))] = int(rng.integers(256))
            c.sock.sendall(bytes(graph) + wire.pack_request(Cmd.DEVICE_COUNT))
            try:
                c.reply(expect=4)
            except (ServerClosed, OSError):
                pass
        else:                                        # half a request header, then gone
            c.sock.sendall(struct.pack("<BQ", int(Cmd.GET_ALIGNMENT), 4)[:5])
    finally:
        c.close()


def _warmup(n: int) -> int:
    return min(n // 10, WARMUP_MAX)


def _run(st, n: int) -> tuple[int, int]:
    """RSS after the warm-up of ``n`` sessions and after the last (both synchronised by a
    fresh connection: the previous session has been torn down)."""
    rng = np.random.default_rng(7)
    rss_warm = 0
    for i in range(n):
        _session(st, rng, ENDINGS[i % len(ENDINGS)])
        if i + 1 == _warmup(n):
            assert st.alive()
            rss_warm = _rss()
        if (i + 1) % WARMUP_MAX == 0:               # the curve, for the record (pytest -s)
            print(f"session {i + 1}: RSS {_rss() / 2**20:.1f} MiB", flush=True)
    assert st.alive()
    return rss_warm, _rss()


def _check(st, n: int, rss_warm: int, rss_last: int) -> None:
    w = st.state.weight_stats
    assert 0 < w.retired_bytes <= BUDGET and w.evicted_budget + w.evicted_staging > 0
    assert n // 3 <= w.retired <= n - n // 3            # the truncated sessions retired nothing
    assert w.staged == 0 and st.state.memory.allocated == 0
    print(f"RSS after {_warmup(n)} sessions {rss_warm / 2**20:.1f} MiB, after {n} {rss_last / 2**20:.1f} MiB")
    assert rss_last <= rss_warm * 1.10, f"RSS {rss_warm >> 20} -> {rss_last >> 20} MiB over {n} sessions"


@pytest.mark.timeout(600)
def test_short_mutated_sessions_keep_memory_flat(sim_server):
    n = int(os.environ.get("RKNPU_SESSIONS_SHORT", "300"))
    rss_warm, rss_last = _run(sim_server, n)
    _check(sim_server, n, rss_warm, rss_last)
    # tighter than the 10% rule for this short run. A weight copy kept per session (128 KiB in
    # fp16, twice that in the simulator's two views) would add 35-70 MiB over the 270 sessions
    # after the warm-up; what may still appear once is allocator and first-use growth of the
    # shared process (a mutated graph reaching a code path for the first time; measured up to
    # 1.5 MiB in the full suite), which is why the weight is large and the bound is 4 MiB.
    assert rss_last - rss_warm <= GROWTH_MAX, f"RSS grew {(rss_last - rss_warm) >> 10} KiB"


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_twenty_thousand_mutated_sessions_keep_memory_flat(sim_server):
    n = int(os.environ.get("RKNPU_SESSIONS_SLOW", "20000"))
    _check(sim_server, n, *_run(sim_server, n))
