"""Indices that are data are checked before the node that reads them runs, on every replay,
whatever wrote them: the client (SET_TENSOR before the compute: checked once per replay,
before any step) or a node of the graph (the node that computes them, or any node whose
destination overlaps their bytes: checked in the segment after that node). ggml-cpu would
abort on an index out of range (GGML_ASSERT in GET_ROWS), taking the server with it."""

from __future__ import annotations

import numpy as np
import pytest

from ggml_rknpu.libggml.enums import GgmlOp, GgmlType
from ggml_rknpu.server import plan_steps
from support.rpc_testkit import FakeNpu, T, serve

pytestmark = pytest.mark.timeout(60)
GET_ROWS, MUL_MAT, ADD = int(GgmlOp.GET_ROWS), int(GgmlOp.MUL_MAT), int(GgmlOp.ADD)


def f32(buffer: int, data: int, *ne: int, **kw) -> T:
    n0, n1, n2, n3 = tuple(ne) + (1,) * (4 - len(ne))
    return T(ne=(n0, n1, n2, n3), buffer=buffer, data=data, **kw)


def closed_and_alive(st, c) -> bool:
    closed = c.is_closed_by_server()
    c.close()
    return closed and st.alive()


@pytest.fixture
def checks_run(monkeypatch):
    """How many index checks the server ran."""
    calls = [0]
    check = plan_steps.IndexCheck.check

    def counted(self):
        calls[0] += 1
        check(self)
    monkeypatch.setattr(plan_steps.IndexCheck, "check", counted)
    return calls


def test_input_indices_are_checked_once_per_replay_before_any_step(checks_run):
    """rows = GET_ROWS(table, idx); y = W x on the NPU; rows2 = GET_ROWS(table, idx): two
    segments read one uploaded index tensor, one check per replay, and an index out of range
    stops the replay before anything ran (the NPU matmul included)."""
    npu = FakeNpu()
    with serve(npu=npu) as st:
        with st.client() as c:
            wh, wb = c.alloc_base(1 << 16)
            h, base = c.alloc_base(1 << 12)
            w = f32(wh, wb, 64, 32, name="blk.0.ffn_up.weight")
            table = f32(h, base, 8, 4, name="table")
            idx = T(ne=(2, 1, 1, 1), buffer=h, data=base + 256, type=int(GgmlType.I32), name="idx")
            x = f32(h, base + 512, 64, 1, name="x")
            rows = f32(h, base + 1024, 8, 2, op=GET_ROWS, src=(table.id, idx.id), name="rows")
            y = f32(h, base + 1280, 32, 1, op=MUL_MAT, src=(w.id, x.id), name="y")
            rows2 = f32(h, base + 1536, 8, 2, op=GET_ROWS, src=(table.id, idx.id), name="rows2")
            c.set_array(w, np.ones((32, 64), np.float32))
            c.set_array(table, np.arange(32, dtype=np.float32))
            c.set_array(x, np.ones(64, np.float32))
            c.set_array(idx, np.array([1, 3], np.int32))
            c.graph_compute([rows, y, rows2], [w, table, idx, x, rows, y, rows2])   # no reply either
            assert np.array_equal(c.get_array(rows2), np.arange(32, dtype=np.float32).reshape(4, 8)[[1, 3]])
            assert npu.matmuls == 1 and checks_run[0] == 1
            c.set_array(idx, np.array([2, 0], np.int32))
            c.graph_recompute()                      # no reply: the GET_TENSOR after it waits for it
            assert np.array_equal(c.get_array(rows), np.arange(32, dtype=np.float32).reshape(4, 8)[[2, 0]])
            assert npu.matmuls == 2 and checks_run[0] == 2
            c.set_array(idx, np.array([0, 4], np.int32))
            c.graph_recompute()
            assert closed_and_alive(st, c)
            assert npu.matmuls == 2                    # refused before the first step


def test_indices_overwritten_by_an_earlier_node_are_checked_after_it():
    """over = x + x written over idx's bytes, then GET_ROWS(table, idx): the check before the
    segment would pass; the one after ``over`` sees the float bits and refuses."""
    with serve(npu=FakeNpu()) as st:
        c = st.client()
        h, base = c.alloc_base(1 << 12)
        table = f32(h, base, 8, 4, name="table")
        idx = T(ne=(2, 1, 1, 1), buffer=h, data=base + 256, type=int(GgmlType.I32), name="idx")
        x = f32(h, base + 1024, 2, name="x")
        over = f32(h, base + 256, 2, op=ADD, src=(x.id, x.id), name="over")
        rows = f32(h, base + 512, 8, 2, op=GET_ROWS, src=(table.id, idx.id), name="rows")
        c.set_array(table, np.arange(32, dtype=np.float32))
        c.set_array(idx, np.array([0, 0], np.int32))
        c.set_array(x, np.array([1e6, 1e6], np.float32))
        c.graph_compute([over, rows], [table, idx, x, over, rows])
        assert closed_and_alive(st, c)
