"""TensorRef geometry, planning of view ops and unsupported-op signatures."""

from __future__ import annotations

import numpy as np
import pytest
from support.ops_helpers import F16, F32, I32, alloc, node, params, permute

from ggml_rknpu.ggml.enums import GgmlOp, GgmlType
from ggml_rknpu.ggml.ops.registry import TensorRef, UnsupportedOp, plan_op, tensor_span


def test_as_array_follows_ne_and_nb():
    t = alloc(F32, (3, 2, 2, 1))
    t.as_array()[...] = np.arange(12, dtype=np.float32).reshape(1, 2, 2, 3)
    p = permute(t, (1, 0, 2, 3))
    assert p.ne == (2, 3, 2, 1)
    # element (i0=1, i1=2, i2=1) of the transposed view is source (i0=2, i1=1, i2=1)
    assert p.as_array()[0, 1, 2, 1] == 1 * 6 + 1 * 3 + 2


def test_quantized_as_array_is_raw_rows():
    t = alloc(GgmlType.Q8_0, (64, 3))
    assert t.as_array().shape == (1, 1, 3, 2 * 34)
    assert t.as_array().dtype == np.uint8


def test_span_and_out_of_buffer_rejected():
    assert tensor_span(F32, (4, 3, 1, 1), (4, 16, 48, 48)) == 4 + 3 * 4 + 2 * 16
    assert tensor_span(GgmlType.Q4_0, (64, 2, 1, 1), (18, 36, 72, 72)) == 2 * 18 + 36
    buf = np.zeros(40, np.uint8)
    with pytest.raises(ValueError, match="outside buffer"):
        TensorRef.in_buffer(buf, 0, F32, (11, 1, 1, 1))
    bad = TensorRef(F32, (4, 4, 1, 1), (4, 16, 64, 64), np.zeros(16, np.uint8))
    with pytest.raises(ValueError):
        bad.as_array()


@pytest.mark.parametrize("op", [GgmlOp.NONE, GgmlOp.RESHAPE, GgmlOp.VIEW, GgmlOp.PERMUTE, GgmlOp.TRANSPOSE])
def test_view_ops_are_noops(op):
    t = alloc(F32, (4, 4))
    t.as_array()[...] = 7
    fn = plan_op(node(op, t, t))
    fn()
    assert (t.as_array() == 7).all()


def test_unsupported_signature_names_op_types_and_params():
    x, pos = alloc(F32, (8, 2, 3)), alloc(I32, (3,))
    with pytest.raises(UnsupportedOp) as err:
        plan_op(node(GgmlOp.ROPE, alloc(F32, (8, 2, 3)), x, pos, op_params=params(0, 8, 99)))
    assert err.value.signature == "ROPE(f32,i32)->f32 mode=99"
    with pytest.raises(UnsupportedOp) as err:
        plan_op(node(GgmlOp.CONV_2D, alloc(F32, (4,)), x))
    assert err.value.signature.startswith("CONV_2D(f32)->f32")
    with pytest.raises(UnsupportedOp) as err:
        plan_op(node(GgmlOp.UNARY, alloc(F16, (4,)), alloc(F16, (4,)), op_params=params(99)))
    assert err.value.signature == "UNARY:99(f16)->f16"
    with pytest.raises(UnsupportedOp) as err:
        plan_op(node(GgmlOp.GLU, alloc(F32, (4,)), alloc(F16, (8,)), op_params=params(2)))
    assert err.value.signature == "GLU:SWIGLU(f16)->f32"


def test_missing_sources_are_unsupported_not_crashes():
    from ggml_rknpu.ggml.ops.registry import _planners
    for op in _planners():
        with pytest.raises(UnsupportedOp):
            plan_op(node(op, alloc(F32, (4, 2)), op_params=params(0, 4, 0)))


@pytest.mark.timeout(120)
def test_random_nodes_plan_or_refuse_cleanly():
    """Random types, shapes, sources and op_params: planning either succeeds or raises
    UnsupportedOp; a planned closure either runs or raises OpDataError (never a crash)."""
    from ggml_rknpu.ggml.ops.registry import OpDataError, _planners
    rng = np.random.default_rng(60)
    types = [F32, F16, GgmlType.BF16, I32, GgmlType.I64, GgmlType.Q8_0]
    ops = sorted(_planners())

    def tensor(like=None):
        t = types[rng.integers(len(types))] if like is None else like.type
        block = 32 if t == GgmlType.Q8_0 else 1
        ne = like.ne if like is not None else tuple(
            int(rng.integers(1, 4)) * (block if i == 0 else 1) for i in range(4))
        ref = alloc(t, ne)
        ref.raw[:] = rng.integers(0, 256, ref.raw.size, dtype=np.uint8)
        return ref

    planned = 0
    for _ in range(1500):
        op = ops[rng.integers(len(ops))]
        srcs = [tensor() if rng.random() < 0.9 else None for _ in range(int(rng.integers(0, 5)))]
        dst = tensor(srcs[0]) if srcs and srcs[0] is not None and rng.random() < 0.7 else tensor()
        raw = rng.integers(-3, 50, 16) if rng.random() < 0.5 else rng.uniform(-2, 2, 16)
        p = params(*[int(v) if isinstance(v, np.integer) else float(v) for v in raw])
        try:
            fn = plan_op(node(op, dst, *srcs, op_params=p))
        except UnsupportedOp:
            continue
        planned += 1
        with np.errstate(all="ignore"):
            try:
                fn()
            except OpDataError:
                pass
    assert planned > 100
