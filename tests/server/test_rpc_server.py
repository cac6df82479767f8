"""rknpu serve, protocol level: every command round-trips; malformed input closes only
that connection (the server answers HELLO afterwards) and never writes outside a buffer."""

from __future__ import annotations

import socket
import struct

import numpy as np
import pytest

from ggml_rknpu.libggml.enums import GgmlOp, GgmlType
from ggml_rknpu.server import buffers as buffers_mod
from ggml_rknpu.server.rpc import wire
from ggml_rknpu.server.rpc.wire import Cmd
from support.rpc_testkit import GIB, FakeNpu, RpcClient, T, graph_payload, serve

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def srv():
    with serve(npu=FakeNpu()) as st:
        yield st


@pytest.fixture
def alloc_log(monkeypatch):
    """Every RpcBuffer the server allocates, kept alive so tests can inspect its bytes."""
    made = []
    original = buffers_mod.BufferTable.alloc

    def alloc(self, size):
        buf = original(self, size)
        if buf is not None:
            made.append(buf)
        return buf

    monkeypatch.setattr(buffers_mod.BufferTable, "alloc", alloc)
    return made


def f32(buffer: int, data: int, *ne: int, **kw) -> T:
    n0, n1, n2, n3 = tuple(ne) + (1,) * (4 - len(ne))
    return T(ne=(n0, n1, n2, n3), buffer=buffer, data=data, **kw)


def test_handshake_and_device_queries(srv):
    with srv.client() as c:
        assert c.device_count() == 1
        assert c.alignment() == 64
        assert c.max_size() == 4 * GIB
        assert c.device_memory() == (3 * GIB, 4 * GIB)


def test_buffers_set_get_memset_clear_copy_roundtrip(srv):
    with srv.client() as c:
        h, base = c.alloc_base(4096)
        assert base % 4096 == 0 and base >= 1 << 32
        h2, base2 = c.alloc_base(1024)
        assert base2 >= base + 4096                       # distinct, non-overlapping ranges
        t = f32(h, base + 256, 16, 4)
        x = np.arange(64, dtype=np.float32)
        c.set_array(t, x)
        assert np.array_equal(c.get_array(t).ravel(), x)
        c.set_tensor(t, np.full(4, 7.0, np.float32).tobytes(), offset=8)   # partial write at an offset
        got = c.get_array(t).ravel()
        assert np.array_equal(got[2:6], [7.0] * 4) and got[1] == 1 and got[6] == 6
        c.memset(t, 0, 8, 0xFF)
        assert c.get_tensor(t, 0, 8) == b"\xff" * 8
        dst = f32(h2, base2, 16, 4)
        assert c.copy_tensor(t, dst) == 1
        assert c.get_tensor(dst) == c.get_tensor(t)
        c.clear(h2, 0x11)
        assert c.get_tensor(dst) == b"\x11" * 256
        c.init_tensor(t)                                       # no reply; next call still in order
        assert c.alloc_size(f32(0, 0, 10, 3)) == 120
        q = T(ne=(512, 2, 1, 1), buffer=0, data=0, type=int(GgmlType.Q4_0))
        assert c.alloc_size(q) == 2 * 16 * 18
        c.free(h2)
        assert c.device_memory() == (3 * GIB, 4 * GIB)      # min(npu free, total - 4096) = npu free
        assert c.set_tensor_hash(t, 0x1234) == 0             # no cache dir: always a miss


