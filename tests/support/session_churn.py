"""Many short mutated sessions against one in-process server on the simulated NPU, run as a
process of its own so that its RSS is the server's and its sessions', not a test runner's
heap shaped by every test before it (in the full suite that heap grew by up to 5.6 MiB over
the same sessions: the allocator state other tests left).

Usage: ``python session_churn.py N BUDGET`` (N sessions, BUDGET bytes of retired weights).
Prints one JSON object: RSS after the warm-up and after the last session, the weight
counters, the server's allocated bytes, the kernel misuses recorded and whether the server
was alive at both points. Each session uploads a weight of its own (fresh bytes: a mutated
model), runs a matmul and ends cleanly, with a corrupted request, or in the middle of a
message."""

from __future__ import annotations

import json
import logging
import struct
import sys

import numpy as np

import ggml_rknpu
from ggml_rknpu.libggml.enums import GgmlOp
from ggml_rknpu.server.rpc import wire
from ggml_rknpu.server.rpc.wire import Cmd
from ggml_rknpu.sim.kernel import misuse
from support.proc_status import status_bytes
from support.rpc_testkit import ServerClosed, T, graph_payload, serve

MUL_MAT = int(GgmlOp.MUL_MAT)
K, N, M = 256, 256, 2                        # a 256 KiB f32 weight per session
ENDINGS = ("clean", "corrupt", "truncated")
WARMUP_MAX = 1000                            # sessions before the reference RSS, at most


def warmup(n: int) -> int:
    return min(n // 10, WARMUP_MAX)


def _rss() -> int:
    rss = status_bytes("VmRSS")
    assert rss is not None
    return rss


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


def run(n: int, budget: int) -> dict:
    """The sessions; RSS read after the warm-up and after the last one, each once the server
    has no session left (the previous one torn down)."""
    logging.getLogger("ggml_rknpu").setLevel(logging.CRITICAL)
    npu = ggml_rknpu.open(device="sim-rknpu")
    rng = np.random.default_rng(7)
    out: dict = {"curve": []}
    try:
        with serve(npu=npu, retired_budget=budget) as st:
            for i in range(n):
                _session(st, rng, ENDINGS[i % len(ENDINGS)])
                if i + 1 == warmup(n) or i + 1 == n:
                    assert st.server.wait_idle()
                    out["alive_warm" if i + 1 < n else "alive_last"] = st.alive()
                    out["rss_warm" if i + 1 < n else "rss_last"] = _rss()
                if (i + 1) % WARMUP_MAX == 0:               # the curve, for the record
                    out["curve"].append((i + 1, _rss()))
            out["weights"] = dict(vars(st.state.weight_stats))
            out["allocated"] = st.state.memory.allocated
    finally:
        npu.close()
    out["misuse"] = [m.describe() for m in misuse.drain()]
    return out


if __name__ == "__main__":
    print(json.dumps(run(int(sys.argv[1]), int(sys.argv[2]))))
