"""Protocol 8.0.0's pairwise communicator between two servers (docs/ggml-rpc.md §4.6): COMM_INIT
pairs rank 0 and rank 1, COMM_ALLREDUCE sums the two copies of a tensor in place (raw f32, BF16
from 32768 elements, as upstream), and a peer that dies or stalls costs only that client its
connection: both servers keep serving."""

from __future__ import annotations

import struct
import threading

import numpy as np
import pytest

from ggml_rknpu.server.rpc import comm
from ggml_rknpu.server.rpc.wire import Cmd
from ggml_rknpu.toolchain.launch import free_port
from support.matmul_graph import f32
from support.rpc_testkit import RpcClient, ServerThread

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pair():
    a, b = (ServerThread(protocol=8, stall_timeout_s=2.0) for _ in range(2))
    yield a, b
    a.stop()
    b.stop()


def _join(ca: RpcClient, cb: RpcClient, port: int) -> tuple[int, int]:
    """COMM_INIT to both before reading either reply, as the client does."""
    got: dict[str, int] = {}
    t = threading.Thread(target=lambda: got.setdefault("a", ca.comm_init(rank=0, world=2, port=port)))
    t.start()
    got["b"] = cb.comm_init(rank=1, world=2, port=port, host="127.0.0.1")
    t.join(30)
    return got["a"], got["b"]


def _tensor(c: RpcClient, values: np.ndarray):
    h, base = c.alloc_base(values.nbytes + 64)
    t = f32(h, base, values.size)
    c.set_array(t, values)
    return t


def _allreduce(c: RpcClient, t) -> None:
    c.send(Cmd.COMM_ALLREDUCE, struct.pack("<I", 0) + t.pack())


@pytest.mark.parametrize("n", [1000, comm.BF16_FROM_ELEMENTS])
def test_allreduce_sums_both_copies(pair, n):
    a, b = pair
    rng = np.random.default_rng(n)
    va, vb = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    with a.client() as ca, b.client() as cb:
        assert _join(ca, cb, free_port()) == (1, 1)
        ta, tb = _tensor(ca, va), _tensor(cb, vb)
        _allreduce(ca, ta)                        # no reply; the servers exchange while we send on
        _allreduce(cb, tb)
        ra = np.frombuffer(ca.get_tensor(ta), np.float32)
        rb = np.frombuffer(cb.get_tensor(tb), np.float32)
        assert ca.comm_init(rank=0, world=2, port=1) == 1     # a device with a peer: 1 at once
        ca.send(Cmd.COMM_FREE, struct.pack("<I", 0))
        cb.send(Cmd.COMM_FREE, struct.pack("<I", 0))
        assert ca.device_count() == cb.device_count() == 1
    if n < comm.BF16_FROM_ELEMENTS:
        assert np.array_equal(ra, va + vb) and np.array_equal(rb, va + vb)
    else:                                          # each adds the peer's BF16-rounded copy to its own
        assert np.array_equal(ra, va + comm.bf16_to_fp32(comm.fp32_to_bf16(vb)))
        assert np.array_equal(rb, vb + comm.bf16_to_fp32(comm.fp32_to_bf16(va)))
        assert np.abs(ra - (va + vb)).max() < 0.05
    assert a.state.stats.rejected == b.state.stats.rejected == 0


def test_bf16_rounding_is_ggmls():
    x = np.array([1.0, 1.00390625, 1.005859375, -2.5e-8, np.inf, 3.0e38], np.float32)
    # round to nearest, ties to even (1 + 2^-8 is a tie between 1 and 1 + 2^-7: even is 1)
    assert comm.bf16_to_fp32(comm.fp32_to_bf16(x))[:3].tolist() == [1.0, 1.0, 1.0078125]
    nan = comm.fp32_to_bf16(np.array([np.nan], np.float32))
    assert np.isnan(comm.bf16_to_fp32(nan))[0]


def test_a_peer_that_dies_costs_only_that_clients_connection(pair):
    a, b = pair
    with a.client() as ca:
        cb = b.client()
        assert _join(ca, cb, free_port()) == (1, 1)
        ta = _tensor(ca, np.ones(64, np.float32))
        cb.close()                                 # rank 1's client goes: its session drops the link
        _allreduce(ca, ta)
        assert ca.is_closed_by_server()
    assert a.alive() and b.alive()
    assert a.state.stats.rejected == 1


def test_a_peer_that_stalls_costs_only_that_clients_connection(pair):
    a, b = pair
    with a.client() as ca, b.client() as cb:
        assert _join(ca, cb, free_port()) == (1, 1)
        ta = _tensor(ca, np.ones(64, np.float32))
        _allreduce(ca, ta)                         # rank 1 never all-reduces: rank 0 waits its stall timeout
        assert ca.is_closed_by_server(timeout=10)
        assert cb.device_count() == 1              # rank 1's client is still served
    assert a.alive() and b.alive()


def test_rank0_without_rank1_is_answered_0_not_hung(pair):
    a, _ = pair
    with a.client() as ca:
        assert ca.comm_init(rank=0, world=2, port=free_port()) == 0   # after the (stall-capped) join wait
        assert ca.device_count() == 1
    assert a.state.stats.rejected == 0