def test_device_memory_reflects_allocations():
    npu = FakeNpu(budget=(3 * GIB, 4 * GIB))
    with serve(npu=npu) as st:
        with st.client() as c:
            h, size = c.alloc(3 * GIB // 2)                 # lazily committed host memory
            assert h and size == 3 * GIB // 2
            assert c.device_memory() == (5 * GIB // 2, 4 * GIB)
            assert c.alloc(3 * GIB) == (0, 0)              # over budget: the client sees out-of-memory
            assert c.alloc(2**64 - 1) == (0, 0)            # absurd size: refused, connection stays up
            npu.budget = (GIB, 4 * GIB)                    # staged weights used NPU address space
            assert c.device_memory() == (GIB, 4 * GIB)
        with st.client() as c:                             # buffers die with their connection
            npu.budget = (3 * GIB, 4 * GIB)
            assert c.device_memory() == (3 * GIB, 4 * GIB)


def test_graph_compute_and_recompute_add(srv):
    with srv.client() as c:
        h, base = c.alloc_base(1 << 12)
        a, b = f32(h, base, 8, 2), f32(h, base + 64, 8, 2)
        out = f32(h, base + 128, 8, 2, op=int(GgmlOp.ADD), src=(a.id, b.id))
        c.set_array(a, np.ones(16, np.float32))
        c.set_array(b, np.arange(16, dtype=np.float32))
        c.graph_compute([out], [a, b, out])
        assert np.array_equal(c.get_array(out).ravel(), 1 + np.arange(16))
        c.set_array(a, np.full(16, 10, np.float32))
        c.graph_recompute()
        assert np.array_equal(c.get_array(out).ravel(), 10 + np.arange(16))


def test_many_short_connections(srv):
    for _ in range(60):
        with srv.client() as c:
            assert c.device_memory() == (3 * GIB, 4 * GIB)
    with RpcClient(srv.port) as c:
        assert c.device_count() == 1
    assert srv.state.stats.connections >= 61
    assert srv.state.stats.rejected == 0


# --- malformed input -------------------------------------------------------------------------
def expect_closed(srv, c: RpcClient) -> None:
    assert c.is_closed_by_server(), "server kept the connection open after a bad request"
    c.close()
    assert srv.alive(), "server does not answer HELLO after rejecting a client"


def test_no_hello_first(srv):
    c = srv.client(hello=False)
    c.send(Cmd.DEVICE_COUNT)
    expect_closed(srv, c)
    assert srv.state.stats.rejected == 1


def test_second_hello(srv):
    c = srv.client()
    c.send(Cmd.HELLO, bytes(24))
    expect_closed(srv, c)


@pytest.mark.parametrize("cmd", [18, 19, 77, 255])
def test_unknown_command(srv, cmd):
    c = srv.client()
    c.sock.sendall(struct.pack("<BQ", cmd, 0))
    expect_closed(srv, c)


@pytest.mark.parametrize("cmd,size", [(Cmd.ALLOC_BUFFER, 11), (Cmd.GET_TENSOR, 313), (Cmd.DEVICE_COUNT, 4),
                                      (Cmd.SET_TENSOR, 300), (Cmd.HELLO, 0)])
def test_wrong_payload_size(srv, cmd, size):
    c = srv.client(hello=cmd != Cmd.HELLO)
    c.sock.sendall(struct.pack("<BQ", cmd, size) + bytes(size))
    expect_closed(srv, c)


def test_truncated_payload(srv):
    c = srv.client()
    c.sock.sendall(struct.pack("<BQ", Cmd.ALLOC_BUFFER, 12) + bytes(5))
    c.sock.shutdown(socket.SHUT_WR)
    expect_closed(srv, c)
    assert srv.state.stats.rejected == 1


def test_client_stalling_mid_message_is_dropped():
    with serve(npu=FakeNpu(), stall_timeout_s=0.5) as st:
        c = st.client()
        c.sock.sendall(struct.pack("<BQ", Cmd.ALLOC_BUFFER, 12) + bytes(5))   # ...and never the rest
        assert c.is_closed_by_server(timeout=10)
        c.close()
        assert st.alive() and st.state.stats.rejected == 1


def test_idle_client_between_messages_is_kept():
    with serve(npu=FakeNpu(), stall_timeout_s=0.3) as st:
        with st.client() as c:
            assert not c.is_closed_by_server(timeout=1.0)   # silent for > stall timeout at a boundary
            assert c.device_count() == 1


def test_truncated_set_tensor_data(srv, alloc_log):
    c = srv.client()
    h, base = c.alloc_base(4096)
    t = f32(h, base, 256)
    payload = t.pack() + struct.pack("<BQ", 0, 0) + bytes(1024)
    c.sock.sendall(struct.pack("<BQ", Cmd.SET_TENSOR, len(payload)) + payload[:-100])
    c.sock.shutdown(socket.SHUT_WR)
    expect_closed(srv, c)


def test_unknown_device_and_handle(srv):
    c = srv.client()
    c.send(Cmd.ALLOC_BUFFER, struct.pack("<IQ", 3, 64))
    expect_closed(srv, c)
    c = srv.client()
    c.send(Cmd.BUFFER_GET_BASE, struct.pack("<Q", 0xDEAD))
    expect_closed(srv, c)
    c = srv.client()
    c.free(0xDEAD)
    expect_closed(srv, c)


def _neighbours(c: RpcClient) -> tuple[tuple[int, int], tuple[int, int]]:
    return c.alloc_base(4096), c.alloc_base(4096)


@pytest.mark.parametrize("case", ["set_past_end", "set_offset_past_end", "set_before_base", "tensor_in_other",
                                  "memset_past_end", "copy_past_end", "get_past_end", "huge_ne",
                                  "zero_stride_giant", "bad_type", "unaligned_quant", "null_buffer"])
def test_tensor_outside_its_buffer_is_rejected_and_nothing_written(srv, alloc_log, case):
    c = srv.client()
    (h1, b1), (h2, b2) = _neighbours(c)
    ok = f32(h1, b1, 1024)
    data = bytes([0xAB]) * 4096
    if case == "set_past_end":
        c.set_tensor(f32(h1, b1 + 64, 1024), data)
    elif case == "set_offset_past_end":
        c.set_tensor(ok, bytes(8), offset=4092)
    elif case == "set_before_base":
        c.set_tensor(f32(h1, b1 - 64, 16), bytes(64))
    elif case == "tensor_in_other":
        c.set_tensor(f32(h1, b2, 16), bytes([0xAB]) * 64)          # address of buffer 2, handle of buffer 1
    elif case == "memset_past_end":
        c.memset(ok, 4000, 200, 0xAB)
    elif case == "copy_past_end":
        c.send(Cmd.COPY_TENSOR, ok.pack() + f32(h2, b2 + 8, 16).pack())   # 4096 bytes of src into 4088
    elif case == "get_past_end":
        c.send(Cmd.GET_TENSOR, ok.pack() + struct.pack("<QQ", 4000, 200))
    elif case == "huge_ne":
        c.set_tensor(T(ne=(0xFFFFFFFF, 0xFFFFFFFF, 1, 1), nb=(4, 1 << 20, 0, 0), buffer=h1, data=b1), bytes(64))
    elif case == "zero_stride_giant":
        c.set_tensor(T(ne=(0xFFFFFFFF, 0xFFFFFFFF, 1, 1), nb=(0, 0, 0, 0), buffer=h1, data=b1), bytes(4))
    elif case == "bad_type":
        c.set_tensor(T(ne=(4, 1, 1, 1), nb=(4, 16, 16, 16), buffer=h1, data=b1, type=99), bytes(16))
    elif case == "unaligned_quant":
        c.set_tensor(T(ne=(33, 1, 1, 1), nb=(18, 18, 18, 18), buffer=h1, data=b1, type=int(GgmlType.Q4_0)),
                     bytes(18))
    elif case == "null_buffer":
        c.set_tensor(f32(0, b1, 16), bytes(64))
    expect_closed(srv, c)
    buf1, buf2 = alloc_log[-2], alloc_log[-1]
    assert not buf1.array.any() and not buf2.array.any(), "bytes were written despite the rejection"


def test_graph_recompute_without_graph(srv):
    c = srv.client()
    c.graph_recompute()
    expect_closed(srv, c)


def _graph_client(srv):
    c = srv.client()
    h, base = c.alloc_base(1 << 12)
    a, b = f32(h, base, 8), f32(h, base + 64, 8)
    return c, h, base, a, b


@pytest.mark.parametrize("case", ["unknown_src", "unknown_node", "cycle", "self_loop", "view_cycle",
                                  "node_twice", "dup_id", "absurd_nodes", "count_mismatch", "bad_view_addr",
                                  "tensor_out_of_buffer", "unknown_dev", "unsupported_op", "unbacked_src",
                                  "unbacked_dst"])
def test_bad_graphs_are_rejected(srv, alloc_log, case):
    c, h, base, a, b = _graph_client(srv)
    add = int(GgmlOp.ADD)
    out = f32(h, base + 128, 8, op=add, src=(a.id, b.id))
    nodes, tensors = [out], [a, b, out]
    dev = 0
    raw: bytes | None = None
    if case == "unknown_src":
        out.src = (a.id, 0xBAD0)
    elif case == "unknown_node":
        nodes = [f32(h, base, 8)]
    elif case == "cycle":
        out2 = f32(h, base + 192, 8, op=add, src=(out.id, a.id))
        out.src = (a.id, out2.id)
        nodes, tensors = [out, out2], [a, b, out, out2]
    elif case == "self_loop":
        out.src = (out.id, a.id)
    elif case == "view_cycle":
        v1 = f32(h, base, 8, op=int(GgmlOp.VIEW))
        v2 = f32(h, base, 8, op=int(GgmlOp.VIEW), view_src=v1.id)
        v1.view_src = v2.id
        out.src = (v1.id, b.id)
        tensors = [a, b, v1, v2, out]
    elif case == "node_twice":
        nodes = [out, out]
    elif case == "dup_id":
        b.id = a.id
    elif case == "absurd_nodes":
        raw = struct.pack("<II", 0, 0xFFFFFFF0) + bytes(64)
    elif case == "count_mismatch":
        raw = graph_payload(nodes, tensors)[:-10]
    elif case == "bad_view_addr":
        v = f32(h, base + 4, 8, op=int(GgmlOp.VIEW), view_src=a.id, view_offs=0)
        out.src = (v.id, b.id)
        nodes, tensors = [v, out], [a, b, v, out]
    elif case == "tensor_out_of_buffer":
        out.data = base + 4096 - 16
    elif case == "unknown_dev":
        dev = 1
    elif case == "unbacked_src":                       # a CPU-side tensor (buffer 0) read by a computing node
        cpu = f32(0, 0x7F00_0000_0000, 8, name="cpu_side")
        out.src = (a.id, cpu.id)
        tensors = [a, cpu, out]
    elif case == "unbacked_dst":
        out.buffer = 0xB0F_0000_0999
    elif case == "unsupported_op":
        out.op = int(GgmlOp.MAP_CUSTOM1)     # a function pointer in op_params: never admitted
    c.send(Cmd.GRAPH_COMPUTE, raw if raw is not None else graph_payload(nodes, tensors, dev))
    expect_closed(srv, c)
    if case == "unsupported_op":
        assert srv.state.stats.unsupported == 1
    else:
        assert srv.state.stats.rejected == 1
    assert not alloc_log[-1].array.any(), "a rejected graph wrote into its buffer"


def test_views_of_tensors_on_other_backends_are_accepted(srv):
    """Partial offload: the client lists views of CPU-side tensors (e.g. its KV cache) as no-op nodes."""
    c, h, base, a, b = _graph_client(srv)
    cache = f32(0, 0x7F00_0000_0000, 64, name="cache_k_l0")
    view = f32(0, 0x7F00_0000_0040, 8, op=int(GgmlOp.VIEW), view_src=cache.id, view_offs=64, name="k_view")
    out = f32(h, base + 128, 8, op=int(GgmlOp.ADD), src=(a.id, b.id))
    c.set_array(a, np.ones(8, np.float32))
    c.set_array(b, np.ones(8, np.float32))
    c.graph_compute([view, out], [cache, view, a, b, out])
    assert np.array_equal(c.get_array(out).ravel(), np.full(8, 2, np.float32))
    c.close()
    assert srv.alive() and srv.state.stats.rejected == 0


@pytest.mark.parametrize("index, ok", [(3, True), (4, False), (-1, False)])
def test_row_index_checked_on_every_run(srv, index, ok):
    """GET_ROWS reads rows by indices that are data: out of range closes the connection at
    run time (before ggml-cpu, which would abort), in range computes."""
    with srv.client() as c:
        h, base = c.alloc_base(1 << 12)
        table = f32(h, base, 8, 4, name="table")
        idx = T(ne=(2, 1, 1, 1), buffer=h, data=base + 256, type=int(GgmlType.I32), name="idx")
        out = f32(h, base + 512, 8, 2, op=int(GgmlOp.GET_ROWS), src=(table.id, idx.id))
        c.set_array(table, np.arange(32, dtype=np.float32))
        c.set_array(idx, np.array([0, 0], np.int32))
        c.graph_compute([out], [table, idx, out])
        assert np.array_equal(c.get_array(out).ravel(), np.tile(np.arange(8, dtype=np.float32), 2))
        c.set_array(idx, np.array([1, index], np.int32))
        c.graph_recompute()
        if ok:
            assert np.array_equal(c.get_array(out)[1], np.arange(8, dtype=np.float32) + 8 * index)
        else:
            expect_closed(srv, c)
    assert srv.alive()


def test_huge_graph_payload_refused_before_reading(srv):
    c = srv.client()
    c.sock.sendall(struct.pack("<BQ", Cmd.GRAPH_COMPUTE, wire.MAX_GRAPH_PAYLOAD + 1))
    expect_closed(srv, c)


def test_set_tensor_hash_cache(tmp_path):
    with serve(npu=FakeNpu(), cache_dir=tmp_path) as st:
        data = np.arange(256, dtype=np.float32).tobytes()
        with st.client() as c:
            h, base = c.alloc_base(4096)
            t = f32(h, base, 256)
            assert c.set_tensor_hash(t, 0xFEED) == 0         # miss: the client then sends the bytes
            c.set_tensor(t, data, cache_flag=1)
            assert c.get_tensor(t) == data
        assert (tmp_path / f"{0xFEED:016x}").read_bytes() == data
        with st.client() as c:                               # a later client loads it from the cache
            h, base = c.alloc_base(4096)
            t = f32(h, base, 256)
            assert c.set_tensor_hash(t, 0xFEED) == 1
            assert c.get_tensor(t) == data
