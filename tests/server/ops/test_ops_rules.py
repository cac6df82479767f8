"""The validator's rules, judged by ggml itself.

* the geometry twins agree with ggml's exported predicates on random shapes and strides;
* what ggml's own builders make (ggml_add, ggml_mul_mat, ggml_rope_ext, ... through ctypes
  in a scratch no-alloc context) is admitted, with the index sources the rule names;
* the same node with a wrong dst shape or type, a missing source, an extra source, a bad
  sub-op or an overlapping stride is refused with its signature.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggml_rknpu.libggml.enums import GgmlGluOp, GgmlOp, GgmlType, GgmlUnaryOp
from ggml_rknpu.libggml.lib import TensorP
from ggml_rknpu.server.ops import geometry as geo
from ggml_rknpu.server.ops.rules import RULES, check_node
from ggml_rknpu.server.ops.vocabulary import UnsupportedOp
from ggml_rknpu.server.tensor import RpcTensor
from support.ggml_builders import _B, _SZ, F16, F32, I32, I64, PREDICATES, Q4_0, Q8_0, Scratch, _made_by_ggml


def _four(values: Sequence[int]) -> tuple[int, int, int, int]:
    a, b, c, d = values
    return a, b, c, d


@pytest.fixture
def sc(host_ggml):
    s = Scratch(host_ggml)
    yield s
    s.close()


INDEX_SOURCES = {"mul_mat_id": [(2, 8)], "get_rows": [(1, 9)], "get_rows q4_0": [(1, 32)], "set_rows": [(1, 16)],
                 "add_id": [(2, 8)], "get_rows_back": [(1, 9)]}


def test_what_ggml_builds_is_admitted(sc):
    seen = set()
    for label, t in _made_by_ggml(sc):
        node, srcs = sc.node(t)
        assert check_node(node, srcs) == INDEX_SOURCES.get(label, []), label
        seen.add(node.op)
    assert seen <= set(RULES)


def _mutants(node: RpcTensor, srcs: tuple):
    yield "dst shape", dataclasses.replace(node, ne=(node.ne[0] + 1, *node.ne[1:])), srcs
    yield "dst type", dataclasses.replace(node, type=I64 if node.type != I64 else F16), srcs
    if srcs and srcs[0] is not None:
        yield "missing src0", node, (None, *srcs[1:])
    free = [i for i in range(len(srcs)) if srcs[i] is None]
    if free:
        extra = list(srcs)
        extra[free[-1]] = srcs[0]
        yield "extra source", node, tuple(extra)
    wide = [d for d in range(1, 4) if node.ne[d] > 1]
    if wide:                                   # two rows on the same bytes
        nb = list(node.nb)
        nb[wide[0]] = 0
        yield "overlapping dst", dataclasses.replace(node, nb=_four(nb)), srcs


def test_malformed_nodes_are_refused_with_their_signature(sc):
    for label, t in _made_by_ggml(sc):
        node, srcs = sc.node(t)
        srcs = srcs + (None,) * (10 - len(srcs))
        for what, bad, bad_srcs in _mutants(node, srcs):
            if what == "extra source" and RULES[node.op].optional:
                continue                     # the free slot is an optional source: filling it may be fine
            try:
                check_node(bad, bad_srcs)
            except UnsupportedOp as err:
                assert GgmlOp(node.op).name in err.signature, (label, what)
            else:
                raise AssertionError(f"{label}: {what} was admitted")


@pytest.mark.parametrize("op, params, reason", [
    (GgmlOp.UNARY, (int(GgmlUnaryOp.XIELU) + 40,), "unary op id"),
    (GgmlOp.GLU, (99,), "glu op id"),
    (GgmlOp.GLU, (int(GgmlGluOp.SWIGLU), 7), "swapped"),
    (GgmlOp.ARGSORT, (5,), "order"),
    (GgmlOp.ROPE, (0, 64, 3), "rope mode"),
    (GgmlOp.CONCAT, (4,), "concat dim"),
])
def test_sub_op_ids_out_of_range_are_refused(op, params, reason):
    a = RpcTensor(id=1, type=F32, buffer=1, ne=(64, 3, 1, 1), nb=(4, 256, 768, 768), op=0, op_params=(0,) * 16,
                  flags=0, src=(0,) * 10, view_src=0, view_offs=0, data=0, name="a", use_count=0)
    pos = dataclasses.replace(a, id=2, type=I32, ne=(1, 1, 1, 1), nb=(4, 4, 4, 4))
    p = tuple(params) + (0,) * (16 - len(params))
    dst = dataclasses.replace(a, id=3, op=int(op), op_params=p)
    if op == GgmlOp.ARGSORT:
        dst = dataclasses.replace(dst, type=I32)
    srcs = (a, pos) if op == GgmlOp.ROPE else (a, a) if op == GgmlOp.CONCAT else (a,)
    with pytest.raises(UnsupportedOp, match=reason):
        check_node(dst, srcs)


def test_op_without_a_rule_is_refused():
    t = RpcTensor(id=1, type=F32, buffer=1, ne=(4, 1, 1, 1), nb=(4, 16, 16, 16), op=int(GgmlOp.MAP_CUSTOM1),
                  op_params=(0,) * 16, flags=0, src=(0,) * 10, view_src=0, view_offs=0, data=0, name="", use_count=0)
    with pytest.raises(UnsupportedOp, match="MAP_CUSTOM1.*no rule"):
        check_node(t, (t,))


_types = st.sampled_from([F32, F16, Q4_0, Q8_0, I32])


@settings(max_examples=300, deadline=None)
@given(type_=_types, ne=st.tuples(*[st.integers(1, 5)] * 4), perm=st.permutations(range(4)),
       pad=st.tuples(*[st.integers(0, 2)] * 4), data=st.data())
def test_geometry_twins_agree_with_ggml(host_ggml, type_, ne, perm, pad, data):
    block = geo.TYPE_TRAITS[GgmlType(type_)][0]
    ne = (ne[0] * block, *ne[1:])
    nb = list(geo.contiguous_nb(type_, ne))
    nb = [nb[0], nb[1] + pad[1] * nb[0], 0, 0]
    nb[2], nb[3] = nb[1] * ne[1] + pad[2] * nb[0], 0
    nb[3] = nb[2] * ne[2] + pad[3] * nb[0]
    if block == 1 and data.draw(st.booleans()):                      # a permuted view
        ne = tuple(ne[i] for i in perm)
        nb = [nb[i] for i in perm]
    g = host_ggml
    ctx = g.context(2, ())
    try:
        t = g.new_tensor(ctx, type_, ne)
        t.contents.nb[:] = nb
        fake = RpcTensor(id=1, type=type_, buffer=1, ne=_four(ne), nb=_four(nb), op=0, op_params=(0,) * 16,
                         flags=0, src=(0,) * 10, view_src=0, view_offs=0, data=0, name="", use_count=0)
        for name in PREDICATES:
            f = getattr(g.base, name)
            f.restype, f.argtypes = (_SZ if name == "ggml_nbytes" else _B), [TensorP]
            twin = geo.span if name == "ggml_nbytes" else getattr(geo, name.removeprefix("ggml_"))
            assert twin(fake) == f(t), (name, ne, nb)
        other = g.new_tensor(ctx, type_, tuple(max(1, n // 2) for n in ne))
        f = g.base.ggml_can_repeat
        f.restype, f.argtypes = _B, [TensorP, TensorP]
        small = dataclasses.replace(fake, ne=tuple(other.contents.ne))
        assert geo.can_repeat(small, fake) == f(other, t)
    finally:
        g.ggml_free(ctx)


def test_one_column_tensors_keep_their_element_stride_where_kernels_assert_it(sc):
    """ggml_is_contiguous(_rows) lets a tensor with ne0 == 1 have any nb0, but kernels such as
    ggml_compute_forward_repeat_f32 GGML_ASSERT(nb00 == sizeof(float)) and (nb0 == sizeof(float)):
    such a node, admitted, would abort the server."""
    node, srcs = sc.node(sc.call("ggml_repeat", sc.new(F32, 1, 4, 3, 1), sc.new(F32, 1, 8, 3, 1)))
    assert check_node(node, srcs) == []
    wide = (dataclasses.replace(srcs[0], nb=(8, *srcs[0].nb[1:])), *srcs[1:])
    with pytest.raises(UnsupportedOp, match="repeat src0 nb0=8 must be the element size"):
        check_node(node, wide)
    with pytest.raises(UnsupportedOp, match="repeat dst nb0=8 must be the element size"):
        check_node(dataclasses.replace(node, nb=(8, *node.nb[1:])), srcs)
