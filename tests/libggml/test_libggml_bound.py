"""Scratch bound to a graph's tensors for one run (``HostCompute.bound``): the graph computes
into the arrays inside the block, and after it (also when the block raises) the tensors point
at none of them; an array smaller than its tensor is refused before anything is bound."""

from __future__ import annotations

import numpy as np
import pytest

from ggml_rknpu.libggml import abi
from ggml_rknpu.libggml.compute import HostContext, Threads
from ggml_rknpu.libggml.enums import GgmlOp, GgmlType

N = 8
SHAPE, STRIDES = (N, 1, 1, 1), (4, 4 * N, 4 * N, 4 * N)


@pytest.fixture
def add_graph(host_ggml):
    """out = a + b over unbound a and out (b is a fixed array of ones)."""
    threads = Threads(host_ggml, 1)
    host = HostContext(host_ggml, threads, 3, (1,))
    ones = np.ones(N, np.float32)
    a = host.tensor(GgmlType.F32, SHAPE, STRIDES, 0, (), 0, "a", None)
    b = host.tensor(GgmlType.F32, SHAPE, STRIDES, 0, (), 0, "b", (ones.view(np.uint8), 0))
    out = host.tensor(GgmlType.F32, SHAPE, STRIDES, int(GgmlOp.ADD), (), abi.GGML_TENSOR_FLAG_COMPUTE, "out", None)
    host.link(out, [a, b], None, 0)
    compute = host.segment([out])
    host.finish()
    yield compute, a, out
    host.close()
    threads.close()


def test_bound_arrays_take_the_run_and_are_let_go(add_graph):
    compute, a, out = add_graph
    x = np.arange(N, dtype=np.float32)
    y = np.zeros(N, np.float32)
    with compute.bound((a, x), (out, y)):
        compute.run()
    np.testing.assert_array_equal(y, x + 1)
    assert {a.contents.data, out.contents.data}.isdisjoint({x.ctypes.data, y.ctypes.data})
    with compute.bound((a, y), (out, y)):               # in place: out over its own source
        compute.run()
    np.testing.assert_array_equal(y, x + 2)


def test_a_raising_block_unbinds_and_a_short_array_is_refused(add_graph):
    compute, a, out = add_graph
    x = np.zeros(N, np.float32)
    with pytest.raises(KeyError), compute.bound((a, x)):
        raise KeyError("the run failed")
    assert a.contents.data != x.ctypes.data
    with pytest.raises(ValueError, match="'out' needs 32 contiguous bytes"), compute.bound((a, x), (out, x[:4])):
        pass
    assert a.contents.data != x.ctypes.data
