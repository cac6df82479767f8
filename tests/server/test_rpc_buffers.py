"""Buffers: the interval set that remembers graph-written bytes, the fake address space."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggml_rknpu.server.buffers import ADDRESS_SPACE_START, BufferTable, DeviceBudget, IntervalSet
from ggml_rknpu.server.rpc.wire import ProtocolError

ranges = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 40)), max_size=25)


@settings(max_examples=200, deadline=None)
@given(adds=ranges, probes=ranges)
def test_interval_set_matches_a_set_of_bytes(adds, probes):
    s, covered = IntervalSet(), set[int]()
    for start, length in adds:
        s.add(start, start + length)
        covered.update(range(start, start + length))
    for start, length in probes:
        assert s.overlaps(start, start + length) == bool(covered & set(range(start, start + length)))
    assert len(s) <= len(adds)
    starts, ends = s._starts, s._ends
    assert all(a < b for a, b in zip(starts, ends))                       # non-empty
    assert all(e < s2 for e, s2 in zip(ends, starts[1:]))                # disjoint, not touching, sorted


def test_address_space_is_never_reused_and_spans_are_checked():
    memory = DeviceBudget(lambda: (1 << 30, 1 << 30))
    table = BufferTable(memory)
    a = table.alloc(100)
    assert a is not None
    table.free(a.handle)
    b = table.alloc(100)
    assert b is not None
    assert b.base > a.base + a.size and b.base >= ADDRESS_SPACE_START and b.handle != a.handle
    assert b.span(b.base + 10, 90, "t") == (10, 100)
    for addr, n in ((b.base - 1, 1), (b.base + 1, 100), (b.base + 100, 1), (b.base, -1)):
        with pytest.raises(ProtocolError):
            b.span(addr, n, "t")
    with pytest.raises(ProtocolError):
        table.get(a.handle, "BUFFER_GET_BASE")
    assert memory.allocated == 100
    table.close()
    assert memory.allocated == 0 and len(table) == 0
