"""The order rule over the wire (server/node_order.py): a CPY whose destination is the node itself
(``ggml_cast``, as llama.cpp sends it for flash attention in encoders and embedding models)
computes; the refusals the C++ server's own kernels make necessary stay refusals, with their
reason, and cost only that connection."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from ggml_rknpu.libggml.enums import GgmlOp, GgmlType
from support.rpc_testkit import FakeNpu, T, serve

pytestmark = pytest.mark.timeout(60)
CPY, ADD = int(GgmlOp.CPY), int(GgmlOp.ADD)
F16 = int(GgmlType.F16)


@pytest.fixture
def srv():
    with serve(npu=FakeNpu()) as st:
        yield st


def _refused(srv, c, caplog, reason: str) -> None:
    assert c.is_closed_by_server(), "the graph was computed"
    c.close()
    assert reason in caplog.text, caplog.text
    assert srv.alive()


def _cast(h: int, base: int, ne_out: tuple[int, int, int, int]) -> tuple[T, T]:
    """x (f32 [8, 3]) and ggml_cast(x, f16) as ggml builds it: a CPY whose src1 is the node itself."""
    x = T(ne=(8, 3, 1, 1), buffer=h, data=base, name="Kcur-0 (permuted)")
    out = T(ne=ne_out, buffer=h, data=base + 256, type=F16, op=CPY, name="Kcur-0 (permuted) (copy)")
    out.src = (x.id, out.id)
    return x, out


def test_a_cast_whose_destination_is_itself_computes(srv):
    with srv.client() as c:
        h, base = c.alloc_base(1 << 12)
        x, out = _cast(h, base, (8, 3, 1, 1))
        values = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
        c.set_array(x, values)
        c.graph_compute([out], [x, out])
        np.testing.assert_array_equal(c.get_array(out, np.float16), values.astype(np.float16))
        c.graph_recompute()                              # the plan replays
        np.testing.assert_array_equal(c.get_array(out, np.float16), values.astype(np.float16))
    assert srv.state.stats.rejected == srv.state.stats.unsupported == 0


def test_a_cast_of_another_element_count_stays_refused(srv, caplog):
    """ggml-cpu's dup kernels GGML_ASSERT equal element counts: the C++ server would abort."""
    with caplog.at_level(logging.WARNING, logger="ggml_rknpu.rpc"):
        c = srv.client()
        h, base = c.alloc_base(1 << 12)
        x, out = _cast(h, base, (8, 4, 1, 1))
        c.graph_compute([out], [x, out])
        _refused(srv, c, caplog, "cpy needs equal element counts")
    assert srv.state.stats.unsupported == 1
    with srv.client() as c:                              # the next client is served
        h, base = c.alloc_base(1 << 12)
        x, out = _cast(h, base, (8, 3, 1, 1))
        c.set_array(x, np.ones((3, 8), np.float32))
        c.graph_compute([out], [x, out])
        assert (c.get_array(out, np.float16) == 1).all()


def test_only_a_copy_destination_may_be_the_node_itself(srv, caplog):
    """An ADD reading its own result reads bytes nothing wrote yet: no builder makes it."""
    with caplog.at_level(logging.WARNING, logger="ggml_rknpu.rpc"):
        c = srv.client()
        h, base = c.alloc_base(1 << 12)
        a = T(ne=(8, 1, 1, 1), buffer=h, data=base)
        out = T(ne=(8, 1, 1, 1), buffer=h, data=base + 64, op=ADD, name="sum")
        out.src = (a.id, out.id)
        c.graph_compute([out], [a, out])
        _refused(srv, c, caplog, "'sum' reads itself")
    assert srv.state.stats.rejected == 1


def test_a_copy_into_a_destination_computed_later_stays_refused(srv, caplog):
    """ggml_cpy(a, b) with b listed after the copy: b's node would overwrite what it copied."""
    with caplog.at_level(logging.WARNING, logger="ggml_rknpu.rpc"):
        c = srv.client()
        h, base = c.alloc_base(1 << 12)
        a, b0 = T(ne=(8, 1, 1, 1), buffer=h, data=base), T(ne=(8, 1, 1, 1), buffer=h, data=base + 64)
        b = T(ne=(8, 1, 1, 1), buffer=h, data=base + 128, op=ADD, src=(a.id, b0.id), name="b")
        cpy = T(ne=(8, 1, 1, 1), buffer=h, data=base + 128, op=CPY, src=(a.id, b.id), view_src=b.id, name="copy")
        c.graph_compute([cpy, b], [a, b0, b, cpy])
        _refused(srv, c, caplog, "'copy' reads 'b', which is computed at or after it")
    assert srv.state.stats.rejected == 1
